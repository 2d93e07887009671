// CPU kernels of the MoE routing ops (compiled once per ISA; see common/cpu_dispatch.h).
//
// Gating, per row of E logits: pass 1 converts the row to acc_t into a per-thread buffer and
// tracks its max, pass 2 replaces it by exp(x - max) and sums, pass 3 divides by the sum (and, for
// fp16 / bf16, rounds to x's dtype: torch_npu's golden ranks the rounded probabilities), then the
// top k are selected from the buffer: ties go to the lower expert index, NaN ranks last. Small k
// keeps a sorted list of k (one compare per expert in the common case); larger k partially sorts
// an index array with the same order.
//
// Finalize, per output row: the row's K terms (scale, source row, bias row) are gathered once,
// then one pass over H accumulates skip1 + skip2 + sum_k scale * (row + bias) in acc_t vectors
// and stores the result rounded once.
//
// Row gather (permute / init_routing): whole rows copied by bytes, with streaming stores when the
// output is larger than the last-level cache (common/stream_store.h).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "common/stream_store.h"
#include "common/vec.h"
#include "ops/moe/moe.h"

namespace opennpu::moe {
inline namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// The ranking of the top-k: a larger probability first; NaN after every number.
template <typename T>
inline bool ranks_before(T a, T b) {
  return a > b || (std::isnan(b) && !std::isnan(a));
}

// k at most this: insertion into a sorted list; above: std::partial_sort of an index array.
constexpr int64_t kInsertionMaxK = 32;

// Softmax of one row of E logits into p (acc_t); with kRound, fp16 / bf16 probabilities are
// rounded to scalar_t and back, so the ranking sees the values the output holds (v1's golden;
// v2's ranks the float32 probabilities).
template <typename scalar_t, bool kRound = true>
void softmax_row(const scalar_t* x, int64_t e, acc_t<scalar_t>* p) {
  using T = acc_t<scalar_t>;
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  constexpr int64_t kStep = IO::kStep;
  Vec vmax(-std::numeric_limits<T>::infinity());
  int64_t i = 0;
  for (; i + kStep <= e; i += kStep) {
    Vec a, b;
    IO::load(x + i, a, b);
    a.store(p + i);
    b.store(p + i + Vec::size());
    vmax = at::vec::maximum(vmax, at::vec::maximum(a, b));
  }
  T m = at::vec::vec_reduce_all<T>([](Vec& u, Vec& v) { return at::vec::maximum(u, v); }, vmax);
  for (; i < e; ++i) {
    p[i] = static_cast<T>(x[i]);
    m = std::isnan(p[i]) || p[i] > m ? p[i] : m;
  }
  // A NaN max makes every exp NaN, as torch.softmax gives; so does a row of -inf (-inf - -inf).
  // Every exp, the tail's included, is the vector one: equal logits must give equal
  // probabilities, or a tie would not go to the lower expert.
  const Vec vm(m);
  Vec vsum(0);
  T sum = 0;
  for (i = 0; i < e; i += Vec::size()) {
    const int64_t n = std::min<int64_t>(Vec::size(), e - i);
    const Vec ex = (Vec::loadu(p + i, n) - vm).exp();
    ex.store(p + i, n);
    if (n == Vec::size()) {
      vsum = vsum + ex;
    } else {
      for (int64_t j = 0; j < n; ++j) sum += p[i + j];
    }
  }
  sum += horizontal_sum(vsum);
  const Vec vs(sum);
  i = 0;
  for (; i + Vec::size() <= e; i += Vec::size()) (Vec::loadu(p + i) / vs).store(p + i);
  for (; i < e; ++i) p[i] = p[i] / sum;
  if constexpr (IO::kReduced && kRound) {
    for (int64_t j = 0; j < e; ++j) p[j] = static_cast<T>(static_cast<scalar_t>(p[j]));
  }
}

// The k best of p[0, e) (ranks_before, ties to the lower index) into (value, index), best first.
template <typename T>
void top_k(const T* p, int64_t e, int64_t k, T* value, int32_t* index,
           std::vector<int32_t>& order) {
  if (k <= kInsertionMaxK) {
    int64_t count = 0;
    for (int64_t j = 0; j < e; ++j) {
      const T v = p[j];
      if (count == k && !ranks_before(v, value[k - 1])) continue;
      // Equal values stay behind the earlier (lower) indices already in the list.
      int64_t pos = count < k ? count++ : k - 1;
      for (; pos > 0 && ranks_before(v, value[pos - 1]); --pos) {
        value[pos] = value[pos - 1];
        index[pos] = index[pos - 1];
      }
      value[pos] = v;
      index[pos] = static_cast<int32_t>(j);
    }
    return;
  }
  order.resize(e);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [p](int32_t a, int32_t b) {
    if (ranks_before(p[a], p[b])) return true;
    if (ranks_before(p[b], p[a])) return false;
    return a < b;
  });
  for (int64_t j = 0; j < k; ++j) {
    index[j] = order[j];
    value[j] = p[order[j]];
  }
}

