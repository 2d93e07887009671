"""The portable path of opennpu.optim (src/opennpu/ops/portable_optim.py): the torch._foreach_*
compositions of the opennpu::_fused_* ops, which parameters on CUDA / XPU / MPS run.

On CPU the tests force them (opennpu.ops.portable.force) and compare them with the C++ kernels
on the same inputs: float32 and float64 to a few ulps, float16 / bfloat16 to one unit in the last
place, for parameters, every state tensor and the step counters, over several steps. The CUDA
tests at the end run the optimizers on CUDA parameters against CPU copies; without a GPU they are
skipped (written, not yet run on a GPU).
"""

from __future__ import annotations

import math

import pytest
import torch

import opennpu.optim as optim
from opennpu.ops import portable, portable_optim

ops = torch.ops.opennpu
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
MIXED = (F32, F16, BF16, F64)
SHAPES = [(7,), (33, 5), (0,), (3, 4, 5, 2), (1,), (129, 3)]
# fp16 / bf16: a relative bound of one unit in the last place. fp32 / fp64: a few ulps of the
# result, or of the tensor's largest value (or 1) where that is larger: operation order and
# fused multiply-adds differ between the C++ kernels and ATen's, and a value near 0 is often a
# difference of larger terms.
ULP = {F16: 2.0**-10, BF16: 2.0**-7, F32: 2.0**-20, F64: 2.0**-48}
TINY = {F16: 2.0**-24, BF16: 1e-38, F32: 2.0**-20, F64: 2.0**-48}


def assert_ulp(actual, expected, what="", ulps=1, dtype=None):
    """Equal to `ulps` units in the last place of `dtype` (default: the tensors')."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    a, e = actual.double(), expected.double()
    dtype = dtype or actual.dtype
    tiny = TINY[dtype]
    if dtype in (F32, F64) and e.numel():  # also normwise: relative to the tensor's largest value
        tiny *= max(1.0, float(e.abs().nan_to_num(0, 0, 0).max()))
    bound = ulps * (ULP[dtype] * torch.maximum(a.abs(), e.abs()) + tiny)
    bad = ~((a - e).abs() <= bound) & ~(a.isnan() & e.isnan()) & ~(a == e)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {a.numel()} differ, e.g. "
                           f"{a[bad][:3].tolist()} vs {e[bad][:3].tolist()}")


def make_params(dtypes=MIXED, shapes=SHAPES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt))
              for dt in dtypes for s in shapes]
    # a channels_last parameter (dense, not contiguous)
    params.append(torch.nn.Parameter(torch.randn(2, 3, 4, 5, generator=gen)
                                     .to(memory_format=torch.channels_last)))
    return params


def clone(params):
    return [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format))
            for p in params]


def set_grads(lists, step, scale=1.0, skip=()):
    """The same gradients for every list of parameters; parameters at `skip` get none."""
    gen = torch.Generator().manual_seed(1000 + step)
    draws = [torch.randn(p.shape, generator=gen) * scale for p in lists[0]]
    for params in lists:
        for i, (p, g) in enumerate(zip(params, draws)):
            p.grad = None if i in skip else g.to(p.dtype, copy=True)


def assert_same_state(opt_a, opt_b, params_a, params_b, ulps=1, fp32_scalars=False):
    """Parameters and states equal to `ulps` units in the last place. fp32_scalars: a float32
    factor common to all parameters (LAMB's global gradient norm) may differ by an ulp, so fp64
    tensors are compared at fp32's ulp."""
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        dtype = F32 if fp32_scalars and a.dtype == F64 else None
        assert_ulp(a.detach(), b.detach(), f"param {i} {a.dtype} {tuple(a.shape)}", ulps, dtype)
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert sa.keys() == sb.keys(), i
        for name in sa:
            if name == "step":
                assert float(sa[name]) == float(sb[name])
            elif torch.is_tensor(sa[name]):
                assert_ulp(sa[name], sb[name], f"{name} of param {i} {a.dtype}", ulps, dtype)


@torch.no_grad()
def sync_state(opt_a, opt_b, params_a, params_b):
    """Copies a's parameters and states into b's: the next step starts from the same values (an
    ulp that rounded the other way would otherwise be compared again, grown, steps later)."""
    for a, b in zip(params_a, params_b):
        b.copy_(a)
        for name, value in opt_a.state.get(a, {}).items():
            if torch.is_tensor(value) and name != "step":
                opt_b.state[b][name].copy_(value)


def kernel_is_portable(name="_fused_adam_"):
    dump = torch._C._dispatch_dump(f"opennpu::{name}")
    return "ops/portable.py" in dump.split("CPU:")[1].split("\n")[0]


# ----------------------------------------------------------------------------- registration


def test_every_optimizer_op_has_a_portable_kernel_and_force_switches_cpu():
    names = {n for n in torch._C._dispatch_get_all_op_names() if n.startswith("opennpu::_fused")}
    assert names == set(portable_optim.KERNELS)
    for qualname in portable_optim.KERNELS:
        assert qualname in portable.IMPLS and qualname in portable.NOT_DECOMPOSED
        for key in portable.PORTABLE_KEYS:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), (qualname, key)
    assert not kernel_is_portable()
    with portable.force():
        assert all(kernel_is_portable(q.split("::")[1]) for q in portable_optim.KERNELS)
    assert not kernel_is_portable()


