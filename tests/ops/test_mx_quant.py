"""MX (microscaling) and block quantisation: npu_dynamic_mx_quant, npu_dynamic_mx_quant_with_dual_axis,
npu_grouped_dynamic_mx_quant, npu_dynamic_block_quant.

Contract: CANN's aclnnDynamicMxQuant(V3) / aclnnGroupedDynamicMxQuant docs and goldens (shared
exponent floor(log2(amax)) - emax or the cuBLAS-style rounding up, element rounding at the target
precision with saturation, NaN -> +0, e8m0 scales interleaved in pairs), op-plugin's meta shapes
and its (Ascend950-only) tests, and torch_npu's npu_dynamic_block_quant doc and golden.

The oracles (opennpu.testing.reference) compute the same float32 operations with torch ops, so
codes and scales must match bit for bit.
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

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
E4M3, E5M2, FP4, E1M2 = 24, 23, 296, 297
FP8_Y = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}


def _raises(fn, *pieces):
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


def spread(*shape, dtype=F32, seed=0):
    """Values over many binades, with zeros and exact ties for the element rounding."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-12, 12, shape,
                                                                     generator=gen).float())
    x[torch.rand(shape, generator=gen) < 0.05] = 0
    return x.to(dtype)


def check_mx(x, **kw):
    y, s = opennpu.npu_dynamic_mx_quant(x, **kw)
    dst_type = kw.get("dst_type", FP4)
    codes, scale = R.dynamic_mx_quant(x, axis=kw.get("axis", -1), dst_type=dst_type,
                                      block_size=kw.get("block_size", 32),
                                      round_mode=kw.get("round_mode", "rint"),
                                      scale_alg=kw.get("scale_alg", 0),
                                      max_low_bound=kw.get("max_low_bound", 0.0))
    assert s.dtype == torch.uint8 and s.shape == scale.shape, (s.shape, scale.shape)
    assert torch.equal(s, scale), (s.int() - scale.int()).abs().max()
    if dst_type in FP8_Y:
        assert y.dtype == FP8_Y[dst_type] and y.shape == x.shape
        assert torch.equal(y.view(torch.uint8), codes)
    else:
        assert y.dtype == torch.uint8 and y.shape == (*x.shape[:-1], x.shape[-1] // 2)
        assert torch.equal(y, R.pack_fp4(codes))
    return y, s


# ----------------------------------------------------------------------------- npu_dynamic_mx_quant


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=str)
@pytest.mark.parametrize("dst_type", (E4M3, E5M2, FP4, E1M2))
@pytest.mark.parametrize("axis", (-1, 0, 1))
def test_dynamic_mx_quant_matches_reference(dtype, dst_type, axis):
    check_mx(spread(3, 70, 64, dtype=dtype), axis=axis, dst_type=dst_type)


@pytest.mark.parametrize("dst_type", (E4M3, E5M2))
def test_dynamic_mx_quant_scale_alg_1(dst_type):
    x = spread(4, 96, seed=1)
    check_mx(x, dst_type=dst_type, scale_alg=1)
    check_mx(x * 1e-30, dst_type=dst_type, scale_alg=1, max_low_bound=1e-3)
    check_mx(x, dst_type=dst_type, scale_alg=1, axis=0, block_size=64)


@pytest.mark.parametrize("mode", ("rint", "round", "floor"))
def test_dynamic_mx_quant_fp4_round_modes(mode):
    check_mx(spread(5, 64, seed=2), dst_type=FP4, round_mode=mode)
    check_mx(spread(5, 64, seed=3), dst_type=E1M2, round_mode=mode)


