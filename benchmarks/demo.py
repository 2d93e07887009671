"""The demo's op table: a few of the benchmark cases, each next to the native code it replaces.

    python -m benchmarks.demo [--ops rms_norm,swiglu] [--threads N] [--min-run-time S]

prints the table alone; `python -m opennpu demo` prints it followed by the training, compiled
model and npu device sections (opennpu.demo). Every row is a case of benchmarks/cases, built,
checked and timed by benchmarks.run.run_case: the shapes, inputs, baselines and fp32 oracles are
the benchmarks' own, and this module only picks the rows (DEMO_ROWS) and lays out the table. The
whole sweep is `python -m benchmarks.run --quick` (or without --quick).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from opennpu.testing.table import format_table
from opennpu.testing.timing import (busy_warning, has_cpu_kernel, measure_copy_bandwidth,
                                    reuse_freed_memory)

from .cases import all_cases
from .common import DTYPE_NAMES, DTYPES, Case
from .run import run_case

# (family, direction, shape, dtype) of each row, in the order the table lists them: one LLM-sized
# case per op that a decoder layer calls, from the --quick set so that the demo stays short. The
# GEMM-bound rows are fp32: on CPUs without bf16 matrix units the native bf16 matmuls run many
# times slower than fp32 ones, which would make the demo long and its speedups flattering. Gating is fp32 too: bf16 logits tie often, and topk
# then orders tied experts differently, which the eager error column would show as index errors.
DEMO_ROWS = [
    ("rms_norm", "fwd", "T=4096 H=4096", "bf16"),
    ("rms_norm", "bwd", "T=4096 H=4096", "bf16"),
    ("add_rms_norm", "fwd", "T=4096 H=4096", "bf16"),
    ("dynamic_quant", "fwd", "T=4096 H=4096", "bf16"),
    ("add_rms_norm_dynamic_quant", "fwd", "T=4096 H=4096", "bf16"),
    ("swiglu", "fwd", "T=4096 I=11008", "bf16"),
    ("swiglu", "bwd", "T=4096 I=11008", "bf16"),
    ("fast_gelu", "fwd", "T=4096 H=4096", "bf16"),
    ("rotary_mul", "fwd", "BSND S=4096 N=32 D=128", "bf16"),
    ("rotary_mul", "bwd", "BSND S=4096 N=32 D=128", "bf16"),
    ("scaled_masked_softmax", "fwd", "B=64 N=8 S=128 W=256", "bf16"),
    ("confusion_transpose", "fwd", "seed ex1 64x3x64x128", "fp32"),
    ("attention", "fwd", "S=1024 N=32/8 D=128 causal", "fp32"),
    ("infer_attention", "fwd", "decode B=8 ctx=4096 N=32/8 D=128 paged", "fp32"),
    ("ffn", "fwd", "T=128 H=4096 I=11008", "fp32"),
    ("moe_gating_v2", "fwd", "T=1024 E=64 k=8", "fp32"),
    ("moe_token_permute", "fwd", "T=1024 H=4096 K=8 E=64", "bf16"),
]

HEADER = ("op", "dir", "shape", "dtype", "err ours", "err eager", "ours ms", "eager ms",
          "compile ms", "x eager", "x compile", "speed", "other baselines")
LEFT = (0, 1, 2, 3, 12)  # the text columns; numbers are right-aligned
DEMO_OPS = tuple(dict.fromkeys(row[0] for row in DEMO_ROWS))  # the families --ops accepts


def demo_cases(ops=None) -> list[Case]:
    """The cases of DEMO_ROWS (those of `ops` only, when given), in DEMO_ROWS' order."""
    wanted = [row for row in DEMO_ROWS if ops is None or row[0] in ops]
    dtypes = list(dict.fromkeys(DTYPES[row[3]] for row in wanted))
    found = {(c.op, c.direction, c.shape, DTYPE_NAMES[c.dtype]): c
             for c in all_cases(True, dtypes)}
    missing = [row for row in wanted if row not in found]
    if missing:  # a case was renamed or dropped in benchmarks/cases: say which row to update
        raise LookupError(f"benchmarks.demo: DEMO_ROWS names cases that benchmarks/cases does not "
                          f"have (--quick): {missing}")
    return [found[row] for row in wanted]


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 100 else f"{ms:.1f}"


def _err(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1e}"