# ----------------------------------------------------------------------------- optimizers

OPTIMIZERS = [
    (optim.NpuFusedAdamW, dict(lr=1e-2, weight_decay=0.1)),
    (optim.NpuFusedAdamW, dict(lr=1e-2, amsgrad=True, betas=(0.8, 0.99), maximize=True)),
    (optim.NpuFusedAdam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    (optim.NpuFusedSGD, dict(lr=0.05)),
    (optim.NpuFusedSGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    (optim.NpuFusedSGD, dict(lr=0.05, momentum=0.9, nesterov=True, maximize=True)),
    (optim.NpuFusedRMSprop, dict(lr=1e-3)),
    (optim.NpuFusedRMSprop, dict(lr=1e-3, momentum=0.9, centered=True, weight_decay=0.01,
                                 maximize=True)),
    (optim.NpuFusedRMSpropTF, dict(lr=1e-3, momentum=0.9)),
    (optim.NpuFusedRMSpropTF, dict(lr=1e-3, momentum=0.9, centered=True, weight_decay=0.01,
                                   decoupled_decay=True, lr_in_momentum=False)),
    (optim.NpuFusedRMSpropTF, dict(lr=1e-3, weight_decay=0.01)),
    (optim.NpuFusedAdadelta, dict(lr=0.5, rho=0.8, weight_decay=0.01, maximize=True)),
    (optim.NpuFusedLamb, dict(lr=1e-2, weight_decay=0.01)),
    (optim.NpuFusedLamb, dict(lr=1e-2, adam=True)),
    (optim.NpuFusedLamb, dict(lr=1e-2, use_global_grad_norm=True)),
    (optim.NpuFusedBertAdam, dict(lr=1e-2, warmup=0.2, t_total=6)),
    (optim.NpuFusedBertAdam, dict(lr=1e-2, warmup=0.1, t_total=10, schedule="warmup_cosine",
                                  max_grad_norm=0.0)),
    (optim.NpuFusedBertAdam, dict(lr=1e-2, schedule="warmup_poly", max_grad_norm=1e3)),
    (optim.NpuFusedAdamP, dict(lr=1e-2, weight_decay=0.01)),
    (optim.NpuFusedAdamP, dict(lr=1e-2, weight_decay=0.01, nesterov=True)),
]


def _id(case):
    cls, kwargs = case
    return cls.__name__ + "-" + "-".join(f"{k}={v}" for k, v in kwargs.items())


@pytest.mark.parametrize("case", OPTIMIZERS, ids=[_id(c) for c in OPTIMIZERS])
def test_optimizer_steps_match_the_cpu_kernels(case):
    """Five steps, each compared (1 ulp) and then synchronised: fp32 + fp16 + bf16 + fp64 in one
    group, an empty tensor, a channels_last parameter, one parameter that never has a gradient
    and one that has none every other step (its step count falls behind: per-tensor bias
    corrections)."""
    cls, kwargs = case
    a = make_params()
    b = clone(a)
    opt_a, opt_b = cls(a, **kwargs), cls(b, **kwargs)
    never, sometimes = 1, 8
    for step in range(5):
        set_grads([a, b], step, skip={never} | ({sometimes} if step % 2 else set()))
        opt_a.step()
        with portable.force():
            opt_b.step()
        assert_same_state(opt_a, opt_b, a, b,
                          fp32_scalars=kwargs.get("use_global_grad_norm", False))
        sync_state(opt_a, opt_b, a, b)
    assert not opt_a.state.get(a[never]) and not opt_b.state.get(b[never])
    if "step" in opt_a.state[a[0]]:
        assert float(opt_b.state[b[sometimes]]["step"]) == 3.0
        assert opt_b.state[b[0]]["step"].dtype == F32


@pytest.mark.parametrize("case", [OPTIMIZERS[i] for i in (0, 5, 9, 11, 12, 15, 19)],
                         ids=[_id(OPTIMIZERS[i]) for i in (0, 5, 9, 11, 12, 15, 19)])
def test_grad_scale_and_found_inf_attributes(case):
    """torch.amp.GradScaler's protocol: grad_scale multiplies each gradient by 1 / scale as it
    is read (p.grad keeps its values), found_inf != 0 skips the step."""
    cls, kwargs = case
    a = make_params((F32, BF16), [(7,), (33, 5)])
    b = clone(a)
    opt_a, opt_b = cls(a, **kwargs), cls(b, **kwargs)
    for opt in (opt_a, opt_b):
        opt.grad_scale = torch.tensor(512.0)
        opt.found_inf = torch.tensor(0.0)
    for step in range(3):
        set_grads([a, b], step, scale=512.0)
        kept = [p.grad.clone() for p in b]
        opt_a.step()
        with portable.force():
            opt_b.step()
        for p, g in zip(b, kept):
            assert torch.equal(p.grad, g)
        assert_same_state(opt_a, opt_b, a, b)
        sync_state(opt_a, opt_b, a, b)
    before = [p.detach().clone() for p in b]
    opt_b.found_inf = torch.tensor(1.0)
    with portable.force():
        opt_b.step()
    for p, q in zip(b, before):
        assert torch.equal(p, q)


@pytest.mark.parametrize("clip", [None, 1.0], ids=["step", "unscale+clip+step"])
def test_grad_scaler_training_with_an_overflow(clip):
    def train(params, forced):
        opt = optim.NpuFusedAdamW(params, lr=1e-2)
        scaler = optim.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        with portable.force(forced):
            for step in range(5):
                scaler.scale(torch.ones(()))
                set_grads([params], step, scale=scaler.get_scale())
                if step == 2:
                    params[1].grad.view(-1)[0] = float("inf")
                if clip is not None:
                    scaler.unscale_(opt)
                    opt.clip_grad_norm_fused_(clip)
                scaler.step(opt)
                scaler.update()
        return opt, scaler

    a = make_params((F32, F16, BF16), [(7,), (33, 5), (0,)])
    b = clone(a)
    opt_a, scaler_a = train(a, False)
    opt_b, scaler_b = train(b, True)
    assert scaler_a.get_scale() == scaler_b.get_scale()
    assert float(opt_b.state[b[0]]["step"]) == 4.0  # the overflow step was skipped
    assert_same_state(opt_a, opt_b, a, b, ulps=2)  # five steps, not synchronised


# ----------------------------------------------------------------------------- ops


def _lists(dtypes=MIXED, shapes=((5,), (4, 6), (0,), (2, 3, 4)), states=2, seed=0, grads=True):
    gen = torch.Generator().manual_seed(seed)
    params, moments = [], [[] for _ in range(states)]
    for dt in dtypes:
        for s in shapes:
            p = torch.randn(s, generator=gen).to(dt)
            if grads:
                p.grad = torch.randn(s, generator=gen).to(dt)
            params.append(p)
            for k in range(states):
                moments[k].append((torch.rand(s, generator=gen) * (0.3 if k else 1)).to(dt))
    steps = [torch.tensor(float(3 + i % 4)) for i in range(len(params))]
    return params, moments, steps


def _copy(params, moments, steps):
    out = []
    for p in params:
        q = p.clone()
        if p.grad is not None:
            q.grad = p.grad.clone()
        out.append(q)
    return out, [[t.clone() for t in m] for m in moments], [s.clone() for s in steps]


def _compare_op(call, states=2, grads_change=False, **lists_kwargs):
    """call(params, moments, steps) on the C++ kernel and on the forced portable one."""
    args = _lists(states=states, **lists_kwargs)
    other = _copy(*args)
    call(*args)
    with portable.force():
        call(*other)
    for p, q in zip(args[0], other[0]):
        assert_ulp(p, q, f"param {p.dtype} {tuple(p.shape)}")
        if p.grad is not None:  # the steps read the gradients and leave them as they are
            if grads_change:
                assert_ulp(p.grad, q.grad, "grad")
            else:
                assert torch.equal(p.grad, q.grad)
    for m, n in zip(args[1], other[1]):
        for x, y in zip(m, n):
            assert_ulp(x, y, f"state {x.dtype}")
    assert [float(s) for s in args[2]] == [float(s) for s in other[2]]
    return args, other


ADAM = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8)


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
@pytest.mark.parametrize("grad_scale", [1.0, 0.125])
def test_fused_adam_flags(amsgrad, decoupled, maximize, grad_scale):
    def call(params, m, steps):
        ops._fused_adam_(params, m[0], m[1], m[2] if amsgrad else [], steps, **ADAM,
                         amsgrad=amsgrad, maximize=maximize, decoupled_weight_decay=decoupled,
                         grad_scale=grad_scale)

    _compare_op(call, states=3)


@pytest.mark.parametrize("nesterov,dampening,weight_decay,maximize",
                         [(False, 0.0, 0.0, False), (False, 0.3, 0.01, True),
                          (True, 0.0, 0.01, False)])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_sgd_flags_and_fresh_buffers(nesterov, dampening, weight_decay, maximize, momentum):
    if nesterov and momentum == 0:
        pytest.skip("Nesterov needs momentum")

    def call(params, m, steps):
        fresh = [i for i in range(len(params)) if i % 3 == 0]  # set to the gradient
        ops._fused_sgd_(params, m[0] if momentum else [], fresh, lr=0.05, momentum=momentum,
                        dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, grad_scale=0.5)

    _compare_op(call, states=1)


@pytest.mark.parametrize("tf_style,lr_in_momentum,decoupled", [
    (False, False, False), (True, True, False), (True, False, True), (True, True, True)])
@pytest.mark.parametrize("centered", [False, True])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_rmsprop_flags(tf_style, lr_in_momentum, decoupled, centered, momentum):
    def call(params, m, steps):
        ops._fused_rmsprop_(params, m[0], m[1] if centered else [], m[2] if momentum else [],
                            steps, lr=1e-2, alpha=0.9, eps=1e-6, weight_decay=0.01,
                            momentum=momentum, centered=centered, maximize=not tf_style,
                            tf_style=tf_style, lr_in_momentum=lr_in_momentum,
                            decoupled_decay=decoupled, grad_scale=2.0)

    # square_avg >= grad_avg^2 as in training (rand states: keep the centered root real)
    _compare_op(call, states=3)


def test_fused_adadelta():
    def call(params, m, steps):
        ops._fused_adadelta_(params, m[0], m[1], steps, lr=1.0, rho=0.9, eps=1e-6,
                             weight_decay=0.01, maximize=True, grad_scale=0.25)

    _compare_op(call)


@pytest.mark.parametrize("use_trust_ratio", [False, True])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_fused_lamb(use_trust_ratio, weight_decay):
    def call(params, m, steps):
        ops._fused_lamb_(params, m[0], m[1], steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6,
                         weight_decay=weight_decay, use_trust_ratio=use_trust_ratio,
                         grad_scale=0.5)

    _compare_op(call)


def test_fused_lamb_trust_ratio_edges():
    """|p| clamped to 10; trust 1 where |p| or |u| is 0 (a zero parameter and zero moments)."""
    def call(params, m, steps):
        params[0].mul_(100)  # |p| > 10
        params[1].zero_()
        params[1].grad.zero_()
        m[0][1].zero_()
        ops._fused_lamb_(params, m[0], m[1], steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6,
                         weight_decay=0.0, use_trust_ratio=True)

    _compare_op(call, dtypes=(F32, BF16))


@pytest.mark.parametrize("schedule", ["warmup_linear", "warmup_cosine", "warmup_constant",
                                      "warmup_poly"])
@pytest.mark.parametrize("max_grad_norm", [0.0, 1.0, 1e4])
def test_fused_bert_adam(schedule, max_grad_norm):
    def call(params, m, steps):
        ops._fused_bert_adam_(params, m[0], m[1], steps, lr=1e-2, beta1=0.9, beta2=0.999,
                              eps=1e-6, weight_decay=0.01, max_grad_norm=max_grad_norm,
                              schedule=schedule, warmup=0.1, t_total=20.0, grad_scale=0.5)

    _compare_op(call)


def test_fused_bert_adam_constant_rate():
    def call(params, m, steps):
        ops._fused_bert_adam_(params, m[0], m[1], steps, lr=1e-2, beta1=0.9, beta2=0.999,
                              eps=1e-6, weight_decay=0.0, max_grad_norm=0.5,
                              schedule="warmup_linear", warmup=-1.0, t_total=-1.0)

    _compare_op(call)


def _orthogonal(params, per_row):
    """Makes each gradient orthogonal to its parameter, per row (AdamP's channel projection) or
    with rows of opposite cosine that cancel over the whole tensor (the whole-tensor one)."""
    for p in params:
        if p.dim() < 2 or p.numel() == 0:
            continue
        g = p.grad.double().reshape(p.shape[0], -1)
        w = p.double().reshape(p.shape[0], -1)
        if per_row:
            g = g - (g * w).sum(1, keepdim=True) / (w * w).sum(1, keepdim=True) * w
        else:
            g = g - (g * w).sum() / (w * w).sum() * w + 0.3 * w * torch.tensor(
                [(-1.0) ** r for r in range(p.shape[0])], dtype=torch.float64)[:, None]
            g = g - (g * w).sum() / (w * w).sum() * w
        p.grad.copy_(g.reshape(p.shape))


@pytest.mark.parametrize("projection", ["none", "per_row", "whole"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_fused_adamp_projections(projection, nesterov):
    def call(params, m, steps):
        if projection != "none":
            _orthogonal(params, projection == "per_row")
        ops._fused_adamp_(params, m[0], m[1], steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.1, delta=0.1, wd_ratio=0.1, nesterov=nesterov,
                          grad_scale=0.5)

    # fp32 / fp64 only where the projection is chosen: a rounding of the cosine can flip it
    _compare_op(call, dtypes=MIXED if projection == "none" else (F32, F64),
                shapes=((5,), (4, 6), (0,), (3, 4, 5), (8, 3, 2)))


def test_fused_adamp_projection_is_taken():
    """The projection changes the result (the tests above compare both sides of each branch)."""
    params, (m, v), steps = _lists(dtypes=(F32,), shapes=((6, 10),))
    _orthogonal(params, per_row=True)
    plain = _copy(params, [m, v], steps)
    with portable.force():
        ops._fused_adamp_(params, m, v, steps, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                          weight_decay=0.1, delta=0.1, wd_ratio=0.1, nesterov=False)
        ops._fused_adamp_(plain[0], *plain[1], plain[2], lr=1e-2, beta1=0.9, beta2=0.999,
                          eps=1e-8, weight_decay=0.1, delta=0.0, wd_ratio=0.1, nesterov=False)
    assert not torch.allclose(params[0], plain[0][0])


# ----------------------------------------------------------------------------- norm and scaling


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.5, math.inf], ids=lambda v: f"p={v}")
def test_fused_grad_norm(norm_type):
    params, _, _ = _lists(states=0, shapes=((5,), (40, 7), (0,), (1000,)))
    expected = ops._fused_grad_norm(params, norm_type)
    with portable.force():
        total = ops._fused_grad_norm(params, norm_type)
    assert total.dtype == F32 and total.dim() == 0
    torch.testing.assert_close(total, expected, rtol=2e-6, atol=0)
    params[5].grad.view(-1)[3] = float("nan")
    with portable.force():
        assert math.isnan(ops._fused_grad_norm(params, norm_type).item())
    params[5].grad.view(-1)[3] = float("-inf")
    with portable.force():
        assert ops._fused_grad_norm(params, norm_type).item() == math.inf


def test_fused_grad_norm_without_gradients():
    params, _, _ = _lists(states=0, grads=False)
    with portable.force():
        assert torch.equal(ops._fused_grad_norm(params, 2.0), torch.tensor(0.0))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf], ids=lambda v: f"p={v}")
