"""npu_grouped_matmul's quantised paths: A8W8 (int8 x and weights, per-channel scale, per-token
scale, int32 / float bias, int8 / float16 / bfloat16 / float32 / int32 outputs) and the
weight-only A16W8 / A16W4 (antiquant_scale / antiquant_offset, per channel or per group).

Contract: op-plugin's docs of npu_grouped_matmul (formulas 2-4, table 2) and the goldens of its
test_npu_grouped_matmul.py (A8W8: the int32 product dequantised in float, rounded once, int8
half to even and saturated; weight-only: the weight dequantised into x's dtype, float16 with
``w + offset`` rounded to float16 first, then a float32-accumulated GEMM). The references below
are written here, in float64, independently of the kernels and of the portable path.
"""

from __future__ import annotations

import pytest
import torch
from op_helpers import opcheck

import opennpu
from opennpu.ops import portable
from opennpu.testing import reference as R

I8, I32, I64 = torch.int8, torch.int32, torch.int64
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
npu = torch.ops.npu


def gmm(x, weight, **kwargs):
    return opennpu.npu_grouped_matmul(x, weight, **kwargs)


def codes(*shape, lo=-128, hi=128):
    return torch.randint(lo, hi, shape, dtype=I8)


def cumsum(sizes):
    return torch.tensor(sizes, dtype=I64).cumsum(0)


def row_groups(t, sizes):
    return list(t[:sum(sizes)].split(sizes))


# ----------------------------------------------------------------------------- references


def ref_a8w8(xg, w, scale=None, token=None, bias=None, out_dtype=I8, offset=None):
    """One group: (x @ w (+ int32 bias)) * scale (* token) (+ float bias) (+ offset), float64."""
    acc = xg.double() @ w.double()
    if bias is not None and bias.dtype == I32:
        acc = acc + bias.double()
    if out_dtype == I32:
        return acc.to(I32)
    y = acc * scale.double()
    if token is not None:
        y = y * token.double().reshape(-1, 1)
    if bias is not None and bias.dtype != I32:
        y = y + bias.double()
    if offset is not None:
        y = y + offset.double()
    if out_dtype == I8:
        return torch.round(y).clamp(-128, 127).to(I8)  # torch.round: half to even
    return y.to(out_dtype)


def unpack_int4(words):
    """int32 words [..., n] -> their int4 codes [..., 8 n], lowest nibble first."""
    nibbles = [((words >> (4 * j)) & 0xF) for j in range(8)]
    v = torch.stack(nibbles, -1).flatten(-2)
    return torch.where(v >= 8, v - 16, v)


def pack_int4(values):
    """int codes [..., 8 n] in [-8, 7] -> int32 words [..., n] (the inverse of unpack_int4)."""
    v = (values.to(I64) & 0xF).reshape(*values.shape[:-1], -1, 8)
    word = sum(v[..., j] << (4 * j) for j in range(8))
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(I32)


def ref_dequant(w_codes, scale, offset, dtype):
    """The weight in x's dtype: (w + offset) * scale, float16 rounding the sum first; scale /
    offset [G, N] cover K / G rows each."""
    g = scale.shape[0]
    rep = w_codes.shape[0] // g
    v = w_codes.double()
    if offset is not None:
        v = v + offset.double().repeat_interleave(rep, 0)
        if dtype == F16:
            v = v.to(F16).double()
    return (v * scale.double().repeat_interleave(rep, 0)).to(dtype)


def ref_antiquant(xg, w_codes, scale, offset=None, bias=None):
    y = xg.double() @ ref_dequant(w_codes, scale, offset, xg.dtype).double()
    if bias is not None:
        y = y + bias.double()
    return y.to(xg.dtype)


def assert_ulp(out, ref, ulps=1):
    """out within `ulps` units in the last place of ref's dtype (float64 reference rounded once
    against fp32 arithmetic: a tie may round the other way)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape,
                                                               ref.shape)
    if not out.dtype.is_floating_point:
        assert (out.long() - ref.long()).abs().max().item() <= ulps if out.numel() else True
        return
    eps = torch.finfo(out.dtype).eps
    tol = ulps * eps * ref.double().abs() + torch.finfo(out.dtype).tiny
    diff = (out.double() - ref.double()).abs()
    assert bool((diff <= tol).all()), f"max diff {diff.max().item()}"


def assert_close_gemm(out, ref, k):
    """fp32-accumulated K-term sums against float64: the tolerance grows with sqrt(K)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.double(), ref.double(), rtol=2 * eps,
                               atol=2 * eps * max(1.0, k ** 0.5) * max(1.0, ref.abs().max().item()))


# ----------------------------------------------------------------------------- A8W8


