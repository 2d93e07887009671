"""What a benchmark case is, and the helpers the case modules share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DTYPE_NAMES[torch.int8] = "int8"  # quantised cases (ffn), which pick their own dtypes


@dataclass
class Timed:
    """The functions of one case, built once its inputs exist.

    `ours` and every baseline are zero-argument calls returning the outputs compared against
    `reference()` (the fp32 oracle); "eager" (the native composition) is the first baseline.
    """

    ours: Callable[[], Any]
    baselines: dict[str, Callable[[], Any]]
    reference: Callable[[], Any] | None  # None where the oracle itself would not fit in memory
    info: str | None = None  # printed after the row and kept in the JSON (e.g. graph fusions)


@dataclass
class Case:
    op: str  # the family name --ops selects, e.g. "rms_norm"
    direction: str  # "fwd" or "bwd"
    shape: str
    dtype: torch.dtype
    nbytes: int  # effective bytes: each tensor read or written once
    build: Callable[[int], Timed]  # build(threads) allocates the inputs when the case runs
    requires: tuple[str, ...] = ()  # the torch.ops.npu ops the case calls
    flops: int = 0  # compute-bound cases (attention) report GFLOP/s instead of bandwidth


def gpt2_small_shapes(vocab=50257, positions=1024, width=768, layers=12):
    """GPT-2 small's 148 parameter shapes (124 M parameters)."""
    shapes = [(vocab, width), (positions, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width),
                   (width,)]
    return shapes + [(width,), (width,)]


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


def reference_backward(fn: Callable, inputs: tuple[torch.Tensor, ...], grad: torch.Tensor):
    """Gradients of an fp32 oracle by autograd, for ops whose oracle has no closed-form backward."""
    leaves = tuple(t.detach().float().requires_grad_() for t in inputs)
    with torch.enable_grad():
        return torch.autograd.grad(fn(*leaves), leaves, grad.float())
