"""Memory statistics and control of the npu caching allocator (csrc/device/npu_allocator.cpp),
with torch.cuda's names.

Each device holds host blocks binned by size: `memory_allocated` counts the bytes of live blocks,
`memory_reserved` those of live and cached ones. Outputs that CPU kernels allocate while running
an npu op come from the same pool, so every npu tensor is counted.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

from .device import _checked_index

__all__ = [
    "caching_allocator_alloc", "caching_allocator_delete", "empty_cache",
    "get_per_process_memory_fraction", "max_memory_allocated", "max_memory_cached",
    "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_cached", "memory_reserved",
    "memory_snapshot", "memory_stats", "memory_stats_as_nested_dict", "memory_summary",
    "reset_accumulated_memory_stats", "reset_max_memory_allocated", "reset_max_memory_cached",
    "reset_peak_memory_stats", "set_per_process_memory_fraction",
]

_ops = torch.ops.opennpu
_FIELDS = ("allocated", "allocated_peak", "reserved", "reserved_peak", "blocks", "blocks_peak",
           "segments", "segments_peak", "allocs", "frees", "host_allocs", "host_frees",
           "alloc_retries", "ooms", "adopted")


def _raw_stats(device: Any = None) -> dict[str, int]:
    return dict(zip(_FIELDS, _ops._npu_memory_stats(_checked_index(device))))


def memory_stats(device: Any = None) -> dict[str, int]:
    """torch.cuda.memory_stats's keys that the npu allocator tracks (flat, sorted)."""
    s = _raw_stats(device)
    stats = {
        "allocated_bytes.all.current": s["allocated"],
        "allocated_bytes.all.peak": s["allocated_peak"],
        "active_bytes.all.current": s["allocated"],
        "active_bytes.all.peak": s["allocated_peak"],
        "reserved_bytes.all.current": s["reserved"],
        "reserved_bytes.all.peak": s["reserved_peak"],
        "inactive_split_bytes.all.current": 0,
        "allocation.all.current": s["blocks"],
        "allocation.all.peak": s["blocks_peak"],
        "allocation.all.allocated": s["allocs"],
        "allocation.all.freed": s["frees"],
        "active.all.current": s["blocks"],
        "active.all.peak": s["blocks_peak"],
        "segment.all.current": s["segments"],
        "segment.all.peak": s["segments_peak"],
        "segment.all.allocated": s["host_allocs"],
        "segment.all.freed": s["host_frees"],
        "num_device_alloc": s["host_allocs"],
        "num_device_free": s["host_frees"],
        "num_alloc_retries": s["alloc_retries"],
        "num_ooms": s["ooms"],
        "adopted_bytes.all.current": s["adopted"],
    }
    return collections.OrderedDict(sorted(stats.items()))


def memory_stats_as_nested_dict(device: Any = None) -> dict:
    nested: dict = {}
    for key, value in memory_stats(device).items():
        node = nested
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def memory_allocated(device: Any = None) -> int:
    return _raw_stats(device)["allocated"]


def max_memory_allocated(device: Any = None) -> int:
    return _raw_stats(device)["allocated_peak"]


def memory_reserved(device: Any = None) -> int:
    return _raw_stats(device)["reserved"]


def max_memory_reserved(device: Any = None) -> int:
    return _raw_stats(device)["reserved_peak"]


memory_cached = memory_reserved
max_memory_cached = max_memory_reserved


def reset_peak_memory_stats(device: Any = None) -> None:
    _ops._npu_reset_peak_memory_stats(_checked_index(device))


reset_max_memory_allocated = reset_peak_memory_stats
reset_max_memory_cached = reset_peak_memory_stats


def reset_accumulated_memory_stats(device: Any = None) -> None:
    _ops._npu_reset_accumulated_memory_stats(_checked_index(device))


def empty_cache() -> None:
    """Returns every cached (unused) block of every device to the host."""
    _ops._npu_empty_cache()


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Caps what this process may hold on `device` at `fraction` (0..1) of its capacity."""
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    _ops._npu_set_memory_fraction(float(fraction), _checked_index(device))


def get_per_process_memory_fraction(device: Any = None) -> float:
    return float(_ops._npu_memory_fraction(_checked_index(device)))


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the emulated device: total is its capacity, free what this process
    has not reserved of it."""
    index = _checked_index(device)
    total = int(_ops._npu_device_capacity(index))
    return max(0, total - memory_reserved(index)), total


_raw_blocks: dict[int, torch.Tensor] = {}


def caching_allocator_alloc(size: int, device: Any = None, stream: Any = None) -> int:
    """Allocates `size` bytes from the caching allocator and returns the address."""
    block = torch.empty(int(size), dtype=torch.uint8, device=torch.device("npu", _checked_index(device)))
    _raw_blocks[block.data_ptr()] = block
    return block.data_ptr()


def caching_allocator_delete(mem_ptr: int) -> None:
    if _raw_blocks.pop(int(mem_ptr), None) is None:
        raise RuntimeError(f"caching_allocator_delete: {mem_ptr:#x} was not allocated by "
                           "caching_allocator_alloc")


def memory_snapshot() -> list:
    """The allocator keeps no per-block history; an empty snapshot."""
    return []


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    index = _checked_index(device)
    s = memory_stats(index)

    def mib(n: int) -> str:
        return f"{n / 2**20:12.2f} MiB"

    lines = [
        f"opennpu memory summary, device npu:{index} (capacity {mib(int(_ops._npu_device_capacity(index))).strip()})",
        f"  allocated  current {mib(s['allocated_bytes.all.current'])}   peak {mib(s['allocated_bytes.all.peak'])}",
        f"  reserved   current {mib(s['reserved_bytes.all.current'])}   peak {mib(s['reserved_bytes.all.peak'])}",
        f"  blocks     current {s['allocation.all.current']:12d}       peak {s['allocation.all.peak']:12d}",
        f"  segments   current {s['segment.all.current']:12d}       peak {s['segment.all.peak']:12d}",
        f"  alloc retries {s['num_alloc_retries']}, OOMs {s['num_ooms']}",
    ]
    return "\n".join(lines) + "\n"