SCALE_OUT = [(F32, F16), (BF16, BF16), (F32, F32), (F32, BF16), (I64, I8), (None, I32)]


@pytest.mark.parametrize("scale_dtype,out_dtype", SCALE_OUT, ids=lambda v: str(v).split(".")[-1])
@pytest.mark.parametrize("form", ["cumsum", "counts", "list"])
def test_a8w8_single_x_3d_weight(scale_dtype, out_dtype, form):
    sizes, k, n, tail = [5, 0, 9, 1], 37, 19, 3
    e = len(sizes)
    x, w = codes(sum(sizes) + tail, k), codes(e, k, n)
    scale32 = torch.rand(e, n) * 0.02 + 0.001
    token = torch.rand(x.shape[0]) + 0.5
    kwargs, offset = {}, None
    if scale_dtype == I64:  # npu_trans_quant_param's encoding, with an int8 offset
        off = torch.randint(-3, 4, (e, n)).float()
        scale = opennpu.npu_trans_quant_param(scale32.reshape(-1), off.reshape(-1)).reshape(e, n)
        scale32 = (scale & 0xFFFFE000).to(I32).view(F32)  # the 19 bits kept
        offset = off
    elif scale_dtype is not None:
        scale = scale32.to(scale_dtype)
        scale32 = scale.float()
    if scale_dtype is not None:
        kwargs["scale"] = [scale]
    if out_dtype in (F16, BF16, F32):
        kwargs["per_token_scale"] = [token]
    bias = torch.randint(-500, 500, (e, n), dtype=I32)
    gl = {"cumsum": cumsum(sizes), "counts": torch.tensor(sizes),
          "list": cumsum(sizes).tolist()}[form]
    out = gmm([x], [w], bias=[bias], group_list=gl, group_list_type=int(form == "counts"), **kwargs,
              split_item=3, group_type=0, output_dtype=out_dtype)[0]
    refs = []
    for g, xg in enumerate(row_groups(x, sizes)):
        tg = row_groups(token, sizes)[g] if "per_token_scale" in kwargs else None
        refs.append(ref_a8w8(xg, w[g], scale32[g] if scale_dtype else None, tg, bias[g],
                             out_dtype, None if offset is None else offset[g]))
    ref = torch.cat(refs + [torch.zeros(tail, n, dtype=out_dtype)])
    assert_ulp(out, ref)


@pytest.mark.parametrize("pairs", [[(0, 4), (1, 0), (3, 6)], [(3, 2), (0, 5), (3, 1), (1, 3)]],
                         ids=["in_group_order", "sparse_unsorted_repeated"])
def test_a8w8_group_list_type_2_pairs(pairs):
    """group_list_type 2: [E, 2] (expert, rows) pairs, x's rows in the list's order, the output
    in x's row order; per-token scales follow their rows."""
    e, k, n = 4, 29, 11
    m = sum(rows for _, rows in pairs)
    x, w = codes(m, k), codes(e, k, n)
    scale = torch.rand(e, n) * 0.02 + 0.001
    token = torch.rand(m) + 0.5
    bias = torch.randint(-500, 500, (e, n), dtype=I32)
    out = gmm([x], [w], bias=[bias], scale=[scale], per_token_scale=[token],
              group_list=torch.tensor(pairs), group_list_type=2, split_item=3, group_type=0,
              output_dtype=BF16)[0]
    refs, r = [], 0
    for g, rows in pairs:
        refs.append(ref_a8w8(x[r:r + rows], w[g], scale[g], token[r:r + rows], bias[g], BF16))
        r += rows
    assert out.shape == (m, n)
    assert_ulp(out, torch.cat(refs))
    bad = dict(scale=[scale], per_token_scale=[token], split_item=3, group_type=0,
               group_list_type=2, output_dtype=BF16)
    with pytest.raises(RuntimeError, match=r"group indices in \[0, 4\).* entry 1 has 4"):
        gmm([x], [w], group_list=torch.tensor([[0, 1], [4, m - 1]]), **bad)
    with pytest.raises(RuntimeError, match=f"sum to x's {m} rows, but they sum to {m - 1}"):
        gmm([x], [w], group_list=torch.tensor([[0, 1], [2, m - 2]]), **bad)
    with pytest.raises(RuntimeError, match="non-negative group sizes .* entry 0 has -1"):
        gmm([x], [w], group_list=torch.tensor([[0, -1], [2, m + 1]]), **bad)
    with pytest.raises(RuntimeError, match=r"must be \[E, 2\] .* pairs"):
        gmm([x], [w], group_list=torch.tensor([m]), **bad)
    with pytest.raises(RuntimeError, match="'split_item' must be 2 or 3"):
        gmm([x], [w], group_list=torch.tensor(pairs), **{**bad, "split_item": 0})


