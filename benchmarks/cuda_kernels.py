"""opennpu's native CUDA kernels against the GPU peers, on one GPU, ratios from one run.

    python -m benchmarks.cuda_kernels [--quick] [--json out.json] [--ops rms_norm,attention]

Per case: our median time per call (CUDA events around a batch of calls), effective GB/s (each
tensor read or written once) and its fraction of the device-to-device copy bandwidth measured at
the start of the run, and the speedup over each peer: the native PyTorch composition in eager
mode, torch.compile of it (Inductor's fused Triton kernel), the portable path (opennpu's ATen
composition, what a CUDA tensor got before these kernels), F.rms_norm for rms_norm,
Liger-Kernel's Triton kernel where Liger has the op and is importable, and
F.scaled_dot_product_attention for attention (which runs through the same flash kernels; for
decode on the same cache, gathered first when it is paged). Method: shared/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

try:  # before opennpu: Liger picks its backend at import
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction
except ImportError:
    LigerRMSNormFunction = LigerRopeFunction = LigerSiLUMulFunction = None

import opennpu  # noqa: E402,F401
from opennpu.ops import portable  # noqa: E402
from opennpu.testing import reference  # noqa: E402

npu = torch.ops.npu
EPS = 1e-6


def time_ms(fn, batch=20, repeats=15):
    """Median milliseconds per call of fn over `repeats` batches, after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / batch)
    return statistics.median(times)


def copy_bandwidth():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_ms(lambda: dst.copy_(src), batch=10, repeats=5) * 1e-3) / 1e9


def rand(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def rms_norm_cases(t, h, dtype):
    x, w = rand(t, h, dtype=dtype), (1 + 0.1 * rand(h, dtype=torch.float32)).to(dtype)
    dy = rand(t, h, dtype=dtype)
    rstd = npu.npu_rms_norm(x, w, EPS)[1]
    size = x.numel() * x.element_size()
    fwd = {"ours": lambda: npu.npu_rms_norm(x, w, EPS),
           "eager": lambda: reference.native_rms_norm(x, w, EPS),
           "compile": compiled(reference.native_rms_norm, x, w, EPS),
           "portable": lambda: portable.IMPLS["npu::npu_rms_norm"](x, w, EPS),
           "F.rms_norm": lambda: F.rms_norm(x, (h,), w, EPS)}
    if LigerRMSNormFunction is not None:
        fwd["liger"] = lambda: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)
    bwd = {"ours": lambda: npu.npu_rms_norm_backward(dy, x, w, rstd),
           "eager": grad_of(reference.native_rms_norm, dy, x, w),
           "compile": grad_of(torch.compile(reference.native_rms_norm), dy, x, w),
           "portable": lambda: portable.IMPLS["npu::npu_rms_norm_backward"](dy, x, w, rstd)}
    if LigerRMSNormFunction is not None:
        bwd["liger"] = grad_of(lambda a, b: LigerRMSNormFunction.apply(a, b, EPS, 0.0, "llama", False), dy, x, w)
    return [("rms_norm", "fwd", 2 * size, fwd), ("rms_norm", "bwd", 3 * size, bwd)]


def add_rms_norm_cases(t, h, dtype):
    x1, x2 = rand(t, h, dtype=dtype), rand(t, h, dtype=dtype)
    w = (1 + 0.1 * rand(h, dtype=torch.float32)).to(dtype)
    size = x1.numel() * x1.element_size()
    fwd = {"ours": lambda: npu.npu_add_rms_norm(x1, x2, w, EPS),
           "eager": lambda: reference.native_add_rms_norm(x1, x2, w, EPS),
           "compile": compiled(reference.native_add_rms_norm, x1, x2, w, EPS),
           "portable": lambda: portable.IMPLS["npu::npu_add_rms_norm"](x1, x2, w, EPS)}
    return [("add_rms_norm", "fwd", 4 * size, fwd)]


