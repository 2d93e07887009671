"""`torch.npu.amp.autocast` and `custom_fwd` / `custom_bwd` (= `torch_npu.npu.amp.autocast_mode`).

``torch.npu.amp.autocast(...)`` is ``torch.autocast("npu", ...)`` with torch_npu's default dtype,
float16. The cast policy itself is C++ (csrc/device/npu_autocast.cpp): CUDA's op lists, registered
for the npu device's autocast key.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["autocast", "custom_fwd", "custom_bwd"]


class autocast(torch.amp.autocast_mode.autocast):
    """``torch.npu.amp.autocast(enabled=True, dtype=torch.float16, cache_enabled=True)``: see
    :class:`torch.autocast`; equivalent to ``torch.autocast("npu", ...)``."""

    def __init__(self, enabled: bool = True, dtype: torch.dtype = torch.float16,
                 cache_enabled: bool = True) -> None:
        super().__init__("npu", enabled=enabled, dtype=dtype, cache_enabled=cache_enabled)


def custom_fwd(fwd=None, *, cast_inputs: torch.dtype | None = None):
    """``torch.amp.custom_fwd(fwd, device_type="npu", cast_inputs=cast_inputs)``: in an npu
    autocast region, with ``cast_inputs`` the forward's floating-point npu tensors are cast to it
    and the forward runs with autocast off; without, it runs under the caller's autocast state."""
    if fwd is None:
        return functools.partial(custom_fwd, cast_inputs=cast_inputs)
    return torch.amp.custom_fwd(fwd, device_type="npu", cast_inputs=cast_inputs)


def custom_bwd(bwd=None):
    """``torch.amp.custom_bwd(bwd, device_type="npu")``: the backward runs under the autocast state
    its forward ran under."""
    if bwd is None:
        return custom_bwd
    return torch.amp.custom_bwd(bwd, device_type="npu")
