// CUDA decode kernel of npu_fused_infer_attention_score (infer_decode's CUDA slot, see
// infer_attention.h) and the CUDA registration of npu_fused_infer_attention_score and _v2.
//
// Routing: the npu ops' CUDA kernel looks at a call's arguments (no device data) and sends a
// decode call (one query row per sequence) that the decode kernel covers to the C++ entry point
// (opennpu::_fia_decode / _fia_v2_decode: infer_attention.cpp's validation, layouts, paged cache,
// masks, antiquant factors, then this kernel), every other call (prefill, pse_shift, full int8
// quantisation, int8 MLA, padding and prefix arguments, float64) to the portable composition
// (opennpu::_fia_portable / _fia_v2_portable, src/opennpu/ops/portable.py: flash / cuDNN where
// they fit). Both take the call's stack as it is: they share the op's schema.
//
// Flash-decoding in two launches:
// 1. Split pass: a block (kWarps warps) serves one (batch, kv head, context split, tile of query
//    heads of the kv head's group), so a K/V row is read once for the tile's heads; tiles of one
//    split are adjacent block indices and share the rows through L2. Block ids are checked on
//    device. Two implementations write the same partials (max, sum, acc per head and split):
//    - decode_mma_kernel (fp16 / bf16 caches, head size 64 or 128, no rope part): 16-key tiles
//      copied to shared memory ahead of use, both products on tensor cores (see its comment);
//    - decode_split_kernel (everything else: fp32, int8 codes, MLA rope parts, other head sizes):
//      each warp walks chunks of kChunk keys (chunk w, w + kWarps, ... of the split). Per chunk,
//      lane j finds key j's row; a key row is spread over lpk lanes, kVec elements a lane per
//      vector load (K then the rope part of K, as one concatenated row), each lane holding q's
//      matching elements in registers (scaled in fp32), the lpk partial dot products summed
//      through shared memory; lane j then takes key j of every head (user mask, per-token key
//      factors, the chunk's max, NaN-propagating as the CPU kernel, one online-softmax step in
//      fp32), and acc[head][element] += p * v in fp32 with the value rows spread the same way.
//      An int8 cache is read as codes: per-channel key factors are folded into q
//      (q'_d = q_d s_d, plus q' . offset added to every score), per-channel value factors applied
//      to the partial's acc once (s_d (acc_d + o_d l), linear in acc and l, so exact under the
//      later merge); per-token factors scale the score (s_t (q . x + o_t sum q)) and P
//      (p'_t = p_t s_t, with sum_t p'_t o_t carried beside acc).
//    The warps' states are merged by log-sum-exp through shared memory (write_partial).
// 2. Merge: per (batch, query head) the splits' partials (and the learnable sink, as a partial of
//    max = sink, sum = 1, acc = 0) by log-sum-exp; out = acc * (1 / l) rounded once to the
//    output dtype, lse = max + log(sum) (-inf where nothing was seen; out 0 there).
// Numerics as infer_decode_cpu: fp32 accumulation and softmax, one rounding of the output (the
// tensor-core pass also rounds P to the cache's dtype before P V, as flash attention does). The
// summation order differs, so results agree to a few fp32 ulps before that rounding.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>

#include "common/cuda_rows.cuh"
#include "ops/attention/infer_attention.h"

