"""Import hook that lets `import torch_npu` (and `import torchair`, `import apex`) load opennpu's
compatibility modules on machines without the real packages.

Installed next to opennpu and activated by opennpu-compat.pth at interpreter start-up, so it must
stay cheap: standard library only, and nothing is imported until a script asks for torch_npu.
When the real torch_npu (or torchair, or any package named apex) is installed, the hook steps
aside and the real package loads. Beside a visible CUDA GPU it provides torch_npu only when
OPENNPU_NPU_DEVICE=1 (npu_device_wanted says why).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

ALIASES = {
    "torch_npu": "opennpu.compat.torch_npu",
    "torch_npu.npu": "opennpu.npu",  # torch_npu.npu is torch.npu, the very same module
    "torchair": "opennpu.compat.torchair",
    "apex": "opennpu.compat.apex",  # Ascend's apex fork: amp and the NpuFused* optimizers
}


NPU_DEVICE_ENV = "OPENNPU_NPU_DEVICE"


def cuda_gpu_visible() -> bool:
    """Whether this process sees a CUDA GPU; asks NVML first, so CUDA is not initialised."""
    import torch

    if not torch.version.cuda:
        return False
    count = torch.cuda._device_count_nvml()
    return count > 0 if count >= 0 else torch.cuda.is_available()


def npu_device_wanted(explicit: bool = False) -> bool:
    """Whether opennpu registers its npu device (and provides torch_npu) in this process.

    PyTorch makes a named PrivateUse1 backend its accelerator ahead of CUDA, and CUDA backward
    then fails in that process (pytorch/pytorch#161129). So by default (OPENNPU_NPU_DEVICE=auto)
    npu is off where a CUDA GPU is visible; explicit (opennpu.compat.torch_npu imported by name)
    and OPENNPU_NPU_DEVICE=1 turn it on, OPENNPU_NPU_DEVICE=0 keeps it off.
    """
    setting = os.environ.get(NPU_DEVICE_ENV, "auto")
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"opennpu: {NPU_DEVICE_ENV} must be 0, 1 or auto, but got {setting!r}")
    if setting != "auto":
        return setting == "1"
    return explicit or not cuda_gpu_visible()


def _alias_target(fullname: str) -> str:
    """opennpu's module for `fullname`, through the longest aliased prefix."""
    parts = fullname.split(".")
    for end in range(len(parts), 0, -1):
        prefix = ".".join(parts[:end])
        if prefix in ALIASES:
            return ALIASES[prefix] + fullname[len(prefix):]
    raise KeyError(fullname)


def real_package_origin(name: str) -> str | None:
    """Where the genuine package `name` is installed, or None when only opennpu provides it."""
    spec = importlib.machinery.PathFinder.find_spec(name)
    return None if spec is None else (spec.origin or str(spec.submodule_search_locations))


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        # The alias is the very same module object as its opennpu target.
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass

    def get_code(self, fullname):
        # `python -m torch_npu.utils.collect_env` runs the target module's code as __main__.
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class CompatFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        top, _, rest = fullname.partition(".")
        if top not in ALIASES:
            return None
        if not rest:
            if real_package_origin(top) is not None:
                return None  # the real package wins
            if top == "torch_npu" and not npu_device_wanted():
                # Beside a visible CUDA GPU torch_npu is absent unless OPENNPU_NPU_DEVICE=1: a
                # library probing for Ascend (transformers' is_torch_npu_available imports it)
                # must not turn the npu device on and CUDA autograd off.
                return None
        elif top not in sys.modules or sys.modules[top] is not sys.modules.get(ALIASES[top]):
            return None  # a submodule of the real package
        target_name = _alias_target(fullname)
        target_spec = importlib.util.find_spec(target_name)
        if target_spec is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(target_name),
            is_package=target_spec.submodule_search_locations is not None)


def install() -> None:
    if not any(isinstance(f, CompatFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CompatFinder())
