"""The attention rule: native attention forms -> npu_fusion_attention.

Forms: seed 000's matmul/mul/masked_fill/softmax/matmul chain, transformers' eager attention
(repeat_kv, additive mask, dropout) and F.scaled_dot_product_attention (mask, is_causal, scale,
enable_gqa, repeat_kv). Each test checks the graph before/after, the numerics against eager and,
where it matters, gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_helpers import count, grads, run_compiled
from opennpu.compile import CompilerConfig, get_npu_backend
from opennpu.compile.rules import attention as attention_rule
from opennpu.testing.tolerances import assert_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def no_speed_gate(monkeypatch):
    """The tests use short sequences, where the rule leaves SDPA (and the chain in training) alone
    for speed; test_speed_gate checks that gate, the others switch it off."""
    monkeypatch.setattr(attention_rule, "SDPA_MIN_KV", 0)
    monkeypatch.setattr(attention_rule, "CHAIN_TRAINING_MIN_KV", 0)


def repeat_kv(x, n_rep):
    """transformers' repeat_kv."""
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class SeedAttention(nn.Module):
    """Seed 000's TorchFlashAttention.supported_op_exec (BNSD in, the attention out in BNSD)."""

    def __init__(self, scale=0.099):
        super().__init__()
        self.scale = scale

    def forward(self, query, key, value, atten_mask=None):
        qk = torch.matmul(query, key.transpose(2, 3)).mul(self.scale)
        if atten_mask is not None:
            qk.masked_fill_(atten_mask, torch.tensor(-float("inf")))
        softmax_res = F.softmax(qk, dim=-1, dtype=torch.float32).to(query.dtype)
        return torch.matmul(softmax_res, value)


class PlainAttention(nn.Module):
    """softmax without a dtype, k transposed with negative dims, masked_fill out of place."""

    def forward(self, q, k, v, mask=None):
        s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5)
        if mask is not None:
            s = s.masked_fill(mask, float("-inf"))
        return torch.softmax(s, dim=-1) @ v


class EagerAttention(nn.Module):
    """transformers' eager_attention_forward (Llama, Qwen2, Mistral)."""

    def __init__(self, n_rep=2, scaling=0.125, dropout=0.0):
        super().__init__()
        self.n_rep, self.scaling, self.dropout = n_rep, scaling, dropout

    def forward(self, query, key, value, attention_mask=None):
        key_states = repeat_kv(key, self.n_rep)
        value_states = repeat_kv(value, self.n_rep)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        attn_weights = F.dropout(attn_weights, p=self.dropout, training=self.training)
        return torch.matmul(attn_weights, value_states)


class Sdpa(nn.Module):
    def __init__(self, n_rep=1, gqa=False, **kwargs):
        super().__init__()
        self.n_rep, self.gqa, self.kwargs = n_rep, gqa, kwargs

    def forward(self, q, k, v, mask=None):
        extra = {"enable_gqa": True} if self.gqa else {}
        k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kwargs, **extra)


def qkv(b=2, n=4, n_kv=4, sq=24, skv=24, d=16, dtype=torch.float32, grad=False, bsnd=False):
    """q, k, v in BNSD; bsnd=True gives them transformers' memory layout ([B, S, N, D] transposed)."""
    def make(heads, s):
        shape = (b, s, heads, d) if bsnd else (b, heads, s, d)
        t = torch.randn(shape, dtype=dtype)
        t = t.transpose(1, 2) if bsnd else t
        return t.detach().requires_grad_(grad) if grad else t
    return make(n, sq), make(n_kv, skv), make(n_kv, skv)


def causal_bool(sq, skv):
    """True = masked out (j > i)."""
    return torch.ones(sq, skv, dtype=torch.bool).triu(1)


