"""Registers the `npu` device with PyTorch: PrivateUse1 renamed `npu`, `torch.npu` (= opennpu.npu,
also `torch_npu.npu`), and the generated `Tensor.npu()`, `Tensor.is_npu`, `Module.npu()` and storage
methods. The C++ side (guard, allocator, hooks, kernels) registers itself when the operator
library loads.

One accelerator per process: PyTorch makes a named PrivateUse1 backend its accelerator
(`torch.accelerator`) ahead of CUDA, and its autograd engine then finds no stream for CUDA nodes,
so every CUDA backward in the process fails (an internal assert; pytorch/pytorch#161129). Where a
CUDA GPU is visible, npu is therefore off unless OPENNPU_NPU_DEVICE=1 (the policy lives in the
import hook, _opennpu_compat.npu_device_wanted, which also keeps torch_npu unimportable there):
`import torch` and `import opennpu` leave CUDA the accelerator, and opennpu's ops run on CUDA
tensors.
"""

from __future__ import annotations

import os
import warnings

import torch
from _opennpu_compat import NPU_DEVICE_ENV as ENV
from _opennpu_compat import cuda_gpu_visible, npu_device_wanted as wanted


def is_registered() -> bool:
    return torch._C._get_privateuse1_backend_name() == "npu"


def ask_for_npu() -> None:
    """For code that runs on npu by definition (TORCH_TRANSFER_TO_NPU, `opennpu analyze`): npu and
    torch_npu on also beside a visible GPU, unless OPENNPU_NPU_DEVICE=0 says never. Set in the
    environment, so the import hook and child processes (DDP ranks) agree."""
    if os.environ.get(ENV, "auto") != "0":
        os.environ[ENV] = "1"


def register(explicit: bool = False) -> bool:
    """Registers npu unless a visible CUDA GPU keeps it off (see the module's docstring);
    returns whether npu is registered. Idempotent; fails clearly if another backend already
    owns PrivateUse1."""
    if not is_registered() and not wanted(explicit):
        return False
    if not is_registered() and cuda_gpu_visible():
        warnings.warn(
            "opennpu: registering the npu device makes it PyTorch's accelerator in this process, "
            "ahead of CUDA: backward passes over CUDA tensors fail here (pytorch/pytorch#161129). "
            f"Unset {ENV} (or set it to 0) to keep CUDA, and opennpu's ops on CUDA tensors.",
            stacklevel=3)
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
    return True


def autoload() -> None:
    """Entry point of group `torch.backends`: `import torch` calls it (unless
    TORCH_DEVICE_BACKEND_AUTOLOAD=0); importing opennpu (done by loading this module) registers
    the device."""
