"""hifloat8 (torch_npu.hifloat8 = 290) as an output format: npu_quantize, npu_dynamic_quant,
npu_dynamic_block_quant (round_mode="round") and npu_fused_infer_attention_score_v2's output
quantisation. Outputs are uint8 codes, as torch_npu returns them.

The oracle is en_dtypes.hifloat8 (the package op-plugin's goldens use): each op's float32
arithmetic is redone step by step in PyTorch and the result cast by
``np.float32(...).astype(en_dtypes.hifloat8)``; codes must match bit for bit. The encoder
itself (csrc/ops/quant/hifloat8.h, and the portable path's torch version) was checked against
en_dtypes on all 2^32 float32 patterns once (scripts/hifloat8_exhaustive.py); here it is checked
on a random sample of bit patterns, every special value, and both sides of every boundary between
adjacent codes, the midpoints themselves included (ties go away from zero)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch._dynamo.testing
from op_helpers import dtype_id, opcheck

import opennpu
from opennpu.ops import portable

en_dtypes = pytest.importorskip("en_dtypes")

npu = torch.ops.npu
HIF8 = 290
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _raises(fn, *pieces):
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


def oracle(t: torch.Tensor) -> torch.Tensor:
    """en_dtypes' hifloat8 codes of a float32 tensor, as uint8."""
    assert t.dtype == torch.float32
    a = t.detach().cpu().contiguous().numpy()
    with np.errstate(invalid="ignore"):  # NaN casts
        return torch.from_numpy(a.astype(en_dtypes.hifloat8).view(np.uint8).copy())


def decoded():
    """The 256 codes' values (float64), from en_dtypes."""
    return np.arange(256, dtype=np.uint8).view(en_dtypes.hifloat8).astype(np.float64)


def adjacent_or_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Codes equal, or of adjacent values (in the order of the 256 codes' values)."""
    v = decoded()
    order = np.unique(v[~np.isnan(v)])
    rank = {x: i for i, x in enumerate(order)}
    ra = np.array([rank.get(x, -10) for x in v[a.numpy().ravel()]])
    rb = np.array([rank.get(x, -10) for x in v[b.numpy().ravel()]])
    return bool(np.all(np.abs(ra - rb) <= 1))


def boundary_sample() -> torch.Tensor:
    """Every finite code's value, the midpoint between each pair of adjacent magnitudes (a tie),
    and the float32 neighbours of each midpoint, with both signs."""
    v = decoded()
    mags = np.unique(np.abs(v[np.isfinite(v)]))  # 0, 2^-22 .. 2^15
    mags = np.append(mags, 1.5 * 2.0**15)  # the inf slot: its midpoint with 2^15 is 40960
    mids = ((mags[:-1] + mags[1:]) / 2).astype(np.float32)
    assert np.all(mids.astype(np.float64) == (mags[:-1] + mags[1:]) / 2)  # exact in float32
    below = np.nextafter(mids, np.float32(0))
    above = np.nextafter(mids, np.float32(np.inf))
    pos = np.concatenate([mags[:-1].astype(np.float32), mids, below, above])
    return torch.from_numpy(np.concatenate([pos, -pos]))


def special_sample() -> torch.Tensor:
    f = np.float32
    vals = [0.0, -0.0, np.inf, -np.inf, np.nan, 40960.0, 40959.996, 65536.0, 1e30, -1e30,
            2.0**-23, 2.0**-24, np.nextafter(f(2.0**-23), f(0)), 1e-45, -1e-45, 1.17e-38,
            2.0**-15, 2.0**16, 3.4e38]
    bits = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x00000001,
                     0x807FFFFF, 0x7F7FFFFF], dtype=np.uint32)
    return torch.from_numpy(np.concatenate([np.array(vals, dtype=f), bits.view(f)]))


