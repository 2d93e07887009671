"""The registry of fusion rules, apart from the machinery that applies them (fusion.py), so that
the rule modules (compile/rules/) import it without importing fusion.py, which imports them.

A rule module declares its rule with `@fusion_rule(...)`; `training()` is what its extra_check may
ask about the compile in progress."""

from __future__ import annotations

import contextvars
import dataclasses
from collections import Counter
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .fusion import Registrar

STAGES = ("pre_autograd", "post_grad")


@dataclasses.dataclass
class Rule:
    name: str
    stage: str
    doc: str
    register: Callable[[Registrar], None]
    order: int = 0  # rules of a higher order run after the lower ones, over their results
    user: bool = False
    # Only where the graph runs op by op (debug.run_eagerly): for a fused op that beats ATen's
    # composition but not the code Inductor generates for it (see rules/transpose.py).
    eager_only: bool = False
    # Off unless named in experimental_config.enabled_patterns: a rewrite that trades something
    # (rules/linear.py: speed for a float32 product's summation order) is the user's choice.
    opt_in: bool = False
    # A rule that rewrites the graph itself instead of matching patterns: graph_pass(gm) makes
    # its rewrites and returns how many (see graph_rule).
    graph_pass: Callable | None = None


_RULES: dict[str, Rule] = {}


def fusion_rule(name: str, *, stage: str, doc: str, order: int = 0, eager_only: bool = False):
    """Decorator for a function that registers the patterns of one named rule."""
    if stage not in STAGES:
        raise ValueError(f"fusion_rule {name!r}: stage must be one of {STAGES}, got {stage!r}")

    def wrap(register: Callable[[Registrar], None]):
        if name in _RULES:
            raise ValueError(f"fusion rule {name!r} is registered twice")
        _RULES[name] = Rule(name, stage, doc, register, order, eager_only=eager_only)
        return register

    return wrap


def graph_rule(name: str, *, stage: str, doc: str, order: int = 0, opt_in: bool = False):
    """Decorator for a rule that is a function over the whole graph, `fn(gm) -> int` (the number
    of rewrites), for decisions a pattern cannot make alone (which buffers are read later).
    Graph rules run after every pattern rule of their stage and after the user's
    post_grad_custom_post_pass, in their order (fusion.apply_graph_rules)."""
    if stage not in STAGES:
        raise ValueError(f"graph_rule {name!r}: stage must be one of {STAGES}, got {stage!r}")

    def wrap(graph_pass: Callable):
        if name in _RULES:
            raise ValueError(f"fusion rule {name!r} is registered twice")
        _RULES[name] = Rule(name, stage, doc, lambda r: None, order, graph_pass=graph_pass,
                            opt_in=opt_in)
        return graph_pass

    return wrap


@dataclasses.dataclass
class _Active:
    disabled: frozenset[str]
    counts: Counter
    training: bool = False  # the graph will be differentiated (see apply_rules)


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("opennpu_fusion",
                                                                         default=None)


def training() -> bool:
    """Whether the graph the rules are running on will be differentiated (for rules whose speed
    differs between inference and training; inside extra_check only)."""
    active = _ACTIVE.get()
    return active is not None and active.training
