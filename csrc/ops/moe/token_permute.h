// npu_moe_token_permute / npu_moe_token_unpermute and their gradients (Ascend MoeTokenPermute,
// MoeTokenUnpermute, MoeTokenPermuteGrad, MoeTokenUnpermuteGrad): Megatron's MoE dispatch and
// combine.
//
//   indices [T, K] (expert of slot k of token t) --stable sort--> order (position of each pair)
//   permute:   permuted[p] = tokens[order[p] / K]             (p < num_out_tokens)
//              sorted_indices[order[p]] = p                    (int32 [T*K]: where pair i went)
//   unpermute: out[t] = sum_k probs[t, k] * permuted[sorted_indices[t*K + k]]
//              (a sorted_indices value >= permuted.size(0) is a dropped pair: it adds 0)
//
// The gradient of permute is an unpermute without probs summed over the K slots; the gradient of
// unpermute scatters probs * grad back to the permuted rows and forms grad_probs as row dots.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "common/kernel_slots.h"

namespace opennpu::moe {

// out[t] = sum_{k < K} w[t*K + k] * rows[src[t*K + k]] for the T = out.size(0) output rows,
// accumulated in acc_t and rounded once. rows: [R, H] contiguous in out's dtype; src: T*K row
// indices, -1 = dropped (adds 0); weight: T*K values in the accumulator dtype (float32, float64
// for float64 rows), or nullptr (= 1). Indices were checked by the caller.
using GatherSumFn = void(const at::Tensor& rows, const int64_t* src, const void* weight,
                         int64_t k, at::Tensor& out);

// The gradients of GatherSumFn with respect to rows and to w, for one incoming grad [T, H]:
//   grad_rows[src[q]] = w[q] * grad[q / K]          (rows no q points at are left untouched)
//   grad_w[q] = dot(grad[q / K], rows[src[q]])       (when grad_w is not nullptr; 0 if dropped)
// rows: [R, H] in grad's dtype, read only for grad_w. grad_rows: [R, H] contiguous. src values
// are distinct (checked by the caller), so every grad_rows row is written by one q at most.
// weight, grad_w: T*K values in the accumulator dtype, or nullptr.
using GatherSumBackwardFn = void(const at::Tensor& grad, const at::Tensor& rows,
                                 const int64_t* src, const void* weight, int64_t k,
                                 at::Tensor& grad_rows, void* grad_w);

extern KernelSlots<GatherSumFn> gather_sum;
extern KernelSlots<GatherSumBackwardFn> gather_sum_backward;

}  // namespace opennpu::moe
