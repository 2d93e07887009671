"""Graph mode: a Llama decoder layer (transformers' LlamaDecoderLayer, random weights) compiled with
opennpu's backend (pattern fusion, then Inductor) against torch.compile's default backend
(Inductor alone, "compile") and eager ("eager").

The layer is called as LlamaModel calls it: hidden_states [1, S, H], position_embeddings from
LlamaRotaryEmbedding, attention_mask None (no padding: SDPA with is_causal=True and enable_gqa),
SDPA attention (transformers' default). Scaled to the CPU: H=1024, 16 query heads and 4 key/value
heads of 64, intermediate 2816, S=512 (--quick) to 2048, batch 1. "fwd" is inference (eval,
no_grad); "f+b" a training step: forward, then the gradients of every parameter and of the input.
The fusions the opennpu backend made (per rule) are printed after the row. Rows marked "frozen"
compile ours with experimental_config.frozen_parameter (inference: weights packed once); the
baselines stay torch.compile's defaults (benchmarks.decoder_attribution also compares with
Inductor's own freezing).
"""

from __future__ import annotations

import functools

import torch
from opennpu.testing.timing import compiled

from ..common import Case, Timed, randn

OP = "decoder_layer"
BATCH, HIDDEN, HEADS, KV_HEADS, INTERMEDIATE = 1, 1024, 16, 4, 2816


def _flops(s: int) -> int:
    """Forward FLOPs: the projections (q, o: H x H; k, v: H x H*Nkv/N), the MLP's three GEMMs and
    causal attention (two S x S x H GEMMs, halved by the mask)."""
    kv = HIDDEN * KV_HEADS // HEADS
    proj = 2 * BATCH * s * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv)
    mlp = 2 * BATCH * s * 3 * HIDDEN * INTERMEDIATE
    attention = 4 * BATCH * s * s * HIDDEN // 2
    return proj + mlp + attention


def _layer(dtype: torch.dtype, training: bool):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=1, max_position_embeddings=8192, attention_dropout=0.0)
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, layer_idx=0).to(dtype)
    for p in layer.parameters():
        if p.dim() == 1:
            torch.nn.init.uniform_(p, 0.5, 1.5)
    layer.train(training)
    return layer, LlamaRotaryEmbedding(config=config)


class _Call(torch.nn.Module):
    """layer(hidden_states, attention_mask=None, position_embeddings=(cos, sin))."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, cos, sin):
        return self.layer(x, attention_mask=None, position_embeddings=(cos, sin))


def _opennpu(module, args, threads: int, frozen: bool = False):
    """torch.compile with opennpu's backend (default CompilerConfig: fusion + Inductor; `frozen`:
    with experimental_config.frozen_parameter), compiled here with Inductor's C++ kernels fixed to
    `threads` (as the compile baseline's are)."""
    from opennpu.compile import CompilerConfig, get_npu_backend

    config = CompilerConfig()
    config.experimental_config.frozen_parameter = frozen
    backend = get_npu_backend(compiler_config=config)
    fn = torch.compile(module, backend=backend, dynamic=False)
    with torch._inductor.config.patch({"cpp.threads": threads}):
        fn(*args)  # compiles (forward; the backward graph is compiled by its first call)
    return fn, backend


def build(direction: str, s: int, dtype: torch.dtype, threads: int, frozen: bool = False) -> Timed:
    training = direction == "f+b"
    layer, rotary = _layer(dtype, training)
    module = _Call(layer)
    x = randn(BATCH, s, HIDDEN, dtype=dtype)
    position_ids = torch.arange(s)[None]
    with torch.no_grad():
        cos, sin = rotary(x, position_ids)
    args = (x.requires_grad_(training), cos, sin)
    ours_fn, backend = _opennpu(module, args, threads, frozen)
    inductor_fn = compiled(module, *args, threads=threads)
    params = tuple(layer.parameters())
    dy = randn(BATCH, s, HIDDEN, dtype=dtype)

    def step(fn):
        if not training:
            return lambda: fn(*args)

        def run():
            return torch.autograd.grad(fn(*args), (x, *params), dy)
        return run

    ours = step(ours_fn)
    if training:
        with torch._inductor.config.patch({"cpp.threads": threads}):
            ours()  # compiles the backward graph with the same thread count
    reference = None
    if not training:
        layer32 = _Call(_layer(torch.float32, False)[0])
        layer32.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
        reference = functools.partial(layer32, x.float(), cos.float(), sin.float())
    fusions = ", ".join(f"{rule} {n}" for rule, n in sorted(backend.fusions.items()))
    return Timed(ours=ours, baselines={"eager": step(module), "compile": step(inductor_fn)},
                 reference=reference, info=f"fusions: {fusions or 'none'}")


def cases(quick: bool, dtypes):
    seqs = (512,) if quick else (512, 1024, 2048)
    for s in seqs:
        for dtype in dtypes:
            shape = f"H={HIDDEN} N={HEADS}/{KV_HEADS} S={s}"
            e = dtype.itemsize
            weights = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN * KV_HEADS // HEADS
                       + 3 * HIDDEN * INTERMEDIATE) * e
            act = BATCH * s * HIDDEN * e
            flops = _flops(s)
            yield Case(OP, "fwd", shape, dtype, weights + 2 * act,
                       functools.partial(build, "fwd", s, dtype), ("npu_fusion_attention",), flops)
            # Inference with frozen_parameter (weights packed once), against the same baselines.
            yield Case(OP, "fwd", f"{shape} frozen", dtype, weights + 2 * act,
                       functools.partial(build, "fwd", s, dtype, frozen=True),
                       ("npu_fusion_attention",), flops)
            # A training step: the backward's GEMMs cost twice the forward's.
            yield Case(OP, "f+b", shape, dtype, 3 * weights + 4 * act,
                       functools.partial(build, "f+b", s, dtype),
                       ("npu_fusion_attention", "npu_fusion_attention_grad"), 3 * flops)
