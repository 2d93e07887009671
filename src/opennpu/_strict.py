"""Strict mode: also enforce the documented Ascend limits, to check code before moving it."""

from __future__ import annotations

import contextlib

import torch


def set_strict(enabled: bool) -> None:
    """Turn strict mode on or off for the whole process (also: OPENNPU_STRICT=1 at start-up).

    By default opennpu accepts every shape and dtype its kernels compute correctly. In strict mode
    the ops additionally reject what Ascend's torch_npu documents as unsupported (e.g. rotary_mul
    ranks and broadcast patterns, rms_norm dtype pairs); such errors end in
    "(strict mode: Ascend constraint)".
    """
    torch.ops.opennpu.set_strict(bool(enabled))


def is_strict() -> bool:
    return bool(torch.ops.opennpu.is_strict())


@contextlib.contextmanager
def strict(enabled: bool = True):
    """Context manager form of set_strict; restores the previous setting on exit."""
    previous = is_strict()
    set_strict(enabled)
    try:
        yield
    finally:
        set_strict(previous)
