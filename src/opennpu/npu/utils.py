"""`torch_npu.npu.utils`: the device helpers torch_npu keeps in this module, here the same
functions as torch.npu's."""

from __future__ import annotations

from ._not_provided import missing
from .device import (_get_device_index, current_device, device, device_of,  # noqa: F401
                     get_sync_debug_mode, is_bf16_supported, set_device, set_sync_debug_mode,
                     synchronize)
from .npu_config import set_compile_mode, set_option  # noqa: F401
from .streams import StreamContext, current_stream, default_stream, set_stream, stream  # noqa: F401

__all__ = ["StreamContext", "current_device", "current_stream", "default_stream", "device",
           "device_of", "get_sync_debug_mode", "is_bf16_supported", "set_device", "set_stream",
           "set_sync_debug_mode", "stream", "synchronize", "is_support_inf_nan"]


def is_support_inf_nan() -> bool:
    """Whether the device computes with IEEE infinities and NaNs (Ascend's INF_NAN mode): the
    host CPU always does."""
    return True


def __getattr__(name: str):
    raise missing("torch_npu.npu.utils", name)
