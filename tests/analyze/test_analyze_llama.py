"""The analyzer on a transformers Llama model (tiny random config, nothing downloaded): one
training step's ops, forward and backward, and graph mode's fused replacements."""

from __future__ import annotations

import pytest
import torch

from opennpu.analyze import OpCensus

transformers = pytest.importorskip("transformers")

LAYERS = 2


@pytest.fixture(scope="module")
def census():
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to("npu")
    ids = torch.randint(0, 128, (2, 16), device="npu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with OpCensus() as census:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    torch._dynamo.reset()
    return census


def test_fused_replacements(census):
    fusions = census.fusions()
    assert fusions.error is None and fusions.module == "LlamaForCausalLM"
    counts = {m.rule: m.matches for m in fusions.matches}
    # per layer: two RMSNorms (the second fed by the residual add: add_rms_norm), rotary on q
    # and k, one attention, the MLP's silu(gate) * up; plus the final norm (after the last
    # residual add: add_rms_norm too)
    assert counts == {"rms_norm": 2 * LAYERS + 1, "add_rms_norm": 2 * LAYERS,
                      "rotary": 2 * LAYERS, "attention": LAYERS, "silu_mul": LAYERS}
    replacement = {m.rule: m.replacement for m in fusions.matches}
    assert replacement["rms_norm"] == "npu_rms_norm"
    assert replacement["rotary"] == "npu_rotary_mul"
    assert replacement["attention"] == "npu_fusion_attention"
    text = census.table()
    assert "rms_norm matched 5x -> use torch_npu.npu_rms_norm (or compile with " \
           "backend='opennpu')" in text
    assert "attention matched 2x -> use torch_npu.npu_fusion_attention" in text
    from opennpu.analyze.report import fusions_to_csv

    lines = fusions_to_csv(fusions).splitlines()
    assert lines[0] == "rule,matches,stage,replacement,eager_only,advice"
    assert [line.split(",")[:4] for line in lines[1:]] == [
        ["add_rms_norm", "4", "pre_autograd", "npu_add_rms_norm"],
        ["attention", "2", "pre_autograd", "npu_fusion_attention"],
        ["rms_norm", "5", "pre_autograd", "npu_rms_norm"],
        ["rotary", "4", "pre_autograd", "npu_rotary_mul"],
        ["silu_mul", "2", "pre_autograd", "opennpu::_silu_mul"]]


def test_training_step_ops(census):
    rows = {r.op: r for r in census.rows()}
    # the RMSNorms as native compositions: rsqrt per norm, mean per norm
    assert rows["aten::rsqrt"].forward == 2 * LAYERS + 1
    assert rows["aten::mean.dim"].forward == 2 * LAYERS + 1
    assert rows["aten::silu"].forward == LAYERS
    assert rows["aten::rsqrt"].modules == f"LlamaRMSNorm {2 * LAYERS + 1}x"
    for op in ("aten::silu_backward", "aten::embedding_dense_backward",
               "aten::_log_softmax_backward_data", "aten::nll_loss_backward",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward"):
        assert rows[op].backward > 0 and rows[op].forward == 0, op
    # seven linears per layer (q, k, v, o, gate, up, down) and the lm_head: one mm each forward,
    # two backward (the input's gradient and the weight's)
    linears = 7 * LAYERS + 1
    assert (rows["aten::mm"].forward, rows["aten::mm"].backward) == (linears, 2 * linears)
    attention = rows["aten::_scaled_dot_product_flash_attention_for_cpu"]
    assert (attention.status, attention.ascend, attention.forward) == ("native", "via-parent", LAYERS)
    assert "scaled_dot_product_attention" in attention.note
    assert rows["aten::_foreach_lerp_.Scalar"].optimizer == 1  # AdamW's foreach step
    assert not [r.op for r in rows.values() if r.status == "missing"]
    assert all(r.devices == "npu" for r in rows.values() if r.op != "aten::_local_scalar_dense"
               and r.calls and r.backward)