namespace opennpu::attention {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kChunk = 32;   // keys per warp step: one per lane in the softmax
constexpr int kUnroll = 4;   // key rows a lane loads before it uses them
constexpr int kPerBatch = 6;  // per-batch table columns, see Batch
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Columns of the per-batch table: visible keys [lo, hi] (empty when hi < lo), whether the batch
// has a query row, its first query row (TND), its first key row (contiguous TND) and the index
// of its head 0's lse value.
enum Batch { kLo = 0, kHi, kActive, kQStart, kKvStart, kLseBase };

// Elements a lane loads at once: 16 bytes of fp16 / bf16 / fp32, 8 of int8 (8 codes).
template <typename T>
constexpr int vec_of() {
  return sizeof(T) == 4 ? 4 : 8;
}

struct SplitArgs {
  const void* q = nullptr;
  const void* q_rope = nullptr;
  int q_dtype = 0;  // 0 fp32, 1 fp16, 2 bf16
  int64_t q_b = 0, q_s = 0, q_n = 0, qr_b = 0, qr_s = 0, qr_n = 0;
  KvRows k, v, kr;  // (blk, pos) below: (cache block, row in it) or (batch, kv_start + key)
  const int32_t* table = nullptr;  // null: contiguous rows (blk = b, pos = kv_start + t)
  int64_t table_stride = 0, block_size = 1, num_blocks = 0;
  const int64_t* batch = nullptr;  // [B, kPerBatch]
  const uint8_t* mask = nullptr;
  int64_t mask_b = 0, mask_n = 0;
  KvQuant kq, vq;  // an int8 cache's factors (kNone otherwise)
  int heads_kv = 0, group = 0, tile_heads = 0, tiles = 0;
  int d = 0, dr = 0, dv = 0;
  int nv_main = 0, nv_k = 0, lpk = 0, nv_v = 0, lpk_v = 0;  // vectors per row, lanes per row
  int key_stride = 0, red_floats = 0;  // the split kernel's partial dot products (see red)
  bool packed_k = false, packed_v = false;  // vector loads allowed (alignment, widths)
  float scale = 1.0f;
  int splits = 1;
  float* part = nullptr;  // [B * N, splits, 2 + dv]: max, sum, acc
};

__device__ __forceinline__ float nan_max(float a, float b) { return cuda::NanMaxOp()(a, b); }

// Row (blk, pos) of kv head kvh in `r`, as T elements.
template <typename T>
__device__ __forceinline__ const T* row_at(const KvRows& r, int64_t blk, int64_t pos, int kvh) {
  return static_cast<const T*>(r.base) + blk * r.stride_blk + pos * r.stride_s + kvh * r.stride_n;
}

__device__ __forceinline__ bool per_channel(const KvQuant& q) {
  return q.kind == KvQuant::Kind::kChannel;
}
__device__ __forceinline__ bool per_token(const KvQuant& q) { return q.kind == KvQuant::Kind::kToken; }

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = nan_max(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float load_q_element(const void* base, int dtype, int64_t i) {
  switch (dtype) {
    case 1: return static_cast<float>(static_cast<const at::Half*>(base)[i]);
    case 2: return static_cast<float>(static_cast<const at::BFloat16*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// x[0..V) = elements [e0, e0 + V) of `row` as float, 0 past `width` (packed: one vector load;
// the caller guarantees alignment and width % V == 0 then).
template <typename T, int V>
__device__ __forceinline__ void load_elements(const T* row, int e0, int width, bool packed,
                                              float (&x)[V]) {
  if (packed && e0 < width) {
    const auto p = *reinterpret_cast<const cuda::Pack<T, V>*>(row + e0);
#pragma unroll
    for (int i = 0; i < V; ++i) x[i] = static_cast<float>(p.v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) x[i] = e0 + i < width ? static_cast<float>(row[e0 + i]) : 0.0f;
  }
}

// This lane's VPL vectors of one key's row: vectors first + w * lanes of the concatenated row
// (n_main vectors of `row`, `width` wide, then those of `rope`, `rope_width` wide; n_all in
// all), zeros past it or where the key is past the chunk (valid false).
template <typename T, int V, int VPL>
__device__ __forceinline__ void load_row_vectors(float (&x)[VPL][V], bool valid, const T* row,
                                                 const T* rope, int first, int lanes, int n_main,
                                                 int n_all, int width, int rope_width,
                                                 bool packed) {
#pragma unroll
  for (int w = 0; w < VPL; ++w) {
    const int v = first + w * lanes;
    if (!valid || v >= n_all) {
#pragma unroll
      for (int i = 0; i < V; ++i) x[w][i] = 0.0f;
    } else if (v < n_main) {
      load_elements<T, V>(row, v * V, width, packed, x[w]);
    } else {
      load_elements<T, V>(rope, (v - n_main) * V, rope_width, packed, x[w]);
    }
  }
}

// Asks L2 for the `width` elements at p (a hint: nothing is loaded into registers).
template <typename T>
__device__ __forceinline__ void prefetch_row(const T* p, int width) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t o = 0; o < int64_t(width) * int64_t(sizeof(T)); o += 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
  }
}

// The split's partial of heads h0 .. h0 + nh of kv head kvh: the kWarps warps' states in
// `merge` (per warp and tile row: max, sum, per-token value offsets' share c, acc[dv]; rows
// tile_rows apart), merged by log-sum-exp, the int8 value factors applied (linear in acc and the
// sum), written to a.part. Every thread of the block takes part.
__device__ void write_partial(const SplitArgs& a, const float* merge, int tile_rows, int nh,
                              int64_t b, int kvh, int h0, int sp) {
  const int rec = 3 + a.dv;
  const int n_heads = a.heads_kv * a.group;
  for (int h = 0; h < nh; ++h) {
    float mx = kNegInf;
    for (int w = 0; w < kWarps; ++w) mx = nan_max(mx, merge[(w * tile_rows + h) * rec]);
    float weight[kWarps];
    float sum = 0.0f, tok = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      const float mw = merge[(w * tile_rows + h) * rec];
      weight[w] = mw == kNegInf ? 0.0f : expf(mw - mx);
      sum += merge[(w * tile_rows + h) * rec + 1] * weight[w];
      tok += merge[(w * tile_rows + h) * rec + 2] * weight[w];
    }
    const int n = kvh * a.group + h0 + h;
    float* dst = a.part + ((b * n_heads + n) * a.splits + sp) * (2 + a.dv);
    if (threadIdx.x == 0) {
      dst[0] = mx;
      dst[1] = sum;
    }
    for (int e = threadIdx.x; e < a.dv; e += kThreads) {
      float r = 0.0f;
      for (int w = 0; w < kWarps; ++w) r += merge[(w * tile_rows + h) * rec + 3 + e] * weight[w];
      if (per_channel(a.vq)) {
        const float off = a.vq.offset != nullptr ? a.vq.offset[kvh * a.dv + e] * sum : 0.0f;
        r = (r + off) * a.vq.scale[kvh * a.dv + e];
      } else if (per_token(a.vq)) {
        r += tok;
      }
      dst[2 + e] = r;
    }
  }
}

// A split block's place: (batch, kv head, split, head tile) of blockIdx.x, its key range
// [t0, t1) and the heads h0 .. h0 + nh of its tile. active false: the batch has no query row.
struct BlockPlace {
  int64_t b, t0, t1;
  int kvh, sp, h0, nh;
  const int64_t* pb;
  bool active;
};

__device__ __forceinline__ BlockPlace place_of(const SplitArgs& a, int tile_heads) {
  BlockPlace w;
  int64_t index = blockIdx.x;
  const int tile = static_cast<int>(index % a.tiles);
  index /= a.tiles;
  w.sp = static_cast<int>(index % a.splits);
  index /= a.splits;
  w.kvh = static_cast<int>(index % a.heads_kv);
  w.b = index / a.heads_kv;
  w.pb = a.batch + w.b * kPerBatch;
  w.active = w.pb[kActive] != 0;
  w.h0 = tile * tile_heads;
  w.nh = ::min(tile_heads, a.group - w.h0);
  const int64_t lo = w.pb[kLo];
  const int64_t n_keys = ::max(w.pb[kHi] + 1 - lo, int64_t(0));
  const int64_t per = (n_keys + a.splits - 1) / a.splits;
  const int64_t per_r = (per + kChunk - 1) / kChunk * kChunk;
  w.t0 = lo + ::min(n_keys, w.sp * per_r);
  w.t1 = lo + ::min(n_keys, (w.sp + 1) * per_r);
  return w;
}

// Where key t of batch b lives: (cache block, row in block), or (b, kv_start + t) for contiguous
// rows; false (and (0, 0)) where the block table holds an id outside the cache.
__device__ __forceinline__ bool locate_key(const SplitArgs& a, int64_t b, const int64_t* pb,
                                           int64_t t, int32_t& blk, int32_t& pos) {
  if (a.table == nullptr) {
    blk = static_cast<int32_t>(b);
    pos = static_cast<int32_t>(pb[kKvStart] + t);
    return true;
  }
  const int64_t id = a.table[b * a.table_stride + int32_t(t) / int32_t(a.block_size)];
  const bool inside = id >= 0 && id < a.num_blocks;
  blk = inside ? static_cast<int32_t>(id) : 0;
  pos = inside ? int32_t(t) % int32_t(a.block_size) : 0;
  return inside;
}

// locate_key for a key the kernel reads: an id outside the cache is a device-side assertion
// (block 0 is read where assertions are compiled out).
__device__ __forceinline__ void key_row(const SplitArgs& a, int64_t b, const int64_t* pb, int64_t t,
                                        int32_t& blk, int32_t& pos) {
  const bool inside = locate_key(a, b, pb, t, blk, pos);
  CUDA_KERNEL_ASSERT_MSG(inside, "npu_fused_infer_attention_score: block_table holds a block id "
                                 "outside the cache");
}

template <typename T, int G, int VPL>
__global__ void __launch_bounds__(kThreads) decode_split_kernel(const SplitArgs a) {
  constexpr int V = vec_of<T>();
  extern __shared__ float smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BlockPlace place = place_of(a, a.tile_heads);
  if (!place.active) return;
  const int64_t b = place.b, t0 = place.t0, t1 = place.t1;
  const int kvh = place.kvh, sp = place.sp, h0 = place.h0, nh = place.nh;
  const int64_t* pb = place.pb;

  // Key side: lane = kk * lpk + vi, vector vi + w * lpk of the concatenated (K, K rope) row.
  const int kk = lane / a.lpk, vi = lane % a.lpk, kps = 32 / a.lpk;
  const int kk_v = lane / a.lpk_v, vi_v = lane % a.lpk_v, kps_v = 32 / a.lpk_v;

  float q[G][VPL][V];
  float q_off[G], q_sum[G];  // per-channel offsets' share of a score; sum of q (token offsets)
#pragma unroll
  for (int h = 0; h < G; ++h) {
    q_off[h] = 0.0f;
    q_sum[h] = 0.0f;
    const int n = kvh * a.group + h0 + min(h, nh - 1);
    const int64_t qrow = b * a.q_b + pb[kQStart] * a.q_s + n * a.q_n;
    const int64_t qrrow = b * a.qr_b + pb[kQStart] * a.qr_s + n * a.qr_n;
#pragma unroll
    for (int w = 0; w < VPL; ++w) {
      const int v = vi + w * a.lpk;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        float x = 0.0f;
        if (v < a.nv_main) {
          const int e = v * V + i;
          if (e < a.d) {
            x = load_q_element(a.q, a.q_dtype, qrow + e) * a.scale;
            q_sum[h] += x;
            if (per_channel(a.kq)) {
              x *= a.kq.scale[kvh * a.d + e];
              if (a.kq.offset != nullptr) q_off[h] += x * a.kq.offset[kvh * a.d + e];
            }
          }
        } else if (v < a.nv_k) {
          const int e = (v - a.nv_main) * V + i;
          if (e < a.dr) x = load_q_element(a.q_rope, a.q_dtype, qrrow + e) * a.scale;
        }
        q[h][w][i] = x;
      }
    }
    // every lane of a key group holds one share of the row: sum the shares over the group
    for (int o = 1; o < a.lpk; o *= 2) {
      q_off[h] += __shfl_xor_sync(0xffffffffu, q_off[h], o);
      q_sum[h] += __shfl_xor_sync(0xffffffffu, q_sum[h], o);
    }
  }

  float m[G], l[G], c[G], acc[G][VPL][V];
#pragma unroll
  for (int h = 0; h < G; ++h) {
    m[h] = kNegInf;
    l[h] = 0.0f;
    c[h] = 0.0f;
#pragma unroll
    for (int w = 0; w < VPL; ++w) {
#pragma unroll
      for (int i = 0; i < V; ++i) acc[h][w][i] = 0.0f;
    }
  }
  // This warp's scores / probabilities [G][kChunk] and its partial dot products: row i of an
  // iteration's keys at red + i * key_stride, lpk shares a head (key_stride = lpk mod 32: the
  // key groups' stores fall in different banks).
  float* s = smem + warp * (G * kChunk + a.red_floats);
  float* red = s + G * kChunk;

  for (int64_t c0 = t0 + int64_t(warp) * kChunk; c0 < t1; c0 += int64_t(kWarps) * kChunk) {
    const int cnt = static_cast<int>(::min(int64_t(kChunk), t1 - c0));
    // Lane j: where key c0 + j lives, and its per-token factors.
    int32_t my_blk = 0, my_pos = 0;
    float ks = 1.0f, ko = 0.0f, vs = 1.0f, vo = 0.0f;
    if (lane < cnt) {
      const int64_t t = c0 + lane;
      key_row(a, b, pb, t, my_blk, my_pos);
      const auto factor_at = [&](const KvQuant& f) {  // (i, j): (block, slot) or (batch, key)
        return (f.paged ? my_blk : b) * f.stride_blk + (f.paged ? my_pos : t) * f.stride_s +
               kvh * f.stride_n;
      };
      if (per_token(a.kq)) {
        const int64_t at = factor_at(a.kq);
        ks = a.kq.scale[at];
        if (a.kq.offset != nullptr) ko = a.kq.offset[at];
      }
      if (per_token(a.vq)) {
        const int64_t at = factor_at(a.vq);
        vs = a.vq.scale[at];
        if (a.vq.offset != nullptr) vo = a.vq.offset[at];
      }
      // The value rows are read after the scores: ask for them now.
      prefetch_row(row_at<T>(a.v, my_blk, my_pos, kvh), a.dv);
    }
    // The key rows of this warp's next chunk, read after this one: ask for them now.
    int32_t next_blk, next_pos;
    if (c0 + kWarps * kChunk + lane < t1 &&
        locate_key(a, b, pb, c0 + kWarps * kChunk + lane, next_blk, next_pos)) {
      prefetch_row(row_at<T>(a.k, next_blk, next_pos, kvh), a.d);
    }

    // Scores of this chunk's keys for the tile's heads -> s[h][j].
    for (int j0 = 0; j0 < cnt; j0 += kps * kUnroll) {
      float x[kUnroll][VPL][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * kps + kk;
        const int64_t blk = __shfl_sync(0xffffffffu, my_blk, j & 31);
        const int64_t pos = __shfl_sync(0xffffffffu, my_pos, j & 31);
        const T* rrow = a.kr.base == nullptr ? nullptr : row_at<T>(a.kr, blk, pos, kvh);
        load_row_vectors<T, V, VPL>(x[u], j < cnt, row_at<T>(a.k, blk, pos, kvh), rrow, vi, a.lpk,
                                    a.nv_main, a.nv_k, a.d, a.dr, a.packed_k);
      }
      // Partial dot products (this lane's share of each row) -> red, then lane i sums the lpk
      // shares of (key, head) pair i: independent loads and adds, no chain of shuffles per key.
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
          float dot = 0.0f;
#pragma unroll
          for (int w = 0; w < VPL; ++w) {
#pragma unroll
            for (int i = 0; i < V; ++i) dot = fmaf(q[h][w][i], x[u][w][i], dot);
          }
          red[(u * kps + kk) * a.key_stride + h * a.lpk + vi] = dot;
        }
      }
      __syncwarp();
      for (int pair = lane; pair < kps * kUnroll * G; pair += 32) {
        const int i = pair / G, h = pair % G, j = j0 + i;
        const float4* r = reinterpret_cast<const float4*>(red + i * a.key_stride + h * a.lpk);
        float4 sum = r[0];
        for (int e = 1; e < a.lpk / 4; ++e) {
          const float4 more = r[e];
          sum.x += more.x;
          sum.y += more.y;
          sum.z += more.z;
          sum.w += more.w;
        }
        if (j < cnt && h < nh) s[h * kChunk + j] = (sum.x + sum.y) + (sum.z + sum.w);
      }
      __syncwarp();
    }
    __syncwarp();

