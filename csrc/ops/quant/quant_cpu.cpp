// CPU kernels of the quantisation family (compiled once per ISA; see common/cpu_dispatch.h).
//
// Per row, in fp32: pass 1 finds rowmax(|v|) (v = x, or x * smooth), pass 2 recomputes v and
// writes its codes; the row is still in L1/L2, so memory sees one read of x and one write of y.
// Codes are clamp(round(v / scale), lo, hi) with round half to even, the rounding of torch.round
// that torch_npu's goldens use (vroundps / vrndscaleps with _MM_FROUND_TO_NEAREST_INT), of the
// correctly rounded float32 quotient v / scale, so ties land exactly where the golden's
// `v / scale` puts them (quantize_row multiplies by 1 / scale and divides only near ties).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/stream_store.h"
#include "common/vec.h"
#include "ops/norm/norm_rows.h"
#include "common/fp_barrier.h"
#include "ops/quant/hifloat8.h"
#include "ops/quant/quant.h"
#include "ops/quant/simd16.h"

namespace opennpu::quant {
inline namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
using FloatIO = VecPair<float>;

// fp16, bf16 and fp32 (the entry points convert fp64 to fp32).
#define OPENNPU_QUANT_DISPATCH(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, v);
}

// (a, b) = x[i, i + len) (times smooth[i, i + len) when given), in fp32.
template <typename src_t>
inline void load_smoothed(const src_t* x, const float* smooth, int64_t i, int64_t len, Vec& a,
                          Vec& b) {
  VecPair<src_t>::load(x + i, a, b, len);
  if (smooth != nullptr) {
    Vec sa, sb;
    FloatIO::load(smooth + i, sa, sb, len);
    a = a * sa;
    b = b * sb;
  }
}

// Running max of |v| kept as the bit patterns of |v| (sign cleared), compared as integers: for
// non-negative floats the integer order is the float order, and every NaN's pattern is above
// +inf's, so a NaN anywhere makes the max a NaN (at::vec::maximum's propagation) in one integer
// max instead of ATen's four-instruction NaN-propagating maximum.
OPENNPU_VEC_INLINE Vec absmax_bits(const Vec& acc, const Vec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castsi512_ps(_mm512_max_epu32(
      _mm512_castps_si512(acc),
      _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff))));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_castsi256_ps(_mm256_max_epu32(
      _mm256_castps_si256(acc),
      _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff))));
#else
  return at::vec::maximum(acc, v.abs());
#endif
}

// The float whose bits are the largest lane of absmax_bits' accumulator.
inline float reduce_absmax_bits(const Vec& acc) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  uint32_t lanes[Vec::size()];
  std::memcpy(lanes, &acc, sizeof(lanes));
  const uint32_t m = *std::max_element(lanes, lanes + Vec::size());
  float f;
  std::memcpy(&f, &m, sizeof(f));
  return f;
#else
  return reduce_max(acc);
#endif
}

// rowmax(|x * smooth|) (smooth may be null) over n elements.
template <typename src_t>
float row_absmax(const src_t* x, const float* smooth, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<src_t, at::BFloat16>) {
    if (smooth == nullptr) {  // |x| of bf16 is exact: the max of the 16-bit patterns, 32 a vector
      const __m512i sign_off = _mm512_set1_epi16(0x7fff);
      __m512i m = _mm512_setzero_si512();
      int64_t i = 0;
      for (; i + 32 <= n; i += 32) {
        m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512(x + i), sign_off));
      }
      if (i < n) {
        const __mmask32 tail = _cvtu32_mask32((1u << (n - i)) - 1);
        m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_maskz_loadu_epi16(tail, x + i), sign_off));
      }
      const __m512i wide = _mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(m)),
                                            _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(m, 1)));
      const uint32_t bits = static_cast<uint32_t>(_mm512_reduce_max_epu32(wide)) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      return f;
    }
  }
  // The generic loop's values from plain intrinsics (ATen's bf16 load spends three instructions
  // where load16 spends two): the same products, the same integer max of their |v| patterns.
  const __m512i sign_off = _mm512_set1_epi32(0x7fffffff);
  auto run = [&](auto smoothed) __attribute__((always_inline)) {
    constexpr bool kSmooth = decltype(smoothed)::value;
    __m512i m0 = _mm512_setzero_si512(), m1 = _mm512_setzero_si512();
    auto absbits = [&](__m512 v) { return _mm512_and_si512(_mm512_castps_si512(v), sign_off); };
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      __m512 a = load16(x + i), b = load16(x + i + 16);
      if constexpr (kSmooth) {
        a = _mm512_mul_ps(a, _mm512_loadu_ps(smooth + i));
        b = _mm512_mul_ps(b, _mm512_loadu_ps(smooth + i + 16));
      }
      m0 = _mm512_max_epu32(m0, absbits(a));
      m1 = _mm512_max_epu32(m1, absbits(b));
    }
    for (; i < n; i += 16) {  // lanes past n load as 0
      const __mmask16 mask = _cvtu32_mask16((1u << std::min<int64_t>(16, n - i)) - 1);
      __m512 a = load16(x + i, mask);
      if constexpr (kSmooth) a = _mm512_mul_ps(a, _mm512_maskz_loadu_ps(mask, smooth + i));
      m0 = _mm512_max_epu32(m0, absbits(a));
    }
    const uint32_t top = static_cast<uint32_t>(_mm512_reduce_max_epu32(_mm512_max_epu32(m0, m1)));
    return std::bit_cast<float>(top);
  };
  return smooth != nullptr ? run(std::true_type{}) : run(std::false_type{});
#else
  Vec m0(0), m1(0);
  for_each_step<src_t>(n, [&](int64_t i, int64_t len) {
    Vec a, b;
    load_smoothed(x, smooth, i, len, a, b);
    m0 = absmax_bits(m0, a);  // lanes past len are 0: the max is unaffected
    m1 = absmax_bits(m1, b);
  });
  return reduce_absmax_bits(absmax_bits(m0, m1));
