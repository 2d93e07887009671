// CPU kernels of the MX and block quantisers (compiled once per ISA; see mx_quant.h for the
// numerics). Work is split into (line group, block) units; within a unit the block maxima of
// all `post` columns are found first, then every element is scaled and rounded in fp32. The
// AVX-512 build does the MX units in registers (quantise_units: sixteen contiguous blocks at a
// time, or sixteen columns at a time for blocks along another axis) with lane forms of the same
// numerics (fp32 lanes; bf16 / fp16 "rint" in the elements' own 16-bit lanes); the AVX2 build
// does contiguous 32-element "rint" blocks in lanes too (quantise_8_blocks_avx2, with bf16 /
// fp16 in 16-bit lanes where the AVX-512 build uses them, and quantise_block32_avx2) and the rest
// in the scalar loops of mx_quant_kernel, as other ISAs do.
// All give the same codes.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <type_traits>
#include <vector>

#include "common/vec.h"
#include "common/fp_barrier.h"
#include "ops/quant/hifloat8.h"
#include "ops/quant/mx_quant.h"
#include "ops/quant/simd16.h"

namespace opennpu::quant {
inline namespace CPU_CAPABILITY {
namespace {

#define OPENNPU_MX_DISPATCH(TYPE, NAME, ...)                    \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

constexpr int kNanExp = 128;  // shared exponent marking a NaN scale (e8m0 code 0xFF)

// 2^e as a float, for e in [-149, 127].
inline float pow2(int e) {
  if (e >= -126) return std::bit_cast<float>(static_cast<uint32_t>(e + 127) << 23);
  return std::bit_cast<float>(uint32_t{1} << (e + 149));  // subnormal
}

// floor(log2(a)) for finite a > 0, exactly.
inline int exponent_of(float a) {
  const uint32_t bits = std::bit_cast<uint32_t>(a);
  const int biased = static_cast<int>((bits >> 23) & 0xFF);
  return biased != 0 ? biased - 127 : std::ilogb(a);
}

// The shared exponent of a block whose largest magnitude is amax.
inline int shared_exponent(float amax, const MxFormat& f, int64_t scale_alg, float low_bound) {
  if (std::isnan(amax) || std::isinf(amax)) return kNanExp;
  int e;
  if (scale_alg == 1) {
    amax = std::max(amax, low_bound);
    if (amax == 0.f) return -127;
    const uint32_t bits = std::bit_cast<uint32_t>(amax / f.max_norm);
    int biased = static_cast<int>((bits >> 23) & 0xFF);
    const uint32_t mantissa = bits & 0x7FFFFF;
    if ((biased > 0 && biased < 254 && mantissa > 0) || (biased == 0 && mantissa > 0x400000)) {
      ++biased;
    }
    e = biased - 127;
  } else {
    if (amax == 0.f) return -127;
    e = exponent_of(amax) - f.emax;
  }
  if (e > 127) return kNanExp;
  return std::max(e, -127);
}

// t (= V / 2^shared_exp) rounded to the element format, saturated; NaN -> +0.
inline float round_element(float t, const MxFormat& f, MxRound mode) {
  if (std::isnan(t)) return 0.f;
  const float a = std::fabs(t);
  if (a == 0.f) return t;  // keeps the sign of zero, as the conversion does
  const int e = std::max(std::isinf(a) ? 1000 : exponent_of(a), f.min_exp);
  if (e > f.emax + 1) return std::copysign(f.max_norm, t);  // far beyond the range: saturate
  const int shift = e - f.mbits;
  float m = t * pow2(-shift);  // exact: a power-of-two scaling of a normal fp32 value
  switch (mode) {
    case MxRound::kRint: m = std::rint(m); break;
    case MxRound::kRound: m = std::copysign(std::floor(std::fabs(m) + 0.5f), m); break;
    case MxRound::kFloor: m = std::floor(m); break;
  }
  const float r = m * pow2(shift);
  return std::clamp(r, -f.max_norm, f.max_norm);
}

// The code of c (finite, |c| <= the format's max_norm) in a float8 or fp4 element format with
// the sign in its top bit, rounded to nearest even as c10's float8 conversions round such values
// (for fp4, as round_element's rint then encode), from the float's bits with no branch, the
// format's constants worked out once (so that the element loop vectorises): in the normal range,
// half an ulp of the format less one plus the lowest kept mantissa bit is added to the
// magnitude's bits (a carry moves the exponent up), which are then shifted and rebiased; below
// the smallest normal 2^min_exp, the magnitude in units of the subnormal spacing
// 2^(min_exp - mbits) (an exact power-of-two product) plus 2^23 leaves rint(units) in the low
// mantissa bits, by the float addition's own rounding, 2^mbits (the smallest normal's code)
// included.
struct RintEncoder {
  static constexpr float kTwo23 = 8388608.f;
  uint32_t shift, half_less_one, rebias, min_normal_bits;
  float units;

  explicit RintEncoder(const MxFormat& f)
      : shift(static_cast<uint32_t>(23 - f.mbits)),
        half_less_one((1u << (22 - f.mbits)) - 1),
        rebias(static_cast<uint32_t>(126 + f.min_exp) << f.mbits),
        min_normal_bits(static_cast<uint32_t>(127 + f.min_exp) << 23),
        units(pow2(f.mbits - f.min_exp)) {}

  // half_less_one with the rebias taken off before the shift, for lane forms that shift once:
  // (mag + round_less_rebias() + lsb) >> shift is magnitude_code's normal value for every
  // magnitude at or above the smallest normal (rebias << shift is a multiple of 2^shift).
  uint32_t round_less_rebias() const { return half_less_one - (rebias << shift); }

  // The magnitude's code (the sign bit is the caller's).
  uint32_t magnitude_code(uint32_t mag) const {
    const uint32_t normal = ((mag + half_less_one + ((mag >> shift) & 1u)) >> shift) - rebias;
    const uint32_t subnormal =
        std::bit_cast<uint32_t>(std::bit_cast<float>(mag) * units + kTwo23) -
        std::bit_cast<uint32_t>(kTwo23);
    return mag < min_normal_bits ? subnormal : normal;
  }

  uint8_t float8_code(float c) const {
    const uint32_t bits = std::bit_cast<uint32_t>(c);
    return static_cast<uint8_t>(((bits >> 24) & 0x80u) | magnitude_code(bits & 0x7FFFFFFFu));
  }
};

// The scalar constants of the encoders that work in bf16 / fp16's own 16-bit lanes (the AVX-512
// Rint16 family and AVX2's Half16Lanes, whose comments give the arithmetic): the patterns are
// signed 16-bit, compared with a block's scaled magnitudes.
template <typename half_t>
struct Half16Format {
  static constexpr bool kBf16 = std::is_same_v<half_t, at::BFloat16>;
  static constexpr int kMantissaBits = kBf16 ? 7 : 10;
  // fp4: the smallest shared exponent whose blocks the 16-bit lanes take
  static constexpr int kFp4MinExp = kBf16 ? -120 : -11;

  // The 16-bit pattern of v (exact in half_t).
  static int16_t bits16(float v) {
    if constexpr (kBf16) {
      return static_cast<int16_t>(std::bit_cast<uint32_t>(v) >> 16);
    } else {
      return static_cast<int16_t>(c10::Half(v).x);
    }
  }

  // fp4: |t|'s code is at least k + 1 iff its bits > above[k]: the midpoints between
  // neighbouring values (exact in bf16 and fp16: at most mbits + 2 significant bits), a midpoint
  // itself rounding to the even code (ties to even, as rint); the last saturates everything above.
  static std::array<int16_t, 7> fp4_above(const MxFormat& f) {
    const auto value = [&](int c) {  // the format's value of magnitude code c
      const int m = 1 << f.mbits;
      return c < m ? std::ldexp(static_cast<float>(c), f.min_exp - f.mbits)
                   : std::ldexp(1.f + static_cast<float>(c % m) / static_cast<float>(m),
                                c / m - 1 + f.min_exp);
    };
    std::array<int16_t, 7> above{};
    for (int k = 0; k < 7; ++k) {
      const int bits = bits16((value(k) + value(k + 1)) / 2.f);
      above[k] = static_cast<int16_t>((k + 1) % 2 == 0 ? bits - 1 : bits);
    }
    return above;
  }
};

// float8 from bf16 in 16-bit lanes: RintEncoder's normal-range arithmetic on bf16 bits, the
// smallest normal, half the subnormal spacing, and the smallest shared exponent taken there.
struct Bf16Fp8Format {
  int16_t max_bits, round_less_rebias, min_normal_bits, half_spacing_bits;
  int shift, min_exp_16;
  explicit Bf16Fp8Format(const MxFormat& f)
      : max_bits(Half16Format<at::BFloat16>::bits16(f.max_norm)),
        round_less_rebias(
            static_cast<int16_t>(((1 << (6 - f.mbits)) - 1) - ((126 + f.min_exp) << 7))),
        min_normal_bits(Half16Format<at::BFloat16>::bits16(std::ldexp(1.f, f.min_exp))),
        half_spacing_bits(
            Half16Format<at::BFloat16>::bits16(std::ldexp(1.f, f.min_exp - f.mbits - 1))),
        shift(7 - f.mbits),
        min_exp_16(-(126 + f.min_exp)) {}
};

// The code of an element value r (exactly representable in the format).
inline uint8_t encode(float r, const MxFormat& f) {
  if (!f.fp4) {
    return f.e4m3 ? c10::Float8_e4m3fn(r).x : c10::Float8_e5m2(r).x;
  }
  const uint8_t sign = std::signbit(r) ? 0x8 : 0x0;
  const float a = std::fabs(r);
  if (f.emax == 2) {  // e2m1: 0, 0.5, 1, 1.5, 2, 3, 4, 6
    static constexpr uint8_t kCode[13] = {0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7};
    return sign | kCode[static_cast<int>(a * 2.f)];
  }
  return sign | static_cast<uint8_t>(a * 4.f);  // e1m2: 0, 0.25, ..., 1.75
}

#if defined(CPU_CAPABILITY_AVX512)
// The MX units in AVX-512 registers (quantise_units): fp32 lanes, 16 a register. The lane
// functions below compute the scalar path's values exactly (the same IEEE products and
// roundings, exact power-of-two scalings and exponent reads in place of the scalar bit
// arithmetic, comparisons on the same bit patterns), so the codes and scales are the scalar
// path's bit for bit.

// p[0, n) for n <= 16 as fp32 lanes, lanes past n 0 (load16 of ops/quant/simd16.h).
template <typename scalar_t>
OPENNPU_VEC_INLINE __m512 load16_n(const scalar_t* p, int64_t n) {
  return load16(p, static_cast<__mmask16>((1u << n) - 1));
}

// The magnitudes' bits: ordered as the magnitudes, a NaN above inf (as the scalar reduction).
OPENNPU_VEC_INLINE __m512i magnitude_bits(__m512 v) {
  return _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7FFFFFFF));
}

// The float8 or fp4 codes of 16 lanes of quotients t (finite; other lanes give a code the
// caller discards) rounded to nearest even: RintEncoder's arithmetic on the bits of
// clamp(t, -max_norm, max_norm), whose magnitude is min(|t|, max_norm), an unsigned minimum of
// the magnitudes' bits (their order is the values'), and whose sign is t's (rounding is monotonic
// and max_norm a code, so clamping before rounding saturates as round_element's rounding then
// clamp). The rebias is subtracted before the shift (rebias << shift, a multiple of 2^shift,
// leaves the quotient of every normal magnitude unchanged; subnormal lanes take the other
// result), and the subnormal product and 2^23 are one fused multiply-add (the product is exact).
// The sign goes to bit 7 (float8) or bit 3 (fp4).
struct RintLanes {
  __m128i shift;
  __m512i max_bits, round_less_rebias, min_normal_bits, sign_bit;
  __m512 units, two23;
  int sign_shift;

