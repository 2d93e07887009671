"""MoE dispatch / combine: npu_moe_token_permute, npu_moe_token_unpermute, their gradient ops
(npu_moe_token_permute_grad(_v2), npu_moe_token_unpermute_grad(_v2)) and autograd.

Contract: op-plugin's op_plugin_functions.yaml and its goldens (Megatron's permute / unpermute in
test_npu_moe_token_permute_and_unpermute(_backward).py: stable argsort of the flattened indices,
index_select of tokens[sorted // topk]; the op returns the inverse permutation as sorted_indices;
unpermute gathers by it and sums probs-weighted over topk). The references below are those
goldens, computed in float64.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import LOW_DTYPES, SETTINGS, assert_not_worse_than_native, dtype_id, opcheck, randn

import opennpu
from opennpu.testing.tolerances import assert_close

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
npu = torch.ops.npu


# ----------------------------------------------------------------------------- references


def ref_permute(tokens, indices, num_out_tokens=None):
    k = 1 if indices.dim() == 1 else indices.shape[1]
    order = torch.argsort(indices.reshape(-1), stable=True)
    n = order.numel()
    rows = (min(num_out_tokens, n) if num_out_tokens and num_out_tokens > 0
            else n + (num_out_tokens or 0))
    return tokens[order[:rows] // k], torch.argsort(order).to(I32)


def ref_unpermute(permuted, sorted_indices, probs=None):
    """Megatron's unpermute (index_copy of the permuted rows, weighted sum over topk) in float64,
    positions past the permuted rows counting as dropped (zero) rows."""
    src = sorted_indices.long()
    padded = torch.cat([permuted.double(), permuted.new_zeros(1, permuted.shape[1]).double()])
    terms = padded[torch.where(src < permuted.shape[0], src, permuted.shape[0])]
    if probs is None:
        return terms
    return (terms.view(*probs.shape, -1) * probs.double().unsqueeze(-1)).sum(1)


def routing(t, k, experts, h, dtype=F32, index_dtype=I64):
    tokens = randn(t, h, dtype=dtype)
    indices = torch.randint(0, experts, (t, k) if k else (t,), dtype=index_dtype)
    return tokens, indices


# ----------------------------------------------------------------------------- permute


@pytest.mark.parametrize("t,k,experts,h", [(7, 2, 4, 5), (33, 4, 128, 83), (16, 1, 3, 769),
                                           (5, 0, 8, 64)], ids=str)
def test_permute_matches_reference(dtype, t, k, experts, h):
    tokens, indices = routing(t, k, experts, h, dtype)
    permuted, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices)
    want, want_idx = ref_permute(tokens, indices)
    assert permuted.dtype == dtype and sorted_indices.dtype == I32
    assert torch.equal(permuted, want)  # rows are moved, bit for bit
    assert torch.equal(sorted_indices, want_idx)


@pytest.mark.parametrize("h", [5, 64, 83, 1000])
def test_permute_streamed_rows(h):
    """Outputs over the streaming threshold are written with streaming stores (whole lines;
    the partial lines at each row's ends stored normally): the same rows, bit for bit, for rows
    of any length and alignment, and dropped rows (num_out_tokens past the pairs) still zero."""
    old = torch.ops.opennpu._set_stream_min_bytes(256)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            tokens, indices = routing(37, 3, 8, h, dtype)
            permuted, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices)
            want, want_idx = ref_permute(tokens, indices)
            assert torch.equal(permuted, want) and torch.equal(sorted_indices, want_idx)
            x = randn(37, h, dtype=dtype)
            expert = torch.randint(0, 8, (37, 3), dtype=I32)
            row_idx = torch.arange(37 * 3, dtype=I32).view(3, 37).t().contiguous()
            expanded, _, _ = opennpu.npu_moe_init_routing(x, row_idx, expert, 37)
            old_off = torch.ops.opennpu._set_stream_min_bytes(1 << 40)
            try:
                plain, _, _ = opennpu.npu_moe_init_routing(x, row_idx, expert, 37)
            finally:
                torch.ops.opennpu._set_stream_min_bytes(old_off)
            assert torch.equal(expanded, plain)
    finally:
        torch.ops.opennpu._set_stream_min_bytes(old)


@pytest.mark.parametrize("num_out_tokens", [None, 0, 5, 13, 100, -3, -13])
def test_permute_num_out_tokens(num_out_tokens):
    tokens, indices = routing(13, 1, 4, 8)
    permuted, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices, num_out_tokens)
    want, want_idx = ref_permute(tokens, indices, num_out_tokens)
    assert torch.equal(permuted, want) and torch.equal(sorted_indices, want_idx)
    assert sorted_indices.shape == (13,)  # all pairs, dropped ones included


def test_permute_op_plugin_example():
    # stable: equal experts keep the (token, slot) order
    tokens = torch.arange(3.0).view(3, 1).expand(3, 2).contiguous()
    indices = torch.tensor([[1, 0], [0, 1], [1, 1]], dtype=I32)
    permuted, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices)
    assert permuted[:, 0].tolist() == [0, 1, 0, 1, 2, 2]
    assert sorted_indices.tolist() == [2, 0, 1, 3, 4, 5]


def test_permute_any_dtype_noncontiguous_and_empty():
    tokens = torch.arange(40, dtype=torch.int16).view(8, 5)
    indices = torch.randint(0, 3, (8, 2), dtype=I32)
    permuted, idx = opennpu.npu_moe_token_permute(tokens, indices)
    assert torch.equal(permuted, ref_permute(tokens, indices)[0])
    x = randn(6, 9).t()  # [9, 6], strided
    ind = torch.randint(0, 5, (3, 9)).t()  # [9, 3], strided
    assert torch.equal(opennpu.npu_moe_token_permute(x, ind)[0], ref_permute(x, ind)[0])
    p, i = opennpu.npu_moe_token_permute(randn(0, 4), torch.zeros(0, 2, dtype=I32))
    assert p.shape == (0, 4) and i.shape == (0,)


def test_permute_bad_inputs():
    op = opennpu.npu_moe_token_permute
    tokens, indices = routing(4, 2, 3, 8)
    with pytest.raises(RuntimeError, match="argument 'padded_mode' must be False"):
        op(tokens, indices, None, True)
    with pytest.raises(RuntimeError, match=re.escape("argument 'tokens' must be 2-D")):
        op(tokens.view(2, 2, 8), indices)
    with pytest.raises(RuntimeError, match=r"argument 'indices' must be \[num_tokens\] or "
                                           r"\[num_tokens, topk\] with num_tokens = .* = 4, "
                                           r"but got shape \[3, 2\]"):
        op(tokens, indices[:3])
    with pytest.raises(RuntimeError, match="argument 'indices' must be int32 .or int64., but got "
                                           "Float"):
        op(tokens, indices.float())
    with pytest.raises(RuntimeError, match=r"argument 'num_out_tokens' must be >= "
                                           r"-indices.numel\(\) = -8 .* but got -9"):
        op(tokens, indices, -9)


def test_permute_opcheck():
    tokens, indices = routing(6, 2, 4, 8)
    opcheck(npu.npu_moe_token_permute.default,
            [((tokens, indices), {}), ((tokens.bfloat16(), indices.int(), 5), {}),
             ((tokens, indices[:, 0], -2), {}), ((randn(0, 3), torch.zeros(0, 2, dtype=I32)), {})])


# ----------------------------------------------------------------------------- unpermute


@pytest.mark.parametrize("t,k,h", [(7, 2, 5), (33, 4, 83), (3, 1, 769), (20, 8, 64)], ids=str)
def test_unpermute_matches_reference(dtype, t, k, h):
    _, indices = routing(t, k, 8, h)
    sorted_indices = torch.argsort(torch.argsort(indices.reshape(-1), stable=True)).to(I32)
    permuted = randn(t * k, h, dtype=dtype)
    probs = torch.rand(t, k, dtype=dtype)
    out = opennpu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    assert out.dtype == dtype and out.shape == (t, h)
    assert_close(out, ref_unpermute(permuted, sorted_indices, probs), dtype=dtype, scale=2)
    # without probs every pair is its own output row (topk = 1)
    plain = opennpu.npu_moe_token_unpermute(permuted, sorted_indices)
    assert plain.shape == (t * k, h)
    assert torch.equal(plain, permuted[sorted_indices.long()])


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_unpermute_float32_probs_and_not_worse_than_native(dtype):
    t, k, h = 64, 4, 128
    _, sorted_indices = opennpu.npu_moe_token_permute(randn(t, 1), torch.randint(0, 8, (t, k)))
    permuted = randn(t * k, h, dtype=dtype)
    probs32 = torch.softmax(randn(t, k), -1)
    out = opennpu.npu_moe_token_unpermute(permuted, sorted_indices, probs32)
    assert out.dtype == dtype
    ref = ref_unpermute(permuted, sorted_indices, probs32)
    assert_close(out, ref, dtype=dtype)
    probs = probs32.to(dtype)
    ours = opennpu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    native = (permuted[sorted_indices.long()].view(t, k, h) * probs.unsqueeze(-1)).sum(1)
    assert_not_worse_than_native(ours, native, ref_unpermute(permuted, sorted_indices, probs))


def test_unpermute_round_trip_and_dropped_pairs():
    tokens, indices = routing(21, 3, 5, 16)
    permuted, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices)
    probs = torch.full((21, 3), 1 / 3)
    torch.testing.assert_close(opennpu.npu_moe_token_unpermute(permuted, sorted_indices, probs),
                               tokens, rtol=1e-6, atol=1e-6)
    # num_out_tokens drops the last pairs in expert order: they come back as zero terms
    permuted, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices, 40)
    assert permuted.shape == (40, 16)
    out = opennpu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    assert_close(out, ref_unpermute(permuted, sorted_indices, probs), dtype=F32)
    kept = (sorted_indices < 40).view(21, 3).float()
    torch.testing.assert_close(out, tokens * (kept.sum(1, keepdim=True) / 3), rtol=1e-5,
                               atol=1e-6)


def test_unpermute_noncontiguous_and_empty():
    _, sorted_indices = opennpu.npu_moe_token_permute(randn(9, 1), torch.randint(0, 4, (9, 2)))
    permuted = randn(8, 18).t()  # [18, 8], strided
    probs = torch.rand(2, 9).t()
    out = opennpu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    assert_close(out, ref_unpermute(permuted, sorted_indices, probs), dtype=F32)
    empty = opennpu.npu_moe_token_unpermute(randn(0, 5), torch.zeros(0, dtype=I32),
                                            torch.rand(0, 3))
    assert empty.shape == (0, 5)


def test_unpermute_bad_inputs():
    op = opennpu.npu_moe_token_unpermute
    permuted, idx, probs = randn(8, 4), torch.randperm(8).to(I32), torch.rand(4, 2)
    with pytest.raises(RuntimeError, match="'sorted_indices' must hold positions in \\[0, 8\\).*"
                                           "but got 8"):
        op(permuted, idx + 1 - idx.min(), probs)
    with pytest.raises(RuntimeError, match=re.escape("argument 'probs' must have shape [4, 2]")):
        op(permuted, idx, probs[:3])
    with pytest.raises(RuntimeError, match="'sorted_indices' must have num_tokens \\* topk "
                                           "entries for topk = probs.size\\(1\\) = 3, but got 8"):
        op(permuted, idx, torch.rand(3, 3))
    with pytest.raises(RuntimeError, match="argument 'sorted_indices' must be 1-D"):
        op(permuted, idx.view(4, 2), probs)
    with pytest.raises(RuntimeError, match="argument 'padded_mode' must be False"):
        op(permuted, idx, probs, True, [4, 4])
    with pytest.raises(RuntimeError, match="argument 'permuted_tokens' must be float16, bfloat16"):
        op(permuted.int(), idx, probs)


def test_unpermute_opcheck():
    permuted, idx = randn(12, 7), torch.randperm(12).to(I32)
    opcheck(npu.npu_moe_token_unpermute.default,
            [((permuted, idx, torch.rand(4, 3)), {}), ((permuted, idx), {}),
             ((permuted[:9].bfloat16(), idx.long(), torch.rand(6, 2)), {"restore_shape": [6, 7]})])


# ----------------------------------------------------------------------------- gradients


def test_gradcheck_float64():
    tokens, indices = routing(6, 3, 4, 5, F64)
    tokens.requires_grad_()
    probs = torch.rand(6, 3, dtype=F64, requires_grad=True)

    def layer(x, p, num_out=None):
        permuted, sorted_indices = opennpu.npu_moe_token_permute(x, indices, num_out)
        return opennpu.npu_moe_token_unpermute(permuted * 1.5, sorted_indices, p)

    assert torch.autograd.gradcheck(layer, (tokens, probs))
    assert torch.autograd.gradcheck(lambda x, p: layer(x, p, 11), (tokens, probs))
    assert torch.autograd.gradcheck(
        lambda x: opennpu.npu_moe_token_permute(x, indices[:, 0], -2)[0], (tokens,))
    _, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices)
    rows = randn(18, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda r: opennpu.npu_moe_token_unpermute(r, sorted_indices), (rows,))


@pytest.mark.parametrize("dtype", (F32, *LOW_DTYPES), ids=dtype_id)
def test_gradients_match_the_reference(dtype):
    t, k, h = 19, 4, 37
    tokens, indices = routing(t, k, 6, h, dtype)
    probs = torch.rand(t, k, dtype=F32)  # float32 probs with low-precision tokens, as Megatron
    leaves = [tokens.clone().requires_grad_(), probs.clone().requires_grad_()]
    permuted, sorted_indices = opennpu.npu_moe_token_permute(leaves[0], indices)
    out = opennpu.npu_moe_token_unpermute(permuted, sorted_indices, leaves[1])
    grad = randn(t, h, dtype=dtype)
    out.backward(grad)
    ref_leaves = [tokens.double().requires_grad_(), probs.double().requires_grad_()]
    rp, ri = ref_permute(ref_leaves[0], indices)
    ref_unpermute(rp, ri, ref_leaves[1]).backward(grad.double())
    assert leaves[0].grad.dtype == dtype and leaves[1].grad.dtype == F32
    assert_close(leaves[0].grad, ref_leaves[0].grad, dtype=dtype, scale=4)
    assert_close(leaves[1].grad, ref_leaves[1].grad, dtype=dtype, scale=8)


def test_gradient_ops_direct():
    t, k, h = 9, 3, 11
    tokens, indices = routing(t, k, 4, h, F64)
    permuted, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices, 20)
    g = randn(20, h, dtype=F64)
    want = ref_unpermute(g, sorted_indices).view(t, k, h).sum(1)
    torch.testing.assert_close(
        opennpu.npu_moe_token_permute_grad(tokens, g, indices, sorted_indices), want)
    torch.testing.assert_close(
        opennpu.npu_moe_token_permute_grad_v2(g, sorted_indices, t, F64, k), want)
    probs = torch.rand(t, k, dtype=F64)
    gu = randn(t, h, dtype=F64)
    leaves = [permuted.clone().requires_grad_(), probs.clone().requires_grad_()]
    ref_unpermute(leaves[0], sorted_indices, leaves[1]).backward(gu)
    for grad_rows, grad_probs in (
            opennpu.npu_moe_token_unpermute_grad(permuted, gu, sorted_indices, probs),
            opennpu.npu_moe_token_unpermute_grad_v2(gu, sorted_indices, 20, F64, probs,
                                                    permuted_tokens=permuted)):
        torch.testing.assert_close(grad_rows, leaves[0].grad)
        torch.testing.assert_close(grad_probs, leaves[1].grad)
    rows, none = opennpu.npu_moe_token_unpermute_grad_v2(gu.repeat_interleave(k, 0),
                                                         sorted_indices, 20, F32)
    assert rows.dtype == F32 and none.shape == () and none.item() == 0
    torch.testing.assert_close(rows.double()[sorted_indices[sorted_indices < 20].long()],
                               gu.repeat_interleave(k, 0)[sorted_indices < 20], atol=1e-6,
                               rtol=1e-6)


def test_gradient_ops_bad_inputs():
    g, idx = randn(8, 4), torch.randperm(8).to(I32)
    with pytest.raises(RuntimeError, match="'sorted_indices' must not repeat a position"):
        opennpu.npu_moe_token_unpermute_grad_v2(g, torch.zeros(8, dtype=I32), 8, F32)
    with pytest.raises(RuntimeError, match="'permuted_tokens' must be given with probs"):
        opennpu.npu_moe_token_unpermute_grad_v2(g[:4], idx, 8, F32, torch.rand(4, 2))
    with pytest.raises(RuntimeError, match=r"'sorted_indices' must have num_tokens \* topk = 3 "
                                           r"\* 2 = 6 entries, but got 8"):
        opennpu.npu_moe_token_permute_grad_v2(g, idx, 3, F32, 2)
    with pytest.raises(RuntimeError, match="argument 'num_topK' must be >= 1, but got 0"):
        opennpu.npu_moe_token_permute_grad_v2(g, idx, 3, F32, 0)
    with pytest.raises(RuntimeError, match="'tokens_dtype' must be a floating dtype"):
        opennpu.npu_moe_token_permute_grad_v2(g, idx, 4, I32, 2)


def test_gradient_ops_opcheck():
    t, k, h = 5, 2, 6
    tokens, indices = routing(t, k, 3, h)
    permuted, idx = opennpu.npu_moe_token_permute(tokens, indices, 8)
    g, gu, probs = randn(8, h), randn(t, h), torch.rand(t, k)
    opcheck(npu.npu_moe_token_permute_grad.default, [((tokens, g, indices, idx), {})])
    opcheck(npu.npu_moe_token_permute_grad_v2.default,
            [((g, idx, t, F32, k), {}), ((g.bfloat16(), idx, t, torch.bfloat16, k), {})])
    opcheck(npu.npu_moe_token_unpermute_grad.default,
            [((permuted, gu, idx, probs), {}), ((permuted, randn(t * k, h), idx), {})])
    opcheck(npu.npu_moe_token_unpermute_grad_v2.default,
            [((gu, idx, 8, F32, probs), {"permuted_tokens": permuted}),
             ((randn(t * k, h), idx, 8, F32), {})])


def test_unpermute_keeps_permuted_tokens_only_with_probs():
    tokens, indices = routing(6, 2, 3, 8)
    permuted = randn(12, 8, requires_grad=True)
    _, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices)
    for probs in (None, torch.rand(6, 2, requires_grad=True)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = opennpu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
        assert any(s is permuted for s in saved) == (probs is not None)
        out.sum().backward()
        assert permuted.grad is not None


def test_backward_ops_are_not_differentiable_again():
    g = randn(8, 4, requires_grad=True)
    out = opennpu.npu_moe_token_permute_grad_v2(g, torch.randperm(8).to(I32), 4, F32, 2)
    with pytest.raises(RuntimeError, match="npu_moe_token_permute_grad_v2: double backward"):
        out.sum().backward()


# ----------------------------------------------------------------------------- compile, device


def test_compiles_without_graph_breaks():
    def layer(x, indices, probs):
        permuted, sorted_indices = torch.ops.npu.npu_moe_token_permute(x, indices)
        return (torch.ops.npu.npu_moe_token_unpermute(permuted.sin(), sorted_indices, probs),)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend=counter)
    for t in (6, 11):
        x, indices = routing(t, 2, 4, 8)
        probs = torch.rand(t, 2)
        xe, pe = x.clone().requires_grad_(), probs.clone().requires_grad_()
        xc, pc = x.clone().requires_grad_(), probs.clone().requires_grad_()
        eager, comp = layer(xe, indices, pe)[0], compiled(xc, indices, pc)[0]
        torch.testing.assert_close(comp, eager, rtol=0, atol=0)
        eager.sum().backward()
        comp.sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad)
        torch.testing.assert_close(pc.grad, pe.grad)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_npu_device_runs_the_same_kernels():
    tokens, indices = routing(10, 3, 4, 16)
    probs = torch.rand(10, 3)
    x = tokens.to("npu").requires_grad_()
    p = probs.to("npu").requires_grad_()
    permuted, sorted_indices = opennpu.npu_moe_token_permute(x, indices.to("npu"))
    out = opennpu.npu_moe_token_unpermute(permuted, sorted_indices, p)
    assert out.device.type == "npu" and sorted_indices.device.type == "npu"
    cp, ci = opennpu.npu_moe_token_permute(tokens, indices)
    assert torch.equal(permuted.cpu(), cp) and torch.equal(sorted_indices.cpu(), ci)
    torch.testing.assert_close(out.cpu(), opennpu.npu_moe_token_unpermute(cp, ci, probs))
    out.sum().backward()
    assert x.grad.device.type == "npu" and p.grad.shape == (10, 3)


@settings(**SETTINGS)
@given(t=st.integers(0, 25), k=st.integers(1, 5), experts=st.integers(1, 12),
       h=st.integers(1, 40), drop=st.integers(-3, 30), with_probs=st.booleans(),
       dtype=st.sampled_from([F32, torch.bfloat16]))
def test_hypothesis(t, k, experts, h, drop, with_probs, dtype):
    tokens, indices = routing(t, k, experts, h, dtype)
    num_out = drop if -drop <= t * k else None
    permuted, sorted_indices = opennpu.npu_moe_token_permute(tokens, indices, num_out)
    want, want_idx = ref_permute(tokens, indices, num_out)
    assert torch.equal(permuted, want) and torch.equal(sorted_indices, want_idx)
    probs = torch.rand(t, k) if with_probs else None
    out = opennpu.npu_moe_token_unpermute(permuted, sorted_indices, probs)
    assert_close(out, ref_unpermute(permuted, sorted_indices, probs), dtype=dtype)


# ----------------------------------------------------------------------------- routing map


def routing_map_of(t, e, k, dtype=torch.bool):
    m = torch.zeros(t, e, dtype=torch.bool)
    for i in range(t):
        m[i, torch.randperm(e)[:k]] = True
    return m.to(dtype)


def ref_permute_with_routing_map(tokens, routing_map, probs, num_out_tokens, drop_and_pad):
    """op-plugin's cpu_op_exec (test_npu_moe_token_permute_with_routing_map.py)."""
    t = tokens.shape[0]
    e = routing_map.shape[1]
    if drop_and_pad:
        cap = num_out_tokens // e
        order = routing_map.to(torch.int8).T.contiguous().sort(dim=-1, descending=True,
                                                                stable=True)[1]
        sorted_indices = order[:, :cap].contiguous().view(-1)
        permuted_probs = None
        if probs is not None:
            flat = (torch.arange(e).unsqueeze(-1) * t + sorted_indices.view(e, cap)).view(-1)
            permuted_probs = probs.T.contiguous().view(-1).index_select(0, flat)
        return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices.to(I32)
    mask = routing_map.bool().T.contiguous()
    token_ids = torch.arange(t).unsqueeze(0).expand(e, -1).masked_select(mask)
    permuted_probs = probs.T.masked_select(mask) if probs is not None else None
    return (tokens.index_select(0, token_ids), permuted_probs,
            torch.sort(token_ids.float(), stable=True)[1].to(I32))


def ref_unpermute_with_routing_map(permuted, sorted_indices, routing_map, probs, drop_and_pad,
                                   restore_shape):
    """op-plugin's unpermute_with_routing_map_golden, in float64."""
    if drop_and_pad:
        t, e = restore_shape[0], routing_map.shape[1]
        cap = sorted_indices.numel() // e
        rows = permuted.double()
        if probs is not None:
            flat = (torch.arange(e).unsqueeze(-1) * t + sorted_indices.long().view(e, cap)).view(-1)
            rows = rows * probs.T.contiguous().view(-1).double().index_select(0, flat).unsqueeze(-1)
        out = torch.zeros(restore_shape, dtype=F64)
        return out.index_add(0, sorted_indices.long(), rows)
    k = permuted.shape[0] // routing_map.shape[0]
    rows = permuted.double().index_select(0, sorted_indices.long())
    rows = rows.reshape(-1, k, permuted.shape[1])
    if probs is not None:
        rows = rows * probs.double().masked_select(routing_map.bool()).reshape(-1, k).unsqueeze(-1)
    return rows.sum(1)


@pytest.mark.parametrize("drop_and_pad", [False, True])
@pytest.mark.parametrize("map_dtype", [torch.bool, torch.int8], ids=dtype_id)
def test_permute_with_routing_map_matches_golden(dtype, drop_and_pad, map_dtype):
    t, e, k, h = 13, 6, 2, 19
    tokens, probs = randn(t, h, dtype=dtype), torch.rand(t, e)
    routing_map = routing_map_of(t, e, k, map_dtype)
    num_out = 12 if drop_and_pad else t * k  # capacity 2 with drop_and_pad
    out = opennpu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, probs=probs, num_out_tokens=num_out, drop_and_pad=drop_and_pad)
    want = ref_permute_with_routing_map(tokens, routing_map, probs, num_out, drop_and_pad)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert torch.equal(out[2], want[2])
    no_probs = opennpu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, num_out_tokens=num_out, drop_and_pad=drop_and_pad)
    assert torch.equal(no_probs[0], want[0]) and no_probs[1].shape == (0,)