#endif
}

// scale = rowmax / DTYPE_MAX; an all-zero row gets scale 1 (its codes are 0 either way), as the
// torch_npu golden does, so scale is never 0 and dequantisation never divides by it.
float scale_of(float absmax, const QuantSpec& spec) {
  const float s = spec.fp8 != 0 ? absmax * (1.f / spec.qmax) : absmax / spec.qmax;
  return s == 0.f ? 1.f : s;
}

// Stores the first len <= Vec::size() lanes of q (integral floats within [-128, 127]) as int8.
// With `stream` (AVX-512 only; out 16-byte aligned), full vectors use a non-temporal store.
inline void store_codes(int8_t* out, const Vec& q, int64_t len, bool stream = false) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(q));
  if (len == Vec::size()) {
    if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out), bytes);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bytes);
    }
    return;
  }
  alignas(16) int8_t tmp[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), bytes);
  std::memcpy(out, tmp, len);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i ints = _mm256_cvttps_epi32(q);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints),
                                        _mm256_extracti128_si256(ints, 1));
  const __m128i bytes = _mm_packs_epi16(words, words);
  if (len == Vec::size()) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes);
    return;
  }
  alignas(16) int8_t tmp[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), bytes);
  std::memcpy(out, tmp, len);
#else
  float tmp[Vec::size()];
  q.store(tmp);
  for (int64_t i = 0; i < len; ++i) out[i] = static_cast<int8_t>(tmp[i]);
#endif
#if !defined(CPU_CAPABILITY_AVX512)
  (void)stream;
#endif
}

// Packs the first len (a multiple of 8) lanes of q (integral floats within [-8, 7]) as int4,
// eight per int32, lane k of each eight in bits [4k, 4k + 4): lowest bits first, as torch_npu's
// quint4x2 outputs. Each lane's nibble is shifted into place and the eight are OR-ed together.
#if defined(CPU_CAPABILITY_AVX512)
// The int4 bytes of 16 int32 lanes (integers within [-8, 7]), in the low 8 bytes. Each 64-bit
// lane holds the codes of two consecutive elements (the first in its low half): their low
// nibbles, the second moved up to bits [4, 8), make the lane's low byte, which vpmovqb gathers:
// byte j is element 2j | element 2j + 1 << 4, the little-endian bytes of store_int4's words.
OPENNPU_VEC_INLINE __m128i int4_bytes(__m512i codes) {
  const __m512i t = _mm512_and_si512(codes, _mm512_set1_epi64(0x0000000F0000000FLL));
  return _mm512_cvtepi64_epi8(_mm512_or_si512(t, _mm512_srli_epi64(t, 28)));
}

// The 16 int4 bytes of 32 codes (qa elements 0-15, qb 16-31; int32 lanes, clamped here to
// [lo, hi] within [-8, 7]), as store_int4 lays them out: vpackssdw narrows both to int16 (its
// saturation leaves every clamp result as it was), interleaving them four at a time per 128-bit
// lane; each 32-bit lane then holds two consecutive codes, whose nibbles make its low byte
// (vpmovdb), and one byte shuffle restores the element order.
OPENNPU_VEC_INLINE __m128i int4_bytes32(__m512i qa, __m512i qb, __m512i lo16, __m512i hi16) {
  __m512i w = _mm512_packs_epi32(qa, qb);
  w = _mm512_min_epi16(_mm512_max_epi16(w, lo16), hi16);
  const __m512i t = _mm512_and_si512(w, _mm512_set1_epi32(0x000F000F));
  const __m128i b = _mm512_cvtepi32_epi8(_mm512_or_si512(t, _mm512_srli_epi32(t, 12)));
  // byte 4k + h: the pair h of qa's lane k (h < 2) or of qb's (h >= 2, pair h - 2)
  return _mm_shuffle_epi8(b, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
}

// The 32 int4 bytes of 64 codes (q[0] elements 0-15, ..., q[3] 48-63; int32 lanes, clamped
// here to [lo, hi] within [-8, 7]): two vpackssdw and one vpacksswb narrow them to bytes (the
// saturations keep every clamp result), 128-bit lane L then holding elements 4L + {0..3} of
// each group of 16 in turn; vpmaddubsw makes each adjacent pair one nibble byte (lo | hi << 4,
// as a word), and one vpermw puts pair k at word k before vpmovwb narrows the words to bytes.
OPENNPU_VEC_INLINE __m256i int4_bytes64(const __m512i* q, __m512i lo8, __m512i hi8) {
  __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3]));
  b = _mm512_and_si512(_mm512_min_epi8(_mm512_max_epi8(b, lo8), hi8), _mm512_set1_epi8(0x0F));
  const __m512i pairs = _mm512_maddubs_epi16(b, _mm512_set1_epi16(0x1001));
  // byte 16L + 4G + r is element 16G + 4L + r, so word 8L + 2G + j is pair 8G + 2L + j
  alignas(64) static constexpr int16_t kOrder[32] = {
      0, 1, 8, 9, 16, 17, 24, 25, 2, 3, 10, 11, 18, 19, 26, 27,
      4, 5, 12, 13, 20, 21, 28, 29, 6, 7, 14, 15, 22, 23, 30, 31};
  const __m512i ordered = _mm512_permutexvar_epi16(_mm512_load_si512(kOrder), pairs);
  return _mm512_cvtepi16_epi8(ordered);
}

// store_int4 of int32 lanes (integers within [-8, 7]; len 8 or 16).
OPENNPU_VEC_INLINE void store_int4_ints(int32_t* out, __m512i codes, int64_t len) {
  const __m128i bytes = int4_bytes(codes);
  if (len > 8) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), bytes);
  } else {
    out[0] = _mm_cvtsi128_si32(bytes);
  }
}
#endif

