"""npu_ffn, dense: x [T, H] through W1 [H, I] (fastgelu, seed 002's activation) and W2 [I, H].

Compute-bound, so rows report GFLOP/s (4 T H I flops) instead of bandwidth. Peers: the native
composition (``act(x @ W1) @ W2`` in the input dtype) and torch.compile of it, plus "gemms", the
two GEMMs alone in the same dtype (``(x @ W1) @ W2``, ATen's matmul; for int8 two
``torch._int_mm`` calls), whose time the fused op should stay within 1.1x of. int8 rows (the
quantised path) also time our own float32 op on the same shape ("fp32").
"""

from __future__ import annotations

import functools
import itertools

import torch
from opennpu.testing import reference
from opennpu.testing.timing import compiled

from ..common import Case, Timed, randn

ACTIVATION = "fastgelu"
npu = torch.ops.npu


def shapes(quick: bool):
    """(T, H, I)."""
    tokens = (128, 1024) if quick else (128, 1024, 4096)
    sizes = ((4096, 11008),) if quick else ((4096, 11008), (4096, 14336))
    return [(t, h, i) for (h, i), t in itertools.product(sizes, tokens)]


def native_ffn(x, w1, w2):
    return reference.native_ffn(x, w1, w2, ACTIVATION)


def two_gemms(x, w1, w2):
    return (x @ w1) @ w2


def _reference(t, x, w1, w2, **kwargs):
    """fp32 oracle (fp64 would take minutes); skipped at T=4096, where it would too."""
    if t > 1024:
        return None
    return lambda: reference.ffn(x, w1, w2, ACTIVATION, compute_dtype=torch.float32, **kwargs)


def ffn_float(t, h, i, dtype, threads):
    x = randn(t, h, dtype=dtype)
    w1 = (torch.randn(h, i) / h ** 0.5).to(dtype)
    w2 = (torch.randn(i, h) / i ** 0.5).to(dtype)
    native_compiled = compiled(native_ffn, x, w1, w2, threads=threads)
    return Timed(
        ours=lambda: npu.npu_ffn(x, w1, w2, ACTIVATION),
        baselines={"eager": lambda: native_ffn(x, w1, w2),
                   "compile": lambda: native_compiled(x, w1, w2),
                   "gemms": lambda: two_gemms(x, w1, w2)},
        reference=_reference(t, x, w1, w2),
    )


def ffn_int8(t, h, i, dtype, threads):
    x = torch.randint(-128, 128, (t, h), dtype=torch.int8)
    w1 = torch.randint(-128, 128, (h, i), dtype=torch.int8)
    w2 = torch.randint(-128, 128, (i, h), dtype=torch.int8)
    quant = dict(scale=torch.tensor([30.0]), offset=torch.tensor([0.0]),
                 deq_scale1=torch.full((i,), 2.0 / (128 * 128 * h ** 0.5)),
                 deq_scale2=torch.full((h,), 2.0 / (128 * 128 * i ** 0.5)))  # fp16 output
    h8 = torch.randint(-128, 128, (t, i), dtype=torch.int8)  # an int8 intermediate
    xf, w1f, w2f = x.float(), w1.float() / h ** 0.5, w2.float() / i ** 0.5
    return Timed(
        ours=lambda: npu.npu_ffn(x, w1, w2, ACTIVATION, **quant),
        baselines={"gemms": lambda: (torch._int_mm(x, w1), torch._int_mm(h8, w2)),
                   "fp32": lambda: npu.npu_ffn(xf, w1f, w2f, ACTIVATION)},
        reference=None,  # the quantised result is checked in tests/ops/test_ffn.py
    )


def cases(quick: bool, dtypes):
    for (t, h, i), dtype in itertools.product(shapes(quick), dtypes):
        yield Case("ffn", "fwd", f"T={t} H={h} I={i}", dtype, 0,
                   functools.partial(ffn_float, t, h, i, dtype), ("npu_ffn",), 4 * t * h * i)
    for t, h, i in shapes(quick):
        yield Case("ffn", "fwd", f"T={t} H={h} I={i} int8", torch.int8, 0,
                   functools.partial(ffn_int8, t, h, i, torch.int8), ("npu_ffn",), 4 * t * h * i)