def test_dynamic_mx_quant_hand_values():
    # amax 6 -> shared_exp floor(log2 6) - 2 = 0 (code 127); 2.5 is a tie between 2 and 3
    # (to even: 2), 5 between 4 and 6 (to even: 4), 0.25 between 0 and 0.5 (to even: 0)
    x = torch.tensor([[6.0, 2.5, 5.0, 0.25, -1.5, 7.0, -0.75, 1.25] + [0.0] * 24])
    y, s = opennpu.npu_dynamic_mx_quant(x)
    assert s.tolist() == [[[127, 0]]]  # one block, padded to a pair with code 0
    # 7 -> 6 (saturated); -0.75 -> -1 (tie, to even mantissa); 1.25 -> 1 (tie)
    values = [6.0, 2.0, 4.0, 0.0, -1.5, 6.0, -1.0, 1.0]
    codes = R.mx_encode(torch.tensor(values), "float4_e2m1")
    assert y[0, :4].tolist() == R.pack_fp4(codes).tolist()
    # the op-plugin case: zeros give codes 0 and scale code 0 (2^-127)
    z = torch.zeros(1, 2, 2, dtype=BF16)
    y1, s1, y2, s2 = opennpu.npu_dynamic_mx_quant_with_dual_axis(z, dst_type=23)
    assert not y1.view(torch.uint8).any() and not s1.any() and s1.shape == (1, 2, 1, 2)
    assert not y2.view(torch.uint8).any() and s2.shape == (1, 1, 2, 2)


def test_dynamic_mx_quant_e4m3_saturates_and_nan_blocks():
    x = torch.zeros(3, 32)
    x[0, 0], x[0, 1] = 500.0, 460.0  # amax 500: exp 8 - 8 = 0; 500 -> 448, 460 -> 448
    x[1, 0], x[1, 5] = float("nan"), 1.0
    x[2, 0] = float("inf")
    y, s = check_mx(x, dst_type=E4M3)
    assert y[0, :2].float().tolist() == [448.0, 448.0]
    assert s[1, 0, 0].item() == 255 and s[2, 0, 0].item() == 255  # NaN scales
    assert not y[1:].view(torch.uint8).any()  # their codes are +0
    # negative values that round to zero keep the sign bit (0x80), as the conversion does
    y, _ = check_mx(torch.tensor([[1.0, -1e-6] + [0.0] * 30]), dst_type=E4M3)
    assert y.view(torch.uint8)[0, 1].item() == 0x80


def test_dynamic_mx_quant_odd_empty_noncontiguous():
    for shape in [(1, 2), (7, 33), (2, 3, 1026)]:
        check_mx(spread(*shape), dst_type=E5M2)
    check_mx(spread(65, 4, seed=4), axis=0, dst_type=FP4)
    check_mx(spread(0, 64), dst_type=E4M3)
    check_mx(spread(64, 6, seed=5).t(), dst_type=E4M3)
    check_mx(spread(2, 40, 6, dtype=BF16, seed=6).transpose(1, 2), axis=2, dst_type=FP4)
    check_mx(spread(3, 64) * 1e-38, dst_type=E4M3)  # subnormal inputs, clamped exponents
    x = spread(4, 64).to("npu")
    y, s = opennpu.npu_dynamic_mx_quant(x, dst_type=E4M3)
    assert y.device.type == "npu"
    cy, cs = opennpu.npu_dynamic_mx_quant(x.cpu(), dst_type=E4M3)
    assert torch.equal(y.cpu().view(torch.uint8), cy.view(torch.uint8)) and torch.equal(s.cpu(), cs)


def test_dynamic_mx_quant_dtype_arguments():
    # torch's dtypes (as int codes) and torch_npu's codes name the same formats
    x = spread(2, 64)
    for a, b in [(23, 291), (24, 292), (296, 45)]:
        ya, sa = opennpu.npu_dynamic_mx_quant(x, dst_type=a)
        yb, sb = opennpu.npu_dynamic_mx_quant(x, dst_type=b)
        assert torch.equal(ya.view(torch.uint8), yb.view(torch.uint8)) and torch.equal(sa, sb)
    y, _ = opennpu.npu_dynamic_mx_quant(x, dst_type=torch.float8_e4m3fn)
    assert y.dtype == torch.float8_e4m3fn