def random_sample(n=1 << 18, seed=0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    bits = g.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    # and many values in the range quantisers produce
    dense = (g.standard_normal(n) * g.choice([1e-5, 1e-2, 1.0, 1e2, 1e4], n)).astype(np.float32)
    return torch.from_numpy(np.concatenate([bits, dense]))


def encode(x: torch.Tensor) -> torch.Tensor:
    """The C++ encoder through npu_quantize: fp32(x * 1) + 0 is x (and -0 becomes +0, whose
    code is 0 as well), so the codes are hifloat8(x)."""
    return opennpu.npu_quantize(x, torch.ones(1), None, HIF8, -1, False)


# ----------------------------------------------------------------------------- the encoder


@pytest.mark.parametrize("sample", ["boundaries", "specials", "random"])
def test_encoder_matches_en_dtypes(sample):
    make = {"boundaries": boundary_sample, "specials": special_sample, "random": random_sample}
    x = make[sample]()
    want = oracle(x)
    got = encode(x)
    assert got.dtype == torch.uint8 and got.shape == x.shape
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(hex(x[i].view(torch.int32).item() & 0xFFFFFFFF),
                               hex(got[i].item()), hex(want[i].item())) for i in bad[:8]]
    assert torch.equal(portable._hif8_encode(x), want)  # the portable path's encoder


def test_rounding_rules():
    """The documented rules, value by value: ties away from zero, no saturation, NaN 0x80."""
    x = torch.tensor([1.0625, 1.1875, -1.0625, 32768.0, 40959.996, 40960.0, float("inf"),
                      -40960.0, float("nan"), -0.0, 2.0**-23, 2.0**-24, 1.5 * 2.0**-17])
    assert encode(x).tolist() == [0x09, 0x0A, 0x89, 0x6E, 0x6E, 0x6F, 0x6F, 0xEF, 0x80, 0x00,
                                  0x01, 0x00, 0x07]


def test_boundaries_are_nearest_value_ties_away():
    """Independent of en_dtypes' code: each boundary sample goes to the nearest code value
    (the inf slot counting as 1.5 * 2^15), ties to the larger magnitude."""
    v = decoded()
    mags = np.append(np.unique(np.abs(v[np.isfinite(v)])), 1.5 * 2.0**15)
    x = boundary_sample()
    a = np.abs(x.numpy().astype(np.float64))
    i = np.clip(np.searchsorted(mags, a, side="right") - 1, 0, len(mags) - 2)
    nearest = np.where(a - mags[i] >= mags[i + 1] - a, mags[i + 1], mags[i])
    got = decoded()[encode(x).numpy()]
    got = np.where(np.isinf(got), 1.5 * 2.0**15, np.abs(got))
    assert np.array_equal(got, nearest)


# ----------------------------------------------------------------------------- npu_quantize


def quantize_golden(x, scales, zero, div, axis_shape):
    s = scales.float().reshape(axis_shape)
    t = x.float() / s if div else x.float() * s
    if zero is not None:
        t = t + zero.float().reshape(axis_shape)
    return oracle(t)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("div", [True, False], ids=["div", "mul"])
@pytest.mark.parametrize("shape,axis", [((3, 7, 83), 1), ((5, 129), -1), ((1,), 0),
                                        ((4, 6, 2), -2)])
def test_quantize(dtype, div, shape, axis):
    torch.manual_seed(1)
    if not div and axis not in (-1, -2):
        axis = -1
    x = (torch.randn(shape) * 300).to(dtype)
    ax = axis % len(shape) if div else (len(shape) - 2 if axis == -2 else len(shape) - 1)
    c = shape[ax]
    axis_shape = [1] * len(shape)
    axis_shape[ax] = c
    scales = torch.rand(c) * 4 + 0.01
    zero = torch.randn(c) * 2
    y = opennpu.npu_quantize(x, scales, zero, HIF8, axis, div)
    assert y.dtype == torch.uint8 and y.shape == x.shape
    assert torch.equal(y, quantize_golden(x, scales, zero, div, axis_shape))
    y1 = opennpu.npu_quantize(x, scales[:1], None, HIF8, axis, div)  # one scale, no zero point
    assert torch.equal(y1, quantize_golden(x, scales[:1], None, div, [1] * len(shape)))


