"""Decoder layers of Llama, Qwen2 and Mistral (transformers, tiny random configs, nothing
downloaded) compiled with opennpu's backend: fusions per layer per rule, outputs and parameter
gradients against eager.

Each layer is called as the model calls it: hidden_states, position_embeddings from the model's
rotary embedding module, and the attention mask the model builds (masking_utils) for its
attention implementation: None for SDPA without padding (transformers then passes
is_causal=True and, for GQA, enable_gqa=True), a bool [B, 1, S, S] mask with padding (SDPA after
repeat_kv), a float finfo.min mask for eager attention (repeat_kv, additive mask, dropout p=0).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import masking_utils  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

from fusion_helpers import count, run_compiled  # noqa: E402
from opennpu.compile import rule_names  # noqa: E402
from opennpu.compile.rules import attention as attention_rule  # noqa: E402
from opennpu.testing.tolerances import assert_close  # noqa: E402

MODELS = {
    "llama": (transformers.LlamaConfig, modeling_llama.LlamaDecoderLayer,
              modeling_llama.LlamaRotaryEmbedding),
    "qwen2": (transformers.Qwen2Config, modeling_qwen2.Qwen2DecoderLayer,
              modeling_qwen2.Qwen2RotaryEmbedding),
    "mistral": (transformers.MistralConfig, modeling_mistral.MistralDecoderLayer,
                modeling_mistral.MistralRotaryEmbedding),
}
BATCH, SEQ, HIDDEN = 2, 16, 64

# Fusions per decoder layer, per rule: two RMSNorms, the second fed by the residual add
# (add_rms_norm takes it over, and its own count is the add), one attention, rotary embedding on
# q and on k, and the MLP's silu(gate_proj(x)) * up_proj(x) (silu_mul: its halves come from two
# linears, so not npu_swiglu's one-tensor split). The residual sum is written into o_proj's
# output, which nothing reads after the add and its backward does not keep (add_rms_norm_inplace).
EXPECTED = {"rms_norm": 2, "add_rms_norm": 1, "attention": 1, "rotary": 2, "silu_mul": 1,
            "add_rms_norm_inplace": 1}


@pytest.fixture(autouse=True)
def no_speed_gate(monkeypatch):
    """Tiny sequences: switch off the attention rule's speed gate (tested in test_rules_attention),
    so the layer's structure alone decides what fuses."""
    monkeypatch.setattr(attention_rule, "SDPA_MIN_KV", 0)
    monkeypatch.setattr(attention_rule, "CHAIN_TRAINING_MIN_KV", 0)


class Layer(nn.Module):
    """The decoder layer, called with the arguments its model passes."""

    def __init__(self, name: str, dtype: torch.dtype, attn_implementation: str):
        super().__init__()
        config_cls, layer_cls, rotary_cls = MODELS[name]
        self.config = config_cls(
            hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, num_hidden_layers=1, vocab_size=32,
            max_position_embeddings=256, attention_dropout=0.0)
        self.config._attn_implementation = attn_implementation
        torch.manual_seed(0)
        self.layer = layer_cls(self.config, layer_idx=0).to(dtype)
        for p in self.layer.parameters():  # RMSNorm weights start at 1: make them matter
            if p.dim() == 1:
                nn.init.uniform_(p, 0.5, 1.5)
        self.rotary = rotary_cls(config=self.config)

    def inputs(self, dtype: torch.dtype, padded: bool):
        torch.manual_seed(1)
        x = torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype)
        position_ids = torch.arange(SEQ)[None].expand(BATCH, SEQ)
        cos, sin = self.rotary(x, position_ids)
        padding = None
        if padded:  # left padding of 3 tokens in the first sequence
            padding = torch.ones(BATCH, SEQ, dtype=torch.long)
            padding[0, :3] = 0
        sliding = getattr(self.config, "sliding_window", None) is not None and \
            getattr(self.config, "layer_types", [None])[0] != "full_attention"
        make_mask = masking_utils.create_sliding_window_causal_mask if sliding \
            else masking_utils.create_causal_mask
        mask = make_mask(config=self.config, inputs_embeds=x, attention_mask=padding,
                         past_key_values=None, position_ids=position_ids)
        return x, cos, sin, mask

    def forward(self, x, cos, sin, mask):
        return self.layer(x, attention_mask=mask, position_embeddings=(cos, sin))


def expected_counts():
    return dict(EXPECTED)


