"""Rotary embedding: npu_rotary_mul and npu_rotary_mul_backward.

Contract: shared/spec/torch_npu_api.md section 1.8; seed 000 section torch_npu.npu_rotary_mul and
seed 004 (RotaryMul & RotaryMulGrad, examples one and two).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import (
    GRAD_DTYPES,
    LOW_DTYPES,
    SETTINGS,
    assert_not_worse_than_native,
    check_compiled_matches_eager,
    dtype_id,
    grads_of,
    leaf_copies,
    max_err,
    opcheck,
    randn,
)

import opennpu
from opennpu.testing import reference as R
from opennpu.testing.tolerances import assert_close

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
MODES = ["half", "interleave"]
modes = pytest.mark.parametrize("mode", MODES)

# ----------------------------------------------------------------------------- layouts
# Each documented layout with its r1/r2 broadcast patterns (spec 1.8). A pattern letter keeps
# x's size in that position, "1" broadcasts.
SIZES = {"B": 2, "N": 3, "S": 5, "T": 7, "D": 8}
PATTERNS = [
    ("BNSD", "11SD"), ("BNSD", "B1SD"), ("BNSD", "BNSD"),
    ("BSND", "1S1D"), ("BSND", "BS1D"), ("BSND", "BSND"),
    ("SBND", "S11D"), ("SBND", "SB1D"), ("SBND", "SBND"),
    ("TND", "T1D"), ("TND", "TND"),
]
patterns = pytest.mark.parametrize("layout,pattern", PATTERNS,
                                   ids=[f"{lay}-{pat}" for lay, pat in PATTERNS])


def layout_shape(layout, **sizes):
    s = {**SIZES, **sizes}
    return tuple(s[c] for c in layout)


def pattern_shape(x_shape, pattern):
    return tuple(1 if p == "1" else n for p, n in zip(pattern, x_shape, strict=True))


def make(x_shape, r_shape=None, dtype=F32, r_dtype=None, requires_grad=False):
    """x and (cos-like, sin-like) r1, r2; r1/r2 default to the BSND 1S1D-style [1.., S, 1, D]."""
    r_shape = r_shape or x_shape
    x = randn(*x_shape, dtype=dtype, requires_grad=requires_grad)
    r1 = randn(*r_shape, dtype=r_dtype or dtype, requires_grad=requires_grad)
    r2 = randn(*r_shape, dtype=r_dtype or dtype, requires_grad=requires_grad)
    return x, r1, r2


def native(x, r1, r2, mode):
    """The eager composition in the inputs' dtype (seed 000's torch_func for 'half')."""
    if mode == "half":
        return R.native_rotary_mul(x, r1, r2)
    return r1 * x + r2 * R.rotate(x, "interleave")


def check_rotary(x, r1, r2, mode="half", grad_scale=4.0):
    """Forward and the backward op match the reference; returns the forward output.

    dr1/dr2 sum over the broadcast dims, so they get `grad_scale` times the tolerance."""
    out = opennpu.npu_rotary_mul(x, r1, r2, mode)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, R.rotary_mul(x, r1, r2, mode))
    grad = torch.randn_like(out)
    dx, dr1, dr2 = opennpu.npu_rotary_mul_backward(grad, x, r1, r2, mode)
    ref = R.rotary_mul_backward(grad, x, r1, r2, mode)
    for name, got, want, like in zip(("dx", "dr1", "dr2"), (dx, dr1, dr2), ref, (x, r1, r2)):
        assert got.shape == like.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(like.shape)}"
        assert got.dtype == x.dtype, f"{name}: dtype {got.dtype}"
        assert_close(got, want, scale=1.0 if name == "dx" else grad_scale, msg=name)
    return out


def half_matrix(d, dtype=F32):
    """M with x @ M == rotate_half(x) = cat(-x2, x1)."""
    h = d // 2
    m = torch.zeros(d, d, dtype=dtype)
    m[torch.arange(h) + h, torch.arange(h)] = -1
    m[torch.arange(h), torch.arange(h) + h] = 1
    return m


def interleave_matrix(d, dtype=F32):
    """Block-diagonal 2x2 [[0, 1], [-1, 0]] blocks: x @ M == interleave rotation."""
    return torch.block_diag(*[torch.tensor([[0.0, 1.0], [-1.0, 0.0]], dtype=dtype)] * (d // 2))


# ----------------------------------------------------------------------------- parity


@modes
@pytest.mark.parametrize("r_pattern", ["11SD", "BNSD"])
def test_matches_reference(dtype, mode, r_pattern):
    x_shape = layout_shape("BNSD")
    check_rotary(*make(x_shape, pattern_shape(x_shape, r_pattern), dtype), mode)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
@modes
def test_low_precision_not_worse_than_native(dtype, mode):
    x, r1, r2 = make((2, 64, 4, 128), (1, 64, 1, 128), dtype)
    out = opennpu.npu_rotary_mul(x, r1, r2, mode)
    assert_not_worse_than_native(out, native(x, r1, r2, mode), R.rotary_mul(x, r1, r2, mode))


@pytest.mark.parametrize("x_dtype", LOW_DTYPES, ids=dtype_id)
@modes
def test_fp32_r_with_low_precision_x(x_dtype, mode):
    # fp32 cos/sin are used unrounded: the result matches the reference built from fp32 r
    x, r1, r2 = make((2, 6, 3, 16), (1, 6, 1, 16), x_dtype, r_dtype=F32)
    out = check_rotary(x, r1, r2, mode)
    assert out.dtype == x_dtype
    rounded = R.rotary_mul(x, r1.to(x_dtype), r2.to(x_dtype), mode)
    assert max_err(out, R.rotary_mul(x, r1, r2, mode)) <= max_err(out, rounded)


@modes
def test_rotate_modes_match_formula(mode):
    # explicit pairs: half rotates (x1, x2) -> (-x2, x1); interleave (a, b) -> (-b, a)
    x = torch.arange(1.0, 9.0).view(1, 1, 1, 8)
    one, zero = torch.ones(1, 1, 1, 8), torch.zeros(1, 1, 1, 8)
    got = opennpu.npu_rotary_mul(x, zero, one, mode).flatten().tolist()
    want = {"half": [-5, -6, -7, -8, 1, 2, 3, 4], "interleave": [-2, 1, -4, 3, -6, 5, -8, 7]}
    assert got == want[mode]
    assert opennpu.npu_rotary_mul(x, one, zero, mode).flatten().tolist() == x.flatten().tolist()


def test_default_mode_is_half():
    x, r1, r2 = make((2, 3, 4, 8), (1, 1, 4, 8))
    torch.testing.assert_close(opennpu.npu_rotary_mul(x, r1, r2),
                               opennpu.npu_rotary_mul(x, r1, r2, "half"), rtol=0, atol=0)


# ----------------------------------------------------------------------------- broadcast patterns


@patterns
@modes
@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16), (BF16, F32)],
                         ids=["fp32", "bf16", "bf16-x-fp32-r"])
def test_layout_broadcast_patterns(layout, pattern, mode, dtypes):
    x_shape = layout_shape(layout)
    check_rotary(*make(x_shape, pattern_shape(x_shape, pattern), *dtypes), mode)


@pytest.mark.parametrize("r1_shape,r2_shape", [
    ((1, 5, 1, 8), (2, 5, 3, 8)),  # r1 and r2 broadcast differently
    ((5, 1, 8), (5, 1, 8)),  # lower rank than x
    ((8,), (1, 1, 1, 8)),  # one row for all
    ((2, 5, 3, 1), (2, 5, 3, 1)),  # last dim broadcast
], ids=["mixed", "rank3", "rank1", "last1"])
@modes
def test_other_broadcasts(r1_shape, r2_shape, mode):
    x = randn(2, 5, 3, 8)
    check_rotary(x, randn(*r1_shape), randn(*r2_shape), mode)


# ----------------------------------------------------------------------------- sizes & layouts


@modes
@pytest.mark.parametrize("x_shape,r_shape", [
    ((0, 5, 3, 8), (1, 5, 1, 8)),
    ((2, 0, 3, 8), (1, 0, 1, 8)),
    ((1, 1, 1, 2), (1, 1, 1, 2)),
    ((1, 7, 1, 14), (1, 7, 1, 14)),
    ((2, 83, 3, 16), (1, 83, 1, 16)),
    ((1, 3, 2, 1538), (1, 3, 1, 1538)),  # D/2 = 769
    ((5125, 2), (5125, 2)),
    ((2, 64, 8, 128), (1, 64, 1, 128)),
    ((3, 2, 4, 5, 6), (1, 2, 1, 5, 6)),
], ids=["B0", "S0", "1", "S7", "S83", "D1538", "T5125", "large", "5d"])
def test_sizes(x_shape, r_shape, mode):
    check_rotary(*make(x_shape, r_shape), mode, grad_scale=8.0)


@modes
@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16, F64], ids=dtype_id)
@pytest.mark.parametrize("layout", ["BSND", "BNSD-view", "D=64", "D=40"])
def test_streamed_outputs_have_the_same_bits(dtype, layout, mode, stream_threshold):
    # Outputs of stream_min_bytes and more are written with streaming stores where every half row
    # starts on a cache line (D = 128 and 64 here; D = 40 never does, and stores normally);
    # 0 streams every output here.
    if layout == "BNSD-view":  # BSND memory viewed as BNSD: the tiled path
        x = randn(2, 37, 3, 128, dtype=dtype).transpose(1, 2)
        r1, r2 = randn(1, 1, 37, 128, dtype=dtype), randn(1, 1, 37, 128, dtype=dtype)
    else:
        d = {"BSND": 128, "D=64": 64, "D=40": 40}[layout]
        x, r1, r2 = make((2, 9, 3, d), (1, 9, 1, d), dtype)
    stream_threshold(2**62)
    plain = opennpu.npu_rotary_mul(x, r1, r2, mode)
    stream_threshold(0)
    got = opennpu.npu_rotary_mul(x, r1, r2, mode)  # `plain` alive: another buffer
    bits = {F32: torch.int32, F64: torch.int64}.get(dtype, torch.int16)
    assert torch.equal(got.view(bits), plain.view(bits))


def test_large_low_precision():
    check_rotary(*make((2, 64, 8, 128), (1, 64, 1, 128), BF16), "half")


@modes
@pytest.mark.parametrize("layout", ["qkv_slice", "transposed", "transposed_tiles",
                                    "transposed_r_per_head", "expanded", "r_strided"])
def test_non_contiguous(layout, mode):
    if layout == "qkv_slice":  # seed 004 example two: qkv[:, 0, :, :rotary_dim]
        x = randn(5, 3, 4, 24)[:, 0, :, :16]
        r1, r2 = randn(5, 1, 16), randn(5, 1, 16)
    elif layout == "transposed":  # BSND storage viewed as BNSD
        x = randn(2, 5, 3, 8).transpose(1, 2)
        r1, r2 = randn(1, 1, 5, 8), randn(1, 1, 5, 8)
    elif layout == "transposed_tiles":  # the same over 2 tiles of 16 positions and a tail
        x = randn(2, 37, 3, 8).transpose(1, 2)
        r1, r2 = randn(2, 1, 37, 8), randn(2, 1, 37, 8)
    elif layout == "transposed_r_per_head":  # r with a head dim, broadcast over the batch
        x = randn(3, 21, 4, 8).transpose(1, 2)
        r1, r2 = randn(1, 4, 21, 8), randn(4, 1, 8)
    elif layout == "expanded":  # zero strides in x itself
        x = randn(1, 5, 1, 8).expand(2, 5, 3, 8)
        r1, r2 = randn(2, 5, 1, 8), randn(2, 5, 1, 8)
    else:  # r1/r2 are strided slices, x contiguous
        x = randn(2, 5, 3, 8)
        r1, r2 = randn(1, 5, 1, 16)[..., ::2], randn(10, 1, 8)[::2]
    assert not (x.is_contiguous() and r1.is_contiguous() and r2.is_contiguous())
    check_rotary(x, r1, r2, mode)


@modes
def test_rank_2_and_3(mode):
    check_rotary(*make((7, 8), (7, 8)), mode)
    check_rotary(*make((7, 3, 8), (7, 1, 8)), mode)


# ----------------------------------------------------------------------------- rotate matrix


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("mode,matrix", [("half", half_matrix), ("interleave", interleave_matrix)])
def test_rotate_matrix_equal_to_mode_gives_mode(dtype, mode, matrix):
    x, r1, r2 = make((2, 5, 3, 16), (1, 5, 1, 16), dtype)
    by_mode = opennpu.npu_rotary_mul(x, r1, r2, mode)
    by_matrix = opennpu.npu_rotary_mul(x, r1, r2, rotate=matrix(16, dtype))
    assert_close(by_matrix, R.rotary_mul(x, r1, r2, mode))
    assert_close(by_matrix, by_mode)


def test_block_diagonal_rotate_is_half_rotation_per_sub_head():
    # A [16, 16] block-diagonal rotate of two [8, 8] half rotations rotates each 8-wide sub-head.
    x, r1, r2 = make((2, 5, 3, 16), (1, 5, 1, 16))
    m = torch.block_diag(half_matrix(8), half_matrix(8))
    got = opennpu.npu_rotary_mul(x, r1, r2, rotate=m)
    per_head = opennpu.npu_rotary_mul(x.unflatten(-1, (2, 8)), r1.unflatten(-1, (2, 8)),
                                      r2.unflatten(-1, (2, 8)), "half").flatten(-2)
    assert_close(got, per_head)
    assert_close(got, R.rotary_mul(x, r1, r2, rotate_matrix=m))


@pytest.mark.parametrize("dtype", [F32, torch.float16, BF16, F64], ids=dtype_id)
def test_random_rotate_matrix_matches_reference(dtype):
    x, r1, r2 = make((2, 4, 3, 8), (1, 4, 1, 8), dtype)
    m = randn(8, 8, dtype=dtype)
    out = opennpu.npu_rotary_mul(x, r1, r2, rotate=m)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, R.rotary_mul(x, r1, r2, rotate_matrix=m), scale=2)  # an 8-term dot


def test_rotate_matrix_ignores_mode_string():
    x, r1, r2 = make((2, 4, 3, 8), (1, 4, 1, 8))
    m = randn(8, 8)
    torch.testing.assert_close(opennpu.npu_rotary_mul(x, r1, r2, "interleave", m),
                               opennpu.npu_rotary_mul(x, r1, r2, "half", m), rtol=0, atol=0)


# ----------------------------------------------------------------------------- output contract


@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16), (BF16, F32), (torch.float16, F32)],
                         ids=["fp32", "bf16", "bf16-fp32r", "fp16-fp32r"])
def test_output_contract(dtypes):
    x, r1, r2 = make((2, 5, 3, 8), (1, 5, 1, 8), *dtypes)
    r2 = randn(2, 5, 1, 8, dtype=dtypes[1])
    out = opennpu.npu_rotary_mul(x, r1, r2)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    dx, dr1, dr2 = opennpu.npu_rotary_mul_backward(torch.randn_like(out), x, r1, r2)
    assert dx.shape == x.shape and dr1.shape == r1.shape and dr2.shape == r2.shape
    assert dx.dtype == dr1.dtype == dr2.dtype == x.dtype  # backward op: dtype of self
    # through autograd each gradient comes back in its input's dtype
    leaves = leaf_copies([t.requires_grad_() for t in (x, r1, r2)])
    grads = grads_of(opennpu.npu_rotary_mul, leaves, torch.randn_like(out))
    for g, t in zip(grads, leaves):
        assert g.shape == t.shape and g.dtype == t.dtype


# ----------------------------------------------------------------------------- gradients


@modes
@pytest.mark.parametrize("r_shape", [(1, 3, 1, 4), (2, 3, 2, 4)], ids=["1S1D", "BSND"])
def test_gradcheck_float64(mode, r_shape):
    inputs = make((2, 3, 2, 4), r_shape, F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a, b: opennpu.npu_rotary_mul(x, a, b, mode), inputs)


@pytest.mark.parametrize("matrix", ["half", "random"])
def test_gradcheck_float64_rotate_matrix(matrix):
    inputs = make((2, 3, 2, 4), (1, 3, 1, 4), F64, requires_grad=True)
    m = half_matrix(4, F64) if matrix == "half" else randn(4, 4, dtype=F64)
    assert torch.autograd.gradcheck(
        lambda x, a, b: opennpu.npu_rotary_mul(x, a, b, rotate=m), inputs)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
@modes
@pytest.mark.parametrize("rotate", [False, True], ids=["mode", "matrix"])
def test_autograd_matches_reference_autograd(dtype, mode, rotate):
    inputs = make((2, 6, 3, 16), (1, 6, 1, 16), dtype, requires_grad=True)
    m = randn(16, 16, dtype=dtype) if rotate else None
    grad = torch.randn(2, 6, 3, 16, dtype=dtype)
    ours = grads_of(lambda x, a, b: opennpu.npu_rotary_mul(x, a, b, mode, m), inputs, grad)
    ref = grads_of(lambda x, a, b: R.rotary_mul(x, a, b, mode, m), leaf_copies(inputs), grad)
    for name, g, r, t in zip(("dx", "dr1", "dr2"), ours, ref, inputs):
        assert g.dtype == dtype and g.shape == t.shape
        assert_close(g, r, scale=(2 if name == "dx" else 4) * (2 if rotate else 1), msg=name)


def test_autograd_only_computes_requested_grads():
    x = randn(2, 4, 3, 8, requires_grad=True)
    r1, r2 = randn(1, 4, 1, 8), randn(1, 4, 1, 8)
    (gx,) = torch.autograd.grad(opennpu.npu_rotary_mul(x, r1, r2).sum(), [x])
    assert gx.shape == x.shape and r1.grad is None and r2.grad is None


@pytest.mark.parametrize("dtype", [F64, F32, BF16, torch.float16], ids=dtype_id)
@modes
@pytest.mark.parametrize("layout", ["BNSD_11SD", "BSND_1S1D", "strided_grad", "fp32_r"])
def test_dx_alone_equals_full_backward(dtype, mode, layout):
    # Autograd takes dx alone when r1/r2 need no gradient; it must equal the full backward's dx,
    # whatever the layout and r dtype: bit for bit in half mode (the same products and fmas), to
    # within one rounding in interleave mode (the forward kernel orders its fma differently).
    x_shape, r_shape = ((2, 3, 5, 8), (1, 1, 5, 8)) if layout != "BSND_1S1D" else (
        (2, 5, 3, 8), (1, 5, 1, 8))
    x, r1, r2 = make(x_shape, r_shape, dtype)
    if layout == "fp32_r":
        r1, r2 = r1.float(), r2.float()
    grad = torch.randn(x_shape).to(dtype)
    if layout == "strided_grad":
        grad = torch.randn(2, 5, 3, 8).to(dtype).transpose(1, 2)
    dx = torch.ops.opennpu._rotary_mul_backward_dx(grad, x, r1, r2, mode)
    full, _, _ = torch.ops.npu.npu_rotary_mul_backward(grad, x, r1, r2, mode)
    eps = torch.finfo(dtype).eps if mode == "interleave" else 0.0
    tol = dict(rtol=eps, atol=eps * float(full.abs().max()))
    assert dx.dtype == dtype and dx.shape == x.shape
    torch.testing.assert_close(dx, full, **tol)
    (auto,) = torch.autograd.grad(
        opennpu.npu_rotary_mul(x.requires_grad_(), r1, r2, mode), [x], grad)
    torch.testing.assert_close(auto, full, **tol)


def test_dx_alone_checks_its_arguments():
    x, r1, r2 = make((2, 3, 5, 8), (1, 1, 5, 8))
    with pytest.raises(RuntimeError, match="npu_rotary_mul_backward.*grad.*shape"):
        torch.ops.opennpu._rotary_mul_backward_dx(torch.randn(2, 3, 5, 4), x, r1, r2, "half")
    with pytest.raises(RuntimeError, match="rotary_mode of npu_rotary_mul_backward"):
        torch.ops.opennpu._rotary_mul_backward_dx(torch.randn_like(x), x, r1, r2, "full")


def test_double_backward_is_a_clear_error():
    x, r1, r2 = make((2, 4, 3, 8), (1, 4, 1, 8), requires_grad=True)
    (gx,) = torch.autograd.grad(opennpu.npu_rotary_mul(x, r1, r2).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match="npu_rotary_mul_backward: double backward"):
        gx.sum().backward()


# ----------------------------------------------------------------------------- opcheck


def test_opcheck_rotary_mul():
    samples = []
    for mode in MODES:
        for rg in (False, True):
            x, r1, r2 = make((2, 4, 3, 8), (1, 4, 1, 8), requires_grad=rg)
            samples.append(((x, r1, r2), {"rotary_mode": mode}))
    x, r1, r2 = make((3, 2, 8), (3, 1, 8), requires_grad=True)
    samples.append(((x, r1, r2), {"rotate": randn(8, 8)}))
    samples.append(((randn(4, 3, 2, 16)[..., :8].requires_grad_(), randn(1, 3, 1, 8),
                     randn(4, 3, 2, 8)), {}))
    samples.append(((randn(2, 4, 3, 8, dtype=BF16, requires_grad=True),
                     randn(1, 4, 1, 8, requires_grad=True), randn(1, 4, 1, 8)),
                    {"rotary_mode": "interleave"}))
    opcheck(torch.ops.npu.npu_rotary_mul.default, samples)


def test_opcheck_rotary_mul_backward():
    samples = []
    for mode in MODES:
        x, r1, r2 = make((2, 4, 3, 8), (1, 4, 1, 8))
        samples.append(((torch.randn_like(x), x, r1, r2), {"rotary_mode": mode}))
    x, r1, r2 = make((3, 2, 8), (3, 1, 8))
    samples.append(((torch.randn_like(x), x, r1, randn(3, 2, 8)), {}))
    opcheck(torch.ops.npu.npu_rotary_mul_backward.default, samples)
    opcheck(torch.ops.opennpu._rotary_mul_backward_dx.default, samples)


# ----------------------------------------------------------------------------- hypothesis


@settings(**SETTINGS)
@given(
    layout_pattern=st.sampled_from(PATTERNS),
    sizes=st.fixed_dictionaries({c: st.integers(1, 6) for c in "BNST"}),
    half_d=st.integers(1, 40),
    mode=st.sampled_from(MODES),
    dtypes=st.sampled_from([(F32, F32), (BF16, BF16), (BF16, F32), (torch.float16, F32)]),
)
def test_hypothesis_shape_sweep(layout_pattern, sizes, half_d, mode, dtypes):
    layout, pattern = layout_pattern
    x_shape = layout_shape(layout, D=2 * half_d, **sizes)
    check_rotary(*make(x_shape, pattern_shape(x_shape, pattern), *dtypes), mode, grad_scale=8.0)


# ----------------------------------------------------------------------------- torch.compile


def test_compile_fullgraph_dynamic_matches_eager():
    m_half = half_matrix(8)

    def block(q, cos, sin):
        a = opennpu.npu_rotary_mul(q, cos, sin)
        b = opennpu.npu_rotary_mul(a, cos, sin, "interleave")
        c = opennpu.npu_rotary_mul(q, cos, sin, rotate=m_half)
        return a, b, c

    def make_inputs(shape):
        b, s, n, d = shape
        return list(make((b, s, n, d), (1, s, 1, d), requires_grad=True))

    check_compiled_matches_eager(block, make_inputs, [(2, 4, 3, 8), (3, 6, 2, 8)])


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    def block(q, cos, sin):
        return (opennpu.npu_rotary_mul(q * 2, cos, sin) + q,)

    def make_inputs(shape):
        b, s, n, d = shape
        return list(make((b, s, n, d), (1, s, 1, d), requires_grad=True))

    check_compiled_matches_eager(block, make_inputs, [(2, 4, 3, 8), (3, 6, 2, 8)],
                                 backend="inductor", tol=1e-5)


# ----------------------------------------------------------------------------- bad input

X, R1 = randn(2, 4, 3, 8), randn(1, 4, 1, 8)


def _raises(fn, *pieces):
    """fn raises RuntimeError whose message contains every piece, in order."""
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


@pytest.mark.parametrize("op", ["npu_rotary_mul", "npu_rotary_mul_backward"])
def test_rejects_unknown_rotary_mode(op):
    call = {
        "npu_rotary_mul": lambda: opennpu.npu_rotary_mul(X, R1, R1, "quarter"),
        "npu_rotary_mul_backward": lambda: opennpu.npu_rotary_mul_backward(X, X, R1, R1,
                                                                           "quarter"),
    }[op]
    msg = f"The rotary_mode of {op} should be half or interleave, but got quarter"
    with pytest.raises(RuntimeError) as info:
        call()
    # exactly torch_npu's text (a C++ backtrace, if TORCH_SHOW_CPP_STACKTRACES=1, follows it)
    assert str(info.value).splitlines()[0] == msg


def test_rejects_bad_x():
    _raises(lambda: opennpu.npu_rotary_mul(X.int(), R1, R1),
            "npu_rotary_mul: argument 'self'", "but got Int")
    _raises(lambda: opennpu.npu_rotary_mul(randn(2, 4, 3, 7), randn(1, 4, 1, 7), randn(1, 4, 1, 7)),
            "npu_rotary_mul: argument 'self'", "even last dim", "[2, 4, 3, 7]")


@pytest.mark.parametrize("arg,r1,r2", [
    ("r1", (1, 5, 1, 8), (1, 4, 1, 8)),
    ("r2", (1, 4, 1, 8), (1, 4, 1, 4)),
    ("r1", (1, 1, 4, 1, 8), (1, 4, 1, 8)),
    ("r2", (1, 4, 1, 8), (3, 4, 1, 8)),
], ids=["r1-S", "r2-D", "r1-rank", "r2-B"])
def test_rejects_non_broadcastable_r(arg, r1, r2):
    _raises(lambda: opennpu.npu_rotary_mul(X, randn(*r1), randn(*r2)),
            f"npu_rotary_mul: argument '{arg}' must broadcast to the shape of 'self'")
    _raises(lambda: opennpu.npu_rotary_mul_backward(X, X, randn(*r1), randn(*r2)),
            f"npu_rotary_mul_backward: argument '{arg}' must broadcast")


def test_rejects_bad_r_dtype():
    _raises(lambda: opennpu.npu_rotary_mul(X, R1.long(), R1),
            "npu_rotary_mul: argument 'r1'", "Long")


@pytest.mark.parametrize("shape", [(8, 10), (8,), (4, 4), (2, 8, 8)], ids=str)
def test_rejects_bad_rotate_shape(shape):
    _raises(lambda: opennpu.npu_rotary_mul(X, R1, R1, rotate=randn(*shape)),
            "npu_rotary_mul: argument 'rotate' must be a [D, D] = [8, 8] matrix")


def test_rejects_bad_rotate_dtype():
    _raises(lambda: opennpu.npu_rotary_mul(X, R1, R1, rotate=torch.eye(8, dtype=torch.int32)),
            "npu_rotary_mul: argument 'rotate'", "Int")


def test_backward_rejects_wrong_grad():
    _raises(lambda: opennpu.npu_rotary_mul_backward(randn(2, 4, 3, 6), X, R1, R1),
            "npu_rotary_mul_backward: argument 'grad' must have the shape of 'self'",
            "[2, 4, 3, 8]", "[2, 4, 3, 6]")
    _raises(lambda: opennpu.npu_rotary_mul_backward(X.int(), X, R1, R1),
            "npu_rotary_mul_backward: argument 'grad'", "Int")


@pytest.mark.parametrize("case", ["2-D x", "5-D x", "r 111D", "r 1NSD", "TND r 11D", "D 896",
                                  "r1 r2 differ", "fp64"])
def test_strict_mode_rejects_ascend_unsupported(case):
    calls = {
        "2-D x": (lambda: opennpu.npu_rotary_mul(*make((6, 8))), "'self'"),
        "5-D x": (lambda: opennpu.npu_rotary_mul(*make((2, 2, 3, 4, 8), (1, 1, 3, 1, 8))),
                  "'self'"),
        "r 111D": (lambda: opennpu.npu_rotary_mul(*make((2, 3, 4, 8), (1, 1, 1, 8))), "'r1'"),
        "r 1NSD": (lambda: opennpu.npu_rotary_mul(*make((2, 3, 4, 8), (1, 3, 4, 8))), "'r1'"),
        "TND r 11D": (lambda: opennpu.npu_rotary_mul(*make((5, 3, 8), (1, 1, 8))), "'r1'"),
        "D 896": (lambda: opennpu.npu_rotary_mul(*make((1, 2, 1, 896), (1, 2, 1, 896))),
                  "'self'"),
        "r1 r2 differ": (lambda: opennpu.npu_rotary_mul(randn(2, 3, 4, 8), randn(1, 1, 4, 8),
                                                        randn(2, 3, 4, 8)), "'r2'"),
        "fp64": (lambda: opennpu.npu_rotary_mul(*make((2, 3, 4, 8), (1, 1, 4, 8), F64)),
                 "'self'"),
    }
    call, arg = calls[case]
    call()  # accepted by default
    with opennpu.strict(True):
        _raises(call, f"npu_rotary_mul: argument {arg}", "strict mode")
    call()


def test_strict_mode_accepts_documented_patterns():
    with opennpu.strict(True):
        for layout, pattern in PATTERNS:
            x_shape = layout_shape(layout, D=128)
            for dtype in (F32, BF16, torch.float16):
                x, r1, r2 = make(x_shape, pattern_shape(x_shape, pattern), dtype)
                opennpu.npu_rotary_mul(x, r1, r2)
                opennpu.npu_rotary_mul_backward(torch.randn_like(x), x, r1, r2, "interleave")


# ----------------------------------------------------------------------------- seed 000


def torch_func(x, r1, r2):
    """Seed 000's native code for npu_rotary_mul."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    x_new = torch.cat((-x2, x1), dim=-1)
    return r1 * x + r2 * x_new


