// Decode kernel of npu_fused_infer_attention_score: one query row per sequence against a KV
// cache, memory-bound on reading K and V.
//
// A task serves whole GQA groups, so every K/V row is read once for all g query heads of its kv
// head. Where one kv head's rows are contiguous (BNSD, paged [blocks, KVN, block_size, D]) a
// task is one (batch, kv head, context split); where the heads of a token are adjacent (BSH,
// TND, paged [blocks, block_size, KVN * D]) a task is one (batch, context split) and walks the
// tokens, chunk by chunk, for every kv head (token-major: each 4 KiB page of a chunk is consumed
// while cached instead of once per kv head). A task walks its keys in chunks of at most 64 (32
// fp16/bf16 token-major) rows that never cross a cache block (paged caches are read in place
// through the block table), asks for the rows it needs next (software prefetch: rows kv heads
// apart start in different pages, where the hardware prefetchers stop; spread over the compute
// loops, a few lines per key, not in bursts; fp16/bf16 token-major walks ask for the next
// chunk's whole-token spans in address order, fp32 token-major walks for the values a kv head
// ahead), and per chunk computes: scores of the g heads (a register of partial dot products per
// (head, key) for 4 heads x 4 keys at a time on AVX-512, fp32 accumulation, K converted from
// fp16/bf16 in registers (bf16 K on AVX512_BF16: straight into vdpbf16ps with a bf16 copy of q,
// chunk_scores_bf16), the 16 horizontal sums done together
// by one transpose-and-add), the user mask, one online-softmax step per head (fp32 running max
// and sum, vectorised exp), then acc += P V with the V chunk read once per tile of heads (the
// accumulators of 4 heads x kPvVecs vectors stay in registers). When the tasks are too few for
// the threads, the context is split (flash-decoding) and the partial (max, sum, acc) of the
// splits are merged by log-sum-exp in a second pass. The output is rounded once.
// An int8 cache (antiquant) with per-channel factors is read as codes (the factors folded into
// q and applied to the P V sums once, see fused_int8_), multiplied by 16-bit integer codes of q
// and P with vpdpwssd on AVX512_VNNI for fp16 / bf16 queries (chunk_scores_int8_vnni), converted
// to fp32 in registers elsewhere; with per-token
// factors it is dequantised chunk by chunk into fp32 rows of the task's scratch,
// (x + offset) * scale, and those rows go through the same score and P V loops: no fp32 copy of
// the cache is made either way.
#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/vec.h"
#include "common/vnni_gemm.h"
#include "ops/attention/infer_attention.h"

namespace opennpu::attention {
inline namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using Vec = Vectorized<float>;

constexpr int64_t kChunk = 64;     // keys per softmax step
constexpr int64_t kChunkTokenMajor = 32;  // keys per step when a chunk holds every kv head
constexpr int kHeadTile = 4;       // query heads whose accumulators share registers
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#define OPENNPU_VEC_INLINE_LAMBDA __attribute__((always_inline))

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// max(a, b) that keeps a NaN from either side (std::max drops a NaN b): a NaN score, from a NaN
// or infinite query, must make its head's output NaN, as the composition's softmax does, not
// read as a fully masked row (output 0).
inline float max_nan(float a, float b) { return b > a || std::isnan(b) ? b : a; }

// Cache-line prefetch of bytes [off, off + n) of row p (n may be 0). K/V rows of one kv head are
// KVN * D elements apart in a BSH or paged cache, so every row starts in another 4 KiB page where
// the hardware prefetchers stop: the kernel asks for the rows of the next chunk itself.
// Into L2 (prefetcht1), not L1: a chunk ahead is 64-128 KiB of K and V for the token-major walks,
// more than the 32-48 KiB L1D, so prefetcht0 evicted the lines the current chunk was still
// reading. Zen 4, B=8, 32/8 heads, D=128, paged, in-process A/B against prefetcht0: 0.68-0.75x
// the time in bf16 (ctx 4096 / 32768, 1 and 2 threads), 0.67x in fp32, 0.83x BNSD bf16.
OPENNPU_VEC_INLINE void prefetch_bytes(const void* p, int64_t off, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = off; o < off + n; o += 64) __builtin_prefetch(c + o, 0, 2);
}

template <typename In>
struct Rows {
  const In* base;
  int64_t stride_blk, stride_s, stride_n;
};

template <typename In>
Rows<In> rows_of(const KvRows& r) {
  return {static_cast<const In*>(r.base), r.stride_blk, r.stride_s, r.stride_n};
}

// Row t0 of kv head h of batch b, valid for the rows t0 .. end of t0's block (paged) or beyond.
template <typename In>
const In* row_ptr(const Rows<In>& r, const DecodeProblem& d, int64_t b, int64_t h, int64_t t0) {
  const KvCache& c = d.cache;
  if (c.block_table != nullptr) {
    const int64_t blk = c.block_table[b * c.table_stride + t0 / c.block_size];
    return r.base + blk * r.stride_blk + (t0 % c.block_size) * r.stride_s + h * r.stride_n;
  }
  return r.base + b * r.stride_blk + (d.p->kv_start[b] + t0) * r.stride_s + h * r.stride_n;
}

