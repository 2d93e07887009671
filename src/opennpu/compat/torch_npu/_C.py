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


def __getattr__(name: str):
    raise AttributeError(f"torch_npu._C.{name} is not provided by opennpu (a binding of the "
                         "Ascend runtime with no counterpart on the emulated device)")
