"""Quantisation: npu_dynamic_quant, npu_add_rms_norm_dynamic_quant, and npu_add_rms_norm_cast
(a norm-family op, tested here beside its quantising sibling).

Contract: shared/spec/torch_npu_api.md sections 1.3 to 1.5; seed 003 (the torchair fusion of
npu_add_rms_norm + npu_dynamic_quant into npu_add_rms_norm_dynamic_quant).

The references (opennpu.testing.reference) scale, round (torch.round: half to even) and clamp
step by step in float32. npu_dynamic_quant computes exactly those float32 operations, so its codes
and scales must match bit for bit; the fused op's rstd is a differently ordered fp32 sum, so its
codes may differ by 1 where v / scale sits within an ulp of a .5 tie.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import LOW_DTYPES, SETTINGS, dtype_id, opcheck, randn

import opennpu
from opennpu.testing import reference as R
from opennpu.testing.tolerances import assert_close

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
INT4 = torch.quint4x2
QUANT_DTYPES = (F32, F16, BF16, torch.float64)


def _raises(fn, *pieces):
    """fn raises RuntimeError whose message contains every piece, in order."""
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


def codes_of(y, dst_type=None):
    """Our output as int8 codes (int4 words unpacked)."""
    if R.is_int4(dst_type):
        assert y.dtype == torch.int32
        return R.unpack_int4(y)
    assert y.dtype == torch.int8
    return y


def check_dynamic_quant(x, exact=True, **kwargs):
    y, scale = opennpu.npu_dynamic_quant(x, **kwargs)
    codes_ref, scale_ref = R.dynamic_quant(x, **kwargs)
    codes = codes_of(y, kwargs.get("dst_type"))
    assert scale.dtype == F32 and scale.shape == scale_ref.shape
    if R.is_int4(kwargs.get("dst_type")):
        assert y.shape == (*x.shape[:-1], x.shape[-1] // 8)
    else:
        assert y.shape == x.shape
    if exact:
        assert torch.equal(codes, codes_ref), (codes - codes_ref).abs().max()
        assert torch.equal(scale, scale_ref), (scale - scale_ref).abs().max()
    else:
        assert (codes.int() - codes_ref.int()).abs().max().item() <= 1
        torch.testing.assert_close(scale, scale_ref, rtol=1e-5, atol=0)
    return y, scale


# ----------------------------------------------------------------------------- npu_dynamic_quant


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("dst_type", [None, torch.int8, INT4], ids=["default", "int8", "int4"])
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smooth"])
def test_dynamic_quant_matches_reference(dtype, dst_type, smooth):
    x = randn(2, 5, 64, dtype=dtype)
    kwargs = {"dst_type": dst_type}
    if smooth:
        kwargs["smooth_scales"] = (torch.rand(64) + 0.5).to(dtype)
    check_dynamic_quant(x, **kwargs)


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=dtype_id)
def test_dynamic_quant_int4_codes_in_place(dtype):
    """Integer rows whose largest |x| is 7 have scale 1 and codes equal to x: every nibble lands
    at its element's place, in the 64-, 32- and 16-element steps and the tails."""
    torch.manual_seed(4)
    for cols in (64, 96, 136, 200, 8):
        x = torch.randint(-7, 8, (5, cols)).float()
        x[:, 0] = 7
        y, scale = opennpu.npu_dynamic_quant(x.to(dtype), dst_type=INT4)
        assert scale.tolist() == [1.0] * 5
        assert torch.equal(R.unpack_int4(y).float(), x), cols


def test_dynamic_quant_rounds_ties_half_to_even():
    # scale = 254 / 127 = 2 exactly, so v / scale hits the .5 ties exactly: torch.round (and
    # torch_npu's golden) rounds them to the even neighbour, not away from zero.
    row = [254, 1, 3, 5, 7, -1, -3, -5, -7, 9, 0, 2]
    expected = [127, 0, 2, 2, 4, 0, -2, -2, -4, 4, 0, 1]
    for dtype in (F32, F16, BF16):
        y, scale = opennpu.npu_dynamic_quant(torch.tensor([row], dtype=dtype))
        assert scale.tolist() == [2.0]
        assert y.tolist() == [expected], dtype
    # int4: scale = 14 / 7 = 2
    y, scale = opennpu.npu_dynamic_quant(torch.tensor([[14, 1, 3, 5, 7, -1, -3, -5]], dtype=F32),
                                         dst_type=INT4)
    assert scale.tolist() == [2.0]
    assert R.unpack_int4(y).tolist() == [[7, 0, 2, 2, 4, 0, -2, -2]]


