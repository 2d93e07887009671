"""npu_fused_infer_attention_score (+ .out, workspace, infer_output) and _v2 against a plain
float64 reference: the cache gathered per sequence, masked softmax, per layout, dtype, GQA, paged
and contiguous caches, decode and prefill."""

from __future__ import annotations

import math

import pytest
import torch

import opennpu
from opennpu.testing.tolerances import assert_close

from op_helpers import dtype_id, opcheck

npu = torch.ops.npu
MAX = 2147483647
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- reference


def _to_bnsd(t, layout, heads):
    """[B, N, S, D] (or [T, N, D] for TND/NTD) of a tensor in `layout`."""
    if layout == "BSH":
        return t.unflatten(2, (heads, t.shape[2] // heads)).transpose(1, 2)
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "NSD":
        return t.unsqueeze(0)
    if layout == "NTD":
        return t.transpose(0, 1)
    return t  # BNSD, TND


def _from_bnsd(t, layout):
    if layout == "BSH":
        return t.transpose(1, 2).flatten(2)
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "NBSD":
        return t.transpose(0, 1)
    if layout == "NSD":
        return t.squeeze(0)
    if layout == "NTD":
        return t.transpose(0, 1)
    return t


def _cache_rows(cache, heads, block_table, b, length):
    """[heads, length, D] rows of sequence b from a paged cache ([nb, bs, H] or [nb, N, bs, D])."""
    c = cache.unflatten(2, (heads, -1)) if cache.dim() == 3 else cache.transpose(1, 2)
    bs = c.shape[1]
    ids = block_table[b, :(length + bs - 1) // bs].long()
    return c[ids].flatten(0, 1)[:length].transpose(0, 1)


def reference(q, k, v, *, n, kvn=0, scale=1.0, layout="BSH", seq=None, seq_kv=None,
              block_table=None, atten_mask=None, sparse_mode=0, pre=MAX, nxt=MAX, q_rope=None,
              k_rope=None, sink=None, pse=None):
    """(attention_out, lse) in float64 following the documented semantics."""
    kvn = kvn or n
    lin, lout = opennpu.ops.infer_attention.LAYOUTS[layout]
    varlen = lin in ("TND", "NTD")
    qc = _to_bnsd(q.double(), lin, n)
    qrc = _to_bnsd(q_rope.double(), lin, n) if q_rope is not None else None
    paged = block_table is not None
    if varlen:
        ends = list(seq)
        starts = [0] + ends[:-1]
        B = len(ends)
        qlens = [e - s for s, e in zip(starts, ends)]
        out = torch.zeros(qc.shape[0], n, v.shape[-1] if not (paged and v.dim() == 3) else
                          v.shape[-1] // kvn, dtype=torch.float64)
        lse = torch.full((qc.shape[0], n, 1), -math.inf, dtype=torch.float64)
    else:
        B, S = qc.shape[0], qc.shape[2]
        qlens = [S] * B if seq is None or S == 1 else [seq[0] if len(seq) == 1 else seq[b]
                                                       for b in range(B)]
        dv = (v.shape[-1] // kvn) if (paged and v.dim() == 3) or (not paged and lin == "BSH") \
            else v.shape[-1]
        out = torch.zeros(B, n, S, dv, dtype=torch.float64)
        lse = torch.full((B, n, S, 1), -math.inf, dtype=torch.float64)
    if not paged:
        kc, vc = _to_bnsd(k.double(), lin, kvn), _to_bnsd(v.double(), lin, kvn)
        krc = _to_bnsd(k_rope.double(), lin, kvn) if k_rope is not None else None
        if varlen:
            kv_ends = list(seq_kv)
            kv_starts = [0] + kv_ends[:-1]
            kvlens = [e - s for s, e in zip(kv_starts, kv_ends)]
        else:
            full = kc.shape[2]
            kvlens = [full] * B if seq_kv is None else [seq_kv[0] if len(seq_kv) == 1 else
                                                       seq_kv[b] for b in range(B)]
    else:
        kvlens = [seq_kv[0] if len(seq_kv) == 1 else seq_kv[b] for b in range(B)]
    decode = max(qlens) <= 1 and (varlen or qc.shape[2] == 1)
    ignore_sparse = decode and q_rope is None
    g = n // kvn
    for b in range(B):
        sq, skv = qlens[b], kvlens[b]
        if sq == 0 or (skv == 0 and sink is None):
            continue  # zeros, lse -inf
        if varlen:
            qb = qc[starts[b]:starts[b] + sq].transpose(0, 1)
            qrb = qrc[starts[b]:starts[b] + sq].transpose(0, 1) if qrc is not None else None
        else:
            qb = qc[b, :, :sq]
            qrb = qrc[b, :, :sq] if qrc is not None else None
        if paged:
            kb = _cache_rows(k.double(), kvn, block_table, b, skv)
            vb = _cache_rows(v.double(), kvn, block_table, b, skv)
            krb = _cache_rows(k_rope.double(), kvn, block_table, b, skv) if k_rope is not None \
                else None
        elif varlen:
            sl = slice(kv_starts[b], kv_starts[b] + skv)
            kb, vb = kc[sl].transpose(0, 1), vc[sl].transpose(0, 1)
            krb = krc[sl].transpose(0, 1) if krc is not None else None
        else:
            kb, vb = kc[b, :, :skv], vc[b, :, :skv]
            krb = krc[b, :, :skv] if krc is not None else None
        kb, vb = kb.repeat_interleave(g, 0), vb.repeat_interleave(g, 0)
        s = qb @ kb.transpose(-1, -2)
        if qrb is not None:
            s = s + qrb @ krb.repeat_interleave(g, 0).transpose(-1, -2)
        s = s * scale
        if pse is not None:
            s = s + pse.double()[b if pse.shape[0] > 1 else 0, :, :sq, :skv]
        i = torch.arange(sq).unsqueeze(1)
        j = torch.arange(skv).unsqueeze(0)
        visible = torch.ones(sq, skv, dtype=torch.bool)
        if not ignore_sparse:
            if sparse_mode == 0 and atten_mask is not None:
                visible &= (j >= i - pre) & (j <= i + nxt)
            elif sparse_mode == 2:
                visible &= j <= i
            elif sparse_mode == 3:
                visible &= j <= i + skv - sq
            elif sparse_mode == 4:
                visible &= (j >= i + skv - sq - pre) & (j <= i + skv - sq + nxt)
        # modes 2-4 describe the mask by the mode (the tensor is a compressed placeholder), also
        # in decode, where the mode itself is ignored
        if atten_mask is not None and sparse_mode in (0, 1):
            m = atten_mask.bool()
            if decode and m.dim() == 2 and not varlen:
                mb = m[b if m.shape[0] > 1 else 0].unsqueeze(0)
            elif m.dim() == 2:
                mb = m
            elif m.dim() == 3:
                mb = m[b if m.shape[0] > 1 else 0]
            else:
                mb = m[b if m.shape[0] > 1 else 0, 0]
            visible &= ~mb[:sq, :skv] if mb.shape[0] > 1 else ~mb[:1, :skv]
        s = s.masked_fill(~visible, -math.inf)
        if sink is not None:
            s = torch.cat([s, sink.double().view(n, 1, 1).expand(n, sq, 1)], -1)
            vb = torch.cat([vb, vb.new_zeros(n, 1, vb.shape[-1])], 1)
        mx = s.amax(-1, keepdim=True)
        mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
        e = torch.exp(s - mx)
        tot = e.sum(-1, keepdim=True)
        ob = torch.where(tot > 0, (e @ vb) / tot, torch.zeros(()))
        lb = torch.log(tot) + mx
        if varlen:
            out[starts[b]:starts[b] + sq] = ob.transpose(0, 1)
            lse[starts[b]:starts[b] + sq] = lb.transpose(0, 1)
        else:
            out[b, :, :sq] = ob
            lse[b, :, :sq] = lb
    return _from_bnsd(out, lout if not varlen else lout), lse


def check(out, lse, ref, dtype, lse_flag=True):
    ro, rl = ref
    assert out.dtype == dtype and out.shape == ro.shape, (out.dtype, out.shape, ro.shape)
    assert_close(out, ro, dtype=dtype, scale=2)
    if lse_flag:
        assert lse.dtype == torch.float32 and lse.shape == rl.shape, (lse.shape, rl.shape)
        lse_dtype = torch.float32 if dtype == torch.float64 else dtype  # lse is float32
        assert_close(lse, rl, dtype=lse_dtype, scale=4)
    else:
        assert lse.shape == (1,) and lse.dtype == torch.float32


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def make(layout, B, N, KVN, Sq, Skv, D, dtype, Dv=None):
    Dv = Dv or D
    lin = opennpu.ops.infer_attention.LAYOUTS[layout][0]
    shape = {"BSH": lambda h, s, d: (B, s, h * d), "BSND": lambda h, s, d: (B, s, h, d),
             "BNSD": lambda h, s, d: (B, h, s, d), "NSD": lambda h, s, d: (h, s, d)}[lin]
    return rnd(*shape(N, Sq, D), dtype=dtype), rnd(*shape(KVN, Skv, D), dtype=dtype), \
        rnd(*shape(KVN, Skv, Dv), dtype=dtype)


@pytest.fixture(params=["fast", "general"])
def decode_path(request, monkeypatch):
    """Decode runs on the decode kernel, or (OPENNPU_FIA_DECODE=0) on the prefill kernels."""
    if request.param == "general":
        monkeypatch.setenv("OPENNPU_FIA_DECODE", "0")
    return request.param


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("kvn", [8, 2, 1])
def test_decode_contiguous(layout, kvn, dtype, decode_path):
    torch.manual_seed(0)
    q, k, v = make(layout, 3, 8, kvn, 1, 77, 40, dtype)
    kw = dict(num_heads=8, num_key_value_heads=kvn, input_layout=layout, scale=0.3,
              actual_seq_lengths_kv=[77, 5, 0], softmax_lse_flag=True)
    out, lse = npu.npu_fused_infer_attention_score(q, k, v, **kw)
    check(out, lse, reference(q, k, v, n=8, kvn=kvn, scale=0.3, layout=layout,
                              seq_kv=[77, 5, 0]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("cache", ["BnBsH", "BnNBsD"])
def test_decode_paged(cache, dtype, decode_path):
    torch.manual_seed(1)
    B, N, KVN, D, bs, nb = 4, 8, 2, 64, 16, 40
    layout = "BSH" if cache == "BnBsH" else "BNSD"
    q = rnd(B, 1, N * D, dtype=dtype) if layout == "BSH" else rnd(B, N, 1, D, dtype=dtype)
    shape = (nb, bs, KVN * D) if cache == "BnBsH" else (nb, KVN, bs, D)
    k, v = rnd(*shape, dtype=dtype), rnd(*shape, dtype=dtype)
    table = torch.randperm(nb, dtype=torch.int32)[:B * 10].view(B, 10)
    lens = [160, 1, 33, 97]
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=N, num_key_value_heads=KVN, input_layout=layout, scale=0.125,
        block_table=table, block_size=bs, actual_seq_lengths_kv=lens, softmax_lse_flag=True)
    check(out, lse, reference(q, k, v, n=N, kvn=KVN, scale=0.125, layout=layout, seq_kv=lens,
                              block_table=table), dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
def test_decode_long_context_splits(dtype):
    # one (batch, kv head) pair: the kernel splits the context and merges the partials
    torch.manual_seed(2)
    q, k, v = make("BNSD", 1, 4, 1, 1, 3001, 32, dtype)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, num_key_value_heads=1, input_layout="BNSD", scale=0.2,
        softmax_lse_flag=True, actual_seq_lengths_kv=[2999])
    check(out, lse, reference(q, k, v, n=4, kvn=1, scale=0.2, layout="BNSD", seq_kv=[2999]),
          dtype)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("S", [50, 3001], ids=["one_split", "context_splits"])
def test_decode_nan_query_head_gives_nan(S, dtype, decode_path):
    """A NaN in one query head's row: that head's output is NaN, as the composition's (once
    read as a fully masked row, output 0), and the other heads of its group are unchanged."""
    torch.manual_seed(3)
    q, k, v = make("BNSD", 1, 4, 1, 1, S, 32, dtype)
    q[0, 1, 0, 3] = float("nan")
    kw = dict(num_heads=4, num_key_value_heads=1, input_layout="BNSD", scale=0.2)
    out, _ = npu.npu_fused_infer_attention_score(q, k, v, **kw)
    assert out[0, 1].isnan().all()
    keep = [0, 2, 3]
    ref, _ = reference(q[:, keep], k, v, n=3, kvn=1, scale=0.2, layout="BNSD")
    assert_close(out[:, keep], ref, dtype=dtype, scale=2)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("paged", [False, True])
def test_decode_long_context_splits_all_heads(paged, dtype):
    # BSH / [blocks, block_size, KVN * D] caches: a task walks the tokens of a sequence for every
    # kv head at once; one sequence of 2999 keys is split across tasks and the partials merged
    torch.manual_seed(2)
    N, KVN, D, bs, S = 6, 3, 32, 128, 3001
    q = rnd(1, 1, N * D, dtype=dtype)
    extra, table = {}, None
    if paged:
        k, v = rnd(30, bs, KVN * D, dtype=dtype), rnd(30, bs, KVN * D, dtype=dtype)
        table = torch.randperm(30, dtype=torch.int32)[:24].view(1, 24)
        extra = dict(block_table=table, block_size=bs)
    else:
        k, v = rnd(1, S, KVN * D, dtype=dtype), rnd(1, S, KVN * D, dtype=dtype)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=N, num_key_value_heads=KVN, input_layout="BSH", scale=0.2,
        softmax_lse_flag=True, actual_seq_lengths_kv=[2999], **extra)
    check(out, lse, reference(q, k, v, n=N, kvn=KVN, scale=0.2, layout="BSH", seq_kv=[2999],
                              block_table=table), dtype)


# Decode tails: head sizes in partial 32- and 64-column pieces of the P V tiles (40, 200) and whole
# ones (64, 96, 192), query groups not a multiple of the 4-head tile (g = 3), context lengths that
# are not a multiple of the chunk, paged and BSH / BNSD caches, and the context splits, whose
# partial accumulators are merged before the store.
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("D", [40, 64, 96, 192, 200])
@pytest.mark.parametrize("case", ["BSH", "BNSD", "paged", "split"])
def test_decode_head_dims_and_groups(case, D, dtype):
    torch.manual_seed(7)
    N, KVN = 6, 2
    kw = dict(num_heads=N, num_key_value_heads=KVN, scale=0.1, softmax_lse_flag=True)
    table = None
    if case == "paged":
        bs, nb, B = 16, 24, 3
        q = rnd(B, 1, N * D, dtype=dtype)
        k, v = rnd(nb, bs, KVN * D, dtype=dtype), rnd(nb, bs, KVN * D, dtype=dtype)
        table = torch.randperm(nb, dtype=torch.int32)[:B * 8].view(B, 8)
        lens = [128, 19, 1]
        kw.update(input_layout="BSH", block_table=table, block_size=bs)
        layout = "BSH"
    else:
        layout = "BNSD" if case != "BSH" else "BSH"
        B, S = (1, 1500) if case == "split" else (3, 77)
        q, k, v = make(layout, B, N, KVN, 1, S, D, dtype)
        lens = [S - 3] if case == "split" else [77, 33, 5]
        kw.update(input_layout=layout)
    kw["actual_seq_lengths_kv"] = lens
    out, lse = npu.npu_fused_infer_attention_score(q, k, v, **kw)
    check(out, lse, reference(q, k, v, n=N, kvn=KVN, scale=0.1, layout=layout, seq_kv=lens,
                              block_table=table), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_tnd_paged_vllm_style(dtype, decode_path):
    # vllm-ascend: TND query, cumulative query ends, per-sequence cached lengths
    torch.manual_seed(3)
    N, KVN, D, bs = 4, 2, 32, 8
    q = rnd(3, N, D, dtype=dtype)
    k, v = rnd(12, bs, KVN * D, dtype=dtype), rnd(12, bs, KVN * D, dtype=dtype)
    table = torch.tensor([[3, 1, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]], dtype=torch.int32)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=N, num_key_value_heads=KVN, input_layout="TND", scale=0.17,
        block_table=table, block_size=bs, actual_seq_lengths=[1, 2, 3],
        actual_seq_lengths_kv=[11, 29, 3], softmax_lse_flag=True)
    check(out, lse, reference(q, k, v, n=N, kvn=KVN, scale=0.17, layout="TND", seq=[1, 2, 3],
                              seq_kv=[11, 29, 3], block_table=table), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_mask_and_lse_of_masked_rows(dtype, decode_path):
    torch.manual_seed(4)
    q, k, v = make("BSND", 2, 4, 4, 1, 50, 16, dtype)
    mask = torch.rand(2, 50) < 0.3
    mask[1] = True  # batch 1 sees nothing: zeros and lse -inf
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, input_layout="BSND", scale=0.5, atten_mask=mask, pre_tokens=0,
        next_tokens=0, softmax_lse_flag=True)  # pre/next_tokens are ignored in decode
    ref = reference(q, k, v, n=4, scale=0.5, layout="BSND", atten_mask=mask)
    check(out, lse, ref, dtype)
    assert (out[1] == 0).all() and torch.isinf(lse[1]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("paged", [False, True])
def test_mla_rope(paged, dtype, decode_path):
    torch.manual_seed(5)
    B, N, D, Dr, S = 2, 8, 64, 16, 40
    q, qr = rnd(B, N, 1, D, dtype=dtype), rnd(B, N, 1, Dr, dtype=dtype)
    if paged:
        k, kr = rnd(8, 16, D, dtype=dtype), rnd(8, 16, Dr, dtype=dtype)
        table = torch.tensor([[0, 2, 4], [7, 1, 3]], dtype=torch.int32)
        extra = dict(block_table=table, block_size=16, actual_seq_lengths_kv=[S, 17])
        layout = "BSH"
        q, qr = q.transpose(1, 2).flatten(2), qr.transpose(1, 2).flatten(2)
    else:
        k, kr = rnd(B, 1, S, D, dtype=dtype), rnd(B, 1, S, Dr, dtype=dtype)
        extra, layout, table = {}, "BNSD", None
    scale = 1 / math.sqrt(D + Dr)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, k, query_rope=qr, key_rope=kr, num_heads=N, num_key_value_heads=1,
        input_layout=layout, scale=scale, softmax_lse_flag=True, **extra)
    ref = reference(q, k, k, n=N, kvn=1, scale=scale, layout=layout, q_rope=qr, k_rope=kr,
                    block_table=table, seq_kv=extra.get("actual_seq_lengths_kv"))
    check(out, lse, ref, dtype)


# ----------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD", "BNSD_BSND", "BSH_NBSD"])
def test_prefill_layouts_gqa(layout, dtype):
    torch.manual_seed(6)
    q, k, v = make(layout, 2, 6, 2, 13, 21, 24, dtype, Dv=16)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=6, num_key_value_heads=2, input_layout=layout, scale=0.3,
        actual_seq_lengths=[13, 7], actual_seq_lengths_kv=[21, 9], softmax_lse_flag=True)
    check(out, lse, reference(q, k, v, n=6, kvn=2, scale=0.3, layout=layout, seq=[13, 7],
                              seq_kv=[21, 9]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", [0, 1, 2, 3, 4])
def test_prefill_sparse_modes(mode, dtype):
    torch.manual_seed(7)
    q, k, v = make("BNSD", 2, 4, 4, 11, 19, 16, dtype)
    if mode in (0, 1):
        mask = torch.rand(2, 1, 11, 19) < 0.3
    else:
        mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    pre, nxt = (3, 2) if mode in (0, 4) else (MAX, MAX)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, input_layout="BNSD", scale=0.4, atten_mask=mask, sparse_mode=mode,
        pre_tokens=pre, next_tokens=nxt, softmax_lse_flag=True)
    check(out, lse, reference(q, k, v, n=4, scale=0.4, layout="BNSD", atten_mask=mask,
                              sparse_mode=mode, pre=pre, nxt=nxt), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", ["TND", "NTD_TND", "TND_NTD"])
def test_prefill_varlen(layout, dtype):
    torch.manual_seed(8)
    N, KVN, D = 4, 2, 32
    q = rnd(20, N, D, dtype=dtype) if layout != "NTD_TND" else rnd(N, 20, D, dtype=dtype)
    k = rnd(30, KVN, D, dtype=dtype) if layout != "NTD_TND" else rnd(KVN, 30, D, dtype=dtype)
    v = torch.randn_like(k.float()).to(dtype)
    seq, seq_kv = [5, 5, 17], [9, 20, 30]  # the second sequence is empty
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=N, num_key_value_heads=KVN, input_layout=layout, scale=0.2,
        actual_seq_lengths=seq, actual_seq_lengths_kv=seq_kv, sparse_mode=3,
        atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1), softmax_lse_flag=True)
    check(out, lse, reference(q, k, v, n=N, kvn=KVN, scale=0.2, layout=layout, seq=seq,
                              seq_kv=seq_kv, sparse_mode=3), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefill_paged_with_pse(dtype):
    torch.manual_seed(9)
    B, N, D, bs = 2, 4, 32, 16
    q = rnd(B, N, 9, D, dtype=dtype)
    k, v = rnd(10, N, bs, D, dtype=dtype), rnd(10, N, bs, D, dtype=dtype)
    table = torch.tensor([[9, 3, 4], [0, 1, 2]], dtype=torch.int32)
    pse = rnd(1, N, 9, 48, dtype=dtype)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, pse_shift=pse, num_heads=N, input_layout="BNSD", scale=0.25, block_table=table,
        block_size=bs, actual_seq_lengths_kv=[40, 9], softmax_lse_flag=True)
    check(out, lse, reference(q, k, v, n=N, scale=0.25, layout="BNSD", seq_kv=[40, 9],
                              block_table=table, pse=pse), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout,sq", [("BNSD", 7), ("BSH", 1), ("BSND", 5), ("BNSD_BSND", 1)])
@pytest.mark.parametrize("prefix_len", [None, 3])
def test_shared_prefix(layout, sq, prefix_len, dtype):
    """Every batch attends to [prefix[:P], key[b]]: the reference on the concatenated K/V, with
    actual_seq_lengths_kv shifted by P, a mask over the concatenated sequence (prefill) and GQA."""
    torch.manual_seed(8)
    B, N, KVN, Skv, Sp, D = 2, 4, 2, 9, 6, 16
    q, k, v = make(layout, B, N, KVN, sq, Skv, D, dtype)
    kp, vp = (t[:1] for t in make(layout, 1, KVN, KVN, Sp, Sp, D, dtype)[1:])
    P = Sp if prefix_len is None else prefix_len
    seq_dim = 2 if layout.startswith("BNSD") else 1
    heads = [p.narrow(seq_dim, 0, P) for p in (kp, vp)]
    kc, vc = (torch.cat([h.expand(B, *h.shape[1:]), c], seq_dim) for h, c in zip(heads, (k, v)))
    seq_kv = [Skv, 4]
    mask = torch.rand(B, 1, sq, P + Skv) < 0.2 if sq > 1 else None
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout=layout, scale=0.35,
              actual_seq_lengths_kv=seq_kv, atten_mask=mask, softmax_lse_flag=True)
    extra = {} if prefix_len is None else dict(actual_shared_prefix_len=[prefix_len])
    out, lse = npu.npu_fused_infer_attention_score(q, k, v, key_shared_prefix=kp, value_shared_prefix=vp,
                                                   **kw, **extra)
    check(out, lse, reference(q, kc, vc, n=N, kvn=KVN, scale=0.35, layout=layout,
                              seq_kv=[P + s for s in seq_kv], atten_mask=mask), dtype)


def _right_aligned(t, starts, seq_dim):
    """Batch b's left-aligned rows moved to start at starts[b] (left padding's layout)."""
    return torch.stack([t[b].roll(s, seq_dim - 1) for b, s in enumerate(starts)])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout,sq,masked", [("BSH", 7, False), ("BNSD", 6, True), ("BSND", 1, False),
                                              ("BNSD_BSND", 5, False)])
def test_left_padding(layout, sq, masked, dtype):
    """query_padding_size / kv_padding_size: batch b's rows sit at [S - pad - len_b, S - pad).
    The reference runs on the same rows left-aligned; the output comes back right-aligned."""
    torch.manual_seed(9)
    B, N, KVN, Skv, D = 2, 4, 2, 12, 16
    qa, ka, va = make(layout, B, N, KVN, sq, Skv, D, dtype)
    seq_in = 2 if layout.startswith("BNSD") else 1
    seq_out = 2 if layout in ("BNSD",) else 1
    qpad, kvpad = 1, 3
    lens = [sq - 1, max(sq - 3, 1)] if sq > 1 else [1, 1]
    lens_kv = [Skv - kvpad, 5]
    q_starts = [sq - qpad - n for n in lens] if sq > 1 else [0, 0]
    kv_starts = [Skv - kvpad - n for n in lens_kv]
    mask = torch.rand(B, 1, sq, Skv) < 0.25 if masked else None
    ro, rl = reference(qa, ka, va, n=N, kvn=KVN, scale=0.3, layout=layout, seq=lens if sq > 1 else None,
                       seq_kv=lens_kv, atten_mask=mask)
    q = _right_aligned(qa, q_starts, seq_in)
    k, v = _right_aligned(ka, kv_starts, seq_in), _right_aligned(va, kv_starts, seq_in)
    m = None if mask is None else torch.stack([mask[b].roll((q_starts[b], kv_starts[b]), (-2, -1))
                                               for b in range(B)])
    out, lse = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=N, num_key_value_heads=KVN, input_layout=layout, scale=0.3,
        actual_seq_lengths=lens if sq > 1 else None, actual_seq_lengths_kv=lens_kv, atten_mask=m,
        query_padding_size=torch.tensor([qpad]) if sq > 1 else None,
        kv_padding_size=torch.tensor([kvpad]), softmax_lse_flag=True)
    check(out, lse, (_right_aligned(ro, q_starts, seq_out), _right_aligned(rl, q_starts, 2)), dtype)


def test_left_padding_decode_window_before_row_0_gives_zeros():
    q, k, v = make("BSH", 2, 4, 2, 1, 10, 8, torch.float32)
    out, _ = npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, num_key_value_heads=2, input_layout="BSH",
        actual_seq_lengths_kv=[6, 9], kv_padding_size=torch.tensor([3]))
    ref, _ = npu.npu_fused_infer_attention_score(
        q[:1], k[:1, 1:7], v[:1, 1:7], num_heads=4, num_key_value_heads=2, input_layout="BSH")
    assert_close(out[:1], ref, dtype=torch.float32)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # 10 - 3 - 9 < 0: sees no key


