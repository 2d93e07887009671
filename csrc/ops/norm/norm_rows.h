// Row kernels of the RMSNorm family, shared by csrc/ops/norm/norm_cpu.cpp and the fused
// norm + quantisation ops in csrc/ops/quant/quant_cpu.cpp. Included only from *_cpu.cpp files
// (compiled once per ISA), so everything lives in the inline namespace CPU_CAPABILITY.
#pragma once

#include <cmath>
#include <cstdlib>
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

// add_row fused with sum_of_squares of the sum it stores: x = x1 + x2 rounded to scalar_t, and
// sum(x^2) of those rounded values, accumulated exactly as sum_of_squares(x, n) accumulates them
// (the same steps, the same two accumulators, the same values: the result is bit-identical to
// add_row then sum_of_squares). One pass over the row instead of two: the squares are summed while
// x1 and x2 stream in from memory, where a separate pass over x (in L1) left memory idle. x may be
// x1 or x2 itself (each step loads both before it stores). kNative: as in add_row.
template <typename scalar_t, bool kNative = false>
acc_t<scalar_t> add_row_sum_of_squares(const scalar_t* x1, const scalar_t* x2, scalar_t* x,
                                       int64_t n) {
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  Vec s0(0), s1(0);
  for_each_step<scalar_t>(n, [&](int64_t i, int64_t len) {
    Vec a0, a1, b0, b1;
    IO::load(x1 + i, a0, a1, len);
    IO::load(x2 + i, b0, b1, len);
    a0 = a0 + b0;
    a1 = a1 + b1;
    store_pair<kNative>(x + i, a0, a1, len);
    // fp16 / bf16: the squares are of the stored (rounded) values, read back from L1.
    if constexpr (IO::kReduced) IO::load(x + i, a0, a1, len);
    s0 = at::vec::fmadd(a0, a0, s0);
    s1 = at::vec::fmadd(a1, a1, s1);
  });
  return horizontal_sum(s0 + s1);
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

// y = x * rstd * gamma in x's dtype, for a given rstd. kNative: bf16 rounded by the AVX512_BF16
// instruction (see with_bf16_stores in common/vec.h). stream: y's whole lines are written with
// streaming stores (common/stream_store.h; the values are the same either way, as y is
// elementwise in x's lanes). copy, when given, receives x itself in the same pass (x is a row the
// caller keeps in L1, e.g. add_rms_norm's sum): its whole lines are streamed with y's, so copy must
// sit at y's offset within a cache line (same_line_offset) when stream is set.
// next_a / next_b, when given, are the next row's inputs (n elements each), which this pass
// prefetches into L2 a step at a time: the pass reads only L1 / L2 itself, so without them the
// core's memory reads would pause while it writes y; with them the next row's reads overlap y's
// writes, and the next row's first pass finds its lines in L2 (docs/performance.md has the
// measurements, and why not L1).
template <typename scalar_t, bool kNative = false>
void rms_norm_write_row(const scalar_t* x, const acc_t<scalar_t>* gamma, scalar_t* y, int64_t n,
                        acc_t<scalar_t> rstd, bool stream, scalar_t* copy = nullptr,
                        const scalar_t* next_a = nullptr, const scalar_t* next_b = nullptr) {
  using T = acc_t<scalar_t>;
  using Vec = AccVec<scalar_t>;
  const Vec vrstd(rstd);
  for_each_output_step<scalar_t>(y, n, stream, [&](int64_t i, int64_t len, bool streamed) {
    if (next_a != nullptr) {  // a prefetch never faults: a step's last line may pass row n
      prefetch_step<2>(next_a + i);
      if (next_b != nullptr) prefetch_step<2>(next_b + i);
    }
    Vec a, b, ga, gb;
    VecPair<scalar_t>::load(x + i, a, b, len);
    VecPair<T>::load(gamma + i, ga, gb, len);
    store_output<kNative>(y + i, a * vrstd * ga, b * vrstd * gb, len, streamed);
    if (copy != nullptr) copy_output(copy + i, x + i, len, streamed);
  });
}

// y = x * rstd * gamma in x's dtype (rms_norm_write_row; next: the next row of x, prefetched);
// returns rstd.
template <typename scalar_t, bool kNative = false>
acc_t<scalar_t> rms_norm_row(const scalar_t* x, const acc_t<scalar_t>* gamma, scalar_t* y,
                             int64_t n, acc_t<scalar_t> eps, bool stream = false,
                             const scalar_t* next = nullptr) {
  const acc_t<scalar_t> rstd = rstd_of<acc_t<scalar_t>>(sum_of_squares(x, n), n, eps);
  rms_norm_write_row<scalar_t, kNative>(x, gamma, y, n, rstd, stream, nullptr, next);
  return rstd;
}

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::norm
