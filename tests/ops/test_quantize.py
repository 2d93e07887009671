"""npu_quantize: affine quantisation with given scales / zero points.

Contract: op-plugin's op_plugin_functions.yaml schema, its torch_npu-npu_quantize doc and the
goldens of test/test_custom_ops/test_npu_quantize.py: div_mode=True is torch.quantize_per_channel
(``zero_point + round(x * (1 / scale))``, clamped), div_mode=False is AscendQuantV2's
``clip(round(fp32(x * scale) + zero_point))`` with numpy's round half to even; torch.quint4x2
packs int4 codes eight per int32, lowest bits first.

The oracles are independent of the kernel: torch's quantized tensors for div_mode=True, float64
numpy arithmetic for div_mode=False (the fp32 product, then the add, rounded as float32 does).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch._dynamo.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import SETTINGS, opcheck

import opennpu

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
Q = opennpu.npu_quantize


def _raises(fn, *pieces):
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


def per_channel_ref(x, scales, zero_points, axis, dtype):
    """torch.quantize_per_channel's codes (the golden of op-plugin's div_mode tests)."""
    zp = zero_points if zero_points is not None else torch.zeros(scales.shape, dtype=torch.int64)
    return torch.quantize_per_channel(x.float(), scales.double(), zp.long(), axis,
                                      dtype).int_repr()


def ascend_quant_ref(x, scales, zero_points, ax, int4=False):
    """AscendQuantV2's golden: float32 product, float32 add, round half to even, clip."""
    shape = [1] * x.dim()
    shape[ax] = -1
    xs = x.float().numpy()
    s = scales.float().reshape(shape).numpy()
    t = (xs * s).astype(np.float32)
    if zero_points is not None:
        t = (t + zero_points.float().reshape(shape).numpy()).astype(np.float32)
    lo, hi = (-8, 7) if int4 else (-128, 127)
    codes = torch.from_numpy(np.clip(np.round(t), lo, hi).astype(np.int8))
    return pack_int4(codes) if int4 else codes


