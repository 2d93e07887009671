"""SwiGLU written in PyTorch -> npu_swiglu(x, dim=-1).

npu_swiglu splits x in halves ``a | b`` along ``dim`` and returns ``silu(a) * b``: the FIRST half
is activated. The forms matched (pre-dispatch ATen), each with the product in either order and
SiLU as F.silu or written out (``a * torch.sigmoid(a)``, ``torch.sigmoid(a) * a``):

- seed 000's TorchSwiGlu: ``a, b = torch.chunk(x, 2, -1); silu(a) * b``
- slicing: ``n = x.shape[-1] // 2; silu(x[..., :n]) * x[..., n:]``

The chunk / slice arguments are pattern wildcards (a traced pattern would burn in the example's
sizes, which fails under dynamic shapes), so `_swiglu_ok` verifies every one of them: a split of
the LAST dim into its two equal halves, the first half into silu. A split of another dim, a
swapped pair (``silu(x[..., n:]) * x[..., :n]``) or unequal parts is left alone.

Numerics: npu_swiglu computes silu(a) * b in float32 and rounds once, where the composition
rounds silu(a) (or sigmoid(a) and a * sigmoid(a)) to the input dtype before the product, so for fp16 / bf16 it is at least as
accurate; it keeps x's dtype and the halved shape, as the composition does. Its autograd is
npu_swiglu_backward, so training graphs differentiate through the fused op.

The two-tensor form, Llama's MLP ``silu(gate_proj(x)) * up_proj(x)`` (rule "silu_mul"), has its
halves in two tensors from separate linears. Concatenating the weights to feed npu_swiglu would
copy 2 * H * I elements per call (measured slower at every size), so it goes to
opennpu::_silu_mul instead: npu_swiglu's kernel reading the halves from the two tensors, with
the same fp32 arithmetic and backward. It runs after "swiglu" (order 1), over contiguous gate
and up of one shape and dtype (no broadcast); slices of one tensor that "swiglu" declined are
left to Inductor, which reads them in place.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from ..rule_registry import fusion_rule
from ._util import FLOAT_DTYPES, empty, guard_even, halves_of_last_dim, has_kernels, \
    is_chunk_in_halves, known_contiguous, known_same_shape, nodes, same_float_dtype, val

aten = torch.ops.aten


def _halves(x, split: str):
    if split == "chunk":
        return torch.chunk(x, 2, -1)
    n = x.shape[-1] // 2
    return x[..., :n], x[..., n:]


_ACTIVATIONS = {
    "silu": F.silu,
    "a_sigmoid": lambda a: a * torch.sigmoid(a),   # SiLU written out
    "sigmoid_a": lambda a: torch.sigmoid(a) * a,
}


def _search_fn(split: str, activation: str, activated_first: bool):
    def search(x):
        a, b = _halves(x, split)
        g = _ACTIVATIONS[activation](a)
        return g * b if activated_first else b * g

    search.__name__ = f"swiglu_{split}_{activation}_{'gb' if activated_first else 'bg'}"
    return search


_OPS = ("npu_swiglu", "npu_swiglu_backward")


def _fused(x):
    return torch.ops.npu.npu_swiglu(x, -1)


def _swiglu_ok(match) -> bool:
    x = val(match, "x")
    if not (isinstance(x, torch.Tensor) and x.dtype in FLOAT_DTYPES and x.dim() >= 1
            and has_kernels(_OPS, x)):
        return False
    chunks = nodes(match, aten.chunk.default)
    if chunks:
        (chunk,) = chunks
        split = is_chunk_in_halves(chunk, x)
    else:
        slices = nodes(match, aten.slice.Tensor)
        (activation,) = nodes(match, aten.silu.default, aten.sigmoid.default)
        first = activation.args[0]
        if len(slices) != 2 or first not in slices:
            return False
        second = slices[1] if slices[0] is first else slices[0]
        split = halves_of_last_dim(first, second, x)
    # An even D, last (it may install a guard). Under dynamic shapes the product already made
    # Dynamo guard the two parts equal, so this adds no recompile; statically it rejects
    # silu(x[..., :1]) * x[..., 1:] of a 3-wide x (a broadcast, not a SwiGLU).
    return split and guard_even(x.shape[-1])


@fusion_rule("swiglu", stage="pre_autograd",
             doc="silu(first half) * second half, by chunk(2, -1) or slicing -> npu_swiglu")
def _register_swiglu(r) -> None:
    # One dtype suffices: the forms have no casts, and with generic_sizes the pattern is not
    # re-traced per match (extra_check verifies the split instead).
    for split, activation, activated_first in itertools.product(
            ("chunk", "slice"), _ACTIVATIONS, (True, False)):
        r.replacement(_search_fn(split, activation, activated_first), _fused, [empty(2, 8)],
                      extra_check=_swiglu_ok, generic_sizes=True)


# --- silu(gate) * up over two tensors -----------------------------------------------------------

_GATE_UP_OPS = ("opennpu::_silu_mul", "opennpu::_silu_mul_backward")


def _gate_up_search_fn(activation: str, activated_first: bool):
    def search(gate, up):
        g = _ACTIVATIONS[activation](gate)
        return g * up if activated_first else up * g

    search.__name__ = f"silu_mul_{activation}_{'gu' if activated_first else 'ug'}"
    return search


def _silu_mul(gate, up):
    return torch.ops.opennpu._silu_mul(gate, up)


def _silu_mul_ok(match) -> bool:
    gate, up = val(match, "gate"), val(match, "up")
    return (same_float_dtype(gate, up) and known_same_shape(gate, up)
            and known_contiguous(gate) and known_contiguous(up)
            and has_kernels(_GATE_UP_OPS, gate, up))


@fusion_rule("silu_mul", stage="pre_autograd", order=1,
             doc="silu(gate) * up over two same-shape tensors (Llama's MLP) -> opennpu::_silu_mul")
def _register_silu_mul(r) -> None:
    for activation, activated_first in itertools.product(_ACTIVATIONS, (True, False)):
        r.replacement(_gate_up_search_fn(activation, activated_first), _silu_mul,
                      [empty(2, 8), empty(2, 8)], extra_check=_silu_mul_ok, generic_sizes=True)
