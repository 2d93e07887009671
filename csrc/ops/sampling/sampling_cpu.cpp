// CPU kernels of the sampling family (compiled once per ISA; see common/cpu_dispatch.h):
// npu_top_k_top_p and npu_top_k_top_p_sample, one row per task of at::parallel_for.
//
// A row is converted to fp32 once. Top-k takes the k-th largest value with std::nth_element
// (linear time) and sorts only the entries at or above it; top-p without top-k sorts a first
// guess of the largest entries and grows it fourfold while the probability mass it needs lies
// further down, so a whole-vocabulary sort happens only where the kept set is that large. The
// order of every sort is the goldens' torch.sort(stable=True): value, then index.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "ops/sampling/sampling.h"

namespace opennpu::sampling {
inline namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Entry a comes before entry b in descending order: the larger value first, NaN above every
// number (where torch.sort puts it), equal values by index: the lower first (a stable descending
// sort, npu_top_k_top_p_sample's golden) or, with `reversed_ties`, the higher first (the reverse
// of a stable ascending sort, npu_top_k_top_p's golden).
struct Before {
  const float* x;
  bool reversed_ties = false;
  bool operator()(int32_t a, int32_t b) const {
    const float va = x[a], vb = x[b];
    const bool na = std::isnan(va), nb = std::isnan(vb);
    if (na || nb) return na && nb ? (a < b) != reversed_ties : na;
    if (va != vb) return va > vb;
    return (a < b) != reversed_ties;
  }
};

// a > b with NaN the largest value (a strict weak order, unlike a plain >).
inline bool greater_nan_first(float a, float b) {
  if (std::isnan(a)) return !std::isnan(b);
  if (std::isnan(b)) return false;
  return a > b;
}

// One thread's buffers, reused row after row.
struct Scratch {
  std::vector<float> x;       // the row in fp32
  std::vector<float> tmp;     // nth_element's copy of the row
  std::vector<float> all;     // softmax (or values) of the whole row
  std::vector<int32_t> idx;   // selected entries, in order
  std::vector<float> prob;    // their probabilities, in the same order
  bool reversed_ties = false; // the order of equal values (Before)
};

template <typename scalar_t>
void load_row(const scalar_t* src, int64_t n, std::vector<float>& x) {
  x.resize(n);
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::copy(src, src + n, x.begin());
  } else {
    at::vec::convert(src, x.data(), n);
  }
}

// The m-th largest value of x[0, n), 1 <= m <= n.
float kth_largest(const float* x, int64_t n, int64_t m, std::vector<float>& tmp) {
  tmp.assign(x, x + n);
  std::nth_element(tmp.begin(), tmp.begin() + (m - 1), tmp.end(), greater_nan_first);
  return tmp[m - 1];
}

// idx = the m first entries of the row in descending order (value, then index).
void top_sorted(const float* x, int64_t n, int64_t m, Scratch& s) {
  auto& idx = s.idx;
  idx.clear();
  if (m >= n) {
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), 0);
    std::sort(idx.begin(), idx.end(), Before{x, s.reversed_ties});
    return;
  }
  const float t = kth_largest(x, n, m, s.tmp);
  for (int64_t i = 0; i < n; ++i) {
    if (!greater_nan_first(t, x[i])) idx.push_back(static_cast<int32_t>(i));
  }
  std::partial_sort(idx.begin(), idx.begin() + m, idx.end(), Before{x, s.reversed_ties});
  idx.resize(m);
}

