// Mixture-of-experts routing: npu_moe_gating_top_k_softmax, npu_moe_init_routing,
// npu_moe_compute_expert_tokens, npu_moe_finalize_routing (Ascend MoeGatingTopKSoftmax,
// MoeInitRouting, MoeComputeExpertTokens, MoeFinalizeRouting) and npu_grouped_matmul
// (grouped_matmul.cpp), the pieces of a MoE layer:
//
//   logits [T, E] --gating--> y, expert_idx [T, k] (softmax top-k), row_idx [T, k]
//   x [T, H] --init_routing--> expanded_x [T*k, H] (rows sorted by expert, stable),
//                              expanded_row_idx [T*k] (where each (token, slot) went),
//                              expanded_expert_idx [T*k] (the sorted experts)
//   expanded_expert_idx --compute_expert_tokens--> cumulative rows per expert [E]
//   expanded_x --npu_grouped_matmul (group_list = those counts) + activation--> rows [T*k, H]
//   rows --finalize_routing--> out [T, H] = skip1 + skip2 + sum_k scales * (row + bias[expert])
//
// Slot j of token i is "source row" j*T + i (torch_npu's row_idx = arange(T*k).view(k, T).t()).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "common/kernel_slots.h"

namespace opennpu::moe {

// Softmax over the last dim of each of the `rows` rows of x (contiguous, [rows, E]), then its
// top k (ties to the lower expert index; for fp16/bf16 the values are compared as rounded to
// x's dtype, as torch_npu's golden does). y: [rows, k] in x's dtype; expert_idx, row_idx:
// [rows, k] int32. finished (nullptr or rows bools): those rows get expert index E.
using GatingFn = void(const at::Tensor& x, const bool* finished, int64_t k, at::Tensor& y,
                      at::Tensor& expert_idx, at::Tensor& row_idx);

// npu_moe_gating_top_k_softmax_v2 over x [rows, E] (contiguous): y [rows, k] in x's dtype,
// expert_idx [rows, k] int32 (E where finished). renorm false: the top k of the softmax computed
// in acc_t and ranked unrounded, written (when probs is defined) to probs [rows, E] in acc_t;
// renorm true: the top k of the logits themselves, y = their softmax (probs is undefined).
using GatingV2Fn = void(const at::Tensor& x, const bool* finished, int64_t k, bool renorm,
                        at::Tensor& y, at::Tensor& expert_idx, at::Tensor& probs);

// The gather and the sums of npu_moe_finalize_routing, one pass over the output:
//   out[i] = skip1[i] + skip2[i] + sum_j scale[i, j] * (rows[src[i, j]] + bias[expert[i, j]])
// rows: [R, H] contiguous, out's dtype. skip1 / skip2: [N, H] contiguous in out's dtype, or
// undefined. bias: [E, H] contiguous float32 (float64 for float64 rows) or undefined. scales:
// [N, K] contiguous in bias's dtype, or undefined (= 1). src: [N, K] int32 row of each term, -1 =
// a dropped slot (its row counts as 0). expert: [N, K] int32, read only with a bias. All indices
// were checked by the caller.
using FinalizeFn = void(const at::Tensor& rows, const at::Tensor& skip1, const at::Tensor& skip2,
                        const at::Tensor& bias, const at::Tensor& scales, const int32_t* src,
                        const int32_t* expert, int64_t k, at::Tensor& out);

// Host helpers of moe.cpp shared with the other routing ops (token_permute.cpp, routing_v2.cpp).
// An index tensor: int32 (torch_npu's dtype) or int64 (what torch.topk / torch.sort return).
void check_index(const char* op, const char* arg, const at::Tensor& t);
// t's values as a contiguous int64 vector (index tensors here are small: N*K entries).
std::vector<int64_t> index_values(const at::Tensor& t);
// A stable sort of keys: order[p] = the position of the p-th smallest key (ties in position
// order). Counting sort when the key range is small next to the count, else std::stable_sort.
std::vector<int64_t> sort_by_expert(const std::vector<int64_t>& expert);
// out[r] = x[src_row[r]] for r < rows (row bytes, in parallel), a zero row where src_row[r] < 0.
// x, out: contiguous [*, H] of one dtype. op names the caller in errors.
void gather_rows(const char* op, const at::Tensor& x, const int64_t* src_row, int64_t rows,
                 at::Tensor& out);

// gather_rows' kernel: an output larger than the last-level cache (the permuted tokens are K
// times the input) is written with streaming stores (common/stream_store.h), which skip reading
// each destination line before writing it.
using GatherRowsFn = void(const at::Tensor& x, const int64_t* src_row, int64_t rows,
                          at::Tensor& out);

extern KernelSlots<GatingFn> gating;
extern KernelSlots<GatingV2Fn> gating_v2;
extern KernelSlots<FinalizeFn> finalize;
extern KernelSlots<GatherRowsFn> gather_rows_slots;

}  // namespace opennpu::moe
