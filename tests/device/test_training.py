"""Training on npu: opennpu's fused ops and optimizers take npu tensors, and a model trained on npu
computes the very losses it computes on CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import opennpu


def copies() -> int:
    return torch.ops.opennpu._npu_copy_stats()[0]


def test_fused_ops_run_on_npu_tensors():
    x = torch.randn(4, 16)
    g = torch.randn(16)
    xn, gn = x.npu(), g.npu()
    before = copies()
    y, rstd = torch.ops.npu.npu_rms_norm(xn, gn)
    assert y.device.type == "npu" and rstd.device.type == "npu"
    assert copies() == before
    y_cpu, rstd_cpu = torch.ops.npu.npu_rms_norm(x, g)
    torch.testing.assert_close(y.cpu(), y_cpu, rtol=0, atol=0)
    torch.testing.assert_close(rstd.cpu(), rstd_cpu, rtol=0, atol=0)
    torch.testing.assert_close(torch.ops.npu.npu_swiglu(x.npu()).cpu(), torch.ops.npu.npu_swiglu(x),
                               rtol=0, atol=0)


def test_fused_op_autograd_on_npu():
    x = torch.randn(3, 8, requires_grad=True)
    g = torch.randn(8, requires_grad=True)
    xn = x.detach().npu().requires_grad_()
    gn = g.detach().npu().requires_grad_()
    opennpu.npu_rms_norm(x, g)[0].sum().backward()
    opennpu.npu_rms_norm(xn, gn)[0].sum().backward()
    assert xn.grad.device.type == "npu" and gn.grad.device.type == "npu"
    torch.testing.assert_close(xn.grad.cpu(), x.grad, rtol=0, atol=0)
    torch.testing.assert_close(gn.grad.cpu(), g.grad, rtol=0, atol=0)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(32),
                                 nn.Linear(32, 4))

    def forward(self, x):
        return self.net(x)


def train(device: str, optimizer_cls, steps: int = 20) -> list[float]:
    torch.manual_seed(0)
    model = MLP().to(device)
    optimizer = optimizer_cls(model.parameters())
    data = torch.Generator().manual_seed(1)
    teacher = torch.randn(16, 4, generator=data)  # a learnable target: the loss must fall
    losses = []
    for _ in range(steps):
        x_cpu = torch.randn(32, 16, generator=data)
        x, y = x_cpu.to(device), (x_cpu @ teacher).argmax(1).to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer_cls", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    lambda p: torch.optim.AdamW(p, lr=1e-2),
    lambda p: opennpu.optim.NpuFusedAdamW(p, lr=1e-2),
], ids=["SGD", "AdamW", "NpuFusedAdamW"])
def test_mlp_losses_on_npu_are_bit_identical_to_cpu(optimizer_cls):
    cpu = train("cpu", optimizer_cls)
    npu = train("npu", optimizer_cls)
    assert npu == cpu
    assert cpu[-1] < cpu[0]


def test_state_dict_moves_between_devices():
    model = MLP()
    moved = copy.deepcopy(model).npu()
    assert all(p.device.type == "npu" for p in moved.parameters())
    back = {k: v.cpu() for k, v in moved.state_dict().items()}
    for key, value in model.state_dict().items():
        torch.testing.assert_close(back[key], value, rtol=0, atol=0)


def test_conv_batchnorm_attention_match_cpu_bitwise():
    """Composites that pick kernels by device type (convolution, sdpa) take CPU's kernels on npu."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 8))
    moved = copy.deepcopy(model).npu()
    x = torch.randn(2, 3, 8, 8)
    out, out_npu = model(x), moved(x.npu())
    out.sum().backward()
    out_npu.sum().backward()
    assert out_npu.device.type == "npu"
    torch.testing.assert_close(out_npu.cpu(), out, rtol=0, atol=0)
    for p, q in zip(model.parameters(), moved.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=0, atol=0)
    torch.testing.assert_close(moved[1].running_var.cpu(), model[1].running_var, rtol=0, atol=0)
    q = torch.randn(1, 2, 5, 8)
    attention = nn.functional.scaled_dot_product_attention
    torch.testing.assert_close(attention(q.npu(), q.npu(), q.npu(), is_causal=True).cpu(),
                               attention(q, q, q, is_causal=True), rtol=0, atol=0)


def test_a_training_step_on_npu_copies_nothing():
    model = MLP().npu()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16).npu(), torch.randint(0, 4, (8,)).npu()
    for _ in range(2):  # the first step creates the optimizer state
        before = copies()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert copies() == before


def test_transformers_detects_npu_and_trains_llama_identically():
    """transformers' own Ascend detection finds the device, and a tiny LlamaForCausalLM trains on
    npu (SDPA attention, RMSNorm, rotary, AdamW) with losses bit-identical to CPU."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils import is_torch_npu_available

    assert is_torch_npu_available()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128, max_position_embeddings=32)
    cpu_model = transformers.LlamaForCausalLM(config)
    npu_model = copy.deepcopy(cpu_model).npu()
    ids = torch.randint(0, 128, (2, 16))

    def train(model, device):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(4):
            loss = model(input_ids=ids.to(device), labels=ids.to(device)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    cpu_losses, npu_losses = train(cpu_model, "cpu"), train(npu_model, "npu")
    assert npu_losses == cpu_losses and npu_losses[-1] < npu_losses[0]
    assert next(npu_model.parameters()).device.type == "npu"
