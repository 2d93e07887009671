// Confusion transpose: npu_confusion_transpose and npu_confusion_transpose_backward.
//
//   transpose_first=True:  out = self.permute(perm).contiguous().view(shape)
//   transpose_first=False: out = self.view(shape).permute(perm).contiguous()
//
// Both are one data movement: gather a strided view of the input into a new contiguous tensor.
// The entry points (transpose.cpp) reduce every call to a CopyPlan: the dims of that view in
// output order, with size-1 dims dropped and dims that stay adjacent in memory merged, and the
// innermost dims that are contiguous on both sides folded into "runs". The kernels move bytes, so
// they are chosen by element size (1, 2, 4 or 8 bytes), never by dtype.
#pragma once

#include <cstdint>
#include <vector>

#include "common/kernel_slots.h"

namespace opennpu::transpose {

struct CopyPlan {
  int64_t unit = 1;  // bytes per moved element: 1, 2, 4 or 8
  int64_t run = 1;   // units per run: contiguous in both the source and the output
  // The remaining dims in output order (their elements are runs; the output is contiguous over
  // them) and the source strides of those dims, in units. May be empty (one run).
  std::vector<int64_t> sizes;
  std::vector<int64_t> src_strides;
};

// dst (contiguous, prod(sizes) * run units) <- the source view described by plan, based at src.
using PermuteCopyFn = void(const char* src, char* dst, const CopyPlan& plan);

extern KernelSlots<PermuteCopyFn> permute_copy;

// dst[0, bytes) <- src[0, bytes) with streaming stores (common/stream_store.h), in parallel: the
// benchmark harness's second memory roof (torch.ops.opennpu._stream_copy_).
using StreamCopyFn = void(const char* src, char* dst, int64_t bytes);

extern KernelSlots<StreamCopyFn> stream_copy;

}  // namespace opennpu::transpose