@pytest.mark.parametrize("s", [64, 8192], ids=["S64", "S8192-seed-shape"])
def test_seed_rotary_mul_equals_torch_func(s):
    x = torch.rand([2, s, 5, 128])
    r1, r2 = torch.rand([1, s, 1, 128]), torch.rand([1, s, 1, 128])
    got = opennpu.npu_rotary_mul(x, r1, r2)
    assert_close(got, torch_func(x, r1, r2))


# ----------------------------------------------------------------------------- seed 004


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_seed_llama_rotary_replacement(dtype):
    # Example one: q, k = q*cos + rotate_half(q)*sin, k*cos + rotate_half(k)*sin
    #          ->  q = npu_rotary_mul(q, cos, sin); k = npu_rotary_mul(k, cos, sin)
    b, n, s, d = 2, 4, 6, 16
    q, k = randn(b, n, s, d, dtype=dtype), randn(b, n, s, d, dtype=dtype)
    freqs = torch.outer(torch.arange(s, dtype=F32), 1.0 / 10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat((freqs, freqs), dim=-1)[None, None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    leaves = [t.requires_grad_() for t in (q, k, cos, sin)]
    native_leaves = leaf_copies(leaves, F32)

    def native_fn(q, k, cos, sin):
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)

    def npu_fn(q, k, cos, sin):
        return opennpu.npu_rotary_mul(q, cos, sin), opennpu.npu_rotary_mul(k, cos, sin)

    grads_out = (torch.randn(b, n, s, d, dtype=dtype), torch.randn(b, n, s, d, dtype=dtype))
    for got, want in zip(npu_fn(*leaves), native_fn(*native_leaves)):
        assert_close(got, want)  # native run in fp32 on the same values = the oracle
    ours = grads_of(npu_fn, leaves, grads_out)
    want = grads_of(native_fn, native_leaves, grads_out)
    for name, g, w in zip(("dq", "dk", "dcos", "dsin"), ours, want):
        # dcos/dsin sum over B, N and both q and k
        assert_close(g, w, dtype=dtype, scale=1 if name in ("dq", "dk") else 8, msg=name)


def apply_rotary(x1, x2, cos, sin, conj):
    """flash-attn's rotary_emb.apply_rotary (out-of-place): conj=True uses -sin."""
    if conj:
        sin = -sin
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


def test_seed_flash_attn_rotary_replacement():
    # Example two: qkv is [S, 3, H, headdim]; the first rotary_dim channels of q are rotated with
    # cos/sin of shape [S, rotary_dim / 2] rearranged "s d -> s 1 d".
    s, h, headdim, rotary_dim = 6, 4, 24, 16
    qkv = randn(s, 3, h, headdim)
    freqs = torch.outer(torch.arange(s, dtype=F32), torch.rand(rotary_dim // 2))
    cos, sin = freqs.cos(), freqs.sin()
    cos_b, sin_b = cos[:, None, :], sin[:, None, :]  # rearrange(cos, "s d -> s 1 d")

    # forward: apply_rotary(q1, q2, cos, sin, False) == npu_rotary_mul(slice, cat(cos, cos), ...)
    q1, q2 = qkv[:, 0, :, :rotary_dim].chunk(2, dim=-1)
    want = torch.cat(apply_rotary(q1, q2, cos_b, sin_b, False), dim=-1)
    r1 = torch.cat((cos, cos), dim=-1)[:, None, :]  # [S, 1, rotary_dim]: the TND "T1D" pattern
    r2 = torch.cat((sin, sin), dim=-1)[:, None, :]
    x = qkv[:, 0, :, :rotary_dim]
    assert not x.is_contiguous()
    assert_close(opennpu.npu_rotary_mul(x, r1, r2), want)

    # backward: the gradient flowing into the slice is the adjoint of the rotation, i.e.
    # apply_rotary(..., conj=True) of the incoming gradient.
    qkv_leaf = qkv.clone().requires_grad_()
    out = opennpu.npu_rotary_mul(qkv_leaf[:, 0, :, :rotary_dim], r1, r2)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv_leaf, dout)
    d1, d2 = dout.chunk(2, dim=-1)
    adjoint = torch.cat(apply_rotary(d1, d2, cos_b, sin_b, True), dim=-1)
    assert_close(dqkv[:, 0, :, :rotary_dim], adjoint)
    assert dqkv[:, 0, :, rotary_dim:].abs().max() == 0 and dqkv[:, 1:].abs().max() == 0
    # The seed replaces the backward by `dq = -npu_rotary_mul(dq, cos, sin)`. That is not the
    # adjoint (it negates the cos term), so it does not reproduce flash-attn's conj=True result;
    # opennpu's backward therefore applies the transpose r1*g + rotate^T(r2*g) instead.
    seed_backward = -opennpu.npu_rotary_mul(dout, r1, r2)
    assert max_err(seed_backward, adjoint) > 0.1
    # ... whereas rotating by the conjugate (sin -> -sin) is the adjoint.
    assert_close(opennpu.npu_rotary_mul(dout, r1, -r2), adjoint)


def test_bf16_rounding_is_exactly_torchs():
    """bf16 results are rounded once, to nearest even, exactly as torch rounds float32. With
    r2 = 0 the half rotation is x * r1, a product two bf16 values make exactly in float32, so the
    output must equal torch's rounding of it bit for bit: ties, and products small enough to be
    float32 subnormals, over lengths that end mid-vector (the shared bf16 store, common/vec.h)."""
    g = torch.Generator().manual_seed(0)

    def spread(*shape):  # signs and exponents from 2^-70 to 2^10, so some products are subnormal
        mag = torch.exp2(torch.randint(-70, 10, shape, generator=g).float())
        return (torch.randn(*shape, generator=g) * mag).to(torch.bfloat16)

    for d in (64, 38):
        x, r1 = spread(3, 8, 2, d), spread(1, 8, 1, d)
        want = (x.float() * r1.float()).to(torch.bfloat16)
        assert (want.float().abs() < torch.finfo(torch.bfloat16).tiny).any()  # subnormals occur
        got = opennpu.npu_rotary_mul(x, r1, torch.zeros_like(r1))
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), d