def test_dynamic_mx_quant_bad_inputs():
    mx = opennpu.npu_dynamic_mx_quant
    x = spread(2, 64)
    _raises(lambda: mx(x.double()), "npu_dynamic_mx_quant: argument 'input' must be float16",
            "Double")
    _raises(lambda: mx(x, dst_type=290), "argument 'dst_type' must be", "hifloat8")
    _raises(lambda: mx(x, dst_type=1), "argument 'dst_type' must be", "got 1")
    _raises(lambda: mx(x, block_size=48), "argument 'block_size' must be a multiple of 32",
            "48")
    _raises(lambda: mx(x, axis=2), "axis")
    _raises(lambda: mx(x, scale_alg=2), "argument 'scale_alg'", "got 2")
    _raises(lambda: mx(x, dst_type=E4M3, round_mode="floor"),
            "argument 'round_mode' must be \"rint\" for float8")
    _raises(lambda: mx(x, round_mode="ceil"), "argument 'round_mode'", "ceil")
    _raises(lambda: mx(x, dst_type_max=6.0), "argument 'dst_type_max' must be 0.0")
    _raises(lambda: mx(x, max_low_bound=1.0), "argument 'max_low_bound'")
    _raises(lambda: mx(spread(2, 63)), "must have an even last dim for float4_e2m1")


def test_dynamic_mx_quant_opcheck_and_compile():
    x = spread(3, 64)
    opcheck(torch.ops.npu.npu_dynamic_mx_quant.default, [
        ((x,), {}), ((x,), {"dst_type": E4M3, "axis": 0}), ((spread(2, 3, 64, dtype=BF16),),
                                                             {"dst_type": E5M2, "scale_alg": 1})])
    opcheck(torch.ops.npu.npu_dynamic_mx_quant_with_dual_axis.default,
            [((spread(2, 40, 64),), {"dst_type": E4M3})])

    def block(x):
        y, s = opennpu.npu_dynamic_mx_quant(x, dst_type=E4M3)
        y1, s1, y2, s2 = opennpu.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=FP4)
        return y.view(torch.uint8), s, y1, s1, y2, s2

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for shape in [(130, 160), (200, 224)]:
        x = spread(*shape)
        for e, c in zip(block(x), compiled(x)):
            assert torch.equal(e, c)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_dynamic_mx_quant_with_dual_axis_is_two_quantisations():
    x = spread(2, 70, 64, dtype=BF16, seed=7)
    for dst_type in (E4M3, FP4):
        y1, s1, y2, s2 = opennpu.npu_dynamic_mx_quant_with_dual_axis(x, dst_type=dst_type)
        a, sa = opennpu.npu_dynamic_mx_quant(x, axis=-1, dst_type=dst_type)
        b, sb = opennpu.npu_dynamic_mx_quant(x, axis=-2, dst_type=dst_type)
        assert torch.equal(y1.view(torch.uint8), a.view(torch.uint8)) and torch.equal(s1, sa)
        assert torch.equal(y2.view(torch.uint8), b.view(torch.uint8)) and torch.equal(s2, sb)
    _raises(lambda: opennpu.npu_dynamic_mx_quant_with_dual_axis(spread(64)),
            "npu_dynamic_mx_quant_with_dual_axis: argument 'input' must have at least 2 dims")


@settings(**SETTINGS)
@given(rows=st.integers(0, 5), d=st.integers(1, 100), dst_type=st.sampled_from([E4M3, E5M2, FP4]),
       axis=st.sampled_from([0, 1]), dtype=st.sampled_from([F32, F16, BF16]),
       alg=st.sampled_from([0, 1]))
def test_dynamic_mx_quant_hypothesis(rows, d, dst_type, axis, dtype, alg):
    d += d % 2 if dst_type == FP4 else 0
    x = spread(rows, d, dtype=dtype, seed=rows * 131 + d)
    check_mx(x, axis=axis, dst_type=dst_type, scale_alg=alg if dst_type != FP4 else 0)


# ----------------------------------------------------------------------------- grouped


