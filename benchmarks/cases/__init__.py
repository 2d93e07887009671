"""Benchmark cases, one module per op family."""

from __future__ import annotations

from . import (activation, attention, compile, ffn, moe, moe_routing, norm, optim, quant, rotary,
               softmax, transpose)

# The families --ops accepts, in the order the table lists them.
OPS = ("rms_norm", "gemma_rms_norm", "add_rms_norm", "add_rms_norm_v2", "add_rms_norm_cast",
       "dynamic_quant",
       "add_rms_norm_dynamic_quant", "swiglu", "geglu", "fast_gelu", "rotary_mul",
       "scaled_masked_softmax", "confusion_transpose", "attention", "ffn", "moe_layer",
       "moe_token_permute", "moe_token_unpermute", "moe_gating_v2", "moe_init_routing_v2", "adamw",
       "clip_grad_norm", "decoder_layer")


def all_cases(quick: bool, dtypes):
    """Every case of every family, grouped by op and direction (shapes keep their order)."""
    modules = (norm, quant, activation, rotary, softmax, transpose, attention, ffn, moe,
               moe_routing, optim, compile)
    cases = [c for module in modules for c in module.cases(quick, dtypes)]
    return sorted(cases, key=lambda c: (OPS.index(c.op), c.direction != "fwd"))
