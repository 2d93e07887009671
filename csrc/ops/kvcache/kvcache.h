// KV-cache and scatter data movement: npu_scatter_nd_update(_), npu_scatter_pa_kv_cache(_functional)
// and npu_gather_pa_kv_cache(_functional) (Ascend's ScatterNdUpdate, ScatterPaKvCache,
// GatherPaKvCache).
//
// All of them move rows of bytes between tensors at offsets computed from an index tensor (slots,
// block tables, nd indices): the entry points (kvcache.cpp) validate the indices and turn them
// into a RowPlan of byte offsets, and one CPU kernel executes any plan. The dtype never matters
// (every element size is copied as bytes), so int8 / fp8 caches work as fp16 ones do.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "common/kernel_slots.h"

namespace opennpu::kvcache {

// Row r of the plan copies `chunks` chunks of `chunk_bytes` from src + src_off[r] +
// c * src_chunk_stride to dst + dst_off[r] + c * dst_chunk_stride (c < chunks); a negative
// src_off[r] writes zeros instead. A contiguous row is one chunk; the PA_NZ cache layout splits a
// token's row into chunks one block-row apart. With `ordered`, rows are copied in order on one
// thread (several rows write the same place and the last must win); otherwise rows are
// independent and copied in parallel.
struct RowPlan {
  const char* src = nullptr;
  char* dst = nullptr;
  int64_t rows = 0;
  int64_t chunks = 1;
  int64_t chunk_bytes = 0;
  int64_t src_chunk_stride = 0;
  int64_t dst_chunk_stride = 0;
  const int64_t* src_off = nullptr;
  const int64_t* dst_off = nullptr;
  bool ordered = false;
};

using CopyRowsFn = void(const RowPlan& plan);

extern KernelSlots<CopyRowsFn> row_copy;

// Entry-point bodies shared with the ATB ops (ops/atb): errors name `op`. The cache layout
// ('Norm' [blocks, block_size, a, b] or 'PA_NZ' [blocks, a, block_size, b], a * b = the elements
// of a token row) follows from the cache's shape, 'Norm' where both fit.
//
// Row t of `tok` [T, ...] to slot slot_mapping[t] of `cache` (negative: skip the token; repeated
// slots: the last token wins).
void scatter_tokens(const char* op, const char* tok_name, const at::Tensor& tok,
                    const char* cache_name, at::Tensor& cache, const at::Tensor& slot_mapping);
// npu_gather_pa_kv_cache into `key` / `value`.
void gather_tokens(const char* op, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, at::Tensor& key,
                   at::Tensor& value, const std::optional<at::Tensor>& seq_offset,
                   bool is_seq_lens_cumsum);

}  // namespace opennpu::kvcache
