"""Native CUDA kernels (csrc/ops/<family>/<family>_cuda.cu) against the CPU kernels of the same
entry points, on the same inputs. Run wherever a GPU is visible (bash scripts/gpu_check.sh);
skipped elsewhere."""

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
# odd halves (one element per step), packed halves along the last dim and along an inner dim
@pytest.mark.parametrize("shape,dim", [((7, 10), -1), ((3, 6, 5), 1), ((0, 4), -1), ((2, 1030), -1),
                                       ((5, 128), -1), ((3, 4, 32), 1)])
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
    xp, upp, dyp = (t[:, :32].contiguous() for t in (x, up, dy))  # whole packs
    _close(*_both(npu.npu_fast_gelu, xp), dtype)
    _close(*_both(npu.npu_fast_gelu_backward, dyp, xp), dtype)
    _close(*_both(internal._silu_mul, xp, upp), dtype)
    _close(*_both(internal._silu_mul_backward, dyp, xp, upp), dtype)
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


# ----------------------------------------------------------------------------- norm

NORM_OPS = ("npu_rms_norm", "npu_rms_norm_backward", "npu_gemma_rms_norm", "npu_add_rms_norm",
            "npu_add_rms_norm_v2", "npu_add_rms_norm_v2_functional", "npu_add_rms_norm_cast",
            "npu_rotary_mul", "npu_rotary_mul_backward", "npu_interleave_rope",
            "npu_apply_rotary_pos_emb", "npu_dynamic_quant")


@pytest.mark.parametrize("name", NORM_OPS)
def test_native_kernels_win_over_the_portable_path(name):
    assert torch._C._dispatch_has_kernel_for_dispatch_key(f"npu::{name}", "CUDA")
    assert "portable.py" not in torch._C._dispatch_dump(f"npu::{name}").split("CUDA:")[1].split("\n")[0]