    // Online softmax step: lane j takes key j of every head.
    float alpha[G];
    const int64_t t = c0 + lane;
#pragma unroll
    for (int h = 0; h < G; ++h) {
      alpha[h] = 1.0f;
      if (h >= nh) continue;
      float x = kNegInf;
      if (lane < cnt) {
        x = s[h * kChunk + lane];
        x = per_token(a.kq) ? ks * (x + ko * q_sum[h]) : x + q_off[h];
        const int n = kvh * a.group + h0 + h;
        if (a.mask != nullptr && a.mask[b * a.mask_b + n * a.mask_n + t] != 0) x = kNegInf;
      }
      const float m_new = nan_max(m[h], warp_max(x));
      float p = 0.0f;
      if (m_new != kNegInf) {  // else nothing visible yet: p = 0, acc stays 0
        alpha[h] = m[h] == kNegInf ? 0.0f : expf(m[h] - m_new);
        p = lane < cnt ? expf(x - m_new) : 0.0f;
      }
      l[h] = l[h] * alpha[h] + warp_sum(p);
      m[h] = m_new;
      if (per_token(a.vq)) {
        p *= vs;
        c[h] = c[h] * alpha[h] + warp_sum(p * vo);
      }
      s[h * kChunk + lane] = p;
    }
    __syncwarp();

