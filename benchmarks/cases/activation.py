"""Activations: swiglu and geglu (x = [T, 2*I]) and fast_gelu (x = [T, H]), forward and backward."""

from __future__ import annotations

import functools
import itertools

import torch
from opennpu.testing import reference
from opennpu.testing.timing import autograd_backward, compiled

from ..common import Case, Timed, randn, reference_backward
from .norm import shapes as norm_shapes

npu = torch.ops.npu


def glu_shapes(quick: bool):
    """(T, I) pairs: x is [T, 2*I]."""
    tokens = (1, 4096) if quick else (1, 128, 4096, 8192)
    intermediate = (11008,) if quick else (11008, 14336)
    return itertools.product(tokens, intermediate)


def swiglu_fwd(t, i, dtype, threads):
    x = randn(t, 2 * i, dtype=dtype)
    native_compiled = compiled(reference.native_swiglu, x, threads=threads)
    return Timed(
        ours=lambda: npu.npu_swiglu(x, -1),
        baselines={"eager": lambda: reference.native_swiglu(x, -1),
                   "compile": lambda: native_compiled(x, -1)},
        reference=lambda: reference.swiglu(x),
    )


def swiglu_bwd(t, i, dtype, threads):
    x, grad = randn(t, 2 * i, dtype=dtype), randn(t, i, dtype=dtype)
    native_compiled = compiled(reference.native_swiglu, x, threads=threads)
    return Timed(
        ours=lambda: npu.npu_swiglu_backward(grad, x, -1),
        baselines={"eager": autograd_backward(reference.native_swiglu, (x,), grad),
                   "compile": autograd_backward(native_compiled, (x,), grad)},
        reference=lambda: reference.swiglu_backward(grad, x),
    )


def geglu_fwd(t, i, dtype, threads):
    x = randn(t, 2 * i, dtype=dtype)
    native_compiled = compiled(reference.native_geglu, x, threads=threads)
    return Timed(
        ours=lambda: npu.npu_geglu(x, -1, 1, False)[0],
        baselines={"eager": lambda: reference.native_geglu(x),
                   "compile": lambda: native_compiled(x)},
        reference=lambda: reference.geglu(x)[0],
    )


def geglu_bwd(t, i, dtype, threads):
    x, grad = randn(t, 2 * i, dtype=dtype), randn(t, i, dtype=dtype)
    gelu = npu.npu_geglu(x, -1, 1, False)[1]
    native_compiled = compiled(reference.native_geglu, x, threads=threads)
    return Timed(
        ours=lambda: npu.npu_geglu_grad(grad, x, gelu, -1, 1, False),
        baselines={"eager": autograd_backward(reference.native_geglu, (x,), grad),
                   "compile": autograd_backward(native_compiled, (x,), grad)},
        reference=lambda: reference_backward(lambda xf: reference.geglu(xf)[0], (x,), grad),
    )


def fast_gelu_fwd(t, h, dtype, threads):
    x = randn(t, h, dtype=dtype)
    native_compiled = compiled(reference.native_fast_gelu, x, threads=threads)
    return Timed(
        ours=lambda: npu.npu_fast_gelu(x),
        baselines={"eager": lambda: reference.native_fast_gelu(x),
                   "compile": lambda: native_compiled(x)},
        reference=lambda: reference.fast_gelu(x),
    )


def fast_gelu_bwd(t, h, dtype, threads):
    x, grad = randn(t, h, dtype=dtype), randn(t, h, dtype=dtype)
    native_compiled = compiled(reference.native_fast_gelu, x, threads=threads)
    return Timed(
        ours=lambda: npu.npu_fast_gelu_backward(grad, x),
        baselines={"eager": autograd_backward(reference.native_fast_gelu, (x,), grad),
                   "compile": autograd_backward(native_compiled, (x,), grad)},
        reference=lambda: reference.fast_gelu_backward(grad, x),
    )


def cases(quick: bool, dtypes):
    for (t, i), dtype in itertools.product(glu_shapes(quick), dtypes):
        e, shape = dtype.itemsize, f"T={t} I={i}"
        # In units of a [T, I] tensor: swiglu reads x (2) and writes out (1); its backward reads
        # grad (1) and x (2) and writes dx (2). geglu also writes gelu (1), which its grad reads.
        yield Case("swiglu", "fwd", shape, dtype, 3 * t * i * e,
                   functools.partial(swiglu_fwd, t, i, dtype), ("npu_swiglu",))
        yield Case("swiglu", "bwd", shape, dtype, 5 * t * i * e,
                   functools.partial(swiglu_bwd, t, i, dtype), ("npu_swiglu_backward",))
        yield Case("geglu", "fwd", shape, dtype, 4 * t * i * e,
                   functools.partial(geglu_fwd, t, i, dtype), ("npu_geglu",))
        yield Case("geglu", "bwd", shape, dtype, 6 * t * i * e,
                   functools.partial(geglu_bwd, t, i, dtype), ("npu_geglu", "npu_geglu_grad"))
    for (t, h), dtype in itertools.product(norm_shapes(quick), dtypes):
        e, shape = dtype.itemsize, f"T={t} H={h}"
        yield Case("fast_gelu", "fwd", shape, dtype, 2 * t * h * e,
                   functools.partial(fast_gelu_fwd, t, h, dtype), ("npu_fast_gelu",))
        yield Case("fast_gelu", "bwd", shape, dtype, 3 * t * h * e,
                   functools.partial(fast_gelu_bwd, t, h, dtype), ("npu_fast_gelu_backward",))