# (rows shape, normalised shape): odd n (one element per step), packed n, a row longer than the
# registers keep (fp32: 4 packs x 512 threads x 4 < 40000), empty, 2-D gamma.
NORM_SHAPES = [((7,), (10,)), ((3, 4), (4096,)), ((2,), (40000,)), ((0,), (16,)), ((5,), (3, 24))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,normed", NORM_SHAPES)
def test_rms_norm_forward_and_backward(dtype, rows, normed):
    x = torch.randn(*rows, *normed, dtype=dtype)
    gamma = (1 + 0.1 * torch.randn(normed)).to(dtype)
    _close(*_both(lambda t, g: npu.npu_rms_norm(t, g, 1e-6), x, gamma), dtype)
    _close(*_both(lambda t, g: npu.npu_gemma_rms_norm(t, g, 1e-6), x, gamma), dtype)
    y, rstd = npu.npu_rms_norm(x, gamma, 1e-6)
    dy = torch.randn_like(y)
    got, want = _both(lambda d, t, g, r: npu.npu_rms_norm_backward(d, t, g, r), dy, x, gamma, rstd)
    _close(got[0], want[0], dtype)
    # dgamma sums over rows in a different order: relative to its magnitude
    torch.testing.assert_close(got[1].cpu(), want[1], atol=TOL[dtype]["atol"] * max(1, x.numel() // gamma.numel()),
                               rtol=TOL[dtype]["rtol"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_unaligned_and_non_contiguous(dtype):
    base = torch.randn(9, 65, dtype=dtype)
    x = base[:, 1:]  # rows start one element past a pack boundary
    gamma32 = torch.rand(64) + 0.5  # fp32 gamma with a narrower x
    _close(*_both(lambda t, g: npu.npu_rms_norm(t, g, 1e-5), x, gamma32), dtype)
    _close(*_both(lambda t, g: npu.npu_rms_norm(t, g, 1e-5), x.t().contiguous().t(), gamma32), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [24, 4096, 13])
def test_add_rms_norm_family(dtype, n):
    x1, x2 = torch.randn(6, n, dtype=dtype), torch.randn(6, n, dtype=dtype)
    gamma = (1 + 0.1 * torch.randn(n)).to(dtype)
    _close(*_both(lambda a, b, g: npu.npu_add_rms_norm(a, b, g, 1e-6), x1, x2, gamma), dtype)
    _close(*_both(lambda a, b, g: npu.npu_add_rms_norm(a, b, g, 1e-6), x1, x2[:1], gamma), dtype)  # broadcast
    _close(*_both(lambda a, b, g: npu.npu_add_rms_norm_cast(a, b, g, 1e-6), x1, x2, gamma), dtype)
    _close(*_both(lambda a, b, g: npu.npu_add_rms_norm_v2_functional(a, b, g, 1e-6), x1, x2, gamma), dtype)
    # the in-place form writes x1 + x2 into x1 on both devices
    a_gpu, a_cpu = x1.cuda(), x1.clone()
    npu.npu_add_rms_norm_v2(a_gpu, x2.cuda(), gamma.cuda(), 1e-6)
    npu.npu_add_rms_norm_v2(a_cpu, x2, gamma, 1e-6)
    _close(a_gpu, a_cpu, dtype)


def test_rms_norm_autograd_and_compile_on_cuda():
    # importing opennpu beside a GPU leaves CUDA torch's accelerator (opennpu/_device.py), so
    # CUDA autograd keeps its streams
    assert torch.accelerator.current_accelerator().type == "cuda"
    x = torch.randn(4, 64, device="cuda", requires_grad=True)
    g = (torch.rand(64, device="cuda") + 0.5).requires_grad_()
    y = torch.ops.npu.npu_rms_norm(x, g)[0]
    y.square().sum().backward()
    xc, gc = x.detach().cpu().requires_grad_(), g.detach().cpu().requires_grad_()
    torch.ops.npu.npu_rms_norm(xc, gc)[0].square().sum().backward()
    torch.testing.assert_close(x.grad.cpu(), xc.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(g.grad.cpu(), gc.grad, atol=1e-4, rtol=1e-5)
    compiled = torch.compile(lambda t, w: torch.ops.npu.npu_rms_norm(t, w)[0] * 2, fullgraph=True)
    torch.testing.assert_close(compiled(x.detach(), g.detach()).cpu(),
                               torch.ops.npu.npu_rms_norm(xc.detach(), gc.detach())[0] * 2)


# ----------------------------------------------------------------------------- rotary

# (x shape, r shape): BNSD with 11SD, BSND with 1S1D, TND with T1D, decode (S = 1, many heads:
# the backward splits each r row's heads into shares), odd D/2, r broadcast in its last dim.
ROTARY_SHAPES = [((2, 3, 5, 8), (1, 1, 5, 8)), ((2, 5, 3, 16), (1, 5, 1, 16)), ((7, 2, 6), (7, 1, 6)),
                 ((64, 32, 1, 128), (64, 1, 1, 128)), ((3, 4, 10), (3, 4, 1))]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["half", "interleave"])
@pytest.mark.parametrize("xs,rs", ROTARY_SHAPES)
def test_rotary_mul_forward_and_backward(dtype, mode, xs, rs):
    x, r1, r2 = torch.randn(xs, dtype=dtype), torch.randn(rs, dtype=dtype), torch.randn(rs, dtype=dtype)
    _close(*_both(lambda t, c, s: npu.npu_rotary_mul(t, c, s, mode), x, r1, r2), dtype)
    dy = torch.randn(xs, dtype=dtype)
    got, want = _both(lambda g, t, c, s: npu.npu_rotary_mul_backward(g, t, c, s, mode), dy, x, r1, r2)
    summed = x.numel() // r1.numel() if rs[-1] != 1 else x.numel() // r1.numel() // xs[-1]
    _close(got[0], want[0], dtype)
    for g_, w_ in zip(got[1:], want[1:]):
        torch.testing.assert_close(g_.cpu(), w_, atol=TOL[dtype]["atol"] * max(1, summed), rtol=TOL[dtype]["rtol"])
    _close(*_both(lambda g, t, c, s: internal._rotary_mul_backward_dx(g, t, c, s, mode), dy, x, r1, r2), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_fp32_tables_and_strided_x(dtype):
    # a BNSD view of BSND memory (rows strided), cos / sin in fp32 for a half-precision x
    x = torch.randn(2, 6, 4, 32, dtype=dtype).transpose(1, 2)
    r1, r2 = torch.randn(1, 1, 6, 32), torch.randn(1, 1, 6, 32)
    _close(*_both(lambda t, c, s: npu.npu_rotary_mul(t, c, s), x, r1, r2), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_interleave_rope_and_apply_rotary_pos_emb(dtype):
    x = torch.randn(2, 3, 5, 64, dtype=dtype)
    cos, sin = torch.randn(2, 1, 5, 64, dtype=dtype), torch.randn(2, 1, 5, 64, dtype=dtype)
    _close(*_both(npu.npu_interleave_rope, x, cos, sin), dtype)
    q, k = torch.randn(2, 5, 4, 64, dtype=dtype), torch.randn(2, 5, 2, 64, dtype=dtype)
    c, s = torch.randn(2, 5, 1, 64, dtype=dtype), torch.randn(2, 5, 1, 64, dtype=dtype)
    qg, kg = q.cuda(), k.cuda()
    out = npu.npu_apply_rotary_pos_emb(qg, kg, c.cuda(), s.cuda(), "BSND", "half")
    assert out[0].data_ptr() == qg.data_ptr()  # in place, as torch_npu
    _close(out, npu.npu_apply_rotary_pos_emb(q, k, c, s, "BSND", "half"), dtype)


# ----------------------------------------------------------------------------- dynamic quant


def _codes_equal(got, want):
    for g, w in zip(got, want):
        assert g.device.type == "cuda" and g.dtype == w.dtype
        if g.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            g, w = g.view(torch.uint8), w.view(torch.uint8)
        torch.testing.assert_close(g.cpu(), w, rtol=0, atol=0, equal_nan=True)  # bit for bit


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [37, 64, 4096, 20000])  # 20000: longer than the registers keep
@pytest.mark.parametrize("dst_type", [None, torch.quint4x2, torch.float8_e4m3fn, torch.float8_e5m2,
                                      290])  # 290: torch_npu.hifloat8, uint8 codes
@pytest.mark.parametrize("mode", ["pertoken", "pertensor"])
def test_dynamic_quant_codes_match_the_cpu_bit_for_bit(dtype, n, dst_type, mode):
    if dst_type == torch.quint4x2 and n % 8:
        pytest.skip("int4 packs eight codes per int32")
    x = torch.randn(5, 3, n, dtype=dtype) * 3
    x[0, 0, 1] = 0.5 * x[0, 0].abs().max()  # a tie (v / scale = 63.5 for int8)
    x[1, 1] = 0  # an all-zero row: scale 1
    if dst_type == 290:  # hifloat8 ties (1.0625 -> 1.125) and every dot field's range
        x[0, 0, 2] = x[0, 0].abs().max() * (1.0625 / 32768)
        x[2, 2, : min(n, 31)] = torch.logspace(-8, 4, min(n, 31), base=2.0).to(dtype)
    kw = dict(dst_type=dst_type, quant_mode=mode)
    _codes_equal(*_both(lambda t: npu.npu_dynamic_quant(t, **kw), x))
    smooth = torch.rand(n, dtype=dtype) + 0.5
    _codes_equal(*_both(lambda t, s: npu.npu_dynamic_quant(t, smooth_scales=s, **kw), x, smooth))


def test_dynamic_quant_groups_nan_and_unaligned_rows():
    x = torch.randn(7, 33, dtype=torch.float16)[:, 1:]  # unaligned rows of 32
    x = x.contiguous()
    x[2, 5] = float("nan")
    smooth = torch.rand(3, 32, dtype=torch.float16) + 0.5
    groups = torch.tensor([2, 2, 7], dtype=torch.int32)
    _codes_equal(*_both(lambda t, s, g: npu.npu_dynamic_quant(t, smooth_scales=s, group_index=g), x, smooth, groups))
    odd = torch.randn(4, 65, dtype=torch.bfloat16)[:, 1:]
    _codes_equal(*_both(lambda t: npu.npu_dynamic_quant(t.contiguous()[:, :63]), odd))
    with pytest.raises(RuntimeError, match="npu_dynamic_quant.*group_index.*non-decreasing"):
        npu.npu_dynamic_quant(x.cuda(), smooth_scales=smooth[:2].cuda(),
                              group_index=torch.tensor([2, 9], device="cuda"))
