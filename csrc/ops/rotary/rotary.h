// Rotary embedding: npu_rotary_mul and npu_rotary_mul_backward (Ascend's RotaryMul / RotaryMulGrad).
//
//   out = x * r1 + rotate(x) * r2,   r1 = cos, r2 = sin, both broadcast against x
//   'half':       rotate(x) = cat(-x[D/2:], x[:D/2])
//   'interleave': rotate(x)[2i] = -x[2i+1], rotate(x)[2i+1] = x[2i]
// Any layout (BNSD, BSND, SBND, TND, ...) is a broadcast pattern of r over x's leading dims; the
// kernels walk rows of D elements and find each row's r row through (possibly zero) strides.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "common/cpu_dispatch.h"

namespace opennpu::rotary {

enum class Mode { kHalf, kInterleave };

// Leading-dim geometry: x has rows indexed by `sizes` (x.shape[:-1]); each tensor's row start is
// sum(index[d] * strides[d]) in elements.
struct RowLayout {
  std::vector<int64_t> sizes;
  std::vector<int64_t> x_strides, r1_strides, r2_strides;
};

// out (contiguous) = x * r1 + rotate(x) * r2. x rows may be strided (last dim contiguous); r1/r2
// share one dtype: x's, or the accumulator dtype.
using RotaryFwdFn = void(const at::Tensor& x, const at::Tensor& r1, const at::Tensor& r2,
                         const RowLayout& layout, Mode mode, at::Tensor& out);

// Backward over contiguous grad and x of shape [..., D], with r1/r2 materialised in their joint
// broadcast shape `r_shape` (contiguous). dr1/dr2 (accumulator dtype, r_shape) receive the sums
// of x * grad and rotate(x) * grad over the dims where r broadcasts.
using RotaryBwdFn = void(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& r1,
                         const at::Tensor& r2, Mode mode, at::Tensor& dx, at::Tensor& dr1,
                         at::Tensor& dr2);

extern CpuKernel<RotaryFwdFn> rotary_fwd_cpu;
extern CpuKernel<RotaryBwdFn> rotary_bwd_cpu;

}  // namespace opennpu::rotary
