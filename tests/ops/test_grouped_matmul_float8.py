"""npu_grouped_matmul's float8 / MX path (Ascend 950): float8_e4m3fn / float8_e5m2 x and weights
with per-channel (and per-token) float scales, and MX: float8 or float4_e2m1 codes with
float8_e8m0 block scales of 32 along K.

Contract: op-plugin's GroupedMatmulKernelNpuOpApi.cpp (x_dtype / weight_dtype / scale_dtype /
per_token_scale_dtype reinterpret byte tensors; float4 weights pack two codes per byte along the
memory-contiguous dim, N = 2 * weight.size(-1) unless the weight is a transposed view), the
Ascend950 goldens of test_npu_grouped_matmul.py (float8: matmul(x.float(), w.float()) * scale),
and the MX scale layout of the same hardware's grouped ops (npu_grouped_matmul_swiglu_quant_v2.md:
the weights' [E, ceil(K / 64), N, 2], x's [M, ceil(K / 64), 2]), which is npu_quant_matmul's per
group. The oracle below decodes the codes with torch's own float8 dtypes and multiplies each
group in float64 (test_quant_matmul's ref_float_qmm); with small-integer codes and power-of-two
scales every float32 sum is exact, so the kernel must match it bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing
from op_helpers import opcheck
from test_quant_matmul import (E4, E5, U8, assert_close_fp32_acc, fp4_bytes, fp8, mx_scale_codes,
                               mx_scales, ref_float_qmm, unpack_fp4)

import opennpu
from opennpu.ops import portable

BF16, F16, F32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.int64
npu = torch.ops.npu
E8M0, FP4 = 293, 296  # torch_npu.float8_e8m0fnu, torch_npu.float4_e2m1fn_x2

MX_KINDS = [(E4, E4), (E5, E5), ("fp4", "fp4"), (E4, "fp4"), (E5, E4)]
MX_IDS = ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "fp8_x_fp4", "e5m2_x_e4m3"]


def gmm(x, weight, **kwargs):
    return opennpu.npu_grouped_matmul(x, weight, **kwargs)


def cumsum(sizes):
    return torch.tensor(sizes, dtype=I64).cumsum(0)


def codes(rows, cols, kind, gen, small=True):
    """Codes of a logical [rows, cols] operand stored row-major (float4: bytes [rows, cols / 2])
    and their float64 values."""
    if kind == "fp4":
        b = fp4_bytes(rows, cols // 2, gen=gen)
        return b, unpack_fp4(b)
    b = fp8(rows, cols, dtype=kind, gen=gen, small=small)
    return b, b.double()


def mx_case(sizes, k, n, kx, kw, gen, trans=False, small=True):
    """Split x [M, K] (or its bytes), a 3-D weight [E, K, N] (trans: the transpose of a
    contiguous [E, N, K]), their MX scale codes, and the decoded float64 operands."""
    m = sum(sizes)
    e = len(sizes)
    x, a = codes(m, k, kx, gen, small)
    if trans:
        wb, wv = zip(*(codes(n, k, kw, gen, small) for _ in range(e)))
        w, wv = torch.stack(wb).mT, torch.stack(wv).mT
    else:
        wb, wv = zip(*(codes(k, n, kw, gen, small) for _ in range(e)))
        w, wv = torch.stack(wb), torch.stack(wv)
    pairs = (k + 63) // 64
    sa = mx_scale_codes(m, pairs, 2, gen=gen)
    sw = mx_scale_codes(e, n, pairs, 2, gen=gen).transpose(1, 2) if trans else \
        mx_scale_codes(e, pairs, n, 2, gen=gen)
    return x, w, sa, sw, a, wv


def mx_kw(kx, kw, out_dtype):
    kwargs = dict(output_dtype=out_dtype, scale_dtype=E8M0, per_token_scale_dtype=E8M0)
    if kx == "fp4":
        kwargs["x_dtype"] = FP4
    if kw == "fp4":
        kwargs["weight_dtype"] = FP4
    return kwargs


def ref_groups(sizes, a, w, out_dtype, sa=None, sw=None, scale=None, token=None, bias=None):
    """Each group through the float64 oracle, the rows one after another."""
    ys, start = [], 0
    for g, m in enumerate(sizes):
        rows = slice(start, start + m)
        start += m
        ys.append(ref_float_qmm(
            a[rows], w[g], scale=None if scale is None else scale[g],
            pertoken=None if token is None else token[rows],
            bias=None if bias is None else bias[g], out_dtype=out_dtype,
            sa=None if sa is None else sa[rows], sw=None if sw is None else sw[g]))
    return ys


# ----------------------------------------------------------------------------- MX


@pytest.mark.parametrize("out_dtype", (F16, BF16, F32), ids=str)
@pytest.mark.parametrize("kinds", MX_KINDS, ids=MX_IDS)
@pytest.mark.parametrize("trans", [False, True], ids=["w_kn", "w_nk"])
def test_mx_split_x_exact(out_dtype, kinds, trans):
    gen = torch.Generator().manual_seed(31)
    sizes, k, n = [3, 0, 5, 2], 160, 10  # an empty group; K: 5 blocks, the last pair half used
    x, w, sa, sw, a, wv = mx_case(sizes, k, n, *kinds, gen, trans)
    bias = torch.randint(-4, 4, (len(sizes), n), generator=gen).float()
    y = gmm([x], [w], bias=[bias], scale=[sw], per_token_scale=[sa], group_list=cumsum(sizes),
            split_item=3, group_type=0, **mx_kw(*kinds, out_dtype))[0]
    ref = torch.cat(ref_groups(sizes, a, wv, out_dtype, sa=sa, sw=sw, bias=bias))
    assert y.dtype == out_dtype and y.shape == (sum(sizes), n)
    assert torch.equal(y, ref)
    # one output per group (split_item 0), group sizes (group_list_type 1)
    ys = gmm([x], [w], bias=[bias], scale=[sw], per_token_scale=[sa],
             group_list=torch.tensor(sizes), group_list_type=1, split_item=0, group_type=0, **mx_kw(*kinds, out_dtype))
    assert [t.shape[0] for t in ys] == sizes
    assert torch.equal(torch.cat(ys), ref)


E1M2 = 297  # torch_npu.float4_e1m2fn_x2
E1M2_VALUES = torch.tensor([(-1 if c & 8 else 1) * 0.25 * (c & 7) for c in range(16)],
                           dtype=torch.float64)


def unpack_e1m2(b):
    b = b.long()
    return torch.stack([E1M2_VALUES[b & 15], E1M2_VALUES[b >> 4]], -1).flatten(-2)


@pytest.mark.parametrize("trans", [False, True], ids=["w_kn", "w_nk"])
def test_mx_float4_e1m2(trans):
    """float4_e1m2 x and weights (bytes with x_dtype / weight_dtype 297), and e1m2 x with
    float4_e2m1 weights: npu_quant_matmul's MX product per group, exact."""
    from opennpu.ops import portable

    gen = torch.Generator().manual_seed(39)
    sizes, k, n = [3, 0, 5, 2], 160, 10
    x, w, sa, sw, _, wv_e2m1 = mx_case(sizes, k, n, "fp4", "fp4", gen, trans)
    a = unpack_e1m2(x)
    wv = unpack_e1m2(w.mT).mT if trans else unpack_e1m2(w)
    for weight_dtype, values in [(E1M2, wv), (FP4, wv_e2m1)]:
        kw = dict(output_dtype=F32, scale_dtype=E8M0, per_token_scale_dtype=E8M0, x_dtype=E1M2,
                  weight_dtype=weight_dtype, group_list=cumsum(sizes), split_item=3,
                  group_type=0)
        y = gmm([x], [w], scale=[sw], per_token_scale=[sa], **kw)[0]
        assert torch.equal(y, torch.cat(ref_groups(sizes, a, values, F32, sa=sa, sw=sw)))
        with portable.force():
            assert torch.equal(gmm([x], [w], scale=[sw], per_token_scale=[sa], **kw)[0], y)