#if defined(CPU_CAPABILITY_AVX512)
// Lane i of the result: the sum of the lanes of a[i], for 16 registers, `add` adding two
// registers lane by lane (fp32 or int32 lanes, the shuffles move bits alike): per 16 sums 45
// shuffles and adds, where one horizontal sum each costs 8, 128 in all.
template <typename Add>
OPENNPU_VEC_INLINE __m512 transpose_sum16(const __m512* a, const Add& add) {
  // 32-bit interleave: b[j] holds, per 128-bit lane, the pairwise sums of a[2j] (lanes 0, 2)
  // and a[2j + 1] (lanes 1, 3).
  __m512 b[8];
  for (int j = 0; j < 8; ++j) {
    const __m512 x = a[2 * j], y = a[2 * j + 1];
    b[j] = add(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  // 64-bit: c[j] holds, per 128-bit lane L, the sums over L of a[4j + p] in lane p.
  __m512 c[4];
  for (int j = 0; j < 4; ++j) {
    const __m512 x = b[2 * j], y = b[2 * j + 1];
    c[j] = add(_mm512_shuffle_ps(x, y, 0x44), _mm512_shuffle_ps(x, y, 0xEE));
  }
  // 128-bit: block j of the result is the sum of the four blocks of c[j].
  const __m512 e0 = add(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                        _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 e1 = add(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                        _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return add(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}
#endif

// Lane i of the result: the sum of the lanes of a[i], for Vec::size() vectors (the horizontal
// sums of a whole register file of dot products at once).
OPENNPU_VEC_INLINE Vec transpose_sum(const Vec* a) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = a[i];
  return transpose_sum16(v, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
#elif defined(CPU_CAPABILITY_AVX2)
  // hadd sums adjacent pairs per 128-bit lane; the two lanes hold the halves of each sum.
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
#else
  float s[Vec::size()];
  for (int i = 0; i < Vec::size(); ++i) s[i] = horizontal_sum(a[i]);
  return Vec::loadu(s);
#endif
}

// int8 codes as fp32 lanes behind VecPair's interface (kStep = two vectors): the rows of an int8
// cache with per-channel factors, which the score and P V loops read as codes (see
// DecodeKernel::fused_int8_).
struct Int8Pair {
  static constexpr int64_t kStep = 2 * Vec::size();
  OPENNPU_VEC_INLINE static void load(const int8_t* p, Vec& a, Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(x)));
    b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(x, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
#else
    float t[kStep];
    for (int64_t i = 0; i < kStep; ++i) t[i] = static_cast<float>(p[i]);
    a = Vec::loadu(t);
    b = Vec::loadu(t + Vec::size());
#endif
  }
  // n < kStep codes; lanes past n are 0
  OPENNPU_VEC_INLINE static void load(const int8_t* p, Vec& a, Vec& b, int64_t n) {
    if (n == kStep) return load(p, a, b);
    int8_t t[kStep] = {};
    std::memcpy(t, p, n);
    load(t, a, b);
  }
};

template <typename In>
struct RowPair {
  using type = VecPair<In>;
};
template <>
struct RowPair<int8_t> {
  using type = Int8Pair;
};

// The rows to prefetch beside a dot-product loop of `n` elements in steps of kStep, spread over
// the steps: each step asks for the next `per_step` bytes (whole lines) of each row, the last
// steps for what is left (nothing once a row is covered). No division per step: on AVX2 (16
// elements a step) the two divisions per step and key stood out in the profile.
template <int64_t kStep>
struct StepPrefetch {
  int64_t bytes, per_step;
  StepPrefetch(int64_t pf_bytes, int64_t n)
      : bytes(pf_bytes),
        per_step(n > 0 ? round_up((pf_bytes * kStep + n - 1) / n, 64) : pf_bytes) {}
  // asks for step j's share (j a multiple of kStep) of the NK rows pf[i] (null: none)
  template <int NK>
  OPENNPU_VEC_INLINE void at(int64_t j, const char* const* pf) const {
    const int64_t lo = j / kStep * per_step;
    if (lo >= bytes) return;
    const int64_t cnt = std::min(per_step, bytes - lo);
    for (int i = 0; i < NK; ++i) {
      if (pf[i] != nullptr) prefetch_bytes(pf[i], lo, cnt);
    }
  }
};

// acc[h * NK + i] += q_h * k_i lane by lane (summed later by transpose_sum) for NH heads and
// NK = Vec::size() / NH keys, over n elements: one register of partial dot products per (head,
// key), each key row converted once for the NH heads and each q vector loaded once for the NK
// keys. q rows (fp32, stride ldq) are zero-padded to a multiple of kStep; k's lanes past n load
// as 0.
//
// pf (when set): NK rows of pf_bytes to prefetch, spread over the steps (StepPrefetch): asked
// for all at once, the lines of a chunk filled the core's miss buffers and the prefetch
// instructions stalled the FMAs behind them.
template <int NH, typename In>
OPENNPU_VEC_INLINE void dots_block(const float* q, int64_t ldq, const In* const* k, int64_t n,
                                   Vec* acc, const char* const* pf = nullptr,
                                   int64_t pf_bytes = 0) {
  using Pair = typename RowPair<In>::type;
  constexpr int NK = Vec::size() / NH;
  const StepPrefetch<Pair::kStep> share(pf_bytes, n);
  const auto step = [&](int64_t j, int64_t cnt) OPENNPU_VEC_INLINE_LAMBDA {
    if (pf != nullptr) share.template at<NK>(j, pf);
    Vec qa[NH], qb[NH];
    for (int h = 0; h < NH; ++h) {
      qa[h] = Vec::loadu(q + h * ldq + j);
      qb[h] = Vec::loadu(q + h * ldq + j + Vec::size());
    }
    for (int i = 0; i < NK; ++i) {
      Vec x0, x1;
      if (cnt == Pair::kStep) {
        Pair::load(k[i] + j, x0, x1);
      } else {
        Pair::load(k[i] + j, x0, x1, cnt);
      }
      for (int h = 0; h < NH; ++h) {
        acc[h * NK + i] = at::vec::fmadd(qa[h], x0, acc[h * NK + i]);
        acc[h * NK + i] = at::vec::fmadd(qb[h], x1, acc[h * NK + i]);
      }
    }
  };
  int64_t j = 0;
  for (; j + Pair::kStep <= n; j += Pair::kStep) step(j, Pair::kStep);
  if (j < n) step(j, n - j);
}

// Stores lanes [h * NK, h * NK + cnt) of r at dst (cnt <= NK).
template <int NK>
OPENNPU_VEC_INLINE void store_lanes(float* dst, const Vec& r, int h, int64_t cnt) {
#if defined(CPU_CAPABILITY_AVX512)
  // a masked store of the whole register, shifted so that lane h * NK lands on dst: the lanes
  // outside the mask are neither written nor read.
  const __mmask16 m = static_cast<__mmask16>(((1u << cnt) - 1) << (h * NK));
  _mm512_mask_storeu_ps(dst - h * NK, m, r);
#elif defined(CPU_CAPABILITY_AVX2)
  // whole groups straight from the register's 128-bit half (h is a constant once the caller's
  // head loop is unrolled); through memory, the narrow reloads of a wide store stalled
  if (cnt == NK) {
    const __m128 half = h * NK >= 4 ? _mm256_extractf128_ps(r, 1) : _mm256_castps256_ps128(r);
    if constexpr (NK == 8) {
      _mm256_storeu_ps(dst, r);
    } else if constexpr (NK == 4) {
      _mm_storeu_ps(dst, half);
    } else if constexpr (NK == 2) {
      if (h % 2 == 0) {
        _mm_storel_pi(reinterpret_cast<__m64*>(dst), half);
      } else {
        _mm_storeh_pi(reinterpret_cast<__m64*>(dst), half);
      }
    } else {
      static_assert(NK == 1);
      _mm_store_ss(dst, _mm_permutevar_ps(half, _mm_set1_epi32(h % 4)));
    }
    return;
  }
#endif
#if !defined(CPU_CAPABILITY_AVX512)
  float tmp[Vec::size()];
  r.store(tmp);
  for (int64_t i = 0; i < cnt; ++i) dst[i] = tmp[h * NK + i];
#endif
}

// The rows of keys [t, t + NK) of a chunk (a short last group, cnt < NK, repeats its last key),
// their rope rows, and the rows to prefetch beside them (null past cnt or pf_len).
template <int NK, typename In, typename RopeIn>
struct KeyGroup {
  const In* k[NK];
  const RopeIn* kr[NK];
  const char* pf[NK];
  OPENNPU_VEC_INLINE KeyGroup(int64_t t, int64_t cnt, const In* keys, int64_t k_stride,
                              const RopeIn* rope, int64_t kr_stride, int64_t Dr, const char* pf_base,
                              int64_t pf_stride, int64_t pf_len) {
    for (int i = 0; i < NK; ++i) {
      const int64_t row = t + std::min<int64_t>(i, cnt - 1);
      k[i] = keys + row * k_stride;
      kr[i] = Dr > 0 ? rope + row * kr_stride : nullptr;
      pf[i] = i < cnt && t + i < pf_len ? pf_base + (t + i) * pf_stride : nullptr;
    }
  }
};

// s[h * kChunk + t] = scaled q_h . k_t (+ q_rope_h . k_rope_t) for NH heads, len keys, NK =
// Vec::size() / NH keys at a time (a short last block repeats its last key). Prefetches pf_bytes
// of rows [0, pf_len) of pf (pf_stride bytes apart), row t with key t, when pf is set.
template <int NH, typename In, typename RopeIn>
void chunk_scores(const float* q, const float* qr, int64_t ldq, int64_t ldqr, const In* k,
                  int64_t k_stride, const RopeIn* kr, int64_t kr_stride, int64_t D, int64_t Dr,
                  int64_t len, float* s, const char* pf, int64_t pf_stride, int64_t pf_bytes,
                  int64_t pf_len) {
  constexpr int NK = Vec::size() / NH;
  if (pf == nullptr) pf_len = 0;
  for (int64_t t = len; t < pf_len; ++t) prefetch_bytes(pf + t * pf_stride, 0, pf_bytes);
  for (int64_t t = 0; t < len; t += NK) {
    const int64_t cnt = std::min<int64_t>(NK, len - t);
    const KeyGroup<NK, In, RopeIn> g(t, cnt, k, k_stride, kr, kr_stride, Dr, pf, pf_stride, pf_len);
    Vec acc[Vec::size()];
    for (int i = 0; i < Vec::size(); ++i) acc[i] = Vec(0.0f);
    dots_block<NH>(q, ldq, g.k, D, acc, t < pf_len ? g.pf : nullptr, pf_bytes);
    if (Dr > 0) dots_block<NH>(qr, ldqr, g.kr, Dr, acc);
    const Vec sums = transpose_sum(acc);
    for (int h = 0; h < NH; ++h) store_lanes<NK>(s + h * kChunk + t, sums, h, cnt);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// chunk_scores for a bf16 cache on CPUs with AVX512_BF16: q (unscaled bf16, rows zero-padded to
// ldq / ldqr, multiples of 32) and each key row go into vdpbf16ps pair by pair, which multiplies
// bf16 pairs exactly and adds both products to the fp32 partial sums: one instruction per head
// and 32 elements, where converting K to fp32 took two per 16 and then two FMAs per head. The
// sums are scaled after the reduction (q is not rounded a second time). Same fp32 accumulation
// as the converting loop but for the order of the additions and subnormals (read and flushed as
// 0 by the instruction, see vnni_gemm.h).
// acc[h * NK + i] += q_h . k_i over n elements (k's lanes past n read as 0), NK =
// Vec::size() / NH; pf / pf_bytes as in dots_block.
template <int NH>
OPENNPU_AVX512_BF16_TARGET inline void dots_bf16(const at::BFloat16* q, int64_t ldq,
                                                 const at::BFloat16* const* k, int64_t n,
                                                 __m512* acc, const char* const* pf,
                                                 int64_t pf_bytes) {
  constexpr int NK = Vec::size() / NH;
  constexpr int64_t kStep = 32;
  const StepPrefetch<kStep> share(pf_bytes, n);
  for (int64_t j = 0; j < n; j += kStep) {
    const int64_t cnt = std::min<int64_t>(kStep, n - j);
    if (pf != nullptr) share.at<NK>(j, pf);
    __m512bh qv[NH];
    for (int h = 0; h < NH; ++h) qv[h] = (__m512bh)_mm512_loadu_si512(q + h * ldq + j);
    const __mmask32 m = cnt == kStep ? ~__mmask32{0} : _cvtu32_mask32((1u << cnt) - 1);
    for (int i = 0; i < NK; ++i) {
      const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(m, k[i] + j);
      for (int h = 0; h < NH; ++h) acc[h * NK + i] = _mm512_dpbf16_ps(acc[h * NK + i], qv[h], kv);
    }
  }
}

template <int NH>
OPENNPU_AVX512_BF16_TARGET void chunk_scores_bf16(
    const at::BFloat16* q, const at::BFloat16* qr, int64_t ldq, int64_t ldqr, const at::BFloat16* k,
    int64_t k_stride, const at::BFloat16* kr, int64_t kr_stride, int64_t D, int64_t Dr,
    int64_t len, float scale, float* s, const char* pf, int64_t pf_stride, int64_t pf_bytes,
    int64_t pf_len) {
  constexpr int NK = Vec::size() / NH;
  if (pf == nullptr) pf_len = 0;
  for (int64_t t = len; t < pf_len; ++t) prefetch_bytes(pf + t * pf_stride, 0, pf_bytes);
  for (int64_t t = 0; t < len; t += NK) {
    const int64_t cnt = std::min<int64_t>(NK, len - t);
    const KeyGroup<NK, at::BFloat16, at::BFloat16> g(t, cnt, k, k_stride, kr, kr_stride, Dr, pf,
                                                     pf_stride, pf_len);
    __m512 acc[Vec::size()];
    for (int i = 0; i < Vec::size(); ++i) acc[i] = _mm512_setzero_ps();
    dots_bf16<NH>(q, ldq, g.k, D, acc, t < pf_len ? g.pf : nullptr, pf_bytes);
    if (Dr > 0) dots_bf16<NH>(qr, ldqr, g.kr, Dr, acc, nullptr, 0);
    Vec sums[Vec::size()];
    for (int i = 0; i < Vec::size(); ++i) sums[i] = acc[i];
    const Vec scaled = transpose_sum(sums) * Vec(scale);
    for (int h = 0; h < NH; ++h) store_lanes<NK>(s + h * kChunk + t, scaled, h, cnt);
  }
}
#endif

// Accumulator vectors per head in the P V loop: 4 on AVX-512 (4 heads x 4 = 16 of its 32
// registers; each broadcast probability feeds 4 FMAs), 2 where there are 16 registers.
constexpr int kPvVecs = Vec::size() >= 16 ? 4 : 2;
constexpr int64_t kPvWidth = kPvVecs * Vec::size();  // accumulator rows are padded to this

// The lines that column tile i (of `tiles`) of a P V loop asks for: bytes [off, off + cnt) of
// rows [0, rows) of the next chunk, row t's beside key t (rows past the chunk's length after
// its loop): spread, not in one burst (see dots_block). Nothing when pf is null.
struct PvPrefetch {
  int64_t off = 0, cnt = 0, rows = 0;
  PvPrefetch(const char* pf, int64_t pf_bytes, int64_t pf_len, int64_t tiles, int64_t i) {
    if (pf == nullptr) return;
    const int64_t share = round_up((pf_bytes + tiles - 1) / tiles, 64);
    off = i * share;
    cnt = std::max<int64_t>(std::min<int64_t>(share, pf_bytes - off), 0);
    rows = cnt > 0 ? pf_len : 0;
  }
};

// acc_h[0, Dv) += sum_t p[h * kChunk + t] * v_t for NH heads, in column tiles of kPvWidth.
template <int NH, typename In>
void chunk_pv(const float* p, const In* v, int64_t v_stride, int64_t len, int64_t Dv, float* acc,
              int64_t ld_acc, const char* pf, int64_t pf_stride, int64_t pf_bytes, int64_t pf_len) {
  using Pair = typename RowPair<In>::type;
  static_assert(kPvWidth % Pair::kStep == 0);
  constexpr int kPairs = kPvWidth / Pair::kStep;
  const int64_t tiles = (Dv + kPvWidth - 1) / kPvWidth;
  for (int64_t j = 0, i = 0; j < Dv; j += kPvWidth, ++i) {
    const int64_t n = std::min<int64_t>(kPvWidth, Dv - j);
    const PvPrefetch pft(pf, pf_bytes, pf_len, tiles, i);
    const int64_t pf_off = pft.off, pf_cnt = pft.cnt, pf_t = pft.rows;
    Vec a[NH][kPvVecs];
    for (int h = 0; h < NH; ++h) {  // acc rows are padded to a multiple of kPvWidth
      for (int u = 0; u < kPvVecs; ++u) a[h][u] = Vec::loadu(acc + h * ld_acc + j + u * Vec::size());
    }
    const In* vj = v + j;
    const auto body = [&](int64_t t, auto full) OPENNPU_VEC_INLINE_LAMBDA {
      if (t < pf_t) prefetch_bytes(pf + t * pf_stride, pf_off, pf_cnt);
      Vec x[kPvVecs];
      for (int u = 0; u < kPairs; ++u) {
        if constexpr (decltype(full)::value) {
          Pair::load(vj + t * v_stride + u * Pair::kStep, x[2 * u], x[2 * u + 1]);
        } else {
          const int64_t m = n - u * Pair::kStep;
          if (m > 0) {
            Pair::load(vj + t * v_stride + u * Pair::kStep, x[2 * u], x[2 * u + 1],
                       std::min<int64_t>(m, Pair::kStep));
          } else {
            x[2 * u] = x[2 * u + 1] = Vec(0.0f);
          }
        }
      }
      for (int h = 0; h < NH; ++h) {
        const Vec w(p[h * kChunk + t]);
        for (int u = 0; u < kPvVecs; ++u) a[h][u] = at::vec::fmadd(w, x[u], a[h][u]);
      }
    };
    if (n == kPvWidth) {
      for (int64_t t = 0; t < len; ++t) body(t, std::true_type{});
    } else {
      for (int64_t t = 0; t < len; ++t) body(t, std::false_type{});
    }
    for (int64_t t = len; t < pf_t; ++t) prefetch_bytes(pf + t * pf_stride, pf_off, pf_cnt);
    for (int h = 0; h < NH; ++h) {
      for (int u = 0; u < kPvVecs; ++u) a[h][u].store(acc + h * ld_acc + j + u * Vec::size());
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// Fused int8 on AVX512_VNNI (fp16 / bf16 queries only): both loops of a chunk
// multiply the int8 codes by 16-bit integer codes with vpdpwssd (32 products summed in pairs
// into 16 int32 lanes per instruction), where the fp32 loops spend two conversions per 16 codes
// and then one FMA per 16 codes and head. The 16-bit sides:
//  - scores: q' (scale q s, fp32, see fused_int8_) of each head as int16 codes
//    rint(q' * 32767 / max|q'|), one scale per head and call (load_q). A code's error is at most
//    2^-16 of the head's largest |q'_d|; the bf16 / fp16 composition rounds every dequantised
//    key element and every score to 8 / 11 bits (2^-9 / 2^-12 relative).
//  - P V: each chunk's probabilities of a head as int16 codes rint(p * 32767 / max_t p_t), one
//    scale per head and chunk (block floating point), applied when the int32 sums are folded
//    into the fp32 accumulators. A probability's error is at most 2^-16 of its chunk's largest,
//    so the weights' summed error stays below about 2^-16 of l (every chunk's largest p is part
//    of l), where the composition rounds each p to 8 / 11 bits.
// Integer sums are exact: |code| <= 32767 and |x| <= 128 give < 2^23 per pair, < 2^29 per lane
// over 64 keys, and a whole score's dot product over D <= 512 elements is at most
// 512 * 32767 * 128 < 2^31 (so the scores' lanes are summed in int32; larger D keeps the fp32
// loops, as does an fp32 q: an fp32 composition is exact to 2^-24).
// The instruction is written as inline asm (no target flag for the file, and the accumulator
// tied to its register: GCC 12's intrinsic copied every accumulator to another register and
// back around each product).
OPENNPU_VEC_INLINE __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

constexpr int64_t kVnniStep = 32;  // int16 lanes of a register: q16 rows are padded to this

// n (<= kVnniStep) int8 key codes at k as int16 lanes (zeros past n): a whole step widened
// straight from memory (the load folds into vpmovsxbw), a short one through a masked load m.
OPENNPU_VEC_INLINE __m512i key_step(const int8_t* k, int64_t n, __mmask32 m) {
  if (n == kVnniStep) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k)));
  }
  return _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(m, k));
}

// s[h * kChunk + t] = qscale[h] * (q16_h . k_t) for NH heads over len keys of D int8 codes;
// q16 rows (stride ldq, zero-padded to kVnniStep) hold q' as codes (see above). Keys NK =
// 16 / NH at a time as in chunk_scores (a short last group repeats its last key); pf as there.
template <int NH>
void chunk_scores_int8_vnni(
    const int16_t* q, int64_t ldq, const float* qscale, const int8_t* k, int64_t k_stride,
    int64_t D, int64_t len, float* s, const char* pf, int64_t pf_stride, int64_t pf_bytes,
    int64_t pf_len) {
  constexpr int NK = Vec::size() / NH;
  if (pf == nullptr) pf_len = 0;
  for (int64_t t = len; t < pf_len; ++t) prefetch_bytes(pf + t * pf_stride, 0, pf_bytes);
  float lane_scale[Vec::size()];  // lane h * NK + i of the sums is head h's
  for (int h = 0; h < NH; ++h) std::fill(lane_scale + h * NK, lane_scale + (h + 1) * NK, qscale[h]);
  const Vec lane_scales = Vec::loadu(lane_scale);
  // NH = 4: the q operand of rotation r holds in its 128-bit quarter c (8 elements of the step)
  // head (c + r) % 4's codes, so that accumulator (r, key) holds in quarter c head (c + r) % 4's
  // partial sums over quarter c's elements; moving quarter c to c + r lines every head's four
  // partials up in quarter `head` (3 shuffles and 3 adds a key), and a 4 x 4 transpose sum
  // (9 instructions a group) finishes: 33 instructions per 16 sums where transpose_sum16 takes
  // 45. Built once per call (D / 32 steps of 4 registers).
  constexpr int64_t kMaxSteps = 512 / kVnniStep;  // vnni_int8_ holds D <= 512
  __m512i qrot[NH == 4 ? 4 * kMaxSteps : 1];
  if constexpr (NH == 4) {
    for (int64_t j = 0, st = 0; j < D; j += kVnniStep, ++st) {
      __m512i qv[4];
      for (int h = 0; h < 4; ++h) qv[h] = _mm512_loadu_si512(q + h * ldq + j);
      for (int r = 0; r < 4; ++r) {
        __m512i x = qv[r];
        for (int c = 1; c < 4; ++c) {
          x = _mm512_mask_mov_epi32(x, _cvtu32_mask16(0xFu << (4 * c)), qv[(c + r) % 4]);
        }
        qrot[4 * st + r] = x;
      }
    }
  }
  for (int64_t t = 0; t < len; t += NK) {
    const int64_t cnt = std::min<int64_t>(NK, len - t);
    const KeyGroup<NK, int8_t, int8_t> g(t, cnt, k, k_stride, nullptr, 0, 0, pf, pf_stride,
                                         pf_len);
    // the group's rows to prefetch, asked for before its loop: a few lines per key (spread
    // over the steps, their index arithmetic cost more than the loop's products)
    if (t < pf_len) {
      for (int i = 0; i < NK; ++i) {
        if (g.pf[i] != nullptr) prefetch_bytes(g.pf[i], 0, pf_bytes);
      }
    }
    __m512i acc[Vec::size()];
    for (int i = 0; i < Vec::size(); ++i) acc[i] = _mm512_setzero_si512();
    // the 16 sums in int32 (exact: each whole dot product is below 2^31, see above), then one
    // conversion
    __m512i dots;
    if constexpr (NH == 4) {
      for (int64_t j = 0, st = 0; j < D; j += kVnniStep, ++st) {
        const int64_t n = std::min<int64_t>(kVnniStep, D - j);
        const __mmask32 m = n == kVnniStep ? ~__mmask32{0} : _cvtu32_mask32((1u << n) - 1);
        for (int i = 0; i < 4; ++i) {
          const __m512i kv = key_step(g.k[i] + j, n, m);
          for (int r = 0; r < 4; ++r) acc[4 * r + i] = dpwssd(acc[4 * r + i], qrot[4 * st + r], kv);
        }
      }
      __m512i v[4];  // quarter h: head h's four partial sums of key i
      for (int i = 0; i < 4; ++i) {
        // shuffle_i32x4 quarter selectors: result quarter c = quarter (c - r) % 4
        const __m512i a1 = _mm512_shuffle_i32x4(acc[4 + i], acc[4 + i], 0x93);
        const __m512i a2 = _mm512_shuffle_i32x4(acc[8 + i], acc[8 + i], 0x4E);
        const __m512i a3 = _mm512_shuffle_i32x4(acc[12 + i], acc[12 + i], 0x39);
        v[i] = _mm512_add_epi32(_mm512_add_epi32(acc[i], a1), _mm512_add_epi32(a2, a3));
      }
      // per quarter: lane i = the sum of v[i]'s four lanes
      const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]),
                                           _mm512_unpackhi_epi32(v[0], v[1]));
      const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]),
                                           _mm512_unpackhi_epi32(v[2], v[3]));
      dots = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
    } else {
      for (int64_t j = 0; j < D; j += kVnniStep) {
        const int64_t n = std::min<int64_t>(kVnniStep, D - j);
        __m512i qv[NH];
        for (int h = 0; h < NH; ++h) qv[h] = _mm512_loadu_si512(q + h * ldq + j);
        const __mmask32 m = n == kVnniStep ? ~__mmask32{0} : _cvtu32_mask32((1u << n) - 1);
        for (int i = 0; i < NK; ++i) {
          const __m512i kv = key_step(g.k[i] + j, n, m);
          for (int h = 0; h < NH; ++h) acc[h * NK + i] = dpwssd(acc[h * NK + i], qv[h], kv);
        }
      }
      __m512 bits[Vec::size()];
      for (int i = 0; i < Vec::size(); ++i) bits[i] = _mm512_castsi512_ps(acc[i]);
      dots = _mm512_castps_si512(transpose_sum16(bits, [](__m512 x, __m512 y) {
        return _mm512_castsi512_ps(
            _mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
      }));
    }
    const Vec r = Vec(_mm512_cvtepi32_ps(dots)) * lane_scales;
    for (int h = 0; h < NH; ++h) store_lanes<NK>(s + h * kChunk + t, r, h, cnt);
  }
}