@pytest.mark.parametrize("max_norm", [0.5, 1e4], ids=["clips", "no-clip"])
def test_clip_grad_norm_fused(norm_type, max_norm):
    a = make_params((F32, F16, BF16), [(7,), (33, 5), (0,)])
    b = clone(a)
    set_grads([a, b], 0, scale=3.0)
    total_a = optim.NpuFusedAdamW(a).clip_grad_norm_fused_(max_norm, norm_type)
    with portable.force():
        total_b = optim.NpuFusedAdamW(b).clip_grad_norm_fused_(max_norm, norm_type)
    torch.testing.assert_close(total_b, total_a, rtol=2e-6, atol=0)
    for p, q in zip(a, b):
        if p.grad is not None:
            # the clip factor is computed from the norm: allow its few-ulp difference
            torch.testing.assert_close(q.grad.double(), p.grad.double(), atol=0,
                                       rtol=2 * ULP[p.dtype] if p.dtype != F32 else 1e-6)


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_fused_scale_grads(scale):
    def call(params, m, steps):
        ops._fused_scale_grads_(params, scale)

    args, other = _compare_op(call, states=0, grads_change=True)
    for p, q in zip(args[0], other[0]):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("bad", [None, "inf", "nan"])
def test_fused_unscale_grads(bad):
    def call(params, m, steps):
        if bad:
            params[5].grad.view(-1)[1] = float(bad)  # float16
        found = torch.zeros(())
        ops._fused_unscale_grads_(params, found, torch.tensor([0.25]))
        m.append([found])

    args, other = _compare_op(call, states=0, grads_change=True)
    for p, q in zip(args[0], other[0]):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True)
    assert args[1][0][0].item() == other[1][0][0].item() == (1.0 if bad else 0.0)