@pytest.mark.parametrize("kinds", MX_KINDS, ids=MX_IDS)
def test_mx_weight_list_and_x_list(kinds):
    """2-D weights, each with its [ceil(K / 64), N, 2] scale (one transposed), and x as one
    tensor per group (group_type -1): per_token_scale one [M_g, ceil(K / 64), 2] per x."""
    gen = torch.Generator().manual_seed(32)
    sizes, k, n = [4, 2], 96, 6
    x, w, sa, sw, a, wv = mx_case(sizes, k, n, *kinds, gen)
    _, wt, _, swt, _, wvt = mx_case([1], k, n, kinds[1], kinds[1], gen, trans=True)
    weights, scales = [w[0], wt[0]], [sw[0], swt[0]]
    ref = ref_groups(sizes, a, [wv[0], wvt[0]], F32, sa=sa, sw=torch.stack([sw[0], swt[0]]))
    ys = gmm([x[:4], x[4:]], weights, scale=scales, per_token_scale=[sa[:4], sa[4:]],
             split_item=0, group_type=-1, **mx_kw(*kinds, F32))
    assert all(torch.equal(y, r) for y, r in zip(ys, ref))
    y = gmm([x], weights, scale=scales, per_token_scale=[sa], group_list=cumsum(sizes),
            split_item=2, group_type=0, **mx_kw(*kinds, F32))[0]
    assert torch.equal(y, torch.cat(ref))


