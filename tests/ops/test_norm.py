"""RMSNorm family: npu_rms_norm (+ npu_rms_norm_backward), npu_gemma_rms_norm, npu_add_rms_norm.

Contract: shared/spec/torch_npu_api.md sections 1.1 and 1.2; seed 000 section
torch_npu.npu_rms_norm.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

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
    check_outputs,
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

F32 = torch.float32


def acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- op table
# Every forward op of the family as (ours, reference, native) over a uniform argument list
# `xs + [gamma]`, so parity, size and hypothesis tests loop over the family instead of repeating.


@dataclass(frozen=True)
class NormOp:
    name: str
    n_x: int  # number of x-like inputs before gamma
    ours: Callable
    ref: Callable
    native: Callable  # the eager composition in the input dtype: returns outputs[0] (and x)

    def make(self, shape, gamma_shape=None, dtype=F32, gamma_dtype=None):
        gamma_shape = gamma_shape or shape[-1:]
        xs = [randn(*shape, dtype=dtype) for _ in range(self.n_x)]
        return xs + [randn(*gamma_shape, dtype=gamma_dtype or dtype)]

    def out_dtypes(self, x_dtype):
        return (x_dtype, acc(x_dtype), x_dtype)[: 3 if self.n_x == 2 else 2]


RMS = NormOp("npu_rms_norm", 1, opennpu.npu_rms_norm, R.rms_norm,
             lambda x, g, eps=1e-6: (R.native_rms_norm(x, g, eps),))
GEMMA = NormOp("npu_gemma_rms_norm", 1, opennpu.npu_gemma_rms_norm, R.gemma_rms_norm,
               lambda x, g, eps=1e-6: (R.native_rms_norm(x, 1 + g, eps),))
ADD = NormOp("npu_add_rms_norm", 2, opennpu.npu_add_rms_norm, R.add_rms_norm,
             lambda a, b, g, eps=1e-6: R.native_add_rms_norm(a, b, g, eps))
NORM_OPS = [RMS, GEMMA, ADD]
norm_ops = pytest.mark.parametrize("op", NORM_OPS, ids=lambda o: o.name)


def check_parity(op: NormOp, inputs, eps=1e-6):
    """Outputs match the fp32 oracle; rstd is compared with the accumulator dtype's tolerance."""
    outs = op.ours(*inputs, epsilon=eps)
    refs = op.ref(*inputs, epsilon=eps)
    dtype = inputs[0].dtype
    check_outputs(outs, refs, op.out_dtypes(dtype))
    return outs, refs


# ----------------------------------------------------------------------------- parity


@norm_ops
@pytest.mark.parametrize("shape,gamma_shape", [((2, 3, 8), None), ((5, 83), None),
                                                ((2, 3, 4, 8), (4, 8))],
                         ids=["3d", "odd", "gamma2d"])
def test_forward_matches_reference(op, dtype, shape, gamma_shape):
    check_parity(op, op.make(shape, gamma_shape, dtype))


@norm_ops
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_low_precision_not_worse_than_native(op, dtype):
    inputs = op.make((16, 256), dtype=dtype)
    outs, refs = check_parity(op, inputs)
    native = op.native(*inputs)
    for i, nat in enumerate(native):
        j = 0 if i == 0 else 2  # native returns (y,) or (y, x)
        assert_not_worse_than_native(outs[j], nat, refs[j])


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", [RMS, GEMMA], ids=lambda o: o.name)
def test_low_precision_x_with_fp32_gamma(op, dtype):
    x, gamma = randn(4, 5, 64, dtype=dtype), randn(64)
    y, rstd = op.ours(x, gamma)
    assert y.dtype == dtype and rstd.dtype == F32
    y_ref, rstd_ref = op.ref(x, gamma)
    assert_close(y, y_ref)
    assert_close(rstd, rstd_ref)


@pytest.mark.parametrize("dtype", [F32, torch.float16, torch.bfloat16, torch.float64],
                         ids=dtype_id)
def test_add_rms_norm_sum_rounded_to_input_dtype(dtype):
    # torch_npu's golden adds in the input dtype: x is exactly x1 + x2 in x1's dtype.
    x1, x2, gamma = ADD.make((6, 40), dtype=dtype)
    _, _, x = opennpu.npu_add_rms_norm(x1, x2, gamma)
    torch.testing.assert_close(x, x1 + x2, rtol=0, atol=0)



@pytest.mark.parametrize("dtype", [F32, torch.float16, torch.bfloat16, torch.float64],
                         ids=dtype_id)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (4, 31), (2, 33), (3, 64), (5, 83), (2, 1000),
                                   (2, 4097), (0, 16)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