  explicit RintLanes(const MxFormat& f) : RintLanes(RintEncoder(f), f.max_norm, f.fp4 ? 28 : 24) {}
  RintLanes(const RintEncoder& e, float max_norm, int sign_shift_)
      : shift(_mm_cvtsi32_si128(static_cast<int>(e.shift))),
        max_bits(_mm512_set1_epi32(static_cast<int>(std::bit_cast<uint32_t>(max_norm)))),
        round_less_rebias(_mm512_set1_epi32(static_cast<int>(e.round_less_rebias()))),
        min_normal_bits(_mm512_set1_epi32(static_cast<int>(e.min_normal_bits))),
        sign_bit(_mm512_set1_epi32(static_cast<int>(0x80000000u >> sign_shift_))),
        units(_mm512_set1_ps(e.units)),
        two23(_mm512_set1_ps(RintEncoder::kTwo23)),
        sign_shift(sign_shift_) {}

  OPENNPU_VEC_INLINE __m512i operator()(__m512 t) const {
    const __m512i bits = _mm512_castps_si512(t);
    const __m512i mag = _mm512_min_epu32(magnitude_bits(t), max_bits);
    const __m512i lsb = _mm512_and_si512(_mm512_srl_epi32(mag, shift), _mm512_set1_epi32(1));
    const __m512i normal = _mm512_srl_epi32(
        _mm512_add_epi32(_mm512_add_epi32(mag, round_less_rebias), lsb), shift);
    const __m512i subnormal = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(mag), units, two23)),
        _mm512_castps_si512(two23));
    const __m512i code =
        _mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(mag, min_normal_bits), normal, subnormal);
    // sign | code: sign_bit of (bits >> sign_shift) is t's sign, code < sign_bit
    return _mm512_ternarylogic_epi32(_mm512_srli_epi32(bits, sign_shift), sign_bit, code, 0xEA);
  }
};

// round_element followed by encode (fp4 formats, modes "round" and "floor") on 16 lanes of
// quotients t, with no branch:
// e = max(floor(log2|t|), min_exp) (vgetexpps: exact, subnormals included, -inf for a zero),
// capped at emax + 2; m = t * 2^-(e - mbits) and r = round(m) * 2^(e - mbits) are exact
// power-of-two scalings (vscalefps), as in the scalar path, and |r| is clamped to max_norm: the
// lanes the scalar path saturates, |t| >= 2^(emax + 2) (inf included), have |r| >= 2^(emax + 2)
// with the capped e, so the clamp saturates them too. The code's sign is t's: round(m) keeps m's
// sign ("round" gives -0 for small negative m, floor at most -1), so r's sign is t's.
// |r| * 2^(mbits - min_exp) is an integer (the value in units of the subnormal spacing), looked
// up in the code table (e2m1: 0, .5, 1, 1.5, 2, 3, 4, 6 are units 0, 1, 2, 3, 4, 6, 8, 12; e1m2:
// units are codes). NaN: +0.
template <MxRound kMode>
struct Fp4Lanes {
  __m512 min_exp, cap, mbits, max_norm, to_units;
  __m512i table;

  explicit Fp4Lanes(const MxFormat& f)
      : min_exp(_mm512_set1_ps(static_cast<float>(f.min_exp))),
        cap(_mm512_set1_ps(static_cast<float>(f.emax + 2))),
        mbits(_mm512_set1_ps(static_cast<float>(f.mbits))),
        max_norm(_mm512_set1_ps(f.max_norm)),
        to_units(_mm512_set1_ps(pow2(f.mbits - f.min_exp))),
        table(f.emax == 2 ? _mm512_setr_epi32(0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7, 0, 0, 0)
                          : _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                                              15)) {}

  OPENNPU_VEC_INLINE __m512i operator()(__m512 t) const {
    const __m512 e = _mm512_min_ps(_mm512_max_ps(_mm512_getexp_ps(t), min_exp), cap);
    __m512 m = _mm512_scalef_ps(t, _mm512_sub_ps(mbits, e));
    static_assert(kMode != MxRound::kRint, "rint takes RintLanes");
    if constexpr (kMode == MxRound::kFloor) {
      m = _mm512_roundscale_ps(m, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    } else {  // copysign(floor(|m| + 0.5), m)
      const __m512 half = _mm512_add_ps(_mm512_abs_ps(m), _mm512_set1_ps(0.5f));
      const __m512i sign = _mm512_and_si512(_mm512_castps_si512(m), _mm512_set1_epi32(INT32_MIN));
      const __m512 lower = _mm512_roundscale_ps(half, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      m = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(lower), sign));
    }
    const __m512 a =
        _mm512_min_ps(_mm512_abs_ps(_mm512_scalef_ps(m, _mm512_sub_ps(e, mbits))), max_norm);
    const __m512i units = _mm512_cvttps_epi32(_mm512_mul_ps(a, to_units));
    const __m512i code = _mm512_permutexvar_epi32(units, table);
    // (t's sign bit >> 28) | code, lanes of NaN 0
    return _mm512_maskz_ternarylogic_epi32(_mm512_cmp_ps_mask(t, t, _CMP_ORD_Q),
                                           _mm512_srli_epi32(_mm512_castps_si512(t), 28),
                                           _mm512_set1_epi32(0x8), code, 0xEA);
  }
};

// bf16 / fp16 to fp4 and bf16 to float8, "rint", in the elements' own 16-bit lanes, 32 a register
// (Fp4Rint16, Bf16Fp8Rint), for blocks of shared exponent e >= min_exp_16; RintLanes' fp32
// lanes (inherited) take the other blocks and every other layout. t = x * 2^-e is x with e taken
// off its exponent field (vpsubsw): exact, as the fp32 product is (t stays within the 16-bit
// format's range: |t| < 2^(emax + 1)), and a magnitude whose field would fall to 0 or below
// (t below the format's smallest normal; code 0 in the fp32 path too, as below) saturates to a
// negative or tiny bit pattern, which the signed comparisons below read as smaller than every
// threshold. A subnormal element (exponent field 0) is scaled wrongly, to a pattern whose value
// is below 2^(-e - 126) for bf16, 2^(-e - 14) for fp16 (as is its true |t|): for e >= min_exp_16
// that is below the float8 format's smallest normal (bf16: min_exp_16 = -(126 + min_exp); such
// lanes are code 0 or go to the fp32 lanes, see Bf16Fp8Rint) or below fp4's first rounding
// threshold, 2^-3 or more (min_exp_16 = -120 for bf16, -11 for fp16: code 0, as the true |t|
// gives). An all-zero block has e = -127 and takes the fp32 lanes.
template <typename half_t>
struct Rint16 : RintLanes {
  using half_type = half_t;
  static constexpr int kMantissaBits = Half16Format<half_t>::kMantissaBits;
  int min_exp_16;
  Rint16(const MxFormat& f, int min_exp) : RintLanes(f), min_exp_16(min_exp) {}

