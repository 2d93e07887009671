"""Benchmark cases, one module per op family."""

from __future__ import annotations

from . import activation, attention, norm, rotary

# The families --ops accepts, in the order the table lists them.
OPS = ("rms_norm", "gemma_rms_norm", "add_rms_norm", "swiglu", "geglu", "fast_gelu", "rotary_mul",
       "attention")


def all_cases(quick: bool, dtypes):
    """Every case of every family, grouped by op and direction (shapes keep their order)."""
    cases = [c for module in (norm, activation, rotary, attention) for c in module.cases(quick, dtypes)]
    return sorted(cases, key=lambda c: (OPS.index(c.op), c.direction != "fwd"))