inline void store_int4(int32_t* out, const Vec& q, int64_t len) {
#if defined(CPU_CAPABILITY_AVX512)
  store_int4_ints(out, _mm512_cvttps_epi32(q), len);
#elif defined(CPU_CAPABILITY_AVX2)
  (void)len;  // always 8: one word
  const __m256i shifts = _mm256_set_epi32(28, 24, 20, 16, 12, 8, 4, 0);
  __m256i v = _mm256_sllv_epi32(
      _mm256_and_si256(_mm256_cvttps_epi32(q), _mm256_set1_epi32(0xF)), shifts);
  v = _mm256_or_si256(v, _mm256_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  v = _mm256_or_si256(v, _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm256_or_si256(v, _mm256_permute2x128_si256(v, v, 1));
  out[0] = _mm256_cvtsi256_si32(v);
#else
  float tmp[Vec::size()];
  q.store(tmp);
  for (int64_t j = 0; j < len; j += 8) {
    uint32_t word = 0;
    for (int k = 0; k < 8; ++k) {
      word |= (static_cast<uint32_t>(static_cast<int32_t>(tmp[j + k])) & 0xFu) << (4 * k);
    }
    out[j / 8] = static_cast<int32_t>(word);
  }
#endif
}

// Prefetches into L2 the lines of elements [i, i + VecPair::kStep) of one or two rows of 4- or
// 2-byte elements (L2 as for the norms' rows, common/stream_store.h: a whole next row, up to
// 32 KiB in fp32, prefetched into L1 evicts the lines being read; measured against L1 prefetches
// in docs/performance.md). Untyped, since add_rms_norm_dynamic_quant quantises fp32 rows whose
// next rows are in x1's dtype. The loop is spelled out on purpose: written as a lambda calling
// prefetch_step<2> per row, GCC 12 emitted no prefetch instruction at all (none in this file's
// objects), and every row's first pass waited for memory.
inline void prefetch_rows_step(const void* row, const void* row2, int64_t elem_size, int64_t i) {
  constexpr int kL2 = 2;  // __builtin_prefetch's locality: prefetcht1
  const int64_t bytes = VecPair<float>::kStep * elem_size;
  for (int64_t off = 0; off < bytes; off += kLineBytes) {
    __builtin_prefetch(static_cast<const char*>(row) + i * elem_size + off, 0, kL2);
    if (row2 != nullptr) {
      __builtin_prefetch(static_cast<const char*>(row2) + i * elem_size + off, 0, kL2);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int kRint = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// int32 codes round_half_even(v / scale) of 16 lanes (0 for NaN), as quantize_row's `code`
// computes them before its clamp, for a finite inverse = 1 / scale and |v / scale| < 2^31:
// - the near-tie test takes t - rint(t) from one vreduceps: a lane is near a tie when
//   |t - rint(t)| > 1/2 - 2^-15, the same lanes as |t - floor(t) - 1/2| < 2^-15;
// - one vcvtps2dq rounds half to even and converts (t.round(), then a truncating cast before);
// - NaN lanes are masked off in that conversion instead of blended afterwards.
OPENNPU_VEC_INLINE __m512i codes16(__m512 v, __m512 vinverse, __m512 vscale, __m512 near_tie) {
  __m512 t = _mm512_mul_ps(v, vinverse);
  const __m512 frac = _mm512_reduce_ps(t, kRint);  // t - rint(t), in [-1/2, 1/2]
  const __mmask16 near = _mm512_cmp_ps_mask(_mm512_abs_ps(frac), near_tie, _CMP_GT_OQ);
  if (__builtin_expect(near != 0, 0)) t = _mm512_mask_div_ps(t, near, v, vscale);  // the golden's
  return _mm512_maskz_cvt_roundps_epi32(_mm512_cmp_ps_mask(t, t, _CMP_ORD_Q), t, kRint);
}

// quantize_row's integer codes on AVX-512 (same arguments; quantize_row checks the conditions:
// a finite 1 / scale, |qmax| <= 2^24 so every |t| is far below 2^31, int8's range exactly
// [-128, 127]). The clamp: int8's is the saturation of vpmovsdb itself, int4's an integer
// max / min (the generic path's ATen float maximum / minimum propagate NaN: four instructions
// each). The generic path measured ~2 cycles an element on a Zen 4.
template <typename src_t, bool kSmooth, bool kInt4>
void quantize_row_avx512(const src_t* x, const float* smooth, int64_t n, float scale,
                         const QuantSpec& spec, void* out, const void* next, const void* next2,
                         int64_t next_elem_size, bool stream) {
  const __m512 vscale = _mm512_set1_ps(scale), vinverse = _mm512_set1_ps(1.f / scale);
  const __m512 near_tie = _mm512_set1_ps(0.5f - 1.f / 32768);
  const __m512i lo = _mm512_set1_epi32(static_cast<int32_t>(spec.lo));
  const __m512i hi = _mm512_set1_epi32(static_cast<int32_t>(spec.hi));
  const __m512i lo16 = _mm512_set1_epi16(static_cast<int16_t>(spec.lo));
  const __m512i hi16 = _mm512_set1_epi16(static_cast<int16_t>(spec.hi));
  int8_t* out8 = static_cast<int8_t*>(out);
  int32_t* words = static_cast<int32_t*>(out);
  auto code = [&](int64_t i, __m512 v) __attribute__((always_inline)) {
    if constexpr (kSmooth) v = _mm512_mul_ps(v, _mm512_loadu_ps(smooth + i));
    return codes16(v, vinverse, vscale, near_tie);  // int4: clamped by int4_bytes32
  };
  int64_t i = 0;
  if constexpr (kInt4) {
    const __m512i lo8 = _mm512_set1_epi8(static_cast<int8_t>(spec.lo));
    const __m512i hi8 = _mm512_set1_epi8(static_cast<int8_t>(spec.hi));
    for (; i + 64 <= n; i += 64) {  // 64 codes: eight words, one store
      if (next != nullptr) {
        prefetch_rows_step(next, next2, next_elem_size, i);
        prefetch_rows_step(next, next2, next_elem_size, i + 32);
      }
      __m512i q[4];
      for (int u = 0; u < 4; ++u) q[u] = code(i + 16 * u, load16(x + i + 16 * u));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(words + i / 8), int4_bytes64(q, lo8, hi8));
    }
  }
  for (; i + 32 <= n; i += 32) {
    if (next != nullptr) prefetch_rows_step(next, next2, next_elem_size, i);
    const __m512i qa = code(i, load16(x + i));
    const __m512i qb = code(i + 16, load16(x + i + 16));
    if constexpr (kInt4) {
      // 32 codes (clamped there): four words, one store
      _mm_storeu_si128(reinterpret_cast<__m128i*>(words + i / 8),
                       int4_bytes32(qa, qb, lo16, hi16));
    } else if (stream) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(out8 + i), _mm512_cvtsepi32_epi8(qa));
      _mm_stream_si128(reinterpret_cast<__m128i*>(out8 + i + 16), _mm512_cvtsepi32_epi8(qb));
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out8 + i), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out8 + i + 16), _mm512_cvtsepi32_epi8(qb));
    }
  }
  for (; i < n; i += 16) {  // the tail: lanes past n load as 0 and are not stored
    const int64_t len = std::min<int64_t>(16, n - i);
    const __mmask16 mask = _cvtu32_mask16((1u << len) - 1);
    __m512 v = load16(x + i, mask);
    if constexpr (kSmooth) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, smooth + i));
    const __m512i q = codes16(v, vinverse, vscale, near_tie);
    if constexpr (kInt4) {  // len is a multiple of 8 (n is)
      store_int4_ints(words + i / 8, _mm512_min_epi32(_mm512_max_epi32(q, lo), hi), len);
    } else {
      _mm_mask_storeu_epi8(out8 + i, mask, _mm512_cvtsepi32_epi8(q));
    }
  }
}
#endif