@pytest.mark.parametrize("over,match", [
    (dict(query_padding_size=torch.tensor([1])), "'query_padding_size' needs actual_seq_lengths"),
    (dict(kv_padding_size=torch.tensor([1])), "'kv_padding_size' needs actual_seq_lengths_kv"),
    (dict(query_padding_size=torch.tensor([1.0]), actual_seq_lengths=[2, 2]),
     "'query_padding_size' must hold one integer"),
    (dict(query_padding_size=torch.tensor([3]), actual_seq_lengths=[4, 2]),
     "'query_padding_size' leaves no room for actual_seq_lengths"),
    (dict(kv_padding_size=torch.tensor([5]), actual_seq_lengths_kv=[16, 2]),
     "'kv_padding_size' leaves no room for actual_seq_lengths_kv"),
    (dict(kv_padding_size=torch.tensor([1]), actual_seq_lengths_kv=[2, 2], input_layout="TND"),
     "'kv_padding_size' needs input_layout BSH"),
    (dict(kv_padding_size=torch.tensor([1]), actual_seq_lengths_kv=[2, 2],
          pse_shift=torch.zeros(2, 4, 5, 20)), "'kv_padding_size' is not supported with pse_shift"),
])
def test_left_padding_bad_inputs(over, match):
    q, k, v = make("BNSD", 2, 4, 2, 5, 20, 8, torch.float32)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD")
    kw.update(over)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_fused_infer_attention_score(q, k, v, **kw)


