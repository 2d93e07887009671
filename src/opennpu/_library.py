"""Loads opennpu's C++ operator library into the PyTorch dispatcher."""

from __future__ import annotations

import os
from pathlib import Path

import torch

_LIBRARY_NAME = "libopennpu_ops.so"


def library_path() -> Path:
    return Path(__file__).resolve().parent / _LIBRARY_NAME


def load(conflicting_package: str | None = None) -> None:
    path = library_path()
    if not path.exists():
        raise ImportError(
            f"opennpu: the compiled operator library {path} is missing; install opennpu with "
            "`pip install --no-build-isolation .` (see README) instead of importing it from the "
            "source tree"
        )
    try:
        torch.ops.load_library(os.fspath(path))
    except (OSError, RuntimeError) as error:
        if conflicting_package and "npu" in str(error):
            raise ImportError(
                "opennpu: cannot register the torch.ops.npu operators because Ascend's torch_npu "
                f"({conflicting_package}) already defines that namespace in this process. Use "
                "torch_npu on Ascend machines, or run opennpu in an environment without it."
            ) from error
        raise


def cpu_isa() -> str:
    """The instruction set opennpu's CPU kernels run with: 'AVX512', 'AVX2' or 'DEFAULT'."""
    return torch.ops.opennpu.cpu_isa()


def half_gemm(dtype: torch.dtype) -> str:
    """How the CPU kernels multiply matrices of ``dtype``: ``'fp32'`` where float16 / bfloat16
    operands are multiplied as float32 copies (a CPU without native arithmetic for the dtype:
    bfloat16 needs AVX512_BF16 or AMX-BF16, float16 AVX512_FP16), else ``'native'``. Either way
    products accumulate in float32 and the result is rounded once. ``OPENNPU_HALF_GEMM=auto``
    (default), ``native`` or ``fp32`` overrides the choice; it is read on every call."""
    return torch.ops.opennpu.half_gemm(dtype)