@pytest.mark.parametrize("kinds", MX_KINDS, ids=MX_IDS)
@pytest.mark.parametrize("sizes,k,n", [([1], 32, 2), ([5, 1, 0], 100, 6), ([2, 3], 1100, 130),
                                       ([0, 0], 64, 4), ([520, 2], 64, 4)])
def test_mx_full_range_odd_sizes(kinds, sizes, k, n):
    """Full-range codes; K not a multiple of 32 or 64, K panels of 512, a group above the 512
    rows where the kernel decodes W whole, all groups empty."""
    gen = torch.Generator().manual_seed(33)
    x, w, sa, sw, a, wv = mx_case(sizes, k, n, *kinds, gen, small=False)
    y = gmm([x], [w], scale=[sw], per_token_scale=[sa], group_list=cumsum(sizes), split_item=3,
            group_type=0, **mx_kw(*kinds, F32))[0]
    assert y.shape == (sum(sizes), n)
    start = 0
    for g, m in enumerate(sizes):
        rows = slice(start, start + m)
        start += m
        ea, ew = mx_scales(sa[rows], sw[g], k)
        ref = ref_float_qmm(a[rows], wv[g], out_dtype=torch.float64, sa=sa[rows], sw=sw[g])
        assert_close_fp32_acc(y[rows], ref, a[rows] * ea, wv[g] * ew)


def test_mx_torch_dtypes_equal_bytes_and_nan_scale():
    """torch.float8_e8m0fnu / float4_e2m1fn_x2 tensors need no *_dtype; int8 bytes with torch's
    codes (float8_e4m3fn 24, float8_e8m0fnu 44) read alike; e8m0 code 255 is NaN."""
    gen = torch.Generator().manual_seed(34)
    sizes, k, n = [3, 2], 128, 4
    x, w, sa, sw, *_ = mx_case(sizes, k, n, "fp4", "fp4", gen)
    kw = dict(group_list=cumsum(sizes), split_item=3, group_type=0, output_dtype=BF16)
    base = gmm([x], [w], scale=[sw], per_token_scale=[sa], **mx_kw("fp4", "fp4", BF16),
               **{k_: v for k_, v in kw.items() if k_ != "output_dtype"})[0]
    typed = gmm([x.view(torch.float4_e2m1fn_x2)], [w.view(torch.float4_e2m1fn_x2)],
                scale=[sw.view(torch.float8_e8m0fnu)],
                per_token_scale=[sa.view(torch.float8_e8m0fnu)], **kw)[0]
    assert torch.equal(typed, base)
    x8, w8, sa8, sw8, *_ = mx_case(sizes, k, n, E4, E4, gen)
    ref = gmm([x8], [w8], scale=[sw8], per_token_scale=[sa8], **mx_kw(E4, E4, F32),
              group_list=cumsum(sizes), split_item=3, group_type=0)[0]
    got = gmm([x8.view(torch.int8)], [w8.view(U8)], scale=[sw8.view(torch.int8)],
              per_token_scale=[sa8], x_dtype=24, weight_dtype=292, scale_dtype=44,
              per_token_scale_dtype=torch.float8_e8m0fnu, output_dtype=F32,
              group_list=cumsum(sizes), split_item=3, group_type=0)[0]
    assert torch.equal(got, ref)
    sa8 = sa8.clone()
    sa8[1, 0, 1] = 255
    got = gmm([x8], [w8], scale=[sw8], per_token_scale=[sa8], **mx_kw(E4, E4, F32),
              group_list=cumsum(sizes), split_item=3, group_type=0)[0]
    assert got[1].isnan().all() and not got[[0, 2, 3, 4]].isnan().any()