def test_shared_prefix_rejects_the_paged_cache():
    q, k, v = make("BSH", 2, 4, 2, 1, 16, 8, torch.float32)
    cache = torch.zeros(4, 8, 16)
    with pytest.raises(RuntimeError, match="'key_shared_prefix' is not supported with a paged cache"):
        npu.npu_fused_infer_attention_score(
            q, cache, cache, num_heads=4, num_key_value_heads=2, input_layout="BSH",
            block_table=torch.zeros(2, 2, dtype=torch.int32), block_size=8,
            actual_seq_lengths_kv=[8, 8], key_shared_prefix=torch.zeros(1, 3, 16),
            value_shared_prefix=torch.zeros(1, 3, 16))


def test_non_contiguous_inputs_and_no_lse():
    torch.manual_seed(10)
    q = rnd(2, 9, 4, 16).transpose(1, 2)  # BNSD view of BSND storage
    k = rnd(2, 30, 4, 16).transpose(1, 2)
    v = rnd(2, 30, 4, 32)[..., ::2].transpose(1, 2)  # strided head dim
    out, lse = npu.npu_fused_infer_attention_score(q, k, v, num_heads=4, input_layout="BNSD",
                                                   scale=0.3)
    check(out, lse, reference(q, k, v, n=4, scale=0.3, layout="BNSD"), torch.float32,
          lse_flag=False)
    out1, _ = npu.npu_fused_infer_attention_score(q[:, :, :1], k, v, num_heads=4,
                                                  input_layout="BNSD", scale=0.3)
    assert_close(out1, reference(q[:, :, :1], k, v, n=4, scale=0.3, layout="BNSD")[0])


