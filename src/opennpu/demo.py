"""`python -m opennpu demo`: every available op next to the native PyTorch code it replaces.

Each row runs one op on the seed documents' example shape (or on a large LLM shape, where timing
means something) and prints the max abs error of ours and of the native code against the fp32
oracle, the median times of ours, native eager and torch.compile(native), the speedups, and our
effective bandwidth as a fraction of the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from .testing import reference
from .testing.timing import (autograd_backward, busy_warning, compiled, has_cpu_kernel,
                             max_abs_error, measure_copy_bandwidth, num_threads,
                             reuse_freed_memory, time_fn)

EPS = 1e-6
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPE_NAMES = {F32: "fp32", BF16: "bf16", F16: "fp16"}
npu = torch.ops.npu


@dataclass
class Trial:
    """One row's calls. `ours` returns the outputs `native` computes too (extras dropped)."""

    ours: Callable[[], Any]
    native: Callable[[], Any]
    native_compiled: Callable[[], Any]
    expected: Callable[[], Any]  # the fp32 oracle of those outputs
    nbytes: int  # every input and output of our op, once


def _nbytes(tensors) -> int:
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def forward(op, args, native, native_args, expected, threads, pick=lambda out: out) -> Trial:
    """torch.ops.npu.<op>(*args) against native(*native_args)."""
    call = getattr(npu, op)
    native_compiled = compiled(native, *native_args, threads=threads)
    return Trial(ours=lambda: pick(call(*args)), native=lambda: native(*native_args),
                 native_compiled=lambda: native_compiled(*native_args), expected=expected,
                 nbytes=_nbytes(args) + _nbytes(call(*args)))


def backward(op, args, native, inputs, grad, expected, threads) -> Trial:
    """The backward op alone against autograd through a graph of the native code."""
    call = getattr(npu, op)
    native_compiled = compiled(native, *inputs, threads=threads)
    return Trial(ours=lambda: call(*args), native=autograd_backward(native, inputs, grad),
                 native_compiled=autograd_backward(native_compiled, inputs, grad),
                 expected=expected, nbytes=_nbytes(args) + _nbytes(call(*args)))


def randn(*shape, dtype):
    return torch.randn(*shape).to(dtype)


def ones(n, dtype):
    return torch.ones(n, dtype=dtype)  # the seeds' RMSNorm weight


def rms_norm(shape, dtype, threads):
    x, w = randn(*shape, dtype=dtype), ones(shape[-1], dtype)
    return forward("npu_rms_norm", (x, w, EPS), reference.native_rms_norm, (x, w),
                   lambda: reference.rms_norm(x, w, EPS)[0], threads, pick=lambda out: out[0])


def rms_norm_backward(shape, dtype, threads):
    x, w, dy = randn(*shape, dtype=dtype), ones(shape[-1], dtype), randn(*shape, dtype=dtype)
    rstd = npu.npu_rms_norm(x, w, EPS)[1]
    expected_rstd = reference.rms_norm(x, w, EPS)[1]
    return backward("npu_rms_norm_backward", (dy, x, w, rstd), reference.native_rms_norm, (x, w),
                    dy, lambda: reference.rms_norm_backward(dy, x, w, expected_rstd), threads)


def native_gemma_rms_norm(x, weight):
    return reference.native_rms_norm(x, 1 + weight)


def gemma_rms_norm(shape, dtype, threads):
    x, w = randn(*shape, dtype=dtype), ones(shape[-1], dtype) - 1  # gemma stores gamma - 1
    return forward("npu_gemma_rms_norm", (x, w, EPS), native_gemma_rms_norm, (x, w),
                   lambda: reference.gemma_rms_norm(x, w, EPS)[0], threads, pick=lambda out: out[0])


def add_rms_norm(shape, dtype, threads):
    x1, x2, w = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), ones(shape[-1], dtype)
    return forward("npu_add_rms_norm", (x1, x2, w, EPS), reference.native_add_rms_norm,
                   (x1, x2, w), lambda: reference.add_rms_norm(x1, x2, w, EPS)[::2], threads,
                   pick=lambda out: out[::2])  # (y, x1 + x2)


