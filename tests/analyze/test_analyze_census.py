"""The op census on hand-written programs: exact op counts, phases, signatures, statuses."""

from __future__ import annotations

import pytest
import torch

import opennpu
from opennpu.analyze import OpCensus, ascend_support, npu_dispatch, op_key
from opennpu.analyze.census import describe, signature


def linear_relu_step():
    """One Linear(8, 16) + ReLU on npu, forward and backward, the loss summed outside the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()).to("npu")
    x = torch.randn(4, 8).to("npu")
    with OpCensus(fusion=False) as census:
        loss = model(x).sum()
        loss.backward()
    return census


def calls_by_phase(census, phase):
    return {op: r.phases[phase] for op, r in census.records.items() if r.phases.get(phase)}


def test_linear_relu_forward_backward_ops_exactly():
    census = linear_relu_step()
    # Forward: F.linear decomposes (CompositeImplicitAutograd) into t + addmm before reaching the
    # backend; relu is its own op.
    forward = calls_by_phase(census, "forward")
    forward.pop("aten::detach", None)  # autograd's bookkeeping: how many depends on torch
    assert forward == {"aten::t": 1, "aten::addmm": 1, "aten::relu": 1}
    assert calls_by_phase(census, "other") == {"aten::sum": 1}  # the loss, outside the module
    backward = calls_by_phase(census, "backward")
    backward.pop("aten::detach", None)
    # The seed gradient, sum's backward (expand), relu's (threshold_backward), addmm's for the
    # weight ((grad.t() @ x).t() from mm_mat2_backward, then t's own backward: t, mm, t, t) and
    # the bias (sum over the batch; view to its shape). x needs no grad.
    assert backward == {"aten::ones_like": 1, "aten::expand": 1, "aten::threshold_backward": 1,
                        "aten::t": 3, "aten::mm": 1, "aten::sum.dim_IntList": 1,
                        "aten::view": 1}
    assert census.records["aten::addmm"].calls == 1
    assert census.records["aten::addmm"].devices == {"npu"}
    assert census.records["aten::addmm"].modules == {"Linear": 1}
    assert census.records["aten::relu"].modules == {"ReLU": 1}
    assert not census.records["aten::mm"].modules  # backward runs outside module calls


def test_signatures_torchair_style():
    census = linear_relu_step()
    addmm = census.records["aten::addmm"]
    assert addmm.top_signatures() == [(1, "float32(16), float32(4,8), float32(8,16)")]
    rows = {r.op: r for r in census.rows()}
    assert rows["aten::addmm"].signatures == "1x: float32(16), float32(4,8), float32(8,16)"
    assert rows["aten::addmm"].dtypes == "float32"
    # most frequent first, ties by text, at most `top`
    census = OpCensus(fusion=False, top=2)
    with census:
        a = torch.ones(3, device="npu", dtype=torch.float16)
        for _ in range(3):
            a + a
        a.float() + a.float()
        a[:2] + a[:2]
    add = census.records["aten::add.Tensor"]
    assert add.calls == 5
    assert add.top_signatures(2) == [(3, "float16(3), float16(3)"), (1, "float16(2), float16(2)")]
    row = next(r for r in census.rows() if r.op == "aten::add.Tensor")
    assert row.signatures == "3x: float16(3), float16(3) | 1x: float16(2), float16(2)"
    assert row.dtypes == "float16 float32"


def test_describe_and_keys():
    t = torch.empty(12, 1, 512, 64, dtype=torch.float16)
    assert describe(t) == "float16(12,1,512,64)"
    assert describe([t, torch.empty(0)]) == "[float16(12,1,512,64), float32(0)]"
    assert describe(3) is None and describe([1, 2]) is None
    assert signature((t, 2, [1]), {"alpha": 1}) == "float16(12,1,512,64)"
    assert signature((), {}) == "-"
    assert op_key(torch.ops.aten.add.Tensor) == "aten::add.Tensor"
    assert op_key(torch.ops.aten.addmm.default) == "aten::addmm"
    assert op_key(torch.ops.npu.npu_rms_norm.default) == "npu::npu_rms_norm"


def test_npu_dispatch_kinds():
    # opennpu's own unboxed kernel, the zero-copy fallback (global and routed per op), a
    # CompositeExplicitAutograd kernel, a CompositeImplicitAutograd op, a CUDA-only op
    kind, detail = npu_dispatch("aten::add.Tensor")
    assert kind == "npu-kernel" and "npu_hot_ops.cpp" in detail
    assert npu_dispatch("aten::view")[0] == "npu-kernel"
    kind, detail = npu_dispatch("aten::relu")
    assert kind == "fallback" and "routed" not in detail
    kind, detail = npu_dispatch("aten::bmm")
    assert kind == "fallback" and "routed" in detail
    kind, detail = npu_dispatch("aten::addmm")  # a training step's hot op: unboxed
    assert kind == "npu-kernel" and "npu_unboxed_ops.cpp" in detail
    assert npu_dispatch("aten::t")[0] == "composite"
    assert npu_dispatch("aten::linear")[0] == "composite-implicit"
    assert npu_dispatch("aten::_scaled_dot_product_flash_attention")[0] == "missing"
    assert npu_dispatch("aten::no_such_op")[0] == "missing"
    assert npu_dispatch("npu::npu_rms_norm")[0] == "fallback"


def test_ascend_support_values():
    assert ascend_support("aten::addmm") == "op-plugin"
    assert ascend_support("aten::view") == "torch_npu"          # torch_npu's framework layer
    assert ascend_support("aten::t") == "composite"
    assert ascend_support("aten::_standard_gamma") == "cpu-fallback"
    assert ascend_support("npu::npu_rms_norm") == "op-plugin"
    assert ascend_support("npu::npu_no_such_fused_op") == "not-in-op-plugin"
    assert ascend_support("opennpu::_silu_mul") == "opennpu-only"
    assert ascend_support("aten::_scaled_dot_product_flash_attention_for_cpu") == "via-parent"


def test_statuses_fused_and_flagged():
    x = torch.randn(4, 32, device="npu", requires_grad=True)
    gamma = torch.ones(32, device="npu", requires_grad=True)
    with OpCensus(fusion=False) as census:
        y, _ = opennpu.npu_rms_norm(x, gamma)
        y.sum().backward()
        torch._standard_gamma(x.detach().abs() + 1)
    rows = {r.op: r for r in census.rows()}
    fused = rows["npu::npu_rms_norm"]
    assert (fused.status, fused.npu, fused.ascend) == ("fused", "fallback", "op-plugin")
    assert fused.forward == 0 and fused.other == 1
    bwd = rows["npu::npu_rms_norm_backward"]
    assert bwd.status == "fused" and bwd.backward == 1
    flagged = rows["aten::_standard_gamma"]
    assert (flagged.status, flagged.ascend) == ("ascend-cpu-fallback", "cpu-fallback")
    assert "host CPU" in flagged.note
    assert rows["aten::sum"].status == "native"
    assert rows["aten::expand"].status == "composite"


def test_steps_stop_the_program():
    model = torch.nn.Linear(4, 4).to("npu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    done = []
    with OpCensus(steps=2, fusion=False) as census:
        for i in range(5):
            model(torch.ones(2, 4, device="npu")).sum().backward()
            opt.step()
            done.append(i)
    assert done == [0] and census.steps_done == 2 and census.stopped_early
    assert census.records["aten::addmm"].calls == 2
    # by backward() calls and by outermost module calls
    with OpCensus(steps=1, step_on="backward", fusion=False) as census:
        for _ in range(3):
            model(torch.ones(2, 4, device="npu")).sum().backward()
    assert census.records["aten::addmm"].calls == 1 and census.stopped_early
    with OpCensus(steps=3, step_on="forward", fusion=False) as census:
        with torch.no_grad():
            for _ in range(10):
                model(torch.ones(2, 4, device="npu"))
    assert census.records["aten::addmm"].calls == 3
    # hooks and patches are gone afterwards
    assert torch.autograd.backward.__module__ == "torch.autograd"
    with pytest.raises(ValueError, match="step_on"):
        OpCensus(step_on="epoch")


def test_optimizer_phase():
    model = torch.nn.Linear(4, 4).to("npu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    model(torch.ones(2, 4, device="npu")).sum().backward()
    with OpCensus(fusion=False) as census:
        opt.step()
    assert {op: r.phase_text() for op, r in census.records.items()} == {
        "aten::add_.Tensor": "optimizer"}
    assert census.records["aten::add_.Tensor"].calls == 2


def test_inner_calls_of_composites():
    """logcumsumexp is composite (on Ascend too); the _logcumsumexp it calls is in no Ascend
    list: the census sees it as an inner call and flags it."""
    x = torch.randn(5, 3, device="npu")
    with OpCensus(fusion=False) as census:
        torch.logcumsumexp(x, 0)
        x.t()
        x.clone()
    rows = {r.op: r for r in census.rows()}
    outer, inner = rows["aten::logcumsumexp"], rows["aten::_logcumsumexp"]
    assert (outer.status, outer.calls, outer.inner) == ("composite", 1, 0)
    assert (inner.status, inner.calls, inner.inner) == ("ascend-cpu-fallback", 0, 1)
    assert inner.signatures == "1x: float32(5,3)"
    assert (rows["aten::t"].calls, rows["aten::transpose.int"].inner) == (1, 1)
    assert "aten::_logcumsumexp" in census.table().split("flagged: ")[1]
    # clone -> copy_ -> _copy_from: torch_npu implements clone and copy_ itself, so on Ascend
    # _copy_from (in no Ascend list) is never reached
    copy_from = rows["aten::_copy_from"]
    assert census.records["aten::_copy_from"].chains == {("aten::clone", "aten::copy_"): 1}
    assert (copy_from.ascend, copy_from.status) == ("via-parent", "native")
    assert "aten::clone" in copy_from.note
    with OpCensus(fusion=False, inner=False) as census:
        torch.logcumsumexp(x, 0)
    assert set(census.records) == {"aten::logcumsumexp"}


def test_root_call_is_the_largest_outermost_module():
    model = torch.nn.Linear(4, 4).to("npu")
    loss_fn = torch.nn.MSELoss()
    x = torch.ones(2, 4, device="npu")
    with OpCensus() as census:
        loss_fn(x, x)  # called first, outside the model, no parameters
        loss_fn(model(x), x)
    module, args, kwargs, grad = census.root_call
    assert module is model and args[0] is x and kwargs == {} and grad


def test_npu_dispatch_without_the_table(monkeypatch):
    """If the dump format changed, the yes/no dispatcher queries still classify."""
    from opennpu.analyze import support

    monkeypatch.setattr(torch._C, "_dispatch_dump_table", lambda name: "")
    support.npu_dispatch.cache_clear()
    try:
        assert support.npu_dispatch("aten::add.Tensor")[0] == "npu-kernel"
        assert support.npu_dispatch("aten::t")[0] == "composite"
        assert support.npu_dispatch("aten::linear")[0] == "composite-implicit"
        assert support.npu_dispatch("aten::relu")[0] == "fallback"
        assert support.npu_dispatch("aten::_scaled_dot_product_flash_attention")[0] == "missing"
    finally:
        support.npu_dispatch.cache_clear()


def test_results_unchanged_by_the_census():
    """Running composites' kernels under the census (inner calls) computes the same bits, and
    gradients flow as without it."""
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 4)).to("npu")
        x = torch.randn(5, 8).to("npu").requires_grad_(True)
        y = torch.logcumsumexp(model(x), 0).t().clone()
        y.square().sum().backward()
        return [y.detach(), x.grad, *(p.grad for p in model.parameters())]

    plain = run()
    with OpCensus(fusion=False) as census:
        counted = run()
    # logcumsumexp's backward formula calls logcumsumexp twice more
    assert census.records["aten::logcumsumexp"].phases == {"other": 1, "backward": 2}
    assert census.records["aten::_logcumsumexp"].inner == 3
    assert all(torch.equal(a.cpu(), b.cpu()) and a.device.type == b.device.type == "npu"
               for a, b in zip(plain, counted))


def test_scalar_arguments_of_inner_calls():
    """remainder.Scalar's composite kernel calls remainder.Tensor with the scalar as a wrapped
    number, which reaches the census as a Python int: the call still runs (it failed with
    "Expected a value of type 'Tensor' for argument 'other'"), with the same result."""
    x = torch.arange(8, device="npu")
    with OpCensus(fusion=False) as census:
        y = x % 3
    assert torch.equal(y.cpu(), torch.arange(8) % 3) and y.device.type == "npu"
    assert census.records["aten::remainder.Scalar"].calls == 1
    assert census.records["aten::remainder.Tensor"].inner == 1
