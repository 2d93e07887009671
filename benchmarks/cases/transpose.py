"""npu_confusion_transpose, forward: seed 000's two examples and large bandwidth-regime shapes.

The op is one copy, so "native eager" is one copy too (ATen's permuted `copy_`): the 3x-eager
target of the fused ops cannot apply, and the ratio is reported as measured. Seed example two's
native code returns a view; its baselines materialise it (`.contiguous()`), as the op does.
"""

from __future__ import annotations

import functools
import math

import torch
from opennpu.testing import reference
from opennpu.testing.timing import compiled

from ..common import Case, Timed, randn

npu = torch.ops.npu
SEED = (64, 3, 64, 128)  # B, C, H, W of seed 000's examples


def native_example_two(data):
    return reference.native_confusion_transpose_2(data).contiguous()


def native_transpose_first(x, perm, shape):
    return x.permute(perm).contiguous().view(shape)


def native_view_first(x, perm, shape):
    return x.view(shape).permute(perm).contiguous()


def example(which, dtype, threads):
    data = randn(*SEED, dtype=dtype)
    b, c, h, w = SEED
    if which == 1:
        native, args = reference.native_confusion_transpose_1, ((0, 2, 1, 3), (h, b, c * w), True)
    else:
        native, args = native_example_two, ((1, 0), (b, h * c * w), False)
    native_compiled = compiled(native, data, threads=threads)
    return Timed(
        ours=lambda: npu.npu_confusion_transpose(data, *args),
        baselines={"eager": lambda: native(data), "compile": lambda: native_compiled(data)},
        reference=lambda: reference.confusion_transpose(data, *args),
    )


def large(x_shape, perm, shape, transpose_first, dtype, threads):
    x = randn(*x_shape, dtype=dtype)
    native = native_transpose_first if transpose_first else native_view_first
    native_compiled = compiled(native, x, perm, shape, threads=threads)
    return Timed(
        ours=lambda: npu.npu_confusion_transpose(x, perm, shape, transpose_first),
        baselines={"eager": lambda: native(x, perm, shape),
                   "compile": lambda: native_compiled(x, perm, shape)},
        reference=lambda: reference.confusion_transpose(x, perm, shape, transpose_first),
    )


# (label, x shape, perm, shape, transpose_first): BSND -> BNSD keeps D innermost (contiguous
# runs); the 2-D transposes move the innermost dim (element transpose), the odd one with output
# rows that are not whole cache lines.
LARGE = [
    ("BSND>BNSD 4x4096x32x128", (4, 4096, 32, 128), (0, 2, 1, 3), (4, 32, 4096, 128), True),
    ("2D 8192x8192 (1,0)", (8192, 8192), (1, 0), (8192, 8192), False),
    ("2D 4099x8191 (1,0)", (4099, 8191), (1, 0), (8191, 4099), True),
]


def cases(quick: bool, dtypes):
    large_cases = LARGE[:2] if quick else LARGE
    for dtype in dtypes:
        e = dtype.itemsize
        for which in (1, 2):
            yield Case("confusion_transpose", "fwd", f"seed ex{which} 64x3x64x128", dtype,
                       2 * math.prod(SEED) * e, functools.partial(example, which, dtype),
                       ("npu_confusion_transpose",))
        for label, x_shape, perm, shape, transpose_first in large_cases:
            yield Case("confusion_transpose", "fwd", label, dtype, 2 * math.prod(x_shape) * e,
                       functools.partial(large, x_shape, perm, shape, transpose_first, dtype),
                       ("npu_confusion_transpose",))