// out[i] = exp(x[i] - max) / sum over the row (the goldens' softmax, in fp32; the sum is kept in
// double, blocks of 256 summed in fp32 lanes). Returns the max.
float softmax_row(const float* x, int64_t n, float* out) {
  float mx = -kInf;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    nan |= std::isnan(x[i]);
    mx = std::max(mx, x[i]);
  }
  if (nan) mx = std::numeric_limits<float>::quiet_NaN();
  const Vec vmax(mx);
  double sum = 0;
  constexpr int64_t kBlock = 256;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    Vec acc(0.f);
    int64_t i = b;
    for (; i + Vec::size() <= end; i += Vec::size()) {
      const Vec e = (Vec::loadu(x + i) - vmax).exp();
      e.store(out + i);
      acc = acc + e;
    }
    float part = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return a + c; }, acc);
    for (; i < end; ++i) {
      out[i] = std::exp(x[i] - mx);
      part += out[i];
    }
    sum += part;
  }
  const float total = static_cast<float>(sum);
  at::vec::map([total](Vec v) { return v / Vec(total); }, out, out, n);
  return mx;
}

// prob[j] = softmax over the entries idx[0, n) of x, in that order.
void softmax_of(const float* x, const std::vector<int32_t>& idx, std::vector<float>& prob) {
  const size_t n = idx.size();
  prob.resize(n);
  float mx = -kInf;
  bool nan = false;
  for (size_t j = 0; j < n; ++j) {
    nan |= std::isnan(x[idx[j]]);
    mx = std::max(mx, x[idx[j]]);
  }
  if (nan) mx = std::numeric_limits<float>::quiet_NaN();
  double sum = 0;
  for (size_t j = 0; j < n; ++j) {
    prob[j] = std::exp(x[idx[j]] - mx);
    sum += prob[j];
  }
  const float total = static_cast<float>(sum);
  for (size_t j = 0; j < n; ++j) prob[j] /= total;
}

// ---------------------------------------------------------------------------------------------
// npu_top_k_top_p

// Top-p of the golden over the entries idx (sorted descending): their softmax, summed from the
// smallest up; entries whose running sum is <= thr are dropped, the largest never. `below` is
// the probability mass of the entries under idx (already dropped from the sum's point of view).
void drop_low_mass(const std::vector<float>& prob, std::vector<int32_t>& idx, double below,
                   float thr) {
  double cum = below;
  size_t keep = idx.size();
  for (size_t j = idx.size() - 1; j >= 1; --j) {
    cum += prob[j];
    if (static_cast<float>(cum) <= thr) {
      keep = j;
    } else {
      break;
    }
  }
  idx.resize(keep);
}

// Filters one row; returns false where everything is kept (idx unused), else the kept entries
// are idx.
bool filter_row(const float* x, int64_t n, int64_t k, const float* thr, Scratch& s) {
  bool all = true;
  if (k > 0 && k < n) {
    const float t = kth_largest(x, n, k, s.tmp);
    if (!std::isnan(t)) {  // (x < NaN) is false: the golden's mask keeps everything
      all = false;
      s.idx.clear();
      for (int64_t i = 0; i < n; ++i) {
        if (!(x[i] < t)) s.idx.push_back(static_cast<int32_t>(i));
      }
    }
  }
  if (thr == nullptr) return !all;
  if (!all) {
    std::sort(s.idx.begin(), s.idx.end(), Before{x, true});
    const float mx = x[s.idx[0]];
    if (!std::isfinite(mx)) return true;  // a NaN / inf softmax masks nothing more
    softmax_of(x, s.idx, s.prob);
    drop_low_mass(s.prob, s.idx, 0.0, *thr);
    return true;
  }
  // top-p over the whole row
  s.all.resize(n);
  const float mx = softmax_row(x, n, s.all.data());
  if (!std::isfinite(mx) || *thr < 0) return false;
  const float* prob = s.all.data();
  if (*thr == 0) {  // only entries of probability 0 have a running sum <= 0
    s.idx.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (prob[i] > 0) s.idx.push_back(static_cast<int32_t>(i));
    }
    return true;
  }
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += prob[i];
  for (int64_t m = std::min<int64_t>(n, 1024);; m = std::min(n, 4 * m)) {
    top_sorted(x, n, m, s);
    double top = 0;
    s.prob.resize(m);
    for (int64_t j = 0; j < m; ++j) {
      s.prob[j] = prob[s.idx[j]];
      top += s.prob[j];
    }
    const double below = m == n ? 0.0 : std::max(0.0, total - top);
    if (m < n && static_cast<float>(below) > *thr) continue;  // the cut is further down
    drop_low_mass(s.prob, s.idx, below, *thr);
    return true;
  }
}

