"""npu_grouped_matmul (Tensor group_list) and npu_grouped_matmul.List (int[] group_list), the
non-quantised paths: split_item 0-3, group_type -1 / 0, group_list_type 0 / 1, bias (the
quantised ones: test_grouped_matmul_quant.py).

Contract: shared/spec/torch_npu_api.md section 1.14; op-plugin's docs of npu_grouped_matmul (the
"single / multi x, weight, y" scenarios).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import LOW_DTYPES, SETTINGS, assert_not_worse_than_native, dtype_id, opcheck, randn

import opennpu
from opennpu.testing import reference as R
from opennpu.testing.tolerances import assert_close

F32, F64, I64 = torch.float32, torch.float64, torch.int64
npu = torch.ops.npu


def gmm(x, weight, **kwargs):
    return opennpu.npu_grouped_matmul(x, weight, **kwargs)


def check(x, weight, bias=None, group_list=None, split_item=0, group_list_type=0, **kwargs):
    out = gmm(x, weight, bias=bias, group_list=group_list, split_item=split_item,
              group_list_type=group_list_type, **kwargs)
    ref = R.grouped_matmul(x, weight, bias, group_list, split_item, group_list_type)
    assert isinstance(out, list) and len(out) == len(ref)
    k = max(w.shape[-2] for w in weight)
    for o, r in zip(out, ref):
        assert o.dtype == x[0].dtype and o.shape == r.shape, (o.shape, r.shape)
        assert_close(o, r, scale=max(1.0, k ** 0.5 / 4))  # K-term dot products
    return out


def cumsum(sizes):
    return torch.tensor(sizes, dtype=I64).cumsum(0)


# ----------------------------------------------------------------------------- the scenarios


@pytest.mark.parametrize("split_item", [2, 3])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_single_x_single_3d_weight(dtype, split_item, with_bias):
    # torch_npu's "single-single-single" MoE form: x [M, K], weight [E, K, N], group_list
    sizes = [5, 0, 17, 3]  # an empty group
    x, w = randn(25, 24, dtype=dtype), randn(4, 24, 40, dtype=dtype)
    bias = [randn(4, 40, dtype=dtype)] if with_bias else None
    check([x], [w], bias, cumsum(sizes), split_item, group_type=0)
    check([x], [w], bias, torch.tensor(sizes), split_item, group_list_type=1, group_type=0)


def test_doc_example_transposed_weight():
    # op-plugin's example: weight [g, K, N] made by transposing a [g, N, K] tensor
    m, k, n, g = 256, 256, 256, 2
    x = torch.randint(-1, 1, (m, k), dtype=torch.float16)
    weight = torch.randint(-1, 1, (g, k, n), dtype=torch.float16).transpose(1, 2)
    out = check([x], [weight], group_list=torch.tensor([128, 256]), split_item=2, group_type=0,
                output_dtype=torch.float16)
    assert out[0].shape == (256, 256)


@pytest.mark.parametrize("split_item", [2, 3])
def test_single_x_weight_list_single_output(split_item):
    sizes = [3, 9, 0, 6]
    x = randn(18, 20)
    ws = [randn(20, 12) for _ in sizes]
    bias = [randn(12) for _ in sizes]
    check([x], ws, bias, cumsum(sizes), split_item, group_type=0)


def test_single_x_weight_list_list_output():
    # "single-multi-multi": x split by group_list, one output per group, each with its own N
    sizes = [4, 0, 7]
    x = randn(11, 16)
    ws = [randn(16, n) for n in (5, 9, 3)]
    out = check([x], ws, [randn(n) for n in (5, 9, 3)], cumsum(sizes), 0, group_type=0)
    assert [o.shape for o in out] == [(4, 5), (0, 9), (7, 3)]


@pytest.mark.parametrize("with_group_list", [False, True])
def test_x_list_single_output(with_group_list):
    # "multi-multi-single": the groups' results one after another in one tensor
    xs = [randn(m, 10) for m in (3, 0, 8)]
    ws = [randn(10, 14) for _ in xs]
    group_list = cumsum([3, 0, 8]) if with_group_list else None
    out = check(xs, ws, [randn(14) for _ in xs], group_list, 2, group_type=0)
    assert out[0].shape == (11, 14)


@pytest.mark.parametrize("dims", [2, 3, 4])
def test_no_grouping_x_list_list_output(dtype, dims):
    # group_type -1, "multi-multi-multi": independent matmuls, x may have leading dims
    lead = (2, 3, 1)[: dims - 2]
    xs = [randn(*lead, m, k, dtype=dtype) for m, k in ((3, 8), (5, 16), (1, 4))]
    ws = [randn(k, n, dtype=dtype) for k, n in ((8, 6), (16, 10), (4, 1))]
    out = check(xs, ws, [randn(n, dtype=dtype) for n in (6, 10, 1)], None, 0, group_type=-1)
    assert out[1].shape == (*lead, 5, 10)


def test_group_type_none_is_inferred():
    x, w = randn(9, 8), randn(3, 8, 4)
    check([x], [w], group_list=cumsum([2, 3, 4]), split_item=3)  # group_type=None
    check([randn(2, 8)], [randn(8, 4)])  # one group, no group_list


def test_list_overload_takes_int_group_lists():
    x, w = randn(12, 16), randn(3, 16, 8)
    out = npu.npu_grouped_matmul.List([x], [w], group_list=[4, 4, 12], split_item=3, group_type=0)
    ref = R.grouped_matmul([x], [w], None, [4, 4, 12], 3)
    assert_close(out[0], ref[0])
    out = npu.npu_grouped_matmul([x], [w], group_list=[4, 4, 12], split_item=3, group_type=0)
    assert_close(out[0], ref[0])  # the packet picks .List for an int list
    outs = check([x], [randn(16, 5), randn(16, 7), randn(16, 2)], group_list=[3, 4, 5],
                 group_list_type=1, split_item=0, group_type=0)
    assert [o.shape for o in outs] == [(3, 5), (4, 7), (5, 2)]


def test_rows_past_the_last_group_are_zero():
    x, w = randn(10, 8), randn(2, 8, 6)
    out = check([x], [w], group_list=cumsum([3, 4]), split_item=3, group_type=0)
    assert (out[0][7:] == 0).all()
    with opennpu.strict():
        with pytest.raises(RuntimeError, match=r"must cover all 10 rows of x\[0\].*strict mode"):
            gmm([x], [w], group_list=cumsum([3, 4]), split_item=3, group_type=0)


def test_tiles_and_transposed_operands(dtype):
    # more than one 256 x 512 output tile per group, weights as transposed views, and x with a
    # row stride (a column slice)
    sizes = [300, 0, 20]
    x = randn(320, 70, dtype=dtype)[:, 3:67]
    w = randn(3, 600, 64, dtype=dtype).transpose(1, 2)
    bias = [randn(3, 600, dtype=dtype)]
    check([x], [w], bias, cumsum(sizes), 3, group_type=0)
    xt = randn(64, 320, dtype=dtype).t()  # column-major x
    check([xt], [w], bias, cumsum(sizes), 3, group_type=0)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_bias_in_float32_with_half_inputs(dtype):
    x, w = randn(30, 32, dtype=dtype), randn(2, 32, 24, dtype=dtype)
    bias = randn(2, 24) * 100  # added in fp32 before the one rounding
    out = check([x], [w], [bias], cumsum([10, 20]), 3, group_type=0)
    ref = R.grouped_matmul([x], [w], [bias], cumsum([10, 20]), 3)[0]
    native = torch.cat([x[:10] @ w[0] + bias[0].to(dtype), x[10:] @ w[1] + bias[1].to(dtype)])
    assert_not_worse_than_native(out[0], native, ref)


def test_empty_shapes():
    check([randn(0, 8)], [randn(2, 8, 4)], group_list=cumsum([0, 0]), split_item=3, group_type=0)
    out = check([randn(5, 0)], [randn(2, 0, 4)], [randn(2, 4)], cumsum([2, 3]), 3, group_type=0)
    assert_close(out[0][:2], randn(2, 4) * 0 + out[0][0])  # K = 0: just the bias
    check([randn(3, 8)], [randn(8, 0)], split_item=0, group_type=-1)


def test_converting_fallback_matches(tmp_path):
    # OPENNPU_GMM_HALF_GEMM=0 (or a BLAS without MKL's half-precision GEMMs): operands converted
    # to fp32 per tile and multiplied by sgemm; same results up to summation order.
    script = tmp_path / "fallback.py"
    script.write_text(
        "import torch, opennpu\n"
        "from opennpu.testing import reference as R\n"
        "from opennpu.testing.tolerances import assert_close\n"
        "torch.manual_seed(0)\n"
        "for dt in (torch.bfloat16, torch.float16):\n"
        "    x = torch.randn(300, 40).to(dt)\n"
        "    w = torch.randn(2, 600, 40).to(dt).transpose(1, 2)\n"
        "    b = [torch.randn(2, 600)]\n"
        "    gl = torch.tensor([100, 300])\n"
        "    out = opennpu.npu_grouped_matmul([x], [w], bias=b, group_list=gl, split_item=3,\n"
        "                                     group_type=0)[0]\n"
        "    assert_close(out, R.grouped_matmul([x], [w], b, gl, 3)[0], scale=2)\n"
        "    xt = torch.randn(40, 300).to(dt).t()\n"
        "    out = opennpu.npu_grouped_matmul([xt], [w], group_list=gl, split_item=3,\n"
        "                                     group_type=0)[0]\n"
        "    assert_close(out, R.grouped_matmul([xt], [w], None, gl, 3)[0], scale=2)\n"
        "print('ok')\n")
    env = dict(os.environ, OPENNPU_GMM_HALF_GEMM="0")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


# ----------------------------------------------------------------------------- grouping on K


def k_split_reference(x, w, sizes):
    """Group g: x[:, K_g] @ w[K_g, :] in float64, stacked into [G, M, N]."""
    out, k0 = [], 0
    for kg in sizes:
        out.append(x[:, k0:k0 + kg].double() @ w[k0:k0 + kg].double())
        k0 += kg
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [F32, *LOW_DTYPES], ids=dtype_id)
@pytest.mark.parametrize("transposed_x", [False, True])
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_group_type_2_groups_on_k(dtype, transposed_x, group_list_type):
    # op-plugin's test_npu_grouped_matmul_6: x = x1.T, weight [K, N], cumulative K ends.
    sizes = [3, 0, 7, 13]  # an empty group gives zeros; the last K column is not used
    m, k, n = 5, 24, 6
    x = randn(k, m, dtype=dtype).t() if transposed_x else randn(m, k, dtype=dtype)
    w = randn(k, n, dtype=dtype)
    gl = torch.tensor(sizes, dtype=I64) if group_list_type == 1 else cumsum(sizes)
    (out,) = npu.npu_grouped_matmul([x], [w], group_list=gl, split_item=3, group_type=2,
                                    group_list_type=group_list_type)
    assert out.shape == (4, m, n) and out.dtype == dtype
    assert_close(out, k_split_reference(x, w, sizes), dtype=dtype)
    assert not out[1].any()
    (out_list,) = npu.npu_grouped_matmul.List([x], [w], group_list=gl.tolist(), split_item=2,
                                              group_type=2, group_list_type=group_list_type)
    torch.testing.assert_close(out_list, out)


def test_group_type_2_opcheck():
    x, w = randn(10, 6).t(), randn(10, 3)
    opcheck(npu.npu_grouped_matmul.default,
            [(([x], [w]), dict(group_list=cumsum([4, 6]), split_item=3, group_type=2))])
    opcheck(npu.npu_grouped_matmul.List,
            [(([x], [w]), dict(group_list=[4, 10], split_item=2, group_type=2))])


# ----------------------------------------------------------------------------- errors


def test_bad_inputs():
    x, w = randn(9, 8), randn(3, 8, 4)
    gl = cumsum([2, 3, 4])

    def raises(pattern, *args, **kwargs):
        with pytest.raises(RuntimeError, match=pattern):
            gmm(*args, **kwargs)

    raises("argument 'scale' must be None on the non-quantised path", [x], [w], scale=[torch.ones(3, 4)],
           group_list=gl, split_item=3, group_type=0)
    raises("argument 'per_token_scale' must be None", [x], [w], per_token_scale=[torch.ones(9)],
           group_list=gl, split_item=3, group_type=0)
    raises("argument 'act_type' applies only to int8 x and weights with per_token_scale", [x], [w],
           group_list=gl, split_item=3, group_type=0, act_type=1)
    raises(r"argument 'weight' must hold one 2-D tensor \[K, N\] with group_type 2", [x], [w],
           group_list=gl, split_item=3, group_type=2)
    raises(r"argument 'split_item' must be 2 or 3 .* with group_type 2", [x], [randn(8, 4)],
           group_list=gl, split_item=0, group_type=2)
    raises(r"argument 'bias' must be None with group_type 2", [x], [randn(8, 4)],
           bias=[randn(4)], group_list=gl, split_item=3, group_type=2)
    raises(r"'group_list' must cover at most the K = 8 columns", [x], [randn(8, 4)],
           group_list=cumsum([4, 5]), split_item=3, group_type=2)
    for bad in (1, 3, 100):  # op-plugin's words, which its test_npu_grouped_matmul matches
        raises(rf"The group type must be -1 .*, 0 .* or 2 .*but now is \[{bad}\]", [x], [w],
               group_list=gl, split_item=3, group_type=bad)
    raises(r"argument 'x_dtype' must be None or the dtype of x \(Float\) on this path", [x], [w],
           group_list=gl, split_item=3, group_type=0, x_dtype=torch.int8)
    raises(r"argument 'weight\[0\]' must hold one byte per element .* 'weight_dtype' is dtype "
           r"code 296", [x], [w], group_list=gl, split_item=3, group_type=0, weight_dtype=296)
    raises(r"argument 'scale_dtype' must be None when scale is not given", [x], [w],
           group_list=gl, split_item=3, group_type=0, scale_dtype=torch.float32)
    raises(r"argument 'per_token_scale_dtype' must be None", [x], [w], group_list=gl,
           split_item=3, group_type=0, per_token_scale_dtype=torch.float32)
    raises("argument 'group_list' must be None with group_type -1", [x], [w], group_list=gl,
           split_item=3, group_type=-1)
    raises("argument 'split_item' must be 0 or 1", [x], [w], group_list=gl, split_item=4,
           group_type=0)
    raises(r"argument 'output_dtype' must be None or x's dtype \(Float\)", [x], [w],
           group_list=gl, split_item=3, group_type=0, output_dtype=torch.float16)
    raises(r"argument 'group_list' must have one entry per group \(3", [x], [w],
           group_list=cumsum([2, 7]), split_item=3, group_type=0)
    raises(r"'group_list' must cover at most the 9 rows of x\[0\], but group 2 holds 5 rows after 5", [x],
           [w], group_list=cumsum([2, 3, 5]), split_item=3, group_type=0)
    raises("must be non-negative and non-decreasing .* entry 1 is 1 after 2", [x], [w],
           group_list=torch.tensor([2, 1, 9]), split_item=3, group_type=0)
    raises("must hold non-negative group sizes", [x], [w], group_list=torch.tensor([2, -1, 8]),
           group_list_type=1, split_item=3, group_type=0)
    raises(r"'group_list' must be \[E, 2\] \(group index, group size\) pairs", [x], [w],
           group_list=gl, group_list_type=2, split_item=3, group_type=0)
    raises("'group_list_type' must be 0 .* or 1 .*, or 2 with a group_list tensor", [x], [w],
           group_list=[2, 3, 4], group_list_type=2, split_item=3, group_type=0)
    raises(r"argument 'x\[0\]' must have K = 8 columns", [randn(9, 7)], [w], group_list=gl,
           split_item=3, group_type=0)
    raises(r"argument 'x' must hold one tensor per group \(3\).*1 tensors and no group_list", [x],
           [w], split_item=3, group_type=0)
    raises("must give every group the same N with split_item 2 or 3", [x],
           [randn(8, 4), randn(8, 5), randn(8, 4)], group_list=gl, split_item=3, group_type=0)
    raises(r"argument 'weight\[0\]' must have x's dtype \(Float\), but got Half", [x], [w.half()],
           group_list=gl, split_item=3, group_type=0)
    raises(r"argument 'scale' must be given with int8 x and weights", [x.to(torch.int8)], [w.to(torch.int8)],
           group_list=gl, split_item=3, group_type=0)
    raises(r"argument 'bias\[0\]' must be \[E, N\] = \[3, 4\]", [x], [w], bias=[randn(4)],
           group_list=gl, split_item=3, group_type=0)
    raises(r"argument 'bias\[1\]' must be 1-D \[N\] = \[5\]", [randn(2, 8), randn(3, 8)],
           [randn(8, 4), randn(8, 5)], bias=[randn(4), randn(4)], split_item=0, group_type=-1)
    raises(r"argument 'x\[0\]' must be 2-D \[M, K\] with split_item 2 or 3", [randn(2, 3, 8)],
           [randn(8, 4)], split_item=3, group_type=-1)
    raises(r"'group_list' must give each group the rows of its x tensor, but group 1 has 2 rows",
           [randn(2, 8), randn(3, 8)], [randn(8, 4), randn(8, 4)], group_list=cumsum([2, 2]),
           split_item=2, group_type=0)
    # The op (torch_npu.npu_grouped_matmul) requires group_type, in op-plugin's words; the
    # opennpu wrapper picks it (0 with a group_list splitting one x, else -1).
    with pytest.raises(RuntimeError, match="Requires manual passing group_type"):
        npu.npu_grouped_matmul([x], [w], group_list=gl, split_item=3)
    with pytest.raises(RuntimeError, match="Requires manual passing group_type"):
        npu.npu_grouped_matmul([randn(2, 8)], [randn(8, 4)])
    torch.testing.assert_close(gmm([x], [w], group_list=gl, split_item=3)[0],
                               gmm([x], [w], group_list=gl, split_item=3, group_type=0)[0])


# ----------------------------------------------------------------------------- opcheck, compile


def test_opcheck_tensor_overload():
    x, w = randn(9, 8), randn(3, 8, 4)
    gl = cumsum([2, 3, 4])
    samples = [
        (([x], [w]), dict(group_list=gl, split_item=3, group_type=0)),
        (([x], [w]), dict(bias=[randn(3, 4)], group_list=torch.tensor([2, 3, 4]), split_item=2,
                          group_type=0, group_list_type=1)),
        (([randn(2, 8), randn(3, 5)], [randn(8, 4), randn(5, 6)]),
         dict(bias=[randn(4), randn(6)], split_item=0, group_type=-1)),
        (([randn(2, 8).bfloat16(), randn(3, 8).bfloat16()], [randn(8, 4).bfloat16()] * 2),
         dict(split_item=2, group_type=0)),
    ]
    opcheck(npu.npu_grouped_matmul.default, samples)


def test_opcheck_list_overload():
    x, w = randn(9, 8), randn(3, 8, 4)
    samples = [(([x], [w]), dict(group_list=[2, 5, 9], split_item=3, group_type=0)),
               (([x], [randn(8, 2), randn(8, 3), randn(8, 4)]),
                dict(group_list=[2, 3, 4], group_list_type=1, split_item=0, group_type=0))]
    opcheck(npu.npu_grouped_matmul.List, samples)


def test_data_dependent_list_outputs_have_dynamic_sizes():
    # single x split into a list by a Tensor group_list: the output sizes are data
    x, ws = randn(9, 8), [randn(8, 3) for _ in range(3)]
    gl = cumsum([2, 3, 4])
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fx, fws, fgl = mode.from_tensor(x), [mode.from_tensor(w) for w in ws], mode.from_tensor(gl)
        out = npu.npu_grouped_matmul([fx], fws, group_list=fgl, split_item=0, group_type=0)
    assert len(out) == 3 and all(isinstance(o.shape[0], torch.SymInt) for o in out)
    check([x], ws, group_list=gl, split_item=0, group_type=0)


def test_compile_fullgraph_dynamic():
    def layer(x, w, gl, b):
        h = npu.npu_grouped_matmul([x], [w], bias=[b], group_list=gl, split_item=3,
                                   group_type=0)[0]
        return (torch.relu(h) * 2,)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    for m in (9, 14):
        x, w, b = randn(m, 8), randn(3, 8, 5), randn(3, 5)
        gl = torch.tensor([2, 5, m])
        torch.testing.assert_close(compiled(x, w, gl, b)[0], layer(x, w, gl, b)[0], rtol=0, atol=0)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_not_differentiable():
    x = randn(4, 8, requires_grad=True)
    out = gmm([x], [randn(8, 3)], split_item=0, group_type=-1)
    with pytest.raises(RuntimeError, match="npu_grouped_matmul: not differentiable"):
        out[0].sum().backward()


@settings(**SETTINGS)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6), k=st.integers(1, 40),
       n=st.integers(1, 70), tail=st.integers(0, 3), split_item=st.sampled_from([0, 2, 3]),
       list_type=st.sampled_from([0, 1]), with_bias=st.booleans(), transposed=st.booleans(),
       as_list=st.booleans(), dtype=st.sampled_from([F32, torch.bfloat16]))
def test_hypothesis_single_x(sizes, k, n, tail, split_item, list_type, with_bias, transposed,
                             as_list, dtype):
    e = len(sizes)
    x = randn(sum(sizes) + tail, k, dtype=dtype)
    w = randn(e, n, k, dtype=dtype).transpose(1, 2) if transposed else randn(e, k, n, dtype=dtype)
    group_list = cumsum(sizes) if list_type == 0 else torch.tensor(sizes)
    if as_list:
        group_list = group_list.tolist()
    if split_item == 0:
        w = list(w.unbind(0))  # one weight per group for list outputs
        bias = [randn(n, dtype=dtype) for _ in range(e)] if with_bias else None
    else:
        w = [w]
        bias = [randn(e, n, dtype=dtype)] if with_bias else None
    check([x], w, bias, group_list, split_item, list_type, group_type=0)


@pytest.mark.parametrize("pairs", [[(0, 2), (1, 0), (2, 5)], [(2, 3), (0, 2), (2, 1), (1, 1)]],
                         ids=["in_group_order", "sparse_unsorted_repeated"])
def test_group_list_type_2_pairs(pairs):
    """group_list_type 2: [E, 2] (group, rows) pairs, x's rows taken in the list's order."""
    e, k, n = 3, 8, 5
    m = sum(rows for _, rows in pairs)
    x, w, bias = randn(m, k), randn(e, k, n), randn(e, n)
    out = gmm([x], [w], bias=[bias], group_list=torch.tensor(pairs), group_list_type=2,
              split_item=3, group_type=0)[0]
    refs, r = [], 0
    for g, rows in pairs:
        refs.append(x[r:r + rows].double() @ w[g].double() + bias[g].double())
        r += rows
    assert out.shape == (m, n)
    torch.testing.assert_close(out.double(), torch.cat(refs), rtol=1e-5, atol=1e-5)


def test_group_list_type_2_from_routing_v2():
    """npu_moe_init_routing_v2's expert_tokens_num_type 2 ((expert, count) rows of the experts
    with tokens, then (0, 0)) drives npu_grouped_matmul's group_list_type 2 as the counts of type
    1 do."""
    gen = torch.Generator().manual_seed(5)
    tokens, topk, experts, h, n = 6, 2, 5, 8, 4
    x = torch.randn(tokens, h, generator=gen)
    idx = torch.tensor([[4, 1], [1, 4], [4, 1], [1, 1], [4, 4], [1, 4]], dtype=torch.int32)
    w = torch.randn(experts, h, n, generator=gen)
    outs = {}
    for t in (1, 2):
        ex, _, counts, _ = opennpu.npu_moe_init_routing_v2(
            x, idx, expert_num=experts, expert_tokens_num_type=t, expert_tokens_num_flag=True,
            active_num=tokens * topk)
        outs[t] = gmm([ex], [w], group_list=counts, group_list_type=t, split_item=3,
                      group_type=0)[0]
        if t == 2:
            assert counts.shape == (experts, 2) and counts[2:].eq(0).all()
    assert torch.equal(outs[2], outs[1])
