// SIMD helpers shared by the CPU kernels. Included only from <family>_cpu.cpp files, which are
// compiled once per ISA, so everything here lives in the inline namespace CPU_CAPABILITY.
//
// Numerics: every kernel computes in acc_t = at::opmath_type<scalar_t> (float for fp16/bf16/fp32,
// double for fp64) and rounds to scalar_t once, when it stores.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <limits>
#include <cstdint>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

// For the small vector helpers every kernel calls per vector (loads, stores, exp, sigmoid): GCC
// left some of them out of line in large kernels, and a call there costs more than the helper
// itself, as the SysV ABI saves no vector register across it (every constant is reloaded, every
// live vector spilled). _silu_mul bf16 [512, 2816], one thread: 0.61 -> 0.50 ms.
#define OPENNPU_VEC_INLINE inline __attribute__((always_inline))

namespace opennpu {
inline namespace CPU_CAPABILITY {

template <typename scalar_t>
using acc_t = at::opmath_type<scalar_t>;

template <typename scalar_t>
using AccVec = at::vec::Vectorized<acc_t<scalar_t>>;

// Moves 2 * AccVec::size() elements of scalar_t between memory and a pair of accumulator
// vectors (the natural unit for fp16/bf16, whose Vectorized holds twice as many lanes).
template <typename scalar_t>
struct VecPair {
  using Vec = AccVec<scalar_t>;
  static constexpr int64_t kStep = 2 * Vec::size();
  static constexpr bool kReduced = !std::is_same_v<scalar_t, acc_t<scalar_t>>;

  OPENNPU_VEC_INLINE static void load(const scalar_t* p, Vec& a, Vec& b) {
    if constexpr (kReduced) {
      at::vec::load_to_float<scalar_t>(p, a, b);
    } else {
      a = Vec::loadu(p);
      b = Vec::loadu(p + Vec::size());
    }
  }
  // Loads n <= kStep elements; lanes past n are zero.
  OPENNPU_VEC_INLINE static void load(const scalar_t* p, Vec& a, Vec& b, int64_t n) {
    if (n == kStep) return load(p, a, b);
    if constexpr (kReduced) {
      auto both = at::vec::Vectorized<scalar_t>::loadu(p, n);
      auto converted = at::vec::convert_to_float<scalar_t>(both);
      a = std::get<0>(converted);
      b = std::get<1>(converted);
    } else {
      const int64_t na = std::min<int64_t>(n, Vec::size());
      a = Vec::loadu(p, na);
      b = n > Vec::size() ? Vec::loadu(p + Vec::size(), n - Vec::size()) : Vec(0);
    }
  }
  OPENNPU_VEC_INLINE static void store(scalar_t* p, const Vec& a, const Vec& b) {
    if constexpr (kReduced) {
      at::vec::convert_from_float<scalar_t>(a, b).store(p);
    } else {
      a.store(p);
      b.store(p + Vec::size());
    }
  }
  OPENNPU_VEC_INLINE static void store(scalar_t* p, const Vec& a, const Vec& b, int64_t n) {
    if (n == kStep) return store(p, a, b);
    if constexpr (kReduced) {
      at::vec::convert_from_float<scalar_t>(a, b).store(p, n);
    } else {
      const int64_t na = std::min<int64_t>(n, Vec::size());
      a.store(p, na);
      if (n > Vec::size()) b.store(p + Vec::size(), n - Vec::size());
    }
  }
};

// Rounds a | b (32 fp32 lanes) to bf16 and stores the first n. Where the CPU has AVX512_BF16,
// one vcvtne2ps2bf16 replaces the ~16-instruction emulation of ATen's AVX-512 build (which cannot
// assume the extension): the same rounding to nearest even (NaN stays NaN) except that fp32
// subnormals become 0, so callers use it only where that cannot matter: an operand of a GEMM,
// or the output of an activation, softmax or RMSNorm, where it is an absolute change below
// 1.2e-38 (oneDNN's bf16 kernels round with the same instruction; rotary keeps ATen's exact
// rounding, which its tests pin bit for bit). Inline asm, so the file needs no target flag;
// callers check has_avx512_bf16() once, outside their loops: checked per store, with a fallback
// for subnormals, it measured slower than ATen's emulation.
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kNativeBf16Build = true;

inline bool has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

// a | b rounded to 32 bf16 values (a first).
OPENNPU_VEC_INLINE __m512i bf16_native(const at::vec::Vectorized<float>& a,
                                       const at::vec::Vectorized<float>& b) {
  __m512i r;
  asm("vcvtne2ps2bf16 %1, %2, %0" : "=v"(r) : "v"(static_cast<__m512>(a)), "v"(static_cast<__m512>(b)));
  return r;
}

OPENNPU_VEC_INLINE void store_bf16_native(at::BFloat16* p, const at::vec::Vectorized<float>& a,
                                          const at::vec::Vectorized<float>& b, int64_t n = 32) {
  const __m512i r = bf16_native(a, b);
  if (n == 32) {
    _mm512_storeu_si512(p, r);
  } else {
    _mm512_mask_storeu_epi16(p, _cvtu32_mask32((1u << n) - 1), r);
  }
}
#else
constexpr bool kNativeBf16Build = false;

inline bool has_avx512_bf16() { return false; }
#endif

// VecPair<scalar_t>::store of the first n elements, bf16 rounded by store_bf16_native when
// kNative (the caller has checked has_avx512_bf16()).
template <bool kNative, typename scalar_t>
OPENNPU_VEC_INLINE void store_pair(scalar_t* p, const AccVec<scalar_t>& a,
                                   const AccVec<scalar_t>& b, int64_t n = VecPair<scalar_t>::kStep) {
  if constexpr (kNative && kNativeBf16Build && std::is_same_v<scalar_t, at::BFloat16>) {
    store_bf16_native(p, a, b, n);
  } else {
    VecPair<scalar_t>::store(p, a, b, n);
  }
}

// body(std::bool_constant<kNative>{}) with kNative true for bf16 on CPUs with AVX512_BF16: a
// kernel's stores through store_pair<kNative> then round with one instruction per 32 values
// (flushing fp32 subnormals, below 1.2e-38, to 0) instead of ATen's ~16-instruction emulation.
// The CPU is checked once per call, outside the loops.
template <typename scalar_t, typename Body>
inline void with_bf16_stores(const Body& body) {
  if constexpr (kNativeBf16Build && std::is_same_v<scalar_t, at::BFloat16>) {
    if (has_avx512_bf16()) return body(std::true_type{});
  }
  body(std::false_type{});
}

// exp of fp32 lanes, faster than ATen's exp_u20 on AVX-512 at the same accuracy: with
// n = round(x * log2(e)) and r = x - n * ln2 (ln2 split in two so that n * ln2_hi is exact),
// exp(x) = 2^n * p(r), p a degree-5 fit of e^r on |r| <= ln2 / 2, scaled by vscalefps. Relative
// error <= 2.3e-7 for every normal result (exp_u20: 2.0e-7 on [-20, 0], the softmax range).
// Like exp_u20, results below FLT_MIN (x < -87.34, -inf included) are exactly 0: the lanes are
// masked off rather than left to underflow, which would cost a microcode assist per lane (the
// masked keys of a softmax tile are -inf). +inf gives inf; NaN stays NaN.
OPENNPU_VEC_INLINE at::vec::Vectorized<float> exp_fast(const at::vec::Vectorized<float>& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_NLT_UQ);
  // min returns its second operand when either is NaN: x must be the second.
  const __m512 xc = _mm512_min_ps(_mm512_set1_ps(89.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), xc);  // ln2_hi: 17 bits
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f), r);        // ln2_lo
  __m512 p = _mm512_set1_ps(0x1.0fe5c6p-7f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.575eeep-5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.555a18p-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.fffd1ap-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.fffff6p-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0x1.000002p+0f));
  return _mm512_maskz_scalef_ps(normal, p, n);
