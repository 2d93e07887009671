"""opennpu.optim: parity with torch.optim, the contract's formulas, AMP, state dicts, zero_grad,
clipping, DDP and argument errors. Small shapes; no timing."""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import opennpu.optim as optim
from opennpu.testing import optim_reference as ref
from opennpu.testing.tolerances import assert_close

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Odd sizes, an empty tensor, a 4-D one, and one long enough to be split between threads.
SHAPES = [(7,), (33, 5), (3, 4, 5, 2), (1,), (0,), (40000,), (129, 260)]


def make_params(dtypes=DTYPES, shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt))
            for dt in dtypes for s in shapes]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def set_grads(param_lists, step, scale=1.0):
    """The same gradients (fp32 draws rounded to each parameter's dtype) for every list."""
    gen = torch.Generator().manual_seed(1000 + step)
    draws = [torch.randn(p.shape, generator=gen) * scale for p in param_lists[0]]
    for params in param_lists:
        for p, g in zip(params, draws):
            p.grad = g.to(p.dtype, copy=True)


def run_pair(ours, theirs, params_a, params_b, steps=12):
    for step in range(steps):
        set_grads([params_a, params_b], step)
        ours.step()
        theirs.step()


def check_params(actual, expected, scale=1.0):
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.dtype == e.dtype
        assert_close(a.detach(), e.detach(), scale=scale, msg=f"param {i} ({a.dtype}, "
                                                                 f"{tuple(a.shape)})")


# --------------------------------------------------------------------------------------------
# Parity with torch.optim (12 steps, fp32 + fp16 + bf16 parameters in one group)

