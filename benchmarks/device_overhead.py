"""The npu device's costs against CPU, measured side by side in one process.

    python -m benchmarks.device_overhead [--repeats 15]

1. Dispatch overhead of a tiny op: a 16-element `a + b` on npu vs CPU (timeit loops, CPU and npu
   interleaved, the best repeat of each kept), and how many copies the npu loop made (none).
2. Large fresh outputs: npu_rms_norm at [8192, 4096] fp32, where each call's output is a new
   128 MiB tensor. On CPU it is a fresh host allocation whose pages fault on first touch; on npu it
   is a block the caching allocator keeps.
"""

from __future__ import annotations

import argparse
import time
import timeit

import torch

import opennpu  # noqa: F401  (registers the npu device, also done by torch's autoload)


def best_us(fn, number: int, repeats: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def tiny_add(repeats: int) -> dict[str, float]:
    a, b = torch.randn(16), torch.randn(16)
    an, bn = a.npu(), b.npu()
    copies = torch.ops.opennpu._npu_copy_stats()[0]
    cpu, npu = [], []
    for _ in range(repeats):  # interleaved, so both sides see the same machine load
        cpu.append(best_us(lambda: a + b, 20000, 1))
        npu.append(best_us(lambda: an + bn, 20000, 1))
    return {"cpu_us": min(cpu), "npu_us": min(npu), "ratio": min(npu) / min(cpu),
            "copies": torch.ops.opennpu._npu_copy_stats()[0] - copies}


def large_outputs(repeats: int) -> dict[str, float]:
    x, g = torch.randn(8192, 4096), torch.randn(4096)
    xn, gn = x.npu(), g.npu()

    def ms(fn) -> float:
        fn()  # warm: the npu cache then holds a block of the output's size
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return min(times)

    cpu = ms(lambda: torch.ops.npu.npu_rms_norm(x, g))
    npu = ms(lambda: torch.ops.npu.npu_rms_norm(xn, gn))
    return {"cpu_ms": cpu, "npu_ms": npu, "speedup": cpu / npu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    add = tiny_add(args.repeats)
    print(f"16-element a + b: cpu {add['cpu_us']:.2f} us, npu {add['npu_us']:.2f} us, "
          f"npu/cpu {add['ratio']:.2f}x, copies made on npu: {add['copies']}")
    big = large_outputs(max(3, args.repeats // 3))
    print(f"npu_rms_norm [8192, 4096] fp32 (fresh 128 MiB output): cpu {big['cpu_ms']:.1f} ms, "
          f"npu {big['npu_ms']:.1f} ms, npu {big['speedup']:.2f}x faster")


if __name__ == "__main__":
    main()
