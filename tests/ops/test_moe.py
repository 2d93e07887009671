"""MoE routing: npu_moe_gating_top_k_softmax, npu_moe_init_routing, npu_moe_compute_expert_tokens,
npu_moe_finalize_routing, and a whole MoE layer on opennpu ops against a plain PyTorch one.
(npu_grouped_matmul has its own module, test_grouped_matmul.py.)

Contract: shared/spec/torch_npu_api.md section 1.14 (MoE lines); op-plugin's goldens
(test_npu_moe_gating_top_k_softmax.py: stable argsort of the rounded softmax;
test_npu_moe_init_routing.py; docs of npu_moe_finalize_routing / npu_moe_compute_expert_tokens).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import LOW_DTYPES, SETTINGS, assert_not_worse_than_native, dtype_id, opcheck, randn

import opennpu
from opennpu.testing import reference as R
from opennpu.testing.moe_layer import npu_moe_layer, npu_moe_layer_ffn, swap_glu_halves
from opennpu.testing.tolerances import assert_close

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
npu = torch.ops.npu


# ----------------------------------------------------------------------------- gating


def check_gating(x, finished=None, k=1):
    y, idx, row = opennpu.npu_moe_gating_top_k_softmax(x, finished, k)
    ry, ridx, rrow = R.moe_gating_top_k_softmax(x, finished, k)
    assert y.dtype == x.dtype and idx.dtype == I32 and row.dtype == I32
    assert y.shape == idx.shape == row.shape == (*x.shape[:-1], k)
    torch.testing.assert_close(idx, ridx, rtol=0, atol=0)
    torch.testing.assert_close(row, rrow, rtol=0, atol=0)
    assert_close(y, ry)
    return y, idx, row


@pytest.mark.parametrize("rows,experts", [(7, 8), (33, 64), (5, 257), (1, 1)],
                         ids=lambda v: str(v))
def test_gating_matches_reference(dtype, rows, experts):
    x = randn(rows, experts, dtype=dtype) * 2
    for k in sorted({1, min(2, experts), experts}):
        check_gating(x, None, k)


def test_gating_every_k():
    x = randn(9, 12)
    for k in range(1, 13):
        y, idx, _ = check_gating(x, None, k)
        assert (y[:, :-1] >= y[:, 1:]).all(), "largest first"


@pytest.mark.parametrize("k", [33, 40, 100], ids=lambda k: f"k{k}")
def test_gating_large_k_takes_the_sort_path(k):
    x = torch.randint(-3, 4, (6, 100)).float()  # many ties
    check_gating(x, None, k)


def test_gating_ties_go_to_the_lower_expert():
    x = torch.zeros(3, 6)
    _, idx, _ = check_gating(x, None, 4)
    assert idx.tolist() == [[0, 1, 2, 3]] * 3
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    _, idx, _ = check_gating(x, None, 4)
    assert idx.tolist() == [[1, 2, 4, 3]]


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_gating_ranks_the_rounded_probabilities(dtype):
    # Logits a few 1e-4 apart give fp32 probabilities that differ but round to the same fp16 /
    # bf16 value: torch_npu's golden ranks the rounded values, so the lower expert wins the tie.
    delta = 1e-3 if dtype == torch.bfloat16 else 1e-4
    x = torch.tensor([[0.0, delta, -5.0, -5.0]]).to(dtype)
    p = torch.softmax(x.float(), -1)
    assert p[0, 1] > p[0, 0] and p[0, 0].to(dtype) == p[0, 1].to(dtype)
    _, idx, _ = check_gating(x, None, 2)
    assert idx.tolist() == [[0, 1]]


def test_gating_finished_rows_get_expert_count():
    x = randn(2, 5, 16)
    finished = torch.tensor([[True, False, False, True, False], [False] * 5])
    y, idx, _ = check_gating(x, finished, 3)
    assert (idx[finished] == 16).all() and (idx[~finished] < 16).all()
    y_all, _, _ = opennpu.npu_moe_gating_top_k_softmax(x, None, 3)
    torch.testing.assert_close(y, y_all, rtol=0, atol=0)  # y is the top k either way


def test_gating_row_idx_is_slot_major():
    _, _, row = opennpu.npu_moe_gating_top_k_softmax(randn(4, 8), k=3)
    assert row.tolist() == torch.arange(12).view(3, 4).t().tolist()
    _, _, row3 = opennpu.npu_moe_gating_top_k_softmax(randn(2, 3, 8), k=2)
    assert row3.reshape(6, 2).tolist() == torch.arange(12).view(2, 6).t().tolist()


def test_gating_nan_rows_rank_last_and_stay_nan():
    x = randn(3, 8)
    x[1, 4] = float("nan")
    y, idx, _ = opennpu.npu_moe_gating_top_k_softmax(x, None, 3)
    assert torch.isnan(y[1]).all() and idx[1].tolist() == [0, 1, 2]
    ry, ridx, _ = R.moe_gating_top_k_softmax(x[[0, 2]], None, 3)
    assert_close(y[[0, 2]], ry)
    assert torch.equal(idx[[0, 2]], ridx)


def test_gating_not_worse_than_native():
    for dtype in LOW_DTYPES:
        x = randn(64, 32, dtype=dtype)
        y, _, _ = opennpu.npu_moe_gating_top_k_softmax(x, None, 4)
        ry, _, _ = R.moe_gating_top_k_softmax(x, None, 4)
        native = R.native_moe_gating(x, 4).values
        assert_not_worse_than_native(y, native, ry)


def test_gating_empty_and_non_contiguous():
    y, idx, row = opennpu.npu_moe_gating_top_k_softmax(randn(0, 8), k=2)
    assert y.shape == idx.shape == row.shape == (0, 2)
    x = randn(16, 10).t()  # [10, 16], columns strided
    check_gating(x, torch.rand(10) < 0.3, 5)


def test_gating_bad_inputs():
    op = opennpu.npu_moe_gating_top_k_softmax
    with pytest.raises(RuntimeError, match=r"argument 'k' must be in \[1, 8\].*but got 0"):
        op(randn(3, 8), None, 0)
    with pytest.raises(RuntimeError, match=r"argument 'k' must be in \[1, 8\].*but got 9"):
        op(randn(3, 8), None, 9)
    with pytest.raises(RuntimeError, match="argument 'finished' must be bool, but got Float"):
        op(randn(3, 8), torch.zeros(3), 2)
    with pytest.raises(RuntimeError, match=re.escape("argument 'finished' must have shape [3]")):
        op(randn(3, 8), torch.zeros(4, dtype=torch.bool), 2)
    with pytest.raises(RuntimeError, match="argument 'x' must be float16, bfloat16 or float32"):
        op(torch.ones(3, 8, dtype=I32), None, 2)
    with opennpu.strict():
        with pytest.raises(RuntimeError, match=r"'k' must be at most 1024.*strict mode"):
            op(randn(1, 1100), None, 1025)
        with pytest.raises(RuntimeError, match=r"'x' must have 2 to 3 dims.*strict mode"):
            op(randn(8), None, 1)


def test_gating_opcheck():
    samples = [((randn(5, 8),), {"k": 2}), ((randn(2, 3, 16), torch.rand(2, 3) < 0.5), {"k": 4}),
               ((randn(0, 4, dtype=torch.bfloat16),), {"k": 4}), ((randn(6, 9).t(),), {"k": 1})]
    opcheck(npu.npu_moe_gating_top_k_softmax.default, samples)


@settings(**SETTINGS)
@given(rows=st.integers(0, 40), experts=st.integers(1, 70), k_frac=st.floats(0, 1),
       ties=st.booleans(), with_finished=st.booleans(),
       dtype=st.sampled_from([F32, torch.bfloat16, torch.float16]))
def test_gating_hypothesis(rows, experts, k_frac, ties, with_finished, dtype):
    k = max(1, round(k_frac * experts))
    x = (torch.randint(-2, 3, (rows, experts)).to(dtype) if ties
         else randn(rows, experts, dtype=dtype))
    finished = torch.rand(rows) < 0.3 if with_finished else None
    check_gating(x, finished, k)


# ----------------------------------------------------------------------------- init routing


def routing_inputs(n, k, experts, h=16, dtype=F32):
    x = randn(n, h, dtype=dtype)
    row_idx = torch.arange(n * k, dtype=I32).view(k, n).t().contiguous()
    expert_idx = torch.randint(0, experts, (n, k), dtype=I32)
    return x, row_idx, expert_idx


def check_routing(x, row_idx, expert_idx, active_num):
    out = opennpu.npu_moe_init_routing(x, row_idx, expert_idx, active_num)
    ref = R.moe_init_routing(x, row_idx, expert_idx, active_num)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(o, r, rtol=0, atol=0)  # data movement and indices: exact
    return out


@pytest.mark.parametrize("n,k,experts", [(10, 2, 8), (37, 4, 100), (5, 1, 3), (64, 8, 8)],
                         ids=lambda v: str(v))
def test_routing_matches_reference(dtype, n, k, experts):
    x, row_idx, expert_idx = routing_inputs(n, k, experts, dtype=dtype)
    check_routing(x, row_idx, expert_idx, n)


@pytest.mark.parametrize("active_num", [0, 3, 10, 1000])
def test_routing_active_num_limits_the_rows(active_num):
    x, row_idx, expert_idx = routing_inputs(10, 3, 6)
    expanded_x, _, _ = check_routing(x, row_idx, expert_idx, active_num)
    assert expanded_x.shape == (min(active_num, 10) * 3, 16)


def test_routing_doc_example():
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=I32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=I32)
    expanded_x, expanded_row_idx, expanded_expert_idx = opennpu.npu_moe_init_routing(
        x, row_idx, expert_idx, 3)
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    # pairs (row, slot) sorted stably by expert: (1,0) (2,0) (0,0) (1,1) (0,1) (2,1)
    assert expanded_x[:, 0].tolist() == pytest.approx([0.2, 0.3, 0.1, 0.2, 0.1, 0.3])
    assert expanded_row_idx.tolist() == [2, 0, 1, 4, 3, 5]


def test_routing_experts_without_tokens_and_finished_rows():
    x, row_idx, _ = routing_inputs(12, 2, 8)
    expert_idx = torch.tensor([[7, 2]] * 6 + [[8, 8]] * 6, dtype=I32)  # 8 = finished rows
    _, _, expanded_expert_idx = check_routing(x, row_idx, expert_idx, 12)
    assert expanded_expert_idx.tolist() == [2] * 6 + [7] * 6 + [8] * 12


def test_routing_inverse_and_gather_properties():
    n, k = 23, 3
    x, row_idx, expert_idx = routing_inputs(n, k, 5)
    expanded_x, expanded_row_idx, _ = check_routing(x, row_idx, expert_idx, n)
    # slot j of token i went to position expanded_row_idx[j * n + i], which holds x[i]
    for i in range(n):
        for j in range(k):
            assert torch.equal(expanded_x[expanded_row_idx[j * n + i]], x[i])


def test_routing_int64_indices_any_permutation_and_any_dtype():
    n, k = 9, 2
    x = torch.arange(n * 4, dtype=torch.int16).view(n, 4)  # rows are moved, any dtype
    row_idx = torch.randperm(n * k).view(n, k)
    expert_idx = torch.randint(0, 4, (n, k))  # int64, as torch.topk returns
    check_routing(x, row_idx, expert_idx, n)


def test_routing_sparse_expert_ids_use_the_general_sort():
    x, row_idx, _ = routing_inputs(20, 2, 4)
    expert_idx = (torch.randint(0, 5, (20, 2)) * 400_000_000 - 1_000_000_000).to(I32)
    check_routing(x, row_idx, expert_idx, 20)


def test_routing_non_contiguous_and_empty():
    x, row_idx, expert_idx = routing_inputs(8, 2, 4)
    check_routing(randn(16, 8).t(), row_idx, expert_idx, 8)
    out = opennpu.npu_moe_init_routing(randn(0, 8), row_idx[:0], expert_idx[:0], 4)
    assert [t.shape for t in out] == [(0, 8), (0,), (0,)]


def test_routing_bad_inputs():
    op = opennpu.npu_moe_init_routing
    x, row_idx, expert_idx = routing_inputs(4, 2, 3)
    bad = row_idx.clone()
    bad[0, 0] = bad[1, 0]
    with pytest.raises(RuntimeError,
                       match=r"'row_idx' must be a permutation of .* = \[0, 8\).*a repeated value"):
        op(x, bad, expert_idx, 4)
    with pytest.raises(RuntimeError, match=r"'row_idx' must be a permutation.*the value 8"):
        op(x, row_idx + 1, expert_idx, 4)
    with pytest.raises(RuntimeError, match="argument 'row_idx' must have shape"):
        op(x, row_idx[:, :1], expert_idx, 4)
    with pytest.raises(RuntimeError,
                       match=r"'expert_idx' must be 2-D \[num_rows, k\] with num_rows"):
        op(x, row_idx, expert_idx[:3], 4)
    with pytest.raises(RuntimeError, match="argument 'active_num' must be >= 0, but got -1"):
        op(x, row_idx, expert_idx, -1)
    with pytest.raises(RuntimeError, match="argument 'expert_idx' must be int32 .or int64."):
        op(x, row_idx, expert_idx.float(), 4)
    with pytest.raises(RuntimeError, match=r"argument 'x' must be 2-D"):
        op(x.view(2, 2, 16), row_idx, expert_idx, 4)


def test_routing_opcheck():
    x, row_idx, expert_idx = routing_inputs(6, 2, 4)
    opcheck(npu.npu_moe_init_routing.default,
            [((x, row_idx, expert_idx, 6), {}), ((x, row_idx, expert_idx, 2), {}),
             ((x.bfloat16(), row_idx, expert_idx.long(), 100), {})])


@settings(**SETTINGS)
@given(n=st.integers(0, 30), k=st.integers(1, 6), experts=st.integers(1, 20),
       h=st.integers(1, 40), active=st.integers(0, 40))
def test_routing_hypothesis(n, k, experts, h, active):
    x, row_idx, expert_idx = routing_inputs(n, k, experts, h)
    check_routing(x, row_idx, expert_idx, active)


# ----------------------------------------------------------------------------- expert tokens


def test_expert_tokens_doc_example():
    out = opennpu.npu_moe_compute_expert_tokens(torch.tensor([3, 3, 4, 5, 6, 7], dtype=I32), 5)
    assert out.dtype == I32 and out.tolist() == [0, 0, 0, 2, 3]


@pytest.mark.parametrize("index_dtype", [I32, I64], ids=dtype_id)
def test_expert_tokens_match_reference(index_dtype):
    for n, experts in [(50, 8), (7, 20), (0, 4), (30, 0)]:
        sorted_experts = torch.randint(0, max(experts, 1) + 1, (n,)).sort().values.to(index_dtype)
        out = opennpu.npu_moe_compute_expert_tokens(sorted_experts, experts)
        ref = R.moe_compute_expert_tokens(sorted_experts, experts)
        assert out.dtype == index_dtype and out.shape == (experts,)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_expert_tokens_bad_inputs():
    op = opennpu.npu_moe_compute_expert_tokens
    with pytest.raises(RuntimeError, match="must be sorted in non-decreasing order.*position 2 "
                                           "holds 1 after 3"):
        op(torch.tensor([0, 3, 1], dtype=I32), 4)
    with pytest.raises(RuntimeError, match=r"argument 'num_expert' must be in \[0, 2147483647\]"):
        op(torch.tensor([0], dtype=I32), -1)
    with pytest.raises(RuntimeError, match="must be 1-D"):
        op(torch.zeros(2, 2, dtype=I32), 4)


def test_expert_tokens_opcheck():
    opcheck(npu.npu_moe_compute_expert_tokens.default,
            [((torch.tensor([0, 0, 2, 5], dtype=I32), 6), {}),
             ((torch.tensor([1, 1], dtype=I64), 3), {})])


# ----------------------------------------------------------------------------- finalize routing


def finalize_inputs(n, k, experts, h, dtype=F32, mode=0, capacity=None, parts="12bse"):
    """expanded_permuted_rows and the optional terms ('1' skip1, '2' skip2, 'b' bias, 's' scales,
    'e' expert_for_source_row)."""
    if mode in (1, 3):
        rows = randn(experts, capacity, h, dtype=dtype)
        src = torch.randint(-1, experts * capacity, (n * k,), dtype=I32)
    else:
        rows = randn(n * k, h, dtype=dtype)
        src = torch.randperm(n * k).to(I32)
    skip1 = randn(n, h, dtype=dtype) if "1" in parts else None
    skip2 = randn(n, h, dtype=dtype) if "2" in parts else None
    bias = randn(experts, h, dtype=dtype) if "b" in parts else None
    scales = randn(n, k, dtype=dtype) if "s" in parts else None
    expert = torch.randint(0, experts, (n, k), dtype=I32) if "e" in parts or "b" in parts else None
    return rows, skip1, skip2, bias, scales, src, expert


def check_finalize(*args, mode=0):
    out = opennpu.npu_moe_finalize_routing(*args, mode)
    ref = R.moe_finalize_routing(*args, mode)
    assert out.dtype == args[0].dtype and out.shape == ref.shape
    assert_close(out, ref, scale=4)  # sums of up to 2 + 2k rounded terms
    return out


@pytest.mark.parametrize("mode", [0, 2])
@pytest.mark.parametrize("n,k,h", [(5, 4, 5), (13, 2, 83), (3, 1, 600)], ids=lambda v: str(v))
def test_finalize_matches_reference(dtype, mode, n, k, h):
    check_finalize(*finalize_inputs(n, k, 16, h, dtype, mode), mode=mode)


@pytest.mark.parametrize("mode", [1, 3])
def test_finalize_drop_pad_modes(dtype, mode):
    args = finalize_inputs(20, 2, 4, 37, dtype, mode, capacity=6)
    assert (args[5] == -1).any()
    check_finalize(*args, mode=mode)
    rows2d = args[0].reshape(24, 37)  # [E * C, H] is accepted too
    check_finalize(rows2d, *args[1:], mode=mode)


@pytest.mark.parametrize("parts", ["", "1", "12", "s", "se", "1bs", "12be", "b"])
def test_finalize_optional_terms(parts):
    for dtype in (F32, torch.bfloat16):
        check_finalize(*finalize_inputs(6, 3, 5, 40, dtype, parts=parts))


def test_finalize_doc_golden():
    # op-plugin's test: expert_num 16, token_len 5, top_k 4, num_rows 5, every term given
    args = finalize_inputs(5, 4, 16, 5)
    out = opennpu.npu_moe_finalize_routing(*args)
    rows, skip1, skip2, bias, scales, src, expert = args
    golden = skip1 + skip2
    for i in range(5):
        for j in range(4):
            golden[i] += scales[i, j] * (rows[src[j * 5 + i]] + bias[expert[i, j]])
    torch.testing.assert_close(out, golden, rtol=1e-4, atol=1e-5)


def test_finalize_float32_scales_and_bias_with_bf16_rows():
    rows, skip1, skip2, _, _, src, expert = finalize_inputs(9, 2, 4, 64, torch.bfloat16)
    scales, bias = torch.rand(9, 2), randn(4, 64)
    check_finalize(rows, skip1, skip2, bias, scales, src, expert)


def test_finalize_non_contiguous_and_empty():
    rows, skip1, skip2, bias, scales, src, expert = finalize_inputs(8, 2, 4, 24)
    check_finalize(rows.t().contiguous().t(), skip1.t().contiguous().t(), skip2, bias, scales.t(
    ).contiguous().t(), src, expert)
    out = opennpu.npu_moe_finalize_routing(randn(0, 8), randn(0, 8), None, None, randn(0, 2),
                                           torch.zeros(0, dtype=I32), None, 0)
    assert out.shape == (0, 8)


@pytest.mark.parametrize("mode", [0, 2])
def test_finalize_k_without_scales(mode):
    # op-plugin's `int? k=1`: without scales, num_rows = len(expanded_src_to_dst_row) / k.
    n, k, h = 7, 3, 19
    rows, _, _, _, _, src, _ = finalize_inputs(n, k, 4, h, mode=mode, parts="")
    out = opennpu.npu_moe_finalize_routing(rows, None, None, None, None, src, None, mode, k)
    assert out.shape == (n, h)
    ref = R.moe_finalize_routing(rows, None, None, None, None, src, None, mode, k)
    assert_close(out, ref, scale=4)
    view = src.long().view(n, k) if mode == 2 else src.long().view(k, n).t()
    torch.testing.assert_close(out, rows[view].sum(1))
    # k=1 (the default) keeps the old behaviour: one slot per entry of expanded_src_to_dst_row
    assert opennpu.npu_moe_finalize_routing(rows, None, None, None, None, src, None,
                                            mode).shape == (n * k, h)
    # with scales, k must be 1 or scales' k; the terms then come from scales
    scales = randn(n, k)
    torch.testing.assert_close(
        opennpu.npu_moe_finalize_routing(rows, None, None, None, scales, src, None, mode, k),
        opennpu.npu_moe_finalize_routing(rows, None, None, None, scales, src, None, mode))
    opcheck(npu.npu_moe_finalize_routing.default,
            [((rows, None, None, None, None, src, None, mode, k), {})])


def test_finalize_k_bad_inputs():
    op = opennpu.npu_moe_finalize_routing
    rows, skip1, skip2, bias, scales, src, expert = finalize_inputs(4, 2, 3, 8)
    with pytest.raises(RuntimeError, match=r"argument 'k' must be 1 \(the default\) or "
                                           r"scales.size\(1\) = 2 when scales is given, but got 3"):
        op(rows, skip1, skip2, bias, scales, src, expert, 0, 3)
    with pytest.raises(RuntimeError, match="argument 'k' must be >= 1 .* but got 0"):
        op(rows, None, None, None, None, src, None, 0, 0)
    with pytest.raises(RuntimeError, match=r"'expanded_src_to_dst_row' must have num_rows \* k "
                                           r"entries for k = 3, but got 8"):
        op(rows, None, None, None, None, src, None, 0, 3)
    with pytest.raises(RuntimeError, match=re.escape("'export_for_source_row' must have shape "
                                                     "[2, 4]")):
        op(rows, None, None, bias, None, src, expert, 0, 4)


def test_finalize_bad_inputs():
    op = opennpu.npu_moe_finalize_routing
    rows, skip1, skip2, bias, scales, src, expert = finalize_inputs(4, 2, 3, 8)
    with pytest.raises(RuntimeError, match=r"'expanded_src_to_dst_row' must hold rows .* in "
                                           r"\[0, 8\), but got 8"):
        op(rows, skip1, skip2, bias, scales, src + 1 - src.min(), expert, 0)
    with pytest.raises(RuntimeError, match="'export_for_source_row' must be given with a bias"):
        op(rows, skip1, skip2, bias, scales, src, None, 0)
    with pytest.raises(RuntimeError,
                       match=r"'export_for_source_row' must hold experts in \[0, 3\)"):
        op(rows, skip1, skip2, bias, scales, src, expert + 3, 0)
    with pytest.raises(RuntimeError, match="'skip1' must have the dtype of expanded_permuted_rows"):
        op(rows, skip1.double(), skip2, bias, scales, src, expert, 0)
    with pytest.raises(RuntimeError, match=re.escape("'skip2' must have shape [4, 8]")):
        op(rows, skip1, skip2[:3], bias, scales, src, expert, 0)
    with pytest.raises(RuntimeError, match="'drop_pad_mode' must be 0 .* but got 4"):
        op(rows, skip1, skip2, bias, scales, src, expert, 4)
    with pytest.raises(RuntimeError, match=r"'expanded_src_to_dst_row' must have num_rows \* k = "
                                           r"4 \* 2 = 8 entries, but got 7"):
        op(rows, skip1, skip2, bias, scales, src[:7], expert, 0)
    with pytest.raises(RuntimeError, match=r"'expanded_permuted_rows' must be 2-D"):
        op(rows.view(2, 4, 8), skip1, skip2, bias, scales, src, expert, 0)
    with opennpu.strict():
        with pytest.raises(RuntimeError, match="'skip2' must be None when skip1 is None"):
            op(rows, None, skip2, bias, scales, src, expert, 0)


def test_finalize_opcheck():
    samples = [(finalize_inputs(5, 2, 4, 8), {"drop_pad_mode": 0}),
               (finalize_inputs(5, 2, 4, 8, mode=3, capacity=3, parts="1s"), {"drop_pad_mode": 3}),
               (finalize_inputs(4, 1, 2, 8, torch.bfloat16, parts=""), {})]
    opcheck(npu.npu_moe_finalize_routing.default, samples)


@settings(**SETTINGS)
@given(n=st.integers(1, 12), k=st.integers(1, 5), h=st.integers(1, 90),
       mode=st.integers(0, 3), parts=st.sampled_from(["", "1s", "12bse", "bs", "2"]),
       dtype=st.sampled_from([F32, torch.bfloat16]))
def test_finalize_hypothesis(n, k, h, mode, parts, dtype):
    check_finalize(*finalize_inputs(n, k, 4, h, dtype, mode, capacity=3, parts=parts), mode=mode)


# ----------------------------------------------------------------------------- a whole MoE layer


def moe_weights(hidden, inter, experts, dtype):
    w_gate = randn(hidden, experts, dtype=dtype)
    w13 = (randn(experts, hidden, 2 * inter) / hidden ** 0.5).to(dtype)
    w2 = (randn(experts, inter, hidden) / inter ** 0.5).to(dtype)
    return w_gate, w13, w2


@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
@pytest.mark.parametrize("k,renormalize", [(2, True), (1, False), (8, True)])
def test_moe_layer_matches_plain_pytorch(dtype, k, renormalize):
    x = randn(13, 32, dtype=dtype)
    weights = moe_weights(32, 48, 8, dtype)
    ours = npu_moe_layer(x, *weights, k, renormalize)
    native = R.native_moe_layer(x, *weights, k, renormalize)
    assert ours.dtype == dtype and ours.shape == x.shape
    assert_close(ours, native, scale=10)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_moe_layer_low_precision_not_worse_than_plain_pytorch(dtype):
    x = randn(40, 64, dtype=dtype)
    weights = moe_weights(64, 96, 8, dtype)
    ours = npu_moe_layer(x, *weights, 2)
    native = R.native_moe_layer(x, *weights, 2)
    oracle = R.moe_layer(x, *weights, 2)
    # Tokens whose 2nd and 3rd probabilities round to the same value in `dtype` may pick
    # different experts (ours ranks the rounded values, as torch_npu does); compare the others.
    probs = torch.softmax((x @ weights[0]).float(), -1)
    chosen = torch.topk(probs, 2).indices.sort().values
    _, ours_idx, _ = opennpu.npu_moe_gating_top_k_softmax(x @ weights[0], None, 2)
    same = (ours_idx.long().sort().values == chosen).all(-1)
    assert same.float().mean() > 0.9
    assert_not_worse_than_native(ours[same], native[same], oracle[same])


def test_moe_layer_with_empty_experts():
    # every token routed to experts 2 and 5 only: the other experts' groups are empty
    x = randn(9, 16)
    w_gate, w13, w2 = moe_weights(16, 8, 6, F32)
    w_gate = torch.zeros(16, 6)
    w_gate[:, 2], w_gate[:, 5] = 5.0, 4.0
    x = x.abs() + 0.1
    ours = npu_moe_layer(x, w_gate, w13, w2, 2)
    assert_close(ours, R.native_moe_layer(x, w_gate, w13, w2, 2), scale=10)


@pytest.mark.parametrize("k,renormalize", [(2, True), (1, False), (8, True)])
def test_moe_layer_through_npu_ffn_matches_plain_pytorch(k, renormalize):
    """The full layer with the experts run by npu_ffn's expert path (expert_tokens_index from
    npu_moe_compute_expert_tokens) against the plain PyTorch loop, and against the layer whose
    experts run as grouped matmuls + npu_swiglu (same routing, so the same rows per expert)."""
    x = randn(29, 32)
    w_gate, w13, w2 = moe_weights(32, 48, 8, F32)
    ours = npu_moe_layer_ffn(x, w_gate, swap_glu_halves(w13), w2, k, renormalize)
    assert ours.dtype == F32 and ours.shape == x.shape
    assert_close(ours, R.native_moe_layer(x, w_gate, w13, w2, k, renormalize), scale=10)
    assert_close(ours, npu_moe_layer(x, w_gate, w13, w2, k, renormalize), scale=10)


def test_moe_layer_through_npu_ffn_needs_the_swapped_halves():
    """npu_ffn's swiglu activates the second half: unswapped [w1 | w3] gives another layer."""
    x = randn(12, 16)
    w_gate, w13, w2 = moe_weights(16, 24, 4, F32)
    native = R.native_moe_layer(x, w_gate, w13, w2, 2)
    wrong = npu_moe_layer_ffn(x, w_gate, w13, w2, 2)
    assert (wrong - native).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