def test_dynamic_quant_near_ties_match_the_true_division():
    # Values within a few ulps of (k + 1/2) * scale, for many scales: the kernel multiplies by
    # 1 / scale and must divide for real wherever that could round differently.
    gen = torch.Generator().manual_seed(1)
    scales = torch.rand(256, 1, generator=gen) * 10 + 1e-3
    k = torch.randint(-127, 127, (256, 255), generator=gen).float()
    ulps = torch.randint(-6, 7, (256, 255), generator=gen).float()
    v = (k + 0.5) * scales
    v = v + ulps * torch.finfo(torch.float32).eps * v.abs()
    x = torch.cat([127 * scales, v], dim=1)  # row max 127 * scale
    for dst_type in (None, INT4):
        xs = x if dst_type is None else torch.cat([x[:, :1] * 7 / 127, v[:, :255] * 7 / 127,
                                                   v[:, :8] * 0], dim=1)
        check_dynamic_quant(xs, dst_type=dst_type)
    check_dynamic_quant(x, dst_type_max=101.0)
    check_dynamic_quant(x * 1e-38)  # subnormal scales: no finite inverse, divided throughout


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=dtype_id)
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smooth"])
def test_dynamic_quant_full_steps_and_tails(dtype, smooth):
    """Rows of whole 32-element steps, and rows ending in one or two part vectors: the same
    codes and scales as the reference, rows spread unevenly over the threads."""
    for cols in (256, 200, 47, 16, 9):
        x = randn(37, cols, dtype=dtype) * 3
        kwargs = {"smooth_scales": (torch.rand(cols) + 0.5).to(dtype)} if smooth else {}
        check_dynamic_quant(x, **kwargs)


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=dtype_id)
@pytest.mark.parametrize("dst_type", [None, INT4], ids=["int8", "int4"])
def test_dynamic_quant_nan_and_inf_rows(dtype, dst_type):
    """A NaN makes its row's max and scale NaN and every code of the row 0; an inf makes the
    scale inf, the finite values' codes 0 and the inf's own code 0 (inf / inf is NaN). Rows of
    odd lengths put the special values in the tails too."""
    for cols in (48, 40, 72):
        x = randn(4, cols, dtype=dtype)
        x[0, 3] = float("nan")
        x[1, -1] = float("nan")
        x[2, 5] = float("inf")
        x[3, -2] = -float("inf")
        y, scale = opennpu.npu_dynamic_quant(x, dst_type=dst_type)
        codes = codes_of(y, dst_type)
        assert torch.isnan(scale[:2]).all() and torch.isinf(scale[2:]).all()
        assert (codes == 0).all()


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=dtype_id)
@pytest.mark.parametrize("dst_type", [torch.float8_e4m3fn, torch.float8_e5m2, 292, 291],
                         ids=["e4m3fn", "e5m2", "npu292", "npu291"])
@pytest.mark.parametrize("mode", ["pertoken", "pertensor"])
def test_dynamic_quant_fp8_matches_cann_golden(dtype, dst_type, mode):
    # CANN's golden: scale = rowmax * (1 / DTYPE_MAX) (448 / 57344), y = fp8(x / scale) (RNE)
    x = randn(3, 5, 80, dtype=dtype) * 3
    x[0, 1] = 0  # an all-zero row: scale 1, codes 0 (the golden divides by 0)
    y, scale = opennpu.npu_dynamic_quant(x, dst_type=dst_type, quant_mode=mode)
    ry, rscale = R.dynamic_quant(x, dst_type=dst_type, quant_mode=mode)
    assert y.dtype == ry.dtype and y.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert torch.equal(y.view(torch.uint8), ry.view(torch.uint8))
    assert torch.equal(scale, rscale)
    assert y.float().abs().max() <= (448 if y.dtype == torch.float8_e4m3fn else 57344)
    # smooth scales and groups work as for int8
    sm = (torch.rand(4, 80) + 0.5).to(dtype)
    gi = torch.tensor([2, 9, 9, 15], dtype=torch.int32)
    y, scale = opennpu.npu_dynamic_quant(x, smooth_scales=sm, group_index=gi, dst_type=dst_type)
    ry, rscale = R.dynamic_quant(x, smooth_scales=sm, group_index=gi, dst_type=dst_type)
    assert torch.equal(y.view(torch.uint8), ry.view(torch.uint8)) and torch.equal(scale, rscale)


def test_dynamic_quant_fp8_dst_type_max_and_errors():
    x = randn(4, 64)
    y, scale = opennpu.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn, dst_type_max=240.0)
    assert y.float().abs().amax(dim=-1).tolist() == [240.0] * 4
    _raises(lambda: opennpu.npu_dynamic_quant(x, dst_type=torch.float8_e4m3fn,
                                              dst_type_max=500.0),
            "npu_dynamic_quant: argument 'dst_type_max' must be 0", "448")
    y, _ = opennpu.npu_dynamic_quant(x, dst_type=290)  # hifloat8: test_hifloat8_out.py
    assert y.dtype == torch.uint8
    torch.library.opcheck(torch.ops.npu.npu_dynamic_quant.default, (x,),
                          {"dst_type": torch.float8_e5m2})


def test_dynamic_quant_all_zero_row_gets_scale_one():
    x = torch.zeros(3, 16)
    x[1] = torch.linspace(-1, 1, 16)
    y, scale = opennpu.npu_dynamic_quant(x)
    assert scale[0].item() == 1.0 and scale[2].item() == 1.0
    assert scale[1].item() == pytest.approx(1 / 127)
    assert not y[0].any() and not y[2].any()
    assert y[1].abs().max().item() == 127


def test_dynamic_quant_codes_stay_in_range_and_reach_the_max():
    x = randn(64, 96) * 100
    for dst_type, top in ((None, 127), (INT4, 7)):
        y, _ = opennpu.npu_dynamic_quant(x, dst_type=dst_type)
        codes = codes_of(y, dst_type)
        assert codes.abs().max(dim=-1).values.eq(top).all()  # each row's max maps to DTYPE_MAX
        assert codes.min().item() >= -top


