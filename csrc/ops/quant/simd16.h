// AVX-512 helpers of the quantisers' row kernels (quant_cpu.cpp, mx_quant_cpu.cpp): 16 elements
// of fp32 / fp16 / bf16 as fp32 lanes. Kernel-only (compiled once per instruction set, in
// CPU_CAPABILITY); empty outside the AVX-512 build.
#pragma once

#include <c10/util/BFloat16.h>

#include <type_traits>

#include "common/vec.h"

namespace opennpu::quant {
inline namespace CPU_CAPABILITY {

#if defined(CPU_CAPABILITY_AVX512)
// 16 elements of src_t as fp32 (exact: bf16 is shifted, fp16 widened by vcvtph2ps), all or the
// lanes of `mask` (the others 0). Plain intrinsics, always inlined: the row kernels keep every
// constant in a register (built from ATen's Vectorized and lambdas, GCC left a call in the loop,
// which spilled every vector and reloaded the constants each step).
template <typename src_t>
OPENNPU_VEC_INLINE __m512 load16(const src_t* p) {
  if constexpr (std::is_same_v<src_t, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<src_t, at::BFloat16>) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}
template <typename src_t>
OPENNPU_VEC_INLINE __m512 load16(const src_t* p, __mmask16 mask) {
  if constexpr (std::is_same_v<src_t, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (std::is_same_v<src_t, at::BFloat16>) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
}
#endif

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::quant