// P of NH heads (p[h * kChunk + t], len <= kChunk keys, p >= 0) as int16 codes
// rint(p * 32767 / max p) in codes[h * kChunk + t], the value of one code in pscale[h].
template <int NH>
void p_codes(const float* p, int64_t len, int16_t* codes, float* pscale) {
  for (int h = 0; h < NH; ++h) {
    const float* ph = p + h * kChunk;
    // p >= 0, so the masked lanes' zeros leave the max alone; a NaN propagates to pscale (and
    // so to the output, as the fp32 loop's would)
    Vec vmax(0.0f);
    for (int64_t t = 0; t < len; t += Vec::size()) {
      const __mmask16 m = _cvtu32_mask16((1u << std::min<int64_t>(Vec::size(), len - t)) - 1);
      vmax = at::vec::maximum(vmax, Vec(_mm512_maskz_loadu_ps(m, ph + t)));
    }
    const float pmax = at::vec::vec_reduce_all<float>(
        [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
    pscale[h] = pmax / 32767.0f;
    const __m512 inv = _mm512_set1_ps(pmax > 0.0f ? 32767.0f / pmax : 0.0f);
    for (int64_t t = 0; t < len; t += Vec::size()) {  // round to nearest even, saturated
      const int64_t n = std::min<int64_t>(Vec::size(), len - t);
      const __mmask16 m = _cvtu32_mask16((1u << n) - 1);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ph + t), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + h * kChunk + t),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(x)));
    }
  }
}