def test_dynamic_quant_dst_type_max_replaces_dtype_max():
    x = randn(4, 32)
    y, scale = check_dynamic_quant(x, dst_type_max=100.0)
    assert y.abs().max().item() == 100
    torch.testing.assert_close(scale, x.abs().amax(-1) / 100)
    check_dynamic_quant(x, dst_type=INT4, dst_type_max=5.0)


def test_dynamic_quant_accepts_torch_int4_and_dtype_codes():
    x = randn(3, 16)
    words = opennpu.npu_dynamic_quant(x, dst_type=INT4)[0]
    assert torch.equal(opennpu.npu_dynamic_quant(x, dst_type=torch.int4)[0], words)
    assert torch.equal(opennpu.npu_dynamic_quant(x, dst_type=16)[0], words)
    assert torch.equal(opennpu.npu_dynamic_quant(x, dst_type=1)[0],
                       opennpu.npu_dynamic_quant(x)[0])


@pytest.mark.parametrize("dtype", (F32, F16, BF16), ids=dtype_id)
@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smooth"])
def test_dynamic_quant_int4_words_pack_the_int8_codes(dtype, smooth):
    """int4 output = the int8 path's codes at dst_type_max=7 (the same scale, every code within
    [-7, 7]), packed: every nibble position, widths whose last 32-element step is 8, 16, 24 or 32
    wide, and rows with NaN / inf."""
    for cols in (8, 16, 24, 32, 40, 56, 96, 104):
        x = randn(6, cols, dtype=dtype) * 5
        x[1, cols // 2] = float("nan")
        x[2, -1] = float("inf")
        kwargs = {"smooth_scales": (torch.rand(cols) + 0.5).to(dtype)} if smooth else {}
        y4, s4 = opennpu.npu_dynamic_quant(x, dst_type=INT4, **kwargs)
        y8, s8 = opennpu.npu_dynamic_quant(x, dst_type_max=7.0, **kwargs)
        assert torch.equal(s4, s8) or torch.equal(s4.nan_to_num(), s8.nan_to_num())
        assert torch.equal(R.unpack_int4(y4), y8)


# ----------------------------------------------------------------------------- int4 packing


def test_int4_pack_unpack_round_trip():
    every = torch.arange(-8, 8, dtype=torch.int8)
    codes = torch.stack([every, every.flip(0), every.roll(3)]).reshape(3, 2, 8)
    words = R.pack_int4(codes)
    assert words.shape == (3, 2, 1) and words.dtype == torch.int32
    assert torch.equal(R.unpack_int4(words), codes)
    # and words -> codes -> words, over random bit patterns
    words = torch.randint(-2**31, 2**31, (5, 7), dtype=torch.int64).to(torch.int32)
    assert torch.equal(R.pack_int4(R.unpack_int4(words)), words)


def test_int4_layout_is_lowest_bits_first():
    # codes 1..7, -7 -> nibbles 1..7, 9 from the lowest: 0x97654321 (negative as int32)
    x = torch.tensor([[1, 2, 3, 4, 5, 6, 7, -7]], dtype=F32) * 3
    y, scale = opennpu.npu_dynamic_quant(x, dst_type=INT4)
    assert scale.item() == 3.0
    assert y.tolist() == [[0x97654321 - 2**32]]
    # torch_npu's test view: bytes of the word, low nibble first within each byte
    as_bytes = y.view(torch.uint8).view(-1, 1)
    low = ((as_bytes & 0x0F) << 4).view(torch.int8) >> 4
    high = (as_bytes & 0xF0).view(torch.int8) >> 4
    assert torch.cat([low, high], dim=-1).flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, -7]


def test_int4_output_is_the_packing_of_the_reference_codes():
    x = randn(4, 3, 40, dtype=BF16)
    y, _ = opennpu.npu_dynamic_quant(x, dst_type=INT4)
    codes_ref, _ = R.dynamic_quant(x, dst_type=INT4)
    assert torch.equal(y, R.pack_int4(codes_ref))


# ----------------------------------------------------------------------------- groups, modes


