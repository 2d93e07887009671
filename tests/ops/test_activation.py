"""Activation family: npu_swiglu (+ backward), npu_geglu (+ grad), fast_gelu / npu_fast_gelu
(+ npu_fast_gelu_backward).

Contract: shared/spec/torch_npu_api.md sections 1.6, 1.7, 1.12; seed 000 sections
torch_npu.npu_swiglu and torch_npu.fast_gelu.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
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

F32, F64 = torch.float32, torch.float64


def _up(t):
    return t if t.dtype == F64 else t.float()


# ----------------------------------------------------------------------------- GLU cases
# swiglu and the four geglu variants behind one interface: forward, reference, native
# composition, and the backward op, all taking (x, dim).


@dataclass(frozen=True)
class Glu:
    name: str
    geglu: dict = field(default_factory=dict)  # npu_geglu kwargs; empty = swiglu

    def __repr__(self):
        return self.name

    @property
    def op_name(self):
        return "npu_geglu" if self.geglu else "npu_swiglu"

    def ours(self, x, dim=-1):
        """Tuple of outputs: (out,) for swiglu, (out, gelu) for geglu."""
        if self.geglu:
            return opennpu.npu_geglu(x, dim, **self.geglu)
        return (opennpu.npu_swiglu(x, dim),)

    def ref(self, x, dim=-1):
        if self.geglu:
            return R.geglu(x, dim, **self.geglu)
        return (R.swiglu(x, dim),)

    def native(self, x, dim=-1):
        if self.geglu:
            return R.native_geglu(x, dim, **self.geglu)
        return R.native_swiglu(x, dim)

    def backward_op(self, grad, x, dim=-1):
        if self.geglu:
            gelu = opennpu.npu_geglu(x, dim, **self.geglu)[1]
            return opennpu.npu_geglu_grad(grad, x, gelu, dim, **self.geglu)
        return opennpu.npu_swiglu_backward(grad, x, dim)

    def ref_backward(self, grad, x, dim=-1):
        """d(sum(out * grad))/dx through the reference, in the accumulator dtype."""
        xa = _up(x).detach().requires_grad_()
        (dx,) = torch.autograd.grad(self.ref(xa, dim)[0], xa, _up(grad))
        return dx


SWIGLU = Glu("swiglu")
GLU_CASES = [
    SWIGLU,
    Glu("geglu_tanh", dict(approximate=1, activate_left=False)),
    Glu("geglu_erf", dict(approximate=0, activate_left=False)),
    Glu("geglu_tanh_left", dict(approximate=1, activate_left=True)),
    Glu("geglu_erf_left", dict(approximate=0, activate_left=True)),
]
glu_cases = pytest.mark.parametrize("glu", GLU_CASES, ids=repr)
FAST_GELUS = {"fast_gelu": opennpu.fast_gelu, "npu_fast_gelu": opennpu.npu_fast_gelu}
fast_gelus = pytest.mark.parametrize("name", list(FAST_GELUS))


def check_glu(glu: Glu, x, dim=-1):
    """Forward outputs and the backward op match the reference; returns the outputs."""
    outs, refs = glu.ours(x, dim), glu.ref(x, dim)
    for out, ref in zip(outs, refs, strict=True):
        assert out.dtype == x.dtype and out.shape == ref.shape
        assert_close(out, ref)
    grad = torch.randn_like(outs[0])
    dx = glu.backward_op(grad, x, dim)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert_close(dx, glu.ref_backward(grad, x, dim))
    return outs


def check_fast_gelu(name, x):
    y = FAST_GELUS[name](x)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, R.fast_gelu(x))
    grad = torch.randn_like(x)
    dx = opennpu.npu_fast_gelu_backward(grad, x)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert_close(dx, R.fast_gelu_backward(grad, x))
    return y


# ----------------------------------------------------------------------------- parity


@glu_cases
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_glu_matches_reference(glu, dtype, dim):
    check_glu(glu, randn(4, 6, 10, dtype=dtype), dim)


@fast_gelus
def test_fast_gelu_matches_reference(name, dtype):
    # a wide range: both tails of the sigmoid and the region around 0
    check_fast_gelu(name, (torch.randn(8, 33) * 4).to(dtype))


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
@glu_cases
def test_glu_low_precision_not_worse_than_native(glu, dtype):
    x = randn(32, 256, dtype=dtype) * 2
    for dim in (-1, 0):
        assert_not_worse_than_native(glu.ours(x, dim)[0], glu.native(x, dim), glu.ref(x, dim)[0])


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_fast_gelu_low_precision_not_worse_than_native(dtype):
    x = (torch.randn(64, 128) * 4).to(dtype)
    assert_not_worse_than_native(opennpu.fast_gelu(x), R.native_fast_gelu(x), R.fast_gelu(x))


# Saturation: exp overflows for |x| beyond ~88 (the fp16/bf16 path uses a polynomial exp and a
# reciprocal estimate); results must still follow the reference, NaN and inf included.
EXTREMES = [-1e4, -1000.0, -100.0, -89.0, -88.0, -30.0, -1.0, 0.0, 1.0, 30.0, 88.0, 100.0, 1e4,
            float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("dtype", [F32, *LOW_DTYPES], ids=dtype_id)
def test_activations_saturate_like_the_reference(dtype):
    x = torch.tensor(EXTREMES * 3, dtype=dtype)  # long enough to hit full vectors and a tail
    assert_close(opennpu.fast_gelu(x), R.fast_gelu(x))
    assert_close(opennpu.npu_fast_gelu_backward(torch.ones_like(x), x),
                 R.fast_gelu_backward(torch.ones_like(x), x))
    pairs = torch.stack([x, torch.full_like(x, 2.0)], dim=-1)  # gate | up
    for glu in GLU_CASES:
        for out, ref in zip(glu.ours(pairs), glu.ref(pairs), strict=True):
            assert_close(out, ref)


def test_geglu_approximate_selects_the_gelu_formula():
    # 1 = tanh approximation (default), 0 = exact erf; the two differ visibly at |x| ~ 2.
    x = torch.full((1, 2), 2.0)
    x[0, 0] = 1.0  # a = 1, b = 2
    _, g_default = opennpu.npu_geglu(x)
    _, g_tanh = opennpu.npu_geglu(x, approximate=1)
    _, g_erf = opennpu.npu_geglu(x, approximate=0)
    b = torch.tensor([2.0])
    torch.testing.assert_close(g_default, g_tanh, rtol=0, atol=0)
    assert_close(g_tanh.flatten(), F.gelu(b, approximate="tanh"))
    assert_close(g_erf.flatten(), F.gelu(b))
    assert (g_tanh - g_erf).abs().item() > 1e-5


def test_geglu_activate_left_selects_the_gated_half():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    x = torch.cat([a, b], dim=-1)
    out_r, gelu_r = opennpu.npu_geglu(x, activate_left=False)
    out_l, gelu_l = opennpu.npu_geglu(x, activate_left=True)
    assert_close(gelu_r, F.gelu(b, approximate="tanh"))
    assert_close(out_r, a * F.gelu(b, approximate="tanh"))
    assert_close(gelu_l, F.gelu(a, approximate="tanh"))
    assert_close(out_l, F.gelu(a, approximate="tanh") * b)


def test_fast_gelu_aliases_agree():
    x = torch.randn(5, 17)
    torch.testing.assert_close(opennpu.fast_gelu(x), opennpu.npu_fast_gelu(x), rtol=0, atol=0)


# ----------------------------------------------------------------------------- sizes & layouts


@glu_cases
@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (3, 2), (3, 14), (3, 166), (2, 1538),
                                   (2, 10250), (64, 4096)],
                         ids=lambda s: "x".join(map(str, s)))
def test_glu_sizes(glu, shape):
    # halves of 1, 7, 83, 769 and 5125 along the last dim; empty rows and an empty split dim
    check_glu(glu, randn(*shape))


BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
        torch.bfloat16: torch.int16}


@glu_cases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64],
                         ids=dtype_id)
@pytest.mark.parametrize("shape,dim", [((3, 14), -1), ((5, 166), -1), ((3, 2050), -1),
                                       ((4, 6, 10), 1), ((10, 6), 0)],
                         ids=["3x14", "5x166", "3x2050", "mid-dim", "dim0"])
def test_glu_streamed_outputs_have_the_same_bits(glu, dtype, shape, dim, stream_threshold):
    # Outputs of stream_min_bytes and more are written with streaming stores (whole lines; head
    # and tail of each run with ordinary stores); 0 streams every output here.
    x = randn(*shape, dtype=dtype)
    stream_threshold(2**62)
    plain = glu.ours(x, dim)
    stream_threshold(0)
    for got, want in zip(glu.ours(x, dim), plain, strict=True):  # `plain` alive: other buffers
        assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype]))


@glu_cases
def test_glu_large_low_precision(glu):
    check_glu(glu, randn(64, 4096, dtype=torch.bfloat16))


@fast_gelus
@pytest.mark.parametrize("shape", [(), (0,), (1,), (7,), (83,), (3, 769), (5125,), (64, 4096)],
                         ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_fast_gelu_sizes(name, shape):
    check_fast_gelu(name, randn(*shape))


@glu_cases
@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_glu_non_contiguous(glu, dim, layout):
    x = randn(10, 6).t() if layout == "transposed" else randn(6, 20)[:, ::2]
    assert not x.is_contiguous()
    check_glu(glu, x, dim)


@fast_gelus
def test_fast_gelu_non_contiguous(name):
    x = randn(10, 6, 4).permute(2, 0, 1)[:, ::2]
    assert not x.is_contiguous()
    check_fast_gelu(name, x)


def test_glu_split_on_middle_dim_of_4d():
    # outer = 2*3 rows, inner block = 5*7 elements per half
    check_glu(GLU_CASES[1], randn(2, 3, 10, 7), dim=2)
    check_glu(SWIGLU, randn(2, 3, 10, 7), dim=-2)


# ----------------------------------------------------------------------------- output contract


@glu_cases
@pytest.mark.parametrize("dim,out_shape", [(-1, (4, 6, 5)), (0, (2, 6, 10)), (1, (4, 3, 10)),
                                           (-3, (2, 6, 10))])
def test_glu_output_shapes_and_dtypes(glu, dim, out_shape):
    for dtype in (torch.bfloat16, torch.float16, F32):
        x = randn(4, 6, 10, dtype=dtype)
        outs = glu.ours(x, dim)
        assert len(outs) == (2 if glu.geglu else 1)
        for out in outs:
            assert out.shape == out_shape and out.dtype == dtype
        dx = glu.backward_op(torch.randn(out_shape, dtype=dtype), x, dim)
        assert dx.shape == x.shape and dx.dtype == dtype


def test_swiglu_default_dim_is_last():
    x = torch.randn(4, 6)
    torch.testing.assert_close(opennpu.npu_swiglu(x), opennpu.npu_swiglu(x, dim=-1), rtol=0,
                               atol=0)
    torch.testing.assert_close(torch.ops.npu.npu_swiglu(x), opennpu.npu_swiglu(x, -1), rtol=0,
                               atol=0)


# ----------------------------------------------------------------------------- gradients


@glu_cases
@pytest.mark.parametrize("dim", [-1, 0])
def test_glu_gradcheck_float64(glu, dim):
    x = randn(4, 6, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: glu.ours(t, dim)[0], [x])


@fast_gelus
def test_fast_gelu_gradcheck_float64(name):
    x = (torch.randn(3, 5, dtype=F64) * 3).requires_grad_()
    assert torch.autograd.gradcheck(FAST_GELUS[name], [x])


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
@glu_cases
def test_glu_autograd_matches_reference_autograd(glu, dtype):
    x = randn(6, 3, 16, dtype=dtype, requires_grad=True)
    for dim in (-1, 0):
        grad = torch.randn_like(glu.ours(x, dim)[0])
        (ours,) = grads_of(lambda t: glu.ours(t, dim)[0], [x], grad)
        (ref,) = grads_of(lambda t: glu.ref(t, dim)[0], leaf_copies([x]), grad)
        assert ours.dtype == dtype
        assert_close(ours, ref)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
@fast_gelus
def test_fast_gelu_autograd_matches_reference_autograd(name, dtype):
    x = (torch.randn(6, 40) * 3).to(dtype).requires_grad_()
    grad = torch.randn_like(x)
    (ours,) = grads_of(FAST_GELUS[name], [x], grad)
    (ref,) = grads_of(R.fast_gelu, leaf_copies([x]), grad)
    assert ours.dtype == dtype
    assert_close(ours, ref)


def test_geglu_gelu_output_is_not_differentiable():
    x = randn(3, 8, requires_grad=True)
    out, gelu = opennpu.npu_geglu(x)
    assert out.requires_grad and not gelu.requires_grad


@pytest.mark.parametrize("forward,backward_name", [
    (lambda x: opennpu.npu_swiglu(x), "npu_swiglu_backward"),
    (lambda x: opennpu.npu_geglu(x)[0], "npu_geglu_grad"),
    (lambda x: opennpu.fast_gelu(x), "npu_fast_gelu_backward"),
], ids=["swiglu", "geglu", "fast_gelu"])
def test_double_backward_is_a_clear_error(forward, backward_name):
    x = randn(3, 8, requires_grad=True)
    (gx,) = torch.autograd.grad(forward(x).sum(), [x], create_graph=True)
    with pytest.raises(RuntimeError, match=f"{backward_name}: double backward"):
        gx.sum().backward()


# ----------------------------------------------------------------------------- opcheck


def _x(*shape, rg=False):
    return randn(*shape, requires_grad=rg)


def test_opcheck_swiglu():
    opcheck(torch.ops.npu.npu_swiglu.default, [
        ((_x(3, 8),), {}), ((_x(4, 6, 2, rg=True),), {"dim": 0}),
        ((_x(8, 5).t().requires_grad_(),), {"dim": -1}), ((_x(0, 4, rg=True),), {}),
    ])
    opcheck(torch.ops.npu.npu_swiglu_backward.default, [
        ((_x(3, 4), _x(3, 8)), {}), ((_x(2, 6, 2), _x(4, 6, 2)), {"dim": 0}),
    ])


def test_opcheck_geglu():
    opcheck(torch.ops.npu.npu_geglu.default, [
        ((_x(3, 8),), {}),
        ((_x(4, 6, 2, rg=True),), {"dim": 1, "approximate": 0}),
        ((_x(3, 8, rg=True),), {"activate_left": True}),
        ((_x(8, 6).t().requires_grad_(),), {"dim": 0, "approximate": 1, "activate_left": True}),
    ])
    x = _x(4, 6)
    for kwargs in ({}, {"dim": 0, "approximate": 0, "activate_left": True}):
        out, gelu = opennpu.npu_geglu(x, **kwargs)
        opcheck(torch.ops.npu.npu_geglu_grad.default,
                [((torch.randn_like(out), x, gelu), kwargs)])


def test_opcheck_fast_gelu():
    for op in (torch.ops.npu.fast_gelu.default, torch.ops.npu.npu_fast_gelu.default):
        opcheck(op, [((_x(3, 8),), {}), ((_x(2, 3, 5, rg=True),), {}),
                     ((_x(6, 4).t().requires_grad_(),), {}), ((_x(),), {})])
    opcheck(torch.ops.npu.npu_fast_gelu_backward.default,
            [((_x(3, 8), _x(3, 8)), {}), ((_x(0, 2), _x(0, 2)), {})])


# ----------------------------------------------------------------------------- hypothesis


@settings(**SETTINGS)
@given(
    glu=st.sampled_from(GLU_CASES),
    lead=st.lists(st.integers(0, 4), min_size=0, max_size=3),
    half=st.integers(1, 200),
    data=st.data(),
    dtype=st.sampled_from([F32, torch.bfloat16, torch.float16]),
)
def test_hypothesis_glu_shape_sweep(glu, lead, half, data, dtype):
    shape = [*lead, 3]
    split = data.draw(st.integers(0, len(shape)))
    shape.insert(split, 2 * half)  # the split dim, anywhere
    dim = data.draw(st.sampled_from([split, split - len(shape)]))
    check_glu(glu, randn(*shape, dtype=dtype), dim)


@settings(**SETTINGS)
@given(
    lead=st.lists(st.integers(0, 6), min_size=0, max_size=3),
    last=st.integers(0, 300),
    scale=st.sampled_from([0.1, 1.0, 10.0]),
    dtype=st.sampled_from([F32, torch.bfloat16, torch.float16]),
)
def test_hypothesis_fast_gelu_shape_sweep(lead, last, scale, dtype):
    check_fast_gelu("fast_gelu", (torch.randn(*lead, last) * scale).to(dtype))


# ----------------------------------------------------------------------------- torch.compile


def test_compile_fullgraph_dynamic_matches_eager():
    def block(x):
        h = opennpu.npu_swiglu(x, dim=-1)
        g, _ = opennpu.npu_geglu(h, dim=0, approximate=0)
        y = opennpu.fast_gelu(g) + opennpu.npu_fast_gelu(g)
        z, _ = opennpu.npu_geglu(x, dim=1, activate_left=True)
        return y, z

    check_compiled_matches_eager(block, lambda s: [randn(*s, requires_grad=True)],
                                 [(4, 6, 8), (6, 10, 12)])


@pytest.mark.slow
def test_compile_inductor_matches_eager():
    def block(x):
        h = opennpu.npu_swiglu(x * 2, dim=-1)
        g, _ = opennpu.npu_geglu(h, dim=-1)
        return (opennpu.fast_gelu(g) + 1,)

    check_compiled_matches_eager(block, lambda s: [randn(*s, requires_grad=True)],
                                 [(3, 16), (5, 24)], backend="inductor", tol=1e-5)


# ----------------------------------------------------------------------------- bad input


def _raises(fn, *pieces):
    """fn raises RuntimeError whose message contains every piece, in order."""
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


INT = torch.ones(3, 8, dtype=torch.int32)


@pytest.mark.parametrize("name,call", [
    ("npu_swiglu", lambda: opennpu.npu_swiglu(INT)),
    ("npu_geglu", lambda: opennpu.npu_geglu(INT)),
    ("fast_gelu", lambda: opennpu.fast_gelu(INT)),
    ("npu_fast_gelu", lambda: opennpu.npu_fast_gelu(INT)),
    ("npu_swiglu_backward", lambda: opennpu.npu_swiglu_backward(randn(3, 4), INT)),
    ("npu_geglu_grad", lambda: opennpu.npu_geglu_grad(randn(3, 4), INT, randn(3, 4))),
    ("npu_fast_gelu_backward", lambda: opennpu.npu_fast_gelu_backward(randn(3, 8), INT)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_rejects_integer_input(name, call):
    _raises(call, f"{name}: argument 'self'", "but got Int")


@pytest.mark.parametrize("glu", [SWIGLU, GLU_CASES[1]], ids=repr)
def test_glu_rejects_odd_split_and_bad_dim(glu):
    fn = opennpu.npu_geglu if glu.geglu else opennpu.npu_swiglu
    _raises(lambda: fn(randn(3, 7)), f"{glu.op_name}: argument 'self'",
            "even size along dim -1", "[3, 7]")
    _raises(lambda: fn(randn(3, 8), 0), f"{glu.op_name}: argument 'self'",
            "even size along dim 0")
    _raises(lambda: fn(randn(3, 8), 2), f"{glu.op_name}: argument 'dim'", "[-2, 1]", "got 2")
    _raises(lambda: fn(randn(3, 8), -3), f"{glu.op_name}: argument 'dim'", "got -3")
    _raises(lambda: fn(torch.tensor(1.0)), f"{glu.op_name}: argument 'self'", "0-dim")


def test_geglu_rejects_bad_approximate():
    x = randn(3, 8)
    _raises(lambda: opennpu.npu_geglu(x, approximate=2), "npu_geglu: argument 'approximate'",
            "got 2")
    _raises(lambda: opennpu.npu_geglu(x, approximate=-1), "npu_geglu: argument 'approximate'")
    _raises(lambda: opennpu.npu_geglu_grad(randn(3, 4), x, randn(3, 4), approximate=2),
            "npu_geglu_grad: argument 'approximate'", "got 2")


def test_backward_ops_reject_wrong_grad_shape():
    x = randn(4, 8)
    _raises(lambda: opennpu.npu_swiglu_backward(randn(4, 8), x),
            "npu_swiglu_backward: argument 'grad_output'", "[4, 4]", "got [4, 8]")
    _raises(lambda: opennpu.npu_swiglu_backward(randn(4, 4), x, 0),
            "npu_swiglu_backward: argument 'grad_output'", "[2, 8]", "got [4, 4]")
    _raises(lambda: opennpu.npu_geglu_grad(randn(4, 8), x, randn(4, 4)),
            "npu_geglu_grad: argument 'grad_output'", "[4, 4]", "got [4, 8]")
    _raises(lambda: opennpu.npu_geglu_grad(randn(4, 4), x, randn(4, 8)),
            "npu_geglu_grad: argument 'gelu'", "[4, 4]", "got [4, 8]")
    _raises(lambda: opennpu.npu_fast_gelu_backward(randn(4, 7), x),
            "npu_fast_gelu_backward: argument 'grad'", "[4, 8]", "got [4, 7]")
    _raises(lambda: opennpu.npu_swiglu_backward(torch.ones(4, 4, dtype=torch.int64), x),
            "npu_swiglu_backward: argument 'grad_output'", "Long")


@pytest.mark.parametrize("case", ["swiglu 9-D", "geglu fp64", "fast_gelu 9-D"])
def test_strict_mode_rejects_ascend_unsupported(case):
    calls = {
        "swiglu 9-D": (lambda: opennpu.npu_swiglu(randn(*[1] * 8, 4)), "npu_swiglu"),
        "geglu fp64": (lambda: opennpu.npu_geglu(randn(3, 4, dtype=F64)), "npu_geglu"),
        "fast_gelu 9-D": (lambda: opennpu.fast_gelu(randn(*[1] * 9)), "fast_gelu"),
    }
    call, name = calls[case]
    call()  # accepted by default
    with opennpu.strict(True):
        _raises(call, f"{name}: argument 'self'", "strict mode")
    call()


def test_strict_mode_accepts_documented_inputs():
    with opennpu.strict(True):
        for dtype in (torch.float16, torch.bfloat16, F32):
            opennpu.npu_swiglu(randn(*[2] * 7, 4, dtype=dtype))
            opennpu.npu_geglu(randn(4, dtype=dtype))
            opennpu.fast_gelu(randn(2, 3, dtype=dtype))


def test_fast_gelu_accepts_input_keyword():
    x = torch.rand(4)
    torch.testing.assert_close(opennpu.fast_gelu(input=x), opennpu.fast_gelu(x))


# ----------------------------------------------------------------------------- seed 000


class TorchSwiGlu(torch.nn.Module):
    """Seed 000's native module."""

    def __init__(self, dim=-1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return R.native_swiglu(x)  # the seed's _swiglu (chunk on -1, silu, mul)


class NpuSwiGlu(torch.nn.Module):
    """Seed 000's torch_npu replacement."""

    def __init__(self, dim=-1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        dim = -1
        return opennpu.npu_swiglu(x, dim=dim)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16], ids=dtype_id)