  // |x| * 2^-e as 16-bit patterns (signed; see above), x's bits in w
  OPENNPU_VEC_INLINE static __m512i scaled_magnitude(__m512i w, int e) {
    return _mm512_subs_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x7FFF)),
                             _mm512_set1_epi16(static_cast<int16_t>(e * (1 << kMantissaBits))));
  }
};

// fp4: the code's magnitude is the number of the format's rounding thresholds below |t| (bit
// patterns order as the magnitudes): the midpoints between neighbouring values, a midpoint
// itself rounding to the even code (ties to even, as rint). The last threshold saturates
// everything above it (nothing rounds past max_norm).
template <typename half_t>
struct Fp4Rint16 : Rint16<half_t> {
  __m512i above[7];  // |t|'s code is at least k + 1 iff its bits > above[k] (signed 16-bit)

  explicit Fp4Rint16(const MxFormat& f) : Rint16<half_t>(f, Half16Format<half_t>::kFp4MinExp) {
    const std::array<int16_t, 7> bits = Half16Format<half_t>::fp4_above(f);
    for (int k = 0; k < 7; ++k) above[k] = _mm512_set1_epi16(bits[k]);
  }

  // The codes of x[0, 32), element 2j's in the low nibble of out[j]. Always done (true).
  OPENNPU_VEC_INLINE bool store32(const half_t* x, int e, uint8_t* out) const {
    const __m512i w = _mm512_loadu_si512(x);
    const __m512i t = Rint16<half_t>::scaled_magnitude(w, e);
    __m512i code = _mm512_setzero_si512();
    for (int k = 0; k < 7; ++k) {
      code = _mm512_mask_sub_epi16(code, _mm512_cmpgt_epi16_mask(t, above[k]), code,
                                   _mm512_set1_epi16(-1));
    }
    // the sign (bit 15 of x) to bit 3; then each 32-bit lane's two codes into its low byte
    code = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 12), _mm512_set1_epi16(0x8), code, 0xEA);
    const __m512i pairs = _mm512_or_si512(code, _mm512_srli_epi32(code, 12));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(pairs));
    return true;
  }
};

// float8: RintEncoder's normal-range arithmetic on the bf16 bits of min(|t|, max_norm) (the
// fp32 bits' low 16 are zero, so shifting 16 fewer gives the same code); |t| below the smallest
// normal is code 0 up to half the subnormal spacing (ties to even: 0), and 32 elements with any
// magnitude in [half the spacing, smallest normal) are left to the fp32 lanes (false: nothing
// stored), which round subnormals (rare in a block scaled to its largest element).
struct Bf16Fp8Rint : Rint16<at::BFloat16> {
  __m512i max_bits, round_less_rebias, min_normal_bits, half_spacing_bits;
  int shift;

  explicit Bf16Fp8Rint(const MxFormat& f) : Bf16Fp8Rint(f, Bf16Fp8Format(f)) {}
  Bf16Fp8Rint(const MxFormat& f, const Bf16Fp8Format& c)
      : Rint16<at::BFloat16>(f, c.min_exp_16),
        max_bits(_mm512_set1_epi16(c.max_bits)),
        round_less_rebias(_mm512_set1_epi16(c.round_less_rebias)),
        min_normal_bits(_mm512_set1_epi16(c.min_normal_bits)),
        half_spacing_bits(_mm512_set1_epi16(c.half_spacing_bits)),
        shift(c.shift) {}

  // The codes of x[0, 32), one byte each, or false (nothing stored) for the fp32 lanes.
  OPENNPU_VEC_INLINE bool store32(const at::BFloat16* x, int e, uint8_t* out) const {
    const __m512i w = _mm512_loadu_si512(x);
    const __m512i t = _mm512_min_epi16(scaled_magnitude(w, e), max_bits);
    const __mmask32 small = _mm512_cmpgt_epi16_mask(min_normal_bits, t);
    if (_mm512_mask_cmpgt_epi16_mask(small, t, half_spacing_bits) != 0) return false;
    // the rebias is subtracted before the shift (see RintLanes): normal lanes stay positive
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi16(t, shift), _mm512_set1_epi16(1));
    const __m512i normal = _mm512_srli_epi16(
        _mm512_add_epi16(_mm512_add_epi16(t, round_less_rebias), lsb), shift);
    // sign (bit 15 of x, to bit 7) | code, small lanes 0
    const __m512i code = _mm512_ternarylogic_epi32(
        _mm512_srli_epi16(w, 8), _mm512_set1_epi16(0x80),
        _mm512_maskz_mov_epi16(static_cast<__mmask32>(~small), normal), 0xEA);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi16_epi8(code));
    return true;
  }
};

// Stores the codes of elements [i, i + n) (n <= 16, i a multiple of 16) of a block whose output
// starts at out: fp8 one byte each; fp4 two codes a byte, element 2j in the low nibble (i and n
// even).
template <bool kFp4>
OPENNPU_VEC_INLINE void store16(uint8_t* out, int64_t i, __m512i codes, int64_t n = 16) {
  if constexpr (kFp4) {
    // 64-bit lane j holds codes 2j (low half) and 2j + 1: its low byte becomes 2j | (2j + 1) << 4
    const __m512i pairs = _mm512_or_si512(codes, _mm512_srli_epi64(codes, 28));
    const __m128i bytes = _mm512_cvtepi64_epi8(pairs);
    if (n == 16) {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i / 2), bytes);
    } else {
      _mm_mask_storeu_epi8(out + i / 2, static_cast<__mmask16>((1u << (n / 2)) - 1), bytes);
    }
  } else {
    const __m128i bytes = _mm512_cvtepi32_epi8(codes);
    if (n == 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), bytes);
    } else {
      _mm_mask_storeu_epi8(out + i, static_cast<__mmask16>((1u << n) - 1), bytes);
    }
  }
}

// x[0, 32) as fp32 lanes split by parity: even holds elements 0, 2, ..., 30, odd 1, 3, ..., 31.
// bf16 from one load (a bf16's fp32 bits are its 16 bits shifted up: the even element of each
// 32-bit word by a shift, the odd one by a mask); fp32 / fp16 from two, gathered by vpermt2ps.
template <typename scalar_t>
OPENNPU_VEC_INLINE void load32_by_parity(const scalar_t* x, __m512& even, __m512& odd) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const __m512i v = _mm512_loadu_si512(x);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536)));
  } else {
    const __m512 a = load16(x), b = load16(x + 16);
    const __m512i idx =
        _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    even = _mm512_permutex2var_ps(a, idx, b);
    odd = _mm512_permutex2var_ps(a, _mm512_add_epi32(idx, _mm512_set1_epi32(1)), b);
  }
}

// The codes of 32 contiguous elements x[0, 32) of a block of shared exponent e (inv = 2^-e),
// stored from out (where element 0's code goes). fp4: the codes of elements 2j and 2j + 1 are
// computed in lane j of two registers (load32_by_parity) and pair into byte j with a shift and an
// or; bf16 / fp16 "rint" in 16-bit lanes where the format, the exponent and the values allow
// (the encoders of Rint16).
template <bool kFp4, typename scalar_t, typename Encode>
OPENNPU_VEC_INLINE void encode32(const scalar_t* x, int e, __m512 inv, uint8_t* out,
                                 const Encode& encode) {
  if constexpr (requires { typename Encode::half_type; }) {
    static_assert(std::is_same_v<typename Encode::half_type, scalar_t>);
    if (e >= encode.min_exp_16 && encode.store32(x, e, out)) return;
  }
  if constexpr (kFp4) {
    __m512 even, odd;
    load32_by_parity(x, even, odd);
    const __m512i low = encode(_mm512_mul_ps(even, inv)), high = encode(_mm512_mul_ps(odd, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm512_cvtepi32_epi8(_mm512_or_si512(low, _mm512_slli_epi32(high, 4))));
  } else {
    store16<false>(out, 0, encode(_mm512_mul_ps(load16(x), inv)));
    store16<false>(out, 16, encode(_mm512_mul_ps(load16(x + 16), inv)));
  }
}

// One block of n contiguous elements (n <= bs; x and out at its start): its e8m0 scale and codes.
template <bool kFp4, typename scalar_t, typename Encode>
OPENNPU_VEC_INLINE void quantise_block(const scalar_t* x, int64_t n, uint8_t* out, uint8_t* scale,
                                       const MxFormat& fmt, int64_t scale_alg, float low_bound,
                                       const Encode& encode) {
  const auto exponent = [&](__m512i top) {
    const int e = shared_exponent(std::bit_cast<float>(_mm512_reduce_max_epu32(top)), fmt,
                                  scale_alg, low_bound);
    *scale = e == kNanExp ? uint8_t{0xFF} : static_cast<uint8_t>(e + 127);
    if (e == kNanExp) std::fill(out, out + (kFp4 ? n / 2 : n), uint8_t{0});
    return e;
  };
  if (n == 32) {  // the common block: two registers, loaded once
    const __m512 a = load16(x), b = load16(x + 16);
    const int e = exponent(_mm512_max_epu32(magnitude_bits(a), magnitude_bits(b)));
    if (e == kNanExp) return;
    encode32<kFp4>(x, e, _mm512_set1_ps(pow2(-e)), out, encode);
    return;
  }
  __m512i top = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) top = _mm512_max_epu32(top, magnitude_bits(load16(x + i)));
  if (i < n) top = _mm512_max_epu32(top, magnitude_bits(load16_n(x + i, n - i)));
  const int e = exponent(top);
  if (e == kNanExp) return;
  const __m512 inv = _mm512_set1_ps(pow2(-e));
  for (i = 0; i + 16 <= n; i += 16) {
    store16<kFp4>(out, i, encode(_mm512_mul_ps(load16(x + i), inv)));
  }
  if (i < n) store16<kFp4>(out, i, encode(_mm512_mul_ps(load16_n(x + i, n - i), inv)), n - i);
}