#else
  return x.exp_u20();
#endif
}

// max(a, acc) for a running maximum that may skip NaN: where a is NaN, acc. One vmaxps (which
// returns its second operand when either is NaN), where at::vec::maximum spends four instructions
// on propagating NaN; for callers whose NaN reaches the result another way.
template <typename T>
OPENNPU_VEC_INLINE at::vec::Vectorized<T> max_skip_nan(const at::vec::Vectorized<T>& a,
                                                       const at::vec::Vectorized<T>& acc) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) return _mm512_max_ps(a, acc);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) return _mm256_max_ps(a, acc);
#endif
  return at::vec::Vectorized<T>::blendv(at::vec::maximum(a, acc), acc, a != a);
}

// 2^t of fp32 lanes, for values rounded to fp16/bf16 (11 or 8 significant bits) before anyone
// reads them, and for sums of such values: n = round(t), f = t - n in [-1/2, 1/2], 2^t = 2^n * p(f)
// with p a degree-4 minimax fit of 2^f (relative error <= 2.7e-6, 2^-18.5: under 1/180 of fp16's
// half ulp). Against exp_fast: one fma less and no ln2 reduction (callers multiply by log2(e)).
// Results below 2^-125 (t < -125, -inf included) are exactly 0, never subnormal (see below),
// t >= 128 (+inf included) gives inf and NaN stays NaN.
OPENNPU_VEC_INLINE at::vec::Vectorized<float> exp2_reduced(const at::vec::Vectorized<float>& t_in) {
#if defined(CPU_CAPABILITY_AVX512)
  // Below -125, p(f) * 2^n could be subnormal (n = -126, p < 1), and a subnormal result costs
  // a microcode assist: those lanes, whose true values are below 2.4e-38, are 0.
  const __mmask16 normal = _mm512_cmp_ps_mask(t_in, _mm512_set1_ps(-125.0f), _CMP_NLT_UQ);
  // min returns its second operand when either is NaN: t_in must be the second.
  // 2^129 * p(0) is inf (2^128 * p(0) would not be: p(0) is 1 - 2^-20).
  const __m512 t = _mm512_min_ps(_mm512_set1_ps(129.0f), t_in);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(0x1.3997d4p-7f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0x1.ca1442p-5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0x1.ec06dap-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0x1.62e0dcp-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0x1.ffffe8p-1f));
  return _mm512_maskz_scalef_ps(normal, p, n);
