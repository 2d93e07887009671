"""NpuFusedAdamW against torch.optim.AdamW(fused=True), interleaved and order-controlled.

    python -m benchmarks.optim_interleaved [--dtypes fp32,bf16] [--processes 4] [--rounds 15]

benchmarks.run times each optimizer in its own block, one after the other, in one process. On a
2-vCPU VM whose memory bandwidth drifts with its neighbours, and where in one process the
optimizer whose states were allocated first ran about 4% slower whatever it was, that gives the
fp32 step's ratio a spread of 0.9-1.2x between runs. Here each process builds both optimizers on
the same GPT-2 small parameter list (benchmarks/cases/optim.py), alternates their steps round by
round (ABAB then BABA), and processes alternate which optimizer is built first. The ratio
(torch's time over ours, > 1: we are faster) is reported per process, from the median and from
the best step, then averaged over processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from .common import DTYPES

NAMES = ("ours", "fused=True")


def one_process(dtype: torch.dtype, first: str, rounds: int, threads: int) -> dict:
    from opennpu import optim
    from opennpu.testing.timing import reuse_freed_memory

    from .cases.optim import _params, gpt2_small_shapes

    torch.set_num_threads(threads)
    reuse_freed_memory()
    params = _params(gpt2_small_shapes(), dtype)
    make = {"ours": lambda: optim.NpuFusedAdamW(params, lr=1e-4),
            "fused=True": lambda: torch.optim.AdamW(params, lr=1e-4, fused=True)}
    order = [first] + [name for name in NAMES if name != first]
    opts = {name: make[name]() for name in order}
    for name in order:
        opts[name].step()  # allocates the states, in construction order
    times = {name: [] for name in order}
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            opts[name].step()
            times[name].append(time.perf_counter() - start)
    return {"first": first,
            "median": {n: statistics.median(t) for n, t in times.items()},
            "best": {n: min(t) for n, t in times.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # "dtype,first": run one process
    args = parser.parse_args(argv)
    if args.child:
        dtype_name, first = args.child.split(",", 1)
        print(json.dumps(one_process(DTYPES[dtype_name], first, args.rounds, args.threads)))
        return 0
    for dtype_name in args.dtypes.split(","):
        by_median, by_best = [], []
        for k in range(args.processes):
            first = NAMES[k % 2]
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.optim_interleaved", "--child",
                 f"{dtype_name},{first}", "--rounds", str(args.rounds),
                 "--threads", str(args.threads)],
                check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            by_median.append(row["median"]["fused=True"] / row["median"]["ours"])
            by_best.append(row["best"]["fused=True"] / row["best"]["ours"])
            print(f"{dtype_name} built first: {first:10} ours {row['median']['ours'] * 1e3:6.1f} ms "
                  f"(best {row['best']['ours'] * 1e3:6.1f})  fused=True "
                  f"{row['median']['fused=True'] * 1e3:6.1f} ms "
                  f"(best {row['best']['fused=True'] * 1e3:6.1f})  "
                  f"x fused=True {by_median[-1]:.3f} (best {by_best[-1]:.3f})", flush=True)
        print(f"{dtype_name} GPT-2 small AdamW step, {args.processes} processes: x fused=True "
              f"{statistics.mean(by_median):.3f} by median step, {statistics.mean(by_best):.3f} "
              f"by best step", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