// One online-softmax step of a head over the chunk's len (1 .. kChunk) scores s (+ off), all
// finite, fused with p_codes: m, l and acc (ldacc floats) updated as the fp32 step does, and P
// written as int16 codes rint(p * 32767 / max p) with pscale the value of one code. The scores
// stay in registers from the max to the codes.
OPENNPU_VEC_INLINE void softmax_codes(const float* s, int64_t len, float off, float& m, float& l,
                                      float* acc, int64_t ldacc, int16_t* codes, float& pscale) {
  constexpr int kVecs = kChunk / 16;
  __m512 x[kVecs];
  __mmask16 live[kVecs];
  __m512 vmax = _mm512_set1_ps(kNegInf);
  const __m512 voff = _mm512_set1_ps(off);
  for (int i = 0; i < kVecs; ++i) {
    const int64_t n = std::clamp<int64_t>(len - 16 * i, 0, 16);
    live[i] = _cvtu32_mask16((1u << n) - 1);
    x[i] = _mm512_add_ps(_mm512_maskz_loadu_ps(live[i], s + 16 * i), voff);
    vmax = _mm512_mask_max_ps(vmax, live[i], vmax, x[i]);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const float alpha = m == m_new ? 1.0f : (m == kNegInf ? 0.0f : std::exp(m - m_new));
  const __m512 vm = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps(), pmax = _mm512_setzero_ps();
  for (int i = 0; i < kVecs; ++i) {  // the lanes past len are 0
    x[i] = _mm512_maskz_mov_ps(live[i], exp_fast(Vec(_mm512_sub_ps(x[i], vm))));
    vsum = _mm512_add_ps(vsum, x[i]);
    pmax = _mm512_max_ps(pmax, x[i]);
  }
  if (alpha != 1.0f) {
    for (int64_t j = 0; j < ldacc; j += Vec::size()) {
      (Vec::loadu(acc + j) * Vec(alpha)).store(acc + j);
    }
  }
  l = l * alpha + _mm512_reduce_add_ps(vsum);
  m = m_new;
  const float top = _mm512_reduce_max_ps(pmax);
  pscale = top / 32767.0f;
  const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
  for (int i = 0; i < kVecs; ++i) {  // round to nearest even, saturated
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 16 * i),
                        _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[i], inv))));
  }
}

// acc_h[0, Dv) += pscale[h] * sum_t codes[h * kChunk + t] * v_t over int8 codes v (len <=
// kChunk keys) for NH heads: P as int16 codes (p_codes, or softmax_codes), two keys per
// vpdpwssd (their rows' elements interleaved in 16-bit pairs), column tiles of kPvWidth = 64
// codes; pf as chunk_pv.
template <int NH>
void chunk_pv_int8_codes(const int16_t* codes_, const float* pscale, const int8_t* v,
                         int64_t v_stride, int64_t len, int64_t Dv, float* acc, int64_t ld_acc,
                         const char* pf, int64_t pf_stride, int64_t pf_bytes, int64_t pf_len) {
  static_assert(kPvWidth == 64 && kChunk % 2 == 0);
  const auto codes = [&](int h) { return codes_ + h * kChunk; };
  // dword lane 4L + r of unpack{lo,hi}_epi16 of two 32-element rows holds element 8L + r
  // (+ 4 for hi): these indices put lanes back in element order (qwords of lo, then of hi)
  const __m512i first16 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i second16 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  const int64_t tiles = (Dv + kPvWidth - 1) / kPvWidth;
  for (int64_t j = 0, i = 0; j < Dv; j += kPvWidth, ++i) {
    const int64_t n = std::min<int64_t>(kPvWidth, Dv - j);
    const __mmask64 m = n == kPvWidth ? ~__mmask64{0} : _cvtu64_mask64((uint64_t{1} << n) - 1);
    const PvPrefetch pft(pf, pf_bytes, pf_len, tiles, i);
    __m512i a[NH][4];
    for (int h = 0; h < NH; ++h) {
      for (int u = 0; u < 4; ++u) a[h][u] = _mm512_setzero_si512();
    }
    for (int64_t t = 0; t < len; t += 2) {
      const bool pair = t + 1 < len;
      if (t < pft.rows) prefetch_bytes(pf + t * pf_stride, pft.off, pft.cnt);
      if (pair && t + 1 < pft.rows) prefetch_bytes(pf + (t + 1) * pf_stride, pft.off, pft.cnt);
      const int8_t* r0 = v + t * v_stride + j;
      __m512i x0, x1, y0, y1;
      if (n == kPvWidth) {
        // whole tile: each half widened straight from memory (the load folds into vpmovsxbw)
        const int8_t* r1 = pair ? r0 + v_stride : r0;  // weight 0
        x0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0)));
        x1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 32)));
        y0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1)));
        y1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 32)));
      } else {
        const __m512i x = _mm512_maskz_loadu_epi8(m, r0);
        const __m512i y = pair ? _mm512_maskz_loadu_epi8(m, r0 + v_stride) : x;  // weight 0
        x0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(x));
        x1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(x, 1));
        y0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(y));
        y1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(y, 1));
      }
      const __m512i b[4] = {_mm512_unpacklo_epi16(x0, y0), _mm512_unpackhi_epi16(x0, y0),
                            _mm512_unpacklo_epi16(x1, y1), _mm512_unpackhi_epi16(x1, y1)};
      for (int h = 0; h < NH; ++h) {
        int32_t w2;
        if (pair) {
          std::memcpy(&w2, codes(h) + t, 4);
        } else {
          w2 = static_cast<uint16_t>(codes(h)[t]);
        }
        const __m512i w = _mm512_set1_epi32(w2);
        for (int u = 0; u < 4; ++u) a[h][u] = dpwssd(a[h][u], b[u], w);
      }
    }
    for (int64_t t = len; t < pft.rows; ++t) prefetch_bytes(pf + t * pf_stride, pft.off, pft.cnt);
    for (int h = 0; h < NH; ++h) {
      const __m512 sc = _mm512_set1_ps(pscale[h]);
      float* o = acc + h * ld_acc + j;
      for (int u = 0; u < 2; ++u) {
        const __m512i lo = a[h][2 * u], hi = a[h][2 * u + 1];
        const __m512i e0 = _mm512_permutex2var_epi64(lo, first16, hi);
        const __m512i e1 = _mm512_permutex2var_epi64(lo, second16, hi);
        float* o0 = o + 32 * u;
        _mm512_storeu_ps(o0, _mm512_fmadd_ps(_mm512_cvtepi32_ps(e0), sc, _mm512_loadu_ps(o0)));
        _mm512_storeu_ps(o0 + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(e1), sc, _mm512_loadu_ps(o0 + 16)));
      }
    }
  }
}

