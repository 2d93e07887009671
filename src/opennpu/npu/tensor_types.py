"""torch.npu.FloatTensor and the other legacy tensor types: constructors of npu tensors of one
dtype, and isinstance checks against them; torch.npu.FloatStorage and the other legacy storage
types do the same for npu TypedStorages.

`FloatTensor(2, 3)` is uninitialised of that shape, `FloatTensor([1, 2])` holds the data,
`FloatTensor(t)` converts a tensor, all on the current device (or `device=`). `t.type(cls)`
converts to the class's dtype on npu, as `t.type(torch.cuda.FloatTensor)` does on CUDA.
"""

from __future__ import annotations

import torch

from .device import _get_device_index

_TYPES = {
    "DoubleTensor": torch.float64, "FloatTensor": torch.float32, "HalfTensor": torch.float16,
    "BFloat16Tensor": torch.bfloat16, "LongTensor": torch.int64, "IntTensor": torch.int32,
    "ShortTensor": torch.int16, "CharTensor": torch.int8, "ByteTensor": torch.uint8,
    "BoolTensor": torch.bool,
}

__all__ = [*_TYPES, *(name.replace("Tensor", "Storage") for name in _TYPES)]


class _LegacyTensorType(type):
    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, torch.Tensor) and obj.device.type == "npu" and obj.dtype == cls.dtype


def _new(cls, *args, device=None):
    device = torch.device("npu", _get_device_index(device))
    if len(args) == 1 and not isinstance(args[0], int):
        data = args[0]
        if isinstance(data, torch.Tensor):
            return data.to(device=device, dtype=cls.dtype)
        if isinstance(data, torch.Size):
            return torch.empty(data, dtype=cls.dtype, device=device)
        return torch.tensor(data, dtype=cls.dtype, device=device)
    return torch.empty(args, dtype=cls.dtype, device=device)


# Tensor.type(cls) reads the class's C-level type name (tp_name), which for a class defined in
# Python is its __name__: the full "torch.npu.FloatTensor" makes PyTorch parse it as the string
# form. __qualname__ keeps the short name for repr and pickling.
for _name, _dtype in _TYPES.items():
    globals()[_name] = _LegacyTensorType(f"torch.npu.{_name}", (), {
        "dtype": _dtype, "is_npu": True, "is_sparse": False, "__new__": _new,
        "__module__": "torch.npu", "__qualname__": _name,
        "__doc__": f"npu tensors of dtype {_dtype}."})
del _name, _dtype


class _LegacyStorageType(type):
    def __instancecheck__(cls, obj) -> bool:
        return (isinstance(obj, torch.TypedStorage) and obj.device.type == "npu"
                and obj.dtype == cls.dtype)


def _new_storage(cls, *args, device=None):
    """`FloatStorage()` / `FloatStorage(n)` (uninitialised) / `FloatStorage([1, 2])` on the
    current device (or `device=`); `wrap_storage=` as torch.TypedStorage takes it."""
    device = torch.device("npu", _get_device_index(device))
    return torch.TypedStorage(*args, dtype=cls.dtype, device=device, _internal=True)


for _name, _dtype in _TYPES.items():
    _storage_name = _name.replace("Tensor", "Storage")
    globals()[_storage_name] = _LegacyStorageType(_storage_name, (), {
        "dtype": _dtype, "is_npu": True, "is_sparse": False, "__new__": _new_storage,
        "__module__": "torch.npu", "__qualname__": _storage_name,
        "__doc__": f"npu TypedStorages of dtype {_dtype}."})
del _name, _dtype, _storage_name
