"""`torchair`, provided by opennpu on machines without Ascend's TorchAir.

TorchAir's whole public surface maps onto opennpu.compile (opennpu.compile.torchair_api): the
ten names of its __all__ and the submodules inference, ops, scope, ge and llm_datadist, plus
torchair.configs.compiler_config and torchair.core.utils for the imports TorchAir's documentation
uses. docs/torchair_api.md says what each does here. Seed 003's snippet runs as written:

    import torchair
    config = torchair.CompilerConfig()
    config.experimental_config.pattern_fusion_pass = False
    npu_backend = torchair.get_npu_backend(compiler_config=config)
    opt_model = torch.compile(model, backend=npu_backend)
"""

from __future__ import annotations

import opennpu
from opennpu.compile.torchair_api import (CompilerConfig, dynamo_export, get_compiler,
                                          get_npu_backend, logger, npu_format_cast_via_cpu,
                                          patch_for_hcom, register_fx_node_ge_converter,
                                          register_replacement, use_internal_format_weight)

from . import configs, core, ge, inference, llm_datadist, ops, scope

__version__ = f"{opennpu.__version__}+opennpu"
IS_OPENNPU = True

__all__ = ["get_compiler", "get_npu_backend", "dynamo_export", "CompilerConfig",
           "use_internal_format_weight", "logger", "register_fx_node_ge_converter",
           "patch_for_hcom", "register_replacement", "npu_format_cast_via_cpu"]
