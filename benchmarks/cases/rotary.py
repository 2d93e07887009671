"""npu_rotary_mul ('half' mode), forward and backward, in the BSND and BNSD layouts; the inference
ropes npu_interleave_rope (DeepSeek's q_pe, decode) and npu_kv_rmsnorm_rope_cache (MLA's KV step
into a 'PA' cache, decode), against their native compositions.

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


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def native_interleave_rope(x, cos, sin):
    """The doc's formula in ATen ops, fp32 math, one rounding."""
    q = x.float().unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)
    return (q * cos.float() + _rotate_half(q) * sin.float()).to(x.dtype)


def interleave_rope_fwd(tokens, dtype, threads):
    x = randn(tokens, HEADS, 1, 64, dtype=dtype)
    cos, sin = randn(tokens, 1, 1, 64, dtype=dtype), randn(tokens, 1, 1, 64, dtype=dtype)
    native_compiled = compiled(native_interleave_rope, x, cos, sin, threads=threads)
    return Timed(
        ours=lambda: npu.npu_interleave_rope(x, cos, sin),
        baselines={"eager": lambda: native_interleave_rope(x, cos, sin),
                   "compile": lambda: native_compiled(x, cos, sin)},
        reference=lambda: native_interleave_rope(x.float(), cos.float(), sin.float()),
    )


def native_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, slots, k_cache, ckv_cache, eps=1e-5):
    """RMSNorm of kv[..., :512], interleave rope of kv[..., 512:], index_copy_ into 'PA' caches."""
    x = kv.float()
    c = x[..., :512]
    c = (c * torch.rsqrt(c.square().mean(-1, keepdim=True) + eps) * gamma.float()).to(kv.dtype)
    k = native_interleave_rope(kv[..., 512:], cos, sin)
    k_cache.view(-1, 64).index_copy_(0, slots, k.view(-1, 64))
    ckv_cache.view(-1, 512).index_copy_(0, slots, c.view(-1, 512))
    return k, c


def kv_rmsnorm_rope_cache_fwd(tokens, dtype, threads):
    kv = randn(tokens, 1, 1, 576, dtype=dtype)
    gamma = randn(512, dtype=dtype)
    cos, sin = randn(tokens, 1, 1, 64, dtype=dtype), randn(tokens, 1, 1, 64, dtype=dtype)
    blocks, block_size = 4 * tokens // 128 + 1, 128
    slots = torch.randperm(blocks * block_size)[:tokens]
    k_cache = torch.zeros(blocks, block_size, 1, 64, dtype=dtype)
    ckv_cache = torch.zeros(blocks, block_size, 1, 512, dtype=dtype)
    args = (kv, gamma, cos, sin, slots, k_cache, ckv_cache)
    native_compiled = compiled(native_kv_rmsnorm_rope_cache, *args, threads=threads)
    return Timed(
        ours=lambda: npu.npu_kv_rmsnorm_rope_cache(*args, cache_mode="PA")[2:],
        baselines={"eager": lambda: native_kv_rmsnorm_rope_cache(*args),
                   "compile": lambda: native_compiled(*args)},
        reference=lambda: native_kv_rmsnorm_rope_cache(
            kv.float(), gamma.float(), cos.float(), sin.float(), slots, k_cache.float(),
            ckv_cache.float()),
    )


def cases(quick: bool, dtypes):
    for tokens, dtype in itertools.product((256,) if quick else (256, 2048), dtypes):
        e = dtype.itemsize
        # interleave_rope reads x, cos, sin and writes out; kv_rmsnorm_rope_cache reads kv,
        # cos, sin and writes k, c and the two cache rows.
        yield Case("interleave_rope", "fwd", f"T={tokens} N={HEADS} D=64", dtype,
                   (2 * tokens * HEADS * 64 + 2 * tokens * 64) * e,
                   functools.partial(interleave_rope_fwd, tokens, dtype), ("npu_interleave_rope",))
        yield Case("kv_rmsnorm_rope_cache", "fwd", f"T={tokens} 512+64 PA", dtype,
                   (tokens * 576 * 3 + 2 * tokens * 64) * e,
                   functools.partial(kv_rmsnorm_rope_cache_fwd, tokens, dtype),
                   ("npu_kv_rmsnorm_rope_cache",))
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
