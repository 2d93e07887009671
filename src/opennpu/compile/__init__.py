"""Graph mode: a torch.compile backend that fuses op groups into opennpu's fused ops.

    import opennpu.compile as oc
    config = oc.CompilerConfig()
    config.experimental_config.pattern_fusion_pass = True      # the default
    model = torch.compile(model, backend=oc.get_npu_backend(compiler_config=config))

The same names are importable as `torchair` (TorchAir's API). See backend.py for the pipeline and
fusion.py for how rules work; the rules themselves live in rules/.
"""

from __future__ import annotations

from torch._inductor.pattern_matcher import Match, fwd_only, joint_fwd_bwd

import sys
import types

from .backend import NpuBackend, compile, dump_graph, get_npu_backend, opennpu_backend
from .config import CompilerConfig
from .fusion import node_targets, rules
from .register import register_replacement
from .rules import rule_names

__all__ = ["CompilerConfig", "Match", "NpuBackend", "compile", "dump_graph", "fwd_only",
           "get_npu_backend", "joint_fwd_bwd", "node_targets", "opennpu_backend",
           "register_replacement", "rule_names", "rules"]


class _CallableModule(types.ModuleType):
    """`opennpu.compile(model, config=...)` works as well as `opennpu.compile.compile(...)`."""

    def __call__(self, model=None, **kwargs):
        return compile(model, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
