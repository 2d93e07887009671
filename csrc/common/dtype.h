// Dtype conventions shared by the entry points.
#pragma once

#include <ATen/core/Tensor.h>

namespace opennpu {

// The kernels' accumulator dtype, also the dtype of fp32-by-contract outputs such as rstd and
// dgamma: float32, or float64 for float64 inputs (kept exact for gradcheck).
inline at::ScalarType acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace opennpu