def add_rms_norm_cast(shape, dtype, threads):
    x1, x2, w = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), ones(shape[-1], dtype)
    return forward("npu_add_rms_norm_cast", (x1, x2, w, EPS), reference.native_add_rms_norm_cast,
                   (x1, x2, w), lambda: [reference.add_rms_norm_cast(x1, x2, w, EPS)[i]
                                         for i in (0, 1, 3)],
                   threads, pick=lambda out: (out[0], out[1], out[3]))  # (y1 fp32, y2, x)


def _smooth(n, dtype):
    return (torch.rand(n) + 0.5).to(dtype)


def dynamic_quant(shape, dtype, threads):
    """Per-token int8 with smooth scales (codes and scales against the golden's fp32 math)."""
    x, smooth = randn(*shape, dtype=dtype), _smooth(shape[-1], dtype)
    native = reference.native_dynamic_quant
    native_compiled = compiled(native, x, smooth, threads=threads)

    def ours():
        return npu.npu_dynamic_quant(x, smooth_scales=smooth)

    return Trial(ours=ours, native=lambda: native(x, smooth),
                 native_compiled=lambda: native_compiled(x, smooth),
                 expected=lambda: reference.dynamic_quant(x, smooth),
                 nbytes=_nbytes((x, smooth)) + _nbytes(ours()))


def add_rms_norm_dynamic_quant(shape, dtype, threads):
    """Seed 003's fusion: npu_add_rms_norm + npu_dynamic_quant(smooth) in one op, branch 1 only."""
    x1, x2, w = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), ones(shape[-1], dtype)
    smooth = _smooth(shape[-1], dtype)
    native = reference.native_add_rms_norm_dynamic_quant
    native_compiled = compiled(native, x1, x2, w, smooth, threads=threads)

    def call():
        return npu.npu_add_rms_norm_dynamic_quant(x1, x2, w, smooth_scale1=smooth, epsilon=EPS,
                                                  output_mask=[True, False])

    def expected():
        y1, _, x, s1, _ = reference.add_rms_norm_dynamic_quant(x1, x2, w, smooth, epsilon=EPS)
        return y1, x, s1

    return Trial(ours=lambda: (lambda o: (o[0], o[2], o[3]))(call()),
                 native=lambda: native(x1, x2, w, smooth),
                 native_compiled=lambda: native_compiled(x1, x2, w, smooth), expected=expected,
                 nbytes=_nbytes((x1, x2, w, smooth)) + _nbytes(call()))


def swiglu(shape, dtype, threads):
    x = randn(*shape, dtype=dtype)
    return forward("npu_swiglu", (x,), reference.native_swiglu, (x,),
                   lambda: reference.swiglu(x), threads)