PARITY = [
    (optim.NpuFusedAdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (optim.NpuFusedAdamW, torch.optim.AdamW, dict(lr=1e-2, amsgrad=True)),
    (optim.NpuFusedAdamW, torch.optim.AdamW, dict(lr=1e-2, betas=(0.8, 0.99), maximize=True)),
    (optim.NpuFusedAdam, torch.optim.Adam, dict(lr=1e-2)),
    (optim.NpuFusedAdam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (optim.NpuFusedSGD, torch.optim.SGD, dict(lr=0.05)),
    (optim.NpuFusedSGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9)),
    (optim.NpuFusedSGD, torch.optim.SGD,
     dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (optim.NpuFusedSGD, torch.optim.SGD,
     dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
    (optim.NpuFusedRMSprop, torch.optim.RMSprop, dict(lr=1e-3)),
    (optim.NpuFusedRMSprop, torch.optim.RMSprop,
     dict(lr=1e-3, momentum=0.9, centered=True, weight_decay=0.01)),
    (optim.NpuFusedAdadelta, torch.optim.Adadelta, dict()),
    (optim.NpuFusedAdadelta, torch.optim.Adadelta, dict(lr=0.5, rho=0.8, weight_decay=0.01)),
]


class StoredInDtype:
    """torch.optim run in fp32 on fp32 copies of low-precision parameters, with the parameters
    and the state rounded to the parameters' dtype after every step: the fused kernels' numerics
    (fp32 math, one rounding per stored value). torch's own fp16/bf16 step rounds after every
    operation instead, which drifts by several units in the last place over 12 steps."""

    def __init__(self, torch_cls, params, **kwargs):
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        self.opt = torch_cls(self.masters, **kwargs)

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)
            m.copy_(p)
            for key, value in self.opt.state[m].items():
                if torch.is_tensor(value) and key != "step":
                    value.copy_(value.to(p.dtype))


@pytest.mark.parametrize("ours_cls,torch_cls,kwargs", PARITY,
                         ids=lambda v: v.__name__ if isinstance(v, type) else
                         ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_parity_with_torch_optim(ours_cls, torch_cls, kwargs):
    # fp32: against torch's default (per-tensor) step, 12 steps.
    a = make_params((torch.float32,))
    b = clone_params(a)
    run_pair(ours_cls(a, **kwargs), torch_cls(b, **kwargs), a, b)
    check_params(a, b)
    # fp16 + bf16: against torch in fp32 with the values stored in fp16/bf16 after each step.
    a = make_params((torch.float16, torch.bfloat16))
    b = clone_params(a)
    run_pair(ours_cls(a, **kwargs), StoredInDtype(torch_cls, b, **kwargs), a, b)
    check_params(a, b)


def test_low_precision_adamw_matches_torch_fused():
    # torch's fused CPU AdamW also computes fp16/bf16 parameters in fp32: bit for bit the same.
    a = make_params((torch.float16, torch.bfloat16))
    b = clone_params(a)
    run_pair(optim.NpuFusedAdamW(a, lr=1e-2, weight_decay=0.1),
             torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=True), a, b)
    check_params(a, b)


def test_adamw_fp32_matches_torch_to_a_few_ulps():
    a = make_params((torch.float32,))
    b = clone_params(a)
    run_pair(optim.NpuFusedAdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2), a, b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach(), y.detach(), atol=1e-6, rtol=4e-7)


def test_many_tensors_are_split_across_threads_correctly():
    # 2,000 tensors of varied sizes: pieces start and end mid-tensor.
    gen = torch.Generator().manual_seed(3)
    shapes = [(int(n),) for n in torch.randint(1, 200, (2000,), generator=gen)] + [(70001,)]
    a = make_params((torch.float32, torch.bfloat16), shapes)
    b = clone_params(a)
    run_pair(optim.NpuFusedAdamW(a, lr=1e-2),
             torch.optim.AdamW(b, lr=1e-2, fused=True), a, b, steps=3)
    check_params(a, b)


def test_state_matches_torch_state():
    a = make_params((torch.float32,))
    b = clone_params(a)
    ours, theirs = optim.NpuFusedAdamW(a, lr=1e-2), torch.optim.AdamW(b, lr=1e-2)
    run_pair(ours, theirs, a, b, steps=4)
    for pa, pb in zip(a, b):
        sa, sb = ours.state[pa], theirs.state[pb]
        assert set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"}
        assert sa["step"].dtype == torch.float32 and float(sa["step"]) == float(sb["step"]) == 4
        assert_close(sa["exp_avg"], sb["exp_avg"])
        assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"])


# --------------------------------------------------------------------------------------------
# The contract's formulas (optimizers without a torch counterpart)

CONTRACT = [
    (optim.NpuFusedRMSpropTF, ref.RMSpropTF,
     dict(lr=1e-2, alpha=0.9, eps=1e-10, weight_decay=0, momentum=0.0)),
    (optim.NpuFusedRMSpropTF, ref.RMSpropTF,
     dict(lr=1e-2, alpha=0.9, eps=1e-3, weight_decay=0.01, momentum=0.9, centered=True)),
    (optim.NpuFusedRMSpropTF, ref.RMSpropTF,
     dict(lr=1e-2, alpha=0.9, eps=1e-3, weight_decay=0.01, momentum=0.9,
          decoupled_decay=True, lr_in_momentum=False)),
    (optim.NpuFusedLamb, ref.Lamb, dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0)),
    (optim.NpuFusedLamb, ref.Lamb,
     dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, use_global_grad_norm=True)),
    (optim.NpuFusedLamb, ref.Lamb,
     dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, adam=True)),
    (optim.NpuFusedAdamP, ref.AdamP,
     dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, delta=0.1, wd_ratio=0.1)),
    (optim.NpuFusedAdamP, ref.AdamP,
     dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, delta=0.1, wd_ratio=0.1,
          nesterov=True)),
    (optim.NpuFusedBertAdam, ref.BertAdam,
     dict(lr=1e-2, warmup=-1, t_total=-1, schedule="warmup_linear", b1=0.9, b2=0.999, e=1e-6,
          weight_decay=0.01, max_grad_norm=1.0)),
]
CONTRACT += [
    (optim.NpuFusedBertAdam, ref.BertAdam,
     dict(lr=1e-2, warmup=0.2, t_total=20, schedule=s, b1=0.9, b2=0.999, e=1e-6,
          weight_decay=0.01, max_grad_norm=-1)) for s in optim.optimizers.BERT_SCHEDULES
]


@pytest.mark.parametrize("ours_cls,ref_cls,kwargs", CONTRACT,
                         ids=lambda v: v.__name__ if isinstance(v, type) else
                         ",".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float16,)],
                         ids=["fp32", "bf16", "fp16"])
def test_contract_formulas(ours_cls, ref_cls, kwargs, dtypes):
    if dtypes == (torch.float16,) and (kwargs.get("max_grad_norm", 0) > 0
                                       or kwargs.get("use_global_grad_norm")):
        # Gradients scaled to norm 1 over 40k elements make v ~ 1e-8: below fp16's normal
        # range, so the fp16 state holds a few bits and u = m / (sqrt(v) + e) is chaotic, in
        # torch_npu (fp16 buffers) as in any fp16-state implementation.
        pytest.skip("fp16 second moments underflow under gradient normalisation; bf16, fp32 "
                    "cover it")
    a = make_params(dtypes)
    b = clone_params(a)
    ours, theirs = ours_cls(a, **kwargs), ref_cls(b, **kwargs)
    run_pair(ours, theirs, a, b)
    check_params(a, b, scale=1.0 if dtypes == (torch.float32,) else 2.0)


