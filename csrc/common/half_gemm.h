// The CPU GEMM policy for fp16 / bf16 operands, decided at run time from the CPU this process
// runs on (never the build machine), shared by every op that multiplies matrices on the CPU.
//
// ATen's (oneDNN's, or its cpublas fallback's) and MKL's fp16 / bf16 GEMMs are fast only where
// the CPU has arithmetic for the dtype: bf16 with AVX512_BF16 or AMX-BF16, fp16 with AVX512_FP16
// (which every AMX-FP16 CPU also has). Elsewhere (AVX2-only CPUs; fp16 on AMD Zen 4) they emulate
// it, one to two orders of magnitude slower than sgemm on the same values, so there the ops
// multiply fp32 copies (or fp32 panels) of the operands and round the result once to the output
// dtype. Numerics are the same on both paths: fp16 / bf16 values are exact in fp32, products
// accumulate in fp32, and the result is rounded once; only the summation order may differ.
//
// OPENNPU_HALF_GEMM=auto|native|fp32 (unset: auto; read on every call) forces one path on any
// machine, e.g. for tests that compare the two; torch.ops.opennpu.half_gemm(dtype) (and
// opennpu.half_gemm) reports the choice. An op's own, narrower setting (OPENNPU_FFN_GEMM,
// OPENNPU_ATTENTION_HALF_GEMM=0, OPENNPU_GMM_HALF_GEMM=0) takes precedence over this one.
#pragma once

#include <c10/core/ScalarType.h>

namespace opennpu {

enum class HalfGemmSetting { kAuto, kNative, kFp32 };

// OPENNPU_HALF_GEMM, read on every call; a value other than auto, native or fp32 is an error.
HalfGemmSetting half_gemm_setting();

// Whether this CPU multiplies t natively (the hardware alone; computed once per dtype).
bool cpu_multiplies_natively(at::ScalarType t);

// Whether products of fp16 / bf16 operands of dtype t run on fp32 copies or panels (true), or in
// t, through ATen's / MKL's half-precision GEMMs (false): the setting above, and under auto, the
// CPU. Always false for other dtypes (nothing to convert).
bool half_gemm_in_fp32(at::ScalarType t);

}  // namespace opennpu