// Codes clamp(round_half_even(v_i / scale), lo, hi), v = x (* smooth), into `out`: int8 codes,
// or int32 words of eight int4 codes (spec.int4).
//
// The division is the golden's, bit for bit, without paying a vector divide per element:
// t = v * (1 / scale) is within 2 ulps of v / scale, and |t| <= ~127 here, so 2 ulps are at most
// 2^-16. Unless t lies within 2^-15 of a half-integer, v / scale rounds to the same integer as t;
// the vectors with such a lane (about one in a thousand, and every exact tie) are divided for real.
//
// `next` (optional, up to two rows) are the rows the caller reads next: their cache lines are
// prefetched one step at a time, so the next row's first pass finds them in cache and memory
// streams while this row computes (without it, every row waits for memory, then computes).
// `stream`: int8 codes go out with non-temporal stores (out 16-byte aligned, n % 16 == 0).
template <typename src_t>
void quantize_row(const src_t* x, const float* smooth, int64_t n, float scale,
                  const QuantSpec& spec, void* out, const void* next = nullptr,
                  const void* next2 = nullptr, int64_t next_elem_size = 0, bool stream = false) {
  const Vec vscale(scale), lo(spec.lo), hi(spec.hi);
  const float inverse = 1.f / scale;
  const bool by_inverse = std::isfinite(inverse);  // a subnormal scale has no finite inverse
#if defined(CPU_CAPABILITY_AVX512)
  // int8 codes must span exactly vpmovsdb's saturation range.
  if (spec.fp8 == 0 && by_inverse && std::abs(spec.qmax) <= 16777216.f &&
      (spec.int4 || (spec.lo == -128.f && spec.hi == 127.f))) {
    auto run = [&](auto smoothed, auto int4) {
      quantize_row_avx512<src_t, decltype(smoothed)::value, decltype(int4)::value>(
          x, smooth, n, scale, spec, out, next, next2, next_elem_size, stream);
    };
    if (smooth != nullptr) {
      return spec.int4 ? run(std::true_type{}, std::true_type{})
                       : run(std::true_type{}, std::false_type{});
    }
    return spec.int4 ? run(std::false_type{}, std::true_type{})
                     : run(std::false_type{}, std::false_type{});
  }
#endif
  const Vec vinverse(inverse), half(0.5f), near_tie(1.f / 32768);
  constexpr int kNoLane = (1 << Vec::size()) - 1;  // zero_mask() when no lane is set
  auto code = [&](const Vec& v) {
    Vec t;
    if (by_inverse) {
      t = v * vinverse;
      const Vec near = (t - t.floor() - half).abs() < near_tie;
      if (near.zero_mask() != kNoLane) t = Vec::blendv(t, v / vscale, near);
    } else {
      t = v / vscale;
    }
    // NaN (a NaN in the row, or inf / inf when the row's max is inf) gives code 0: the cast
    // would turn it into INT_MIN, then -128, as if the value were very negative.
    const Vec clamped = at::vec::minimum(at::vec::maximum(t.round(), lo), hi);
    return Vec::blendv(clamped, Vec(0), clamped.isnan());
  };
  for_each_step<src_t>(n, [&](int64_t i, int64_t len) {
    if (next != nullptr) prefetch_rows_step(next, next2, next_elem_size, i);
    Vec a, b;
    load_smoothed(x, smooth, i, len, a, b);
    const int64_t len_a = std::min<int64_t>(len, Vec::size());
    if (spec.fp8 != 0) {  // float8 / hifloat8: the true quotient, converted
      float t[2 * Vec::size()];
      (a / vscale).store(t);
      (b / vscale).store(t + Vec::size());
      uint8_t* codes = static_cast<uint8_t*>(out) + i;
      if (spec.fp8 == kFp8Hif8) {  // ties away from zero (hifloat8.h)
        for (int64_t k = 0; k < len; ++k) codes[k] = float_to_hifloat8_table(t[k]);
      } else {  // rounded to nearest even by c10
        for (int64_t k = 0; k < len; ++k) {
          codes[k] = spec.fp8 == kFp8E4m3 ? c10::Float8_e4m3fn(t[k]).x : c10::Float8_e5m2(t[k]).x;
        }
      }
      return;
    }
    if (spec.int4) {  // i and len are multiples of 8 (n is)
      int32_t* words = static_cast<int32_t*>(out) + i / 8;
      store_int4(words, code(a), len_a);
      if (len > Vec::size()) store_int4(words + Vec::size() / 8, code(b), len - Vec::size());
    } else {
      int8_t* codes = static_cast<int8_t*>(out) + i;
      store_codes(codes, code(a), len_a, stream);
      if (len > Vec::size()) store_codes(codes + Vec::size(), code(b), len - Vec::size(), stream);
    }
  });
}

