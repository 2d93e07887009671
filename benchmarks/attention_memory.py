"""Peak extra memory of one attention forward (and forward + backward), per implementation.

    python -m benchmarks.attention_memory [--seqs 1024,2048,4096] [--dtype fp32]

Each measurement runs in a fresh process: inputs are allocated and touched, then the peak
resident set size (ru_maxrss) is read before and after one call; the difference is the memory
the call needed beyond its inputs. B=1, N=32, D=128, BNSD, as in benchmarks/cases/attention.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

IMPLS = ("opennpu", "sdpa", "native")

_CHILD = r"""
import json, resource, sys
import torch
import opennpu
from benchmarks.cases import attention as a
from benchmarks.common import DTYPES
s, impl, dtype, backward = int(sys.argv[1]), sys.argv[2], DTYPES[sys.argv[3]], sys.argv[4] == "1"
torch.manual_seed(0)
q, k, v = (t.requires_grad_(backward) for t in a._inputs(s, a.HEADS, dtype))
mask = a._causal_mask(s)
fn = {"opennpu": lambda: a.ours_forward(q, k, v, True)[0],
      "sdpa": lambda: a.sdpa(q, k, v, True),
      "native": lambda: a.native_attention(q, k, v, mask)}[impl]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = fn()
if backward:
    out.backward(torch.ones_like(out))
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"extra_mb": (after - before) / 1024}))
"""


def measure(s: int, impl: str, dtype: str, backward: bool) -> float | None:
    result = subprocess.run([sys.executable, "-c", _CHILD, str(s), impl, dtype, str(int(backward))],
                            capture_output=True, text=True)
    if result.returncode != 0:
        return None  # e.g. killed for running out of memory
    return json.loads(result.stdout.strip().splitlines()[-1])["extra_mb"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention_memory")
    parser.add_argument("--seqs", default="1024,2048,4096")
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args(argv)
    print("causal attention, B=1 N=32 D=128: peak memory beyond the inputs (MB)")
    print(f"{'S':>6} {'pass':<8}" + "".join(f"{impl:>10}" for impl in IMPLS))
    for s in (int(x) for x in args.seqs.split(",")):
        for backward in (False, True):
            cells = []
            for impl in IMPLS:
                mb = measure(s, impl, args.dtype, backward)
                cells.append(f"{mb:>10.0f}" if mb is not None else f"{'failed':>10}")
            print(f"{s:>6} {'fwd+bwd' if backward else 'fwd':<8}" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