def pack_int4(codes):
    """int codes [..., 8 n] in [-8, 7] -> int32 words [..., n], code k in bits [4k, 4k + 4)."""
    nib = (codes.to(torch.int64) & 0xF).unflatten(-1, (-1, 8))
    words = (nib << torch.arange(0, 32, 4)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def ties(*shape, dtype=F32, scale=0.25, seed=0):
    """Values k * scale / 2 for integer k: every other one an exact tie of x / scale."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-700, 700, shape, generator=gen).float() * (scale / 2)).to(dtype)


# ----------------------------------------------------------------------------- div_mode=True


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=str)
@pytest.mark.parametrize("qtype", (torch.qint8, torch.quint8, torch.qint32), ids=str)
@pytest.mark.parametrize("axis", (0, 1, -1))
def test_div_mode_matches_quantize_per_channel(dtype, qtype, axis):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 7, 83, generator=gen) * 40).to(dtype)
    c = x.shape[axis]
    scales = torch.rand(c, generator=gen) * 0.9 + 0.05
    zp_dtype = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}[qtype]
    lo = 0 if qtype == torch.quint8 else -20
    zps = torch.randint(lo, lo + 40, (c,), generator=gen).to(zp_dtype)
    y = Q(x, scales, zps, qtype, axis)
    assert y.dtype == zp_dtype and y.shape == x.shape
    assert torch.equal(y, per_channel_ref(x, scales, zps, axis % 3, qtype))


def test_div_mode_ties_round_half_to_even_without_zero_points():
    x = ties(4, 300)
    scales = torch.full((300,), 0.25)
    y = Q(x, scales, None, torch.qint8, 1)
    assert torch.equal(y, per_channel_ref(x, scales, None, 1, torch.qint8))
    # 2.5 -> 2, 3.5 -> 4, -0.5 -> 0 (half to even), not away from zero
    x = torch.tensor([[0.625, 0.875, -0.125]])
    assert Q(x, torch.full((3,), 0.25), None, torch.qint8, 1).tolist() == [[2, 4, 0]]


def test_div_mode_reciprocal_as_torch():
    """x * (1 / scale) in float32, not x / scale: the two round differently near ties."""
    x = (torch.randint(-200, 200, (20000,)).float() + 0.5) * 0.37
    scales = torch.full((1,), 0.37)
    y = Q(x.view(1, -1), scales, None, torch.qint8, 0)
    assert torch.equal(y, per_channel_ref(x.view(1, -1), scales, None, 0, torch.qint8))
    y = Q(x.view(-1, 1), torch.full((20000,), 0.37), None, torch.qint8, 0)
    assert torch.equal(y.view(-1), per_channel_ref(x.view(1, -1), torch.full((20000,), 0.37),
                                                   None, 1, torch.qint8).view(-1))


def test_div_mode_saturates():
    x = torch.tensor([[1e3, -1e3, 1e12, -1e12, float("inf"), float("-inf")]])
    s = torch.ones(6)
    assert Q(x, s, None, torch.qint8, 1).tolist() == [[127, -128, 127, -128, 127, -128]]
    assert Q(x, s, None, torch.quint8, 1).tolist() == [[255, 0, 255, 0, 255, 0]]
    i32 = Q(x, s, None, torch.qint32, 1).tolist()[0]
    assert i32 == [1000, -1000, 2**31 - 1, -2**31, 2**31 - 1, -2**31]
    assert torch.equal(Q(x[:, :4], s[:4], None, torch.qint32, 1),
                       per_channel_ref(x[:, :4], s[:4], None, 1, torch.qint32))


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=str)
@pytest.mark.parametrize("div_mode", (True, False))
def test_int8_special_values_full_steps_and_tails(dtype, div_mode):
    """int8 codes of rows of whole 32-element steps and rows ending in part vectors, with NaN
    (the zero point), +-inf and out-of-range values (saturated) among them: torch's formula."""
    for cols in (192, 136, 23):
        x = (torch.randn(29, cols) * 300).to(dtype)
        x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
        x[1, -4:] = torch.tensor([-1e30, float("nan"), float("-inf"), float("inf")])
        scale = torch.rand(cols) + 0.1
        zero = torch.randint(-4, 4, (cols,))
        zp = zero.to(torch.int32) if div_mode else zero.float()
        v = x.float()
        t = torch.round(v * (1.0 / scale)) + zp if div_mode else torch.round(v * scale + zp)
        t = torch.where(torch.isnan(t), zp.float(), t)
        assert torch.equal(Q(x, scale, zp, torch.qint8, -1, div_mode),
                           t.clamp(-128, 127).to(torch.int8))


def test_nan_gives_the_zero_point():
    x = torch.tensor([[float("nan"), 1.0]])
    assert Q(x, torch.ones(2), torch.tensor([3, 3], dtype=torch.int32), torch.qint8, 1).tolist() \
        == [[3, 4]]
    assert Q(x, torch.ones(2), torch.tensor([3.0, 3.0]), torch.qint8, -1, False).tolist() \
        == [[3, 4]]


def test_plain_integer_dtypes_and_codes():
    x = torch.randn(3, 16) * 10
    s = torch.rand(16) + 0.1
    for plain, q in ((torch.int8, torch.qint8), (torch.uint8, torch.quint8),
                     (torch.int32, torch.qint32)):
        assert torch.equal(Q(x, s, None, plain, 1), Q(x, s, None, q, 1))
    assert torch.equal(torch.ops.npu.npu_quantize(x, s, None, 12, 1, True), Q(x, s, None, torch.qint8))


def test_per_tensor_scale_broadcasts():
    x = torch.randn(4, 9, 5) * 30
    s, z = torch.tensor([0.3]), torch.tensor([7], dtype=torch.int32)
    expected = per_channel_ref(x, s.expand(9), z.expand(9), 1, torch.qint8)
    assert torch.equal(Q(x, s, z, torch.qint8, 1), expected)
    assert torch.equal(Q(x, s, None, torch.qint8, -1, False),
                       ascend_quant_ref(x, s, None, 2))


# ----------------------------------------------------------------------------- div_mode=False


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=str)
@pytest.mark.parametrize("form", ("perchannel", "perhead", "pertensor", "perhead_1d"))
def test_mul_mode_matches_ascend_quant_golden(dtype, form):
    gen = torch.Generator().manual_seed(2)
    x = (torch.rand(3, 16, 136, generator=gen) * 2 - 1).to(dtype)
    shape, axis = {"perchannel": ((136,), -1), "perhead": ((1, 16, 1), -2),
                   "pertensor": ((1,), -1), "perhead_1d": ((16,), -2)}[form]
    s = (torch.rand(shape, generator=gen) * 2 - 1).to(dtype)
    z = (torch.rand(shape, generator=gen) * 2 - 1).to(dtype)
    y = Q(x, s, z, torch.qint8, axis, False)
    assert y.dtype == torch.int8 and y.shape == x.shape
    assert torch.equal(y, ascend_quant_ref(x, s, z, 1 if axis == -2 else 2))