def test_moe_layer_through_npu_ffn_low_precision_not_worse_than_plain_pytorch(dtype):
    x = randn(40, 64, dtype=dtype)
    w_gate, w13, w2 = moe_weights(64, 96, 8, dtype)
    ours = npu_moe_layer_ffn(x, w_gate, swap_glu_halves(w13), w2, 2)
    native = R.native_moe_layer(x, w_gate, w13, w2, 2)
    oracle = R.moe_layer(x, w_gate, w13, w2, 2)
    # As for the grouped-matmul layer: compare the tokens whose top-2 experts do not hinge on
    # probabilities that round to the same value in `dtype`.
    probs = torch.softmax((x @ w_gate).float(), -1)
    chosen = torch.topk(probs, 2).indices.sort().values
    _, ours_idx, _ = opennpu.npu_moe_gating_top_k_softmax(x @ w_gate, None, 2)
    same = (ours_idx.long().sort().values == chosen).all(-1)
    assert same.float().mean() > 0.9
    assert_not_worse_than_native(ours[same], native[same], oracle[same])


def test_moe_layer_through_npu_ffn_with_empty_experts():
    # every token routed to experts 2 and 5 only: npu_ffn sees empty expert row ranges
    w_gate, w13, w2 = moe_weights(16, 8, 6, F32)
    w_gate = torch.zeros(16, 6)
    w_gate[:, 2], w_gate[:, 5] = 5.0, 4.0
    x = randn(9, 16).abs() + 0.1
    ours = npu_moe_layer_ffn(x, w_gate, swap_glu_halves(w13), w2, 2)
    assert_close(ours, R.native_moe_layer(x, w_gate, w13, w2, 2), scale=10)