def swiglu_backward(shape, dtype, threads):
    x, grad = randn(*shape, dtype=dtype), randn(shape[0], shape[1] // 2, dtype=dtype)
    return backward("npu_swiglu_backward", (grad, x), reference.native_swiglu, (x,), grad,
                    lambda: reference.swiglu_backward(grad, x), threads)


def geglu(shape, dtype, threads):
    x = randn(*shape, dtype=dtype)
    return forward("npu_geglu", (x,), reference.native_geglu, (x,),
                   lambda: reference.geglu(x)[0], threads, pick=lambda out: out[0])


def fast_gelu(native):
    def build(shape, dtype, threads):
        x = randn(*shape, dtype=dtype)
        return forward("npu_fast_gelu", (x,), native, (x,), lambda: reference.fast_gelu(x), threads)
    return build


def fast_gelu_backward(shape, dtype, threads):
    x, grad = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    return backward("npu_fast_gelu_backward", (grad, x), reference.native_fast_gelu, (x,), grad,
                    lambda: reference.fast_gelu_backward(grad, x), threads)


def _rotary_inputs(shape, dtype):
    angle = torch.rand(1, shape[1], 1, shape[3]) * 6.283  # r1, r2: [1, S, 1, D]
    return randn(*shape, dtype=dtype), angle.cos().to(dtype), angle.sin().to(dtype)


def rotary_mul(shape, dtype, threads):
    x, r1, r2 = _rotary_inputs(shape, dtype)
    return forward("npu_rotary_mul", (x, r1, r2), reference.native_rotary_mul, (x, r1, r2),
                   lambda: reference.rotary_mul(x, r1, r2), threads)


def rotary_mul_backward(shape, dtype, threads):
    x, r1, r2 = _rotary_inputs(shape, dtype)
    grad = randn(*shape, dtype=dtype)
    return backward("npu_rotary_mul_backward", (grad, x, r1, r2), reference.native_rotary_mul,
                    (x, r1, r2), grad, lambda: reference.rotary_mul_backward(grad, x, r1, r2),
                    threads)


SOFTMAX_SCALE = 0.8


def _softmax_inputs(shape, dtype):
    """Seed 000: x [B, N, S, W] and a [1, 1, S, W] mask from randn >= 1."""
    return randn(*shape, dtype=dtype), torch.randn(1, 1, *shape[-2:]) >= 1


def scaled_masked_softmax(shape, dtype, threads):
    x, mask = _softmax_inputs(shape, dtype)
    return forward("npu_scaled_masked_softmax", (x, mask, SOFTMAX_SCALE),
                   reference.native_scaled_masked_softmax, (x, mask, SOFTMAX_SCALE),
                   lambda: reference.scaled_masked_softmax(x, mask, SOFTMAX_SCALE), threads)


def scaled_masked_softmax_backward(shape, dtype, threads):
    x, mask = _softmax_inputs(shape, dtype)
    dy = randn(*shape, dtype=dtype)
    y = npu.npu_scaled_masked_softmax(x, mask, SOFTMAX_SCALE)
    expected_y = reference.scaled_masked_softmax(x, mask, SOFTMAX_SCALE)

    def native(t):
        return reference.native_scaled_masked_softmax(t, mask, SOFTMAX_SCALE)

    return backward("npu_scaled_masked_softmax_backward", (dy, y, mask, SOFTMAX_SCALE, False),
                    native, (x,), dy,
                    lambda: reference.scaled_masked_softmax_backward(dy, expected_y, mask,
                                                                     SOFTMAX_SCALE), threads)


def _seed_example_two(data):
    return reference.native_confusion_transpose_2(data).contiguous()  # materialised, as the op's


def confusion_transpose(example: int):
    """Seed 000's npu_confusion_transpose examples on BCHW data: one permutes then reshapes, two
    views then transposes."""
    def build(shape, dtype, threads):
        data = randn(*shape, dtype=dtype)
        b, c, h, w = shape
        if example == 1:
            args = ((0, 2, 1, 3), (h, b, c * w), True)
            native = reference.native_confusion_transpose_1
        else:
            args, native = ((1, 0), (b, h * c * w), False), _seed_example_two
        return forward("npu_confusion_transpose", (data, *args), native, (data,),
                       lambda: reference.confusion_transpose(data, *args), threads)
    return build


def fusion_attention(shape, dtype, threads):
    """Seed 000's flash attention: BSH, scale 0.099, a [1, 1, S, S] mask (True = masked out);
    the seed's random mask on its own shape, a causal one on the long sequence."""
    b, n, s, d = shape
    q, k, v = (randn(b, n, s, d, dtype=dtype) for _ in range(3))
    mask = (torch.randn(1, 1, s, s) >= 0) if s <= 128 else torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)

    def to_bsh(t):
        return t.transpose(1, 2).reshape(b, s, n * d)

    args = (to_bsh(q), to_bsh(k), to_bsh(v), n, "BSH", None, None, mask, 0.099)
    trial = forward("npu_fusion_attention", args, reference.native_flash_attention_seed,
                    (q, k, v, mask),
                    lambda: reference.native_flash_attention_seed(q.float(), k.float(), v.float(), mask),
                    threads, pick=lambda out: out[0])
    trial.nbytes = 0  # compute-bound: no bandwidth fraction
    return trial


def moe_gating(shape, dtype, threads):
    x = randn(*shape, dtype=dtype)
    return forward("npu_moe_gating_top_k_softmax", (x, None, 2), native_moe_gating_values, (x, 2),
                   lambda: reference.moe_gating_top_k_softmax(x, None, 2)[0], threads,
                   pick=lambda out: out[0])


def native_moe_gating_values(x, k):
    return reference.native_moe_gating(x, k).values


def _routing_inputs(shape, dtype, experts=8, k=2):
    t, h = shape
    x = randn(t, h, dtype=dtype)
    row_idx = torch.arange(t * k, dtype=torch.int32).view(k, t).t().contiguous()
    expert_idx = torch.randint(0, experts, (t, k), dtype=torch.int32)
    return x, row_idx, expert_idx


