"""The op census: every operator a program dispatches, counted under a TorchDispatchMode.

A TorchDispatchMode sits below autograd, so it sees exactly the operators that reach the backend:
the ops of the forward pass after CompositeImplicitAutograd ops (aten::linear, aten::dropout ...)
have decomposed, the backward formulas' ops, the optimizer's. Each is keyed by its dispatcher name
(`aten::add.Tensor`, `aten::addmm` for a default overload, `npu::npu_rms_norm`) and counted with
its input signatures (torchair's fx_summary style, `24x: float16(12,1,512,64), float16(64)`), the
phase it ran in and the devices of its tensors.

Ops called by the kernel of a composite op (CompositeExplicitAutograd: aten::t calls transpose,
logcumsumexp calls _logcumsumexp) are counted apart, as `inner` calls, so `calls` stays the
program's own op stream.

The class of the innermost nn.Module a call ran in is counted too (`modules`: LlamaRMSNorm,
Linear ...); backward and optimizer ops run outside any module call.

Phases: `backward` (inside torch.autograd.backward or the autograd engine), `optimizer` (inside
an optimizer's step()), `forward` (inside an nn.Module call), `other` (anything else:
initialisation, inputs, a loss computed outside the model).

Steps: the census counts steps by one event (`step_on`): optimizer.step() calls (every optimizer,
through torch.optim's global step hook), backward() calls (torch.autograd.backward), or calls of an
outermost nn.Module (forward). With `steps=N`, the N-th event raises StopCensus (a BaseException,
so `except Exception` in the script does not swallow it) once that step is complete.

The first call of each outermost nn.Module is kept (module and arguments); the fusion report
(fusion_report.py) re-runs the largest one through graph mode's rules.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PHASES = ("forward", "backward", "optimizer", "other")
STEP_EVENTS = ("optimizer", "backward", "forward")


class StopCensus(BaseException):
    """Raised by the census after its last step; `run_script` and `OpCensus.__exit__` absorb it."""


def op_key(func: torch._ops.OpOverload) -> str:
    """The dispatcher's name of an overload: `aten::add.Tensor`, `aten::addmm` (default)."""
    name = func._schema.name
    overload = func._schema.overload_name
    return f"{name}.{overload}" if overload else name


def _shape(t: torch.Tensor) -> str:
    return "(" + ",".join(str(s) for s in t.shape) + ")"


