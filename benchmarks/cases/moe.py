"""A Mixtral-like MoE layer (E=8 experts, top-2, H=4096, I=14336) built from opennpu ops
(opennpu.testing.moe_layer.npu_moe_layer: gating, routing, two grouped matmuls around swiglu,
finalize) against the plain PyTorch MoE loop (reference.native_moe_layer, the Hugging Face
Mixtral block) and against the layer's expert GEMMs alone (one torch.mm per expert and
projection on already-routed rows: the floor a fused layer can approach).

T in {16, 256} tokens. The bf16 weights take 2.8 GB; in fp32 they would take 5.6 GB, more than
the benchmark machines can spare next to everything else, so the fp32 cases halve I (7168).
torch.compile is not a baseline: the loop's per-expert token counts are data-dependent.

grouped_matmul: npu_grouped_matmul's float path alone (x [M, K] split over E experts by
group_list, weight [E, K, N], with or without bias) against the per-expert loop of torch.mm in the
same dtype (the native composition), torch.compile of it, and the same loop on float32 copies
made beforehand ("fp32 gemms": the GEMMs' floor on a CPU without fp16 / bf16 arithmetic, where
opennpu multiplies fp32 tiles; docs/performance.md, "fp16 / bf16 GEMMs on the CPU").
"""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from opennpu.testing import reference
from opennpu.testing.moe_layer import npu_moe_layer
from opennpu.testing.timing import compiled

from ..common import Case, Timed, randn
from .quant import _expert_sizes

npu = torch.ops.npu
EXPERTS, TOP_K, HIDDEN = 8, 2, 4096
INTER = {torch.bfloat16: 14336, torch.float16: 14336, torch.float32: 7168}


def tokens(quick: bool):
    return (16,) if quick else (16, 256)


def _weights(hidden, inter, experts, dtype):
    """Random weights made in place in their dtype (no fp32 copy of the whole tensor)."""
    w_gate = torch.randn(hidden, experts, dtype=dtype)
    w13 = torch.randn(experts, hidden, 2 * inter, dtype=dtype).mul_(hidden ** -0.5)
    w2 = torch.randn(experts, inter, hidden, dtype=dtype).mul_(inter ** -0.5)
    return w_gate, w13, w2


def _oracle(x, w_gate, w13, w2):
    """The fp32 layer, casting one expert's weights at a time (a full fp32 copy would not fit)."""
    xf, gate = x.float(), w_gate.float()
    probs = torch.softmax(xf @ gate, dim=-1)
    weights, chosen = torch.topk(probs, TOP_K, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(xf)
    inter = w13.shape[-1] // 2
    for e in range(w13.shape[0]):
        token, slot = torch.where(chosen == e)
        if token.numel() == 0:
            continue
        h = xf[token] @ w13[e].float()
        h = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, token, (h @ w2[e].float()) * weights[token, slot, None])
    return out


def _gemms_alone(x, w_gate, w13, w2):
    """The expert GEMMs of the layer on pre-routed, pre-activated rows (same token counts)."""
    probs = torch.softmax((x @ w_gate).float(), dim=-1)
    chosen = torch.topk(probs, TOP_K, dim=-1).indices
    counts = torch.bincount(chosen.flatten(), minlength=w13.shape[0]).tolist()
    inter = w13.shape[-1] // 2
    rows = [x.new_empty(m, x.shape[1]).normal_() for m in counts]
    acts = [x.new_empty(m, inter).normal_() for m in counts]

    def run():
        return [(r @ w13[e], a @ w2[e]) for e, (r, a) in enumerate(zip(rows, acts)) if r.shape[0]]

    return run