    // acc = acc * alpha + P V over the chunk.
#pragma unroll
    for (int h = 0; h < G; ++h) {
#pragma unroll
      for (int w = 0; w < VPL; ++w) {
#pragma unroll
        for (int i = 0; i < V; ++i) acc[h][w][i] *= alpha[h];
      }
    }
    for (int j0 = 0; j0 < cnt; j0 += kps_v * kUnroll) {
      float x[kUnroll][VPL][V];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = j0 + u * kps_v + kk_v;
        const int64_t blk = __shfl_sync(0xffffffffu, my_blk, j & 31);
        const int64_t pos = __shfl_sync(0xffffffffu, my_pos, j & 31);
        load_row_vectors<T, V, VPL>(x[u], j < cnt, row_at<T>(a.v, blk, pos, kvh), nullptr, vi_v,
                                    a.lpk_v, a.nv_v, a.nv_v, a.dv, 0, a.packed_v);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = min(j0 + u * kps_v + kk_v, kChunk - 1);  // j >= cnt: x is 0, p is 0
#pragma unroll
        for (int h = 0; h < G; ++h) {
          const float p = s[h * kChunk + j];
#pragma unroll
          for (int w = 0; w < VPL; ++w) {
#pragma unroll
            for (int i = 0; i < V; ++i) acc[h][w][i] = fmaf(p, x[u][w][i], acc[h][w][i]);
          }
        }
      }
    }
    __syncwarp();
  }

  // Sum acc over the warp's key groups: lanes vi_v of every group hold the same elements.
#pragma unroll
  for (int h = 0; h < G; ++h) {
#pragma unroll
    for (int w = 0; w < VPL; ++w) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        for (int o = a.lpk_v; o < 32; o *= 2) acc[h][w][i] += __shfl_xor_sync(0xffffffffu, acc[h][w][i], o);
      }
    }
  }

  // Merge the warps through shared memory (over the loop's scratch, once every warp is done):
  // per warp and head [m, l, c, acc[dv]].
  const int rec = 3 + a.dv;
  float* merge = smem;
  float* mine = merge + warp * G * rec;
  __syncthreads();
#pragma unroll
  for (int h = 0; h < G; ++h) {
    if (h >= nh) continue;
    if (lane == 0) {
      mine[h * rec] = m[h];
      mine[h * rec + 1] = l[h];
      mine[h * rec + 2] = c[h];
    }
    if (kk_v == 0) {
#pragma unroll
      for (int w = 0; w < VPL; ++w) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const int e = (vi_v + w * a.lpk_v) * V + i;
          if (e < a.dv) mine[h * rec + 3 + e] = acc[h][w][i];
        }
      }
    }
  }
  __syncthreads();
  write_partial(a, merge, G, nh, b, kvh, h0, sp);
}

// ---- tensor-core split pass (fp16 / bf16 caches, head size 64 or 128, no rope, no int8) ----
//
// The same partials as decode_split_kernel, with the two products on mma.sync m16n8k16: a warp
// takes 16-key tiles (tile w, w + kWarps, ... of the split), copied into shared memory with
// cp.async two tiles ahead of... one tile ahead of their use (double buffer, rows padded by 16
// bytes so that ldmatrix reads conflict-free); the tile's 16 query heads (rows past the group's
// are zero) are the MMA's rows: S = Q K^T (B fragments by ldmatrix from the K rows), scaled and
// masked in fp32, one online-softmax step per row in registers (a row's 16 scores sit in the 4
// lanes of a quad), then O += P V with P rounded to the cache's dtype (as flash attention does)
// and V's fragments by ldmatrix.trans. Accumulation in fp32.

constexpr int kTileKeys = 16;
constexpr int kTileRows = 16;  // query heads of an MMA tile

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes from global to shared without registers; valid false writes zeros (reads nothing).
__device__ __forceinline__ void copy_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

