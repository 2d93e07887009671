// Dtype conventions shared by the entry points.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace opennpu {

// The kernels' accumulator dtype, also the dtype of fp32-by-contract outputs such as rstd and
// dgamma: float32, or float64 for float64 inputs (kept exact for gradcheck).
inline at::ScalarType acc_dtype(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The name of a dtype code of an `int? *_dtype` argument (torch's ScalarType numbering; torch_npu's
// own codes, such as hifloat8's 290, are named as Ascend-only types).
inline std::string dtype_name(int64_t code) {
  if (code >= 0 && code < static_cast<int64_t>(c10::ScalarType::NumOptions)) {
    return c10::toString(static_cast<c10::ScalarType>(code));
  }
  return "dtype code " + std::to_string(code) + " (an Ascend-only type such as hifloat8 or float4)";
}

}  // namespace opennpu