// Row r's codes in the output: int8 [rows, n], or int32 [rows, n / 8] for int4.
struct CodeSink {
  const QuantSpec& spec;
  at::Tensor& y;
  int64_t n;

  void* row(int64_t r) const {
    if (spec.int4) return y.mutable_data_ptr<int32_t>() + r * (n / 8);
    if (spec.fp8 != 0) return static_cast<uint8_t*>(y.mutable_data_ptr()) + r * n;
    return y.mutable_data_ptr<int8_t>() + r * n;
  }
};

void dynamic_quant_kernel(const at::Tensor& x, const at::Tensor& smooth,
                          const at::Tensor& group_ends, bool per_tensor, const QuantSpec& spec,
                          at::Tensor& y, at::Tensor& scale) {
  const int64_t rows = x.size(0);
  const int64_t n = x.size(1);
  const float* ps = smooth.defined() ? smooth.const_data_ptr<float>() : nullptr;
  const int64_t* pg = group_ends.defined() ? group_ends.const_data_ptr<int64_t>() : nullptr;
  const int64_t groups = group_ends.defined() ? group_ends.numel() : 0;
  float* pscale = scale.mutable_data_ptr<float>();
  const CodeSink sink{spec, y, n};
  // Row r's smooth vector: the one of its group (group g ends before group_ends[g]).
  auto smooth_row = [&](int64_t r) -> const float* {
    if (pg == nullptr) return ps;
    return ps + (std::upper_bound(pg, pg + groups, r) - pg) * n;
  };
  OPENNPU_QUANT_DISPATCH(x.scalar_type(), "npu_dynamic_quant", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const int64_t grain = grain_rows(n);
    // The codes use ordinary stores: streaming them (outputs beyond the LLC, AVX-512) measured
    // no gain on the Zen 4 of issue 23 at T = H = 8192, within that run's noise.
    if (per_tensor) {
      const float absmax = at::parallel_reduce(
          0, rows, grain, 0.f,
          [&](int64_t begin, int64_t end, float m) {
            for (int64_t r = begin; r < end; ++r) {
              m = std::max(m, row_absmax<scalar_t>(px + r * n, smooth_row(r), n));
            }
            return m;
          },
          [](float a, float b) { return std::max(a, b); });
      const float s = scale_of(absmax, spec);
      pscale[0] = s;
      at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          quantize_row<scalar_t>(px + r * n, smooth_row(r), n, s, spec, sink.row(r),
                                 r + 1 < end ? px + (r + 1) * n : nullptr, nullptr,
                                 sizeof(scalar_t));
        }
      });
      return;
    }
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float* sm = smooth_row(r);
        const float s = scale_of(row_absmax<scalar_t>(px + r * n, sm, n), spec);
        pscale[r] = s;
        quantize_row<scalar_t>(px + r * n, sm, n, s, spec, sink.row(r),
                               r + 1 < end ? px + (r + 1) * n : nullptr, nullptr,
                               sizeof(scalar_t));
      }
    });
  });
}