// chunk_pv_int8_codes for P as fp32 values p[h * kChunk + t] (codes made by p_codes).
template <int NH>
void chunk_pv_int8_vnni(const float* p, const int8_t* v, int64_t v_stride, int64_t len,
                        int64_t Dv, float* acc, int64_t ld_acc, const char* pf, int64_t pf_stride,
                        int64_t pf_bytes, int64_t pf_len) {
  alignas(64) int16_t codes[NH * kChunk];
  float pscale[NH];
  p_codes<NH>(p, len, codes, pscale);
  chunk_pv_int8_codes<NH>(codes, pscale, v, v_stride, len, Dv, acc, ld_acc, pf, pf_stride,
                          pf_bytes, pf_len);
}
#endif

// Calls f(std::integral_constant<int, NH>, h0) over head tiles of 4, 2, 1 covering [0, g).
template <typename F>
void for_head_tiles(int64_t g, const F& f) {
  int64_t h = 0;
  for (; h + 4 <= g; h += 4) f(std::integral_constant<int, 4>{}, h);
  if (h + 2 <= g) {
    f(std::integral_constant<int, 2>{}, h);
    h += 2;
  }
  if (h < g) f(std::integral_constant<int, 1>{}, h);
}

// Per-thread buffers: scaled q of the group, scores / probabilities, accumulators, and the
// dequantised K / V rows of a chunk (int8 caches).
struct Scratch {
  std::vector<float> q, qr, s, acc, m, l, kd, vd;
  std::vector<at::BFloat16> qb, qrb;  // unscaled bf16 q of the group (chunk_scores_bf16)
  std::vector<float> qoff;  // per head: sum_d q'_d * key offset_d (fused int8, see fused_int8_)
  std::vector<int16_t> q16;  // q' of the group as int16 codes (vnni_int8_)
  std::vector<float> qscale;  // per head: the value of one q16 code
  std::vector<int16_t> pcodes;  // P of a step's heads as int16 codes (softmax_codes)
  std::vector<float> pscale;  // per head: the value of one P code
};

// Offset of the token factor of row t0 of (b, h) in a KvQuant::Kind::kToken table.
int64_t token_index(const KvQuant& qd, const DecodeProblem& d, int64_t b, int64_t h, int64_t t0) {
  const KvCache& c = d.cache;
  if (qd.paged) {
    const int64_t blk = c.block_table[b * c.table_stride + t0 / c.block_size];
    return blk * qd.stride_blk + (t0 % c.block_size) * qd.stride_s + h * qd.stride_n;
  }
  return b * qd.stride_blk + t0 * qd.stride_s + h * qd.stride_n;
}

// Rows t0 .. t0 + len of (b, h) (inside one cache block), n int8 values each at src_stride, as
// fp32 rows (x + offset) * scale at dst + t * ld.
void dequant_rows(const KvQuant& qd, const DecodeProblem& d, int64_t b, int64_t h, int64_t t0,
                  int64_t len, const int8_t* src, int64_t src_stride, int64_t n, float* dst,
                  int64_t ld) {
  if (qd.kind == KvQuant::Kind::kChannel) {
    const float* __restrict sc = qd.scale + h * n;
    const float* __restrict off = qd.offset == nullptr ? nullptr : qd.offset + h * n;
    for (int64_t t = 0; t < len; ++t) {
      const int8_t* __restrict x = src + t * src_stride;
      float* __restrict y = dst + t * ld;
      if (off != nullptr) {
        for (int64_t j = 0; j < n; ++j) y[j] = (static_cast<float>(x[j]) + off[j]) * sc[j];
      } else {
        for (int64_t j = 0; j < n; ++j) y[j] = static_cast<float>(x[j]) * sc[j];
      }
    }
    return;
  }
  const int64_t i0 = token_index(qd, d, b, h, t0);
  for (int64_t t = 0; t < len; ++t) {
    const float s = qd.scale[i0 + t * qd.stride_s];
    const float o = qd.offset == nullptr ? 0.0f : qd.offset[i0 + t * qd.stride_s];
    const int8_t* __restrict x = src + t * src_stride;
    float* __restrict y = dst + t * ld;
    for (int64_t j = 0; j < n; ++j) y[j] = (static_cast<float>(x[j]) + o) * s;
  }
}

// In: the dtype of q and out; KvT: of the K / V cache (In, or int8 with antiquant factors).
template <typename In, typename KvT = In>
struct DecodeKernel {
  static constexpr bool kInt8 = std::is_same_v<KvT, int8_t>;
  using KRow = std::conditional_t<kInt8, float, In>;  // what the score / P V loops read
  const DecodeProblem& d;
  const AttentionProblem& p;
  int64_t g, D, Dr, Dv, ldq, ldqr, ldacc;
  Rows<KvT> K, V;
  Rows<In> KR;

  explicit DecodeKernel(const DecodeProblem& dp)
      : d(dp), p(*dp.p), g(dp.p->group()), D(dp.p->head_dim), Dr(dp.rope_dim),
        Dv(dp.p->head_dim_v) {
    constexpr int64_t step = VecPair<In>::kStep;
    ldq = std::max<int64_t>(round_up(D, step), step);
    ldqr = std::max<int64_t>(round_up(Dr, step), step);
    ldacc = std::max<int64_t>(round_up(Dv, kPvWidth), kPvWidth);
    K = rows_of<KvT>(d.cache.k);
    V = rows_of<KvT>(d.cache.v);
    KR = rows_of<In>(d.cache.k_rope);
  }

  // Kv heads whose state one task holds: 1 (a task walks one kv head's rows) or all of them
  // (token-major: a task walks the tokens and, per chunk, every kv head). Token-major is taken
  // where the heads of a token are adjacent in memory (BSH / TND caches, paged caches of
  // [blocks, block_size, KVN * D]): one kv head's rows are KVN * D elements apart there, so a
  // head-major walk would touch every 4 KiB page once per kv head and leave the rest of each
  // page's lines to be fetched again from DRAM by the next head's task; token-major consumes a
  // chunk of whole tokens while it is cached.
  bool token_major() const {
    if (p.heads_kv < 2) return false;
    if (K.stride_n != D || V.stride_n != Dv) return false;
    return Dr == 0 || KR.stride_n == Dr;
  }

  void prepare(Scratch& w, int64_t nkv) const {
    w.q.assign(nkv * g * ldq, 0.0f);
    w.qr.assign(nkv * g * ldqr, 0.0f);
    w.s.resize(g * kChunk);
    w.acc.resize(nkv * g * ldacc);
    w.m.resize(nkv * g);
    w.l.resize(nkv * g);
    if constexpr (kInt8) {
      w.kd.resize(kChunk * ldq);
      w.vd.resize(kChunk * ldacc);
      w.qoff.assign(nkv * g, 0.0f);
      if (vnni_int8_) {
        w.q16.assign(nkv * g * ldq16, 0);
        w.qscale.assign(nkv * g, 0.0f);
        w.pcodes.assign(g * kChunk, 0);
        w.pscale.assign(g, 0.0f);
      }
    }
    if (native_bf16_) {
      w.qb.assign(nkv * g * ldq, at::BFloat16(0.0f));
      w.qrb.assign(nkv * g * ldqr, at::BFloat16(0.0f));
    }
  }

