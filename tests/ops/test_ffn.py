"""npu_ffn: dense and expert FFN in float32 / float16 / bfloat16, the int8 quantised path and the
weight-only int8 path.

Contract: shared/spec/torch_npu_api.md section 1.13; seed 002 (torch_npu.npu_ffn), its two
examples included.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import SETTINGS, dtype_id, max_err, opcheck

import opennpu
from opennpu.testing import reference as R

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
FLOAT_DTYPES = (F32, F16, BF16)
ACTIVATIONS = ("fastgelu", "gelu", "relu", "silu", "geglu", "swiglu", "reglu")
GLU = R.FFN_GLU
# Max error relative to the output's largest magnitude: fp32 accumulation order, the 20-ulp exp
# of fp16 / bf16 and the output's own rounding (the reference rounds the intermediate as we do).
REL_TOL = {F32: 2e-5, F16: 2e-3, BF16: 1.6e-2}
SEED_EXPERT_TOKENS = [227, 62, 78, 126, 178, 27, 122, 1, 19, 182, 166, 118, 66, 217, 122, 243]

dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
activations = pytest.mark.parametrize("activation", ACTIVATIONS)


def check_close(out, ref, dtype, factor=1.0):
    assert out.shape == ref.shape, (tuple(out.shape), tuple(ref.shape))
    scale = max(ref.abs().max().item(), 1.0) if ref.numel() else 1.0
    err = max_err(out, ref)
    assert err <= REL_TOL[dtype] * factor * scale, (
        f"max error {err:.3g} > {REL_TOL[dtype] * factor:g} x max |ref| {scale:.3g}")


def ffn_inputs(m, k1, i, activation, dtype, experts=None, bias=True, bias_dtype=None):
    """x [m, k1], weights scaled so every stage stays O(1); experts = token counts."""
    n1 = 2 * i if activation in GLU else i
    e = () if experts is None else (len(experts),)
    x = torch.randn(m, k1).to(dtype)
    w1 = (torch.randn(*e, k1, n1) / math.sqrt(k1)).to(dtype)
    w2 = (torch.randn(*e, i, k1) / math.sqrt(i)).to(dtype)
    kwargs = {}
    if experts is not None:
        kwargs["expert_tokens"] = list(experts)
    if bias:
        bd = bias_dtype or (F32 if dtype == BF16 else dtype)
        kwargs["bias1"] = torch.randn(*e, n1).to(bd)
        kwargs["bias2"] = torch.randn(*e, k1).to(bd)
    return x, w1, w2, kwargs


def run_and_check(x, w1, w2, activation, dtype, factor=1.0, **kwargs):
    out = opennpu.npu_ffn(x, w1, w2, activation, **kwargs)
    assert out.dtype == dtype
    check_close(out, R.ffn(x, w1, w2, activation, **kwargs), dtype, factor)
    return out


def _raises(fn, *pieces):
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


# ----------------------------------------------------------------------------- seed examples


def test_seed_example_single_op_fastgelu():
    """Seed 002's single-op example: fp16 x [1, 1280], W1 [1280, 10240], W2 [10240, 1280],
    fastgelu, inner_precise=1 (unscaled randn weights, as in the seed)."""
    import torch_npu

    x = torch.randn((1, 1280), dtype=F16)
    w1 = torch.randn(1280, 10240, dtype=F16)
    w2 = torch.randn(10240, 1280, dtype=F16)
    out = torch_npu.npu_ffn(x, w1, w2, "fastgelu", inner_precise=1)
    assert out.shape == (1, 1280) and out.dtype == F16
    assert torch.isfinite(out).all()
    check_close(out, R.ffn(x, w1, w2, "fastgelu"), F16)


@pytest.mark.slow
def test_seed_example_16_experts():
    """Seed 002's graph-mode example, run eagerly: x [1954, 2560], 16 experts of W1 [2560, 5120]
    and W2 [5120, 2560], fastgelu, its expert token list, inner_precise=1; per-expert reference."""
    x = torch.randn((1954, 2560), dtype=F16)
    w1 = torch.randn((16, 2560, 5120), dtype=F16)
    w2 = torch.randn((16, 5120, 2560), dtype=F16)
    assert sum(SEED_EXPERT_TOKENS) == 1954
    out = opennpu.npu_ffn(x, w1, w2, "fastgelu", expert_tokens=SEED_EXPERT_TOKENS,
                          inner_precise=1)
    assert out.shape == (1954, 2560) and out.dtype == F16
    # fp32 oracle (fp64 would take minutes at this size); its error is far below fp16's.
    ref = R.ffn(x, w1, w2, "fastgelu", expert_tokens=SEED_EXPERT_TOKENS,
                compute_dtype=torch.float32)
    check_close(out, ref, F16)
    # Each expert's rows went through that expert's weights, and only those.
    start = 0
    for e, n in enumerate(SEED_EXPERT_TOKENS[:3]):
        own = R.ffn(x[start:start + n], w1[e], w2[e], "fastgelu", compute_dtype=torch.float32)
        check_close(out[start:start + n], own, F16)
        start += n


# ----------------------------------------------------------------------------- float paths


@dtypes
@activations
def test_dense_matches_reference(activation, dtype):
    x, w1, w2, kw = ffn_inputs(37, 48, 80, activation, dtype)
    run_and_check(x, w1, w2, activation, dtype, **kw)


@dtypes
@pytest.mark.parametrize("activation", ["fastgelu", "swiglu", "relu"])
def test_experts_match_reference(activation, dtype):
    tokens = [5, 0, 17, 9, 1]
    x, w1, w2, kw = ffn_inputs(sum(tokens), 40, 72, activation, dtype, experts=tokens)
    out = run_and_check(x, w1, w2, activation, dtype, **kw)
    # Row blocks of one expert use that expert's weights only.
    start = 0
    for e, n in enumerate(tokens):
        if n:
            own = R.ffn(x[start:start + n], w1[e], w2[e], activation,
                        bias1=kw["bias1"][e], bias2=kw["bias2"][e])
            check_close(out[start:start + n], own, dtype)
        start += n


def test_expert_tokens_index_is_the_cumulative_form():
    tokens = [3, 0, 6, 2]
    x, w1, w2, kw = ffn_inputs(11, 32, 48, "silu", F32, experts=tokens)
    by_count = opennpu.npu_ffn(x, w1, w2, "silu", **kw)
    kw.pop("expert_tokens")
    index = [3, 3, 9, 11]
    by_index = opennpu.npu_ffn(x, w1, w2, "silu", expert_tokens_index=index, **kw)
    assert torch.equal(by_count, by_index)


@pytest.mark.parametrize("activation", ["geglu", "swiglu", "reglu"])
def test_glu_activates_the_second_half(activation):
    """GLU forms: the first GEMM's halves a | b give a * act(b) (Ascend's FFN kernel passes the
    left half as AscendC's GLU operand 0, which is not activated)."""
    x, w1, w2, _ = ffn_inputs(9, 16, 24, activation, F32, bias=False)
    act = {"geglu": lambda z: torch.nn.functional.gelu(z, approximate="tanh"),
           "swiglu": torch.nn.functional.silu, "reglu": torch.relu}[activation]
    h = x @ w1
    expected = (h[:, :24] * act(h[:, 24:])) @ w2
    torch.testing.assert_close(opennpu.npu_ffn(x, w1, w2, activation), expected,
                               rtol=1e-5, atol=1e-5)