def test_unscale_keeps_a_set_found_inf():
    params, _, _ = _lists(states=0)
    found = torch.ones(1)
    with portable.force():
        ops._fused_unscale_grads_(params, found, torch.ones(1))
    assert found.item() == 1.0


def test_gradients_of_another_layout():
    """A transposed gradient on a contiguous parameter (the C++ kernels re-lay it out)."""
    def call(params, m, steps):
        for p in params:
            if p.dim() == 2:
                p.grad = p.grad.t().contiguous().t()
        ops._fused_adam_(params, m[0], m[1], [], steps, **ADAM, amsgrad=False, maximize=False,
                         decoupled_weight_decay=True, grad_scale=0.5)
        ops._fused_scale_grads_(params, 3.0)

    args, other = _compare_op(call, grads_change=True)
    for p, q in zip(args[0], other[0]):
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad) and p.grad.stride() == q.grad.stride()


# ----------------------------------------------------------------------------- argument errors


def _p(shape=(3, 4), dtype=F32, grad=True):
    t = torch.randn(shape).to(dtype)
    if grad:
        t.grad = torch.randn(shape).to(dtype)
    return t


_ADAM_KW = dict(ADAM, amsgrad=False, maximize=False, decoupled_weight_decay=True)
_S = torch.zeros


