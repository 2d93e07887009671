"""npu_fused_infer_attention_score decode (one query row per sequence) over a paged KV cache,
against F.scaled_dot_product_attention on the same cache gathered to [B, N, S, D] (gather not
timed) and torch.compile of the native composition (gather + matmul + softmax + matmul).

32 query heads / 8 kv heads, D=128, block size 128, blocks shuffled. Decode reads the whole
cache once, so the effective bytes are K + V (+ q and out) and the bandwidth fraction against
the copy roof is the figure of merit.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import torch.nn.functional as F

from ..common import Case, Timed, randn

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 128
SCALE = 1.0 / math.sqrt(HEAD_DIM)
npu = torch.ops.npu


def _inputs(batch, ctx, dtype):
    blocks_per_seq = ctx // BLOCK
    nb = batch * blocks_per_seq
    q = randn(batch, 1, HEADS * HEAD_DIM, dtype=dtype)
    k = randn(nb, BLOCK, KV_HEADS * HEAD_DIM, dtype=dtype)
    v = randn(nb, BLOCK, KV_HEADS * HEAD_DIM, dtype=dtype)
    table = torch.randperm(nb, dtype=torch.int32).view(batch, blocks_per_seq)
    return q, k, v, table


def _gathered(k, table):
    b = table.shape[0]
    return k[table.long()].view(b, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)


def native(q, k, v, table):
    """Gather + GQA repeat + matmul / softmax / matmul, as a model without the fused op does."""
    b = q.shape[0]
    qh = q.view(b, 1, HEADS, HEAD_DIM).transpose(1, 2)
    kg = _gathered(k, table).repeat_interleave(HEADS // KV_HEADS, 1)
    vg = _gathered(v, table).repeat_interleave(HEADS // KV_HEADS, 1)
    p = torch.softmax((qh @ kg.transpose(-1, -2)).float() * SCALE, dim=-1).to(q.dtype)
    return (p @ vg).transpose(1, 2).reshape(b, 1, -1)


def decode(batch, ctx, dtype, threads):
    from opennpu.testing.timing import compiled

    q, k, v, table = _inputs(batch, ctx, dtype)
    lens = [ctx] * batch
    qh = q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    kg, vg = _gathered(k, table).contiguous(), _gathered(v, table).contiguous()
    native_compiled = compiled(native, q, k, v, table, threads=threads)

    def ours():
        return npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=HEADS, num_key_value_heads=KV_HEADS, input_layout="BSH",
            scale=SCALE, block_table=table, block_size=BLOCK, actual_seq_lengths_kv=lens)[0]

    def sdpa():
        return F.scaled_dot_product_attention(qh, kg, vg, scale=SCALE, enable_gqa=True)

    baselines = {"sdpa": sdpa, "compile": lambda: native_compiled(q, k, v, table)}
    if batch * ctx <= 8 * 4096:
        baselines["eager"] = lambda: native(q, k, v, table)
    return Timed(ours=lambda: ours().view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2),
                 baselines={name: (lambda f=f: f().reshape(batch, 1, HEADS, HEAD_DIM)
                                   .transpose(1, 2)) for name, f in baselines.items()},
                 reference=lambda: F.scaled_dot_product_attention(
                     qh.float(), kg.float(), vg.float(), scale=SCALE, enable_gqa=True))


def cases(quick: bool, dtypes):
    shapes = ((8, 4096), (32, 4096)) if quick else ((8, 4096), (8, 16384), (32, 4096), (32, 16384))
    for (batch, ctx), dtype in itertools.product(shapes, dtypes):
        e = dtype.itemsize
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * e
        qo_bytes = 2 * batch * HEADS * HEAD_DIM * e
        shape = f"decode B={batch} ctx={ctx} N={HEADS}/{KV_HEADS} D={HEAD_DIM} paged"
        yield Case("infer_attention", "fwd", shape, dtype, kv_bytes + qo_bytes,
                   functools.partial(decode, batch, ctx, dtype),
                   ("npu_fused_infer_attention_score",))
