"""Benchmark cases, one module per op family."""

from __future__ import annotations

from . import (activation, atb, attention, compile, ffn, infer_attention, kvcache, moe, moe_routing,
               norm, optim, quant, rotary, sampling, softmax, transpose)

# The families --ops accepts, in the order the table lists them.
OPS = ("rms_norm", "gemma_rms_norm", "add_rms_norm", "add_rms_norm_v2", "add_rms_norm_inplace",
       "add_rms_norm_cast", "dynamic_quant", "quantize", "add_rms_norm_dynamic_quant", "quant_matmul", "grouped_matmul",
       "grouped_matmul_quant", "dynamic_mx_quant", "dynamic_block_quant", "swiglu", "geglu",
       "fast_gelu", "rotary_mul", "interleave_rope", "kv_rmsnorm_rope_cache",
       "scaled_masked_softmax", "confusion_transpose", "attention", "infer_attention", "ffn",
       "moe_layer", "moe_token_permute", "moe_token_unpermute", "moe_gating_v2",
       "moe_init_routing_v2", "adamw", "clip_grad_norm", "decoder_layer", "scatter_pa_kv_cache",
       "gather_pa_kv_cache", "scatter_nd_update", "top_k_top_p", "top_k_top_p_sample",
       "atb_paged_attention", "atb_flash_attention", "atb_rotary_embedding")


def all_cases(quick: bool, dtypes):
    """Every case of every family, grouped by op and direction (shapes keep their order)."""
    modules = (norm, quant, activation, rotary, softmax, transpose, attention, infer_attention,
               ffn, moe, moe_routing, optim, compile, kvcache, sampling, atb)
    cases = [c for module in modules for c in module.cases(quick, dtypes)]
    return sorted(cases, key=lambda c: (OPS.index(c.op), c.direction != "fwd"))
