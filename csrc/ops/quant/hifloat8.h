// float32 -> hifloat8 (HiF8, Ascend's tapered 8-bit float; torch_npu.hifloat8 = 290), the one
// encoder every hifloat8 output uses: the CPU kernels, the CUDA kernels (it is __host__
// __device__ under nvcc) and, through the same rules, the portable path (ops/portable.py).
//
// The format (quant_matmul.h, FloatCode::kHif8, decodes it): sign bit 7; a prefix-coded "dot"
// field gives the exponent width D ('11' D=4, '10' D=3, '01' D=2, '001' D=1, '0001' D=0, '0000'
// subnormal); then a D-bit sign-magnitude exponent with an implicit leading 1 (|E| in
// [2^(D-1), 2^D - 1]; E = 0 for D = 0); the remaining bits the mantissa, m = 1, 2, 3, 3, 3 bits
// for D = 4, 3, 2, 1, 0. Normal values +-2^E * 1.M, E in [-15, 15]; subnormals +-2^(M - 23),
// M in 1..7 (2^-22 .. 2^-16); 0x00 zero, 0x80 NaN, 0x6F / 0xEF +-inf (the E = 15, M = 1 slot).
// The largest finite magnitude is 2^15 (0x6E).
//
// Rounding, as en_dtypes.hifloat8 (the package op-plugin's goldens use) casts float32: to the
// nearest value, ties away from zero (the rounding Ascend calls "round"), in linear value:
//   - a normal binade [2^E, 2^(E+1)) rounds its mantissa to m bits, ties away; a carry moves to
//     2^(E+1) (exactly representable whatever D it needs);
//   - below 2^-15 the values are powers of two: |x| in [2^E, 2^(E+1)) goes to 2^(E+1) from the
//     midpoint 1.5 * 2^E up; [2^-23, 2^-22) all go to 2^-22 (their midpoint with 0 is 2^-23),
//     anything below 2^-23 to zero;
//   - from 40960 = 1.25 * 2^15 (the midpoint of 2^15 and the inf slot's 1.5 * 2^15) up, and for
//     +-inf, the result is +-inf: no saturation;
//   - NaN -> 0x80; a zero of either sign, and anything that rounds to zero, -> 0x00 (0x80 is
//     NaN, so there is no negative zero).
// The result depends on the sign, the float32 exponent and the top four mantissa bits only
// (m + 1 <= 4 bits decide a ties-away rounding). This was checked against en_dtypes 0.0.4 on
// all 2^32 float32 bit patterns, both forms below (scripts/hifloat8_exhaustive.py;
// tests/ops/test_hifloat8_out.py keeps a sample of them and every code boundary and tie).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define OPENNPU_HIF8_HD __host__ __device__ __forceinline__ constexpr
#else
#define OPENNPU_HIF8_HD inline constexpr
#endif

namespace opennpu::quant {

constexpr uint8_t kHif8Nan = 0x80;
constexpr uint8_t kHif8Inf = 0x6F;      // +inf; -inf is 0xEF
constexpr float kHif8Max = 32768.f;     // the largest finite magnitude, 2^15
constexpr int64_t kHif8DtypeCode = 290; // torch_npu.hifloat8

// The hifloat8 code of the float32 with bit pattern `bits`.
OPENNPU_HIF8_HD uint8_t hifloat8_from_bits(uint32_t bits) {
  const uint32_t mag = bits & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return kHif8Nan;
  const uint8_t sign = (bits >> 31) ? 0x80 : 0x00;
  if (mag >= 0x7F800000u) return sign | kHif8Inf;
  int e = static_cast<int>(mag >> 23) - 127;  // float32 subnormals: -127, they round to 0
  const uint32_t mant = mag & 0x7FFFFFu;
  uint8_t code = 0;
  if (e < -23) {
    code = 0;
  } else if (e < -15) {  // subnormal codes 2^(M - 23): up to 2^(e+1) from 1.5 * 2^e
    const int m = e == -23 ? 1 : e + 23 + static_cast<int>(mant >> 22);
    code = m == 8 ? 0x7E /* 2^-15, the smallest normal */ : static_cast<uint8_t>(m);
  } else {
    const int a = e < 0 ? -e : e;
    const int mbits = a >= 8 ? 1 : a >= 4 ? 2 : 3;
    // round to mbits, ties away from zero: add half an ulp, truncate
    uint32_t r = (mant + (1u << (22 - mbits))) >> (23 - mbits);
    if (r >> mbits) {  // carried into the next binade: 2^(e+1), mantissa 0
      r = 0;
      ++e;
    }
    if (e > 15) return sign | kHif8Inf;  // 2^16 and up
    const int b = e < 0 ? -e : e;
    const uint32_t s = e < 0 ? 1u : 0u;  // the exponent's sign bit
    if (b == 0) {  // D = 0: '0001' M(3)
      code = static_cast<uint8_t>(0x08 | r);
    } else if (b == 1) {  // D = 1: '001' S M(3)
      code = static_cast<uint8_t>(0x10 | (s << 3) | r);
    } else if (b <= 3) {  // D = 2: '01' S e(1) M(3)
      code = static_cast<uint8_t>(0x20 | (s << 4) | ((b & 1u) << 3) | r);
    } else if (b <= 7) {  // D = 3: '10' S e(2) M(2)
      code = static_cast<uint8_t>(0x40 | (s << 4) | ((b & 3u) << 2) | r);
    } else {  // D = 4: '11' S e(3) M(1); e = 15 with M = 1 is the inf code, as it should be
      code = static_cast<uint8_t>(0x60 | (s << 4) | ((b & 7u) << 1) | r);
    }
  }
  return code == 0 ? code : static_cast<uint8_t>(sign | code);
}

#if defined(__CUDACC__)
__host__ __device__ __forceinline__
#else
inline
#endif
uint8_t float_to_hifloat8(float v) {
#if defined(__CUDA_ARCH__)
  return hifloat8_from_bits(__float_as_uint(v));
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return hifloat8_from_bits(bits);
#endif
}

#if !defined(__CUDACC__)
// The CPU kernels' form: one load from a table of the 8192 (sign, float32 exponent, top four
// mantissa bits) keys, which decide every non-NaN code (see above), built at compile time from
// hifloat8_from_bits; NaNs (exponent 255 and a mantissa beyond the key's bits) are patched.
struct Hifloat8Table {
  uint8_t code[8192];
  constexpr Hifloat8Table() : code() {
    for (uint32_t k = 0; k < 8192; ++k) code[k] = hifloat8_from_bits(k << 19);
  }
};
inline constexpr Hifloat8Table kHifloat8Table{};

inline uint8_t float_to_hifloat8_table(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint8_t code = kHifloat8Table.code[bits >> 19];
  return (bits & 0x7FFFFFFFu) > 0x7F800000u ? kHif8Nan : code;
}
#endif

}  // namespace opennpu::quant

#undef OPENNPU_HIF8_HD
