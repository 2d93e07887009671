"""Native CUDA kernels (csrc/ops/<family>/<family>_cuda.cu) against the CPU kernels of the same
entry points, on the same inputs. Run wherever a GPU is visible; skipped elsewhere. Until they
have run on a GPU, docs/ops.md marks these kernels "compiled, not yet run"."""

import pytest
import torch

import opennpu  # noqa: F401

npu, internal = torch.ops.npu, torch.ops.opennpu
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2), torch.float64: dict(atol=1e-12, rtol=1e-12)}
DTYPES = list(TOL)


def _both(fn, *tensors):
    """fn on CUDA copies of the inputs, and on the CPU originals."""
    return fn(*[t.cuda() for t in tensors]), fn(*tensors)


def _close(got, expected, dtype):
    for g, e in zip(got if isinstance(got, (tuple, list)) else [got],
                    expected if isinstance(expected, (tuple, list)) else [expected]):
        assert g.device.type == "cuda"
        torch.testing.assert_close(g.cpu(), e, **TOL[dtype])


def test_the_cuda_kernels_are_registered():
    for name in ("npu::npu_swiglu", "npu::npu_geglu", "npu::npu_fast_gelu", "opennpu::_silu_mul"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")
        assert "portable.py" not in torch._C._dispatch_dump(name).split("CUDA:")[1].split("\n")[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,dim", [((7, 10), -1), ((3, 6, 5), 1), ((0, 4), -1), ((2, 1030), -1)])
def test_swiglu(dtype, shape, dim):
    x = torch.randn(shape, dtype=dtype)
    _close(*_both(lambda t: npu.npu_swiglu(t, dim), x), dtype)
    dy = torch.randn(npu.npu_swiglu(x, dim).shape, dtype=dtype)
    _close(*_both(lambda g, t: npu.npu_swiglu_backward(g, t, dim), dy, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", [0, 1])
@pytest.mark.parametrize("activate_left", [False, True])
def test_geglu(dtype, approximate, activate_left):
    x = torch.randn(5, 2 * 33, dtype=dtype)
    _close(*_both(lambda t: npu.npu_geglu(t, -1, approximate, activate_left), x), dtype)
    out, gelu = npu.npu_geglu(x, -1, approximate, activate_left)
    dy = torch.randn_like(out)
    _close(*_both(lambda g, t, h: npu.npu_geglu_grad(g, t, h, -1, approximate, activate_left), dy, x, gelu), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fast_gelu_and_silu_mul(dtype):
    x, up, dy = (torch.randn(4, 37, dtype=dtype) for _ in range(3))
    _close(*_both(npu.npu_fast_gelu, x), dtype)
    _close(*_both(npu.npu_fast_gelu_backward, dy, x), dtype)
    _close(*_both(internal._silu_mul, x, up), dtype)
    _close(*_both(internal._silu_mul_backward, dy, x, up), dtype)


def test_non_contiguous_and_second_device():
    x = torch.randn(6, 8, dtype=torch.float32).t()  # non-contiguous
    _close(*_both(lambda t: npu.npu_swiglu(t, 0), x), torch.float32)
    if torch.cuda.device_count() > 1:
        got = npu.npu_swiglu(x.to("cuda:1"), 0)
        assert got.device == torch.device("cuda:1")
        torch.testing.assert_close(got.cpu(), npu.npu_swiglu(x, 0))


def test_bad_input_names_the_op():
    with pytest.raises(RuntimeError, match="npu_swiglu.*even size"):
        npu.npu_swiglu(torch.randn(3, 5, device="cuda"), -1)
