// npu_grouped_matmul (Ascend GroupedMatmul): y_g = x_g @ w_g (+ b_g) for G groups, where the
// groups are separate tensors or the row ranges of one x that group_list cuts (group_type 0,
// "grouped on M"), or column ranges (group_type 2, "grouped on K"). Quantised paths:
//   A8W8       int8 x and weights: each group is one npu_quant_matmul product (exact int32
//              accumulation, then its fused dequantise / requantise epilogue; ops/quant).
//   A16W8/W4   fp16 / bf16 x, int8 or packed-int4 weights with antiquant_scale (and offset):
//              each non-empty group's weight is dequantised into x's dtype (antiquant_weight
//              below, at the golden's rounding points) and goes through the float GEMMs.
//   float8 / MX float8 / float4 x and weights (Ascend 950's path): each group is one product of
//              npu_quant_matmul's float-operand kernel (codes decoded exactly, MX block scales
//              applied in fp32, an fp32 GEMM, its epilogue; ops/quant).
//
// The entry point (grouped_matmul.cpp) turns every accepted x / weight / output layout into a list
// of plain 2-D GEMMs (GemmGroup); the kernel (grouped_matmul_cpu.cpp) cuts those into tiles of at
// most kRowTile x kColTile outputs and hands the tiles to the threads dynamically, so a few large
// groups and many tiny ones (MoE decoding: a handful of tokens per expert) both keep every thread
// busy. Each tile is one single-threaded BLAS call plus a vectorised epilogue while the tile is in
// cache:
//   fp32 / fp64   MKL sgemm_ / dgemm_ (or ATen's addmm) straight into the output, then + bias;
//   fp16 / bf16   MKL's cblas_gemm_{f16f16f32,bf16bf16f32} (fp32 accumulation) into an fp32 tile,
//                 then + bias (kept in fp32) and one rounding into the output. Where the CPU
//                 GEMM policy (common/half_gemm.h) says fp32 (a CPU without fp16 / bf16
//                 arithmetic), where PyTorch's BLAS lacks those GEMMs, or with
//                 OPENNPU_GMM_HALF_GEMM=0, the tile's operands are converted to fp32 and go
//                 through sgemm_ instead.
// Groups without bias skip the tiles for one whole ATen GEMM each where grouped_gemm_plan says so
// (see GroupedGemmPlan).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>

#include "common/kernel_slots.h"

namespace opennpu::moe {

// One GEMM out[m, n] = a[m, k] @ b[k, n] (+ bias[n]) in `dtype` (a, b and out), row-major with
// leading dimensions; ta / tb: the operand is stored transposed (a as [k, m], b as [n, k]).
struct GemmGroup {
  const void* a = nullptr;
  int64_t lda = 0;
  bool ta = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool tb = false;
  const void* bias = nullptr;  // [n] in the accumulator dtype (float, double for fp64), or null
  void* out = nullptr;
  int64_t ldout = 0;
  int64_t m = 0, n = 0, k = 0;
};

using GroupedGemmFn = void(at::ScalarType dtype, c10::ArrayRef<GemmGroup> groups);

extern KernelSlots<GroupedGemmFn> grouped_gemm;

// How the float and weight-only paths multiply on this device (the CPU's policy lives in
// grouped_matmul_cpu.cpp). Read once per call.
struct GroupedGemmPlan {
  // Groups without bias go to one whole ATen GEMM each (at::mm_out in `dtype`) rather than the
  // tiles of grouped_gemm.
  bool whole_aten = false;
  // The weight-only path multiplies fp32 copies of x and of the dequantised weight (holding
  // their fp16 / bf16 values exactly), then adds the bias and rounds once into the output,
  // rather than GEMMs in x's dtype.
  bool antiquant_fp32 = false;
};

using GroupedGemmPlanFn = GroupedGemmPlan(at::ScalarType dtype);

extern KernelSlots<GroupedGemmPlanFn> grouped_gemm_plan;

// Weight-only dequantisation into `dtype` (float16 or bfloat16): out [rows, cols] (contiguous, in
// dtype, or float32 holding the dtype values exactly) from `codes`, int8 [rows, cols] or int32
// [rows, cols / 8] (eight int4 codes per word, lowest bits first), contiguous. The weight's K
// axis is the rows (k_on_rows) or the columns, its N axis the other; scale / offset are fp32
// [G, N] (offset may be undefined) and element (k, n) uses row k / group_size of them.
// out = (code + offset) * scale, computed in fp32 with (code + offset) first rounded to float16
// for float16 (the golden's fp16 arithmetic), rounded once to dtype.
using AntiquantWeightFn = void(const at::Tensor& codes, bool int4, bool k_on_rows,
                               const at::Tensor& scale, const at::Tensor& offset,
                               int64_t group_size, at::ScalarType dtype, at::Tensor& out);

extern KernelSlots<AntiquantWeightFn> antiquant_weight;

}  // namespace opennpu::moe