@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_unpermute_with_routing_map_matches_golden(dtype, drop_and_pad):
    # op-plugin's test: 40 tokens, 20 experts, top-20, capacity 20
    t, e, k, h = 40, 20, 20, 20
    routing_map = routing_map_of(t, e, k, torch.int8)
    probs = torch.rand(t, e, dtype=dtype)
    if drop_and_pad:
        permuted = randn(e * 20, h, dtype=dtype)
        sorted_indices = routing_map.T.contiguous().argsort(dim=-1, descending=True, stable=True)[
            :, :20].contiguous().to(I32).view(-1)
    else:
        permuted = randn(t * k, h, dtype=dtype)
        _, _, sorted_indices = ref_permute_with_routing_map(randn(t, 1), routing_map, None, t * k,
                                                            False)
    for p in (probs, None):
        out = opennpu.npu_moe_token_unpermute_with_routing_map(
            permuted, sorted_indices, [t, h], probs=p, routing_map=routing_map,
            drop_and_pad=drop_and_pad)
        want = ref_unpermute_with_routing_map(permuted, sorted_indices, routing_map, p,
                                              drop_and_pad, [t, h])
        assert out.dtype == dtype
        assert_close(out, want, dtype=dtype, scale=4)


@pytest.mark.parametrize("drop_and_pad", [False, True])
def test_routing_map_gradients_match_golden_autograd(drop_and_pad):
    t, e, k, h = 11, 5, 2, 7
    routing_map = routing_map_of(t, e, k)
    tokens = randn(t, h, dtype=F64, requires_grad=True)
    probs = torch.rand(t, e, dtype=F64, requires_grad=True)
    num_out = 10 if drop_and_pad else t * k
    out = opennpu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, probs=probs, num_out_tokens=num_out, drop_and_pad=drop_and_pad)
    g0, g1 = randn(*out[0].shape, dtype=F64), randn(*out[1].shape, dtype=F64)
    ours = torch.autograd.grad((out[0] * g0).sum() + (out[1] * g1).sum(), (tokens, probs))
    ref = ref_permute_with_routing_map(tokens, routing_map, probs, num_out, drop_and_pad)
    want = torch.autograd.grad((ref[0] * g0).sum() + (ref[1] * g1).sum(), (tokens, probs))
    for a, b in zip(ours, want):
        torch.testing.assert_close(a, b)
    # unpermute: the gradients of its golden
    permuted = out[0].detach().clone().requires_grad_()
    res = opennpu.npu_moe_token_unpermute_with_routing_map(
        permuted, out[2], [t, h], probs=probs, routing_map=routing_map, drop_and_pad=drop_and_pad)
    g = randn(t, h, dtype=F64)
    ours = torch.autograd.grad((res * g).sum(), (permuted, probs))
    gold = ref_unpermute_with_routing_map(permuted, out[2], routing_map, probs, drop_and_pad,
                                          [t, h])
    want = torch.autograd.grad((gold * g).sum(), (permuted, probs))
    for a, b in zip(ours, want):
        torch.testing.assert_close(a, b)
    assert torch.autograd.gradcheck(
        lambda x, p: opennpu.npu_moe_token_unpermute_with_routing_map(
            x, out[2], [t, h], probs=p, routing_map=routing_map, drop_and_pad=drop_and_pad),
        (permuted, probs))