def _sparse_grad():
    p = _p()
    p.grad = torch.randn(3, 4).to_sparse()
    return p


def _strided():
    p = torch.randn(4, 6)[:, ::2]
    p.grad = torch.randn(4, 3)
    return p


def _int_param():
    p = torch.ones(3, dtype=torch.int32)
    p.grad = torch.ones(3, dtype=torch.int32)
    return p


BAD_CALLS = {
    "state list length": lambda: ops._fused_adam_([_p()], [_S(3, 4)], [], [], [_S(())],
                                                  **_ADAM_KW),
    "missing steps": lambda: ops._fused_adam_([_p()], [_S(3, 4)], [_S(3, 4)], [], [],
                                              **_ADAM_KW),
    "state dtype": lambda: ops._fused_adam_([_p(), _p(dtype=F64)], [_S(3, 4)] * 2,
                                            [_S(3, 4)] * 2, [], [_S(()), _S(())], **_ADAM_KW),
    "state shape": lambda: ops._fused_adam_([_p()], [_S(3, 5)], [_S(3, 4)], [], [_S(())],
                                            **_ADAM_KW),
    "state layout": lambda: ops._fused_adam_([_p()], [_S(4, 3).t()], [_S(3, 4)], [], [_S(())],
                                             **_ADAM_KW),
    "step dtype": lambda: ops._fused_adam_([_p()], [_S(3, 4)], [_S(3, 4)], [],
                                           [_S((), dtype=torch.int64)], **_ADAM_KW),
    "amsgrad list": lambda: ops._fused_adam_([_p()], [_S(3, 4)], [_S(3, 4)], [], [_S(())],
                                             **dict(_ADAM_KW, amsgrad=True)),
    "grad_scale": lambda: ops._fused_adam_([_p()], [_S(3, 4)], [_S(3, 4)], [], [_S(())],
                                           **_ADAM_KW, grad_scale=0.0),
    "not dense": lambda: ops._fused_scale_grads_([_strided()], 2.0),
    "int params": lambda: ops._fused_scale_grads_([_int_param()], 2.0),
    "sparse grad": lambda: ops._fused_scale_grads_([_sparse_grad()], 2.0),
    "fresh index": lambda: ops._fused_sgd_([_p()], [_S(3, 4)], [3], lr=0.1, momentum=0.9,
                                           dampening=0.0, weight_decay=0.0, nesterov=False,
                                           maximize=False),
    "schedule": lambda: ops._fused_bert_adam_([_p()], [_S(3, 4)], [_S(3, 4)], [_S(())], lr=0.1,
                                              beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.0,
                                              max_grad_norm=1.0, schedule="nope", warmup=0.1,
                                              t_total=10.0),
    "norm_type": lambda: ops._fused_grad_norm([_p()], 0.0),
    "found_inf": lambda: ops._fused_unscale_grads_([_p()], _S(1, dtype=F64), torch.ones(1)),
    "inv_scale": lambda: ops._fused_unscale_grads_([_p()], _S(1), torch.ones(2)),
    "grad_avgs": lambda: ops._fused_rmsprop_([_p()], [_S(3, 4)], [], [], [_S(())], lr=0.1,
                                             alpha=0.9, eps=1e-8, weight_decay=0.0,
                                             momentum=0.0, centered=True, maximize=False),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_the_cpu_kernels_message(name):
    messages = []
    for forced in (False, True):
        with portable.force(forced), pytest.raises(RuntimeError) as error:
            BAD_CALLS[name]()
        messages.append(str(error.value).split("\n")[0])
    assert messages[0] == messages[1]
    assert "argument '" in messages[1]


def test_int_params_without_gradient_are_skipped():
    with portable.force():
        ops._fused_scale_grads_([_p(dtype=torch.int32, grad=False), _p()], 2.0)


# ----------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _to(params, device):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().to(device))
        out.append(q)
    return out


@cuda
@pytest.mark.parametrize("case", OPTIMIZERS, ids=[_id(c) for c in OPTIMIZERS])
def test_optimizers_on_cuda_match_cpu(case):
    """The optimizers on CUDA parameters (the portable kernels) against CPU copies (the C++
    kernels): same steps, states on the parameters' device, step counters on the CPU. Each step
    is compared (CUDA contracts multiply-adds and reduces in another order: 2 ulps, fp32 also
    normwise), then the CPU values are copied over, so a last-place difference cannot grow."""
    cls, kwargs = case
    cpu = make_params()
    gpu = _to(cpu, "cuda")
    opt_cpu, opt_gpu = cls(cpu, **kwargs), cls(gpu, **kwargs)
    for step in range(4):
        set_grads([cpu], step, skip={1})
        for p, q in zip(cpu, gpu):
            q.grad = None if p.grad is None else p.grad.to("cuda")
        opt_cpu.step()
        opt_gpu.step()
        for i, (p, q) in enumerate(zip(cpu, gpu)):
            assert q.device.type == "cuda"
            for name, value in opt_gpu.state.get(q, {}).items():
                if name == "step":
                    assert value.device.type == "cpu" and value.dtype == F32
                    assert float(value) == float(opt_cpu.state[p][name])
                elif torch.is_tensor(value):
                    assert value.device.type == "cuda"
                    want = opt_cpu.state[p][name]
                    assert_ulp(value.cpu(), want, f"step {step} param {i} {name}", ulps=2)
                    with torch.no_grad():
                        value.copy_(want)
            assert_ulp(q.detach().cpu(), p.detach(), f"step {step} param {i}", ulps=2)
            with torch.no_grad():
                q.copy_(p)


@cuda
def test_clip_unscale_and_grad_scaler_on_cuda():
    cpu = make_params((F32, BF16), [(7,), (33, 5)])
    gpu = _to(cpu, "cuda")
    set_grads([cpu], 0, scale=3.0)
    for p, q in zip(cpu, gpu):
        q.grad = p.grad.to("cuda")
    total_cpu = optim.NpuFusedSGD(cpu, lr=0.1).clip_grad_norm_fused_(1.0)
    total_gpu = optim.NpuFusedSGD(gpu, lr=0.1).clip_grad_norm_fused_(1.0)
    assert total_gpu.device.type == "cuda"
    torch.testing.assert_close(total_gpu.cpu(), total_cpu, rtol=1e-5, atol=0)
    found = torch.zeros(1, device="cuda")
    gpu[0].grad.view(-1)[0] = float("inf")
    ops._fused_unscale_grads_(gpu, found, torch.full((1,), 0.5, device="cuda"))
    assert found.device.type == "cuda" and found.item() == 1.0
    model = torch.nn.Linear(8, 4).cuda()
    opt = optim.NpuFusedAdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**8)
    for _ in range(3):
        loss = model(torch.randn(5, 8, device="cuda")).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert float(opt.state[model.weight]["step"]) == 3.0
