"""nn.DataParallel on npu: the single-process multi-device copies that torch.nn.parallel.comm
makes through torch._C (_broadcast, _broadcast_coalesced, _scatter, _gather and their _out forms,
CUDA-only in torch), done for npu tensors, as torch_npu binds its own versions there.

npu memory is host memory, so each is a tensor copy between npu devices (`Tensor.to`); a chunk
or tensor already on its target device is passed on as is, as CUDA's are. Calls for other
devices go to torch's originals. torch's DataParallel, replicate, parallel_apply and
data_parallel then run unchanged on npu (they take the device type, streams and autocast from
the accelerator, npu).
"""

from __future__ import annotations

import torch

_ORIGINAL: dict = {}


def _npu_target(tensor: torch.Tensor) -> bool:
    """Whether a copy of TENSOR to device indices means npu devices: the tensor is on npu, or on
    the CPU with npu the accelerator (DataParallel scatters CPU inputs)."""
    if tensor.device.type == "npu":
        return True
    return tensor.device.type == "cpu" and not torch.cuda.is_available() and torch.npu.is_available()


def _device(index) -> torch.device:
    if index is None:
        return torch.device("npu", torch.npu.current_device())
    if isinstance(index, torch.device):
        return index
    return torch.device("cpu") if index == -1 else torch.device("npu", index)


def _broadcast(tensor, devices):
    if not _npu_target(tensor):
        return _ORIGINAL["_broadcast"](tensor, devices)
    return [tensor.to(_device(d)) for d in devices]


def _broadcast_out(tensor, out):
    if not _npu_target(tensor):
        return _ORIGINAL["_broadcast_out"](tensor, out)
    for o in out:
        o.copy_(tensor)
    return out


def _broadcast_coalesced(tensors, devices, buffer_size):
    if not tensors or not _npu_target(tensors[0]):
        return _ORIGINAL["_broadcast_coalesced"](tensors, devices, buffer_size)
    return [[t.to(_device(d)) for t in tensors] for d in devices]


def _scatter(tensor, devices, chunk_sizes, dim, streams):
    if not _npu_target(tensor):
        return _ORIGINAL["_scatter"](tensor, devices, chunk_sizes, dim, streams)
    chunks = tensor.split(list(chunk_sizes), dim) if chunk_sizes else tensor.chunk(len(devices), dim)
    return [c.to(_device(d), non_blocking=True) for c, d in zip(chunks, devices)]


def _scatter_out(tensor, out, dim, streams):
    if not _npu_target(tensor):
        return _ORIGINAL["_scatter_out"](tensor, out, dim, streams)
    for o, c in zip(out, tensor.split([o.shape[dim] for o in out], dim)):
        o.copy_(c)
    return out


def _gather(tensors, dim, destination_index):
    if not tensors or not _npu_target(tensors[0]):
        return _ORIGINAL["_gather"](tensors, dim, destination_index)
    target = _device(destination_index)
    return torch.cat([t.to(target) for t in tensors], dim)


def _gather_out(tensors, out, dim):
    if not tensors or not _npu_target(tensors[0]):
        return _ORIGINAL["_gather_out"](tensors, out, dim)
    return torch.cat([t.to(out.device) for t in tensors], dim, out=out)


def install() -> None:
    """Puts the npu versions in torch._C (idempotent)."""
    if _ORIGINAL:
        return
    for name, fn in (("_broadcast", _broadcast), ("_broadcast_out", _broadcast_out),
                     ("_broadcast_coalesced", _broadcast_coalesced), ("_scatter", _scatter),
                     ("_scatter_out", _scatter_out), ("_gather", _gather), ("_gather_out", _gather_out)):
        _ORIGINAL[name] = getattr(torch._C, name, None) or _missing(name)
        setattr(torch._C, name, fn)


def _missing(name):
    def fn(*args, **kwargs):
        raise RuntimeError(f"torch._C.{name} is not available in this build of torch")
    return fn