def _groups(rows, ends):
    return torch.tensor(ends, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("dst_type", [None, INT4], ids=["int8", "int4"])
def test_dynamic_quant_group_index(dtype, dst_type):
    x = randn(3, 7, 48, dtype=dtype)  # 21 rows
    group_index = _groups(21, [0, 4, 4, 13, 20, 21])  # empty groups at 0 and 2
    smooth = (torch.rand(6, 48) + 0.25).to(dtype)
    y, _ = check_dynamic_quant(x, smooth_scales=smooth, group_index=group_index,
                               dst_type=dst_type)
    # rows 4..12 are group 3: the same as quantising them with smooth_scales[3] alone
    rows = x.reshape(21, 48)[4:13]
    y3, _ = opennpu.npu_dynamic_quant(rows, smooth_scales=smooth[3], dst_type=dst_type)
    assert torch.equal(y.reshape(21, -1)[4:13], y3)


def test_dynamic_quant_group_index_int64_and_one_group():
    x = randn(6, 16)
    smooth = torch.rand(1, 16) + 0.5
    y, scale = opennpu.npu_dynamic_quant(x, smooth_scales=smooth,
                                         group_index=torch.tensor([6]))
    y1, scale1 = opennpu.npu_dynamic_quant(x, smooth_scales=smooth[0])
    assert torch.equal(y, y1) and torch.equal(scale, scale1)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("dst_type", [None, INT4], ids=["int8", "int4"])
def test_dynamic_quant_pertensor(dtype, dst_type):
    x = randn(5, 3, 32, dtype=dtype)
    x[2, 1, 7] = 9.0  # the tensor's max sits in one row
    smooth = (torch.rand(32) + 0.5).to(dtype)
    y, scale = check_dynamic_quant(x, smooth_scales=smooth, quant_mode="pertensor",
                                   dst_type=dst_type)
    assert scale.shape == (1,)


def test_dynamic_quant_pertensor_many_rows_is_one_scale():
    x = randn(4099, 64)  # several parallel chunks
    x[4000, 3] = 50.0
    _, scale = check_dynamic_quant(x, quant_mode="pertensor")
    assert scale.item() == pytest.approx(50.0 / 127)


# ----------------------------------------------------------------------------- sizes & layouts


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (3, 83), (2, 769), (2, 5125), (64, 4096),
                                   (2, 3, 5, 24), (7,)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_dynamic_quant_sizes(shape, dtype):
    check_dynamic_quant(randn(*shape, dtype=dtype),
                        smooth_scales=torch.rand(shape[-1]).to(dtype) + 0.5)


@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 16), (3, 0), (0,)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["pertoken", "pertensor"])
def test_dynamic_quant_empty(shape, mode):
    y, scale = opennpu.npu_dynamic_quant(torch.zeros(shape), quant_mode=mode)
    assert y.shape == shape and y.dtype == torch.int8
    expected = (1,) if mode == "pertensor" else shape[:-1]
    assert scale.shape == expected and (scale == 1).all()


def test_dynamic_quant_non_contiguous():
    x = randn(64, 6, 2).permute(1, 2, 0)  # (6, 2, 64), transposed in memory
    smooth = (torch.rand(128) + 0.5)[::2]
    assert not x.is_contiguous() and not smooth.is_contiguous()
    check_dynamic_quant(x, smooth_scales=smooth)
    check_dynamic_quant(randn(5, 96)[:, ::3], dst_type=INT4)  # last dim 32, stride 3


# ----------------------------------------------------------------------------- fused add + norm + quant


def make_fused(shape, dtype=BF16, smooth1=False, smooth2=False, beta=False):
    n = shape[-1]
    args = [randn(*shape, dtype=dtype), randn(*shape, dtype=dtype),
            (1 + 0.1 * torch.randn(n)).to(dtype)]
    kwargs = {}
    if smooth1:
        kwargs["smooth_scale1"] = (torch.rand(n) + 0.5).to(dtype)
    if smooth2:
        kwargs["smooth_scale2"] = (torch.rand(n) + 0.5).to(dtype)
    if beta:
        kwargs["beta"] = (0.1 * torch.randn(n)).to(dtype)
    return args, kwargs