def test_routing_map_internal_outputs_and_round_trip():
    t, e, h = 9, 4, 8
    routing_map = routing_map_of(t, e, 2)
    tokens, probs = randn(t, h), torch.rand(t, e)
    permuted, permuted_probs, sorted_indices = opennpu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, probs=probs, num_out_tokens=2 * t)
    out, out_index, token_id, permute_probs = opennpu._npu_moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, [t, h], probs=probs, routing_map=routing_map)
    assert torch.equal(out_index, sorted_indices) and torch.equal(token_id, sorted_indices)
    torch.testing.assert_close(out, tokens * (probs * routing_map).sum(1, keepdim=True))
    assert torch.equal(permute_probs, probs[routing_map])  # token-major, as the golden
    permuted, _, slot_token = opennpu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, num_out_tokens=12, drop_and_pad=True)
    _, out_index, token_id, _ = opennpu._npu_moe_token_unpermute_with_routing_map(
        permuted, slot_token, [t, h], routing_map=routing_map, drop_and_pad=True)
    sorted_tokens, order = torch.sort(slot_token, stable=True)
    assert torch.equal(out_index, order.to(I32)) and torch.equal(token_id, sorted_tokens)


def test_routing_map_bad_inputs():
    tokens, routing_map = randn(4, 8), routing_map_of(4, 3, 2)
    op = opennpu.npu_moe_token_permute_with_routing_map
    with pytest.raises(RuntimeError, match=r"'num_out_tokens' must give routing_map.sum\(\) = 8 "
                                           r"rows .* but gives 4"):
        op(tokens, routing_map)
    with pytest.raises(RuntimeError, match="'num_out_tokens' must give a capacity .* at most "
                                           "num_tokens = 4"):
        op(tokens, routing_map, num_out_tokens=15, drop_and_pad=True)
    with pytest.raises(RuntimeError, match=re.escape("'routing_map' must be 2-D [num_tokens, "
                                                     "num_experts] with num_tokens = 4")):
        op(tokens, routing_map[:3], num_out_tokens=8)
    with pytest.raises(RuntimeError, match="'routing_map' must be bool or an integer dtype"):
        op(tokens, routing_map.float(), num_out_tokens=8)
    with pytest.raises(RuntimeError, match=re.escape("'probs' must have the routing map's shape "
                                                     "[4, 3]")):
        op(tokens, routing_map, probs=torch.rand(4, 2), num_out_tokens=8)
    unpermute = opennpu.npu_moe_token_unpermute_with_routing_map
    _, _, sorted_indices = op(tokens, routing_map, num_out_tokens=8)
    with pytest.raises(RuntimeError, match=re.escape("'restore_shape' must be [num_tokens, H] "
                                                     "with H = 8")):
        unpermute(randn(8, 8), sorted_indices, [4, 7], routing_map=routing_map)
    with pytest.raises(RuntimeError, match="'sorted_indices' must be a permutation of"):
        unpermute(randn(8, 8), torch.zeros(8, dtype=I32), [4, 8], routing_map=routing_map)
    with pytest.raises(RuntimeError, match="'routing_map' must be given with probs"):
        unpermute(randn(8, 8), sorted_indices, [4, 8], probs=torch.rand(4, 3))


