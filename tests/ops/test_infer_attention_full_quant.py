"""npu_fused_infer_attention_score's full int8 quantisation: int8 query, key and value with
dequant_scale1 (after Q K^T), quant_scale1 (softmax's exps to int8 codes before P V) and
dequant_scale2 (after P V); float16 output, or int8 through quant_scale2 / quant_offset2.

The oracle follows the documented steps in float64: scores (q . k) * dequant_scale1 * scale
(the factor product in float32, as the op forms it), exps e = exp(s - row max), codes
rint(float16(e * quant_scale1)) saturated at 127, output (codes . v) * dequant_scale2 / sum(e).
With one key block (<= 512 keys) the op's exps are against the row's own max too, so its codes
are the oracle's except where e * quant_scale1 sits within float32 exp error of a rounding
boundary: rows with such a code are checked against the bound of one code step instead."""

from __future__ import annotations

import math

import pytest
import torch
from op_helpers import opcheck
from test_infer_attention import _from_bnsd, _to_bnsd

npu = torch.ops.npu
LAYOUTS = ["BSH", "BNSD", "BSND", "BNSD_BSND"]


def int8(*shape, lo=-128, hi=128):
    return torch.randint(lo, hi, shape, dtype=torch.int8)


def make(layout, B, N, KVN, Sq, Skv, D, qk_range=128):
    lin = layout.split("_")[0]
    shape = {"BSH": lambda h, s: (B, s, h * D), "BSND": lambda h, s: (B, s, h, D),
             "BNSD": lambda h, s: (B, h, s, D)}[lin]
    r = qk_range
    return int8(*shape(N, Sq), lo=-r, hi=r), int8(*shape(KVN, Skv), lo=-r, hi=r), \
        int8(*shape(KVN, Skv))


def codes(x, quant1):
    """int8 codes of exps x (float64) times quant_scale1: float16 product, half to even."""
    return torch.clamp(torch.round((x * quant1).float().half().double()), max=127.0)


def reference(q, k, v, *, n, kvn, layout, scale, deq1, quant1, deq2, mask=None):
    """(out float64 in the output layout, lse, per-row ambiguity flags, per-row code-step bound)."""
    lin = layout.split("_")[0]
    lout = layout.split("_")[-1]
    qc, kc, vc = (_to_bnsd(t.double(), lin, h) for t, h in ((q, n), (k, kvn), (v, kvn)))
    g = n // kvn
    kc, vc = kc.repeat_interleave(g, 1), vc.repeat_interleave(g, 1)
    factor = float(torch.tensor(scale * deq1, dtype=torch.float32))  # one float32 factor
    s = (qc @ kc.transpose(-1, -2)) * factor
    if mask is not None:
        s = s.masked_fill(mask.bool(), -math.inf)
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    e = torch.exp(s - mx)
    tot = e.sum(-1, keepdim=True)
    c = codes(e, quant1)
    # A code is ambiguous where a relative nudge of 1e-5 (far above float32 exp error) moves it.
    ambiguous = ((codes(e * (1 + 1e-5), quant1) != c) | (codes(e * (1 - 1e-5), quant1) != c))
    out = torch.where(tot > 0, (c @ vc) * deq2 / tot, torch.zeros(()))
    lse = torch.log(tot) + mx
    step = vc.abs().sum(-2, keepdim=True).amax(-1, keepdim=True) * deq2 / tot  # one code per key
    return (_from_bnsd(out, lout), lse, _from_bnsd(ambiguous.any(-1, keepdim=True).expand_as(out),
                                                   lout), _from_bnsd(step.expand_as(out), lout))


def check(out, ref, loose_only=False):
    ro, _, ambiguous, step = ref
    assert out.dtype == torch.float16 and out.shape == ro.shape
    err = (out.double() - ro).abs()
    tight = 1e-3 * ro.abs() + 1e-6 * step  # float16's rounding of the output
    if not loose_only:
        assert bool((err <= tight)[~ambiguous].all()), err[~ambiguous].max()
    assert bool((err <= step + tight).all())  # at most one code step per key anywhere


