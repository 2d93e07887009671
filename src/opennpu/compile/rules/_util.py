"""Helpers shared by the rule modules: example inputs and the checks on matched values."""

from __future__ import annotations

import inspect

import torch
from torch._inductor.pattern_matcher import Match

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def val(match: Match, name: str):
    """The fake value (tensor, SymInt or Python scalar) bound to pattern argument `name`."""
    arg = match.kwargs[name]
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def same_float_dtype(*tensors) -> bool:
    """All tensors share one of fp32/fp16/bf16 (the fused ops' dtypes; no mixed promotion)."""
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return False
    return tensors[0].dtype in FLOAT_DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)


def is_last_dim_vector(weight, x) -> bool:
    """`weight` is 1-D with x's last size (a per-channel scale over the normalised axis)."""
    return (isinstance(weight, torch.Tensor) and isinstance(x, torch.Tensor) and weight.dim() == 1
            and x.dim() >= 1 and torch.fx.experimental.symbolic_shapes.statically_known_true(
                weight.shape[0] == x.shape[-1]))


def drop_eps(fn):
    """`fn` without its last parameter `eps` (passed as None): the pattern without epsilon."""
    sig = inspect.signature(fn)

    def without_eps(*args):
        return fn(*args, None)

    without_eps.__signature__ = sig.replace(parameters=list(sig.parameters.values())[:-1])
    without_eps.__name__ = f"{fn.__name__}_default_eps"
    return without_eps


def call_eps(op, *args, eps):
    """op(*args, eps), or op(*args) when eps is None (the default-epsilon spelling)."""
    return op(*args) if eps is None else op(*args, eps)