def test_seed_swiglu_module_replacement(dtype):
    x = torch.randn(128, 256, dtype=dtype, requires_grad=True)
    expected, got = TorchSwiGlu()(x), NpuSwiGlu()(x)
    assert got.shape == expected.shape == (128, 128) and got.dtype == dtype
    ref = R.swiglu(x)
    assert_close(got, ref)
    if dtype == F32:
        assert_close(got, expected)
    else:
        assert_not_worse_than_native(got, expected, ref)
    grad = torch.randn_like(got)
    (g_native,) = torch.autograd.grad(expected, x, grad)
    (g_ours,) = torch.autograd.grad(got, x, grad)
    assert_close(g_ours, R.swiglu_backward(grad, x))
    if dtype == F32:
        assert_close(g_ours, g_native)


def test_seed_fast_gelu_replaces_gelu_with_a_small_difference():
    # Seed: "the implementations differ, so the activation outputs will differ".
    x = torch.rand(64, 32)
    got, gelu = opennpu.fast_gelu(x), F.gelu(x)
    diff = (got - gelu).abs().max().item()
    assert 0 < diff < 0.02
    assert_close(got, x * torch.sigmoid(1.702 * x))


def test_seed_fast_gelu_module_subclass():
    class FastGelu(torch.nn.GELU):
        def forward(self, input_data):
            return opennpu.fast_gelu(input_data)

    x = torch.rand(64, 32, requires_grad=True)
    module = FastGelu()
    y = module(x)
    assert isinstance(module, torch.nn.GELU)
    assert_close(y, R.fast_gelu(x))
    assert max_err(y, torch.nn.GELU()(x)) < 0.02
    y.sum().backward()
    assert_close(x.grad, R.fast_gelu_backward(torch.ones_like(x), x))


