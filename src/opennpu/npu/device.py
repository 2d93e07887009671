"""Devices of `torch.npu`: count, selection, names and properties.

The devices are emulated on the host: OPENNPU_DEVICE_COUNT of them (default 8), narrowed by
ASCEND_RT_VISIBLE_DEVICES, each with OPENNPU_DEVICE_MEMORY bytes of capacity (default 64 GiB) and
named after OPENNPU_SOC_NAME (default Ascend910B).
"""

from __future__ import annotations

import os
import re
import uuid
import warnings
from typing import Any

import torch

from . import graphs as _graphs

__all__ = [
    "can_device_access_peer", "current_blas_handle", "current_device", "device", "device_count",
    "device_of",
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
            raise ValueError("Expected a npu device, but got None")
        return current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "npu":
            raise ValueError(f"Expected a npu device, but got: {device}")
        return current_device() if device.index is None else device.index
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    raise TypeError(f"Expected a npu device (int, str or torch.device), but got {device!r}")


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
    the device (and raises while a graph captures, as a capturing stream does)."""
    _checked_index(device)
    _graphs._check_not_capturing("torch.npu.synchronize()")


def _soc_name() -> str:
    return os.environ.get("OPENNPU_SOC_NAME") or _DEFAULT_SOC


def get_device_name(device: Any = None) -> str:
    """The emulated SoC's name (OPENNPU_SOC_NAME, default Ascend910B) followed by a note that the
    device is emulated."""
    _checked_index(device)
    return f"{_soc_name()} (emulated by opennpu on the host CPU)"


class _NPUDeviceProperties:
    """torch_npu's device properties: name, total_memory (the emulated capacity), the core counts
    (here the host's CPU count) and a uuid that is stable for a device index and SoC name.

    The CUDA-only fields that torch_npu also answers with None (major, minor, warp_size, ...) are
    None here too, so code written for torch.cuda's properties can read them."""

    _CUDA_ONLY = ("major", "minor", "is_multi_gpu_board", "is_integrated",
                  "max_threads_per_multi_processor", "warp_size", "regs_per_multiprocessor",
                  "gcnArchName")

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
        self.uuid = uuid.uuid5(uuid.NAMESPACE_URL, f"opennpu:{_soc_name()}:{index}")
        for field in self._CUDA_ONLY:
            setattr(self, field, None)

    def __repr__(self) -> str:
        return (f"_NPUDeviceProperties(name='{self.name}', total_memory="
                f"{self.total_memory // (1024 * 1024)}MB, cube_core_num={self.cube_core_num}, "
                f"vector_core_num={self.vector_core_num}, L2_cache_size={self.L2_cache_size}MB, "
                f"uuid={self.uuid})")


def get_device_properties(device: Any = None) -> _NPUDeviceProperties:
    return _NPUDeviceProperties(_checked_index(device))


_CAPABILITY = re.compile(r"^(\d+)\.(\d+)$")


def get_device_capability(device: Any = None) -> tuple[int, int] | None:
    """CANN has no compute capability. As in torch_npu, the answer is what the environment
    variable TORCH_NPU_DEVICE_CAPABILITY ("major.minor", e.g. "8.0") says, or None (with a
    warning) when it is unset or malformed; `device` is accepted and not used."""
    env = os.environ.get("TORCH_NPU_DEVICE_CAPABILITY")
    if not env:
        warnings.warn("torch.npu.get_device_capability: the npu has no compute capability; set "
                      "TORCH_NPU_DEVICE_CAPABILITY=major.minor to report one for code written "
                      "for torch.cuda", stacklevel=2)
        return None
    match = _CAPABILITY.match(env)
    if match is None:
        warnings.warn(f"torch.npu.get_device_capability can't parse TORCH_NPU_DEVICE_CAPABILITY="
                      f"{env!r}: expected 'major.minor' with non-negative integers, e.g. '8.0'",
                      stacklevel=2)
        return None
    return int(match.group(1)), int(match.group(2))


def can_device_access_peer(device: Any, peer_device: Any) -> bool:
    """Whether `device` can access `peer_device`'s memory directly: every pair of distinct
    emulated devices can (they share host memory); a device is never its own peer. An index
    outside the visible devices is an AssertionError, as in torch_npu and torch.cuda."""
    count = device_count()
    index = _get_device_index(device)
    peer = _get_device_index(peer_device)
    if not 0 <= index < count:
        raise AssertionError(f"Invalid device id {index}: torch.npu.can_device_access_peer "
                             f"expects 0 <= id < {count}")
    if not 0 <= peer < count:
        raise AssertionError(f"Invalid peer device id {peer}: torch.npu.can_device_access_peer "
                             f"expects 0 <= id < {count}")
    return index != peer


def current_blas_handle() -> None:
    """The npu has no BLAS handle: None, with torch_npu's warning."""
    warnings.warn("NPU does not use blas handle.", stacklevel=2)
    return None


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
    if int(debug_mode) not in (0, 1, 2):
        raise RuntimeError("invalid value of debug_mode, expected one of 0,1,2")
    _sync_debug_mode = int(debug_mode)


def get_sync_debug_mode() -> int:
    return _sync_debug_mode


def init() -> None:
    """Initialises the device runtime: from here on the visible devices are fixed.

    Until then (or the first npu allocation or `set_device`), `device_count()` re-reads
    ASCEND_RT_VISIBLE_DEVICES, as torch_npu does.
    """
    _ops._npu_init()


def is_initialized() -> bool:
    return bool(_ops._npu_is_initialized())


def _lazy_init() -> None:
    _ops._npu_init()


def _is_in_bad_fork() -> bool:
    return False


def is_bf16_supported() -> bool:
    return True
