"""npu_fused_infer_attention_score (and _v2) with an int8 key/value cache (antiquant): the cache
is dequantised here in float64, (x + offset) * scale with the factors of each mode, and the
float64 attention of test_infer_attention.reference is the oracle. Per mode (per channel / per
tensor, per token, per tensor and head, per token and head, paged per token), with and without
offsets, contiguous and paged caches, GQA, decode (both decode paths) and prefill; the portable
composition against the C++ kernels; bad inputs; opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch
from op_helpers import dtype_id, opcheck
from test_infer_attention import check, reference

from opennpu.ops import portable
from opennpu.testing.tolerances import assert_close

npu = torch.ops.npu
LOW = (torch.float16, torch.bfloat16)


def i8(*shape):
    return torch.randint(-128, 128, shape, dtype=torch.int8)


def pos(*shape):
    return torch.rand(*shape) * 0.02 + 0.005


def to_layout(t, layout):
    """[B, N, S, D] -> the cache layout of a contiguous call."""
    if layout == "BSH":
        return t.transpose(1, 2).flatten(2).contiguous()
    if layout == "BSND":
        return t.transpose(1, 2).contiguous()
    return t.contiguous()


# Factors of one side in canonical form for the float64 dequantisation, and as passed to the op.
def factors(mode, form, B, KVN, S, D, with_offset, dtype, paged_shape=None):
    """(scale, offset) as the op takes them, and a function mapping int8 [B, KVN, S, D] (or the
    paged [nb, KVN, bs, D]) to float64 (x + offset) * scale."""
    fdt = torch.float32 if mode in (1, 3, 4, 5) else dtype
    if mode == 0 and form == "tensor":
        shape, canon = (1,), lambda t: t.double().view(1, 1, 1, 1)
    elif mode == 0:
        shape = {"1n1d": (1, KVN, 1, D), "1nd": (1, KVN, D), "1h": (1, KVN * D),
                 "n1d": (KVN, 1, D), "nd": (KVN, D), "h": (KVN * D,)}[form]
        canon = lambda t: t.double().reshape(1, KVN, 1, D)  # noqa: E731
    elif mode == 1:
        shape = (1, B, S) if form == "1bs" else (B, S)
        canon = lambda t: t.double().reshape(B, 1, S, 1)  # noqa: E731
    elif mode == 2:
        shape, canon = (KVN,), lambda t: t.double().view(1, KVN, 1, 1)
    elif mode == 3:
        shape, canon = (B, KVN, S), lambda t: t.double().unsqueeze(-1)
    elif mode == 4:
        nb, bs = paged_shape
        shape, canon = (nb, bs), lambda t: t.double().view(nb, 1, bs, 1)
    else:
        nb, bs = paged_shape
        shape, canon = (nb, KVN, bs), lambda t: t.double().unsqueeze(-1)
    sc = pos(*shape).to(fdt)
    off = (torch.randn(*shape) * 4).to(fdt) if with_offset else None

    def deq(x):
        y = x.double()
        if off is not None:
            y = y + canon(off)
        return y * canon(sc)

    return sc, off, deq


# ----------------------------------------------------------------------------- contiguous


@pytest.fixture(params=["fast", "general"])
def decode_path(request, monkeypatch):
    if request.param == "general":
        monkeypatch.setenv("OPENNPU_FIA_DECODE", "0")
    return request.param


MODES = [(0, "1n1d"), (0, "nd"), (0, "h"), (0, "tensor"), (1, "1bs"), (1, "bs"), (2, None),
         (3, None)]


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("mode,form", MODES, ids=lambda x: str(x))
@pytest.mark.parametrize("with_offset", [False, True], ids=["sym", "offset"])
def test_decode_contiguous_modes(mode, form, with_offset, dtype, decode_path):
    torch.manual_seed(mode * 10 + len(str(form)))
    B, N, KVN, S, D = 3, 4, 2, 37, 16
    q = torch.randn(B, N, 1, D).to(dtype)
    k8, v8 = i8(B, KVN, S, D), i8(B, KVN, S, D)
    ks, ko, kdeq = factors(mode, form, B, KVN, S, D, with_offset, dtype)
    vs, vo, vdeq = factors(mode, form, B, KVN, S, D, with_offset, dtype)
    lens = [37, 5, 20]
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=0.3,
              actual_seq_lengths_kv=lens, softmax_lse_flag=True, key_antiquant_mode=mode,
              value_antiquant_mode=mode)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k8, v8, key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko,
        value_antiquant_offset=vo, **kw)
    ref = reference(q, kdeq(k8), vdeq(v8), n=N, kvn=KVN, scale=0.3, layout="BNSD", seq_kv=lens)
    check(out, lse, ref, dtype)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32), ids=dtype_id)
@pytest.mark.parametrize("layout", ["BSH", "BSND", "BNSD"])
@pytest.mark.parametrize("kvn", [4, 1])
def test_decode_layouts_gqa(layout, kvn, dtype, decode_path):
    torch.manual_seed(kvn)
    B, N, S, D = 2, 4, 29, 24
    qc = torch.randn(B, N, 1, D).to(dtype)
    k8, v8 = i8(B, kvn, S, D), i8(B, kvn, S, D)
    ks, ko, kdeq = factors(0, "1nd", B, kvn, S, D, True, dtype)
    vs, vo, vdeq = factors(1, "bs", B, kvn, S, D, True, dtype)  # key per channel, value per token
    out, lse = npu.npu_fused_infer_attention_score(
        to_layout(qc, layout), to_layout(k8, layout), to_layout(v8, layout),
        key_antiquant_scale=ks, key_antiquant_offset=ko, value_antiquant_scale=vs,
        value_antiquant_offset=vo, key_antiquant_mode=0, value_antiquant_mode=1, num_heads=N,
        num_key_value_heads=kvn, input_layout=layout, scale=0.2, softmax_lse_flag=True)
    ref = reference(to_layout(qc, layout), to_layout(kdeq(k8), layout),
                    to_layout(vdeq(v8), layout), n=N, kvn=kvn, scale=0.2, layout=layout)
    check(out, lse, ref, dtype)


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("form", ["n1d", "h", "tensor", "token"])
def test_combined_antiquant_scale(form, dtype, decode_path):
    """v1's antiquant_scale / antiquant_offset: row 0 the key factors, row 1 the value's."""
    torch.manual_seed(3)
    B, N, KVN, S, D = 2, 4, 2, 19, 16
    q = torch.randn(B, 1, N * D).to(dtype)
    k8, v8 = i8(B, KVN, S, D), i8(B, KVN, S, D)
    mode = 1 if form == "token" else 0
    shape = {"n1d": (2, KVN, 1, D), "h": (2, KVN * D), "tensor": (2,), "token": (2, B, S)}[form]
    fdt = torch.float32 if mode else dtype
    sc, off = pos(*shape).to(fdt), (torch.randn(*shape) * 3).to(fdt)
    canon = {"n1d": lambda t: t.reshape(1, KVN, 1, D), "h": lambda t: t.reshape(1, KVN, 1, D),
             "tensor": lambda t: t.reshape(1, 1, 1, 1),
             "token": lambda t: t.reshape(B, 1, S, 1)}[form]
    kd = (k8.double() + canon(off[0].double())) * canon(sc[0].double())
    vd = (v8.double() + canon(off[1].double())) * canon(sc[1].double())
    out, lse = npu.npu_fused_infer_attention_score(
        q, to_layout(k8, "BSH"), to_layout(v8, "BSH"), antiquant_scale=sc, antiquant_offset=off,
        antiquant_mode=mode, num_heads=N, num_key_value_heads=KVN, scale=0.25,
        softmax_lse_flag=True)
    ref = reference(q, to_layout(kd, "BSH"), to_layout(vd, "BSH"), n=N, kvn=KVN, scale=0.25)
    check(out, lse, ref, dtype)


def test_separate_factors_win_over_combined():
    torch.manual_seed(4)
    q = torch.randn(1, 2, 1, 8).half()
    k8, v8 = i8(1, 2, 9, 8), i8(1, 2, 9, 8)
    ks, vs = pos(1, 2, 1, 8).half(), pos(1, 2, 1, 8).half()
    kw = dict(num_heads=2, input_layout="BNSD")
    a = npu.npu_fused_infer_attention_score(q, k8, v8, key_antiquant_scale=ks,
                                            value_antiquant_scale=vs, **kw)[0]
    b = npu.npu_fused_infer_attention_score(q, k8, v8, key_antiquant_scale=ks,
                                            value_antiquant_scale=vs,
                                            antiquant_scale=torch.ones(2).half(), **kw)[0]
    c = npu.npu_fused_infer_attention_score(q, k8, v8, antiquant_scale=torch.ones(2).half(),
                                            **kw)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


# ----------------------------------------------------------------------------- paged


def paged_case(cache, mode, with_offset, dtype, B=3, N=8, KVN=2, D=16, bs=16, lens=(40, 7, 33)):
    """A paged int8 cache (every block used by one sequence, in shuffled order) with its
    factors, and the float64 dequantised cache in the same layout."""
    cols = 3
    nb = B * cols + 1
    table = torch.randperm(nb)[:B * cols].to(torch.int32).view(B, cols)
    k8, v8 = i8(nb, KVN, bs, D), i8(nb, KVN, bs, D)  # canonical [nb, KVN, bs, D]
    S = cols * bs

    def side(x):
        sc, off, deq = factors(mode, "bs" if mode == 1 else "1n1d", B, KVN, S, D, with_offset,
                               dtype, paged_shape=(nb, bs))
        if mode in (1, 3):  # logical (b, t) factors: move them to the physical slots
            def phys(t):
                t = t.double().reshape(B, -1, S)
                out = torch.zeros(nb, t.shape[1], bs, dtype=torch.float64)
                for b in range(B):
                    for j in range(cols):
                        out[table[b, j]] = t[b, :, j * bs:(j + 1) * bs]
                return out.unsqueeze(-1)

            dq = x.double()
            if off is not None:
                dq = dq + phys(off)
            return sc, off, dq * phys(sc)
        return sc, off, deq(x)

    ks, ko, kd = side(k8)
    vs, vo, vd = side(v8)
    lay = (lambda t: t.transpose(1, 2).flatten(2).contiguous()) if cache == "BnBsH" else \
        (lambda t: t)
    q = torch.randn(B, 1, N * D).to(dtype)
    kw = dict(num_heads=N, num_key_value_heads=KVN, scale=0.3, block_table=table, block_size=bs,
              actual_seq_lengths_kv=list(lens), softmax_lse_flag=True)
    quant = dict(key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko,
                 value_antiquant_offset=vo, key_antiquant_mode=mode, value_antiquant_mode=mode)
    return q, lay(k8), lay(v8), lay(kd), lay(vd), kw, quant


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("cache", ["BnBsH", "BnNBsD"])
@pytest.mark.parametrize("mode", [0, 1, 3, 4, 5])
@pytest.mark.parametrize("with_offset", [False, True], ids=["sym", "offset"])
def test_decode_paged_modes(cache, mode, with_offset, dtype, decode_path):
    torch.manual_seed(mode)
    q, k8, v8, kd, vd, kw, quant = paged_case(cache, mode, with_offset, dtype)
    layout = "BSH" if cache == "BnBsH" else "BNSD"
    if layout == "BNSD":
        q = q.view(q.shape[0], 1, kw["num_heads"], -1).transpose(1, 2)
    out, lse = npu.npu_fused_infer_attention_score(q, k8, v8, input_layout=layout, **kw,
                                                   **quant)
    ref = reference(q, kd, vd, n=kw["num_heads"], kvn=kw["num_key_value_heads"], scale=0.3,
                    layout=layout, seq_kv=kw["actual_seq_lengths_kv"],
                    block_table=kw["block_table"])
    check(out, lse, ref, dtype)


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
def test_decode_tnd_paged_vllm_style_v2(dtype, decode_path):
    """vllm-ascend's decode: TND query, BnBsH int8 cache, per-channel factors (v2 names)."""
    torch.manual_seed(7)
    q, k8, v8, kd, vd, kw, quant = paged_case("BnBsH", 0, True, dtype)
    B, N = q.shape[0], kw["num_heads"]
    qt = q.view(B, N, -1)
    out, lse = npu.npu_fused_infer_attention_score_v2(
        qt, k8, v8, num_query_heads=N, num_key_value_heads=kw["num_key_value_heads"],
        softmax_scale=0.3, input_layout="TND", block_table=kw["block_table"],
        block_size=kw["block_size"], actual_seq_qlen=list(range(1, B + 1)),
        actual_seq_kvlen=kw["actual_seq_lengths_kv"], return_softmax_lse=True,
        dequant_scale_key=quant["key_antiquant_scale"],
        dequant_scale_value=quant["value_antiquant_scale"],
        dequant_offset_key=quant["key_antiquant_offset"],
        dequant_offset_value=quant["value_antiquant_offset"])
    ref = reference(qt, kd, vd, n=N, kvn=kw["num_key_value_heads"], scale=0.3, layout="TND",
                    seq=list(range(1, B + 1)), seq_kv=kw["actual_seq_lengths_kv"],
                    block_table=kw["block_table"])
    check(out, lse, ref, dtype)