def test_mx_end_to_end_with_dynamic_mx_quant():
    """npu_dynamic_mx_quant of x and of each expert's weight -> the MX grouped matmul: each
    group's x_g @ w_g.T up to the element format's precision."""
    gen = torch.Generator().manual_seed(35)
    sizes, k, n = [6, 3, 7], 128, 16
    x = torch.randn(sum(sizes), k, generator=gen)
    ws = torch.randn(len(sizes), n, k, generator=gen)
    exact = torch.cat([x[s:s + m].double() @ ws[g].double().T
                       for g, (s, m) in enumerate(zip([0, 6, 9], sizes))])
    for dst, tol in [(torch.float8_e4m3fn, 0.06), (296, 0.3)]:
        xq, xs = opennpu.npu_dynamic_mx_quant(x, dst_type=dst)
        wq, wsc = zip(*(opennpu.npu_dynamic_mx_quant(w, dst_type=dst) for w in ws))
        w3, s3 = torch.stack(wq).mT, torch.stack(wsc).transpose(1, 2)  # [E, K, N] transposed
        kw = dict(scale_dtype=E8M0, per_token_scale_dtype=E8M0)
        if dst == 296:
            kw.update(x_dtype=FP4, weight_dtype=FP4)
        y = gmm([xq], [w3], scale=[s3], per_token_scale=[xs], group_list=cumsum(sizes),
                split_item=3, group_type=0, output_dtype=F32, **kw)[0]
        rel = ((y.double() - exact).norm() / exact.norm()).item()
        assert rel < tol, (dst, rel)


# ----------------------------------------------------------------------------- float8, float scales


@pytest.mark.parametrize("out_dtype", (F16, BF16, F32), ids=str)
@pytest.mark.parametrize("kx,kw", [(E4, E4), (E5, E5), (E4, E5)], ids=["e4m3", "e5m2", "mixed"])
@pytest.mark.parametrize("scale_kind", ["f32", "bf16", "int64", "tensor"])
def test_fp8_per_channel_per_token_exact(out_dtype, kx, kw, scale_kind):
    gen = torch.Generator().manual_seed(36)
    sizes, k, n = [4, 0, 3], 40, 7
    x, a = codes(sum(sizes), k, kx, gen)
    w = torch.stack([codes(k, n, kw, gen)[0] for _ in sizes])
    pow2 = lambda *s: torch.exp2(torch.randint(-4, 5, s, generator=gen).float())  # noqa: E731
    scale = pow2(len(sizes), 1 if scale_kind == "tensor" else n)
    given = {"bf16": scale.to(BF16), "int64": opennpu.npu_trans_quant_param(
        scale.reshape(-1)).reshape(scale.shape)}.get(scale_kind, scale)
    token = pow2(sum(sizes))
    bias = torch.randint(-8, 8, (len(sizes), n), generator=gen).to(BF16)
    y = gmm([x], [w], bias=[bias], scale=[given], per_token_scale=[token],
            group_list=cumsum(sizes), split_item=3, group_type=0, output_dtype=out_dtype)[0]
    ref = torch.cat(ref_groups(sizes, a, w.double(), out_dtype, scale=scale.expand(-1, n),
                               token=token, bias=bias))
    assert torch.equal(y, ref)
    # op-plugin's golden (test_npu_grouped_matmul_quant_950): matmul in float32, * scale
    golden = torch.cat([(x[s:s + m].float() @ w[g].float()) * scale[g] * token[s:s + m, None] +
                        bias[g].float() for g, (s, m) in enumerate(zip([0, 4, 4], sizes))])
    assert torch.equal(y, golden.to(out_dtype))


