// Quantised matmul: npu_quant_matmul (int8 / int4 operands, int32 accumulation, per-channel and
// per-token dequantisation or int8 requantisation), npu_trans_quant_param (the int64 scale
// encoding it accepts) and npu_convert_weight_to_int4pack (the packed int4 weights it reads).
//
// How the int32 product is computed: ATen's int8 GEMM (at::_int_mm) is fast only where oneDNN
// has int8 dot-product instructions (AVX512-VNNI, AMX); elsewhere it is a scalar loop (on an
// AVX2 Zen 3, [16 x 4096] x [4096 x 4096] took 640 ms, MKL's sgemm 13 ms). There the codes are
// converted to fp32 and multiplied by MKL's sgemm (common/blas.h), which is exact: every product
// of two codes is an integer of at most 2^14 and every partial sum an integer no larger than
// sum_k |x1_ik| |x2_kj|; while that bound is <= 2^24 each partial sum is an exactly representable
// fp32, whatever order the GEMM adds in. Usually W is converted panel by panel in cache, 512 deep
// (so the bound always holds) and the panels summed in int32 (tiled_int_gemm); for many rows
// the whole operands are converted, the conversion measures the bound (per-row L1 norms and
// absolute maxima of the codes), and K is split into chunks that keep it, summed in int32.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "common/cpu_dispatch.h"

namespace opennpu::quant {

// Largest integer magnitude below which every fp32 integer sum is exact.
constexpr int64_t kExactFloatInt = int64_t{1} << 24;

// Statistics of converted codes: the largest |code| and the largest row L1 norm (sum of |code|
// over the contiguous last dim of the source).
struct CodeStats {
  int64_t absmax = 0;
  int64_t row_l1_max = 0;
};

// int8 [rows, n] (contiguous) -> fp32 [rows, n]; int32 words [rows, n / 8] holding eight int4
// codes each (lowest bits first, sign-extended) -> fp32 [rows, n]. `dst` is contiguous.
using CodesToFloatFn = CodeStats(const at::Tensor& src, bool int4, at::Tensor& dst);
// acc [m, n] (int32) = a [m, k] (fp32 codes) x W (int8, or int4 words; rows [k, n], or [n, k]
// when w_trans), exactly: W is converted panel by panel, the panels summed in int32.
using TiledIntGemmFn = void(const float* a, int64_t m, int64_t k, int64_t n, const void* w,
                            bool int4, bool w_trans, int32_t* acc);
// int4 words [rows, w] -> int8 codes [rows, 8 w].
using UnpackInt4Fn = void(const at::Tensor& src, at::Tensor& dst);
// acc (int32, contiguous) += int32(partial) (fp32 holding exact integers, same numel).
using AccumulateChunkFn = void(at::Tensor& acc, const at::Tensor& partial);

// The epilogue over rows of the accumulator acc [batches * m, n] (int32, or fp32 holding the
// exact int32 values or, for float operands, the fp32 product):
//   v = acc (+ bias_int[b, j]) (in int32), then for float and int8 outputs
//   y = v * scale[j] (* pertoken[i]) (+ bias_float[b, j]) (+ offset[j]) in fp32, rounded once to
//   the output dtype (int8: round half to even, saturated to [-128, 127]); int32 outputs are v.
// Vectors of length n have n elements or one (broadcast); bias tensors are [1 or batches, n].
struct QuantMatmulEpilogue {
  at::Tensor scale;     // fp32 [1] or [n] (unused for int32 outputs)
  at::Tensor pertoken;  // fp32 [m] or undefined
  at::Tensor bias_int;  // int32 [bb, n] or undefined
  at::Tensor bias_float;  // fp32 [bb, n] or undefined
  at::Tensor offset;    // fp32 [1] or [n] or undefined
  int64_t m = 1;        // rows per batch (pertoken index = row % m, bias batch = row / m)
};
using QuantMatmulEpilogueFn = void(const at::Tensor& acc, const QuantMatmulEpilogue& e,
                                   at::Tensor& out);

// weight int32 [..., n] with values in [-8, 7] -> int32 [..., n / 8], eight codes per word,
// lowest bits first.
using PackInt4Fn = void(const at::Tensor& weight, at::Tensor& packed);

extern CpuKernel<CodesToFloatFn> codes_to_float_cpu;
extern CpuKernel<TiledIntGemmFn> tiled_int_gemm_cpu;
extern CpuKernel<UnpackInt4Fn> unpack_int4_cpu;
extern CpuKernel<AccumulateChunkFn> accumulate_chunk_cpu;
extern CpuKernel<QuantMatmulEpilogueFn> quant_matmul_epilogue_cpu;
extern CpuKernel<PackInt4Fn> pack_int4_cpu;

}  // namespace opennpu::quant
