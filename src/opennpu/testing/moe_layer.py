"""A Mixtral-style MoE layer built from opennpu ops only (the composition the tests compare with
reference.native_moe_layer / reference.moe_layer, and the benchmarks time).

    gate logits -> npu_moe_gating_top_k_softmax -> npu_moe_init_routing
    -> npu_moe_compute_expert_tokens -> expert FFN -> npu_moe_finalize_routing

The expert FFN is either two grouped matmuls around npu_swiglu (``npu_moe_layer``) or one
npu_ffn call with the experts' cumulative token counts (``npu_moe_layer_ffn``).
"""

from __future__ import annotations

import torch

_ops = torch.ops.npu


def _route(x, w_gate, k, experts, renormalize):
    """Gate, top-k and the expert-sorted rows: (scales, expanded_x, expanded_row_idx,
    expert_idx, group_list) with group_list the cumulative rows per expert."""
    logits = x @ w_gate
    probs, expert_idx, row_idx = _ops.npu_moe_gating_top_k_softmax(logits, None, k)
    scales = probs.to(torch.promote_types(probs.dtype, torch.float32))
    if renormalize:
        scales = scales / scales.sum(dim=-1, keepdim=True)
    expanded_x, expanded_row_idx, expanded_expert_idx = _ops.npu_moe_init_routing(
        x, row_idx, expert_idx, x.shape[0])
    group_list = _ops.npu_moe_compute_expert_tokens(expanded_expert_idx, experts)
    return scales, expanded_x, expanded_row_idx, expert_idx, group_list


def npu_moe_layer(x, w_gate, w13, w2, k, renormalize=True):
    """x [T, H]; w_gate [H, E]; w13 = [w1 | w3] as [E, H, 2I]; w2 [E, I, H]. Returns [T, H].

    Same math as reference.native_moe_layer; the routing weights stay in float32 up to the
    combine (finalize takes float32 scales), where the native loop rounds them to x's dtype."""
    scales, expanded_x, expanded_row_idx, expert_idx, group_list = _route(
        x, w_gate, k, w13.shape[0], renormalize)
    h = _ops.npu_grouped_matmul([expanded_x], [w13], group_list=group_list, split_item=3,
                                group_type=0, group_list_type=0)[0]
    h = _ops.npu_swiglu(h, -1)
    h = _ops.npu_grouped_matmul([h], [w2], group_list=group_list, split_item=3, group_type=0,
                                group_list_type=0)[0]
    return _ops.npu_moe_finalize_routing(h, None, None, None, scales, expanded_row_idx,
                                         expert_idx, 0)


def swap_glu_halves(w13):
    """[w1 | w3] -> [w3 | w1] along the last dim. npu_swiglu activates the first half of its
    input (silu(a) * b), npu_ffn's "swiglu" the second (a * silu(b), Ascend's FFN kernel), so
    the same expert needs its up-projection halves in the other order; a model would store
    them that way once."""
    inter = w13.shape[-1] // 2
    return torch.cat([w13[..., inter:], w13[..., :inter]], dim=-1)


def npu_moe_layer_ffn(x, w_gate, w31, w2, k, renormalize=True):
    """The layer of npu_moe_layer with the expert FFN as ONE npu_ffn call over the expert-sorted
    rows: w31 = [w3 | w1] as [E, H, 2I] (see swap_glu_halves), w2 [E, I, H].

    npu_ffn takes the token split as a list (expert_tokens_index: the cumulative counts from
    npu_moe_compute_expert_tokens), so the counts come back to the host: eager only."""
    scales, expanded_x, expanded_row_idx, expert_idx, group_list = _route(
        x, w_gate, k, w31.shape[0], renormalize)
    h = _ops.npu_ffn(expanded_x, w31, w2, "swiglu", expert_tokens_index=group_list.tolist())
    return _ops.npu_moe_finalize_routing(h, None, None, None, scales, expanded_row_idx,
                                         expert_idx, 0)
