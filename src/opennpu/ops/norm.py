"""RMSNorm family: npu_rms_norm, npu_rms_norm_backward, npu_gemma_rms_norm, npu_add_rms_norm,
npu_add_rms_norm_cast, npu_add_rms_norm_v2 (in place) and npu_add_rms_norm_v2_functional.

Numerics (all dtypes): sum(x^2) is accumulated in float32 (float64 for float64 inputs), rstd is
1 / sqrt(mean(x^2) + epsilon), and y = x * rstd * gamma is formed in float32 and rounded once to
x's dtype. gamma may be float32 while x is float16/bfloat16 (y keeps x's dtype).
"""

from __future__ import annotations

import torch

from ._registry import (_register_mutable_overload_kernel, accepts_input_keyword, acc_dtype,
                        mark_backward_op, mark_not_differentiable, register_autograd,
                        register_fake)

_ops = torch.ops.npu


def _rstd_shape(x: torch.Tensor, gamma: torch.Tensor) -> list:
    lead = x.dim() - gamma.dim()
    return list(x.shape[:lead]) + [1] * gamma.dim()


@accepts_input_keyword
def npu_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """RMSNorm over the trailing ``gamma.dim()`` dims of ``self``.

    Returns ``(y, rstd)``: ``y = self * rstd * gamma`` in self's dtype and
    ``rstd = 1 / sqrt(mean(self^2) + epsilon)`` in float32, with the normalised dims kept as 1
    (x ``[2, 3, 8]``, gamma ``[8]`` gives rstd ``[2, 3, 1]``). Differentiable in ``self`` and
    ``gamma`` (through npu_rms_norm_backward); rstd is not differentiable.
    """
    return _ops.npu_rms_norm(self, gamma, epsilon)


@accepts_input_keyword
def npu_rms_norm_backward(dy, self, gamma, rstd):
    """Gradient of npu_rms_norm: returns ``(dx, dgamma)``, dgamma in float32 and gamma's shape.

    ``dx = dy*gamma*rstd - x*rstd^3*mean(dy*gamma*x)``, ``dgamma = sum_rows(dy*x*rstd)``.
    """
    return _ops.npu_rms_norm_backward(dy, self, gamma, rstd)


@accepts_input_keyword
def npu_gemma_rms_norm(self: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """Gemma's RMSNorm: ``y = self * rstd * (1 + gamma)``; returns ``(y, rstd)`` like npu_rms_norm."""
    return _ops.npu_gemma_rms_norm(self, gamma, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon: float = 1e-6):
    """Residual add fused with RMSNorm. Returns ``(y, rstd, x)`` with ``x = x1 + x2``.

    The sum is rounded to x1's dtype before it is normalised (as torch_npu's golden does), and
    ``x`` is that rounded sum. ``x2`` may broadcast to ``x1``. Differentiable in x1, x2, gamma.
    """
    return _ops.npu_add_rms_norm(x1, x2, gamma, epsilon)


def npu_add_rms_norm_v2(x1, x2, gamma, epsilon: float = 1e-6):
    """npu_add_rms_norm in place: ``x1`` receives ``y`` (the normalised output, x1's dtype),
    ``x2`` receives ``x = x1 + x2`` (rounded to x1's dtype); returns ``rstd`` (float32, the
    normalised dims kept as 1). x1 and x2 have one shape (no broadcast: x2 is written).
    Not differentiable (in-place writes; npu_add_rms_norm is the differentiable form)."""
    return _ops.npu_add_rms_norm_v2(x1, x2, gamma, epsilon)


def npu_add_rms_norm_v2_functional(x1, x2, gamma, epsilon: float = 1e-6):
    """The out-of-place form of npu_add_rms_norm_v2: returns ``(rstd, y, x)``, the values the
    in-place op returns and writes into x1 and x2 (x1 and x2 are left unchanged). Not
    differentiable (torch_npu registers no gradient; npu_add_rms_norm computes the same)."""
    return _ops.npu_add_rms_norm_v2_functional(x1, x2, gamma, epsilon)


def npu_add_rms_norm_cast(x1, x2, gamma, epsilon: float = 1e-6):
    """npu_add_rms_norm with the normalised output also in float32: returns ``(y1, y2, rstd, x)``.

    ``y1`` is ``x / rms * gamma`` in float32 (not rounded through x1's dtype), ``y2`` the same
    rounded once to x1's dtype (equal to npu_add_rms_norm's ``y``), ``rstd`` float32 keep-dim,
    ``x = x1 + x2`` rounded to x1's dtype (normalised as rounded, like npu_add_rms_norm). It
    stands for ``npu_add_rms_norm(...)`` followed by ``y.float()``, without the second pass.
    Not differentiable (torch_npu registers no gradient for it).
    """
    return _ops.npu_add_rms_norm_cast(x1, x2, gamma, epsilon)


# ----------------------------------------------------------------------------- fake kernels


@register_fake("npu::npu_rms_norm")
def _rms_norm_fake(self, gamma, epsilon=1e-6):
    return (
        self.new_empty(self.shape),
        self.new_empty(_rstd_shape(self, gamma), dtype=acc_dtype(self.dtype)),
    )


@register_fake("npu::npu_gemma_rms_norm")
def _gemma_rms_norm_fake(self, gamma, epsilon=1e-6):
    return _rms_norm_fake(self, gamma, epsilon)


@register_fake("npu::npu_add_rms_norm")
def _add_rms_norm_fake(x1, x2, gamma, epsilon=1e-6):
    return (
        x1.new_empty(x1.shape),
        x1.new_empty(_rstd_shape(x1, gamma), dtype=acc_dtype(x1.dtype)),
        x1.new_empty(x1.shape),
    )


@register_fake("npu::npu_add_rms_norm_v2")
def _add_rms_norm_v2_fake(x1, x2, gamma, epsilon=1e-6):
    return x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32)