def test_mul_mode_no_fma_at_ties():
    """fp32(x * s) + z, two roundings: with p = fp32(x * s) in [2, 4) and z = 0.5 - p (exact),
    the golden's sum is exactly the tie 0.5 (code 0); a fused multiply-add keeps the product's
    rounding error and rounds about half of them to 1."""
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(16, 512, generator=gen) * 0.6 + 1.4
    s = torch.rand(512, generator=gen) * 0.6 + 1.4
    z = 0.5 - (x[:1] * s)[0]  # per column; exact in float32
    x = x[:1].expand(16, 512).contiguous()
    y = Q(x, s, z, torch.qint8, -1, False)
    assert torch.equal(y, ascend_quant_ref(x, s, z, 1))
    assert (y == 0).all()
    fused = np.round(x.double().numpy() * s.double().numpy() + z.double().numpy()
                     ).astype(np.float32)  # the FMA's (nearly) exact sum, for contrast
    assert (fused != 0).sum() > 1000


@pytest.mark.parametrize("axis", (-1, 1, -2))
def test_quint4x2_packs_eight_codes_per_int32(axis):
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(-10, 10, (2, 6, 40), generator=gen).float()
    s = torch.tensor([1.0])
    y = Q(x, s, None, torch.quint4x2, axis, False)
    assert y.dtype == torch.int32 and y.shape == (2, 6, 5)
    assert torch.equal(y, pack_int4(x.clamp(-8, 7).to(torch.int8)))
    s2 = torch.rand(6, generator=gen) + 0.5 if axis == -2 else torch.rand(40, generator=gen) + 0.5
    ax = 1 if axis == -2 else 2
    assert torch.equal(Q(x, s2, None, torch.quint4x2, axis, False),
                       ascend_quant_ref(x, s2, None, ax, int4=True))


@pytest.mark.parametrize("dtype", (F32, BF16, F16))
@pytest.mark.parametrize("cols", (8, 24, 40, 64, 136))
@pytest.mark.parametrize("zero", (False, True))
def test_quint4x2_special_values_tails_and_dtypes(dtype, cols, zero):
    """int4 codes (AVX-512 fast path and generic tails alike) against the golden, with NaN (the
    zero point), +-inf and out-of-range values (clamped to [-8, 7]) among them."""
    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(5, cols, generator=gen) * 9).to(dtype)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 6e4]).to(dtype)
    x[3, -4:] = torch.tensor([-6e4, float("nan"), 7.5, -8.5]).to(dtype)
    for s in (torch.rand(cols, generator=gen) + 0.3, torch.tensor([0.7])):
        z = torch.randint(-3, 4, s.shape, generator=gen).float() if zero else None
        t = x.float() * s.float()
        if z is not None:
            t = t + z
        t = torch.where(torch.isnan(t), z if z is not None else torch.zeros(()), t)
        expected = pack_int4(torch.from_numpy(np.clip(np.round(t.numpy()), -8, 7).astype(np.int8)))
        assert torch.equal(Q(x, s, z, torch.quint4x2, -1, False), expected)