// Lane j: the maximum of m[j]'s 16 lanes (unsigned), for 16 vectors at once: a transposing tree
// of pairwise maxima (halves, quarters, pairs of lanes, lanes), 45 operations where 16
// horizontal reductions take about 130. Level by level, each vector holds the partial maxima of
// twice as many blocks in half as many lanes each; the last level leaves block c + 4i in lane
// 4c + i, put in order by one permutation.
OPENNPU_VEC_INLINE __m512i block_maxima(__m512i m[16]) {
  __m512i t[8], u[4], s[2];
  for (int k = 0; k < 8; ++k) {  // lanes 0-7: block 2k, 8-15: block 2k + 1
    t[k] = _mm512_max_epu32(_mm512_shuffle_i64x2(m[2 * k], m[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_i64x2(m[2 * k], m[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int k = 0; k < 4; ++k) {  // 128-bit chunk c: block 4k + c
    u[k] = _mm512_max_epu32(_mm512_shuffle_i32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int k = 0; k < 2; ++k) {  // chunk c: 64-bit half 0 block 8k + c, half 1 block 8k + 4 + c
    s[k] = _mm512_max_epu32(_mm512_unpacklo_epi64(u[2 * k], u[2 * k + 1]),
                            _mm512_unpackhi_epi64(u[2 * k], u[2 * k + 1]));
  }
  const auto pick = [&](int imm_even) {  // dwords 0, 2 (or 1, 3) of each chunk of s0, then s1
    return imm_even ? _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(s[0]),
                                                            _mm512_castsi512_ps(s[1]),
                                                            _MM_SHUFFLE(2, 0, 2, 0)))
                    : _mm512_castps_si512(_mm512_shuffle_ps(_mm512_castsi512_ps(s[0]),
                                                            _mm512_castsi512_ps(s[1]),
                                                            _MM_SHUFFLE(3, 1, 3, 1)));
  };
  const __m512i r = _mm512_max_epu32(pick(1), pick(0));  // lane 4c + i: block c + 4i
  return _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// Sixteen full blocks of bs contiguous elements (x, out and scale at the first): the shared
// exponents of all sixteen from one vector of block maxima (scale_alg 0 in lanes, the same
// integer arithmetic as shared_exponent: a subnormal or zero maximum gives -127 like any value
// below 2^(emax - 127); scale_alg 1 per lane through shared_exponent), the sixteen e8m0 codes in
// one store, then each block's codes as quantise_block makes them.
template <bool kFp4, typename scalar_t, typename Encode>
OPENNPU_VEC_INLINE void quantise_16_blocks(const scalar_t* x, int64_t bs, uint8_t* out,
                                           uint8_t* scale, const MxFormat& fmt, int64_t scale_alg,
                                           float low_bound, const Encode& encode) {
  __m512i m[16];
  __m512i top;
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (int j = 0; j < 16; ++j) {
      const scalar_t* blk = x + j * bs;
      m[j] = _mm512_max_epu32(magnitude_bits(load16(blk)), magnitude_bits(load16(blk + 16)));
      for (int64_t i = 32; i < bs; i += 16) {
        m[j] = _mm512_max_epu32(m[j], magnitude_bits(load16(blk + i)));
      }
    }
    top = block_maxima(m);
  } else {
    // bf16 / fp16: the maxima of the 16-bit magnitudes' bits (ordered as the values, NaN above
    // inf, as the fp32 bits they convert to), 32 elements a register; the block's maximum is
    // then converted once.
    const __m512i mask = _mm512_set1_epi16(0x7FFF);
    for (int j = 0; j < 16; ++j) {
      const scalar_t* blk = x + j * bs;
      __m512i h = _mm512_and_si512(_mm512_loadu_si512(blk), mask);
      for (int64_t i = 32; i < bs; i += 32) {
        h = _mm512_max_epu16(h, _mm512_and_si512(_mm512_loadu_si512(blk + i), mask));
      }
      m[j] = _mm512_max_epu32(_mm512_and_si512(h, _mm512_set1_epi32(0xFFFF)),
                              _mm512_srli_epi32(h, 16));
    }
    const __m512i top16 = block_maxima(m);
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      top = _mm512_slli_epi32(top16, 16);
    } else {
      top = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(top16)));
    }
  }
  __m512i e;
  __mmask16 nan;
  if (scale_alg == 0) {
    const __m512i biased = _mm512_srli_epi32(top, 23);
    e = _mm512_max_epi32(_mm512_sub_epi32(biased, _mm512_set1_epi32(127 + fmt.emax)),
                         _mm512_set1_epi32(-127));
    nan = static_cast<__mmask16>(_mm512_cmpge_epu32_mask(top, _mm512_set1_epi32(0x7F800000)) |
                                 _mm512_cmpgt_epi32_mask(e, _mm512_set1_epi32(127)));
  } else {
    alignas(64) uint32_t tops[16];
    alignas(64) int32_t exps[16];
    _mm512_store_si512(tops, top);
    for (int j = 0; j < 16; ++j) {
      exps[j] = shared_exponent(std::bit_cast<float>(tops[j]), fmt, scale_alg, low_bound);
    }
    e = _mm512_load_si512(exps);
    nan = _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(kNanExp));
  }
  const __m512i codes = _mm512_mask_blend_epi32(nan, _mm512_add_epi32(e, _mm512_set1_epi32(127)),
                                                _mm512_set1_epi32(0xFF));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(scale), _mm512_cvtepi32_epi8(codes));
  // 2^-e as pow2 makes it: normal down to 2^-126, 2^-127 the subnormal 0x00400000
  const __m512i inv_bits = _mm512_mask_blend_epi32(
      _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(127)),
      _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(127), e), 23),
      _mm512_set1_epi32(0x00400000));
  alignas(64) float invs[16];
  alignas(64) int32_t exps[16];
  _mm512_store_si512(invs, inv_bits);
  _mm512_store_si512(exps, e);
  const int64_t out_block = kFp4 ? bs / 2 : bs;
  if constexpr (requires { typename Encode::half_type; }) {
    // the common case in one loop (its constants in registers): every block finite, of an
    // exponent the 16-bit lanes take
    if (nan == 0 &&
        _mm512_cmpge_epi32_mask(e, _mm512_set1_epi32(encode.min_exp_16)) == 0xFFFF) {
      for (int j = 0; j < 16; ++j) {
        const __m512 inv = _mm512_set1_ps(invs[j]);
        for (int64_t i = 0; i < bs; i += 32) {
          uint8_t* o = out + j * out_block + (kFp4 ? i / 2 : i);
          if (!encode.store32(x + j * bs + i, exps[j], o)) {
            encode32<kFp4>(x + j * bs + i, exps[j], inv, o, static_cast<const RintLanes&>(encode));
          }
        }
      }
      return;
    }
  }
  for (int j = 0; j < 16; ++j) {
    const scalar_t* blk = x + j * bs;
    uint8_t* o = out + j * out_block;
    if ((nan >> j) & 1) {
      std::fill(o, o + out_block, uint8_t{0});
      continue;
    }
    const __m512 inv = _mm512_set1_ps(invs[j]);
    for (int64_t i = 0; i < bs; i += 32) {
      encode32<kFp4>(blk + i, exps[j], inv, o + (kFp4 ? i / 2 : i), encode);
    }
  }
}

