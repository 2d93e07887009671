"""opennpu: an open implementation of the torch_npu fused-operator system on CPUs and GPUs.

Importing opennpu registers the ``torch.ops.npu`` operators (C++ kernels, fake kernels, autograd)
and exposes them as ``opennpu.<name>``, and registers the emulated ``npu`` device (``torch.npu``); ``import torch_npu`` maps the Ascend names onto them when
the real torch_npu is not installed.
"""

from __future__ import annotations

import os
import warnings

import torch  # noqa: F401  (the operator library links against the loaded torch)

from . import _library

try:
    import _opennpu_compat
except ImportError:  # running from a source tree without the installed import hook
    _opennpu_compat = None

_REAL_TORCH_NPU = _opennpu_compat.real_package_origin("torch_npu") if _opennpu_compat else None
if _REAL_TORCH_NPU is not None:
    warnings.warn(
        f"opennpu: Ascend's torch_npu is installed ({_REAL_TORCH_NPU}), so `import torch_npu` "
        "loads it and opennpu's torch_npu compatibility names stay inactive; opennpu's ops are "
        "available as opennpu.<name>.",
        stacklevel=2,
    )

_library.load(conflicting_package=_REAL_TORCH_NPU)

from . import _device  # noqa: E402

from . import distributed  # noqa: E402

# The `npu` device (torch.npu, Tensor.npu(), "npu:0") and torch.distributed's `hccl` backend for
# npu tensors; not where a CUDA GPU is visible, unless asked (see _device.py). TORCH_TRANSFER_TO_NPU
# (run CUDA code on npu, below) asks for it, torch_npu included.
if os.environ.get("TORCH_TRANSFER_TO_NPU", "0") != "0":
    _device.ask_for_npu()
if _device.register():
    distributed.register()

# opennpu.optim (and torch.npu.amp) import torch._dynamo (torch.compiler.disable), seconds of work
# that `import torch` would pay through the backend autoload: they load on first use.
from . import npu, ops  # noqa: E402
from ._library import cpu_isa, half_gemm  # noqa: E402
from ._strict import is_strict, set_strict, strict  # noqa: E402
from .ops import *  # noqa: E402,F401,F403

__version__ = "0.1.0"


def __getattr__(name: str):
    # opennpu.compile (graph mode) imports torch._inductor, opennpu.optim torch._dynamo,
    # opennpu.analyze either on use: they load on first use only.
    if name in ("analyze", "compile", "optim"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'opennpu' has no attribute {name!r}")

__all__ = ["cpu_isa", "half_gemm", "is_strict", "set_strict", "strict", *ops.__all__]

# TORCH_TRANSFER_TO_NPU=1 migrates CUDA code at run time as soon as opennpu loads (import torch,
# import torch_npu), as torch_npu does; other values than 0 and 1 are a ValueError. The patcher
# is imported only then: `import torch` stays as fast without it.
if os.environ.get("TORCH_TRANSFER_TO_NPU", "0") != "0":
    from .migrate import transfer as _transfer

    _transfer.enable_from_env()
