"""The kernels of every instruction set opennpu compiles are correct, not only the one this
machine picks: each ISA runs in a subprocess (ATEN_CPU_CAPABILITY selects it) over all ops, dtypes
and sizes that exercise full vectors and tails."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

import opennpu

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import opennpu
    from opennpu.testing import reference as R
    from opennpu.testing.tolerances import assert_close

    assert opennpu.cpu_isa() == sys.argv[1], opennpu.cpu_isa()
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for rows, n in ((3, 7), (5, 64), (2, 769)):
            x, g = torch.randn(rows, 2 * n, dtype=dtype), torch.randn(2 * n, dtype=dtype)
            dy = torch.randn_like(x)
            y, rstd = opennpu.npu_rms_norm(x, g)
            assert_close(y, R.rms_norm(x, g)[0])
            for ours, ref in zip(opennpu.npu_rms_norm_backward(dy, x, g, rstd),
                                 R.rms_norm_backward(dy, x, g, rstd)):
                assert_close(ours, ref, dtype=dtype, scale=4)
            assert_close(opennpu.npu_add_rms_norm(x, dy, g)[0], R.add_rms_norm(x, dy, g)[0])
            assert_close(opennpu.npu_add_rms_norm_cast(x, dy, g)[0], R.add_rms_norm(x, dy, g)[0],
                         dtype=torch.float64 if dtype == torch.float64 else torch.float32)
            # quantisation: codes and scales bit-exact (int8, packed int4, smooth scales)
            sm = torch.rand(2 * n, dtype=dtype) + 0.5
            for dst in (None, torch.quint4x2):
                if dst is not None and (2 * n) % 8:
                    continue
                yq, sq = opennpu.npu_dynamic_quant(x, smooth_scales=sm, dst_type=dst)
                cq, sref = R.dynamic_quant(x, sm, dst_type=dst)
                assert torch.equal(R.unpack_int4(yq) if dst else yq, cq) and torch.equal(sq, sref)
            y1, _, _, s1, _ = opennpu.npu_add_rms_norm_dynamic_quant(x, dy, g, smooth_scale1=sm)
            c1, _, _, r1, _ = R.add_rms_norm_dynamic_quant(x, dy, g, sm)
            assert (y1.int() - c1.int()).abs().max() <= 1
            torch.testing.assert_close(s1, r1, rtol=2e-6, atol=0)
            assert_close(opennpu.npu_swiglu(x), R.swiglu(x))
            gh = torch.randn(rows, n, dtype=dtype)
            assert_close(opennpu.npu_swiglu_backward(gh, x), R.swiglu_backward(gh, x))
            for approximate in (0, 1):
                assert_close(opennpu.npu_geglu(x, -1, approximate)[0], R.geglu(x, -1, approximate)[0])
            assert_close(opennpu.fast_gelu(x), R.fast_gelu(x))
            assert_close(opennpu.npu_fast_gelu_backward(dy, x), R.fast_gelu_backward(dy, x))
            q = torch.randn(2, rows, 3, 2 * n, dtype=dtype)
            c, s = torch.randn(1, rows, 1, 2 * n, dtype=dtype), torch.randn(1, rows, 1, 2 * n, dtype=dtype)
            dq = torch.randn_like(q)
            for mode in ("half", "interleave"):
                assert_close(opennpu.npu_rotary_mul(q, c, s, mode), R.rotary_mul(q, c, s, mode))
                for ours, ref in zip(opennpu.npu_rotary_mul_backward(dq, q, c, s, mode),
                                     R.rotary_mul_backward(dq, q, c, s, mode)):
                    assert_close(ours, ref, dtype=dtype, scale=4)
            mask = torch.rand(rows, 1, 2 * n) < 0.3  # against q [2, rows, 3, 2n]
            for m in (mask, mask[..., :1], mask.to(torch.uint8)):
                for triu in (False, True):
                    y = opennpu.npu_scaled_masked_softmax(q, m, 0.7, triu)
                    assert_close(y, R.scaled_masked_softmax(q, m, 0.7, triu))
                    assert_close(opennpu.npu_scaled_masked_softmax_backward(dq, y, m, 0.7, triu),
                                 R.scaled_masked_softmax_backward(dq, y, m, 0.7, triu))

    # confusion transpose: every unit size (1, 2, 4, 8 bytes, and 16-byte runs), SIMD blocks + tails
    for dtype in (torch.int8, torch.bfloat16, torch.float32, torch.float64, torch.complex128):
        big = (2048, 4096 // dtype.itemsize)  # a 16 MiB output: the streaming-store paths
        for shape, perm in (((37, 70), (1, 0)), ((3, 19, 5, 33), (0, 2, 1, 3)), ((9, 17, 6), (2, 0, 1)),
                            (big, (1, 0)), ((4, 32, 2048 // dtype.itemsize, 64), (0, 2, 1, 3))):
            x = torch.randn(shape).to(dtype)
            out = opennpu.npu_confusion_transpose(x, perm, [shape[p] for p in perm], True)
            assert torch.equal(out, x.permute(perm).contiguous()), (dtype, shape, perm)

    # MX quantisation: codes and scales bit-exact for every element format and fp4 rounding
    # mode, blocks along the last axis (32, longer, a partial last block) and along another axis
    # (full and partial groups of 16 columns)
    gen = torch.Generator().manual_seed(1)
    xm = torch.randn(6, 70, generator=gen) * torch.exp2(
        torch.randint(-12, 12, (6, 70), generator=gen).float())
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for dst, mode in ((24, "rint"), (23, "rint"), (296, "rint"), (296, "round"), (296, "floor"),
                          (297, "rint")):
            for shape, axis, bs in (((6, 70), -1, 32), ((6, 70), -1, 64), ((70, 6), 0, 32),
                                    ((3, 70, 2), 1, 32), ((2, 35, 6), 1, 32), ((14, 30), 0, 32)):
                xd = xm.flatten()[:shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1)]
                xd = xd.reshape(shape).to(dtype)
                if dst in (296, 297) and shape[-1] % 2:
                    continue
                y, s = opennpu.npu_dynamic_mx_quant(xd, axis=axis, dst_type=dst, round_mode=mode,
                                                    block_size=bs)
                c, sr = R.dynamic_mx_quant(xd, axis, dst, bs, mode)
                assert torch.equal(s, sr), (dtype, dst, mode, shape, axis)
                want = c if dst in (23, 24) else R.pack_fp4(c)
                assert torch.equal(y.view(torch.uint8), want), (dtype, dst, mode, shape, axis)

    # gradient norms of the fused optimizers: the unrolled loop (bf16 widened by shift / mask),
    # its tail, and pieces cut between threads, against float64 sums of the same values
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (7, 769, 70001)]
        for p in params:
            p.grad = torch.randn(p.shape).to(dtype)
        g = torch.cat([p.grad.double() for p in params]).abs()
        for norm_type in (1.0, 2.0, 3.5, float("inf")):
            got = torch.ops.opennpu._fused_grad_norm(params, norm_type).double()
            want = g.max() if norm_type == float("inf") else g.pow(norm_type).sum() ** (1 / norm_type)
            torch.testing.assert_close(got, want, rtol=2e-6, atol=0, msg=f"{dtype} p={norm_type}")
    print("ok")
    """
)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 ISAs only")
@pytest.mark.parametrize("capability,isa", [("avx2", "AVX2"), ("default", "AVX2"),
                                            ("avx512", "AVX512")])
def test_every_compiled_isa_matches_the_reference(capability, isa):
    if isa == "AVX512" and opennpu.cpu_isa() != "AVX512":
        pytest.skip("this CPU has no AVX-512")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    result = subprocess.run([sys.executable, "-c", SCRIPT, isa], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")