// Blocks along another axis (post > 1): rows [i0, i0 + rows) of line p, x and out at its
// column 0 (row stride post), its scales at column 0 (stride 2). Sixteen columns at a time, lane
// j for column q + j: the block maxima are lane-wise maxima over the rows (no horizontal
// reduction), the shared exponents found per lane, then each row scaled and encoded in the same
// lanes (a NaN block's lanes written as code 0).
template <bool kFp4, typename scalar_t, typename Encode>
void quantise_columns(const scalar_t* x, int64_t rows, int64_t post, uint8_t* out,
                      uint8_t* scale, const MxFormat& fmt, int64_t scale_alg, float low_bound,
                      const Encode& encode) {
  const int64_t out_row = kFp4 ? post / 2 : post;  // fp4: post is even (it holds the last dim)
  for (int64_t q = 0; q < post; q += 16) {
    const int64_t n = std::min<int64_t>(16, post - q);
    const auto load = [&](int64_t r) {
      return n == 16 ? load16(x + r * post + q) : load16_n(x + r * post + q, n);
    };
    __m512i top = _mm512_setzero_si512();
    for (int64_t r = 0; r < rows; ++r) top = _mm512_max_epu32(top, magnitude_bits(load(r)));
    alignas(64) uint32_t tops[16];
    alignas(64) float invs[16];
    _mm512_store_si512(tops, top);
    __mmask16 finite = 0;
    for (int64_t j = 0; j < n; ++j) {
      const int e = shared_exponent(std::bit_cast<float>(tops[j]), fmt, scale_alg, low_bound);
      scale[2 * (q + j)] = e == kNanExp ? uint8_t{0xFF} : static_cast<uint8_t>(e + 127);
      invs[j] = e == kNanExp ? 0.f : pow2(-e);
      finite |= static_cast<__mmask16>((e == kNanExp ? 0u : 1u) << j);
    }
    const __m512 inv = _mm512_maskz_load_ps(static_cast<__mmask16>((1u << n) - 1), invs);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i c = encode(_mm512_mul_ps(load(r), inv));
      store16<kFp4>(out + r * out_row, q, _mm512_maskz_mov_epi32(finite, c), n);
    }
  }
}

// Every block of units [begin, end) (unit = line p * blocks + block b), float8 with "rint" or
// fp4 in any mode.
template <typename scalar_t>
void quantise_units(const scalar_t* px, int64_t begin, int64_t end, int64_t d, int64_t post,
                    int64_t bs, const MxFormat& fmt, MxRound round, int64_t scale_alg,
                    float low_bound, uint8_t* codes, uint8_t* scales) {
  const int64_t blocks = (d + bs - 1) / bs, pairs = (blocks + 1) / 2;
  const auto run = [&](auto fp4, const auto& encode) {
    constexpr bool kFp4 = decltype(fp4)::value;
    if (post == 1) {
      const int64_t full = d / bs;  // blocks of a row with bs elements
      for (int64_t unit = begin; unit < end;) {
        const int64_t p = unit / blocks, b = unit % blocks, i0 = b * bs;
        uint8_t* out = codes + (kFp4 ? (p * d + i0) / 2 : p * d + i0);
        if (b + 16 <= full && unit + 16 <= end) {
          quantise_16_blocks<kFp4>(px + p * d + i0, bs, out, scales + p * pairs * 2 + b, fmt,
                                   scale_alg, low_bound, encode);
          unit += 16;
        } else {
          quantise_block<kFp4>(px + p * d + i0, std::min(bs, d - i0), out,
                               scales + p * pairs * 2 + b, fmt, scale_alg, low_bound, encode);
          unit += 1;
        }
      }
      return;
    }
    for (int64_t unit = begin, p = begin / blocks, b = begin % blocks; unit < end;
         ++unit, b = b + 1 == blocks ? 0 : b + 1, p += b == 0) {
      const int64_t i0 = b * bs, k0 = (p * d + i0) * post;  // the block's first element
      uint8_t* out = codes + (kFp4 ? k0 / 2 : k0);
      uint8_t* scale = scales + ((p * pairs + b / 2) * post) * 2 + (b & 1);
      quantise_columns<kFp4>(px + k0, std::min(bs, d - i0), post, out, scale, fmt, scale_alg,
                             low_bound, encode);
    }
  };
  if (!fmt.fp4) {
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      run(std::false_type{}, Bf16Fp8Rint(fmt));
    } else {
      run(std::false_type{}, RintLanes(fmt));
    }
  } else if (round == MxRound::kRint) {
    if constexpr (!std::is_same_v<scalar_t, float>) {
      run(std::true_type{}, Fp4Rint16<scalar_t>(fmt));
    } else {
      run(std::true_type{}, RintLanes(fmt));
    }
  } else if (round == MxRound::kRound) {
    run(std::true_type{}, Fp4Lanes<MxRound::kRound>(fmt));
  } else {
    run(std::true_type{}, Fp4Lanes<MxRound::kFloor>(fmt));
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// The AVX2 build's lane form of the common MX unit: a contiguous block of 32 elements (post ==
// 1), float8 or fp4 with "rint", in fp32 lanes, 8 a register; the other units take the scalar
// loops. The values are the scalar path's bit for bit: the block maximum is the unsigned maximum
// of the magnitudes' bit patterns (as the scalar reduction), the shared exponent is the scalar
// function's (or, eight blocks at a time, its scale_alg 0 arithmetic in lanes), x * 2^-e is the
// same IEEE product, and the codes are RintEncoder's arithmetic on the bits of min(|t|, max_norm)
// with t's sign, which is x's (2^-e > 0), taken for 32 codes at once by signed saturating packs
// (as RintLanes on AVX-512: clamping before rounding saturates as the scalar clamp does, and a
// block holding a NaN or an inf has the NaN exponent, so every quotient encoded here is finite).

// 8 elements of src_t as fp32 lanes (exact: bf16 shifted up, fp16 widened by vcvtph2ps).
template <typename src_t>
OPENNPU_VEC_INLINE __m256 load8(const src_t* p) {
  if constexpr (std::is_same_v<src_t, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    if constexpr (std::is_same_v<src_t, at::BFloat16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

struct RintLanes8 {
  __m128i shift;
  __m256i max_bits, round_less_rebias, min_normal_bits;
  __m256 units, two23;

  explicit RintLanes8(const MxFormat& f) : RintLanes8(RintEncoder(f), f.max_norm) {}
  RintLanes8(const RintEncoder& e, float max_norm)
      : shift(_mm_cvtsi32_si128(static_cast<int>(e.shift))),
        max_bits(_mm256_set1_epi32(static_cast<int>(std::bit_cast<uint32_t>(max_norm)))),
        round_less_rebias(_mm256_set1_epi32(static_cast<int>(e.round_less_rebias()))),
        min_normal_bits(_mm256_set1_epi32(static_cast<int>(e.min_normal_bits))),
        units(_mm256_set1_ps(e.units)),
        two23(_mm256_set1_ps(RintEncoder::kTwo23)) {}

  // The codes of 8 finite quotients' magnitudes |t|, one per 32-bit lane, without the sign
  // (encode_block32_avx2 adds it for 32 codes at once).
  OPENNPU_VEC_INLINE __m256i operator()(__m256 t) const {
    const __m256i bits = _mm256_castps_si256(t);
    const __m256i mag =
        _mm256_min_epu32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)), max_bits);
    const __m256i lsb = _mm256_and_si256(_mm256_srl_epi32(mag, shift), _mm256_set1_epi32(1));
    const __m256i normal = _mm256_srl_epi32(
        _mm256_add_epi32(_mm256_add_epi32(mag, round_less_rebias), lsb), shift);
    const __m256i subnormal = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_fmadd_ps(_mm256_castsi256_ps(mag), units, two23)),
        _mm256_castps_si256(two23));
    // both sides below 2^31: the signed comparison orders them as the unsigned one would
    const __m256i small = _mm256_cmpgt_epi32(min_normal_bits, mag);
    return _mm256_blendv_epi8(normal, subnormal, small);
  }
};

// The codes of a block of 32 contiguous elements x[0, 32) of shared exponent e (inv = 2^-e, not
// the NaN exponent), stored at out (float8: 32 bytes; fp4: 16, element 2j in the low nibble of
// byte j).
template <typename scalar_t>
OPENNPU_VEC_INLINE void encode_block32_avx2(const scalar_t* x, __m256 inv, bool fp4,
                                            const RintLanes8& encode, uint8_t* out) {
  __m256i c[4], v[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 xv = load8(x + 8 * k);
    v[k] = _mm256_castps_si256(xv);
    c[k] = encode(_mm256_mul_ps(xv, inv));
  }
  // codes <= 0x7F: the unsigned saturating packs keep them; the signed ones keep each element's
  // sign bit (x's, which the quotient by 2^e > 0 has too, a -0.0 included) as its byte's bit 7.
  // Per 128-bit half the 4-byte groups come out as c0 c1 c2 c3 (elements 0-3, 8-11, ... low
  // half; 4-7, 12-15, ... high half), the same order for both.
  const __m256i magnitudes =
      _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
  const __m256i signs = _mm256_and_si256(
      _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3])),
      _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  if (!fp4) {
    const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_or_si256(magnitudes, signs), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
    return;
  }
  // fp4: the sign is the code's bit 3 (bit 7 of each byte moved down by 4, within its byte);
  // byte j of the result = code 2j | code 2j + 1 << 4
  const __m256i packed = _mm256_permutevar8x32_epi32(
      _mm256_or_si256(magnitudes, _mm256_srli_epi16(signs, 4)), order);
  const __m256i pairs = _mm256_and_si256(_mm256_or_si256(packed, _mm256_srli_epi16(packed, 4)),
                                         _mm256_set1_epi16(0xFF));
  const __m256i bytes = _mm256_permute4x64_epi64(_mm256_packus_epi16(pairs, pairs), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(bytes));
}