template <typename scalar_t>
void top_k_top_p_impl(const at::Tensor& logits, const FilterArgs& args, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const scalar_t* src = logits.const_data_ptr<scalar_t>();
  scalar_t* dst = out.mutable_data_ptr<scalar_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    s.reversed_ties = true;  // the golden sorts ascending: of equal values the lower index goes first
    for (int64_t b = begin; b < end; ++b) {
      const scalar_t* in = src + b * n;
      scalar_t* o = dst + b * n;
      load_row(in, n, s.x);
      const float* thr = args.one_minus_p ? args.one_minus_p + b : nullptr;
      const int64_t k = args.k ? args.k[b] : 0;
      if (!filter_row(s.x.data(), n, k, thr, s)) {
        std::copy(in, in + n, o);
        continue;
      }
      std::fill(o, o + n, static_cast<scalar_t>(-kInf));
      for (const int32_t i : s.idx) o[i] = in[i];
    }
  });
}

void top_k_top_p_cpu(const at::Tensor& logits, const FilterArgs& args, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(),
                                  "npu_top_k_top_p", [&] {
                                    top_k_top_p_impl<scalar_t>(logits, args, out);
                                  });
}

// ---------------------------------------------------------------------------------------------
// npu_top_k_top_p_sample

// The golden's top-p over the selected entries (descending): entry j stays while the mass before
// it, float(running sum through j) - prob[j], is < p; p <= 0 keeps the first alone (with
// probability 1 when the input is logits). Returns whether the last entry stayed.
bool keep_nucleus(std::vector<int32_t>& idx, std::vector<float>& prob, float p,
                  bool input_is_logits) {
  if (!(p > 0)) {
    idx.resize(1);
    prob.resize(1);
    if (input_is_logits) prob[0] = 1.f;
    return false;
  }
  double cum = 0;
  size_t w = 0;
  bool last = false;
  for (size_t j = 0; j < idx.size(); ++j) {
    cum += prob[j];
    const float before = static_cast<float>(cum) - prob[j];
    last = !(before >= p);
    if (last) {
      idx[w] = idx[j];
      prob[w] = prob[j];
      ++w;
    }
  }
  idx.resize(w);
  prob.resize(w);
  return last;
}

// torch.argmax: the first maximum, a NaN above every number.
template <typename Score>
size_t first_argmax(size_t n, const Score& score) {
  size_t best = 0;
  float top = score(0);
  for (size_t j = 1; j < n && !std::isnan(top); ++j) {
    const float v = score(j);
    if (v > top || std::isnan(v)) {
      top = v;
      best = j;
    }
  }
  return best;
}

