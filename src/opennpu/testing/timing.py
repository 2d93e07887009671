"""Timing helpers shared by the benchmarks (benchmarks/) and the demo (`python -m opennpu demo`).

Method (shared/PERFORMANCE.md): CPU times come from `torch.utils.benchmark.Timer.blocked_autorange`
with the thread count set explicitly, and every speed is also reported as a fraction of the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator

import torch
import torch.utils.benchmark as benchmark


@contextlib.contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """Runs the block with `torch.set_num_threads(threads)`, restoring the previous count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def time_fn(fn: Callable[[], Any], threads: int, min_run_time: float = 0.5) -> dict[str, float]:
    """Times `fn()` on `threads` threads: {"median", "p20", "p80"} in seconds per call."""
    with num_threads(threads):
        timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
        measurement = timer.blocked_autorange(min_run_time=min_run_time)
    times = torch.tensor(measurement.times, dtype=torch.float64)
    return {
        "median": measurement.median,
        "p20": torch.quantile(times, 0.2).item(),
        "p80": torch.quantile(times, 0.8).item(),
    }


def measure_copy_bandwidth(threads: int, nbytes: int = 256 * 2**20,
                           min_run_time: float = 0.5) -> float:
    """The memory roof: GB/s of a large `dst.copy_(src)`, counting the bytes read and written."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), threads, min_run_time)["median"]
    return 2 * nbytes / seconds / 1e9


_compiled: dict[tuple, Callable] = {}


def compiled(fn: Callable, *args: Any, threads: int) -> Callable:
    """`torch.compile(fn, dynamic=False)` for `fn(*args)` on `threads` threads, compiled once per
    (fn, shapes and dtypes of args, threads).

    Inductor bakes its thread count into the C++ kernels it generates (`omp parallel
    num_threads(n)`), ignoring later `torch.set_num_threads` calls, so the count is fixed here.
    Dynamo's recompile limit counts per function and is raised: a sweep over many shapes must not
    fall back to eager silently.
    """
    shapes = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args)
    key = (fn, shapes, threads)
    if key not in _compiled:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 1024)
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4096)
        _compiled[key] = torch.compile(fn, dynamic=False, options={"cpp.threads": threads})
    return _compiled[key]


def autograd_backward(fn: Callable, inputs: tuple[torch.Tensor, ...],
                      grad: torch.Tensor) -> Callable:
    """A call re-running the backward of `fn(*inputs)` on one graph built here, so that only the
    backward is timed. It returns the gradients of all `inputs`."""
    leaves = tuple(t.detach().requires_grad_() for t in inputs)
    with torch.enable_grad():
        out = fn(*leaves)
    return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)


def busy_warning(threshold: float = 0.75) -> str | None:
    """A warning when other work is running (1-minute load average above `threshold`): on a
    2-core machine it takes cores from the timed code and skews multi-threaded timings."""
    load = os.getloadavg()[0]
    if load <= threshold:
        return None
    return (f"warning: load average {load:.1f} on {os.cpu_count()} CPUs before this run; "
            "other work skews these timings")


def has_cpu_kernel(op: str) -> bool:
    """Whether `torch.ops.npu.<op>` is registered with a CPU kernel (schemas may land first)."""
    try:
        getattr(torch.ops.npu, op)
    except (AttributeError, RuntimeError):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"npu::{op}", "CPU")


def _as_list(tensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def max_abs_error(actual, expected) -> float:
    """The largest |actual - expected| over matching tensors (a tensor or a sequence of them)."""
    errors = []
    for a, e in zip(_as_list(actual), _as_list(expected), strict=True):
        dtype = torch.promote_types(torch.promote_types(a.dtype, e.dtype), torch.float32)
        errors.append((a.to(dtype) - e.to(dtype)).abs().max().item())
    return max(errors)
