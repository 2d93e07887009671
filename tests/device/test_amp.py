"""AMP on npu: torch.autocast("npu") with CUDA's op lists, GradScaler on npu tensors,
custom_fwd / custom_bwd, and Ascend's apex (amp.initialize / scale_loss) through the import hook."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import opennpu

REDUCED = (torch.float16, torch.bfloat16)
ids = lambda d: str(d).removeprefix("torch.")  # noqa: E731


def autocast_ops(key: str) -> set[str]:
    return {op for op in torch._C._dispatch_get_all_op_names()
            if torch._C._dispatch_has_kernel_for_dispatch_key(op, key)}


def test_npu_autocast_has_cuda_op_lists():
    cudnn_only = {"aten::cudnn_convolution", "aten::cudnn_convolution_transpose", "aten::_cudnn_rnn"}
    cuda = autocast_ops("AutocastCUDA")
    assert {"aten::mm", "aten::softmax.int", "aten::addcmul"} <= cuda
    assert autocast_ops("AutocastPrivateUse1") == cuda - cudnn_only


def npu_autocast(kind: str, dtype: torch.dtype):
    if kind == "torch.autocast":
        return torch.autocast("npu", dtype=dtype)
    return torch.npu.amp.autocast(dtype=dtype)


@pytest.fixture(params=["torch.autocast", "torch.npu.amp.autocast"])
def kind(request) -> str:
    return request.param


def same(npu_result: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-identical to the CPU computation with explicit casts (npu runs the CPU kernels)."""
    assert npu_result.device.type == "npu"
    assert npu_result.dtype == expected.dtype
    torch.testing.assert_close(npu_result.cpu(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", REDUCED, ids=ids)
def test_lower_precision_ops_run_in_the_autocast_dtype(kind, dtype):
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    bias = torch.randn(4)
    x3, y3 = torch.randn(2, 8, 16), torch.randn(2, 16, 4)
    n = lambda t: t.npu()  # noqa: E731
    lo = lambda t: t.to(dtype)  # noqa: E731
    with npu_autocast(kind, dtype):
        assert torch.npu.is_autocast_enabled()
        same(n(a) @ n(b), lo(a) @ lo(b))
        same(torch.mm(n(a), n(b)), torch.mm(lo(a), lo(b)))
        same(F.linear(n(a), n(b).t(), n(bias)), F.linear(lo(a), lo(b).t(), lo(bias)))
        same(torch.addmm(n(bias), n(a), n(b)), torch.addmm(lo(bias), lo(a), lo(b)))
        same(torch.bmm(n(x3), n(y3)), torch.bmm(lo(x3), lo(y3)))
        same(torch.baddbmm(n(torch.zeros(2, 8, 4)), n(x3), n(y3)),
             torch.baddbmm(lo(torch.zeros(2, 8, 4)), lo(x3), lo(y3)))
        # Outside the lists: fp32 in, fp32 out, and CPU tensors are left alone.
        assert (n(a) + n(a)).dtype == torch.float32
        assert (a @ b).dtype == torch.float32
    assert not torch.npu.is_autocast_enabled()
    assert (n(a) @ n(b)).dtype == torch.float32


@pytest.mark.parametrize("dtype", REDUCED, ids=ids)
def test_fp32_ops_run_in_float32(kind, dtype):
    x = torch.randn(6, 10).to(dtype)
    target = torch.randint(0, 10, (6,))
    w, b = torch.randn(10).to(dtype), torch.randn(10).to(dtype)
    with npu_autocast(kind, dtype):
        same(torch.softmax(x.npu(), -1), torch.softmax(x.float(), -1))
        same(F.log_softmax(x.npu(), -1), F.log_softmax(x.float(), -1))
        same(F.layer_norm(x.npu(), (10,), w.npu(), b.npu()),
             F.layer_norm(x.float(), (10,), w.float(), b.float()))
        same(F.mse_loss(x.npu(), x.npu().flip(0)), F.mse_loss(x.float(), x.float().flip(0)))
        # cross_entropy passes log_softmax its input's dtype explicitly, which autocast keeps
        # (as on CUDA); nll_loss then runs in float32.
        same(F.cross_entropy(x.npu(), target.npu()),
             F.nll_loss(F.log_softmax(x, -1, dtype=dtype).float(), target))
        same(torch.exp(x.npu()), torch.exp(x.float()))
        same(x.npu().sum(), x.float().sum())


@pytest.mark.parametrize("dtype", REDUCED, ids=ids)
def test_multi_input_ops_promote(kind, dtype):
    full, low = torch.randn(3, 4), torch.randn(3, 4).to(dtype)
    with npu_autocast(kind, dtype):
        same(torch.cat([full.npu(), low.npu()]), torch.cat([full, low.float()]))
        same(torch.stack([low.npu(), full.npu()]), torch.stack([low.float(), full]))
        same(torch.addcmul(full.npu(), low.npu(), low.npu(), value=0.5),
             torch.addcmul(full, low.float(), low.float(), value=0.5))
        # All inputs in the autocast dtype: nothing to widen.
        assert torch.addcmul(low.npu(), low.npu(), low.npu()).dtype == dtype


def test_autocast_backward_gives_float32_gradients():
    w = torch.randn(16, 4, device="npu", requires_grad=True)
    x = torch.randn(8, 16, device="npu")
    with torch.autocast("npu"):
        out = x @ w
        loss = out.float().pow(2).mean()
    assert out.dtype == torch.float16
    loss.backward()
    assert w.grad.dtype == torch.float32 and w.grad.device.type == "npu"
    w_cpu = w.detach().cpu().requires_grad_()
    (x.cpu().half() @ w_cpu.half()).float().pow(2).mean().backward()
    torch.testing.assert_close(w.grad.cpu(), w_cpu.grad, rtol=0, atol=0)


def test_autocast_dtype_settings_and_errors():
    assert torch.npu.get_amp_supported_dtype() == [torch.float16, torch.bfloat16]
    assert torch.npu.get_autocast_dtype() == torch.float16  # torch_npu's default
    with torch.npu.amp.autocast():
        assert (torch.ones(2, 2, device="npu") @ torch.ones(2, 2, device="npu")).dtype == torch.float16
    with pytest.raises(ValueError, match="set_autocast_dtype"):
        torch.npu.set_autocast_dtype(torch.float64)
    torch.npu.set_autocast_dtype(torch.bfloat16)
    try:
        with torch.autocast("npu"):
            assert torch.mm(torch.ones(2, 2, device="npu"),
                            torch.ones(2, 2, device="npu")).dtype == torch.bfloat16
    finally:
        torch.npu.set_autocast_dtype(torch.float16)
    p = torch.rand(4, device="npu")
    with torch.autocast("npu"), pytest.raises(RuntimeError, match="unsafe to autocast on npu"):
        F.binary_cross_entropy(p, p)
    F.binary_cross_entropy(p, p)  # fine outside autocast


class _ScaledMM(torch.autograd.Function):
    """A custom op in the style of torch_npu's tutorials."""

    @staticmethod
    @torch.npu.amp.custom_fwd
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.forward_autocast = torch.npu.is_autocast_enabled()
        return a @ b

    @staticmethod
    @torch.npu.amp.custom_bwd
    def backward(ctx, grad):
        ctx.backward_autocast = torch.npu.is_autocast_enabled()
        _ScaledMM.seen_backward_autocast = ctx.backward_autocast
        a, b = ctx.saved_tensors
        return grad @ b.t().to(grad.dtype), a.t().to(grad.dtype) @ grad


class _Float32MM(torch.autograd.Function):
    @staticmethod
    @torch.npu.amp.custom_fwd(cast_inputs=torch.float32)
    def forward(ctx, a, b):
        _Float32MM.seen = (a.dtype, b.dtype, torch.npu.is_autocast_enabled())
        return a @ b

    @staticmethod
    @torch.npu.amp.custom_bwd
    def backward(ctx, grad):
        return grad, grad


def test_custom_fwd_and_custom_bwd():
    a = torch.randn(4, 8, device="npu", requires_grad=True)
    b = torch.randn(8, 3, device="npu", requires_grad=True)
    with torch.npu.amp.autocast():
        out = _ScaledMM.apply(a, b)
    assert out.dtype == torch.float16  # the forward ran under the caller's autocast
    out.float().sum().backward()
    assert _ScaledMM.seen_backward_autocast is True  # custom_bwd restores the forward's state
    with torch.npu.amp.autocast():
        out = _Float32MM.apply(a.half(), b.half())
    assert _Float32MM.seen == (torch.float32, torch.float32, False)
    assert out.dtype == torch.float32
    _Float32MM.apply(a.half(), b.half())  # outside autocast: no cast
    assert _Float32MM.seen == (torch.float16, torch.float16, False)


# --------------------------------------------------------------------------------------------
# GradScaler


SCALERS = {
    "torch.amp.GradScaler": lambda **kw: torch.amp.GradScaler("npu", **kw),
    "torch.npu.amp.GradScaler": lambda **kw: torch.npu.amp.GradScaler(**kw),
}
OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "NpuFusedAdamW": lambda p: opennpu.optim.NpuFusedAdamW(p, lr=0.1),
}


@pytest.mark.parametrize("scaler", SCALERS, ids=str)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=str)
def test_grad_scaler_skips_inf_step_and_halves_scale(scaler, optimizer):
    model = nn.Linear(4, 2).npu()
    opt = OPTIMIZERS[optimizer](model.parameters())
    s = SCALERS[scaler](init_scale=8.0, growth_interval=1)
    x = torch.randn(3, 4, device="npu")
    before = [p.detach().cpu().clone() for p in model.parameters()]
    s.scale(model(x).sum()).backward()
    assert s._scale.device.type == "npu"
    model.weight.grad[0, 1] = float("inf")
    s.step(opt)
    s.update()
    assert s.get_scale() == 4.0
    assert all(torch.equal(p.detach().cpu(), q) for p, q in zip(model.parameters(), before))
    opt.zero_grad()
    with torch.npu.amp.autocast():
        loss = model(x).float().sum()
    s.scale(loss).backward()
    s.unscale_(opt)  # the gradients are the unscaled ones
    expected = x.cpu().sum(0)
    torch.testing.assert_close(model.weight.grad.cpu(), torch.stack([expected, expected]),
                               rtol=1e-3, atol=1e-3)
    s.step(opt)
    s.update()
    assert s.get_scale() == 8.0  # a finite step with growth_interval=1 doubles it
    assert not torch.equal(model.weight.detach().cpu(), before[0])


