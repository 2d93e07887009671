"""torch_npu's ATB ops as vllm-ascend calls them (torch.ops.atb): _npu_paged_attention (decode),
_npu_flash_attention (prefill) and _npu_rotary_embedding, against the native compositions a
model without the fused ops writes and torch.compile of them. (_npu_reshape_and_cache runs the
same copy plans as npu_scatter_pa_kv_cache: see the scatter_pa_kv_cache rows.)

Decode: 32 query / 8 kv heads, D = 128, block size 128, blocks shuffled; the native composition
gathers the blocks, repeats the kv heads and runs matmul / softmax / matmul. Prefill: 4 packed
sequences, 32 / 8 heads, a causal -inf mask; native is F.scaled_dot_product_attention per
sequence. Rope: vLLM's interleaved (GPT-J) rotary embedding in place on query and key.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from opennpu.testing.timing import compiled

from ..common import Case, Timed, randn

atb = torch.ops.atb
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 128
SCALE = 1.0 / math.sqrt(HEAD_DIM)
GROUP = HEADS // KV_HEADS


def native_paged(q, kc, vc, table):
    b = q.shape[0]
    kg = kc[table.long()].flatten(1, 2).transpose(1, 2).repeat_interleave(GROUP, 1)
    vg = vc[table.long()].flatten(1, 2).transpose(1, 2).repeat_interleave(GROUP, 1)
    s = (q.unsqueeze(2) @ kg.transpose(-1, -2)).float() * SCALE  # [B, N, 1, S]
    return (torch.softmax(s, -1).to(q.dtype) @ vg).reshape(b, HEADS, HEAD_DIM)


def paged(batch, ctx, dtype, threads):
    nb = batch * ctx // BLOCK
    q = randn(batch, HEADS, HEAD_DIM, dtype=dtype)
    kc = randn(nb, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    vc = randn(nb, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    table = torch.randperm(nb, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    out = torch.empty(batch, HEADS, HEAD_DIM, dtype=dtype)
    native_compiled = compiled(native_paged, q, kc, vc, table, threads=threads)

    def ours():
        atb._npu_paged_attention(q, kc, vc, KV_HEADS, HEADS, SCALE, table, lens, out)
        return out

    return Timed(ours=ours,
                 baselines={"eager": lambda: native_paged(q, kc, vc, table),
                            "compile": lambda: native_compiled(q, kc, vc, table)},
                 reference=lambda: native_paged(q.float(), kc.float(), vc.float(), table))


def native_prefill(q, k, v, lens):
    outs, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start:start + n].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=SCALE,
                                                   enable_gqa=True).transpose(0, 1))
        start += n
    return torch.cat(outs)


def prefill(seq, dtype, threads):
    lens = (seq,) * 4
    T = sum(lens)
    q = randn(T, HEADS, HEAD_DIM, dtype=dtype)
    k, v = randn(T, KV_HEADS, HEAD_DIM, dtype=dtype), randn(T, KV_HEADS, HEAD_DIM, dtype=dtype)
    mask = torch.triu(torch.full((seq, seq), float("-inf")), 1).to(dtype)
    seq_len = torch.tensor(lens, dtype=torch.int32)
    out = torch.empty(T, HEADS, HEAD_DIM, dtype=dtype)
    native_compiled = compiled(native_prefill, q, k, v, lens, threads=threads)

    def ours():
        atb._npu_flash_attention(q, k, v, mask, seq_len, SCALE, HEADS, KV_HEADS, out)
        return out

    return Timed(ours=ours,
                 baselines={"eager": lambda: native_prefill(q, k, v, lens),
                            "compile": lambda: native_compiled(q, k, v, lens)},
                 reference=lambda: native_prefill(q.float(), k.float(), v.float(), lens))


def native_rope(positions, query, key, cache):
    """vLLM's forward_native (GPT-J style), written back into query / key."""
    cos, sin = cache.index_select(0, positions).chunk(2, -1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for x in (query, key):
        h = x.view(x.shape[0], -1, HEAD_DIM).float()
        x1, x2 = h[..., ::2], h[..., 1::2]
        r = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
        x.copy_(r.reshape(x.shape))
    return query, key


def rope(tokens, dtype, threads):
    positions = torch.randint(0, 4096, (tokens,))
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    f = torch.outer(torch.arange(4096).float(), inv)
    cache = torch.cat([f.cos(), f.sin()], -1)
    q0, k0 = randn(tokens, HEADS * HEAD_DIM, dtype=dtype), randn(tokens, KV_HEADS * HEAD_DIM, dtype=dtype)
    q, k = q0.clone(), k0.clone()
    q2, k2, q3, k3 = q0.clone(), k0.clone(), q0.clone(), k0.clone()
    native_compiled = compiled(native_rope, positions, q3, k3, cache, threads=threads)

    def ours():  # rotates the same buffers on every call, as the baselines do
        atb._npu_rotary_embedding(positions, q, k, HEAD_DIM, cache, False)
        return q, k

    return Timed(ours=ours,
                 baselines={"eager": lambda: native_rope(positions, q2, k2, cache),
                            "compile": lambda: native_compiled(positions, q3, k3, cache)},
                 reference=None)


def cases(quick: bool, dtypes):
    for dtype in dtypes:
        e = dtype.itemsize
        for batch, ctx in ((8, 2048),) if quick else ((8, 2048), (32, 4096)):
            nbytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * e
            yield Case("atb_paged_attention", "fwd", f"B={batch} ctx={ctx} {HEADS}/{KV_HEADS}x{HEAD_DIM}",
                       dtype, nbytes, functools.partial(paged, batch, ctx, dtype),
                       ("atb::_npu_paged_attention",))
        for seq in (512,) if quick else (512, 2048):
            T = 4 * seq
            yield Case("atb_flash_attention", "fwd", f"4x{seq} tok {HEADS}/{KV_HEADS}x{HEAD_DIM} causal",
                       dtype, 2 * T * (HEADS + KV_HEADS) * HEAD_DIM * e,
                       functools.partial(prefill, seq, dtype), ("atb::_npu_flash_attention",),
                       flops=4 * 4 * seq * seq * HEADS * HEAD_DIM // 2)
        tokens = 2048
        yield Case("atb_rotary_embedding", "fwd", f"{tokens} tok {HEADS}+{KV_HEADS}x{HEAD_DIM}",
                   dtype, 2 * tokens * (HEADS + KV_HEADS) * HEAD_DIM * e,
                   functools.partial(rope, tokens, dtype), ("atb::_npu_rotary_embedding",))
