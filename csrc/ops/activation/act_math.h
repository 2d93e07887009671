// The activation math of the activation family, shared with the ops that fuse an activation into
// a larger kernel (npu_ffn). Included only from <family>_cpu.cpp files (compiled once per ISA),
// so everything lives in the inline namespace CPU_CAPABILITY.
//
// Every gated activation here except exact GELU has the form z * sigmoid(u(z)), so value and
// derivative share one exp:  act(z) = z * s,  act'(z) = s + z * s * (1 - s) * u'(z),  s = sigmoid(u).
#pragma once

#include <type_traits>

#include "common/fp_barrier.h"
#include "common/vec.h"
#include "ops/activation/activation.h"

namespace opennpu::activation {
inline namespace CPU_CAPABILITY {

constexpr double kSqrt2OverPi = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kGeluCubic = 0.044715;
constexpr double kFastGeluScale = 1.702;
constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1 / sqrt(2 pi)
constexpr double kGradClampZ = 200.0;  // |z| past which the gate's derivative term is 0

// u(z) and u'(z) of the sigmoid-gated forms.
template <Act kAct, typename Vec>
OPENNPU_VEC_INLINE Vec gate_arg(const Vec& z) {
  using T = typename Vec::value_type;
  if constexpr (kAct == Act::kSilu) {
    return z;
  } else if constexpr (kAct == Act::kFastGelu) {
    return z * Vec(T(kFastGeluScale));
  } else {
    const Vec k(T(2 * kSqrt2OverPi));
    return k * at::vec::fmadd(z * z * z, Vec(T(kGeluCubic)), z);
  }
}

template <Act kAct, typename Vec>
OPENNPU_VEC_INLINE Vec gate_arg_grad(const Vec& z) {
  using T = typename Vec::value_type;
  if constexpr (kAct == Act::kSilu) {
    return Vec(T(1));
  } else if constexpr (kAct == Act::kFastGelu) {
    return Vec(T(kFastGeluScale));
  } else {
    const Vec k(T(2 * kSqrt2OverPi));
    return k * at::vec::fmadd(z * z, Vec(T(3 * kGeluCubic)), Vec(T(1)));
  }
}

template <Act kAct, typename scalar_t>
OPENNPU_VEC_INLINE AccVec<scalar_t> act_value(const AccVec<scalar_t>& z) {
  using Vec = AccVec<scalar_t>;
  using T = acc_t<scalar_t>;
  if constexpr (kAct == Act::kGeluErf) {
    return z * Vec(T(0.5)) * (Vec(T(1)) + (z * Vec(T(kInvSqrt2))).erf());
  } else {
    return z * sigmoid_for<scalar_t>(gate_arg<kAct>(z));
  }
}

template <Act kAct, typename scalar_t>
OPENNPU_VEC_INLINE void act_value_grad(const AccVec<scalar_t>& z, AccVec<scalar_t>& value,
                                       AccVec<scalar_t>& grad) {
  using Vec = AccVec<scalar_t>;
  using T = acc_t<scalar_t>;
  if constexpr (kAct == Act::kGeluErf) {
    const Vec cdf = Vec(T(0.5)) * (Vec(T(1)) + (z * Vec(T(kInvSqrt2))).erf());
    const Vec pdf = Vec(T(kInvSqrt2Pi)) * exp_for<scalar_t>(Vec(T(-0.5)) * z * z);
    value = z * cdf;
    grad = at::vec::fmadd(z, pdf, cdf);
  } else {
    const Vec s = sigmoid_for<scalar_t>(gate_arg<kAct>(z));
    value = z * s;
    // The term z * s * (1 - s) * u'(z) vanishes for |z| > kGradClampZ (s (1 - s) is below
    // 1e-80 there, or 1 - s rounds to 0 or to one ulp); z clamped, z = +-inf gives the limits
    // 1 and 0 instead of inf * 0 = NaN (or inf, where 1 - s rounds to one ulp).
    const Vec zc = at::vec::clamp(z, Vec(T(-kGradClampZ)), Vec(T(kGradClampZ)));
    grad = at::vec::fmadd(zc * s * (Vec(T(1)) - s), gate_arg_grad<kAct>(zc), s);
  }
}

// SiLU as torch_npu's swiglu goldens compose it (op-plugin's test_npu_swi_glu*.py, float32, one
// rounding to the output dtype at the end), for float32 accumulation: the forward is F.silu,
// whose ATen kernel computes z / (1 + exp(-z)) with its vectorised exp (Sleef's, the same as
// Vectorized<float>::exp here); the backward is sigmoid(z) = 1 / (1 + exp(0 - z)) (ATen's
// sigmoid), swish(z) = z * s and swish'(z) = s + (z * (1 - s)) * s, each operation rounded to
// float32 in that order (the product is kept from fusing with the add). So a bf16 / fp16 output
// rounds the very float32 value the golden rounds. z is clamped to +-kGradClampZ in the
// derivative only, where the formula would give inf * 0 = NaN at z = -inf (the limits 1 and 0
// instead; for |z| <= kGradClampZ it is the golden's value, beyond it the same limit).
template <typename scalar_t>
inline constexpr bool kGoldenSilu = std::is_same_v<acc_t<scalar_t>, float>;

template <typename scalar_t>
OPENNPU_VEC_INLINE AccVec<scalar_t> silu_golden(const AccVec<scalar_t>& z) {
  using Vec = AccVec<scalar_t>;
  return z / (Vec(1.f) + z.neg().exp());
}

template <typename scalar_t>
OPENNPU_VEC_INLINE void silu_golden_grad(const AccVec<scalar_t>& z, AccVec<scalar_t>& swish,
                                         AccVec<scalar_t>& dswish) {
  using Vec = AccVec<scalar_t>;
  const Vec s = Vec(1.f) / (Vec(1.f) + (Vec(0.f) - z).exp());
  swish = z * s;
  const Vec zc = at::vec::clamp(z, Vec(float(-kGradClampZ)), Vec(float(kGradClampZ)));
  dswish = s + rounded((zc * (Vec(1.f) - s)) * s);
}

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::activation
