"""npu_rotary_mul ('half' mode), forward and backward, in the BSND and BNSD layouts.

Two backward rows: torch_npu's npu_rotary_mul_backward (dx, dr1, dr2), and "bwd dx", the dx-only
backward autograd runs when cos/sin need no gradient (opennpu::_rotary_mul_backward_dx), against
native autograd with cos/sin as constants."""

from __future__ import annotations

import functools
import itertools

import torch
from opennpu.testing import reference
from opennpu.testing.timing import autograd_backward, compiled

from ..common import Case, Timed, randn

HEADS, HEAD_DIM = 32, 128
npu = torch.ops.npu


def layout_shapes(layout: str, s: int):
    """(x shape, r1/r2 shape) for batch 1."""
    if layout == "BSND":
        return (1, s, HEADS, HEAD_DIM), (1, s, 1, HEAD_DIM)
    return (1, HEADS, s, HEAD_DIM), (1, 1, s, HEAD_DIM)


def _inputs(layout, s, dtype):
    x_shape, r_shape = layout_shapes(layout, s)
    angle = torch.rand(r_shape) * 6.283
    return randn(*x_shape, dtype=dtype), angle.cos().to(dtype), angle.sin().to(dtype)


def rotary_fwd(layout, s, dtype, threads):
    x, r1, r2 = _inputs(layout, s, dtype)
    native_compiled = compiled(reference.native_rotary_mul, x, r1, r2, threads=threads)
    return Timed(
        ours=lambda: npu.npu_rotary_mul(x, r1, r2),
        baselines={"eager": lambda: reference.native_rotary_mul(x, r1, r2),
                   "compile": lambda: native_compiled(x, r1, r2)},
        reference=lambda: reference.rotary_mul(x, r1, r2),
    )


def rotary_bwd(layout, s, dtype, threads):
    x, r1, r2 = _inputs(layout, s, dtype)
    grad = randn(*x.shape, dtype=dtype)
    native_compiled = compiled(reference.native_rotary_mul, x, r1, r2, threads=threads)
    return Timed(
        ours=lambda: npu.npu_rotary_mul_backward(grad, x, r1, r2),
        baselines={"eager": autograd_backward(reference.native_rotary_mul, (x, r1, r2), grad),
                   "compile": autograd_backward(native_compiled, (x, r1, r2), grad)},
        reference=lambda: reference.rotary_mul_backward(grad, x, r1, r2),
    )


def rotary_bwd_dx(layout, s, dtype, threads):
    x, r1, r2 = _inputs(layout, s, dtype)
    grad = randn(*x.shape, dtype=dtype)
    native_compiled = compiled(reference.native_rotary_mul, x, r1, r2, threads=threads)
    x_only = (True, False, False)
    return Timed(
        ours=lambda: torch.ops.opennpu._rotary_mul_backward_dx(grad, x, r1, r2),
        baselines={"eager": autograd_backward(reference.native_rotary_mul, (x, r1, r2), grad,
                                              x_only),
                   "compile": autograd_backward(native_compiled, (x, r1, r2), grad, x_only)},
        reference=lambda: reference.rotary_mul_backward(grad, x, r1, r2)[0],
    )


def cases(quick: bool, dtypes):
    seqs = (4096,) if quick else (4096, 8192)
    for layout, s, dtype in itertools.product(("BSND", "BNSD"), seqs, dtypes):
        e = dtype.itemsize
        x_numel, r_numel = s * HEADS * HEAD_DIM, s * HEAD_DIM
        shape = f"{layout} S={s} N={HEADS} D={HEAD_DIM}"
        # fwd reads x, r1, r2 and writes out; bwd reads grad, x, r1, r2 and writes dx, dr1, dr2;
        # bwd dx reads grad, r1, r2 and writes dx.
        yield Case("rotary_mul", "fwd", shape, dtype, 2 * x_numel * e + 2 * r_numel * e,
                   functools.partial(rotary_fwd, layout, s, dtype), ("npu_rotary_mul",))
        yield Case("rotary_mul", "bwd", shape, dtype, 3 * x_numel * e + 4 * r_numel * e,
                   functools.partial(rotary_bwd, layout, s, dtype), ("npu_rotary_mul_backward",))
        yield Case("rotary_mul", "bwd", f"{shape} dx", dtype, 2 * x_numel * e + 2 * r_numel * e,
                   functools.partial(rotary_bwd_dx, layout, s, dtype), ("npu_rotary_mul",))