def describe(value: Any) -> str | None:
    """`float16(12,1,512,64)` for a tensor, `[float32(2,3), float32(3)]` for a tensor list, None
    for anything else (scalars, sizes and flags are not part of a signature)."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{_shape(value)}"
    if isinstance(value, (list, tuple)):
        parts = [describe(v) for v in value]
        parts = [p if p is not None else "None" for p in parts] if any(p for p in parts) else []
        if parts:
            return "[" + ", ".join(parts) + "]"
    return None


def signature(args: tuple, kwargs: dict) -> str:
    """The tensor arguments of one call, in schema order: `float32(4,8), float32(16,8)`."""
    parts = [d for d in (describe(a) for a in (*args, *kwargs.values())) if d is not None]
    return ", ".join(parts) if parts else "-"


@dataclasses.dataclass
class OpRecord:
    """What the census saw of one operator."""

    op: str
    calls: int = 0
    inner: int = 0  # calls made by the kernels of composite ops (with OpCensus(inner=True))
    chains: Counter = dataclasses.field(default_factory=Counter)  # composite ops around them
    modules: Counter = dataclasses.field(default_factory=Counter)  # innermost nn.Module class
    phases: Counter = dataclasses.field(default_factory=Counter)
    signatures: Counter = dataclasses.field(default_factory=Counter)
    dtypes: set = dataclasses.field(default_factory=set)      # of the inputs
    devices: set = dataclasses.field(default_factory=set)     # of inputs and outputs

    def top_signatures(self, n: int = 3) -> list[tuple[int, str]]:
        """The n most frequent signatures, most frequent first (ties by text, so stable)."""
        ranked = sorted(self.signatures.items(), key=lambda item: (-item[1], item[0]))
        return [(count, sig) for sig, count in ranked[:n]]

    def top_modules(self, n: int = 3) -> list[tuple[int, str]]:
        ranked = sorted(self.modules.items(), key=lambda item: (-item[1], item[0]))
        return [(count, name) for name, count in ranked[:n]]

    def phase_text(self) -> str:
        return "+".join(p for p in PHASES if self.phases.get(p))


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class _Mode(TorchDispatchMode):
    def __init__(self, census: OpCensus):
        super().__init__()
        self.census = census
        self.expanding: list = []  # the composite ops whose kernels are running, innermost last

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        census = self.census
        if _number_for_tensor(func, args, kwargs):
            # A composite kernel passed a Python scalar as a "wrapped number" tensor, which
            # reaches a dispatch mode as a Python number; the overload itself rejects a number,
            # so call the op's packet, which picks the Scalar overload (that wraps it again)
            out = func.overloadpacket(*args, **kwargs)
        elif census.inner and func not in self.expanding and _runs_composite(func):
            # The CompositeExplicitAutograd kernel npu would run, with the census still active,
            # so the ops it calls are seen (as inner calls)
            self.expanding.append(func)
            try:
                with self:
                    out = func._op_dk(torch._C.DispatchKey.CompositeExplicitAutograd, *args,
                                      **kwargs)
            finally:
                self.expanding.pop()
        else:
            out = func(*args, **kwargs)
        census._record(func, args, kwargs, out,
                       chain=tuple(op_key(f) for f in self.expanding))
        return out


_NUMBERS = (bool, int, float, complex)


def _number_for_tensor(func, args, kwargs) -> bool:
    """Whether a Python number came for an argument of type Tensor of the schema."""
    for i, arg in enumerate(func._schema.arguments):
        if isinstance(arg.type, torch._C.TensorType):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, _NUMBERS):
                return True
    return False


def _runs_composite(func) -> bool:
    from .support import npu_dispatch

    return npu_dispatch(op_key(func))[0] == "composite"


class OpCensus:
    """Context manager that counts every operator dispatched inside it.

        with opennpu.analyze.OpCensus() as census:
            loss = model(x).sum(); loss.backward(); opt.step()
        print(census.table())
        census.write("report_dir", formats=("csv", "html"))

    `steps`/`step_on`: stop the program after that many steps (see the module docstring).
    `fusion`: keep the first outermost module call for `fusions()` (graph mode's rules).
    `inner`: run the kernels of composite ops (aten::t, _to_copy, logcumsumexp ...) under the
    census too, counting the ops they call as `inner` calls: a composite is only as supported
    as what it calls.
    """

    def __init__(self, *, steps: int | None = None, step_on: str = "optimizer",
                 fusion: bool = True, inner: bool = True, top: int = 3):
        if step_on not in STEP_EVENTS:
            raise ValueError(f"OpCensus: step_on must be one of {STEP_EVENTS}, got {step_on!r}")
        if steps is not None and steps < 1:
            raise ValueError(f"OpCensus: steps must be >= 1, got {steps}")
        self.steps, self.step_on, self.fusion, self.top = steps, step_on, fusion, top
        self.inner = inner
        self.records: dict[str, OpRecord] = {}
        self.steps_done = 0
        self.stopped_early = False
        self.error: str | None = None  # set by run_script when the script failed
        # the first call of each outermost module: id -> (module, args, kwargs, grad_enabled)
        self._root_calls: dict[int, tuple] = {}
        self._fusions: dict = {}  # speed_gates -> FusionReport
        self._in_optimizer = 0
        self._in_backward = 0
        self._module_depth = 0
        self._modules: list[str] = []  # class names of the nn.Module calls in progress
        self._handles: list = []
        self._mode: _Mode | None = None
        self._saved_backward = None
        self._saved_call = None

    # -- recording -------------------------------------------------------------------------------

    def _phase(self) -> str:
        if self._in_backward or torch._C._current_graph_task_id() != -1:
            return "backward"
        if self._in_optimizer:
            return "optimizer"
        return "forward" if self._module_depth else "other"

    def _record(self, func, args, kwargs, out, chain: tuple = ()) -> None:
        inputs = _tensors((args, kwargs))
        if not inputs and not _tensors(out):
            return  # runtime queries (device counts, ...) are not tensor operators
        key = op_key(func)
        record = self.records.get(key)
        if record is None:
            record = self.records[key] = OpRecord(key)
        if chain:
            record.inner += 1
            record.chains[chain] += 1
        else:
            record.calls += 1
            record.phases[self._phase()] += 1
            if self._modules:
                record.modules[self._modules[-1]] += 1
        record.signatures[signature(args, kwargs)] += 1
        for t in inputs:
            record.dtypes.add(str(t.dtype).removeprefix("torch."))
        for t in (*inputs, *_tensors(out)):
            record.devices.add(t.device.type)

    # -- steps -----------------------------------------------------------------------------------

    def _step(self, event: str) -> None:
        if event != self.step_on:
            return
        self.steps_done += 1
        if self.steps is not None and self.steps_done >= self.steps:
            self.stopped_early = True
            raise StopCensus(f"opennpu.analyze: stopped after {self.steps_done} "
                             f"{self.step_on} step(s)")

    def _install_hooks(self) -> None:
        from torch.optim import optimizer

        def step_pre(opt, args, kwargs):
            self._in_optimizer += 1

        def step_post(opt, args, kwargs):
            self._in_optimizer -= 1
            self._step("optimizer")

        # nn.Module.__call__ wrapped (global module hooks receive no keyword arguments, and the
        # root call is kept with its keyword arguments for the fusion report)
        call = self._saved_call = torch.nn.Module.__call__

        def module_call(module, *args, **kwargs):
            if self._module_depth == 0 and self.fusion and id(module) not in self._root_calls \
                    and torch._C._current_graph_task_id() == -1:
                self._root_calls[id(module)] = (module, args, kwargs, torch.is_grad_enabled())
            self._module_depth += 1
            self._modules.append(type(module).__name__)
            try:
                result = call(module, *args, **kwargs)
            finally:
                self._module_depth -= 1
                self._modules.pop()
            if self._module_depth == 0:
                self._step("forward")
            return result

        torch.nn.Module.__call__ = module_call
        self._handles = [
            optimizer.register_optimizer_step_pre_hook(step_pre),
            optimizer.register_optimizer_step_post_hook(step_post),
        ]
        self._saved_backward = torch.autograd.backward

        def backward(*args, **kwargs):
            self._in_backward += 1  # the gradient seeds (ones_like) are backward's too
            try:
                result = self._saved_backward(*args, **kwargs)
            finally:
                self._in_backward -= 1
            self._step("backward")
            return result

        torch.autograd.backward = backward

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._saved_backward is not None:
            torch.autograd.backward = self._saved_backward
            self._saved_backward = None
        if self._saved_call is not None:
            torch.nn.Module.__call__ = self._saved_call
            self._saved_call = None

    # -- context manager -------------------------------------------------------------------------

    def __enter__(self) -> OpCensus:
        import opennpu  # noqa: F401  (the npu device and torch.ops.npu must be registered)

        self._install_hooks()
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, kind, value, traceback) -> bool:
        self._mode.__exit__(kind, value, traceback)
        self._mode = None
        self._remove_hooks()
        return kind is not None and issubclass(kind, StopCensus)

    # -- results ---------------------------------------------------------------------------------

    @property
    def root_call(self) -> tuple | None:
        """The outermost module call the fusion report compiles: of the modules the program
        called outside any other module, the one with the most parameters (the model rather than
        a loss module), at its first call."""
        calls = list(self._root_calls.values())
        if not calls:
            return None
        size = lambda call: sum(p.numel() for p in call[0].parameters())  # noqa: E731
        return max(calls, key=size)  # the first of equals: max keeps the first maximum

    def rows(self):
        """One classified row per operator, sorted by name (support.Row)."""
        from .support import classify

        return [classify(self.records[key], top=self.top) for key in sorted(self.records)]

    def fusions(self, *, speed_gates: bool = False):
        """Graph mode's fusion rules run over the first outermost module call (cached)."""
        if speed_gates not in self._fusions:
            from .fusion_report import match_rules

            self._fusions[speed_gates] = match_rules(self.root_call, speed_gates=speed_gates) \
                if self.root_call is not None else None
        return self._fusions[speed_gates]

    def report(self, directory=None, *, formats=("table",), fusion: bool | None = None) -> str:
        """The terminal table as text; with `directory`, also the files of `formats`
        (csv, html, table -> report.txt). Returns the table."""
        from . import report

        fusions = self.fusions() if (self.fusion if fusion is None else fusion) else None
        return report.write(self, directory, formats=formats, fusions=fusions)

    def table(self) -> str:
        from . import report

        return report.table(self.rows(), self.fusions() if self.fusion else None, census=self)
