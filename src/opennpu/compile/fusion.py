"""The fusion rules and the two graphs they run on.

A rule replaces a group of ops by a fused op through torch._inductor.pattern_matcher: the search
function is traced into a pattern, matches are re-checked against the real shapes, then
`extra_check` decides (dtypes, sizes) and the replacement function is traced in place.

Rules run at one of two stages:

- ``pre_autograd``: the graph Dynamo captured, traced to pre-dispatch ATen (high-level ops such as
  aten.linear, aten.softmax and aten.to survive; x.float() and x.to(torch.float32) are the same
  node), before AOTAutograd. The fused ops brought in here carry their own autograd formulas, so
  training differentiates through them: this is where native PyTorch code (RMSNorm, SwiGLU, rotary
  embedding, attention...) becomes opennpu ops.
- ``post_grad``: the functional ATen graphs AOTAutograd hands to the compiler (forward, backward,
  inference), as TorchAir does. Its default rules and the user rules of `register_replacement`
  run here. Views are reshapes at this point (Inductor rewrites them before its passes, and the
  eager path does the same), so patterns traced here get the same rewrite.

Rules are registered lazily on the first compile, once per process. Each rule can be switched off
by name (`experimental_config.disabled_patterns`), and every replacement is counted per rule.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import Counter
from typing import Any, Callable, Iterable

import torch
from torch._inductor import pattern_matcher as pm

from .rule_registry import _ACTIVE, _RULES, Rule, _Active

log = logging.getLogger("opennpu.compile")

def rules() -> list[Rule]:
    from . import rules as _  # noqa: F401  (importing the package registers the built-in rules)

    return list(_RULES.values())


# --- tracing ----------------------------------------------------------------------------------


def remove_noop_casts(gm: torch.fx.GraphModule) -> None:
    """Drop aten.to / aten.type_as nodes that keep the dtype (x.float() on an fp32 x).

    Eagerly these return x itself, so the node is an alias; left in, it hides x's other uses
    from the patterns (fp32 RMSNorm's residual reads x through the `to` node) and makes fp32
    traces differ from fp16/bf16 ones.
    """
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.to.dtype, aten.type_as.default):
            continue
        if node.kwargs.get("copy") or (node.target is aten.to.dtype and len(node.args) > 3
                                       and node.args[3]):
            continue
        source = node.args[0]
        before, after = source.meta.get("val"), node.meta.get("val")
        if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) \
                and before.dtype == after.dtype:
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)


def _is_fresh(node) -> bool:
    """node's value is a new tensor that nothing else reads: a non-view, non-mutating ATen op
    whose only user is the one asking (so mutating it in place is invisible elsewhere)."""
    target = getattr(node, "target", None)
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and not target.is_view and not target._schema.is_mutable and len(node.users) == 1)


def _constant_scalar(gm: torch.fx.GraphModule, node):
    """The value of a 0-dim constant tensor node (torch.tensor(-inf) in user code becomes
    lift_fresh_copy(get_attr), possibly detached), or None."""
    aten = torch.ops.aten
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in (
            aten.lift_fresh_copy.default, aten.detach_.default, aten.detach.default,
            aten.clone.default):
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex() \
                and value.device.type != "meta" and not isinstance(
                    value, torch._subclasses.fake_tensor.FakeTensor):
            return value.item()
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and \
            node.target is aten.scalar_tensor.default:
        return node.args[0]
    return None


def canonicalize_masked_fill(gm: torch.fx.GraphModule) -> None:
    """x.masked_fill_(mask, v) on a fresh intermediate -> x.masked_fill(mask, v), and a 0-dim
    constant tensor v -> the Python scalar (seed 000 writes qk.masked_fill_(mask,
    torch.tensor(-inf))). Both are exact: nothing else sees x, and masked_fill casts a 0-dim v to
    x's dtype just as it does a scalar. Patterns then need only masked_fill.Scalar."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (
                aten.masked_fill_.Tensor, aten.masked_fill_.Scalar,
                aten.masked_fill.Tensor):
            continue
        x, mask, value = node.args[:3]
        if node.target is aten.masked_fill.Tensor or node.target is aten.masked_fill_.Tensor:
            value = _constant_scalar(gm, value)
            if value is None:
                continue
        if node.target is not aten.masked_fill.Tensor and not _is_fresh(x):
            continue
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(aten.masked_fill.Scalar, (x, mask, value))
        new.meta = dict(node.meta)
        constant = node.args[2]
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        _erase_dead_constant(gm, constant)