def test_quantize_non_contiguous_empty_and_specials():
    x = torch.randn(40, 9).t()[:, ::3] * 1000  # [9, 14], strided
    s = torch.rand(9) + 0.5
    y = opennpu.npu_quantize(x, s, None, HIF8, 0, True)
    assert torch.equal(y, quantize_golden(x, s, None, True, [9, 1]))
    e = opennpu.npu_quantize(torch.randn(0, 5), torch.ones(5), None, HIF8, 1, True)
    assert e.shape == (0, 5) and e.dtype == torch.uint8
    x = torch.tensor([[float("nan"), 1e6, -1e6, 0.0]])
    y = opennpu.npu_quantize(x, torch.ones(1), torch.ones(1), HIF8, -1, False)
    assert y.tolist() == [[0x80, 0x6F, 0xEF, 0x08]]  # NaN, inf, -inf, 1.0
    with portable.force():  # the ATen composition agrees
        for div in (True, False):
            x = torch.randn(3, 7, 33, dtype=torch.bfloat16) * 50
            s, z = torch.rand(7) + 0.1, torch.randn(7)
            want = opennpu.npu_quantize(x, s, z, HIF8, 1 if div else -2, div)
            assert torch.equal(portable.npu_quantize(x, s, z, HIF8, 1 if div else -2, div), want)


def test_quantize_opcheck_and_compile():
    x = torch.randn(4, 6) * 10
    s = torch.rand(6) + 0.5
    opcheck(npu.npu_quantize.default, [((x, s, None, HIF8, 1, True), {}),
                                       ((x, s, s, HIF8, -1, False), {})])
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(x, s):
        return opennpu.npu_quantize(x, s, None, HIF8, -1, False)

    assert torch.equal(f(x, s), opennpu.npu_quantize(x, s, None, HIF8, -1, False))
    assert counter.frame_count == 1


# ----------------------------------------------------------------------------- npu_dynamic_quant


def dynamic_golden(x, smooth=None, per_tensor=False, qmax=32768.0):
    v = x.float()
    if smooth is not None:
        v = v * smooth.float()
    amax = v.abs().amax() if per_tensor else v.abs().amax(dim=-1)
    inverse = torch.tensor(1.0) / torch.tensor(qmax)  # in float32
    scale = amax * inverse  # CANN's golden: rowmax * (1 / DTYPE_MAX)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    y = oracle(v / (scale if per_tensor else scale.unsqueeze(-1)))
    return y, scale.reshape(1) if per_tensor else scale


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", [(7, 83), (2, 3, 64), (1, 1), (5, 769)])
@pytest.mark.parametrize("mode", ["pertoken", "pertensor"])
def test_dynamic_quant(dtype, shape, mode):
    torch.manual_seed(2)
    x = (torch.randn(shape) * 5).to(dtype)
    if x.numel() > 4:
        x.view(-1)[3] = 0
    smooth = (torch.rand(shape[-1]) + 0.5).to(dtype)
    for sm in (None, smooth):
        y, scale = opennpu.npu_dynamic_quant(x, smooth_scales=sm, dst_type=HIF8, quant_mode=mode)
        wy, ws = dynamic_golden(x, sm, mode == "pertensor")
        assert y.dtype == torch.uint8 and y.shape == x.shape
        assert torch.equal(scale, ws) and torch.equal(y, wy)
        # the largest |v| lands on 2^15 exactly
        assert (y == 0x6E).any() or (y == 0xEE).any()