@pytest.mark.parametrize("dst_type", (E4M3, E5M2))
@pytest.mark.parametrize("ends", ([1], [70], [10, 10, 75, 140], [0, 64, 65, 200]))
def test_grouped_dynamic_mx_quant_matches_reference(dst_type, ends):
    m = ends[-1]
    x = spread(m, 48, dtype=BF16, seed=m)
    gi = torch.tensor(ends, dtype=torch.int32)
    y, s = opennpu.npu_grouped_dynamic_mx_quant(x, gi, dst_type=dst_type)
    codes, scale = R.grouped_dynamic_mx_quant(x, gi, dst_type=dst_type)
    assert y.dtype == FP8_Y[dst_type] and s.shape == (m // 64 + len(ends), 48, 2)
    assert torch.equal(y.view(torch.uint8), codes)
    assert torch.equal(s, scale)


def test_grouped_dynamic_mx_quant_op_plugin_case_and_layout():
    y, s = opennpu.npu_grouped_dynamic_mx_quant(torch.zeros(1, 2, dtype=F16),
                                                torch.ones(1, dtype=torch.int32))
    assert not y.view(torch.uint8).any() and s.shape == (1, 2, 2) and not s.any()
    # rows 0..63 (two blocks: one pair, then a pair of scale-1 filler up to the next group's
    # start at pair 64 // 64 + 1), row 64 (one block, padded with code 0)
    _, s = opennpu.npu_grouped_dynamic_mx_quant(torch.ones(65, 1),
                                                torch.tensor([64, 65], dtype=torch.int32))
    e = 127 - 15  # e5m2: log2(1) - 15
    assert s[:, 0].tolist() == [[e, e], [127, 127], [e, 0]]
    # rows 0..9 (one block), 10..74 (three blocks): no filler
    _, s = opennpu.npu_grouped_dynamic_mx_quant(torch.ones(75, 1),
                                                torch.tensor([10, 75], dtype=torch.int32))
    assert s[:, 0].tolist() == [[e, 0], [e, e], [e, 0]]


def test_grouped_dynamic_mx_quant_bad_inputs_and_opcheck():
    g = opennpu.npu_grouped_dynamic_mx_quant
    x, gi = spread(70, 8), torch.tensor([30, 70], dtype=torch.int32)
    _raises(lambda: g(x, torch.tensor([40, 30], dtype=torch.int32)),
            "npu_grouped_dynamic_mx_quant: argument 'group_index' must be non-decreasing")
    _raises(lambda: g(x, torch.tensor([30, 60], dtype=torch.int32)), "must end at the number of "
            "rows of 'x' (70)")
    _raises(lambda: g(x, gi, dst_type=FP4), "argument 'dst_type' must be torch.float8_e5m2")
    _raises(lambda: g(x, gi, blocksize=64), "argument 'blocksize' must be 32")
    _raises(lambda: g(spread(2, 3, 4), gi), "argument 'x' must be 2-D")
    opcheck(torch.ops.npu.npu_grouped_dynamic_mx_quant.default, [((x, gi), {}),
                                                                 ((x, gi), {"dst_type": E4M3})])


# ----------------------------------------------------------------------------- block quant


@pytest.mark.parametrize("dtype", (F16, BF16, F32), ids=str)
@pytest.mark.parametrize("dst_type", (1, E4M3, E5M2))
def test_dynamic_block_quant_matches_reference(dtype, dst_type):
    for shape, rb, cb in [((5, 300), 1, 128), ((2, 7, 130), 1, 128), ((9, 70), 4, 32)]:
        x = spread(*shape, dtype=dtype, seed=sum(shape))
        y, s = opennpu.npu_dynamic_block_quant(x, dst_type=dst_type, row_block_size=rb,
                                               col_block_size=cb)
        ry, rs = R.dynamic_block_quant(x, dst_type=dst_type, row_block_size=rb,
                                       col_block_size=cb)
        assert y.dtype == ry.dtype and s.shape == rs.shape
        assert torch.equal(y.view(torch.uint8), ry.view(torch.uint8))
        assert torch.equal(s, rs)


@pytest.mark.parametrize("dtype", (F16, BF16, F32), ids=str)
def test_dynamic_block_quant_int8_non_finite_and_tiny_blocks(dtype):
    """Blocks holding a NaN (codes 0, scale NaN), an inf (scale inf, codes 0) or only values so
    small that 1 / amax overflows (multiplier inf: the codes saturate), in full blocks and tails."""
    for shape, rb, cb in [((4, 300), 1, 128), ((3, 9, 70), 2, 32), ((5, 33), 1, 16)]:
        x = spread(*shape, dtype=dtype, seed=3)
        flat = x.view(-1, shape[-1])
        flat[0, 1] = float("nan")
        flat[1, -1] = float("inf")
        flat[2, :] = 0.0
        flat[2, -3] = -1e-40 if dtype == F32 else 0.0
        y, s = opennpu.npu_dynamic_block_quant(x, row_block_size=rb, col_block_size=cb)
        ry, rs = R.dynamic_block_quant(x, row_block_size=rb, col_block_size=cb)
        assert torch.equal(y, ry)
        assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s.nan_to_num(), rs.nan_to_num())