@pytest.mark.parametrize("mode", [0, 1])
def test_decode_long_context_splits(mode):
    """Few (batch, kv head) pairs and a long context: the context is split across threads and
    the partial softmax states merged."""
    torch.manual_seed(8)
    B, N, KVN, S, D = 1, 4, 1, 3000, 32
    q = torch.randn(B, N, 1, D).bfloat16()
    k8, v8 = i8(B, KVN, S, D), i8(B, KVN, S, D)
    ks, ko, kdeq = factors(mode, "bs" if mode else "nd", B, KVN, S, D, True, torch.bfloat16)
    vs, vo, vdeq = factors(mode, "bs" if mode else "nd", B, KVN, S, D, True, torch.bfloat16)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k8, v8, key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko,
        value_antiquant_offset=vo, key_antiquant_mode=mode, value_antiquant_mode=mode,
        num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", scale=0.1,
        softmax_lse_flag=True)
    ref = reference(q, kdeq(k8), vdeq(v8), n=N, kvn=KVN, scale=0.1, layout="BNSD")
    check(out, lse, ref, torch.bfloat16)


# Per-channel key and value factors: the decode kernel reads the codes themselves (on AVX-512
# with VNNI, q' and P as 16-bit integer codes for fp16 / bf16 queries; fp32 loops elsewhere).


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("D", [16, 40, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 6])
def test_decode_per_channel_codes(dtype, D, group):
    """Head dims below, across and at the 32-element steps, every head-tile size (4, 2, 1),
    context lengths that leave odd key pairs and short key groups, one empty sequence."""
    torch.manual_seed(D * 7 + group)
    KVN = 2
    N = KVN * group
    lens = [1, 67, 0, 130]
    B, S = len(lens), max(lens)
    q = torch.randn(B, N, 1, D).to(dtype)
    k8, v8 = i8(B, KVN, S, D), i8(B, KVN, S, D)
    ks, ko, kdeq = factors(0, "nd", B, KVN, S, D, True, dtype)
    vs, vo, vdeq = factors(0, "nd", B, KVN, S, D, True, dtype)
    out, lse = npu.npu_fused_infer_attention_score(
        q, k8, v8, key_antiquant_scale=ks, key_antiquant_offset=ko, value_antiquant_scale=vs,
        value_antiquant_offset=vo, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
        scale=D ** -0.5, actual_seq_lengths_kv=lens, softmax_lse_flag=True)
    ref = reference(q, kdeq(k8), vdeq(v8), n=N, kvn=KVN, scale=D ** -0.5, layout="BNSD",
                    seq_kv=lens)
    check(out, lse, ref, dtype)


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
def test_decode_per_channel_codes_not_less_accurate_than_the_composition(dtype):
    """A query with an outlier channel (64x the others) and a long context with a few keys far
    above the rest: the output's error against float64 is at most that of the composition a
    user writes in the query's dtype (dequantise, then softmax(q k^T) v)."""
    torch.manual_seed(5)
    B, N, KVN, S, D = 2, 8, 2, 2100, 128
    q = torch.randn(B, N, 1, D)
    q[..., 7] *= 64
    q = q.to(dtype)
    k8, v8 = i8(B, KVN, S, D), i8(B, KVN, S, D)
    k8[:, :, ::300] = 127  # keys with large scores among many small ones
    ks, ko, kdeq = factors(0, "nd", B, KVN, S, D, True, dtype)
    vs, vo, vdeq = factors(0, "nd", B, KVN, S, D, True, dtype)
    out, _ = npu.npu_fused_infer_attention_score(
        q, k8, v8, key_antiquant_scale=ks, key_antiquant_offset=ko, value_antiquant_scale=vs,
        value_antiquant_offset=vo, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
        scale=0.01)
    ref, _ = reference(q, kdeq(k8), vdeq(v8), n=N, kvn=KVN, scale=0.01, layout="BNSD")
    kd = kdeq(k8).to(dtype).repeat_interleave(N // KVN, 1)
    vd = vdeq(v8).to(dtype).repeat_interleave(N // KVN, 1)
    comp = torch.softmax((q @ kd.transpose(-1, -2)) * 0.01, -1) @ vd
    ours_err = (out.double() - ref).abs().max().item()
    comp_err = (comp.double() - ref).abs().max().item()
    assert ours_err <= comp_err, (ours_err, comp_err)


@pytest.mark.parametrize("S", [50, 3000], ids=["one_split", "context_splits"])
def test_decode_per_channel_codes_nan_query_head(S):
    """A NaN in one query head's row makes that head's output NaN (as the composition gives),
    and leaves the other heads of its group exact."""
    torch.manual_seed(6)
    B, N, KVN, D = 1, 4, 1, 32
    q = torch.randn(B, N, 1, D).bfloat16()
    q[0, 2, 0, 5] = float("nan")
    k8, v8 = i8(B, KVN, S, D), i8(B, KVN, S, D)
    ks, ko, kdeq = factors(0, "nd", B, KVN, S, D, True, torch.bfloat16)
    vs, vo, vdeq = factors(0, "nd", B, KVN, S, D, True, torch.bfloat16)
    out, _ = npu.npu_fused_infer_attention_score(
        q, k8, v8, key_antiquant_scale=ks, key_antiquant_offset=ko, value_antiquant_scale=vs,
        value_antiquant_offset=vo, num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
        scale=0.2)
    assert out[0, 2].isnan().all()
    keep = [0, 1, 3]
    ref, _ = reference(q[:, keep], kdeq(k8), vdeq(v8), n=3, kvn=1, scale=0.2, layout="BNSD")
    assert_close(out[:, keep], ref, dtype=torch.bfloat16, scale=2)


# ----------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("mode,form", [(0, "1n1d"), (0, "tensor"), (1, "1bs")], ids=str)
@pytest.mark.parametrize("layout", ["BNSD", "BSH"])
def test_prefill_causal(layout, mode, form, dtype):
    torch.manual_seed(9)
    B, N, KVN, Sq, S, D = 2, 4, 2, 6, 21, 16
    qc = torch.randn(B, N, Sq, D).to(dtype)
    k8, v8 = i8(B, KVN, S, D), i8(B, KVN, S, D)
    ks, ko, kdeq = factors(mode, form, B, KVN, S, D, True, dtype)
    vs, vo, vdeq = factors(mode, form, B, KVN, S, D, True, dtype)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout=layout, scale=0.25,
              sparse_mode=3, actual_seq_lengths=[6, 4], actual_seq_lengths_kv=[21, 12])
    out, lse = npu.npu_fused_infer_attention_score(
        to_layout(qc, layout), to_layout(k8, layout), to_layout(v8, layout), atten_mask=mask,
        key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko,
        value_antiquant_offset=vo, key_antiquant_mode=mode, value_antiquant_mode=mode,
        softmax_lse_flag=True, **kw)
    ref = reference(to_layout(qc, layout), to_layout(kdeq(k8), layout),
                    to_layout(vdeq(v8), layout), n=N, kvn=KVN, scale=0.25, layout=layout,
                    seq=[6, 4], seq_kv=[21, 12], atten_mask=mask, sparse_mode=3)
    check(out, lse, ref, dtype)


@pytest.mark.parametrize("mode", [0, 1, 4])
def test_prefill_paged(mode):
    torch.manual_seed(10)
    dtype = torch.float16
    q, k8, v8, kd, vd, kw, quant = paged_case("BnNBsD", mode, True, dtype)
    B, N = q.shape[0], kw["num_heads"]
    q = torch.randn(B, N, 5, 16).to(dtype)
    out, lse = npu.npu_fused_infer_attention_score(q, k8, v8, input_layout="BNSD", **kw,
                                                   **quant)
    ref = reference(q, kd, vd, n=N, kvn=kw["num_key_value_heads"], scale=0.3, layout="BNSD",
                    seq_kv=kw["actual_seq_lengths_kv"], block_table=kw["block_table"])
    check(out, lse, ref, dtype)


def test_non_contiguous_cache_and_empty_rows(decode_path):
    torch.manual_seed(11)
    B, N, KVN, S, D = 2, 2, 2, 24, 16
    q = torch.randn(B, N, 1, D).half()
    base = i8(B, S, KVN, D + 4)
    k8 = base[..., :D].transpose(1, 2)  # BNSD view of a padded BSND buffer
    v8 = i8(B, KVN, D, S).transpose(-1, -2)
    ks, ko, kdeq = factors(0, "nd", B, KVN, S, D, True, torch.float16)
    vs, vo, vdeq = factors(0, "nd", B, KVN, S, D, True, torch.float16)
    lens = [0, 24]
    out, lse = npu.npu_fused_infer_attention_score(
        q, k8, v8, key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_offset=ko,
        value_antiquant_offset=vo, num_heads=N, input_layout="BNSD", scale=0.3,
        actual_seq_lengths_kv=lens, softmax_lse_flag=True)
    ref = reference(q, kdeq(k8), vdeq(v8), n=N, scale=0.3, layout="BNSD", seq_kv=lens)
    check(out, lse, ref, torch.float16)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isinf(lse[0]).all()


# ----------------------------------------------------------------------------- portable


PORTABLE_CASES = [("BnBsH", 0, True), ("BnNBsD", 1, True), ("BnNBsD", 5, False),
                  ("BnBsH", 3, True)]


@pytest.mark.parametrize("cache,mode,with_offset", PORTABLE_CASES, ids=str)
def test_portable_matches_cpp(cache, mode, with_offset):
    torch.manual_seed(12)
    q, k8, v8, kd, vd, kw, quant = paged_case(cache, mode, with_offset, torch.bfloat16)
    layout = "BSH" if cache == "BnBsH" else "BNSD"
    if layout == "BNSD":
        q = q.view(q.shape[0], 1, kw["num_heads"], -1).transpose(1, 2)
    cpp = npu.npu_fused_infer_attention_score(q, k8, v8, input_layout=layout, **kw, **quant)
    with portable.force():
        port = npu.npu_fused_infer_attention_score(q, k8, v8, input_layout=layout, **kw, **quant)
    assert_close(port[0], cpp[0], dtype=torch.bfloat16)
    assert_close(port[1], cpp[1], dtype=torch.float32)


def test_portable_combined_and_v2_and_prefill():
    torch.manual_seed(13)
    B, N, KVN, S, D = 2, 4, 2, 13, 8
    q, qp = torch.randn(B, N, 1, D).half(), torch.randn(B, N, 5, D).half()
    k8, v8 = i8(B, KVN, S, D), i8(B, KVN, S, D)
    sc, off = pos(2, B, S), torch.randn(2, B, S)
    ks, vs = pos(KVN).half(), pos(KVN).half()
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BNSD", softmax_lse_flag=True)
    calls = [
        lambda: npu.npu_fused_infer_attention_score(q, k8, v8, antiquant_scale=sc,
                                                    antiquant_offset=off, antiquant_mode=1, **kw),
        lambda: npu.npu_fused_infer_attention_score(qp, k8, v8, antiquant_scale=sc,
                                                    antiquant_mode=1, **kw),
        lambda: npu.npu_fused_infer_attention_score_v2(
            q, k8, v8, dequant_scale_key=ks, dequant_scale_value=vs,
            key_quant_mode=2, value_quant_mode=2, num_query_heads=N, num_key_value_heads=KVN,
            input_layout="BNSD", return_softmax_lse=True),
    ]
    for call in calls:
        cpp = call()
        with portable.force():
            port = call()
        assert_close(port[0], cpp[0], dtype=torch.float16)
        assert_close(port[1], cpp[1], dtype=torch.float32)


# ----------------------------------------------------------------------------- bad inputs


def _bad(**over):
    B, N, KVN, S, D = 2, 4, 2, 10, 8
    args = dict(query=torch.randn(B, N, 1, D).half(), key=i8(B, KVN, S, D),
                value=i8(B, KVN, S, D))
    kw = dict(num_heads=N, num_key_value_heads=KVN, input_layout="BNSD",
              key_antiquant_scale=pos(KVN, D).half(), value_antiquant_scale=pos(KVN, D).half())
    for name in ("query", "key", "value"):
        if name in over:
            args[name] = over.pop(name)
    kw.update(over)
    kw = {k: v for k, v in kw.items() if v is not None}
    return npu.npu_fused_infer_attention_score(args["query"], args["key"], args["value"], **kw)


OP = "npu_fused_infer_attention_score: argument "
BAD = [
    (dict(value=torch.randn(2, 2, 10, 8).half()),
     OP + "'value' must be int8 like 'key' .* but got Half"),
    (dict(key_antiquant_scale=None, value_antiquant_scale=None),
     OP + "'key' is int8, which needs antiquant factors"),
    (dict(value_antiquant_scale=None), OP + "'value_antiquant_scale' must be given together"),
    (dict(key_antiquant_scale=pos(2, 7).half()),
     OP + r"'key_antiquant_scale' must be .* \(KV_N, D\).* D = 8, but got shape \[2, 7\]"),
    (dict(key_antiquant_scale=torch.ones(2, 8, dtype=torch.int32)),
     OP + "'key_antiquant_scale' must be float16, bfloat16 or float32 .* but got Int"),
    (dict(key_antiquant_scale=pos(2, 10).half(), value_antiquant_scale=pos(2, 10).half(),
          key_antiquant_mode=1, value_antiquant_mode=1),
     OP + "'key_antiquant_scale' must be float32 for key_antiquant_mode 1, but got Half"),
    (dict(key_antiquant_scale=pos(2, 9), value_antiquant_scale=pos(2, 9),
          key_antiquant_mode=1, value_antiquant_mode=1),
     OP + r"'key_antiquant_scale' must cover the 10 keys read"),
    (dict(key_antiquant_offset=torch.zeros(2, 8).half()),
     OP + "'value_antiquant_offset' must be given together"),
    (dict(key_antiquant_offset=torch.zeros(8).half(), value_antiquant_offset=torch.zeros(8).half()),
     OP + r"'key_antiquant_offset' must have the shape of 'key_antiquant_scale' \[2, 8\]"),
    (dict(key_antiquant_mode=1, value_antiquant_mode=0),
     OP + r"'value_antiquant_mode' must equal key_antiquant_mode \(1\)"),
    (dict(key_antiquant_scale=pos(2, 2).float(), value_antiquant_scale=pos(2, 2).float(),
          key_antiquant_mode=4, value_antiquant_mode=4),
     OP + "'key_antiquant_mode' may be 4 only with a paged cache"),
    (dict(key_antiquant_mode=6, value_antiquant_mode=6), OP + "'key_antiquant_mode' must be in"),
    (dict(key_antiquant_scale=None, value_antiquant_scale=None, antiquant_scale=pos(3, 16).half()),
     OP + "'antiquant_scale' must hold the key .* leading dim of 2, but got shape \\[3, 16\\]"),
    (dict(key_antiquant_scale=None, value_antiquant_scale=None, antiquant_scale=pos(2, 16).half(),
          antiquant_mode=3),
     OP + "'antiquant_mode' must be 0 .* or 1 .* but got 3"),
    (dict(query=torch.randn(2, 4, 1, 8).double()),
     OP + "'query' must be float16, bfloat16 or float32 with an int8 key/value cache"),
]


@pytest.mark.parametrize("over,match", BAD, ids=range(len(BAD)))
def test_bad_inputs(over, match):
    with pytest.raises(RuntimeError, match=match):
        _bad(**over)


@pytest.mark.parametrize("over,match", BAD[:4] + BAD[9:10], ids=range(5))
def test_bad_inputs_portable(over, match):
    """The portable path raises for the same mistakes (its own wording, op and argument named)."""
    with portable.force(), pytest.raises(RuntimeError, match="npu_fused_infer_attention_score"):
        _bad(**over)


def test_bad_rope_with_int8():
    q = torch.randn(1, 2, 1, 8).half()
    k8 = i8(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="'key_rope' is not supported with an int8"):
        npu.npu_fused_infer_attention_score(
            q, k8, k8, query_rope=q, key_rope=k8, num_heads=2, input_layout="BNSD",
            key_antiquant_scale=pos(2, 8).half(), value_antiquant_scale=pos(2, 8).half())


# ----------------------------------------------------------------------------- registration


def test_opcheck_and_compile():
    torch.manual_seed(14)
    q, k8, v8, kd, vd, kw, quant = paged_case("BnBsH", 1, True, torch.float16)
    quant = {k: v for k, v in quant.items()}
    opcheck(npu.npu_fused_infer_attention_score.default, [((q, k8, v8), {**kw, **quant})])
    opcheck(npu.npu_fused_infer_attention_score_v2.default, [(
        (q, k8, v8), dict(num_query_heads=kw["num_heads"],
                          num_key_value_heads=kw["num_key_value_heads"],
                          block_table=kw["block_table"], block_size=kw["block_size"],
                          actual_seq_kvlen=kw["actual_seq_lengths_kv"],
                          dequant_scale_key=quant["key_antiquant_scale"],
                          dequant_scale_value=quant["value_antiquant_scale"],
                          key_quant_mode=1, value_quant_mode=1))])
    torch._dynamo.reset()

    def f(q, k8, v8, ks, vs):
        return npu.npu_fused_infer_attention_score(
            q, k8, v8, key_antiquant_scale=ks, value_antiquant_scale=vs, key_antiquant_mode=1,
            value_antiquant_mode=1, **kw)

    args = (q, k8, v8, quant["key_antiquant_scale"], quant["value_antiquant_scale"])
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, dynamic=True)(*args)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