  // Loads the query rows of kv head kvh's group, times scale, as fp32 into state `slot`.
  void load_q(Scratch& w, int64_t b, int64_t kvh, int64_t slot) const {
    float* q = w.q.data() + slot * g * ldq;
    float* qr = w.qr.data() + slot * g * ldqr;
    for (int64_t h = 0; h < g; ++h) {
      const int64_t n = kvh * g + h;
      const In* src = q_base_ + b * p.q.stride_b + p.q_start[b] * p.q.stride_s + n * p.q.stride_n;
      for (int64_t j = 0; j < D; ++j) q[h * ldq + j] = static_cast<float>(src[j]) * scale_;
      if (fused_int8_) {  // q'_d = scale q_d s_d, and the offsets' share of every score
        const float* ks = d.cache.kq.scale + kvh * D;
        const float* ko = d.cache.kq.offset == nullptr ? nullptr : d.cache.kq.offset + kvh * D;
        float off = 0.0f;
        for (int64_t j = 0; j < D; ++j) {
          q[h * ldq + j] *= ks[j];
          if (ko != nullptr) off += q[h * ldq + j] * ko[j];
        }
        w.qoff[slot * g + h] = off;
        if (vnni_int8_) quantise_q(w, slot * g + h, q + h * ldq);
      }
      if constexpr (std::is_same_v<In, at::BFloat16>) {
        if (native_bf16_) std::copy(src, src + D, w.qb.data() + (slot * g + h) * ldq);
      }
      if (Dr > 0) {
        const In* r = qr_base_ + b * d.q_rope_view.stride_b + p.q_start[b] * d.q_rope_view.stride_s +
                      n * d.q_rope_view.stride_n;
        for (int64_t j = 0; j < Dr; ++j) qr[h * ldqr + j] = static_cast<float>(r[j]) * scale_;
        if constexpr (std::is_same_v<In, at::BFloat16>) {
          if (native_bf16_) std::copy(r, r + Dr, w.qrb.data() + (slot * g + h) * ldqr);
        }
      }
    }
  }

  // q' (D fp32 values) of group head i as int16 codes rint(q' * 32767 / max|q'|) and the value
  // of one code (NaN when q' is not finite, so that the scores and the output are NaN, as the
  // fp32 loops would give).
  void quantise_q(Scratch& w, int64_t i, const float* q) const {
    float amax = 0.0f;
    bool finite = true;
    for (int64_t j = 0; j < D; ++j) {
      finite = finite && std::isfinite(q[j]);
      amax = std::max(amax, std::abs(q[j]));
    }
    const float inv = finite && amax > 0.0f ? 32767.0f / amax : 0.0f;
    w.qscale[i] = finite ? amax / 32767.0f : std::numeric_limits<float>::quiet_NaN();
    int16_t* c = w.q16.data() + i * ldq16;
    for (int64_t j = 0; j < D; ++j) c[j] = static_cast<int16_t>(std::nearbyint(q[j] * inv));
  }

  // A fresh online-softmax state (sink or nothing) for kv head kvh in `slot`.
  void start(Scratch& w, int64_t kvh, int64_t slot, bool with_sink) const {
    for (int64_t h = 0; h < g; ++h) {
      const bool sink = with_sink && p.sink != nullptr;
      const float m = sink ? p.sink[kvh * g + h] : kNegInf;
      w.m[slot * g + h] = m;
      w.l[slot * g + h] = sink && m != kNegInf ? 1.0f : 0.0f;
    }
    std::fill(w.acc.begin() + slot * g * ldacc, w.acc.begin() + (slot + 1) * g * ldacc, 0.0f);
  }

  // Keys in the chunk starting at c (up to t1): at most `chunk`, never crossing a cache block.
  int64_t chunk_len(int64_t c, int64_t t1) const {
    const int64_t bs = d.cache.block_table != nullptr ? d.cache.block_size : kChunk;
    return std::min({chunk_, t1 - c, bs - c % bs});
  }

  // Asks for the keys of the first chunk of kv head kvh (later ones are asked for by step).
  void prefetch_first(int64_t b, int64_t kvh, int64_t t0, int64_t t1) const {
    if ((kInt8 && !whole_rows_) || t0 >= t1) return;
    const char* k = reinterpret_cast<const char*>(row_ptr(K, d, b, kvh, t0));
    const int64_t n = chunk_len(t0, t1);
    for (int64_t t = 0; t < n; ++t) {
      prefetch_bytes(k + t * K.stride_s * sizeof(KvT), 0, D * sizeof(KvT));
    }
    if (whole_rows_ || v_ahead_) {  // the steps ask only for the next chunk's values
      const char* v = reinterpret_cast<const char*>(row_ptr(V, d, b, kvh, t0));
      for (int64_t t = 0; t < n; ++t) {
        prefetch_bytes(v + t * V.stride_s * sizeof(KvT), 0, Dv * sizeof(KvT));
      }
    }
  }

