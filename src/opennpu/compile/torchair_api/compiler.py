"""torchair.get_compiler: the graph compiler behind the backend, for a custom backend's AOTAutograd.

TorchAir's get_compiler returns NpuFxCompiler, a callable `(gm, example_inputs)` that a user's
backend hands to `aot_module_simplified` as fw_compiler (or bw_compiler / inference_compiler). It
receives the functional ATen graphs AOTAutograd builds. opennpu's compiler runs on them what the
backend's post-grad stage runs (the user's post_grad_custom_pre_pass, the post_grad fusion rules
with `register_replacement` rules, post_grad_custom_post_pass; counted and dumped as configured),
then runs the graph op by op. It does not hand the graph to Inductor: a user's backend calls
AOTAutograd without Inductor's decompositions, and Inductor cannot lower such graphs
(undecomposed ops such as aten._to_copy trip its lowering); get_npu_backend is the path that
compiles with Inductor.
The pre-autograd rules need Dynamo's graph and so belong to get_npu_backend, not to this compiler.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from ..backend import NpuBackend, PostGradPasses, _phase_of
from ..config import CompilerConfig


class NpuFxCompiler:
    """`compiler(gm, example_inputs)` -> a boxed callable, as AOTAutograd's compilers return.

    `fusions` counts the replacements per rule over every graph it compiled; `graphs` keeps
    (phase, graph after the passes)."""

    def __init__(self, config: CompilerConfig):
        self.config = config
        self._backend = NpuBackend(config)

    @property
    def fusions(self) -> Counter:
        return self._backend.fusions

    @property
    def graphs(self) -> list[tuple[str, torch.fx.GraphModule]]:
        return self._backend.graphs

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]):
        from functorch.compile import make_boxed_func
        from torch._inductor.fx_passes.post_grad import view_to_reshape

        if not isinstance(gm, torch.fx.GraphModule):
            raise TypeError(f"get_compiler: the compiler takes an ATen torch.fx.GraphModule (as "
                            f"AOTAutograd passes to fw_compiler), got {type(gm).__name__}")
        passes = PostGradPasses(self.config, self._backend, next(_ids))
        view_to_reshape(gm)  # the rules match reshapes, as Inductor's post_grad graphs have
        passes.run(gm, _phase_of(gm))
        return make_boxed_func(gm)


def _counter():
    from .. import backend

    # Graph numbers are shared with the backend so dump names never collide.
    while True:
        yield next(backend._graph_ids)


_ids = _counter()


def get_compiler(compiler_config: CompilerConfig | None = None) -> NpuFxCompiler:
    """The ATen-graph compiler configured by `compiler_config` (default: CompilerConfig())."""
    if compiler_config is None:
        compiler_config = CompilerConfig()
    if not isinstance(compiler_config, CompilerConfig):
        raise TypeError(f"get_compiler: compiler_config must be a CompilerConfig, got "
                        f"{type(compiler_config).__name__}")
    return NpuFxCompiler(compiler_config)
