"""`torch_npu.utils.set_thread_affinity` / `reset_thread_affinity`: bind the calling thread's CPU
cores under CPU_AFFINITY_CONF (mode 1 or 2; with mode 0 they do nothing, as on Ascend). The binding
itself is opennpu's C++ runtime (csrc/device/npu_affinity.cpp); docs/device.md describes it."""

from __future__ import annotations

__all__: list[str] = []


def _core_list(core_range) -> list[int]:
    if (isinstance(core_range, list) and len(core_range) == 2
            and all(isinstance(x, int) for x in core_range)):
        ranges = [core_range]
    elif (isinstance(core_range, list) and core_range
          and all(isinstance(x, list) and len(x) == 2 for x in core_range)):
        ranges = core_range
    else:
        raise ValueError(f"Invalid core range: {core_range!r}; expected [start, end] or "
                         "[[start, end], ...] of CPU ids")
    for start, end in ranges:
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise ValueError(f"Invalid core range values: [{start}, {end}]; expected "
                             "0 <= start <= end")
    return sorted({core for start, end in ranges for core in range(start, end + 1)})


def _set_thread_affinity(core_range: list[int] | list[list[int]] | None = None) -> None:
    """Binds the calling thread to `core_range` ([start, end] inclusive, or a list of such
    ranges); None binds it to its current device's CPU_AFFINITY_CONF range."""
    import torch_npu

    if core_range is None:
        torch_npu._C._npu_set_thread_affinity(-1, -1)
    else:
        torch_npu._C._npu_set_thread_affinity(_core_list(core_range))


def _reset_thread_affinity() -> None:
    """Binds the calling thread back to the main thread's range (after starting a child thread
    with set_thread_affinity, so that the child keeps its own cores)."""
    import torch_npu

    torch_npu._C._npu_reset_thread_affinity()
