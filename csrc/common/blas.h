// Tile GEMMs for the CPU kernels, row-major: C[m, n] = alpha * op(A) op(B) + beta * C, where
// op(X) = X^T when ta / tb is set and A, B, C rows are lda / ldb / ldc elements apart.
//
// fp32 / fp64 go to MKL's sgemm_ / dgemm_ (exported by libtorch_cpu, where ATen's matmul calls
// them), or, in a build without them, through ATen's CPU matmul (at::cpu::addmm_out on from_blob
// views, no dispatcher round trip). fp16 / bf16 operands go to MKL's
// half-precision GEMMs with fp32 accumulation and an fp32 C (cblas_gemm_bf16bf16f32 /
// cblas_gemm_f16f16f32, which use AMX / AVX512-BF16 / AVX512-FP16 where present). ATen calls
// those through an internal (unexported) cpublas::gemm overload; libtorch_cpu exports the MKL
// symbols themselves, so all of them are declared weak here: a PyTorch build without them leaves
// them null, half_gemm_available() says so for the half-precision ones, and callers compute in
// fp32 instead.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/alloc_cpu.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common/half_gemm.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <type_traits>

extern "C" {
// Fortran BLAS (column-major), LP64 as in PyTorch's MKL.
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
            const float* beta, float* c, const int* ldc) __attribute__((weak));
void dgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
            const double* alpha, const double* a, const int* lda, const double* b, const int* ldb,
            const double* beta, double* c, const int* ldc) __attribute__((weak));
// MKL CBLAS, LP64 (int indices); layout 101 = row-major, transpose 111 = no, 112 = yes.
void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const c10::BFloat16* a, int lda, const c10::BFloat16* b, int ldb,
                            float beta, float* c, int ldc) __attribute__((weak));
void cblas_gemm_f16f16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                          const c10::Half* a, int lda, const c10::Half* b, int ldb, float beta,
                          float* c, int ldc) __attribute__((weak));
}

namespace opennpu::blas {

// Whether the CPU multiplies t natively (common/half_gemm.h: AMX-BF16 or AVX512-BF16 for bf16,
// AVX512-FP16 for fp16). Elsewhere MKL and oneDNN emulate them, and converting to fp32 is faster.
using opennpu::cpu_multiplies_natively;

// Whether MKL's half-precision GEMMs use those instructions. MKL picks its kernels by CPU vendor:
// on an AMD Zen 4 (AVX512-BF16) cblas_gemm_bf16bf16f32 ran at fp32 speed (one thread,
// [128 x 64] x [64 x 512]: 90 GFLOP/s, sgemm 93), while oneDNN's bf16 matmul, which aten::mm
// calls, reached 210. Callers that can take whole ATen GEMMs instead ask this.
inline bool mkl_multiplies_natively(at::ScalarType t) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return cpu_multiplies_natively(t) && __builtin_cpu_is("intel");
#else
  return false;
#endif
}

// Whether fp16 / bf16 operands of dtype t are multiplied as they are, by MKL's half-precision
// GEMMs: the CPU GEMM policy (common/half_gemm.h) does not send them to fp32 copies, and
// PyTorch's MKL has those GEMMs.
inline bool half_gemm_available(at::ScalarType t) {
  if (half_gemm_in_fp32(t)) return false;
  if (t == at::kBFloat16) return cblas_gemm_bf16bf16f32 != nullptr;
  if (t == at::kHalf) return cblas_gemm_f16f16f32 != nullptr;
  return false;
}

// Scratch for GEMM tiles, 64-byte aligned (c10::alloc_cpu): tile rows whose length is a multiple
// of 64 bytes then start on cache lines, as the matrix units' row loads and stores need to run at
// full speed (std::vector's large blocks start 16 bytes past a page boundary). Uninitialised.
template <typename T>
class TileBuffer {
 public:
  explicit TileBuffer(int64_t n = 0)
      : data_(n > 0 ? static_cast<T*>(c10::alloc_cpu(n * sizeof(T))) : nullptr), size_(n) {}
  T* data() const { return data_.get(); }
  int64_t size() const { return size_; }

 private:
  struct Free {
    void operator()(T* p) const { c10::free_cpu(p); }
  };
  std::unique_ptr<T, Free> data_;
  int64_t size_;
};

template <typename T>
at::Tensor wrap(const T* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<T*>(data), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

// In: the operands' dtype; T: C's (In, or float for fp16 / bf16 operands). Callers of the
// fp16 / bf16 form check half_gemm_available() first.
template <typename In, typename T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const In* a, int64_t lda,
          const In* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty product: C = beta * C, with beta 0 meaning "overwrite"
    for (int64_t r = 0; r < m; ++r) {
      T* row = c + r * ldc;
      if (beta == T(0)) {
        std::fill(row, row + n, T(0));
      } else {
        std::for_each(row, row + n, [beta](T& x) { x *= beta; });
      }
    }
    return;
  }
  if constexpr (std::is_same_v<In, T>) {
    // BLAS directly where PyTorch exports it (a few microseconds less per tile than building
    // tensors for at::cpu::addmm_out, which ends in the same call). Column-major, so C^T is asked
    // for: C^T = op(B)^T op(A)^T.
    auto* blas_fn = [] {
      if constexpr (std::is_same_v<T, float>) {
        return sgemm_;
      } else {
        return dgemm_;
      }
    }();
    if (blas_fn != nullptr) {
      const char trans_a = ta ? 'T' : 'N', trans_b = tb ? 'T' : 'N';
      const int mi = static_cast<int>(m), ni = static_cast<int>(n), ki = static_cast<int>(k);
      const int lda_i = static_cast<int>(lda), ldb_i = static_cast<int>(ldb);
      const int ldc_i = static_cast<int>(ldc);
      blas_fn(&trans_b, &trans_a, &ni, &mi, &ki, &alpha, b, &ldb_i, a, &lda_i, &beta, c, &ldc_i);
      return;
    }
    at::Tensor out = wrap(c, m, n, ldc);
    const at::Tensor a_op = ta ? wrap(a, k, m, lda).t() : wrap(a, m, k, lda);
    const at::Tensor b_op = tb ? wrap(b, n, k, ldb).t() : wrap(b, k, n, ldb);
    at::cpu::addmm_out(out, out, a_op, b_op, beta, alpha);  // beta 0: out is not read
  } else {
    static_assert(std::is_same_v<T, float>, "fp16 / bf16 GEMMs accumulate and write fp32");
    constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
    const auto args = [&](auto fn) {
      fn(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, static_cast<int>(m),
         static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
         static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
    };
    if constexpr (std::is_same_v<In, c10::BFloat16>) {
      args(cblas_gemm_bf16bf16f32);
    } else {
      static_assert(std::is_same_v<In, c10::Half>, "unsupported GEMM operand dtype");
      args(cblas_gemm_f16f16f32);
    }
  }
}

}  // namespace opennpu::blas