def swiglu_cases(t, h, dtype):
    x = rand(t, 2 * h, dtype=dtype)
    dy = rand(t, h, dtype=dtype)
    a, b = x.chunk(2, -1)
    a, b = a.contiguous(), b.contiguous()
    size = dy.numel() * dy.element_size()
    fwd = {"ours": lambda: npu.npu_swiglu(x, -1),
           "eager": lambda: reference.native_swiglu(x),
           "compile": compiled(reference.native_swiglu, x),
           "portable": lambda: portable.IMPLS["npu::npu_swiglu"](x, -1)}
    bwd = {"ours": lambda: npu.npu_swiglu_backward(dy, x, -1),
           "eager": grad_of(reference.native_swiglu, dy, x),
           "compile": grad_of(torch.compile(reference.native_swiglu), dy, x),
           "portable": lambda: portable.IMPLS["npu::npu_swiglu_backward"](dy, x, -1)}
    if LigerSiLUMulFunction is not None:  # Liger takes the two halves as separate tensors
        fwd["liger"] = lambda: LigerSiLUMulFunction.apply(a, b)
        bwd["liger"] = grad_of(LigerSiLUMulFunction.apply, dy, a, b)
    return [("swiglu", "fwd", 3 * size, fwd), ("swiglu", "bwd", 5 * size, bwd)]


def rotary_cases(b, n, s, d, dtype):
    """q and k of one attention layer in BNSD (Liger's layout), cos / sin [1, 1, S, D]."""
    q, k = rand(b, n, s, d, dtype=dtype), rand(b, n // 4, s, d, dtype=dtype)
    cos, sin = rand(1, 1, s, d, dtype=dtype), rand(1, 1, s, d, dtype=dtype)
    size = (q.numel() + k.numel()) * q.element_size()

    def both(fn):
        return lambda: (fn(q, cos, sin), fn(k, cos, sin))

    fwd = {"ours": both(lambda t, c, s_: npu.npu_rotary_mul(t, c, s_)),
           "eager": both(reference.native_rotary_mul),
           "compile": both(torch.compile(reference.native_rotary_mul)),
           "portable": both(portable.IMPLS["npu::npu_rotary_mul"])}
    if LigerRopeFunction is not None:
        c3, s3 = cos[0], sin[0]
        fwd["liger"] = lambda: LigerRopeFunction.apply(q, k, c3, s3)
    return [("rotary_mul", "fwd", 2 * size, fwd)]


def dynamic_quant_cases(t, h, dtype):
    x = rand(t, h, dtype=dtype)
    nbytes = x.numel() * (x.element_size() + 1)
    fwd = {"ours": lambda: npu.npu_dynamic_quant(x),
           "eager": lambda: reference.native_dynamic_quant(x),
           "compile": compiled(reference.native_dynamic_quant, x),
           "portable": lambda: portable.IMPLS["npu::npu_dynamic_quant"](x)}
    return [("dynamic_quant", "fwd", nbytes, fwd)]


def _no_flash(fn):
    """fn with flash attention off: the portable composition the route replaces."""
    def run():
        torch.backends.cuda.enable_flash_sdp(False)
        try:
            return fn()
        finally:
            torch.backends.cuda.enable_flash_sdp(True)
    return run


def attention_cases(b, n, nkv, s, d, dtype):
    """npu_fusion_attention (causal, BSND) through the flash route, against the seed's native
    composition, torch.compile of it, the portable composition and F.scaled_dot_product_attention
    (the same flash kernels: the route's overhead). Bytes: Q, K, V, O once (compute-bound)."""
    q, k, v = rand(b, s, n, d, dtype=dtype), rand(b, s, nkv, d, dtype=dtype), rand(b, s, nkv, d, dtype=dtype)
    mask, scale = torch.ones(2048, 2048, dtype=torch.bool, device="cuda").triu(1), d ** -0.5
    causal = torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1)

    def ours():
        return npu.npu_fusion_attention(q, k, v, n, "BSND", atten_mask=mask, scale=scale,
                                        sparse_mode=3)

    def native(q, k, v):
        qb, kb, vb = (t.transpose(1, 2) for t in (q, k, v))
        kb, vb = kb.repeat_interleave(n // nkv, 1), vb.repeat_interleave(n // nkv, 1)
        return reference.native_flash_attention_seed(qb, kb, vb, causal, scale=scale, layout="BNSD")

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True, scale=scale, enable_gqa=nkv != n)

    out, smax, ssum = ours()[:3]
    dy = torch.randn_like(out)
    size = 2 * (q.numel() + k.numel()) * q.element_size()
    fwd = {"ours": ours, "eager": lambda: native(q, k, v), "compile": compiled(native, q, k, v),
           "portable": _no_flash(ours), "sdpa": lambda: sdpa(q, k, v)}

    def grad(**kw):
        return npu.npu_fusion_attention_grad(q, k, v, dy, n, "BSND", atten_mask=mask,
                                             softmax_max=smax, softmax_sum=ssum, attention_in=out,
                                             scale_value=scale, sparse_mode=3)

    bwd = {"ours": grad, "eager": grad_of(native, dy.transpose(1, 2), q, k, v),
           "portable": _no_flash(grad), "sdpa": grad_of(sdpa, dy.transpose(1, 2), q, k, v)}
    return [("attention", "fwd", size, fwd), ("attention", "bwd", 2 * size, bwd)]


