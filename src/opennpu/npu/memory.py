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
    "caching_allocator_alloc", "caching_allocator_delete", "empty_cache", "get_allocator_backend",
    "get_per_process_memory_fraction", "host_empty_cache", "host_memory_stats",
    "host_memory_stats_as_nested_dict", "max_memory_allocated", "max_memory_cached",
    "max_memory_reserved", "mem_get_info", "memory_allocated", "memory_cached", "memory_reserved",
    "memory_snapshot", "memory_stats", "memory_stats_as_nested_dict", "memory_summary",
    "reset_accumulated_host_memory_stats", "reset_accumulated_memory_stats",
    "reset_max_memory_allocated", "reset_max_memory_cached",
    "reset_peak_host_memory_stats", "reset_peak_memory_stats", "set_per_process_memory_fraction",
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
    """Caps what this process may hold on `device` at `fraction` (a float in [0, 1]) of its
    capacity."""
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`, but got "
                        f"{type(fraction).__name__} (torch.npu.set_per_process_memory_fraction)")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1 "
                         "(torch.npu.set_per_process_memory_fraction)")
    _ops._npu_set_memory_fraction(fraction, _checked_index(device))


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


def host_empty_cache() -> None:
    """Returns the cached blocks of the pinned-memory allocator (`pin_memory()`) to the system."""
    _ops._npu_host_empty_cache()


_HOST_STATS = ("allocations", "allocated_bytes", "active_requests", "active_bytes")
_HOST_METRICS = ("current", "peak", "allocated", "freed")


def host_memory_stats_as_nested_dict() -> dict:
    """The pinned-memory allocator's statistics, nested as torch.cuda's."""
    raw = [int(v) for v in _ops._npu_host_memory_stats()]
    stats: dict = {}
    for i, name in enumerate(_HOST_STATS):
        stats[name] = dict(zip(_HOST_METRICS, raw[4 * i: 4 * i + 4]))
    stats["num_host_alloc"], stats["num_host_free"] = raw[16], raw[17]
    return stats


def host_memory_stats() -> dict[str, int]:
    """The pinned-memory allocator's statistics with torch.cuda.host_memory_stats()'s keys
    ("allocations.current", "allocated_bytes.peak", ..., "num_host_alloc", "num_host_free").

    `allocations` and `allocated_bytes` count blocks held (in use and cached), `active_*` those
    in use; block sizes are rounded up to powers of two. Host timing figures are not kept.
    """
    flat = {}
    for name, value in host_memory_stats_as_nested_dict().items():
        if isinstance(value, dict):
            flat.update({f"{name}.{metric}": v for metric, v in value.items()})
        else:
            flat[name] = value
    return collections.OrderedDict(sorted(flat.items()))


def reset_peak_host_memory_stats() -> None:
    _ops._npu_host_reset_stats(True)


def reset_accumulated_host_memory_stats() -> None:
    _ops._npu_host_reset_stats(False)


def get_allocator_backend() -> str:
    """The npu allocator in use: "native", torch_npu's name for its caching allocator (the only
    allocator opennpu has; NPUPluggableAllocator is not provided)."""
    return "native"


def _format_bytes(n: int) -> str:
    for unit in ("B  ", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 10 * 1024 or unit == "TiB":
            return f"{n:6d} {unit}"
        n //= 1024
    return f"{n:6d} TiB"


def _format_count(n: int) -> str:
    for unit in (" ", "K", "M"):
        if abs(n) < 10 * 1000 or unit == "M":
            return f"{n:7d} {unit} "
        n //= 1000
    return f"{n:7d} M "


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A table of the allocator's statistics for `device` in torch.cuda.memory_summary's layout
    (header "PyTorch NPU memory summary, device ID N", one row per metric with current, peak,
    total allocated and total freed). The allocator does not split blocks or keep pools apart, so
    the table has the "all" rows only."""
    index = _checked_index(device)
    s = memory_stats(index)
    raw = _raw_stats(index)
    bar, thin = "=" * 75, "-" * 75
    rows = [
        bar,
        " {:16} PyTorch NPU memory summary, device ID {:<18d} ".format("", index),
        thin,
        "  {:9} NPU OOMs: {:<13d} | {:6} npuMalloc retries: {:<9d}  ".format(
            "", s["num_ooms"], "", s["num_alloc_retries"]),
        bar,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
        thin,
    ]
    # (label, current, peak, total allocated, total freed, formatter); byte totals are not
    # counted by the allocator, so those cells stay empty rather than show a made-up figure.
    metrics = [
        ("Allocated memory", s["allocated_bytes.all.current"], s["allocated_bytes.all.peak"],
         None, None, _format_bytes),
        ("NPU reserved memory", s["reserved_bytes.all.current"], s["reserved_bytes.all.peak"],
         None, None, _format_bytes),
        ("Allocations", s["allocation.all.current"], s["allocation.all.peak"],
         raw["allocs"], raw["frees"], _format_count),
        ("Active allocs", s["active.all.current"], s["active.all.peak"],
         raw["allocs"], raw["frees"], _format_count),
        ("NPU reserved segments", s["segment.all.current"], s["segment.all.peak"],
         raw["host_allocs"], raw["host_frees"], _format_count),
    ]
    blank = " " * 10
    for label, cur, peak, total, freed, fmt in metrics:
        cells = [fmt(cur), fmt(peak), blank if total is None else fmt(total),
                 blank if freed is None else fmt(freed)]
        rows.append(" {:<21} | {} | {} | {} | {} ".format(label, *cells))
        rows.append(thin)
    rows[-1] = bar
    return "|" + "|\n|".join(rows) + "|\n"