def test_adamp_projects_when_gradient_is_orthogonal():
    # A gradient orthogonal to every row of the weight: the channel-view projection applies, so
    # the step has no component along the weight's rows and its decay uses wd_ratio.
    w = torch.nn.Parameter(torch.tensor([[3.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0]]))
    w2 = torch.nn.Parameter(w.detach().clone())
    w.grad = torch.tensor([[0.0, 1.0, -2.0, 0.5], [1.0, 0.0, 0.3, -1.0]])
    w2.grad = w.grad.clone()
    kwargs = dict(lr=0.1, weight_decay=0.5, delta=0.1, wd_ratio=0.1)
    optim.NpuFusedAdamP([w], **kwargs).step()
    ref.AdamP([w2], betas=(0.9, 0.999), eps=1e-8, **kwargs).step()
    assert_close(w.detach(), w2.detach())
    # Radial components: only the decay, scaled by wd_ratio.
    assert w[0, 0].item() == pytest.approx(3.0 * (1 - 0.1 * 0.5 * 0.1), rel=1e-6)
    assert w[1, 1].item() == pytest.approx(2.0 * (1 - 0.1 * 0.5 * 0.1), rel=1e-6)


# --------------------------------------------------------------------------------------------
# Mixed precision


def _amp_train(opt_cls, scaler_cls, params, steps=6, inf_at=None, clip=None, **kwargs):
    opt = opt_cls(params, **kwargs)
    scaler = scaler_cls("cpu", init_scale=2.0**10, growth_interval=2)
    for step in range(steps):
        scaler.scale(torch.ones(()))  # (starts the scaler as a scaled loss would)
        set_grads([params], step, scale=scaler.get_scale())  # as if the loss were scaled
        if step == inf_at:
            params[0].grad.view(-1)[0] = float("inf")
        if clip is not None:
            scaler.unscale_(opt)
            if hasattr(opt, "clip_grad_norm_fused_"):
                opt.clip_grad_norm_fused_(clip)
            else:
                torch.nn.utils.clip_grad_norm_(params, clip)
        scaler.step(opt)
        scaler.update()
    return opt, scaler


def _torch_npu_scaler(device, **kwargs):
    """torch_npu.npu.amp.GradScaler, which takes no device argument (its scale is on the CPU)."""
    from torch_npu.npu.amp import GradScaler

    assert device == "cpu"
    return GradScaler(**kwargs)


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, optim.GradScaler, _torch_npu_scaler],
                         ids=["torch.amp.GradScaler", "opennpu.GradScaler",
                              "torch_npu.npu.amp.GradScaler"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["step", "unscale+clip+step"])
def test_amp_grad_scaler_matches_torch(scaler_cls, clip):
    # With clipping, fp32 only: torch's clip_grad_norm_ rounds each bf16 gradient's norm to bf16
    # before summing (ours sums in fp32), which moves the clip factor by up to ~0.4%.
    a = make_params((torch.float32,) if clip else (torch.float32, torch.bfloat16))
    b = clone_params(a)
    ours, s1 = _amp_train(optim.NpuFusedAdamW, scaler_cls, a, inf_at=3, clip=clip, lr=1e-2)
    theirs, s2 = _amp_train(torch.optim.AdamW, torch.amp.GradScaler, b, inf_at=3, clip=clip,
                            lr=1e-2, fused=True)
    check_params(a, b, scale=2.0)
    assert s1.get_scale() == s2.get_scale()
    # The inf step was skipped: 5 updates, not 6.
    assert float(ours.state[a[0]]["step"]) == float(theirs.state[b[0]]["step"]) == 5


def test_grad_scaler_unscales_fused_optimizer_in_one_pass():
    params = make_params((torch.float32, torch.float16))
    opt = optim.NpuFusedAdamW(params)
    scaler = optim.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))
    set_grads([params], 0)
    expected = [p.grad.float() / 4 for p in params]
    scaler.unscale_(opt)  # fp16 gradients are fine on this path (torch_npu's behaviour)
    for p, e in zip(params, expected):
        assert_close(p.grad, e.to(p.dtype))
    params[1].grad.view(-1)[0] = float("nan")
    found = torch.zeros(1)
    opt._unscale_grads_(torch.ones(1), found)
    assert found.item() == 1.0


