"""Quantised matmul: npu_quant_matmul, npu_trans_quant_param, npu_convert_weight_to_int4pack.

Contract: op-plugin's docs (torch_npu-npu_quant_matmul.md, -npu_trans_quant_param.md,
-npu_convert_weight_to_int4pack.md) and test_npu_quant_matmul.py's goldens
(matmul(x1.int32, x2.int32) * scale (* pertoken_scale)).

The oracle (opennpu.testing.reference.quant_matmul) multiplies the codes exactly in int64 and
dequantises step by step in float32 in the same order as the kernel, so outputs must match bit
for bit. Every GEMM path of the kernel is run: ATen's int8 GEMM (OPENNPU_QUANT_MATMUL_GEMM=int), exact
fp32 GEMMs on panels of W converted in cache (=tiled, few rows), and on whole converted operands
(=whole, chunked along K where the sums could pass 2^24).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import SETTINGS, opcheck

import opennpu
from opennpu.testing import reference as R

I8, I32, F16, BF16, F32 = torch.int8, torch.int32, torch.float16, torch.bfloat16, torch.float32
OUT_DTYPES = (I8, F16, BF16, I32)


@pytest.fixture(params=["tiled", "whole", "int"])
def gemm(request, monkeypatch):
    """Runs the test once per GEMM path of the kernel."""
    monkeypatch.setenv("OPENNPU_QUANT_MATMUL_GEMM", request.param)
    return request.param


def _raises(fn, *pieces):
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


def codes(*shape, lo=-128, hi=128, gen=None):
    return torch.randint(lo, hi, shape, dtype=I8, generator=gen)


def check(x1, x2, scale, **kw):
    out = opennpu.npu_quant_matmul(x1, x2, scale, **kw)
    ref = R.quant_matmul(x1, x2, scale, offset=kw.get("offset"),
                         pertoken_scale=kw.get("pertoken_scale"), bias=kw.get("bias"),
                         output_dtype=kw.get("output_dtype"))
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    if out.is_floating_point():
        assert torch.equal(out.isnan(), ref.isnan())
        assert torch.equal(out.nan_to_num(), ref.nan_to_num()), (out.float() - ref.float()).abs().max()
    else:
        assert torch.equal(out, ref), (out.int() - ref.int()).abs().max()
    return out


# ----------------------------------------------------------------------------- npu_quant_matmul


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("scale_kind", ["f32", "bf16", "int64", "scalar"])
def test_quant_matmul_matches_reference(gemm, out_dtype, scale_kind):
    x1, x2 = codes(7, 83), codes(83, 37)
    s = torch.rand(37) * 0.01
    if scale_kind == "bf16":
        s = s.to(BF16)
    elif scale_kind == "int64":
        s = opennpu.npu_trans_quant_param(s)
    elif scale_kind == "scalar":
        s = torch.tensor([0.003])
    kw = {} if out_dtype == I8 else {"output_dtype": out_dtype}
    out = check(x1, x2, s, **kw)
    if out_dtype in (F16, BF16):  # the op-plugin golden: int32 matmul * scale, rtol 0.01
        sf = R.decode_trans_quant_param(s)[0] if s.dtype == torch.int64 else s.float()
        golden = (x1.int() @ x2.int()).float() * sf
        torch.testing.assert_close(out.float(), golden, rtol=0.01, atol=1e-2)


def test_quant_matmul_pertoken_bias_offset(gemm):
    gen = torch.Generator().manual_seed(3)
    x1, x2 = codes(9, 64, gen=gen), codes(64, 24, gen=gen)
    scale, pt = torch.rand(24, generator=gen) * 0.01, torch.rand(9, generator=gen) + 0.5
    ib = torch.randint(-1000, 1000, (24,), dtype=I32, generator=gen)
    for out_dtype in (F16, BF16):
        for bias in (ib, torch.randn(24, generator=gen).to(BF16), torch.randn(24, generator=gen),
                     torch.randn(24, generator=gen).to(F16), None):
            check(x1, x2, scale, pertoken_scale=pt, bias=bias, output_dtype=out_dtype)
    # int8 requantisation with offset, per channel and broadcast
    check(x1, x2, scale, offset=torch.randn(24) * 20, bias=ib)
    check(x1, x2, scale, offset=torch.tensor([3.5]))
    check(x1, x2, torch.tensor([0.01]), pertoken_scale=pt)
    # int32: the accumulator plus the int32 bias, scale unused
    out = check(x1, x2, scale, bias=ib, output_dtype=I32)
    assert torch.equal(out, (x1.int() @ x2.int()) + ib)


def test_quant_matmul_int8_rounds_half_to_even_and_saturates(gemm):
    # x1 @ x2 = [1, 3, 5, -1, -3, 300, -300, 2] with scale 0.5: ties 0.5, 1.5, 2.5, ...
    x1 = torch.ones(1, 1, dtype=I8)
    x2 = torch.tensor([[1, 3, 5, -1, -3, 127, -128, 2]], dtype=I8)
    out = opennpu.npu_quant_matmul(x1, x2, torch.tensor([0.5]))
    assert out.tolist() == [[0, 2, 2, 0, -2, 64, -64, 1]]
    out = opennpu.npu_quant_matmul(x1, x2, torch.tensor([3.0]))
    assert out.tolist() == [[3, 9, 15, -3, -9, 127, -128, 6]]


def test_quant_matmul_int32_accumulation_is_exact_beyond_float(gemm):
    # Sums past 2^24, where a plain fp32 GEMM of the codes rounds: -128 * -128 * k = 2^14 k.
    gen = torch.Generator().manual_seed(0)
    k = 3001
    x1 = torch.full((3, k), -128, dtype=I8)
    x1[1] = codes(k, gen=gen)
    x1[2, ::2] = 127
    x2 = torch.full((k, 5), -128, dtype=I8)
    x2[:, 1] = codes(k, gen=gen)
    x2[::3, 2] = 1
    x1[0, 0] = x2[0, 3] = 1  # out[0, 3] = 1 + 3000 * 2^14: odd, above 2^24
    exact = x1.long() @ x2.long()
    out = opennpu.npu_quant_matmul(x1, x2, torch.ones(1), output_dtype=I32)
    assert torch.equal(out.long(), exact)
    # the test can fail: a float32 GEMM of these codes is not exact
    assert not torch.equal((x1.float() @ x2.float()).long(), exact)
    # chunked sums then scaled: the same as the oracle
    check(x1, x2, torch.rand(5), output_dtype=BF16)


def test_quant_matmul_one_gemm_when_the_bound_allows(gemm):
    # Small codes: rows' L1 norm x max|x2| stays under 2^24 at K = 8192 (one fp32 GEMM exact).
    gen = torch.Generator().manual_seed(1)
    x1, x2 = codes(4, 8192, lo=-5, hi=5, gen=gen), codes(8192, 16, gen=gen)
    check(x1, x2, torch.rand(16), output_dtype=I32)
    check(x1, x2, torch.rand(16), output_dtype=F16)


def _int4_pair(m, k, n, gen):
    a = codes(m, k, lo=-8, hi=8, gen=gen)
    w = codes(k, n, lo=-8, hi=8, gen=gen)
    return a, w


@pytest.mark.parametrize("layout", ["kn", "nk_transposed"])
def test_quant_matmul_int4_panels(gemm, layout):
    # several W panels in both directions (128 columns, 512 deep), with partial last ones
    gen = torch.Generator().manual_seed(9)
    a, w = _int4_pair(3, 1032, 264, gen)
    x2 = R.pack_int4(w) if layout == "kn" else R.pack_int4(w.t().contiguous()).t()
    out = check(R.pack_int4(a), x2, torch.rand(264), output_dtype=I32)
    assert torch.equal(out, a.int() @ w.int())


@pytest.mark.parametrize("layout", ["kn", "nk_transposed"])
def test_quant_matmul_int4(gemm, layout):
    gen = torch.Generator().manual_seed(2)
    a, w = _int4_pair(5, 64, 24, gen)
    x1 = R.pack_int4(a)
    x2 = R.pack_int4(w) if layout == "kn" else R.pack_int4(w.t().contiguous()).t()
    assert x2.shape == ((64, 3) if layout == "kn" else (8, 24))
    scale = torch.rand(24) * 0.1
    for out_dtype in (F16, BF16, I8, I32):
        out = check(x1, x2, scale, output_dtype=out_dtype)
        assert out.shape == (5, 24)
        # int4 words give what the int8 codes give
        assert torch.equal(out, opennpu.npu_quant_matmul(a, w, scale, output_dtype=out_dtype))
    check(x1, x2, scale, pertoken_scale=torch.rand(5), output_dtype=BF16)


def test_quant_matmul_batch_broadcast_and_3d_bias(gemm):
    gen = torch.Generator().manual_seed(4)
    x1 = codes(1, 6, 32, gen=gen)
    x2 = codes(3, 32, 16, gen=gen)
    bias = torch.randint(-50, 50, (3, 1, 16), dtype=I32, generator=gen)
    out = check(x1, x2, torch.rand(16) * 0.1, bias=bias, output_dtype=F16)
    assert out.shape == (3, 6, 16)
    check(codes(2, 1, 3, 8, gen=gen), codes(4, 8, 5, gen=gen), torch.rand(5), output_dtype=BF16)
    check(codes(2, 3, 8, gen=gen), codes(8, 5, gen=gen), torch.rand(1), offset=torch.ones(5))
    check(codes(3, 8, gen=gen), codes(2, 2, 8, 5, gen=gen), torch.rand(5), output_dtype=I32)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 7, 83), (83, 769, 1), (7, 5125, 9), (3, 1100, 300),
                                   (0, 8, 4), (4, 0, 5), (4, 8, 0)])
def test_quant_matmul_odd_and_empty_sizes(gemm, m, k, n):
    gen = torch.Generator().manual_seed(m + k + n)
    x1, x2 = codes(m, k, gen=gen), codes(k, n, gen=gen)
    for out_dtype in (I8, BF16, I32):
        out = check(x1, x2, torch.rand(max(n, 1))[:n] if n else torch.rand(1),
                    output_dtype=out_dtype, bias=torch.ones(n, dtype=I32))
        assert out.shape == (m, n)


def test_quant_matmul_non_contiguous_inputs(gemm):
    gen = torch.Generator().manual_seed(5)
    x1 = codes(9, 80, gen=gen)[:, ::2]  # strided
    x2t = codes(24, 40, gen=gen).t()  # a transposed weight [k, n] (Ascend's x2.t() calls)
    scale = torch.rand(48)[::2]
    check(x1, x2t, scale, output_dtype=BF16)
    check(x1, codes(40, 48, gen=gen)[:, ::2], scale, output_dtype=I32)
    check(x1.t().contiguous().t(), x2t, scale)


def test_quant_matmul_nan_and_inf_scales(gemm):
    x1, x2 = codes(2, 16), codes(16, 4)
    scale = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0])
    check(x1, x2, scale, output_dtype=F16)
    check(x1, x2, scale)  # int8: NaN -> 0, inf saturates


def test_quant_matmul_on_the_npu_device(gemm):
    gen = torch.Generator().manual_seed(6)
    x1, x2 = codes(5, 32, gen=gen), codes(32, 8, gen=gen)
    scale, pt = torch.rand(8), torch.rand(5)
    cpu = opennpu.npu_quant_matmul(x1, x2, scale, pertoken_scale=pt, output_dtype=BF16)
    out = opennpu.npu_quant_matmul(x1.to("npu"), x2.to("npu").t().contiguous().t(),
                                   scale.to("npu"), pertoken_scale=pt.to("npu"),
                                   output_dtype=BF16)
    assert out.device.type == "npu"
    assert torch.equal(out.cpu(), cpu)


def test_quant_matmul_opcheck():
    gen = torch.Generator().manual_seed(7)
    x1, x2 = codes(4, 16, gen=gen), codes(16, 8, gen=gen)
    opcheck(torch.ops.npu.npu_quant_matmul.default, [
        ((x1, x2, torch.rand(8)), {}),
        ((x1, x2.t().contiguous().t(), torch.rand(8)),
         {"pertoken_scale": torch.rand(4), "bias": torch.randn(8), "output_dtype": BF16}),
        ((codes(2, 4, 16, gen=gen), x2, torch.rand(1)), {"output_dtype": I32}),
        ((R.pack_int4(codes(4, 16, lo=-8, hi=8)), R.pack_int4(codes(16, 8, lo=-8, hi=8)),
          torch.rand(8)), {"output_dtype": F16}),
    ])


def test_quant_matmul_compile_fullgraph_dynamic():
    def block(x1, x2, scale, pt, w4):
        y = opennpu.npu_quant_matmul(x1, x2, scale, pertoken_scale=pt, output_dtype=BF16)
        q = opennpu.npu_quant_matmul(x1, x2, opennpu.npu_trans_quant_param(scale))
        packed = opennpu.npu_convert_weight_to_int4pack(w4)
        return y, q, packed

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for m, k, n in [(3, 16, 16), (5, 24, 24)]:
        args = [codes(m, k), codes(k, n), torch.rand(n), torch.rand(m),
                torch.randint(-8, 8, (k, n), dtype=I32)]
        for e, c in zip(block(*args), compiled(*args)):
            assert torch.equal(e, c)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_quant_matmul_compile_inductor():
    def block(x1, x2, scale):
        return opennpu.npu_quant_matmul(x1, x2, scale, output_dtype=F16) * 2

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    args = [codes(4, 32), codes(32, 8), torch.rand(8)]
    assert torch.equal(block(*args), compiled(*args))
    torch._dynamo.reset()


def test_quant_matmul_bad_inputs():
    x1, x2, s = codes(4, 16), codes(16, 8), torch.rand(8)
    qmm = opennpu.npu_quant_matmul
    _raises(lambda: qmm(x1.float(), x2, s), "npu_quant_matmul: argument 'x1' must be int8",
            "got Float")
    _raises(lambda: qmm(x1, x2.int(), s), "argument 'output_dtype' must be torch.float16 or "
            "torch.bfloat16 with int8 'x1' and int4 'x2' (A8W4)", "got None")
    _raises(lambda: qmm(x1, codes(15, 8), s), "argument 'x2' must have k = 16", "[15, 8]")
    _raises(lambda: qmm(x1, x2, torch.rand(7)), "argument 'scale' must have shape [1] or [8]",
            "[7]")
    _raises(lambda: qmm(x1, x2, s.half()), "argument 'scale' must be float32, bfloat16 or int64",
            "Half")
    _raises(lambda: qmm(x1, x2, torch.empty(0)), "argument 'scale' must not be empty")
    _raises(lambda: qmm(x1, x2, s, output_dtype=torch.float32),
            "argument 'output_dtype' must be None, torch.int8", "got Float")
    _raises(lambda: qmm(x1, x2, s, offset=torch.ones(8), output_dtype=F16),
            "argument 'offset' applies only to int8 outputs")
    _raises(lambda: qmm(x1, x2, s, pertoken_scale=torch.rand(5), output_dtype=F16),
            "argument 'pertoken_scale' must have shape [4]", "[5]")
    _raises(lambda: qmm(x1, x2, s, pertoken_scale=torch.rand(4).half(), output_dtype=F16),
            "argument 'pertoken_scale' must be float32", "Half")
    _raises(lambda: qmm(x1, x2, s, bias=torch.ones(8)), "argument 'bias' must be int32 for Char",
            "Float")
    _raises(lambda: qmm(x1, x2, s, bias=torch.ones(9, dtype=I32)),
            "argument 'bias' must have shape [8]", "[9]")
    _raises(lambda: qmm(x1, x2, s, group_sizes=[1, 1, 32]),
            "argument 'group_sizes' must be None or [0, 0, 0]")
    _raises(lambda: qmm(x1, x2, s, y_scale=torch.ones(1)), "argument 'y_scale' must be None")
    _raises(lambda: qmm(x1, x2, s, x1_dtype=290),  # int8 bytes read as hifloat8 x1
            "argument 'x2' must be float8 / float4 codes like 'x1'", "Char")
    _raises(lambda: qmm(x1, x2, s, x2_dtype=293), "argument 'x2_dtype' must be None",
            "dtype code 293")
    _raises(lambda: qmm(codes(2, 4, 16), codes(3, 16, 8), s), "argument 'x2' must have batch dims",
            "[2]", "[3]")
    _raises(lambda: qmm(codes(16), x2, s), "argument 'x1' must have 2 to 6 dims")
    w4 = R.pack_int4(codes(16, 8, lo=-8, hi=8))
    _raises(lambda: qmm(R.pack_int4(x1.clamp(-8, 7)), w4[:, :1].contiguous().repeat(2, 1), s),
            "argument 'x2' must be int4 words of shape [..., k, n / 8]")
    # an int64 scale that carries an offset needs an int8 output
    _raises(lambda: qmm(x1, x2, opennpu.npu_trans_quant_param(s, torch.ones(8)),
                        output_dtype=F16), "argument 'scale' carries an offset")


@settings(**SETTINGS)
@given(m=st.integers(0, 9), k=st.integers(1, 70), n=st.integers(1, 20),
       out_dtype=st.sampled_from(OUT_DTYPES), per_channel=st.booleans(),
       pertoken=st.booleans(), transposed=st.booleans())
def test_quant_matmul_hypothesis(m, k, n, out_dtype, per_channel, pertoken, transposed):
    gen = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    x1 = codes(m, k, gen=gen)
    x2 = codes(n, k, gen=gen).t() if transposed else codes(k, n, gen=gen)
    kw = {"output_dtype": out_dtype}
    if pertoken and out_dtype in (F16, BF16):
        kw["pertoken_scale"] = torch.rand(m, generator=gen)
    check(x1, x2, torch.rand(n if per_channel else 1, generator=gen), **kw)


# ----------------------------------------------------------------------------- trans_quant_param


def test_trans_quant_param_bits():
    scale = torch.tensor([1.0, 0.1, -3.3e-5, 1e-40, float("inf"), 65504.0])
    out = opennpu.npu_trans_quant_param(scale)
    assert out.dtype == torch.int64 and out.shape == scale.shape
    assert torch.equal(out, R.trans_quant_param(scale))
    assert out[0].item() == 0x3F800000 | (1 << 46)
    # truncation cuts the low 13 mantissa bits; round_mode=1 rounds to the nearest fp19
    x = torch.tensor([1.0 + 2**-10 * 0.75, 1.0 + 2**-10 * 0.5, 1.0 + 2**-10 * 1.5, 0.1])
    trunc = opennpu.npu_trans_quant_param(x)
    rint = opennpu.npu_trans_quant_param(x, None, 1)
    assert torch.equal(rint, R.trans_quant_param(x, None, 1))
    s_trunc, _ = R.decode_trans_quant_param(trunc)
    s_rint, _ = R.decode_trans_quant_param(rint)
    assert s_trunc.tolist()[:3] == [1.0, 1.0, 1.0 + 2**-10]
    assert s_rint.tolist()[:3] == [1.0 + 2**-10, 1.0, 1.0 + 2**-9]  # ties to even


def test_trans_quant_param_offset():
    scale = torch.rand(6)
    offset = torch.tensor([0.4, 2.5, -3.5, 300.0, -1000.0, float("nan")])
    out = opennpu.npu_trans_quant_param(scale, offset)
    assert torch.equal(out, R.trans_quant_param(scale, offset))
    _, off = R.decode_trans_quant_param(out)
    assert off.tolist() == [0, 2, -4, 255, -256, 0]
    # shapes: 1-D broadcast, 2-D kept
    assert opennpu.npu_trans_quant_param(torch.rand(1), torch.rand(5)).shape == (5,)
    assert opennpu.npu_trans_quant_param(torch.rand(1, 5), torch.rand(1)).shape == (1, 5)
    assert opennpu.npu_trans_quant_param(torch.rand(1, 5)).shape == (1, 5)


def test_trans_quant_param_feeds_quant_matmul(gemm):
    # op-plugin's doc: npu_quant_matmul(x1, x2, scale, offset=offset) equals
    # npu_quant_matmul(x1, x2, npu_trans_quant_param(scale, offset)) once the scale is fp19.
    gen = torch.Generator().manual_seed(8)
    x1, x2 = codes(6, 48, lo=-5, hi=5, gen=gen), codes(48, 16, lo=-5, hi=5, gen=gen)
    scale, offset = torch.rand(16, generator=gen) * 0.1, torch.randn(16, generator=gen) * 5
    packed = opennpu.npu_trans_quant_param(scale, offset)
    fp19, off = R.decode_trans_quant_param(packed)
    a = opennpu.npu_quant_matmul(x1, x2, packed)
    b = opennpu.npu_quant_matmul(x1, x2, fp19, offset=off)
    assert torch.equal(a, b)
    check(x1, x2, packed)
    # an offset argument beside a packed one: the packed offset is the one used
    assert torch.equal(opennpu.npu_quant_matmul(x1, x2, packed, offset=offset), a)


def test_trans_quant_param_bad_inputs_and_opcheck():
    tqp = opennpu.npu_trans_quant_param
    _raises(lambda: tqp(torch.ones(3).half()), "npu_trans_quant_param: argument 'scale' must be "
            "float32", "Half")
    _raises(lambda: tqp(torch.ones(0)), "argument 'scale' must be a non-empty 1-D or 2-D")
    _raises(lambda: tqp(torch.ones(3), torch.ones(4)), "argument 'offset' must have 1 element or "
            "as many as 'scale' (3)")
    _raises(lambda: tqp(torch.ones(3), None, 2), "argument 'round_mode' must be 0", "got 2")
    opcheck(torch.ops.npu.npu_trans_quant_param.default, [
        ((torch.rand(5),), {}), ((torch.rand(1, 5), torch.rand(5)), {}),
        ((torch.rand(1), torch.rand(4), 1), {})])


# ----------------------------------------------------------------------------- int4 packing


def test_convert_weight_to_int4pack_matches_pack_int4():
    w = torch.randint(-8, 8, (16, 40), dtype=I32)
    packed = opennpu.npu_convert_weight_to_int4pack(w)
    assert packed.dtype == I32 and packed.shape == (16, 5)
    assert torch.equal(packed, R.pack_int4(w.to(I8)))
    assert torch.equal(R.unpack_int4(packed).int(), w)
    # op-plugin's 3-dim golden: byte j of word i holds codes 2j (low nibble) and 2j + 1
    w3 = torch.randint(-8, 8, (2, 8, 16), dtype=I32)
    p3 = opennpu.npu_convert_weight_to_int4pack(w3)
    assert p3.shape == (2, 8, 2)
    u = w3 & 0xF
    bytes_ = [u[..., 2 * j::8] + (u[..., 2 * j + 1::8] << 4) for j in range(4)]
    golden = bytes_[0] + (bytes_[1] << 8) + (bytes_[2] << 16) + (bytes_[3].long() << 24)
    golden = torch.where(golden >= 2**31, golden - 2**32, golden).to(I32)
    assert torch.equal(p3, golden)
    # non-contiguous, empty, and on the npu device
    assert torch.equal(opennpu.npu_convert_weight_to_int4pack(w.t().contiguous().t()[:, :8]),
                       R.pack_int4(w[:, :8].to(I8)))
    assert opennpu.npu_convert_weight_to_int4pack(torch.empty(0, 8, dtype=I32)).shape == (0, 1)
    on_npu = opennpu.npu_convert_weight_to_int4pack(w.to("npu"))
    assert on_npu.device.type == "npu" and torch.equal(on_npu.cpu(), packed)


def test_convert_weight_to_int4pack_feeds_quant_matmul():
    # op-plugin's A8W4 tests pack with this op, then read the words as npu_quant_matmul's int4
    a = codes(3, 32, lo=-8, hi=8)
    w = torch.randint(-8, 8, (32, 16), dtype=I32)
    x2 = opennpu.npu_convert_weight_to_int4pack(w)
    out = opennpu.npu_quant_matmul(R.pack_int4(a), x2, torch.ones(1), output_dtype=I32)
    assert torch.equal(out, a.int() @ w)


def test_convert_weight_to_int4pack_bad_inputs_and_opcheck():
    cw = opennpu.npu_convert_weight_to_int4pack
    _raises(lambda: cw(torch.ones(4, 8)), "npu_convert_weight_to_int4pack: argument 'weight' "
            "must be int32", "Float")
    _raises(lambda: cw(torch.ones(4, 12, dtype=I32)), "last dim divisible by 8", "[4, 12]")
    _raises(lambda: cw(torch.ones(8, dtype=I32)), "must have 2 or 3 dims")
    _raises(lambda: cw(torch.full((2, 8), 8, dtype=I32)), "values in [-8, 7]", "[8, 8]")
    _raises(lambda: cw(torch.ones(2, 8, dtype=I32), -1), "argument 'inner_k_tiles' must be >= 0")
    opcheck(torch.ops.npu.npu_convert_weight_to_int4pack.default, [
        ((torch.randint(-8, 8, (4, 16), dtype=I32),), {}),
        ((torch.randint(-8, 8, (2, 4, 8), dtype=I32), 2), {})])


# ----------------------------------------------------------------------------- A8W4


def _a8w4_inputs(m, k, n, group, seed=0):
    """op-plugin's A8W4 test data: int8 x, int4 weight codes, per-group scales, y offset, per-token
    scales; the weight packed as its test packs it."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, (m, k), dtype=I8, generator=gen)
    w = torch.randint(-8, 8, (k, n), dtype=I32, generator=gen)
    scale = torch.rand(k // group, n, generator=gen)
    offset = torch.randn(n, generator=gen)
    token = torch.randn(m, 1, generator=gen) * 0.01
    return x, w, opennpu.npu_convert_weight_to_int4pack(w), scale, offset, token


@pytest.mark.parametrize("out_dtype", (F16, BF16), ids=str)
@pytest.mark.parametrize("m,k,n,group", [(1, 256, 64, 64), (5, 96, 24, 32), (33, 512, 40, 256)])
def test_a8w4_matches_op_plugin_golden(out_dtype, m, k, n, group):
    x, w, x2, scale, offset, token = _a8w4_inputs(m, k, n, group)
    out = opennpu.npu_quant_matmul(x, x2, scale, offset=offset, pertoken_scale=token,
                                   output_dtype=out_dtype, group_sizes=[0, 0, group])
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert torch.equal(out, R.a8w4_matmul(x, w, scale, offset, token, out_dtype))
    # the int64 scale of npu_trans_quant_param (its fp19 value), as op-plugin's test passes it
    packed = opennpu.npu_trans_quant_param(scale.reshape(-1)).reshape(scale.shape)
    out = opennpu.npu_quant_matmul(x, x2, packed, offset=offset, pertoken_scale=token.reshape(-1),
                                   output_dtype=out_dtype, group_sizes=[0, 0, group])
    fp19 = R.decode_trans_quant_param(packed.reshape(-1))[0].reshape(scale.shape)
    assert torch.equal(out, R.a8w4_matmul(x, w, fp19, offset, token, out_dtype))


def test_a8w4_float16_accumulation_and_optional_terms():
    x, w, x2, scale, _, _ = _a8w4_inputs(4, 1024, 16, 32, seed=1)
    scale = scale * 40  # sums near float16's 11 bits: the float16 accumulator rounds visibly
    out = opennpu.npu_quant_matmul(x, x2, scale, output_dtype=F16)  # group from scale's rows
    ref = R.a8w4_matmul(x, w, scale, output_dtype=F16)
    assert torch.equal(out, ref)
    hi = torch.div(x.int(), 16, rounding_mode="floor").double()
    lo = ((x.int() & 15) - 8).double()
    sc = scale.double().repeat_interleave(32, 0)
    exact = 16 * (hi @ (w.double() * sc)) + lo @ (w.double() * sc)
    assert exact.shape == out.shape
    assert not torch.equal(out.double(), exact.half().double())  # the golden's roundings matter


def test_a8w4_is_the_product_of_x_minus_8():
    """With offset = 8 * sum_k(w * scale) (how A8W4 weights are prepared), the result is the
    dequantised product x @ (w * scale), up to the float16 accumulation."""
    x, w, x2, scale, _, _ = _a8w4_inputs(3, 128, 16, 64, seed=2)
    wf = w.double() * scale.double().repeat_interleave(64, 0)
    offset = (8 * wf.sum(0)).float()
    out = opennpu.npu_quant_matmul(x, x2, scale, offset=offset, output_dtype=F16,
                                   group_sizes=[0, 0, 64])
    expected = x.double() @ wf
    assert torch.allclose(out.double(), expected, rtol=4e-3, atol=0.5)


def test_a8w4_portable_npu_device_opcheck_and_compile():
    from opennpu.ops import portable

    x, w, x2, scale, offset, token = _a8w4_inputs(6, 128, 32, 32, seed=3)
    kw = dict(offset=offset, pertoken_scale=token, output_dtype=BF16, group_sizes=[0, 0, 32])
    out = opennpu.npu_quant_matmul(x, x2, scale, **kw)
    with portable.force():
        assert torch.equal(opennpu.npu_quant_matmul(x, x2, scale, **kw), out)
    on_npu = opennpu.npu_quant_matmul(x.to("npu"), x2.to("npu"), scale.to("npu"),
                                      offset=offset.to("npu"), pertoken_scale=token.to("npu"),
                                      output_dtype=BF16, group_sizes=[0, 0, 32])
    assert on_npu.device.type == "npu" and torch.equal(on_npu.cpu(), out)
    opcheck(torch.ops.npu.npu_quant_matmul.default, [
        ((x, x2, scale), dict(offset=offset, pertoken_scale=token, output_dtype=5,
                              group_sizes=[0, 0, 32])),
        ((x[:1], x2, scale), dict(output_dtype=15))])
    counter = torch._dynamo.testing.CompileCounter()
    fn = torch.compile(lambda *a: opennpu.npu_quant_matmul(*a, **kw), fullgraph=True,
                       backend=counter)
    assert torch.equal(fn(x, x2, scale), out) and counter.frame_count == 1


def test_a8w4_bad_inputs():
    qmm = opennpu.npu_quant_matmul
    x, _, x2, scale, offset, _ = _a8w4_inputs(2, 64, 16, 32)
    _raises(lambda: qmm(x, x2, scale, output_dtype=I8), "argument 'output_dtype' must be "
            "torch.float16 or torch.bfloat16 with int8 'x1' and int4 'x2' (A8W4)", "Char")
    _raises(lambda: qmm(x, x2, scale[0], output_dtype=F16), "argument 'scale' must be "
            "[k / group_size, n] = [G, 16]", "[16]")
    _raises(lambda: qmm(x, x2, scale, output_dtype=F16, group_sizes=[0, 0, 16]),
            "argument 'scale' must have k / group_size = 4 rows", "got shape [2, 16]")
    _raises(lambda: qmm(x, x2, scale, output_dtype=F16, group_sizes=[2, 0, 32]),
            "argument 'group_sizes' must be [0, 0, group_k]")
    _raises(lambda: qmm(x, x2, scale.half(), output_dtype=F16), "argument 'scale' must be "
            "int64", "Half")
    _raises(lambda: qmm(x, x2, scale, bias=offset, output_dtype=F16),
            "argument 'bias' must be None with A8W4")
    _raises(lambda: qmm(x, x2[:32], scale, output_dtype=F16), "argument 'x2' must be int4 words "
            "[k, n / 8] = [64, n / 8]", "[32, 2]")
    _raises(lambda: qmm(x[None], x2, scale, output_dtype=F16), "argument 'x1' must be 2-D")
    _raises(lambda: qmm(x, x2, scale, offset=offset.half(), output_dtype=F16),
            "argument 'offset' must be float32 with A8W4", "Half")


# ----------------------------------------------------------------------------- float8 / MX
#
# Contract: op-plugin's QuantMatmulKernelNpuOpApi.cpp (x1_dtype / x2_dtype / scale_dtype
# reinterpretations, float4 packing along the memory-contiguous dim, the output shape, the MX
# scales' transpose check), test_npu_quant_matmul.py's Ascend950 goldens (matmul(x1.float(),
# x2.float()) * scale (* pertoken_scale); MX: the operands times their e8m0 scales repeated 32
# times along k, cut to k, then one float32 matmul) and npu_add_quant_matmul_.md (MX scale
# shapes [m, ceil(k / 64), 2] / [ceil(k / 64), n, 2], a last block shorter than 32).
# The oracle below decodes the codes with torch's own float8 dtypes and multiplies in float64.
# With small-integer codes and power-of-two scales every fp32 sum is exact, so the kernel must
# match it bit for bit; with full-range codes it must match within fp32 accumulation error.

E4, E5, U8 = torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)