def test_add_rms_norm_is_rms_norm_of_its_sum_bit_for_bit(dtype, shape, streamed,
                                                         stream_threshold):
    # The kernel sums the squares of x while it adds x1 + x2 (one pass over the inputs) and, where
    # x streams, copies x out of an L1 row in the pass that writes y. Both must give what the two
    # steps give: the sum x, then npu_rms_norm of x (the same rounded values, summed in the same
    # order), in and out of place, at every row length (vector tails, rows of partial lines).
    x1, x2, gamma = ADD.make(shape, dtype=dtype)
    stream_threshold(0 if streamed else NEVER)
    y, rstd, x = opennpu.npu_add_rms_norm(x1, x2, gamma)
    assert_same_bits([x], [x1 + x2])
    assert_same_bits([y, rstd], opennpu.npu_rms_norm(x, gamma))
    b = x2.clone()
    assert_same_bits(_inplace(x1, b, gamma), [y, rstd])
    assert_same_bits([b], [x])
    # a non-contiguous x1 (read through a copy) and x1 == x2
    wide = torch.cat([x1, x1], dim=-1)[..., : shape[-1]]
    assert_same_bits(opennpu.npu_add_rms_norm(wide, x2, gamma), [y, rstd, x])
    y2, rstd2, x2x = opennpu.npu_add_rms_norm(x1, x1, gamma)
    assert_same_bits([y2, rstd2], opennpu.npu_rms_norm(x2x, gamma))


# ----------------------------------------------------------------------------- sizes & layouts


@norm_ops
@pytest.mark.parametrize("shape", [(0, 8), (2, 0, 8), (1, 1), (3, 7), (3, 83), (2, 769),
                                   (2, 5125), (64, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_sizes(op, shape):
    check_parity(op, op.make(shape))


# ----------------------------------------------------------------------------- streaming stores
# Outputs at least stream_min_bytes large are written with non-temporal stores (whole cache lines;
# each row's partial lines with ordinary stores). The values must be the same bits either way.
# (stream_threshold: tests/conftest.py.)

NEVER = 2**62
BITS = {F32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
        torch.bfloat16: torch.int16}


def assert_same_bits(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.contiguous().view(BITS[g.dtype]), w.contiguous().view(BITS[w.dtype]))


def test_stream_threshold_setting(stream_threshold):
    assert torch.ops.opennpu._last_level_cache_bytes() >= 0
    default = stream_threshold(123)
    assert default > 0  # the last-level cache, or 16 MiB where the system does not say
    assert stream_threshold(-1) == 123
    assert stream_threshold(-1) == default


@norm_ops
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, torch.float16, torch.float64],
                         ids=dtype_id)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 83), (4, 64), (3, 1000), (2, 4099),
                                   (2, 3, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_streamed_outputs_have_the_same_bits(op, dtype, shape, stream_threshold):
    inputs = op.make(shape, dtype=dtype)
    stream_threshold(NEVER)
    plain = op.ours(*inputs)
    stream_threshold(0)  # every output streams
    # `plain` stays alive, so the streamed outputs are other buffers: a store left out shows.
    assert_same_bits(op.ours(*inputs), plain)
    assert_same_bits(plain, op.ours(*inputs))


@norm_ops
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_streamed_outputs_non_contiguous_inputs(op, layout, stream_threshold):
    inputs = [non_contiguous(t.shape, layout) for t in op.make((6, 5, 40))]
    stream_threshold(NEVER)
    plain = op.ours(*inputs)
    stream_threshold(0)
    assert_same_bits(op.ours(*inputs), plain)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=dtype_id)
def test_outputs_above_and_below_the_stream_threshold(dtype, stream_threshold):
    n = 520  # rows of 2080 / 1040 bytes: not whole cache lines
    cases = [(op, op.make((rows, n), dtype=dtype)) for op in (RMS, ADD) for rows in (4, 64)]
    stream_threshold(NEVER)
    plain = [op.ours(*xs) for op, xs in cases]
    stream_threshold(16 * n * dtype.itemsize)  # 4 rows store normally, 64 rows stream
    for (op, xs), want in zip(cases, plain):
        assert_same_bits(op.ours(*xs), want)
        check_parity(op, xs)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=dtype_id)
def test_large_low_precision(dtype):
    check_parity(RMS, RMS.make((64, 4096), dtype=dtype))


@norm_ops
def test_empty_normalised_dims_give_defined_rstd(op):
    eps = 1e-6
    outs = op.ours(*op.make((37, 0)), epsilon=eps)
    assert outs[0].shape == (37, 0) and outs[1].shape == (37, 1)
    rstd = outs[1]
    assert torch.isnan(rstd).all() or torch.allclose(rstd, torch.full_like(rstd, eps ** -0.5)), (
        f"rstd is neither NaN nor 1/sqrt(eps): {rstd.flatten()[:4].tolist()} ...")


def non_contiguous(shape, layout):
    """A non-contiguous tensor of `shape`: all dims reversed in memory, or every other element of
    the last dim (1-D tensors are always sliced)."""
    if layout == "transposed" and len(shape) > 1:
        return randn(*reversed(shape)).permute(*reversed(range(len(shape))))
    return randn(*shape[:-1], 2 * shape[-1])[..., ::2]


