"""`torch_npu.utils.collect_env`: the environment report torch_npu's bug template asks for
(`python -m torch_npu.utils.collect_env`), from PyTorch's own collectors plus what stands in for
Ascend here: opennpu's version, the emulated SoC, the device count and the CPU kernels' ISA.
There is no CANN: its version reads "not known", torch_npu's own value when none is installed."""

from __future__ import annotations

import sys
from collections import namedtuple

import torch
from torch.utils import collect_env as _torch_env

SystemEnv = namedtuple("SystemEnv", [
    "torch_version", "torch_npu_version", "is_debug_build", "gcc_version", "clang_version",
    "cmake_version", "os", "libc_version", "python_version", "python_platform", "pip_version",
    "pip_packages", "conda_packages", "caching_allocator_config", "is_xnnpack_available",
    "cpu_info", "cann_version", "npu_device", "opennpu_cpu_kernels",
])


def get_cann_version() -> str:
    """CANN's version: "not known" (no CANN is installed; opennpu runs the npu ops on the CPU)."""
    return "not known"


def get_torch_npu_version() -> str:
    import opennpu

    return f"opennpu {opennpu.__version__}"


def get_env_info() -> SystemEnv:
    import opennpu

    run = _torch_env.run
    pip_version, pip_packages = _torch_env.get_pip_packages(run)
    device = (f"{torch.npu.get_device_name(0)}, {torch.npu.device_count()} devices"
              if torch.npu.is_available() else "none")
    return SystemEnv(
        torch_version=torch.__version__,
        torch_npu_version=get_torch_npu_version(),
        is_debug_build=str(torch.version.debug),
        gcc_version=_torch_env.get_gcc_version(run),
        clang_version=_torch_env.get_clang_version(run),
        cmake_version=_torch_env.get_cmake_version(run),
        os=_torch_env.get_os(run),
        libc_version=_torch_env.get_libc_version(),
        python_version=sys.version.replace("\n", " "),
        python_platform=_torch_env.get_python_platform(),
        pip_version=pip_version,
        pip_packages=pip_packages,
        conda_packages=_torch_env.get_conda_packages(run),
        caching_allocator_config=_torch_env.get_cachingallocator_config(),
        is_xnnpack_available=_torch_env.is_xnnpack_available(),
        cpu_info=_torch_env.get_cpu_info(run),
        cann_version=get_cann_version(),
        npu_device=device,
        opennpu_cpu_kernels=opennpu.cpu_isa(),
    )


_FORMAT = """
PyTorch version: {torch_version}
Torch-npu version: {torch_npu_version}
Is debug build: {is_debug_build}
OS: {os}
GCC version: {gcc_version}
Clang version: {clang_version}
CMake version: {cmake_version}
Libc version: {libc_version}

Python version: {python_version}
Python platform: {python_platform}
Is XNNPACK available: {is_xnnpack_available}

CPU:
{cpu_info}

NPU: {npu_device}
opennpu CPU kernels: {opennpu_cpu_kernels}
CANN: {cann_version}

Versions of relevant libraries:
{pip_packages}
{conda_packages}
""".strip()


def pretty_str(info: SystemEnv) -> str:
    fields = {k: ("Could not collect" if v is None else v) for k, v in info._asdict().items()}
    for key in ("pip_packages", "conda_packages"):
        text = fields[key] or "No relevant packages"
        tag = f"[{info.pip_version}] " if key == "pip_packages" else "[conda] "
        fields[key] = "\n".join(tag + line for line in text.split("\n"))
    return _FORMAT.format(**fields)


def get_pretty_env_info() -> str:
    return pretty_str(get_env_info())


def main() -> None:
    print("Collecting environment information...")
    print(get_pretty_env_info())


if __name__ == "__main__":
    main()
