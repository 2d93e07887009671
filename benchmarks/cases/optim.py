"""Fused optimizers: NpuFusedAdamW.step and clip_grad_norm_fused_.

Parameter lists: GPT-2 small (124 M parameters in 148 tensors) and 10,000 small tensors (1 to 2048
elements each, about 10 M in all). Baselines: torch.optim.AdamW with foreach=False (torch's CPU
default), foreach=True and fused=True; and, as the measurement behind the list-vs-flat-buffer
decision (README), our own kernel stepping one flat buffer holding every parameter (torch_npu's
combined-buffer layout, without the one-off cost of combining). clip_grad_norm_fused_ is timed
against torch.nn.utils.clip_grad_norm_(foreach=True), with nothing to clip (a read pass for us;
torch also multiplies by 1) and clipping on every call (two read passes and a write).

Effective bytes of a step: p, g, exp_avg, exp_avg_sq read and p, exp_avg, exp_avg_sq written, 7
tensors of the parameters' dtype; of a norm: the gradients read once; of a clip: read twice and
written once.
"""

from __future__ import annotations

import torch
from opennpu import optim

from ..common import Case, Timed, gpt2_small_shapes


def small_shapes(count=10_000, largest=2048):
    gen = torch.Generator().manual_seed(0)
    return [(int(n),) for n in torch.randint(1, largest + 1, (count,), generator=gen)]


PARAM_LISTS = {
    "GPT-2 small 124M params": gpt2_small_shapes,
    "10k small tensors": small_shapes,
}


def _params(shapes, dtype):
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape) * 1e-2).to(dtype)
    return params


def _flat(params):
    """One parameter and gradient holding all of them: torch_npu's combined buffer."""
    flat = torch.nn.Parameter(torch.cat([p.detach().flatten() for p in params]))
    flat.grad = torch.cat([p.grad.flatten() for p in params])
    return flat


def adamw_step(shapes, dtype, threads):
    params = _params(shapes, dtype)
    ours = optim.NpuFusedAdamW(params, lr=1e-4)
    flat_opt = optim.NpuFusedAdamW([_flat(params)], lr=1e-4)
    peers = {name: torch.optim.AdamW(params, lr=1e-4, **kw) for name, kw in (
        ("foreach=False", dict(foreach=False)), ("foreach=True", dict(foreach=True)),
        ("fused=True", dict(fused=True)))}
    return Timed(ours=ours.step,
                 baselines={**{name: opt.step for name, opt in peers.items()},
                            "flat buffer": flat_opt.step},
                 reference=None)


def clip(shapes, dtype, threads, clipping):
    """clip_grad_norm_fused_ against clip_grad_norm_(foreach=True), each on its own gradients.

    clipping=False: max_norm = inf, nothing to scale (ours reads the gradients once; torch still
    multiplies them by 1). clipping=True: every call clips to 0.9x the norm the previous call
    returned, so every call scales (the gradients shrink 10% per call, far from underflow within a
    benchmark's calls); both read the gradients twice and write them once."""
    mine, theirs = _params(shapes, dtype), _params(shapes, dtype)
    ours = optim.NpuFusedAdamW(mine)

    def torch_clip(max_norm):
        return torch.nn.utils.clip_grad_norm_(theirs, max_norm, foreach=True)

    def shrinking(fn):
        last = [None]

        def run():
            max_norm = float("inf") if not clipping else (
                1e-3 if last[0] is None else 0.9 * float(last[0]))
            last[0] = fn(max_norm)
            return last[0]
        return run

    return Timed(ours=shrinking(ours.clip_grad_norm_fused_),
                 baselines={"clip_grad_norm_": shrinking(torch_clip)}, reference=None)


def cases(quick: bool, dtypes):
    out = []
    for label, make_shapes in PARAM_LISTS.items():
        if quick and label.startswith("GPT-2"):
            continue  # 124 M parameters: minutes with every baseline
        shapes = make_shapes()
        numel = sum(torch.Size(s).numel() for s in shapes)
        for dtype in dtypes:
            size = torch.empty((), dtype=dtype).element_size()
            out.append(Case("adamw", "step", label, dtype, 7 * numel * size,
                            lambda n, s=shapes, d=dtype: adamw_step(s, d, n)))
            out.append(Case("clip_grad_norm", "norm", label, dtype, numel * size,
                            lambda n, s=shapes, d=dtype: clip(s, d, n, clipping=False)))
            out.append(Case("clip_grad_norm", "clip", label, dtype, 3 * numel * size,
                            lambda n, s=shapes, d=dtype: clip(s, d, n, clipping=True)))
    return out