def moe_init_routing(shape, dtype, threads):
    x, row_idx, expert_idx = _routing_inputs(shape, dtype)
    args = (x, row_idx, expert_idx, shape[0])
    return forward("npu_moe_init_routing", args, reference.moe_init_routing, args,
                   lambda: reference.moe_init_routing(*args), threads)


def moe_finalize_routing(shape, dtype, threads):
    t, h = shape
    k = 2
    rows, skip1 = randn(t * k, h, dtype=dtype), randn(t, h, dtype=dtype)
    scales = torch.rand(t, k).to(dtype)
    src = torch.randperm(t * k).to(torch.int32)
    return forward("npu_moe_finalize_routing", (rows, skip1, None, None, scales, src, None, 0),
                   reference.native_moe_finalize_routing, (rows, skip1, scales, src),
                   lambda: reference.moe_finalize_routing(rows, skip1, None, None, scales, src,
                                                          None), threads)


MOE_LAYER_OPS = ("npu_moe_gating_top_k_softmax", "npu_moe_init_routing",
                 "npu_moe_compute_expert_tokens", "npu_grouped_matmul", "npu_swiglu",
                 "npu_moe_finalize_routing")


def moe_layer(shape, dtype, threads):
    """A Mixtral-style MoE layer (E=8, top-2) on opennpu ops against the plain PyTorch loop."""
    from .testing.moe_layer import npu_moe_layer

    t, h, inter = shape
    experts, k = 8, 2
    x = randn(t, h, dtype=dtype)
    w_gate = randn(h, experts, dtype=dtype)
    w13 = (torch.randn(experts, h, 2 * inter) / h ** 0.5).to(dtype)
    w2 = (torch.randn(experts, inter, h) / inter ** 0.5).to(dtype)
    weights = (w_gate, w13, w2)
    return Trial(ours=lambda: npu_moe_layer(x, *weights, k),
                 native=lambda: reference.native_moe_layer(x, *weights, k),
                 native_compiled=lambda: reference.native_moe_layer(x, *weights, k),
                 expected=lambda: reference.moe_layer(x, *weights, k), nbytes=0)


def _ffn_native(x, w1, w2, expert_tokens=None):
    return reference.native_ffn(x, w1, w2, "fastgelu", expert_tokens=expert_tokens)


def ffn(shape, dtype, threads):
    """Seed 002's single-op example: x [M, H], W1 [H, I], W2 [I, H], fastgelu, inner_precise=1
    (weights scaled by 1/sqrt(fan-in) so that bf16 values stay O(1))."""
    m, h, i = shape
    x = randn(m, h, dtype=dtype)
    w1 = (torch.randn(h, i) / h ** 0.5).to(dtype)
    w2 = (torch.randn(i, h) / i ** 0.5).to(dtype)
    trial = forward("npu_ffn", (x, w1, w2, "fastgelu"), _ffn_native, (x, w1, w2),
                    lambda: reference.ffn(x, w1, w2, "fastgelu", compute_dtype=torch.float32),
                    threads)
    trial.nbytes = 0  # compute-bound: no bandwidth fraction
    return trial


SEED_EXPERT_TOKENS = [227, 62, 78, 126, 178, 27, 122, 1, 19, 182, 166, 118, 66, 217, 122, 243]


def ffn_experts(shape, dtype, threads):
    """Seed 002's 16-expert example (its expert token list, M = 1954), at H = 1024 and I = 2048
    instead of 2560 / 5120 to keep the demo short."""
    m, h, i = shape
    x = randn(m, h, dtype=dtype)
    w1 = (torch.randn(16, h, i) / h ** 0.5).to(dtype)
    w2 = (torch.randn(16, i, h) / i ** 0.5).to(dtype)
    tokens = tuple(SEED_EXPERT_TOKENS)  # hashable: compiled() keys on the arguments
    call = npu.npu_ffn
    native_compiled = compiled(_ffn_native, x, w1, w2, tokens, threads=threads)
    return Trial(ours=lambda: call(x, w1, w2, "fastgelu", expert_tokens=list(tokens),
                                              inner_precise=1),
                 native=lambda: _ffn_native(x, w1, w2, tokens),
                 native_compiled=lambda: native_compiled(x, w1, w2, tokens),
                 expected=lambda: reference.ffn(x, w1, w2, "fastgelu",
                                                expert_tokens=list(tokens),
                                                compute_dtype=torch.float32),
                 nbytes=0)


