"""permute + reshape (and reshape + permute + contiguous) -> npu_confusion_transpose, on the eager
path only (``debug.run_eagerly``).

The forms matched (pre-dispatch ATen), P one of permute(perm) / transpose(d0, d1) / t():

- transpose first (seed 000, example one): ``P(x).reshape(shape)`` and
  ``P(x).contiguous().view(shape)`` -> ``npu_confusion_transpose(x, perm, shape, True)``
- reshape first (seed 000, example two, materialised): ``x.view(shape)`` or
  ``x.reshape(shape)``, then ``P(.).contiguous()`` -> ``npu_confusion_transpose(x, perm, shape,
  False)``

Only where the composition COPIES: the fused op always returns a new contiguous tensor, so a
reshape that is a view of the permuted x (e.g. a permutation of size-1 dims), or a permuted
tensor that is already contiguous (contiguous() returns it as is), is left alone; so is seed
example two without .contiguous(), which is a view in eager (fusing it would add a copy and
break its aliasing). Then the result is the same new contiguous tensor, bit for bit (the op
moves bytes, every dtype). Its autograd is npu_confusion_transpose_backward.

Static sizes only: perm and shape are ``int[]`` in the op's schema, so symbolic sizes would be
specialised into guards (a recompile per shape); under dynamic shapes the graph is left as it is.

Why eager only: measured on this project's CPU machine (2 cores shared with other jobs; medians,
1 thread, fp32), with `python -m benchmarks.run --ops confusion_transpose` and an in-graph
script (attention-output shape [4, 16, 512, 64] -> [4, 512, 1024], permute (0, 2, 1, 3)):
- against ATen's permuted copy (the eager path) the op is 1.8-3.3x faster in fp32 and 2.1-6.0x
  in bf16 on seed 000's examples and the large cases (BSND->BNSD 4x4096x32x128, 2-D 8192^2
  and 4099x8191 transposes);
- against Inductor's generated copy of the same permute + reshape alone it is 1.0-1.2x on the
  seed shapes and the in-graph copy (0.79 vs 0.86 ms), up to 1.4-3.4x on large 2-D transposes;
- but Inductor fuses the permuted write into a pointwise producer: ``(a + b).permute(...)
  .reshape(...)`` took 1.36 ms compiled, 2.94 ms with the op in its place (the sum is then
  written and read again), and next to a GEMM (attention output into o_proj) the difference
  was lost in noise (111 vs 114 ms).
So under Inductor the op rarely helps and can cost 2x: the rule is an eager-path rule.
"""

from __future__ import annotations

import contextvars
import itertools

import torch

from ..rule_registry import fusion_rule
from ._util import empty, has_kernels, nodes, val

aten = torch.ops.aten

# (perm, shape) found by extra_check for the replacement traced right after it: the pattern's
# int / list arguments are wildcards, and a replacement function receives only the tensors.
_PENDING: contextvars.ContextVar[tuple[list[int], list[int]] | None] = contextvars.ContextVar(
    "opennpu_confusion_transpose", default=None)

_PERMUTES = (aten.permute.default, aten.transpose.int, aten.t.default)


def _permute(x, kind: str):
    if kind == "permute":
        return x.permute(1, 0, 2)
    if kind == "transpose":
        return x.transpose(0, 1)
    return x.t()


def _transpose_first_fn(kind: str, spelling: str):
    def search(x):
        y = _permute(x, kind)
        if spelling == "reshape":
            return y.reshape(-1)
        return y.contiguous().view(-1)

    search.__name__ = f"confusion_{kind}_then_{spelling}"
    return search


def _reshape_first_fn(kind: str, spelling: str):
    def search(x):
        shape = (6, 4) if kind == "t" else (2, 3, 4)  # t() takes a 2-D tensor
        y = x.reshape(shape) if spelling == "reshape" else x.view(shape)
        return _permute(y, kind).contiguous()

    search.__name__ = f"confusion_{spelling}_then_{kind}"
    return search