// The magnitudes' bits of x[0, 32) reduced to 8 lanes by unsigned maxima (their order is the
// values', a NaN's above inf's, as the scalar reduction).
template <typename scalar_t>
OPENNPU_VEC_INLINE __m256i block32_maxima(const scalar_t* x) {
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  const auto mag = [&](int k) {
    return _mm256_and_si256(_mm256_castps_si256(load8(x + 8 * k)), magnitude);
  };
  return _mm256_max_epu32(_mm256_max_epu32(mag(0), mag(1)), _mm256_max_epu32(mag(2), mag(3)));
}

// The e8m0 scale of a block of shared exponent e (the NaN exponent: 0xFF) at *scale, and its codes
// at out (a NaN block's all 0, as the scalar path's).
template <typename scalar_t>
OPENNPU_VEC_INLINE void finish_block32_avx2(const scalar_t* x, int e, const MxFormat& fmt,
                                            const RintLanes8& encode, uint8_t* out,
                                            uint8_t* scale) {
  *scale = e == kNanExp ? uint8_t{0xFF} : static_cast<uint8_t>(e + 127);
  if (e == kNanExp) {
    std::fill(out, out + (fmt.fp4 ? 16 : 32), uint8_t{0});
    return;
  }
  encode_block32_avx2(x, _mm256_set1_ps(pow2(-e)), fmt.fp4, encode, out);
}

// One block of 32 contiguous elements x[0, 32): its scale at *scale, its codes at out.
template <typename scalar_t>
OPENNPU_VEC_INLINE void quantise_block32_avx2(const scalar_t* x, uint8_t* out, uint8_t* scale,
                                              const MxFormat& fmt, int64_t scale_alg,
                                              float low_bound, const RintLanes8& encode) {
  const __m256i m8 = block32_maxima(x);
  __m128i m4 = _mm_max_epu32(_mm256_castsi256_si128(m8), _mm256_extracti128_si256(m8, 1));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0x4E));
  m4 = _mm_max_epu32(m4, _mm_shuffle_epi32(m4, 0xB1));
  const uint32_t top = static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
  const int e = shared_exponent(std::bit_cast<float>(top), fmt, scale_alg, low_bound);
  finish_block32_avx2(x, e, fmt, encode, out, scale);
}

// bf16 / fp16 blocks in their own 16-bit lanes, 16 a register (the AVX-512 build's Rint16
// arithmetic, Fp4Rint16 and Bf16Fp8Rint: the reasoning, the exactness of t = x * 2^-e taken off
// the exponent field with a saturating subtraction, and the exponent bound min_exp_16 are
// theirs, see there): fp4 "rint" from bf16 or fp16, and float8 from bf16, for blocks of shared
// exponent e >= min_exp_16; every other block (and format, and fp16 to float8) takes the fp32
// lanes. kind is kNone where this dtype and format have no 16-bit form.
template <typename scalar_t>
struct Half16Lanes {
  enum Kind { kNone, kFp4, kFp8 };
  static constexpr int kMantissaBits = Half16Format<scalar_t>::kMantissaBits;
  Kind kind = kNone;
  int min_exp_16 = 0;
  __m256i above[7];  // fp4: |t|'s code is at least k + 1 iff its bits > above[k] (signed)
  __m256i max_bits, round_less_rebias, min_normal_bits, half_spacing_bits;  // float8
  int shift = 0;

  explicit Half16Lanes(const MxFormat& f) {
    if constexpr (std::is_same_v<scalar_t, float>) {
      return;
    } else if (f.fp4) {
      kind = kFp4;
      min_exp_16 = Half16Format<scalar_t>::kFp4MinExp;
      const std::array<int16_t, 7> bits = Half16Format<scalar_t>::fp4_above(f);
      for (int k = 0; k < 7; ++k) above[k] = _mm256_set1_epi16(bits[k]);
    } else if constexpr (Half16Format<scalar_t>::kBf16) {
      const Bf16Fp8Format c(f);
      kind = kFp8;
      min_exp_16 = c.min_exp_16;
      max_bits = _mm256_set1_epi16(c.max_bits);
      round_less_rebias = _mm256_set1_epi16(c.round_less_rebias);
      min_normal_bits = _mm256_set1_epi16(c.min_normal_bits);
      half_spacing_bits = _mm256_set1_epi16(c.half_spacing_bits);
      shift = c.shift;
    }
  }

  // |x| * 2^-e as 16-bit patterns (signed), x's bits in w
  static OPENNPU_VEC_INLINE __m256i scaled_magnitude(__m256i w, int e) {
    return _mm256_subs_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7FFF)),
                             _mm256_set1_epi16(static_cast<int16_t>(e * (1 << kMantissaBits))));
  }

  // The codes of the block x[0, 32) of shared exponent e (not the NaN exponent) at out, or false
  // (nothing stored) where the fp32 lanes must encode it.
  OPENNPU_VEC_INLINE bool store32(const scalar_t* x, int e, uint8_t* out) const {
    if (e < min_exp_16) return false;  // (kind != kNone: the caller's test)
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
    if (kind == kFp4) {
      store_fp4(w0, w1, e, out);
      return true;
    }
    return store_fp8(w0, w1, e, out);
  }

 private:
  // fp4: the number of rounding thresholds below |t|, the sign (bit 15 of x) as bit 3; byte j of
  // the 16 stored = code 2j | code 2j + 1 << 4
  OPENNPU_VEC_INLINE void store_fp4(__m256i w0, __m256i w1, int e, uint8_t* out) const {
    const auto codes = [&](__m256i w) {
      const __m256i t = scaled_magnitude(w, e);
      __m256i c = _mm256_and_si256(_mm256_srli_epi16(w, 12), _mm256_set1_epi16(0x8));
      for (int k = 0; k < 7; ++k) c = _mm256_sub_epi16(c, _mm256_cmpgt_epi16(t, above[k]));
      // each 32-bit lane's two codes into its low byte
      return _mm256_and_si256(_mm256_or_si256(c, _mm256_srli_epi32(c, 12)),
                              _mm256_set1_epi32(0xFF));
    };
    // per 128-bit half the packs give pairs 0-3 and 8-11 (low half), 4-7 and 12-15 (high)
    const __m256i words = _mm256_packus_epi32(codes(w0), codes(w1));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(words, words),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(bytes));
  }

  // float8 from bf16: RintEncoder's normal-range arithmetic on the bits of min(|t|, max_norm);
  // |t| below the smallest normal is code 0 up to half the subnormal spacing, and a block with a
  // magnitude in [half the spacing, smallest normal) is left to the fp32 lanes (false)
  OPENNPU_VEC_INLINE bool store_fp8(__m256i w0, __m256i w1, int e, uint8_t* out) const {
    const __m256i t0 = _mm256_min_epi16(scaled_magnitude(w0, e), max_bits);
    const __m256i t1 = _mm256_min_epi16(scaled_magnitude(w1, e), max_bits);
    const __m256i small0 = _mm256_cmpgt_epi16(min_normal_bits, t0);
    const __m256i small1 = _mm256_cmpgt_epi16(min_normal_bits, t1);
    const __m256i subnormal =
        _mm256_or_si256(_mm256_and_si256(small0, _mm256_cmpgt_epi16(t0, half_spacing_bits)),
                        _mm256_and_si256(small1, _mm256_cmpgt_epi16(t1, half_spacing_bits)));
    if (!_mm256_testz_si256(subnormal, subnormal)) return false;
    const auto normal = [&](__m256i t, __m256i small) {
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi16(t, shift), _mm256_set1_epi16(1));
      return _mm256_andnot_si256(
          small, _mm256_srli_epi16(_mm256_add_epi16(_mm256_add_epi16(t, round_less_rebias), lsb),
                                   shift));
    };
    // codes <= 0x7F and x's sign as bit 7, both by saturating packs (per 128-bit half: elements
    // 0-7, 16-23 low, 8-15, 24-31 high; the qword permute restores the order)
    const __m256i codes = _mm256_packus_epi16(normal(t0, small0), normal(t1, small1));
    const __m256i signs = _mm256_and_si256(_mm256_packs_epi16(w0, w1),
                                           _mm256_set1_epi8(static_cast<char>(0x80)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                        _mm256_permute4x64_epi64(_mm256_or_si256(codes, signs), 0xD8));
    return true;
  }
};

// One level of a transposing tree of unsigned maxima (kLane-bit lanes): out[k] = the maximum of
// in[2k] and in[2k + 1] interleaved in kBits-bit pieces (unpacklo against unpackhi), k < n / 2.
template <int kLane, int kBits>
OPENNPU_VEC_INLINE void interleaved_maxima(const __m256i* in, int n, __m256i* out) {
  for (int k = 0; k < n / 2; ++k) {
    const __m256i a = in[2 * k], b = in[2 * k + 1];
    __m256i lo, hi;
    if constexpr (kBits == 16) {
      lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
    } else if constexpr (kBits == 32) {
      lo = _mm256_unpacklo_epi32(a, b), hi = _mm256_unpackhi_epi32(a, b);
    } else {
      static_assert(kBits == 64);
      lo = _mm256_unpacklo_epi64(a, b), hi = _mm256_unpackhi_epi64(a, b);
    }
    out[k] = kLane == 16 ? _mm256_max_epu16(lo, hi) : _mm256_max_epu32(lo, hi);
  }
}