void gating_kernel(const at::Tensor& x, const bool* finished, int64_t k, at::Tensor& y,
                   at::Tensor& expert_idx, at::Tensor& row_idx) {
  const int64_t e = x.size(-1);
  const int64_t rows = y.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "npu_moe_gating_top_k_softmax", [&] {
    using T = acc_t<scalar_t>;
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    scalar_t* py = y.mutable_data_ptr<scalar_t>();
    int32_t* pi = expert_idx.mutable_data_ptr<int32_t>();
    int32_t* pr = row_idx.mutable_data_ptr<int32_t>();
    at::parallel_for(0, rows, grain_rows(e + k), [&](int64_t begin, int64_t end) {
      std::vector<T> p(e), value(k);
      std::vector<int32_t> index(k), order;
      for (int64_t r = begin; r < end; ++r) {
        softmax_row<scalar_t>(px + r * e, e, p.data());
        top_k<T>(p.data(), e, k, value.data(), index.data(), order);
        const bool done = finished != nullptr && finished[r];
        for (int64_t j = 0; j < k; ++j) {
          py[r * k + j] = static_cast<scalar_t>(value[j]);
          pi[r * k + j] = done ? static_cast<int32_t>(e) : index[j];
          pr[r * k + j] = static_cast<int32_t>(j * rows + r);
        }
      }
    });
  });
}

// npu_moe_gating_top_k_softmax_v2. renorm 0: the top k of the float32 softmax (not rounded
// first), optionally the whole softmax into probs; renorm 1: the top k of the logits, then the
// softmax of those k values.
void gating_v2_kernel(const at::Tensor& x, const bool* finished, int64_t k, bool renorm,
                      at::Tensor& y, at::Tensor& expert_idx, at::Tensor& probs) {
  const int64_t e = x.size(-1);
  const int64_t rows = y.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(),
                                  "npu_moe_gating_top_k_softmax_v2", [&] {
    using T = acc_t<scalar_t>;
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    scalar_t* py = y.mutable_data_ptr<scalar_t>();
    int32_t* pi = expert_idx.mutable_data_ptr<int32_t>();
    T* pp = probs.defined() ? probs.mutable_data_ptr<T>() : nullptr;
    at::parallel_for(0, rows, grain_rows(e + k), [&](int64_t begin, int64_t end) {
      std::vector<T> buf(e), value(k);
      std::vector<int32_t> index(k), order;
      for (int64_t r = begin; r < end; ++r) {
        T* p = pp != nullptr ? pp + r * e : buf.data();
        if (renorm) {
          for (int64_t j = 0; j < e; ++j) p[j] = static_cast<T>(px[r * e + j]);
        } else {
          softmax_row<scalar_t, false>(px + r * e, e, p);
        }
        if (k == 0) continue;  // only the softmax was asked for
        top_k<T>(p, e, k, value.data(), index.data(), order);
        if (renorm) {  // softmax of the k selected logits (value[0] is their max unless NaN)
          T m = value[0], sum = 0;
          for (int64_t j = 1; j < k; ++j) m = std::isnan(value[j]) || value[j] > m ? value[j] : m;
          for (int64_t j = 0; j < k; ++j) sum += (value[j] = std::exp(value[j] - m));
          for (int64_t j = 0; j < k; ++j) value[j] /= sum;
        }
        const bool done = finished != nullptr && finished[r];
        for (int64_t j = 0; j < k; ++j) {
          py[r * k + j] = static_cast<scalar_t>(value[j]);
          pi[r * k + j] = done ? static_cast<int32_t>(e) : index[j];
        }
      }
    });
  });
}