def test_fp8_x_list_multi_dim_non_contiguous_and_transposed_weights():
    gen = torch.Generator().manual_seed(37)
    x0 = fp8(2, 3, 40, gen=gen, small=True)[:, :, ::2]  # [2, 3, 20], non-contiguous
    x1 = fp8(4, 20, dtype=E5, gen=gen, small=True).to(E4)
    w0 = fp8(20, 5, dtype=E5, gen=gen, small=True)
    w1 = fp8(5, 20, dtype=E5, gen=gen, small=True).t()  # a transposed view [20, 5]
    s = [torch.tensor([0.5]), torch.rand(5, generator=gen)]
    ys = gmm([x0, x1], [w0, w1], scale=s, split_item=0, group_type=-1, output_dtype=F32)
    assert ys[0].shape == (2, 3, 5) and ys[1].shape == (4, 5)
    r0 = ref_float_qmm(x0.reshape(6, 20).double(), w0.double(), scale=s[0], out_dtype=F32)
    r1 = ref_float_qmm(x1.double(), w1.double(), scale=s[1], out_dtype=F32)
    assert torch.equal(ys[0].reshape(6, 5), r0) and torch.equal(ys[1], r1)


def test_op_plugin_quant_950_golden():
    """test_npu_grouped_matmul_quant_950 (Ascend950-only upstream): int8 2 viewed as float8_e4m3fn
    (2^-8), x [16, 256] @ weight [1, 256, 32], int64 (fp19) or float32 scale [1, 32], float32 out;
    golden single_matmul: matmul(x.float(), w.float()) * scale, rtol 0.001."""
    x = torch.full((16, 256), 2, dtype=torch.int8).view(E4)
    w = torch.full((1, 256, 32), 2, dtype=torch.int8).view(E4)
    f = torch.empty(1, 32).uniform_(-5, 5)
    bits = f.view(torch.int32).to(I64) & 0xFFFFE000  # perchannelcube_templater_scale_generate
    f19 = (bits & 0xFFFFFFFF).to(torch.int32).view(F32)
    for scale, fs in [(bits, f19), (f, f)]:
        y = gmm([x], [w], scale=[scale], group_list=torch.tensor([16]), split_item=2,
                group_type=0, output_dtype=F32)[0]
        golden = (x.float() @ w[0].float()) * fs[0]
        torch.testing.assert_close(y, golden, rtol=1e-3, atol=0)


# ----------------------------------------------------------------------------- portable, opcheck,
# compile


def portable_cases():
    gen = torch.Generator().manual_seed(38)
    sizes = [3, 0, 2]
    x, w, sa, sw, *_ = mx_case(sizes, 96, 6, "fp4", "fp4", gen, trans=True)
    x8, w8, sa8, sw8, *_ = mx_case(sizes, 70, 5, E5, E4, gen)
    f1 = fp8(5, 40, gen=gen, small=True)
    f2 = torch.stack([fp8(40, 6, dtype=E5, gen=gen, small=True) for _ in sizes])
    gl = cumsum(sizes)
    # float8 operands go as bytes with x_dtype / weight_dtype (opcheck compares inputs with
    # allclose, which float8 tensors lack); the e8m0 scales are uint8 with *_dtype codes
    return [
        (([x], [w]), dict(scale=[sw], per_token_scale=[sa], group_list=gl, split_item=3,
                          group_type=0, **mx_kw("fp4", "fp4", BF16))),
        (([x8.view(U8)], [w8.view(U8)]),
         dict(scale=[sw8], per_token_scale=[sa8], group_list=gl, split_item=0, group_type=0,
              x_dtype=23, weight_dtype=292, scale_dtype=E8M0, per_token_scale_dtype=E8M0,
              output_dtype=F32, bias=[torch.randn(3, 5, generator=gen)])),
        (([f1.view(U8)], [f2.view(torch.int8)]),
         dict(scale=[torch.rand(3, 6, generator=gen)],
              per_token_scale=[torch.rand(5, generator=gen)], group_list=gl, split_item=3, group_type=0, x_dtype=24, weight_dtype=291,
              output_dtype=F16)),
    ]