// Lane k: the magnitude bits (as fp32) of the maximum of block k of eight consecutive blocks of
// 32 contiguous elements, by a transposing tree of pairwise maxima (21 operations where eight
// horizontal reductions take 56). bf16 / fp16 reduce in their own 16-bit lanes (16 elements a
// register, their magnitudes' bits ordered as the values, a NaN's above inf's), and only the
// eight maxima are widened (exactly) to fp32 bits: the same maxima as the fp32 lanes give.
template <typename scalar_t>
OPENNPU_VEC_INLINE __m256i eight_block_maxima(const scalar_t* x) {
  __m256i m[8], t[4], u[2];
  if constexpr (std::is_same_v<scalar_t, float>) {
    for (int k = 0; k < 8; ++k) m[k] = block32_maxima(x + 32 * k);
    // per 128-bit half: pairs of blocks interleaved, then quadruples, then the halves: lane k
    // ends with block k's maximum
    interleaved_maxima<32, 32>(m, 8, t);
    interleaved_maxima<32, 64>(t, 4, u);
    return _mm256_max_epu32(_mm256_permute2x128_si256(u[0], u[1], 0x20),
                            _mm256_permute2x128_si256(u[0], u[1], 0x31));
  } else {
    const __m256i magnitude = _mm256_set1_epi16(0x7FFF);
    const auto half = [&](int k, int i) {
      return _mm256_and_si256(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * k + 16 * i)), magnitude);
    };
    for (int k = 0; k < 8; ++k) m[k] = _mm256_max_epu16(half(k, 0), half(k, 1));
    // 16-bit lanes interleaved pairwise, then by 32 bits: word k of each quadword of u[0]
    // (u[1]) holds a partial maximum of block k (k + 4); w puts blocks 0-3 in quadword 0 and
    // 4-7 in quadword 1 of each 128-bit half, whose maximum is words 0-7 = blocks 0-7
    interleaved_maxima<16, 16>(m, 8, t);
    interleaved_maxima<16, 32>(t, 4, u);
    __m256i w;
    interleaved_maxima<16, 64>(u, 2, &w);
    const __m128i top16 = _mm_max_epu16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      return _mm256_slli_epi32(_mm256_cvtepu16_epi32(top16), 16);
    } else {
      return _mm256_castps_si256(_mm256_cvtph_ps(top16));
    }
  }
}

// Eight consecutive blocks of 32 contiguous elements (x, out and scale at the first), scale_alg 0:
// the blocks' maxima (eight_block_maxima), their shared exponents in lanes (shared_exponent's
// scale_alg 0 arithmetic: NaN or inf -> the NaN exponent; floor(log2 amax) from the exponent
// field, or, for a subnormal maximum, from the exact int -> float conversion of its bits; minus
// emax, at least -127, which a zero maximum gets too), then each block scaled and encoded.
template <typename scalar_t>
OPENNPU_VEC_INLINE void quantise_8_blocks_avx2(const scalar_t* x, uint8_t* out, uint8_t* scale,
                                               const MxFormat& fmt, const RintLanes8& encode,
                                               const Half16Lanes<scalar_t>& half16) {
  // the group 2 KiB ahead asked for now: the stream is sequential, yet in-cache (L3) timings
  // on a Zen 4 VM gained 7-13% (one thread, 1M elements, every dtype and format), the
  // hardware prefetchers alone leaving the loads waiting
  const char* ahead = reinterpret_cast<const char*>(x) + 2048;
  for (int64_t b = 0; b < 256 * static_cast<int64_t>(sizeof(scalar_t)); b += 64) {
    __builtin_prefetch(ahead + b, 0, 3);
  }
  const __m256i top = eight_block_maxima(x);
  // top <= 0x7FFFFFFF: signed comparisons order the bits as the magnitudes
  const __m256i special = _mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x7F7FFFFF));
  const __m256i biased = _mm256_srli_epi32(top, 23);
  const __m256i subnormal_log2 = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(top)), 23),
      _mm256_set1_epi32(127 + 149));  // top < 2^23 there: the conversion is exact
  const __m256i log2 = _mm256_blendv_epi8(_mm256_sub_epi32(biased, _mm256_set1_epi32(127)),
                                          subnormal_log2,
                                          _mm256_cmpeq_epi32(biased, _mm256_setzero_si256()));
  const __m256i e = _mm256_blendv_epi8(
      _mm256_max_epi32(_mm256_sub_epi32(log2, _mm256_set1_epi32(fmt.emax)),
                       _mm256_set1_epi32(-127)),
      _mm256_set1_epi32(kNanExp), special);
  alignas(32) int32_t es[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(es), e);
  const int64_t out_block = fmt.fp4 ? 16 : 32;
  if (half16.kind == Half16Lanes<scalar_t>::kNone) {
    for (int k = 0; k < 8; ++k) {
      finish_block32_avx2(x + 32 * k, es[k], fmt, encode, out + out_block * k, scale + k);
    }
    return;
  }
  for (int k = 0; k < 8; ++k) {
    uint8_t* o = out + out_block * k;
    if (es[k] != kNanExp && half16.store32(x + 32 * k, es[k], o)) {
      scale[k] = static_cast<uint8_t>(es[k] + 127);
      continue;
    }
    finish_block32_avx2(x + 32 * k, es[k], fmt, encode, o, scale + k);
  }
}
#endif