def _erase_dead_constant(gm: torch.fx.GraphModule, node) -> None:
    """Erase a constant's now-unused lift_fresh_copy / detach_ chain. Left in, its in-place
    detach_ would start a new mutation region, and the pattern matcher never matches across one."""
    aten = torch.ops.aten
    chain = []
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in (
            aten.lift_fresh_copy.default, aten.detach_.default, aten.detach.default):
        chain.append(node)
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
        return
    chain.append(node)
    # The users of the chain: detach_ returns its input, so it may be the chain's only user.
    for n in list(chain):
        for user in list(n.users):
            if user.op == "call_function" and user.target is aten.detach_.default \
                    and not user.users and user not in chain:
                gm.graph.erase_node(user)
    for n in chain:
        if not n.users:
            gm.graph.erase_node(n)


def remove_noop_dropout(gm: torch.fx.GraphModule) -> None:
    """Drop aten.dropout nodes that are the identity (p = 0, or train=False: eval mode).

    transformers' eager attention always calls dropout(p=attention_dropout, training=...); at
    p = 0 or in eval mode it returns its input, and left in the graph it would hide the chain
    from the attention patterns. A dropout that drops stays, and blocks those patterns.
    """
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.dropout.default:
            continue
        x, p, train = node.args[:3]
        if isinstance(p, (int, float)) and isinstance(train, bool) and (p == 0 or not train):
            node.replace_all_uses_with(x)
            gm.graph.erase_node(node)


def remove_noops(gm: torch.fx.GraphModule) -> None:
    """The canonicalisations run before the pre_autograd rules (all exact)."""
    remove_noop_casts(gm)
    remove_noop_dropout(gm)
    canonicalize_masked_fill(gm)
    gm.recompile()


def pre_autograd_trace(fn: Callable, args: Iterable[Any]) -> torch.fx.GraphModule:
    """Pre-dispatch ATen graph of `fn`, no-op casts removed: the IR of the pre_autograd stage."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx.experimental.proxy_tensor import make_fx

    with enable_python_dispatcher():
        gm = make_fx(fn, pre_dispatch=True)(*args)
    remove_noops(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def post_grad_trace(fn: Callable, args: Iterable[Any], *, base=pm.fwd_only) -> torch.fx.GraphModule:
    """`base` (fwd_only by default) followed by the view -> reshape rewrite of the post_grad graphs."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    gm = base(fn, args)
    view_to_reshape(gm)
    gm.recompile()
    return gm


# --- registration -----------------------------------------------------------------------------


def _gated(rule_name: str, extra_check: Callable[[pm.Match], bool]) -> Callable[[pm.Match], bool]:
    """extra_check plus the rule's on/off switch; a match that passes is counted for the rule."""

    def check(match: pm.Match) -> bool:
        active = _ACTIVE.get()
        if active is None or rule_name in active.disabled:
            return False
        if not extra_check(match):
            return False
        active.counts[rule_name] += 1
        return True

    return check


def _always(match: pm.Match) -> bool:
    return True


_PASSES: dict[tuple[str, int], pm.PatternMatcherPass] = {}


def _pass_for(stage: str, order: int) -> pm.PatternMatcherPass:
    key = (stage, order)
    if key not in _PASSES:
        _PASSES[key] = pm.PatternMatcherPass(pass_name=f"opennpu_{stage}_{order}")
    return _PASSES[key]


