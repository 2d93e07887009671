"""torchair.register_replacement: user fusion rules in the post_grad stage."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch._inductor.pattern_matcher import Match, fwd_only

from . import fusion


def _return_true(match: Match) -> bool:
    return True


def register_replacement(search_fn: Callable, replace_fn: Callable, example_inputs: Iterable[Any],
                         trace_fn: Callable = fwd_only,
                         extra_check: Callable[[Match], bool] = _return_true,
                         search_fn_pattern=None, scalar_workaround: dict | None = None,
                         skip_duplicates: bool = False, *, name: str | None = None) -> None:
    """Replace every match of `search_fn` by `replace_fn` in the graphs the backend compiles.

    TorchAir's signature. The rule runs on the functional ATen graphs after AOTAutograd (forward,
    backward and inference), is switched on and off with the other rules by
    ``experimental_config.pattern_fusion_pass``, and is named `name` (default: the search
    function's name) for ``experimental_config.disabled_patterns`` and the fusion counts.
    `extra_check(match)` sees the match with real shapes (``match.kwargs[arg].meta["val"]``).
    Views in the compiled graphs are reshapes, so a hand-built `search_fn_pattern` should use
    ``aten.reshape``; traced patterns are rewritten automatically.
    """
    if not callable(search_fn) or not callable(replace_fn):
        raise TypeError("register_replacement: search_fn and replace_fn must be callables, got "
                        f"{type(search_fn).__name__} and {type(replace_fn).__name__}")
    example_inputs = list(example_inputs)
    if not any(isinstance(x, torch.Tensor) for x in example_inputs):
        raise ValueError("register_replacement: example_inputs must contain at least one tensor "
                         "(the pattern is traced on them)")
    fusion.register_user_rule(
        name or getattr(search_fn, "__name__", "user_rule"), search_fn, replace_fn, example_inputs,
        trace_fn=trace_fn, extra_check=extra_check, search_fn_pattern=search_fn_pattern,
        scalar_workaround=scalar_workaround, skip_duplicates=skip_duplicates)