KW = dict(deq1=2e-4, quant1=127.0, deq2=0.0021)  # scores of order 1: a spread softmax


def call(q, k, v, *, deq1, quant1, deq2, dtype=torch.float32, **kw):
    return npu.npu_fused_infer_attention_score(
        q, k, v, dequant_scale1=torch.tensor([deq1], dtype=dtype),
        quant_scale1=torch.tensor([quant1]), dequant_scale2=torch.tensor([deq2], dtype=dtype), **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sq", [1, 5])
def test_matches_documented_steps(layout, sq):
    torch.manual_seed(sq)
    n, kvn, d = 4, 2, 32
    q, k, v = make(layout, 2, n, kvn, sq, 37, d)
    out, lse = call(q, k, v, num_heads=n, num_key_value_heads=kvn, input_layout=layout,
                    scale=1 / math.sqrt(d), softmax_lse_flag=True, **KW)
    ref = reference(q, k, v, n=n, kvn=kvn, layout=layout, scale=1 / math.sqrt(d), **KW)
    check(out, ref)
    assert lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), ref[1], rtol=1e-5, atol=1e-5)


def test_codes_are_quantised_before_p_v():
    """A coarse quant_scale1 (codes 0..3) moves the output far from unquantised attention, and
    exactly where the documented codes put it."""
    torch.manual_seed(3)
    q, k, v = make("BNSD", 1, 2, 2, 3, 24, 16, qk_range=8)
    kw = dict(num_heads=2, input_layout="BNSD", scale=0.25)
    steps = dict(deq1=0.02, quant1=3.0, deq2=0.01)
    out, _ = call(q, k, v, **kw, **steps)
    ref = reference(q, k, v, n=2, kvn=2, layout="BNSD", scale=0.25, **steps)
    check(out, ref)
    # Unquantised: softmax(q k * 0.02 * 0.25) v * (0.01 * 3).
    plain = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * 0.005, -1) @ v.double()
    assert (out.double() - plain * 0.03).abs().max() > 0.05 * plain.abs().max() * 0.03


def test_int64_dequant_factors_of_npu_trans_quant_param():
    """The int64 encoding's factor is the float32 in its low 32 bits (npu_trans_quant_param
    keeps 10 mantissa bits of it)."""
    torch.manual_seed(4)
    q, k, v = make("BSH", 2, 2, 2, 4, 19, 16)
    kw = dict(num_heads=2, input_layout="BSH", scale=0.25)
    deq1, deq2 = (npu.npu_trans_quant_param(torch.tensor([KW[f]])) for f in ("deq1", "deq2"))
    got, _ = npu.npu_fused_infer_attention_score(
        q, k, v, dequant_scale1=deq1, quant_scale1=torch.tensor([KW["quant1"]]),
        dequant_scale2=deq2, **kw)
    low = [float((t & 0xFFFFFFFF).to(torch.int32).view(torch.float32)) for t in (deq1, deq2)]
    want, _ = call(q, k, v, **kw, deq1=low[0], quant1=KW["quant1"], deq2=low[1])
    assert torch.equal(got, want)
    unsigned, _ = npu.npu_fused_infer_attention_score(
        q, k, v, dequant_scale1=deq1.to(torch.uint64), quant_scale1=torch.tensor([KW["quant1"]]),
        dequant_scale2=deq2.to(torch.uint64), **kw)
    assert torch.equal(unsigned, want)


def test_int8_output_through_quant_scale2():
    torch.manual_seed(5)
    q, k, v = make("BNSD", 1, 2, 1, 6, 30, 16)
    kw = dict(num_heads=2, num_key_value_heads=1, input_layout="BNSD", scale=0.25)
    out, _ = call(q, k, v, quant_scale2=torch.tensor([40.0]), quant_offset2=torch.tensor([3.0]),
                  **kw, **KW)
    assert out.dtype == torch.int8
    ro, _, ambiguous, _ = reference(q, k, v, n=2, kvn=1, layout="BNSD", scale=0.25, **KW)
    want = torch.clamp(torch.round((ro * 40 + 3).float().half().double()), -128, 127)
    assert (out.double() - want)[~ambiguous].abs().max() <= 1  # float32 vs float64 at .5