def test_int4_words_feed_npu_quant_matmul():
    """op-plugin's A4W4 tests build their operands with npu_quantize(..., quint4x2)."""
    x1 = torch.randint(-5, 5, (7, 64))
    x2 = torch.randint(-5, 5, (64, 24))
    one = torch.tensor([1.0])
    a = Q(x1.float(), one, None, torch.quint4x2, -1, False)
    b = Q(x2.float(), one, None, torch.quint4x2, -1, False)
    out = opennpu.npu_quant_matmul(a, b, torch.tensor([0.5]), output_dtype=torch.float16)
    assert torch.equal(out.float(), (x1 @ x2).float() * 0.5)


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("div_mode", (True, False))
def test_odd_empty_and_non_contiguous(div_mode):
    gen = torch.Generator().manual_seed(5)
    for n in (1, 7, 83, 769):
        x = torch.randn(3, n, generator=gen) * 50
        s = torch.rand(n, generator=gen) + 0.1
        ref = (per_channel_ref(x, s, None, 1, torch.qint8) if div_mode
               else ascend_quant_ref(x, s, None, 1))
        assert torch.equal(Q(x, s, None, torch.qint8, 1, div_mode), ref)
    base = torch.randn(40, 30, generator=gen) * 50
    x = base.t()[::2]  # [15, 40], strided
    s = (torch.rand(80, generator=gen) + 0.1)[::2]
    ref = per_channel_ref(x.contiguous(), s.contiguous(), None, 1, torch.qint8) if div_mode \
        else ascend_quant_ref(x.contiguous(), s.contiguous(), None, 1)
    assert torch.equal(Q(x, s, None, torch.qint8, 1, div_mode), ref)
    empty = Q(torch.randn(0, 16), torch.ones(16), None, torch.qint8, 1, div_mode)
    assert empty.shape == (0, 16) and empty.dtype == torch.int8
    e4 = Q(torch.randn(3, 0), torch.ones(1), None, torch.quint4x2, -1, False)
    assert e4.shape == (3, 0) and e4.dtype == torch.int32


@settings(**SETTINGS)
@given(rows=st.integers(0, 9), cols=st.integers(1, 70), axis=st.sampled_from([0, 1]),
       div_mode=st.booleans())
def test_shape_sweep(rows, cols, axis, div_mode):
    x = torch.randn(rows, cols) * 20
    if not div_mode:
        axis = -2 if axis == 0 else -1
    ax = axis % 2
    s = torch.rand(x.shape[ax]) + 0.05
    z = torch.randint(-4, 4, (x.shape[ax],)).float()
    if div_mode:
        ref = per_channel_ref(x, s, z.long(), ax, torch.qint8)
        assert torch.equal(Q(x, s, z.int(), torch.qint8, axis), ref)
    else:
        assert torch.equal(Q(x, s, z, torch.qint8, axis, False), ascend_quant_ref(x, s, z, ax))


def test_npu_device_matches_cpu():
    x = torch.randn(6, 32) * 9
    s = torch.rand(32) + 0.2
    ref = Q(x, s, None, torch.qint8, 1)
    out = Q(x.to("npu"), s.to("npu"), None, torch.qint8, 1)
    assert out.device.type == "npu" and torch.equal(out.cpu(), ref)


def test_forced_portable_matches_cpp():
    from opennpu.ops import portable

    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 6, 48, generator=gen) * 30
    cases = [
        (x, torch.rand(6, generator=gen) + 0.1, torch.randint(-5, 5, (6,), dtype=torch.int32),
         torch.qint8, 1, True),
        (x, torch.rand(48, generator=gen) + 0.1, None, torch.quint8, -1, True),
        (x * 1e9, torch.rand(48, generator=gen) + 0.1, None, torch.qint32, 2, True),
        (x.to(BF16), (torch.rand(6, 1, generator=gen) * 0.2).to(BF16),
         torch.rand(6, 1, generator=gen).to(BF16), torch.qint8, -2, False),
        (x, torch.tensor([0.3]), None, torch.quint4x2, -1, False),
    ]
    expected = [Q(*c) for c in cases]
    with portable.force():
        got = [Q(*c) for c in cases]
    for e, g in zip(expected, got):
        assert e.dtype == g.dtype and torch.equal(e, g)


