"""`torch_npu._C`: the runtime bindings that scripts and torch_npu's own tests call directly.

torch_npu's `_C` is its C++ extension; opennpu's runtime is reached through `torch.ops.opennpu`,
so only the entry points with a meaning off Ascend are mapped here. Any other name raises an
AttributeError that names it (an AttributeError, so `hasattr` probes still answer False).
"""

from __future__ import annotations

import torch

_ops = torch.ops.opennpu


def _npu_getDeviceCount() -> int:
    """The number of visible npu devices (torch.npu.device_count())."""
    return int(_ops._npu_device_count())


# Releases the pinned-memory allocator's cached blocks: the same function as
# torch.npu.host_empty_cache, which transfer_to_npu installs as torch._C._host_emptyCache.
from opennpu.npu.memory import host_empty_cache as _npu_hostEmptyCache  # noqa: E402


def _npu_getCurrentStream(device_index: int):
    """The current stream of npu device `device_index` as torch_npu packs it: (stream_id,
    device_index, device_type), the arguments of torch.npu.Stream."""
    s = torch.npu.current_stream(device_index)
    return (s.stream_id, s.device_index, s.device_type)


def _npu_set_thread_affinity(*cores) -> None:
    """Binds the calling thread to a list of CPU ids, or with (-1, -1) to its current device's
    CPU_AFFINITY_CONF range (torch_npu's two call forms). Does nothing while CPU_AFFINITY_CONF's
    mode is 0."""
    if len(cores) == 1 and isinstance(cores[0], (list, tuple)):
        cores = tuple(cores[0])
    _ops._npu_set_thread_affinity([] if cores == (-1, -1) else [int(c) for c in cores])


def _npu_reset_thread_affinity() -> None:
    """Binds the calling thread back to the main thread's CPU_AFFINITY_CONF range."""
    _ops._npu_reset_thread_affinity()


# A task-group update of a captured npu_fused_infer_attention_score.out in one call (begin, the
# op with new arguments, end, event.record): opennpu.npu.graphs says what it does.
from opennpu.npu.graphs import (  # noqa: E402
    _fused_infer_attention_score_out_graph as _npu_fused_infer_attention_score_out_graph)

from opennpu.npu.graphs import (  # noqa: E402,F401  (host functions on a stream)
    _launch_host_func, _subscribe_report, _unsubscribe_report)


def __getattr__(name: str):
    raise AttributeError(f"torch_npu._C.{name} is not provided by opennpu (a binding of the "
                         "Ascend runtime with no counterpart on the emulated device)")