def test_masks_and_many_key_blocks():
    """An explicit mask, and 1100 keys (three of the kernel's key blocks: codes of earlier blocks
    rescale when a later one raises the max, as on Ascend's tiles, so within one code step)."""
    torch.manual_seed(6)
    q, k, v = make("BNSD", 1, 2, 2, 4, 1100, 16)
    mask = torch.rand(4, 1100) < 0.3
    kw = dict(num_heads=2, input_layout="BNSD", scale=0.25)
    out, _ = call(q, k, v, atten_mask=mask, **kw, **KW)
    check(out, reference(q, k, v, n=2, kvn=2, layout="BNSD", scale=0.25, mask=mask, **KW),
          loose_only=True)
    out, _ = call(q[..., :37, :], k[..., :37, :], v[..., :37, :], atten_mask=mask[:, :37], **kw,
                  **KW)
    check(out, reference(q, k[..., :37, :], v[..., :37, :], n=2, kvn=2, layout="BNSD",
                         scale=0.25, mask=mask[:, :37], **KW))


def test_non_contiguous_inputs_and_out_overload():
    torch.manual_seed(8)
    q, k, v = make("BNSD", 2, 2, 2, 3, 21, 16)
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    kw = dict(num_heads=2, input_layout="BNSD", scale=0.25)
    want, _ = call(q, k, v, **kw, **KW)
    got, _ = call(qt, kt, vt, **kw, **KW)
    assert torch.equal(got, want)
    out = torch.empty_like(want)
    lse = torch.empty(1)
    npu.npu_fused_infer_attention_score.out(
        q, k, v, dequant_scale1=torch.tensor([KW["deq1"]]),
        quant_scale1=torch.tensor([KW["quant1"]]), dequant_scale2=torch.tensor([KW["deq2"]]),
        attention_out=out, softmax_lse=lse, **kw)
    assert torch.equal(out, want)
    shape, _ = npu._npu_fused_infer_attention_score_infer_output(q, v, num_heads=2,
                                                                  input_layout="BNSD")
    assert shape.dtype == torch.float16 and shape.shape == want.shape


def test_empty_key_sequence():
    q, k, v = make("BNSD", 1, 2, 2, 3, 0, 16)
    out, _ = call(q, k, v, num_heads=2, input_layout="BNSD", **KW)
    assert out.dtype == torch.float16 and out.shape == (1, 2, 3, 16) and not out.any()


@pytest.mark.parametrize("over,match", [
    (dict(quant_scale1=None), "argument 'quant_scale1' is needed with an int8 query"),
    (dict(dequant_scale2=None), "argument 'dequant_scale2' is needed with an int8 query"),
    (dict(key=torch.zeros(1, 2, 7, 16)), "argument 'key' must be int8 with an int8 query"),
    (dict(query=torch.zeros(1, 2, 3, 16)), "argument 'dequant_scale1' needs an int8 query"),
    (dict(quant_scale1=torch.ones(2)), "'quant_scale1' must hold one float32 factor"),
    (dict(quant_scale1=torch.zeros(1)), "'quant_scale1' must be a positive finite factor"),
    (dict(dequant_scale1=torch.ones(1, dtype=torch.float16)),
     "'dequant_scale1' must hold one factor \\(per tensor\\), float32 or int64"),
    (dict(antiquant_scale=torch.ones(2, 1)), "'antiquant_scale' does not apply with an int8 query"),
    (dict(input_layout="TND", actual_seq_lengths=[3], actual_seq_lengths_kv=[7]),
     "'input_layout' must be BSH, BNSD, BSND or BNSD_BSND with an int8 query"),
])
def test_bad_inputs(over, match):
    q, k, v = make("BNSD", 1, 2, 2, 3, 7, 16)
    args = dict(query=q, key=k, value=v)
    for name in ("query", "key", "value"):
        if name in over:
            args[name] = over.pop(name)
    kw = dict(dequant_scale1=torch.ones(1), quant_scale1=torch.ones(1),
              dequant_scale2=torch.ones(1), num_heads=2, input_layout="BNSD")
    kw.update(over)
    if kw["input_layout"] == "TND":
        args = {name: t[0].transpose(0, 1) for name, t in args.items()}
    with pytest.raises(RuntimeError, match=match):
        npu.npu_fused_infer_attention_score(*args.values(), **kw)


