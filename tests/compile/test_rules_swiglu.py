"""The swiglu rule: silu(first half) * second half (chunk or slices) -> npu_swiglu."""

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


def test_mlp_backward_through_npu_swiglu_backward():
    mlp = FusedUpMLP(12, 10)
    x = torch.randn(2, 3, 12, requires_grad=True)
    compiled = run_compiled(mlp, x, backward=True)
    (dx,) = grads(x)
    dw = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    expected = mlp(x)
    expected.float().square().sum().backward()
    assert compiled.fusions == {"swiglu": 1}
    assert count(compiled.ops, "npu_swiglu_backward") == 1
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


class LlamaMLP(nn.Module):
    """transformers' LlamaMLP: two linears, deliberately not fused (see rules/swiglu.py)."""

    def __init__(self, h, i):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("module, shape", [
    (SwappedHalves(), (4, 8)), (SplitFirstDim(), (4, 8)), (ThirdsNotHalves(), (4, 12)),
    (OffsetSlices(), (4, 9)), (LlamaMLP(8, 6), (4, 8)), (SigmoidOfOtherHalf(), (4, 8)),
], ids=["swapped", "first-dim", "thirds", "offset", "llama-mlp", "sigmoid-other-half"])
def test_other_splits_are_left_alone(module, shape):
    x = torch.randn(shape)
    compiled = run_compiled(module, x)
    assert not compiled.fusions and count(compiled.ops, "npu_") == 0
    torch.testing.assert_close(compiled.outputs, module(x))


def test_float64_is_left_alone():
    x = torch.randn(4, 8, dtype=torch.float64)
    compiled = run_compiled(SeedSwiGlu(), x)
    assert not compiled.fusions


def test_rule_can_be_disabled_by_name():
    x = torch.randn(4, 8)
    compiled = run_compiled(SeedSwiGlu(), x, disabled=["swiglu"])
    assert not compiled.fusions and count(compiled.ops, "npu_swiglu") == 0