def test_torch_npu_grad_scaler_names_and_arguments():
    import torch_npu
    from torch_npu.npu.amp import GradScaler

    assert torch_npu.npu.amp.GradScaler is GradScaler
    assert issubclass(GradScaler, optim.GradScaler)
    # torch_npu's positional order: init_scale, growth_factor, backoff_factor, growth_interval,
    # dynamic, enabled.
    scaler = GradScaler(8.0, 4.0, 0.25, 1, False, True)
    scaler.scale(torch.ones(()))
    assert scaler.get_scale() == 8.0 and scaler.get_growth_factor() == 4.0
    assert scaler.get_backoff_factor() == 0.25 and scaler.state_dict()["dynamic"] is False
    assert not GradScaler(enabled=False).is_enabled()
    with pytest.raises(ValueError, match="growth factor must be > 1.0"):
        GradScaler(growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff factor must be < 1.0"):
        GradScaler(backoff_factor=1.5)


@pytest.mark.parametrize("fused", [True, False], ids=["NpuFusedSGD", "torch.optim.SGD"])
def test_grad_scaler_static_scale(fused):
    # dynamic=False (torch_npu's static loss scale): gradients are divided by the scale but never
    # checked, so an inf is not skipped, and update() never changes the scale.
    from torch_npu.npu.amp import GradScaler

    a = make_params((torch.float32, torch.bfloat16), [(7,), (33, 5)])
    b = clone_params(a)
    ours = (optim.NpuFusedSGD if fused else torch.optim.SGD)(a, lr=0.1)
    plain = torch.optim.SGD(b, lr=0.1)
    scaler = GradScaler(init_scale=8.0, growth_interval=1, dynamic=False)
    for step in range(3):
        scaler.scale(torch.ones(()))
        set_grads([a], step, scale=8.0)
        set_grads([b], step)
        scaler.step(ours)
        scaler.update()
        plain.step()
        check_params(a, b)
        assert scaler.get_scale() == 8.0  # growth_interval=1 would have doubled a dynamic one
    set_grads([a], 3, scale=8.0)
    a[0].grad.view(-1)[0] = float("inf")
    scaler.step(ours)  # not skipped: the inf reaches the parameter
    scaler.update()
    assert math.isinf(a[0].detach().view(-1)[0].item()) and scaler.get_scale() == 8.0
    state = scaler.state_dict()
    dynamic = GradScaler()
    dynamic.load_state_dict(state)
    assert dynamic.state_dict()["dynamic"] is False
    torch_state = torch.amp.GradScaler("cpu").state_dict()
    dynamic = GradScaler()
    dynamic.load_state_dict({**torch_state, "scale": 4.0})  # no "dynamic" key: stays dynamic
    assert dynamic.state_dict()["dynamic"] is True and dynamic.get_scale() == 4.0


def test_step_with_found_inf_attribute_is_skipped():
    params = make_params((torch.float32,))
    before = [p.detach().clone() for p in params]
    opt = optim.NpuFusedAdamW(params)
    set_grads([params], 0)
    opt.found_inf, opt.grad_scale = torch.ones(()), torch.full((), 2.0)
    opt.step()
    for p, q in zip(params, before):
        assert torch.equal(p.detach(), q)
    assert all(len(opt.state[p]) == 0 or float(opt.state[p]["step"]) == 0 for p in params)


# --------------------------------------------------------------------------------------------
# State dicts


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 3)).to(dtype)


