"""Helpers that torch_npu's test files import from `torch_npu.testing.common_utils`."""

from __future__ import annotations

import functools
import itertools
import os
import unittest
from contextlib import contextmanager
from typing import Any, Callable, Iterable

import numpy as np
import torch

__all__ = [
    "PERF_TEST_ENABLE", "SkipIfNoLapack", "SkipIfNotGteCANNVersion", "SupportedDevices",
    "check_operators_in_prof", "create_common_tensor", "create_dtype_tensor", "freeze_rng_state",
    "get_npu_device", "is_iterable", "iter_indices", "set_npu_device",
]

# torch_npu's performance baselines are Ascend timings; opennpu never enables them.
PERF_TEST_ENABLE = False


def get_npu_device() -> str:
    """The device tests run on: "npu:<SET_NPU_DEVICE>" when that variable is set, else "npu:0"."""
    index = os.environ.get("SET_NPU_DEVICE")
    return "npu:0" if index is None else f"npu:{index}"


def set_npu_device() -> str:
    """Makes get_npu_device() the current device and returns it."""
    device = get_npu_device()
    torch.npu.set_device(device)
    return device


@contextmanager
def freeze_rng_state():
    """Restores the CPU generator's state on exit."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


def iter_indices(tensor: torch.Tensor) -> Iterable:
    """Every index of `tensor`: ints for 1-D, tuples above, nothing for 0-D."""
    if tensor.dim() == 0:
        return range(0)
    if tensor.dim() == 1:
        return range(tensor.size(0))
    return itertools.product(*(range(s) for s in tensor.size()))


def is_iterable(obj: Any) -> bool:
    try:
        iter(obj)
    except TypeError:
        return False
    return True


def _to_npu(array: np.ndarray, npu_format: int, device: Any) -> torch.Tensor:
    import torch_npu

    tensor = torch.from_numpy(array).to(device)
    if npu_format != -1:
        tensor = torch_npu.npu_format_cast(tensor, npu_format)
    return tensor


def create_common_tensor(item, minValue, maxValue, device=None):
    """(cpu_tensor, npu_tensor) holding the same values, uniform in [minValue, maxValue).

    `item` is [numpy dtype, npu format (-1: leave as is), shape]; `device` defaults to
    get_npu_device().
    """
    if len(item) != 3:
        raise ValueError("create_common_tensor: item must be [numpy dtype, npu format, shape], "
                         f"got {item!r}")
    dtype, npu_format, shape = item
    values = np.random.uniform(minValue, maxValue, shape).astype(dtype)
    cpu_input = torch.from_numpy(values)
    return cpu_input, _to_npu(values, npu_format, device or get_npu_device())


def create_dtype_tensor(shape, dtype, npu_format=-1, min_value=-5, max_value=5, no_zero=False,
                        device=None):
    """(cpu_tensor, npu_tensor) of torch dtype bool, half, float (uniform) or int32 (integers in
    [min_value, max_value]); `no_zero` replaces zeros by ones."""
    if dtype == torch.bool:
        values = np.random.randint(0, 2, size=shape).astype(bool)
    elif dtype in (torch.half, torch.float):
        np_dtype = np.float16 if dtype == torch.half else np.float32
        values = np.random.uniform(min_value, max_value, shape).astype(np_dtype)
    else:
        values = np.random.randint(min_value, max_value + 1, size=shape).astype(np.int32)
    if no_zero:
        values = np.where(values != 0, values, np.ones_like(values))
    if dtype not in (torch.float, torch.half):
        npu_format = -1  # torch_npu casts the format of floating tensors only
    return torch.from_numpy(values), _to_npu(values, npu_format, device or get_npu_device())


def check_operators_in_prof(expected_operators, prof, unexpected_operators=None) -> bool:
    """True when the profile `prof` ran every name in `expected_operators` (which it empties)
    and none of `unexpected_operators`; names are compared without a "cached_" prefix."""
    unexpected = set(unexpected_operators or [])
    events = prof.key_averages()
    if not events:
        return False
    for event in events:
        name = event.key.replace("cached_", "")
        if name in unexpected:
            return False
        if name in expected_operators:
            expected_operators.remove(name)
    return not expected_operators


def _soc_prefix(name: str) -> str:
    """The SoC part of a device name as torch_npu's gate reads it: 10 characters, 12 for the
    "Ascend910_xxxx" family, 9 for "Ascend950"."""
    prefix = name[:10]
    if prefix == "Ascend910_":
        return name[:12]
    if prefix.startswith("Ascend950"):
        return name[:9]
    return prefix


class SupportedDevices:
    """Decorator: skips the test unless the device's SoC (torch_npu.npu.get_device_name(0),
    OPENNPU_SOC_NAME here) is one of `supported_devices`, e.g. SupportedDevices(["Ascend910B"])."""

    def __init__(self, supported_devices: list[str]):
        if isinstance(supported_devices, str):
            raise TypeError("SupportedDevices: supported_devices must be a list of SoC names, "
                            f"got the string {supported_devices!r}")
        self.supported_devices = list(supported_devices)

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def gated(slf, *args, **kwargs):
            soc = _soc_prefix(torch.npu.get_device_name(0))
            if soc not in self.supported_devices:
                raise unittest.SkipTest(f"Only run on {self.supported_devices!r}, current device "
                                        f"is {soc}.")
            return fn(slf, *args, **kwargs)

        return gated


class SkipIfNotGteCANNVersion:
    """Decorator: torch_npu runs the test only from a given CANN version on. opennpu emulates no
    CANN, so these tests (of CANN features) are skipped, saying so."""

    def __init__(self, base_version: str, module: str = "CANN"):
        self.base_version = base_version
        self.module = module

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def gated(slf, *args, **kwargs):
            raise unittest.SkipTest(f"needs {self.module} >= {self.base_version}; opennpu emulates "
                                    "no CANN version")

        return gated


class SkipIfNoLapack:
    """Decorator: skips the test when PyTorch was built without LAPACK."""

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def gated(*args, **kwargs):
            if not torch._C.has_lapack:
                raise unittest.SkipTest("PyTorch compiled without Lapack")
            return fn(*args, **kwargs)

        return gated
