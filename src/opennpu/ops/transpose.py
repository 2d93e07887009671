"""Confusion transpose: npu_confusion_transpose and npu_confusion_transpose_backward.

A reshape fused with a permutation, materialised in one pass into a new contiguous tensor. Pure
data movement: every dtype is supported (the kernel moves 1, 2, 4 or 8-byte units), bit-exact.
"""

from __future__ import annotations

import torch

from ._registry import accepts_input_keyword, mark_backward_op, register_autograd, register_fake

_ops = torch.ops.npu


def _checked_perm(op: str, perm, rank: int, of: str) -> list:
    """perm with negative dims wrapped, checked as the C++ entry point checks it, so that fake
    tensors (torch.compile) raise the same message instead of an IndexError."""
    wrapped = [p + rank if p < 0 else p for p in perm]
    if len(perm) != rank or sorted(wrapped) != list(range(rank)):
        raise RuntimeError(f"{op}: argument 'perm' must be a permutation of the dims of {of} "
                           f"({rank} dims), but got {list(perm)}")
    return wrapped


@accepts_input_keyword
def npu_confusion_transpose(self: torch.Tensor, perm, shape, transpose_first: bool):
    """Reshape and permute in one copy; returns a new contiguous tensor.

    ``transpose_first=True``: ``out = self.permute(perm).contiguous().view(shape)``, shape
    ``shape`` (``perm`` permutes the dims of ``self``).
    ``transpose_first=False``: ``out = self.view(shape).permute(perm).contiguous()``, shape
    ``[shape[p] for p in perm]`` (``perm`` permutes the dims of ``shape``).

    ``prod(shape)`` must equal ``self.numel()``; every size is given explicitly (-1 is not
    inferred, as on Ascend). ``perm`` may use negative dims. All dtypes (float, bfloat16, integer,
    bool, complex); any rank; non-contiguous ``self`` is read in its logical order (as ``reshape``
    would). Differentiable through npu_confusion_transpose_backward.
    """
    return _ops.npu_confusion_transpose(self, perm, shape, transpose_first)


def npu_confusion_transpose_backward(grad: torch.Tensor, perm, shape, transpose_first: bool):
    """Gradient of npu_confusion_transpose: called with the input's ``shape`` and the forward's
    ``not transpose_first``. With ``inv[perm[i]] = i``:
    ``transpose_first=False``: ``grad.view([shape[p] for p in perm]).permute(inv)``;
    ``True``: ``grad.permute(inv).reshape(shape)``. The result has shape ``shape``, contiguous.
    """
    return _ops.npu_confusion_transpose_backward(grad, perm, shape, transpose_first)


# ----------------------------------------------------------------------------- fake kernels


@register_fake("npu::npu_confusion_transpose")
def _confusion_transpose_fake(self, perm, shape, transpose_first):
    op = "npu_confusion_transpose"
    if transpose_first:
        _checked_perm(op, perm, self.dim(), "'self'")
        return self.new_empty(shape)
    perm = _checked_perm(op, perm, len(shape), f"'shape' {list(shape)}")
    return self.new_empty([shape[p] for p in perm])


@register_fake("npu::npu_confusion_transpose_backward")
def _confusion_transpose_backward_fake(grad, perm, shape, transpose_first):
    return grad.new_empty(shape)


# ----------------------------------------------------------------------------- autograd


def _setup(ctx, inputs, output):
    self, perm, _shape, transpose_first = inputs
    ctx.perm = perm
    ctx.transpose_first = transpose_first
    ctx.self_shape = self.shape  # SymInts under torch.compile(dynamic=True)


def _backward(ctx, grad):
    dx = None
    if ctx.needs_input_grad[0]:
        dx = _ops.npu_confusion_transpose_backward(grad, ctx.perm, ctx.self_shape,
                                                   not ctx.transpose_first)
    return dx, None, None, None


register_autograd("npu_confusion_transpose", _backward, _setup)
mark_backward_op("npu_confusion_transpose_backward", "npu_confusion_transpose")

__all__ = ["npu_confusion_transpose", "npu_confusion_transpose_backward"]