def fp8(*shape, dtype=E4, gen=None, small=False):
    """Finite float8 codes: small integers in [-5, 5) (op-plugin's randint inputs) or any
    finite code."""
    if small:
        return torch.randint(-5, 5, shape, generator=gen).to(dtype)
    bits = torch.randint(0, 256, shape, dtype=torch.int32, generator=gen).to(U8)
    v = bits.view(dtype)
    return torch.where(v.float().isfinite(), v.float(), 0.0).to(dtype)


def fp4_bytes(*shape, gen=None):
    return torch.randint(0, 256, shape, dtype=torch.int32, generator=gen).to(U8)


def unpack_fp4(b):
    """bytes [..., c] -> float64 [..., 2c], element 2j the low nibble."""
    b = b.long()
    return torch.stack([FP4[b & 15], FP4[b >> 4]], -1).flatten(-2)


def e8m0(codes):
    return torch.where(codes == 255, float("nan"), torch.exp2(codes.double() - 127))


def mx_scale_codes(*shape, gen=None, lo=125, hi=130):
    return torch.randint(lo, hi, shape, dtype=torch.int32, generator=gen).to(U8)


def mx_scales(sa, sw, k):
    """float64 per element of the logical operands: x1's [..., m, k] from codes [..., m,
    ceil(k / 64), 2] and x2's [..., k, n] from [..., ceil(k / 64), n, 2]; element kk takes the
    code [kk // 64, (kk // 32) % 2] (block kk // 32 of 32)."""
    kk = torch.arange(k)
    return (e8m0(sa)[..., kk // 64, (kk // 32) % 2],
            e8m0(sw).movedim(-1, -2)[..., kk // 64, (kk // 32) % 2, :])


def ref_float_qmm(a, w, scale=None, pertoken=None, bias=None, out_dtype=F32, sa=None, sw=None):
    """float64 oracle on decoded logical operands a [..., m, k], w [..., k, n]; sa / sw: MX
    scale codes [..., m, ceil(k / 64), 2] / [..., ceil(k / 64), n, 2]."""
    k = a.shape[-1]
    if sa is not None:
        ea, ew = mx_scales(sa, sw, k)
        a, w = a * ea, w * ew
    y = a @ w
    factor = torch.ones(1, 1, dtype=torch.float64)  # [m or 1, n or 1]: scale x pertoken
    if scale is not None and pertoken is not None and pertoken.numel() == 1 and y.shape[-2] != 1:
        factor = (scale.float() * pertoken.float()).double()[None]  # the golden's double scale
    elif scale is not None:
        factor = scale.double()[None] * (1.0 if pertoken is None else pertoken.double()[:, None])
    return (y * factor + (0.0 if bias is None else bias.double())).to(out_dtype)


def assert_close_fp32_acc(out, ref64, a, w, scale_abs=1.0):
    """out within fp32 accumulation error (k * 2^-23 * (|a| @ |w|) * |scales|) plus one rounding
    of the output dtype of the float64 result (which overflows where that result's does)."""
    bound = a.shape[-1] * 2.0 ** -23 * (a.abs() @ w.abs()) * scale_abs
    ulp = {F32: 2.0 ** -23, F16: 2.0 ** -10, BF16: 2.0 ** -7}[out.dtype]
    overflow = ref64.to(out.dtype).isinf()
    assert torch.equal(out[overflow], ref64.to(out.dtype)[overflow])
    err = (out.double() - ref64).abs()[~overflow]
    tol = (bound + ulp * ref64.abs() + 1e-30)[~overflow]
    assert bool((err <= tol).all()), (err - tol).max()


@pytest.mark.parametrize("out_dtype", (F16, BF16, F32), ids=str)
@pytest.mark.parametrize("dt1,dt2", [(E4, E4), (E5, E5), (E4, E5)], ids=["e4m3", "e5m2", "mixed"])
@pytest.mark.parametrize("scales", ["tensor", "channel", "token", "double"])
def test_fp8_quant_matmul_exact_small_codes(out_dtype, dt1, dt2, scales):
    gen = torch.Generator().manual_seed(11)
    m, k, n = 7, 53, 19
    x1, x2 = fp8(m, k, dtype=dt1, gen=gen, small=True), fp8(k, n, dtype=dt2, gen=gen, small=True)
    pow2 = lambda *s: torch.exp2(torch.randint(-4, 5, s, generator=gen).float())  # noqa: E731
    scale = pow2(n) if scales in ("channel", "token") else pow2(1)
    pt = {"token": pow2(m), "double": pow2(1)}.get(scales)
    bias = torch.randint(-8, 8, (n,), generator=gen).float() if scales == "token" else None
    out = opennpu.npu_quant_matmul(x1, x2, scale, pertoken_scale=pt, bias=bias,
                                   output_dtype=out_dtype)
    ref = ref_float_qmm(x1.double(), x2.double(), scale, pt, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert torch.equal(out, ref)
    # op-plugin's golden, in float32
    golden = torch.matmul(x1.float(), x2.float()) * (scale * pt if scales == "double" else scale)
    if scales == "token":
        golden = golden * pt.unsqueeze(-1) + bias
    assert torch.equal(out, golden.to(out_dtype))


@pytest.mark.parametrize("out_dtype", (F16, BF16, F32), ids=str)
@pytest.mark.parametrize("dt1,dt2", [(E4, E4), (E5, E5), (E5, E4)], ids=["e4m3", "e5m2", "mixed"])
@pytest.mark.parametrize("m", (9, 130))  # from 128 rows: bf16 operands on AVX512_BF16 CPUs
def test_fp8_quant_matmul_full_range_codes(out_dtype, dt1, dt2, m):
    gen = torch.Generator().manual_seed(12)
    k, n = 130, 21
    x1, x2 = fp8(m, k, dtype=dt1, gen=gen), fp8(k, n, dtype=dt2, gen=gen)
    scale, pt = torch.rand(n, generator=gen) * 1e-3, torch.rand(m, generator=gen)
    bias = torch.randn(n, generator=gen).to(BF16)
    out = opennpu.npu_quant_matmul(x1, x2, scale, pertoken_scale=pt, bias=bias,
                                   output_dtype=out_dtype)
    ref = ref_float_qmm(x1.double(), x2.double(), scale, pt, bias, F32).double()
    a, w = x1.double(), x2.double()
    assert_close_fp32_acc(out, ref, a, w * scale.double(), pt.double().reshape(-1, 1) * 1.01)


def mx_operands(m, k, n, kind1, kind2, gen, trans1=False, trans2=False, small=True):
    """MX inputs as op-plugin passes them (float4 as uint8 bytes with x?_dtype), and their
    decoded float64 logical operands."""
    def operand(rows, cols, kind, trans):  # logical [rows, cols]; memory [cols, rows] if trans
        mem_shape = (cols, rows) if trans else (rows, cols)
        if kind == "fp4":
            b = fp4_bytes(mem_shape[0], mem_shape[1] // 2, gen=gen)
            v = unpack_fp4(b)
        else:
            b = fp8(*mem_shape, dtype=kind, gen=gen, small=small)
            v = b.double()
        return (b.t() if trans else b), (v.t() if trans else v)

    x1, a = operand(m, k, kind1, trans1)
    x2, w = operand(k, n, kind2, trans2)
    pairs = (k + 63) // 64
    sa = mx_scale_codes(pairs, m, 2, gen=gen).transpose(0, 1) if trans1 else \
        mx_scale_codes(m, pairs, 2, gen=gen)
    sw = mx_scale_codes(n, pairs, 2, gen=gen).transpose(0, 1) if trans2 else \
        mx_scale_codes(pairs, n, 2, gen=gen)
    return x1, x2, a, w, sa, sw


def mx_kw(kind1, kind2, out_dtype, e8m0_dtype=False):
    kw = dict(output_dtype=out_dtype)
    if not e8m0_dtype:
        kw.update(scale_dtype=torch_npu_codes["e8m0"], pertoken_scale_dtype=torch_npu_codes["e8m0"])
    if kind1 == "fp4":
        kw["x1_dtype"] = torch_npu_codes["fp4"]
    if kind2 == "fp4":
        kw["x2_dtype"] = torch_npu_codes["fp4"]
    return kw


torch_npu_codes = {"e8m0": 293, "fp4": 296, "hif8": 290}

MX_KINDS = [(E4, E4), (E5, E5), ("fp4", "fp4"), (E4, "fp4")]
MX_IDS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "fp8_x_fp4"]


@pytest.mark.parametrize("out_dtype", (F16, BF16, F32), ids=str)
@pytest.mark.parametrize("kinds", MX_KINDS, ids=MX_IDS)
@pytest.mark.parametrize("trans1,trans2", [(False, False), (False, True), (True, True)],
                         ids=["nn", "nt", "tt"])
def test_mx_quant_matmul_exact(out_dtype, kinds, trans1, trans2):
    gen = torch.Generator().manual_seed(13)
    m, k, n = 6, 160, 10  # k: 5 blocks of 32, 3 pairs (the last half padding)
    x1, x2, a, w, sa, sw = mx_operands(m, k, n, *kinds, gen, trans1, trans2)
    bias = torch.randint(-4, 4, (n,), generator=gen).float()
    out = opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, bias=bias,
                                   **mx_kw(*kinds, out_dtype))
    ref = ref_float_qmm(a, w, bias=bias, out_dtype=out_dtype, sa=sa, sw=sw)
    assert out.shape == (m, n) and torch.equal(out, ref)


@pytest.mark.parametrize("trans1,trans2", [(False, True), (True, False)], ids=["nt", "tn"])
def test_mx_quant_matmul_exact_many_rows(trans1, trans2):
    """Above 512 rows the kernel decodes all of W and runs one GEMM (below, panel by panel)."""
    gen = torch.Generator().manual_seed(21)
    x1, x2, a, w, sa, sw = mx_operands(600, 96, 6, "fp4", E5, gen, trans1, trans2)
    out = opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, **mx_kw("fp4", E5, F32))
    assert torch.equal(out, ref_float_qmm(a, w, out_dtype=F32, sa=sa, sw=sw))


@pytest.mark.parametrize("kinds", MX_KINDS, ids=MX_IDS)
@pytest.mark.parametrize("m,k,n", [(1, 32, 1), (5, 96, 7), (3, 100, 4), (0, 64, 3), (2, 64, 0),
                                   (2, 1100, 130), (520, 100, 6),  # K panels of 512; > 512 rows
                                   (130, 98, 40)])  # bf16 operands from 128 rows (AVX512_BF16)
def test_mx_quant_matmul_odd_sizes_and_partial_blocks(kinds, m, k, n):
    gen = torch.Generator().manual_seed(14)
    if "fp4" in kinds and (m % 2 or n % 2):  # float4 packs x1 [m, k / 2], x2 [k, n / 2]
        m, n = m + m % 2, n + n % 2
    x1, x2, a, w, sa, sw = mx_operands(m, k, n, *kinds, gen, small=False)
    out = opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, **mx_kw(*kinds, F32))
    ref = ref_float_qmm(a, w, out_dtype=torch.float64, sa=sa, sw=sw)
    assert out.shape == (m, n)
    sa64, sw64 = mx_scales(sa, sw, k)
    assert_close_fp32_acc(out, ref, a * sa64, w * sw64)


@pytest.mark.parametrize("kinds", [(E4, E4), ("fp4", E5)], ids=["mxfp8", "fp4_x_e5m2"])
def test_mx_quant_matmul_tiny_scales_keep_subnormal_sums(kinds):
    """Scales that put every product below fp32's smallest normal: the results are fp32
    subnormals, which a bf16 dot-product instruction would flush to 0; the kernel must keep them
    (it takes the bf16 path only where no product or sum can be subnormal)."""
    gen = torch.Generator().manual_seed(15)
    m, k, n = 130, 64, 16
    x1, x2, a, w, sa, sw = mx_operands(m, k, n, *kinds, gen, small=True)
    sa = mx_scale_codes(*sa.shape, gen=gen, lo=58, hi=60)    # 2^-69 .. 2^-68
    sw = mx_scale_codes(*sw.shape, gen=gen, lo=58, hi=60)
    out = opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, **mx_kw(*kinds, F32))
    ref = ref_float_qmm(a, w, out_dtype=torch.float64, sa=sa, sw=sw)
    assert bool((ref.abs() < 2.0 ** -126).all()) and bool((ref != 0).any())
    # integer codes times exact powers of two: fp32 holds every sum exactly down to 2^-149
    assert torch.equal(out, ref.float())


