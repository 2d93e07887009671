"""Seed 000's scaled masked softmax -> npu_scaled_masked_softmax(x, mask, scale, False).

The forms matched (pre-dispatch ATen):

- ``torch.softmax((x * scale).masked_fill(mask, -inf), dim=-1)`` (seed 000), scale a Python number
- ``torch.softmax(x.masked_fill(mask, -inf), dim=-1)`` (scale 1)

with a bool mask. Conventions checked against the op (ops/softmax.py): mask True = masked out,
as in masked_fill; the output has x's shape and dtype, as the composition (a Python-number scale
and masked_fill keep x's dtype, softmax without `dtype=` too).

The fill value, the softmax dim and `dtype=` are pattern wildcards, verified by `_softmax_ok`:
the fill must be -inf or a finite value <= -10000 (transformers' finfo.min masks, or -10000
itself), the dim the last one, no `dtype=`. The mask must broadcast to x's shape without growing
it (eager masked_fill would broadcast x up to a larger mask; the fused op returns x's shape).
In strict mode (opennpu.set_strict) only Ascend's shapes are fused, since the op rejects others.

Numerics: the op fills masked scores with -10000 (torch_npu's golden) and computes in float32,
rounded once. A masked score then contributes exp(-10000 - m) with m the row's largest score,
which is 0 in float32 unless m < about -9900: for any row that keeps one score above that, the
result is the composition's (for fp16 / bf16 x more accurate: no rounding of x * scale before
the exponentials). The two cases where it differs are documented deliberately rather than
guarded (no static check can see data):
- a row whose kept scores are all below about -9900 after scaling (not an attention logit any
  model produces);
- a fully masked row: with a -inf fill the composition returns NaN (0 / 0), the fused op the
  uniform 1 / W that torch_npu documents (a finite fill <= -10000 gives uniform in both).
Autograd: npu_scaled_masked_softmax_backward (no gradient to the mask, as through masked_fill).
"""

from __future__ import annotations

import math

import torch

from ..._strict import is_strict
from ..rule_registry import fusion_rule
from ._util import FLOAT_DTYPES, arg, broadcasts_into, empty, has_kernels, is_last_dim, known, \
    nodes, number_or_absent, val

aten = torch.ops.aten
SCALE = 0.3183  # an unusual literal, so scalar_workaround cannot confuse it with other constants
_FILL_LIMIT = -10000.0  # the op's own fill value


_OPS = ("npu_scaled_masked_softmax", "npu_scaled_masked_softmax_backward")


def _scaled(x, mask, scale):
    return torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)


def _unscaled(x, mask):
    return torch.softmax(x.masked_fill(mask, float("-inf")), dim=-1)


def _fused_scaled(x, mask, scale):
    return torch.ops.npu.npu_scaled_masked_softmax(x, mask, scale, False)


def _fused_unscaled(x, mask):
    return torch.ops.npu.npu_scaled_masked_softmax(x, mask, 1.0, False)


def _softmax_ok(match) -> bool:
    x, mask = val(match, "x"), val(match, "mask")
    if not (isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES and x.dim() >= 1):
        return False
    if not (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
            and broadcasts_into(mask, x) and has_kernels(_OPS, x, mask)):
        return False
    # A tensor scale (x * t) is a graph node, not a number the op's Scalar can take.
    if not number_or_absent(match, "scale") or not math.isfinite(match.kwargs.get("scale", 1)):
        return False
    (fill_node,) = nodes(match, aten.masked_fill.Scalar)
    fill = arg(fill_node, 2)
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        return False
    if not (fill == -math.inf or (math.isfinite(fill) and fill <= _FILL_LIMIT)):
        return False
    # Strict mode makes the op enforce Ascend's limits (4-D x and mask, last dims 32..8192 in
    # steps of 32): code that never called it must not start failing there.
    if is_strict() and not all(t.dim() == 4 and known(t.shape[-1] >= 32)
                               and known(t.shape[-1] <= 8192) and known(t.shape[-1] % 32 == 0)
                               for t in (x, mask)):
        return False
    (softmax,) = nodes(match, aten.softmax.int)
    # dtype= would change the output dtype (e.g. fp16 scores, fp32 probabilities).
    return is_last_dim(arg(softmax, 1), x.dim()) and arg(softmax, 2) is None


# order=1: after the order-0 rules, so the attention chain (matmul * scale, masked_fill, softmax,
# matmul), which contains this one, is matched whole first (rules/attention.py).
@fusion_rule("scaled_masked_softmax", stage="pre_autograd", order=1,
             doc="softmax((x * scale).masked_fill(mask, -inf), -1) (seed 000) "
                 "-> npu_scaled_masked_softmax")
def _register_scaled_masked_softmax(r) -> None:
    # One dtype suffices: no casts, and generic_sizes keeps the pattern as traced (the fill value
    # and the dim are verified by extra_check).
    inputs = [empty(2, 3, 8), torch.empty(3, 8, dtype=torch.bool)]
    r.replacement(_scaled, _fused_scaled, inputs, extra_check=_softmax_ok,
                  scalar_workaround={"scale": SCALE}, generic_sizes=True)
    r.replacement(_unscaled, _fused_unscaled, inputs, extra_check=_softmax_ok,
                  generic_sizes=True)