def test_forced_portable_matches_cpp_and_npu_device():
    for args, kwargs in portable_cases():
        ours = npu.npu_grouped_matmul(*args, **kwargs)
        with portable.force():
            theirs = npu.npu_grouped_matmul(*args, **kwargs)
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=2e-6, atol=0)
    (x,), (w,) = portable_cases()[0][0]
    kwargs = portable_cases()[0][1]
    on_cpu = npu.npu_grouped_matmul([x], [w], **kwargs)[0]
    dev = {k: ([t.to("npu") for t in v] if isinstance(v, list) else
               v.to("npu") if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    on_npu = npu.npu_grouped_matmul([x.to("npu")], [w.to("npu")], **dev)[0]
    assert on_npu.device.type == "npu" and torch.equal(on_npu.cpu(), on_cpu)


def test_opcheck_float8_mx():
    opcheck(npu.npu_grouped_matmul.default, portable_cases())


def test_compile_fullgraph():
    gen = torch.Generator().manual_seed(39)
    sizes = [2, 3]
    x, w, sa, sw, *_ = mx_case(sizes, 64, 8, E4, "fp4", gen)
    f1, f2 = fp8(5, 32, gen=gen, small=True), fp8(2, 32, 8, gen=gen, small=True)

    def layer(x, w, sw, sa, gl, f1, f2, s):
        h = npu.npu_grouped_matmul([x], [w], scale=[sw], per_token_scale=[sa], group_list=gl,
                                   split_item=3, group_type=0, weight_dtype=FP4,
                                   scale_dtype=E8M0, per_token_scale_dtype=E8M0,
                                   output_dtype=BF16)[0]
        g = npu.npu_grouped_matmul([f1], [f2], scale=[s], group_list=gl, split_item=3,
                                   group_type=0, output_dtype=F32)[0]
        return h.float().relu() + g

    args = (x, w, sw, sa, cumsum(sizes), f1, f2, torch.rand(2, 8, generator=gen))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    assert torch.equal(compiled(*args), layer(*args))
    assert counter.frame_count == 1
    torch._dynamo.reset()
    fn = torch.compile(lambda *a: layer(*a) * 2, fullgraph=True)
    assert torch.equal(fn(*args), layer(*args) * 2)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- bad inputs


def test_bad_inputs():
    gen = torch.Generator().manual_seed(40)
    sizes = [2, 3]
    x, w, sa, sw, *_ = mx_case(sizes, 64, 8, E4, E4, gen)
    gl = cumsum(sizes)
    mkw = dict(mx_kw(E4, E4, F32), group_list=gl, split_item=3, group_type=0)
    f1, f2, s = fp8(5, 64, gen=gen), fp8(2, 64, 8, gen=gen), torch.rand(2, 8)
    fkw = dict(group_list=gl, split_item=3, group_type=0, output_dtype=F32)

    def raises(pattern, *args, **kwargs):
        with pytest.raises(RuntimeError, match=pattern):
            gmm(*args, **kwargs)

    raises(r"argument 'weight\[0\]' must be float8 / float4 codes like x\[0\].* but got Char",
           [f1], [torch.zeros(2, 64, 8, dtype=torch.int8)], scale=[s], **fkw)
    raises(r"argument 'x\[0\]' must be float8 / float4 codes like weight\[0\].* but got Float",
           [torch.zeros(5, 64)], [f2], scale=[s], **fkw)
    raises(r"argument 'output_dtype' must be torch.float16, torch.bfloat16 or torch.float32 "
           r"with float8 / float4 x and weights, but got None", [f1], [f2], scale=[s],
           **dict(fkw, output_dtype=None))
    raises(r"argument 'output_dtype' .* but got Char", [f1], [f2], scale=[s],
           **dict(fkw, output_dtype=torch.int8))
    raises(r"argument 'scale' must be given with float8 / float4 x and weights", [f1], [f2], **fkw)
    raises(r"argument 'offset' must be None with float8 / float4 x and weights", [f1], [f2],
           scale=[s], offset=[s], **fkw)
    raises(r"argument 'antiquant_scale' must be None on the float8 / MX path", [f1], [f2],
           scale=[s], antiquant_scale=[s], **fkw)
    raises(r"argument 'scale\[0\]' must be \[E, N\] = \[2, 8\]", [f1], [f2],
           scale=[torch.rand(2, 7)], **fkw)
    raises(r"argument 'scale\[0\]' must be float32, bfloat16 or int64", [f1], [f2],
           scale=[s.half()], **fkw)
    raises(r"argument 'per_token_scale\[0\]' must be \[M\] = \[5\]", [f1], [f2], scale=[s],
           per_token_scale=[torch.rand(4)], **fkw)
    raises(r"argument 'bias\[0\]' must be float32, bfloat16 or float16 with float8", [f1], [f2],
           scale=[s], bias=[torch.ones(2, 8, dtype=torch.int32)], **fkw)
    raises(r"argument 'x\[0\]' must have K = 63", [f1], [fp8(2, 63, 8)], scale=[s], **fkw)
    raises(r"argument 'x_dtype' must not be torch_npu.hifloat8", [f1.view(U8)], [f2], scale=[s],
           x_dtype=290, **fkw)
    raises(r"argument 'x\[0\]' must hold one byte per element .* but got Float",
           [torch.zeros(5, 64)], [f2], scale=[s], x_dtype=292, **fkw)
    raises(r"argument 'group_type' must be -1 or 0 on the quantised paths", [f1], [f2[0]],
           scale=[s[0]], group_list=cumsum([32, 32]), split_item=3, group_type=2,
           output_dtype=F32)
    # MX
    raises(r"argument 'per_token_scale' must be float8_e8m0 block scales like scale.* None",
           [x], [w], scale=[sw], **dict(mkw, per_token_scale_dtype=None))
    raises(r"argument 'per_token_scale' must be float8_e8m0 block scales like scale.* another",
           [x], [w], scale=[sw], per_token_scale=[torch.rand(5)],
           **dict(mkw, per_token_scale_dtype=None))
    raises(r"argument 'scale' must be float8_e8m0 block scales like per_token_scale", [x], [w],
           scale=[s], per_token_scale=[sa], **dict(mkw, scale_dtype=None))
    raises(r"argument 'scale' must be float8_e8m0 block scales .* with float4_e2m1",
           [fp4_bytes(5, 32)], [fp4_bytes(2, 64, 4)], scale=[s], x_dtype=FP4, weight_dtype=FP4,
           **fkw)
    raises(r"argument 'scale\[0\]' must be 4-D \[E, ceil\(K / 64\), N, 2\]", [x], [w],
           scale=[sw[0]], per_token_scale=[sa], **mkw)
    raises(r"argument 'scale\[0\]' must have shape \[2, 1, 8, 2\]", [x], [w],
           scale=[sw[:, :, :4]], per_token_scale=[sa], **mkw)
    raises(r"argument 'per_token_scale\[0\]' must have shape \[5, 1, 2\]", [x], [w], scale=[sw],
           per_token_scale=[sa[:4]], **mkw)
    raises(r"argument 'scale_dtype' must be None, float8_e8m0fnu", [x], [w], scale=[sw],
           per_token_scale=[sa], **dict(mkw, scale_dtype=F16))
    raises(r"argument 'scale\[0\]' must hold one byte per element", [x], [w],
           scale=[sw.float()], per_token_scale=[sa], **mkw)
    raises(r"argument 'per_token_scale_dtype' must be None when per_token_scale is not given",
           [f1], [f2], scale=[s], per_token_scale_dtype=E8M0, **fkw)
    xt, wt, sat, *_ = mx_case([1, 1], 128, 8, E4, E4, gen, trans=True)
    raises(r"argument 'scale\[0\]' must be a transpose .* as 'weight\[0\]' is one", [xt], [wt],
           scale=[mx_scale_codes(2, 2, 8, 2, gen=gen)], per_token_scale=[sat],
           **dict(mkw, group_list=cumsum([1, 1])))
    raises(r"argument 'x\[0\]' must hold float4 codes packed along K", [fp4_bytes(32, 5).t()],
           [fp4_bytes(2, 64, 4)], scale=[sw], per_token_scale=[sa],
           **dict(mx_kw("fp4", "fp4", F32), group_list=gl, split_item=3, group_type=0))
