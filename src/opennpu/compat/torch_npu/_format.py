"""Ascend's storage formats (`torch_npu.npu_format_cast`, `torch_npu.get_npu_format`).

On Ascend a tensor's bytes may be laid out in a private format (NZ, 5HD, ...) chosen for the Cube
unit. opennpu's npu tensors live in host memory in their logical layout always: a format is
recorded, never applied. Records are kept per storage, as torch_npu keeps the format in the
storage's descriptor (views of a storage report its format), and follow torch_npu's rules:

- a tensor never cast reports its rank's base format: NCHW (0) for 4-D, NCDHW (30) for 5-D,
  ND (2) otherwise;
- a cast to the format it has returns the tensor itself;
- a cast between two base formats (ND, NCHW, NCDHW, ...) relabels the storage and returns the
  tensor itself (torch_npu does the same);
- a cast to or from a private format (NZ, 5HD, FRACTAL_Z, ...) returns a new tensor with the same
  values in a new storage (a copy, where Ascend runs TransData) carrying the format that
  torch_npu would give it (a 4-D ND is NCHW, NZ needs rank >= 2, ...); the source keeps its own.
  npu_format_cast_ records the format on self's storage instead.

Under torch.compile a cast is the identity (the graph carries values, not formats). Tests that
check the private layouts themselves (storage sizes of NZ tensors) are Ascend-only.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["ACL_FORMATS", "empty_with_format", "get_npu_format", "get_storage_size",
           "npu_format_cast", "npu_format_cast_"]

# ACL's format numbers (aclFormat).
ACL_FORMATS = {
    "ACL_FORMAT_UNDEFINED": -1, "ACL_FORMAT_NCHW": 0, "ACL_FORMAT_NHWC": 1, "ACL_FORMAT_ND": 2,
    "ACL_FORMAT_NC1HWC0": 3, "ACL_FORMAT_FRACTAL_Z": 4, "ACL_FORMAT_NC1HWC0_C04": 12,
    "ACL_FORMAT_HWCN": 16, "ACL_FORMAT_NDHWC": 27, "ACL_FORMAT_FRACTAL_NZ": 29,
    "ACL_FORMAT_NCDHW": 30, "ACL_FORMAT_NDC1HWC0": 32, "ACL_FRACTAL_Z_3D": 33,
    "ACL_FORMAT_NC": 35, "ACL_FORMAT_NCL": 47,
}
_KNOWN = frozenset(ACL_FORMATS.values())
ACL_FORMAT_NCHW, ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ, ACL_FORMAT_NCDHW = 0, 2, 29, 30
# The formats that are their own base format (the logical layouts); a cast between two of them
# only relabels the storage on Ascend too.
_BASE = frozenset({0, 1, 2, 16, 27, 30, 35, 47})

# storage id -> (weak reference to the storage, ACL format). The weak reference tells a live
# storage from a freed one whose address was reused.
_RECORDED: dict[int, tuple[StorageWeakRef, int]] = {}


def _check(fn: str, self, acl_format, *, on_npu: bool = True) -> None:
    """`self` a tensor (on npu unless `on_npu` is False) and `acl_format` an ACL format number."""
    if not isinstance(self, torch.Tensor):
        raise TypeError(f"{fn}: self must be a Tensor, got {type(self).__name__}")
    if on_npu and self.device.type != "npu":
        raise RuntimeError(f"{fn}: self must be an npu tensor (storage formats exist only on the "
                           f"device), got a tensor on {self.device}")
    if isinstance(acl_format, bool) or not isinstance(acl_format, int):
        raise TypeError(f"{fn}: acl_format must be an int (an ACL format number), got "
                        f"{type(acl_format).__name__}")
    if acl_format not in _KNOWN or acl_format == -1:
        raise ValueError(f"{fn}: acl_format {acl_format} is not an ACL format; expected one of "
                         f"{sorted(_KNOWN - {-1})}")


def _check_dtype_code(fn: str, name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, torch.dtype))):
        raise TypeError(f"{fn}: {name} must be a dtype (or its ScalarType number) or None, got "
                        f"{type(value).__name__}")


def _base_format(dim: int) -> int:
    """The format torch_npu gives a new tensor of rank `dim`."""
    return {4: ACL_FORMAT_NCHW, 5: ACL_FORMAT_NCDHW}.get(dim, ACL_FORMAT_ND)


def _storage_format(sizes, acl_format: int) -> int:
    """The format a tensor of `sizes` gets when cast to `acl_format` through a new storage (a cast
    to or from a private format): NZ needs rank >= 2, a 4-D tensor's ND is NCHW, NCHW needs
    rank 4, NCDHW rank 5 (rank 4 becomes NCHW), a scalar or [1] stays ND."""
    dim = len(sizes)
    if acl_format == ACL_FORMAT_FRACTAL_NZ and dim < 2:
        return ACL_FORMAT_ND
    if acl_format == ACL_FORMAT_NCDHW:
        return {4: ACL_FORMAT_NCHW, 5: ACL_FORMAT_NCDHW}.get(dim, ACL_FORMAT_ND)
    if acl_format == ACL_FORMAT_ND and dim == 4:
        return ACL_FORMAT_NCHW
    if acl_format == ACL_FORMAT_NCHW and dim != 4:
        return ACL_FORMAT_ND
    if acl_format in _BASE and (dim == 0 or (dim == 1 and sizes[0] == 1)):
        return ACL_FORMAT_ND
    return acl_format


def _recorded(self: torch.Tensor):
    storage = self.untyped_storage()
    entry = _RECORDED.get(storage._cdata)
    if entry is None or entry[0].expired():
        return None
    return entry[1]


def _record(self: torch.Tensor, acl_format: int) -> None:
    if len(_RECORDED) >= 4096:  # drop the records of freed storages now and then
        for key in [k for k, (ref, _) in _RECORDED.items() if ref.expired()]:
            del _RECORDED[key]
    storage = self.untyped_storage()
    _RECORDED[storage._cdata] = (StorageWeakRef(storage), acl_format)


def _cast(fn: str, self: torch.Tensor, acl_format, *, inplace: bool) -> torch.Tensor:
    if isinstance(acl_format, torch.Tensor):
        acl_format = get_npu_format(acl_format)
    _check(fn, self, acl_format)
    if torch.compiler.is_compiling():
        return self  # traced: the graph needs only the values, not the bookkeeping
    current = get_npu_format(self)
    if current == acl_format:
        return self
    if current in _BASE and acl_format in _BASE:
        _record(self, acl_format)  # a relabel on Ascend too
        return self
    out = self if inplace else self.clone()
    _record(out, _storage_format(tuple(self.shape), acl_format))
    return out


def npu_format_cast(self: torch.Tensor, acl_format, *, customize_dtype=None,
                    input_dtype=None) -> torch.Tensor:
    """`self` in ACL format `acl_format`, recorded and not applied (module docstring): `self`
    itself for a cast between base formats, else a copy of it whose storage carries the format. `acl_format` is an ACL format number (2 = ND, 29 = FRACTAL_NZ, ...)
    or a tensor whose format to adopt. customize_dtype / input_dtype (the dtypes Ascend computes
    the private layout's block size from) are checked and otherwise unused."""
    _check_dtype_code("torch_npu.npu_format_cast", "customize_dtype", customize_dtype)
    _check_dtype_code("torch_npu.npu_format_cast", "input_dtype", input_dtype)
    return _cast("torch_npu.npu_format_cast", self, acl_format, inplace=False)


def npu_format_cast_(self: torch.Tensor, acl_format, *, customize_dtype=None,
                     input_dtype=None) -> torch.Tensor:
    """In-place form of npu_format_cast: records the format on `self`'s storage and returns
    `self`; `acl_format` may also be a tensor whose format to take."""
    _check_dtype_code("torch_npu.npu_format_cast_", "customize_dtype", customize_dtype)
    _check_dtype_code("torch_npu.npu_format_cast_", "input_dtype", input_dtype)
    return _cast("torch_npu.npu_format_cast_", self, acl_format, inplace=True)


def get_npu_format(self: torch.Tensor) -> int:
    """The ACL format of an npu tensor: the one its storage was last cast to, else its rank's base
    format (NCHW for 4-D, NCDHW for 5-D, ND otherwise)."""
    if not isinstance(self, torch.Tensor) or self.device.type != "npu":
        where = self.device if isinstance(self, torch.Tensor) else type(self).__name__
        raise RuntimeError(f"torch_npu.get_npu_format: expected an npu tensor, got {where}")
    recorded = _recorded(self)
    return _base_format(self.dim()) if recorded is None else recorded


def empty_with_format(size, *, dtype=None, layout=None, device=None, pin_memory=None,
                      acl_format: int = ACL_FORMAT_ND, base_addr_aligned_kb=None) -> torch.Tensor:
    """An uninitialised tensor, as torch.empty, requested in ACL format `acl_format`: stored in
    its logical layout like every npu tensor here, with the format recorded (module docstring). Host blocks are 64-byte aligned; a larger
    alignment of the data's address (`base_addr_aligned_kb`) is not offered and is an error."""
    if isinstance(acl_format, bool) or not isinstance(acl_format, int) or acl_format not in _KNOWN:
        raise ValueError(f"torch_npu.empty_with_format: acl_format {acl_format!r} is not an ACL "
                         f"format; expected one of {sorted(_KNOWN)}")
    if base_addr_aligned_kb:
        raise NotImplementedError(
            "torch_npu.empty_with_format: base_addr_aligned_kb is not supported by opennpu (npu "
            f"memory is 64-byte aligned host memory), got {base_addr_aligned_kb!r}")
    if device is None:
        device = torch.device("npu", torch.npu.current_device())
    out = torch.empty(size, dtype=dtype, layout=layout or torch.strided, device=device,
                      pin_memory=bool(pin_memory))
    if acl_format != -1 and out.device.type == "npu":
        _record(out, _storage_format(tuple(out.shape), acl_format))
    return out


def get_storage_size(self: torch.Tensor) -> int:
    """The number of elements of `self`'s storage (not of the view), as torch_npu counts the
    storage of an npu tensor; in ND that is the storage's bytes over the element size."""
    if not isinstance(self, torch.Tensor) or self.device.type != "npu":
        where = self.device if isinstance(self, torch.Tensor) else type(self).__name__
        raise RuntimeError(f"torch_npu.get_storage_size: expected an npu tensor, got {where}")
    return self.untyped_storage().nbytes() // self.element_size()


def install_tensor_methods() -> None:
    """`Tensor.npu_format_cast(fmt)` and `Tensor.npu_format_cast_(fmt)`, as torch_npu adds."""
    if not hasattr(torch.Tensor, "npu_format_cast"):
        torch.Tensor.npu_format_cast = npu_format_cast
        torch.Tensor.npu_format_cast_ = npu_format_cast_


# torch.save keeps a tensor's backend metadata (a str -> bool dict, torch._utils'
# get_tensor_metadata / set_tensor_metadata) beside its storage; torch_npu saves the storage
# format there, so a loaded npu tensor reports the format it was saved with. The recorded format
# travels as one key, "npu_format_<number>".
_META_PREFIX = "npu_format_"


def _get_tensor_metadata(get):
    def get_tensor_metadata(tensor):
        metadata = get(tensor)
        if tensor.device.type == "npu":
            recorded = _recorded(tensor)
            if recorded is not None:
                metadata = {**metadata, f"{_META_PREFIX}{recorded}": True}
        return metadata
    get_tensor_metadata.__wrapped__ = get
    return get_tensor_metadata


def _set_tensor_metadata(set_):
    def set_tensor_metadata(tensor, metadata):
        formats = [k for k in metadata if k.startswith(_META_PREFIX)]
        set_(tensor, {k: v for k, v in metadata.items() if not k.startswith(_META_PREFIX)})
        if formats and tensor.device.type == "npu":
            _record(tensor, int(formats[0][len(_META_PREFIX):]))
    set_tensor_metadata.__wrapped__ = set_
    return set_tensor_metadata


def install_serialization() -> None:
    """Carry recorded formats through torch.save / torch.load (once per process)."""
    import torch._utils as utils

    if not hasattr(utils.get_tensor_metadata, "__wrapped__"):
        utils.get_tensor_metadata = _get_tensor_metadata(utils.get_tensor_metadata)
        utils.set_tensor_metadata = _set_tensor_metadata(utils.set_tensor_metadata)
