"""npu_fused_infer_attention_score (and _v2) with a quantised output: v1's quant_scale2 /
quant_offset2 (int8), v2's quant_scale_out / quant_offset_out (int8, float8_e5m2,
float8_e4m3fn). The oracle quantises the op's own float32 output (the attention on float32 copies
of the inputs) in plain PyTorch / NumPy at the documented rounding points (o * scale, + offset,
each in float32; int8 through float16, round half to even, saturated), so a code is checked
exactly; the float32 output is checked against the float64 reference of test_infer_attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from op_helpers import dtype_id, opcheck
from test_infer_attention import _from_bnsd, make, reference

import opennpu
from opennpu.ops import portable

npu = torch.ops.npu
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def channel_factors(factors, n, dv, lout, out_shape):
    """[Q_N, D] factors (or one) broadcast onto an output of layout `lout`."""
    f = factors.float().reshape(-1)
    if f.numel() == 1:
        return f.reshape(1).expand(out_shape)
    f = f.reshape(n, dv)
    if lout in ("TND",):
        return f.expand(out_shape)
    if lout == "NTD":
        return f.unsqueeze(1).expand(out_shape)
    b = 1 if lout == "NSD" else out_shape[{"BSH": 0, "BSND": 0, "BNSD": 0, "NBSD": 1}[lout]]
    s = out_shape[{"BSH": 1, "BSND": 1, "BNSD": 2, "NBSD": 2, "NSD": 1}[lout]]
    return _from_bnsd(f.view(1, n, 1, dv).expand(b, n, s, dv), lout).reshape(out_shape)


def quantise(o32, scale, offset, n, dv, lout, dtype=torch.int8):
    """The documented post-quantisation of a float32 output, step by step."""
    assert o32.dtype == torch.float32
    y = o32 * channel_factors(scale, n, dv, lout, o32.shape)  # float32 product
    if offset is not None:
        y = y + channel_factors(offset, n, dv, lout, o32.shape)  # float32 sum
    if dtype != torch.int8:
        return y.to(dtype)
    h = y.half().numpy().astype(np.float64)  # float32 -> float16, half to even
    h = np.nan_to_num(h, nan=0.0, posinf=127.0, neginf=-128.0)
    return torch.from_numpy(np.clip(np.rint(h), -128, 127).astype(np.int8))


def f32(*ts):
    return [t.float() if t is not None and t.is_floating_point() else t for t in ts]


LAYOUTS = ["BSH", "BNSD", "BSND", "BNSD_BSND", "BSH_NBSD", "NSD"]
FORMS = ["tensor", "nd", "1n1d", "h", "1_1_h"]


def factors_of(form, n, dv, dtype=torch.float32, offset=False, spread=40.0):
    shape = {"tensor": (1,), "nd": (n, dv), "1n1d": (1, n, 1, dv), "h": (n * dv,),
             "1_1_h": (1, 1, n * dv)}[form]
    sc = (torch.rand(shape) * spread + 1.0).to(dtype)
    off = (torch.randn(shape) * 3).to(dtype) if offset else None
    return sc, off


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("sq", [1, 5])
def test_int8_output_matches_quantised_float32_output(layout, dtype, sq):
    torch.manual_seed(1)
    n, kvn, d = 4, 2, 8
    q, k, v = make(layout, 2, n, kvn, sq, 13, d, dtype)
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=0.35,
              softmax_lse_flag=True)
    lout = opennpu.ops.infer_attention.LAYOUTS[layout][1]
    for i, form in enumerate(FORMS):
        sc, off = factors_of(form, n, d, offset=i % 2 == 1)
        out, lse = npu.npu_fused_infer_attention_score(q, k, v, quant_scale2=sc, quant_offset2=off,
                                                       **kw)
        o32, lse32 = npu.npu_fused_infer_attention_score(*f32(q, k, v), **kw)
        assert out.dtype == torch.int8 and out.shape == o32.shape
        want = quantise(o32, sc, off, n, d, lout)
        if dtype == torch.bfloat16 and sq == 1:
            # bf16 decode may take q . k from vdpbf16ps (pairwise sums) where the float32 copies
            # convert: float32 results within ulps, so a code may sit across a .5 boundary
            assert (out.int() - want.int()).abs().max() <= 1, form
            assert (out == want).float().mean() > 0.95, form
            torch.testing.assert_close(lse, lse32, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(out, want), form
            assert torch.equal(lse, lse32)
        assert out.unique().numel() > 10  # a spread of codes, not all saturated or zero
        # the float32 output is the attention (float64 reference)
        ro, _ = reference(q, k, v, n=n, kvn=kvn, scale=0.35, layout=layout)
        torch.testing.assert_close(o32.double(), ro, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["TND", "NTD_TND", "TND_NTD"])
def test_int8_output_varlen(layout):
    torch.manual_seed(2)
    n, kvn, d = 4, 2, 8
    lin = opennpu.ops.infer_attention.LAYOUTS[layout][0]
    q, k, v = torch.randn(9, n, d), torch.randn(11, kvn, d), torch.randn(11, kvn, d)
    if lin == "NTD":
        q, k, v = q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(), \
            v.transpose(0, 1).contiguous()
    kw = dict(num_heads=n, num_key_value_heads=kvn, input_layout=layout, scale=0.3,
              actual_seq_lengths=[4, 9], actual_seq_lengths_kv=[5, 11], sparse_mode=0)
    sc, off = factors_of("nd", n, d, offset=True)
    out, _ = npu.npu_fused_infer_attention_score(q, k, v, quant_scale2=sc, quant_offset2=off, **kw)
    o32, _ = npu.npu_fused_infer_attention_score(q, k, v, **kw)
    lout = opennpu.ops.infer_attention.LAYOUTS[layout][1]
    assert torch.equal(out, quantise(o32, sc, off, n, d, lout))


def test_rounding_points_are_the_documented_ones():
    """One visible key: o = v exactly, so the codes of chosen values are known by hand."""
    vals = torch.tensor([2.5, 3.5, -2.5, -0.5, 0.5, 2.5004, -3.4999, 126.6, 127.5, 300.0,
                         -128.5, -1e6, 1e6, float("nan"), 1.0, 0.0])
    d = vals.numel()
    q = torch.ones(1, 1, 1, d)
    k = torch.zeros(1, 1, 1, d)
    v = vals.view(1, 1, 1, d)
    out, _ = npu.npu_fused_infer_attention_score(q, k, v, num_heads=1, input_layout="BNSD",
                                                 quant_scale2=torch.ones(1))
    # half to even; 2.5004 is 2.5 in float16 (-> 2, not 3); -3.4999 is -3.5 (-> -4); saturation;
    # float16 overflow (+-1e6 -> inf) saturates; NaN -> 0
    want = [2, 4, -2, 0, 0, 2, -4, 127, 127, 127, -128, -128, 127, 0, 1, 0]
    assert out.flatten().tolist() == want
    # the offset is added after the product: 0.25 * 10 + 0 = 2.5 -> 2, + 1 = 3.5 -> 4
    out, _ = npu.npu_fused_infer_attention_score(
        q, k, torch.full((1, 1, 1, d), 0.25), num_heads=1, input_layout="BNSD",
        quant_scale2=torch.full((1,), 10.0), quant_offset2=torch.full((1,), 0.0))
    assert out.flatten().tolist() == [2] * d
    out, _ = npu.npu_fused_infer_attention_score(
        q, k, torch.full((1, 1, 1, d), 0.25), num_heads=1, input_layout="BNSD",
        quant_scale2=torch.full((1,), 10.0), quant_offset2=torch.full((1,), 1.0))
    assert out.flatten().tolist() == [4] * d


@pytest.mark.parametrize("decode_path", ["fast", "general"])
def test_int8_output_paged_antiquant_cache(decode_path, monkeypatch):
    """An int8 cache (antiquant) and an int8 output together, on a paged cache."""
    if decode_path == "general":
        monkeypatch.setenv("OPENNPU_FIA_DECODE", "0")
    torch.manual_seed(3)
    n, kvn, d, bs = 4, 2, 16, 16
    q = torch.randn(2, 1, n * d, dtype=torch.bfloat16)
    kc = torch.randint(-128, 128, (4, bs, kvn * d), dtype=torch.int8)
    vc = torch.randint(-128, 128, (4, bs, kvn * d), dtype=torch.int8)
    table = torch.tensor([[0, 1], [3, 2]], dtype=torch.int32)
    ks, vs = torch.rand(kvn, d) * 0.02 + 0.01, torch.rand(kvn, d) * 0.02 + 0.01
    kw = dict(num_heads=n, num_key_value_heads=kvn, block_table=table, block_size=bs,
              actual_seq_lengths_kv=[20, 31], key_antiquant_scale=ks, value_antiquant_scale=vs,
              scale=0.2)
    sc = torch.rand(n * d, dtype=torch.bfloat16) * 60 + 1
    out, _ = npu.npu_fused_infer_attention_score(q, kc, vc, quant_scale2=sc, **kw)
    o32, _ = npu.npu_fused_infer_attention_score(q.float(), kc, vc, **kw)
    assert torch.equal(out, quantise(o32, sc, None, n, d, "BSH"))


@pytest.mark.parametrize("out_dtype", [None, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn],
                         ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_v2_quantised_outputs(out_dtype, dtype):
    torch.manual_seed(4)
    n, d = 4, 8
    q, k, v = make("BNSD", 2, n, n, 3, 10, d, dtype)
    kw = dict(num_query_heads=n, input_layout="BNSD", softmax_scale=0.3,
              learnable_sink=torch.randn(n))
    sc, off = factors_of("1n1d", n, d, offset=True, spread=4.0)
    out, _ = npu.npu_fused_infer_attention_score_v2(q, k, v, quant_scale_out=sc,
                                                    quant_offset_out=off, out_dtype=out_dtype, **kw)
    o32, _ = npu.npu_fused_infer_attention_score_v2(*f32(q, k, v), **kw)
    want = quantise(o32, sc, off, n, d, "BNSD", out_dtype or torch.int8)
    assert out.dtype == (out_dtype or torch.int8)
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_out_overload_and_infer_output():
    torch.manual_seed(5)
    q, k, v = make("BNSD", 1, 4, 4, 2, 9, 8, torch.float16)
    kw = dict(num_heads=4, input_layout="BNSD", scale=0.3, quant_scale2=torch.full((1,), 50.0))
    a, b = npu._npu_fused_infer_attention_score_infer_output(
        q, v, input_layout="BNSD", num_heads=4, quant_scale2=kw["quant_scale2"])
    assert a.dtype == torch.int8
    npu.npu_fused_infer_attention_score.out(q, k, v, attention_out=a, softmax_lse=b, **kw)
    assert torch.equal(a, npu.npu_fused_infer_attention_score(q, k, v, **kw)[0])
    with pytest.raises(RuntimeError, match="argument 'attention_out' must be Char, but got Half"):
        npu.npu_fused_infer_attention_score.out(q, k, v, attention_out=torch.empty_like(q),
                                                softmax_lse=b, **kw)


def test_empty_query():
    q, k, v = make("BNSD", 0, 2, 2, 1, 4, 8, torch.float16)
    out, _ = npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="BNSD",
                                                 quant_scale2=torch.ones(2 * 8))
    assert out.dtype == torch.int8 and out.shape == (0, 2, 1, 8)


def test_non_contiguous_factors_and_inputs():
    torch.manual_seed(6)
    q, k, v = make("BNSD", 2, 2, 2, 3, 6, 8, torch.float32)
    q, k, v = q.transpose(2, 3).contiguous().transpose(2, 3), k[:, :, ::1], v
    sc = (torch.rand(8, 2) * 30 + 1).t()  # [N, D], not contiguous
    kw = dict(num_heads=2, input_layout="BNSD", scale=0.4)
    out, _ = npu.npu_fused_infer_attention_score(q, k, v, quant_scale2=sc, **kw)
    o32, _ = npu.npu_fused_infer_attention_score(q, k, v, **kw)
    assert torch.equal(out, quantise(o32, sc.contiguous(), None, 2, 8, "BNSD"))


@pytest.mark.parametrize("over,match", [
    (dict(quant_offset2=torch.ones(1)), "'quant_offset2' needs 'quant_scale2'"),
    (dict(quant_scale2=torch.ones(1, dtype=torch.float16)),
     "'quant_scale2' must be float32 \\(or bfloat16 with a bfloat16 query\\), but got Half"),
    (dict(quant_scale2=torch.ones(1, dtype=torch.bfloat16)),
     "'quant_scale2' must be float32 .* but got BFloat16 with a Half query"),
    (dict(quant_scale2=torch.ones(1), quant_offset2=torch.ones(2)),
     "'quant_offset2' must have the dtype and shape of 'quant_scale2'"),
    (dict(quant_scale2=torch.ones(4, 7)),
     "'quant_scale2' must hold one factor \\(per tensor\\) or Q_N \\* D = 4 \\* 8 = 32"),
    (dict(quant_scale2=torch.ones(1), query=torch.zeros(2, 4, 1, 8, dtype=torch.float64)),
     "argument 'query' must be float16, bfloat16 or float32 with output quantisation"),
    (dict(quant_scale2=torch.ones(1), key=torch.zeros(2, 2, 20, 8, dtype=torch.bfloat16)),
     "argument 'key' must have the dtype of 'query'"),
    (dict(quant_scale2=torch.ones(1), dequant_scale1=torch.ones(1)),
     "argument 'dequant_scale1' needs an int8 query, key and value \\(full quantisation\\)"),
])
def test_bad_inputs(over, match):
    q, k, v = make("BNSD", 2, 4, 2, 1, 20, 8, torch.float16)
    args = dict(query=q, key=k, value=v)
    for name in ("query", "key", "value"):
        if name in over:
            args[name] = over.pop(name)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_fused_infer_attention_score(*args.values(), num_heads=4, num_key_value_heads=2,
                                            input_layout="BNSD", **over)


@pytest.mark.parametrize("over,match", [
    (dict(out_dtype=torch.float16, quant_scale_out=torch.ones(1)),
     "'out_dtype' must be None, torch.int8, torch.float8_e5m2, torch.float8_e4m3fn or "
     r"torch_npu.hifloat8 \(290\) with quant_scale_out"),
    (dict(out_dtype=torch.int8), "'out_dtype' must be None or the output's dtype"),
    (dict(quant_offset_out=torch.ones(1)), "'quant_offset_out' needs 'quant_scale_out'"),
    (dict(quant_scale_p=torch.ones(1)), "'quant_scale_p' is not supported"),
])
def test_v2_bad_inputs(over, match):
    q, k, v = make("BSH", 1, 2, 2, 1, 4, 8, torch.float32)
    with pytest.raises(RuntimeError, match=match):
        npu.npu_fused_infer_attention_score_v2(q, k, v, num_query_heads=2, **over)


def test_portable_composition():
    """The ATen composition (devices without a native kernel) quantises the same way."""
    torch.manual_seed(7)
    q, k, v = make("BSND", 2, 4, 2, 4, 11, 8, torch.bfloat16)
    kw = dict(num_heads=4, num_key_value_heads=2, input_layout="BSND", scale=0.3)
    sc, off = factors_of("nd", 4, 8, dtype=torch.bfloat16, offset=True)
    out, _ = portable.npu_fused_infer_attention_score(q, k, v, quant_scale2=sc, quant_offset2=off,
                                                      **kw)
    o32, _ = portable.npu_fused_infer_attention_score(*f32(q, k, v), **kw)
    assert torch.equal(out, quantise(o32, sc, off, 4, 8, "BSND"))
    native, _ = npu.npu_fused_infer_attention_score(q, k, v, quant_scale2=sc, quant_offset2=off,
                                                    **kw)
    assert (out.int() - native.int()).abs().max() <= 1  # float32 kernels that differ in the ulp
    out, _ = portable.npu_fused_infer_attention_score_v2(
        q, k, v, num_query_heads=4, num_key_value_heads=2, input_layout="BSND",
        softmax_scale=0.3, quant_scale_out=sc, out_dtype=torch.float8_e4m3fn)
    assert out.dtype == torch.float8_e4m3fn
    with pytest.raises(RuntimeError, match="'quant_scale2' must be float32"):
        portable.npu_fused_infer_attention_score(q.half(), k.half(), v.half(), quant_scale2=sc,
                                                 **kw)


def test_opcheck():
    q, k, v = make("BSH", 2, 4, 2, 3, 20, 8, torch.float32)
    sc, off = factors_of("h", 4, 8, offset=True)
    opcheck(npu.npu_fused_infer_attention_score.default, [
        ((q, k, v), dict(num_heads=4, num_key_value_heads=2, quant_scale2=sc, quant_offset2=off,
                         softmax_lse_flag=True)),
        ((q, k, v), dict(num_heads=4, num_key_value_heads=2, quant_scale2=sc[:1]))])
    opcheck(npu.npu_fused_infer_attention_score_v2.default, [
        ((q, k, v), dict(num_query_heads=4, num_key_value_heads=2, quant_scale_out=sc,
                         out_dtype=torch.float8_e5m2)),
        ((q, k, v), dict(num_query_heads=4, num_key_value_heads=2, quant_scale_out=sc))])


def test_compile_fullgraph():
    torch._dynamo.reset()
    q, k, v = make("BNSD", 2, 4, 2, 1, 20, 8, torch.float16)
    sc = torch.rand(4, 8) * 40 + 1

    def f(q, k, v, sc):
        a, _ = npu.npu_fused_infer_attention_score(q, k, v, num_heads=4, num_key_value_heads=2,
                                                   input_layout="BNSD", quant_scale2=sc)
        b, _ = npu.npu_fused_infer_attention_score_v2(
            q, k, v, num_query_heads=4, num_key_value_heads=2, input_layout="BNSD",
            quant_scale_out=sc, out_dtype=torch.float8_e5m2)
        return a, b

    eager = f(q, k, v, sc)
    compiled = torch.compile(f, fullgraph=True, dynamic=True)(q, k, v, sc)
    assert compiled[0].dtype == torch.int8 and compiled[1].dtype == torch.float8_e5m2
    assert torch.equal(eager[0], compiled[0])
    assert torch.equal(eager[1].view(torch.uint8), compiled[1].view(torch.uint8))


def test_v2_out_overload_workspace_and_infer_output():
    """v2's workspace flow (torch_npu's aclgraph path): _get_max_workspace, _infer_output, .out."""
    torch.manual_seed(8)
    q, k, v = make("BNSD", 1, 4, 2, 1, 9, 8, torch.bfloat16)
    kw = dict(num_query_heads=4, num_key_value_heads=2, input_layout="BNSD", softmax_scale=0.3,
              return_softmax_lse=True, quant_scale_out=torch.full((1,), 30.0),
              out_dtype=torch.float8_e4m3fn)
    ws = npu._npu_fused_infer_attention_score_v2_get_max_workspace(q, k, v, **kw)
    assert ws.dtype == torch.uint8 and ws.numel() == 0
    a, b = npu._npu_fused_infer_attention_score_v2_infer_output(
        q, v, input_layout="BNSD", num_query_heads=4, num_key_value_heads=2,
        return_softmax_lse=True, quant_scale_out=kw["quant_scale_out"],
        out_dtype=torch.float8_e4m3fn)
    assert a.dtype == torch.float8_e4m3fn and a.shape == (1, 4, 1, 8) and b.shape == (1, 4, 1, 1)
    opennpu.npu_fused_infer_attention_score_v2.out(q, k, v, workspace=ws, out=[a, b], **kw)
    want = npu.npu_fused_infer_attention_score_v2(q, k, v, **kw)
    assert torch.equal(a.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(b, want[1])
    with pytest.raises(RuntimeError, match="argument 'softmax_lse' must be Float, but got Half"):
        npu.npu_fused_infer_attention_score_v2.out(q, k, v, attention_out=a,
                                                   softmax_lse=b.half(), **kw)
    # without the lse flag softmax_lse is a placeholder: any floating tensor takes it
    lse = torch.empty(1, dtype=torch.float16)
    kw["return_softmax_lse"] = False
    npu.npu_fused_infer_attention_score_v2.out(q, k, v, attention_out=a, softmax_lse=lse, **kw)
    assert lse.tolist() == [0.0]
    q32, k32, v32 = f32(q, k, v)
    a32, b32 = npu._npu_fused_infer_attention_score_v2_infer_output(q32, v32, num_query_heads=4,
                                                                    input_layout="BNSD")
    assert a32.dtype == torch.float32
    # an out overload (aliased outputs): schema and fake kernel only, as for v1's .out
    torch.library.opcheck(
        npu.npu_fused_infer_attention_score_v2.out, (q32, k32, v32),
        dict(num_query_heads=4, num_key_value_heads=2, input_layout="BNSD",
             attention_out=torch.empty(1, 4, 1, 8), softmax_lse=torch.empty(1)),
        test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(npu._npu_fused_infer_attention_score_v2_infer_output.default,
                          (q32, v32), dict(num_query_heads=4, input_layout="BNSD"),
                          test_utils=("test_schema", "test_faketensor"))
    opcheck(npu._npu_fused_infer_attention_score_v2_get_max_workspace.default,
            [((q32, k32, v32), dict(num_query_heads=4, num_key_value_heads=2))])
