"""`torch_npu.utils.storage`: rebuilds tensors from checkpoints written by torch_npu before 2.1.

Those versions pickled an npu tensor as `torch_npu.utils.storage._rebuild_npu_tensor(storage,
storage_offset, size, stride, requires_grad, backward_hooks, npu_storage_info)` over a CPU
storage (location "cpu"). Newer torch_npu, and opennpu, save npu storages with location "npu:N"
through PyTorch's own rebuild functions, which need nothing from here.
"""

from __future__ import annotations

import torch

__all__: list[str] = []


def _rebuild_npu_tensor(storage, storage_offset, size, stride, requires_grad, backward_hooks,
                        npu_storage_info):
    """The tensor on the device its storage was restored to: CPU unless torch.load's
    map_location moved it (real torch_npu moves it to npu unless map_location names cpu).
    npu_storage_info (the Ascend format, or a bool) needs nothing: npu tensors are stored ND."""
    if isinstance(storage, torch.storage.TypedStorage):
        dtype, untyped = storage.dtype, storage._untyped_storage
    else:
        raise TypeError("torch_npu.utils.storage._rebuild_npu_tensor: storage must be a typed "
                        f"storage, got {type(storage).__name__}")
    tensor = torch.empty((0,), dtype=dtype, device=untyped.device)
    tensor.set_(untyped, storage_offset, size, stride)
    tensor.requires_grad = requires_grad
    tensor._backward_hooks = backward_hooks
    return tensor


# torch.load(weights_only=True) accepts these checkpoints too; the pickle names the function by
# its torch_npu path.
torch.serialization.add_safe_globals(
    [(_rebuild_npu_tensor, "torch_npu.utils.storage._rebuild_npu_tensor")])