def _fused_transpose_first(x):
    perm, shape = _PENDING.get()
    return torch.ops.npu.npu_confusion_transpose(x, perm, shape, True)


def _fused_reshape_first(x):
    perm, shape = _PENDING.get()
    return torch.ops.npu.npu_confusion_transpose(x, perm, shape, False)


_OPS = ("npu_confusion_transpose", "npu_confusion_transpose_backward")


def _static(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


def _perm_of(node: torch.fx.Node, rank: int) -> list[int] | None:
    """The permutation a permute / transpose / t node applies to its rank-`rank` input."""
    if node.target is aten.permute.default:
        perm = [p + rank if p < 0 else p for p in node.args[1]]
    elif node.target is aten.transpose.int:
        d0, d1 = (d + rank if d < 0 else d for d in node.args[1:3])
        perm = list(range(rank))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    else:  # t(): swaps the two dims of a 2-D tensor (a 0-D / 1-D t() is no copy)
        perm = [1, 0] if rank == 2 else None
    if perm is None or sorted(perm) != list(range(rank)):
        return None
    return perm


def _copies(permuted: torch.Tensor, shape) -> bool:
    """Whether reshaping the permuted tensor to `shape` copies (it cannot be a view of it)."""
    try:
        permuted.view(shape)
    except (RuntimeError, ValueError):  # fake tensors raise ValueError, real ones RuntimeError
        return True
    return False


def _transpose_first_ok(match) -> bool:
    x = val(match, "x")
    (permute,) = nodes(match, *_PERMUTES)
    out = match.output_node().meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor)
            and _static(x.shape) and _static(out.shape) and has_kernels(_OPS, x)):
        return False
    perm = _perm_of(permute, x.dim())
    permuted = permute.meta.get("val")
    if perm is None or not isinstance(permuted, torch.Tensor):
        return False
    if nodes(match, aten.contiguous.default):
        copies = not permuted.is_contiguous()  # contiguous() copies, then view() is free
    else:
        copies = _copies(permuted, list(out.shape))
    if not copies:
        return False
    _PENDING.set((perm, list(out.shape)))
    return True


def _reshape_first_ok(match) -> bool:
    x = val(match, "x")
    (permute,) = nodes(match, *_PERMUTES)
    (reshape,) = nodes(match, aten.view.default, aten.reshape.default)
    shaped, permuted = reshape.meta.get("val"), permute.meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(shaped, torch.Tensor)
            and isinstance(permuted, torch.Tensor) and _static(x.shape)
            and _static(shaped.shape) and has_kernels(_OPS, x)):
        return False
    perm = _perm_of(permute, shaped.dim())
    # Already contiguous (a permutation of size-1 dims): contiguous() returns it, no copy.
    if perm is None or permuted.is_contiguous():
        return False
    _PENDING.set((perm, list(shaped.shape)))
    return True


# order=2: after every other pre_autograd rule, so a permute + reshape that belongs to a larger
# pattern (the attention chain's output transpose(1, 2).reshape(...)) goes to that rule first.
@fusion_rule("confusion_transpose", stage="pre_autograd", eager_only=True, order=2,
             doc="permute + reshape / reshape + permute + contiguous (seed 000) -> "
                 "npu_confusion_transpose (eager path only: measured, see rules/transpose.py)")
def _register_confusion_transpose(r) -> None:
    # Sizes and dims are wildcards (generic_sizes); extra_check reads them from the nodes.
    for kind, spelling in itertools.product(("permute", "transpose", "t"), ("reshape", "view")):
        x = empty(3, 2, 4) if kind != "t" else empty(6, 4)
        r.replacement(_transpose_first_fn(kind, spelling), _fused_transpose_first, [x],
                      extra_check=_transpose_first_ok, generic_sizes=True)
        r.replacement(_reshape_first_fn(kind, spelling), _fused_reshape_first, [empty(24)],
                      extra_check=_reshape_first_ok, generic_sizes=True)