void mx_quant_kernel(const at::Tensor& x, int64_t pre, int64_t d, int64_t post, int64_t bs,
                     const MxFormat& fmt, MxRound round, int64_t scale_alg, float max_low_bound,
                     uint8_t* codes, uint8_t* scales) {
  const int64_t blocks = (d + bs - 1) / bs;
  const int64_t pairs = (blocks + 1) / 2;
  OPENNPU_MX_DISPATCH(x.scalar_type(), "npu_dynamic_mx_quant", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(bs * post, 1));
    at::parallel_for(0, pre * blocks, grain, [&](int64_t begin, int64_t end) {
#if defined(CPU_CAPABILITY_AVX512)
      // float8 takes "rint" only, so every block goes here; other ISAs take the loops below
      quantise_units(px, begin, end, d, post, bs, fmt, round, scale_alg, max_low_bound, codes,
                     scales);
      return;
#endif
      std::vector<float> amax(post);
      std::vector<int> exps(post);
      const RintEncoder rint_encoder(fmt);
#if defined(CPU_CAPABILITY_AVX2)
      const bool lanes = post == 1 && round == MxRound::kRint;
      const RintLanes8 rint_lanes(fmt);
      const Half16Lanes<scalar_t> half16_lanes(fmt);
#endif
      // The code of flat element k: fp4 codes two a byte, element 2j in the low nibble. A unit's
      // elements are visited in order and each byte's pair lies in one unit (the last dim is even
      // for fp4, block starts are multiples of 32), so a byte's low nibble is written first.
      const auto put = [&](int64_t k, uint8_t c) {
        if (!fmt.fp4) {
          codes[k] = c;
        } else if ((k & 1) == 0) {
          codes[k / 2] = c;
        } else {
          codes[k / 2] |= static_cast<uint8_t>(c << 4);
        }
      };
      // unit = p * blocks + b, stepped without a division per block
      for (int64_t unit = begin, p = begin / blocks, b = begin % blocks; unit < end;
           ++unit, b = b + 1 == blocks ? 0 : b + 1, p += b == 0) {
        const int64_t i0 = b * bs, i1 = std::min(d, i0 + bs);
#if defined(CPU_CAPABILITY_AVX2)
        if (lanes && i1 - i0 == 32) {
          const scalar_t* xb = px + p * d + i0;
          uint8_t* out = codes + (fmt.fp4 ? (p * d + i0) / 2 : p * d + i0);
          uint8_t* scale = scales + p * pairs * 2 + b;
          if (scale_alg == 0 && bs == 32 && i0 + 8 * 32 <= d && unit + 8 <= end) {
            quantise_8_blocks_avx2(xb, out, scale, fmt, rint_lanes, half16_lanes);
            unit += 7;  // and the loop's step: 8 blocks of this row (b + 8 <= blocks)
            b += 7;
            continue;
          }
          quantise_block32_avx2(xb, out, scale, fmt, scale_alg, max_low_bound, rint_lanes);
          continue;
        }
#endif
        if (post == 1) {
          // A contiguous block: the max of the magnitudes' bit patterns, which order as the
          // magnitudes do, with NaN's above inf's (so a NaN still makes the block's amax NaN);
          // a reduction in a register that vectorises, not a read-modify-write of amax[0].
          uint32_t top = 0;
          const scalar_t* row = px + p * d;
          for (int64_t i = i0; i < i1; ++i) {
            top = std::max(top, std::bit_cast<uint32_t>(static_cast<float>(row[i])) & 0x7FFFFFFFu);
          }
          amax[0] = std::bit_cast<float>(top);
        } else {
          std::fill(amax.begin(), amax.end(), 0.f);
          for (int64_t i = i0; i < i1; ++i) {
            const scalar_t* row = px + (p * d + i) * post;
            for (int64_t q = 0; q < post; ++q) {
              const float v = static_cast<float>(row[q]);
              amax[q] = std::isnan(v) ? v : std::max(amax[q], std::fabs(v));
            }
          }
        }
        uint8_t* s = scales + ((p * pairs + b / 2) * post) * 2 + (b & 1);
        for (int64_t q = 0; q < post; ++q) {
          exps[q] = shared_exponent(amax[q], fmt, scale_alg, max_low_bound);
          s[2 * q] = exps[q] == kNanExp ? uint8_t{0xFF} : static_cast<uint8_t>(exps[q] + 127);
        }
        // float8 with "rint" (the only mode float8 takes): c10's conversion rounds to nearest
        // even at the format's precision, subnormals included, which is round_element's result
        // once saturated; so the clamped quotient converts directly.
        const bool direct = !fmt.fp4 && round == MxRound::kRint;
        if (direct && post == 1) {  // a contiguous block: one scale, a loop that vectorises
          const scalar_t* row = px + p * d;
          uint8_t* out = codes + p * d;
          if (exps[0] == kNanExp) {
            std::fill(out + i0, out + i1, uint8_t{0});
            continue;
          }
          const float inv = pow2(-exps[0]), lim = fmt.max_norm;
          for (int64_t i = i0; i < i1; ++i) {  // one product, nothing to contract it with
            const float t = static_cast<float>(row[i]) * inv;
            out[i] = rint_encoder.float8_code(std::clamp(t, -lim, lim));
          }
          continue;
        }
        for (int64_t i = i0; i < i1; ++i) {
          const scalar_t* row = px + (p * d + i) * post;
          const int64_t k0 = (p * d + i) * post;
          for (int64_t q = 0; q < post; ++q) {
            if (exps[q] == kNanExp) {
              put(k0 + q, 0);
              continue;
            }
            const float t = rounded(static_cast<float>(row[q]) * pow2(-exps[q]));
            if (direct) {
              const float c = std::clamp(t, -fmt.max_norm, fmt.max_norm);
              put(k0 + q, fmt.e4m3 ? c10::Float8_e4m3fn(c).x : c10::Float8_e5m2(c).x);
            } else {
              put(k0 + q, encode(round_element(t, fmt, round), fmt));
            }
          }
        }
      }
    });
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// block_quant_kernel's int8 codes of one block (`rows` rows of w elements, `stride` elements
// apart; inverse_of(amax) is the block's multiplier), the portable path's values from fewer
// instructions; returns the block's amax as the portable path finds it.
// - amax: the largest bit pattern of |x| (an unsigned max: for non-negative floats the integer
//   order is the float order, and a NaN's pattern is above inf's); a NaN block gets the NaN that
//   at::vec::maximum's propagation leaves (all bits set), so its scale is the same NaN.
// - codes: x * inv rounded half to even (vrndscaleps, as Vectorized::round), clamped to
//   [-qmax, qmax] and truncated to an integer (the portable path's float -> int8 cast: qmax may be
//   fractional), NaN lanes masked to 0 in that conversion; |code| <= 127, so vpmovsdb's
//   saturation changes nothing.
template <typename scalar_t, typename Inverse>
OPENNPU_VEC_INLINE float block_quant_int8_avx512(const scalar_t* x, int64_t rows, int64_t w,
                                                 int64_t stride, float qmax,
                                                 const Inverse& inverse_of, uint8_t* y) {
  const __mmask16 tail = _cvtu32_mask16((1u << (w % 16)) - 1);
  const int64_t full = w - w % 16;
  const __m512i sign_off = _mm512_set1_epi32(0x7fffffff);
  __m512i m = _mm512_setzero_si512();
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* row = x + r * stride;
    for (int64_t c = 0; c < full; c += 16) {
      m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(load16(row + c)), sign_off));
    }
    if (tail != 0) {
      const __m512 v = load16(row + full, tail);  // lanes past w are 0
      m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(v), sign_off));
    }
  }
  const uint32_t top = static_cast<uint32_t>(_mm512_reduce_max_epu32(m));
  const float amax = std::bit_cast<float>(top > 0x7f800000u ? 0xffffffffu : top);
  const __m512 vinv = _mm512_set1_ps(inverse_of(amax));
  const __m512 lo = _mm512_set1_ps(-qmax), hi = _mm512_set1_ps(qmax);
  auto code = [&](__m512 v) __attribute__((always_inline)) {
    const __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(v, vinv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __mmask16 number = _mm512_cmp_ps_mask(t, t, _CMP_ORD_Q);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
    return _mm512_cvtsepi32_epi8(_mm512_maskz_cvttps_epi32(number, c));
  };
  for (int64_t r = 0; r < rows; ++r) {
    const scalar_t* row = x + r * stride;
    uint8_t* out = y + r * stride;
    for (int64_t c = 0; c < full; c += 16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), code(load16(row + c)));
    }
    if (tail != 0) _mm_mask_storeu_epi8(out + full, tail, code(load16(row + full, tail)));
  }
  return amax;
}
#endif

void block_quant_kernel(const at::Tensor& x, int64_t rb, int64_t cb, float qmax, float min_scale,
                        int fp8, at::Tensor& y, at::Tensor& scale) {
  const int64_t batch = x.size(0), rows = x.size(1), cols = x.size(2);
  const int64_t srows = scale.size(1), scols = scale.size(2);
  float* ps = scale.mutable_data_ptr<float>();
  auto* py = static_cast<uint8_t*>(y.mutable_data_ptr());
  const float inv_min = min_scale > 0.f ? 1.f / min_scale : INFINITY;
  // op-plugin's golden multiplies by 127.0 / amax, which torch evaluates as amax.reciprocal()
  // * 127: two roundings, reproduced here.
  const auto inverse_of = [&](float amax) {
    return amax == 0.f ? 0.f : std::min(rounded(qmax * rounded(1.f / amax)), inv_min);
  };
  const auto scale_of = [&](float amax) {
    return amax == 0.f ? std::max(0.f, min_scale) : std::max(amax / qmax, min_scale);
  };
  OPENNPU_MX_DISPATCH(x.scalar_type(), "npu_dynamic_block_quant", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    at::parallel_for(0, batch * srows * scols, 1, [&](int64_t begin, int64_t end) {
      // unit = (bt * srows + sr) * scols + sc, stepped without a division per block
      int64_t sc = begin % scols, sr = begin / scols % srows, next_bt = begin / (srows * scols);
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t bt = next_bt, r0 = sr * rb, c0 = sc * cb;
        const int64_t r1 = std::min(rows, r0 + rb), c1 = std::min(cols, c0 + cb);
        if (++sc == scols) {
          sc = 0;
          if (++sr == srows) sr = 0, ++next_bt;
        }
#if defined(CPU_CAPABILITY_AVX512)
        if (fp8 == 0) {
          const int64_t first = (bt * rows + r0) * cols + c0;
          ps[unit] = scale_of(block_quant_int8_avx512<scalar_t>(px + first, r1 - r0, c1 - c0,
                                                                cols, qmax, inverse_of,
                                                                py + first));
          continue;
        }
#endif
        using Vec = at::vec::Vectorized<float>;
        using IO = VecPair<scalar_t>;
        Vec m0(0.f), m1(0.f);  // at::vec::maximum propagates NaN
        for (int64_t r = r0; r < r1; ++r) {
          const scalar_t* row = px + (bt * rows + r) * cols + c0;
          for_each_step<scalar_t>(c1 - c0, [&](int64_t i, int64_t len) {
            Vec a, b;
            IO::load(row + i, a, b, len);  // lanes past len are 0
            m0 = at::vec::maximum(m0, a.abs());
            m1 = at::vec::maximum(m1, b.abs());
          });
        }
        const float amax = at::vec::vec_reduce_all<float>(
            [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, at::vec::maximum(m0, m1));
        const float inv = inverse_of(amax);
        ps[unit] = scale_of(amax);
        const Vec vinv(inv), lo(-qmax), hi(qmax);
        for (int64_t r = r0; r < r1; ++r) {
          const scalar_t* row = px + (bt * rows + r) * cols + c0;
          uint8_t* out = py + (bt * rows + r) * cols + c0;
          if (fp8 != 0) {  // c10's conversion (an add inside: products kept rounded), or hifloat8's
            for (int64_t c = 0; c < c1 - c0; ++c) {
              const float t = std::clamp(rounded(static_cast<float>(row[c]) * inv), -qmax, qmax);
              out[c] = fp8 == 1   ? c10::Float8_e4m3fn(t).x
                       : fp8 == 2 ? c10::Float8_e5m2(t).x
                                  : float_to_hifloat8_table(t);
            }
            continue;
          }
          for_each_step<scalar_t>(c1 - c0, [&](int64_t i, int64_t len) {
            Vec a, b;
            IO::load(row + i, a, b, len);
            float q[IO::kStep];
            for (int h = 0; h < 2; ++h) {  // round half to even, saturate, NaN -> 0
              const Vec t = ((h == 0 ? a : b) * vinv).round();
              const Vec c = at::vec::minimum(at::vec::maximum(t, lo), hi);
              Vec::blendv(c, Vec(0.f), c.isnan()).store(q + h * Vec::size());
            }
            for (int64_t k = 0; k < len; ++k) {
              out[i + k] = static_cast<uint8_t>(static_cast<int8_t>(q[k]));
            }
          });
        }
      }
    });
  });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(mx_quant, &mx_quant_kernel);
OPENNPU_REGISTER_CPU_SLOT(block_quant, &block_quant_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::quant