void add_rms_norm_dynamic_quant_kernel(const at::Tensor& x1, const at::Tensor& x2,
                                       const at::Tensor& gamma, const at::Tensor& beta,
                                       const at::Tensor& smooth1, const at::Tensor& smooth2,
                                       double eps, bool branch1, bool branch2,
                                       const QuantSpec& spec, at::Tensor& y1, at::Tensor& y2,
                                       at::Tensor& x_out, at::Tensor& scale1,
                                       at::Tensor& scale2) {
  const int64_t n = gamma.numel();
  const int64_t rows = x1.numel() / n;
  const float* pg = gamma.const_data_ptr<float>();
  const float* pb = beta.defined() ? beta.const_data_ptr<float>() : nullptr;
  const float* ps1 = smooth1.defined() ? smooth1.const_data_ptr<float>() : nullptr;
  const float* ps2 = smooth2.defined() ? smooth2.const_data_ptr<float>() : nullptr;
  float* psc1 = branch1 ? scale1.mutable_data_ptr<float>() : nullptr;
  float* psc2 = branch2 ? scale2.mutable_data_ptr<float>() : nullptr;
  const CodeSink sink1{spec, y1, n}, sink2{spec, y2, n};
  OPENNPU_QUANT_DISPATCH(x1.scalar_type(), "npu_add_rms_norm_dynamic_quant", [&] {
    using IO = VecPair<scalar_t>;
    const scalar_t* pa = x1.const_data_ptr<scalar_t>();
    const scalar_t* pbx = x2.const_data_ptr<scalar_t>();
    scalar_t* px = x_out.mutable_data_ptr<scalar_t>();
    // x_out is 2/3 (fp32) or 1/2 (bf16) of the bytes written: large ones go out with
    // non-temporal stores, which skip reading each destination line first (rows of whole
    // cache lines, so every line is written by streaming stores alone).
    const int64_t row_bytes = n * static_cast<int64_t>(sizeof(scalar_t));
    const bool stream = row_bytes % kLineBytes == 0 && stream_aligned(px) &&
                        stream_output(px, rows * row_bytes);
    // The int8 codes likewise, when x_out streams and their rows are whole cache lines too.
    const auto codes_aligned = [&](const at::Tensor& y) {
      return y.defined() && y.dim() > 0 && stream_aligned(static_cast<const int8_t*>(y.const_data_ptr()));
    };
    const bool stream1 = stream && !spec.int4 && n % 64 == 0 && branch1 && codes_aligned(y1);
    const bool stream2 = stream && !spec.int4 && n % 64 == 0 && branch2 && codes_aligned(y2);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      // Per thread: the fp32 row (x, then branch 1's input in place) and branch 2's input.
      std::vector<float> rowbuf(2 * n);
      float* in1 = rowbuf.data();
      float* in2 = in1 + n;
      for (int64_t r = begin; r < end; ++r) {
        // x = x1 + x2 in fp32 (the golden's sum); x_out is that sum rounded to x1's dtype. The
        // same pass sums x^2 (of the fp32 sum, which the golden normalises), so the row is
        // read from memory once and the fp32 copy in L1 twice more (normalise, quantise).
        Vec q0(0), q1(0);
        for_each_step<scalar_t>(n, [&](int64_t i, int64_t len) {
          Vec a0, a1, b0, b1;
          IO::load(pa + r * n + i, a0, a1, len);
          IO::load(pbx + r * n + i, b0, b1, len);
          a0 = a0 + b0;  // lanes past len: 0 + 0 = 0, so the sums below are unaffected
          a1 = a1 + b1;
          if (stream && len == IO::kStep) {
            stream_step(px + r * n + i, a0, a1);
          } else {
            IO::store(px + r * n + i, a0, a1, len);
          }
          FloatIO::store(in1 + i, a0, a1, len);
          q0 = at::vec::fmadd(a0, a0, q0);
          q1 = at::vec::fmadd(a1, a1, q1);
        });
        const float rstd = norm::rstd_of<float>(horizontal_sum(q0 + q1), n,
                                                static_cast<float>(eps));
        // y = x * rstd * gamma (+ beta) by the RMSNorm family's row kernel; each step of y
        // becomes the branches' inputs (y * smooth_k) and their running rowmax.
        Vec m1a(0), m1b(0), m2a(0), m2b(0);
        norm::rms_norm_apply_row<float>(
            in1, pg, n, rstd,
            [&](int64_t i, Vec a, Vec b, int64_t len) {
              if (pb != nullptr) {
                Vec ba, bb;
                FloatIO::load(pb + i, ba, bb, len);
                a = a + ba;
                b = b + bb;
              }
              auto branch = [&](const float* sm, float* dst, Vec& ma, Vec& mb) {
                Vec va = a, vb = b;
                if (sm != nullptr) {
                  Vec sa, sb;
                  FloatIO::load(sm + i, sa, sb, len);
                  va = va * sa;
                  vb = vb * sb;
                }
                FloatIO::store(dst + i, va, vb, len);  // lanes past len are 0: max unaffected
                ma = at::vec::maximum(ma, va.abs());
                mb = at::vec::maximum(mb, vb.abs());
              };
              // Branch 2 first: branch 1 overwrites in1[i..] (x), which this step has read.
              if (branch2) branch(ps2, in2, m2a, m2b);
              if (branch1) branch(ps1, in1, m1a, m1b);
            });
        // The first quantisation pass prefetches the next row of x1 and x2.
        const bool more = r + 1 < end;
        const scalar_t* next1 = more ? pa + (r + 1) * n : nullptr;
        const scalar_t* next2 = more ? pbx + (r + 1) * n : nullptr;
        if (branch1) {
          const float s = scale_of(reduce_max(at::vec::maximum(m1a, m1b)), spec);
          psc1[r] = s;
          quantize_row<float>(in1, nullptr, n, s, spec, sink1.row(r), next1, next2,
                              sizeof(scalar_t), stream1);
        }
        if (branch2) {
          const float s = scale_of(reduce_max(at::vec::maximum(m2a, m2b)), spec);
          psc2[r] = s;
          quantize_row<float>(in2, nullptr, n, s, spec, sink2.row(r),
                              branch1 ? nullptr : next1, next2, sizeof(scalar_t), stream2);
        }
      }
      if (stream) stream_fence();
    });
  });
}

// ----------------------------------------------------------------------------- npu_quantize

// Stores the first len <= Vec::size() lanes of q (integral floats within [0, 255]) as uint8.
inline void store_uint8(uint8_t* out, const Vec& q, int64_t len) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm512_cvtusepi32_epi8(_mm512_cvttps_epi32(q));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i ints = _mm256_cvttps_epi32(q);
  const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(ints),
                                         _mm256_extracti128_si256(ints, 1));
  const __m128i bytes = _mm_packus_epi16(words, words);
#endif
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  alignas(16) uint8_t tmp[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), bytes);
  std::memcpy(out, tmp, len);
#else
  float tmp[Vec::size()];
  q.store(tmp);
  for (int64_t i = 0; i < len; ++i) out[i] = static_cast<uint8_t>(tmp[i]);
#endif
}

// Stores the first len lanes of q (integral floats, not NaN) as int32, saturating: values at or
// beyond +-2^31 (which float32 cannot hold exactly) become INT32_MAX / INT32_MIN, as torch's
// int64 conversion and clamp do.
inline void store_int32(int32_t* out, const Vec& q, int64_t len) {
  float tmp[Vec::size()];
  q.store(tmp);
  for (int64_t i = 0; i < len; ++i) {
    const float v = tmp[i];
    out[i] = v >= 2147483648.f    ? std::numeric_limits<int32_t>::max()
             : v <= -2147483648.f ? std::numeric_limits<int32_t>::min()
                                  : static_cast<int32_t>(v);
  }
}

