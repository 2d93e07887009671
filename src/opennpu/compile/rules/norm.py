"""RMSNorm written in PyTorch -> npu_rms_norm; a residual add feeding it -> npu_add_rms_norm.

The forms matched (pre-dispatch ATen, per dtype, weight on either side of the product):
- transformers' Llama / Qwen2 / Mistral RMSNorm: h = x.to(float32);
  h = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps); weight * h.to(x.dtype)
- seed 000's TorchRMSNorm: norm(x.float()).type_as(x) * weight
- no up-cast: x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

Numerics: npu_rms_norm reduces in fp32 and rounds once, so for fp16/bf16 it is at least as accurate
as the composition (which rounds h before the weight product). The rule fires only when x and
the weight share a dtype (a mixed product would promote, and the fused op keeps x's dtype) and the
weight is a vector over the last axis. Speed: in inference, fewer than INFERENCE_MIN_TOKENS rows
stay native (see rules/_util.py).
"""

from __future__ import annotations

import math
import operator

import torch

from ..rule_registry import fusion_rule, graph_rule
from ._util import FLOAT_DTYPES, call_eps, drop_eps, empty, has_kernels, is_last_dim_vector, \
    known_contiguous, known_same_shape, number_or_absent, overwritable, same_float_dtype, val, \
    worth_fusing

EPS = 2e-6  # an unusual literal, so scalar_workaround cannot confuse it with other constants


def _rms_norm_ok(match) -> bool:
    x, w = val(match, "x"), val(match, "weight")
    return (same_float_dtype(x, w) and is_last_dim_vector(w, x) and number_or_absent(match, "eps")
            and has_kernels(("npu_rms_norm", "npu_rms_norm_backward"), x, w)
            and worth_fusing(math.prod(x.shape[:-1])))


def _upcast_norm(x, weight, eps):  # transformers
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _upcast_norm_weight_last(x, weight, eps):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype) * weight


def _type_as_norm(x, weight, eps):  # seed 000
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


def _type_as_norm_weight_first(x, weight, eps):
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


