"""Ascend's storage formats (`torch_npu.npu_format_cast`, `torch_npu.get_npu_format`).

On Ascend a tensor's bytes may be laid out in a private format (NZ, 5HD, ...) chosen for the Cube
unit. opennpu's npu tensors live in host memory in their logical layout, ACL's ND, always: a cast
to any ACL format is accepted and returns the tensor itself, and get_npu_format reports ND (2).
Tests that check the private layouts themselves (storage sizes of NZ tensors) are Ascend-only.
"""

from __future__ import annotations

import torch

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
ACL_FORMAT_ND = 2


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
    if acl_format not in _KNOWN:
        raise ValueError(f"{fn}: acl_format {acl_format} is not an ACL format; expected one of "
                         f"{sorted(_KNOWN)}")


def npu_format_cast(self: torch.Tensor, acl_format, customize_dtype=None) -> torch.Tensor:
    """Returns `self`: every npu tensor is already stored in the layout that any format cast
    would produce here (module docstring). `acl_format` is an ACL format number or a tensor whose
    format to adopt."""
    if isinstance(acl_format, torch.Tensor):
        acl_format = get_npu_format(acl_format)
    _check("torch_npu.npu_format_cast", self, acl_format)
    if customize_dtype is not None and not isinstance(customize_dtype, (int, torch.dtype)):
        raise TypeError("torch_npu.npu_format_cast: customize_dtype must be a dtype or None, got "
                        f"{type(customize_dtype).__name__}")
    return self


def npu_format_cast_(self: torch.Tensor, acl_format) -> torch.Tensor:
    """In-place form; `acl_format` may also be a tensor whose format to take (always ND here)."""
    if isinstance(acl_format, torch.Tensor):
        acl_format = get_npu_format(acl_format)
    _check("torch_npu.npu_format_cast_", self, acl_format)
    return self


def get_npu_format(self: torch.Tensor) -> int:
    """The ACL format of an npu tensor: ND (2), the only layout opennpu stores."""
    if not isinstance(self, torch.Tensor) or self.device.type != "npu":
        where = self.device if isinstance(self, torch.Tensor) else type(self).__name__
        raise RuntimeError(f"torch_npu.get_npu_format: expected an npu tensor, got {where}")
    return ACL_FORMAT_ND


def empty_with_format(size, *, dtype=None, layout=None, device=None, pin_memory=None,
                      acl_format: int = ACL_FORMAT_ND, base_addr_aligned_kb=None) -> torch.Tensor:
    """An uninitialised tensor, as torch.empty, requested in ACL format `acl_format`; stored in
    ND like every npu tensor here (module docstring). Host blocks are 64-byte aligned; a larger
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
    return torch.empty(size, dtype=dtype, layout=layout or torch.strided, device=device,
                       pin_memory=bool(pin_memory))


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