// One row: s.idx / s.prob = the selected entries and their probabilities, in the golden's order.
void select_row(const float* x, int64_t n, int64_t b, const SampleArgs& a, Scratch& s) {
  const int64_t k = a.top_k[b];
  const float p = a.top_p[b];
  const float min_p = a.min_p ? a.min_p[b] : -1.f;
  const bool use_k = k >= 1 && k <= std::min(a.k_max, n);
  const bool use_p = p < 1.f;
  auto& idx = s.idx;
  auto& prob = s.prob;
  if (!use_k && !use_p && min_p < 1.f) {  // no sort at all: the row in index order
    idx.resize(n);
    std::iota(idx.begin(), idx.end(), 0);
    prob.resize(n);
    if (a.input_is_logits) {
      softmax_row(x, n, prob.data());
    } else {
      std::copy(x, x + n, prob.begin());
    }
  } else if (use_k) {
    top_sorted(x, n, k, s);
    if (a.input_is_logits) {
      softmax_of(x, idx, prob);
    } else {
      prob.resize(idx.size());
      for (size_t j = 0; j < idx.size(); ++j) prob[j] = x[idx[j]];
    }
    if (use_p) keep_nucleus(idx, prob, p, a.input_is_logits);
  } else {
    // the probabilities of the whole row; then its largest entries, as many as top-p needs
    // (only the first where top-p is off: then min_p >= 1 keeps that one alone)
    s.all.resize(n);
    if (a.input_is_logits) {
      softmax_row(x, n, s.all.data());
    } else {
      std::copy(x, x + n, s.all.begin());
    }
    int64_t m = !use_p || !(p > 0) ? 1 : a.top_k_guess > 0 ? std::min(a.top_k_guess, n) : n;
    for (;; m = std::min(n, 4 * m)) {
      top_sorted(x, n, m, s);
      prob.resize(m);
      for (int64_t j = 0; j < m; ++j) prob[j] = s.all[idx[j]];
      if (!use_p) break;
      if (!keep_nucleus(idx, prob, p, a.input_is_logits) || m == n) break;
    }
  }
  if (min_p >= 1.f) {
    idx.resize(1);
    prob.resize(1);
  } else if (min_p > 0.f) {
    float mx = prob[0];
    for (const float v : prob) {
      if (std::isnan(v) || std::isnan(mx)) {
        mx = std::numeric_limits<float>::quiet_NaN();
        break;
      }
      mx = std::max(mx, v);
    }
    const float thd = mx * min_p;
    size_t w = 0;
    for (size_t j = 0; j < idx.size(); ++j) {
      if (prob[j] >= thd) {
        idx[w] = idx[j];
        prob[w] = prob[j];
        ++w;
      }
    }
    idx.resize(w);
    prob.resize(w);
  }
}

template <typename scalar_t>
void sample_impl(const at::Tensor& logits, const SampleArgs& a, at::Tensor& index,
                 at::Tensor& kept) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const scalar_t* src = logits.const_data_ptr<scalar_t>();
  int64_t* out_index = index.mutable_data_ptr<int64_t>();
  float* out_kept = kept.defined() ? kept.mutable_data_ptr<float>() : nullptr;
  const float fill = a.input_is_logits ? -kInf : 0.f;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t b = begin; b < end; ++b) {
      load_row(src + b * n, n, s.x);
      const float* x = s.x.data();
      select_row(x, n, b, a, s);
      const auto& idx = s.idx;
      const auto& prob = s.prob;
      size_t pick = 0;
      if (!idx.empty()) {
        const float* q = a.q ? a.q + b * n : nullptr;
        switch (a.post) {
          case Post::kArgmax:
            pick = first_argmax(idx.size(), [&](size_t j) { return prob[j]; });
            break;
          case Post::kQSample: {
            const float eps = a.eps;
            pick = first_argmax(idx.size(),
                                [&](size_t j) { return prob[j] / (std::fabs(q[j]) + eps); });
            break;
          }
          case Post::kMultinomial:
            pick = first_argmax(idx.size(), [&](size_t j) { return prob[j] / q[j]; });
            break;
        }
        out_index[b] = idx[pick];
      } else {
        out_index[b] = 0;  // nothing kept: only a NaN min_p threshold gets here
      }
      if (out_kept != nullptr) {
        float* o = out_kept + b * n;
        std::fill(o, o + n, fill);
        for (const int32_t i : idx) o[i] = x[i];
      }
    }
  });
}

void sample_cpu(const at::Tensor& logits, const SampleArgs& a, at::Tensor& index,
                at::Tensor& kept) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, logits.scalar_type(),
                                  "npu_top_k_top_p_sample", [&] {
                                    sample_impl<scalar_t>(logits, a, index, kept);
                                  });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(top_k_top_p, &top_k_top_p_cpu);
OPENNPU_REGISTER_CPU_SLOT(top_k_top_p_sample, &sample_cpu);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::sampling