def table_row(result: dict) -> tuple[str, ...]:
    """One of benchmarks.run.run_case's result rows as the table's cells."""
    base, speedup = result["baselines"], result["speedup"]
    times = [_ms(base[name]["median"]) if name in base else "-" for name in ("eager", "compile")]
    ratios = [f"{speedup[name]:.2f}x" if name in speedup else "-" for name in ("eager", "compile")]
    fraction = result["copy_bw_fraction"]
    speed = (f"{result['gflops']:.0f} GFLOP/s" if result["flops"]
             else f"{fraction:.0%} copy" if fraction >= 0.01 else f"{fraction:.1%} copy")
    others = ", ".join(f"{name} {x:.2f}x" for name, x in speedup.items()
                       if name not in ("eager", "compile")) or "-"
    return (result["op"], result["direction"], result["shape"], result["dtype"],
            _err(result["max_abs_err_ours"]), _err(result["max_abs_err_eager"]),
            _ms(result["ours"]["median"]), *times, *ratios, speed, others)


class Progress:
    """One line on stderr, rewritten in place: '[i/n] op dir shape dtype ...'."""

    def __init__(self):
        self.width = 0

    def show(self, text: str) -> None:
        self.width = max(self.width, len(text))
        print(f"\r{text:<{self.width}}", end="", file=sys.stderr, flush=True)

    def clear(self) -> None:
        print(f"\r{'':<{self.width}}\r", end="", file=sys.stderr, flush=True)


def op_table(threads: int, min_run_time: float = 0.2, ops=None) -> str:
    """Runs the demo's rows on `threads` threads; returns the table with its header and notes."""
    copy_bw = measure_copy_bandwidth(threads)
    cases = demo_cases(ops)
    rows, notes = [], []
    if ops and (unknown := sorted(set(ops) - set(DEMO_OPS))):
        notes.append(f"no demo row for {', '.join(unknown)} (the demo's: {', '.join(DEMO_OPS)}); "
                     f"every op: python -m benchmarks.run --ops NAME --quick")
    progress = Progress()
    for i, case in enumerate(cases, 1):
        name = f"{case.op} {case.direction} {case.shape} {DTYPE_NAMES[case.dtype]}"
        if missing := [op for op in case.requires if not has_cpu_kernel(op)]:
            notes.append(f"skipped {name}: no CPU kernel yet for {', '.join(missing)}")
            continue
        progress.show(f"[{i}/{len(cases)}] {name} ...")
        try:
            results = run_case(case, [threads], {threads: copy_bw}, min_run_time)
        except Exception as error:  # report and go on: one broken op must not lose the demo
            notes.append(f"FAILED {name}: {type(error).__name__}: {error}")
            continue
        rows.append(table_row(results[0]))
    progress.clear()
    title = (f"opennpu demo: CPU ({torch.ops.opennpu.cpu_isa()}), {threads} thread(s), copy "
             f"bandwidth {copy_bw:.1f} GB/s (read + write), torch {torch.__version__}")
    legend = ("err: max |out - fp32 oracle| ('-': no oracle). Times: medians, ours and the "
              "baselines timed in alternation;\nbwd rows time the backward alone (ours: the "
              "backward op; native: autograd through its graph).\nspeed: our effective GB/s "
              "(each input and output once) over the copy bandwidth, or GFLOP/s where\n"
              "compute-bound; small shapes stay in cache and can exceed 100%. Every case: "
              "python -m benchmarks.run --quick")
    return "\n".join([title, format_table(HEADER, rows, LEFT), legend, *notes])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="", help=f"comma-separated, of: {', '.join(DEMO_OPS)}")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    parser.add_argument("--min-run-time", type=float, default=0.2, help="seconds per timing")
    args = parser.parse_args(argv)
    ops = args.ops.split(",") if args.ops else None
    if ops and (unknown := set(ops) - set(DEMO_OPS)):
        parser.error(f"no demo row for {sorted(unknown)}; choose from {', '.join(DEMO_OPS)} "
                     f"(every op: python -m benchmarks.run --ops NAME --quick)")
    warning = busy_warning()
    reuse_freed_memory()  # steady state: outputs reuse freed memory instead of page-faulting
    print(op_table(args.threads or torch.get_num_threads(), args.min_run_time, ops))
    if warning:
        print(warning)
    return 0


if __name__ == "__main__":
    sys.exit(main())
