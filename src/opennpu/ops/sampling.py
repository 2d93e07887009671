"""Sampling: npu_top_k_top_p (Ascend ApplyTopKTopP) and npu_top_k_top_p_sample (TopKTopPSample),
the last step of an inference server (vllm-ascend's sampler, SGLang's Ascend sampler).

Both work per row of 2-D ``[batch, vocab]`` logits (float32 / float16 / bfloat16, computed in
float32) and follow op-plugin's goldens, stable-sort order and ties included, without sorting
the whole vocabulary: a row selects its largest entries (nth_element) and sorts only those, and
top-p without top-k grows that set only as far as the probability mass requires.

Neither is differentiable (torch_npu registers no gradient; their outputs are masks, indices and
copies of input values).
"""

from __future__ import annotations

import torch

from ._registry import mark_not_differentiable, register_fake

_ops = torch.ops.npu


def npu_top_k_top_p(logits, p=None, k=None):
    """Top-k then top-p filtering of ``logits`` [B, V]: removed entries become ``-inf``.

    Per row b, the golden of op-plugin (vLLM's ``apply_top_k_top_p``):

    - top-k (``k`` int32 / int64 [B], values in [1, V]): entries below the k[b]-th largest value
      become -inf; ties with it are all kept (so more than k can remain);
    - top-p (``p`` [B], float): the softmax (float32) of what top-k kept, summed from the smallest
      probability up in stable ascending order; entries whose running sum is <= ``1 - p[b]``
      (computed in p's dtype) become -inf, the largest entry always stays. p = 1 keeps every entry
      of nonzero probability, p = 0 only the largest.

    Either may be None (skipped); with both None the result is a copy. Returns logits' dtype and
    shape. k outside [1, V] is an error (the golden's gather fails there too)."""
    return _ops.npu_top_k_top_p(logits, p, k)


def npu_top_k_top_p_sample(logits, top_k, top_p, q=None, eps=1e-8, is_need_logits=False,
                           top_k_guess=32, min_ps=None, ks_max=1024, input_is_logits=True,
                           post_sample="qSample", generator=None):
    """Top-k, top-p and min-p filtering, then one token per row; returns
    ``(logits_select_idx [B] int64, logits_top_kp_select)``.

    Per row b, as op-plugin's golden (entries sorted by value, descending, stable):

    - top-k when ``1 <= top_k[b] <= min(V, ks_max rounded up to 8, 1024)`` (else skipped): the
      top_k[b] largest;
    - probabilities: softmax of those (``input_is_logits``) or the values themselves;
    - top-p when ``top_p[b] < 1``: an entry stays while the mass before it is < top_p[b];
      top_p[b] <= 0 keeps the largest alone (probability 1 with ``input_is_logits``);
    - min-p (``min_ps``, optional): 0 < min_ps[b] < 1 keeps probabilities >= max * min_ps[b];
      >= 1 keeps the first entry alone;
    - with no top-k, no top-p and min_ps[b] < 1 the row is not sorted (entries in index order);
    - the token: ``post_sample='qSample'`` with ``q`` (float32 [B, V]): argmax of
      ``prob[j] / (|q[b, j]| + eps)``, q indexed by the kept entry's position j (an exponential
      race when q ~ Exp(1)); ``'None'`` or q None: argmax of prob; ``'multiNomial'``:
      ``torch.multinomial(probs, 1, replacement=True, generator=generator)`` over the kept
      probabilities (the same Exp(1) draws from ``generator`` or the default generator, so a
      seeded generator reproduces the golden's tokens).

    ``logits_top_kp_select``: with ``is_need_logits``, float32 [B, V] holding the kept entries'
    logits and -inf (0 when not ``input_is_logits``) elsewhere; else an empty float32 tensor.
    ``top_k_guess`` only sizes the first partial sort of top-p without top-k (no effect on the
    result). Not emulated: ``q`` as an int64 per-row (seed, offset) table for 'multiNomial'
    (Ascend's stateless generator; an error here)."""
    return _ops.npu_top_k_top_p_sample(
        logits, top_k, top_p, q=q, eps=eps, is_need_logits=is_need_logits,
        top_k_guess=top_k_guess, min_ps=min_ps, ks_max=ks_max, input_is_logits=input_is_logits,
        post_sample=post_sample, generator=generator)


@register_fake("npu::npu_top_k_top_p")
def _top_k_top_p_fake(logits, p=None, k=None):
    torch._check(logits.dim() == 2, lambda: "npu_top_k_top_p: argument 'logits' must be 2-D")
    return logits.new_empty(logits.shape)


@register_fake("npu::npu_top_k_top_p_sample")
def _top_k_top_p_sample_fake(logits, top_k, top_p, q=None, eps=1e-8, is_need_logits=False,
                             top_k_guess=32, min_ps=None, ks_max=1024, input_is_logits=True,
                             post_sample="qSample", generator=None):
    torch._check(logits.dim() == 2,
                 lambda: "npu_top_k_top_p_sample: argument 'logits' must be 2-D")
    index = logits.new_empty((logits.shape[0],), dtype=torch.int64)
    shape = logits.shape if is_need_logits else (0,)
    return index, logits.new_empty(shape, dtype=torch.float32)


_REASON = "token filtering and sampling: masks, indices and copies; torch_npu registers no gradient"
for _name in ("npu_top_k_top_p", "npu_top_k_top_p_sample"):
    mark_not_differentiable(_name, _REASON)
del _name

__all__ = ["npu_top_k_top_p", "npu_top_k_top_p_sample"]