def test_gelu_is_the_tanh_approximation_and_fastgelu_the_sigmoid_form():
    x, w1, w2, _ = ffn_inputs(6, 16, 32, "gelu", F32, bias=False)
    h = x @ w1
    torch.testing.assert_close(
        opennpu.npu_ffn(x, w1, w2, "gelu"),
        torch.nn.functional.gelu(h, approximate="tanh") @ w2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(opennpu.npu_ffn(x, w1, w2, "fastgelu"),
                               (h * torch.sigmoid(1.702 * h)) @ w2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", (F16, BF16), ids=dtype_id)
@pytest.mark.parametrize("activation", ["fastgelu", "swiglu"])
def test_low_precision_not_worse_than_native(activation, dtype):
    """Against the exact oracle (intermediate not rounded), ours is at least as accurate as the
    eager composition in the same dtype (which rounds after every op)."""
    x, w1, w2, kw = ffn_inputs(64, 128, 256, activation, dtype)
    exact = R.ffn(x, w1, w2, activation, round_intermediate=False, **kw)
    ours = opennpu.npu_ffn(x, w1, w2, activation, **kw)
    native = R.native_ffn(x, w1, w2, activation, bias1=kw["bias1"].to(dtype),
                          bias2=kw["bias2"].to(dtype))
    assert max_err(ours, exact) <= max_err(native, exact) * 1.05


@pytest.mark.parametrize("dtype", (F16, BF16), ids=dtype_id)
@pytest.mark.parametrize("activation", ["gelu", "geglu"])
def test_fp32_tile_fallback_matches(monkeypatch, activation, dtype):
    """Where the CPU has no fp16 / bf16 matrix instructions, tiles are converted to fp32 (forced
    here): the same rounding of the intermediate, so the same result up to summation order."""
    x, w1, w2, kw = ffn_inputs(40, 64, 96, activation, dtype)
    default = opennpu.npu_ffn(x, w1, w2, activation, **kw)
    monkeypatch.setenv("OPENNPU_FFN_GEMM", "fp32")
    fallback = run_and_check(x, w1, w2, activation, dtype, **kw)
    check_close(fallback, default.double(), dtype)


@pytest.mark.parametrize("gemm", ["blas", "fp32", "aten"])
@dtypes
@pytest.mark.parametrize("activation", ["fastgelu", "relu", "swiglu", "geglu"])
def test_every_gemm_path_matches_reference(monkeypatch, gemm, activation, dtype):
    """Each GEMM path (MKL tiles, fp32 tiles, whole ATen GEMMs with one activation pass; the
    machine picks one per dtype, forced here so that all run everywhere): dense with more rows
    than a tile block, experts with empty ones, a single row (decode), with and without bias."""
    monkeypatch.setenv("OPENNPU_FFN_GEMM", gemm)
    for m, experts, bias in ((300, None, True), (1, None, False), (26, [7, 0, 19], True),
                             (5, [0, 5], False)):
        x, w1, w2, kw = ffn_inputs(m, 48, 1100, activation, dtype, experts=experts, bias=bias)
        run_and_check(x, w1, w2, activation, dtype, **kw)


def test_unknown_gemm_override_is_an_error(monkeypatch):
    monkeypatch.setenv("OPENNPU_FFN_GEMM", "cublas")
    x, w1, w2, _ = ffn_inputs(2, 8, 16, "relu", F32, bias=False)
    _raises(lambda: opennpu.npu_ffn(x, w1, w2, "relu"), "OPENNPU_FFN_GEMM must be auto, blas,",
            "'cublas'")


@pytest.mark.parametrize("m,k1,i", [(1, 7, 5), (83, 33, 65), (300, 24, 40), (5, 1, 3),
                                    (4, 16, 769)])
def test_odd_sizes(m, k1, i):
    """Sizes off every vector width and tile boundary, more rows than one block (256)."""
    for activation in ("silu", "reglu"):
        x, w1, w2, kw = ffn_inputs(m, k1, i, activation, F32)
        run_and_check(x, w1, w2, activation, F32, **kw)


def test_leading_dims_and_non_contiguous_inputs():
    x, w1, w2, kw = ffn_inputs(24, 32, 40, "fastgelu", F32)
    x3 = x.reshape(2, 3, 4, 32)
    out = opennpu.npu_ffn(x3, w1, w2, "fastgelu", **kw)
    assert out.shape == (2, 3, 4, 32)
    torch.testing.assert_close(out.reshape(24, 32), opennpu.npu_ffn(x, w1, w2, "fastgelu", **kw))
    xt = x.t().contiguous().t()
    w1t, w2t = w1.t().contiguous().t(), w2.t().contiguous().t()
    assert not xt.is_contiguous() and not w1t.is_contiguous()
    torch.testing.assert_close(opennpu.npu_ffn(xt, w1t, w2t, "fastgelu", **kw),
                               opennpu.npu_ffn(x, w1, w2, "fastgelu", **kw))


def test_empty_inputs():
    x, w1, w2, _ = ffn_inputs(0, 16, 24, "silu", F32)
    assert opennpu.npu_ffn(x, w1, w2, "silu").shape == (0, 16)
    tokens = [0, 0]
    x, w1, w2, kw = ffn_inputs(0, 16, 24, "silu", BF16, experts=tokens)
    assert opennpu.npu_ffn(x, w1, w2, "silu", **kw).shape == (0, 16)


def test_bias_dtypes_and_no_bias():
    x, w1, w2, kw = ffn_inputs(10, 16, 32, "relu", F16, bias_dtype=F32)
    run_and_check(x, w1, w2, "relu", F16, **kw)
    kw16 = {k: v.half() for k, v in kw.items()}
    run_and_check(x, w1, w2, "relu", F16, **kw16)
    run_and_check(x, w1, w2, "relu", F16, bias2=kw["bias2"])
    run_and_check(x, w1, w2, "relu", F16)


def test_inner_precise_accepts_0_and_1():
    x, w1, w2, kw = ffn_inputs(12, 32, 64, "gelu", F16)
    outs = [opennpu.npu_ffn(x, w1, w2, "gelu", inner_precise=p, **kw) for p in (None, 0, 1)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_output_dtype_is_ignored_outside_the_quantised_path():
    x, w1, w2, _ = ffn_inputs(4, 16, 16, "relu", BF16)
    assert opennpu.npu_ffn(x, w1, w2, "relu", output_dtype=torch.float16).dtype == BF16


@settings(**SETTINGS)
@given(tokens=st.lists(st.integers(0, 40), min_size=1, max_size=5),
       k1=st.integers(1, 70), i=st.integers(1, 90), activation=st.sampled_from(ACTIVATIONS),
       dtype=st.sampled_from(FLOAT_DTYPES), experts=st.booleans())
def test_hypothesis_shape_sweep(tokens, k1, i, activation, dtype, experts):
    x, w1, w2, kw = ffn_inputs(sum(tokens), k1, i, activation, dtype,
                               experts=tokens if experts else None)
    run_and_check(x, w1, w2, activation, dtype, **kw)


# ----------------------------------------------------------------------------- weight-only


def weight_only_inputs(m, k1, i, activation, dtype, experts=None, with_offset=True):
    n1 = 2 * i if activation in GLU else i
    e = () if experts is None else (len(experts),)
    x = torch.randn(m, k1).to(dtype)
    w1 = torch.randint(-128, 128, (*e, k1, n1), dtype=torch.int8)
    w2 = torch.randint(-128, 128, (*e, i, k1), dtype=torch.int8)
    kw = dict(antiquant_scale1=(torch.rand(*e, n1) * 0.02 / math.sqrt(k1)).to(dtype),
              antiquant_scale2=(torch.rand(*e, k1) * 0.02 / math.sqrt(i)).to(dtype),
              bias1=torch.randn(*e, n1).to(F32 if dtype == BF16 else dtype))
    if with_offset:
        kw["antiquant_offset1"] = torch.randint(-8, 8, (*e, n1)).to(dtype)
        kw["antiquant_offset2"] = torch.randint(-8, 8, (*e, k1)).to(dtype)
    if experts is not None:
        kw["expert_tokens"] = list(experts)
    return x, w1, w2, kw


@dtypes
@pytest.mark.parametrize("activation", ["fastgelu", "silu", "swiglu"])
def test_weight_only_matches_reference(activation, dtype):
    x, w1, w2, kw = weight_only_inputs(29, 40, 56, activation, dtype)
    run_and_check(x, w1, w2, activation, dtype, **kw)


@pytest.mark.parametrize("dtype", (F16, BF16), ids=dtype_id)
def test_weight_only_experts_without_offsets(dtype):
    x, w1, w2, kw = weight_only_inputs(21, 32, 48, "gelu", dtype, experts=[7, 0, 14],
                                       with_offset=False)
    run_and_check(x, w1, w2, "gelu", dtype, **kw)


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_weight_only_matches_op_plugin_golden(activation):
    """op-plugin's golden (test_npu_ffn_antiquant), small: W' = (W + offset) * scale computed in
    fp16 (each operation rounded), then both GEMMs and the activation in float32, only the
    output rounded to fp16. Regression: opennpu rounded W' once and the intermediate to fp16,
    which put 2% of op-plugin's 8192 x 320 outputs more than 0.001 off."""
    gen = torch.Generator().manual_seed(0)
    m, k, n = 64, 48, 160
    x = (torch.randn(m, k, generator=gen) * 0.02).half()
    w1 = torch.randint(-9, 9, (k, n), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-9, 9, (n, k), dtype=torch.int8, generator=gen)
    s1, o1 = [(torch.randn(n, generator=gen) * 0.02).half() for _ in range(2)]
    s2, o2 = [(torch.randn(k, generator=gen) * 0.02).half() for _ in range(2)]
    out = opennpu.npu_ffn(x, w1, w2, activation, antiquant_scale1=s1, antiquant_scale2=s2,
                          antiquant_offset1=o1, antiquant_offset2=o2, inner_precise=1)
    w1f = ((w1.half() + o1) * s1).float()  # fp16 tensor arithmetic, as the golden
    w2f = ((w2.half() + o2) * s2).float()
    h = x.float() @ w1f
    h = torch.relu(h) if activation == "relu" else h * torch.sigmoid(h)
    golden = (h @ w2f).half()
    torch.testing.assert_close(out, golden, rtol=2**-10, atol=1e-5)
    assert (out != golden).sum() <= out.numel() // 100  # GEMM summation order only
    check_close(out, R.ffn(x, w1, w2, activation, antiquant_scale1=s1, antiquant_scale2=s2,
                           antiquant_offset1=o1, antiquant_offset2=o2), F16, 1)


# ----------------------------------------------------------------------------- quantised


def pack_deq_scale(s):
    """torch_npu's int64 form of a float32 scale (npu_trans_quant_param without offset)."""
    bits = s.float().view(torch.int32).to(torch.int64) & 0xFFFFE000
    return bits | (1 << 46)


def quant_inputs(m, k1, i, activation, out_dtype, deq_kind, per_channel, experts=None):
    n1 = 2 * i if activation in GLU else i
    e = () if experts is None else (len(experts),)
    ne = len(experts) if experts else 1
    x = torch.randint(-128, 128, (m, k1), dtype=torch.int8)
    w1 = torch.randint(-128, 128, (*e, k1, n1), dtype=torch.int8)
    w2 = torch.randint(-128, 128, (*e, i, k1), dtype=torch.int8)
    deq1 = torch.rand(*e, n1) * 4 / (128 * 128 * math.sqrt(k1))
    deq2 = torch.rand(*e, k1) * 4 / (128 * 128 * math.sqrt(i))
    if deq_kind == "bf16":
        deq1, deq2 = deq1.bfloat16(), deq2.bfloat16()
    elif deq_kind == "int64":
        deq1, deq2 = pack_deq_scale(deq1), pack_deq_scale(deq2)
    scale = (torch.rand(*e, i) * 40 + 20) if per_channel else torch.full((ne,), 50.0)
    kw = dict(bias1=torch.randint(-2000, 2000, (*e, n1), dtype=torch.int32),
              bias2=torch.randint(-2000, 2000, (*e, k1), dtype=torch.int32),
              scale=scale, offset=torch.randn(ne), deq_scale1=deq1, deq_scale2=deq2,
              output_dtype=out_dtype)
    if experts is not None:
        kw["expert_tokens"] = list(experts)
    return x, w1, w2, kw


def check_quant(out, ref, w2, kw, out_dtype):
    """The output matches the explicit reference up to its rounding to fp16 / bf16, except that
    an intermediate landing within an fp32 ulp of a .5 tie may round the other way (then the
    row moves by one int8 step times W2): at most a couple of such elements."""
    scale = max(ref.abs().max().item(), 1.0)
    err = (out.double() - ref.double()).abs()
    tol = REL_TOL[out_dtype] * scale
    bad = (err > tol).sum().item()
    assert bad <= 2, f"{bad} elements off by more than {tol:.3g} (max {err.max().item():.3g})"


# (output dtype, deq_scale kind, per-channel scale); fp32 deq_scale with a per-channel scale is
# refused by Ascend only (strict mode), see test_quant_fp32_deq_per_channel.
QUANT_CASES = [(F16, "fp32", False), (F16, "int64", False), (F16, "int64", True),
               (BF16, "bf16", False), (BF16, "bf16", True)]


@pytest.mark.parametrize("activation", ["fastgelu", "relu", "silu", "gelu", "swiglu"])
@pytest.mark.parametrize("out_dtype,deq_kind,per_channel", QUANT_CASES,
                         ids=lambda v: v if isinstance(v, str) else None)
def test_quant_matches_explicit_reference(activation, out_dtype, deq_kind, per_channel):
    x, w1, w2, kw = quant_inputs(45, 64, 96, activation, out_dtype, deq_kind, per_channel)
    out = opennpu.npu_ffn(x, w1, w2, activation, **kw)
    assert out.dtype == out_dtype
    check_quant(out, R.ffn(x, w1, w2, activation, **kw), w2, kw, out_dtype)


def test_quant_fp32_deq_per_channel():
    x, w1, w2, kw = quant_inputs(20, 32, 48, "relu", F16, "fp32", True)
    check_quant(opennpu.npu_ffn(x, w1, w2, "relu", **kw), R.ffn(x, w1, w2, "relu", **kw), w2,
                kw, F16)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_quant_experts(per_channel):
    tokens = [12, 0, 30, 3]
    x, w1, w2, kw = quant_inputs(45, 48, 64, "fastgelu", BF16, "bf16", per_channel,
                                 experts=tokens)
    out = opennpu.npu_ffn(x, w1, w2, "fastgelu", **kw)
    check_quant(out, R.ffn(x, w1, w2, "fastgelu", **kw), w2, kw, BF16)


@pytest.mark.parametrize("gemm", ["auto", "blas"], ids=["whole_gemms", "tiles"])
@pytest.mark.parametrize("activation", ["fastgelu", "swiglu"])
def test_quant_both_schedules_match_reference(monkeypatch, gemm, activation):
    """The quantised path's two schedules (whole at::_int_mm GEMMs with passes over the int32
    results, the default; per-thread tiles): more rows than a tile block, intermediate columns
    off the 1024-column epilogue chunks, experts with an empty one."""
    monkeypatch.setenv("OPENNPU_FFN_GEMM", gemm)
    x, w1, w2, kw = quant_inputs(300, 40, 1100, activation, F16, "int64", True)
    check_quant(opennpu.npu_ffn(x, w1, w2, activation, **kw), R.ffn(x, w1, w2, activation, **kw),
                w2, kw, F16)
    tokens = [70, 0, 5]
    x, w1, w2, kw = quant_inputs(75, 32, 1030, activation, BF16, "bf16", False, experts=tokens)
    check_quant(opennpu.npu_ffn(x, w1, w2, activation, **kw), R.ffn(x, w1, w2, activation, **kw),
                w2, kw, BF16)
    # More rows than one chunk of the whole GEMMs (4096): the second chunk's rows and offsets.
    x, w1, w2, kw = quant_inputs(4100, 16, 40, activation, F16, "fp32", False)
    check_quant(opennpu.npu_ffn(x, w1, w2, activation, **kw), R.ffn(x, w1, w2, activation, **kw),
                w2, kw, F16)


def test_quant_default_output_is_float16_and_offset_optional():
    x, w1, w2, kw = quant_inputs(8, 32, 32, "relu", None, "fp32", False)
    kw.pop("output_dtype")
    kw.pop("offset")
    out = opennpu.npu_ffn(x, w1, w2, "relu", **kw)
    assert out.dtype == F16
    check_quant(out, R.ffn(x, w1, w2, "relu", **kw), w2, kw, F16)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("output_dtype", [None, F16])
def test_quant_matches_op_plugin_golden(activation, output_dtype):
    """op-plugin's golden (test_npu_ffn_quant / _with_outputdtype), small, with its rounding
    points: (x @ W1) * deq_scale1 rounded to fp16; the activation in fp16; * scale and +
    offset in fp16 (scale 0.001 is 0.0010004 there); round half to even, clamp to int8;
    q @ W2 (int32) converted to fp16 first, then * deq_scale2, rounded to fp16. Regression:
    opennpu requantised in fp32 and dequantised the int32 sum directly, off by up to 29.5 on
    op-plugin's 8192 x 320 x 2560 case. (The golden's gelu is erf-GELU, npu_ffn's the tanh
    form; written here with the tanh form.)"""
    gen = torch.Generator().manual_seed(0)
    m, k, n = 48, 320, 96  # K = 320 as in op-plugin's case: intermediates of ~3000
    x = torch.randint(-128, 127, (m, k), dtype=torch.int8, generator=gen)
    w1 = torch.randint(-128, 127, (k, n), dtype=torch.int8, generator=gen)
    w2 = torch.randint(-128, 127, (n, k), dtype=torch.int8, generator=gen)
    deq1 = R.ffn_deq_scale(pack_deq_scale(torch.rand(n, generator=gen) * 0.04 + 0.01)).float()
    deq2 = R.ffn_deq_scale(pack_deq_scale(torch.rand(k, generator=gen) * 0.04 + 0.01)).float()
    scale, offset = torch.tensor([0.001]), torch.tensor([0.0])
    out = opennpu.npu_ffn(x, w1, w2, activation, scale=scale, offset=offset,
                          deq_scale1=pack_deq_scale(deq1), deq_scale2=pack_deq_scale(deq2),
                          inner_precise=1, output_dtype=output_dtype)
    mm1 = ((x.int() @ w1.int()) * deq1).half()
    act = torch.relu(mm1) if activation == "relu" else F.gelu(mm1, approximate="tanh")
    q = torch.round(act * scale.half() + offset.half()).clamp(-128, 127).int()
    golden = ((q @ w2.int()).half() * deq2).half()
    assert out.dtype == F16
    assert (out != golden).sum() <= 2, (out.float() - golden.float()).abs().max()
    assert q.abs().max() > 1  # the requantisation is not trivially 0


def test_quant_rounds_half_to_even_and_saturates():
    """Hand-made ties: with relu, deq_scale1 = 1, scale = 0.5 and offset 0, the intermediate is
    acc / 2 exactly; W2 = identity reads it out. Ties go to even (2.5 -> 2, 3.5 -> 4, -2.5 ->
    -2), and values past the int8 range saturate at 127 (relu keeps them >= 0)."""
    acc = torch.tensor([5, 7, 9, 1, 300, 254, 255, 0], dtype=torch.int32)  # x @ W1 + b1
    k = acc.numel()
    x = torch.ones(1, k, dtype=torch.int8)
    w1 = torch.zeros(k, k, dtype=torch.int8)
    bias1 = acc.clone()
    w2 = torch.eye(k, dtype=torch.int8)
    kw = dict(bias1=bias1, scale=torch.tensor([0.5]), offset=torch.tensor([0.0]),
              deq_scale1=torch.ones(k), deq_scale2=torch.ones(k), output_dtype=F16)
    out = opennpu.npu_ffn(x, w1, w2, "relu", **kw)
    expected = torch.tensor([[2, 4, 4, 0, 127, 127, 127, 0]], dtype=F16)
    assert torch.equal(out, expected), out
    # Negative ties through the offset: relu(1) * 0.5 - 3 = -2.5 -> -2; saturation at -128.
    kw.update(bias1=torch.ones(k, dtype=torch.int32), offset=torch.tensor([-3.0]))
    assert torch.equal(opennpu.npu_ffn(x, w1, w2, "relu", **kw), torch.full((1, k), -2.0,
                                                                            dtype=F16))
    kw.update(offset=torch.tensor([-1000.0]))
    assert torch.equal(opennpu.npu_ffn(x, w1, w2, "relu", **kw), torch.full((1, k), -128.0,
                                                                            dtype=F16))
    assert torch.equal(R.ffn(x, w1, w2, "relu", **kw).half(), torch.full((1, k), -128.0,
                                                                          dtype=F16))


@pytest.mark.parametrize("activation", ["fastgelu", "gelu", "silu", "relu"])
def test_quant_huge_dequantised_values_saturate(activation):
    """Dequantised values far past any activation's interesting range, up to fp32 overflow
    (20000 * 1e35 = inf): large positive ones saturate at 127, large negative ones give
    act = -0, so the code is round(offset) = 0, as in the float64 reference."""
    bias1 = torch.tensor([20000, 1, 1000, -1000, 5, -5, 7, 0], dtype=torch.int32)
    deq1 = torch.tensor([1e35, 1e35, 1e3, 1e3, 1e30, 1e4, 1e2, 1.0])
    k = bias1.numel()
    x = torch.ones(1, k, dtype=torch.int8)
    w1 = torch.zeros(k, k, dtype=torch.int8)
    w2 = torch.eye(k, dtype=torch.int8)
    kw = dict(bias1=bias1, scale=torch.tensor([0.5]), offset=torch.tensor([0.25]),
              deq_scale1=deq1, deq_scale2=torch.ones(k), output_dtype=F16)
    out = opennpu.npu_ffn(x, w1, w2, activation, **kw)
    expected = torch.tensor([[127, 127, 127, 0, 127, 0, 127, 0]], dtype=F16)
    assert torch.equal(out, expected), out
    assert torch.equal(R.ffn(x, w1, w2, activation, **kw).half(), expected)


def test_quant_int64_deq_scale_uses_the_packed_19_bits():
    """int64 deq_scale: the low 32 bits are float32 bits, read with mask 0xFFFFE000; the upper
    bits (npu_trans_quant_param's flag and offset) are ignored."""
    x, w1, w2, kw = quant_inputs(8, 16, 16, "relu", F16, "fp32", False)
    packed = dict(kw, deq_scale1=pack_deq_scale(kw["deq_scale1"]),
                  deq_scale2=pack_deq_scale(kw["deq_scale2"]))
    truncated = dict(kw, deq_scale1=R.ffn_deq_scale(packed["deq_scale1"]).float(),
                     deq_scale2=R.ffn_deq_scale(packed["deq_scale2"]).float())
    assert torch.equal(opennpu.npu_ffn(x, w1, w2, "relu", **packed),
                       opennpu.npu_ffn(x, w1, w2, "relu", **truncated))


# ----------------------------------------------------------------------------- dispatcher


def test_opcheck():
    samples = []
    x, w1, w2, kw = ffn_inputs(9, 16, 24, "fastgelu", F32)
    samples.append(((x, w1, w2, "fastgelu"), kw))
    x, w1, w2, kw = ffn_inputs(9, 16, 12, "swiglu", BF16, experts=[4, 5])
    samples.append(((x, w1, w2, "swiglu"), kw))
    x, w1, w2, kw = weight_only_inputs(7, 16, 24, "silu", F16)
    samples.append(((x, w1, w2, "silu"), kw))
    x, w1, w2, kw = quant_inputs(7, 16, 24, "relu", BF16, "bf16", True)
    samples.append(((x, w1, w2, "relu"), kw))
    opcheck(torch.ops.npu.npu_ffn.default, samples)


def test_compile_fullgraph_dynamic_matches_eager():
    def block(x, w1, w2, b1, b2):
        return opennpu.npu_ffn(torch.relu(x), w1, w2, "silu", bias1=b1, bias2=b2) * 2

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(block, fullgraph=True, dynamic=True, backend=counter)
    for m in (5, 11, 30):
        x, w1, w2, kw = ffn_inputs(m, 16, 24, "silu", F32)
        args = (x, w1, w2, kw["bias1"], kw["bias2"])
        torch.testing.assert_close(compiled(*args), block(*args), rtol=0, atol=0)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_not_differentiable():
    x, w1, w2, _ = ffn_inputs(4, 8, 8, "relu", F32, bias=False)
    x.requires_grad_()
    out = opennpu.npu_ffn(x, w1, w2, "relu")
    torch.testing.assert_close(out, opennpu.npu_ffn(x.detach(), w1, w2, "relu"))
    with pytest.raises(RuntimeError, match="npu_ffn: not differentiable"):
        out.sum().backward()


# ----------------------------------------------------------------------------- errors


def test_rejects_bad_shapes():
    x, w1, w2, _ = ffn_inputs(4, 16, 24, "relu", F32, bias=False)
    f = opennpu.npu_ffn
    _raises(lambda: f(x[0], w1, w2, "relu"), "npu_ffn: argument 'x'", "at least 2 dims")
    _raises(lambda: f(x, w1, w2, "tanh"), "argument 'activation'", "fastgelu", "'tanh'")
    _raises(lambda: f(x[:, :8], w1, w2, "relu"), "argument 'x'", "K1 = 16")
    _raises(lambda: f(x, w1, w2[:, :8], "relu"), "argument 'weight2'", "N2 = K1 = 16")
    _raises(lambda: f(x, w1, w2, "swiglu"), "argument 'weight1'", "N1 = 2 * K2 = 48")
    _raises(lambda: f(x, w1[:, :20], w2, "relu"), "argument 'weight1'", "N1 = K2 = 24")
    _raises(lambda: f(x, w1[0], w2, "relu"), "argument 'weight1'", "[K1, N1]")
    _raises(lambda: f(x, w1, w2[None], "relu"), "argument 'weight2'", "2 dims")
    _raises(lambda: f(x, w1, w2, "relu", bias1=torch.zeros(23)), "argument 'bias1'", "[24]")
    _raises(lambda: f(x, w1, w2, "relu", bias2=torch.zeros(2, 16)), "argument 'bias2'", "[16]")
    _raises(lambda: f(x, w1, w2, "relu", inner_precise=2), "argument 'inner_precise'", "got 2")


def test_rejects_bad_expert_tokens():
    tokens = [1, 2, 1]
    x, w1, w2, _ = ffn_inputs(4, 16, 24, "relu", F32, experts=tokens, bias=False)
    f = opennpu.npu_ffn
    _raises(lambda: f(x, w1, w2, "relu"), "argument 'expert_tokens'", "required")
    _raises(lambda: f(x, w1, w2, "relu", expert_tokens=[1, 2, 2]), "argument 'expert_tokens'",
            "M = 4", "entry 2 is 2 after 3")
    # counts whose int64 sum wraps around (once a heap-corrupting crash)
    _raises(lambda: f(x, w1, w2, "relu", expert_tokens=[2**63 - 1, 2**63 - 1, 10]),
            "argument 'expert_tokens'", "M = 4", "entry 0 is 9223372036854775807")
    _raises(lambda: f(x[:0], w1, w2, "relu", expert_tokens=[2**62] * 3),
            "argument 'expert_tokens'", "M = 0")
    _raises(lambda: f(x, w1, w2, "relu", expert_tokens=[2, 2]), "argument 'expert_tokens'",
            "one entry per expert", "E = 3")
    _raises(lambda: f(x, w1, w2, "relu", expert_tokens=[3, -1, 2]), "argument 'expert_tokens'",
            ">= 0")
    _raises(lambda: f(x, w1, w2, "relu", expert_tokens_index=[1, 3, 2]),
            "argument 'expert_tokens_index'", "non-decreasing")
    _raises(lambda: f(x, w1, w2, "relu", expert_tokens_index=[1, 3, 3]),
            "argument 'expert_tokens_index'", "last entry")
    _raises(lambda: f(x, w1, w2, "relu", expert_tokens=tokens, expert_tokens_index=[1, 3, 4]),
            "argument 'expert_tokens_index'", "not both")
    _raises(lambda: f(x, w1[0], w2[0], "relu", expert_tokens=[4]), "argument 'expert_tokens'",
            "2-D")
    big = 257
    xb, w1b, w2b, _ = ffn_inputs(big, 4, 4, "relu", F32, experts=[1] * big, bias=False)
    _raises(lambda: f(xb, w1b, w2b, "relu", expert_tokens=[1] * big),
            "argument 'expert_tokens'", "at most 256")
    _raises(lambda: f(x, w1, w2, "relu", expert_tokens=tokens, bias1=torch.zeros(24)),
            "argument 'bias1'", "[E, N] = [3, 24]")


def test_rejects_wrong_parameters_for_the_path():
    x, w1, w2, _ = ffn_inputs(4, 16, 24, "relu", F16, bias=False)
    f = opennpu.npu_ffn
    s = torch.ones(1)
    for name in ("scale", "offset", "deq_scale1", "deq_scale2"):
        _raises(lambda: f(x, w1, w2, "relu", **{name: s}), f"argument '{name}'",
                "None in the non-quantised path")
    for name in ("antiquant_scale1", "antiquant_offset2"):
        _raises(lambda: f(x, w1, w2, "relu", **{name: s}), f"argument '{name}'",
                "None in the non-quantised path")
    _raises(lambda: f(x, w1.float(), w2, "relu"), "argument 'weight1'", "x's dtype")
    _raises(lambda: f(x, w1, w2.float(), "relu"), "argument 'weight2'", "x's dtype")
    _raises(lambda: f(x.double(), w1.double(), w2.double(), "relu"), "argument 'x'",
            "but got Double")
    _raises(lambda: f(x, w1, w2, "relu", bias1=torch.zeros(24, dtype=torch.int32)),
            "argument 'bias1'", "float32, float16 or bfloat16")
    # weight-only
    xw, w1w, w2w, kw = weight_only_inputs(4, 16, 24, "relu", F16)
    _raises(lambda: f(xw, w1w, w2w, "relu"), "argument 'antiquant_scale1'", "required")
    _raises(lambda: f(xw, w1w, w2w, "relu", **kw, scale=s), "argument 'scale'",
            "None in the weight-only")
    _raises(lambda: f(xw, w1w, w2w.half(), "relu", **kw), "argument 'weight2'",
            "weight1's dtype")
    bad = dict(kw, antiquant_scale2=torch.ones(5, dtype=F16))
    _raises(lambda: f(xw, w1w, w2w, "relu", **bad), "argument 'antiquant_scale2'", "[16]")
    # quantised
    xq, w1q, w2q, kq = quant_inputs(4, 16, 24, "relu", F16, "fp32", False)
    _raises(lambda: f(xq, w1q.half(), w2q, "relu", **kq), "argument 'weight1'", "int8")
    _raises(lambda: f(xq, w1q, w2q, "relu", **kq, antiquant_scale1=s),
            "argument 'antiquant_scale1'", "None in the quantised")
    for name in ("scale", "deq_scale1", "deq_scale2"):
        _raises(lambda: f(xq, w1q, w2q, "relu", **dict(kq, **{name: None})),
                f"argument '{name}'", "required")
    _raises(lambda: f(xq, w1q, w2q, "relu", **dict(kq, bias1=kq["bias1"].float())),
            "argument 'bias1'", "int32")
    _raises(lambda: f(xq, w1q, w2q, "relu", **dict(kq, output_dtype=F32)),
            "argument 'output_dtype'", "float16 or torch.bfloat16")
    _raises(lambda: f(xq, w1q, w2q, "relu", **dict(kq, output_dtype=BF16)),
            "argument 'deq_scale1'", "bfloat16 for a bfloat16 output")
    _raises(lambda: f(xq, w1q, w2q, "relu", **dict(kq, deq_scale1=kq["deq_scale1"].bfloat16())),
            "argument 'deq_scale1'", "int64, uint64 or float32 for a float16 output")
    _raises(lambda: f(xq, w1q, w2q, "relu",
                      **dict(kq, deq_scale2=pack_deq_scale(kq["deq_scale2"])),),
            "argument 'deq_scale2'", "deq_scale1's dtype")
    _raises(lambda: f(xq, w1q, w2q, "relu", **dict(kq, scale=torch.ones(3))),
            "argument 'scale'", "[24]")
    _raises(lambda: f(xq, w1q, w2q, "relu", **dict(kq, offset=torch.ones(2))),
            "argument 'offset'", "[1]")
    _raises(lambda: f(xq, w1q, w2q, "relu", **dict(kq, scale=kq["scale"].double())),
            "argument 'scale'", "float32")


def test_strict_mode_rejects_ascend_unsupported():
    f = opennpu.npu_ffn
    x, w1, w2, _ = ffn_inputs(4, 16, 24, "relu", F32, bias=False)
    with opennpu.strict():
        _raises(lambda: f(x, w1, w2, "relu"), "argument 'x'", "strict mode")
        xs, w1s, w2s, _ = ffn_inputs(4, 16, 12, "swiglu", F16, experts=[1, 3], bias=False)
        _raises(lambda: f(xs, w1s, w2s, "swiglu", expert_tokens=[1, 3], inner_precise=1),
                "argument 'activation'", "only without experts", "strict mode")
        xb, w1b, w2b, _ = ffn_inputs(4, 16, 24, "relu", BF16, bias=False)
        _raises(lambda: f(xb, w1b, w2b, "relu", inner_precise=1), "argument 'inner_precise'",
                "strict mode")
        xh, w1h, w2h, _ = ffn_inputs(4, 16, 24, "relu", F16, bias=False)
        f(xh, w1h, w2h, "relu")  # fine on Ascend
        xq, w1q, w2q, kq = quant_inputs(4, 16, 24, "relu", F16, "fp32", True)
        _raises(lambda: f(xq, w1q, w2q, "relu", **kq), "argument 'deq_scale1'", "strict mode")