def test_mx_quant_matmul_torch_dtypes_batch_and_3d_bias():
    """torch.float8_e8m0fnu / torch.float4_e2m1fn_x2 tensors need no *_dtype; scales may carry
    the operands' batch dims; a [batch, 1, n] bias."""
    gen = torch.Generator().manual_seed(15)
    b, m, k, n = 3, 4, 128, 6
    x1 = fp4_bytes(b, m, k // 2, gen=gen)
    x2 = fp4_bytes(b, n, k // 2, gen=gen)  # transposed weights [n, k / 2]
    sa = mx_scale_codes(b, m, 2, 2, gen=gen)
    sw = mx_scale_codes(b, n, 2, 2, gen=gen).transpose(1, 2)
    bias = torch.randn(b, 1, n, generator=gen)
    out = opennpu.npu_quant_matmul(
        x1.view(torch.float4_e2m1fn_x2), x2.view(torch.float4_e2m1fn_x2).mT,
        sw.view(torch.float8_e8m0fnu), pertoken_scale=sa.view(torch.float8_e8m0fnu), bias=bias,
        output_dtype=BF16, group_sizes=[1, 1, 32])
    ref = ref_float_qmm(unpack_fp4(x1), unpack_fp4(x2).mT, bias=bias, out_dtype=BF16, sa=sa,
                        sw=sw)
    assert out.shape == (b, m, n) and torch.equal(out, ref)
    # the same with uint8 bytes and torch_npu's codes, and with unbatched scales broadcast
    out2 = opennpu.npu_quant_matmul(x1, x2.mT, sw, pertoken_scale=sa, bias=bias,
                                    **mx_kw("fp4", "fp4", BF16))
    assert torch.equal(out2, out)
    out3 = opennpu.npu_quant_matmul(x1, x2.mT, sw[0], pertoken_scale=sa[0],
                                    **mx_kw("fp4", "fp4", F32))
    ref3 = ref_float_qmm(unpack_fp4(x1), unpack_fp4(x2).mT, out_dtype=F32, sa=sa[0], sw=sw[0])
    assert torch.equal(out3, ref3)


def test_fp8_quant_matmul_batches_non_contiguous_and_empty():
    gen = torch.Generator().manual_seed(16)
    x1 = fp8(2, 5, 70, gen=gen, small=True)[:, :, ::2]  # non-contiguous [2, 5, 35]
    x2 = fp8(3, 35, dtype=E5, gen=gen, small=True).t()  # a transpose [35, 3]
    x2 = x2.unsqueeze(0).expand(2, 35, 3)  # broadcast batch (stride 0)
    scale = torch.tensor([0.5])
    out = opennpu.npu_quant_matmul(x1, x2, scale, output_dtype=F32)
    ref = ref_float_qmm(x1.double(), x2.double(), scale, out_dtype=F32)
    assert torch.equal(out, ref)
    out = opennpu.npu_quant_matmul(fp8(0, 16), fp8(16, 4), scale, output_dtype=F16)
    assert out.shape == (0, 4) and out.dtype == F16
    out = opennpu.npu_quant_matmul(fp8(3, 0), fp8(0, 4), scale, output_dtype=F16,
                                   bias=torch.ones(4))
    assert torch.equal(out, torch.ones(3, 4, dtype=F16))


@pytest.mark.parametrize("dt", (E4, E5), ids=["e4m3", "e5m2"])
def test_fp8_every_code_decodes_to_torchs_value(dt):
    """Every byte (finite, subnormal, NaN, e5m2's infinities) at every lane position of the
    vectorised decode and in its scalar tail: x1 row r holds code r at all 37 positions; against
    the identity, out[r, j] is code r's value exactly (NaN for NaN codes), and against ones 37
    times it (exact: few significant bits), which keeps the infinities (inf * 0 would not)."""
    codes = torch.arange(256, dtype=torch.int32).to(U8)
    x1 = codes.view(256, 1).expand(256, 37).contiguous().view(dt)
    want = codes.view(dt).float()
    finite = want.isfinite()
    out = opennpu.npu_quant_matmul(x1, torch.eye(37).to(dt), torch.ones(1), output_dtype=F32)
    for j in (0, 15, 16, 31, 36):
        assert torch.equal(out[:, j][finite], want[finite]), j
        assert bool(out[:, j][want.isnan()].isnan().all())
    out = opennpu.npu_quant_matmul(x1, torch.ones(37, 3).to(dt), torch.ones(1), output_dtype=F32)
    assert torch.equal(out[:, 1][~want.isnan()], 37 * want[~want.isnan()])


def test_fp8_reinterpreted_bytes_and_nan_codes():
    gen = torch.Generator().manual_seed(17)
    x1, x2 = fp8(4, 32, gen=gen), fp8(32, 5, dtype=E5, gen=gen)
    s = torch.rand(5, generator=gen)
    out = opennpu.npu_quant_matmul(x1, x2, s, output_dtype=F32)
    for d1, d2 in [(292, 291), (E4, E5)]:
        got = opennpu.npu_quant_matmul(x1.view(U8), x2.view(torch.int8), s, output_dtype=F32,
                                       x1_dtype=d1, x2_dtype=d2)
        assert torch.equal(got, out)
    nan = x1.clone()
    nan.view(U8)[1, 3] = 0x7F  # e4m3fn NaN
    got = opennpu.npu_quant_matmul(nan, x2, s, output_dtype=F16)
    assert got[1].isnan().all() and not got[[0, 2, 3]].isnan().any()
    # e8m0 code 255 is NaN: its block's products are NaN
    x1b, x2b, *_, sa, sw = mx_operands(2, 64, 2, E4, E4, gen)
    sa[0, 0, 1] = 255
    got = opennpu.npu_quant_matmul(x1b, x2b, sw, pertoken_scale=sa, **mx_kw(E4, E4, F32))
    assert got[0].isnan().all() and not got[1].isnan().any()


def test_mx_end_to_end_with_dynamic_mx_quant():
    """npu_dynamic_mx_quant(x) and of the weights -> npu_quant_matmul with the mxscales:
    x @ w.T up to the element formats' precision, and exactly the product of the dequantised
    operands."""
    gen = torch.Generator().manual_seed(18)
    m, k, n = 16, 256, 24
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    exact = x.double() @ w.double().T
    for dst, tol in [(torch.float8_e4m3fn, 0.06), (torch.float8_e5m2, 0.12), (296, 0.3)]:
        xq, xs = opennpu.npu_dynamic_mx_quant(x, dst_type=dst)
        wq, ws = opennpu.npu_dynamic_mx_quant(w, dst_type=dst)
        kw = dict(output_dtype=F32, scale_dtype=293, pertoken_scale_dtype=293)
        if dst == 296:
            kw.update(x1_dtype=296, x2_dtype=296)
        y = opennpu.npu_quant_matmul(xq, wq.t(), ws.transpose(0, 1), pertoken_scale=xs, **kw)
        rel = ((y.double() - exact).norm() / exact.norm()).item()
        assert rel < tol, (dst, rel)
        deq = lambda q, s: (unpack_fp4(q) if dst == 296 else q.double())  # noqa: E731
        ea, ew = mx_scales(xs, ws.transpose(0, 1), k)
        a, b = deq(xq, xs) * ea, deq(wq, ws) * ew.T
        assert_close_fp32_acc(y, a @ b.T, a, b.T)


def test_float_quant_matmul_portable_npu_device_opcheck_and_compile():
    from opennpu.ops import portable

    gen = torch.Generator().manual_seed(19)
    x1, x2, *_, sa, sw = mx_operands(4, 96, 6, "fp4", "fp4", gen, trans2=True)
    mxkw = mx_kw("fp4", "fp4", BF16)
    f1, f2 = fp8(4, 40, gen=gen, small=True), fp8(40, 6, dtype=E5, gen=gen, small=True)
    s, pt = torch.tensor([0.25]), torch.exp2(torch.randint(-3, 3, (4,), generator=gen).float())
    fkw = dict(pertoken_scale=pt, bias=torch.ones(6), output_dtype=F16)
    mx_out = opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, **mxkw)
    f_out = opennpu.npu_quant_matmul(f1, f2, s, **fkw)
    with portable.force():
        assert torch.equal(opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, **mxkw),
                           mx_out)
        assert torch.equal(opennpu.npu_quant_matmul(f1, f2, s, **fkw), f_out)
    on_npu = opennpu.npu_quant_matmul(f1.to("npu"), f2.to("npu"), s.to("npu"),
                                      pertoken_scale=pt.to("npu"), bias=torch.ones(6, device="npu"),
                                      output_dtype=F16)
    assert on_npu.device.type == "npu" and torch.equal(on_npu.cpu(), f_out)
    # opcheck's schema check compares inputs with allclose, which float8 tensors lack: the
    # float8 operands go as bytes with x1_dtype / x2_dtype (torch.compile below runs the dtypes)
    b1, b2 = f1.view(U8), f2.t().contiguous().t().view(U8)
    opcheck(torch.ops.npu.npu_quant_matmul.default, [
        ((x1, x2, sw), dict(pertoken_scale=sa, **mxkw)),
        ((b1, b2, s), dict(x1_dtype=24, x2_dtype=291, **fkw)),
        ((b1, b2, torch.rand(6)), dict(x1_dtype=E4, x2_dtype=E5, output_dtype=F32)),
    ])
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    def block(x1, x2, sw, sa, f1, f2, s, pt):
        y = opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, **mxkw)
        z = opennpu.npu_quant_matmul(f1, f2, s, pertoken_scale=pt, output_dtype=F16)
        return y.float() * 2, z

    compiled = torch.compile(block, fullgraph=True, backend=counter)
    args = (x1, x2, sw, sa, f1, f2, s, pt)
    for e, c in zip(block(*args), compiled(*args)):
        assert torch.equal(e, c)
    assert counter.frame_count == 1
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: opennpu.npu_quant_matmul(*a, **fkw) * 2, fullgraph=True)
    assert torch.equal(fn(f1, f2, s), f_out * 2)
    torch._dynamo.reset()