def check_fused(args, kwargs):
    outs = opennpu.npu_add_rms_norm_dynamic_quant(*args, **kwargs)
    refs = R.add_rms_norm_dynamic_quant(*args, **kwargs)
    x1 = args[0]
    y_dtype = kwargs.get("y_dtype")
    y1, y2, x_out, s1, s2 = outs
    assert x_out.dtype == x1.dtype and x_out.shape == x1.shape
    assert torch.equal(x_out, refs[2].to(x1.dtype))  # the fp32 sum, rounded once
    for y, s, y_ref, s_ref in ((y1, s1, refs[0], refs[3]), (y2, s2, refs[1], refs[4])):
        if y_ref is None:  # disabled branch: 0-dim tensors with one element
            assert y.dim() == 0 and y.numel() == 1 and s.dim() == 0 and s.numel() == 1
            assert s.dtype == F32
            continue
        codes = codes_of(y, y_dtype)
        assert codes.shape == x1.shape and s.shape == x1.shape[:-1] and s.dtype == F32
        diff = (codes.int() - y_ref.int()).abs()
        if diff.numel():  # off by one only next to a tie, and rarely
            assert diff.max().item() <= 1
            assert diff.count_nonzero().item() <= max(1, diff.numel() // 100)
        torch.testing.assert_close(s, s_ref, rtol=2e-6, atol=0)
    return outs


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("y_dtype", [None, INT4], ids=["int8", "int4"])
def test_fused_matches_reference(dtype, y_dtype):
    args, kwargs = make_fused((3, 5, 64), dtype, smooth1=True, smooth2=True, beta=True)
    check_fused(args, {**kwargs, "y_dtype": y_dtype})


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mask", [[True, False], [True, True]], ids=["one", "both"])
def test_fused_large_outputs_stream(dtype, mask):
    """Outputs of 16 MB and more go out with non-temporal stores (x_out, and the int8 codes):
    the same values as the ordinary stores, rows spread over the threads, with a row length
    of whole cache lines (4096) and a tail row count off any block size."""
    rows = (16 << 20) // (4096 * dtype.itemsize) + 3
    args, kwargs = make_fused((rows, 4096), dtype, smooth1=True, smooth2=mask[1], beta=True)
    check_fused(args, {**kwargs, "output_mask": mask})


MASK_CASES = [
    # (output_mask, smooth1, smooth2): every mask, and the defaults without one
    ([True, False], False, False), ([False, True], False, False), ([True, True], False, False),
    ([True, False], True, False), ([False, True], False, True), ([True, True], True, True),
    ([True, True], True, False), ([True, True], False, True),
    (None, False, False), (None, True, False), (None, False, True), (None, True, True),
]


@pytest.mark.parametrize("mask,smooth1,smooth2", MASK_CASES,
                         ids=lambda v: str(v).replace(" ", ""))
@pytest.mark.parametrize("y_dtype", [None, INT4], ids=["int8", "int4"])
def test_fused_output_mask(mask, smooth1, smooth2, y_dtype):
    args, kwargs = make_fused((4, 3, 32), F16, smooth1, smooth2, beta=True)
    outs = check_fused(args, {**kwargs, "output_mask": mask, "y_dtype": y_dtype})
    branches = mask or (True, smooth1 and smooth2)
    code_dtype = torch.int32 if y_dtype is not None else torch.int8
    for on, y, s in zip(branches, outs[0:2], outs[3:5]):
        assert y.dtype == code_dtype
        assert (y.dim() > 0) == on and (s.dim() > 0) == on
        if not on:
            assert y.item() == 0 and s.item() == 0.0


def test_fused_branch_without_smooth_is_the_plain_quantisation():
    args, _ = make_fused((6, 40), BF16)
    y1, y2, _, s1, s2 = opennpu.npu_add_rms_norm_dynamic_quant(*args, output_mask=[True, True])
    assert torch.equal(y1, y2) and torch.equal(s1, s2)


def test_fused_beta_and_gamma_enter_before_the_smooth_scale():
    x1, x2 = randn(2, 16), randn(2, 16)
    gamma, beta, smooth = torch.full((16,), 2.0), torch.full((16,), 0.5), torch.full((16,), 3.0)
    _, _, _, s1, _ = opennpu.npu_add_rms_norm_dynamic_quant(
        x1, x2, gamma, smooth_scale1=smooth, beta=beta)
    x = x1 + x2
    y = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * 2 + 0.5) * 3
    torch.testing.assert_close(s1, y.abs().amax(-1) / 127)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (3, 83), (2, 769), (2, 5125), (64, 4096),
                                   (2, 3, 4, 5, 24), (9,)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fused_sizes(shape):
    args, kwargs = make_fused(shape, BF16, smooth1=True, smooth2=True)
    check_fused(args, kwargs)


def test_fused_empty():
    args, _ = make_fused((0, 16), F32)
    y1, y2, x, s1, s2 = opennpu.npu_add_rms_norm_dynamic_quant(*args, output_mask=[True, True])
    assert y1.shape == y2.shape == x.shape == (0, 16) and s1.shape == s2.shape == (0,)
    args, _ = make_fused((3, 0), F32)
    y1, _, x, s1, _ = opennpu.npu_add_rms_norm_dynamic_quant(*args)
    assert y1.shape == (3, 0) and (s1 == 1).all()


def test_fused_non_contiguous():
    x1, x2 = randn(32, 6).t(), randn(6, 64)[:, ::2]
    gamma, smooth = (torch.rand(64) + 0.5)[::2], (torch.rand(96) + 0.5)[::3]
    assert not any(t.is_contiguous() for t in (x1, x2, gamma, smooth))
    check_fused([x1, x2, gamma], {"smooth_scale1": smooth, "y_dtype": INT4})


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_fused_equals_the_unfused_pair_torchair_replaces(dtype):
    # Seed 003: npu_add_rms_norm followed by npu_dynamic_quant(smooth_scales=s) becomes
    # npu_add_rms_norm_dynamic_quant(..., smooth_scale1=s, output_mask=[True, False]). The pair
    # rounds the sum and y to the low dtype in between (bf16: 2^-9 each, up to ~0.5 code steps at
    # 127 plus the scale's own rounding), so codes may move by a step (two for bf16).
    args, kwargs = make_fused((8, 4, 128), dtype, smooth1=True)
    y, _, x = opennpu.npu_add_rms_norm(*args)
    codes, scale = opennpu.npu_dynamic_quant(y, smooth_scales=kwargs["smooth_scale1"])
    y1, _, x_out, s1, _ = opennpu.npu_add_rms_norm_dynamic_quant(
        *args, **kwargs, output_mask=[True, False])
    assert (y1.int() - codes.int()).abs().max().item() <= (2 if dtype == BF16 else 1)
    torch.testing.assert_close(s1, scale, rtol=1e-2, atol=0)
    assert torch.equal(x_out, x)


# ----------------------------------------------------------------------------- npu_add_rms_norm_cast


@pytest.mark.parametrize("dtype", QUANT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,gamma_shape", [((3, 5, 64), (64,)), ((2, 3, 40), (3, 40)),
                                                ((5, 83), (83,)), ((0, 8), (8,)), ((2, 5125), (5125,))],
                         ids=["3d", "gamma2d", "odd", "empty", "wide"])
