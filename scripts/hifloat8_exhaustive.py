"""Checks opennpu's float32 -> hifloat8 encoder (csrc/ops/quant/hifloat8.h) against
en_dtypes.hifloat8 on every one of the 2^32 float32 bit patterns.

    python scripts/hifloat8_exhaustive.py            # the C++ encoder (built here with g++)
    python scripts/hifloat8_exhaustive.py --portable # also the portable path's torch encoder

en_dtypes casts each chunk of bit patterns in NumPy; the codes stream to a small C++ program that
runs hifloat8_from_bits on the same patterns and counts mismatches (no 4 GiB table on disk). About
a minute on two cores (--portable: a few more). Too slow for the test suite, which keeps a sample
(tests/ops/test_hifloat8_out.py). Needs numpy, en_dtypes and a C++20 compiler (CXX, default g++).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile
import warnings

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHUNK = 1 << 24

HARNESS = r"""
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include "ops/quant/hifloat8.h"
int main() {
  const size_t chunk = size_t(1) << 24;
  std::vector<uint8_t> want(chunk);
  uint64_t start = 0, bad = 0;
  while (std::fread(want.data(), 1, chunk, stdin) == chunk) {
    for (size_t i = 0; i < chunk; ++i) {
      const uint32_t bits = uint32_t(start + i);
      const uint8_t got = opennpu::quant::hifloat8_from_bits(bits);
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      const uint8_t table = opennpu::quant::float_to_hifloat8_table(f);
      if ((got != want[i] || table != want[i]) && bad++ < 20) {
        std::printf("0x%08x: hifloat8.h 0x%02x (table 0x%02x), en_dtypes 0x%02x\n", bits, got,
                    table, want[i]);
      }
    }
    start += chunk;
  }
  std::printf("%llu patterns, %llu mismatches\n", (unsigned long long)start,
              (unsigned long long)bad);
  return start == (uint64_t(1) << 32) && bad == 0 ? 0 : 1;
}
"""


def chunks():
    import en_dtypes

    for start in range(0, 1 << 32, CHUNK):
        bits = np.arange(start, start + CHUNK, dtype=np.uint64).astype(np.uint32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # NaN casts
            yield start, bits, bits.view(np.float32).astype(en_dtypes.hifloat8).view(np.uint8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--portable", action="store_true",
                    help="also check opennpu.ops.portable._hif8_encode (imports opennpu)")
    args = ap.parse_args()
    encode = None
    if args.portable:
        import torch

        from opennpu.ops.portable import _hif8_encode as encode
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "h.cpp"), os.path.join(tmp, "h")
        pathlib.Path(src).write_text(HARNESS)
        subprocess.run([os.environ.get("CXX", "g++"), "-O2", "-std=c++20", "-Wall", "-Wextra",
                        "-Werror", f"-I{ROOT / 'csrc'}", src, "-o", exe], check=True)
        proc = subprocess.Popen([exe], stdin=subprocess.PIPE)
        bad_portable = 0
        for _, bits, want in chunks():
            proc.stdin.write(want.tobytes())
            if encode is not None:
                got = encode(torch.from_numpy(bits.view(np.float32))).numpy()
                bad_portable += int(np.count_nonzero(got != want))
        proc.stdin.close()
        rc = proc.wait()
    if encode is not None:
        print(f"portable encoder: {bad_portable} mismatches")
    return rc or (1 if bad_portable else 0)


if __name__ == "__main__":
    sys.exit(main())
