"""The per-call cost transfer_to_npu adds to a patched function that names no CUDA device.

    python -m benchmarks.transfer_overhead [--repeats 7]

`Tensor.to(torch.float32)` on a small CPU tensor is timed with the patches off and on, alternating
(apply, time, _unpatch, time, ...) so both sides see the same machine load; the best of each side
is kept. The migration log is off (TORCH_NPU_MIGRATION_LOG unset), as by default. Run it on a
quiet machine.
"""

from __future__ import annotations

import argparse
import os
import timeit

import torch

import opennpu.migrate.transfer as transfer


def per_call_us(fn, number: int = 20000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ.pop("TORCH_NPU_MIGRATION_LOG", None)
    a = torch.ones(4)
    plain, patched = [], []
    for _ in range(args.repeats):
        plain.append(per_call_us(lambda: a.to(torch.float32)))
        transfer.apply()
        patched.append(per_call_us(lambda: a.to(torch.float32)))
        transfer._unpatch()
    p, q = min(plain), min(patched)
    print(f"Tensor.to(torch.float32), 4 elements: {p:.2f} us plain, {q:.2f} us under "
          f"transfer_to_npu (+{q - p:.2f} us, {q / p:.2f}x the time)")


if __name__ == "__main__":
    main()