# ----------------------------------------------------------------------------- int4 caches


def i4_words(codes8):
    """int8 codes in [-8, 7] [..., 8 w] -> int32 words [..., w], eight codes each, lowest bits first."""
    flat = codes8.to(torch.int32).reshape(-1, codes8.shape[-1])
    return npu.npu_convert_weight_to_int4pack(flat).reshape(*codes8.shape[:-1], -1)


@pytest.mark.parametrize("dtype", LOW, ids=dtype_id)
@pytest.mark.parametrize("layout,sq", [("BSH", 1), ("BNSD", 1), ("BSND", 5)])
@pytest.mark.parametrize("mode", [0, 1])
def test_int4_cache_equals_the_int8_path(layout, sq, mode, dtype, decode_path):
    """An int4 key/value (int32 words, the last dim an eighth of the real one) gives what the
    same codes as int8 give, bit for bit, and matches the float64 reference."""
    torch.manual_seed(mode + sq)
    B, N, KVN, S, D = 2, 4, 2, 19, 16
    qc = torch.randn(B, N, sq, D).to(dtype)
    k8, v8 = (torch.randint(-8, 8, (B, KVN, S, D), dtype=torch.int8) for _ in range(2))
    ks, ko, kdeq = factors(mode, "bs" if mode == 1 else "1nd", B, KVN, S, D, True, dtype)
    vs, vo, vdeq = factors(mode, "bs" if mode == 1 else "1nd", B, KVN, S, D, True, dtype)
    kw = dict(key_antiquant_scale=ks, key_antiquant_offset=ko, value_antiquant_scale=vs,
              value_antiquant_offset=vo, key_antiquant_mode=mode, value_antiquant_mode=mode,
              num_heads=N, num_key_value_heads=KVN, input_layout=layout, scale=0.25,
              actual_seq_lengths_kv=[S, 11], softmax_lse_flag=True)
    q, k, v = (to_layout(t, layout) for t in (qc, k8, v8))
    out8, lse8 = npu.npu_fused_infer_attention_score(q, k, v, **kw)
    out4, lse4 = npu.npu_fused_infer_attention_score(q, i4_words(k), i4_words(v), **kw)
    assert torch.equal(out4, out8) and torch.equal(lse4, lse8)
    ref = reference(q, to_layout(kdeq(k8), layout), to_layout(vdeq(v8), layout), n=N, kvn=KVN,
                    scale=0.25, layout=layout, seq_kv=[S, 11])
    check(out4, lse4, ref, dtype)


def test_int4_paged_cache_equals_the_int8_path():
    torch.manual_seed(3)
    q, k8, v8, _, _, kw, quant = paged_case("BnBsH", 0, True, torch.float16)
    k8, v8 = (t.clamp(-8, 7) for t in (k8, v8))
    out8, _ = npu.npu_fused_infer_attention_score(q, k8, v8, input_layout="BSH", **kw, **quant)
    out4, _ = npu.npu_fused_infer_attention_score(q, i4_words(k8), i4_words(v8), input_layout="BSH",
                                                  **kw, **quant)
    assert torch.equal(out4, out8)


def test_int4_cache_without_factors_is_refused():
    q = torch.randn(1, 1, 32, dtype=torch.float16)
    k = torch.zeros(1, 4, 4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="int4 key/value packed in int32 needs antiquant factors"):
        npu.npu_fused_infer_attention_score(q, k, k, num_heads=1, input_layout="BSH")
