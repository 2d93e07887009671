"""Rotary position embedding written in PyTorch -> npu_rotary_mul(x, r1, r2).

``x * r1 + cat((-x2, x1), -1) * r2`` with ``x1 | x2`` the two halves of x's last dim, which is
npu_rotary_mul's 'half' mode (r1 = cos, r2 = sin). The forms matched (pre-dispatch ATen):

- seed 000 / seed 004's computation: ``x1, x2 = x[..., :D//2], x[..., D//2:]`` (or
  ``torch.chunk(x, 2, -1)``); ``r1 * x + r2 * cat((-x2, x1), dim=-1)``
- transformers' apply_rotary_pos_emb (Llama, Qwen2, Mistral...): ``(q * cos) + (rotate_half(q)
  * sin)``, the same graph, matched once for q and once for k

with each product and the sum in either operand order (eight spellings per split).

The split arguments are pattern wildcards (sizes burned into a traced pattern fail under dynamic
shapes), so `_rotary_ok` verifies them: the last dim D even, split in its two halves, the first
half x1 concatenated after the negated second half x2, along the last dim.

Broadcasting: npu_rotary_mul returns x's shape and broadcasts r1 / r2 against x only (r of rank
<= x's, each size equal to x's or 1). Eager ``r1 * x`` would instead grow the result when r1 has
more dims or a size > 1 against a size-1 dim of x, so such shapes are left alone. In strict mode
(opennpu.set_strict) only Ascend's documented layouts are fused, since the op would reject others.

Layout: the fused result has eager's layout, since code after it was traced on eager's strides
(a .view may depend on them): a BNSD view of BSND memory for transformers' q and k (rotated as
the BSND tensors, see _bsnd_path), contiguous elsewhere; a match whose eager result has another
layout stays native.

Speed: in inference, cos with fewer than INFERENCE_MIN_TOKENS rows (positions) stays native (see
rules/_util.py).

Numerics: x, r1 and r2 must share one of fp32 / fp16 / bf16. (Eager promotes a bf16 x times fp32
cos / sin to fp32, while the fused op would return bf16: a mixed-dtype graph is not fused.) The
fused op computes in float32 and rounds once where the composition rounds three times (both
products and the sum), so it is at least as accurate. Autograd: npu_rotary_mul_backward gives dx
and dr1 / dr2 summed over their broadcast dims, as autograd through the composition does.
"""

from __future__ import annotations

import itertools
import math

import torch

from ..._strict import is_strict
from ..rule_registry import fusion_rule
from ._util import arg, broadcasts_into, bsnd_in_memory, empty, guard_even, halves_of_last_dim, \
    has_kernels, is_chunk_in_halves, is_last_dim, known, known_contiguous, known_same_shape, nodes, \
    same_float_dtype, val, worth_fusing

aten = torch.ops.aten


def _rotate(x, split: str):
    if split == "chunk":
        x1, x2 = torch.chunk(x, 2, -1)
    else:
        n = x.shape[-1] // 2
        x1, x2 = x[..., :n], x[..., n:]
    return torch.cat((-x2, x1), dim=-1)


def _search_fn(split: str, x_first: bool, rotated_first: bool, cos_term_first: bool):
    """One spelling: x * r1 or r1 * x, rot * r2 or r2 * rot, and the two terms in either order."""

    def search(x, r1, r2):
        rotated = _rotate(x, split)
        cos_term = x * r1 if x_first else r1 * x
        sin_term = rotated * r2 if rotated_first else r2 * rotated
        return cos_term + sin_term if cos_term_first else sin_term + cos_term

    search.__name__ = (f"rotary_{split}_{'x_r1' if x_first else 'r1_x'}_"
                       f"{'rot_r2' if rotated_first else 'r2_rot'}_"
                       f"{'cos_first' if cos_term_first else 'sin_first'}")
    return search


_OPS = ("npu_rotary_mul", "npu_rotary_mul_backward")


# Whether the match _rotary_ok accepted last is rotated in BSND (see _bsnd_path). The pattern
# matcher traces a rule's replacement with the matched inputs only, right after its extra_check
# accepted that match; this carries the one fact about the match's output it needs.
_rotate_in_bsnd = False


def _bsnd_path(x, r1, r2) -> bool:
    """transformers' q and k are BNSD views of [B, S, N, D] projections (or of a fused qkv
    projection [B, S, 3, N, D], whose S rows are then 3 N D apart), with cos / sin [B|1, 1, S, D]:
    the BSND view itself can be rotated (the op reads strided rows) and the result transposed
    back, a BNSD view of BSND memory as eager's `q * cos + rotate_half(q) * sin` is (the caller
    checks that), which the attention rule then hands over as layout BSND with no copy."""
    if not ((known(x.stride(-1) == 1) or known(x.shape[-1] == 1)) and not known(x.shape[1] == 1)
            and all(r.dim() == 4 and known(r.shape[1] == 1) for r in (r1, r2))):
        return False
    return not is_strict() or _ascend_layout(*(t.transpose(1, 2) for t in (x, r1, r2)))