def _train(model, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 6, generator=gen).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def test_state_dict_round_trip_resumes_bit_identically(tmp_path):
    model = _model()
    opt = optim.NpuFusedAdamW(model.parameters(), lr=1e-2, amsgrad=True)
    _train(model, opt, 3)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    _train(model, opt, 4, seed=1)

    resumed = _model(seed=5)
    ckpt = torch.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(ckpt["model"])
    opt2 = optim.NpuFusedAdamW(resumed.parameters(), lr=1e-2, amsgrad=True)
    opt2.load_state_dict(ckpt["opt"])
    _train(resumed, opt2, 4, seed=1)
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_state_is_one_buffer_per_dtype_in_runs():
    # Every state of a group's parameters of one dtype lives in one buffer, all exp_avg first,
    # then all exp_avg_sq; a channels_last parameter's states stay tensors of their own, and a
    # parameter whose first gradient comes later gets a buffer of its own. Steps stay exact.
    conv = torch.nn.Parameter(torch.randn(4, 3, 2, 2).to(memory_format=torch.channels_last))
    late = torch.nn.Parameter(torch.randn(5))
    a = make_params((torch.float32, torch.bfloat16), [(7,), (33, 5)]) + [conv, late]
    b = clone_params(a)
    b[-2] = torch.nn.Parameter(conv.detach().clone().to(memory_format=torch.channels_last))
    ours = optim.NpuFusedAdamW(a, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        set_grads([a[:-1], b[:-1]], step)
        # (torch's fused CPU AdamW misreads a contiguous gradient of a channels_last parameter)
        b[-2].grad = b[-2].grad.contiguous(memory_format=torch.channels_last)
        if step == 2:
            a[-1].grad, b[-1].grad = torch.ones(5), torch.ones(5)
        ours.step()
        theirs.step()
        check_params(a, b)
    for dtype, group in ((torch.float32, a[0:2]), (torch.bfloat16, a[2:4])):
        states = [ours.state[p][name] for name in ("exp_avg", "exp_avg_sq") for p in group]
        assert len({_storage(t) for t in states}) == 1
        offsets = [t.storage_offset() for t in states]
        assert offsets == [0, 7, 7 + 165, 2 * 7 + 165] and all(t.dtype == dtype for t in states)
    conv_state = ours.state[conv]["exp_avg"]
    assert conv_state.is_contiguous(memory_format=torch.channels_last)
    assert _storage(conv_state) != _storage(ours.state[a[0]]["exp_avg"])
    assert _storage(ours.state[late]["exp_avg"]) == _storage(ours.state[late]["exp_avg_sq"])
    assert _storage(ours.state[late]["exp_avg"]) != _storage(ours.state[a[0]]["exp_avg"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [0, 5, (2 << 20) + 3])
def test_state_buffer_is_a_plain_writable_buffer(numel, dtype):
    # Huge pages are only advice: the buffer is an ordinary tensor of the requested size and dtype.
    buffer = torch.ops.opennpu._state_buffer(numel, dtype)
    assert buffer.shape == (numel,) and buffer.dtype == dtype and buffer.is_contiguous()
    buffer.fill_(3.0)
    assert bool((buffer == 3.0).all())


def test_compiled_step_and_clip_match_eager():
    # The kernels read p.grad themselves, so torch.compile must leave step and clipping eager
    # (traced, they would see functionalized copies without gradients and skip every parameter).
    a = make_params((torch.float32, torch.bfloat16), [(7,), (3, 5)])
    b = clone_params(a)
    ours = optim.NpuFusedAdamW(a, lr=1e-2, weight_decay=0.1)
    eager = optim.NpuFusedAdamW(b, lr=1e-2, weight_decay=0.1)

    @torch.compile
    def train_step():
        norm = ours.clip_grad_norm_fused_(0.5)
        ours.step()
        return norm

    for i in range(3):
        set_grads([a, b], i)
        norm = train_step()
        assert torch.equal(norm, eager.clip_grad_norm_fused_(0.5))
        eager.step()
        assert all(torch.equal(x, y) for x, y in zip(a, b))  # the same kernels, bit for bit


def test_state_buffer_rejects_a_negative_size():
    with pytest.raises(RuntimeError, match="_state_buffer.*numel.*>= 0.*-1"):
        torch.ops.opennpu._state_buffer(-1, torch.float32)


def test_loaded_state_is_packed_and_not_shared_with_the_state_dict():
    params = make_params((torch.float32,), [(7,), (3, 4)])
    opt = optim.NpuFusedAdamW(params, lr=1e-2)
    set_grads([params], 0)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt2 = optim.NpuFusedAdamW(clone_params(params), lr=1e-2)
    opt2.load_state_dict(saved)
    group = opt2.param_groups[0]["params"]
    loaded = [opt2.state[p][n] for n in ("exp_avg", "exp_avg_sq") for p in group]
    assert len({_storage(t) for t in loaded}) == 1
    for i, name in ((0, "exp_avg"), (1, "exp_avg_sq")):
        assert torch.equal(opt2.state[group[i]][name], saved["state"][i][name])
    saved["state"][0]["exp_avg"].fill_(7.0)  # the optimizer holds copies, not the dict's tensors
    assert not torch.equal(opt2.state[group[0]]["exp_avg"], saved["state"][0]["exp_avg"])


def test_torch_adamw_state_dict_loads_into_fused_and_back():
    m1, m2 = _model(), _model()
    torch_opt = torch.optim.AdamW(m1.parameters(), lr=1e-2)
    _train(m1, torch_opt, 3)
    m2.load_state_dict(m1.state_dict())
    fused = optim.NpuFusedAdamW(m2.parameters(), lr=1e-2)
    fused.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    _train(m1, torch_opt, 3, seed=1)
    _train(m2, fused, 3, seed=1)
    check_params(list(m2.parameters()), list(m1.parameters()))

    m3 = _model()
    m3.load_state_dict(m2.state_dict())
    back = torch.optim.AdamW(m3.parameters(), lr=1e-2)
    back.load_state_dict(copy.deepcopy(fused.state_dict()))
    assert back.param_groups[0]["decoupled_weight_decay"] is True
    _train(m2, fused, 2, seed=2)
    _train(m3, back, 2, seed=2)
    check_params(list(m3.parameters()), list(m2.parameters()))


def test_int_steps_from_torch_npu_checkpoints_are_accepted():
    model = _model()
    opt = optim.NpuFusedAdam(model.parameters())
    _train(model, opt, 1)
    sd = opt.state_dict()
    for s in sd["state"].values():
        s["step"] = int(s["step"])
    opt.load_state_dict(sd)
    _train(model, opt, 1)
    assert all(float(opt.state[p]["step"]) == 2 for p in model.parameters())


# --------------------------------------------------------------------------------------------
# Groups, missing gradients, zero_grad


def test_param_groups_frozen_params_missing_grads_and_empty_groups():
    a = make_params((torch.float32,), [(5,), (4, 3), (6,), (2,)])
    b = clone_params(a)
    a[3].requires_grad_(False)
    b[3].requires_grad_(False)

    def groups(ps):
        return [{"params": ps[:2], "lr": 1e-2}, {"params": [], "lr": 0.5},
                {"params": ps[2:], "weight_decay": 0.3}]

    ours = optim.NpuFusedAdamW(groups(a), lr=1e-3)
    theirs = torch.optim.AdamW(groups(b), lr=1e-3)
    for step in range(5):
        set_grads([a, b], step)
        for ps in (a, b):
            ps[3].grad = None  # frozen
            if step < 2:
                ps[2].grad = None  # receives its first gradient at step 2
            if step == 3:
                ps[0].grad = None  # skipped once: its step count stays behind
        ours.step()
        theirs.step()
    check_params(a, b)
    assert float(ours.state[a[0]]["step"]) == 4 and float(ours.state[a[2]]["step"]) == 3
    assert len(ours.state[a[3]]) == 0

    extra_a, extra_b = make_params((torch.bfloat16,), [(9,)], seed=7), None
    extra_b = clone_params(extra_a)
    ours.add_param_group({"params": extra_a, "lr": 0.1})
    theirs.add_param_group({"params": extra_b, "lr": 0.1})
    for step in range(3):
        set_grads([a + extra_a, b + extra_b], 10 + step)
        a[3].grad = b[3].grad = None
        ours.step()
        theirs.step()
    check_params(a + extra_a, b + extra_b)


def test_zero_grad_default_keeps_zeroed_tensors_and_set_to_none_works():
    params = make_params((torch.float32, torch.bfloat16), [(4,), (3, 2)])
    opt = optim.NpuFusedAdamW(params)
    set_grads([params], 0)
    grads = [p.grad for p in params]
    opt.step()
    opt.zero_grad()
    for p, g in zip(params, grads):
        assert p.grad is g and not g.any()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in params)
    before = [p.detach().clone() for p in params]
    opt.step()  # no gradients: nothing moves
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    ref_params = clone_params(params)
    ref_opt = torch.optim.AdamW(ref_params)
    ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    set_grads([params, ref_params], 1)
    opt.step()
    ref_opt.step()
    check_params(params, ref_params, scale=2.0)


def test_channels_last_parameters_and_gradients_of_another_layout():
    p = torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    q = torch.nn.Parameter(p.detach().clone())
    assert not p.is_contiguous()
    ours, theirs = optim.NpuFusedAdamW([p], lr=0.1), torch.optim.AdamW([q], lr=0.1)
    for step in range(3):
        g = torch.randn(2, 3, 4, 5)  # contiguous: a layout other than the parameter's
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert_close(p.detach(), q.detach())
    assert ours.state[p]["exp_avg"].is_contiguous(memory_format=torch.channels_last)


# --------------------------------------------------------------------------------------------
# Gradient clipping


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, math.inf, 0.0, -math.inf],
                         ids=lambda v: f"p={v}")
