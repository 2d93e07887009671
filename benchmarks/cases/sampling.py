"""Token filtering and sampling (npu_top_k_top_p, npu_top_k_top_p_sample) at LLM vocabularies
(32000: Llama 2; 152064: Qwen 2) and decode batches of 1 to 64.

The native composition is what vLLM and the goldens write: a stable sort of the whole row, the
k-th largest gathered as a threshold, a float32 softmax and cumsum for top-p, a scatter back
(vLLM's apply_top_k_top_p); for sampling the same filters, then argmax of prob / q over the
kept entries (vLLM's exponential-race sampler). The op sorts only the entries top-k keeps. The
bandwidth column counts the logits read and the output written once.
"""

from __future__ import annotations

import functools
import math

import torch
from opennpu.testing.timing import compiled

from ..common import Case, Timed, randn

npu = torch.ops.npu
K_MAX = 1024


def native_top_k_top_p(logits, p, k):
    vals, order = logits.sort(dim=-1, stable=True)
    kth = vals.gather(1, (vals.size(1) - k.long()).unsqueeze(1))
    vals = vals.masked_fill(vals < kth, -math.inf)
    mass = vals.float().softmax(-1).cumsum(-1)
    drop = mass <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    vals = vals.masked_fill(drop, -math.inf)
    return torch.empty_like(vals).scatter_(1, order, vals)


def native_sample(logits, k, p, q):
    vals, order = logits.float().sort(dim=-1, descending=True, stable=True)
    pos = torch.arange(vals.size(1), device=logits.device)
    in_k = pos < k.long().unsqueeze(1)
    prob = vals.masked_fill(~in_k, -math.inf).softmax(-1)
    keep = in_k & ~((prob.cumsum(-1) - prob) >= p.float().unsqueeze(1))
    score = (prob / (q.abs() + 1e-8)).masked_fill(~keep, -math.inf)
    return order.gather(1, score.argmax(-1, keepdim=True)).squeeze(1)


def _inputs(rows, vocab, dtype):
    g = torch.Generator().manual_seed(0)
    logits = randn(rows, vocab, dtype=dtype) * 3
    p = (torch.rand(rows, generator=g) * 0.5 + 0.5).to(dtype)
    k = torch.randint(10, K_MAX, (rows,), generator=g, dtype=torch.int32)
    return logits, p, k


def _timed(ours, native, args, threads):
    """ours(*args) against native(*args) eager and compiled; native is the reference too."""
    native_compiled = compiled(native, *args, threads=threads)
    return Timed(ours=lambda: ours(*args),
                 baselines={"eager": lambda: native(*args),
                            "compile": lambda: native_compiled(*args)},
                 reference=lambda: native(*args))


def filter_case(rows, vocab, dtype, threads):
    logits, p, k = _inputs(rows, vocab, dtype)
    return _timed(npu.npu_top_k_top_p, native_top_k_top_p, (logits, p, k), threads)


def sample_case(rows, vocab, dtype, threads):
    logits, p, k = _inputs(rows, vocab, dtype)
    q = torch.empty(rows, vocab).exponential_(generator=torch.Generator().manual_seed(1))
    return _timed(lambda *a: npu.npu_top_k_top_p_sample(*a)[0], native_sample, (logits, k, p, q),
                  threads)


def cases(quick: bool, dtypes):
    shapes = ((1, 152064), (16, 32000), (64, 152064)) if quick else \
        ((1, 32000), (1, 152064), (16, 32000), (16, 152064), (64, 32000), (64, 152064))
    for dtype in dtypes:
        for rows, vocab in shapes:
            nbytes = 2 * rows * vocab * dtype.itemsize
            yield Case("top_k_top_p", "fwd", f"B={rows} V={vocab}", dtype, nbytes,
                       functools.partial(filter_case, rows, vocab, dtype), ("npu_top_k_top_p",))
            # the index output is tiny: the bytes are the logits and q read
            yield Case("top_k_top_p_sample", "fwd", f"B={rows} V={vocab}", dtype,
                       rows * vocab * (dtype.itemsize + 4),
                       functools.partial(sample_case, rows, vocab, dtype),
                       ("npu_top_k_top_p_sample",))