@register_fake("npu::npu_add_rms_norm_v2_functional")
def _add_rms_norm_v2_functional_fake(x1, x2, gamma, epsilon=1e-6):
    return (x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32), x1.new_empty(x1.shape),
            x1.new_empty(x1.shape))


@register_fake("opennpu::_add_rms_norm_inplace")
def _add_rms_norm_inplace_fake(x1, x2, gamma, epsilon=1e-6):
    torch._check(x1.shape == x2.shape,
                 lambda: f"_add_rms_norm_inplace: x2 must have x1's shape {tuple(x1.shape)} (it "
                         f"receives x1 + x2), but got {tuple(x2.shape)}")
    return x1.new_empty(x1.shape), x1.new_empty(_rstd_shape(x1, gamma), dtype=acc_dtype(x1.dtype))


@register_fake("npu::npu_add_rms_norm_cast")
def _add_rms_norm_cast_fake(x1, x2, gamma, epsilon=1e-6):
    acc = acc_dtype(x1.dtype)
    return (
        x1.new_empty(x1.shape, dtype=acc),
        x1.new_empty(x1.shape),
        x1.new_empty(_rstd_shape(x1, gamma), dtype=acc),
        x1.new_empty(x1.shape),
    )


@register_fake("npu::npu_rms_norm_backward")
def _rms_norm_backward_fake(dy, self, gamma, rstd):
    return self.new_empty(self.shape), gamma.new_empty(gamma.shape, dtype=acc_dtype(self.dtype))


# ----------------------------------------------------------------------------- autograd


def _rms_norm_setup(ctx, inputs, output):
    self, gamma = inputs[0], inputs[1]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(self, gamma, output[1])


def _rms_norm_bwd(ctx, dy, _drstd):
    self, gamma, rstd = ctx.saved_tensors
    dx, dgamma = _ops.npu_rms_norm_backward(dy, self, gamma, rstd)
    return (
        dx if ctx.needs_input_grad[0] else None,
        dgamma.to(gamma.dtype) if ctx.needs_input_grad[1] else None,
        None,
    )


def _gemma_rms_norm_bwd(ctx, dy, _drstd):
    # d/dx of x*rstd*(1+gamma) is RMSNorm's gradient with gamma' = 1 + gamma (formed in fp32),
    # and d/dgamma is the same sum_rows(dy * x * rstd).
    self, gamma, rstd = ctx.saved_tensors
    dx, dgamma = _ops.npu_rms_norm_backward(dy, self, gamma.to(rstd.dtype) + 1, rstd)
    return (
        dx if ctx.needs_input_grad[0] else None,
        dgamma.to(gamma.dtype) if ctx.needs_input_grad[1] else None,
        None,
    )


def _add_rms_norm_setup(ctx, inputs, output):
    x1, x2, gamma = inputs[0], inputs[1], inputs[2]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[2], gamma, output[1])
    ctx.x2_shape = x2.shape


def _add_rms_norm_bwd(ctx, dy, _drstd, dx_out):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = _ops.npu_rms_norm_backward(dy, x, gamma, rstd)
    if dx_out is not None:
        dx = dx + dx_out
    return (
        dx if ctx.needs_input_grad[0] else None,
        dx.sum_to_size(ctx.x2_shape) if ctx.needs_input_grad[1] else None,
        dgamma.to(gamma.dtype) if ctx.needs_input_grad[2] else None,
        None,
    )


register_autograd("npu_rms_norm", _rms_norm_bwd, _rms_norm_setup)
register_autograd("npu_gemma_rms_norm", _gemma_rms_norm_bwd, _rms_norm_setup)
register_autograd("npu_add_rms_norm", _add_rms_norm_bwd, _add_rms_norm_setup)
mark_backward_op("npu_rms_norm_backward", "npu_rms_norm")
mark_not_differentiable("npu_add_rms_norm_v2", "writes its results into x1 and x2; use "
                        "npu_add_rms_norm to train")
mark_not_differentiable("npu_add_rms_norm_v2_functional",
                        "torch_npu registers no gradient for it; use npu_add_rms_norm to train")
# opennpu::_add_rms_norm_inplace (x2 <- x1 + x2; returns y, rstd) is what the compile backend puts
# in place of npu_add_rms_norm in its post-grad graphs, which autograd never runs through.
_register_mutable_overload_kernel(
    "opennpu::_add_rms_norm_inplace", torch.ops.opennpu._add_rms_norm_inplace.default,
    "_add_rms_norm_inplace: not differentiable (writes x1 + x2 into x2; npu_add_rms_norm is the "
    "differentiable form)")
mark_not_differentiable("npu_add_rms_norm_cast",
                        "torch_npu registers no gradient for it; use npu_add_rms_norm to train")

__all__ = ["npu_rms_norm", "npu_rms_norm_backward", "npu_gemma_rms_norm", "npu_add_rms_norm",
           "npu_add_rms_norm_cast", "npu_add_rms_norm_v2", "npu_add_rms_norm_v2_functional"]
