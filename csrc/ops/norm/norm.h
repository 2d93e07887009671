// RMSNorm family: npu_rms_norm (+ backward), npu_gemma_rms_norm, npu_add_rms_norm,
// npu_add_rms_norm_cast. The row kernels themselves are in norm_rows.h (shared with the fused
// norm + quantisation ops of csrc/ops/quant).
//
// Host-side declarations shared by norm.cpp (validation, entry points, registration) and the
// per-device kernels. The kernels see a row-major [rows, n] view: n = gamma.numel() is the
// normalised size, and gamma arrives already converted to the accumulator dtype (fp32, or fp64
// for fp64 inputs), with the Gemma "+1" folded in, so kernels are templated on x's dtype only.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "common/kernel_slots.h"

namespace opennpu::norm {

// y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2) + eps) per row.
// x, y: [rows, n] contiguous; gamma: [n] accumulator dtype; rstd: [rows] accumulator dtype.
using RmsNormFwdFn = void(const at::Tensor& x, const at::Tensor& gamma, double eps, at::Tensor& y,
                          at::Tensor& rstd);

// x = x1 + x2 rounded to x1's dtype (the torch_npu golden adds in the input dtype), then
// RMSNorm of that rounded x. x1, x2, x, y: [rows, n] contiguous.
using AddRmsNormFwdFn = void(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& gamma,
                             double eps, at::Tensor& y, at::Tensor& rstd, at::Tensor& x);

// add_rms_norm with y stored twice: y1 in the accumulator dtype (float32), y2 in x1's dtype.
using AddRmsNormCastFwdFn = void(const at::Tensor& x1, const at::Tensor& x2,
                                 const at::Tensor& gamma, double eps, at::Tensor& y1,
                                 at::Tensor& y2, at::Tensor& rstd, at::Tensor& x);

// dx = rstd * dy * gamma - x * rstd^3 * sum(dy * gamma * x) / n;  dgamma = sum_rows(dy * x * rstd).
// dy, x, dx: [rows, n]; rstd: [rows]; dgamma: [n] accumulator dtype.
using RmsNormBwdFn = void(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gamma,
                          const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dgamma);

extern KernelSlots<RmsNormFwdFn> rms_norm_fwd;
extern KernelSlots<AddRmsNormFwdFn> add_rms_norm_fwd;
extern KernelSlots<RmsNormBwdFn> rms_norm_bwd;
extern KernelSlots<AddRmsNormCastFwdFn> add_rms_norm_cast_fwd;

// Registers the family's torch.ops.npu entry points (norm.cpp) for one dispatch key.
void register_npu_entry_points(torch::Library& m);

}  // namespace opennpu::norm