def test_add_rms_norm_cast_matches_add_rms_norm(dtype, shape, gamma_shape):
    x1, x2, gamma = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(*gamma_shape,
                                                                                  dtype=dtype)
    y1, y2, rstd, x = opennpu.npu_add_rms_norm_cast(x1, x2, gamma)
    acc = torch.float64 if dtype == torch.float64 else F32
    assert y1.dtype == acc and y2.dtype == dtype and rstd.dtype == acc and x.dtype == dtype
    y, rstd_ref, x_ref = opennpu.npu_add_rms_norm(x1, x2, gamma)
    # y2 is npu_add_rms_norm's y, and y1 the same values before their one rounding
    assert torch.equal(y2, y) and torch.equal(rstd, rstd_ref) and torch.equal(x, x_ref)
    assert torch.equal(y1.to(dtype), y2)
    refs = R.add_rms_norm_cast(x1, x2, gamma)
    assert_close(y1, refs[0], dtype=acc)
    assert_close(y2, refs[1])
    assert_close(rstd, refs[2], dtype=acc)


def test_add_rms_norm_cast_broadcast_and_non_contiguous():
    x1, x2, gamma = randn(24, 6).t(), randn(24), randn(24)
    y1, y2, rstd, x = opennpu.npu_add_rms_norm_cast(x1, x2, gamma, 1e-5)
    refs = R.add_rms_norm_cast(x1, x2, gamma, 1e-5)
    assert_close(y1, refs[0])
    assert_close(x, refs[3])
    assert rstd.shape == (6, 1)


def test_add_rms_norm_cast_replaces_the_cast_of_add_rms_norm():
    # torchair's pattern: npu_add_rms_norm(...)[0].to(float32). The fused y1 is unrounded, so it
    # is at least as close to the fp32 oracle as the cast of the rounded y.
    x1, x2, gamma = randn(16, 256, dtype=BF16), randn(16, 256, dtype=BF16), randn(256, dtype=BF16)
    y1 = opennpu.npu_add_rms_norm_cast(x1, x2, gamma)[0]
    pair = opennpu.npu_add_rms_norm(x1, x2, gamma)[0].to(F32)
    ref = R.add_rms_norm(x1, x2, gamma)[0]
    assert (y1 - ref).abs().max() <= (pair - ref).abs().max()
    assert_close(y1, ref, dtype=F32)


# ----------------------------------------------------------------------------- contract


def test_no_gradient_is_a_clear_error():
    x = randn(4, 16, requires_grad=True)
    y, scale = opennpu.npu_dynamic_quant(x)  # runs under autograd
    assert y.dtype == torch.int8 and not y.requires_grad
    x1, x2, gamma = randn(4, 16, requires_grad=True), randn(4, 16), randn(16)
    _, _, x_out, _, _ = opennpu.npu_add_rms_norm_dynamic_quant(x1, x2, gamma)
    _raises(lambda: x_out.sum().backward(), "npu_add_rms_norm_dynamic_quant: not differentiable")
    y1, *_ = opennpu.npu_add_rms_norm_cast(x1, x2, gamma)
    _raises(lambda: y1.sum().backward(), "npu_add_rms_norm_cast: not differentiable")
    with torch.no_grad():
        assert not opennpu.npu_add_rms_norm_cast(x1, x2, gamma)[0].requires_grad


def test_torch_npu_names():
    import torch_npu

    x = randn(3, 16, dtype=F16)
    y, scale = torch_npu.npu_dynamic_quant(x, dst_type=torch.quint4x2)
    assert y.shape == (3, 2) and y.dtype == torch.int32
    outs = torch_npu.npu_add_rms_norm_dynamic_quant(x, x, torch.ones(16, dtype=F16),
                                                    output_mask=[True, False])
    assert len(outs) == 5 and outs[1].dim() == 0
    assert len(torch_npu.npu_add_rms_norm_cast(x, x, torch.ones(16, dtype=F16))) == 4


def test_opcheck_dynamic_quant():
    x = randn(4, 3, 32, dtype=BF16)
    samples = [
        ((x,), {}),
        ((x,), {"smooth_scales": torch.rand(32, dtype=BF16), "dst_type": INT4}),
        ((x,), {"quant_mode": "pertensor", "dst_type_max": 100.0}),
        ((randn(6, 16),), {"smooth_scales": torch.rand(2, 16),
                           "group_index": torch.tensor([2, 6], dtype=torch.int32)}),
        ((randn(16, 5).t(),), {}),  # non-contiguous
        ((randn(0, 8),), {}),
    ]
    opcheck(torch.ops.npu.npu_dynamic_quant.default, samples)


def test_opcheck_add_rms_norm_dynamic_quant_and_cast():
    args, kwargs = make_fused((2, 3, 32), F16, smooth1=True, smooth2=True, beta=True)
    samples = [
        (tuple(args), {}),
        (tuple(args), {**kwargs, "output_mask": [True, True], "y_dtype": INT4}),
        (tuple(args), {"output_mask": [False, True], "epsilon": 1e-5}),
        (tuple(make_fused((0, 16), F32)[0]), {}),
    ]
    opcheck(torch.ops.npu.npu_add_rms_norm_dynamic_quant.default, samples)
    x1, x2 = randn(3, 16, dtype=BF16), randn(3, 16, dtype=BF16)
    opcheck(torch.ops.npu.npu_add_rms_norm_cast.default,
            [((x1, x2, randn(16, dtype=BF16)), {}), ((x1, x2, randn(3, 16, dtype=BF16)), {}),
             ((randn(8, 3).t(), randn(3, 8).contiguous(), randn(8)), {"epsilon": 1e-5})])


