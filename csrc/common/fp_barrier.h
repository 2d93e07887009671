// An optimisation barrier on a float value: the compiler must materialise it as computed, so a
// multiply is not contracted with a later add into one fused multiply-add (GCC contracts by
// default, -ffp-contract=fast, wherever FMA is enabled). Kernels that round at a golden's
// rounding points (the quantisers: each product rounded to fp32, then added; swiglu's SiLU
// gradient) use it: a fused operation rounds once and moves ties (an fp8 subnormal code, a
// requantised int8, a bf16 output) to the other side.
#pragma once

#include <ATen/cpu/vec/vec.h>

namespace opennpu {
inline namespace CPU_CAPABILITY {

inline float rounded(float v) {
#if defined(__x86_64__)
  asm("" : "+v"(v));
#else
  volatile float keep = v;
  v = keep;
#endif
  return v;
}

inline at::vec::Vectorized<float> rounded(const at::vec::Vectorized<float>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  asm("" : "+v"(r));
  return r;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  asm("" : "+v"(r));
  return r;
#else
  return v;  // the baseline build has no FMA to contract into
#endif
}

}  // namespace CPU_CAPABILITY
}  // namespace opennpu