def test_grad_scaler_names_and_argument_orders():
    import torch_npu

    assert opennpu.optim.GradScaler is torch.npu.amp.GradScaler is torch_npu.npu.amp.GradScaler
    s = torch.npu.amp.GradScaler(8.0, 4.0, 0.25, 1, False, True)  # torch_npu's order
    assert s._device == "npu" and not s.is_dynamic() and s.get_growth_factor() == 4.0
    s = opennpu.optim.GradScaler("cpu", 8.0, 4.0, 0.25, 1, True, dynamic=False)  # torch.amp's
    assert s._device == "cpu" and not s.is_dynamic() and s.get_backoff_factor() == 0.25
    with pytest.raises(TypeError, match="GradScaler"):
        torch.npu.amp.GradScaler(8.0, bogus=1)


def test_fp16_training_loop_on_npu():
    """Seed 001's loop: torch.autocast("npu") + torch.npu.amp.GradScaler on an npu model."""
    torch.manual_seed(0)
    device = torch.device("npu:0")
    torch.npu.set_device(device)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.LayerNorm(64), nn.Linear(64, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.npu.amp.GradScaler()
    data = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=data)
    losses = []
    for _ in range(30):
        x = torch.randn(64, 16, generator=data)
        y = (x @ teacher).argmax(1)
        x, y = x.to(device), y.to(device)
        with torch.autocast(device_type="npu", dtype=torch.float16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        assert logits.dtype == torch.float16 and loss.dtype == torch.float32
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    torch.npu.synchronize()
    assert all(p.dtype == torch.float32 and p.device.type == "npu" for p in model.parameters())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5


# --------------------------------------------------------------------------------------------
# apex (Ascend's fork)


def _apex_train(opt_level, steps=30, **kwargs):
    from apex import amp
    from apex.optimizers import NpuFusedAdamW

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.BatchNorm1d(32), nn.Linear(32, 1)).npu()
    opt = NpuFusedAdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, combine_grad=True, **kwargs)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=data).npu()
    y = x.sum(1, keepdim=True)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        out = model(x)
        loss = F.mse_loss(out.float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, out, losses


def test_apex_is_opennpus_when_no_apex_is_installed():
    import apex
    from apex import amp
    from apex.optimizers import NpuFusedAdamW, NpuFusedSGD

    assert apex.IS_OPENNPU and amp.initialize
    assert NpuFusedAdamW is opennpu.optim.NpuFusedAdamW and NpuFusedSGD is opennpu.optim.NpuFusedSGD


def test_apex_o1_trains_under_npu_autocast():
    model, opt, out, losses = _apex_train("O1")
    assert out.dtype == torch.float16  # the last Linear ran under autocast
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert losses[-1] < 0.2 * losses[0]


def test_apex_o2_trains_fp16_model_on_fp32_master_weights():
    from apex import amp

    model, opt, out, losses = _apex_train("O2")
    assert out.dtype == torch.float32  # apex casts O2 outputs back to float32
    assert model[0].weight.dtype == torch.float16 and model[2].weight.dtype == torch.float32
    masters = list(amp.master_params(opt))
    assert all(p.dtype == torch.float32 and p.device.type == "npu" for p in masters)
    assert masters[0] is not model[0].weight  # the optimizer steps the master copy ...
    torch.testing.assert_close(model[0].weight.cpu(), masters[0].detach().half().cpu(),
                               rtol=0, atol=0)  # ... and the model gets its fp16 rounding
    assert losses[-1] < 0.2 * losses[0]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_apex_overflow_skips_step_and_halves_dynamic_scale(opt_level):
    from apex import amp

    model = nn.Linear(4, 2).npu()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic")
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16
    x = torch.randn(3, 4, device="npu")
    loss_fn = lambda: model(x).float().sum() * 1e-3  # noqa: E731  (* 2**16 stays finite in fp16)
    before = model.weight.detach().cpu().clone()
    with amp.scale_loss(loss_fn(), opt) as scaled:
        scaled.backward()
        model.weight.grad[0, 0] = float("inf")  # after backward, before the unscale on exit
    opt.step()
    assert torch.equal(model.weight.detach().cpu(), before)
    state = amp.state_dict()
    assert state["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}
    opt.zero_grad()
    assert model.weight.grad is None
    with amp.scale_loss(loss_fn(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert not torch.equal(model.weight.detach().cpu(), before)
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 1}
    amp.load_state_dict(state)
    assert amp.state_dict() == state
    with pytest.raises(ValueError, match="num_losses"):
        amp.load_state_dict({"loss_scaler0": state["loss_scaler0"], "loss_scaler1": {}})


def test_apex_static_loss_scale_divides_and_never_skips():
    from apex import amp

    model = nn.Linear(4, 1, bias=False).npu()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale=128.0)
    x = torch.randn(5, 4, device="npu")
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        assert scaled.item() == pytest.approx(128.0 * model(x).float().sum().item(), rel=1e-3)
        scaled.backward()
    torch.testing.assert_close(model.weight.grad.cpu(), x.cpu().sum(0, keepdim=True),
                               rtol=1e-3, atol=1e-3)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0


def test_apex_initialize_errors():
    from apex import amp

    model = nn.Linear(2, 2).npu()
    with pytest.raises(ValueError, match="opt_level"):
        amp.initialize(model, opt_level="02")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2, device="npu")).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="before the first optimizer.step"):
        amp.initialize(model, opt, opt_level="O1")