// d += a b for a 16 x 16 A (row-major fragments) and a 16 x 8 B (column-major), fp32 d.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two values rounded to T, the first in the low half (the lower column of a fragment pair).
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float x, float y) {
  const T lo(x), hi(y);
  return static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) decode_mma_kernel(const SplitArgs a) {
  constexpr int kPitch = D + 8;                    // elements a shared row (16 bytes of padding)
  constexpr int kTile = kTileKeys * kPitch;        // elements of one K or V tile
  constexpr int kPieces = kTileKeys * D / 8 / 32;  // 16-byte copies a lane per tile
  extern __shared__ __align__(16) unsigned char shared_raw[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane >> 2, quad_lane = lane & 3;
  const BlockPlace place = place_of(a, kTileRows);
  if (!place.active) return;
  const int64_t b = place.b, t1 = place.t1;
  const int kvh = place.kvh, h0 = place.h0, nh = place.nh;
  const int64_t* pb = place.pb;
  T* tiles = reinterpret_cast<T*>(shared_raw) + warp * 2 * 2 * kTile;  // [stage][K, V][key][pitch]

  // Q as A fragments: rows group and group + 8 of the tile, k-step ks, columns quad_lane * 2 (+ 8).
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = group + 8 * half;
    const T* q = static_cast<const T*>(a.q) + b * a.q_b + pb[kQStart] * a.q_s +
                 (kvh * a.group + h0 + ::min(row, nh - 1)) * a.q_n;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const int c = ks * 16 + quad_lane * 2;
      qf[ks][half] = row < nh ? (static_cast<uint32_t>(q[c].x) | (static_cast<uint32_t>(q[c + 1].x) << 16)) : 0u;
      qf[ks][2 + half] = row < nh ? (static_cast<uint32_t>(q[c + 8].x) | (static_cast<uint32_t>(q[c + 9].x) << 16)) : 0u;
    }
  }

  // Copies of the K and V rows of the tile at key tile0 into `stage`.
  const auto issue = [&](int64_t tile0, int stage) {
    int32_t blk = 0, pos = 0;
    const bool mine = lane < kTileKeys && tile0 + lane < t1;
    if (mine) key_row(a, b, pb, tile0 + lane, blk, pos);
    T* kt = tiles + stage * 2 * kTile;
    T* vt = kt + kTile;
#pragma unroll
    for (int i = 0; i < kPieces; ++i) {
      const int piece = lane + 32 * i, row = piece / (D / 8), col = piece % (D / 8) * 8;
      const int64_t rb = __shfl_sync(0xffffffffu, blk, row), rp = __shfl_sync(0xffffffffu, pos, row);
      const bool valid = __shfl_sync(0xffffffffu, mine, row);
      copy_async16(kt + row * kPitch + col, row_at<T>(a.k, rb, rp, kvh) + col, valid);
      copy_async16(vt + row * kPitch + col, row_at<T>(a.v, rb, rp, kvh) + col, valid);
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };

  float o[D / 8][4];
#pragma unroll
  for (int j = 0; j < D / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  float m[2] = {kNegInf, kNegInf}, l[2] = {0.0f, 0.0f};
  const int n_row[2] = {kvh * a.group + h0 + group, kvh * a.group + h0 + group + 8};

  int64_t tile0 = place.t0 + int64_t(warp) * kTileKeys;
  if (tile0 < t1) issue(tile0, 0);
  for (int stage = 0; tile0 < t1; tile0 += kWarps * kTileKeys, stage ^= 1) {
    const int64_t next = tile0 + kWarps * kTileKeys;
    if (next < t1) {
      issue(next, stage ^ 1);
      asm volatile("cp.async.wait_group 1;\n" ::);
    } else {
      asm volatile("cp.async.wait_group 0;\n" ::);
    }
    __syncwarp();
    const T* kt = tiles + stage * 2 * kTile;
    const T* vt = kt + kTile;

    // S = Q K^T: n-tile 0 keys 0-7, n-tile 1 keys 8-15.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    const int krow = ((lane >> 4) & 1) * 8 + (lane & 7), kcol = ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t kb[4];
      ldmatrix_x4(kb, kt + krow * kPitch + ks * 16 + kcol);
      mma_16x8x16<T>(s[0], qf[ks], kb[0], kb[1]);
      mma_16x8x16<T>(s[1], qf[ks], kb[2], kb[3]);
    }

    // Online softmax: s[nt][e] is row group + 8 (e >> 1), key tile0 + nt * 8 + quad_lane * 2 + (e & 1).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = kNegInf;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          const int64_t t = tile0 + nt * 8 + quad_lane * 2 + (e & 1);
          float x = s[nt][e] * a.scale;
          if (t >= t1 || (a.mask != nullptr && group + 8 * half < nh &&
                          a.mask[b * a.mask_b + n_row[half] * a.mask_n + t] != 0)) {
            x = kNegInf;
          }
          s[nt][e] = x;
          mx = nan_max(mx, x);
        }
      }
      mx = nan_max(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = nan_max(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = nan_max(m[half], mx);
      float alpha = 1.0f, sum = 0.0f;
      if (m_new != kNegInf) {
        alpha = m[half] == kNegInf ? 0.0f : expf(m[half] - m_new);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int e = 2 * half; e < 2 * half + 2; ++e) {
            s[nt][e] = expf(s[nt][e] - m_new);
            sum += s[nt][e];
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) s[nt][2 * half] = s[nt][2 * half + 1] = 0.0f;
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l[half] = l[half] * alpha + sum;
      m[half] = m_new;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[j][2 * half] *= alpha;
        o[j][2 * half + 1] *= alpha;
      }
    }

    // O += P V: P's A fragments are the score accumulators (keys 0-7 from n-tile 0, 8-15 from 1).
    const uint32_t pa[4] = {pack_pair<T>(s[0][0], s[0][1]), pack_pair<T>(s[0][2], s[0][3]),
                            pack_pair<T>(s[1][0], s[1][1]), pack_pair<T>(s[1][2], s[1][3])};
    const int vrow = ((lane >> 3) & 1) * 8 + (lane & 7), vcol = ((lane >> 4) & 1) * 8;
#pragma unroll
    for (int j2 = 0; j2 < D / 16; ++j2) {
      uint32_t vb[4];
      ldmatrix_x4_trans(vb, vt + vrow * kPitch + j2 * 16 + vcol);
      mma_16x8x16<T>(o[2 * j2], pa, vb[0], vb[1]);
      mma_16x8x16<T>(o[2 * j2 + 1], pa, vb[2], vb[3]);
    }
    __syncwarp();
  }

  // The warps' states through shared memory (over the tiles, once every warp is done).
  asm volatile("cp.async.wait_group 0;\n" ::);
  __syncthreads();
  const int rec = 3 + a.dv;
  float* merge = reinterpret_cast<float*>(shared_raw);
  float* mine = merge + warp * kTileRows * rec;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = group + 8 * half;
    if (row >= nh) continue;
    if (quad_lane == 0) {
      mine[row * rec] = m[half];
      mine[row * rec + 1] = l[half];
      mine[row * rec + 2] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      mine[row * rec + 3 + j * 8 + quad_lane * 2] = o[j][2 * half];
      mine[row * rec + 3 + j * 8 + quad_lane * 2 + 1] = o[j][2 * half + 1];
    }
  }
  __syncthreads();
  write_partial(a, merge, kTileRows, nh, b, kvh, h0, place.sp);
}

struct MergeArgs {
  const float* part = nullptr;
  const int64_t* batch = nullptr;
  const float* sink = nullptr;  // [N] or null
  void* out = nullptr;
  int64_t o_b = 0, o_s = 0, o_n = 0;
  float* lse = nullptr;  // null: not asked for
  int64_t lse_step = 0;
  int n_heads = 0, splits = 1, dv = 0;
};

