"""The rms_norm and add_rms_norm rules: native RMSNorm forms -> npu_rms_norm / npu_add_rms_norm."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion_helpers import count, grads, run_compiled
from opennpu.compile import CompilerConfig, get_npu_backend
from opennpu.testing.tolerances import assert_close


class HFRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm / Qwen2RMSNorm / MistralRMSNorm."""

    def __init__(self, h, eps=1e-6, dtype=torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(h, dtype=dtype) + 0.5)
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class SeedRMSNorm(nn.Module):
    """Seed 000's TorchRMSNorm."""

    def __init__(self, h, eps=1e-6, dtype=torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.rand(h, dtype=dtype) + 0.5)

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight


class PlainRMSNorm(SeedRMSNorm):
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Block(nn.Module):
    """Two residual adds each feeding a norm, as a decoder layer has them."""

    def __init__(self, norm_cls, h, dtype):
        super().__init__()
        self.n1, self.n2 = norm_cls(h, 1e-5, dtype), norm_cls(h, 1e-6, dtype)
        self.lin = nn.Linear(h, h, dtype=dtype)

    def forward(self, x, residual):
        x = x + residual
        y = self.n1(x)
        x = self.lin(y) + x
        return self.n2(x), x


NORMS = [HFRMSNorm, SeedRMSNorm, PlainRMSNorm]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("norm_cls", NORMS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_fused_and_matches_eager(norm_cls, dtype):
    module = norm_cls(24, dtype=dtype)
    x = torch.randn(3, 5, 24, dtype=dtype)
    before = run_compiled(module, x, fusion=False)
    after = run_compiled(module, x)
    assert count(before.ops, "rsqrt") == 1 and count(before.ops, "npu_rms_norm") == 0
    assert after.fusions["rms_norm"] == 1
    assert count(after.ops, "npu.npu_rms_norm.") == 1 and count(after.ops, "rsqrt") == 0
    assert after.outputs.dtype == module(x).dtype
    assert_close(after.outputs, module(x), dtype=dtype)


@pytest.mark.parametrize("norm_cls", NORMS, ids=lambda c: c.__name__)
def test_residual_add_and_norm_become_add_rms_norm_with_gradients(norm_cls):
    block = Block(norm_cls, 16, torch.float32)
    x = torch.randn(2, 3, 16, requires_grad=True)
    residual = torch.randn(2, 3, 16, requires_grad=True)
    compiled = run_compiled(block, x, residual, backward=True)
    dx, dr = grads(x, residual)
    dw = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    expected = block(x, residual)
    expected[0].float().square().sum().backward()
    # the second sum goes into the projection's output (not saved for backward: addmm saves its
    # inputs), tests/compile/test_rules_add_rms_norm_inplace.py
    assert compiled.fusions == {"rms_norm": 2, "add_rms_norm": 2, "add_rms_norm_inplace": 1}
    assert count(compiled.ops, "npu_add_rms_norm.") == 1
    assert count(compiled.ops, "_add_rms_norm_inplace.") == 1
    assert count(compiled.ops, "npu_rms_norm_backward") == 2   # the fused op's own backward
    for got, want in zip(compiled.outputs, expected):
        assert_close(got, want, dtype=torch.float32)
    assert_close(dx, x.grad, dtype=torch.float32)
    assert_close(dr, residual.grad, dtype=torch.float32)
    for got, p in zip(dw, block.parameters()):
        assert_close(got, p.grad, dtype=torch.float32)


def test_dynamic_shapes_fuse_once_and_serve_new_shapes():
    block = Block(HFRMSNorm, 16, torch.bfloat16)
    config = CompilerConfig()
    config.debug.run_eagerly = True
    backend = get_npu_backend(compiler_config=config)
    compiled_fn = torch.compile(block, backend=backend, dynamic=True, fullgraph=True)
    for shape in [(2, 3, 16), (5, 7, 16), (4, 2, 16)]:  # (sizes 0 and 1 would specialise)
        x, r = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
        for got, want in zip(compiled_fn(x, r), block(x, r)):
            assert_close(got, want, dtype=torch.bfloat16)
    # one compile
    assert backend.fusions == {"rms_norm": 2, "add_rms_norm": 2, "add_rms_norm_inplace": 1}


def test_mixed_dtype_weight_is_left_alone():
    """An fp32 weight times a bf16 activation promotes to fp32; npu_rms_norm would keep bf16."""
    module = HFRMSNorm(16, dtype=torch.float32)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    compiled = run_compiled(module, x)
    assert compiled.fusions["rms_norm"] == 0
    assert compiled.outputs.dtype == torch.float32
    torch.testing.assert_close(compiled.outputs, module(x))


def test_broadcast_residual_is_not_fused_into_add_rms_norm():
    block = Block(HFRMSNorm, 16, torch.float32)
    x, residual = torch.randn(2, 3, 16), torch.randn(16)    # residual broadcast over rows
    compiled = run_compiled(block, x, residual)
    assert compiled.fusions["add_rms_norm"] == 1             # only the second, same-shape add
    for got, want in zip(compiled.outputs, block(x, residual)):
        assert_close(got, want, dtype=torch.float32)


def test_rules_can_be_disabled_by_name():
    block = Block(HFRMSNorm, 16, torch.float32)
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    only_norm = run_compiled(block, x, r, disabled=["add_rms_norm"])
    assert only_norm.fusions == {"rms_norm": 2}
    assert count(only_norm.ops, "npu_add_rms_norm") == 0
    none = run_compiled(block, x, r, disabled=["add_rms_norm", "rms_norm"])
    assert not none.fusions and count(none.ops, "npu_") == 0


class TensorEpsRMSNorm(HFRMSNorm):
    """eps as a buffer: `variance + eps` adds a tensor, which npu_rms_norm's float cannot take."""

    def __init__(self, h):
        super().__init__(h)
        self.register_buffer("eps", torch.tensor(1e-6))

    def forward(self, hidden_states):
        h = hidden_states.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(hidden_states.dtype)


def test_tensor_epsilon_is_left_alone():
    module = TensorEpsRMSNorm(16)
    x = torch.randn(4, 16)
    compiled = run_compiled(module, x)           # used to fail tracing the replacement
    assert not compiled.fusions and count(compiled.ops, "npu_") == 0
    torch.testing.assert_close(compiled.outputs, module(x))


def test_speed_gate(monkeypatch):
    """Inference graphs keep norms over fewer than INFERENCE_MIN_TOKENS rows native (the fused
    op's fixed cost per call outweighs its gain there); training graphs fuse at any size."""
    from opennpu.compile.rules import _util

    monkeypatch.setattr(_util, "INFERENCE_MIN_TOKENS", 512)
    module = Block(HFRMSNorm, 8, torch.float32)
    few = (torch.randn(1, 16, 8), torch.randn(1, 16, 8))
    many = (torch.randn(2, 256, 8), torch.randn(2, 256, 8))
    fused = {"rms_norm": 2, "add_rms_norm": 2, "add_rms_norm_inplace": 1}
    with torch.no_grad():
        assert not run_compiled(module, *few).fusions
        assert run_compiled(module, *many).fusions == fused
    assert run_compiled(module, *few).fusions == fused