def _decode_composition(q, k, v, scale):
    """softmax(q k^T * scale) v in plain PyTorch for BNSD q [B, N, 1, D] and k / v [B, KVN, S, D]
    (GQA by repeating the kv heads), fp32 softmax: the native composition of a decode step."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    p = (q @ k.transpose(-1, -2)).float().mul(scale).softmax(-1)
    return (p.to(v.dtype) @ v)


def _with_decode_switch(fn, value):
    """fn with OPENNPU_FIA_DECODE=value ("0": the portable route for every decode call, flash /
    cuDNN where the call fits, else ATen ops: what a CUDA decode call ran before the kernel)."""
    def run():
        os.environ["OPENNPU_FIA_DECODE"] = value
        try:
            return fn()
        finally:
            del os.environ["OPENNPU_FIA_DECODE"]
    return run


def decode_attention_cases(b, n, nkv, skv, d, dtype):
    """npu_fused_infer_attention_score decoding one token per sequence (BSH, GQA) over a dense
    cache, against the native composition (eager and compiled), the portable route and
    F.scaled_dot_product_attention on the same cache. Bytes: the K/V cache read once
    (memory-bound)."""
    q = rand(b, 1, n * d, dtype=dtype)
    k, v = rand(b, skv, nkv * d, dtype=dtype), rand(b, skv, nkv * d, dtype=dtype)
    scale = d ** -0.5

    def ours():
        return npu.npu_fused_infer_attention_score(q, k, v, num_heads=n, num_key_value_heads=nkv,
                                                   input_layout="BSH", scale=scale)

    qb, kb, vb = q.unflatten(2, (n, d)).transpose(1, 2), k.unflatten(2, (nkv, d)).transpose(1, 2), \
        v.unflatten(2, (nkv, d)).transpose(1, 2)

    def sdpa():
        return F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=nkv != n)

    fwd = {"ours": ours, "eager": lambda: _decode_composition(qb, kb, vb, scale),
           "compile": compiled(_decode_composition, qb, kb, vb, scale),
           "portable": _with_decode_switch(ours, "0"), "sdpa": sdpa}
    return [("infer_attention", "fwd", 2 * k.numel() * k.element_size(), fwd)]


def paged_decode_attention_cases(b, n, nkv, skv, d, block_size, dtype):
    """The same decode step over a paged cache ([blocks, block_size, KVN * D], blocks in shuffled
    order, as vllm-ascend keeps it): ours reads the blocks in place; the peers gather each
    sequence's blocks into a dense cache first (index_select), then run the native composition
    (eager, compiled) or SDPA, and the portable route (OPENNPU_FIA_DECODE=0)."""
    cols = skv // block_size
    blocks = b * cols
    q = rand(b, 1, n * d, dtype=dtype)
    k, v = rand(blocks, block_size, nkv * d, dtype=dtype), rand(blocks, block_size, nkv * d, dtype=dtype)
    table = torch.randperm(blocks, device="cuda").to(torch.int32).view(b, cols)
    lens = [skv] * b
    scale = d ** -0.5

    def ours():
        return npu.npu_fused_infer_attention_score(
            q, k, v, num_heads=n, num_key_value_heads=nkv, input_layout="BSH", scale=scale,
            block_table=table, block_size=block_size, actual_seq_lengths_kv=lens)

    def gathered(cache, table):  # [B, KVN, S, D]
        rows = cache.index_select(0, table.flatten().long()).view(b, cols * block_size, nkv, d)
        return rows.transpose(1, 2)

    def composition(q, k, v, table):
        return _decode_composition(q.view(b, 1, n, d).transpose(1, 2), gathered(k, table),
                                   gathered(v, table), scale)

    def sdpa():
        return F.scaled_dot_product_attention(q.view(b, 1, n, d).transpose(1, 2), gathered(k, table),
                                              gathered(v, table), scale=scale, enable_gqa=nkv != n)

    fwd = {"ours": ours, "eager": lambda: composition(q, k, v, table),
           "compile": compiled(composition, q, k, v, table),
           "portable": _with_decode_switch(ours, "0"), "sdpa": sdpa}
    return [("infer_attention", "fwd", 2 * k.numel() * k.element_size(), fwd)]


def compiled(fn, *args):
    c = torch.compile(fn)
    return lambda: c(*args)


def grad_of(fn, dy, *inputs):
    """The backward of fn at inputs, for upstream gradient dy (forward run once, outside)."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    return lambda: torch.autograd.grad(out, leaves, dy, retain_graph=True)