def test_dynamic_block_quant_op_plugin_golden():
    # op-plugin's golden: y = round(x * 127 / amax) clamped to [-127, 127], scale = amax / 127
    x = spread(4, 3, dtype=F16, seed=9)
    y, s = opennpu.npu_dynamic_block_quant(x, dst_type=1)
    amax = x.abs().float().amax(dim=1, keepdim=True)
    assert torch.equal(y, torch.round(x.float() * (127.0 / amax)).clamp(-127, 127).to(torch.int8))
    assert torch.equal(s, amax / 127.0)
    # min_scale bounds the scale from below (and the multiplier from above)
    y, s = opennpu.npu_dynamic_block_quant(x * 1e-4, min_scale=1e-3)
    assert torch.all(s >= 1e-3)
    ry, rs = R.dynamic_block_quant(x * 1e-4, min_scale=1e-3)
    assert torch.equal(y, ry) and torch.equal(s, rs)
    # all-zero blocks: codes 0, scale 0; empty input
    y, s = opennpu.npu_dynamic_block_quant(torch.zeros(2, 8))
    assert not y.any() and not s.any()
    y, s = opennpu.npu_dynamic_block_quant(torch.zeros(0, 8))
    assert y.shape == (0, 8) and s.shape == (0, 1)


def test_dynamic_block_quant_bad_inputs_and_opcheck():
    bq = opennpu.npu_dynamic_block_quant
    x = spread(4, 130)
    _raises(lambda: bq(spread(130)), "npu_dynamic_block_quant: argument 'x' must be 2-D or 3-D")
    _raises(lambda: bq(x, dst_type=290), "argument 'round_mode' must be \"round\" for hifloat8")
    _raises(lambda: bq(x, round_mode="round"), "argument 'round_mode' must be \"rint\"")
    _raises(lambda: bq(x, min_scale=-1.0), "argument 'min_scale' must be >= 0")
    _raises(lambda: bq(x, col_block_size=0), "argument 'col_block_size' must be >= 1")
    _raises(lambda: bq(x, dst_type_max=200.0), "argument 'dst_type_max'")
    opcheck(torch.ops.npu.npu_dynamic_block_quant.default, [
        ((x,), {}), ((spread(2, 5, 70, dtype=BF16),), {"dst_type": E4M3, "row_block_size": 2,
                                                      "col_block_size": 32})])
    xn = x.to("npu")
    y, s = bq(xn)
    assert y.device.type == "npu" and torch.equal(y.cpu(), bq(x)[0])