def test_moe_layer_compiles_without_graph_breaks():
    x = randn(6, 16)
    weights = moe_weights(16, 8, 4, F32)
    torch._dynamo.reset()
    compiled = torch.compile(npu_moe_layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for tokens in (6, 11):
        x = randn(tokens, 16)
        torch.testing.assert_close(compiled(x, *weights, 2), npu_moe_layer(x, *weights, 2),
                                   rtol=0, atol=0)
    torch._dynamo.reset()


def test_moe_ops_are_not_differentiable():
    x = randn(5, 8, requires_grad=True)
    y, _, _ = opennpu.npu_moe_gating_top_k_softmax(x, None, 2)
    with pytest.raises(RuntimeError, match="npu_moe_gating_top_k_softmax: not differentiable"):
        y.sum().backward()
    rows = randn(10, 4, requires_grad=True)
    out = opennpu.npu_moe_finalize_routing(rows, None, None, None, randn(5, 2),
                                           torch.arange(10, dtype=I32), None, 0)
    with pytest.raises(RuntimeError, match="npu_moe_finalize_routing: not differentiable"):
        out.sum().backward()


def test_readme_snippet_through_torch_npu():
    # The README's MoE example, spelled as an Ascend script (small shapes), equals the plain loop.
    import torch_npu

    T, H, I, E, k = 12, 32, 24, 8, 2
    x = randn(T, H)
    w_gate, w13, w2 = moe_weights(H, I, E, F32)
    probs, expert_idx, row_idx = torch_npu.npu_moe_gating_top_k_softmax(x @ w_gate, k=k)
    scales = probs.float() / probs.float().sum(-1, keepdim=True)
    expanded_x, expanded_row_idx, expanded_expert_idx = torch_npu.npu_moe_init_routing(
        x, row_idx, expert_idx, active_num=T)
    group_list = torch_npu.npu_moe_compute_expert_tokens(expanded_expert_idx, E)
    h = torch_npu.npu_grouped_matmul([expanded_x], [w13], group_list=group_list, split_item=3,
                                     group_type=0)[0]
    h = torch_npu.npu_grouped_matmul([torch_npu.npu_swiglu(h)], [w2], group_list=group_list,
                                     split_item=3, group_type=0)[0]
    out = torch_npu.npu_moe_finalize_routing(h, None, None, None, scales, expanded_row_idx,
                                             expert_idx)
    assert_close(out, R.native_moe_layer(x, w_gate, w13, w2, k), scale=10)