def test_empty_inputs():
    q, k, v = make("BNSD", 2, 4, 4, 1, 0, 16, torch.float32)
    out, lse = npu.npu_fused_infer_attention_score(q, k, v, num_heads=4, input_layout="BNSD",
                                                   softmax_lse_flag=True)
    assert (out == 0).all() and out.shape == (2, 4, 1, 16) and torch.isinf(lse).all()
    q, k, v = make("BNSD", 0, 4, 4, 3, 5, 16, torch.float32)
    out, _ = npu.npu_fused_infer_attention_score(q, k, v, num_heads=4, input_layout="BNSD")
    assert out.shape == (0, 4, 3, 16)


def test_float64_decode_takes_the_general_path():
    q, k, v = make("BSH", 2, 4, 2, 1, 12, 8, torch.float64)
    out, lse = npu.npu_fused_infer_attention_score(q, k, v, num_heads=4, num_key_value_heads=2,
                                                   scale=0.5, softmax_lse_flag=True)
    check(out, lse, reference(q, k, v, n=4, kvn=2, scale=0.5), torch.float64)


# ----------------------------------------------------------------------------- v2, out, workspace


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sq", [1, 6])
def test_v2_with_learnable_sink(sq, dtype, decode_path):
    torch.manual_seed(11)
    N, KVN, D = 4, 2, 32
    q, k, v = rnd(2 * sq, N, D, dtype=dtype), rnd(40, KVN, D, dtype=dtype), rnd(40, KVN, D, dtype=dtype)
    sink = rnd(N, dtype=torch.bfloat16)
    seq, seq_kv = [sq, 2 * sq], [15, 40]
    out, lse = npu.npu_fused_infer_attention_score_v2(
        q, k, v, learnable_sink=sink, actual_seq_qlen=seq, actual_seq_kvlen=seq_kv,
        num_query_heads=N, num_key_value_heads=KVN, softmax_scale=0.3, input_layout="TND",
        sparse_mode=3, atten_mask=torch.ones(2048, 2048, dtype=torch.bool).triu(1),
        return_softmax_lse=True)
    ro, _ = reference(q, k, v, n=N, kvn=KVN, scale=0.3, layout="TND", seq=seq, seq_kv=seq_kv,
                      sparse_mode=3, sink=sink)
    assert_close(out, ro, dtype=dtype, scale=2)