@norm_ops
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_non_contiguous_inputs(op, layout):
    inputs = [non_contiguous(t.shape, layout) for t in op.make((6, 5, 24))]
    assert not any(t.is_contiguous() for t in inputs)
    check_parity(op, inputs)


@pytest.mark.parametrize("x2_shape", [(24,), (1, 5, 24), (6, 1, 24), (5, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_add_rms_norm_broadcast_x2(x2_shape):
    x1, gamma, x2 = randn(6, 5, 24), randn(24), randn(*x2_shape)
    y, rstd, x = opennpu.npu_add_rms_norm(x1, x2, gamma)
    assert y.shape == x.shape == x1.shape
    check_outputs((y, rstd, x), R.add_rms_norm(x1, x2, gamma), (F32, F32, F32))


# ----------------------------------------------------------------------------- output contract


@pytest.mark.parametrize("x_shape,gamma_shape,rstd_shape", [
    ((2, 3, 4, 8), (8,), (2, 3, 4, 1)),
    ((2, 3, 4, 8), (4, 8), (2, 3, 1, 1)),
    ((2, 3, 4, 8), (2, 3, 4, 8), (1, 1, 1, 1)),
    ((8,), (8,), (1,)),
])
@pytest.mark.parametrize("op", NORM_OPS, ids=lambda o: o.name)
def test_output_shapes_and_dtypes(op, x_shape, gamma_shape, rstd_shape):
    for dtype in (torch.bfloat16, F32):
        outs = op.ours(*op.make(x_shape, gamma_shape, dtype))
        assert len(outs) == (3 if op is ADD else 2)
        assert outs[0].shape == x_shape and outs[0].dtype == dtype
        assert outs[1].shape == rstd_shape and outs[1].dtype == F32
        if op is ADD:
            assert outs[2].shape == x_shape and outs[2].dtype == dtype


@pytest.mark.parametrize("x_dtype,gamma_dtype", [(torch.bfloat16, torch.bfloat16),
                                                 (torch.float16, F32), (F32, F32)],
                         ids=["bf16", "fp16-fp32gamma", "fp32"])
def test_backward_output_contract(x_dtype, gamma_dtype):
    x, gamma = randn(3, 4, 16, dtype=x_dtype), randn(4, 16, dtype=gamma_dtype)
    _, rstd = opennpu.npu_rms_norm(x, gamma)
    dx, dgamma = opennpu.npu_rms_norm_backward(torch.randn_like(x), x, gamma, rstd)
    assert dx.shape == x.shape and dx.dtype == x_dtype
    assert dgamma.shape == gamma.shape and dgamma.dtype == F32


# ----------------------------------------------------------------------------- backward values


@pytest.mark.parametrize("shape,gamma_shape", [((3, 5, 16), (16,)), ((4, 3, 8), (3, 8)),
                                                ((0, 16), (16,)), ((2, 769), (769,))],
                         ids=["3d", "gamma2d", "empty", "odd"])
def test_backward_op_matches_reference(dtype, shape, gamma_shape):
    x, gamma = randn(*shape, dtype=dtype), randn(*gamma_shape, dtype=dtype)
    dy = torch.randn_like(x)
    _, rstd = opennpu.npu_rms_norm(x, gamma)
    dx, dgamma = opennpu.npu_rms_norm_backward(dy, x, gamma, rstd)
    dx_ref, dgamma_ref = R.rms_norm_backward(dy, x, gamma, rstd)
    assert_close(dx, dx_ref)
    # dgamma sums over rows of rounded products: allow a few units more.
    assert_close(dgamma, dgamma_ref, scale=4)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", NORM_OPS, ids=lambda o: o.name)
def test_autograd_matches_reference_autograd(op, dtype):
    inputs = [t.requires_grad_() for t in op.make((6, 32), dtype=dtype)]
    if op is ADD:  # x2 broadcasts: its gradient is summed over the rows
        inputs[1] = randn(32, dtype=dtype, requires_grad=True)
    grad_out = (torch.randn(6, 32, dtype=dtype), None, torch.randn(6, 32, dtype=dtype))
    grad_out = grad_out[: len(op.out_dtypes(dtype))]

    ours = grads_of(op.ours, inputs, grad_out)
    ref = grads_of(op.ref, leaf_copies(inputs), grad_out)
    for i, (g, r) in enumerate(zip(ours, ref)):
        assert g.dtype == dtype and g.shape == inputs[i].shape
        assert_close(g, r, scale=4 if g.dim() == 1 else 1, msg=f"grad of input {i}")


@pytest.mark.parametrize("op", [RMS, GEMMA], ids=lambda o: o.name)
def test_autograd_low_precision_x_with_fp32_gamma(op):
    x = randn(6, 32, dtype=torch.bfloat16, requires_grad=True)
    gamma = randn(32, requires_grad=True)
    dy = torch.randn(6, 32, dtype=torch.bfloat16)
    gx, ggamma = grads_of(lambda a, b: op.ours(a, b)[0], [x, gamma], dy)
    rx, rgamma = grads_of(lambda a, b: op.ref(a, b)[0], leaf_copies([x, gamma]), dy)
    assert gx.dtype == torch.bfloat16 and ggamma.dtype == F32
    assert_close(gx, rx)
    assert_close(ggamma, rgamma, scale=4)  # fp32 sums of the same bf16 products


def test_autograd_honours_needs_input_grad():
    x, gamma = randn(4, 8, requires_grad=True), randn(8)
    y, rstd = opennpu.npu_rms_norm(x, gamma)
    assert not rstd.requires_grad
    (gx,) = torch.autograd.grad(y.sum(), [x])
    assert gx.shape == x.shape and gamma.grad is None


@norm_ops
@pytest.mark.parametrize("gamma_shape", [(6,), (3, 6)], ids=["gamma1d", "gamma2d"])
def test_gradcheck_float64(op, gamma_shape):
    inputs = [t.requires_grad_() for t in op.make((2, 3, 6), gamma_shape, torch.float64)]
    if op is ADD:
        inputs[1] = randn(3, 6, dtype=torch.float64, requires_grad=True)  # broadcast x2

        def fn(a, b, g):
            y, _, x = op.ours(a, b, g)
            return y, x
    else:

        def fn(x, g):
            return op.ours(x, g)[0]

    assert torch.autograd.gradcheck(fn, inputs)


# ----------------------------------------------------------------------------- opcheck


def _opcheck_samples(op: NormOp):
    samples = []
    for shape, gamma_shape, rg in [((3, 8), None, False), ((2, 3, 4, 8), (4, 8), True),
                                   ((0, 8), None, True)]:
        inputs = [t.requires_grad_(rg) for t in op.make(shape, gamma_shape)]
        samples.append((tuple(inputs), {"epsilon": 1e-5}))
    x = randn(8, 5).t().requires_grad_()  # non-contiguous
    samples.append((tuple([x] * op.n_x + [randn(8)]), {}))
    if op is ADD:  # broadcast x2
        samples.append(((randn(3, 8, requires_grad=True), randn(8, requires_grad=True),
                         randn(8, requires_grad=True)), {}))
    return samples


@norm_ops
def test_opcheck_forward(op):
    opcheck(getattr(torch.ops.npu, op.name).default, _opcheck_samples(op))


def test_opcheck_backward():
    samples = []
    for shape, gamma_shape, gamma_dtype in [((3, 8), (8,), F32), ((2, 3, 4), (3, 4), F32),
                                            ((3, 8), (8,), torch.float16)]:
        x, gamma = randn(*shape), randn(*gamma_shape, dtype=gamma_dtype)
        rstd = opennpu.npu_rms_norm(x, gamma.float())[1]
        samples.append(((torch.randn_like(x), x, gamma, rstd), {}))
    opcheck(torch.ops.npu.npu_rms_norm_backward.default, samples)


# ----------------------------------------------------------------------------- hypothesis


@settings(**SETTINGS)
@given(
    op=st.sampled_from(NORM_OPS),
    lead=st.lists(st.integers(0, 5), min_size=0, max_size=3),
    hidden=st.integers(1, 300),
    gamma_rank=st.integers(1, 2),
    eps=st.sampled_from([0.0, 1e-6, 1e-5, 1e-2]),
    dtype=st.sampled_from([F32, torch.bfloat16]),
)
def test_hypothesis_shape_sweep(op, lead, hidden, gamma_rank, eps, dtype):
    shape = (*lead, 3, hidden)
    gamma_shape = shape[len(shape) - gamma_rank:]
    inputs = op.make(shape, gamma_shape, dtype)
    outs, _ = check_parity(op, inputs, eps)
    dy = torch.randn_like(inputs[0])
    x = outs[2] if op is ADD else inputs[0]
    gamma = inputs[-1] + 1 if op is GEMMA else inputs[-1]
    dx, dgamma = opennpu.npu_rms_norm_backward(dy, x, gamma, outs[1])
    dx_ref, dgamma_ref = R.rms_norm_backward(dy, x, gamma, outs[1])
    assert_close(dx, dx_ref)
    assert_close(dgamma, dgamma_ref, scale=4)


# ----------------------------------------------------------------------------- torch.compile


def test_compile_fullgraph_dynamic_matches_eager():
    def block(x, res, gamma):
        h, _ = opennpu.npu_rms_norm(x, gamma)
        y, rstd, s = opennpu.npu_add_rms_norm(h, res, gamma, 1e-5)
        z, _ = opennpu.npu_gemma_rms_norm(s * 0.5, gamma)
        return y, z, rstd

    def make(shape):
        return [randn(*shape, requires_grad=True), randn(*shape, requires_grad=True),
                randn(shape[-1], requires_grad=True)]

    check_compiled_matches_eager(block, make, [(2, 4, 16), (3, 7, 24)])


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    def block(x, res, gamma):
        y, _, s = opennpu.npu_add_rms_norm(x * 2, res, gamma)
        z, _ = opennpu.npu_rms_norm(s + y, gamma)
        return (z,)

    def make(shape):
        return [randn(*shape, requires_grad=True), randn(*shape, requires_grad=True),
                randn(shape[-1], requires_grad=True)]

    check_compiled_matches_eager(block, make, [(3, 16), (5, 24)], backend="inductor", tol=1e-5)


# ----------------------------------------------------------------------------- bad input


def _raises(fn, *pieces):
    """fn raises RuntimeError whose message contains every piece, in order."""
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


@norm_ops
def test_rejects_integer_input(op):
    inputs = op.make((3, 8))
    inputs[0] = torch.ones(3, 8, dtype=torch.int32)
    arg = "x1" if op is ADD else "self"
    _raises(lambda: op.ours(*inputs), f"{op.name}: argument '{arg}'", "but got Int")


@norm_ops
@pytest.mark.parametrize("gamma_shape", [(7,), (2, 8), (3, 3, 8)], ids=str)
def test_rejects_wrong_gamma_shape(op, gamma_shape):
    inputs = op.make((3, 8))
    inputs[-1] = randn(*gamma_shape)
    _raises(lambda: op.ours(*inputs), f"{op.name}: argument 'gamma'", "trailing dims")


@norm_ops
def test_rejects_negative_epsilon(op):
    _raises(lambda: op.ours(*op.make((3, 8)), epsilon=-1e-6),
            f"{op.name}: argument 'epsilon' must be >= 0")


def test_add_rms_norm_rejects_non_broadcastable_x2():
    _raises(lambda: opennpu.npu_add_rms_norm(randn(3, 8), randn(2, 8), randn(8)),
            "npu_add_rms_norm: argument 'x2'", "broadcast")


def test_add_rms_norm_rejects_bad_x2():
    x1, gamma = randn(3, 8), randn(8)
    _raises(lambda: opennpu.npu_add_rms_norm(x1, randn(1, 3, 8), gamma),
            "npu_add_rms_norm: argument 'x2'", "broadcast")
    _raises(lambda: opennpu.npu_add_rms_norm(x1, randn(3, 8, dtype=torch.float16), gamma),
            "npu_add_rms_norm: argument 'x2'", "dtype")


def test_backward_rejects_bad_grad_and_rstd():
    x, gamma = randn(3, 8), randn(8)
    rstd = opennpu.npu_rms_norm(x, gamma)[1]
    _raises(lambda: opennpu.npu_rms_norm_backward(randn(3, 7), x, gamma, rstd),
            "npu_rms_norm_backward: argument 'dy'", "shape")
    _raises(lambda: opennpu.npu_rms_norm_backward(randn(3, 8), x, gamma, randn(4, 1)),
            "npu_rms_norm_backward: argument 'rstd'", "shape")
    _raises(lambda: opennpu.npu_rms_norm_backward(randn(3, 8), x, randn(7), rstd),
            "npu_rms_norm_backward: argument 'gamma'")
    _raises(lambda: opennpu.npu_rms_norm_backward(torch.ones(3, 8, dtype=torch.int64), x,
                                                  gamma, rstd),
            "npu_rms_norm_backward: argument 'dy'", "Long")


def test_double_backward_is_a_clear_error():
    x, gamma = randn(3, 8, requires_grad=True), randn(8, requires_grad=True)
    y, _ = opennpu.npu_rms_norm(x, gamma)
    (gx,) = torch.autograd.grad(y.sum(), [x], create_graph=True)
    _raises(lambda: gx.sum().backward(), "npu_rms_norm_backward", "double backward")


@pytest.mark.parametrize("case", ["fp32 x with fp16 gamma", "fp64 x", "9-D x",
                                  "add broadcast x2", "add empty x1", "add fp32 gamma"])
def test_strict_mode_rejects_ascend_unsupported(case):
    calls = {
        "fp32 x with fp16 gamma": (lambda: opennpu.npu_rms_norm(
            randn(3, 8), randn(8, dtype=torch.float16)), "npu_rms_norm: argument 'gamma'"),
        "fp64 x": (lambda: opennpu.npu_gemma_rms_norm(
            randn(3, 8, dtype=torch.float64), randn(8, dtype=torch.float64)),
            "npu_gemma_rms_norm: argument 'self'"),
        "9-D x": (lambda: opennpu.npu_rms_norm(randn(*[1] * 8, 8), randn(8)),
                  "npu_rms_norm: argument 'self'"),
        "add broadcast x2": (lambda: opennpu.npu_add_rms_norm(randn(3, 8), randn(8), randn(8)),
                             "npu_add_rms_norm: argument 'x2'"),
        "add empty x1": (lambda: opennpu.npu_add_rms_norm(randn(0, 8), randn(0, 8), randn(8)),
                         "npu_add_rms_norm: argument 'x1'"),
        "add fp32 gamma": (lambda: opennpu.npu_add_rms_norm(
            randn(3, 8, dtype=torch.float16), randn(3, 8, dtype=torch.float16), randn(8)),
            "npu_add_rms_norm: argument 'gamma'"),
    }
    call, prefix = calls[case]
    call()  # accepted by default
    with opennpu.strict(True):
        _raises(call, prefix, "strict mode")
    call()  # and accepted again once strict mode is left


def test_strict_mode_accepts_documented_dtype_pairs():
    with opennpu.strict(True):
        for x_dtype, g_dtype in [(torch.float16, F32), (torch.bfloat16, F32),
                                 (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
                                 (F32, F32)]:
            y, rstd = opennpu.npu_rms_norm(randn(2, 8, dtype=x_dtype), randn(8, dtype=g_dtype))
            assert y.dtype == x_dtype and rstd.dtype == F32


# ----------------------------------------------------------------------------- seed 000


class TorchRMSNorm(torch.nn.Module):
    """Seed 000's native module (nn.Parameter on CPU instead of .cuda())."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


class NpuRMSNorm(torch.nn.Module):
    """Seed 000's torch_npu replacement."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return opennpu.npu_rms_norm(x, self.weight, epsilon=self.eps)[0]


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=dtype_id)
def test_seed_rms_norm_module_replacement(dtype):
    x = torch.randn(128, 256, dtype=dtype)
    torch_mod, npu_mod = TorchRMSNorm(256).to(dtype), NpuRMSNorm(256).to(dtype)
    with torch.no_grad():
        w = torch.randn(256, dtype=dtype)
        torch_mod.weight.copy_(w)
        npu_mod.weight.copy_(w)
    expected, got = torch_mod(x), npu_mod(x)
    assert got.dtype == expected.dtype == dtype
    ref = R.rms_norm(x, w)[0]
    assert_close(got, ref)
    if dtype == F32:
        assert_close(got, expected)
    else:  # the native module rounds twice; the fused op at most as far from the oracle
        assert_not_worse_than_native(got, expected, ref)
    # and the module trains: gradients reach the weight
    npu_mod(x).float().square().mean().backward()
    assert npu_mod.weight.grad is not None and npu_mod.weight.grad.shape == (256,)


def test_seed_rms_norm_literal_weight_shape_normalises_both_dims():
    # The seed constructs both modules with dim=(128, 256). For torch_npu, gamma (128, 256) means
    # "normalise over the trailing two dims of x" (section 1.1), while TorchRMSNorm normalises each
    # row and only multiplies by the (128, 256) weight, so the two are different computations.
    x = torch.randn(128, 256)
    got = NpuRMSNorm((128, 256))(x)
    assert_close(got, x * torch.rsqrt(x.pow(2).mean() + 1e-6))
    assert max_err(got, TorchRMSNorm((128, 256))(x)) > 1e-2


# ----------------------------------------------------------------------------- add_rms_norm v2


@pytest.mark.parametrize("shape", [(3, 7, 83), (1, 1), (5, 769), (0, 16)], ids=str)
def test_add_rms_norm_v2_writes_y_and_x_in_place(dtype, shape):
    x1, x2 = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    gamma = (torch.rand(shape[-1]) + 0.5).to(dtype)
    y, rstd, x = opennpu.npu_add_rms_norm(x1, x2, gamma)
    a, b = x1.clone(), x2.clone()
    got_rstd = opennpu.npu_add_rms_norm_v2(a, b, gamma)
    assert got_rstd.dtype == torch.float32 and got_rstd.shape == rstd.shape
    assert torch.equal(a, y) and torch.equal(b, x)
    torch.testing.assert_close(got_rstd, rstd.float(), rtol=0, atol=0)
    ref_y, ref_rstd, ref_x = R.add_rms_norm(x1, x2, gamma)
    assert_close(a, ref_y)
    functional = opennpu.npu_add_rms_norm_v2_functional(x1, x2, gamma)
    assert [t.dtype for t in functional] == [torch.float32, dtype, dtype]
    torch.testing.assert_close(functional[0], got_rstd, rtol=0, atol=0)
    assert torch.equal(functional[1], y) and torch.equal(functional[2], x)


def test_add_rms_norm_v2_into_strided_views_and_on_npu():
    x1, x2, gamma = randn(33, 8).t(), randn(33, 8).t(), torch.rand(33) + 0.5  # [8, 33] views
    y, rstd, x = opennpu.npu_add_rms_norm(x1, x2, gamma)
    r = opennpu.npu_add_rms_norm_v2(x1, x2, gamma)
    assert torch.equal(x1, y) and torch.equal(x2, x) and torch.equal(r, rstd)
    a, b = randn(4, 16).to("npu"), randn(4, 16).to("npu")
    want = opennpu.npu_add_rms_norm(a.cpu(), b.cpu(), torch.ones(16))
    r = opennpu.npu_add_rms_norm_v2(a, b, torch.ones(16).to("npu"))
    assert r.device.type == "npu"
    assert torch.equal(a.cpu(), want[0]) and torch.equal(b.cpu(), want[2])


def test_add_rms_norm_v2_bad_inputs_and_no_gradient():
    x1, gamma = randn(4, 8), torch.ones(8)
    with pytest.raises(RuntimeError, match=re.escape("npu_add_rms_norm_v2: argument 'x2' must "
                                                     "have the shape of 'x1' ([4, 8]")):
        opennpu.npu_add_rms_norm_v2(x1, randn(8), gamma)
    with pytest.raises(RuntimeError, match="npu_add_rms_norm_v2_functional: argument 'x2' must "
                                           "have the shape"):
        opennpu.npu_add_rms_norm_v2_functional(x1, randn(1, 8), gamma)
    with pytest.raises(RuntimeError, match="argument 'gamma' must have the shape of trailing"):
        opennpu.npu_add_rms_norm_v2(x1, randn(4, 8), torch.ones(7))
    before = x1.clone()
    with pytest.raises(RuntimeError, match="npu_add_rms_norm_v2: not differentiable"):
        opennpu.npu_add_rms_norm_v2(x1, randn(4, 8), gamma.clone().requires_grad_())
    assert torch.equal(x1, before)  # refused before anything was written
    rstd, y, x = opennpu.npu_add_rms_norm_v2_functional(x1.requires_grad_(), randn(4, 8), gamma)
    with pytest.raises(RuntimeError, match="npu_add_rms_norm_v2_functional: not differentiable"):
        y.sum().backward()


def test_add_rms_norm_v2_opcheck_and_compile():
    samples = [((randn(3, 5, 16), randn(3, 5, 16), torch.rand(16) + 0.5), {}),
               ((randn(4, 33, dtype=torch.bfloat16), randn(4, 33, dtype=torch.bfloat16),
                 torch.rand(33) + 0.5, 1e-5), {})]
    opcheck(torch.ops.npu.npu_add_rms_norm_v2.default, samples)
    opcheck(torch.ops.npu.npu_add_rms_norm_v2_functional.default, samples)

    def fn(x1, x2, gamma):
        rstd = torch.ops.npu.npu_add_rms_norm_v2(x1, x2, gamma)
        return rstd, x1 * 2, x2

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (3, 7):
        inputs = [randn(rows, 16), randn(rows, 16), torch.rand(16) + 0.5]
        eager_in, comp_in = [t.clone() for t in inputs], [t.clone() for t in inputs]
        for got, want in zip(compiled(*comp_in), fn(*eager_in)):
            assert torch.equal(got, want)
        assert torch.equal(comp_in[0], eager_in[0]) and torch.equal(comp_in[1], eager_in[1])
    torch._dynamo.reset()


# ------------------------------------------------------------- opennpu::_add_rms_norm_inplace


_inplace = torch.ops.opennpu._add_rms_norm_inplace


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=dtype_id)
@pytest.mark.parametrize("shape", [(3, 7, 83), (1, 1), (5, 769), (0, 16), (2, 4096)], ids=str)
def test_add_rms_norm_inplace_writes_the_sum_into_x2(dtype, shape):
    x1, x2 = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    gamma = (torch.rand(shape[-1]) + 0.5).to(dtype)
    y, rstd, x = opennpu.npu_add_rms_norm(x1, x2, gamma, 1e-5)
    b, before = x2.clone(), x1.clone()
    got_y, got_rstd = _inplace(x1, b, gamma, 1e-5)
    assert torch.equal(b, x) and torch.equal(got_y, y) and torch.equal(got_rstd, rstd)
    assert got_y.dtype == dtype and got_rstd.dtype == rstd.dtype and got_rstd.shape == rstd.shape
    assert torch.equal(x1, before)
    # x1 + x2 commutes: the sum written into the other addend is the same bits
    a = x1.clone()
    got_y, _ = _inplace(x2, a, gamma, 1e-5)
    assert torch.equal(a, x) and torch.equal(got_y, y)


def test_add_rms_norm_inplace_streaming_sizes_x1_aliasing_and_npu():
    # over the streaming threshold: the in-place sum is stored normally, y still streams
    old = torch.ops.opennpu._set_stream_min_bytes(1024)
    try:
        x1, x2, gamma = randn(64, 256), randn(64, 256), torch.rand(256) + 0.5
        y, rstd, x = opennpu.npu_add_rms_norm(x1, x2, gamma)
        b = x2.clone()
        assert torch.equal(_inplace(x1, b, gamma)[0], y) and torch.equal(b, x)
        # x1 is x2 itself: x = 2 * x1
        c = x1.clone()
        y2, _, x2x = opennpu.npu_add_rms_norm(x1, x1, gamma)
        assert torch.equal(_inplace(c, c, gamma)[0], y2) and torch.equal(c, x2x)
    finally:
        torch.ops.opennpu._set_stream_min_bytes(old)
    # a non-contiguous x1 is read through a copy
    x1 = randn(33, 8).t()
    x2 = randn(8, 33)
    y, _, x = opennpu.npu_add_rms_norm(x1, x2, torch.ones(33))
    assert torch.equal(_inplace(x1, x2, torch.ones(33))[0], y) and torch.equal(x2, x)
    # an expanded x1 (another storage) is fine too
    e, f = randn(1, 33).expand(8, 33), randn(8, 33)
    y, _, x = opennpu.npu_add_rms_norm(e, f, torch.ones(33))
    assert torch.equal(_inplace(e, f, torch.ones(33))[0], y) and torch.equal(f, x)
    a, b = randn(4, 16).to("npu"), randn(4, 16).to("npu")
    want = opennpu.npu_add_rms_norm(a.cpu(), b.cpu(), torch.ones(16))
    got = _inplace(a, b, torch.ones(16).to("npu"))
    assert got[0].device.type == "npu"
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(b.cpu(), want[2])


def test_add_rms_norm_inplace_bad_inputs_and_no_gradient():
    x1, gamma = randn(4, 8), torch.ones(8)
    op = "_add_rms_norm_inplace"
    with pytest.raises(RuntimeError, match=re.escape(f"{op}: argument 'x2' must have the shape "
                                                     "of 'x1' ([4, 8]")):
        _inplace(x1, randn(8), gamma)
    with pytest.raises(RuntimeError, match=f"{op}: argument 'x2' must be contiguous"):
        _inplace(x1, randn(8, 4).t(), gamma)
    with pytest.raises(RuntimeError, match=f"{op}: argument 'x2' must be contiguous"):
        _inplace(x1, randn(1, 8).expand(4, 8), gamma)    # an expanded x2 overlaps itself
    base = randn(40)
    with pytest.raises(RuntimeError, match=f"{op}: argument 'x1' must be x2 itself or not share"):
        _inplace(base[:32].view(4, 8), base[8:].view(4, 8), gamma)
    with pytest.raises(RuntimeError, match=f"{op}: argument 'x2' must have the dtype"):
        _inplace(x1, randn(4, 8, dtype=torch.bfloat16), gamma)
    with pytest.raises(RuntimeError, match="argument 'gamma' must have the shape of trailing"):
        _inplace(x1, randn(4, 8), torch.ones(7))
    b = randn(4, 8)
    before = b.clone()
    with pytest.raises(RuntimeError, match=f"{op}: not differentiable"):
        _inplace(x1, b, gamma.clone().requires_grad_())
    assert torch.equal(b, before)  # refused before anything was written
    with torch.no_grad():
        _inplace(x1, b, gamma.clone().requires_grad_())   # no grad mode: runs


def test_add_rms_norm_inplace_opcheck_and_portable():
    from opennpu.ops import portable

    samples = [((randn(3, 5, 16), randn(3, 5, 16), torch.rand(16) + 0.5), {}),
               ((randn(4, 33, dtype=torch.bfloat16), randn(4, 33, dtype=torch.bfloat16),
                 (torch.rand(33) + 0.5).to(torch.bfloat16), 1e-5), {})]
    opcheck(_inplace.default, samples)
    x1, x2, g = randn(6, 40, dtype=torch.bfloat16), randn(6, 40, dtype=torch.bfloat16), \
        (torch.rand(40) + 0.5).to(torch.bfloat16)
    a = x2.clone()
    want = _inplace(x1, a, g)
    b = x2.clone()
    with portable.force():
        got = _inplace(x1, b, g)
    assert torch.equal(b, a)              # the sum: one bf16 rounding either way
    assert_close(got[0], want[0]) and assert_close(got[1], want[1])

    def fn(x1, x2, gamma):                # called in user code: functionalised, x2 written back
        y, rstd = _inplace(x1, x2, gamma)
        return y, rstd, x2 * 2

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (3, 7):
        inputs = [randn(rows, 16), randn(rows, 16), torch.rand(16) + 0.5]
        eager_in, comp_in = [t.clone() for t in inputs], [t.clone() for t in inputs]
        for got, want in zip(compiled(*comp_in), fn(*eager_in)):
            assert torch.equal(got, want)
        assert torch.equal(comp_in[1], eager_in[1])
    torch._dynamo.reset()
