"""Which of graph mode's fusion rules apply to a model: its fused replacements.

The model's first outermost call (kept by the census) is compiled once with opennpu's own
torch.compile backend, configured to run the captured graphs eagerly (`debug.run_eagerly`, no
Inductor): Dynamo captures the graphs, the pre_autograd and post_grad rules of
opennpu/compile/rules run over them exactly as in `torch.compile(backend="opennpu")`, and the
backend's per-rule counters say how often each rule replaced its pattern. The rules are used
unchanged; the user's module is not modified (torch.compile wraps it) and its result is dropped.

Speed gates: some rules keep small inputs native where the fused op would be slower (inference
below 512 tokens for RMSNorm and rotary, short attention). The report is about the program's
structure, so by default (`speed_gates=False`) those thresholds are set to 0 while it runs; with
`speed_gates=True` the counts are what a compile of this very call would fuse.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

log = logging.getLogger("opennpu.analyze")

# The rules' size thresholds (module, attribute) that `speed_gates=False` sets to 0.
SPEED_GATES = (("opennpu.compile.rules._util", "INFERENCE_MIN_TOKENS"),
               ("opennpu.compile.rules.attention", "SDPA_MIN_KV"),
               ("opennpu.compile.rules.attention", "CHAIN_TRAINING_MIN_KV"))


@dataclasses.dataclass(frozen=True)
class RuleMatch:
    rule: str
    matches: int
    stage: str
    replacement: str  # the fused op(s), from the rule's doc ("... -> npu_rms_norm")
    doc: str
    eager_only: bool

    def advice(self) -> str:
        """`use torch_npu.npu_rms_norm (or compile with backend='opennpu')`; a replacement that
        is no torch_npu API (opennpu::_silu_mul) is reached by graph mode only."""
        how = "compile with backend='opennpu'"
        if self.eager_only:
            how += " and debug.run_eagerly (an eager-only rule)"
        if self.replacement.startswith("npu_"):
            return f"use torch_npu.{self.replacement} (or {how})"
        if self.replacement:
            return f"{how} (fuses into {self.replacement}; no torch_npu API)"
        return how


@dataclasses.dataclass
class FusionReport:
    matches: list[RuleMatch]
    module: str
    error: str | None = None  # why the model could not be compiled, if it could not

    def total(self) -> int:
        return sum(m.matches for m in self.matches)


def replacement_of(doc: str) -> str:
    """The target op named at the end of a rule's doc: `... -> npu_rms_norm` -> `npu_rms_norm`."""
    if "->" not in doc:
        return ""
    target = doc.rsplit("->", 1)[1].strip()
    return target.split(" (", 1)[0].strip().rstrip(".")


@contextlib.contextmanager
def _gates_off(enabled: bool):
    import importlib

    saved = []
    try:
        if not enabled:
            for module_name, attribute in SPEED_GATES:
                module = importlib.import_module(module_name)
                saved.append((module, attribute, getattr(module, attribute)))
                setattr(module, attribute, 0)
        yield
    finally:
        for module, attribute, value in saved:
            setattr(module, attribute, value)


def match_rules(root_call, *, speed_gates: bool = False) -> FusionReport:
    """Compile `root_call` = (module, args, kwargs, grad_enabled) with the opennpu backend in
    eager mode and count each rule's replacements."""
    from opennpu.compile import CompilerConfig, NpuBackend, fusion

    module, args, kwargs, grad_enabled = root_call
    config = CompilerConfig()
    config.debug.run_eagerly = True
    # Graph rules (add_rms_norm_inplace) decide where results are stored, not which ops a model
    # could call instead: not fused replacements, so not reported.
    config.experimental_config.disabled_patterns = [r.name for r in fusion.rules()
                                                    if r.graph_pass is not None]
    backend = NpuBackend(config)
    error = None
    torch._dynamo.reset()
    try:
        with _gates_off(speed_gates), torch.set_grad_enabled(grad_enabled):
            torch.compile(module, backend=backend)(*args, **kwargs)
    except Exception as exc:  # the census stands without the fusion report
        error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        log.warning("opennpu.analyze: the model could not be compiled for the fusion report (%s)",
                    error)
    finally:
        torch._dynamo.reset()
    rules = {r.name: r for r in fusion.rules()}
    matches = [RuleMatch(name, count, rules[name].stage, replacement_of(rules[name].doc),
                         rules[name].doc, rules[name].eager_only)
               for name, count in sorted(backend.fusions.items()) if count and name in rules]
    return FusionReport(matches, type(module).__name__, error)