def moe_layer_fwd(t, dtype, threads):
    inter = INTER[dtype]
    w_gate, w13, w2 = _weights(HIDDEN, inter, EXPERTS, dtype)
    x = torch.randn(t, HIDDEN, dtype=dtype)
    return Timed(
        ours=lambda: npu_moe_layer(x, w_gate, w13, w2, TOP_K),
        baselines={"eager": lambda: reference.native_moe_layer(x, w_gate, w13, w2, TOP_K),
                   "gemms": _gemms_alone(x, w_gate, w13, w2)},
        reference=lambda: _oracle(x, w_gate, w13, w2),
    )


def grouped_matmul_shapes(quick: bool):
    """(M, E, K, N): M token rows over E experts (sizes from quant._expert_sizes)."""
    if quick:
        return [(32, 8, 1024, 1024), (512, 8, 1024, 1024)]
    return [(16, 16, 4096, 1536), (256, 16, 4096, 1536), (2048, 16, 4096, 1536)]


def native_grouped_matmul(x, w, bias, sizes):
    """The per-expert loop: x_g @ w_g (+ b_g) in x's dtype."""
    ys = []
    for g, xg in enumerate(x.split(sizes)):
        y = xg @ w[g]
        ys.append(y if bias is None else y + bias[g])
    return torch.cat(ys)


def grouped_matmul_fwd(m, e, k, n, dtype, with_bias, threads):
    sizes = _expert_sizes(m, e, torch.Generator().manual_seed(0))
    group_list = torch.tensor(sizes).cumsum(0)
    x = randn(m, k, dtype=dtype)
    w = randn(e, k, n, dtype=dtype).mul_(k ** -0.5)
    bias = randn(e, n, dtype=dtype) if with_bias else None
    native = functools.partial(native_grouped_matmul, sizes=sizes)
    native_compiled = compiled(native, x, w, bias, threads=threads)
    xf, wf = x.float(), w.float()
    bf = bias.float() if with_bias else None
    return Timed(
        ours=lambda: npu.npu_grouped_matmul([x], [w], bias=None if bias is None else [bias],
                                            group_list=group_list, split_item=3,
                                            group_type=0)[0],
        baselines={"eager": lambda: native(x, w, bias),
                   "compile": lambda: native_compiled(x, w, bias),
                   "fp32 gemms": lambda: native(xf, wf, bf)},
        reference=lambda: native(xf, wf, bf),
    )


def cases(quick: bool, dtypes):
    for (m, e, k, n), dtype in itertools.product(grouped_matmul_shapes(quick), dtypes):
        for with_bias in (False, True):
            # x, the experts' weights (and biases) read, output written
            nbytes = (m * k + e * k * n + m * n + (e * n if with_bias else 0)) * dtype.itemsize
            yield Case("grouped_matmul", "fwd",
                       f"M={m} E={e} K={k} N={n}" + (" bias" if with_bias else ""), dtype,
                       nbytes, functools.partial(grouped_matmul_fwd, m, e, k, n, dtype,
                                                 with_bias),
                       ("npu_grouped_matmul",), flops=2 * m * k * n)
    for t, dtype in itertools.product(tokens(quick), dtypes):
        inter = INTER[dtype]
        e = dtype.itemsize
        shape = f"T={t} E={EXPERTS} k={TOP_K} I={inter}"
        # Bytes: every expert's weights read once (at T=16 the layer streams them), x and out.
        nbytes = EXPERTS * 3 * HIDDEN * inter * e + 2 * t * HIDDEN * e
        # Few tokens stream the weights (reported as GB/s against the copy bandwidth); many
        # tokens are compute-bound (GFLOP/s of the 3 projections of T*k rows; the gate is tiny).
        flops = 6 * t * TOP_K * HIDDEN * inter if t >= 64 else 0
        yield Case("moe_layer", "fwd", shape, dtype, nbytes,
                   functools.partial(moe_layer_fwd, t, dtype),
                   ("npu_moe_gating_top_k_softmax", "npu_moe_init_routing",
                    "npu_moe_compute_expert_tokens", "npu_grouped_matmul",
                    "npu_moe_finalize_routing", "npu_swiglu"),
                   flops=flops)
