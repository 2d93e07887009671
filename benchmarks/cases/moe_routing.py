"""MoE routing ops alone, each against its native composition and torch.compile of it:

- moe_token_permute (fwd: argsort + index_select, and the argsort of the sort for
  sorted_indices; bwd: the index_add of index_select's backward),
- moe_token_unpermute (fwd: index_select by sorted_indices, * probs, sum over the K slots;
  bwd: autograd of that composition),
- the routing-map forms (masked_select + index_select; index_select, * probs[routing_map], sum),
- moe_gating_v2 (softmax + topk), moe_init_routing_v2 (stable sort + gather + bincount).

Megatron / vllm-ascend shapes: T tokens, H hidden, top-K of E experts (bf16 tokens, fp32 probs).
"""

from __future__ import annotations

import functools
import itertools

import torch
from opennpu.testing.timing import autograd_backward, compiled

from ..common import Case, Timed, randn

npu = torch.ops.npu
EXPERTS, TOP_K = 64, 8


def shapes(quick: bool):
    tokens = (1024,) if quick else (256, 1024, 4096)
    hidden = (4096,) if quick else (2048, 4096)
    return itertools.product(tokens, hidden)


def native_permute(tokens, indices):
    order = torch.argsort(indices.view(-1), stable=True)
    permuted = tokens.index_select(0, order // indices.shape[1])
    return permuted, torch.argsort(order).to(torch.int32)


def native_unpermute(permuted, sorted_indices, probs):
    rows = permuted.index_select(0, sorted_indices.long())
    rows = rows.view(*probs.shape, -1) * probs.unsqueeze(-1).to(rows.dtype)
    return rows.sum(dim=1)


def fp32_unpermute(permuted, sorted_indices, probs):
    rows = permuted.float().index_select(0, sorted_indices.long())
    return (rows.view(*probs.shape, -1) * probs.float().unsqueeze(-1)).sum(dim=1)


def _routing(t, h, dtype):
    tokens = randn(t, h, dtype=dtype)
    indices = torch.randint(0, EXPERTS, (t, TOP_K))
    probs = torch.softmax(torch.randn(t, TOP_K), dim=-1)
    return tokens, indices, probs


def permute_fwd(t, h, dtype, threads):
    tokens, indices, _ = _routing(t, h, dtype)
    native_compiled = compiled(native_permute, tokens, indices, threads=threads)
    return Timed(
        ours=lambda: npu.npu_moe_token_permute(tokens, indices),
        baselines={"eager": lambda: native_permute(tokens, indices),
                   "compile": lambda: native_compiled(tokens, indices)},
        reference=lambda: native_permute(tokens.float(), indices),
    )


def permute_bwd(t, h, dtype, threads):
    tokens, indices, _ = _routing(t, h, dtype)
    grad = randn(t * TOP_K, h, dtype=dtype)
    native_compiled = compiled(lambda x: native_permute(x, indices)[0], tokens, threads=threads)
    return Timed(
        ours=autograd_backward(lambda x: npu.npu_moe_token_permute(x, indices)[0], (tokens,),
                               grad),
        baselines={"eager": autograd_backward(lambda x: native_permute(x, indices)[0], (tokens,),
                                              grad),
                   "compile": autograd_backward(native_compiled, (tokens,), grad)},
        reference=lambda: (grad.float().view(-1, h)[torch.argsort(torch.argsort(
            indices.view(-1), stable=True))].view(t, TOP_K, h).sum(1),),
    )


def unpermute_fwd(t, h, dtype, threads):
    tokens, indices, probs = _routing(t, h, dtype)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    native_compiled = compiled(native_unpermute, permuted, sorted_indices, probs,
                               threads=threads)
    return Timed(
        ours=lambda: npu.npu_moe_token_unpermute(permuted, sorted_indices, probs),
        baselines={"eager": lambda: native_unpermute(permuted, sorted_indices, probs),
                   "compile": lambda: native_compiled(permuted, sorted_indices, probs)},
        reference=lambda: fp32_unpermute(permuted, sorted_indices, probs),
    )


def unpermute_bwd(t, h, dtype, threads):
    tokens, indices, probs = _routing(t, h, dtype)
    permuted, sorted_indices = npu.npu_moe_token_permute(tokens, indices)
    grad = randn(t, h, dtype=dtype)
    native_compiled = compiled(lambda r, p: native_unpermute(r, sorted_indices, p), permuted,
                               probs, threads=threads)
    inputs = (permuted, probs)
    return Timed(
        ours=autograd_backward(
            lambda r, p: npu.npu_moe_token_unpermute(r, sorted_indices, p), inputs, grad),
        baselines={"eager": autograd_backward(
            lambda r, p: native_unpermute(r, sorted_indices, p), inputs, grad),
            "compile": autograd_backward(native_compiled, inputs, grad)},
        reference=lambda: _fp32_unpermute_grads(permuted, sorted_indices, probs, grad),
    )


def _fp32_unpermute_grads(permuted, sorted_indices, probs, grad):
    r = permuted.float().requires_grad_()
    p = probs.float().requires_grad_()
    with torch.enable_grad():
        out = fp32_unpermute(r, sorted_indices, p)
    return torch.autograd.grad(out, (r, p), grad.float())


def native_gating(x, k):
    probs = torch.softmax(x.float(), dim=-1)
    y, idx = torch.topk(probs, k, dim=-1)
    return y.to(x.dtype), idx.to(torch.int32)


def stable_gating(x, k):
    """The golden: float32 softmax, stable ranking (ties to the lower expert)."""
    probs = torch.softmax(x.float(), dim=-1)
    idx = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]
    return probs.gather(-1, idx), idx.to(torch.int32)


