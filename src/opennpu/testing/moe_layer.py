"""A Mixtral-style MoE layer built from opennpu ops only (the composition the tests compare with
reference.native_moe_layer / reference.moe_layer, and the benchmarks time).

    gate logits -> npu_moe_gating_top_k_softmax -> npu_moe_init_routing
    -> npu_moe_compute_expert_tokens -> npu_grouped_matmul (gate|up) -> npu_swiglu
    -> npu_grouped_matmul (down) -> npu_moe_finalize_routing

The expert FFN is two grouped matmuls around npu_swiglu. Once npu_ffn (with expert_tokens) is
available it can replace those three calls: npu_ffn(expanded_x, w13, w2, "swiglu",
expert_tokens=<per-expert counts>) computes the same rows.
"""

from __future__ import annotations

import torch

_ops = torch.ops.npu


def npu_moe_layer(x, w_gate, w13, w2, k, renormalize=True):
    """x [T, H]; w_gate [H, E]; w13 = [w1 | w3] as [E, H, 2I]; w2 [E, I, H]. Returns [T, H].

    Same math as reference.native_moe_layer; the routing weights stay in float32 up to the
    combine (finalize takes float32 scales), where the native loop rounds them to x's dtype."""
    tokens, experts = x.shape[0], w13.shape[0]
    logits = x @ w_gate
    probs, expert_idx, row_idx = _ops.npu_moe_gating_top_k_softmax(logits, None, k)
    scales = probs.to(torch.promote_types(probs.dtype, torch.float32))
    if renormalize:
        scales = scales / scales.sum(dim=-1, keepdim=True)
    expanded_x, expanded_row_idx, expanded_expert_idx = _ops.npu_moe_init_routing(
        x, row_idx, expert_idx, tokens)
    group_list = _ops.npu_moe_compute_expert_tokens(expanded_expert_idx, experts)
    h = _ops.npu_grouped_matmul([expanded_x], [w13], group_list=group_list, split_item=3,
                                group_type=0, group_list_type=0)[0]
    h = _ops.npu_swiglu(h, -1)
    h = _ops.npu_grouped_matmul([h], [w2], group_list=group_list, split_item=3, group_type=0,
                                group_list_type=0)[0]
    return _ops.npu_moe_finalize_routing(h, None, None, None, scales, expanded_row_idx,
                                         expert_idx, 0)