def test_float_quant_matmul_bad_inputs():
    gen = torch.Generator().manual_seed(20)
    qmm = opennpu.npu_quant_matmul
    f1, f2, s = fp8(4, 64, gen=gen), fp8(64, 8, gen=gen), torch.rand(8)
    x1, x2, *_, sa, sw = mx_operands(4, 64, 8, E4, E4, gen)
    mkw = mx_kw(E4, E4, F32)
    _raises(lambda: qmm(f1, codes(64, 8), s, output_dtype=F32),
            "argument 'x2' must be float8 / float4 codes like 'x1'", "Char")
    _raises(lambda: qmm(codes(4, 64), f2, s, output_dtype=F32),
            "argument 'x1' must be float8 / float4 codes like 'x2'", "Char")
    _raises(lambda: qmm(f1, f2, s), "argument 'output_dtype' must be torch.float16, "
            "torch.bfloat16 or torch.float32 with float8 / float4 operands", "None")
    _raises(lambda: qmm(f1, f2, s, output_dtype=I8), "argument 'output_dtype'", "Char")
    _raises(lambda: qmm(f1, f2, s, offset=s, output_dtype=F16), "argument 'offset' must be None")
    _raises(lambda: qmm(f1, f2, s.half(), output_dtype=F16),
            "argument 'scale' must be float32 or bfloat16 with float8 / hifloat8 operands",
            "Half")
    _raises(lambda: qmm(f1, f2, torch.rand(7), output_dtype=F16),
            "argument 'scale' must have shape [1] or [8]", "[7]")
    _raises(lambda: qmm(f1, f2, s, pertoken_scale=torch.rand(3), output_dtype=F16),
            "argument 'pertoken_scale' must have shape [4]", "[3]")
    _raises(lambda: qmm(f1, f2, s, bias=torch.ones(8, dtype=I32), output_dtype=F16),
            "argument 'bias' must be bfloat16, float16 or float32 with float8", "Int")
    _raises(lambda: qmm(f1, fp8(63, 8), s, output_dtype=F16), "argument 'x2' must have k = 64",
            "gives k = 63")
    _raises(lambda: qmm(f1, f2, torch.rand(1, 8), pertoken_scale=torch.rand(4, 1),
                        output_dtype=F16, group_sizes=[1, 128, 128]),
            "argument 'scale' must have shape [1, 1]", "group_sizes [1, 128, 128]", "[1, 8]")
    _raises(lambda: qmm(f1.view(U8), f2, s, x1_dtype=290, output_dtype=F16),
            "argument 'x2_dtype' must be torch_npu.hifloat8 like 'x1_dtype'")
    _raises(lambda: qmm(f1.float(), f2, s, x1_dtype=292, output_dtype=F16),
            "argument 'x1' must hold one byte per element", "Float")
    _raises(lambda: qmm(f1, f2, s, y_scale=s, output_dtype=F16), "argument 'y_scale' must be None")
    # MX
    _raises(lambda: qmm(x1, x2, sw[:, :4], pertoken_scale=sa, **mkw),
            "argument 'scale' must have shape [1, 8, 2]", "got [1, 4, 2]")
    _raises(lambda: qmm(x1, x2, sw, pertoken_scale=sa[:, :, :1], **mkw),
            "argument 'pertoken_scale' must have shape [4, 1, 2]", "[4, 1, 1]")
    _raises(lambda: qmm(x1, x2, sw.reshape(2, 8), pertoken_scale=sa, **mkw),
            "argument 'scale' must have shape [1, 8, 2]", "[2, 8]")
    _raises(lambda: qmm(x1, x2, sw, pertoken_scale=torch.rand(4), output_dtype=F32,
                        scale_dtype=293), "argument 'pertoken_scale' must be float8_e8m0 block "
            "scales like 'scale'")
    _raises(lambda: qmm(x1, x2, sw, output_dtype=F32, scale_dtype=293),
            "argument 'pertoken_scale' must be float8_e8m0 block scales", "None")
    _raises(lambda: qmm(x1, x2, sw.float(), pertoken_scale=sa, output_dtype=F32,
                        scale_dtype=293, pertoken_scale_dtype=293),
            "argument 'scale' must hold one byte per element", "Float")
    _raises(lambda: qmm(x1, x2, sw, pertoken_scale=sa, scale_dtype=5, output_dtype=F32),
            "argument 'scale_dtype' must be None, float8_e8m0fnu", "Half")
    _raises(lambda: qmm(x1, x2, sw, pertoken_scale=sa, group_sizes=[1, 1, 64], **mkw),
            "argument 'group_sizes' must be None, [0, 0, 0] or [1, 1, 32] with MX scales")
    _raises(lambda: qmm(fp4_bytes(4, 32), fp4_bytes(64, 4), s, x1_dtype=296, x2_dtype=296,
                        output_dtype=F32),
            "argument 'scale' must be float8_e8m0 block scales", "float4 operands")
    # a transposed x2 needs its scale transposed too (op-plugin's "transpose are not same")
    sq, sp = mx_scale_codes(2, 8, 2, gen=gen), mx_scale_codes(4, 2, 2, gen=gen)
    _raises(lambda: qmm(fp8(4, 128, gen=gen), fp8(8, 128, gen=gen).t(), sq, pertoken_scale=sp,
                        **mkw), "argument 'scale' must be a transpose", "strides [16, 2, 1]")
    sq_t = mx_scale_codes(8, 2, 2, gen=gen).transpose(0, 1)
    _raises(lambda: qmm(fp8(4, 128, gen=gen), fp8(128, 8, gen=gen), sq_t, pertoken_scale=sp,
                        **mkw), "argument 'scale' must not be a transpose", "as 'x2' is not")
