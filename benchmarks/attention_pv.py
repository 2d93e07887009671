"""npu_fusion_attention's fp16/bf16 forward with P rounded for the P V product, or kept in fp32:
error against float64 as a multiple of the rounding floor, and time, both ways.

    python -m benchmarks.attention_pv [--seq 2048] [--threads 2] [--dtype bf16]
                                      [--policies auto,native] [--min-run-time 2]

Causal prefill, B=1, 32 query heads, D=128, BSND, MHA and GQA (8 kv heads). The floor is the
error of the float64 result rounded to the dtype (max and mean). OPENNPU_ATTENTION_PV=half rounds
P to the dtype before P V; =fp32 keeps it (and multiplies an fp32 copy of V). Both only apply
where the dtype is computed in itself (OPENNPU_HALF_GEMM: auto computes bf16 in fp32 on CPUs
without bf16 arithmetic, where P is fp32 either way; native forces bf16 GEMMs). All variants are
timed in alternation (opennpu.testing.timing.time_interleaved).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import opennpu
import torch
from opennpu.testing import timing

from .ipex_peer import _attention64, cpu_name
from .ipex_worker import DTYPES, make_inputs

HEADS, HEAD_DIM = 32, 128


def with_env(fn, **env):
    """fn() run with the given environment variables set (read by the kernel on every call)."""
    def run():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--policies", default="auto,native")
    parser.add_argument("--min-run-time", type=float, default=2.0)
    args = parser.parse_args(argv)
    timing.reuse_freed_memory()
    dtype = DTYPES[args.dtype]
    print(f"CPU {cpu_name()}, opennpu ISA {opennpu.cpu_isa()}, {args.threads} threads, "
          f"{args.dtype}, causal B=1 N={HEADS} S={args.seq} D={HEAD_DIM}")
    print(f"{'kv heads':<9}{'OPENNPU_HALF_GEMM':<19}{'P':<6}{'max err':>10}{'/floor':>8}"
          f"{'mean err':>10}{'/floor':>8}{'ms':>9}")
    for kv_heads in (HEADS, 8):
        shape = {"S": args.seq, "N": HEADS, "Nkv": kv_heads, "D": HEAD_DIM}
        q, k, v = make_inputs("attention", shape, dtype, 0)
        ref = _attention64(q, k, v)
        floor = (ref.to(dtype).double() - ref).abs()
        mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)

        def call():
            return torch.ops.npu.npu_fusion_attention(
                q, k, v, HEADS, "BSND", atten_mask=mask, scale=1 / math.sqrt(HEAD_DIM),
                sparse_mode=2)[0]

        fns = {(policy, pv): with_env(call, OPENNPU_HALF_GEMM=policy, OPENNPU_ATTENTION_PV=pv)
               for policy in args.policies.split(",") for pv in ("half", "fp32")}
        errs = {}
        with torch.no_grad(), timing.num_threads(args.threads):
            for key, fn in fns.items():
                err = (fn().double() - ref).abs()
                errs[key] = (err.max().item(), err.mean().item())
            times = timing.time_interleaved({f"{p}/{pv}": fn for (p, pv), fn in fns.items()},
                                            args.threads, args.min_run_time, min_samples=3,
                                            block_time=0.0)
        for (policy, pv), (mx, mean) in errs.items():
            print(f"{kv_heads:<9}{policy:<19}{pv:<6}{mx:>10.3e}{mx / floor.max().item():>8.2f}"
                  f"{mean:>10.3e}{mean / floor.mean().item():>8.2f}"
                  f"{times[f'{policy}/{pv}']['median'] * 1e3:>9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
