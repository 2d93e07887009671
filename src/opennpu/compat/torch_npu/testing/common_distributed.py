"""`torch_npu.testing.common_distributed`: the multi-device gates and process-group setup of
torch_npu's distributed tests. The `hccl` backend is whatever opennpu.distributed registers;
without it, init_pg fails with torch.distributed's error naming the backend."""

from __future__ import annotations

import functools
import unittest
from collections import namedtuple

import torch
import torch.distributed as dist

__all__ = ["TEST_SKIPS", "init_pg", "skipIfUnsupportMultiNPU", "with_comms"]

TestSkip = namedtuple("TestSkip", "exit_code, message")
TEST_SKIPS = {
    "multi-npu": TestSkip(75, "Multi-NPU condition not satisfied"),
    **{f"multi-npu-{n}": TestSkip(75, f"Need at least {n} ASCEND devices") for n in range(1, 9)},
    "hccl": TestSkip(76, "c10d not compiled with HCCL support"),
    "known_issues": TestSkip(77, "Test skipped due to known issues"),
}


def _enough_devices(count: int) -> bool:
    return torch.npu.is_available() and torch.npu.device_count() >= count


def skipIfUnsupportMultiNPU(npu_number_needed: int):
    """Decorator: skips the test unless at least `npu_number_needed` npu devices are visible."""

    def decorate(fn):
        @functools.wraps(fn)
        def gated(self, *args, **kwargs):
            if not _enough_devices(npu_number_needed):
                raise unittest.SkipTest(f"Multi-NPU {npu_number_needed} condition not satisfied")
            return fn(self, *args, **kwargs)

        return gated

    return decorate


def init_pg(backend: str = "hccl", world_size: int = 1, rank: int = 0,
            file_name: str = "file://") -> None:
    """Initialises the default process group over a file store; for hccl also makes npu:<rank>
    the current device."""
    if backend not in ("hccl", "gloo"):
        raise RuntimeError(f"init_pg: backend {backend!r} not supported (hccl or gloo)")
    if backend == "hccl" and not _enough_devices(world_size):
        raise RuntimeError(TEST_SKIPS[f"multi-npu-{world_size}"].message)
    dist.init_process_group(backend=backend, world_size=world_size, rank=rank,
                            init_method=f"file://{file_name}")
    if backend == "hccl":
        torch.npu.set_device(rank)


def with_comms(fn):
    """Decorator for MultiProcessTestCase methods: runs the test inside a process group (hccl
    when enough npu devices are visible, else gloo) and destroys it afterwards."""
    if fn is None:
        raise RuntimeError("with_comms: the test function is None")

    @functools.wraps(fn)
    def wrapped(self, *args, **kwargs):
        backend = "hccl" if _enough_devices(self.world_size) else "gloo"
        init_pg(backend=backend, world_size=self.world_size, rank=self.rank,
                file_name=self.file_name)
        torch.npu.manual_seed(0)
        fn(self, *args, **kwargs)
        self.destroy_pg()

    return wrapped
