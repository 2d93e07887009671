// Row kernels of the RMSNorm family, shared by csrc/ops/norm/norm_cpu.cpp and the fused
// norm + quantisation ops in csrc/ops/quant/quant_cpu.cpp. Included only from *_cpu.cpp files
// (compiled once per ISA), so everything lives in the inline namespace CPU_CAPABILITY.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/stream_store.h"
#include "common/vec.h"

namespace opennpu::norm {
inline namespace CPU_CAPABILITY {

// x = x1 + x2 over one row, added in acc_t and stored rounded to scalar_t (the add_rms_norm
// family normalises that rounded sum, as torch_npu does, reading it back while it is in L1).
// kNative: see with_bf16_stores (common/vec.h), as in rms_norm_row.
template <typename scalar_t, bool kNative = false>
void add_row(const scalar_t* x1, const scalar_t* x2, scalar_t* x, int64_t n) {
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  for_each_step<scalar_t>(n, [&](int64_t i, int64_t len) {
    Vec a0, a1, b0, b1;
    IO::load(x1 + i, a0, a1, len);
    IO::load(x2 + i, b0, b1, len);
    store_pair<kNative>(x + i, a0 + b0, a1 + b1, len);
  });
}

// sum(x^2) over one row of n elements, accumulated in acc_t.
template <typename scalar_t>
acc_t<scalar_t> sum_of_squares(const scalar_t* x, int64_t n) {
  using Vec = AccVec<scalar_t>;
  Vec s0(0), s1(0);
  for_each_step<scalar_t>(n, [&](int64_t i, int64_t len) {
    Vec a, b;
    VecPair<scalar_t>::load(x + i, a, b, len);
    s0 = at::vec::fmadd(a, a, s0);
    s1 = at::vec::fmadd(b, b, s1);
  });
  return horizontal_sum(s0 + s1);
}

// 1 / sqrt(sum_sq / n + eps).
template <typename T>
T rstd_of(T sum_sq, int64_t n, T eps) {
  return T(1) / std::sqrt(sum_sq / static_cast<T>(n) + eps);
}

// Hands each step's y = x * rstd * gamma of one row (two accumulator vectors, `len` valid
// lanes) to store(i, a, b, len), for a given rstd (callers that formed x themselves fold its
// sum of squares into that pass and skip a pass over the row).
template <typename scalar_t, typename Store>
void rms_norm_apply_row(const scalar_t* x, const acc_t<scalar_t>* gamma, int64_t n,
                        acc_t<scalar_t> rstd, const Store& store) {
  using T = acc_t<scalar_t>;
  using Vec = AccVec<scalar_t>;
  const Vec vrstd(rstd);
  for_each_step<scalar_t>(n, [&](int64_t i, int64_t len) {
    Vec a, b, ga, gb;
    VecPair<scalar_t>::load(x + i, a, b, len);
    VecPair<T>::load(gamma + i, ga, gb, len);
    store(i, a * vrstd * ga, b * vrstd * gb, len);
  });
}

// Normalises one row and hands each step's y = x * rstd * gamma (two accumulator vectors, `len`
// valid lanes) to store(i, a, b, len); returns rstd. Callers store y in one or more dtypes.
template <typename scalar_t, typename Store>
acc_t<scalar_t> rms_norm_row_to(const scalar_t* x, const acc_t<scalar_t>* gamma, int64_t n,
                                acc_t<scalar_t> eps, const Store& store) {
  const acc_t<scalar_t> rstd = rstd_of<acc_t<scalar_t>>(sum_of_squares(x, n), n, eps);
  rms_norm_apply_row<scalar_t>(x, gamma, n, rstd, store);
  return rstd;
}

// y = x * rstd * gamma in x's dtype; returns rstd. kNative: bf16 rounded by the AVX512_BF16
// instruction (see with_bf16_stores in common/vec.h). stream: y's whole lines are written with
// streaming stores (common/stream_store.h; the values are the same either way, as y is
// elementwise in x's lanes).
template <typename scalar_t, bool kNative = false>
acc_t<scalar_t> rms_norm_row(const scalar_t* x, const acc_t<scalar_t>* gamma, scalar_t* y,
                             int64_t n, acc_t<scalar_t> eps, bool stream = false) {
  using T = acc_t<scalar_t>;
  using Vec = AccVec<scalar_t>;
  const T rstd = rstd_of<T>(sum_of_squares(x, n), n, eps);
  const Vec vrstd(rstd);
  for_each_output_step<scalar_t>(y, n, stream, [&](int64_t i, int64_t len, bool streamed) {
    Vec a, b, ga, gb;
    VecPair<scalar_t>::load(x + i, a, b, len);
    VecPair<T>::load(gamma + i, ga, gb, len);
    store_output<kNative>(y + i, a * vrstd * ga, b * vrstd * gb, len, streamed);
  });
  return rstd;
}

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::norm