def _plain_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _plain_norm_weight_first(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _fused_norm(x, weight, eps):
    return torch.ops.npu.npu_rms_norm(x, weight, eps)[0]


@fusion_rule("rms_norm", stage="pre_autograd",
             doc="RMSNorm composed of pow/mean/rsqrt/mul (transformers, seed 000) -> npu_rms_norm")
def _register_rms_norm(r) -> None:
    # Cast-free forms first: an fp32 graph of any form (its casts are no-ops, removed before
    # matching) is the plain pattern, and the variant that owns a pattern is the one whose search
    # function is re-traced to confirm a match, so it must trace to that same pattern in every dtype.
    for search in (_plain_norm, _plain_norm_weight_first, _type_as_norm,
                   _type_as_norm_weight_first, _upcast_norm, _upcast_norm_weight_last):
        for dtype in FLOAT_DTYPES:
            inputs = [empty(2, 8, dtype=dtype), empty(8, dtype=dtype)]  # eps: scalar_workaround
            r.replacement(search, _fused_norm, inputs, extra_check=_rms_norm_ok,
                          scalar_workaround={"eps": EPS})


def _add_norm(x1, x2, weight, eps):
    x = x1 + x2
    return call_eps(torch.ops.npu.npu_rms_norm, x, weight, eps=eps)[0], x


def _add_norm_only(x1, x2, weight, eps):
    return call_eps(torch.ops.npu.npu_rms_norm, x1 + x2, weight, eps=eps)[0]


def _fused_add_norm(x1, x2, weight, eps):
    y, _, x = call_eps(torch.ops.npu.npu_add_rms_norm, x1, x2, weight, eps=eps)
    return y, x


def _fused_add_norm_only(x1, x2, weight, eps):
    return call_eps(torch.ops.npu.npu_add_rms_norm, x1, x2, weight, eps=eps)[0]


def _add_rms_norm_ok(match) -> bool:
    x1, x2, w = val(match, "x1"), val(match, "x2"), val(match, "weight")
    # No broadcasting in the add: npu_add_rms_norm takes two tensors of one shape.
    return (same_float_dtype(x1, x2, w) and is_last_dim_vector(w, x1)
            and x1.shape == x2.shape and number_or_absent(match, "eps")
            and has_kernels(("npu_add_rms_norm", "npu_rms_norm_backward"), x1, x2, w)
            and worth_fusing(math.prod(x1.shape[:-1])))


@fusion_rule("add_rms_norm", stage="pre_autograd", order=1,
             doc="residual add feeding npu_rms_norm (also from the rms_norm rule) -> npu_add_rms_norm")
def _register_add_rms_norm(r) -> None:
    for dtype in FLOAT_DTYPES:
        inputs = [empty(2, 8, dtype=dtype), empty(2, 8, dtype=dtype), empty(8, dtype=dtype)]
        for search, replace in ((_add_norm, _fused_add_norm),
                                (_add_norm_only, _fused_add_norm_only)):
            r.replacement(search, replace, inputs, extra_check=_add_rms_norm_ok,
                          scalar_workaround={"eps": EPS})
            # The dispatcher drops an epsilon equal to the default (1e-6) from the call.
            r.replacement(drop_eps(search), drop_eps(replace), inputs,
                          extra_check=_add_rms_norm_ok)


# --- the sum into a dead buffer ------------------------------------------------------------------


def _sum_fits(arg, total, layout: bool = True) -> bool:
    """`arg`'s value has npu_add_rms_norm's sum `total`'s shape, dtype and device and (`layout`)
    is contiguous, the sum's layout, which later ops were traced against."""
    value = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    return (isinstance(value, torch.Tensor) and value.dtype == total.dtype
            and value.device == total.device and known_same_shape(value, total)
            and (not layout or known_contiguous(value)))


def _wrote_sum_into(writer: torch.fx.Node, buffer: torch.fx.Node) -> bool:
    """`writer` is an earlier rewrite of this rule that wrote its sum into `buffer`. Its sum's
    readers now read `buffer`, so a later add_rms_norm of that sum (the residual stream of
    consecutive layers) may write its own sum there again: the buffer was dead after `writer`
    but for that sum, and the writer itself precedes every one of them."""
    return (writer.op == "call_function"
            and writer.target is torch.ops.opennpu._add_rms_norm_inplace.default
            and len(writer.args) > 1 and writer.args[1] is buffer)


def _reinplace_add_rms_norm(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    values = node.meta.get("val")
    users = list(node.users)
    if not (isinstance(values, (tuple, list)) and len(values) == 3 and len(node.args) >= 3
            and all(u.op == "call_function" and u.target is operator.getitem
                    and isinstance(u.args[1], int) for u in users)):
        return False
    x1, x2, gamma = node.args[:3]
    total = values[2]
    # The in-place kernel is the CPU one (npu runs it through its CPU fallback); elsewhere the op
    # would be the portable composition, which copies.
    if not (isinstance(total, torch.Tensor) and total.device.type in ("cpu", "npu")
            and has_kernels(("opennpu::_add_rms_norm_inplace",), total)):
        return False
    # x1 + x2 is the same sum either way round (each element's fp32 addition commutes), so the
    # residual (x2 in `h + residual` order) or the other addend, whichever is dead. Both must
    # have the sum's shape: the in-place op does not broadcast (npu_add_rms_norm's x2 may).
    if not all(_sum_fits(t, total, layout=False) for t in (x1, x2)):
        return False
    for target, other in ((x2, x1), (x1, x2)):
        if target is not other and _sum_fits(target, total) and overwritable(
                target, node, wrote_before=lambda u, t=target: _wrote_sum_into(u, t)):
            break
    else:
        return False
    with graph.inserting_before(node):
        fused = graph.call_function(torch.ops.opennpu._add_rms_norm_inplace.default,
                                    (other, target, gamma, *node.args[3:]), dict(node.kwargs))
    fused.meta.update(node.meta)
    fused.meta["val"] = (values[0], values[1])
    for user in users:
        if user.args[1] == 2:  # the sum: now target's buffer, written by the fused op
            user.replace_all_uses_with(target)
            graph.erase_node(user)
        else:
            user.replace_input_with(node, fused)
    graph.erase_node(node)
    return True


@graph_rule("add_rms_norm_inplace", stage="post_grad", order=1,
            doc="npu_add_rms_norm whose x2 (or x1) buffer nothing reads afterwards -> "
                "opennpu::_add_rms_norm_inplace (the sum written into that buffer)")
def _add_rms_norm_inplace(gm: torch.fx.GraphModule) -> int:
    """IPEX's add_rms_norm(add_back=True): the residual sum goes into an addend's buffer instead
    of a new one (no allocation, and its lines are in cache from the read). Only where the write
    is invisible to the program (rules/_util.overwritable): never a graph input, a parameter, an
    output, a tensor saved for backward, or memory read later through any alias. The graph is
    no longer purely functional after it, so it runs last (after the user's post pass)."""
    graph = gm.graph
    count = 0
    for node in list(graph.find_nodes(op="call_function",
                                      target=torch.ops.npu.npu_add_rms_norm.default)):
        count += _reinplace_add_rms_norm(graph, node)
    return count
