"""opennpu::_linear: F.linear for the compile backend's opt-in linear_onednn rule, on oneDNN from
64 float32 rows, on aten::linear otherwise (csrc/ops/linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from op_helpers import opcheck

_linear = torch.ops.opennpu._linear
F32, F64 = torch.float32, torch.float64


def _operands(*x_shape, n=24, dtype=F32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = x_shape[-1]
    x = torch.randn(*x_shape, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / max(k, 1) ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _float32_gemm_bound(x, w, b):
    """A float32 product's rounding bound per output: K * eps * sum_k |x_k w_k| (+ |b|), with K the
    summation length; oneDNN and MKL differ in summation order only, both inside it."""
    k = x.shape[-1]
    magnitude = F.linear(x.double().abs(), w.double().abs(),
                         None if b is None else b.double().abs())
    return (k + 1) * torch.finfo(F32).eps * magnitude + 1e-30


def _uses_onednn(fn) -> bool:
    with torch.profiler.profile() as prof:
        fn()
    return any(e.key == "mkldnn::_linear_pointwise" for e in prof.key_averages())


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("x_shape", [(3, 17), (63, 40), (64, 40), (2, 70, 33), (1, 130, 8)],
                         ids=str)
@pytest.mark.parametrize("n", [24, 520], ids=["n24", "n520"])
def test_float32_within_the_rounding_bound_of_the_product(x_shape, bias, n):
    x, w, b = _operands(*x_shape, n=n, bias=bias)
    y = _linear(x, w, b)
    assert y.dtype == F32 and y.shape == (*x_shape[:-1], n) and y.is_contiguous()
    assert ((y.double() - _ref(x, w, b)).abs() <= _float32_gemm_bound(x, w, b)).all()


@pytest.mark.parametrize("rows,n,onednn", [(16, 512, False), (63, 512, False), (64, 512, True),
                                            (200, 600, True), (200, 511, False)])
def test_oneDNN_from_64_rows_and_512_outputs_only(rows, n, onednn):
    x, w, b = _operands(rows, 32, n=n)
    assert _uses_onednn(lambda: _linear(x, w, b)) == (onednn and torch.backends.mkldnn.is_available())
    assert ((_linear(x, w, b).double() - _ref(x, w, b)).abs() <= _float32_gemm_bound(x, w, b)).all()


def test_below_the_threshold_equals_aten_bit_for_bit():
    x, w, b = _operands(5, 9, 31)
    torch.testing.assert_close(_linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, F64], ids=str)
def test_other_dtypes_are_aten_linear(dtype):
    x, w, b = _operands(80, 16, n=512, dtype=dtype)
    assert not _uses_onednn(lambda: _linear(x, w, b))
    torch.testing.assert_close(_linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)


def test_mkldnn_switched_off_is_respected():
    x, w, b = _operands(100, 16, n=512)
    with torch.backends.mkldnn.flags(enabled=False):
        assert not _uses_onednn(lambda: _linear(x, w, b))
        torch.testing.assert_close(_linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)


def test_non_contiguous_operands():
    x, w, b = _operands(40, 96, 16)
    xt = x.transpose(0, 1)  # [96, 40] read as rows of a transposed view
    wt = torch.randn(16, 24).t()  # [24, 16] non-contiguous weight
    y = _linear(xt, wt, None)
    assert ((y.double() - _ref(xt, wt, None)).abs() <= _float32_gemm_bound(xt, wt, None)).all()
    y = _linear(x[:, ::2, :], w, b[::1])
    assert ((y.double() - _ref(x[:, ::2], w, b)).abs() <= _float32_gemm_bound(x[:, ::2], w, b)).all()


@pytest.mark.parametrize("x_shape,n", [((0, 8), 4), ((70, 0), 4), ((70, 8), 0), ((0, 0), 0)], ids=str)
def test_empty(x_shape, n):
    x, w, b = _operands(*x_shape, n=n)
    y = _linear(x, w, b)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=0)


def test_on_the_npu_device():
    x, w, b = _operands(100, 32, n=512)
    y = _linear(x.to("npu"), w.to("npu"), b.to("npu"))
    assert y.device.type == "npu"
    torch.testing.assert_close(y.cpu(), _linear(x, w, b), rtol=0, atol=0)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_autograd_matches_F_linear(bias):
    x, w, b = _operands(2, 40, 12, bias=bias)
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    theirs = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    grad = torch.randn(2, 40, 24)
    _linear(*leaves, *([] if bias else [None])).backward(grad)
    F.linear(*theirs, *([] if bias else [None])).backward(grad)
    for ours, ref in zip(leaves, theirs):
        torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-5, atol=1e-5)


def test_gradcheck_float64():
    x, w, b = (t.requires_grad_() for t in _operands(3, 4, 5, n=6, dtype=F64))
    assert torch.autograd.gradcheck(_linear, (x, w, b))


def test_opcheck():
    x, w, b = _operands(70, 16, n=512)
    opcheck(_linear.default, [((x, w, b), {}), ((x, w), {}), ((x[:5], w, None), {}),
                              ((x.requires_grad_(), w.requires_grad_(), b), {})])


@pytest.mark.parametrize("args,message", [
    (lambda: (torch.randn(4, 8), torch.randn(3, 7)), r"_linear: argument 'input' must end in weight's in_features \(7\), but got shape \[4, 8\]"),
    (lambda: (torch.randn(4, 8), torch.randn(8)), r"_linear: argument 'weight' must be 2-D \[out_features, in_features\], but got shape \[8\]"),
    (lambda: (torch.randn(4, 8), torch.randn(3, 8), torch.randn(4)), r"_linear: argument 'bias' must be 1-D of weight's out_features \(3\), but got shape \[4\]"),
    (lambda: (torch.randn(4, 8), torch.randn(3, 8, dtype=F64)), r"_linear: argument 'weight' must have input's dtype \(Float\), but got Double"),
    (lambda: (torch.randn(4, 8), torch.randn(3, 8), torch.randn(3, dtype=F64)), r"_linear: argument 'bias' must have input's dtype \(Float\), but got Double"),
    (lambda: (torch.randn(()), torch.randn(3, 8)), r"_linear: argument 'input' must end in weight's in_features \(8\), but got shape \[\]"),
], ids=["k", "weight_rank", "bias_shape", "weight_dtype", "bias_dtype", "scalar_input"])
def test_bad_inputs(args, message):
    with pytest.raises(RuntimeError, match=message):
        _linear(*args())