template <typename O>
__global__ void __launch_bounds__(kThreads) decode_merge_kernel(const MergeArgs a) {
  extern __shared__ float weight[];  // [splits]
  __shared__ float row[2];           // max, 1 / sum
  const int64_t b = blockIdx.x / a.n_heads;
  const int n = static_cast<int>(blockIdx.x % a.n_heads);
  const int64_t* pb = a.batch + b * kPerBatch;
  if (pb[kActive] == 0) return;
  const int rec = 2 + a.dv;
  const float* src = a.part + (b * a.n_heads + n) * a.splits * rec;
  if (threadIdx.x == 0) {
    const float sink = a.sink != nullptr ? a.sink[n] : kNegInf;
    float mx = sink;
    for (int sp = 0; sp < a.splits; ++sp) mx = nan_max(mx, src[sp * rec]);
    float sum = sink == kNegInf ? 0.0f : expf(sink - mx);
    for (int sp = 0; sp < a.splits; ++sp) {
      const float ms = src[sp * rec];
      weight[sp] = ms == kNegInf ? 0.0f : expf(ms - mx);
      sum += src[sp * rec + 1] * weight[sp];
    }
    row[0] = mx;
    row[1] = sum == 0.0f ? 0.0f : 1.0f / sum;
    if (a.lse != nullptr) a.lse[pb[kLseBase] + n * a.lse_step] = sum == 0.0f ? kNegInf : mx + logf(sum);
  }
  __syncthreads();
  O* out = static_cast<O*>(a.out) + b * a.o_b + pb[kQStart] * a.o_s + n * a.o_n;
  for (int e = threadIdx.x; e < a.dv; e += kThreads) {
    float r = 0.0f;
    for (int sp = 0; sp < a.splits; ++sp) r += src[sp * rec + 2 + e] * weight[sp];
    out[e] = static_cast<O>(r * row[1]);
  }
}

int64_t pow2_at_least(int64_t x) {
  int64_t p = 1;
  while (p < x) p *= 2;
  return p;
}

template <typename T>
struct Launch {
  // Heads per tile for VPL vectors a lane: at most 8 vectors of q and of acc a lane in registers.
  static void run(const SplitArgs& a, int vpl, int g_tile, int64_t blocks, size_t smem) {
    const auto stream = at::cuda::getCurrentCUDAStream();
#define OPENNPU_DECODE_CASE(G, VPL)                                                          \
  if (g_tile == G && vpl == VPL) {                                                           \
    decode_split_kernel<T, G, VPL><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(a); \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                          \
    return;                                                                                  \
  }
    OPENNPU_DECODE_CASE(1, 1)
    OPENNPU_DECODE_CASE(4, 1)
    OPENNPU_DECODE_CASE(8, 1)
    OPENNPU_DECODE_CASE(1, 2)
    OPENNPU_DECODE_CASE(4, 2)
    OPENNPU_DECODE_CASE(1, 4)
    OPENNPU_DECODE_CASE(2, 4)
#undef OPENNPU_DECODE_CASE
    TORCH_CHECK(false, "npu_fused_infer_attention_score: no CUDA decode kernel for ", g_tile,
                " heads of ", vpl, " vectors");
  }
};

// (vectors a lane, heads a tile) for a group of g query heads: the compiled shapes (Launch),
// which keep at most 8 vectors of q and 8 of acc a lane in registers.
std::pair<int, int> tile_shape(int vpl_needed, int64_t g) {
  const int vpl = vpl_needed <= 1 ? 1 : vpl_needed <= 2 ? 2 : 4;
  static constexpr int kTiles[3][3] = {{1, 4, 8}, {1, 4, 4}, {1, 2, 2}};
  const int* options = kTiles[vpl == 1 ? 0 : vpl == 2 ? 1 : 2];
  for (int i = 0; i < 3; ++i) {
    if (options[i] >= g) return {vpl, options[i]};
  }
  return {vpl, options[2]};
}

bool rows_packed(const KvRows& r, int64_t width, int64_t elem, int64_t vec_bytes) {
  return r.base == nullptr ||
         (cuda::aligned_to(r.base, vec_bytes) && (r.stride_blk * elem) % vec_bytes == 0 &&
          (r.stride_s * elem) % vec_bytes == 0 && (r.stride_n * elem) % vec_bytes == 0 &&
          (width * elem) % vec_bytes == 0);
}

// Shared memory of decode_mma_kernel<T, D>: its tiles, or the warps' merge records if larger.
template <typename T>
size_t smem_for_mma(int d) {
  const size_t tiles = size_t(kWarps) * 2 * 2 * kTileKeys * (d + 8) * sizeof(T);
  const size_t merge = size_t(kWarps) * kTileRows * (3 + d) * sizeof(float);
  return std::max(tiles, merge);
}

constexpr int kMaxDevices = 64;  // devices whose launch settings are kept (others: CUDA cores)

struct MmaLaunch {
  void (*fn)(SplitArgs) = nullptr;  // null: the CUDA-core pass runs the call
  size_t smem = 0;
  int blocks_per_sm = 1;
};

// The tensor-core pass for this call, if it applies: an fp16 / bf16 cache (T) with head size 64
// or 128 for K and V, no rope part, rows whose 16-byte pieces are aligned, a GPU of compute
// capability 8.0 or newer; OPENNPU_FIA_CUDA_MMA=0 turns it off (to compare the two passes).
template <typename T>
MmaLaunch mma_launch(const SplitArgs& a, int major, size_t smem) {
  MmaLaunch r;
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
    const char* env = std::getenv("OPENNPU_FIA_CUDA_MMA");
    if ((env != nullptr && std::string(env) == "0") || major < 8 || a.dr != 0 || a.d != a.dv ||
        (a.d != 64 && a.d != 128) || !a.packed_k || !a.packed_v) {
      return r;
    }
    const int device = c10::cuda::current_device();
    if (device >= kMaxDevices) return r;
    const auto pick = [&](void (*kernel)(SplitArgs), std::atomic<int>& cached) {
      int per_sm = cached.load();
      if (per_sm == 0) {  // once per kernel and device: allow its shared memory, ask how many fit
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
        C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
        per_sm = std::max(per_sm, 1);
        cached.store(per_sm);
      }
      r.fn = kernel;
      r.smem = smem;
      r.blocks_per_sm = per_sm;
    };
    static std::atomic<int> per_sm_64[kMaxDevices], per_sm_128[kMaxDevices];
    if (a.d == 64) {
      pick(decode_mma_kernel<T, 64>, per_sm_64[device]);
    } else {
      pick(decode_mma_kernel<T, 128>, per_sm_128[device]);
    }
  }
  return r;
}

// Splits (1 .. most) for `units` block groups on `slots` resident blocks: the first whose blocks
// fill their last wave to 90% or more, else the one that fills it best.
int64_t whole_waves(int64_t units, int64_t slots, int64_t most) {
  int64_t best = 1;
  double best_fill = 0.0;
  for (int64_t s = 1; s <= most; ++s) {
    const int64_t blocks = units * s;
    const double fill = double(blocks) / double((blocks + slots - 1) / slots * slots);
    if (fill >= 0.9) return s;
    if (fill > best_fill + 1e-9) {
      best = s;
      best_fill = fill;
    }
  }
  return best;
}