class Registrar:
    """What a rule's register function receives: `replacement(...)` adds one pattern variant."""

    def __init__(self, rule: Rule):
        self.rule = rule
        self.variants = 0

    def replacement(self, search_fn, replace_fn, example_inputs, *, extra_check=_always,
                    trace_fn=None, scalar_workaround=None, search_fn_pattern=None,
                    generic_sizes: bool = False, skip_duplicates: bool = True) -> None:
        """One pattern variant. `generic_sizes`: the traced pattern's int and list arguments (view
        sizes, dims) stay wildcards instead of being re-traced with the matched shapes, which
        fails under dynamic shapes (TorchAir f2f29ebf); `extra_check` must then verify them."""
        rule = self.rule
        if trace_fn is None:
            trace_fn = pre_autograd_trace if rule.stage == "pre_autograd" else post_grad_trace
        if generic_sizes:
            search_fn_pattern = pm.gen_pattern(search_fn, list(example_inputs), trace_fn,
                                               scalar_workaround)
        kwargs = {}
        if search_fn_pattern is not None:
            kwargs["search_fn_pattern"] = search_fn_pattern
        pm.register_replacement(
            search_fn, replace_fn, list(example_inputs), trace_fn,
            pass_dicts=_pass_for(rule.stage, rule.order),
            extra_check=_gated(rule.name, extra_check),
            scalar_workaround=scalar_workaround,
            skip_duplicates=skip_duplicates,
            **kwargs,
        )
        self.variants += 1


@contextlib.contextmanager
def _registration_context():
    """Patterns are traced outside the compile in progress, on fake tensors of their own."""
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

    with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode():
        yield


_registered: set[str] = set()


def ensure_registered() -> None:
    """Trace every rule's patterns once per process (the first compile pays for it)."""
    pending = [r for r in rules() if r.name not in _registered]
    if not pending:
        return
    with _registration_context():
        for rule in pending:
            registrar = Registrar(rule)
            rule.register(registrar)
            _registered.add(rule.name)
            log.debug("opennpu.compile: rule %s registered with %d pattern variants",
                      rule.name, registrar.variants)


def register_user_rule(name: str, search_fn, replace_fn, example_inputs, *, trace_fn,
                       extra_check, search_fn_pattern, scalar_workaround,
                       skip_duplicates) -> None:
    """A `register_replacement` rule: post_grad stage, traced now with the caller's trace_fn."""
    if name in _RULES and not _RULES[name].user:
        raise ValueError(f"register_replacement: {name!r} is the name of a built-in rule")
    rule = _RULES.get(name) or Rule(name, "post_grad", "user rule", lambda r: None, user=True)
    _RULES[name] = rule
    _registered.add(name)
    Registrar(rule).replacement(
        search_fn, replace_fn, example_inputs, extra_check=extra_check,
        trace_fn=functools.partial(post_grad_trace, base=trace_fn),
        scalar_workaround=scalar_workaround, search_fn_pattern=search_fn_pattern,
        skip_duplicates=skip_duplicates)


# --- application ------------------------------------------------------------------------------


def inactive_rules(disabled: Iterable[str], run_eagerly: bool,
                   enabled: Iterable[str] = ()) -> frozenset[str]:
    """The rules a compile leaves out: those disabled by name, the opt-in rules not enabled by
    name, and the eager-only rules when Inductor compiles the graphs."""
    enabled = set(enabled)
    off = set(disabled)
    off.update(r.name for r in rules() if r.opt_in and r.name not in enabled)
    if not run_eagerly:
        off.update(r.name for r in rules() if r.eager_only)
    return frozenset(off)


def apply_rules(stage: str, gm: torch.fx.GraphModule, disabled: Iterable[str] = (),
                training: bool = False) -> Counter:
    """Run the rules of `stage` over `gm` in their order; returns replacements per rule."""
    ensure_registered()
    counts: Counter = Counter()
    token = _ACTIVE.set(_Active(frozenset(disabled), counts, training))
    try:
        for order in sorted(order for (s, order) in _PASSES if s == stage):
            _PASSES[(stage, order)].apply(gm)
    finally:
        _ACTIVE.reset(token)
    if counts:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return counts


def apply_graph_rules(stage: str, gm: torch.fx.GraphModule, disabled: Iterable[str] = ()) -> Counter:
    """Run the graph rules of `stage` (rule_registry.graph_rule) over `gm`, in their order, after
    its pattern rules; returns rewrites per rule."""
    counts: Counter = Counter()
    for rule in sorted((r for r in rules() if r.stage == stage and r.graph_pass is not None
                        and r.name not in disabled), key=lambda r: r.order):
        n = rule.graph_pass(gm)
        if n:
            counts[rule.name] += n
    if counts:
        gm.recompile()
    return counts


def node_targets(gm: torch.fx.GraphModule) -> Counter:
    """How many call_function nodes each op has in `gm` (used by reports and tests)."""
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
