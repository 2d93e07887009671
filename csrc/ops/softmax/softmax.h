// Scaled masked softmax: npu_scaled_masked_softmax and its backward (Ascend ScaledMaskedSoftmax).
//
//   y  = softmax(where(mask, -10000, x * scale), dim=-1)         mask True / nonzero = masked out
//   dx = scale * y * (dy - sum_last(dy * y)), 0 where masked
//
// x is viewed as rows of W = x.size(-1) contiguous elements. The mask is never expanded: each row
// finds its mask row through the mask's (possibly zero) broadcast strides, described by MaskLayout.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "common/kernel_slots.h"

namespace opennpu::softmax {

// The value masked positions take before the softmax (torch_npu's golden), in every dtype.
constexpr double kMaskFill = -10000.0;

struct MaskLayout {
  enum class Kind {
    kTensor,  // a bool/uint8 mask tensor broadcast against x
    kTriu,    // fixed_triu_mask: row r is masked at columns j > (r % triu_rows)
  };
  Kind kind = Kind::kTensor;
  // kTensor: the leading dims of x (coalesced where the mask allows) and the mask's strides along
  // them, in bytes (= elements: bool and uint8 are 1 byte); 0 where the mask broadcasts. A row's
  // mask starts at sum(index[d] * strides[d]).
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  // kTensor: the mask's stride along the last dim, 1 (a byte per column) or 0 (one byte per row).
  int64_t col_stride = 1;
  // kTriu: x.size(-2).
  int64_t triu_rows = 1;
};

// y (contiguous, x's dtype) = softmax of x (contiguous) under the mask. `mask` points at the
// mask tensor's first byte (nullptr for kTriu).
using SoftmaxFwdFn = void(const at::Tensor& x, const uint8_t* mask, const MaskLayout& layout,
                          double scale, at::Tensor& y);

// dx = scale * y * (dy - sum_last(dy * y)), 0 where masked. dy, y, dx contiguous, one dtype.
using SoftmaxBwdFn = void(const at::Tensor& dy, const at::Tensor& y, const uint8_t* mask,
                          const MaskLayout& layout, double scale, at::Tensor& dx);

extern KernelSlots<SoftmaxFwdFn> softmax_fwd;
extern KernelSlots<SoftmaxBwdFn> softmax_bwd;

}  // namespace opennpu::softmax
