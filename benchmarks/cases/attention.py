"""npu_fusion_attention forward, backward and both, against the seed's native composition,
torch.compile of it, and F.scaled_dot_product_attention (PyTorch's CPU flash kernel).

B=1, N=32 query heads, D=128, BNSD, causal or not, and GQA with 8 key/value heads. The native
composition holds an Sq x Skv score matrix per head, so it is skipped where that needs more than
a few GB (S=8192); benchmarks/attention_memory.py measures the peak memory of each.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F
from opennpu.testing import reference
from opennpu.testing.timing import autograd_backward, compiled

from ..common import Case, Timed, randn

BATCH, HEADS, HEAD_DIM = 1, 32, 128
SCALE = 1.0 / math.sqrt(HEAD_DIM)
NATIVE_MAX_SCORE_BYTES = 4.5e9  # the native composition's fp32 score matrix must fit twice
npu = torch.ops.npu


def _causal_mask(s):
    return torch.ones(s, s, dtype=torch.bool).triu(1)


def native_attention(q, k, v, mask):
    """The seed's TorchFlashAttention composition (BNSD in and out), GQA by repeating kv heads."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return reference.native_flash_attention_seed(q, k, v, mask, scale=SCALE, layout="BNSD")


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=SCALE,
                                          enable_gqa=k.shape[1] != q.shape[1])


def ours_forward(q, k, v, causal):
    # Causal: sparse_mode 2 with torch_npu's compressed 2048 x 2048 mask (not read).
    mask = _causal_mask(2048) if causal else None
    return npu.npu_fusion_attention(q, k, v, HEADS, "BNSD", atten_mask=mask, scale=SCALE,
                                    sparse_mode=2 if causal else 0)


def _inputs(s, kv_heads, dtype):
    q = randn(BATCH, HEADS, s, HEAD_DIM, dtype=dtype)
    k = randn(BATCH, kv_heads, s, HEAD_DIM, dtype=dtype)
    v = randn(BATCH, kv_heads, s, HEAD_DIM, dtype=dtype)
    return q, k, v


def _native_fits(s):
    return BATCH * HEADS * s * s * 4 <= NATIVE_MAX_SCORE_BYTES


def _oracle(q, k, v, causal):
    """fp32 SDPA as the error oracle (float64 would be too slow at these sizes)."""
    if q.shape[2] > 2048:
        return None
    return lambda: sdpa(q.float(), k.float(), v.float(), causal)


def attention_fwd(s, kv_heads, causal, dtype, threads):
    q, k, v = _inputs(s, kv_heads, dtype)
    mask = _causal_mask(s) if causal else None
    baselines = {}
    if _native_fits(s):
        native_compiled = compiled(native_attention, q, k, v, mask, threads=threads)
        baselines["eager"] = lambda: native_attention(q, k, v, mask)
        baselines["compile"] = lambda: native_compiled(q, k, v, mask)
    baselines["sdpa"] = lambda: sdpa(q, k, v, causal)
    return Timed(ours=lambda: ours_forward(q, k, v, causal)[0], baselines=baselines,
                 reference=_oracle(q, k, v, causal))


def attention_bwd(s, kv_heads, causal, dtype, threads):
    q, k, v = _inputs(s, kv_heads, dtype)
    mask = _causal_mask(s) if causal else None
    out, smax, ssum, *_ = ours_forward(q, k, v, causal)
    dy = randn(*out.shape, dtype=dtype)
    compressed = _causal_mask(2048) if causal else None

    def ours():
        return npu.npu_fusion_attention_grad(
            q, k, v, dy, HEADS, "BNSD", atten_mask=compressed, softmax_max=smax, softmax_sum=ssum,
            attention_in=out, scale_value=SCALE, sparse_mode=2 if causal else 0)[:3]

    baselines = {}
    if _native_fits(s):
        native_compiled = compiled(native_attention, q, k, v, mask, threads=threads)
        baselines["eager"] = autograd_backward(lambda *t: native_attention(*t, mask), (q, k, v), dy)
        baselines["compile"] = autograd_backward(lambda *t: native_compiled(*t, mask), (q, k, v), dy)
    baselines["sdpa"] = autograd_backward(lambda *t: sdpa(*t, causal), (q, k, v), dy)
    oracle = None
    if s <= 2048:
        oracle = autograd_backward(lambda *t: sdpa(*(x.float() for x in t), causal), (q, k, v), dy)
    return Timed(ours=ours, baselines=baselines, reference=oracle)


def attention_both(s, kv_heads, causal, dtype, threads):
    """Forward and backward through autograd, as a training step runs them."""
    q, k, v = (t.requires_grad_() for t in _inputs(s, kv_heads, dtype))
    mask = _causal_mask(s) if causal else None
    dy = randn(BATCH, HEADS, s, HEAD_DIM, dtype=dtype)

    def step(fn):
        def run():
            out = fn(q, k, v)
            return torch.autograd.grad(out, (q, k, v), dy)
        return run

    baselines = {}
    if _native_fits(s):
        native_compiled = compiled(native_attention, q, k, v, mask, threads=threads)
        baselines["eager"] = step(lambda *t: native_attention(*t, mask))
        baselines["compile"] = step(lambda *t: native_compiled(*t, mask))
    baselines["sdpa"] = step(lambda *t: sdpa(*t, causal))
    return Timed(ours=step(lambda *t: ours_forward(*t, causal)[0]), baselines=baselines,
                 reference=None)


def cases(quick: bool, dtypes):
    seqs = (1024, 2048) if quick else (1024, 2048, 4096, 8192)
    for s, kv_heads, causal, dtype in itertools.product(seqs, (HEADS, 8), (False, True), dtypes):
        shape = f"S={s} N={HEADS}/{kv_heads} D={HEAD_DIM}{' causal' if causal else ''}"
        e = dtype.itemsize
        qo_bytes, kv_bytes = BATCH * HEADS * s * HEAD_DIM * e, BATCH * kv_heads * s * HEAD_DIM * e
        # FLOPs of the two forward GEMMs (the backward does 2.5x that); halved under a causal mask.
        fwd_flops = 4 * BATCH * HEADS * s * s * HEAD_DIM // (2 if causal else 1)
        args = (s, kv_heads, causal, dtype)
        need = ("npu_fusion_attention", "npu_fusion_attention_grad")
        yield Case("attention", "fwd", shape, dtype, 2 * qo_bytes + 2 * kv_bytes,
                   functools.partial(attention_fwd, *args), need[:1], fwd_flops)
        yield Case("attention", "bwd", shape, dtype, 5 * qo_bytes + 4 * kv_bytes,
                   functools.partial(attention_bwd, *args), need, fwd_flops * 5 // 2)
        yield Case("attention", "f+b", shape, dtype, 6 * qo_bytes + 4 * kv_bytes,
                   functools.partial(attention_both, *args), need, fwd_flops * 7 // 2)
