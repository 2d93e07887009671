"""The rotary rule: x * cos + cat(-x2, x1) * sin (seed 000/004, rotate_half) -> npu_rotary_mul."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion_helpers import count, grads, run_compiled
from opennpu.compile import CompilerConfig, get_npu_backend
from opennpu.testing.tolerances import assert_close


class SeedRotary(nn.Module):
    """Seed 000's torch_func (slices), or its commented-out chunk spelling."""

    def __init__(self, chunk=False):
        super().__init__()
        self.chunk = chunk

    def forward(self, x, r1, r2):
        if self.chunk:
            x1, x2 = torch.chunk(x, 2, -1)
        else:
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        x_new = torch.cat((-x2, x1), dim=-1)
        return r1 * x + r2 * x_new


def rotate_half(x):
    """transformers' rotate_half (Llama, Qwen2, Mistral)."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class HFRotary(nn.Module):
    """transformers' apply_rotary_pos_emb, q and k in BNSD with [B, S, D] cos / sin."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return torch.cat((q_embed, k_embed), dim=1)   # one output, so the loss covers both


class SinFirst(nn.Module):
    def forward(self, x, r1, r2):
        return rotate_half(x) * r2 + x * r1


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("module", [SeedRotary(), SeedRotary(chunk=True), SinFirst()],
                         ids=["seed-slices", "seed-chunk", "sin-first"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_seed_forms_fused_and_match_eager(module, dtype):
    x = torch.randn(2, 6, 3, 16, dtype=dtype)                     # BSND with 1S1D cos / sin
    r1, r2 = torch.randn(1, 6, 1, 16, dtype=dtype), torch.randn(1, 6, 1, 16, dtype=dtype)
    before = run_compiled(module, x, r1, r2, fusion=False)
    after = run_compiled(module, x, r1, r2)
    assert count(before.ops, "aten.cat") == 1 and count(before.ops, "npu_rotary_mul") == 0
    assert after.fusions == {"rotary": 1}
    assert count(after.ops, "npu.npu_rotary_mul.") == 1 and count(after.ops, "aten.cat") == 0
    expected = module(x, r1, r2)
    assert after.outputs.dtype == expected.dtype
    assert_close(after.outputs, expected, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotate_half_q_and_k_with_gradients(dtype):
    q = torch.randn(2, 4, 5, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 5, 8, dtype=dtype, requires_grad=True)   # fewer k heads (GQA)
    cos = torch.randn(2, 5, 8, dtype=dtype, requires_grad=True)
    sin = torch.randn(2, 5, 8, dtype=dtype, requires_grad=True)
    module = HFRotary()
    compiled = run_compiled(module, q, k, cos, sin, backward=True)
    got_grads = grads(q, k, cos, sin)
    # The oracle: the composition in float32 (eager fp16 / bf16 rounds more than the fused op).
    leaves = [t.detach().float().requires_grad_() for t in (q, k, cos, sin)]
    expected = module(*leaves)
    expected.square().sum().backward()
    assert compiled.fusions == {"rotary": 2}
    assert count(compiled.ops, "npu.npu_rotary_mul.") == 2
    assert count(compiled.ops, "npu_rotary_mul_backward") == 2
    assert compiled.outputs.dtype == dtype
    assert_close(compiled.outputs, expected, dtype=dtype)
    # dcos / dsin sum over heads and over q and k: a few roundings more in fp16 / bf16.
    for got, leaf in zip(got_grads, leaves):
        assert_close(got, leaf.grad, dtype=dtype, scale=8)


class ProjectedRotary(nn.Module):
    """transformers' attention block up to the rotary: q and k projected as [B, S, N * D], viewed
    [B, S, N, D] and transposed to BNSD views, rotated with [B, 1, S, D] cos / sin."""

    def __init__(self, h=32, heads=4, kv_heads=2, d=8):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        self.q_proj = nn.Linear(h, heads * d, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * d, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.d).transpose(1, 2)
        return HFRotary()(q, k, cos, sin)


def test_rotary_of_transposed_projections_runs_on_the_bsnd_tensor():
    """q / k that are BNSD views of BSND memory are rotated as the BSND tensors themselves (rows
    contiguous), the result transposed back: the op's input in the graph is [B, S, N, D]."""
    module = ProjectedRotary()
    x = torch.randn(2, 5, 32, requires_grad=True)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    compiled = run_compiled(module, x, cos, sin, backward=True)
    got_dx, got_wq = x.grad.clone(), module.q_proj.weight.grad.clone()
    x.grad = None
    module.zero_grad()
    assert compiled.fusions == {"rotary": 2}
    shapes = [tuple(n.args[0].meta["val"].shape) for phase, gm in compiled.backend.graphs
              if phase != "pre_autograd" for n in gm.graph.nodes
              if n.target == torch.ops.npu.npu_rotary_mul.default]
    assert sorted(shapes) == [(2, 5, 2, 8), (2, 5, 4, 8)]
    expected = module(x, cos, sin)
    expected.square().sum().backward()
    assert_close(compiled.outputs, expected, dtype=torch.float32)
    assert_close(got_dx, x.grad, dtype=torch.float32, scale=4)
    assert_close(got_wq, module.q_proj.weight.grad, dtype=torch.float32, scale=4)


class ProjectedRotaryViewed(ProjectedRotary):
    """The sin term first: eager's result is then contiguous, and the code after it views it
    as such (a view the BSND-layout result would not allow)."""

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.d).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (rotate_half(q) * sin + q * cos).view(b * self.heads, s, self.d)


class SbndRotaryViewed(ProjectedRotary):
    """q from an [S, B, H] projection viewed [B, N, S, D]; eager's result keeps that SBND memory
    layout, which the code after it views as [S, B, N * D]."""

    def forward(self, x, cos, sin):
        s, b, _ = x.shape
        q = self.q_proj(x).view(s, b, self.heads, self.d).permute(1, 2, 0, 3)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (q * cos + rotate_half(q) * sin).permute(2, 0, 1, 3).view(s, b, -1)


class FullCosRotaryViewed(ProjectedRotary):
    """cos / sin with a head dim [B, N, S, D]: eager's result is a BNSD view of BSND memory,
    which the code after it views as [B, S, N * D]."""

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.d).transpose(1, 2)
        cos = cos.unsqueeze(1).expand(b, self.heads, s, self.d).contiguous()
        sin = sin.unsqueeze(1).expand(b, self.heads, s, self.d).contiguous()
        return (q * cos + rotate_half(q) * sin).transpose(1, 2).view(b, s, -1)


class FusedQkvRotaryViewed(nn.Module):
    """q, k, v from one [B, S, 3 * N * D] projection (as the demo's block, GPT-NeoX and Phi do),
    unbound and transposed to BNSD views whose S rows are 3 N D apart; eager's rotary results
    are BNSD views of dense BSND memory, which the code after them views as [B, S, N * D]."""

    def __init__(self, h=32, heads=4, d=8):
        super().__init__()
        self.heads, self.d = heads, d
        self.qkv = nn.Linear(h, 3 * heads * d, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.d).unbind(2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return (q.transpose(1, 2).view(b, s, -1) + k.transpose(1, 2).view(b, s, -1)
                + v.reshape(b, s, -1))


@pytest.mark.parametrize("module, fused", [
    (ProjectedRotaryViewed(), 1),   # eager's result contiguous: the op's own layout
    (FusedQkvRotaryViewed(), 2),    # strided BSND rows: rotated as the BSND view
    (SbndRotaryViewed(), 0),        # layouts the fused result would not have stay native
    (FullCosRotaryViewed(), 0),
], ids=["contiguous", "fused_qkv", "sbnd", "full_cos"])
@pytest.mark.parametrize("grad", [False, True])
def test_rotary_result_keeps_eagers_layout(module, fused, grad):
    """Code after the rotary was traced on eager's strides: a view that needs them compiles."""
    x = torch.randn(2, 5, 32, requires_grad=grad)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    if isinstance(module, SbndRotaryViewed):
        x = torch.randn(5, 2, 32, requires_grad=grad)
        cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    with torch.set_grad_enabled(grad):
        compiled = run_compiled(module, x, cos, sin, backward=grad)
        assert sum(compiled.fusions.values()) == fused
        assert_close(compiled.outputs, module(x, cos, sin), dtype=torch.float32)


@pytest.mark.parametrize("x_shape, r_shape", [
    ((2, 3, 7, 16), (1, 1, 7, 16)),      # BNSD, 11SD
    ((7, 2, 3, 16), (7, 1, 1, 16)),      # SBND, S11D
    ((9, 3, 16), (9, 1, 16)),            # TND, T1D
    ((2, 7, 3, 16), (7, 1, 16)),         # r of lower rank
    ((2, 7, 3, 16), (16,)),
], ids=["BNSD", "SBND", "TND", "lower-rank", "vector"])
def test_layouts(x_shape, r_shape):
    x, r1, r2 = torch.randn(x_shape), torch.randn(r_shape), torch.randn(r_shape)
    compiled = run_compiled(SeedRotary(), x, r1, r2)
    assert compiled.fusions == {"rotary": 1}
    assert_close(compiled.outputs, SeedRotary()(x, r1, r2), dtype=torch.float32)


def test_dynamic_shapes_fuse_once_and_serve_new_shapes():
    module = SeedRotary()
    config = CompilerConfig()
    config.debug.run_eagerly = True
    backend = get_npu_backend(compiler_config=config)
    compiled_fn = torch.compile(module, backend=backend, dynamic=True, fullgraph=True)
    # The last one has an odd D: the parity guard sends it to a new, unfused graph.
    for b, s, n, d in [(2, 5, 3, 8), (3, 7, 2, 12), (2, 4, 5, 16), (2, 4, 5, 15)]:
        x = torch.randn(b, s, n, d, dtype=torch.bfloat16)
        r1 = torch.randn(1, s, 1, d, dtype=torch.bfloat16)
        r2 = torch.randn(1, s, 1, d, dtype=torch.bfloat16)
        assert_close(compiled_fn(x, r1, r2), module(x, r1, r2), dtype=torch.bfloat16)
    assert backend.fusions["rotary"] >= 1
    assert sum(backend.fusions.values()) == backend.fusions["rotary"]


class QuarterSplit(nn.Module):
    """cat(-x[..., D/4:], x[..., :D/4]): a valid rotation, but not npu_rotary_mul's halves."""

    def forward(self, x, r1, r2):
        q = x.shape[-1] // 4
        return r1 * x + r2 * torch.cat((-x[..., q:], x[..., :q]), dim=-1)


@pytest.mark.parametrize("module, x_shape, r_shape, r_dtype", [
    (SeedRotary(), (2, 6, 3, 16), (1, 6, 1, 16), torch.float32),   # bf16 x, fp32 cos: promotes
    (SeedRotary(), (1, 6, 3, 16), (2, 6, 1, 16), None),            # r grows the result
    (SeedRotary(), (6, 3, 16), (1, 1, 3, 16), None),               # r of higher rank
    (QuarterSplit(), (2, 6, 3, 16), (1, 6, 1, 16), None),
    (SeedRotary(), (2, 6, 3, 15), (1, 6, 1, 15), None),           # odd D: halves of 7 and 8
], ids=["mixed-dtype", "r-larger", "r-higher-rank", "quarter-split", "odd-D"])
def test_shapes_the_op_does_not_broadcast_like_eager_are_left_alone(module, x_shape, r_shape,
                                                                     r_dtype):
    x = torch.randn(x_shape, dtype=torch.bfloat16 if r_dtype else torch.float32)
    r1 = torch.randn(r_shape, dtype=r_dtype or x.dtype)
    r2 = torch.randn(r_shape, dtype=r_dtype or x.dtype)
    compiled = run_compiled(module, x, r1, r2)
    assert not compiled.fusions and count(compiled.ops, "npu_") == 0
    expected = module(x, r1, r2)
    assert compiled.outputs.dtype == expected.dtype and compiled.outputs.shape == expected.shape
    torch.testing.assert_close(compiled.outputs, expected)


def test_rule_can_be_disabled_by_name():
    x, r = torch.randn(2, 6, 3, 16), torch.randn(1, 6, 1, 16)
    compiled = run_compiled(SeedRotary(), x, r, r, disabled=["rotary"])
    assert not compiled.fusions and count(compiled.ops, "npu_rotary") == 0


def test_strict_mode_fuses_only_ascend_layouts():
    """Strict mode makes npu_rotary_mul enforce Ascend's limits; the rule must not bring the op
    (and its errors) into code that never called it."""
    import opennpu

    with opennpu.strict():
        x, r = torch.randn(6, 16), torch.randn(6, 16)                       # 2-D: not Ascend's
        outside = run_compiled(SeedRotary(), x, r, r)
        x4, r4 = torch.randn(2, 6, 3, 16), torch.randn(1, 6, 1, 16)         # BSND, 1S1D
        inside = run_compiled(SeedRotary(), x4, r4, r4)
    assert not outside.fusions
    torch.testing.assert_close(outside.outputs, SeedRotary()(x, r, r))
    assert inside.fusions == {"rotary": 1}
    assert_close(inside.outputs, SeedRotary()(x4, r4, r4), dtype=torch.float32)


def test_speed_gate(monkeypatch):
    """Inference graphs keep the rotation of fewer than INFERENCE_MIN_TOKENS positions (rows of
    cos) native, for q and k alike; training graphs fuse at any length."""
    from opennpu.compile.rules import _util

    monkeypatch.setattr(_util, "INFERENCE_MIN_TOKENS", 512)

    def inputs(s):
        return (torch.randn(1, 4, s, 8), torch.randn(1, 2, s, 8), torch.randn(1, s, 8),
                torch.randn(1, s, 8))

    with torch.no_grad():
        assert not run_compiled(HFRotary(), *inputs(16)).fusions
        assert run_compiled(HFRotary(), *inputs(512)).fusions == {"rotary": 2}
    q, k, cos, sin = inputs(16)
    assert run_compiled(HFRotary(), q.requires_grad_(), k, cos, sin).fusions == {"rotary": 2}