def test_dynamic_quant_groups_max_zero_rows_and_non_contiguous():
    torch.manual_seed(3)
    x = torch.randn(6, 40, dtype=torch.float16)
    x[2] = 0  # an all-zero row: scale 1, codes 0
    sm = torch.rand(3, 40, dtype=torch.float16) + 0.5
    gi = torch.tensor([2, 2, 6], dtype=torch.int32)
    y, scale = opennpu.npu_dynamic_quant(x, smooth_scales=sm, group_index=gi, dst_type=HIF8)
    rows = torch.cat([x[:2].float() * sm[0].float(), x[2:].float() * sm[2].float()])
    wy, ws = dynamic_golden(rows)
    assert torch.equal(y, wy) and torch.equal(scale, ws) and scale[2] == 1 and (y[2] == 0).all()
    y, scale = opennpu.npu_dynamic_quant(x, dst_type=HIF8, dst_type_max=15.0)
    wy, ws = dynamic_golden(x, qmax=15.0)
    assert torch.equal(y, wy) and torch.equal(scale, ws)
    xt = torch.randn(33, 12, dtype=torch.bfloat16).t()  # non-contiguous [12, 33]
    y, scale = opennpu.npu_dynamic_quant(xt, dst_type=HIF8)
    wy, ws = dynamic_golden(xt)
    assert torch.equal(y, wy) and torch.equal(scale, ws)
    y, scale = opennpu.npu_dynamic_quant(torch.randn(0, 8), dst_type=HIF8)
    assert y.shape == (0, 8) and y.dtype == torch.uint8 and scale.shape == (0,)


def test_dynamic_quant_portable_opcheck_compile_and_errors():
    x = torch.randn(5, 3, 48, dtype=torch.bfloat16) * 4
    sm = torch.rand(48, dtype=torch.bfloat16) + 0.5
    for mode in ("pertoken", "pertensor"):
        kernel = opennpu.npu_dynamic_quant(x, smooth_scales=sm, dst_type=HIF8, quant_mode=mode)
        with portable.force():
            port = opennpu.npu_dynamic_quant(x, smooth_scales=sm, dst_type=HIF8, quant_mode=mode)
        assert torch.equal(port[0], kernel[0]) and torch.equal(port[1], kernel[1])
    opcheck(npu.npu_dynamic_quant.default, [((x,), dict(dst_type=HIF8)),
                                            ((x,), dict(dst_type=HIF8, quant_mode="pertensor"))])
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(x):
        return opennpu.npu_dynamic_quant(x, dst_type=HIF8)

    got = f(x)
    assert got[0].dtype == torch.uint8 and torch.equal(got[0], opennpu.npu_dynamic_quant(
        x, dst_type=HIF8)[0]) and counter.frame_count == 1
    _raises(lambda: opennpu.npu_dynamic_quant(x, dst_type=HIF8, dst_type_max=40000.0),
            "npu_dynamic_quant: argument 'dst_type_max' must be 0", "32768", "40000")
    _raises(lambda: opennpu.npu_dynamic_quant(x, dst_type=HIF8, quant_mode="perchannel"),
            "argument 'quant_mode'", "perchannel")
    _raises(lambda: opennpu.npu_add_rms_norm_dynamic_quant(x, x, sm, y_dtype=HIF8),
            "npu_add_rms_norm_dynamic_quant: argument 'y_dtype'", "dtype code 290")


# ----------------------------------------------------------------------------- block quant