@pytest.mark.parametrize("max_norm", [0.5, 1e4], ids=["clips", "no-clip"])
def test_clip_grad_norm_fused_matches_torch(norm_type, max_norm):
    a = make_params((torch.float32,), [(7,), (33, 5), (40000,)])
    b = clone_params(a)
    set_grads([a, b], 0)
    opt = optim.NpuFusedAdamW(a)
    total = opt.clip_grad_norm_fused_(max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(b, max_norm, norm_type, foreach=True)
    assert total.dtype == torch.float32 and total.dim() == 0
    assert_close(total, expected)
    for p, q in zip(a, b):
        assert_close(p.grad, q.grad)


def test_clip_grad_norm_fused_low_precision_and_no_grads():
    a = make_params((torch.float16, torch.bfloat16), [(100,), (20, 3)])
    set_grads([a], 0, scale=3.0)
    expected = torch.linalg.vector_norm(torch.cat([p.grad.double().flatten() for p in a]))
    grads = [p.grad.float().clone() for p in a]
    opt = optim.NpuFusedSGD(a, lr=0.1)
    total = opt.clip_grad_norm_fused_(1.0)
    assert total.dtype == torch.float32
    torch.testing.assert_close(total.double(), expected, rtol=1e-6, atol=0)
    coef = 1.0 / (total.item() + 1e-6)
    for p, g in zip(a, grads):
        assert_close(p.grad, (g * coef).to(p.dtype))
    empty = optim.NpuFusedSGD(make_params((torch.float32,), [(3,)]), lr=0.1)
    assert torch.equal(empty.clip_grad_norm_fused_(1.0), torch.tensor(0.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, math.inf], ids=lambda v: f"p={v}")
def test_grad_norm_exact_for_every_element(dtype, norm_type):
    # Sizes that fill the kernel's unrolled loop (8 vectors per iteration), leave tails of every
    # length, and are split between threads. One large element at an even and one at an odd
    # index of the long tensor: bf16 is widened as even / odd lanes, and a lost lane would show.
    a = make_params((dtype,), [(5,), (257,), (1000,), (70003,)])
    set_grads([a], 0)
    for i in (4097, 8192):
        a[3].grad[i] = 40.0
        g = torch.cat([p.grad.double().flatten() for p in a]).abs()
        expected = g.max() if math.isinf(norm_type) else g.pow(norm_type).sum() ** (1 / norm_type)
        total = torch.ops.opennpu._fused_grad_norm(a, norm_type)
        torch.testing.assert_close(total.double(), expected, rtol=2e-6, atol=0)
        if math.isinf(norm_type):
            assert total.item() == 40.0
        a[3].grad[i] = float("nan")
        assert math.isnan(torch.ops.opennpu._fused_grad_norm(a, norm_type).item())
        a[3].grad[i] = 0.5


def test_clip_grad_norm_fused_inf_and_nan():
    a = make_params((torch.float32,), [(10,), (5,)])
    set_grads([a], 0)
    a[1].grad[2] = float("-inf")
    assert optim.NpuFusedAdamW(a).clip_grad_norm_fused_(1.0, math.inf).item() == math.inf
    a[0].grad[3] = float("nan")
    assert math.isnan(optim.NpuFusedAdamW(a).clip_grad_norm_fused_(1.0, 2).item())


# --------------------------------------------------------------------------------------------
# Argument errors


@pytest.mark.parametrize("make,message", [
    (lambda p: optim.NpuFusedAdamW(p, lr=-1e-3), "Invalid learning rate: -0.001"),
    (lambda p: optim.NpuFusedAdamW(p, betas=(1.0, 0.999)), "Invalid beta parameter at index 0"),
    (lambda p: optim.NpuFusedAdam(p, betas=(0.9, -0.1)), "Invalid beta parameter at index 1"),
    (lambda p: optim.NpuFusedAdam(p, eps=-1.0), "Invalid epsilon value: -1.0"),
    (lambda p: optim.NpuFusedAdamW(p, weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
    (lambda p: optim.NpuFusedSGD(p, lr=0.1, nesterov=True),
     "Nesterov momentum requires a momentum and zero dampening"),
    (lambda p: optim.NpuFusedSGD(p, lr=0.1, momentum=0.9, dampening=0.5, nesterov=True),
     "Nesterov momentum requires a momentum and zero dampening"),
    (lambda p: optim.NpuFusedSGD(p, lr=0.1, momentum=-0.9), "Invalid momentum value: -0.9"),
    (lambda p: optim.NpuFusedRMSprop(p, alpha=-0.5), "Invalid alpha value: -0.5"),
    (lambda p: optim.NpuFusedRMSpropTF(p, eps=-1.0), "Invalid epsilon value"),
    (lambda p: optim.NpuFusedAdadelta(p, rho=1.5), "Invalid rho value: 1.5"),
    (lambda p: optim.NpuFusedLamb(p, betas=(0.9, 1.0)), "Invalid beta parameter at index 1"),
    (lambda p: optim.NpuFusedAdamP(p, lr=-1.0), "Invalid learning rate"),
    (lambda p: optim.NpuFusedBertAdam(p, lr=0.1, schedule="linear"),
     "Invalid schedule parameter: linear"),
    (lambda p: optim.NpuFusedBertAdam(p, lr=0.1, warmup=1.5), "Invalid warmup: 1.5"),
    (lambda p: optim.NpuFusedBertAdam(p, lr=0.1, b1=1.0), "Invalid b1 parameter"),
])
def test_bad_arguments_raise_like_torch_optim(make, message):
    with pytest.raises(ValueError, match=message):
        make([torch.nn.Parameter(torch.zeros(3))])


def test_required_lr_and_bad_gradients():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="didn't specify a value of required optimization "
                                         "parameter lr"):
        optim.NpuFusedSGD([p])
    opt = optim.NpuFusedAdamW([p])
    p.grad_dtype = None  # lets autograd's guard accept a gradient of another dtype
    p.grad = torch.zeros(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"_fused_adam_: argument 'params' \[0\] must have a "
                                           r"gradient of its dtype"):
        opt.step()
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients are not supported"):
        opt.step()
    q = torch.nn.Parameter(torch.zeros(3, dtype=torch.int32), requires_grad=False)
    q.grad = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="must be float32, float16, bfloat16 or float64"):
        optim.NpuFusedAdamW([q]).step()


def test_torch_npu_optim_names():
    import torch_npu

    for name in optim.__all__:
        if name != "GradScaler":
            assert getattr(torch_npu.optim, name) is getattr(optim, name)
    from torch_npu.optim import NpuFusedAdamW  # noqa: F401

    assert issubclass(torch_npu.optim.NpuFusedAdamW, torch.optim.Optimizer)


# --------------------------------------------------------------------------------------------
# DistributedDataParallel (gloo, two processes)

DDP_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import opennpu.optim


    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


    def batches():
        gen = torch.Generator().manual_seed(1)
        return [(torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen))
                for _ in range(5)]


    def worker(rank, port, out):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        net = torch.nn.parallel.DistributedDataParallel(model())
        opt = opennpu.optim.NpuFusedAdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
        for x, y in batches():
            xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(xs), ys).backward()
            opt.clip_grad_norm_fused_(10.0)
            opt.step()
        if rank == 0:
            torch.save(net.module.state_dict(), out)
        dist.destroy_process_group()


    if __name__ == "__main__":
        port, out = int(sys.argv[1]), sys.argv[2]
        mp.spawn(worker, args=(port, out), nprocs=2)
        single = model()
        opt = torch.optim.AdamW(single.parameters(), lr=1e-2, weight_decay=0.1)
        for x, y in batches():
            opt.zero_grad()
            torch.nn.functional.mse_loss(single(x), y).backward()
            torch.nn.utils.clip_grad_norm_(single.parameters(), 10.0)
            opt.step()
        ddp = torch.load(out)
        worst = max((ddp[k] - v).abs().max().item() for k, v in single.state_dict().items())
        print(f"max diff {worst:.3g}")
        sys.exit(0 if worst < 1e-5 else 1)
    """
)


def test_ddp_gloo_two_processes_matches_single_process_adamw(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ddp.py"
    script.write_text(DDP_SCRIPT)
    result = subprocess.run([sys.executable, str(script), str(port), str(tmp_path / "ddp.pt")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_deepcopy_and_pickle_keep_working():
    params = make_params((torch.float32,), [(4,)])
    opt = optim.NpuFusedAdamW(params)
    set_grads([params], 0)
    opt.step()
    clone = copy.deepcopy(opt)
    assert float(clone.state[clone.param_groups[0]["params"][0]]["step"]) == 1