def run_layer(name, dtype, attn, padded, *, eager=True):
    module = Layer(name, dtype, attn).train()           # dropout p=0: the identity, removed
    x, cos, sin, mask = module.inputs(dtype, padded)
    x.requires_grad_(True)
    compiled = run_compiled(module, x, cos, sin, mask, backward=True, eager=eager)
    got_grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    got_dx = x.grad.clone()
    return module, (x, cos, sin, mask), compiled, got_grads, got_dx


def eager_reference(module, args, dtype):
    """Outputs and gradients of the eager layer in float32 (from the same weights and inputs)."""
    ref = copy.deepcopy(module).float()
    x, cos, sin, mask = args
    xf = x.detach().float().requires_grad_(True)
    if mask is not None and mask.is_floating_point():
        # the float mask rebuilt in float32 (finfo.min of float32 where masked)
        mask = torch.where(mask == 0, 0.0, torch.finfo(torch.float32).min)
    out = ref(xf, cos.float(), sin.float(), mask)
    out.float().square().sum().backward()
    return out, {n: p.grad for n, p in ref.named_parameters()}, xf.grad


CASES = [("sdpa", False), ("sdpa", True), ("eager", True)]


@pytest.mark.parametrize("attn,padded", CASES, ids=["sdpa", "sdpa_padded", "eager_padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_decoder_layer_fusions_and_numerics(name, dtype, attn, padded):
    module, args, compiled, got_grads, got_dx = run_layer(name, dtype, attn, padded)
    assert dict(compiled.fusions) == expected_counts()
    assert count(compiled.ops, "npu.npu_fusion_attention.") == 1
    assert count(compiled.ops, "npu_fusion_attention_grad") == 1
    assert count(compiled.ops, "scaled_dot_product") == 0 and count(compiled.ops, "aten.amax") == 0
    out, ref_grads, ref_dx = eager_reference(module, args, dtype)
    if dtype == torch.float32:
        # Outputs sum a few rounded terms (attention, MLP); weight gradients sum B*S of them.
        assert_close(compiled.outputs, out, dtype=dtype, scale=2)
        assert_close(got_dx, ref_dx, dtype=dtype, scale=4)
        for n, g in got_grads.items():
            assert_close(g, ref_grads[n], dtype=dtype, scale=8, msg=f"gradient of {n}")
        return
    # bf16: the whole layer's results carry bf16 roundings of every matmul and sum, so they are
    # compared with the eager bf16 layer's own error against the same float32 reference, as
    # relative Frobenius errors (max-abs errors of single elements vary 2-3x between equally
    # accurate roundings): never more than 1.5x the eager layer's error, and below 2%.
    module.zero_grad()
    x = args[0].detach().requires_grad_(True)
    native = module(x, *args[1:])
    native.float().square().sum().backward()
    pairs = [("output", compiled.outputs, native, out), ("dx", got_dx, x.grad, ref_dx)]
    pairs += [(n, got_grads[n], p.grad, ref_grads[n]) for n, p in module.named_parameters()]
    for what, fused, eager, ref in pairs:
        if what.endswith("k_proj.bias"):
            # Zero in exact arithmetic (softmax is invariant to q . b_k, the same for every key),
            # so its reference is rounding noise and a relative error means nothing.
            assert fused.abs().max() <= 4 * max(eager.abs().max().item(), 1e-2)
            continue
        err, err_eager = rel_err(fused, ref), rel_err(eager, ref)
        assert err <= max(1.5 * err_eager, 1e-3) and err < 0.02, (what, err, err_eager)


def rel_err(got, ref):
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def test_decoder_layer_rules_disabled_leave_the_layer_native():
    module = Layer("llama", torch.float32, "sdpa")
    args = module.inputs(torch.float32, padded=True)
    compiled = run_compiled(module, *args, disabled=rule_names())
    assert not compiled.fusions and count(compiled.ops, "npu_") == 0
    assert_close(compiled.outputs, module(*args), dtype=torch.float32)


def test_decoder_layer_under_inductor():
    """The fused ops inside Inductor's generated code (one Inductor compile: slow, so only here)."""
    module, args, compiled, got_grads, got_dx = run_layer("llama", torch.float32, "sdpa", True,
                                                          eager=False)
    assert dict(compiled.fusions) == expected_counts()
    out, ref_grads, ref_dx = eager_reference(module, args, torch.float32)
    assert_close(compiled.outputs, out, dtype=torch.float32, scale=2)
    for n, g in got_grads.items():
        assert_close(g, ref_grads[n], dtype=torch.float32, scale=8, msg=f"gradient of {n}")