def test_compile_fullgraph_dynamic_matches_eager():
    def block(x1, x2, gamma, smooth):
        y1, _, x, s1, _ = opennpu.npu_add_rms_norm_dynamic_quant(x1, x2, gamma,
                                                                  smooth_scale1=smooth)
        q, s = opennpu.npu_dynamic_quant(x * 2, smooth_scales=smooth, dst_type=INT4)
        c1, c2, _, _ = opennpu.npu_add_rms_norm_cast(x1, x2, gamma)
        return y1, s1, q, s, c1, c2

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for shape in [(2, 4, 16), (3, 7, 24)]:
        args = [randn(*shape, dtype=BF16), randn(*shape, dtype=BF16),
                randn(shape[-1], dtype=BF16), torch.rand(shape[-1], dtype=BF16) + 0.5]
        for e, c in zip(block(*args), compiled(*args)):
            assert torch.equal(e, c)
    assert counter.frame_count == 1
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- hypothesis


@settings(**SETTINGS)
@given(
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=2),
    words=st.integers(1, 40),
    int4=st.booleans(),
    smooth=st.sampled_from(["none", "vector", "groups"]),
    mode=st.sampled_from(["pertoken", "pertensor"]),
    dtype=st.sampled_from([F32, F16, BF16]),
)
def test_hypothesis_dynamic_quant(lead, words, int4, smooth, mode, dtype):
    shape = (*lead, 3, 8 * words - (0 if int4 else words % 5))
    x = randn(*shape, dtype=dtype) * 4
    kwargs = {"dst_type": INT4 if int4 else None, "quant_mode": mode}
    n, rows = shape[-1], x.numel() // shape[-1]
    if smooth == "vector":
        kwargs["smooth_scales"] = (torch.rand(n) + 0.5).to(dtype)
    elif smooth == "groups" and mode == "pertoken":
        ends = sorted(torch.randint(0, rows + 1, (3,)).tolist()) + [rows]
        kwargs["group_index"] = torch.tensor(ends, dtype=torch.int32)
        kwargs["smooth_scales"] = (torch.rand(4, n) + 0.5).to(dtype)
    check_dynamic_quant(x, **kwargs)


@settings(**SETTINGS)
@given(
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=2),
    words=st.integers(1, 40),
    int4=st.booleans(),
    mask=st.sampled_from([None, [True, False], [False, True], [True, True]]),
    smooth=st.tuples(st.booleans(), st.booleans()),
    beta=st.booleans(),
    dtype=st.sampled_from([F32, F16, BF16]),
)
def test_hypothesis_fused(lead, words, int4, mask, smooth, beta, dtype):
    if mask is not None:  # a given smooth scale needs its branch on
        smooth = (smooth[0] and mask[0], smooth[1] and mask[1])
    shape = (*lead, 3, 8 * words - (0 if int4 else words % 5))
    args, kwargs = make_fused(shape, dtype, *smooth, beta=beta)
    check_fused(args, {**kwargs, "output_mask": mask, "y_dtype": INT4 if int4 else None})


# ----------------------------------------------------------------------------- bad input


def test_dynamic_quant_rejects_bad_arguments():
    x = randn(4, 16)
    q = opennpu.npu_dynamic_quant
    _raises(lambda: q(torch.ones(4, 16, dtype=torch.int32)),
            "npu_dynamic_quant: argument 'input'", "but got Int")
    _raises(lambda: q(torch.tensor(1.0)), "npu_dynamic_quant: argument 'input'", "0-dim")
    _raises(lambda: q(x, dst_type=torch.float8_e8m0fnu), "argument 'dst_type'",
            "torch_npu.hifloat8 (290)", "Float8_e8m0fnu")
    _raises(lambda: q(x, dst_type=289), "argument 'dst_type'", "dtype code 289")
    _raises(lambda: q(randn(4, 12), dst_type=INT4), "argument 'input'", "divisible by 8",
            "[4, 12]")
    _raises(lambda: q(x, quant_mode="perchannel"), "argument 'quant_mode'",
            "\"perchannel\" is not supported", "but got \"perchannel\"")
    _raises(lambda: q(x, quant_mode="per_token"), "argument 'quant_mode'", "\"per_token\"")
    _raises(lambda: q(x, dst_type_max=200.0), "argument 'dst_type_max'", "(0, 127]", "200")
    _raises(lambda: q(x, dst_type=INT4, dst_type_max=8.0), "argument 'dst_type_max'", "(0, 7]")
    _raises(lambda: q(x, smooth_scales=torch.ones(15)), "argument 'smooth_scales'",
            "shape [16]", "[15]")


def test_dynamic_quant_rejects_bad_groups():
    x, sm = randn(6, 16), torch.ones(3, 16)
    q = opennpu.npu_dynamic_quant
    gi = torch.tensor([2, 4, 6], dtype=torch.int32)
    _raises(lambda: q(x, group_index=gi), "argument 'group_index'", "needs smooth_scales")
    _raises(lambda: q(x, smooth_scales=torch.ones(16), group_index=gi),
            "argument 'smooth_scales'", "[3, 16]", "but got [16]")
    _raises(lambda: q(x, smooth_scales=sm, group_index=gi, quant_mode="pertensor"),
            "argument 'group_index'", "pertoken")
    _raises(lambda: q(x, smooth_scales=sm, group_index=gi.float()),
            "argument 'group_index'", "int32", "Float")
    _raises(lambda: q(x, smooth_scales=sm, group_index=torch.tensor([4, 2, 6])),
            "argument 'group_index'", "non-decreasing", "element 1 is 2 after 4")
    _raises(lambda: q(x, smooth_scales=sm, group_index=torch.tensor([2, 4, 7])),
            "argument 'group_index'", "[0, 6]", "element 2 is 7")
    _raises(lambda: q(x, smooth_scales=sm, group_index=torch.tensor([2, 4, 5])),
            "argument 'group_index'", "end at the number of rows", "(6)", "is 5")


