"""Scaled masked softmax: npu_scaled_masked_softmax and npu_scaled_masked_softmax_backward.

``y = softmax(where(mask, -10000, x * scale), dim=-1)`` with mask True = masked out, as
torch_npu's golden computes it (-10000, not -inf: a fully masked row is uniform, not NaN).
Computed in float32 (float64 for float64 inputs) and rounded once to x's dtype.
"""

from __future__ import annotations

import torch

from ._registry import mark_backward_op, register_autograd, register_fake

_ops = torch.ops.npu


def npu_scaled_masked_softmax(x: torch.Tensor, mask: torch.Tensor, scale=1,
                              fixed_triu_mask: bool = False) -> torch.Tensor:
    """Softmax over the last dim of ``x * scale`` with masked positions set to -10000 first.

    ``y = softmax((x * scale).masked_fill(mask, -10000), dim=-1)``, in x's shape and dtype.

    - ``mask``: bool (or uint8, nonzero = masked out), **True = masked out**, broadcastable to x
      (e.g. ``[1, 1, S, W]`` or ``[B, 1, S, W]`` against ``[B, N, S, W]``, or a last dim of 1 to
      mask whole rows). It is never expanded in memory. A fully masked row gives the uniform
      distribution ``1 / W``.
    - ``fixed_triu_mask=True``: the mask is ``triu(ones(H, W), diagonal=1)`` over the last two
      dims (column j is masked in row i when j > i, i the index in dim -2); the ``mask`` argument
      must still be a tensor but is otherwise ignored. (Reserved on Ascend, so strict mode
      rejects it.)
    - dtypes: float16, bfloat16, float32 (and float64); any rank >= 1 and last-dim size; the
      accumulation (max, exp, sum) is float32 (float64 for float64 x), rounded once.

    Differentiable in ``x`` (through npu_scaled_masked_softmax_backward); ``mask`` gets no
    gradient. Strict mode enforces Ascend's limits: 4-D x and mask, bool mask, last dims in
    [32, 8192] and multiples of 32.
    """
    return _ops.npu_scaled_masked_softmax(x, mask, scale, fixed_triu_mask)


def npu_scaled_masked_softmax_backward(y_grad: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                                       scale, fixed_triu_mask: bool) -> torch.Tensor:
    """Gradient of npu_scaled_masked_softmax with respect to x, given its output ``y``.

    ``dx = scale * y * (y_grad - sum(y_grad * y, dim=-1, keepdim=True))``, with masked positions
    set to 0 (what autograd through masked_fill gives). Same mask rules as the forward; computed
    in float32 (float64 for float64), returned in y_grad's dtype.
    """
    return _ops.npu_scaled_masked_softmax_backward(y_grad, y, mask, scale, fixed_triu_mask)


@register_fake("npu::npu_scaled_masked_softmax")
def _scaled_masked_softmax_fake(x, mask, scale=1, fixed_triu_mask=False):
    return x.new_empty(x.shape)


@register_fake("npu::npu_scaled_masked_softmax_backward")
def _scaled_masked_softmax_backward_fake(y_grad, y, mask, scale, fixed_triu_mask):
    return y_grad.new_empty(y_grad.shape)


def _setup(ctx, inputs, output):
    _, mask, scale, fixed_triu_mask = inputs
    ctx.scale = scale
    ctx.fixed_triu_mask = fixed_triu_mask
    ctx.save_for_backward(output, mask)


def _backward(ctx, y_grad):
    y, mask = ctx.saved_tensors
    dx = None
    if ctx.needs_input_grad[0]:
        dx = _ops.npu_scaled_masked_softmax_backward(y_grad, y, mask, ctx.scale,
                                                     ctx.fixed_triu_mask)
    return dx, None, None, None


register_autograd("npu_scaled_masked_softmax", _backward, _setup)
mark_backward_op("npu_scaled_masked_softmax_backward", "npu_scaled_masked_softmax")

__all__ = ["npu_scaled_masked_softmax", "npu_scaled_masked_softmax_backward"]