def _fused(x, r1, r2):
    if _rotate_in_bsnd and _bsnd_path(x, r1, r2):
        return torch.ops.npu.npu_rotary_mul(*(t.transpose(1, 2) for t in (x, r1, r2))).transpose(1, 2)
    return torch.ops.npu.npu_rotary_mul(x, r1, r2)


def _split_ok(match, x, first_half: torch.fx.Node, second_half: torch.fx.Node) -> bool:
    """The cat's operands come from a split of x's last dim in halves: first_half = [0, D/2)
    and second_half = [D/2, D)."""
    chunks = nodes(match, aten.chunk.default)
    if chunks:
        (chunk,) = chunks
        # getitem indices are not wildcards: the pattern already has neg(chunk[1]), chunk[0].
        split = is_chunk_in_halves(chunk, x)
    else:
        split = halves_of_last_dim(first_half, second_half, x)
    # Unlike SwiGLU's product, cat((-x2, x1)) is valid for an odd D too (with halves of
    # different sizes, a different rotation from the op's), so nothing in the graph proves D
    # even under dynamic shapes: check it last, as a guard.
    return split and guard_even(x.shape[-1])


def _ascend_layout(x, r1, r2) -> bool:
    """The shapes strict mode accepts (csrc/ops/rotary: check_strict_r_pattern): 3-D or 4-D x
    with D < 896, r1 and r2 of one shape and x's rank, last dim D, in a documented pattern
    (4-D: not 111D and not 1NSD-like 0b011; 3-D: T kept)."""
    if x.dim() not in (3, 4) or not known(x.shape[-1] < 896):
        return False
    if r1.dim() != x.dim() or r2.dim() != x.dim() or not known(r1.shape[-1] == x.shape[-1]):
        return False
    if not known_same_shape(r1, r2):
        return False
    mask = 0
    for d in range(x.dim() - 1):
        mask = mask * 2 + (0 if known(r1.shape[d] == 1) and not known(x.shape[d] == 1) else 1)
    return mask not in (0b000, 0b011) if x.dim() == 4 else bool(mask & 0b10)


def _rotary_ok(match) -> bool:
    x, r1, r2 = val(match, "x"), val(match, "r1"), val(match, "r2")
    if not (same_float_dtype(x, r1, r2) and x.dim() >= 1 and has_kernels(_OPS, x, r1, r2)):
        return False
    if not (broadcasts_into(r1, x) and broadcasts_into(r2, x)):
        return False
    # The speed gate counts the positions cos has (its rows), the same for q and for k.
    if not worth_fusing(math.prod(r1.shape[:-1])):
        return False
    # Strict mode makes the op enforce Ascend's limits: code that never called it must not
    # start failing there, so shapes outside them stay native.
    if is_strict() and not _ascend_layout(x, r1, r2):
        return False
    (cat,) = nodes(match, aten.cat.default)
    if not is_last_dim(arg(cat, 1, 0), x.dim()):
        return False
    negated, first_half = cat.args[0]
    if negated.target is not aten.neg.default:
        return False
    if not _split_ok(match, x, first_half, negated.args[0]):
        return False
    # The fused result must have eager's layout, or a view the code after it takes (traced on
    # eager's strides) could fail: a BSND-layout result where _bsnd_path rotates in BSND, a
    # contiguous one (the op's own) elsewhere; other layouts stay native.
    global _rotate_in_bsnd
    result = match.output_node().meta.get("val")
    if not isinstance(result, torch.Tensor):
        return False
    _rotate_in_bsnd = bsnd_in_memory(result) and _bsnd_path(x, r1, r2)
    return _rotate_in_bsnd or known_contiguous(result)


@fusion_rule("rotary", stage="pre_autograd",
             doc="x * cos + cat(-x2, x1) * sin (seed 000/004, transformers' rotate_half) "
                 "-> npu_rotary_mul")
def _register_rotary(r) -> None:
    # One dtype suffices: no casts in the forms, and with generic_sizes the pattern is not
    # re-traced per match (extra_check verifies the split and the broadcast instead).
    inputs = [empty(2, 3, 8), empty(3, 8), empty(3, 8)]
    for split, *orders in itertools.product(("slice", "chunk"), *[(True, False)] * 3):
        r.replacement(_search_fn(split, *orders), _fused, inputs, extra_check=_rotary_ok,
                      generic_sizes=True)
