"""MoE routing, v2: npu_moe_gating_top_k_softmax_v2 and npu_moe_init_routing_v2.

Contract: op-plugin's op_plugin_functions.yaml and goldens: test_npu_moe_gating_top_k_softmax_v2.py
(renorm 0: stable argsort of the float32 softmax; renorm 1: stable argsort of the logits, then the
softmax of the k values) and test_npu_moe_init_routing_v2.py / the npu_moe_init_routing_v2 doc
(the cpu_op_exec below follows it: stable argsort with experts below the range sent last,
expanded_row_idx, bincount / cumsum / (expert, count) token numbers, drop-pad capacity slots,
float16 static and per-row dynamic int8 quantisation).
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import LOW_DTYPES, SETTINGS, dtype_id, opcheck, randn

import opennpu

F16, F32, F64, I32, I64 = torch.float16, torch.float32, torch.float64, torch.int32, torch.int64
npu = torch.ops.npu


# ----------------------------------------------------------------------------- gating v2


def ref_gating_v2(x, k, finished=None, renorm=0, output_softmax=False):
    e = x.shape[-1]
    x2 = x.reshape(-1, e)
    soft = torch.softmax(x2.double(), -1).float()  # the golden's float32 softmax
    if renorm == 1:
        idx = torch.sort(x2.double(), dim=-1, descending=True, stable=True).indices[:, :k]
        y = torch.softmax(x2.gather(-1, idx).double(), -1).to(x.dtype)
    else:
        idx = torch.sort(soft, dim=-1, descending=True, stable=True).indices[:, :k]
        y = soft.gather(-1, idx).to(x.dtype)
    idx = idx.to(I32)
    if finished is not None:
        idx = idx.masked_fill(finished.reshape(-1, 1), e)
    shape = (*x.shape[:-1], k)
    full = soft.reshape(x.shape) if renorm == 0 and output_softmax else torch.empty(0)
    return y.reshape(shape), idx.reshape(shape), full


def check_gating_v2(x, k, finished=None, renorm=0, output_softmax=False):
    out = opennpu.npu_moe_gating_top_k_softmax_v2(x, k=k, finished=finished, renorm=renorm,
                                                  output_softmax=output_softmax)
    ref = ref_gating_v2(x, k, finished, renorm, output_softmax)
    assert out[0].dtype == x.dtype and out[1].dtype == I32 and out[2].dtype == F32
    assert torch.equal(out[1], ref[1])
    tol = 1e-6 if x.dtype in (F32, F64) else (1e-3 if x.dtype == F16 else 8e-3)
    torch.testing.assert_close(out[0], ref[0], rtol=tol, atol=tol)
    assert out[2].shape == ref[2].shape
    torch.testing.assert_close(out[2], ref[2], rtol=1e-6, atol=1e-7)
    return out


@pytest.mark.parametrize("renorm", [0, 1])
@pytest.mark.parametrize("rows,experts,k", [(7, 8, 2), (33, 200, 9), (5, 257, 40), (1, 1, 1)],
                         ids=str)
def test_gating_v2_matches_reference(dtype, renorm, rows, experts, k):
    x = randn(rows, experts, dtype=dtype) * 2
    finished = torch.rand(rows) < 0.3
    check_gating_v2(x, k, finished, renorm, output_softmax=True)
    check_gating_v2(x, k, None, renorm)


def test_gating_v2_ranks_float32_probabilities_unlike_v1():
    # probabilities that differ in float32 but round to one bf16 value: v2 ranks the float32
    # ones (the larger logit wins), v1 the rounded ones (the lower expert wins)
    x = torch.tensor([[0.0, 1e-3, -5.0, -5.0]]).bfloat16()
    _, idx, _ = check_gating_v2(x, 2)
    assert idx.tolist() == [[1, 0]]
    assert opennpu.npu_moe_gating_top_k_softmax(x, None, 2)[1].tolist() == [[0, 1]]


def test_gating_v2_renorm_is_the_softmax_of_the_top_logits():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0]])
    y, idx, soft = opennpu.npu_moe_gating_top_k_softmax_v2(x, k=3, renorm=1, output_softmax=True)
    assert idx.tolist() == [[1, 3, 2]] and soft.shape == (0,)  # no softmax output with renorm 1
    torch.testing.assert_close(y, torch.softmax(torch.tensor([[3.0, 3.0, 2.0]]), -1))


def test_gating_v2_three_dims_k0_empty_and_noncontiguous():
    x = randn(2, 5, 16)
    finished = torch.rand(2, 5) < 0.5
    check_gating_v2(x, 4, finished, 0, True)
    y, idx, soft = opennpu.npu_moe_gating_top_k_softmax_v2(x, k=0, output_softmax=True)
    assert y.shape == idx.shape == (2, 5, 0)
    torch.testing.assert_close(soft, torch.softmax(x, -1))
    y, idx, soft = opennpu.npu_moe_gating_top_k_softmax_v2(randn(0, 8), k=2, output_softmax=True)
    assert y.shape == (0, 2) and soft.shape == (0, 8)
    check_gating_v2(randn(16, 10).t(), 3, torch.rand(10) < 0.3, 1)


def test_gating_v2_bad_inputs():
    op = opennpu.npu_moe_gating_top_k_softmax_v2
    with pytest.raises(RuntimeError, match=r"argument 'k' must be in \[0, 8\].*but got 9"):
        op(randn(3, 8), k=9)
    with pytest.raises(RuntimeError, match="argument 'renorm' must be 0 .* or 1 .*but got 2"):
        op(randn(3, 8), k=2, renorm=2)
    with pytest.raises(RuntimeError, match="argument 'finished' must be bool, but got Float"):
        op(randn(3, 8), k=2, finished=torch.zeros(3))
    with pytest.raises(RuntimeError, match=re.escape("argument 'finished' must have shape [3]")):
        op(randn(3, 8), k=2, finished=torch.zeros(4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="argument 'x' must be float16, bfloat16 or float32"):
        op(torch.ones(3, 8, dtype=I32), k=2)


def test_gating_v2_opcheck():
    opcheck(npu.npu_moe_gating_top_k_softmax_v2.default,
            [((randn(5, 8),), {"k": 2, "output_softmax": True}),
             ((randn(2, 3, 16),), {"k": 4, "finished": torch.rand(2, 3) < 0.5, "renorm": 1}),
             ((randn(0, 4, dtype=torch.bfloat16),), {"k": 4}), ((randn(6, 9).t(),), {})])


def test_gating_v2_compiles_and_runs_on_npu():
    fn = lambda x: npu.npu_moe_gating_top_k_softmax_v2(x, k=2, output_softmax=True)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (5, 9):
        x = randn(rows, 8)
        for got, want in zip(compiled(x), fn(x)):
            assert torch.equal(got, want)
    torch._dynamo.reset()
    x = randn(4, 8)
    out = opennpu.npu_moe_gating_top_k_softmax_v2(x.to("npu"), k=3, renorm=1)
    assert out[0].device.type == "npu"
    for got, want in zip(out, opennpu.npu_moe_gating_top_k_softmax_v2(x, k=3, renorm=1)):
        assert torch.equal(got.cpu(), want)


# ----------------------------------------------------------------------------- init routing v2


def ref_init_routing_v2(x, expert_idx, scale=None, offset=None, active_num=-1, capacity=-1,
                        expert_num=-1, drop_pad_mode=0, tokens_type=0, tokens_flag=False,
                        quant_mode=-1, expert_range=(), row_idx_type=0):
    """op-plugin's cpu_op_exec (test_npu_moe_init_routing_v2.py / the doc), in torch, with the
    op's output shapes (rows past the active ones zero, scales 0 where no token)."""
    n, h = x.shape
    k = expert_idx.shape[1]
    start, end = expert_range if expert_range else (0, expert_num)
    experts = expert_num if expert_num > 0 else end
    flat = expert_idx.reshape(-1).long()
    valid = int(((flat >= start) & (flat < end)).sum())
    keyed = torch.where(flat < start, torch.iinfo(torch.int32).max, flat)
    order = torch.sort(keyed, stable=True).indices
    sorted_e = keyed[order]
    if row_idx_type == 1:
        row_idx = order.clone()
    else:
        row_idx = torch.full((n * k,), -1, dtype=I64)
        row_idx[order[:valid]] = torch.arange(valid)
    per = torch.bincount(sorted_e[:valid] - start, minlength=end - start) if valid else \
        torch.zeros(end - start, dtype=I64)
    if not tokens_flag:
        counts = torch.zeros((experts, 2) if tokens_type == 2 else (end - start,), dtype=I64)
    elif tokens_type == 2:
        counts = torch.zeros(experts, 2, dtype=I64)
        nz = per.nonzero().flatten()
        counts[:len(nz), 0], counts[:len(nz), 1] = nz + start, per[nz]
    else:
        counts = per.cumsum(0) if tokens_type == 0 and drop_pad_mode == 0 else per
    if drop_pad_mode == 0:
        rows = n * k if active_num <= 0 else min(active_num, n * k)
        filled = valid if active_num <= 0 else min(active_num, valid)
        src = torch.full((rows,), -1, dtype=I64)
        src[:filled] = order[:filled] // k
    else:
        rows = experts * capacity
        src = torch.full((rows,), -1, dtype=I64)
        row_idx = torch.full((n * k,), -1, dtype=I64)
        rank = 0
        for p in range(valid):
            rank = rank + 1 if p and sorted_e[p] == sorted_e[p - 1] else 0
            if rank < capacity:
                slot = (int(sorted_e[p]) - start) * capacity + rank
                src[slot] = order[p] // k
                row_idx[order[p]] = slot
    has = src >= 0
    gathered = torch.where(has.unsqueeze(-1), x[src.clamp(min=0)], torch.zeros((), dtype=x.dtype))
    expanded_scale = torch.zeros(rows)
    if quant_mode == -1:
        out = gathered
        if scale is not None:
            expanded_scale = torch.where(has, scale.float()[src.clamp(min=0)], 0.0)
    elif quant_mode == 0:
        v = (gathered.half() * scale.half()[0]).half() + offset.half()[0]
        out = torch.round(v.half().float()).clamp(-128, 127).to(torch.int8)
        out[~has] = 0
    else:
        v = gathered.float()
        if scale is not None:
            if scale.dim() == 2 and scale.shape[0] > 1:
                expert_of_row = torch.zeros(rows, dtype=I64)
                if drop_pad_mode == 0:
                    expert_of_row[:filled] = sorted_e[:filled] - start
                else:
                    expert_of_row = torch.arange(rows) // capacity
                v = v * scale.float()[expert_of_row.clamp(max=scale.shape[0] - 1)]
            else:
                v = v * scale.float().reshape(1, h)
        amax = v.abs().amax(-1)
        expanded_scale = torch.where(has, amax / 127, 0.0)
        div = torch.where(expanded_scale == 0, 1.0, expanded_scale)
        out = torch.round(v / div.unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
        out[~has] = 0
        expanded_scale = torch.where(has & (amax == 0), 1.0, expanded_scale)  # zero row: scale 1
    if drop_pad_mode == 1:
        out = out.reshape(experts, capacity, h)
    return out, row_idx.to(expert_idx.dtype), counts, expanded_scale


def check_routing_v2(x, expert_idx, **kw):
    out = opennpu.npu_moe_init_routing_v2(x, expert_idx, **kw)
    names = dict(scale="scale", offset="offset", active_num="active_num",
                 expert_capacity="capacity", expert_num="expert_num",
                 drop_pad_mode="drop_pad_mode", expert_tokens_num_type="tokens_type",
                 expert_tokens_num_flag="tokens_flag", quant_mode="quant_mode",
                 active_expert_range="expert_range", row_idx_type="row_idx_type")
    ref = ref_init_routing_v2(x, expert_idx, **{names[a]: v for a, v in kw.items()})
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o.dtype == r.dtype and o.shape == r.shape, (i, o.dtype, r.dtype, o.shape, r.shape)
        if i == 0 and o.dtype == torch.int8:  # codes: off by one where a quotient sits on .5
            assert (o.int() - r.int()).abs().max() <= 1 if o.numel() else True
        elif i == 3:
            torch.testing.assert_close(o, r, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(o, r), i
    return out


def routing_v2_inputs(n, k, h, experts, dtype=F32, index_dtype=I32):
    return randn(n, h, dtype=dtype), torch.randint(0, experts, (n, k), dtype=index_dtype)


@pytest.mark.parametrize("tokens_type", [0, 1, 2])
@pytest.mark.parametrize("row_idx_type", [0, 1])
def test_routing_v2_dropless_matches_reference(dtype, tokens_type, row_idx_type):
    x, expert_idx = routing_v2_inputs(32, 5, 14, 32, dtype)
    for expert_range, active_num in (([0, 16], 160), ([0, 32], -1), ([4, 20], 30), ([0, 32], 0)):
        check_routing_v2(x, expert_idx, active_num=active_num, expert_num=32,
                         expert_tokens_num_type=tokens_type, expert_tokens_num_flag=True,
                         active_expert_range=expert_range, row_idx_type=row_idx_type)


def test_routing_v2_vllm_call_and_int_rows():
    # vllm-ascend's call: full range, counts (type 1), the gather index (row_idx_type 0)
    x, expert_idx = routing_v2_inputs(12, 2, 16, 8, torch.bfloat16)
    out = check_routing_v2(x, expert_idx, active_num=24, expert_num=8,
                           expert_tokens_num_type=1, expert_tokens_num_flag=True,
                           active_expert_range=[0, 8], quant_mode=-1)
    assert out[2].sum() == 24 and out[1].dtype == I32
    # the gather index inverts the sort: row expanded_row_idx[i * K + j] holds x[i]
    for q in range(24):
        assert torch.equal(out[0][out[1][q]], x[q // 2])
    xi = torch.randint(-128, 127, (9, 6), dtype=torch.int8)  # int8 rows move as bytes
    check_routing_v2(xi, torch.randint(0, 4, (9, 3), dtype=I64), expert_num=4,
                     expert_tokens_num_flag=True, scale=torch.rand(9))


@pytest.mark.parametrize("dtype", (F32, *LOW_DTYPES), ids=dtype_id)
def test_routing_v2_drop_pad(dtype):
    x, expert_idx = routing_v2_inputs(32, 5, 14, 8, dtype)
    for capacity in (1, 7, 40):
        out = check_routing_v2(x, expert_idx, expert_capacity=capacity, expert_num=8,
                               drop_pad_mode=1, expert_tokens_num_type=1,
                               expert_tokens_num_flag=True, active_expert_range=[0, 8],
                               scale=torch.rand(32))
        assert out[0].shape == (8, capacity, 14)


@pytest.mark.parametrize("drop_pad_mode", [0, 1])
def test_routing_v2_dynamic_quant(drop_pad_mode):
    h = 200
    x, expert_idx = routing_v2_inputs(32, 8, h, 16, torch.bfloat16)
    kw = dict(expert_num=16, drop_pad_mode=drop_pad_mode, expert_tokens_num_type=1,
              expert_tokens_num_flag=True, quant_mode=1, active_expert_range=[0, 16],
              expert_capacity=12 if drop_pad_mode else -1)
    for scale in (None, torch.rand(1, h) + 0.5, torch.rand(h) + 0.5, torch.rand(16, h) + 0.5):
        check_routing_v2(x, expert_idx, scale=scale, **kw)


def test_routing_v2_static_quant():
    for dtype in (F16, F32, torch.bfloat16):
        x, expert_idx = routing_v2_inputs(32, 5, 14, 16, dtype)
        x = x * 100
        check_routing_v2(x, expert_idx, scale=torch.rand(1) * 2, offset=torch.rand(1) - 0.5,
                         expert_num=16, expert_tokens_num_flag=True, quant_mode=0,
                         active_expert_range=[0, 16], row_idx_type=1)


def test_routing_v2_empty_and_noncontiguous():
    out = opennpu.npu_moe_init_routing_v2(randn(0, 64, dtype=torch.bfloat16),
                                          torch.zeros(0, 12, dtype=I32), scale=torch.rand(0),
                                          quant_mode=1, expert_num=32, expert_tokens_num_flag=True,
                                          expert_tokens_num_type=2, active_expert_range=[0, 16])
    assert [tuple(t.shape) for t in out] == [(0, 64), (0,), (32, 2), (0,)]
    assert out[0].dtype == torch.int8 and (out[2] == 0).all()
    x = randn(16, 12).t()  # [12, 16], strided
    expert_idx = torch.randint(0, 6, (3, 12), dtype=I32).t()
    check_routing_v2(x, expert_idx, expert_num=6, expert_tokens_num_flag=True)


def test_routing_v2_bad_inputs():
    op = opennpu.npu_moe_init_routing_v2
    x, expert_idx = routing_v2_inputs(4, 2, 8, 4)
    with pytest.raises(RuntimeError, match="argument 'quant_mode' must be -1 .* but got 2"):
        op(x, expert_idx, expert_num=4, quant_mode=2)
    with pytest.raises(RuntimeError, match="argument 'x_dtype' must be None"):
        op(x, expert_idx, expert_num=4, x_dtype=34)
    with pytest.raises(RuntimeError, match="argument 'expert_num' must be > 0 when "
                                           "active_expert_range is"):
        op(x, expert_idx)
    with pytest.raises(RuntimeError, match=r"'active_expert_range' must be \[start, end\] with "
                                           r"0 <= start < end <= expert_num \(4\), "
                                           r"but got \[2, 8\]"):
        op(x, expert_idx, expert_num=4, active_expert_range=[2, 8])
    with pytest.raises(RuntimeError, match="argument 'expert_capacity' must be >= 1"):
        op(x, expert_idx, expert_num=4, drop_pad_mode=1, expert_tokens_num_type=1)
    with pytest.raises(RuntimeError, match=re.escape("argument 'scale' must be None or "
                                                     "[num_rows] = [4] with quant_mode=-1")):
        op(x, expert_idx, expert_num=4, scale=torch.rand(3))
    with pytest.raises(RuntimeError, match="argument 'scale' must hold one value with "
                                           "quant_mode=0"):
        op(x, expert_idx, expert_num=4, quant_mode=0, offset=torch.rand(1))
    with pytest.raises(RuntimeError, match=r"argument 'scale' must be \[H\] / \[1, H\] or per "
                                           r"active expert \[4, 8\]"):
        op(x, expert_idx, expert_num=4, quant_mode=1, scale=torch.rand(3, 8))
    with pytest.raises(RuntimeError, match=r"'expert_idx' must be 2-D \[num_rows, k\]"):
        op(x, expert_idx[:3], expert_num=4)


def test_routing_v2_opcheck():
    x, expert_idx = routing_v2_inputs(6, 2, 8, 4)
    opcheck(npu.npu_moe_init_routing_v2.default,
            [((x, expert_idx), dict(expert_num=4, expert_tokens_num_flag=True)),
             ((x, expert_idx.long()), dict(expert_num=4, active_num=5, row_idx_type=1,
                                            expert_tokens_num_type=2, expert_tokens_num_flag=True)),
             ((x.bfloat16(), expert_idx), dict(expert_num=4, quant_mode=1,
                                                scale=torch.rand(4, 8) + 0.5)),
             ((x, expert_idx), dict(expert_num=4, drop_pad_mode=1, expert_capacity=3,
                                    expert_tokens_num_type=1, active_expert_range=[0, 4]))])


def test_routing_v2_compiles_and_runs_on_npu():
    def fn(x, expert_idx):
        return npu.npu_moe_init_routing_v2(x, expert_idx, active_num=x.shape[0] * 2,
                                           expert_num=8, expert_tokens_num_type=1,
                                           expert_tokens_num_flag=True,
                                           active_expert_range=[0, 8])

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (5, 9):
        x, expert_idx = routing_v2_inputs(n, 2, 16, 8)
        for got, want in zip(compiled(x, expert_idx), fn(x, expert_idx)):
            assert torch.equal(got, want)
    torch._dynamo.reset()
    x, expert_idx = routing_v2_inputs(7, 3, 16, 8, torch.bfloat16)
    on_npu = opennpu.npu_moe_init_routing_v2(x.to("npu"), expert_idx.to("npu"), expert_num=8,
                                             quant_mode=1, expert_tokens_num_flag=True)
    for got, want in zip(on_npu, opennpu.npu_moe_init_routing_v2(
            x, expert_idx, expert_num=8, quant_mode=1, expert_tokens_num_flag=True)):
        assert got.device.type == "npu" and torch.equal(got.cpu(), want)


@settings(**SETTINGS)
@given(n=st.integers(0, 20), k=st.integers(1, 6), experts=st.integers(1, 12),
       h=st.integers(1, 30), lo=st.integers(0, 4), width=st.integers(1, 12),
       active=st.integers(-1, 60), tokens_type=st.integers(0, 2), row_idx_type=st.integers(0, 1),
       quant=st.sampled_from([-1, 1]))
def test_routing_v2_hypothesis(n, k, experts, h, lo, width, active, tokens_type, row_idx_type,
                               quant):
    start = min(lo, experts - 1)
    end = min(start + width, experts)
    x, expert_idx = routing_v2_inputs(n, k, h, experts)
    check_routing_v2(x, expert_idx, active_num=active, expert_num=experts,
                     expert_tokens_num_type=tokens_type, expert_tokens_num_flag=True,
                     active_expert_range=[start, end], row_idx_type=row_idx_type,
                     quant_mode=quant)
