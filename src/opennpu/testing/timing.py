"""Timing helpers shared by the benchmarks (benchmarks/, the demo's op table included).

Method (shared/PERFORMANCE.md): CPU times come from `torch.utils.benchmark.Timer` blocks with the
thread count set explicitly, and every speed is also reported as a fraction of the copy bandwidth
measured in the same run. Functions that are compared are timed in alternation (time_interleaved),
so a drift of the machine's speed (other tenants of the VM, memory bandwidth) moves all of them
alike instead of whichever happened to be timed at the time.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
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


def time_fn(fn: Callable[[], Any], threads: int, min_run_time: float = 0.5,
            min_samples: int = 5) -> dict[str, float]:
    """Times `fn()` on `threads` threads: {"median", "p20", "p80"} in seconds per call, over at
    least `min_samples` blocks (slow calls would otherwise give one sample and no spread)."""
    with num_threads(threads):
        timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
        measurement = timer.blocked_autorange(min_run_time=min_run_time)
        samples = list(measurement.times)
        while len(samples) < min_samples:
            samples += timer.timeit(measurement.number_per_run).times
    return _quantiles(samples)


def _quantiles(samples: list[float]) -> dict[str, float]:
    values, quantiles = (torch.tensor(v, dtype=torch.float64) for v in (samples, [0.5, 0.2, 0.8]))
    median, p20, p80 = torch.quantile(values, quantiles).tolist()
    return {"median": median, "p20": p20, "p80": p80}


def time_interleaved(fns: dict[str, Callable[[], Any]], threads: int, min_run_time: float = 0.5,
                     min_samples: int = 5, block_time: float = 0.02) -> dict[str, dict[str, float]]:
    """Times each of `fns` like time_fn, but in alternation: rounds of one block per function
    (blocks of about `block_time` seconds, the order rotated every round) until every function has
    run `min_run_time` seconds in at least `min_samples` blocks. Returns time_fn's dict per name."""
    names = list(fns)
    with num_threads(threads):
        number = {}
        for n in names:
            start = time.perf_counter()
            fns[n]()
            number[n] = max(1, int(block_time / max(time.perf_counter() - start, 1e-9)))
        samples: dict[str, list[float]] = {n: [] for n in names}
        spent = dict.fromkeys(names, 0.0)
        rounds = 0
        while any(spent[n] < min_run_time or len(samples[n]) < min_samples for n in names):
            shift = rounds % len(names)
            for n in names[shift:] + names[:shift]:
                fn, start = fns[n], time.perf_counter()
                for _ in range(number[n]):
                    fn()
                per_call = (time.perf_counter() - start) / number[n]
                samples[n].append(per_call)
                spent[n] += per_call * number[n]
            rounds += 1
    return {n: _quantiles(samples[n]) for n in names}


def measure_copy_bandwidth(threads: int, nbytes: int = 256 * 2**20,
                           min_run_time: float = 0.5) -> float:
    """The memory roof: GB/s of a large `dst.copy_(src)`, counting the bytes read and written."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), threads, min_run_time)["median"]
    return 2 * nbytes / seconds / 1e9


def measure_roofs(threads: int, nbytes: int = 256 * 2**20,
                  min_run_time: float = 0.5) -> dict[str, float]:
    """Both memory roofs, timed in alternation, in GB/s counting the bytes read and written once:
    "copy", a large `dst.copy_(src)` (ordinary stores: every written line is read first, its
    read-for-ownership, so 3 bytes move per 2 counted), and "stream", the same copy with
    non-temporal stores (torch.ops.opennpu._stream_copy_: no read-for-ownership). An op that
    streams its outputs can pass 100% of "copy"; "stream" is the roof it can reach."""
    src = torch.ones(nbytes // 4)
    dst, dst_stream = torch.empty_like(src), torch.empty_like(src)
    dst_stream.copy_(src)  # map the pages first, as dst's first timed call does
    stream_copy = torch.ops.opennpu._stream_copy_
    times = time_interleaved({"copy": lambda: dst.copy_(src),
                              "stream": lambda: stream_copy(dst_stream, src)},
                             threads, min_run_time)
    return {name: 2 * nbytes / t["median"] / 1e9 for name, t in times.items()}


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
                      grad: torch.Tensor, wrt: tuple[bool, ...] | None = None) -> Callable:
    """A call re-running the backward of `fn(*inputs)` on one graph built here, so that only the
    backward is timed. It returns the gradients of the `inputs` marked in `wrt` (default: all);
    the others are constants of the graph."""
    wrt = wrt if wrt is not None else (True,) * len(inputs)
    leaves = tuple(t.detach().requires_grad_(w) for t, w in zip(inputs, wrt))
    with torch.enable_grad():
        out = fn(*leaves)
    wanted = tuple(t for t, w in zip(leaves, wrt) if w)
    return lambda: torch.autograd.grad(out, wanted, grad, retain_graph=True)


def reuse_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for reuse instead of handing large blocks back to
    the OS, so an op's output is not page-faulted in afresh on every timed call.

    On these VMs faulting in a fresh output costs more than the op itself (about 25 ms per
    64 MB, against 5 ms to copy it), for ours and every baseline alike. PyTorch's CPU tuning
    guides get the same steady state from jemalloc or tcmalloc. Affects later allocations only;
    returns False where it could not be applied.
    """
    m_trim_threshold, m_mmap_max = -1, -4  # mallopt parameters from glibc's malloc.h
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def busy_warning(samples: int = 20, interval: float = 0.05) -> str | None:
    """A warning when other processes are running now: on a 2-core machine they take cores from
    the timed code and skew multi-threaded timings badly. Samples the runnable-task count of
    /proc/loadavg (Linux; elsewhere returns None)."""
    others = 0
    try:
        for _ in range(samples):
            with open("/proc/loadavg") as f:
                others += int(f.read().split()[3].split("/")[0]) - 1  # minus this process
            time.sleep(interval)
    except OSError:
        return None
    if others / samples < 0.5:
        return None
    return (f"warning: on average {others / samples:.1f} other tasks were running on "
            f"{os.cpu_count()} CPUs when this run started; they skew these timings")


def has_cpu_kernel(op: str) -> bool:
    """Whether `torch.ops.npu.<op>` (or `ns::op`, e.g. "atb::_npu_paged_attention") is
    registered with a CPU kernel (schemas may land first)."""
    ns, _, name = op.rpartition("::")
    ns = ns or "npu"
    try:
        getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{ns}::{name}", "CPU")


def _as_list(tensors) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def max_abs_error(actual, expected) -> float:
    """The largest |actual - expected| over matching tensors (a tensor or a sequence of them);
    equal values, infinities included (a filter's -inf), differ by 0."""
    errors = []
    for a, e in zip(_as_list(actual), _as_list(expected), strict=True):
        dtype = torch.promote_types(torch.promote_types(a.dtype, e.dtype), torch.float32)
        a, e = a.to(dtype), e.to(dtype)
        errors.append(torch.where(a == e, 0, a - e).abs().max().item())
    return max(errors)