def test_fused_rejects_bad_arguments():
    args, _ = make_fused((4, 16), F16)
    f = opennpu.npu_add_rms_norm_dynamic_quant
    op = "npu_add_rms_norm_dynamic_quant"
    _raises(lambda: f(*args, output_mask=[False, False]), f"{op}: argument 'output_mask'",
            "at least one branch")
    _raises(lambda: f(*args, smooth_scale1=torch.ones(16, dtype=F16), output_mask=[False, True]),
            "argument 'output_mask'", "index 0 when smooth_scale1")
    _raises(lambda: f(*args, smooth_scale2=torch.ones(16, dtype=F16), output_mask=[True, False]),
            "argument 'output_mask'", "index 1 when smooth_scale2")
    _raises(lambda: f(args[0], args[1][:2], args[2]), "argument 'x2'", "shape of 'x1'")
    _raises(lambda: f(args[0], args[1].float(), args[2]), "argument 'x2'", "dtype of 'x1'")
    _raises(lambda: f(args[0], args[1], torch.ones(15)), "argument 'gamma'", "[16]", "[15]")
    _raises(lambda: f(*args, beta=torch.ones(2, 16)), "argument 'beta'", "[16]", "[2, 16]")
    _raises(lambda: f(*args, smooth_scale1=torch.ones(8)), "argument 'smooth_scale1'", "[8]")
    _raises(lambda: f(*args, epsilon=-1.0), "argument 'epsilon'", ">= 0")
    _raises(lambda: f(*args, y_dtype=torch.float16), "argument 'y_dtype'", "Half")
    _raises(lambda: f(randn(3, 12, dtype=F16), randn(3, 12, dtype=F16), torch.ones(12),
                      y_dtype=INT4), "argument 'x1'", "divisible by 8")
    _raises(lambda: f(torch.ones(3, 8, dtype=torch.int64), *args[1:]), "argument 'x1'", "Long")


def test_add_rms_norm_cast_rejects_bad_arguments():
    f = opennpu.npu_add_rms_norm_cast
    _raises(lambda: f(randn(3, 8), randn(2, 8), randn(8)), "npu_add_rms_norm_cast: argument 'x2'",
            "broadcast")
    _raises(lambda: f(randn(3, 8), randn(3, 8), randn(7)),
            "npu_add_rms_norm_cast: argument 'gamma'", "trailing dims")
    _raises(lambda: f(randn(3, 8), randn(3, 8), randn(8), -1.0), "argument 'epsilon'")


@pytest.mark.parametrize("case", ["quant fp32", "quant 1-D", "quant fp32 smooth", "quant int64 groups",
                                  "fused fp32", "fused 1-D", "fused empty", "fused fp32 gamma",
                                  "cast fp32"])
def test_strict_mode_rejects_ascend_unsupported(case):
    h = randn(4, 16, dtype=F16)
    calls = {
        "quant fp32": (lambda: opennpu.npu_dynamic_quant(randn(4, 16)),
                       "npu_dynamic_quant: argument 'input'"),
        "quant 1-D": (lambda: opennpu.npu_dynamic_quant(randn(16, dtype=F16)),
                      "npu_dynamic_quant: argument 'input'"),
        "quant fp32 smooth": (lambda: opennpu.npu_dynamic_quant(h, smooth_scales=torch.ones(16)),
                              "argument 'smooth_scales'"),
        "quant int64 groups": (lambda: opennpu.npu_dynamic_quant(
            h, smooth_scales=torch.ones(1, 16, dtype=F16), group_index=torch.tensor([4])),
            "argument 'group_index'"),
        "fused fp32": (lambda: opennpu.npu_add_rms_norm_dynamic_quant(
            randn(4, 16), randn(4, 16), randn(16)), "argument 'x1'"),
        "fused 1-D": (lambda: opennpu.npu_add_rms_norm_dynamic_quant(
            h[0], h[1], torch.ones(16, dtype=F16)), "argument 'x1'"),
        "fused empty": (lambda: opennpu.npu_add_rms_norm_dynamic_quant(
            h[:0], h[:0], torch.ones(16, dtype=F16)), "argument 'x1'"),
        "fused fp32 gamma": (lambda: opennpu.npu_add_rms_norm_dynamic_quant(h, h, torch.ones(16)),
                             "argument 'gamma'"),
        "cast fp32": (lambda: opennpu.npu_add_rms_norm_cast(randn(4, 16), randn(4, 16), randn(16)),
                      "npu_add_rms_norm_cast: argument 'x1'"),
    }
    call, prefix = calls[case]
    call()  # accepted by default
    with opennpu.strict(True):
        _raises(call, prefix, "strict mode")
    call()