def block_golden(x, rb, cb, min_scale=0.0, qmax=32768.0):
    v = (x if x.dim() == 3 else x.unsqueeze(0)).float()
    b, rows, cols = v.shape
    y = torch.empty(v.shape, dtype=torch.uint8)
    scale = torch.empty(b, -(-rows // rb), -(-cols // cb))
    for i in range(b):
        for r in range(0, rows, rb):
            for c in range(0, cols, cb):
                blk = v[i, r:r + rb, c:c + cb]
                amax = blk.abs().amax()
                if amax == 0:
                    inv, s = torch.tensor(0.0), torch.tensor(max(0.0, min_scale))
                else:  # the golden's qmax * (1 / amax) in float32, capped by 1 / min_scale
                    inv = qmax * amax.reciprocal()
                    if min_scale > 0:
                        inv = torch.minimum(inv, torch.tensor(1.0 / np.float32(min_scale)))
                    s = torch.maximum(amax / qmax, torch.tensor(min_scale, dtype=torch.float32))
                y[i, r:r + rb, c:c + cb] = oracle((blk * inv).clamp(-qmax, qmax))
                scale[i, r // rb, c // cb] = s
    return (y, scale) if x.dim() == 3 else (y[0], scale[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape,rb,cb", [((5, 130), 1, 128), ((2, 9, 70), 4, 32), ((3, 3), 2, 2)])
def test_dynamic_block_quant(dtype, shape, rb, cb):
    torch.manual_seed(4)
    x = (torch.randn(shape) * 7).to(dtype)
    x.view(-1)[:2] = 0
    kw = dict(dst_type=HIF8, round_mode="round", row_block_size=rb, col_block_size=cb)
    y, s = opennpu.npu_dynamic_block_quant(x, **kw)
    wy, ws = block_golden(x, rb, cb)
    assert y.dtype == torch.uint8 and y.shape == x.shape
    assert torch.equal(y, wy) and torch.equal(s, ws)
    y, s = opennpu.npu_dynamic_block_quant(x, min_scale=1e-3, dst_type_max=224.0, **kw)
    wy, ws = block_golden(x, rb, cb, min_scale=1e-3, qmax=224.0)
    assert torch.equal(y, wy) and torch.equal(s, ws)
    with portable.force():
        py, ps = opennpu.npu_dynamic_block_quant(x, **kw)
    yk, sk = opennpu.npu_dynamic_block_quant(x, **kw)
    assert torch.equal(py, yk) and torch.equal(ps, sk)


def test_dynamic_block_quant_non_contiguous_empty_errors_opcheck_compile():
    bq = opennpu.npu_dynamic_block_quant
    kw = dict(dst_type=HIF8, round_mode="round", col_block_size=16)
    xt = (torch.randn(40, 6) * 3).t()  # [6, 40], strided
    y, s = bq(xt, **kw)
    wy, ws = block_golden(xt, 1, 16)
    assert torch.equal(y, wy) and torch.equal(s, ws)
    y, s = bq(torch.randn(0, 16), **kw)
    assert y.shape == (0, 16) and y.dtype == torch.uint8 and s.shape == (0, 1)
    x = torch.randn(4, 32)
    _raises(lambda: bq(x, dst_type=HIF8), "npu_dynamic_block_quant: argument 'round_mode' must be "
            "\"round\" for hifloat8 outputs", "\"hybrid\" is not supported", "got \"rint\"")
    _raises(lambda: bq(x, dst_type=HIF8, round_mode="hybrid"), "argument 'round_mode'",
            "got \"hybrid\"")
    _raises(lambda: bq(x, round_mode="round"), "argument 'round_mode' must be \"rint\"")
    _raises(lambda: bq(x, dst_type=HIF8, round_mode="round", dst_type_max=50000.0),
            "argument 'dst_type_max'", "32768")
    _raises(lambda: bq(x, dst_type=289), "argument 'dst_type'", "torch_npu.hifloat8 (290)",
            "got 289")
    with portable.force():
        _raises(lambda: bq(x, dst_type=HIF8), "argument 'round_mode' must be \"round\"")
    opcheck(npu.npu_dynamic_block_quant.default,
            [((x,), dict(dst_type=HIF8, round_mode="round", col_block_size=8))])
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(x):
        return bq(x, **kw)

    got = f(x)
    assert torch.equal(got[0], bq(x, **kw)[0]) and counter.frame_count == 1


# ----------------------------------------------------------------------------- infer attention


def _fia_inputs(dtype, seed=5):
    torch.manual_seed(seed)
    b, n, kvn, s, skv, d = 2, 4, 2, 3, 10, 8
    q = torch.randn(b, n, s, d).to(dtype)
    k = torch.randn(b, kvn, skv, d).to(dtype)
    v = torch.randn(b, kvn, skv, d).to(dtype)
    kw = dict(num_query_heads=n, num_key_value_heads=kvn, input_layout="BNSD", softmax_scale=0.3)
    return q, k, v, kw


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
def test_infer_attention_v2_out(dtype, per_channel):
    q, k, v, kw = _fia_inputs(dtype)
    sc = torch.rand(4, 8) * 3000 + 1 if per_channel else torch.tensor([2500.0])
    off = torch.randn(sc.shape) * 10
    out, _ = npu.npu_fused_infer_attention_score_v2(q, k, v, quant_scale_out=sc,
                                                    quant_offset_out=off, out_dtype=HIF8, **kw)
    o32, _ = npu.npu_fused_infer_attention_score_v2(q.float(), k.float(), v.float(), **kw)
    f = (lambda t: t.view(1, 4, 1, 8)) if per_channel else (lambda t: t)
    want = oracle(o32 * f(sc) + f(off))  # the product, then the sum, each in float32
    assert out.dtype == torch.uint8 and out.shape == o32.shape
    assert torch.equal(out, want)


def test_infer_attention_v2_empty_and_non_contiguous():
    q, k, v, kw = _fia_inputs(torch.float16, seed=7)
    out, _ = npu.npu_fused_infer_attention_score_v2(q[:0], k[:0], v[:0], out_dtype=HIF8,
                                                    quant_scale_out=torch.ones(1), **kw)
    assert out.dtype == torch.uint8 and out.shape == (0, 4, 3, 8)
    sc = (torch.rand(8, 4) * 500 + 1).t()  # per channel, non-contiguous [4, 8]
    qt = q.transpose(2, 3).contiguous().transpose(2, 3)  # strided query
    out, _ = npu.npu_fused_infer_attention_score_v2(qt, k, v, quant_scale_out=sc, out_dtype=HIF8,
                                                    **kw)
    o32, _ = npu.npu_fused_infer_attention_score_v2(q.float(), k.float(), v.float(), **kw)
    assert torch.equal(out, oracle(o32 * sc.reshape(1, 4, 1, 8)))


def test_infer_attention_v2_portable_out_overload_opcheck_compile_errors():
    q, k, v, kw = _fia_inputs(torch.bfloat16, seed=6)
    sc = torch.rand(4, 8) * 100 + 1
    call = dict(quant_scale_out=sc, out_dtype=HIF8, **kw)
    want, lse = npu.npu_fused_infer_attention_score_v2(q, k, v, **call)
    port, _ = portable.npu_fused_infer_attention_score_v2(q, k, v, **call)
    assert port.dtype == torch.uint8
    # the float32 attention differs in the last ulp between the two paths: a code may move to
    # the adjacent value where o * scale sits at a rounding boundary, never further
    assert adjacent_or_equal(port, want)
    a, b = npu._npu_fused_infer_attention_score_v2_infer_output(
        q, v, input_layout="BNSD", num_query_heads=4, num_key_value_heads=2,
        quant_scale_out=sc, out_dtype=HIF8)
    assert a.dtype == torch.uint8 and a.shape == want.shape
    opennpu.npu_fused_infer_attention_score_v2.out(q, k, v, out=[a, b], **call)
    assert torch.equal(a, want)
    opcheck(npu.npu_fused_infer_attention_score_v2.default,
            [((q.float(), k.float(), v.float()), call)])
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=counter, fullgraph=True, dynamic=True)
    def f(q, k, v, sc):
        return npu.npu_fused_infer_attention_score_v2(q, k, v, quant_scale_out=sc,
                                                      out_dtype=HIF8, **kw)

    assert torch.equal(f(q, k, v, sc)[0], want) and counter.frame_count == 1
    _raises(lambda: npu.npu_fused_infer_attention_score_v2(q, k, v, quant_scale_out=sc,
                                                           out_dtype=291, **kw),
            "argument 'out_dtype' must be None, torch.int8, torch.float8_e5m2, "
            "torch.float8_e4m3fn or torch_npu.hifloat8 (290) with quant_scale_out")
    _raises(lambda: npu.npu_fused_infer_attention_score_v2(q, k, v, out_dtype=HIF8, **kw),
            "argument 'out_dtype' must be None or the output's dtype")