@pytest.mark.parametrize("dst", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_float8_codes_equal_c10s_conversion_bit_for_bit(dst):
    # Each block's first element is the format's largest value, so the shared exponent is 0 and
    # the other 31 elements are converted as they are: random float32 bit patterns of every
    # magnitude up to the largest (subnormal range included), every value of the format, each
    # midpoint between neighbours (ties to even) and the floats on either side of it, both signs.
    # The kernel's branch-free encoder must give torch's own float8 conversion's codes.
    fp8 = FP8_Y[dst]
    top = torch.finfo(fp8).max
    codes = torch.arange(128, dtype=torch.uint8).view(fp8).float()
    vals = codes[torch.isfinite(codes)].unique().sort().values
    vals = vals[vals <= top]
    mids = ((vals[:-1].double() + vals[1:].double()) / 2).float()
    toward0 = torch.nextafter(mids, torch.zeros(()))
    away = torch.nextafter(mids, torch.full((), float("inf")))
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (1 << 15,), generator=gen, dtype=torch.int64)
    rand = bits.to(torch.int32).view(torch.float32)
    rand = rand[torch.isfinite(rand) & (rand <= top)]
    v = torch.cat([vals, mids, toward0, away, rand])
    v = torch.cat([v, -v])
    v = torch.cat([v, torch.zeros((-v.numel()) % 31)]).view(-1, 31)
    x = torch.cat([torch.full((v.shape[0], 1), top), v], 1).contiguous()
    y, s = opennpu.npu_dynamic_mx_quant(x, dst_type=dst)
    assert (s.view(torch.uint8)[..., 0] == 127).all()  # shared exponent 0 (e8m0 code 127)
    assert torch.equal(y.view(torch.uint8), x.to(fp8).view(torch.uint8))
    wide = x.flatten()[:x.numel() // (32 * 21) * 32 * 21].view(-1, 32 * 21)  # rows of 21 blocks
    y, s = opennpu.npu_dynamic_mx_quant(wide, dst_type=dst)
    assert (s.view(torch.uint8).flatten(1)[:, :21] == 127).all()
    assert torch.equal(y.view(torch.uint8), wide.to(fp8).view(torch.uint8))


@pytest.mark.parametrize("dst", [FP4, E1M2], ids=["e2m1", "e1m2"])
@pytest.mark.parametrize("mode", ("rint", "round", "floor"))
def test_fp4_codes_equal_the_scalar_rounding_bit_for_bit(dst, mode):
    # Each block's first element is the format's largest value, so the shared exponent is 0 and
    # the other 31 elements are rounded as they are: random float32 bit patterns of every
    # magnitude below 2^(emax + 1) (fp32 subnormals, and values above the largest that saturate,
    # included), every value of the format, each midpoint between neighbours (the ties of all
    # three modes) and the floats on either side of it, both signs. The same blocks scaled by 2^k
    # (random k per block, subnormal fp32 inputs included) exercise the product's rounding; bf16
    # and fp16 inputs the conversions. Codes must equal the reference's torch rounding.
    top, unit, limit = (6.0, 0.5, 8.0) if dst == FP4 else (1.75, 0.25, 2.0)
    # the format's values and 2^(emax + 1), the next value of a wider exponent range
    vals = (torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 8]) if dst == FP4
            else torch.arange(0, limit + unit, unit))
    mids = ((vals[:-1].double() + vals[1:].double()) / 2).float()
    toward0 = torch.nextafter(mids, torch.zeros(()))
    away = torch.nextafter(mids, torch.full((), float("inf")))
    gen = torch.Generator().manual_seed(0)
    limit_bits = torch.tensor(limit).view(torch.int32).item()
    rand = torch.randint(0, limit_bits, (1 << 14,), generator=gen, dtype=torch.int32)
    v = torch.cat([vals[vals < limit], mids, toward0, away, rand.view(torch.float32)])
    v = torch.cat([v, -v])
    v = torch.cat([v, torch.zeros((-v.numel()) % 31)]).view(-1, 31)
    x = torch.cat([torch.full((v.shape[0], 1), top), v], 1).contiguous()
    y, s = check_mx(x, dst_type=dst, round_mode=mode)
    assert (s[..., 0] == 127).all()  # shared exponent 0 (e8m0 code 127)
    k = torch.randint(-150, 120, (x.shape[0], 1), generator=gen).double()
    scaled = (x.double() * torch.exp2(k)).float()
    check_mx(scaled, dst_type=dst, round_mode=mode)
    check_mx(scaled.to(BF16), dst_type=dst, round_mode=mode)
    check_mx(x.to(F16), dst_type=dst, round_mode=mode)
    # blocks of 64 and 96 along rows whose last block is partial (tails of 16-lane vectors)
    flat = scaled.flatten()
    for d, bs in ((90, 64), (130, 96), (32 * 19, 32), (64 * 17 + 32, 64)):
        check_mx(flat[:flat.numel() // d * d].view(-1, d), dst_type=dst, round_mode=mode,
                 block_size=bs)


@pytest.mark.parametrize("dtype", (F32, BF16, F16), ids=str)
def test_dynamic_mx_quant_wide_rows_special_blocks(dtype):
    # Rows of many blocks (the kernel takes sixteen at a time, then single blocks up to the
    # row's end), each block of a different binade, with NaN, inf, all-zero, subnormal-maximum and
    # huge blocks among them; along the last axis and along the first (columns in lanes).
    gen = torch.Generator().manual_seed(7)
    x = spread(3, 32 * 37, seed=7)
    span = 6 if dtype == F16 else 60  # binades of the blocks
    x = x.view(3, 37, 32) * torch.exp2(torch.randint(-span, span, (3, 37, 1), generator=gen).float())
    x[0, 3], x[1, 20] = 0.0, 1e-40 * torch.randn(32, generator=gen)  # zero, subnormal maximum
    x[0, 5, 7], x[1, 17, 0], x[2, 30, 31] = float("nan"), float("inf"), -float("inf")
    x[2, 9] = 3e38 * torch.rand(32, generator=gen)
    x = x.reshape(3, 32 * 37).to(dtype)
    for dst in (E4M3, E5M2, FP4, E1M2):
        modes = ("rint",) if dst in FP8_Y else ("rint", "round", "floor")
        for mode in modes:
            for bs in (32, 64):
                check_mx(x, dst_type=dst, round_mode=mode, block_size=bs)
            check_mx(x.flatten()[:32 * 6 * 18].view(32 * 6, 18), dst_type=dst, round_mode=mode,
                     axis=0)
        if dst in FP8_Y:
            check_mx(x, dst_type=dst, scale_alg=1)
            check_mx(x, dst_type=dst, scale_alg=1, max_low_bound=1e-3, block_size=64)


@pytest.mark.parametrize("dst,dtype", [(FP4, BF16), (E1M2, BF16), (E4M3, BF16), (E5M2, BF16),
                                       (FP4, F16), (E1M2, F16)],
                         ids=["e2m1", "e1m2", "e4m3", "e5m2", "e2m1-fp16", "e1m2-fp16"])
def test_16_bit_blocks_around_the_16_bit_lanes_limits(dst, dtype):
    # bf16 to fp4 / float8 and fp16 to fp4, "rint", take blocks of shared exponent >= -120
    # (bf16 fp4), -120 (e4m3), -112 (e5m2), -11 (fp16 fp4) in 16-bit lanes (the exponent taken
    # off the elements' exponent fields) and smaller ones in fp32 lanes; float8 passes 32 elements
    # with a magnitude between half the subnormal spacing and the smallest normal to the fp32
    # lanes too. Blocks of every exponent from -127 to -96 (fp16: -16 to 12), each with its
    # largest value, the format's rounding thresholds (fp4) or values around its subnormal range
    # (float8), subnormals of the input type and zeros of both signs, in rows of sixteen blocks
    # and more (every block through the 16-bit loop, or a mixed group) and as single blocks.
    gen = torch.Generator().manual_seed(3)
    exps = torch.arange(-127, -95) if dtype == BF16 else torch.arange(-16, 13)
    tiny = [1e-39, -2e-40, 9e-41, -1e-45] if dtype == BF16 else [3e-5, -1e-6, 6e-8, -6e-8]
    if dst in (FP4, E1M2):
        top, special = (6.0, [0.25, 0.75, 1.25, 2.5, 5.0]) if dst == FP4 else \
            (1.75, [0.125, 0.375, 0.625, 1.125, 1.625])
    else:
        top, min_exp, mbits = (448.0, -6, 3) if dst == E4M3 else (57344.0, -14, 2)
        half = 2.0 ** (min_exp - mbits - 1)  # half the subnormal spacing: a tie, rounds to 0
        special = [2.0 ** min_exp, half, 3 * half, 2.0 ** min_exp * (1 - 2 ** -5)]
    blocks = []
    for e in exps.tolist():
        fracs = torch.tensor([top, *special, 0.0, -0.0, -0.3, 1.0])
        rest = (torch.rand(32 - 4 - fracs.numel(), generator=gen) * 2 - 1) * top
        v = torch.cat([fracs, rest, torch.tensor(tiny)])
        v[:-4] *= 2.0 ** e  # shared exponent e; the last four stay subnormals of dtype
        blocks.append(v)
    x = torch.stack(blocks).to(dtype)  # [32 or 29, 32]
    # without the subnormal-range values: float8 rows all in 16-bit lanes
    plain = x.clone()
    plain[:, 1:1 + len(special)] = plain[:, :1]
    for xx in (x, plain):
        y, s = check_mx(xx, dst_type=dst)                # single blocks
        assert torch.equal(s[:, 0, 0].long(), exps + 127)
        check_mx(xx.reshape(1, -1), dst_type=dst)        # 16-block groups, mixed and not
        check_mx(xx[-16:].reshape(1, -1), dst_type=dst)  # sixteen blocks of the largest exponents
        check_mx(xx[3:].reshape(1, -1).repeat(2, 1), dst_type=dst)