def gating_v2_fwd(t, dtype, threads):
    x = randn(t, EXPERTS, dtype=dtype)
    native_compiled = compiled(native_gating, x, TOP_K, threads=threads)
    return Timed(
        ours=lambda: npu.npu_moe_gating_top_k_softmax_v2(x, k=TOP_K)[:2],
        baselines={"eager": lambda: native_gating(x, TOP_K),
                   "compile": lambda: native_compiled(x, TOP_K)},
        reference=lambda: stable_gating(x, TOP_K),  # bf16 logits tie often: topk's order differs
    )


def native_init_routing_v2(x, expert_idx):
    """vllm-ascend's call (dropless, full range, counts): sort, gather, gather index, counts."""
    flat = expert_idx.view(-1)
    order = torch.argsort(flat, stable=True)
    expanded_x = x.index_select(0, order // expert_idx.shape[1])
    row_idx = torch.argsort(order).to(torch.int32)
    counts = torch.bincount(flat, minlength=EXPERTS)
    return expanded_x, row_idx, counts


def init_routing_v2_fwd(t, h, dtype, threads):
    x, expert_idx, _ = _routing(t, h, dtype)
    expert_idx = expert_idx.to(torch.int32)
    native_compiled = compiled(native_init_routing_v2, x, expert_idx, threads=threads)
    return Timed(
        ours=lambda: npu.npu_moe_init_routing_v2(
            x, expert_idx, active_num=t * TOP_K, expert_num=EXPERTS, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, active_expert_range=[0, EXPERTS])[:3],
        baselines={"eager": lambda: native_init_routing_v2(x, expert_idx),
                   "compile": lambda: native_compiled(x, expert_idx)},
        reference=lambda: native_init_routing_v2(x.float(), expert_idx),
    )


def _routing_map(t):
    chosen = torch.rand(t, EXPERTS).argsort(dim=-1)[:, :TOP_K]
    return torch.zeros(t, EXPERTS, dtype=torch.bool).scatter(1, chosen, True)


def native_permute_with_routing_map(tokens, routing_map, probs):
    """Megatron's permute with a routing map (op-plugin's golden)."""
    mask = routing_map.T.contiguous()
    token_ids = torch.arange(tokens.shape[0]).unsqueeze(0).expand(mask.shape[0], -1)
    token_ids = token_ids.masked_select(mask)
    return tokens.index_select(0, token_ids), probs.T.masked_select(mask)


def permute_with_routing_map_fwd(t, h, dtype, threads):
    tokens, _, _ = _routing(t, h, dtype)
    routing_map, probs = _routing_map(t), torch.rand(t, EXPERTS)
    native_compiled = compiled(native_permute_with_routing_map, tokens, routing_map, probs,
                               threads=threads)
    return Timed(
        ours=lambda: npu.npu_moe_token_permute_with_routing_map(
            tokens, routing_map, probs=probs, num_out_tokens=t * TOP_K)[:2],
        baselines={"eager": lambda: native_permute_with_routing_map(tokens, routing_map, probs),
                   "compile": lambda: native_compiled(tokens, routing_map, probs)},
        reference=lambda: native_permute_with_routing_map(tokens.float(), routing_map, probs),
    )


def native_unpermute_with_routing_map(permuted, sorted_indices, routing_map, probs):
    rows = permuted.index_select(0, sorted_indices.long()).view(routing_map.shape[0], TOP_K, -1)
    weights = probs.masked_select(routing_map).view(-1, TOP_K, 1).to(rows.dtype)
    return (rows * weights).sum(dim=1)


def unpermute_with_routing_map_fwd(t, h, dtype, threads):
    tokens, _, _ = _routing(t, h, dtype)
    routing_map, probs = _routing_map(t), torch.rand(t, EXPERTS)
    permuted, _, sorted_indices = npu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, num_out_tokens=t * TOP_K)
    args = (permuted, sorted_indices, routing_map, probs)
    native_compiled = compiled(native_unpermute_with_routing_map, *args, threads=threads)
    return Timed(
        ours=lambda: npu.npu_moe_token_unpermute_with_routing_map(
            permuted, sorted_indices, [t, h], probs=probs, routing_map=routing_map),
        baselines={"eager": lambda: native_unpermute_with_routing_map(*args),
                   "compile": lambda: native_compiled(*args)},
        reference=lambda: native_unpermute_with_routing_map(permuted.float(), *args[1:]),
    )