def test_opcheck():
    x = torch.randn(3, 5, 16)
    opcheck(torch.ops.npu.npu_quantize.default, [
        ((x, torch.rand(5) + 0.1, torch.zeros(5, dtype=torch.int32), 12, 1, True), {}),
        ((x, torch.rand(16) + 0.1, None, 13, -1, True), {}),
        ((x.to(F16), (torch.rand(16) + 0.1).to(F16), torch.zeros(16, dtype=F16), 12, -1,
          False), {}),
        ((x, torch.tensor([0.5]), None, 16, -1, False), {}),
        ((x.transpose(0, 1), torch.rand(3) + 0.1, None, 12, 1, True), {}),
    ])


def test_compile_fullgraph_dynamic_matches_eager():
    def block(x, s, s4):
        return (Q(x, s, None, torch.qint8, -1, False),
                Q(x, s4, None, torch.quint4x2, -1, False),
                Q(x, s, None, torch.quint8, 1))

    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for rows in (3, 5):
        x = torch.randn(rows, 32) * 20
        s = torch.rand(32) + 0.1
        s4 = torch.tensor([4.0])
        for a, b in zip(compiled(x, s, s4), block(x, s, s4)):
            assert torch.equal(a, b)
    assert counter.frame_count == 1
    inductor = torch.compile(block, fullgraph=True)
    x = torch.randn(4, 32) * 20
    for a, b in zip(inductor(x, torch.rand(32) + 0.1, torch.tensor([4.0])),
                    block(x, torch.rand(32) + 0.1, torch.tensor([4.0]))):
        assert a.shape == b.shape and a.dtype == b.dtype


def test_not_differentiable():
    x = torch.randn(2, 8, requires_grad=True)
    y = Q(x, torch.ones(8), None, torch.qint8, 1)
    assert not y.requires_grad


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs():
    x = torch.randn(4, 16)
    s = torch.ones(16)
    _raises(lambda: Q(torch.ones(4, 16, dtype=torch.int32), s, None, torch.qint8),
            "npu_quantize: argument 'self'", "Int")
    _raises(lambda: Q(torch.tensor(1.0), torch.ones(1), None, torch.qint8),
            "npu_quantize: argument 'self' must have at least 1 dim")
    _raises(lambda: Q(x, s, None, torch.float16), "npu_quantize: argument 'dtype' must be "
            "torch.qint8, torch.quint8 or torch.qint32", "but got Half")
    _raises(lambda: Q(x, s, None, torch.quint4x2), "argument 'dtype'", "div_mode=True")
    _raises(lambda: Q(x, s, None, torch.quint8, -1, False), "argument 'dtype' must be torch.qint8 "
            "(or torch.int8) or torch.quint4x2", "but got QUInt8")
    _raises(lambda: Q(x, s, None, 999), "argument 'dtype'", "dtype code 999")
    _raises(lambda: Q(x, s, None, torch.qint8, 2), "argument 'axis' must be in [-2, 1]", "got 2")
    _raises(lambda: Q(x, s, None, torch.qint8, -3, False), "argument 'axis' must be -2", "got -3")
    _raises(lambda: Q(x, torch.ones(15), None, torch.qint8, 1),
            "argument 'scales' must be 1-D [16] (dim 1 of 'self') or [1]", "got shape [15]")
    _raises(lambda: Q(x, torch.ones(1, 16), None, torch.qint8, 1),
            "argument 'scales' must be 1-D [16]", "got shape [1, 16]")
    _raises(lambda: Q(x, torch.ones(4, 16), None, torch.qint8, -1, False),
            "argument 'scales'", "broadcastable to 'self' with 1 in every dim but dim 1", "got shape [4, 16]")
    _raises(lambda: Q(x, torch.ones(16, dtype=torch.int32), None, torch.qint8),
            "npu_quantize: argument 'scales'")
    _raises(lambda: Q(x, s, torch.zeros(8, dtype=torch.int32), torch.qint8),
            "argument 'zero_points' must be", "as many elements as 'scales' (16)", "[8]")
    _raises(lambda: Q(x, s, torch.zeros(16, dtype=torch.bool), torch.qint8),
            "argument 'zero_points' must be int8, uint8, int32", "Bool")
    _raises(lambda: Q(torch.randn(4, 12), torch.ones(1), None, torch.quint4x2, -1, False),
            "argument 'self' must have a last dim divisible by 8", "[4, 12]")
