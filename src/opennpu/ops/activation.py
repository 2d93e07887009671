"""Activation family: npu_swiglu, npu_geglu, fast_gelu / npu_fast_gelu and their gradients.

All computed in float32 (float64 for float64 inputs) and rounded once to the input dtype.
"""

from __future__ import annotations

import torch

from ._registry import accepts_input_keyword, mark_backward_op, register_autograd, register_fake

_ops = torch.ops.npu


@accepts_input_keyword
def npu_swiglu(self: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """SwiGLU: split ``self`` in halves ``a | b`` along ``dim``; returns ``silu(a) * b``."""
    return _ops.npu_swiglu(self, dim)


@accepts_input_keyword
def npu_swiglu_backward(grad_output, self, dim: int = -1):
    """Gradient of npu_swiglu with respect to its whole input (shape of ``self``)."""
    return _ops.npu_swiglu_backward(grad_output, self, dim)


@accepts_input_keyword
def npu_geglu(self: torch.Tensor, dim: int = -1, approximate: int = 1, activate_left: bool = False):
    """GeGLU: halves ``a | b`` along ``dim``. Returns ``(out, gelu)``.

    ``activate_left=False``: ``out = a * gelu(b)``, ``gelu = gelu(b)``; True: ``gelu(a) * b``.
    ``approximate``: 1 = tanh approximation (default), 0 = exact erf GELU. Only ``out`` is
    differentiable.
    """
    return _ops.npu_geglu(self, dim, approximate, activate_left)


@accepts_input_keyword
def npu_geglu_grad(grad_output, self, gelu, dim: int = -1, approximate: int = 1,
                   activate_left: bool = False):
    """Gradient of npu_geglu's ``out`` with respect to ``self``.

    ``gelu`` (npu_geglu's second output) is checked for shape and device but not read: both
    halves' gradients are recomputed from ``self`` in float32 (``dx_linear = dy * gelu(x_gate)``,
    ``dx_gate = dy * x_linear * gelu'(x_gate)``), which is never less accurate than multiplying by
    the fp16/bf16-rounded ``gelu`` that torch_npu reads, and the same in float32.
    """
    return _ops.npu_geglu_grad(grad_output, self, gelu, dim, approximate, activate_left)


@accepts_input_keyword
def fast_gelu(self: torch.Tensor) -> torch.Tensor:
    """FastGELU: ``x * sigmoid(1.702 x)`` (an approximation of GELU; it differs from F.gelu)."""
    return _ops.fast_gelu(self)


@accepts_input_keyword
def npu_fast_gelu(self: torch.Tensor) -> torch.Tensor:
    """Same as fast_gelu (torch_npu exposes both names)."""
    return _ops.npu_fast_gelu(self)


@accepts_input_keyword
def npu_fast_gelu_backward(grad, self):
    """``grad * (s + 1.702 x s (1 - s))`` with ``s = sigmoid(1.702 x)``."""
    return _ops.npu_fast_gelu_backward(grad, self)


# ----------------------------------------------------------------------------- fake kernels


def _halved(x, dim):
    shape = list(x.shape)
    d = dim % x.dim() if x.dim() else 0
    torch._check(shape[d] % 2 == 0, lambda: f"npu_swiglu/npu_geglu: dim {dim} must be even")
    shape[d] = shape[d] // 2
    return shape


@register_fake("npu::npu_swiglu")
def _swiglu_fake(self, dim=-1):
    return self.new_empty(_halved(self, dim))


@register_fake("npu::npu_swiglu_backward")
def _swiglu_backward_fake(grad_output, self, dim=-1):
    return self.new_empty(self.shape)


@register_fake("npu::npu_geglu")
def _geglu_fake(self, dim=-1, approximate=1, activate_left=False):
    shape = _halved(self, dim)
    return self.new_empty(shape), self.new_empty(shape)


@register_fake("npu::npu_geglu_grad")
def _geglu_grad_fake(grad_output, self, gelu, dim=-1, approximate=1, activate_left=False):
    return self.new_empty(self.shape)


@register_fake("npu::fast_gelu")
def _fast_gelu_fake(self):
    return self.new_empty(self.shape)


@register_fake("npu::npu_fast_gelu")
def _npu_fast_gelu_fake(self):
    return self.new_empty(self.shape)


@register_fake("npu::npu_fast_gelu_backward")
def _fast_gelu_backward_fake(grad, self):
    return self.new_empty(self.shape)


@register_fake("opennpu::_silu_mul")
def _silu_mul_fake(gate, up):
    torch._check(gate.shape == up.shape and gate.dtype == up.dtype,
                 lambda: "_silu_mul: gate and up must share shape and dtype")
    return gate.new_empty(gate.shape)


@register_fake("opennpu::_silu_mul_backward")
def _silu_mul_backward_fake(grad, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape)


# ----------------------------------------------------------------------------- autograd


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.args = inputs[1:]


def _swiglu_bwd(ctx, grad):
    (x,) = ctx.saved_tensors
    return _ops.npu_swiglu_backward(grad, x, *ctx.args), None


def _geglu_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(inputs[0], output[1])
    ctx.args = inputs[1:]


def _geglu_bwd(ctx, grad, _dgelu):
    x, gelu = ctx.saved_tensors
    return (_ops.npu_geglu_grad(grad, x, gelu, *ctx.args), None, None, None)


def _fast_gelu_bwd(ctx, grad):
    (x,) = ctx.saved_tensors
    return _ops.npu_fast_gelu_backward(grad, x)


def _save_gate_up(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_bwd(ctx, grad):
    gate, up = ctx.saved_tensors
    dgate, dup = torch.ops.opennpu._silu_mul_backward(grad, gate, up)
    return (dgate if ctx.needs_input_grad[0] else None, dup if ctx.needs_input_grad[1] else None)


register_autograd("npu_swiglu", _swiglu_bwd, _save_input)
torch.library.register_autograd("opennpu::_silu_mul", _silu_mul_bwd, setup_context=_save_gate_up)
register_autograd("npu_geglu", _geglu_bwd, _geglu_setup)
register_autograd("fast_gelu", _fast_gelu_bwd, _save_input)
register_autograd("npu_fast_gelu", _fast_gelu_bwd, _save_input)
mark_backward_op("npu_swiglu_backward", "npu_swiglu")
mark_backward_op("npu_geglu_grad", "npu_geglu")
mark_backward_op("npu_fast_gelu_backward", "fast_gelu")

__all__ = [
    "npu_swiglu",
    "npu_swiglu_backward",
    "npu_geglu",
    "npu_geglu_grad",
    "fast_gelu",
    "npu_fast_gelu",
    "npu_fast_gelu_backward",
]