#else
  return (t_in * at::vec::Vectorized<float>(0.693147180559945309f)).exp_u20();
#endif
}

// exp for the accumulator type. fp32 and fp64 outputs get ATen's 1-ulp exp (as accurate as the
// native ops they replace); fp16/bf16 outputs keep 8-11 mantissa bits, so exp2_reduced of
// x * log2(e) loses nothing after rounding and is several times cheaper: relative error below
// 1e-5 over the whole range (the fit's 2.7e-6, and the roundings of log2(e) and of the product,
// each at most 2^-25 * 128 in an exponent below 128: 2.6e-6 each).
template <typename scalar_t>
OPENNPU_VEC_INLINE AccVec<scalar_t> exp_for(const AccVec<scalar_t>& x) {
  if constexpr (VecPair<scalar_t>::kReduced) {
    return exp2_reduced(x * AccVec<scalar_t>(1.44269504088896340736f));
  } else {
    return x.exp();
  }
}

// 1 / d for d in [1, 2]: the hardware reciprocal estimate plus one Newton step (relative error
// ~2^-23 on AVX-512, ~2^-22 on AVX2) instead of the slow vector divide.
OPENNPU_VEC_INLINE at::vec::Vectorized<float> reciprocal_in_1_2(
    const at::vec::Vectorized<float>& d) {
  using Vec = at::vec::Vectorized<float>;
#if defined(CPU_CAPABILITY_AVX512)
  const Vec r(_mm512_rcp14_ps(d));
#elif defined(CPU_CAPABILITY_AVX2)
  const Vec r(_mm256_rcp_ps(d));
#else
  return Vec(1) / d;
#endif
  return r * (Vec(2) - d * r);  // one Newton step
}

// 1 / (1 + exp(-z)), saturating to 0 and 1 without NaN for large |z|. fp32/fp64 outputs: as
// written, with ATen's exp and an exactly rounded division. fp16/bf16 outputs: from
// e = exp(-|z|) in [0, 1], 1 / (1 + e) for z >= 0 and e / (1 + e) below, so the reciprocal's
// argument stays in [1, 2] and no lane overflows or turns subnormal: written as above, every
// z below -87 made 1 / (1 + exp(-z)) subnormal, and each such lane cost a microcode assist
// (silu of gates with a standard deviation of 100 ran 13x slower). Lanes of z below -87.3 give
// 0 (the true value is below 1.2e-38).
template <typename scalar_t>
OPENNPU_VEC_INLINE AccVec<scalar_t> sigmoid_for(const AccVec<scalar_t>& z) {
  using Vec = AccVec<scalar_t>;
  if constexpr (VecPair<scalar_t>::kReduced) {
    const Vec e = exp_for<scalar_t>(Vec(0) - z.abs());
    const Vec r = reciprocal_in_1_2(Vec(1) + e);
    return Vec::blendv(r, e * r, z < Vec(0));
  } else {
    return Vec(1) / (Vec(1) + exp_for<scalar_t>(Vec(0) - z));
  }
}

// Rows per parallel chunk for row kernels: about 16K elements of work, so small tensors stay on
// one thread.
inline int64_t grain_rows(int64_t work_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(work_per_row, 1));
}

inline float horizontal_sum(const at::vec::Vectorized<float>& v) {
  return at::vec::vec_reduce_all<float>([](auto& a, auto& b) { return a + b; }, v);
}
inline double horizontal_sum(const at::vec::Vectorized<double>& v) {
  return at::vec::vec_reduce_all<double>([](auto& a, auto& b) { return a + b; }, v);
}

// Calls body(begin, len) for the full-width chunks of [0, n) and once more for the tail
// (len < kStep), so kernels write their loop body once and handle odd sizes.
template <typename scalar_t, typename Body>
inline void for_each_step(int64_t n, const Body& body) {
  constexpr int64_t kStep = VecPair<scalar_t>::kStep;
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) body(i, kStep);
  if (i < n) body(i, n - i);
}

}  // namespace CPU_CAPABILITY
}  // namespace opennpu
