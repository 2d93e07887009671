// Inference attention: npu_fused_infer_attention_score (+ .out, _get_max_workspace,
// _infer_output) and npu_fused_infer_attention_score_v2.
//
// The host side (infer_attention.cpp) turns torch_npu's arguments (layouts, GQA, actual sequence
// lengths, paged KV cache, masks, MLA rope parts) into the AttentionProblem of the training
// kernels (attention.h) plus, for the decode kernel, a description of where each key/value row
// lives (KvCache). Prefill (any query row count) runs on attention_fwd_cpu; decode (one query
// row per sequence, no pse_shift) runs on infer_decode_cpu, which reads K/V straight from the
// cache (paged or not) in their own dtype. An int8 cache (KV antiquant) is dequantised tile by
// tile as the decode kernel reads it: x' = (x + offset) * scale in fp32, with per-channel
// (scale per kv head and channel) or per-token (one scale per cached row) factors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "common/kernel_slots.h"
#include "ops/attention/attention.h"

namespace opennpu::attention {

// Key/value (and key_rope) rows of a cache. Row t of batch b, kv head h:
//   paged:      base + block_table[b * table_stride + t / block_size] * stride_blk
//               + (t % block_size) * stride_s + h * stride_n
//   contiguous: base + b * stride_blk + (kv_start[b] + t) * stride_s + h * stride_n
// The last dim is contiguous.
struct KvRows {
  const void* base = nullptr;
  int64_t stride_blk = 0;
  int64_t stride_s = 0;
  int64_t stride_n = 0;
};

// Antiquant factors of an int8 key or value cache: row t of batch b, kv head h, channel d is
// (x + offset) * scale in fp32 (offset null: 0).
//   kChannel: scale / offset are fp32 [KVN, D] (contiguous), the factors of channel d of head h.
//   kToken:   one fp32 factor per row at base + i * stride_blk + j * stride_s + h * stride_n,
//             (i, j) = (b, t) for logical rows, (block_table[b][t / bs], t % bs) when `paged`.
struct KvQuant {
  enum class Kind { kNone, kChannel, kToken } kind = Kind::kNone;
  const float* scale = nullptr;
  const float* offset = nullptr;
  int64_t stride_blk = 0;
  int64_t stride_s = 0;
  int64_t stride_n = 0;
  bool paged = false;
};

struct KvCache {
  KvRows k, v, k_rope;
  bool int8 = false;  // k and v are int8 with the factors kq / vq (no k_rope then)
  KvQuant kq, vq;
  const int32_t* block_table = nullptr;  // null: contiguous
  int64_t table_stride = 0;
  int64_t block_size = 0;
  int64_t num_blocks = 0;  // blocks of a paged cache (the CUDA kernel checks the ids it reads)
};

// One query row per sequence (q_len[b] is 0 or 1). The AttentionProblem gives q / out views,
// heads, head sizes (head_dim of the non-rope part of q/k), lengths, kv_start (contiguous TND),
// scale, the user mask (row 0 of each batch's [mask_stride_b, mask_stride_n] slice) and sink.
struct DecodeProblem {
  const AttentionProblem* p = nullptr;
  KvCache cache;
  const void* q = nullptr;       // view p->q
  const void* q_rope = nullptr;  // same view as q (p->q), rope_dim wide
  SeqView q_rope_view;
  int64_t rope_dim = 0;
  std::vector<KeyInterval> visible;  // per batch: keys [lo, hi] before the user mask
  float* lse = nullptr;  // [stat rows] float32 at p->stat_index(b, n, 0) when not null
  bool out_float = false;  // out is float32 whatever q's dtype (an output to be quantised)
};

// q, q_rope, k, v, k_rope and out share one dtype: float32, float16 or bfloat16 (k and v are
// int8 instead when cache.int8; out is float32 when out_float).
using InferDecodeFn = void(const DecodeProblem& d, at::ScalarType dtype, void* out);

extern KernelSlots<InferDecodeFn> infer_decode;

}  // namespace opennpu::attention