def test_out_overload_workspace_and_infer_output():
    torch.manual_seed(12)
    q, k, v = make("BNSD", 1, 8, 8, 1, 64, 32, torch.float16)
    kw = dict(num_heads=8, input_layout="BNSD", scale=0.2, softmax_lse_flag=True)
    ws = npu._npu_fused_infer_attention_score_get_max_workspace(q, k, v, **kw)
    assert ws.dtype == torch.uint8
    a, b = npu._npu_fused_infer_attention_score_infer_output(q, v, input_layout="BNSD",
                                                              num_heads=8, softmax_lse_flag=True)
    assert a.shape == (1, 8, 1, 32) and b.shape == (1, 8, 1, 1) and b.dtype == torch.float32
    opennpu.npu_fused_infer_attention_score.out(q, k, v, workspace=ws, out=[a, b], **kw)
    ref = npu.npu_fused_infer_attention_score(q, k, v, **kw)
    assert torch.equal(a, ref[0]) and torch.equal(b, ref[1])


def test_not_differentiable():
    q, k, v = (t.requires_grad_() for t in make("BNSD", 1, 2, 2, 1, 8, 8, torch.float32))
    out, _ = npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD")
    with pytest.raises(RuntimeError, match="not differentiable"):
        out.sum().backward()


def test_opcheck():
    q, k, v = make("BSH", 2, 4, 2, 1, 20, 8, torch.float32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    kc, vc = rnd(4, 16, 16), rnd(4, 16, 16)
    qp, kp, vp = make("BNSD", 2, 4, 2, 5, 20, 8, torch.float32)
    opcheck(npu.npu_fused_infer_attention_score.default, [
        ((q, k, v), dict(num_heads=4, num_key_value_heads=2, softmax_lse_flag=True)),
        ((q, kc, vc), dict(num_heads=4, num_key_value_heads=2, block_table=table, block_size=16,
                           actual_seq_lengths_kv=[20, 3])),
        ((qp, kp, vp), dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD_BSND",
                            softmax_lse_flag=True)),
    ])
    opcheck(npu.npu_fused_infer_attention_score_v2.default, [
        ((q, k, v), dict(num_query_heads=4, num_key_value_heads=2, return_softmax_lse=True))])
    # uninitialised outputs: schema and fake kernel only
    torch.library.opcheck(npu._npu_fused_infer_attention_score_infer_output.default, (q, v),
                          dict(num_heads=4, num_key_value_heads=2),
                          test_utils=("test_schema", "test_faketensor"))
    opcheck(npu._npu_fused_infer_attention_score_get_max_workspace.default,
            [((q, k, v), dict(num_heads=4, num_key_value_heads=2))])


