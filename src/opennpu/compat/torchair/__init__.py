"""`torchair`, provided by opennpu on machines without Ascend's TorchAir.

The graph-mode names of TorchAir map onto opennpu.compile, so seed 003's snippet runs as written:

    import torchair
    config = torchair.CompilerConfig()
    config.experimental_config.pattern_fusion_pass = False
    npu_backend = torchair.get_npu_backend(compiler_config=config)
    opt_model = torch.compile(model, backend=npu_backend)
"""

from __future__ import annotations

import opennpu
from opennpu.compile import CompilerConfig, get_npu_backend, register_replacement

__version__ = f"{opennpu.__version__}+opennpu"
IS_OPENNPU = True

__all__ = ["CompilerConfig", "get_npu_backend", "register_replacement"]