def test_int8_query_needs_the_factors():
    q, k, v = make("BNSD", 1, 2, 2, 3, 7, 16)
    with pytest.raises(RuntimeError, match="'dequant_scale1' is needed with an int8 query"):
        npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD")


def test_opcheck_and_compile():
    torch.manual_seed(9)
    q, k, v = make("BSH", 1, 2, 2, 2, 9, 16)
    factors = dict(dequant_scale1=torch.tensor([0.01]), quant_scale1=torch.tensor([127.0]),
                   dequant_scale2=torch.tensor([0.002]))
    opcheck(npu.npu_fused_infer_attention_score.default,
            [((q, k, v), dict(num_heads=2, softmax_lse_flag=True, **factors))])
    torch._dynamo.reset()

    def f(q, k, v):
        return npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, **factors)[0]

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert compiled.dtype == torch.float16 and torch.equal(eager, compiled)


def test_portable_composition():
    """The ATen composition (devices without a native kernel) follows the same steps."""
    from opennpu.ops import portable

    torch.manual_seed(10)
    q, k, v = make("BSND", 2, 4, 2, 3, 29, 16)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BSND", scale=0.25)
    factors = dict(dequant_scale1=torch.tensor([KW["deq1"]]),
                   quant_scale1=torch.tensor([KW["quant1"]]),
                   dequant_scale2=torch.tensor([KW["deq2"]]))
    out, _ = portable.npu_fused_infer_attention_score(q, k, v, **factors, **kw)
    check(out, reference(q, k, v, n=4, kvn=2, layout="BSND", scale=0.25, **KW))
    out8, _ = portable.npu_fused_infer_attention_score(q, k, v, quant_scale2=torch.tensor([30.0]),
                                                       **factors, **kw)
    native8, _ = npu.npu_fused_infer_attention_score(q, k, v, quant_scale2=torch.tensor([30.0]),
                                                     **factors, **kw)
    assert out8.dtype == torch.int8 and (out8.int() - native8.int()).abs().max() <= 1
    with pytest.raises(RuntimeError, match="'dequant_scale1' is needed with an int8 query"):
        portable.npu_fused_infer_attention_score(q, k, v, **kw)


# ----------------------------------------------------------------------------- v2: int8 MLA


