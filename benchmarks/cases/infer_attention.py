"""npu_fused_infer_attention_score decode (one query row per sequence) over a paged KV cache,
against F.scaled_dot_product_attention on the same cache gathered to [B, N, S, D] (gather not
timed) and torch.compile of the native composition (gather + matmul + softmax + matmul); and over
a contiguous cache (BNSD [B, KVN, S, D] and BSH [B, S, KVN * D]), against SDPA reading that cache
in place (BSH as a strided [B, KVN, S, D] view) and torch.compile of the native composition.

32 query heads / 8 kv heads, D=128, block size 128, blocks shuffled. Decode reads the whole
cache once, so the effective bytes are K + V (+ q and out) and the bandwidth fraction against
the copy roof is the figure of merit (target: 80% fp32, 65% bf16, and 1.5x SDPA). The shapes go
from batch 8 to 64 and context 4k to 32k; the eager / compiled native compositions repeat every
kv head for its group (4x the cache), so they run only where that fits the 24 GiB machines
(and eager only at the smallest shapes), and the largest fp32 cache is skipped where the gathered
copy SDPA needs would not fit.

The int8 case (KV-cache antiquant, per-channel key and value factors with offsets) reads half the
bytes: it is timed against our own fp16/bf16-cache decode on the same values ("float_kv"), the
dequantise-then-attention composition (gather + (x + offset) * scale + matmul / softmax / matmul)
eagerly and under torch.compile.
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

    def ours():
        return npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=HEADS, num_key_value_heads=KV_HEADS, input_layout="BSH",
            scale=SCALE, block_table=table, block_size=BLOCK, actual_seq_lengths_kv=lens)[0]

    def sdpa():
        return F.scaled_dot_product_attention(qh, kg, vg, scale=SCALE, enable_gqa=True)

    baselines = {"sdpa": sdpa}
    if 2 * k.numel() * k.element_size() * HEADS // KV_HEADS <= _NATIVE_BYTES:
        native_compiled = compiled(native, q, k, v, table, threads=threads)
        baselines["compile"] = lambda: native_compiled(q, k, v, table)
    if batch * ctx <= 8 * 4096:
        baselines["eager"] = lambda: native(q, k, v, table)
    return Timed(ours=lambda: ours().view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2),
                 baselines={name: (lambda f=f: f().reshape(batch, 1, HEADS, HEAD_DIM)
                                   .transpose(1, 2)) for name, f in baselines.items()},
                 reference=lambda: F.scaled_dot_product_attention(
                     qh.float(), kg.float(), vg.float(), scale=SCALE, enable_gqa=True))


def _dequant(k8, scale, offset):
    """[nb, bs, KVN * D] int8 -> (x + offset) * scale in fp32 (per-channel [KVN * D] factors)."""
    return (k8.float() + offset) * scale


def native_int8(q, k8, v8, ks, ko, vs, vo, table):
    """Dequantise the gathered blocks, then the native attention composition (fp32 scores)."""
    kg, vg = k8[table.long()], v8[table.long()]
    k, v = _dequant(kg, ks, ko).to(q.dtype), _dequant(vg, vs, vo).to(q.dtype)
    flat = table.new_tensor(range(table.numel())).view(table.shape)
    return native(q, k.flatten(0, 1), v.flatten(0, 1), flat)


def decode_int8(batch, ctx, dtype, threads):
    from opennpu.testing.timing import compiled

    q, k, v, table = _inputs(batch, ctx, dtype)
    h = KV_HEADS * HEAD_DIM
    ks, vs = torch.rand(h) * 0.02 + 0.01, torch.rand(h) * 0.02 + 0.01
    ko, vo = torch.randn(h), torch.randn(h)
    k8 = torch.randint(-128, 128, k.shape, dtype=torch.int8)
    v8 = torch.randint(-128, 128, v.shape, dtype=torch.int8)
    kf, vf = _dequant(k8, ks, ko).to(dtype), _dequant(v8, vs, vo).to(dtype)  # the float cache
    lens = [ctx] * batch
    native_compiled = compiled(native_int8, q, k8, v8, ks, ko, vs, vo, table, threads=threads)
    kw = dict(num_heads=HEADS, num_key_value_heads=KV_HEADS, input_layout="BSH", scale=SCALE,
              block_table=table, block_size=BLOCK, actual_seq_lengths_kv=lens)

    def ours():
        return npu.npu_fused_infer_attention_score(
            q, k8, v8, key_antiquant_scale=ks.to(dtype), key_antiquant_offset=ko.to(dtype),
            value_antiquant_scale=vs.to(dtype), value_antiquant_offset=vo.to(dtype), **kw)[0]

    baselines = {"float_kv": lambda: npu.npu_fused_infer_attention_score(q, kf, vf, **kw)[0],
                 "compile": lambda: native_compiled(q, k8, v8, ks, ko, vs, vo, table)}
    if batch * ctx <= 8 * 4096:
        baselines["eager"] = lambda: native_int8(q, k8, v8, ks, ko, vs, vo, table)
    # factors rounded to dtype, as ours receives them
    ks, ko, vs, vo = (t.to(dtype).float() for t in (ks, ko, vs, vo))
    qh = q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    kd = _gathered(_dequant(k8, ks, ko), table)
    vd = _gathered(_dequant(v8, vs, vo), table)
    shape = (batch, 1, HEADS, HEAD_DIM)
    return Timed(ours=lambda: ours().view(shape).transpose(1, 2),
                 baselines={name: (lambda f=f: f().reshape(shape).transpose(1, 2))
                            for name, f in baselines.items()},
                 reference=lambda: F.scaled_dot_product_attention(
                     qh.float(), kd, vd, scale=SCALE, enable_gqa=True))


def _quantise(o, qs):
    """int8 post-quantisation of [B, 1, H] outputs with per-channel [H] factors (fp32 -> fp16 ->
    int8, half to even, saturated)."""
    return (o.float() * qs).half().float().round().clamp(-128, 127).to(torch.int8)


def native_int8_out(q, k, v, table, qs):
    return _quantise(native(q, k, v, table), qs)


def decode_int8_out(batch, ctx, dtype, threads):
    """Decode with an int8 output (quant_scale2 per channel) against our float-output decode
    followed by a separate quantisation, and the native composition + quantisation compiled."""
    from opennpu.testing.timing import compiled

    q, k, v, table = _inputs(batch, ctx, dtype)
    qs = torch.rand(HEADS * HEAD_DIM) * 100 + 20
    kw = dict(num_heads=HEADS, num_key_value_heads=KV_HEADS, input_layout="BSH", scale=SCALE,
              block_table=table, block_size=BLOCK, actual_seq_lengths_kv=[ctx] * batch)
    native_compiled = compiled(native_int8_out, q, k, v, table, qs, threads=threads)
    baselines = {
        "float_out_then_quantise": lambda: _quantise(
            npu.npu_fused_infer_attention_score(q, k, v, **kw)[0], qs),
        "compile": lambda: native_compiled(q, k, v, table, qs)}
    if batch * ctx <= 8 * 4096:
        baselines["eager"] = lambda: native_int8_out(q, k, v, table, qs)
    qh = q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2)
    kg, vg = _gathered(k, table).float(), _gathered(v, table).float()
    return Timed(
        ours=lambda: npu.npu_fused_infer_attention_score(q, k, v, quant_scale2=qs, **kw)[0],
        baselines=baselines,
        reference=lambda: _quantise(F.scaled_dot_product_attention(
            qh.float(), kg, vg, scale=SCALE, enable_gqa=True).transpose(1, 2).reshape(batch, 1, -1),
            qs))


def _contiguous_inputs(batch, ctx, dtype, layout):
    q = randn(batch, 1, HEADS * HEAD_DIM, dtype=dtype)
    if layout == "BNSD":
        k = randn(batch, KV_HEADS, ctx, HEAD_DIM, dtype=dtype)
        v = randn(batch, KV_HEADS, ctx, HEAD_DIM, dtype=dtype)
        return q.view(batch, 1, HEADS, HEAD_DIM).transpose(1, 2).contiguous(), k, v
    k = randn(batch, ctx, KV_HEADS * HEAD_DIM, dtype=dtype)
    v = randn(batch, ctx, KV_HEADS * HEAD_DIM, dtype=dtype)
    return q, k, v


def _heads(t, layout, heads):
    """[B, heads, S, D] view of a BNSD or BSH tensor."""
    if layout == "BNSD":
        return t
    return t.view(t.shape[0], t.shape[1], heads, HEAD_DIM).transpose(1, 2)


def native_contiguous(q, k, v, layout):
    """GQA repeat + matmul / softmax / matmul over a BNSD or BSH cache."""
    qh = _heads(q, layout, HEADS)
    kg = _heads(k, layout, KV_HEADS).repeat_interleave(HEADS // KV_HEADS, 1)
    vg = _heads(v, layout, KV_HEADS).repeat_interleave(HEADS // KV_HEADS, 1)
    p = torch.softmax((qh @ kg.transpose(-1, -2)).float() * SCALE, dim=-1).to(q.dtype)
    return p @ vg  # [B, N, 1, D]


def decode_contiguous(batch, ctx, dtype, layout, threads):
    from opennpu.testing.timing import compiled

    q, k, v = _contiguous_inputs(batch, ctx, dtype, layout)
    lens = [ctx] * batch
    qh, kh, vh = _heads(q, layout, HEADS), _heads(k, layout, KV_HEADS), _heads(v, layout, KV_HEADS)
    kv_bytes = 2 * k.numel() * k.element_size()
    native = functools.partial(native_contiguous, layout=layout)

    def ours():
        out = npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=HEADS, num_key_value_heads=KV_HEADS, input_layout=layout,
            scale=SCALE, actual_seq_lengths_kv=lens)[0]
        return _heads(out, layout, HEADS)

    baselines = {"sdpa": lambda: F.scaled_dot_product_attention(qh, kh, vh, scale=SCALE,
                                                                enable_gqa=True)}
    if kv_bytes * HEADS // KV_HEADS <= _NATIVE_BYTES:
        native_compiled = compiled(native, q, k, v, threads=threads)
        baselines["compile"] = lambda: native_compiled(q, k, v)
    if batch * ctx <= 8 * 4096:
        baselines["eager"] = lambda: native(q, k, v)
    return Timed(ours=ours, baselines=baselines,
                 reference=lambda: F.scaled_dot_product_attention(
                     qh.float(), kh.float(), vh.float(), scale=SCALE, enable_gqa=True))


# The native compositions' repeated K and V (bytes) that a case may allocate, and the largest
# cache (bytes, K + V) a paged case holds beside its gathered copy.
_NATIVE_BYTES = 2 << 30
_PAGED_BYTES = 3 << 30


def decode_shapes(quick: bool):
    """(batch, context) of the decode cases."""
    if quick:
        return ((8, 4096), (32, 4096))
    return ((8, 4096), (64, 4096), (8, 32768), (32, 16384))


def cases(quick: bool, dtypes):
    shapes = decode_shapes(quick)
    for (batch, ctx), dtype in itertools.product(shapes, dtypes):
        e = dtype.itemsize
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * e
        qo_bytes = 2 * batch * HEADS * HEAD_DIM * e
        if kv_bytes <= _PAGED_BYTES:
            shape = f"decode B={batch} ctx={ctx} N={HEADS}/{KV_HEADS} D={HEAD_DIM} paged"
            yield Case("infer_attention", "fwd", shape, dtype, kv_bytes + qo_bytes,
                       functools.partial(decode, batch, ctx, dtype),
                       ("npu_fused_infer_attention_score",))
        for layout in ("BNSD", "BSH"):
            shape = f"decode B={batch} ctx={ctx} N={HEADS}/{KV_HEADS} D={HEAD_DIM} {layout}"
            yield Case("infer_attention", "fwd", shape, dtype, kv_bytes + qo_bytes,
                       functools.partial(decode_contiguous, batch, ctx, dtype, layout),
                       ("npu_fused_infer_attention_score",))
    for (batch, ctx), dtype in itertools.product(shapes, dtypes):
        if dtype not in (torch.float16, torch.bfloat16):
            continue
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM  # int8
        qo_bytes = 2 * batch * HEADS * HEAD_DIM * dtype.itemsize
        shape = f"decode int8 KV B={batch} ctx={ctx} N={HEADS}/{KV_HEADS} D={HEAD_DIM} paged"
        yield Case("infer_attention", "fwd", shape, dtype, kv_bytes + qo_bytes,
                   functools.partial(decode_int8, batch, ctx, dtype),
                   ("npu_fused_infer_attention_score",))
    for (batch, ctx), dtype in itertools.product(shapes[:1], dtypes):
        if dtype not in (torch.float16, torch.bfloat16):
            continue
        kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * dtype.itemsize
        qo_bytes = batch * HEADS * HEAD_DIM * (dtype.itemsize + 1)  # int8 out
        shape = f"decode int8 out B={batch} ctx={ctx} N={HEADS}/{KV_HEADS} D={HEAD_DIM} paged"
        yield Case("infer_attention", "fwd", shape, dtype, kv_bytes + qo_bytes,
                   functools.partial(decode_int8_out, batch, ctx, dtype),
                   ("npu_fused_infer_attention_score",))