def test_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = make("BSH", 2, 4, 2, 1, 20, 8, torch.float32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    kc, vc = rnd(4, 16, 16), rnd(4, 16, 16)

    def f(q, kc, vc):
        return npu.npu_fused_infer_attention_score(
            q, kc, vc, num_heads=4, num_key_value_heads=2, scale=0.3, block_table=table,
            block_size=16, actual_seq_lengths_kv=[20, 3], softmax_lse_flag=True)

    eager = f(q, kc, vc)
    compiled = torch.compile(f, fullgraph=True, dynamic=True)(q, kc, vc)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


# ----------------------------------------------------------------------------- bad inputs


def _call(**over):
    q, k, v = make("BNSD", 2, 4, 2, 1, 20, 8, torch.float32)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD")
    args = dict(query=q, key=k, value=v)
    for name in ("query", "key", "value"):
        if name in over:
            args[name] = over.pop(name)
    kw.update(over)
    return npu.npu_fused_infer_attention_score(args["query"], args["key"], args["value"], **kw)


@pytest.mark.parametrize("over,match", [
    (dict(input_layout="SBH"), "argument 'input_layout' must be one of"),
    (dict(num_heads=3), "num_key_value_heads' must divide num_heads"),
    (dict(num_key_value_heads=4), "must have 4 key/value heads"),
    (dict(key=torch.zeros(2, 2, 20, 6)), "argument 'key' must have the head size of 'query'"),
    (dict(value=torch.zeros(2, 2, 21, 8)), "argument 'value' must match 'key'"),
    (dict(key=torch.zeros(2, 2, 20, 8, dtype=torch.int8)), "'key' is int8, which needs antiquant"),
    (dict(key=torch.zeros(2, 2, 20, 2, dtype=torch.int32)), "int4 key/value packed in int32"),
    (dict(sparse_mode=5), "argument 'sparse_mode' must be 0, 1, 2, 3 or 4"),
    (dict(actual_seq_lengths_kv=[21, 3]), "actual_seq_lengths_kv' must hold lengths in"),
    (dict(actual_seq_lengths_kv=[7]), None),
    (dict(atten_mask=torch.zeros(2, 10, dtype=torch.bool)), "argument 'atten_mask' must be"),
    (dict(atten_mask=torch.zeros(2, 20)), "argument 'atten_mask' must be bool, int8 or uint8"),
    (dict(dequant_scale1=torch.ones(1)), "argument 'dequant_scale1' needs an int8 query"),
    (dict(key_antiquant_scale=torch.ones(1)), "'value_antiquant_scale' must be given together"),
    (dict(key_antiquant_scale=torch.ones(1), value_antiquant_scale=torch.ones(1)),
     "'key_antiquant_scale' applies to an int8 key/value cache, but 'key' is Float"),
    (dict(key_shared_prefix=torch.ones(1)), "'value_shared_prefix' must be given together"),
    (dict(key_shared_prefix=torch.zeros(2, 2, 5, 8), value_shared_prefix=torch.zeros(2, 2, 5, 8)),
     "'key_shared_prefix' must have 4 dims with batch 1"),
    (dict(key_shared_prefix=torch.zeros(1, 2, 5, 4), value_shared_prefix=torch.zeros(1, 2, 5, 8)),
     "must match the cache's shape"),
    (dict(key_shared_prefix=torch.zeros(1, 2, 5, 8), value_shared_prefix=torch.zeros(1, 2, 4, 8)),
     "'value_shared_prefix' must have key_shared_prefix's sequence length 5"),
    (dict(key_shared_prefix=torch.zeros(1, 2, 5, 8), value_shared_prefix=torch.zeros(1, 2, 5, 8),
          actual_shared_prefix_len=[6]), r"'actual_shared_prefix_len' must be in \[0, 5\]"),
    (dict(key_shared_prefix=torch.zeros(1, 2, 5, 8, dtype=torch.float16),
          value_shared_prefix=torch.zeros(1, 2, 5, 8)), "must have the key's / value's dtype"),
    (dict(actual_shared_prefix_len=[2]), "'actual_shared_prefix_len' needs key_shared_prefix"),
    (dict(query_rope=torch.ones(2, 4, 1, 4)), "argument 'key_rope' must be given together"),
    (dict(input_layout="TND", query=torch.zeros(3, 4, 8), key=torch.zeros(3, 2, 8),
          value=torch.zeros(3, 2, 8)), "argument 'actual_seq_lengths' is required"),
])
def test_bad_inputs(over, match):
    if match is None:  # one length for every batch is accepted
        _call(**over)
        return
    with pytest.raises(RuntimeError, match=match):
        _call(**over)


def test_bad_paged_inputs():
    q = rnd(2, 1, 32)
    kc = rnd(4, 16, 16)
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)
    kw = dict(num_heads=4, num_key_value_heads=2, block_size=16, block_table=table)
    with pytest.raises(RuntimeError, match="block_table' holds block id 9 at \\[1, 1\\]"):
        npu.npu_fused_infer_attention_score(q, kc, kc, actual_seq_lengths_kv=[20, 20], **kw)
    with pytest.raises(RuntimeError, match="actual_seq_lengths_kv' is required with block_table"):
        npu.npu_fused_infer_attention_score(q, kc, kc, **kw)
    with pytest.raises(RuntimeError, match="argument 'block_size' must be the cache's block size 16"):
        npu.npu_fused_infer_attention_score(q, kc, kc, actual_seq_lengths_kv=[20, 3],
                                            **{**kw, "block_size": 8})
    with pytest.raises(RuntimeError, match="block_table' must be an int32"):
        npu.npu_fused_infer_attention_score(q, kc, kc, actual_seq_lengths_kv=[20, 3],
                                            **{**kw, "block_table": table.long()})
    with pytest.raises(RuntimeError, match="actual_seq_lengths_kv' must hold lengths in \\[0, 32\\]"):
        npu.npu_fused_infer_attention_score(q, kc, kc, actual_seq_lengths_kv=[33, 3], **kw)


