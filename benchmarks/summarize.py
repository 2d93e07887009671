"""Markdown summary of benchmark JSON files (from `python -m benchmarks.run --json ...`).

    python -m benchmarks.summarize benchmarks/results/large.json [--threads 2]

One row per (op, direction, shape, dtype) at the chosen thread count: our median time, the fractions
of the two memory roofs measured in the same run (copy_, and a copy with streaming stores, where
the JSON has it), and the speedups over each baseline.
"""

from __future__ import annotations

import argparse
import json


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.summarize")
    parser.add_argument("files", nargs="+")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print("| op | dir | shape | dtype | ours ms | % copy BW / % streaming-copy BW (or GFLOP/s) | "
          "x eager | x compile | x F.rms_norm | x SDPA |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in args.files:
        with open(path) as f:
            result = json.load(f)
        for row in result["rows"]:
            if row["threads"] != args.threads:
                continue
            speedup = row["speedup"]
            cells = [row["op"], row["direction"], row["shape"], row["dtype"],
                     f"{row['ours']['median'] * 1e3:.3g}",
                     (f"{row['gflops']:.0f} GFLOP/s" if row.get("flops")
                      else f"{row['copy_bw_fraction']:.0%}"
                      + (f" / {row['stream_bw_fraction']:.0%}" if "stream_bw_fraction" in row
                         else "")),
                     *(f"{speedup[p]:.2f}x" if p in speedup else "-"
                       for p in ("eager", "compile", "F.rms_norm", "sdpa"))]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
