"""Timing helpers shared by the benchmarks (benchmarks/) and the demo (`python -m opennpu demo`).

Method (shared/PERFORMANCE.md): CPU times come from `torch.utils.benchmark.Timer.blocked_autorange`
with the thread count set explicitly, and every speed is also reported as a fraction of the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.benchmark as benchmark


def time_fn(fn: Callable[[], Any], threads: int, min_run_time: float = 0.5) -> dict[str, float]:
    """Times `fn()` on `threads` threads: {"median", "p20", "p80"} in seconds per call."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
        measurement = timer.blocked_autorange(min_run_time=min_run_time)
    finally:
        torch.set_num_threads(previous)
    times = torch.tensor(measurement.times, dtype=torch.float64)
    return {
        "median": measurement.median,
        "p20": torch.quantile(times, 0.2).item(),
        "p80": torch.quantile(times, 0.8).item(),
    }


def measure_copy_bandwidth(threads: int, nbytes: int = 256 * 2**20, min_run_time: float = 0.5) -> float:
    """The memory roof: GB/s of a large `dst.copy_(src)`, counting the bytes read and written."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), threads, min_run_time)["median"]
    return 2 * nbytes / seconds / 1e9


_compiled: dict[tuple, Callable] = {}


def compiled(fn: Callable, *args: Any) -> Callable:
    """`torch.compile(fn, dynamic=False)`, compiled once per (fn, shapes and dtypes of args).

    Each key gets its own compiled wrapper. Dynamo's recompile limit counts per function, so it
    is raised: a benchmark sweeping many shapes must not fall back to eager silently.
    """
    key = (fn, tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args))
    if key not in _compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4096)
        _compiled[key] = torch.compile(fn, dynamic=False)
    return _compiled[key]


def has_cpu_kernel(op: str) -> bool:
    """Whether `torch.ops.npu.<op>` is registered with a CPU kernel (schemas may land first)."""
    try:
        getattr(torch.ops.npu, op)
    except (AttributeError, RuntimeError):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"npu::{op}", "CPU")


def max_abs_error(actual, expected) -> float:
    """The largest |actual - expected| over matching tensors (a tensor or a sequence of them)."""
    def as_list(v):
        return [v] if isinstance(v, torch.Tensor) else list(v)

    errors = []
    for a, e in zip(as_list(actual), as_list(expected), strict=True):
        dtype = torch.promote_types(torch.promote_types(a.dtype, e.dtype), torch.float32)
        errors.append((a.to(dtype) - e.to(dtype)).abs().max().item())
    return max(errors)