def hf_additive_mask(b, s, dtype, pad=0):
    """transformers' eager mask: 0 where attended, finfo.min elsewhere; causal, the first `pad`
    keys of batch 0 padded (so its first `pad` query rows are fully masked)."""
    allowed = ~causal_bool(s, s)[None, None].expand(b, 1, s, s).clone()
    allowed[0, :, :, :pad] = False
    return torch.where(allowed, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


def reference(module, *args):
    """The module run in float32 (the accuracy reference for fp16/bf16 runs)."""
    return module(*[a.float() if a.is_floating_point() else a for a in args])


def check_numerics(got, module, args, dtype, vs_native=True):
    """fp32: equal to eager within the table. fp16/bf16: within the table of the fp32 result and,
    for the matmul/softmax chains (vs_native), no worse than the chain run in that dtype (which
    rounds the scores too). SDPA's CPU flash kernel keeps P in fp32 for the P V product while the
    fused op rounds P to the input dtype as the chain does, so against SDPA only the table holds."""
    ref = reference(module, *args)
    if dtype == torch.float32:
        assert_close(got, ref, dtype=dtype)
        return
    if vs_native:
        native = module(*args)
        err_fused = (got.double() - ref.double()).abs().max().item()
        err_native = (native.double() - ref.double()).abs().max().item()
        assert err_fused <= max(1.25 * err_native, 1e-3), (err_fused, err_native)
    assert_close(got, ref, dtype=dtype)


# --- seed 000 and hand-written chains --------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_seed_chain_fused_and_matches_eager(dtype, masked):
    module = SeedAttention()
    q, k, v = qkv(dtype=dtype)
    args = (q, k, v, torch.randn(1, 1, 24, 24) >= 1) if masked else (q, k, v)
    before = run_compiled(module, *args, fusion=False)
    after = run_compiled(module, *args)
    assert count(before.ops, "aten.bmm") + count(before.ops, "aten.mm") >= 2
    assert count(before.ops, "aten.amax") == 1
    assert after.fusions == {"attention": 1}
    assert count(after.ops, "npu.npu_fusion_attention.") == 1
    assert count(after.ops, "aten.amax") == 0 and count(after.ops, "bmm") == 0
    check_numerics(after.outputs, module, args, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plain_chain_with_2d_mask_and_negative_dims(dtype):
    module = PlainAttention()
    q, k, v = qkv(sq=20, skv=33, dtype=dtype)
    mask = torch.rand(20, 33) > 0.7
    compiled = run_compiled(module, q, k, v, mask)
    assert compiled.fusions == {"attention": 1}
    check_numerics(compiled.outputs, module, (q, k, v, mask), dtype)


def test_seed_chain_backward_matches_eager():
    module = SeedAttention(scale=0.25)
    q, k, v = qkv(grad=True)
    mask = causal_bool(24, 24)
    compiled = run_compiled(module, q, k, v, mask, backward=True)
    got = grads(q, k, v)
    module(q, k, v, mask).float().square().sum().backward()
    assert compiled.fusions == {"attention": 1}
    assert count(compiled.ops, "npu_fusion_attention_grad") == 1
    for g, t in zip(got, (q, k, v)):
        assert_close(g, t.grad, dtype=torch.float32, scale=4)


# --- transformers' eager attention -------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_attention_with_repeat_kv_and_additive_mask(dtype):
    """GQA through repeat_kv, transformers' finfo.min causal mask with a padded batch (fully
    masked rows: the composition and the fused op both average every value there)."""
    module = EagerAttention(n_rep=2).eval()
    q, k, v = qkv(n=4, n_kv=2, dtype=dtype, bsnd=True)
    mask = hf_additive_mask(2, 24, dtype, pad=3)
    before = run_compiled(module, q, k, v, mask, fusion=False)
    after = run_compiled(module, q, k, v, mask)
    assert count(before.ops, "aten.unsqueeze") == 2
    assert after.fusions == {"attention": 1}
    assert count(after.ops, "npu.npu_fusion_attention.") == 1
    assert count(after.ops, "aten.unsqueeze") == 0    # repeat_kv absorbed: GQA in the fused op
    check_numerics(after.outputs, module, (q, k, v, mask), dtype)


def test_eager_attention_training_backward_with_zero_dropout():
    module = EagerAttention(n_rep=2, dropout=0.0).train()
    q, k, v = qkv(n=4, n_kv=2, grad=True, bsnd=True)
    mask = hf_additive_mask(2, 24, torch.float32)
    compiled = run_compiled(module, q, k, v, mask, backward=True)
    got = grads(q, k, v)
    module(q, k, v, mask).float().square().sum().backward()
    assert compiled.fusions == {"attention": 1}
    for g, t in zip(got, (q, k, v)):
        assert_close(g, t.grad, dtype=torch.float32, scale=4)


def test_eager_attention_without_mask_and_without_groups():
    module = EagerAttention(n_rep=1)
    q, k, v = qkv(dtype=torch.bfloat16)
    compiled = run_compiled(module, q, k, v)
    assert compiled.fusions == {"attention": 1}
    check_numerics(compiled.outputs, module, (q, k, v), torch.bfloat16)


# --- F.scaled_dot_product_attention ---------------------------------------------------------------

SDPA_CASES = {
    "plain": (dict(), 1, 1, None),
    "scale": (dict(scale=0.3), 1, 1, None),
    "causal": (dict(is_causal=True), 1, 1, None),
    "causal_gqa": (dict(is_causal=True, scale=0.2), 1, 2, "gqa"),
    "bool_mask_repeat_kv": (dict(), 2, 1, "bool"),
    "float_mask": (dict(scale=0.125), 1, 1, "float"),
}


def sdpa_args(case, dtype, grad=False, sq=24, skv=24):
    kwargs, n_rep, gqa_rep, mask_kind = SDPA_CASES[case]
    n_kv = 4 // max(n_rep, gqa_rep)
    q, k, v = qkv(n=4, n_kv=n_kv, sq=sq, skv=skv, dtype=dtype, grad=grad, bsnd=True)
    module = Sdpa(n_rep=n_rep, gqa=mask_kind == "gqa", **kwargs)
    args = [q, k, v]
    if mask_kind == "bool":
        args.append(~causal_bool(sq, skv)[None, None].expand(2, 1, sq, skv))  # True = attend
    elif mask_kind == "float":
        args.append(hf_additive_mask(2, sq, dtype, pad=2))
    return module, args


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_fused_and_matches_eager(case, dtype):
    module, args = sdpa_args(case, dtype)
    compiled = run_compiled(module, *args)
    assert compiled.fusions == {"attention": 1}
    assert count(compiled.ops, "npu.npu_fusion_attention.") == 1
    assert count(compiled.ops, "scaled_dot_product") == 0 and count(compiled.ops, "unsqueeze") == 0
    check_numerics(compiled.outputs, module, args, dtype, vs_native=False)


@pytest.mark.parametrize("case", ["causal_gqa", "bool_mask_repeat_kv", "float_mask"])
def test_sdpa_backward_matches_eager(case):
    """Against SDPA's math backend (the composition's autograd). The float mask pads the first keys
    of batch 0, so its first rows are fully masked (finfo.min everywhere: uniform P). There SDPA's
    CPU flash backward is wrong: it recomputes P from logsumexp = min + log(Skv), which rounds
    to min in fp32, and gets P = 1 instead of 1 / Skv; the fused op keeps max and sum apart."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    module, args = sdpa_args(case, torch.float32, grad=True)
    compiled = run_compiled(module, *args, backward=True)
    got = grads(*args[:3])
    with sdpa_kernel(SDPBackend.MATH):
        module(*args).float().square().sum().backward()
    assert compiled.fusions == {"attention": 1}
    assert count(compiled.ops, "npu_fusion_attention_grad") == 1
    for g, t in zip(got, args[:3]):
        assert_close(g, t.grad, dtype=torch.float32, scale=4)


def test_sdpa_causal_with_fewer_queries_is_top_left_aligned():
    module, args = sdpa_args("causal", torch.float32, sq=10, skv=24)
    compiled = run_compiled(module, *args)
    assert compiled.fusions == {"attention": 1}
    assert_close(compiled.outputs, module(*args), dtype=torch.float32)


def test_sdpa_fully_masked_rows_give_zero_as_sdpa_does():
    module, (q, k, v) = sdpa_args("plain", torch.float32)
    mask = torch.ones(2, 1, 24, 24, dtype=torch.bool)
    mask[1, :, 5] = False                       # row 5 of batch 1 sees nothing
    compiled = run_compiled(module, q, k, v, mask)
    assert compiled.fusions == {"attention": 1}
    expected = module(q, k, v, mask)
    assert expected[1, :, 5].abs().max() == 0
    assert_close(compiled.outputs, expected, dtype=torch.float32)


class ProjectedSdpa(nn.Module):
    """q/k/v projected and viewed [B, S, N, D] -> BNSD as transformers does (static head counts,
    symbolic batch and sequence under dynamic=True), repeat_kv, bool mask."""

    def __init__(self, hidden=32, heads=4, kv_heads=2, dtype=torch.bfloat16):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.d, bias=False, dtype=dtype)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, s, -1, self.d).transpose(1, 2).chunk(2, dim=1)
        n_rep = self.heads // self.kv_heads
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                              attn_mask=mask)


def test_dynamic_shapes_fuse_once_and_serve_new_shapes():
    module = ProjectedSdpa()
    config = CompilerConfig()
    config.debug.run_eagerly = True
    backend = get_npu_backend(compiler_config=config)
    compiled_fn = torch.compile(module, backend=backend, dynamic=True, fullgraph=True)
    for b, s in [(2, 24), (3, 17), (2, 40)]:
        x = torch.randn(b, s, 32, dtype=torch.bfloat16)
        mask = torch.rand(b, 1, s, s) > 0.2
        mask[..., 0] = True
        with torch.no_grad():
            expected = copy.deepcopy(module).float()(x.float(), mask)
            assert_close(compiled_fn(x, mask), expected, dtype=torch.bfloat16)
    assert backend.fusions == {"attention": 1}   # one compile


# --- must not fuse ---------------------------------------------------------------------------------


def test_sdpa_with_dropout_is_left_alone():
    module, args = sdpa_args("plain", torch.float32)
    module.kwargs = {"dropout_p": 0.1}
    compiled = run_compiled(module, *args)
    assert not compiled.fusions
    assert count(compiled.ops, "npu_") == 0


def test_eager_attention_with_real_dropout_in_training_is_left_alone():
    module = EagerAttention(n_rep=2, dropout=0.1).train()
    q, k, v = qkv(n=4, n_kv=2)
    compiled = run_compiled(module, q, k, v)
    assert not compiled.fusions


def test_min_fill_is_not_minus_inf_and_is_left_alone():
    """masked_fill(mask, finfo.min) averages fully masked rows; the fused op would give 0."""
    class MinFill(nn.Module):
        def forward(self, q, k, v, mask):
            s = (q @ k.transpose(2, 3) * 0.25).masked_fill(mask, torch.finfo(q.dtype).min)
            return torch.softmax(s, -1) @ v
    q, k, v = qkv()
    mask = torch.rand(24, 24) > 0.5
    mask[3] = True                                       # one fully masked row
    compiled = run_compiled(MinFill(), q, k, v, mask)
    # The softmax alone may still fuse (npu_scaled_masked_softmax averages a fully masked row
    # as the finfo.min composition does); the attention rule must not.
    assert "attention" not in compiled.fusions
    assert count(compiled.ops, "npu_fusion_attention") == 0
    assert_close(compiled.outputs, MinFill()(q, k, v, mask), dtype=torch.float32)


def test_masks_that_would_broadcast_the_scores_are_left_alone():
    """A [3, 1, S, S] mask with batch 1 scores makes the composition's result batch 3."""
    q, k, v = qkv(b=1)
    mask = torch.rand(3, 1, 24, 24) > 0.5
    module = PlainAttention()
    compiled = run_compiled(module, q, k, v, mask)
    assert not compiled.fusions
    assert compiled.outputs.shape[0] == 3


@pytest.mark.parametrize("what", ["softmax_dim", "float64", "fp64_mask", "bool_added"])
def test_other_forms_are_left_alone(what):
    """softmax over another axis; float64 (not a dtype of the rule); an fp64 additive mask (its
    finfo.min would become -inf in the fused op's fp32 pse); a bool mask added as 0/1."""
    class Chain(nn.Module):
        def forward(self, q, k, v, mask=None):
            s = torch.matmul(q, k.transpose(2, 3)) * 0.25
            if mask is not None:
                s = s + mask
            p = torch.softmax(s, dim=2 if what == "softmax_dim" else -1, dtype=torch.float32)
            return torch.matmul(p.to(q.dtype), v)

    args = list(qkv(dtype=torch.float64 if what == "float64" else torch.float32))
    if what == "fp64_mask":
        args.append(hf_additive_mask(2, 24, torch.float64))
    if what == "bool_added":
        args.append(torch.rand(24, 24) > 0.5)
    compiled = run_compiled(Chain(), *args)
    assert not compiled.fusions
    torch.testing.assert_close(compiled.outputs, Chain()(*args))


def test_rule_can_be_disabled_by_name():
    module, args = sdpa_args("causal", torch.float32)
    compiled = run_compiled(module, *args, disabled=["attention"])
    assert not compiled.fusions
    assert count(compiled.ops, "npu_") == 0
    assert_close(compiled.outputs, module(*args), dtype=torch.float32)


def test_speed_gate(monkeypatch):
    """Short sequences: SDPA stays unless fp16/bf16 training (where the fused op wins at every
    length); the chain is fused in inference at any length, in training from 64 keys."""
    monkeypatch.setattr(attention_rule, "SDPA_MIN_KV", 384)
    monkeypatch.setattr(attention_rule, "CHAIN_TRAINING_MIN_KV", 64)
    sdpa = Sdpa(is_causal=True)
    short = qkv(n=2, n_kv=2, sq=16, skv=16, d=8)
    assert not run_compiled(sdpa, *short).fusions
    assert run_compiled(sdpa, *qkv(b=1, n=2, n_kv=2, sq=8, skv=384, d=8)).fusions == {"attention": 1}
    half_training = qkv(n=2, n_kv=2, sq=16, skv=16, d=8, dtype=torch.bfloat16, grad=True)
    assert run_compiled(sdpa, *half_training).fusions == {"attention": 1}
    assert not run_compiled(sdpa, *qkv(n=2, n_kv=2, sq=16, skv=16, d=8, grad=True)).fusions
    chain = SeedAttention()
    assert run_compiled(chain, *short).fusions == {"attention": 1}
    assert not run_compiled(chain, *qkv(n=2, n_kv=2, sq=16, skv=16, d=8, grad=True)).fusions
    assert run_compiled(chain, *qkv(n=2, n_kv=2, sq=16, skv=64, d=8, grad=True)).fusions == \
        {"attention": 1}
