"""Devices of `torch.npu`: count, selection, names and properties.

The devices are emulated on the host: OPENNPU_DEVICE_COUNT of them (default 8), narrowed by
ASCEND_RT_VISIBLE_DEVICES, each with OPENNPU_DEVICE_MEMORY bytes of capacity (default 64 GiB) and
named after OPENNPU_SOC_NAME (default Ascend910B).
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = [
    "can_device_access_peer", "current_device", "device", "device_count", "device_of",
    "get_device_capability", "get_device_name", "get_device_properties", "get_sync_debug_mode",
    "init", "is_available", "is_bf16_supported", "is_initialized", "set_device",
    "set_sync_debug_mode", "synchronize",
]

_ops = torch.ops.opennpu
_DEFAULT_SOC = "Ascend910B"


def is_available() -> bool:
    """True when at least one npu device is visible (always, unless OPENNPU_DEVICE_COUNT=0 or
    ASCEND_RT_VISIBLE_DEVICES hides them all)."""
    return device_count() > 0


def device_count() -> int:
    return int(_ops._npu_device_count())


def current_device() -> int:
    """The calling thread's current device index."""
    return int(_ops._npu_current_device())


def _get_device_index(device: Any = None, optional: bool = True) -> int:
    """The index of `device`: an int, "npu", "npu:1", a torch.device of type npu, or None (the
    current device)."""
    if device is None:
        if not optional:
            raise ValueError("Expected an npu device, but got None")
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "npu":
            raise ValueError(f"Expected an npu device, but got: {device}")
        return current_device() if device.index is None else device.index
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    raise TypeError(f"Expected an npu device (int, str or torch.device), but got {device!r}")


def _checked_index(device: Any = None) -> int:
    index = _get_device_index(device)
    count = device_count()
    if not 0 <= index < count:
        raise RuntimeError(f"Invalid device index npu:{index}: this process sees {count} npu "
                           "device(s) (OPENNPU_DEVICE_COUNT, ASCEND_RT_VISIBLE_DEVICES)")
    return index


def set_device(device: Any) -> None:
    """Makes `device` (int, "npu:1", torch.device) the current device; a negative index is ignored,
    as in torch.cuda.set_device."""
    index = _get_device_index(device)
    if index >= 0:
        _ops._npu_set_device(index)


class device:
    """Context manager that makes `device` current and restores the previous device on exit."""

    def __init__(self, device: Any):
        self.idx = -1 if device is None else _get_device_index(device)
        self.prev_idx = -1

    def __enter__(self):
        self.prev_idx = current_device()
        if self.idx >= 0 and self.idx != self.prev_idx:
            _ops._npu_set_device(self.idx)
        return self

    def __exit__(self, *exc_info) -> bool:
        if self.idx >= 0 and self.prev_idx != self.idx:
            _ops._npu_set_device(self.prev_idx)
        return False


class device_of(device):
    """Context manager that makes the device of tensor `obj` current (no-op for CPU tensors)."""

    def __init__(self, obj: torch.Tensor):
        super().__init__(obj.get_device() if obj.device.type == "npu" else -1)


def synchronize(device: Any = None) -> None:
    """Waits for the device's work: kernels run synchronously on the host, so this only checks
    the device."""
    _checked_index(device)


def _soc_name() -> str:
    return os.environ.get("OPENNPU_SOC_NAME") or _DEFAULT_SOC


def get_device_name(device: Any = None) -> str:
    """The emulated SoC's name (OPENNPU_SOC_NAME, default Ascend910B) followed by a note that the
    device is emulated."""
    _checked_index(device)
    return f"{_soc_name()} (emulated by opennpu on the host CPU)"


class _NPUDeviceProperties:
    """torch_npu's device properties: name, total_memory (the emulated capacity) and the core
    counts, here the host's CPU count."""

    def __init__(self, index: int):
        cores = os.cpu_count() or 1
        self.name = get_device_name(index)
        self.total_memory = int(_ops._npu_device_capacity(index))
        self.cube_core_num = cores
        self.vector_core_num = cores
        self.multi_processor_count = cores
        self.L2_cache_size = 0
        self.index = index
        self.type = "npu"

    def __repr__(self) -> str:
        return (f"_NPUDeviceProperties(name='{self.name}', total_memory="
                f"{self.total_memory // (1024 * 1024)}MB, cube_core_num={self.cube_core_num}, "
                f"vector_core_num={self.vector_core_num}, L2_cache_size={self.L2_cache_size}MB)")


def get_device_properties(device: Any = None) -> _NPUDeviceProperties:
    return _NPUDeviceProperties(_checked_index(device))


def get_device_capability(device: Any = None) -> None:
    """CANN has no compute capability; torch_npu returns None, and so does this."""
    _checked_index(device)
    return None


def can_device_access_peer(device: Any, peer_device: Any) -> bool:
    """All emulated devices share host memory, so every pair of valid devices can."""
    _checked_index(device)
    _checked_index(peer_device)
    return True


_sync_debug_mode = 0


def set_sync_debug_mode(debug_mode: int | str) -> None:
    """Accepted for compatibility ("default"/0, "warn"/1, "error"/2); work is synchronous on the
    host, so no operation ever synchronizes implicitly and nothing is reported."""
    global _sync_debug_mode
    modes = {"default": 0, "warn": 1, "error": 2}
    if isinstance(debug_mode, str):
        if debug_mode not in modes:
            raise RuntimeError("invalid value of debug_mode, expected one of `default`, `warn`, `error`")
        debug_mode = modes[debug_mode]
    _sync_debug_mode = int(debug_mode)


def get_sync_debug_mode() -> int:
    return _sync_debug_mode


def init() -> None:
    """Initialises the device runtime: nothing to do for the emulated devices."""


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    pass


def _is_in_bad_fork() -> bool:
    return False


def is_bf16_supported() -> bool:
    return True