def all_cases(quick):
    """(op family, shape, a function building the family's cases)."""
    dtype = torch.bfloat16
    rows = [(4096, 4096)] if quick else [(4096, 4096), (16384, 8192)]
    for t, h in rows:
        shape = f"T={t} H={h}"
        yield "rms_norm", shape, lambda t=t, h=h: rms_norm_cases(t, h, dtype)
        yield "add_rms_norm", shape, lambda t=t, h=h: add_rms_norm_cases(t, h, dtype)
        yield "swiglu", shape, lambda t=t, h=h: swiglu_cases(t, h, dtype)
        yield "dynamic_quant", shape, lambda t=t, h=h: dynamic_quant_cases(t, h, dtype)
    for b, n, s, d in [(4, 32, 2048, 128)] if quick else [(4, 32, 2048, 128), (64, 32, 1, 128)]:
        yield "rotary_mul", f"B={b} N={n} S={s} D={d}", lambda b=b, n=n, s=s, d=d: rotary_cases(
            b, n, s, d, dtype)
    for b, n, nkv, s in [(4, 32, 8, 2048)] if quick else [(4, 32, 8, 2048), (1, 32, 32, 8192)]:
        yield "attention", f"B={b} N={n}/{nkv} S={s} D=128", lambda b=b, n=n, nkv=nkv, s=s: (
            attention_cases(b, n, nkv, s, 128, dtype))
    for b, skv in [(16, 8192)] if quick else [(16, 8192), (64, 4096), (8, 32768)]:
        yield "infer_attention", f"B={b} N=32/8 Skv={skv} D=128", lambda b=b, skv=skv: (
            decode_attention_cases(b, 32, 8, skv, 128, dtype))
        yield "infer_attention", f"paged B={b} Skv={skv} bs=128", lambda b=b, skv=skv: (
            paged_decode_attention_cases(b, 32, 8, skv, 128, 128, dtype))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cuda_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--ops", help="comma-separated op families to run (default: all)")
    args = parser.parse_args(argv)
    wanted = set(args.ops.split(",")) if args.ops else None
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; bf16; torch {torch.__version__}; "
          f"liger {'yes' if LigerRMSNormFunction else 'not installed'}")
    peers = ("eager", "compile", "portable", "F.rms_norm", "liger", "sdpa")
    print(f"{'op':14} {'dir':4} {'shape':24} {'ours us':>9} {'GB/s':>7} {'%copy':>6} "
          + " ".join(f"{'x' + p:>11}" for p in peers))
    results = []
    for family, shape, build in all_cases(args.quick):
        if wanted is not None and family not in wanted:
            continue
        try:
            built = build()
        except Exception as error:
            print(f"  {shape}: building the case failed: {type(error).__name__}: "
                  f"{str(error).splitlines()[0][:160]}", flush=True)
            continue
        for op, direction, nbytes, fns in built:
            times = {}
            for name, fn in fns.items():
                try:
                    times[name] = time_ms(fn)
                except Exception as error:  # a peer that fails here is reported, not fatal
                    print(f"  {op} {direction} {shape}: {name} failed: {type(error).__name__}: "
                          f"{str(error).splitlines()[0][:160]}", flush=True)
            if "ours" not in times:
                continue
            ours = times["ours"]
            gbs = nbytes / (ours * 1e-3) / 1e9
            speedups = {p: times[p] / ours for p in peers if p in times}
            print(f"{op:14} {direction:4} {shape:24} {ours * 1e3:9.1f} {gbs:7.0f} {gbs / bw:6.0%} "
                  + " ".join(f"{speedups[p]:11.2f}" if p in speedups else f"{'-':>11}" for p in peers),
                  flush=True)
            results.append(dict(op=op, direction=direction, shape=shape, ms=times, gbs=gbs,
                                copy_fraction=gbs / bw, speedup=speedups))
            torch._dynamo.reset()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbs=bw, results=results), f, indent=1)


if __name__ == "__main__":
    main()
