"""Loads opennpu's C++ operator library into the PyTorch dispatcher."""

from __future__ import annotations

import os
from pathlib import Path

import torch

_LIBRARY_NAME = "libopennpu_ops.so"


def library_path() -> Path:
    return Path(__file__).resolve().parent / _LIBRARY_NAME


def load() -> None:
    path = library_path()
    if not path.exists():
        raise ImportError(
            f"opennpu: the compiled operator library {path} is missing; install opennpu with "
            "`pip install --no-build-isolation .` (see README) instead of importing it from the "
            "source tree"
        )
    torch.ops.load_library(os.fspath(path))


def cpu_isa() -> str:
    """The instruction set opennpu's CPU kernels run with: 'AVX512', 'AVX2' or 'DEFAULT'."""
    return torch.ops.opennpu.cpu_isa()