template <QuantizeOut kOut>
inline void store_quantized(void* out, int64_t index, const Vec& q, int64_t len) {
  if constexpr (kOut == QuantizeOut::kInt8) {
    store_codes(static_cast<int8_t*>(out) + index, q, len);
  } else if constexpr (kOut == QuantizeOut::kUInt8) {
    store_uint8(static_cast<uint8_t*>(out) + index, q, len);
  } else if constexpr (kOut == QuantizeOut::kInt32) {
    store_int32(static_cast<int32_t*>(out) + index, q, len);
  } else {  // index and len are multiples of 8
    store_int4(static_cast<int32_t*>(out) + index / 8, q, len);
  }
}

// hifloat8 codes of n consecutive elements x[0, n) at output element `index` (QuantizeFn):
// t = fp32(x / scale) + zero (div; `factor` holds the scales) or fp32(x * scale) + zero (mul),
// each step rounded to float32 (no FMA), then hifloat8(t). f / z per element or f0 / z0.
template <typename src_t>
void quantize_span_hif8(const src_t* x, int64_t n, const float* f, const float* z, float f0,
                        float z0, bool div, uint8_t* out) {
  for_each_step<src_t>(n, [&](int64_t i, int64_t len) {
    Vec a, b, fa(f0), fb(f0), za(z0), zb(z0);
    VecPair<src_t>::load(x + i, a, b, len);
    if (f != nullptr) {
      FloatIO::load(f + i, fa, fb, len);
      if (z != nullptr) FloatIO::load(z + i, za, zb, len);
    }
    float t[2 * Vec::size()];
    (div ? rounded(a / fa) + za : rounded(a * fa) + za).store(t);
    (div ? rounded(b / fb) + zb : rounded(b * fb) + zb).store(t + Vec::size());
    for (int64_t k = 0; k < len; ++k) out[i + k] = float_to_hifloat8_table(t[k]);
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// quantize_span's int8 or int4 codes on AVX-512, the same codes in fewer instructions: NaN -> the
// zero point by one masked move, the clamp from above by one vminps (7 or 127 first: a NaN zero
// point stays NaN, as in quantize_span's `code`), rounding half to even and the conversion by one
// vcvtps2dq (no overflow: t <= 127). The clamp from below: int8's is vpmovsdb's saturation
// (t < -128.5, -inf and NaN convert to at most -129 or INT_MIN: -128); int4's a vmaxps with -8
// before the conversion (NaN kept, converting to INT_MIN, whose low nibble 0 is what
// quantize_span's store_int4 packs for it). kF / kZ: per element factors / zero points (f, z),
// else f0 / z0. `next`: the row to prefetch (or null). int4: index and n are multiples of 8.
template <typename src_t, bool kF, bool kZ, bool kInt4>
void quantize_span_fast(const src_t* x, int64_t n, const float* f, const float* z, float f0,
                        float z0, bool div, void* out, int64_t index, const src_t* next) {
  const __m512 vhi = _mm512_set1_ps(kInt4 ? 7.f : 127.f), vlo = _mm512_set1_ps(-8.f);
  const __m512 vf0 = _mm512_set1_ps(f0), vz0 = _mm512_set1_ps(z0);
  int8_t* out8 = static_cast<int8_t*>(out) + index;
  int32_t* words = static_cast<int32_t*>(out) + index / 8;
  auto code = [&](int64_t i, __m512 v, __mmask16 mask) __attribute__((always_inline)) {
    const __m512 fv = kF ? _mm512_maskz_loadu_ps(mask, f + i) : vf0;
    const __m512 zv = kZ ? _mm512_maskz_loadu_ps(mask, z + i) : vz0;
    // the product rounded to fp32 before the add, as the golden (no FMA contraction)
    const __m512 p = rounded(at::vec::Vectorized<float>(_mm512_mul_ps(v, fv)));
    __m512 t = _mm512_add_ps(div ? _mm512_roundscale_ps(p, kRint) : p, zv);
    t = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q), zv);
    t = _mm512_min_ps(vhi, t);
    if constexpr (kInt4) t = _mm512_max_ps(vlo, t);
    return _mm512_cvt_roundps_epi32(t, kRint);
  };
  auto store = [&](int64_t i, __m512i q, int64_t len) __attribute__((always_inline)) {
    if constexpr (kInt4) {
      store_int4_ints(words + i / 8, q, len);
    } else if (len == 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out8 + i), _mm512_cvtsepi32_epi8(q));
    } else {
      _mm_mask_storeu_epi8(out8 + i, _cvtu32_mask16((1u << len) - 1), _mm512_cvtsepi32_epi8(q));
    }
  };
  const __mmask16 all = 0xFFFF;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    if (next != nullptr) prefetch_rows_step(next, nullptr, sizeof(src_t), i);
    store(i, code(i, load16(x + i), all), 16);
    store(i + 16, code(i + 16, load16(x + i + 16), all), 16);
  }
  for (; i < n; i += 16) {  // the tail: lanes past n load as 0 and are not stored
    const int64_t len = std::min<int64_t>(16, n - i);
    const __mmask16 mask = _cvtu32_mask16((1u << len) - 1);
    store(i, code(i, load16(x + i, mask), mask), len);
  }
}
#endif