template <typename T>
void decode_typed(const DecodeProblem& d, at::ScalarType dtype, void* out) {
  const AttentionProblem& p = *d.p;
  const int64_t B = p.batch, KVN = p.heads_kv, g = p.group(), N = p.heads_q;
  constexpr int V = vec_of<T>();
  constexpr int64_t vec_bytes = V * sizeof(T);
  const c10::Device device(c10::DeviceType::CUDA, c10::cuda::current_device());

  // Per-batch table, uploaded from pinned memory (no synchronisation).
  at::Tensor host = at::empty({B, kPerBatch}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* hb = host.data_ptr<int64_t>();
  int64_t max_keys = 0;
  const int64_t lse_step = N > 1 ? p.stat_index(0, 1, 0) - p.stat_index(0, 0, 0) : 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t* r = hb + b * kPerBatch;
    const bool active = p.q_len[b] > 0;
    r[kLo] = d.visible[b].lo;
    r[kHi] = active ? d.visible[b].hi : d.visible[b].lo - 1;
    r[kActive] = active;
    r[kQStart] = p.q_start[b];
    r[kKvStart] = p.kv_start[b];
    r[kLseBase] = p.stat_index(b, 0, 0);
    max_keys = std::max(max_keys, r[kHi] + 1 - r[kLo]);
  }
  const at::Tensor batch = host.to(at::TensorOptions().device(device), /*non_blocking=*/true);

  SplitArgs a;
  a.q = d.q;
  a.q_rope = d.q_rope;
  a.q_dtype = dtype == at::kHalf ? 1 : dtype == at::kBFloat16 ? 2 : 0;
  a.q_b = p.q.stride_b;
  a.q_s = p.q.stride_s;
  a.q_n = p.q.stride_n;
  a.qr_b = d.q_rope_view.stride_b;
  a.qr_s = d.q_rope_view.stride_s;
  a.qr_n = d.q_rope_view.stride_n;
  a.k = d.cache.k;
  a.v = d.cache.v;
  a.kr = d.cache.k_rope;
  a.table = d.cache.block_table;
  a.table_stride = d.cache.table_stride;
  a.block_size = std::max<int64_t>(d.cache.block_size, 1);
  a.num_blocks = d.cache.num_blocks;
  a.batch = batch.const_data_ptr<int64_t>();
  a.mask = p.user_mask;
  a.mask_b = p.mask_stride_b;
  a.mask_n = p.mask_stride_n;
  a.kq = d.cache.kq;
  a.vq = d.cache.vq;
  a.heads_kv = static_cast<int>(KVN);
  a.group = static_cast<int>(g);
  a.d = static_cast<int>(p.head_dim);
  a.dr = static_cast<int>(d.rope_dim);
  a.dv = static_cast<int>(p.head_dim_v);
  a.nv_main = (a.d + V - 1) / V;
  a.nv_k = a.nv_main + (a.dr + V - 1) / V;
  // at least 4 lanes a key row (idle lanes hold zeros): the sums read the shares as float4
  a.lpk = static_cast<int>(std::clamp<int64_t>(pow2_at_least(a.nv_k), 4, 32));
  a.nv_v = (a.dv + V - 1) / V;
  a.lpk_v = static_cast<int>(std::min<int64_t>(32, pow2_at_least(a.nv_v)));
  const int vpl_needed = std::max((a.nv_k + a.lpk - 1) / a.lpk, (a.nv_v + a.lpk_v - 1) / a.lpk_v);
  TORCH_CHECK(vpl_needed <= 4, "npu_fused_infer_attention_score: head sizes ", a.d, " + ", a.dr,
              " / ", a.dv, " exceed the CUDA decode kernel's ", 4 * 32 * V, " elements");
  const auto [vpl, g_tile] = tile_shape(vpl_needed, a.group);
  a.tile_heads = g_tile;
  a.tiles = static_cast<int>((g + g_tile - 1) / g_tile);
  const int64_t elem = sizeof(T);
  a.packed_k = a.d % V == 0 && a.dr % V == 0 && rows_packed(d.cache.k, a.d, elem, vec_bytes) &&
               rows_packed(d.cache.k_rope, a.dr, elem, vec_bytes);
  a.packed_v = a.dv % V == 0 && rows_packed(d.cache.v, a.dv, elem, vec_bytes);
  a.scale = static_cast<float>(p.scale);

  a.key_stride = (g_tile * a.lpk + 31) / 32 * 32 + a.lpk;
  a.red_floats = (32 / a.lpk) * kUnroll * a.key_stride;
  // The tensor-core pass where it applies (decode_mma_kernel), else the CUDA-core one.
  const auto* props = at::cuda::getCurrentDeviceProperties();
  const MmaLaunch mma = mma_launch<T>(a, props->major, smem_for_mma<T>(a.d));
  if (mma.fn != nullptr) {
    a.tile_heads = kTileRows;
    a.tiles = static_cast<int>((g + kTileRows - 1) / kTileRows);
  }
  const size_t smem = mma.fn != nullptr ? mma.smem
                      : sizeof(float) * kWarps *
                            std::max<int64_t>(g_tile * kChunk + a.red_floats, g_tile * (3 + a.dv));

  // Context splits: the blocks fill the GPU's resident slots (the tensor-core pass: in waves as
  // whole as the split count allows), each split at least one chunk per warp.
  const int64_t sms = props->multiProcessorCount;
  const int64_t units = B * KVN * a.tiles;
  const int64_t most = std::min<int64_t>(
      256, std::max<int64_t>(1, (max_keys + kWarps * kChunk - 1) / (kWarps * kChunk)));
  a.splits = static_cast<int>(
      mma.fn != nullptr ? whole_waves(units, mma.blocks_per_sm * sms, most)
                        : std::clamp<int64_t>((4 * sms + units - 1) / units, 1, most));
  const at::Tensor part = at::empty({B * N * a.splits * (2 + a.dv)},
                                    at::TensorOptions().dtype(at::kFloat).device(device));
  a.part = part.mutable_data_ptr<float>();
  const int64_t blocks = units * a.splits;
  if (mma.fn != nullptr) {
    mma.fn<<<static_cast<unsigned>(blocks), kThreads, mma.smem, at::cuda::getCurrentCUDAStream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    Launch<T>::run(a, vpl, g_tile, blocks, smem);
  }

  MergeArgs mg;
  mg.part = a.part;
  mg.batch = a.batch;
  mg.sink = p.sink;
  mg.out = out;
  mg.o_b = p.out.stride_b;
  mg.o_s = p.out.stride_s;
  mg.o_n = p.out.stride_n;
  mg.lse = d.lse;
  mg.lse_step = lse_step;
  mg.n_heads = static_cast<int>(N);
  mg.splits = a.splits;
  mg.dv = a.dv;
  const auto stream = at::cuda::getCurrentCUDAStream();
  const size_t msmem = sizeof(float) * a.splits;
  const auto merge = [&](auto* tag) {
    using O = std::remove_pointer_t<decltype(tag)>;
    decode_merge_kernel<O><<<static_cast<unsigned>(B * N), kThreads, msmem, stream>>>(mg);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (d.out_float || dtype == at::kFloat) {
    merge(static_cast<float*>(nullptr));
  } else if (dtype == at::kHalf) {
    merge(static_cast<at::Half*>(nullptr));
  } else {
    merge(static_cast<at::BFloat16*>(nullptr));
  }
}

void infer_decode_cuda(const DecodeProblem& d, at::ScalarType dtype, void* out) {
  if (d.p->batch == 0 || d.p->heads_q == 0) return;
  if (d.cache.int8) return decode_typed<int8_t>(d, dtype, out);
  switch (dtype) {
    case at::kBFloat16: return decode_typed<at::BFloat16>(d, dtype, out);
    case at::kHalf: return decode_typed<at::Half>(d, dtype, out);
    default: return decode_typed<float>(d, dtype, out);
  }
}

// ---- routing -----------------------------------------------------------------------------

// Where the router finds the arguments it decides on, by name in the op's schema.
struct RouteArgs {
  bool v2 = false;
  int pse_shift = -1, seq_q = -1, query_rope = -1, layout = -1, num_heads = -1;
  std::vector<int> must_be_none;  // padding / prefix (v1), quant_scale_p (v2)
  int query_quant_mode = -1;      // v2: 3 is the int8 MLA prefill kernel's
};

RouteArgs route_args(const c10::FunctionSchema& schema, bool v2) {
  const auto at = [&](const char* name) {
    const auto i = schema.argumentIndexWithName(name);
    TORCH_INTERNAL_ASSERT(i.has_value(), "npu_fused_infer_attention_score: no argument ", name);
    return static_cast<int>(*i);
  };
  RouteArgs r;
  r.v2 = v2;
  r.pse_shift = at("pse_shift");
  r.seq_q = at(v2 ? "actual_seq_qlen" : "actual_seq_lengths");
  r.query_rope = at("query_rope");
  r.layout = at("input_layout");
  r.num_heads = at(v2 ? "num_query_heads" : "num_heads");
  if (v2) {
    r.must_be_none = {at("quant_scale_p")};
    r.query_quant_mode = at("query_quant_mode");
  } else {
    r.must_be_none = {at("query_padding_size"), at("kv_padding_size"), at("key_shared_prefix"),
                      at("value_shared_prefix"), at("actual_shared_prefix_len")};
  }
  return r;
}

int64_t int_of(const c10::IValue& v) {
  return v.isInt() ? v.toInt() : v.toSymInt().guard_int(__FILE__, __LINE__);
}

// Whether the C++ entry point would run this call on the decode kernel (its test in
// infer_attention.cpp: one query row per sequence, no pse_shift, fp32 / fp16 / bf16 query, no
// int8 cache with rope parts), with head sizes the kernel holds; OPENNPU_FIA_DECODE=0 sends
// every call to the portable route (as it sends the CPU's to the prefill kernels). Shapes the
// entry point rejects go there too: its messages name the argument.
bool decode_call(const c10::IValue* s, const RouteArgs& r) {
  const char* env = std::getenv("OPENNPU_FIA_DECODE");
  if (env != nullptr && std::string(env) == "0") return false;
  const at::Tensor& q = s[0].toTensor();
  const at::Tensor& k = s[1].toTensor();
  const at::ScalarType dt = q.scalar_type();
  if (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16) return false;
  if (!s[r.pse_shift].isNone()) return false;
  for (int i : r.must_be_none) {
    if (!s[i].isNone()) return false;
  }
  if (r.v2 && s[r.query_quant_mode].toInt() == 3) return false;
  const bool rope = !s[r.query_rope].isNone();
  if (rope && k.scalar_type() == at::kChar) return false;
  std::string layout(s[r.layout].toStringRef());
  for (char& ch : layout) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  layout = layout.substr(0, layout.find('_'));
  const int64_t heads = s[r.num_heads].toInt();
  int64_t width = 0;  // query head size, rope part included
  if (layout == "TND" || layout == "NTD") {
    if (s[r.seq_q].isNone()) return true;  // the entry point's error
    int64_t prev = 0;
    for (const c10::IValue& e : s[r.seq_q].toListRef()) {
      const int64_t end = int_of(e);
      if (end - prev > 1) return false;
      prev = end;
    }
  } else {
    const int64_t seq_dim = layout == "BNSD" ? 2 : 1;
    if (q.dim() <= seq_dim) return true;
    if (q.size(seq_dim) != 1) return false;
  }
  if (q.dim() >= 1) {
    width = layout == "BSH" && heads > 0 ? q.size(-1) / heads : q.size(-1);
  }
  if (rope) {
    const at::Tensor& qr = s[r.query_rope].toTensor();
    if (qr.dim() >= 1) width += layout == "BSH" && heads > 0 ? qr.size(-1) / heads : qr.size(-1);
  }
  return width <= (dt == at::kFloat ? 512 : 1024);
}

template <bool kV2>
void route(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  static const RouteArgs args = route_args(op.schema(), kV2);
  static const c10::OperatorHandle decode = c10::Dispatcher::singleton().findSchemaOrThrow(
      kV2 ? "opennpu::_fia_v2_decode" : "opennpu::_fia_decode", "");
  static const c10::OperatorHandle portable = c10::Dispatcher::singleton().findSchemaOrThrow(
      kV2 ? "opennpu::_fia_v2_portable" : "opennpu::_fia_portable", "");
  const c10::IValue* s = stack->data() + stack->size() - op.schema().arguments().size();
  const c10::cuda::CUDAGuard guard(s[0].toTensor().device());
  (decode_call(s, args) ? decode : portable).callBoxed(stack);
}

}  // namespace

OPENNPU_REGISTER_CUDA_SLOT(infer_decode, &infer_decode_cuda);

TORCH_LIBRARY_IMPL(npu, CUDA, m) {
  m.impl("npu_fused_infer_attention_score", torch::CppFunction::makeFromBoxedFunction<&route<false>>());
  m.impl("npu_fused_infer_attention_score_v2", torch::CppFunction::makeFromBoxedFunction<&route<true>>());
}

}  // namespace opennpu::attention
