"""Registers the `npu` device with PyTorch: PrivateUse1 renamed `npu`, `torch.npu` (= opennpu.npu,
also `torch_npu.npu`), and the generated `Tensor.npu()`, `Tensor.is_npu`, `Module.npu()` and storage
methods. The C++ side (guard, allocator, hooks, kernels) registers itself when the operator
library loads."""

from __future__ import annotations

import torch


def register() -> None:
    """Idempotent; fails clearly if another backend already owns PrivateUse1."""
    name = torch._C._get_privateuse1_backend_name()
    if name != "npu":
        if name != "privateuseone":
            raise RuntimeError(f"opennpu: PrivateUse1 is already registered as {name!r} by another "
                               "package, so the npu device cannot be registered")
        torch.utils.rename_privateuse1_backend("npu")

    from . import npu

    registered = getattr(torch, "npu", None)
    if registered is None:
        torch._register_device_module("npu", npu)
    elif registered is not npu:
        raise RuntimeError(f"opennpu: torch.npu is already provided by {registered!r}")

    # npu runs the CPU kernel of every aten op that has one, even where a composite exists
    # (csrc/device/npu_fallback.cpp), so npu computes CPU's bits.
    torch.ops.opennpu._npu_route_cpu_kernels()

    if not hasattr(torch.Tensor, "is_npu"):
        torch.utils.generate_methods_for_privateuse1_backend(
            for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
        # Lazy modules (nn.LazyLinear) allow a list of Tensor methods before materialisation;
        # `.npu()` joins `.cuda()` there, so `LazyLinear(4).npu()` works as on CUDA.
        from torch.nn.parameter import UninitializedTensorMixin
        UninitializedTensorMixin._allowed_methods.append(torch.Tensor.npu)


def autoload() -> None:
    """Entry point of group `torch.backends`: `import torch` calls it (unless
    TORCH_DEVICE_BACKEND_AUTOLOAD=0); importing opennpu (done by loading this module) registers
    the device."""
