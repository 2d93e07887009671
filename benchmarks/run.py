"""Benchmark runner: times opennpu's ops against their baselines and prints one table.

    python -m benchmarks.run [--ops rms_norm,swiglu] [--dtypes fp32,bf16] [--threads 1,2]
                             [--quick] [--shapes 'T=8192 H=4096,S=8192'] [--json out.json]
                             [--ipex-python /path/to/venv-ipex/bin/python]

Per case and thread count: our median time (p20-p80), effective GB/s and its fraction of the two
memory roofs measured at the start of the same run: `copy_` (ordinary stores, which read every
written line first) and a copy with streaming stores (no such read: the roof of an op that streams
its outputs) (GFLOP/s for attention, which is compute-bound),
the speedup over each baseline (native eager, torch.compile of it, F.rms_norm for rms_norm and
F.scaled_dot_product_attention for attention), and the max abs error of ours and of native eager
against the fp32 oracle (where the oracle fits in memory). Method and targets: shared/PERFORMANCE.md.

With --ipex-python (or OPENNPU_IPEX_PYTHON) naming the Python of a torch 2.8 + Intel Extension for
PyTorch virtualenv, a second table follows: ours against IPEX on the ops both have
(benchmarks/ipex_peer.py), timed in alternation with an IPEX worker process; without it that
table is skipped with a note.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys

import opennpu
import torch
from opennpu.testing.timing import (busy_warning, has_cpu_kernel, max_abs_error,
                                    measure_roofs, num_threads, reuse_freed_memory,
                                    time_interleaved)

from . import ipex_peer
from .cases import OPS, all_cases
from .common import DTYPE_NAMES, DTYPES, Case

PEERS = ("eager", "compile", "F.rms_norm", "sdpa")  # the speedup columns, in order


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated, of: {', '.join(OPS)}")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--quick", action="store_true", help="a small subset of the shapes")
    parser.add_argument("--shapes", default="",
                        help="comma-separated substrings; run only cases whose shape contains one "
                             "(e.g. 'T=8192 H=4096,S=8192')")
    parser.add_argument("--dirs", default="",
                        help="comma-separated directions to run (fwd, bwd, f+b); default all")
    parser.add_argument("--min-run-time", type=float, default=None,
                        help="seconds per timing (default 0.5, 0.2 with --quick)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--ipex-python", default=os.environ.get(ipex_peer.ENV),
                        help="the Python of a torch 2.8 + IPEX virtualenv: adds the IPEX table "
                             f"(default: ${ipex_peer.ENV})")
    parser.add_argument("--system-malloc", action="store_true",
                        help="keep glibc's default of returning large blocks to the OS (every "
                             "call then page-faults its outputs in)")
    args = parser.parse_args(argv)
    args.ops, dtype_names = args.ops.split(","), args.dtypes.split(",")
    for given, known in ((args.ops, OPS), (dtype_names, DTYPES)):
        if unknown := set(given) - set(known):
            parser.error(f"unknown {sorted(unknown)}; choose from {', '.join(known)}")
    args.dtype_names, args.dtypes = dtype_names, [DTYPES[name] for name in dtype_names]
    args.threads = [int(n) for n in args.threads.split(",")]
    if args.min_run_time is None:
        args.min_run_time = 0.2 if args.quick else 0.5
    return args


def run_case(case: Case, threads: list[int], roofs: dict[int, dict[str, float]],
             min_run_time: float):
    """One result row per thread count."""
    rows, errors = [], None
    for n in threads:
        # Forward passes run without autograd; a backward needs it to build the native graph.
        # The inputs are rebuilt per thread count because torch.compile's kernels are.
        mode = torch.no_grad() if case.direction == "fwd" else torch.enable_grad()
        with mode, num_threads(n):
            torch.manual_seed(0)
            timed = case.build(n)
            # The first calls also warm up: torch.compile compiles here, not while timed.
            if errors is None:
                errors = (float("nan"), float("nan"))
                if timed.reference is not None:
                    expected = timed.reference()
                    eager = timed.baselines.get("eager")
                    errors = (max_abs_error(timed.ours(), expected),
                              max_abs_error(eager(), expected) if eager else float("nan"))
                    del expected
            for fn in (timed.ours, *timed.baselines.values()):
                fn()
            # ours and the baselines in alternation: ratios from one stretch of the machine's time
            peers = time_interleaved({"ours": timed.ours, **timed.baselines}, n, min_run_time)
            ours = peers.pop("ours")
        info = timed.info
        del timed
        gc.collect()  # the large shapes need their memory back before the next build
        gbps = case.nbytes / ours["median"] / 1e9
        rows.append({
            "op": case.op, "direction": case.direction, "shape": case.shape,
            "dtype": DTYPE_NAMES[case.dtype], "threads": n, "bytes": case.nbytes,
            "ours": ours, "baselines": peers, "gbps": gbps,
            "copy_bw_fraction": gbps / roofs[n]["copy"],
            "stream_bw_fraction": gbps / roofs[n]["stream"],
            "flops": case.flops, "gflops": case.flops / ours["median"] / 1e9,
            "speedup": {name: t["median"] / ours["median"] for name, t in peers.items()},
            "max_abs_err_ours": errors[0], "max_abs_err_eager": errors[1], "info": info,
        })
    return rows


HEADER = (f"{'op':<27}{'dir':<5}{'shape':<32}{'dtype':<6}{'thr':>3} {'ours ms (p20-p80)':>25}"
          f"{'GB/s':>7}{'%copy':>7}{'%strm':>7}{'x eager':>9}{'x compile':>10}{'x F.rms':>9}"
          f"{'x sdpa':>8}{'err ours':>10}{'err eager':>10}")


def format_row(row) -> str:
    ours = row["ours"]
    timing = f"{ours['median'] * 1e3:.4g} ({ours['p20'] * 1e3:.4g}-{ours['p80'] * 1e3:.4g})"
    speedups = [f"{row['speedup'][p]:.2f}x" if p in row["speedup"] else "-" for p in PEERS]
    # Compute-bound cases show GFLOP/s in the GB/s column and no bandwidth fractions.
    rate, fraction = ((f"{row['gflops']:>6.0f}F", f"{'-':>7}{'-':>7}") if row["flops"]
                      else (f"{row['gbps']:>7.1f}",
                            f"{row['copy_bw_fraction']:>7.0%}{row['stream_bw_fraction']:>7.0%}"))
    # Peers without a column of their own (the optimizer baselines) follow the table's columns.
    others = "".join(f"  x {name}: {x:.2f}" for name, x in row["speedup"].items()
                     if name not in PEERS)
    if row.get("info"):
        others += f"  {row['info']}"
    return (f"{row['op']:<27}{row['direction']:<5}{row['shape']:<32}{row['dtype']:<6}"
            f"{row['threads']:>3} {timing:>25}{rate}{fraction}"
            f"{speedups[0]:>9}{speedups[1]:>10}{speedups[2]:>9}{speedups[3]:>8}"
            f"{row['max_abs_err_ours']:>10.2e}{row['max_abs_err_eager']:>10.2e}{others}")


def main(argv=None) -> int:
    args = parse_args(argv)
    notes = [warning] if (warning := busy_warning()) else []
    reused = not args.system_malloc and reuse_freed_memory()
    roofs = {n: measure_roofs(n) for n in args.threads}
    print(f"torch {torch.__version__}, opennpu ISA {opennpu.cpu_isa()}, {platform.platform()}")
    print("malloc: freed memory is " + ("reused (no page faults on outputs)" if reused
                                       else "returned to the OS (outputs page-fault in)"))
    print("memory roofs (read + write), copy_ / streaming-store copy: "
          + ", ".join(f"{n} thread(s) {r['copy']:.1f} / {r['stream']:.1f} GB/s"
                      for n, r in roofs.items()))
    print(HEADER, flush=True)

    rows = []
    for case in all_cases(args.quick, args.dtypes):
        if case.op not in args.ops:
            continue
        if args.shapes and not any(part in case.shape for part in args.shapes.split(",")):
            continue
        if args.dirs and case.direction not in args.dirs.split(","):
            continue
        missing = [op for op in case.requires if not has_cpu_kernel(op)]
        if missing:
            note = f"skipped {case.op} {case.direction}: no CPU kernel yet for {', '.join(missing)}"
            if note not in notes:
                notes.append(note)
            continue
        try:
            case_rows = run_case(case, args.threads, roofs, args.min_run_time)
        except Exception as error:  # report and go on: one broken op must not lose the run
            notes.append(f"FAILED {case.op} {case.direction} {case.shape} "
                         f"{DTYPE_NAMES[case.dtype]}: {type(error).__name__}: {error}")
            print(notes[-1], flush=True)
            continue
        for row in case_rows:
            print(format_row(row), flush=True)
        rows.extend(case_rows)

    ipex_rows, ipex_notes = ipex_peer.run_table(args.ipex_python, args.ops, args.dtype_names,
                                                args.threads, min_run_time=args.min_run_time)
    notes += ipex_notes
    for note in notes:
        print(note)
    if args.json:
        result = {
            "torch": torch.__version__, "cpu_isa": opennpu.cpu_isa(),
            "machine": platform.platform(), "arch": platform.machine(), "cpus": os.cpu_count(),
            "copy_bandwidth_gbps": {n: r["copy"] for n, r in roofs.items()},
            "stream_copy_bandwidth_gbps": {n: r["stream"] for n, r in roofs.items()},
            "min_run_time": args.min_run_time,
            "malloc_reuses_freed_memory": reused,
            "rows": rows, "ipex_rows": ipex_rows, "notes": notes,
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if any(note.startswith("FAILED") for note in notes) else 0


if __name__ == "__main__":
    sys.exit(main())