// Codes of n consecutive elements x[0, n) starting at output element `index`. factor / zero:
// per element (f, z not null: the channels run along x) or one value for the span (f0, z0).
// factor is 1 / scale (div) or scale (mul); see QuantizeFn for the two formulas.
template <typename src_t, QuantizeOut kOut>
void quantize_span(const src_t* x, int64_t n, const float* f, const float* z, float f0, float z0,
                   bool div, void* out, int64_t index, const src_t* next) {
  constexpr float kLo = kOut == QuantizeOut::kInt8    ? -128.f
                        : kOut == QuantizeOut::kUInt8 ? 0.f
                        : kOut == QuantizeOut::kInt4  ? -8.f
                                                      : -2147483648.f;
  constexpr float kHi = kOut == QuantizeOut::kInt8    ? 127.f
                        : kOut == QuantizeOut::kUInt8 ? 255.f
                        : kOut == QuantizeOut::kInt4  ? 7.f
                                                      : 2147483648.f;
  const Vec lo(kLo), hi(kHi), vf0(f0), vz0(z0);
  auto code = [&](const Vec& v, const Vec& fv, const Vec& zv) {
    // The product is rounded to fp32 before the add (the golden's two roundings, not an FMA).
    Vec t = div ? rounded(v * fv).round() + zv : rounded(v * fv) + zv;
    t = Vec::blendv(t, zv, t.isnan());  // NaN: the zero point, not the cast's INT_MIN
    return at::vec::minimum(at::vec::maximum(t.round(), lo), hi);
  };
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kOut == QuantizeOut::kInt8 || kOut == QuantizeOut::kInt4) {
    constexpr bool kInt4 = kOut == QuantizeOut::kInt4;
    if (f != nullptr) {
      return z != nullptr ? quantize_span_fast<src_t, true, true, kInt4>(x, n, f, z, f0, z0, div,
                                                                         out, index, next)
                          : quantize_span_fast<src_t, true, false, kInt4>(x, n, f, z, f0, z0, div,
                                                                          out, index, next);
    }
    return quantize_span_fast<src_t, false, false, kInt4>(x, n, f, z, f0, z0, div, out, index,
                                                           next);
  }
#endif
  (void)next;
  for_each_step<src_t>(n, [&](int64_t i, int64_t len) {
    Vec a, b, fa = vf0, fb = vf0, za = vz0, zb = vz0;
    VecPair<src_t>::load(x + i, a, b, len);
    if (f != nullptr) {
      FloatIO::load(f + i, fa, fb, len);
      if (z != nullptr) FloatIO::load(z + i, za, zb, len);
    }
    const int64_t len_a = std::min<int64_t>(len, Vec::size());
    store_quantized<kOut>(out, index + i, code(a, fa, za), len_a);
    if (len > Vec::size()) {
      store_quantized<kOut>(out, index + i + Vec::size(), code(b, fb, zb), len - Vec::size());
    }
  });
}

// One span of QuantizeFn's output: the integer codes, or hifloat8's.
template <typename src_t, QuantizeOut kOut>
inline void quantize_any_span(const src_t* x, int64_t n, const float* f, const float* z, float f0,
                              float z0, bool div, void* out, int64_t index,
                              const src_t* next = nullptr) {
  if constexpr (kOut == QuantizeOut::kHif8) {
    quantize_span_hif8<src_t>(x, n, f, z, f0, z0, div, static_cast<uint8_t*>(out) + index);
  } else {
    quantize_span<src_t, kOut>(x, n, f, z, f0, z0, div, out, index, next);
  }
}

template <QuantizeOut kOut>
void quantize_typed(const at::Tensor& x, const std::vector<float>& factor, const float* zero,
                    bool div, at::Tensor& y) {
  const int64_t outer = x.size(0), channels = x.size(1), inner = x.size(2);
  void* out = y.mutable_data_ptr();
  const float* pf = factor.data();
  OPENNPU_QUANT_DISPATCH(x.scalar_type(), "npu_quantize", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    if (inner == 1) {  // the channels run along each row: per-element factors
      at::parallel_for(0, outer, grain_rows(channels), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          // The next row is prefetched while this one computes (the int8 kernel's steps).
          quantize_any_span<scalar_t, kOut>(px + r * channels, channels, pf, zero, 0.f, 0.f, div,
                                            out, r * channels,
                                            r + 1 < end ? px + (r + 1) * channels : nullptr);
        }
      });
      return;
    }
    // One channel per span of `inner` elements: its factor and zero point broadcast.
    at::parallel_for(0, outer * channels, grain_rows(inner), [&](int64_t begin, int64_t end) {
      for (int64_t u = begin; u < end; ++u) {
        const int64_t c = u % channels;
        quantize_any_span<scalar_t, kOut>(px + u * inner, inner, nullptr, nullptr, pf[c],
                                          zero != nullptr ? zero[c] : 0.f, div, out, u * inner);
      }
    });
  });
}

void quantize_kernel(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& zero_point,
                     bool div, QuantizeOut out, at::Tensor& y) {
  const int64_t channels = scale.numel();
  const float* ps = scale.const_data_ptr<float>();
  // div multiplies by the float32 reciprocal of each scale, as torch.quantize_per_channel does
  // (hifloat8 divides by the scale itself).
  std::vector<float> factor(ps, ps + channels);
  if (div && out != QuantizeOut::kHif8) {
    for (float& f : factor) f = 1.f / f;
  }
  const float* pz = zero_point.defined() ? zero_point.const_data_ptr<float>() : nullptr;
  switch (out) {
    case QuantizeOut::kInt8: return quantize_typed<QuantizeOut::kInt8>(x, factor, pz, div, y);
    case QuantizeOut::kUInt8: return quantize_typed<QuantizeOut::kUInt8>(x, factor, pz, div, y);
    case QuantizeOut::kInt32: return quantize_typed<QuantizeOut::kInt32>(x, factor, pz, div, y);
    case QuantizeOut::kInt4: return quantize_typed<QuantizeOut::kInt4>(x, factor, pz, div, y);
    case QuantizeOut::kHif8: return quantize_typed<QuantizeOut::kHif8>(x, factor, pz, div, y);
  }
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(dynamic_quant, &dynamic_quant_kernel);
OPENNPU_REGISTER_CPU_SLOT(add_rms_norm_dynamic_quant, &add_rms_norm_dynamic_quant_kernel);
OPENNPU_REGISTER_CPU_SLOT(quantize, &quantize_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::quant