void finalize_kernel(const at::Tensor& rows, const at::Tensor& skip1, const at::Tensor& skip2,
                     const at::Tensor& bias, const at::Tensor& scales, const int32_t* src,
                     const int32_t* expert, int64_t k, at::Tensor& out) {
  const int64_t n = out.size(0);
  const int64_t h = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(),
                                  "npu_moe_finalize_routing", [&] {
    using T = acc_t<scalar_t>;
    using Vec = AccVec<scalar_t>;
    using IO = VecPair<scalar_t>;
    using AccIO = VecPair<T>;
    const scalar_t* prow = rows.const_data_ptr<scalar_t>();
    const scalar_t* ps1 = skip1.defined() ? skip1.const_data_ptr<scalar_t>() : nullptr;
    const scalar_t* ps2 = skip2.defined() ? skip2.const_data_ptr<scalar_t>() : nullptr;
    const T* pb = bias.defined() ? bias.const_data_ptr<T>() : nullptr;
    const T* psc = scales.defined() ? scales.const_data_ptr<T>() : nullptr;
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows(h * (k + 1)), [&](int64_t begin, int64_t end) {
      // Per row: the K source rows (nullptr = dropped), bias rows and scales.
      std::vector<const scalar_t*> term_row(k);
      std::vector<const T*> term_bias(k);
      std::vector<Vec> term_scale(k);
      for (int64_t i = begin; i < end; ++i) {
        for (int64_t j = 0; j < k; ++j) {
          const int32_t s = src[i * k + j];
          term_row[j] = s >= 0 ? prow + s * h : nullptr;
          term_bias[j] = pb != nullptr ? pb + static_cast<int64_t>(expert[i * k + j]) * h : nullptr;
          term_scale[j] = Vec(psc != nullptr ? psc[i * k + j] : T(1));
        }
        const scalar_t* s1 = ps1 != nullptr ? ps1 + i * h : nullptr;
        const scalar_t* s2 = ps2 != nullptr ? ps2 + i * h : nullptr;
        scalar_t* o = po + i * h;
        for_each_step<scalar_t>(h, [&](int64_t c, int64_t len) {
          Vec a(0), b(0), u, v;
          if (s1 != nullptr) {
            IO::load(s1 + c, u, v, len);
            a = a + u;
            b = b + v;
          }
          if (s2 != nullptr) {
            IO::load(s2 + c, u, v, len);
            a = a + u;
            b = b + v;
          }
          for (int64_t j = 0; j < k; ++j) {
            Vec ra(0), rb(0);
            if (term_row[j] != nullptr) IO::load(term_row[j] + c, ra, rb, len);
            if (term_bias[j] != nullptr) {
              AccIO::load(term_bias[j] + c, u, v, len);
              ra = ra + u;
              rb = rb + v;
            }
            a = at::vec::fmadd(term_scale[j], ra, a);
            b = at::vec::fmadd(term_scale[j], rb, b);
          }
          IO::store(o + c, a, b, len);
        });
      }
    });
  });
}

void gather_rows_kernel(const at::Tensor& x, const int64_t* src_row, int64_t rows,
                        at::Tensor& out) {
  const int64_t row_bytes = x.size(1) * static_cast<int64_t>(x.element_size());
  const char* in = static_cast<const char*>(x.const_data_ptr());
  char* o = static_cast<char*>(out.mutable_data_ptr());
  const bool stream = stream_output(o, rows * row_bytes);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / row_bytes);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      char* dst = o + r * row_bytes;
      if (src_row[r] < 0) {
        std::memset(dst, 0, row_bytes);
      } else if (stream) {
        stream_bytes(dst, in + src_row[r] * row_bytes, row_bytes);
      } else {
        std::memcpy(dst, in + src_row[r] * row_bytes, row_bytes);
      }
    }
    if (stream) stream_fence();
  });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(gather_rows_slots, &gather_rows_kernel);
OPENNPU_REGISTER_CPU_SLOT(gating, &gating_kernel);
OPENNPU_REGISTER_CPU_SLOT(gating_v2, &gating_v2_kernel);
OPENNPU_REGISTER_CPU_SLOT(finalize, &finalize_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::moe
