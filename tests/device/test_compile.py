"""torch.compile on npu tensors: Inductor's C++ kernels run on npu memory (the default backend) and
opennpu's backend fuses npu graphs as it fuses CPU ones; fullgraph, dynamic shapes and training,
with CPU's results (src/opennpu/npu/_inductor.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import torch._dynamo.testing
import torch._inductor.config as inductor_config
from torch import nn
from torch._inductor.utils import run_and_get_code

from opennpu.compile import CompilerConfig, get_npu_backend


def copies() -> int:
    return torch.ops.opennpu._npu_copy_stats()[0]


def kernels(codes: list[str]) -> list[str]:
    """The C++ kernels in Inductor's output code (each kernel's argument types and source)."""
    return [k for code in codes for k in re.findall(r"cpp_pybinding\((.*?)'''\)", code, re.S)]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, in plain PyTorch."""

    def __init__(self, h, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(h) + 0.5)
        self.eps = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class Block(nn.Module):
    """A pre-norm decoder layer: RMSNorm, causal attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, d=16):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d, bias=False)
        self.gate, self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).chunk(3, -1)
        x = x + self.o(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def test_registration_is_lazy():
    """import opennpu does not import Inductor; Inductor's first use registers npu."""
    code = ("import sys, torch, opennpu; assert 'torch._inductor' not in sys.modules; "
            "from torch._inductor.codegen.common import init_backend_registration, "
            "get_scheduling_for_device, get_wrapper_codegen_for_device; "
            "init_backend_registration(); "
            "print(get_scheduling_for_device('npu').__name__, "
            "get_wrapper_codegen_for_device('npu').__name__); "
            "from torch._dynamo.device_interface import get_interface_for_device; "
            "print(get_interface_for_device('npu:1').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["NpuScheduling", "NpuPythonWrapperCodegen", "NpuInterface"]


def _fused_cases():
    x = torch.randn(33, 33) * 100
    return [
        (lambda x: x / 3.7 + x.t().sin(), (x,)),                  # division by a constant
        (lambda x: torch.softmax(x.t(), -1) + torch.softmax(x, 0), (x,)),  # reused exp
        (lambda x, w: nn.functional.layer_norm(x, (33,), w) * 2, (x, torch.randn(33))),
    ]


@pytest.mark.parametrize("case", range(3))
def test_default_backend_runs_cpus_kernels_on_npu(case):
    """fullgraph: Inductor writes npu the C++ kernels it writes the CPU, and they compute CPU's
    bits on npu memory; the outputs are npu tensors, and a call makes no copy."""
    fn, args = _fused_cases()[case]
    with inductor_config.patch(fx_graph_cache=False):
        expected, cpu_codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
        torch._dynamo.reset()
        npu_args = [a.npu() for a in args]
        compiled = torch.compile(fn, fullgraph=True)
        out, npu_codes = run_and_get_code(compiled, *npu_args)
    assert kernels(npu_codes) == kernels(cpu_codes) != []
    assert "device='npu:0'" in npu_codes[0]
    assert out.device == torch.device("npu:0")
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(out.cpu(), fn(*args), rtol=1e-5, atol=1e-5)
    before = copies()
    compiled(*npu_args)
    assert copies() == before


def test_device_index_and_cpu_scalar_kept():
    """A graph on npu:1 allocates its buffers on npu:1 (counted there) and reads a 0-dim CPU
    tensor in place, with no copy."""
    def fn(x, scale):
        return (x * scale).sin() + x.sum(-1, keepdim=True)

    x, scale = torch.randn(8, 16, device="npu:1"), torch.tensor(2.5)
    compiled = torch.compile(fn, fullgraph=True)
    compiled(x, scale)
    before, allocated = copies(), torch.npu.memory_allocated(1)
    out = compiled(x, scale)
    assert copies() == before
    assert out.device == torch.device("npu:1")
    assert torch.npu.memory_allocated(1) > allocated
    torch.testing.assert_close(out.cpu(), fn(x.cpu(), scale), rtol=1e-6, atol=1e-6)


def test_random_ops_draw_cpus_numbers():
    """Compiled dropout and rand_like on npu draw from the npu generator what the CPU's draws."""
    def fn(x):
        return nn.functional.dropout(x, 0.5, training=True) * torch.rand_like(x)

    torch.manual_seed(3)
    expected = torch.compile(fn)(torch.ones(32, 32))
    torch._dynamo.reset()
    torch.manual_seed(3)
    out = torch.compile(fn)(torch.ones(32, 32, device="npu"))
    assert out.device.type == "npu"
    assert 0.3 < (out == 0).float().mean().item() < 0.7
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)


def _opennpu_backend():
    config = CompilerConfig()
    config.experimental_config.pattern_fusion_pass = True
    return get_npu_backend(compiler_config=config)


def _train(device, backend, dynamic, lengths):
    """SGD steps on Block, compiled: the losses, the gradients of each step and the parameters
    after the steps."""
    torch.manual_seed(0)
    model = Block().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=True)
    losses, grads = [], []
    for length in lengths:
        x = torch.randn(2, length, 16).to(device)
        out = compiled(x)
        assert out.device == x.device
        loss = out.square().mean()
        loss.backward()
        grads += [p.grad.cpu() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("backend, dynamic", [("inductor", False), ("opennpu", True)])
def test_training_step_equals_cpu(backend, dynamic):
    """Forward, backward and optimizer step of a compiled decoder layer on npu give the losses,
    gradients and parameters of the same compile on CPU, and eager CPU training's within
    rounding; with dynamic=True a second sequence length reuses the graph."""
    lengths = (8, 12) if dynamic else (8, 8)
    make = _opennpu_backend if backend == "opennpu" else lambda: "inductor"
    cpu = _train("cpu", make(), dynamic, lengths)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend(make())
    npu = _train("npu", counter, dynamic, lengths)
    assert counter.frame_count == 1
    assert npu[0] == cpu[0]
    torch.testing.assert_close(npu[1:], cpu[1:], rtol=0, atol=0)
    eager = _train("cpu", "eager", dynamic, lengths)
    torch.testing.assert_close(npu[0], eager[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(npu[1:], eager[1:], rtol=1e-4, atol=1e-5)


def test_opennpu_backend_fuses_npu_graphs_as_cpu_ones():
    """The fusion rules fire on an npu graph as on the CPU one (Llama's RMSNorm -> rms_norm,
    the SwiGLU MLP -> silu_mul), and Inductor compiles the fused graph on npu."""
    model = Block()
    x = torch.randn(2, 8, 16)
    fusions = {}
    outputs = {}
    for device in ("cpu", "npu"):
        torch._dynamo.reset()
        backend = _opennpu_backend()
        module = model.to(device)
        outputs[device] = torch.compile(module, backend=backend, fullgraph=True)(x.to(device))
        fusions[device] = dict(backend.fusions)
    assert fusions["npu"] == fusions["cpu"]
    assert fusions["npu"].get("rms_norm") == 2 and fusions["npu"].get("silu_mul") == 1
    assert outputs["npu"].device.type == "npu"
    torch.testing.assert_close(outputs["npu"].cpu(), outputs["cpu"], rtol=0, atol=0)


def test_cpp_wrapper_is_refused_with_a_clear_error():
    with inductor_config.patch(cpp_wrapper=True), pytest.raises(Exception, match="not supported on npu"):
        torch.compile(lambda x: x.sin() + 1)(torch.randn(4, device="npu"))