def test_seed_fast_gelu_reference_values():
    # spec 1.12: torch_npu's test_fast_gelu goldens
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(opennpu.fast_gelu(x),
                               torch.tensor([0.8458, 1.9357, 2.9819, 3.9956]), rtol=0, atol=5e-5)
    torch.testing.assert_close(
        opennpu.npu_fast_gelu_backward(torch.ones(4), x),
        torch.tensor([1.0677795, 1.0738151, 1.0245483, 1.0064018]), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- opennpu::_silu_mul
# silu(gate) * up over two tensors: the compile backend's fusion of Llama's MLP activation, on
# npu_swiglu's kernel (same fp32 arithmetic), so it is checked against npu_swiglu's reference.

_silu_mul = torch.ops.opennpu._silu_mul


def _silu_mul_ref(gate, up):
    return R.swiglu(torch.cat([_up(gate), _up(up)], -1))


@pytest.mark.parametrize("dtype", [F32, *LOW_DTYPES, F64], ids=dtype_id)
@pytest.mark.parametrize("shape", [(7,), (3, 37), (2, 3, 64), (0, 5)], ids=str)
def test_silu_mul_matches_reference(dtype, shape):
    gate, up = randn(*shape, dtype=dtype) * 3, randn(*shape, dtype=dtype)
    out = _silu_mul(gate, up)
    assert out.dtype == dtype and out.shape == gate.shape
    assert_close(out, _silu_mul_ref(gate, up).to(dtype))
    # the same numbers as npu_swiglu on the concatenated halves
    torch.testing.assert_close(out, opennpu.npu_swiglu(torch.cat([gate, up], -1)), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_silu_mul_low_precision_not_worse_than_native(dtype):
    gate, up = randn(32, 256, dtype=dtype) * 2, randn(32, 256, dtype=dtype)
    assert_not_worse_than_native(_silu_mul(gate, up), F.silu(gate) * up, _silu_mul_ref(gate, up))


def test_silu_mul_non_contiguous_inputs():
    gate, up = randn(16, 10).t(), randn(20, 16)[::2]
    assert_close(_silu_mul(gate, up), _silu_mul_ref(gate, up))


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=dtype_id)
def test_silu_mul_autograd_matches_reference_autograd(dtype):
    gate = (randn(6, 3, 16) * 3).to(dtype).requires_grad_()
    up = randn(6, 3, 16, dtype=dtype, requires_grad=True)
    grad = torch.randn(6, 3, 16).to(dtype)
    ours = grads_of(_silu_mul, [gate, up], grad)
    ref = grads_of(_silu_mul_ref, leaf_copies([gate, up]), grad)
    for got, want in zip(ours, ref):
        assert got.dtype == dtype
        assert_close(got, want.to(dtype))


def test_silu_mul_gradcheck_float64():
    gate = (randn(3, 5, dtype=F64) * 3).requires_grad_()
    up = randn(3, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(_silu_mul, [gate, up])


def test_silu_mul_gradient_of_one_input_only():
    gate, up = randn(4, 8, requires_grad=True), randn(4, 8)
    _silu_mul(gate, up).sum().backward()
    assert up.grad is None
    assert_close(gate.grad, torch.func.grad(lambda g: _silu_mul_ref(g, up).sum())(gate.detach()))


def test_opcheck_silu_mul():
    opcheck(_silu_mul.default, [
        ((_x(3, 8), _x(3, 8)), {}), ((_x(4, 6, rg=True), _x(4, 6, rg=True)), {}),
        ((_x(5, 4).t(), _x(4, 5)), {}), ((_x(0, 4, rg=True), _x(0, 4)), {}),
    ])
    opcheck(torch.ops.opennpu._silu_mul_backward.default, [((_x(3, 4), _x(3, 4), _x(3, 4)), {})])


def test_silu_mul_rejects_mismatched_inputs():
    _raises(lambda: _silu_mul(randn(3, 4), randn(3, 5)), "_silu_mul: argument 'up'",
            "[3, 4]", "[3, 5]")
    _raises(lambda: _silu_mul(randn(3, 4), randn(4)), "_silu_mul: argument 'up'", "[3, 4]")
    _raises(lambda: _silu_mul(randn(3, 4), randn(3, 4, dtype=torch.bfloat16)),
            "_silu_mul: argument 'up'", "gate's dtype", "BFloat16")
    _raises(lambda: _silu_mul(torch.ones(3, 4, dtype=torch.int32), randn(3, 4)),
            "_silu_mul: argument 'gate'", "but got Int")
    _raises(lambda: torch.ops.opennpu._silu_mul_backward(randn(3, 5), randn(3, 4), randn(3, 4)),
            "_silu_mul_backward: argument 'grad'", "[3, 4]", "got [3, 5]")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(64, 1, 2 * 520), (3, 2 * 37)])
