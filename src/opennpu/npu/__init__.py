"""`torch.npu` (also `torch_npu.npu`): the device module of opennpu's emulated Ascend NPU.

PrivateUse1 is renamed `npu` and this module registered as `torch.npu` when opennpu is imported
(by `import torch_npu`, `import opennpu`, or `import torch` through the backend entry point). Device
memory is host memory and every ATen op runs its CPU kernel on it without copies
(csrc/device/npu_fallback.cpp), so Ascend code runs unchanged on a machine without an accelerator.
"""

from __future__ import annotations

import torch

from . import utils  # noqa: F401  (torch_npu.npu.utils)
from ._not_provided import missing as _missing
from .device import *  # noqa: F401,F403
from .device import __all__ as _device_all
from .device import _get_device_index, _is_in_bad_fork, _lazy_init  # noqa: F401
from .graphs import *  # noqa: F401,F403
from .graphs import __all__ as _graphs_all
from .graphs import _launch_host_func, _subscribe_report, _unsubscribe_report  # noqa: F401
from .memory import *  # noqa: F401,F403
from .memory import __all__ as _memory_all
from .npu_config import *  # noqa: F401,F403  (Ascend-only switches: accepted, no effect here)
from .npu_config import __all__ as _config_all
from .random import *  # noqa: F401,F403
from .random import __all__ as _random_all
from .streams import *  # noqa: F401,F403
from .streams import __all__ as _streams_all
from .tensor_types import *  # noqa: F401,F403
from .tensor_types import __all__ as _tensor_types_all


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes torch.autocast("npu") accepts."""
    return [torch.float16, torch.bfloat16]


def is_autocast_enabled() -> bool:
    """Whether the calling thread is in an enabled torch.autocast("npu") region."""
    return torch.is_autocast_enabled("npu")


def set_autocast_enabled(enabled: bool) -> None:
    torch.set_autocast_enabled("npu", bool(enabled))


def get_autocast_dtype() -> torch.dtype:
    """The dtype torch.autocast("npu") uses when given none (float16 unless set)."""
    return torch.get_autocast_dtype("npu")


def set_autocast_dtype(dtype: torch.dtype) -> None:
    if dtype not in get_amp_supported_dtype():
        raise ValueError(f"torch.npu.set_autocast_dtype: dtype must be one of "
                         f"{get_amp_supported_dtype()}, but got {dtype}")
    torch.set_autocast_dtype("npu", dtype)


def _is_compiled() -> bool:
    return True


def __getattr__(name: str):
    # torch.npu.amp (autocast, GradScaler) imports opennpu.optim and with it torch._dynamo:
    # loaded on first use, so that `import torch` (which loads this module through the backend
    # entry point) stays fast.
    if name == "amp":
        import importlib

        return importlib.import_module(".amp", __name__)
    if name in _INDUCTOR_HOOKS:
        # Inductor's init_backend_registration() looks these up on the PrivateUse1 device module
        # before its first compile; the lookup registers npu's code generator and Dynamo device
        # interface (_inductor.py), so importing torch.npu never imports torch._inductor.
        from . import _inductor

        return getattr(_inductor, _INDUCTOR_HOOKS[name])
    raise _missing("torch.npu", name)


_INDUCTOR_HOOKS = {"Scheduling": "NpuScheduling", "PythonWrapperCodegen": "NpuPythonWrapperCodegen",
                   "CppWrapperCodegen": "NpuCppWrapperCodegen"}


__all__ = ["amp", "get_amp_supported_dtype", "get_autocast_dtype", "is_autocast_enabled",
           "set_autocast_dtype", "set_autocast_enabled", "utils", *_config_all, *_device_all, *_graphs_all,
           *_memory_all, *_random_all, *_streams_all, *_tensor_types_all]
