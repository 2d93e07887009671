"""Where the opennpu backend wins or loses on the decoder layer: one rule family switched off at a
time, against torch.compile (Inductor) and eager.

    python -m benchmarks.decoder_attribution [--seqs 512,1024] [--dtypes fp32,bf16] [--dirs fwd,f+b]

The layer and its calls are benchmarks/cases/compile.py's (transformers' LlamaDecoderLayer,
H=1024, 16/4 heads, SDPA, no padding). Variants: "opennpu" (every rule), "no_attention" and
"no_norms", "no_rotary" (the attention rule, rms_norm + add_rms_norm, or rotary disabled), "inductor" (torch.compile's
default backend), "eager"; for the forward also "frozen" (every rule, with
experimental_config.frozen_parameter) and "inductor_frozen" (Inductor with
torch._inductor.config.freezing), where the weights are constants packed for oneDNN / MKL. Each call is timed by the CPU time of the calling thread on ONE thread
(time.thread_time, best of --repeats, the variants interleaved, each timed call right after an
untimed one of the same variant): on a shared 2-core machine
wall-clock times of 2-thread runs swing by 2x with the other processes, while one thread's own
CPU time only moves by a few percent. The ratios are against Inductor (> 1: faster).

Run it with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc 2.35+): malloc's memory then sits on
transparent huge pages for every variant alike, and a process's ratios no longer depend on where
its buffers happened to land (on 4 KiB pages one run in four measured a variant 10-15% off).
"""

from __future__ import annotations

import argparse
import time

import torch

from opennpu.testing.timing import reuse_freed_memory

from .cases import compile as layer_case
from .common import DTYPES

VARIANTS = {"opennpu": [], "no_attention": ["attention"], "no_norms": ["rms_norm", "add_rms_norm"],
            "no_rotary": ["rotary"], "no_silu_mul": ["silu_mul"]}


def _inductor_frozen(gm, example_inputs):
    """Inductor as torch.compile's default backend runs it (a distinct callable, so Dynamo keeps a
    separate cache entry), used with torch._inductor.config.freezing on."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def measure(s: int, dtype: torch.dtype, training: bool, repeats: int) -> dict[str, float]:
    from opennpu.compile import CompilerConfig, get_npu_backend
    from opennpu.testing.timing import compiled

    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    with torch.enable_grad() if training else torch.no_grad():
        layer, rotary = layer_case._layer(dtype, training)
        module = layer_case._Call(layer)
        x = torch.randn(1, s, layer_case.HIDDEN).to(dtype)
        cos, sin = (t.detach() for t in rotary(x, torch.arange(s)[None]))
        args = (x.requires_grad_(training), cos, sin)
        params = tuple(layer.parameters())
        dy = torch.randn(1, s, layer_case.HIDDEN).to(dtype)

        def step(fn):
            if not training:
                return lambda: fn(*args)
            return lambda: torch.autograd.grad(fn(*args), (x, *params), dy)

        fns = {"eager": step(module), "inductor": step(compiled(module, *args, threads=1))}
        for name, disabled in VARIANTS.items():
            config = CompilerConfig()
            config.experimental_config.disabled_patterns = disabled
            backend = get_npu_backend(compiler_config=config)
            fns[name] = step(torch.compile(module, backend=backend, dynamic=False))
        if not training:
            config = CompilerConfig()
            config.experimental_config.frozen_parameter = True
            backend = get_npu_backend(compiler_config=config)
            fns["frozen"] = step(torch.compile(module, backend=backend, dynamic=False))
            fns["inductor_frozen"] = step(torch.compile(module, backend=_inductor_frozen,
                                                        dynamic=False))
        with torch._inductor.config.patch({"cpp.threads": 1}):
            for name, fn in fns.items():  # compile (forward, and backward on the first backward)
                # Inductor freezes only when the flag is on while Dynamo traces, too.
                with torch._inductor.config.patch({"freezing": name == "inductor_frozen"}):
                    fn()
                fn()
        times = {name: float("inf") for name in fns}
        names = list(fns)
        for rep in range(repeats):
            # Each timed call follows an untimed call of the same variant, and the order rotates
            # from repeat to repeat: a call that directly follows another variant's finds the
            # caches and malloc's free lists as that variant left them, which measured up to 6%
            # slower (the same variant timed right after Inductor and after another of ours).
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                fns[name]()
                start = time.thread_time()
                fns[name]()
                times[name] = min(times[name], time.thread_time() - start)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="1024")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--dirs", default="fwd,f+b")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    reuse_freed_memory()  # as benchmarks.run: no page faults on outputs
    for s in (int(x) for x in args.seqs.split(",")):
        for dtype_name in args.dtypes.split(","):
            for direction in args.dirs.split(","):
                times = measure(s, DTYPES[dtype_name], direction == "f+b", args.repeats)
                base = times["inductor"]
                print(f"S={s} {dtype_name} {direction}: " + "  ".join(
                    f"{name} {t * 1e3:.1f} ms ({base / t:.3f}x)" for name, t in times.items()),
                    flush=True)


if __name__ == "__main__":
    main()