# act_type -> its activation (fast_gelu: npu_fast_gelu's oracle)
ACTIVATIONS = {1: torch.relu, 2: lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
               4: R.fast_gelu, 5: torch.nn.functional.silu}


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
@pytest.mark.parametrize("out_dtype", [BF16, F16, F32])
def test_a8w8_per_token_fused_activation(act, out_dtype):
    """act_type on the per-token path: the epilogue's values (float bias included) activated,
    then rounded once into the output (an empty group among them)."""
    sizes = [3, 0, 6, 4]
    x, w = codes(13, 32), codes(4, 32, 16)
    scale, token, bias = torch.rand(4, 16) * 1e-3, torch.rand(13), torch.randn(4, 16)
    kw = dict(scale=[scale], per_token_scale=[token], bias=[bias], group_list=cumsum(sizes),
              split_item=3, group_type=0, act_type=act, output_dtype=out_dtype)
    out = gmm([x], [w], **kw)[0]
    values = torch.cat([ref_a8w8(xg, w[g], scale[g], tg, bias[g], torch.float64)
                        for g, (xg, tg) in enumerate(zip(row_groups(x, sizes),
                                                         row_groups(token, sizes)))])
    assert values.min() < -3 and values.max() > 3  # both sides of each activation's bend
    ref = ACTIVATIONS[act](values)
    assert out.dtype == out_dtype and out.shape == (13, 16)
    # one rounding of a float32 computation: the output dtype's epsilon, plus float32's error
    # where the activation cancels (gelu / silu of large negative values)
    torch.testing.assert_close(out.double(), ref, rtol=torch.finfo(out_dtype).eps,
                               atol=1e-6 * ref.abs().max().item())
    # the same on the npu device
    npu_out = gmm([x.to("npu")], [w.to("npu")], **{
        k: ([t.to("npu") for t in v] if isinstance(v, list) else
            v.to("npu") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})[0]
    torch.testing.assert_close(npu_out.cpu(), out, rtol=0, atol=0)


def test_a8w8_float_bias_weight_list_and_transposed():
    # single x, a list of transposed weights [K, N] (views of [N, K]), float bias, list output
    sizes, k, n = [3, 7, 0], 21, 13
    x = codes(sum(sizes), k)
    ws = [codes(n, k).t() for _ in sizes]
    scales = [torch.rand(n) * 0.01 for _ in sizes]
    biases = [torch.randn(n) for _ in sizes]
    token = torch.rand(sum(sizes))
    out = gmm([x], ws, scale=scales, bias=biases, per_token_scale=[token],
              group_list=cumsum(sizes), split_item=0, group_type=0, output_dtype=BF16)
    for g, (o, xg) in enumerate(zip(out, row_groups(x, sizes))):
        assert_ulp(o, ref_a8w8(xg, ws[g], scales[g], row_groups(token, sizes)[g], biases[g], BF16))


def test_a8w8_x_list_multi_dim_and_per_tensor_scale():
    # no grouping: x[i] @ w[i], x with leading dims, a [1] (per-tensor) scale, per-x token scales
    xs = [codes(2, 3, 8), codes(4, 8)]
    ws = [codes(8, 5), codes(8, 6)]
    scales = [torch.tensor([0.01]), torch.rand(6) * 0.01]
    tokens = [torch.rand(6), torch.rand(4)]
    out = gmm(xs, ws, scale=scales, per_token_scale=tokens, split_item=0, group_type=-1,
              output_dtype=F16)
    assert out[0].shape == (2, 3, 5) and out[1].shape == (4, 6)
    for o, xg, w, s, t in zip(out, xs, ws, scales, tokens):
        assert_ulp(o.reshape(-1, o.shape[-1]), ref_a8w8(xg.reshape(-1, 8), w, s, t, None, F16))


def test_a8w8_large_k_is_exact():
    # K = 3000 with extreme codes: sums past 2^24, exact int32 accumulation required
    x = torch.full((4, 3000), -128, dtype=I8)
    w = torch.full((2, 3000, 16), -128, dtype=I8)
    out = gmm([x], [w], group_list=cumsum([1, 3]), split_item=3, group_type=0,
              output_dtype=I32)[0]
    assert bool((out == 3000 * 128 * 128).all())


def test_a8w8_empty_shapes():
    x, w = codes(0, 8), codes(3, 8, 4)
    out = gmm([x], [w], scale=[torch.ones(3, 4)], group_list=cumsum([0, 0, 0]), split_item=3,
              group_type=0, output_dtype=F16)[0]
    assert out.shape == (0, 4) and out.dtype == F16
    out = gmm([codes(3, 0)], [codes(2, 0, 4)], scale=[torch.ones(2, 4)],
              group_list=cumsum([1, 2]), split_item=3, group_type=0, output_dtype=BF16)[0]
    assert out.shape == (3, 4) and bool((out == 0).all())  # K = 0: an empty sum


# ----------------------------------------------------------------------------- weight-only


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("with_offset", [False, True], ids=["sym", "offset"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_a16w8_per_channel(dtype, with_offset, with_bias):
    sizes, k, n = [4, 0, 11, 2], 33, 29
    e = len(sizes)
    x, w = torch.randn(sum(sizes), k).to(dtype), codes(e, k, n)
    scale = (torch.rand(e, n) * 0.02).to(dtype)
    offset = torch.randn(e, n).to(dtype) if with_offset else None
    bias = torch.randn(e, n).to(F32 if dtype == BF16 else dtype) if with_bias else None
    out = gmm([x], [w], antiquant_scale=[scale],
              antiquant_offset=[offset] if with_offset else None,
              bias=[bias] if with_bias else None, group_list=torch.tensor(sizes),
              group_list_type=1, split_item=2, group_type=0)[0]
    ref = torch.cat([ref_antiquant(xg, w[g], scale[g:g + 1],
                                   offset[g:g + 1] if with_offset else None,
                                   bias[g] if with_bias else None)
                     for g, xg in enumerate(row_groups(x, sizes))])
    assert_close_gemm(out, ref, k)


def test_dequantised_weight_rounding_points():
    # K = 1, one row of x equal to 1: y is the dequantised weight itself, rounded like the golden
    for dtype in (F16, BF16):
        w = torch.arange(-128, 128, dtype=I8).reshape(1, 1, 256)
        scale = (torch.rand(1, 256) * 3).to(dtype)
        offset = (torch.randn(1, 256) * 50).to(dtype)
        y = gmm([torch.ones(1, 1, dtype=dtype)], [w], antiquant_scale=[scale],
                antiquant_offset=[offset], group_list=cumsum([1]), split_item=3,
                group_type=0)[0]
        torch.testing.assert_close(y[0], ref_dequant(w[0], scale, offset, dtype)[0], rtol=0,
                                   atol=0)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("groups_k", [1, 4], ids=["per_channel", "per_group"])
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_a16w4(dtype, groups_k, transposed):
    sizes, k, n = [3, 6, 0], 64, 24
    e = len(sizes)
    values = torch.randint(-8, 8, (e, k, n))
    if transposed:  # stored [E, N, K / 8], passed as its transpose [E, K / 8, N]
        w = pack_int4(values.transpose(1, 2).contiguous()).contiguous().transpose(1, 2)
        assert not w.is_contiguous()
    else:
        w = pack_int4(values)
    assert w.dtype == I32
    x = torch.randn(sum(sizes), k).to(dtype)
    scale = (torch.rand(e, groups_k, n) * 0.1).to(dtype)
    offset = torch.randn(e, groups_k, n).to(dtype)
    aq_scale = scale if groups_k > 1 else scale[:, 0]
    aq_offset = offset if groups_k > 1 else offset[:, 0]
    out = gmm([x], [w], antiquant_scale=[aq_scale], antiquant_offset=[aq_offset],
              group_list=cumsum(sizes), split_item=3, group_type=0, weight_dtype=torch.quint4x2)[0]
    assert out.shape == (sum(sizes), n)
    ref = torch.cat([ref_antiquant(xg, values[g], scale[g], offset[g])
                     for g, xg in enumerate(row_groups(x, sizes))])
    assert_close_gemm(out, ref, k)


def test_a16w4_weight_list_list_overload():
    # multi-weight [K, N / 8] tensors, per-group [G, N] scales, the .List overload
    sizes, k, n = [2, 5], 32, 16
    values = [torch.randint(-8, 8, (k, n)) for _ in sizes]
    ws = [pack_int4(v) for v in values]
    x = torch.randn(sum(sizes), k).to(BF16)
    scales = [(torch.rand(2, n) * 0.1).to(BF16) for _ in sizes]
    out = gmm([x], ws, antiquant_scale=scales, group_list=cumsum(sizes).tolist(), split_item=3,
              group_type=0)[0]
    ref = torch.cat([ref_antiquant(xg, values[g], scales[g])
                     for g, xg in enumerate(row_groups(x, sizes))])
    assert_close_gemm(out, ref, k)


# ----------------------------------------------------------------------------- portable, dtypes


def portable_cases():
    torch.manual_seed(3)
    x, w = codes(14, 24), codes(3, 24, 10)
    w4 = pack_int4(torch.randint(-8, 8, (3, 24, 16)))
    xh = torch.randn(14, 24).to(BF16)
    gl = cumsum([4, 0, 10])
    return [
        (([x], [w]), dict(scale=[torch.rand(3, 10)], per_token_scale=[torch.rand(14)],
                          bias=[torch.randint(-9, 9, (3, 10), dtype=I32)], group_list=gl,
                          split_item=3, group_type=0, output_dtype=BF16)),
        (([x], [w]), dict(scale=[opennpu.npu_trans_quant_param(torch.rand(30) * 0.01,
                                                               torch.ones(30)).reshape(3, 10)],
                          group_list=gl, split_item=2, group_type=0)),
        (([x], [w]), dict(group_list=gl, split_item=3, group_type=0, output_dtype=I32)),
        (([xh], [w]), dict(antiquant_scale=[torch.rand(3, 10).to(BF16)],
                           antiquant_offset=[torch.randn(3, 10).to(BF16)], group_list=gl,
                           split_item=3, group_type=0)),
        (([xh.half()], [w4]), dict(antiquant_scale=[torch.rand(3, 2, 16).half()],
                                   group_list=gl, split_item=3, group_type=0)),
        (([x[:4], x[4:]], [w[0], w[1]]), dict(scale=[torch.rand(10), torch.rand(10)],
                                              per_token_scale=[torch.rand(4), torch.rand(10)],
                                              split_item=0, group_type=-1, output_dtype=F16)),
    ]


def test_forced_portable_matches_cpp():
    for args, kwargs in portable_cases():
        ours = npu.npu_grouped_matmul(*args, **kwargs)
        with portable.force():
            theirs = npu.npu_grouped_matmul(*args, **kwargs)
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and a.shape == b.shape
            if a.dtype in (I8, I32):
                assert torch.equal(a, b)
            else:
                assert_ulp(a, b.to(a.dtype), ulps=2)


def test_opcheck_quantised():
    opcheck(npu.npu_grouped_matmul.default, portable_cases())
    x, w = codes(9, 8), codes(3, 8, 4)
    scale = opennpu.npu_trans_quant_param(torch.rand(12)).reshape(3, 4)
    opcheck(npu.npu_grouped_matmul.List,
            [(([x], [w]), dict(scale=[scale], group_list=[2, 5, 9], split_item=3, group_type=0))])


def test_declared_dtypes_accept_own_dtypes():
    x, w = codes(6, 8), codes(2, 8, 4)
    scale = opennpu.npu_trans_quant_param(torch.rand(8) * 0.01).reshape(2, 4)
    base = gmm([x], [w], scale=[scale], per_token_scale=[torch.rand(6)], group_list=cumsum([2, 4]),
               split_item=3, group_type=0, output_dtype=F16)[0]
    again = gmm([x], [w], scale=[scale], per_token_scale=[torch.rand(6).fill_(1) * 0 + 1],
                group_list=cumsum([2, 4]), split_item=3, group_type=0, output_dtype=F16,
                x_dtype=I8, weight_dtype=I8, scale_dtype=torch.uint64,
                per_token_scale_dtype=F32)[0]
    assert again.shape == base.shape
    with portable.force():
        gmm([x], [w], scale=[scale], group_list=cumsum([2, 4]), split_item=3, group_type=0,
            scale_dtype=I64, x_dtype=I8)


def test_compile_fullgraph():
    def layer(x, w, scale, token, gl, xh, w4, aq):
        h = npu.npu_grouped_matmul([x], [w], scale=[scale], per_token_scale=[token],
                                   group_list=gl, split_item=3, group_type=0,
                                   output_dtype=BF16)[0]
        g = npu.npu_grouped_matmul([xh], [w4], antiquant_scale=[aq], group_list=gl,
                                   split_item=3, group_type=0)[0]
        return h.float().relu() + g.float()

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    args = (codes(9, 16), codes(3, 16, 8), torch.rand(3, 8), torch.rand(9),
            torch.tensor([2, 5, 9]), torch.randn(9, 16).to(BF16),
            pack_int4(torch.randint(-8, 8, (3, 16, 8))), torch.rand(3, 8).to(BF16))
    torch.testing.assert_close(compiled(*args), layer(*args), rtol=0, atol=0)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_autograd_registration_with_quantised_inputs():
    # int inputs never require grad; a float scale or x that does: the forward runs, floating
    # outputs carry the not-differentiable node, integer outputs are left alone
    x, w = codes(5, 8), codes(2, 8, 4)
    scale = torch.rand(2, 4, requires_grad=True)
    gl = cumsum([2, 3])
    y = gmm([x], [w], scale=[scale], group_list=gl, split_item=3, group_type=0,
            output_dtype=F16)[0]
    with pytest.raises(RuntimeError, match="npu_grouped_matmul: not differentiable"):
        y.float().sum().backward()
    y8 = gmm([x], [w], scale=[scale], group_list=gl, split_item=3, group_type=0)[0]
    assert y8.dtype == I8 and not y8.requires_grad
    xh = torch.randn(5, 8, dtype=BF16, requires_grad=True)
    y = gmm([xh], [w], antiquant_scale=[torch.rand(2, 4).to(BF16)], group_list=gl, split_item=3,
            group_type=0)[0]
    with pytest.raises(RuntimeError, match="npu_grouped_matmul: not differentiable"):
        y.float().sum().backward()


# ----------------------------------------------------------------------------- errors


def test_bad_quantised_inputs():
    x, w, xh = codes(9, 8), codes(3, 8, 4), torch.randn(9, 8).to(BF16)
    gl = cumsum([2, 3, 4])
    s = torch.rand(3, 4)

    def raises(pattern, *args, **kwargs):
        kwargs = dict(dict(group_list=gl, split_item=3, group_type=0), **kwargs)
        with pytest.raises(RuntimeError, match=pattern):
            gmm(*args, **kwargs)

    raises(r"argument 'act_type' must be 0 \(none\), 1 \(relu\).*but got 3", [x], [w],
           scale=[s], per_token_scale=[torch.rand(9)], act_type=3, output_dtype=BF16)
    raises(r"argument 'act_type' must be 0 \(none\).*but got 6", [x], [w], scale=[s],
           per_token_scale=[torch.rand(9)], act_type=6, output_dtype=BF16)
    raises(r"argument 'act_type' applies only to int8 x and weights with per_token_scale", [x],
           [w], scale=[s], act_type=1, output_dtype=BF16)
    raises(r"argument 'act_type' applies only to int8 x and weights with per_token_scale", [xh],
           [w], antiquant_scale=[s.to(BF16)], act_type=5)
    raises(r"argument 'output_dtype' must be torch.float16, torch.bfloat16 or torch.float32 with "
           r"act_type 2, but got Char", [x], [w], scale=[s], per_token_scale=[torch.rand(9)],
           act_type=2)
    with pytest.raises(RuntimeError, match=r"argument 'act_type' must be 0 or None with an int\[\] "
                       r"group_list .* but got 1"):
        npu.npu_grouped_matmul.List([x], [w], scale=[s], per_token_scale=[torch.rand(9)],
                                    group_list=[2, 5, 9], split_item=3, group_type=0, act_type=1,
                                    output_dtype=BF16)
    raises(r"npu_grouped_matmul: argument 'scale\[0\]' must be \[E, N\] = \[3, 4\]", [x], [w],
           scale=[torch.rand(3, 5)])
    raises(r"argument 'scale\[0\]' must be \[E, N\].*per-group \[E, G, N\] scales belong to the "
           "A8W4", [x], [w], scale=[torch.rand(3, 2, 4)])
    raises(r"argument 'scale\[0\]' must be float32, bfloat16 or int64 .* but got Half", [x], [w],
           scale=[s.half()])
    raises(r"argument 'scale' must hold one tensor per weight tensor \(1\), but got 2", [x], [w],
           scale=[s, s])
    raises(r"argument 'scale\[1\]' must be 1-D \[N\] = \[4\]", [x], [w[0], w[1], w[2]],
           scale=[torch.rand(4), torch.rand(3, 4), torch.rand(4)])
    raises(r"argument 'scale' must be given with int8 x and weights unless output_dtype is "
           "torch.int32", [x], [w], output_dtype=F16)
    raises(r"argument 'scale' must be None with output_dtype torch.int32", [x], [w], scale=[s],
           output_dtype=I32)
    raises(r"argument 'per_token_scale\[0\]' must be \[M\] = \[9\]", [x], [w], scale=[s],
           per_token_scale=[torch.rand(8)], output_dtype=F16)
    raises(r"argument 'per_token_scale\[0\]' must be float32, but got BFloat16", [x], [w],
           scale=[s], per_token_scale=[torch.rand(9).to(BF16)], output_dtype=F16)
    raises(r"argument 'offset' must be None: op-plugin's asymmetric A8W4 offset", [x], [w],
           scale=[s], offset=[s])
    raises(r"argument 'bias\[0\]' must be int32 for Char outputs", [x], [w], scale=[s],
           bias=[torch.rand(3, 4)])
    raises(r"argument 'output_dtype' must be None \(int8\), torch.int8, .* but got Double", [x],
           [w], scale=[s], output_dtype=torch.float64)
    raises(r"argument 'scale\[0\]' carries an offset .* applies only to int8 outputs", [x], [w],
           scale=[opennpu.npu_trans_quant_param(s.reshape(-1), torch.ones(12)).reshape(3, 4)],
           output_dtype=F16)
    raises(r"argument 'antiquant_scale' must be None on the A8W8 path", [x], [w], scale=[s],
           antiquant_scale=[s.to(BF16)])
    raises(r"argument 'output_dtype' must be torch.float16 or torch.bfloat16 with int8 x and int4 "
           r"weights \(A8W4\), but got None", [x], [w.int()], scale=[s])
    raises(r"argument 'weight\[0\]' must be int8 \(A8W8\) or int32 .* \(A8W4\) with int8 x, but "
           "got Short", [x], [w.short()], scale=[s])
    raises(r"argument 'x\[0\]' is int32 .*A4W4", [x.int()], [w.int()], scale=[s])
    raises(r"argument 'weight\[0\]' must be float8 / float4 codes like x\[0\].* but got Char",
           [x.view(torch.float8_e4m3fn)], [w], scale=[s], output_dtype=F32)
    raises(r"argument 'group_type' must be -1 or 0 on the quantised paths", [x], [codes(8, 4)],
           scale=[torch.rand(4)], group_type=2)
    # weight-only
    raises(r"argument 'antiquant_scale' must be given with int8 weights and BFloat16 x", [xh],
           [w])
    raises(r"argument 'antiquant_scale\[0\]' must have x's dtype \(BFloat16\), but got Float",
           [xh], [w], antiquant_scale=[s])
    raises(r"argument 'antiquant_scale\[0\]' must be \[E, N\] = \[3, 4\] \(per channel\) or "
           r"\[E, G, N\]", [xh], [w], antiquant_scale=[torch.rand(3, 5).to(BF16)])
    raises(r"argument 'antiquant_scale\[0\]' must be per channel with int8 weights", [xh], [w],
           antiquant_scale=[torch.rand(3, 2, 4).to(BF16)])
    raises(r"argument 'antiquant_scale\[0\]' must cut K = 8 into equal groups", [xh],
           [pack_int4(torch.zeros(3, 8, 8, dtype=I32))],
           antiquant_scale=[torch.rand(3, 3, 8).to(BF16)])
    raises(r"argument 'antiquant_offset\[0\]' must have the shape of antiquant_scale", [xh],
           [pack_int4(torch.zeros(3, 8, 8, dtype=I32))],
           antiquant_scale=[torch.rand(3, 2, 8).to(BF16)],
           antiquant_offset=[torch.rand(3, 8).to(BF16)])
    raises(r"argument 'scale' must be None on the weight-only path", [xh], [w], scale=[s],
           antiquant_scale=[s.to(BF16)])
    raises(r"argument 'x\[0\]' must be float16 or bfloat16 with int8 / int4 weights", [xh.float()],
           [w], antiquant_scale=[s])
    raises(r"argument 'output_dtype' must be None or x's dtype \(BFloat16\) on the weight-only",
           [xh], [w], antiquant_scale=[s.to(BF16)], output_dtype=F16)
    # the declared dtypes
    raises(r"argument 'weight\[0\]' must be float8 / float4 codes like x\[0\]", [x], [w],
           scale=[s], x_dtype=296)  # int8 bytes named float4_e2m1 x: the float8 / MX path
    raises(r"argument 'x\[0\]' must be float8 / float4 codes like weight\[0\]", [x], [w],
           scale=[s], weight_dtype=torch.float8_e4m3fn)
    raises(r"argument 'weight\[0\]' must be float8 / float4 codes like x\[0\]", [x], [w],
           scale=[s], x_dtype=297)  # int8 bytes named float4_e1m2 x
    raises(r"argument 'x_dtype' must not be torch_npu.hifloat8 \(290\): hifloat8 x / weights "
           r"are not supported", [x], [w], scale=[s], x_dtype=290)
    raises(r"argument 'scale_dtype' must be None or the dtype of scale \(Float\)", [x], [w],
           scale=[s], scale_dtype=I64)
    raises(r"argument 'per_token_scale_dtype' must be None when per_token_scale is not given",
           [x], [w], scale=[s], per_token_scale_dtype=F32)
    raises(r"argument 'activation_input' must be None on the A8W8 path", [x], [w], scale=[s],
           activation_input=[s])


# ----------------------------------------------------------------------------- A8W4


def _uint64_scale(scale):
    """op-plugin's A8W4 scale: the float32 bits in the low 32 bits of an int64."""
    return scale.contiguous().view(I32).to(I64) & 0xFFFFFFFF


def _a8w4_experts(e=3, k=128, n=16, groups=2, rows=(2, 0, 5), seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = sum(rows) + 2  # rows past the groups stay zero
    x = codes(m, k)
    w = torch.randint(-8, 8, (e, k, n), dtype=I32, generator=gen)
    scale = torch.rand(e, groups, n, generator=gen) * 0.01
    bias = torch.rand(e, n, generator=gen) * 10 - 5
    token = torch.rand(m, 1, generator=gen)
    return x, w, scale, bias, token


def ref_a8w4(x, w, scale, bias, token, rows, out_dtype):
    outs, start = [], 0
    for g, m in enumerate(rows):
        xs = x[start:start + m]
        outs.append(R.a8w4_matmul(xs, w[g], scale[g], bias[g], token[start:start + m],
                                  out_dtype))
        start += m
    return torch.cat(outs)


@pytest.mark.parametrize("out_dtype", (F16, BF16), ids=str)
@pytest.mark.parametrize("scale_form", ("uint64", "float32"))
def test_a8w4_matches_op_plugin_golden(out_dtype, scale_form):
    rows = (2, 0, 5)
    x, w, scale, bias, token = _a8w4_experts(rows=rows)
    wq = opennpu.npu_quantize(w.float(), torch.tensor([1.0]), None, torch.quint4x2, -1, False)
    s = _uint64_scale(scale) if scale_form == "uint64" else scale
    y = gmm([x], [wq], bias=[bias], scale=[s], per_token_scale=[token],
            group_list=torch.tensor(rows), split_item=3, group_type=0, group_list_type=1,
            output_dtype=out_dtype)[0]
    assert y.dtype == out_dtype and y.shape == (x.shape[0], 16)
    assert torch.equal(y[:sum(rows)], ref_a8w4(x, w, scale, bias, token, rows, out_dtype))
    assert (y[sum(rows):] == 0).all()
    with portable.force():
        yp = gmm([x], [wq], bias=[bias], scale=[s], per_token_scale=[token],
                 group_list=torch.tensor(rows), split_item=3, group_type=0, group_list_type=1,
                 output_dtype=out_dtype)[0]
    assert torch.equal(yp, y)


def test_a8w4_weight_list_and_x_list():
    rows = (3, 4)
    x, w, scale, bias, token = _a8w4_experts(e=2, k=64, n=24, groups=4, rows=rows, seed=1)
    ws = [opennpu.npu_convert_weight_to_int4pack(w[g]) for g in range(2)]
    xs = [x[:3], x[3:7]]
    ys = gmm(xs, ws, bias=[bias[0], bias[1]], scale=[scale[0], scale[1]],
             per_token_scale=[token[:3], token[3:7].reshape(-1)], output_dtype=F16)
    ref = ref_a8w4(x, w, scale, bias, token, rows, F16)
    assert torch.equal(torch.cat(ys), ref)
    opcheck(npu.npu_grouped_matmul.default, [
        (([x[:7]], ws), dict(scale=[scale[0], scale[1]], group_list=cumsum(rows), split_item=3,
                             group_type=0, output_dtype=5)),
    ])


def test_a8w4_bad_inputs():
    rows = (2, 0, 5)
    x, w, scale, bias, token = _a8w4_experts(rows=rows)
    wq = opennpu.npu_convert_weight_to_int4pack(w)
    kw = dict(group_list=torch.tensor(rows), split_item=3, group_type=0, group_list_type=1,
              output_dtype=F16)

    def raises(pattern, **extra):
        with pytest.raises(RuntimeError, match=pattern):
            gmm([x], [wq], **dict(kw, **extra))

    raises(r"argument 'scale' must be given with int8 x and int4 weights \(A8W4")
    raises(r"argument 'scale\[0\]' must be \[E, G, N\] = \[3, G, 16\]", scale=[scale[0]])
    raises(r"argument 'scale\[0\]' must be int64 .* or float32 with A8W4, but got Half",
           scale=[scale.half()])
    raises(r"argument 'scale' must cut K = 128 of group 0 into equal groups", 
           scale=[torch.rand(3, 3, 16)])
    raises(r"argument 'offset' must be None: op-plugin's asymmetric A8W4 offset", scale=[scale],
           offset=[scale])
    raises(r"argument 'bias\[0\]' must be float32 .* with A8W4, but got Int", scale=[scale],
           bias=[bias.int()])
    raises(r"argument 'output_dtype' must be torch.float16 or torch.bfloat16 with int8 x and "
           r"int4 weights \(A8W4\), but got Float", scale=[scale], output_dtype=F32)