class Example(NamedTuple):
    op: str
    direction: str
    shape: tuple
    dtype: torch.dtype
    native: str  # the native code's name; backward rows run autograd through it
    build: Callable[[tuple, torch.dtype, int], Trial]


LLM, GLU, ROPE = (4096, 4096), (4096, 2 * 11008), (2, 8192, 5, 128)
ATTN_SEED, ATTN_LONG = (1, 32, 128, 128), (1, 32, 2048, 128)
SEED_BCHW = (64, 3, 64, 128)
SOFTMAX = (64, 8, 128, 256)
# The first row of each op is the seed document's example.
EXAMPLES = [
    Example("npu_rms_norm", "fwd", (128, 256), F32, "native_rms_norm", rms_norm),
    Example("npu_rms_norm", "fwd", LLM, BF16, "native_rms_norm", rms_norm),
    Example("npu_rms_norm_backward", "bwd", LLM, BF16, "native_rms_norm", rms_norm_backward),
    Example("npu_gemma_rms_norm", "fwd", LLM, BF16, "native_rms_norm(1+w)", gemma_rms_norm),
    Example("npu_add_rms_norm", "fwd", LLM, BF16, "native_add_rms_norm", add_rms_norm),
    Example("npu_add_rms_norm_cast", "fwd", LLM, BF16, "add_rms_norm+.float()", add_rms_norm_cast),
    Example("npu_dynamic_quant", "fwd", LLM, BF16, "x*s,amax,round,clamp", dynamic_quant),
    Example("npu_add_rms_norm_dynamic_quant", "fwd", LLM, BF16, "add_rms_norm+quant",
            add_rms_norm_dynamic_quant),
    Example("npu_swiglu", "fwd", (128, 256), F32, "native_swiglu", swiglu),
    Example("npu_swiglu", "fwd", GLU, BF16, "native_swiglu", swiglu),
    Example("npu_swiglu_backward", "bwd", GLU, BF16, "native_swiglu", swiglu_backward),
    Example("npu_geglu", "fwd", GLU, BF16, "native_geglu", geglu),
    # The seed's native code for fast_gelu is F.gelu, a different function (its error shows it);
    # the large rows compare with the same function written in torch.
    Example("npu_fast_gelu", "fwd", (64, 32), F32, "F.gelu", fast_gelu(reference.native_gelu)),
    Example("npu_fast_gelu", "fwd", (4096, 11008), BF16, "x*sigmoid(1.702x)",
            fast_gelu(reference.native_fast_gelu)),
    Example("npu_fast_gelu_backward", "bwd", (4096, 11008), BF16, "x*sigmoid(1.702x)",
            fast_gelu_backward),
    Example("npu_rotary_mul", "fwd", ROPE, F32, "native_rotary_mul", rotary_mul),
    Example("npu_rotary_mul", "fwd", ROPE, BF16, "native_rotary_mul", rotary_mul),
    Example("npu_rotary_mul_backward", "bwd", ROPE, BF16, "native_rotary_mul", rotary_mul_backward),
    Example("npu_confusion_transpose", "fwd", SEED_BCHW, F32, "permute().reshape()",
            confusion_transpose(1)),
    Example("npu_confusion_transpose", "fwd", SEED_BCHW, F32, "view().transpose()",
            confusion_transpose(2)),
    # BCHW = (4, 4096, 32, 128) read as BSND: example one's permutation is BSND -> BNSD.
    Example("npu_confusion_transpose", "fwd", (4, 4096, 32, 128), BF16, "permute().reshape()",
            confusion_transpose(1)),
    Example("npu_fusion_attention", "fwd", ATTN_SEED, F16, "TorchFlashAttention", fusion_attention),
    Example("npu_fusion_attention", "fwd", ATTN_LONG, BF16, "TorchFlashAttention", fusion_attention),
    Example("npu_scaled_masked_softmax", "fwd", SOFTMAX, F32, "seed (-inf fill)",
            scaled_masked_softmax),
    Example("npu_scaled_masked_softmax", "fwd", SOFTMAX, BF16, "seed (-inf fill)",
            scaled_masked_softmax),
    Example("npu_scaled_masked_softmax_backward", "bwd", SOFTMAX, BF16, "seed (-inf fill)",
            scaled_masked_softmax_backward),
    Example("npu_moe_gating_top_k_softmax", "fwd", (8192, 64), BF16, "topk(softmax)", moe_gating),
    Example("npu_moe_init_routing", "fwd", (4096, 4096), BF16, "sort + gather", moe_init_routing),
    Example("npu_moe_finalize_routing", "fwd", (4096, 4096), BF16, "gather + weighted sum",
            moe_finalize_routing),
    # The whole layer; "comp ms" repeats eager (the loop's data-dependent shapes do not compile).
    Example("MoE layer (npu ops)", "fwd", (64, 1024, 3584), BF16, "Mixtral loop", moe_layer),
    Example("npu_ffn", "fwd", (1, 1280, 10240), F16, "act(x@W1)@W2", ffn),
    Example("npu_ffn", "fwd", (1024, 4096, 11008), BF16, "act(x@W1)@W2", ffn),
    Example("npu_ffn", "fwd", (1954, 1024, 2048), F16, "per-expert loop", ffn_experts),
]

