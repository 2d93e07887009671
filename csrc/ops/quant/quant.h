// Quantisation family: npu_dynamic_quant, npu_add_rms_norm_dynamic_quant and npu_quantize.
//
// Why a folder of its own: both ops end in the same per-row symmetric quantiser (rowmax of |v|,
// scale = rowmax / DTYPE_MAX, round half to even, clamp, int8 or packed int4), which lives once in
// quant_cpu.cpp. The fused op's RMSNorm part reuses the RMSNorm family's row kernels
// (csrc/ops/norm/norm_rows.h) instead of copying them.
//
// Kernels see row-major [rows, n] contiguous views. Floating inputs are float16, bfloat16 or
// float32 (float64 is converted to float32 by the entry points); every auxiliary vector (smooth
// scales, gamma, beta) arrives as contiguous float32. Outputs: codes as int8 [rows, n], or int32
// [rows, n / 8] holding eight int4 codes each, lowest bits first, or float8 / hifloat8 bytes
// [rows, n] (fp8 != 0, npu_dynamic_quant only); scales float32.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "common/kernel_slots.h"

namespace opennpu::quant {

// How codes are produced: v -> clamp(round_half_even(v / scale), lo, hi) with
// scale = rowmax(|v|) / qmax (a zero scale is replaced by 1), stored as int8 or packed int4.
struct QuantSpec {
  float qmax;  // DTYPE_MAX: 127 (int8), 7 (int4), or dst_type_max
  float lo, hi;  // the code range: [-128, 127] or [-8, 7]
  bool int4;  // pack eight codes per int32
  int fp8 = 0;  // float codes instead (1: float8_e4m3fn, 2: float8_e5m2, 3: hifloat8 as uint8):
                // y = fp8(v / scale) with scale = rowmax * (1 / qmax) as CANN's golden forms
                // it; float8 rounds half to even (c10), hifloat8 half away from zero
                // (hifloat8.h, en_dtypes' cast)
};
constexpr int kFp8E4m3 = 1, kFp8E5m2 = 2, kFp8Hif8 = 3;

// npu_dynamic_quant. smooth: undefined, [n], or [groups, n] with group_ends (int64 [groups],
// non-decreasing, last = rows: group g covers rows [group_ends[g-1], group_ends[g])).
// per_tensor: one scale for the whole tensor (scale has 1 element), else one per row.
using DynamicQuantFn = void(const at::Tensor& x, const at::Tensor& smooth,
                            const at::Tensor& group_ends, bool per_tensor, const QuantSpec& spec,
                            at::Tensor& y, at::Tensor& scale);

// npu_add_rms_norm_dynamic_quant. x = x1 + x2 in float32 (stored rounded to x_out),
// y = x * rstd * gamma (+ beta); branch k quantises y * smooth_k (or y) into (y_k, scale_k).
// beta / smooth1 / smooth2 may be undefined; outputs of a disabled branch are not touched.
using AddRmsNormDynamicQuantFn = void(const at::Tensor& x1, const at::Tensor& x2,
                                      const at::Tensor& gamma, const at::Tensor& beta,
                                      const at::Tensor& smooth1, const at::Tensor& smooth2,
                                      double eps, bool branch1, bool branch2,
                                      const QuantSpec& spec, at::Tensor& y1, at::Tensor& y2,
                                      at::Tensor& x_out, at::Tensor& scale1, at::Tensor& scale2);

// npu_quantize: the codes of an affine quantisation with fixed (not data-derived) parameters.
// x is a contiguous [outer, channels, inner] view, scale and zero_point (the latter may be
// undefined: 0) contiguous float32 [channels]; element (o, c, i) uses channel c's pair.
//   div:  t = round_half_even(x * (1 / scale)) + zero_point      (torch.quantize_per_channel)
//   mul:  t = fp32(x * scale) + zero_point (two roundings, no FMA) (AscendQuantV2's golden)
// then q = clamp(round_half_even(t), lo, hi) of the output type (int32: saturating), NaN t -> zero_point.
// y: int8 / uint8 / int32 codes of x's shape, or (int4) int32 [outer, channels, inner / 8]
// words of eight int4 codes, lowest bits first; int4 needs inner % 8 == 0 or, with inner == 1,
// channels % 8 == 0 (the packed axis is always x's last dim).
// hifloat8 (kHif8, uint8 codes of x's shape; no golden defines it, this follows the formulas):
//   div:  t = fp32(x / scale) + zero_point   (the true quotient, aclnnQuantize's x / scales)
//   mul:  t = fp32(x * scale) + zero_point
// q = hifloat8(t) (hifloat8.h: ties away from zero, |t| >= 40960 -> inf, NaN -> NaN code).
enum class QuantizeOut { kInt8, kUInt8, kInt32, kInt4, kHif8 };
using QuantizeFn = void(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& zero_point,
                        bool div, QuantizeOut out, at::Tensor& y);

// hifloat8 codes (uint8, contiguous, x's shape) of a float32 tensor on the CPU (or npu) device:
// y = hifloat8(x) element by element (hifloat8.h). Used by the ops whose outputs are cast to
// hifloat8 after their own arithmetic (npu_fused_infer_attention_score_v2's output quant).
at::Tensor to_hifloat8(const at::Tensor& x);

extern KernelSlots<DynamicQuantFn> dynamic_quant;
extern KernelSlots<AddRmsNormDynamicQuantFn> add_rms_norm_dynamic_quant;
extern KernelSlots<QuantizeFn> quantize;

// The npu_dynamic_quant entry point (quant.cpp), registered for CPU there and for CUDA in
// quant_cuda.cu.
std::tuple<at::Tensor, at::Tensor> npu_dynamic_quant(const at::Tensor& input,
                                                     const std::optional<at::Tensor>& smooth_scales,
                                                     const std::optional<at::Tensor>& group_index,
                                                     std::optional<int64_t> dst_type,
                                                     std::string_view quant_mode, double dst_type_max);

}  // namespace opennpu::quant