def test_real_apex_wins(tmp_path):
    fake = tmp_path / "apex"
    fake.mkdir()
    (fake / "__init__.py").write_text("REAL = True\n")
    script = textwrap.dedent(
        """
        import apex
        assert getattr(apex, "REAL", False), apex
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True,
                            text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _two_models_one_overflowing(scaler_cls):
    """Two models, each with its own optimizer; only model 0's gradients overflow."""
    torch.manual_seed(0)
    models = [nn.Linear(4, 4).to("npu") for _ in range(2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    before = [[p.detach().clone() for p in m.parameters()] for m in models]
    scaler = scaler_cls(init_scale=8.0)
    x = torch.randn(2, 4, device="npu")
    scaler.scale(sum(m(x).sum() for m in models)).backward()
    models[0].weight.grad.fill_(float("inf"))
    for opt in optimizers:
        scaler.step(opt)
    scaler.update()
    moved = [any(not torch.equal(p, b) for p, b in zip(m.parameters(), bs))
             for m, bs in zip(models, before)]
    return moved, scaler.get_scale()


def test_torch_npu_grad_scaler_overflow_skips_every_later_step_of_the_iteration():
    from torch_npu.npu.amp import GradScaler

    moved, scale = _two_models_one_overflowing(GradScaler)
    assert moved == [False, False] and scale == 4.0
    # torch.amp.GradScaler decides per optimizer: model 1's finite step is taken.
    moved, scale = _two_models_one_overflowing(
        lambda **kw: torch.amp.GradScaler("npu", **kw))
    assert moved == [False, True] and scale == 4.0


def test_torch_npu_grad_scaler_overflow_flag_resets_at_update():
    from torch_npu.npu.amp import GradScaler

    model = nn.Linear(3, 1).to("npu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=4.0)
    x = torch.ones(1, 3, device="npu")
    scaler.scale(model(x).sum()).backward()
    model.weight.grad.fill_(float("nan"))
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    w = model.weight.detach().clone()
    scaler.scale(model(x).sum()).backward()
    scaler.step(opt)  # finite gradients in the next iteration: the step is taken
    scaler.update()
    assert not torch.equal(model.weight, w)


@pytest.mark.parametrize("dynamic", [True, False])
def test_torch_npu_grad_scaler_unscales_fused_optimizer_grads_in_place(dynamic):
    from torch_npu.npu.amp import GradScaler
    from torch_npu.optim import NpuFusedSGD

    def train(opt_cls):
        torch.manual_seed(0)
        model = nn.Linear(4, 2).to("npu")
        opt = opt_cls(model.parameters(), lr=0.1, momentum=0.9)
        scaler = GradScaler(init_scale=128.0, dynamic=dynamic)
        grads = []
        for _ in range(3):  # no zero_grad: gradients accumulate across steps
            scaler.scale(model(torch.ones(2, 4, device="npu")).pow(2).sum()).backward()
            scaler.step(opt)
            scaler.update()
            grads.append(model.weight.grad.clone())
        return grads, model.weight.detach()

    ref_grads, ref_weight = train(torch.optim.SGD)
    fused_grads, fused_weight = train(NpuFusedSGD)
    for r, f in zip(ref_grads, fused_grads):
        torch.testing.assert_close(f, r)  # unscaled, as the plain optimizer's are
    torch.testing.assert_close(fused_weight, ref_weight)