  // One online-softmax step of kv head kvh (state `slot`) over keys [c0, c0 + len) of batch b.
  void step(Scratch& w, int64_t slot, int64_t b, int64_t kvh, int64_t c0, int64_t len,
            int64_t t1) const {
    float* const qs = w.q.data() + slot * g * ldq;
    float* const qrs = w.qr.data() + slot * g * ldqr;
    float* const accs = w.acc.data() + slot * g * ldacc;
    float* const ms = w.m.data() + slot * g;
    float* const ls = w.l.data() + slot * g;
    const uint8_t* mask = p.user_mask == nullptr ? nullptr : p.user_mask + b * p.mask_stride_b;
    constexpr int64_t e = sizeof(KvT);
    const int64_t k_bytes = D * e, v_bytes = Dv * e;
    const int64_t k_pitch = K.stride_s * e, v_pitch = V.stride_s * e;
    const KvT* k_raw = row_ptr(K, d, b, kvh, c0);
    const KvT* v_raw = row_ptr(V, d, b, kvh, c0);
    // Prefetches: an fp16/bf16/fp32 cache asks for this chunk's values while it scores and for
    // the next chunk's keys while it sums P V (for an fp32 cache, asking a whole chunk ahead for
    // both measured slower on the token-major walk; fp16/bf16 and int8-code token-major walks
    // over gapless rows ask for whole-token spans a chunk ahead, see whole_rows_); an int8
    // cache otherwise for the next chunk's keys, then values.
    const int64_t c1 = c0 + len;
    const int64_t next_len = c1 < t1 ? chunk_len(c1, t1) : 0;
    const char* next_k = next_len > 0 ? reinterpret_cast<const char*>(row_ptr(K, d, b, kvh, c1)) : nullptr;
    const char* next_v = next_len > 0 ? reinterpret_cast<const char*>(row_ptr(V, d, b, kvh, c1)) : nullptr;
    const char* pf_s = kInt8 ? next_k : reinterpret_cast<const char*>(v_raw);
    int64_t pf_s_len = kInt8 ? next_len : len;
    int64_t pf_s_pitch = kInt8 ? k_pitch : v_pitch, pf_s_bytes = kInt8 ? k_bytes : v_bytes;
    const char* pf_pv = kInt8 ? next_v : next_k;
    int64_t pf_pv_pitch = kInt8 ? v_pitch : k_pitch, pf_pv_bytes = kInt8 ? v_bytes : k_bytes;
    int64_t pf_pv_len = next_len;
    // (compiled for fp32 caches only: the 16-bit and int8 steps keep their code as it was)
    if constexpr (sizeof(KvT) == 4) {
      if (v_ahead_) {
        // Token-major fp32: while scoring kv head kvh, ask for the values of kv head kvh + 1 (of
        // the next chunk's head 0 after the last head), a whole step ahead: asked for in their own
        // step, the values of a chunk (32 KiB per head) were still arriving when P V read them.
        // The keys are asked for a chunk ahead, as above.
        if (kvh + 1 < p.heads_kv) {
          pf_s = reinterpret_cast<const char*>(row_ptr(V, d, b, kvh + 1, c0));
          pf_s_len = len;
        } else {
          pf_s = next_len > 0 ? reinterpret_cast<const char*>(row_ptr(V, d, b, 0, c1)) : nullptr;
          pf_s_len = next_len;
        }
      }
    }
    if (whole_rows_) {
      // Token-major over rows of whole tokens (no gaps): the step of kv head kvh asks for its
      // 1 / KVN share of the next chunk's V (while it scores) and K (while it sums P V) as
      // one contiguous span, in address order, a chunk ahead; cut into len pieces so that the
      // loops spread it a piece per key.
      pf_s = pf_pv = nullptr;
      if (next_len > 0) {
        const int64_t kvn = p.heads_kv;
        const auto share = [&](const Rows<KvT>& r, int64_t row_bytes, const char*& pf,
                               int64_t& pitch, int64_t& bytes, int64_t& n) {
          const int64_t span = next_len * row_bytes;
          const int64_t lo = kvh * span / kvn / 64 * 64;
          const int64_t hi = kvh + 1 == kvn ? span : (kvh + 1) * span / kvn / 64 * 64;
          pf = reinterpret_cast<const char*>(row_ptr(r, d, b, 0, c1)) + lo;
          // A share can be empty (a short chunk cut among many kv heads): no prefetch then.
          bytes = pitch = std::max<int64_t>(64, round_up((hi - lo + len - 1) / len, 64));
          n = (hi - lo + pitch - 1) / pitch;
        };
        share(V, V.stride_s * e, pf_s, pf_s_pitch, pf_s_bytes, pf_s_len);
        share(K, K.stride_s * e, pf_pv, pf_pv_pitch, pf_pv_bytes, pf_pv_len);
        // (a share's last piece may reach less than one piece past it, past the span for the
        // last kv head: a prefetch never faults)
      }
    }
    const KRow* k = nullptr;
    const KRow* v = nullptr;
    int64_t k_stride = 0, v_stride = 0;
    if constexpr (kInt8) {
      if (!fused_int8_) {  // per-token factors: the chunk's rows dequantised into scratch
        dequant_rows(d.cache.kq, d, b, kvh, c0, len, k_raw, K.stride_s, D, w.kd.data(), ldq);
        dequant_rows(d.cache.vq, d, b, kvh, c0, len, v_raw, V.stride_s, Dv, w.vd.data(), ldacc);
        k = w.kd.data();
        v = w.vd.data();
        k_stride = ldq;
        v_stride = ldacc;
      }
    } else {
      k = k_raw;
      v = v_raw;
      k_stride = K.stride_s;
      v_stride = V.stride_s;
    }
    const In* kr = Dr > 0 ? row_ptr(KR, d, b, kvh, c0) : nullptr;
    for_head_tiles(g, [&](auto nh, int64_t h0) {
      if constexpr (kInt8) {
#if defined(CPU_CAPABILITY_AVX512)
        if (vnni_int8_) {
          chunk_scores_int8_vnni<decltype(nh)::value>(
              w.q16.data() + (slot * g + h0) * ldq16, ldq16, w.qscale.data() + slot * g + h0,
              k_raw, K.stride_s, D, len, w.s.data() + h0 * kChunk, h0 == 0 ? pf_s : nullptr,
              pf_s_pitch, pf_s_bytes, pf_s_len);
          return;
        }
#endif
        if (fused_int8_) {  // scores from the codes: q' . k (the offsets' share added below)
          chunk_scores<decltype(nh)::value, int8_t, In>(
              qs + h0 * ldq, qrs + h0 * ldqr, ldq, ldqr, k_raw, K.stride_s, nullptr, 0, D, 0,
              len, w.s.data() + h0 * kChunk, h0 == 0 ? pf_s : nullptr, pf_s_pitch, pf_s_bytes,
              pf_s_len);
          return;
        }
      }
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (std::is_same_v<KRow, at::BFloat16>) {
        if (native_bf16_) {
          const at::BFloat16* qb = w.qb.data() + slot * g * ldq;
          const at::BFloat16* qrb = w.qrb.data() + slot * g * ldqr;
          chunk_scores_bf16<decltype(nh)::value>(
              qb + h0 * ldq, qrb + h0 * ldqr, ldq, ldqr, k, k_stride, kr, KR.stride_s, D, Dr, len,
              scale_, w.s.data() + h0 * kChunk, h0 == 0 ? pf_s : nullptr, pf_s_pitch, pf_s_bytes,
              pf_s_len);
          return;
        }
      }
#endif
      chunk_scores<decltype(nh)::value, KRow, In>(qs + h0 * ldq, qrs + h0 * ldqr, ldq, ldqr, k,
                                                  k_stride, kr, KR.stride_s, D, Dr, len,
                                                  w.s.data() + h0 * kChunk,
                                                  h0 == 0 ? pf_s : nullptr, pf_s_pitch,
                                                  pf_s_bytes, pf_s_len);
    });
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (kInt8) {
      // Every score finite (q' and its offsets' share are: the codes are integers) and no mask:
      // the softmax and P's codes in one pass per head, then P V from the codes.
      bool finite = vnni_int8_ && mask == nullptr;
      for (int64_t h = 0; finite && h < g; ++h) {
        finite = std::isfinite(w.qscale[slot * g + h]) && std::isfinite(w.qoff[slot * g + h]);
      }
      if (finite) {
        for (int64_t h = 0; h < g; ++h) {
          const float off = d.cache.kq.offset != nullptr ? w.qoff[slot * g + h] : 0.0f;
          softmax_codes(w.s.data() + h * kChunk, len, off, ms[h], ls[h], accs + h * ldacc,
                        ldacc, w.pcodes.data() + h * kChunk, w.pscale[h]);
        }
        for_head_tiles(g, [&](auto nh, int64_t h0) {
          chunk_pv_int8_codes<decltype(nh)::value>(
              w.pcodes.data() + h0 * kChunk, w.pscale.data() + h0, v_raw, V.stride_s, len, Dv,
              accs + h0 * ldacc, ldacc, h0 == 0 ? pf_pv : nullptr, pf_pv_pitch, pf_pv_bytes,
              pf_pv_len);
        });
        return;
      }
    }
#endif
    if (fused_int8_ && d.cache.kq.offset != nullptr) {
      for (int64_t h = 0; h < g; ++h) {
        float* sh = w.s.data() + h * kChunk;
        const float off = w.qoff[slot * g + h];
        for (int64_t t = 0; t < len; ++t) sh[t] += off;
      }
    }
    for (int64_t h = 0; h < g; ++h) {
      float* s = w.s.data() + h * kChunk;
      if (mask != nullptr) {
        // mask rows may differ per query head ([B, N, 1, S] masks)
        const uint8_t* mrow = mask + (kvh * g + h) * p.mask_stride_n + c0;
        for (int64_t t = 0; t < len; ++t) {
          if (mrow[t] != 0) s[t] = kNegInf;
        }
      }
      // the chunk's max, NaN-propagating (max_nan; at::vec::maximum propagates NaN too)
      Vec vmax(kNegInf);
      int64_t i = 0;
      for (; i + Vec::size() <= len; i += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(s + i));
      float cmax = at::vec::vec_reduce_all<float>(
          [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vmax);
      for (; i < len; ++i) cmax = max_nan(cmax, s[i]);
      const float m_new = max_nan(ms[h], cmax);
      if (m_new == kNegInf) {  // nothing visible yet: p = 0
        std::fill(s, s + len, 0.0f);
        continue;
      }
      const float alpha = ms[h] == kNegInf ? 0.0f : std::exp(ms[h] - m_new);
      Vec vsum(0.0f);
      const Vec vm(m_new);
      int64_t t = 0;
      for (; t + Vec::size() <= len; t += Vec::size()) {
        const Vec ex = exp_fast(Vec::loadu(s + t) - vm);
        ex.store(s + t);
        vsum = vsum + ex;
      }
      float sum = horizontal_sum(vsum);
      for (; t < len; ++t) {
        s[t] = std::exp(s[t] - m_new);
        sum += s[t];
      }
      if (alpha != 1.0f) {
        float* a = accs + h * ldacc;
        for (int64_t j = 0; j < ldacc; j += Vec::size()) (Vec::loadu(a + j) * Vec(alpha)).store(a + j);
      }
      ls[h] = ls[h] * alpha + sum;
      ms[h] = m_new;
    }
    for_head_tiles(g, [&](auto nh, int64_t h0) {
      if constexpr (kInt8) {
#if defined(CPU_CAPABILITY_AVX512)
        if (vnni_int8_) {
          chunk_pv_int8_vnni<decltype(nh)::value>(w.s.data() + h0 * kChunk, v_raw, V.stride_s,
                                                  len, Dv, accs + h0 * ldacc, ldacc,
                                                  h0 == 0 ? pf_pv : nullptr, pf_pv_pitch,
                                                  pf_pv_bytes, pf_pv_len);
          return;
        }
#endif
        if (fused_int8_) {  // acc += P codes; the factors are applied once, by finish_int8
          chunk_pv<decltype(nh)::value, int8_t>(w.s.data() + h0 * kChunk, v_raw, V.stride_s, len,
                                                Dv, accs + h0 * ldacc, ldacc,
                                                h0 == 0 ? pf_pv : nullptr, pf_pv_pitch,
                                                pf_pv_bytes, pf_pv_len);
          return;
        }
      }
      chunk_pv<decltype(nh)::value, KRow>(w.s.data() + h0 * kChunk, v, v_stride, len, Dv,
                                          accs + h0 * ldacc, ldacc, h0 == 0 ? pf_pv : nullptr,
                                          pf_pv_pitch, pf_pv_bytes, pf_pv_len);
    });
  }

  // Online softmax over keys [t0, t1) of batch b for kv heads kvh0 .. kvh0 + nkv (state slots
  // 0 .. nkv), from fresh states (the sink when with_sink); leaves m, l and the unnormalised acc
  // in w. nkv > 1 walks token-major: each chunk of keys for every head before the next chunk.
  void run(Scratch& w, int64_t b, int64_t kvh0, int64_t nkv, int64_t t0, int64_t t1,
           bool with_sink) const {
    for (int64_t s = 0; s < nkv; ++s) {
      load_q(w, b, kvh0 + s, s);
      start(w, kvh0 + s, s, with_sink);
      prefetch_first(b, kvh0 + s, t0, t1);
    }
    for (int64_t c0 = t0; c0 < t1;) {
      const int64_t len = chunk_len(c0, t1);
      for (int64_t s = 0; s < nkv; ++s) step(w, s, b, kvh0 + s, c0, len, t1);
      c0 += len;
    }
    if (fused_int8_) {
      for (int64_t s = 0; s < nkv; ++s) finish_int8(w, kvh0 + s, s);
    }
  }

  // Fused int8: acc = sum_t p_t v_t over the codes becomes sum_t p_t (v_t + o) s = s (acc + o l)
  // with the value factors of kv head kvh, l = sum_t p_t (linear in acc and l, as the merge of
  // context splits is).
  void finish_int8(Scratch& w, int64_t kvh, int64_t slot) const {
    const float* vs = d.cache.vq.scale + kvh * Dv;
    const float* vo = d.cache.vq.offset == nullptr ? nullptr : d.cache.vq.offset + kvh * Dv;
    for (int64_t h = 0; h < g; ++h) {
      float* a = w.acc.data() + (slot * g + h) * ldacc;
      const float l = w.l[slot * g + h];
      for (int64_t j = 0; j < Dv; ++j) a[j] = (a[j] + (vo != nullptr ? vo[j] * l : 0.0f)) * vs[j];
    }
  }

  // out row of head n = acc / l rounded once; lse = m + log(l) (-inf when nothing was seen).
  void finish(int64_t b, int64_t n, const float* acc, float m, float l) const {
    const int64_t at = b * p.out.stride_b + p.q_start[b] * p.out.stride_s + n * p.out.stride_n;
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    const auto store = [&]<typename O>(O* o) {
      using Pair = VecPair<O>;
      for (int64_t j = 0; j < Dv; j += Pair::kStep) {
        const int64_t cnt = std::min<int64_t>(Pair::kStep, Dv - j);
        const Vec a0 = Vec::loadu(acc + j) * Vec(inv);
        const Vec a1 = Vec::loadu(acc + j + Vec::size()) * Vec(inv);
        Pair::store(o + j, a0, a1, cnt);
      }
    };
    if (d.out_float) {
      store(static_cast<float*>(out_raw_) + at);
    } else {
      store(out_ + at);
    }
    if (d.lse != nullptr) {
      d.lse[p.stat_index(b, n, 0)] = l == 0.0f ? kNegInf : m + std::log(l);
    }
  }

  const In* q_base_ = nullptr;
  const In* qr_base_ = nullptr;
  In* out_ = nullptr;
  void* out_raw_ = nullptr;  // out_, or float32 rows when d.out_float
  float scale_ = 1.0f;
  bool native_bf16_ = false;  // bf16 K read by chunk_scores_bf16 (AVX512_BF16)
  // An int8 cache with per-channel factors: the score and P V loops read the codes (converted
  // in registers) instead of dequantised rows. score = sum_d q_d (k_d + o_d) s_d scale
  // = q' . k + q' . o with q' = scale q s (load_q); the P V sums take the codes and finish_int8
  // applies the value factors once. The same values as dequantising first, summed in another
  // order (one fp32 rounding of q' per element instead of one of each dequantised element).
  bool fused_int8_ = false;
  // fused_int8_ with 16-bit q on AVX512_VNNI: q' and P as int16 codes, see
  // chunk_scores_int8_vnni (ldq16: the q16 row stride)
  bool vnni_int8_ = false;
  int64_t ldq16 = 0;
  int64_t chunk_ = kChunk;  // keys per step, <= kChunk
  bool whole_rows_ = false;  // token-major over gapless token rows (see step)
  bool v_ahead_ = false;  // token-major, fp32: the values are asked for a kv head ahead (see step)
};

template <typename In, typename KvT = In>
void decode_impl(const DecodeProblem& d, void* out) {
  const AttentionProblem& p = *d.p;
  DecodeKernel<In, KvT> kern(d);
  kern.q_base_ = static_cast<const In*>(d.q);
  kern.qr_base_ = static_cast<const In*>(d.q_rope);
  kern.out_ = static_cast<In*>(out);
  kern.out_raw_ = out;
  kern.scale_ = static_cast<float>(p.scale);
  kern.native_bf16_ = std::is_same_v<In, at::BFloat16> && std::is_same_v<KvT, In> &&
                      has_avx512_bf16();
  kern.fused_int8_ = std::is_same_v<KvT, int8_t> && d.cache.kq.kind == KvQuant::Kind::kChannel &&
                     d.cache.vq.kind == KvQuant::Kind::kChannel && kern.Dr == 0;
#if defined(CPU_CAPABILITY_AVX512)
  kern.vnni_int8_ = kern.fused_int8_ && !std::is_same_v<In, float> && kern.D <= 512 &&
                    at::cpu::is_avx512_vnni_supported();
  kern.ldq16 = round_up(std::max<int64_t>(kern.D, 1), kVnniStep);
#endif
  const int64_t g = kern.g;
  const int64_t KVN = p.heads_kv;
  // A task unit: one (batch, kv head) pair, or (token-major) one batch with all its kv heads.
  const int64_t nkv = kern.token_major() ? KVN : 1;
  if (nkv > 1) {
    // fp16 / bf16 caches and int8 caches read as codes: a chunk ahead, the spans of an fp32
    // cache (256 KiB per chunk) measured no faster than the per-head prefetches, sometimes
    // slower; 16-bit caches gained 10-40% (B=8, ctx 4096-32768, paged and BSH, 2 threads on the
    // Zen 4), int8 codes 1-5%.
    kern.whole_rows_ = (sizeof(KvT) == 2 || kern.fused_int8_) && kern.K.stride_s == KVN * kern.D &&
                       kern.V.stride_s == KVN * kern.Dv;
    // fp32 caches: chunks of 64 keys and the values asked for one kv head ahead (see step;
    // measured against 32 keys with the values asked for in their own step in
    // docs/performance.md).
    kern.v_ahead_ = sizeof(KvT) == 4 && !kern.whole_rows_;
    // int8 codes: chunks of 64 keys too (a chunk's spans as many bytes as 32 keys of a 16-bit
    // cache, and the per-chunk work is halved): 1.04-1.14x over 32 (B=8 / 32, ctx 4096).
    kern.chunk_ = kern.v_ahead_ || kern.fused_int8_ ? kChunk : kChunkTokenMajor;
  }
  const int64_t units = p.batch * (KVN / nkv);

  // Visible key range per batch (empty when the sequence has no query row).
  std::vector<int64_t> lo(p.batch), hi(p.batch);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    lo[b] = d.visible[b].lo;
    hi[b] = p.q_len[b] == 0 ? lo[b] - 1 : d.visible[b].hi;
    max_keys = std::max(max_keys, hi[b] + 1 - lo[b]);
  }
  // Context splits: enough tasks for every thread (4 per thread), each split >= 512 keys.
  const int64_t threads = at::get_num_threads();
  int64_t splits = 1;
  if (units < 4 * threads && max_keys > 1024) {
    splits = std::min<int64_t>((4 * threads + units - 1) / units, (max_keys + 511) / 512);
  }
  if (splits == 1) {
    at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
      Scratch w;
      kern.prepare(w, nkv);
      for (int64_t u = begin; u < end; ++u) {
        const int64_t b = u * nkv / KVN, kvh0 = u * nkv % KVN;
        if (p.q_len[b] == 0) continue;
        kern.run(w, b, kvh0, nkv, lo[b], hi[b] + 1, /*with_sink=*/true);
        for (int64_t i = 0; i < nkv * g; ++i) {
          kern.finish(b, kvh0 * g + i, w.acc.data() + i * kern.ldacc, w.m[i], w.l[i]);
        }
      }
    });
    return;
  }
  // Partials: per (unit, split, head of the unit) m, l and acc[ldacc].
  const int64_t rec = kern.ldacc + 2;
  const int64_t heads_per_unit = nkv * g;
  std::vector<float> part(units * splits * heads_per_unit * rec);
  at::parallel_for(0, units * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    kern.prepare(w, nkv);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t u = t / splits, sp = t % splits;
      const int64_t b = u * nkv / KVN, kvh0 = u * nkv % KVN;
      float* dst = part.data() + t * heads_per_unit * rec;
      const int64_t n_keys = std::max<int64_t>(hi[b] + 1 - lo[b], 0);
      const int64_t per = round_up((n_keys + splits - 1) / splits, kChunk);
      const int64_t t0 = lo[b] + std::min(n_keys, sp * per);
      const int64_t t1 = lo[b] + std::min(n_keys, (sp + 1) * per);
      if (p.q_len[b] == 0 || t0 >= t1) {
        for (int64_t i = 0; i < heads_per_unit; ++i) {
          dst[i * rec] = kNegInf;
          dst[i * rec + 1] = 0.0f;
        }
        continue;
      }
      kern.run(w, b, kvh0, nkv, t0, t1, /*with_sink=*/sp == 0);
      for (int64_t i = 0; i < heads_per_unit; ++i) {
        dst[i * rec] = w.m[i];
        dst[i * rec + 1] = w.l[i];
        std::copy(w.acc.data() + i * kern.ldacc, w.acc.data() + (i + 1) * kern.ldacc,
                  dst + i * rec + 2);
      }
    }
  });
  // Merge: head n = kvh * g + h of batch b is head i = n - kvh0 * g of unit b * KVN / nkv + ...
  at::parallel_for(0, p.batch * KVN * g, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kern.ldacc);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (KVN * g), n = t % (KVN * g);
      if (p.q_len[b] == 0) continue;
      const int64_t u = (b * KVN + n / g) / nkv, i = (b * KVN * g + n) % heads_per_unit;
      const float* src = part.data() + u * splits * heads_per_unit * rec + i * rec;
      const int64_t sp_stride = heads_per_unit * rec;
      float m = kNegInf;
      for (int64_t sp = 0; sp < splits; ++sp) m = max_nan(m, src[sp * sp_stride]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float l = 0.0f;
      if (m != kNegInf) {
        for (int64_t sp = 0; sp < splits; ++sp) {
          const float* r = src + sp * sp_stride;
          if (r[0] == kNegInf) continue;
          const float f = std::exp(r[0] - m);
          l += r[1] * f;
          for (int64_t j = 0; j < kern.ldacc; ++j) acc[j] += r[2 + j] * f;
        }
      }
      kern.finish(b, n, acc.data(), m, l);
    }
  });
}

void infer_decode_kernel(const DecodeProblem& d, at::ScalarType dtype, void* out) {
  if (d.cache.int8) {
    switch (dtype) {
      case at::kBFloat16: return decode_impl<at::BFloat16, int8_t>(d, out);
      case at::kHalf: return decode_impl<at::Half, int8_t>(d, out);
      default: return decode_impl<float, int8_t>(d, out);
    }
  }
  switch (dtype) {
    case at::kBFloat16: return decode_impl<at::BFloat16>(d, out);
    case at::kHalf: return decode_impl<at::Half>(d, out);
    default: return decode_impl<float>(d, out);
  }
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(infer_decode, infer_decode_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::attention