def cases(quick: bool, dtypes):
    for (t, h), dtype in itertools.product(shapes(quick), dtypes):
        e = dtype.itemsize
        shape = f"T={t} H={h} K={TOP_K} E={EXPERTS}"
        rows = t * TOP_K * h * e  # the permuted rows, read or written once
        yield Case("moe_token_permute", "fwd", shape, dtype, rows + t * h * e,
                   functools.partial(permute_fwd, t, h, dtype), ("npu_moe_token_permute",))
        yield Case("moe_token_permute", "bwd", shape, dtype, rows + t * h * e,
                   functools.partial(permute_bwd, t, h, dtype),
                   ("npu_moe_token_permute", "npu_moe_token_permute_grad_v2"))
        yield Case("moe_token_unpermute", "fwd", shape, dtype, rows + t * h * e,
                   functools.partial(unpermute_fwd, t, h, dtype), ("npu_moe_token_unpermute",))
        yield Case("moe_token_unpermute", "bwd", shape, dtype, 2 * rows + t * h * e,
                   functools.partial(unpermute_bwd, t, h, dtype),
                   ("npu_moe_token_unpermute", "npu_moe_token_unpermute_grad_v2"))
        yield Case("moe_token_permute", "fwd", shape + " routing_map", dtype, rows + t * h * e,
                   functools.partial(permute_with_routing_map_fwd, t, h, dtype),
                   ("npu_moe_token_permute_with_routing_map",))
        yield Case("moe_token_unpermute", "fwd", shape + " routing_map", dtype,
                   rows + t * h * e, functools.partial(unpermute_with_routing_map_fwd, t, h, dtype),
                   ("npu_moe_token_unpermute_with_routing_map",))
        yield Case("moe_init_routing_v2", "fwd", shape, dtype, rows + t * h * e,
                   functools.partial(init_routing_v2_fwd, t, h, dtype),
                   ("npu_moe_init_routing_v2",))
    for t, dtype in itertools.product((1024,) if quick else (256, 4096), dtypes):
        yield Case("moe_gating_v2", "fwd", f"T={t} E={EXPERTS} k={TOP_K}", dtype,
                   t * EXPERTS * dtype.itemsize, functools.partial(gating_v2_fwd, t, dtype),
                   ("npu_moe_gating_top_k_softmax_v2",))
