"""TorchAir's public API on opennpu's graph mode; `import torchair` re-exports it.

The ten names of torchair.__all__ and the submodules inference, ops, scope, ge and llm_datadist.
What each does here, and which are no-ops or errors, is in docs/torchair_api.md.
"""

from __future__ import annotations

from ..backend import get_npu_backend
from ..config import CompilerConfig
from ..register import register_replacement
from . import ge, inference, llm_datadist, ops, scope
from .compiler import NpuFxCompiler, get_compiler
from .converters import register_fx_node_ge_converter
from .export import dynamo_export
from .hcom import patch_for_hcom
from .logger import EVENT_LEVEL, logger
from .weight_format import npu_format_cast_via_cpu, use_internal_format_weight

__all__ = ["get_compiler", "get_npu_backend", "dynamo_export", "CompilerConfig",
           "use_internal_format_weight", "logger", "register_fx_node_ge_converter",
           "patch_for_hcom", "register_replacement", "npu_format_cast_via_cpu"]