def test_routing_map_opcheck_compile_and_npu():
    t, e, h = 6, 4, 8
    routing_map = routing_map_of(t, e, 2)
    tokens, probs = randn(t, h), torch.rand(t, e)
    opcheck(npu.npu_moe_token_permute_with_routing_map.default,
            [((tokens, routing_map), dict(probs=probs, num_out_tokens=12)),
             ((tokens, routing_map), dict(num_out_tokens=8, drop_and_pad=True))])
    permuted, _, idx = opennpu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, probs=probs, num_out_tokens=12)
    opcheck(npu.npu_moe_token_unpermute_with_routing_map.default,
            [((permuted, idx, [t, h]), dict(probs=probs, routing_map=routing_map))])
    opcheck(npu._npu_moe_token_unpermute_with_routing_map.default,
            [((permuted, idx, [t, h]), dict(probs=probs, routing_map=routing_map))])
    opcheck(npu.npu_moe_token_permute_with_routing_map_grad.default,
            [((randn(12, h), torch.rand(12), idx, routing_map, e, t, False), {})])
    opcheck(npu.npu_moe_token_unpermute_with_routing_map_grad.default,
            [((randn(t, h), idx, idx, routing_map, permuted, probs, False, [t, h]), {})])

    def layer(x, p):
        rows, _, si = torch.ops.npu.npu_moe_token_permute_with_routing_map(
            x, routing_map, probs=p, num_out_tokens=x.shape[0] * 2)
        return torch.ops.npu.npu_moe_token_unpermute_with_routing_map(
            rows.sin(), si, [x.shape[0], x.shape[1]], probs=p, routing_map=routing_map)

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    xe, pe = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    xc, pc = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    eager, comp = layer(xe, pe), compiled(xc, pc)
    torch.testing.assert_close(comp, eager, rtol=0, atol=0)
    eager.sum().backward()
    comp.sum().backward()
    torch.testing.assert_close(xc.grad, xe.grad)
    torch.testing.assert_close(pc.grad, pe.grad)
    torch._dynamo.reset()
    on_npu = opennpu.npu_moe_token_permute_with_routing_map(
        tokens.to("npu"), routing_map.to("npu"), probs=probs.to("npu"), num_out_tokens=12)
    assert on_npu[0].device.type == "npu" and torch.equal(on_npu[0].cpu(), permuted)