def test_v2_bad_inputs():
    q, k, v = make("BSH", 1, 2, 2, 1, 4, 8, torch.float32)
    with pytest.raises(RuntimeError, match="argument 'out_dtype' must be None or the output's dtype"):
        npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=2, out_dtype=1)
    with pytest.raises(RuntimeError, match="argument 'dequant_scale_value' must be given together"):
        npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=2,
                                               dequant_scale_key=torch.ones(1))
    with pytest.raises(RuntimeError, match="argument 'learnable_sink' must be"):
        npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=2,
                                               learnable_sink=torch.ones(3))


# ----------------------------------------------------------------------------- NZ caches


def to_nz(cache, kvn):
    """A paged cache [nb, bs, KVN * D] (or [nb, bs, D] for one head) in Ascend's NZ layout
    [nb, KVN, D / c, bs, c], c the elements of 32 bytes (what PA_NZ's scatter writes)."""
    nb, bs, h = cache.shape
    c = 32 // cache.element_size()
    return cache.view(nb, bs, kvn, h // kvn // c, c).permute(0, 2, 3, 1, 4).contiguous()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("sq", [1, 3])
def test_nz_paged_cache_is_read_as_its_rows(sq, dtype, decode_path):
    """An NZ cache gives exactly the result of the same rows in the ND paged layout (prefill and
    decode, GQA, the output's head size taken from the NZ value)."""
    torch.manual_seed(11)
    B, N, KVN, D, bs, nb = 3, 8, 2, 64, 16, 12
    q = rnd(B, sq, N * D, dtype=dtype)
    k, v = rnd(nb, bs, KVN * D, dtype=dtype), rnd(nb, bs, KVN * D, dtype=dtype)
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BSH", scale=0.125,
              block_table=torch.randperm(nb, dtype=torch.int32)[:B * 4].view(B, 4),
              block_size=bs, actual_seq_lengths_kv=[64, 5, 33], softmax_lse_flag=True)
    want = npu.npu_fused_infer_attention_score(q, k, v, **kw)
    got = npu.npu_fused_infer_attention_score(q, to_nz(k, KVN), to_nz(v, KVN), **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    shape, _ = npu._npu_fused_infer_attention_score_infer_output(
        q, to_nz(v, KVN), num_heads=N, num_key_value_heads=KVN, block_table=kw["block_table"])
    assert shape.shape == want[0].shape
    from opennpu.ops import portable

    ported = portable.npu_fused_infer_attention_score(q, to_nz(k, KVN), to_nz(v, KVN), **kw)
    torch.testing.assert_close(ported[0], want[0], rtol=2e-2 if dtype != torch.float32 else 1e-5,
                               atol=1e-2 if dtype != torch.float32 else 1e-5)


def test_nz_paged_cache_int8_antiquant_and_mla_rope():
    torch.manual_seed(12)
    B, N, D, Dr, bs, nb = 2, 4, 64, 32, 16, 6
    table = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
    kw = dict(num_heads=N, num_key_value_heads=1, input_layout="BSH", scale=0.1,
              block_table=table, block_size=bs, actual_seq_lengths_kv=[40, 17])
    # int8 cache (c = 32) with per-channel factors
    q = rnd(B, 1, N * D, dtype=torch.bfloat16)
    k8 = torch.randint(-128, 128, (nb, bs, D), dtype=torch.int8)
    v8 = torch.randint(-128, 128, (nb, bs, D), dtype=torch.int8)
    quant = dict(key_antiquant_scale=torch.rand(1, D, dtype=torch.bfloat16) / 50,
                 value_antiquant_scale=torch.rand(1, D, dtype=torch.bfloat16) / 50)
    want = npu.npu_fused_infer_attention_score(q, k8, v8, **kw, **quant)[0]
    got = npu.npu_fused_infer_attention_score(q, to_nz(k8, 1), to_nz(v8, 1), **kw, **quant)[0]
    assert torch.equal(got, want)
    # MLA: key, value and key_rope NZ
    q, qr = rnd(B, 1, N * D), rnd(B, 1, N * Dr)
    k, kr = rnd(nb, bs, D), rnd(nb, bs, Dr)
    want = npu.npu_fused_infer_attention_score(q, k, k, query_rope=qr, key_rope=kr, **kw)[0]
    got = npu.npu_fused_infer_attention_score(q, to_nz(k, 1), to_nz(k, 1), query_rope=qr,
                                              key_rope=to_nz(kr, 1), **kw)[0]
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match=r"'key' in the NZ layout must be \[num_blocks, 1 "
                                           r"\(num_key_value_heads\), D / 8, block_size, 8\]"):
        npu.npu_fused_infer_attention_score(q, k.view(nb, 1, D // 16, bs, 16), to_nz(k, 1), **kw)