@pytest.mark.parametrize("layout", ["TND", "BSND"])
def test_v2_int8_mla_query_per_token_and_head(layout):
    """query_quant_mode 3: an int8 query with one factor per token and head, an int8 latent
    cache with per-tensor factors, bf16 rope parts; the output in bf16 is the attention of the
    dequantised values (float64 reference)."""
    from test_infer_attention import check, reference, rnd

    torch.manual_seed(13)
    N, D, Dr, bs, nb = 8, 64, 16, 16, 7
    bf16 = torch.bfloat16
    table = torch.tensor([[5, 0, 3], [1, 6, 2]], dtype=torch.int32)
    lens_kv = [40, 17]
    if layout == "TND":
        q8, qr = int8(3, N, D), rnd(3, N, Dr, dtype=bf16)
        seq = dict(actual_seq_qlen=[1, 3])
    else:
        q8, qr = int8(2, 2, N, D), rnd(2, 2, N, Dr, dtype=bf16)
        seq = {}
    sq = torch.rand(q8.shape[:-1]) / 500 + 1e-4
    c8, kr = int8(nb, bs, D), rnd(nb, bs, Dr, dtype=bf16)
    sk = torch.tensor([0.02])
    scale = 1 / math.sqrt(D + Dr)
    out, lse = npu.npu_fused_infer_attention_score_v2(
        q8, c8, c8, query_rope=qr, key_rope=kr, dequant_scale_query=sq, dequant_scale_key=sk,
        dequant_scale_value=sk, query_quant_mode=3, num_query_heads=N, num_key_value_heads=1,
        input_layout=layout, softmax_scale=scale, block_table=table, block_size=bs,
        actual_seq_kvlen=lens_kv, return_softmax_lse=True, **seq)
    qd = q8.double() * sq.double().unsqueeze(-1)
    cd = c8.double() * 0.02
    ref = reference(qd, cd, cd, n=N, kvn=1, scale=scale, layout=layout,
                    seq=seq.get("actual_seq_qlen"), seq_kv=lens_kv, block_table=table,
                    q_rope=qr, k_rope=kr)
    check(out, lse, ref, bf16)
    # a trailing 1 on the factors' shape, and the ATen composition, agree
    again, _ = npu.npu_fused_infer_attention_score_v2(
        q8, c8, c8, query_rope=qr, key_rope=kr, dequant_scale_query=sq.unsqueeze(-1),
        dequant_scale_key=sk, dequant_scale_value=sk, query_quant_mode=3, num_query_heads=N,
        num_key_value_heads=1, input_layout=layout, softmax_scale=scale, block_table=table,
        block_size=bs, actual_seq_kvlen=lens_kv, **seq)
    assert torch.equal(again, out)
    from opennpu.ops import portable

    ported, _ = portable.npu_fused_infer_attention_score_v2(
        q8, c8, c8, query_rope=qr, key_rope=kr, dequant_scale_query=sq, dequant_scale_key=sk,
        dequant_scale_value=sk, query_quant_mode=3, num_query_heads=N, num_key_value_heads=1,
        input_layout=layout, softmax_scale=scale, block_table=table, block_size=bs,
        actual_seq_kvlen=lens_kv, **seq)
    assert ported.dtype == bf16
    torch.testing.assert_close(ported.float(), out.float(), rtol=2e-2, atol=2e-2)
    shape, _ = npu._npu_fused_infer_attention_score_v2_infer_output(
        q8, c8, query_rope=qr, num_query_heads=N, num_key_value_heads=1, input_layout=layout,
        block_table=table)
    assert shape.dtype == bf16 and shape.shape == out.shape


@pytest.mark.parametrize("over,match", [
    (dict(query_quant_mode=0), "'query_quant_mode' must be 3 \\(per token and head\\)"),
    (dict(dequant_scale_query=None), "'dequant_scale_query' is needed with an int8 query"),
    (dict(query_rope=None, key_rope=None), "'query_rope' is needed with an int8 query"),
    (dict(dequant_scale_query=torch.ones(2, 4)),
     "'dequant_scale_query' must be float32 with query's shape but its head size \\(\\[2, 8\\]"),
    (dict(quant_scale_out=torch.ones(1)), "'quant_scale_out' is not supported by opennpu"),
    (dict(dequant_scale_key=None, dequant_scale_value=None),
     "'key' must be int8 with dequant_scale_key / dequant_scale_value"),
])
def test_v2_int8_mla_bad_inputs(over, match):
    from test_infer_attention import rnd

    q8, c8 = int8(2, 8, 32), int8(4, 16, 32)
    kw = dict(query_rope=rnd(2, 8, 16, dtype=torch.bfloat16),
              key_rope=rnd(4, 16, 16, dtype=torch.bfloat16), dequant_scale_query=torch.ones(2, 8),
              dequant_scale_key=torch.ones(1), dequant_scale_value=torch.ones(1),
              query_quant_mode=3, num_query_heads=8, num_key_value_heads=1, input_layout="TND",
              block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), block_size=16,
              actual_seq_qlen=[1, 2], actual_seq_kvlen=[20, 9])
    kw.update(over)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_fused_infer_attention_score_v2(q8, c8, c8, **kw)
