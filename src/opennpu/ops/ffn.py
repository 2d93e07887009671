"""npu_ffn: the feed-forward block ``act(x @ W1 + b1) @ W2 + b2``, dense or split by experts,
in float, int8-quantised and weight-only-int8 forms. Inference only (as in torch_npu).
"""

from __future__ import annotations

import torch

from ._registry import DIFFERENTIABILITY, register_fake

_ops = torch.ops.npu
_ops.npu_ffn  # resolves the op, so that dir(torch.ops.npu) (the torch_npu alias list) has it

_GLU = ("geglu", "swiglu", "reglu")


def npu_ffn(x, weight1, weight2, activation, *, expert_tokens=None, expert_tokens_index=None,
            bias1=None, bias2=None, scale=None, offset=None, deq_scale1=None, deq_scale2=None,
            antiquant_scale1=None, antiquant_scale2=None, antiquant_offset1=None,
            antiquant_offset2=None, inner_precise=None, output_dtype=None):
    """FFN: ``y = act(x @ W1 + b1) @ W2 + b2``; with experts, rows split by expert.

    - ``x`` ``[..., K1]``; ``weight1`` ``[K1, N1]`` and ``weight2`` ``[K2, N2]``, or with experts
      ``[E, K1, N1]`` / ``[E, K2, N2]`` plus ``expert_tokens`` (rows per expert, in order; sum =
      M) or ``expert_tokens_index`` (their cumulative ends, last = M); at most 256 experts.
      K1 = N2 (the output has x's shape).
    - ``activation``: ``fastgelu`` (``z * sigmoid(1.702 z)``), ``gelu`` (tanh approximation),
      ``relu``, ``silu`` (N1 = K2), or the GLU forms ``geglu`` / ``swiglu`` / ``reglu``
      (N1 = 2 * K2): the first GEMM's halves ``a | b`` give ``a * act(b)``, the second half
      activated, as Ascend's FFN kernel computes it.
    - float path: x and weights float32, float16 or bfloat16 (one dtype), optional float biases
      ``[N1]`` / ``[N2]`` (``[E, N]`` with experts). fp32 accumulation, bias and activation in
      fp32; for fp16 / bf16 the intermediate is rounded once to x's dtype (the second GEMM's
      operand) and the output once. ``inner_precise`` (0 or 1) is accepted; both compute this
      way (high precision costs nothing on a CPU).
    - weight-only: float x with int8 weights and ``antiquant_scale1/2`` (``antiquant_offset1/2``
      optional), per output channel: ``W' = (W + antiquant_offset) * antiquant_scale``,
      rounded to x's dtype.
    - quantised: int8 x and weights, int32 biases, float32 ``scale`` (per tensor ``[1]`` /
      ``[E]`` or per channel ``[K2]`` / ``[E, K2]``) and ``offset`` (``[1]`` / ``[E]``,
      default 0), ``deq_scale1`` ``[N1]`` and ``deq_scale2`` ``[N2]`` of one dtype: int64 /
      uint64 (torch_npu's packed form: float32 bits in the low 32 bits, 19 significant bits) or
      float32 for a float16 output (``output_dtype`` None or torch.float16), bfloat16 for a
      bfloat16 output. ``y = ((act((x @ W1 + b1) * deq_scale1) * scale + offset) @ W2 + b2) *
      deq_scale2`` with the intermediate rounded half to even and saturated to int8.

    Not differentiable: a backward through it raises.
    """
    return _ops.npu_ffn(x, weight1, weight2, activation, expert_tokens=expert_tokens,
                        expert_tokens_index=expert_tokens_index, bias1=bias1, bias2=bias2,
                        scale=scale, offset=offset, deq_scale1=deq_scale1,
                        deq_scale2=deq_scale2, antiquant_scale1=antiquant_scale1,
                        antiquant_scale2=antiquant_scale2, antiquant_offset1=antiquant_offset1,
                        antiquant_offset2=antiquant_offset2, inner_precise=inner_precise,
                        output_dtype=output_dtype)


# ----------------------------------------------------------------------------- fake kernel


@register_fake("npu::npu_ffn")
def _ffn_fake(x, weight1, weight2, activation, *, expert_tokens=None, expert_tokens_index=None,
              bias1=None, bias2=None, scale=None, offset=None, deq_scale1=None, deq_scale2=None,
              antiquant_scale1=None, antiquant_scale2=None, antiquant_offset1=None,
              antiquant_offset2=None, inner_precise=None, output_dtype=None):
    torch._check(x.dim() >= 2, lambda: "npu_ffn: argument 'x' must have at least 2 dims")
    torch._check(weight1.dim() in (2, 3) and weight2.dim() == weight1.dim(),
                 lambda: "npu_ffn: weights must be [K, N] or [E, K, N], both alike")
    k1, n1 = weight1.shape[-2], weight1.shape[-1]
    k2, n2 = weight2.shape[-2], weight2.shape[-1]
    torch._check(x.shape[-1] == k1, lambda: "npu_ffn: x's last dim must be K1")
    torch._check(n2 == k1, lambda: "npu_ffn: weight2 must have N2 = K1 columns")
    torch._check(n1 == (2 * k2 if activation in _GLU else k2),
                 lambda: "npu_ffn: weight1's N1 must be K2 (2 * K2 for GLU activations)")
    if x.dtype == torch.int8:
        dtype = output_dtype if output_dtype is not None else torch.float16
    else:
        dtype = x.dtype
    return x.new_empty((*x.shape[:-1], n2), dtype=dtype)


# ----------------------------------------------------------------------------- autograd


class _NoGradient(torch.autograd.Function):
    """Ties npu_ffn's output to its differentiable inputs with a backward that raises."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("npu_ffn: not differentiable (inference only, as in torch_npu); "
                           "compose F.linear and the activation for training")


@torch.library.impl("npu::npu_ffn", "Autograd")
def _ffn_autograd(*args, **kwargs):
    with torch._C._AutoDispatchBelowAutograd():
        out = _ops.npu_ffn(*args, **kwargs)
    needs_grad = [t for t in (*args, *kwargs.values())
                  if isinstance(t, torch.Tensor) and t.requires_grad]
    if not (torch.is_grad_enabled() and needs_grad):
        return out
    return _NoGradient.apply(out, *needs_grad)


DIFFERENTIABILITY["npu_ffn"] = "not differentiable: inference only (torch_npu has no gradient)"

__all__ = ["npu_ffn"]
