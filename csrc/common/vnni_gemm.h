// bf16 tile GEMMs on AVX512_BF16's dot product (vdpbf16ps), for CPUs that have the instruction
// but no AMX (AMD Zen 4 and later, Intel Cooper Lake). There ATen's brgemm (oneDNN's ukernel,
// cpublas::could_pack) is not offered, and MKL's cblas_gemm_bf16bf16f32 ran at fp32 speed on a
// Zen 4 (one thread, [128 x 64] x [64 x 512]: 90 GFLOP/s, sgemm 93), half of what the
// instruction gives. Included only from <family>_cpu.cpp files (compiled once per ISA); defined
// in the AVX-512 build (elsewhere a stub that nothing reaches), and callers check
// has_avx512_bf16() first.
//
// The operands are those of the brgemm tiles: C[M, N] (fp32, row-major) = A[M, K] B[K, N]
// (+ C), A bf16 row-major, B bf16 in the VNNI layout (B[k, n] at ((k / 2) * ldb + n) * 2 + k % 2)
// and K even. vdpbf16ps multiplies each pair exactly (bf16 x bf16 fits fp32) and adds both
// products to the fp32 accumulator, so the result is an fp32-accumulated GEMM, as the other
// tile paths compute, but for the order of the additions and for subnormals: the instruction
// ignores MXCSR, reads subnormal bf16 inputs as 0 and flushes subnormal results to 0 (absolute
// changes below 1.2e-38, as oneDNN's bf16 kernels make; the attention's P is rounded with that
// flush already, see store_bf16_native in vec.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

namespace opennpu::blas {
inline namespace CPU_CAPABILITY {

// The kernels need the extension's intrinsics; the rest of the AVX-512 build must not assume it.
#define OPENNPU_AVX512_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace vnni_detail {

// Columns per micro-tile (two vectors), rows per micro-tile (2 x kTileRows accumulators, 24 of
// the 32 vector registers), and K pairs per pass: a 32-column panel of B for kKPairs pairs is
// 16 KiB, which stays in L1 while every row block of A passes over it.
constexpr int64_t kTileCols = 32;
constexpr int kTileRows = 12;
constexpr int64_t kKPairs = 128;

inline uint32_t load_pair(const c10::BFloat16* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// C[kRows, n] (+)= A[kRows, 2 * k_pairs] B[2 * k_pairs, n] for n <= 32 columns (masks m0, m1).
template <int kRows>
OPENNPU_AVX512_BF16_TARGET inline void micro_tile(int64_t k_pairs, const c10::BFloat16* a,
                                                  int64_t lda, const uint32_t* b, int64_t ldb,
                                                  float* c, int64_t ldc, bool add_c,
                                                  __mmask16 m0, __mmask16 m1) {
  // Every loop over r is unrolled before GCC looks at the arrays, which then live in registers
  // (left as loops, every accumulator was stored to the stack on every k step).
  __m512 acc0[kRows], acc1[kRows];
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    acc0[r] = add_c ? _mm512_maskz_loadu_ps(m0, c + r * ldc) : _mm512_setzero_ps();
    acc1[r] = add_c ? _mm512_maskz_loadu_ps(m1, c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t kp = 0; kp < k_pairs; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(m0, b + kp * ldb);
    const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(m1, b + kp * ldb + 16);
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(load_pair(a + r * lda + 2 * kp)));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], av, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], av, b1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < kRows; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, acc0[r]);
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, acc1[r]);
  }
}

template <int kRows = kTileRows>
OPENNPU_AVX512_BF16_TARGET inline void row_tail(int rows, int64_t k_pairs, const c10::BFloat16* a,
                                                int64_t lda, const uint32_t* b, int64_t ldb,
                                                float* c, int64_t ldc, bool add_c, __mmask16 m0,
                                                __mmask16 m1) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return micro_tile<kRows>(k_pairs, a, lda, b, ldb, c, ldc, add_c, m0, m1);
    return row_tail<kRows - 1>(rows, k_pairs, a, lda, b, ldb, c, ldc, add_c, m0, m1);
  }
}

}  // namespace vnni_detail

// C[M, N] = A[M, K] B[K, N] (+ C when add_c): A bf16 row-major (row stride lda), B bf16 in VNNI
// with ldb columns per pair row, C fp32 (row stride ldc); K even (the tiles pad it with zeros).
OPENNPU_AVX512_BF16_TARGET inline void vnni_gemm_bf16(int64_t M, int64_t N, int64_t K, int64_t lda,
                                                      int64_t ldb, int64_t ldc, bool add_c,
                                                      const c10::BFloat16* A,
                                                      const c10::BFloat16* B, float* C) {
  using namespace vnni_detail;
  TORCH_INTERNAL_ASSERT_DEBUG_ONLY(K % 2 == 0);
  const int64_t k_pairs = K / 2;
  const auto* b_pairs = reinterpret_cast<const uint32_t*>(B);
  if (k_pairs == 0) {  // an empty product: C keeps its value, or becomes 0
    if (!add_c) {
      for (int64_t r = 0; r < M; ++r) std::fill(C + r * ldc, C + r * ldc + N, 0.0f);
    }
    return;
  }
  for (int64_t n0 = 0; n0 < N; n0 += kTileCols) {
    const int64_t n = std::min(kTileCols, N - n0);
    const auto m0 = static_cast<__mmask16>((1u << std::min<int64_t>(n, 16)) - 1);
    const auto m1 = static_cast<__mmask16>((1u << std::max<int64_t>(n - 16, 0)) - 1);
    // K in passes of kKPairs pairs: the later passes add to what the first wrote.
    for (int64_t k0 = 0; k0 < k_pairs; k0 += kKPairs) {
      const int64_t kn = std::min(kKPairs, k_pairs - k0);
      const bool add = add_c || k0 > 0;
      const uint32_t* b = b_pairs + k0 * ldb + n0;
      for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - r0));
        row_tail(rows, kn, A + r0 * lda + 2 * k0, lda, b, ldb, C + r0 * ldc + n0, ldc, add, m0, m1);
      }
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::blas

#else  // builds without AVX-512, where has_avx512_bf16() is false and nothing calls it

namespace opennpu::blas {
inline namespace CPU_CAPABILITY {
inline void vnni_gemm_bf16(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool,
                           const c10::BFloat16*, const c10::BFloat16*, float*) {
  TORCH_INTERNAL_ASSERT(false, "vnni_gemm_bf16 needs the AVX-512 build of the kernels");
}
}  // namespace CPU_CAPABILITY
}  // namespace opennpu::blas

#endif  // CPU_CAPABILITY_AVX512
