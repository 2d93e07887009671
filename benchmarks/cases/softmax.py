"""npu_scaled_masked_softmax, forward and backward, x [B, N, S, W] with the seed's [1, 1, S, W] mask.

Baselines: the seed's native code `torch.softmax((x * scale).masked_fill(mask, -inf), -1)` and
torch.compile of it. The seed's mask (randn >= 1, ~16% masked) never masks a whole row at these
widths, so the -inf of the native code and the -10000 of the fused op give the same values.
"""

from __future__ import annotations

import functools

import torch
from opennpu.testing import reference
from opennpu.testing.timing import autograd_backward, compiled

from ..common import Case, Timed, randn

SCALE = 0.8
npu = torch.ops.npu


def shapes(quick: bool):
    """(B, N, S, W): a cache-resident shape, the seed's (B=64, W=256), the seed's N and S at wider
    rows (B shrunk to keep 16.7 M elements), and a bandwidth-regime shape (67 M elements)."""
    if quick:
        return [(1, 8, 128, 256), (64, 8, 128, 256), (4, 16, 1024, 1024)]
    return [(1, 8, 128, 256), (64, 8, 128, 256), (8, 8, 128, 2048), (2, 8, 128, 8192),
            (4, 16, 1024, 1024)]


def _inputs(shape, dtype):
    _, _, s, w = shape
    return randn(*shape, dtype=dtype), torch.randn(1, 1, s, w) >= 1


def softmax_fwd(shape, dtype, threads):
    x, mask = _inputs(shape, dtype)
    native = reference.native_scaled_masked_softmax
    native_compiled = compiled(native, x, mask, SCALE, threads=threads)
    return Timed(
        ours=lambda: npu.npu_scaled_masked_softmax(x, mask, SCALE, False),
        baselines={"eager": lambda: native(x, mask, SCALE),
                   "compile": lambda: native_compiled(x, mask, SCALE)},
        reference=lambda: reference.scaled_masked_softmax(x, mask, SCALE),
    )


def softmax_bwd(shape, dtype, threads):
    x, mask = _inputs(shape, dtype)
    dy = randn(*shape, dtype=dtype)
    y = npu.npu_scaled_masked_softmax(x, mask, SCALE, False)
    native = reference.native_scaled_masked_softmax
    native_compiled = compiled(native, x, mask, SCALE, threads=threads)
    return Timed(
        ours=lambda: npu.npu_scaled_masked_softmax_backward(dy, y, mask, SCALE, False),
        baselines={
            "eager": autograd_backward(lambda t: native(t, mask, SCALE), (x,), dy),
            "compile": autograd_backward(lambda t: native_compiled(t, mask, SCALE), (x,), dy),
        },
        reference=lambda: reference.scaled_masked_softmax_backward(
            dy, reference.scaled_masked_softmax(x, mask, SCALE), mask, SCALE),
    )


def cases(quick: bool, dtypes):
    for shape in shapes(quick):
        b, n, s, w = shape
        name = f"B={b} N={n} S={s} W={w}"
        numel = b * n * s * w
        for dtype in dtypes:
            e = dtype.itemsize
            # fwd reads x and the bool mask, writes y; bwd reads dy, y and the mask, writes dx.
            yield Case("scaled_masked_softmax", "fwd", name, dtype, 2 * numel * e + s * w,
                       functools.partial(softmax_fwd, shape, dtype),
                       ("npu_scaled_masked_softmax",))
            yield Case("scaled_masked_softmax", "bwd", name, dtype, 3 * numel * e + s * w,
                       functools.partial(softmax_bwd, shape, dtype),
                       ("npu_scaled_masked_softmax_backward",))