ROW = "{:<36}{:<4}{:<15}{:<5}{:<21}{:>9}{:>9}{:>9}{:>9}{:>9}{:>8}{:>8}{:>6}"
HEADER = ROW.format("op", "dir", "shape", "type", "native", "err ours", "err nat", "ours ms",
                    "eager ms", "comp ms", "x eager", "x comp", "%copy")


def shape_name(shape: tuple) -> str:
    return "x".join(map(str, shape))


# Native code slower than this per call is timed by one call each (eager: the call that checked
# its error): fp16 GEMMs on a CPU without AVX512-FP16 (the seed's fp16 expert loop took 25 s per
# call on a Zen 4) would otherwise spend minutes of the demo on three samples each of eager and
# compiled.
SLOW_CALL = 2.0


def _time_once(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_example(example: Example, threads: int, min_run_time: float, copy_bw: float) -> str:
    """Builds, checks and times one row; returns it formatted."""
    mode = torch.no_grad() if example.direction == "fwd" else torch.enable_grad()
    with mode, num_threads(threads):
        torch.manual_seed(0)
        trial = example.build(example.shape, example.dtype, threads)
        expected = trial.expected()
        err_ours = max_abs_error(trial.ours(), expected)
        start = time.perf_counter()
        err_native = max_abs_error(trial.native(), expected)
        native_call = time.perf_counter() - start
        del expected
        trial.native_compiled()  # compiles before it is timed
        if native_call > SLOW_CALL:  # its untimed first call was as slow as any: it is the time
            ours = time_fn(trial.ours, threads, min_run_time, min_samples=3)["median"]
            eager, comp = native_call, _time_once(trial.native_compiled)
        else:
            ours, eager, comp = (time_fn(fn, threads, min_run_time, min_samples=3)["median"]
                                 for fn in (trial.ours, trial.native, trial.native_compiled))
    return ROW.format(
        example.op, example.direction, shape_name(example.shape),
        DTYPE_NAMES[example.dtype], example.native, f"{err_ours:.1e}", f"{err_native:.1e}",
        f"{ours * 1e3:.3f}", f"{eager * 1e3:.3f}", f"{comp * 1e3:.3f}", f"{eager / ours:.1f}x",
        f"{comp / ours:.1f}x", f"{trial.nbytes / ours / 1e9 / copy_bw:.0%}" if trial.nbytes else "-")


def _ops_of(example: Example) -> tuple[str, ...]:
    """The torch.ops.npu ops a row needs (the MoE layer row runs several)."""
    return MOE_LAYER_OPS if example.build is moe_layer else (example.op,)


def run(threads: int | None = None, min_run_time: float = 0.2) -> None:
    threads = threads or torch.get_num_threads()
    warning = busy_warning()
    reuse_freed_memory()  # steady state: outputs reuse freed memory instead of page-faulting
    copy_bw = measure_copy_bandwidth(threads)
    available = [e for e in EXAMPLES if all(has_cpu_kernel(op) for op in _ops_of(e))]
    rows = []
    for i, example in enumerate(available, 1):
        progress = (f"[{i}/{len(available)}] {example.op} {shape_name(example.shape)} "
                    f"{DTYPE_NAMES[example.dtype]} ...")
        print(f"\r{progress:<70}", end="", file=sys.stderr, flush=True)
        rows.append(run_example(example, threads, min_run_time, copy_bw))
    print(f"\r{'':<70}\r", end="", file=sys.stderr, flush=True)

    print(f"opennpu demo: CPU ({torch.ops.opennpu.cpu_isa()}), {threads} thread(s), copy "
          f"bandwidth {copy_bw:.1f} GB/s (read + write), torch {torch.__version__}")
    print(HEADER, *rows, sep="\n")
    print("err: max |out - fp32 oracle|. Times: medians; bwd rows time the backward alone (ours: "
          "the backward op;\nnative: autograd through its graph). %copy: our effective GB/s (each "
          "input and output once)\nover the copy bandwidth; small shapes stay in cache and can "
          "exceed 100%.")
    print()
    print(training_demo(threads))
    print()
    print(compiled_model_demo(threads))
    print()
    print(npu_device_demo(threads))
    missing = sorted({op for e in EXAMPLES for op in _ops_of(e) if not has_cpu_kernel(op)})
    if missing:
        print(f"not available yet (no CPU kernel): {', '.join(missing)}")
    if warning:
        print(warning)


def training_demo(threads: int, steps: int = 30) -> str:
    """A short training run of one small MLP, stepped by torch_npu.optim.NpuFusedAdamW and by
    torch.optim.AdamW from the same start: the losses agree, the fused step is faster."""
    import time

    from . import optim

    def model():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                  torch.nn.GELU(), torch.nn.Linear(1024, 16)]
        return torch.nn.Sequential(*layers)

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(64, 256, generator=gen), torch.randn(64, 16, generator=gen))
            for _ in range(8)]
    runs = {}
    with num_threads(threads):
        for name, make in (("torch.optim.AdamW", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                           ("torch.optim.AdamW(fused=True)",
                            lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True)),
                           ("NpuFusedAdamW", lambda ps: optim.NpuFusedAdamW(ps, lr=1e-3))):
            net = model()
            opt = make(net.parameters())
            losses, step_time = [], 0.0
            for i in range(steps):
                x, y = data[i % len(data)]
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(net(x), y)
                loss.backward()
                opt.clip_grad_norm_fused_(1.0) if hasattr(opt, "clip_grad_norm_fused_") else \
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                start = time.perf_counter()
                opt.step()
                step_time += time.perf_counter() - start
                losses.append(loss.item())
            runs[name] = (losses, step_time / steps)
    base_losses, base_time = runs["torch.optim.AdamW"]
    n_params = sum(p.numel() for p in model().parameters())
    lines = [f"training demo: MLP of {n_params / 1e6:.1f} M parameters, {steps} steps of AdamW "
             f"(lr 1e-3, clipping at 1.0), {threads} thread(s)",
             f"{'optimizer':<32}{'first loss':>12}{'last loss':>12}{'max |dloss|':>13}"
             f"{'step ms':>10}{'speedup':>9}"]
    for name, (losses, step_time) in runs.items():
        diff = max(abs(a - b) for a, b in zip(losses, base_losses))
        lines.append(f"{name:<32}{losses[0]:>12.5f}{losses[-1]:>12.5f}{diff:>13.2e}"
                     f"{step_time * 1e3:>10.3f}{base_time / step_time:>8.1f}x")
    return "\n".join(lines)



