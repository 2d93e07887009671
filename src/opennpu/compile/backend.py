"""opennpu's torch.compile backend: pattern fusion, then Inductor (or eager execution).

The pipeline for each graph Dynamo captures:

1. pre_autograd rules (when pattern_fusion_pass is on): the captured graph is traced to
   pre-dispatch ATen on the compile's fake tensors and native op groups are replaced by opennpu's
   fused ops. When nothing matches, Dynamo's own graph goes on unchanged.
2. AOTAutograd builds the functional forward/backward (or inference) graphs; on each, the user's
   post_grad_custom_pre_pass, the post_grad rules (TorchAir's defaults and `register_replacement`
   rules) and post_grad_custom_post_pass run, in that order.
3. Inductor compiles the result (the post_grad rules run as its post_grad_custom_pre_pass; on
   the npu device with the C++ kernels it writes for CPU, see opennpu/npu/_inductor.py), or with
   ``debug.run_eagerly`` the graphs run op by op.

Every compile reports what fused, warm caches included: AOTAutograd's cache and Inductor's FX
graph cache serve a compiled graph without running the passes, so the passes keep a record beside
those caches and a cache-served compile replays it into the counters, the dumps and the log
(pass_record.py). User passes (post_grad_custom_pre_pass / _post_pass) are opaque callables that
must run on every compile, so with either set the two caches are bypassed.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from . import fusion, graph_text
from .config import CompilerConfig
from .pass_record import PassRecord, graph_key

log = logging.getLogger("opennpu.compile")

_graph_ids = itertools.count()


def _fake_inputs(example_inputs: Sequence[Any]):
    """The compile's fake mode and fake copies of `example_inputs` with Dynamo's symbolic sizes."""
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    fake = next((x for x in example_inputs if isinstance(x, FakeTensor)), None)
    if fake is not None:
        return fake.fake_mode, list(example_inputs)
    context = TracingContext.try_get()
    fake_mode = context.fake_mode if context is not None else FakeTensorMode()
    fakes = []
    with fake_mode:
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                symbolic = context.tensor_to_context.get(x) if context is not None else None
                fakes.append(fake_mode.from_tensor(
                    x, symbolic_context=symbolic,
                    source=symbolic.tensor_source if symbolic is not None else None, trace=False))
            else:
                fakes.append(x)
    return fake_mode, fakes


def _specialize_floats() -> None:
    """Keep Python floats (RMSNorm's eps, attention's scale) as graph constants.

    With dynamic=True, Dynamo otherwise turns float attributes into tensor inputs read with
    .item(); a fused op's float argument cannot take such a runtime value, so no rule could fire.
    Specialising floats (the default of torch <= 2.5) costs a recompile only if a float changes.
    This is process-wide, as TorchAir's own patches are, and logged once.
    """
    import torch._dynamo.config as dynamo_config

    if not dynamo_config.specialize_float:
        dynamo_config.specialize_float = True
        log.info("opennpu.compile: torch._dynamo.config.specialize_float set to True so that float "
                 "constants stay matchable by the fusion rules")


def _graph_inputs(gm: torch.fx.GraphModule) -> list[Any]:
    return [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]


def _input_sources(gm: torch.fx.GraphModule) -> list:
    """Where Dynamo took each input of its graph from (None where it did not say)."""
    return [getattr(n.meta.get("grapharg"), "source", None)
            for n in gm.graph.find_nodes(op="placeholder")]


def _parameters_as_constants(gm: torch.fx.GraphModule, example_inputs, sources: list):
    """frozen_parameter: the graph's nn.Parameter inputs become attributes of `gm`, which is how
    Dynamo hands parameters over when Inductor's freezing is on (torch._inductor.config.freezing
    during tracing): Inductor then folds them as constants (weights pre-packed for oneDNN / MKL,
    constant subgraphs evaluated once). Buffers stay inputs: a model may update them between calls.

    Dynamo shares compiled code between modules of one class (regional compilation, a layer
    compiled per instance), so each frozen parameter gets the guard Dynamo itself installs under
    freezing: its identity (ID_MATCH on its source). Another module's parameters then compile
    anew instead of meeting these constants. A parameter whose source Dynamo did not record stays
    an input. Returns the graph, the inputs left and their indices among the original inputs."""
    from torch._dynamo.guards import GuardBuilder, install_guard
    from torch._guards import TracingContext

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    frozen = {i for i, x in enumerate(example_inputs)
              if isinstance(x, torch.nn.Parameter) and i < len(sources) and sources[i] is not None}
    if (len(placeholders) != len(example_inputs) or len(sources) != len(example_inputs)
            or not frozen or TracingContext.try_get() is None):
        return gm, example_inputs, None
    for i in sorted(frozen):
        install_guard(sources[i].make_guard(GuardBuilder.ID_MATCH))
    # A copy: Dynamo reads its own graph's placeholders to decide what it passes at run time.
    gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    kept = []
    for i, (node, x) in enumerate(zip(placeholders, example_inputs)):
        if i not in frozen:
            kept.append(i)
            continue
        name = f"_frozen_param{i}"
        gm.register_parameter(name, x)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(name)
        attr.meta.update(node.meta)
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
    gm.recompile()
    return gm, [example_inputs[i] for i in kept], kept


class NpuBackend:
    """The callable given to torch.compile. `fusions` counts replacements per rule over every graph
    it compiled; `graphs` keeps (phase, graph after fusion) for inspection."""

    def __init__(self, config: CompilerConfig | None = None, decompositions=None):
        self.config = config if config is not None else CompilerConfig()
        self.decompositions = dict(decompositions or {})
        self.fusions: Counter = Counter()
        self.graphs: list[tuple[str, torch.fx.GraphModule]] = []
        self.pass_records: list[PassRecord] = []  # of the Inductor compiles, for cache_compile
        _specialize_floats()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, **kwargs):
        config = self.config.with_options(kwargs.pop("options", None))
        if kwargs:
            raise TypeError(f"opennpu backend: unexpected arguments {sorted(kwargs)}")
        graph_id = next(_graph_ids)
        log.debug("opennpu.compile: graph %d as Dynamo captured it: %s", graph_id, gm.graph)
        if config.debug.graph_dump.type is not None:  # TorchAir's name for the captured graph
            _write_dump(_render(gm, config.debug.graph_dump.type),
                        f"dynamo_original_graph_{graph_id}", config)
        sources = _input_sources(gm)  # before the pre-autograd stage re-traces the graph
        if config.experimental_config.pattern_fusion_pass:
            gm = self._pre_autograd(gm, example_inputs, config, graph_id)
        post_grad = PostGradPasses(config, self, graph_id)
        if config.debug.run_eagerly:
            return self._aot_eager(gm, example_inputs, config, post_grad)

        patches: dict[str, Any] = {"post_grad_custom_pre_pass": post_grad}
        if config.mode in ("reduce-overhead", "npugraph_ex"):
            patches["triton.cudagraphs"] = True
        kept = None
        if config.experimental_config.frozen_parameter and not torch.is_grad_enabled():
            gm, example_inputs, kept = _parameters_as_constants(gm, example_inputs, sources)
            patches["freezing"] = kept is not None
        decompositions = None
        if self.decompositions:
            from torch._inductor.decomposition import select_decomp_table

            decompositions = {**select_decomp_table(), **self.decompositions}
        post_grad.record = PassRecord(graph_key(gm, example_inputs, post_grad.uuid()))
        self.pass_records.append(post_grad.record)
        user_passes = (config.post_grad_custom_pre_pass is not None
                       or config.post_grad_custom_post_pass is not None)
        compiled = _compile_fx(gm, example_inputs, patches, decompositions, caches=not user_passes)
        if not post_grad.record.saw_forward():  # served by a cache: replay what the passes did
            recorded = post_grad.record.load()
            if recorded is not None:
                post_grad.replay(recorded)
            else:
                log.info("opennpu.compile: graph %d came from Inductor's cache without a record of "
                         "its fusions; compiling it again with the caches off", graph_id)
                compiled = _compile_fx(gm, example_inputs, patches, decompositions, caches=False)
        if kept is None:
            return compiled
        return lambda *args: compiled(*[args[i] for i in kept])

    # -- stage 1 -------------------------------------------------------------------------------

    def _pre_autograd(self, gm, example_inputs, config: CompilerConfig, graph_id: int):
        from torch._dispatch.python import enable_python_dispatcher
        from torch.fx.experimental.proxy_tensor import make_fx

        inactive = fusion.inactive_rules(config.experimental_config.disabled_patterns,
                                         config.debug.run_eagerly,
                                         config.experimental_config.enabled_patterns)
        if not any(r.stage == "pre_autograd" and r.name not in inactive for r in fusion.rules()):
            return gm
        try:
            fake_mode, fakes = _fake_inputs(example_inputs)
            with fake_mode, enable_python_dispatcher():
                traced = make_fx(gm, pre_dispatch=True, record_module_stack=True)(*fakes)
        except Exception as error:  # a graph we cannot re-trace still compiles, unfused
            log.warning("opennpu.compile: graph %d could not be traced to pre-dispatch ATen, so "
                        "its native op groups are not fused (%s: %s)", graph_id,
                        type(error).__name__, error)
            return gm
        fusion.remove_noops(traced)
        # AOTAutograd's own test: a backward graph is built when grad mode is on and an input
        # (a parameter, typically) requires grad.
        training = torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
        counts = fusion.apply_rules("pre_autograd", traced,
                                    inactive, training)
        if not counts:
            return gm  # nothing fused: Dynamo's graph goes on as it came
        self._record("pre_autograd", traced, counts, config, graph_id)
        return traced

    # -- eager execution -------------------------------------------------------------------------

    def _aot_eager(self, gm, example_inputs, config: CompilerConfig, post_grad: PostGradPasses):
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified
        from torch._inductor.decomposition import select_decomp_table
        from torch._inductor.fx_passes.post_grad import view_to_reshape

        def compiler(phase: str):
            def compile_graph(graph_module, inputs):
                view_to_reshape(graph_module)
                post_grad.run(graph_module, phase)
                return make_boxed_func(graph_module)

            return compile_graph

        return aot_module_simplified(
            gm, example_inputs,
            fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
            inference_compiler=compiler("inference"),
            decompositions={**select_decomp_table(), **self.decompositions},
            keep_inference_input_mutations=config.experimental_config.keep_inference_input_mutations,
        )

    # -- bookkeeping -----------------------------------------------------------------------------

    def _record(self, phase: str, gm: torch.fx.GraphModule | None, counts: Counter,
                config: CompilerConfig, graph_id: int, texts: dict[str, str] | None = None) -> None:
        """Count, log and dump one graph after fusion; `texts` (the dump formats' renderings)
        stands in for `gm` when a cache-served compile replays its record."""
        self.fusions.update(counts)
        if gm is not None:
            self.graphs.append((phase, gm))
        if counts:
            log.debug("opennpu.compile: graph %d (%s): fused %s", graph_id, phase,
                      ", ".join(f"{name} x{n}" for name, n in sorted(counts.items())))
        kind = config.debug.graph_dump.type
        if kind is not None:
            text = texts[kind] if texts is not None else _render(gm, kind)
            _write_dump(text, f"{phase}_graph_{graph_id}", config)


def _phase_of(gm: torch.fx.GraphModule) -> str:
    """forward or backward, from AOTAutograd's placeholder names (backward graphs take tangents)."""
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    return "backward" if any(n.startswith("tangents") for n in names) else "forward"


_SOURCE_HASH: str | None = None


def _source_hash() -> str:
    """Hash of the sources that shape a compiled graph: the compile package's (rules, passes) and
    the ops package's (the autograd formulas AOTAutograd traces into backward graphs, and the
    fake kernels). Any change to either invalidates cached graphs: AOTAutograd's and Inductor's
    caches key on the graph Dynamo captured, which does not show how a custom op differentiates."""
    global _SOURCE_HASH
    if _SOURCE_HASH is None:
        digest = hashlib.sha256()
        package = Path(__file__).parent.parent
        for path in sorted([*(package / "compile").rglob("*.py"), *(package / "ops").rglob("*.py")]):
            digest.update(path.read_bytes())
        _SOURCE_HASH = digest.hexdigest()
    return _SOURCE_HASH


class PostGradPasses(CustomGraphPass):
    """Stage 2, run by Inductor as post_grad_custom_pre_pass (or by the eager path directly).
    `record` (Inductor path) keeps what the passes did, for compiles the caches serve."""

    def __init__(self, config: CompilerConfig, backend: NpuBackend, graph_id: int):
        self.config, self.backend, self.graph_id = config, backend, graph_id
        self.record: PassRecord | None = None
        self.replayed: set[str] = set()

    def replay(self, recorded: dict[str, dict[str, Any]]) -> None:
        """Report the recorded phases as if the passes had run. A phase compiled later in this
        process anyway (a backward compiled lazily, its FX cache entry missing) is not counted
        twice."""
        for phase, entry in recorded.items():
            self.replayed.add(phase)
            self.backend._record(phase, None, Counter(entry["counts"]), self.config,
                                 self.graph_id, texts=entry)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.run(graph.owning_module, _phase_of(graph.owning_module))

    def run(self, gm: torch.fx.GraphModule, phase: str) -> None:
        config = self.config
        if config.post_grad_custom_pre_pass is not None:
            config.post_grad_custom_pre_pass(gm, _graph_inputs(gm), config)
        counts: Counter = Counter()
        fusing = config.experimental_config.pattern_fusion_pass
        inactive = fusion.inactive_rules(config.experimental_config.disabled_patterns,
                                         config.debug.run_eagerly,
                                         config.experimental_config.enabled_patterns)
        if fusing:
            counts = fusion.apply_rules("post_grad", gm, inactive)
        if config.post_grad_custom_post_pass is not None:
            config.post_grad_custom_post_pass(gm, _graph_inputs(gm), config)
            gm.recompile()
        if fusing:  # last: they decide which buffers may be overwritten, on the final graph
            counts.update(fusion.apply_graph_rules("post_grad", gm, inactive))
        if phase in self.replayed:
            return
        if self.record is not None:
            self.record.add(phase, counts, gm)
        self.backend._record(phase, gm, counts, config, self.graph_id)

    def uuid(self) -> Any:
        user_rules = sorted(r.name for r in fusion.rules() if r.user)
        key = f"{_source_hash()}|{self.config.fingerprint()}|{user_rules}|{torch.__version__}"
        return hashlib.sha256(key.encode()).hexdigest()


def dump_graph(gm: torch.fx.GraphModule, name: str, config: CompilerConfig) -> Path | None:
    """Write `gm` as TorchAir's graph_dump does: {path}/{name}_rank_{r}_pid_{p}_ts_{t}.{type}."""
    kind = config.debug.graph_dump.type
    if kind is None:
        return None
    return _write_dump(_render(gm, kind), name, config)


def _render(gm: torch.fx.GraphModule, kind: str) -> str:
    return graph_text.render(gm, kind)


def _write_dump(text: str, name: str, config: CompilerConfig) -> Path:
    rank = torch.distributed.get_rank() if (torch.distributed.is_available()
                                            and torch.distributed.is_initialized()) else 0
    folder = Path(config.debug.graph_dump.path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}_rank_{rank}_pid_{os.getpid()}_ts_{time.time_ns()}.{config.debug.graph_dump.type}"
    path.write_text(text)
    return path


def _compile_fx(gm, example_inputs, patches: dict[str, Any], decompositions, *, caches: bool):
    """Inductor's compile_fx; with caches=False, without AOTAutograd's and the FX graph cache
    (the generated kernels' own cache still serves: the C++ build is not repeated)."""
    from torch._inductor.compile_fx import compile_fx

    if caches:
        return compile_fx(gm, example_inputs, config_patches=patches, decompositions=decompositions)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        return compile_fx(gm, example_inputs, config_patches={**patches, "fx_graph_cache": False},
                          decompositions=decompositions)


def get_npu_backend(*, compiler_config: CompilerConfig | None = None,
                    custom_decompositions: dict | None = None) -> NpuBackend:
    """A torch.compile backend configured by `compiler_config` (torchair.get_npu_backend)."""
    if compiler_config is not None and not isinstance(compiler_config, CompilerConfig):
        raise TypeError(f"get_npu_backend: compiler_config must be a CompilerConfig, "
                        f"got {type(compiler_config).__name__}")
    return NpuBackend(compiler_config, custom_decompositions)


def opennpu_backend(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """`torch.compile(model, backend="opennpu")`: the backend with the default CompilerConfig."""
    return NpuBackend()(gm, example_inputs, **kwargs)


def compile(model=None, *, config: CompilerConfig | None = None, **torch_compile_kwargs):  # noqa: A001
    """torch.compile(model, backend=get_npu_backend(compiler_config=config), **kwargs)."""
    if "backend" in torch_compile_kwargs:
        raise TypeError("opennpu.compile: the backend is opennpu's; pass `config=` to configure it")
    backend = get_npu_backend(compiler_config=config)
    if model is None:
        return functools.partial(torch.compile, backend=backend, **torch_compile_kwargs)
    return torch.compile(model, backend=backend, **torch_compile_kwargs)
