// CPU kernels of the MX and block quantisers (compiled once per ISA; see mx_quant.h for the
// numerics). Work is split into (line group, block) units; within a unit the block maxima of
// all `post` columns are found first, then every element is scaled and rounded in fp32.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <bit>
#include <cmath>
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

// The float8 code of c (finite, |c| <= the format's max_norm), rounded to nearest even as c10's
// conversion rounds such values, from the float's bits with no branch, the format's constants
// worked out once (so that the element loop vectorises): in the normal range, half an ulp of the
// format less one plus the lowest kept mantissa bit is added to the magnitude's bits (a carry
// moves the exponent up), which are then shifted and rebiased; below the smallest normal
// 2^min_exp, the magnitude in units of the subnormal spacing 2^(min_exp - mbits) (an exact
// power-of-two product) plus 2^23 leaves rint(units) in the low mantissa bits, by the float
// addition's own rounding, 2^mbits (the smallest normal's code) included.
struct Fp8Encoder {
  static constexpr float kTwo23 = 8388608.f;
  uint32_t shift, half_less_one, rebias, min_normal_bits;
  float units;

  explicit Fp8Encoder(const MxFormat& f)
      : shift(static_cast<uint32_t>(23 - f.mbits)),
        half_less_one((1u << (22 - f.mbits)) - 1),
        rebias(static_cast<uint32_t>(126 + f.min_exp) << f.mbits),
        min_normal_bits(static_cast<uint32_t>(127 + f.min_exp) << 23),
        units(pow2(f.mbits - f.min_exp)) {}

  uint8_t operator()(float c) const {
    const uint32_t bits = std::bit_cast<uint32_t>(c);
    const uint32_t mag = bits & 0x7FFFFFFFu;
    const uint32_t normal = ((mag + half_less_one + ((mag >> shift) & 1u)) >> shift) - rebias;
    const uint32_t subnormal =
        std::bit_cast<uint32_t>(std::bit_cast<float>(mag) * units + kTwo23) -
        std::bit_cast<uint32_t>(kTwo23);
    return static_cast<uint8_t>(((bits >> 24) & 0x80u) | (mag < min_normal_bits ? subnormal : normal));
  }
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

void mx_quant_kernel(const at::Tensor& x, int64_t pre, int64_t d, int64_t post, int64_t bs,
                     const MxFormat& fmt, MxRound round, int64_t scale_alg, float max_low_bound,
                     uint8_t* codes, uint8_t* scales) {
  const int64_t blocks = (d + bs - 1) / bs;
  const int64_t pairs = (blocks + 1) / 2;
  OPENNPU_MX_DISPATCH(x.scalar_type(), "npu_dynamic_mx_quant", [&] {
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(bs * post, 1));
    at::parallel_for(0, pre * blocks, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> amax(post);
      std::vector<int> exps(post);
      const Fp8Encoder fp8(fmt);
      // unit = p * blocks + b, stepped without a division per block
      for (int64_t unit = begin, p = begin / blocks, b = begin % blocks; unit < end;
           ++unit, b = b + 1 == blocks ? 0 : b + 1, p += b == 0) {
        const int64_t i0 = b * bs, i1 = std::min(d, i0 + bs);
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
            out[i] = fp8(std::clamp(t, -lim, lim));
          }
          continue;
        }
        for (int64_t i = i0; i < i1; ++i) {
          const scalar_t* row = px + (p * d + i) * post;
          uint8_t* out = codes + (p * d + i) * post;
          for (int64_t q = 0; q < post; ++q) {
            if (exps[q] == kNanExp) {
              out[q] = 0;
              continue;
            }
            const float t = rounded(static_cast<float>(row[q]) * pow2(-exps[q]));
            if (direct) {
              const float c = std::clamp(t, -fmt.max_norm, fmt.max_norm);
              out[q] = fmt.e4m3 ? c10::Float8_e4m3fn(c).x : c10::Float8_e5m2(c).x;
            } else {
              out[q] = encode(round_element(t, fmt, round), fmt);
            }
          }
        }
      }
    });
  });
}

void pack_fp4_kernel(const uint8_t* codes, int64_t pairs, uint8_t* packed) {
  at::parallel_for(0, pairs, int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      packed[i] = static_cast<uint8_t>((codes[2 * i] & 0xF) | ((codes[2 * i + 1] & 0xF) << 4));
    }
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
OPENNPU_REGISTER_CPU_SLOT(pack_fp4, &pack_fp4_kernel);
OPENNPU_REGISTER_CPU_SLOT(block_quant, &block_quant_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::quant