class LlamaStyleBlock(torch.nn.Module):
    """A small Llama-style decoder block written in plain PyTorch, as a user would: HF-style
    RMSNorm (fp32 up-cast), rotate_half rotary embedding on q and k, causal attention written
    out (scores * scale, masked_fill(-inf), softmax, @ v), and a SwiGLU MLP whose gate and up
    projections are one linear (split with chunk, as Phi-3 and vLLM do: the swiglu rule; two
    separate linears, as Llama's, go to the silu_mul rule instead)."""

    def __init__(self, hidden=512, heads=8, inter=1408, eps=1e-6):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, hidden // heads, eps
        self.norm1 = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.norm2 = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * inter, bias=False)
        self.down = torch.nn.Linear(inter, hidden, bias=False)

    def rms_norm(self, x, weight):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    @staticmethod
    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, x, cos, sin, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.rms_norm(x, self.norm1)).view(b, s, 3, self.heads,
                                                              self.head_dim).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                      # [B, N, S, D]
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        scores = torch.matmul(q, k.transpose(2, 3)) * self.head_dim ** -0.5
        probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        attn = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        h = x + self.o(attn)
        gate, up = self.gate_up(self.rms_norm(h, self.norm2)).chunk(2, dim=-1)
        return h + self.down(torch.nn.functional.silu(gate) * up)


