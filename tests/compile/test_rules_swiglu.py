"""The swiglu rule: silu(first half) * second half (chunk or slices) -> npu_swiglu; the silu_mul
rule: silu(gate) * up over two tensors (Llama's MLP) -> opennpu::_silu_mul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_helpers import count, grads, run_compiled
from opennpu.compile import CompilerConfig, get_npu_backend
from opennpu.testing import reference
from opennpu.testing.tolerances import assert_close


class SeedSwiGlu(nn.Module):
    """Seed 000's TorchSwiGlu."""

    def __init__(self, dim=-1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return reference.native_swiglu(x)  # the seed's _swiglu (chunk on -1, silu, mul)


class ChunkUpFirst(nn.Module):
    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return up * F.silu(gate)


class Sliced(nn.Module):
    def forward(self, x):
        n = x.shape[-1] // 2
        return F.silu(x[..., :n]) * x[..., n:]


class SlicedUpFirst(nn.Module):
    def forward(self, x):
        n = x.shape[-1] // 2
        return x[..., n:] * F.silu(x[..., :n])


class WrittenOutSiLU(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return a * torch.sigmoid(a) * b


class SlicedSigmoidFirst(nn.Module):
    def forward(self, x):
        n = x.shape[-1] // 2
        a = x[..., :n]
        return x[..., n:] * (torch.sigmoid(a) * a)


class FusedUpMLP(nn.Module):
    """An MLP whose up-projection gives [gate | up] in one linear (as ChatGLM's, Phi-3's)."""

    def __init__(self, h, i, dtype=torch.float32):
        super().__init__()
        self.up = nn.Linear(h, 2 * i, bias=False, dtype=dtype)
        self.down = nn.Linear(i, h, bias=False, dtype=dtype)

    def forward(self, x):
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaMLP(nn.Module):
    """transformers' LlamaMLP, its activation spelled `activation`."""

    SPELLINGS = {
        "silu_gate_up": lambda g, u: F.silu(g) * u,
        "up_silu_gate": lambda g, u: u * F.silu(g),
        "written_out": lambda g, u: g * torch.sigmoid(g) * u,
        "up_written_out": lambda g, u: u * (torch.sigmoid(g) * g),
    }

    def __init__(self, h, i, spelling="silu_gate_up", dtype=torch.float32):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)
        self.act = self.SPELLINGS[spelling]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


FORMS = [SeedSwiGlu, ChunkUpFirst, Sliced, SlicedUpFirst, WrittenOutSiLU, SlicedSigmoidFirst]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def silu_count(ops) -> int:
    # Inductor's decomposition table lowers silu to x / (1 + exp(-x)) in the counted graphs.
    return count(ops, "aten.silu") + count(ops, "aten.sigmoid") + count(ops, "aten.exp")


@pytest.mark.parametrize("form", FORMS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forms_fused_and_match_eager(form, dtype):
    module = form()
    x = torch.randn(3, 5, 22, dtype=dtype)
    before = run_compiled(module, x, fusion=False)
    after = run_compiled(module, x)
    assert silu_count(before.ops) >= 1 and count(before.ops, "npu_swiglu") == 0
    assert after.fusions == {"swiglu": 1}
    assert count(after.ops, "npu.npu_swiglu.") == 1 and silu_count(after.ops) == 0
    expected = module(x)
    assert after.outputs.dtype == expected.dtype and after.outputs.shape == (3, 5, 11)
    assert_close(after.outputs, expected, dtype=dtype)


@pytest.mark.parametrize("mlp, rule, backward_op", [
    (FusedUpMLP(12, 10), "swiglu", "npu_swiglu_backward"),
    (LlamaMLP(12, 10), "silu_mul", "_silu_mul_backward"),
], ids=["swiglu", "silu_mul"])
def test_mlp_backward_through_the_fused_backward(mlp, rule, backward_op):
    x = torch.randn(2, 3, 12, requires_grad=True)
    compiled = run_compiled(mlp, x, backward=True)
    (dx,) = grads(x)
    dw = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    expected = mlp(x)
    expected.float().square().sum().backward()
    assert compiled.fusions == {rule: 1}
    assert count(compiled.ops, backward_op) == 1
    assert_close(compiled.outputs, expected, dtype=torch.float32)
    assert_close(dx, x.grad, dtype=torch.float32)
    for got, p in zip(dw, mlp.parameters()):
        assert_close(got, p.grad, dtype=torch.float32, scale=4)


@pytest.mark.parametrize("form", [SeedSwiGlu, Sliced], ids=lambda c: c.__name__)
def test_dynamic_shapes_fuse_once_and_serve_new_shapes(form):
    module = form()
    config = CompilerConfig()
    config.debug.run_eagerly = True
    backend = get_npu_backend(compiler_config=config)
    compiled_fn = torch.compile(module, backend=backend, dynamic=True, fullgraph=True)
    for shape in [(3, 10), (5, 18), (2, 4, 6)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        assert_close(compiled_fn(x), module(x), dtype=torch.bfloat16)
    assert backend.fusions["swiglu"] >= 1
    assert sum(backend.fusions.values()) == backend.fusions["swiglu"]


class SwappedHalves(nn.Module):
    """silu of the SECOND half: npu_swiglu activates the first, so this must stay as it is."""

    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(b) * a


class SigmoidOfOtherHalf(nn.Module):
    """a * sigmoid(b) * b: a gate, but not SiLU of the first half."""

    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return a * torch.sigmoid(b) * b


class SplitFirstDim(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=0)
        return F.silu(a) * b


class ThirdsNotHalves(nn.Module):
    """x[..., :n] and x[..., n:2n] of a 3n-wide x: parts of one shape, not npu_swiglu's halves."""

    def forward(self, x):
        n = x.shape[-1] // 3
        return F.silu(x[..., :n]) * x[..., n:2 * n]


class OffsetSlices(nn.Module):
    def forward(self, x):
        return F.silu(x[..., 1:5]) * x[..., 5:9]


@pytest.mark.parametrize("module, shape", [
    (SwappedHalves(), (4, 8)), (ThirdsNotHalves(), (4, 12)), (OffsetSlices(), (4, 9)),
    (SigmoidOfOtherHalf(), (4, 8)),
], ids=["swapped", "thirds", "offset", "sigmoid-other-half"])
def test_other_splits_are_left_alone(module, shape):
    x = torch.randn(shape)
    compiled = run_compiled(module, x)
    assert not compiled.fusions and count(compiled.ops, "npu_") == 0
    torch.testing.assert_close(compiled.outputs, module(x))


def test_halves_of_the_first_dim_go_to_silu_mul():
    """chunk(2, dim=0) halves are contiguous tensors of one shape: not npu_swiglu's split, but
    silu(gate) * up all the same."""
    x = torch.randn(4, 8)
    compiled = run_compiled(SplitFirstDim(), x)
    assert compiled.fusions == {"silu_mul": 1} and count(compiled.ops, "npu_swiglu") == 0
    assert_close(compiled.outputs, SplitFirstDim()(x), dtype=torch.float32)


def test_float64_is_left_alone():
    x = torch.randn(4, 8, dtype=torch.float64)
    compiled = run_compiled(SeedSwiGlu(), x)
    assert not compiled.fusions


def test_rule_can_be_disabled_by_name():
    x = torch.randn(4, 8)
    compiled = run_compiled(SeedSwiGlu(), x, disabled=["swiglu"])
    assert not compiled.fusions and count(compiled.ops, "npu_swiglu") == 0


# --- silu_mul: silu(gate) * up over two tensors ------------------------------------------------


@pytest.mark.parametrize("spelling", list(LlamaMLP.SPELLINGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_mlp_fused_into_silu_mul(spelling, dtype):
    torch.manual_seed(0)
    mlp = LlamaMLP(12, 10, spelling, dtype)
    x = torch.randn(2, 3, 12, dtype=dtype)
    before = run_compiled(mlp, x, fusion=False)
    after = run_compiled(mlp, x)
    assert silu_count(before.ops) >= 1 and count(before.ops, "_silu_mul") == 0
    assert after.fusions == {"silu_mul": 1}
    assert count(after.ops, "opennpu._silu_mul.") == 1 and silu_count(after.ops) == 0
    expected = mlp(x)
    assert after.outputs.dtype == dtype
    assert_close(after.outputs, expected, dtype=dtype, scale=2)


def test_silu_mul_dynamic_shapes():
    mlp = LlamaMLP(8, 6, dtype=torch.bfloat16)
    config = CompilerConfig()
    config.debug.run_eagerly = True
    backend = get_npu_backend(compiler_config=config)
    compiled_fn = torch.compile(mlp, backend=backend, dynamic=True, fullgraph=True)
    for shape in [(3, 8), (5, 8), (2, 4, 8)]:
        x = torch.randn(shape, dtype=torch.bfloat16)
        assert_close(compiled_fn(x), mlp(x), dtype=torch.bfloat16, scale=2)
    assert backend.fusions["silu_mul"] >= 1
    assert sum(backend.fusions.values()) == backend.fusions["silu_mul"]


class GateUp(nn.Module):
    def forward(self, gate, up):
        return F.silu(gate) * up


@pytest.mark.parametrize("gate, up", [
    (torch.randn(4, 6), torch.randn(1, 6)),                      # up broadcast
    (torch.randn(1, 6), torch.randn(4, 6)),                      # gate broadcast
    (torch.randn(4, 6), torch.randn(4, 6, dtype=torch.bfloat16)),  # mixed dtypes (promotion)
    (torch.randn(6, 4).t(), torch.randn(4, 6)),                  # gate not contiguous
    (torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)),
], ids=["up-broadcast", "gate-broadcast", "mixed-dtypes", "transposed-gate", "float64"])
def test_silu_mul_left_alone(gate, up):
    compiled = run_compiled(GateUp(), gate, up)
    assert not compiled.fusions and count(compiled.ops, "_silu_mul") == 0
    torch.testing.assert_close(compiled.outputs, GateUp()(gate, up))


def test_silu_mul_can_be_disabled_by_name():
    x = torch.randn(2, 8)
    compiled = run_compiled(LlamaMLP(8, 6), x, disabled=["silu_mul"])
    assert not compiled.fusions and count(compiled.ops, "_silu_mul") == 0