def test_swiglu_equals_torch_npu_golden_bit_for_bit(shape, dtype):
    """op-plugin's swiglu goldens: F.silu(a) * b in float32, one rounding to the dtype; the
    backward (other * swish'(a)) * grad and grad * swish(a), swish = a * sigmoid(a) and
    swish' = sigmoid(a) + a * (1 - sigmoid(a)) * sigmoid(a), each op in float32. Ours rounds the
    same float32 values (test_npu_swi_glu*.py compare after the rounding). In float32 itself the
    golden's exp differs where ATen's kernel falls back to the C library's expf (the last
    elements of its flat loop), by one float32 ulp: float32 is compared to 2 ulps."""
    gen = torch.Generator().manual_seed(shape[-1])
    x = torch.cat([torch.rand(shape, generator=gen), torch.randn(shape, generator=gen) * 6], 0).to(dtype)
    x[0, ..., :4] = torch.tensor([0.0, -0.0, 150.0, -150.0])
    grad = torch.rand(x.shape[:-1] + (shape[-1] // 2,), generator=gen).to(dtype)
    a, b = (t.float() for t in x.chunk(2, -1))
    golden = (F.silu(a) * b).to(dtype)
    s = torch.sigmoid(a)
    g = grad.float()
    golden_grad = torch.cat([torch.mul(torch.mul(b, s + a * (1 - s) * s), g), torch.mul(g, a * s)], -1).to(dtype)
    xn = x.clone().requires_grad_(True)
    y = torch.ops.npu.npu_swiglu(xn, -1)
    y.backward(grad)
    if dtype == torch.float32:
        torch.testing.assert_close(y, golden, rtol=4.8e-7, atol=1e-30)
        torch.testing.assert_close(xn.grad, golden_grad, rtol=4.8e-7, atol=1e-30)
    else:
        assert torch.equal(y, golden)
        assert torch.equal(xn.grad, golden_grad)