def compiled_model_demo(threads: int, seq: int = 512) -> str:
    """LlamaStyleBlock's forward, fp32, eager vs torch.compile (Inductor) vs torch.compile with
    opennpu's backend (the fusion rules, then Inductor): fusions per rule, time, error."""
    from . import compile as npu_compile

    torch.manual_seed(0)
    block = LlamaStyleBlock().eval()
    x = torch.randn(1, seq, 512)
    angles = torch.arange(seq)[:, None] * (1e4 ** (-torch.arange(0, 64, 2) / 64))[None, :]
    cos, sin = (f(torch.cat((angles, angles), -1))[None, None] for f in (torch.cos, torch.sin))
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]       # True = masked out
    args = (x, cos, sin, mask)
    backend = npu_compile.get_npu_backend()
    rows = []
    with torch.no_grad(), num_threads(threads):
        expected = block(*args)
        torch._dynamo.reset()
        default = torch.compile(block)
        ours = torch.compile(block, backend=backend)
        for name, fn in (("eager", block), ("torch.compile (Inductor)", default),
                         ("opennpu backend + Inductor", ours)):
            err = (fn(*args) - expected).abs().max().item()        # the first call compiles
            rows.append((name, time_fn(lambda: fn(*args), threads, 0.5)["median"], err))
    fusions = ", ".join(f"{rule} x{n}" for rule, n in sorted(backend.fusions.items())) or "none"
    lines = [f"compiled model demo: a Llama-style block (hidden 512, 8 heads, MLP 1408, "
             f"seq {seq}, fp32 forward), {threads} thread(s)",
             f"opennpu fusions: {fusions}",
             f"{'':<30}{'ms':>10}{'x eager':>9}{'max |out - eager|':>20}"]
    base = rows[0][1]
    for name, t, err in rows:
        lines.append(f"{name:<30}{t * 1e3:>10.3f}{base / t:>8.2f}x{err:>20.2e}")
    return "\n".join(lines)


def _seed001_training(device: str, use_amp: bool, steps: int) -> tuple[list[float], float]:
    """Seed 001's manual-migration training loop (an MLP, SGD with momentum, MSE, autocast and
    GradScaler) on `device`; returns the losses and the median step time."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 64)).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler(device, enabled=use_amp)
    inputs = [torch.randn(128, 256) for _ in range(4)]
    batches = [(x.to(device), torch.tanh(x[:, :64]).to(device)) for x in inputs]  # learnable
    losses, times = [], []
    for step in range(steps):
        inp, target = batches[step % 4]
        start = time.perf_counter()
        with torch.autocast(device_type=device, dtype=torch.float16, enabled=use_amp):
            loss = torch.nn.functional.mse_loss(net(inp).float(), target)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    return losses, sorted(times[2:])[len(times[2:]) // 2]


def npu_device_demo(threads: int, steps: int = 20) -> str:
    """Seed 001's training loop on the npu device and on CPU: the same losses, bit for bit in
    fp32, and the step times side by side (npu tensors run the CPU kernels on the same memory)."""
    lines = [f"npu device demo: seed 001's training loop (MLP 256-256-256-64, batch 128, SGD, "
             f"{steps} steps) on {torch.npu.get_device_name(0)}, {threads} thread(s)",
             f"{'':<26}{'first loss':>12}{'last loss':>12}{'step ms':>10}{'losses vs cpu':>16}"]
    with num_threads(threads):
        for use_amp in (False, True):
            cpu_losses, cpu_time = _seed001_training("cpu", use_amp, steps)
            npu_losses, npu_time = _seed001_training("npu", use_amp, steps)
            label = "fp16 autocast + scaler" if use_amp else "fp32"
            for device, losses, t in (("cpu", cpu_losses, cpu_time), ("npu", npu_losses, npu_time)):
                same = "bit-identical" if losses == cpu_losses else (
                    f"{max(abs(a - b) for a, b in zip(losses, cpu_losses)):.1e}")
                lines.append(f"{label + ' ' + device:<26}{losses[0]:>12.5f}{losses[-1]:>12.5f}"
                             f"{t * 1e3:>10.3f}{same if device == 'npu' else '':>16}")
    return "\n".join(lines)

