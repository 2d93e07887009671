"""`torch_npu.npu.utils`: torch_npu keeps its device functions in this module and re-exports them
from torch_npu.npu; code that imports them from here finds the same functions."""

from __future__ import annotations

from ._not_provided import missing
from .device import *  # noqa: F401,F403
from .device import __all__ as _device_all
from .device import _get_device_index, _lazy_init  # noqa: F401
from .memory import mem_get_info  # noqa: F401
from .npu_config import set_compile_mode, set_option  # noqa: F401
from .streams import *  # noqa: F401,F403
from .streams import __all__ as _streams_all

__all__ = [*_device_all, *_streams_all, "is_support_inf_nan", "mem_get_info", "set_compile_mode",
           "set_option"]


def is_support_inf_nan() -> bool:
    """Whether the device computes with IEEE infinities and NaNs (Ascend's INF_NAN mode): the
    host CPU always does."""
    return True


def __getattr__(name: str):
    raise missing("torch_npu.npu.utils", name)
