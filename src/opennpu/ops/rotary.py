"""Rotary embedding: npu_rotary_mul and npu_rotary_mul_backward (Ascend RotaryMul / RotaryMulGrad).

``out = x * r1 + rotate(x) * r2`` with r1 = cos and r2 = sin broadcast against x (any of the
BNSD, BSND, SBND, TND patterns, or any other broadcast). Computed in float32; r1/r2 given in
float32 are used unrounded with float16/bfloat16 x.
"""

from __future__ import annotations

import torch

from ._registry import accepts_input_keyword, mark_backward_op, register_autograd, register_fake

_ops = torch.ops.npu


@accepts_input_keyword
def npu_rotary_mul(self, r1, r2, rotary_mode: str = "half", rotate=None):
    """Apply rotary position embedding.

    ``rotary_mode='half'``: ``rotate(x) = cat(-x[..., D/2:], x[..., :D/2])`` (Llama's
    rotate_half); ``'interleave'``: pairs ``(x[2i], x[2i+1]) -> (-x[2i+1], x[2i])``.
    ``rotate`` (optional ``[D, D]`` matrix) replaces the rotation by ``x @ rotate``.
    Differentiable in ``self``, ``r1`` and ``r2`` (not in ``rotate``).
    """
    return _ops.npu_rotary_mul(self, r1, r2, rotary_mode, rotate)


@accepts_input_keyword
def npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode: str = "half"):
    """Returns ``(dx, dr1, dr2)``: ``dx = r1*g + rotate^T(r2*g)``, and ``dr1``/``dr2`` the sums of
    ``x*g`` / ``rotate(x)*g`` over the dims r1/r2 broadcast along (shapes of r1/r2, dtype of x)."""
    return _ops.npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode)


@register_fake("npu::npu_rotary_mul")
def _rotary_mul_fake(self, r1, r2, rotary_mode="half", rotate=None):
    return self.new_empty(self.shape)


@register_fake("npu::npu_rotary_mul_backward")
def _rotary_mul_backward_fake(grad, self, r1, r2, rotary_mode="half"):
    return self.new_empty(self.shape), self.new_empty(r1.shape), self.new_empty(r2.shape)


@register_fake("opennpu::_rotary_mul_backward_dx")
def _rotary_mul_backward_dx_fake(grad, self, r1, r2, rotary_mode="half"):
    return torch.empty(self.shape, dtype=self.dtype, device=self.device)


def _setup(ctx, inputs, output):
    self, r1, r2, mode, rotate = inputs
    ctx.mode = mode
    ctx.save_for_backward(self, r1, r2, rotate)


def _backward(ctx, grad):
    x, r1, r2, rotate = ctx.saved_tensors
    need = ctx.needs_input_grad
    if rotate is None and not (need[1] or need[2]):
        # cos/sin as constants (the usual case): dx alone, without the dr1/dr2 reductions.
        dx = None if not need[0] else torch.ops.opennpu._rotary_mul_backward_dx(
            grad, x, r1, r2, ctx.mode)
        return dx, None, None, None, None
    if rotate is None:
        dx, dr1, dr2 = _ops.npu_rotary_mul_backward(grad, x, r1, r2, ctx.mode)
    else:
        # x @ rotate path: the adjoint of the matrix is its transpose (computed in float32).
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        g, xf, m = grad.to(acc), x.to(acc), rotate.to(acc)
        gs = g * r2.to(acc)
        dx = (g * r1.to(acc) + gs @ m.t()).to(x.dtype)
        dr1 = (xf * g).sum_to_size(r1.shape).to(x.dtype)
        dr2 = ((xf @ m) * g).sum_to_size(r2.shape).to(x.dtype)
    return (
        dx if need[0] else None,
        dr1.to(r1.dtype) if need[1] else None,
        dr2.to(r2.dtype) if need[2] else None,
        None,
        None,
    )


register_autograd("npu_rotary_mul", _backward, _setup)
mark_backward_op("npu_rotary_mul_backward", "npu_rotary_mul")

__all__ = ["npu_rotary_mul", "npu_rotary_mul_backward"]
