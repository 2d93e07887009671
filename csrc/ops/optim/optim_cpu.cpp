// CPU kernels of the fused optimizers (compiled once per ISA; see common/cpu_dispatch.h).
//
// Work split: the slots of a call are laid end to end and at::parallel_for cuts that element range
// into one equal piece per thread; a piece covers the tail of one tensor, whole tensors, and the
// head of another. Every element-wise step reads p, g and the states once and writes p and the
// states once, computing in acc_t (fp32 for fp16/bf16/fp32 parameters) and rounding each stored
// value once. The update formulas follow torch.optim's operation order (e.g. lerp for Adam's first
// moment, square average decayed then increased), so fp32 results agree with torch to a few ulps.
//
// Per-tensor reductions (LAMB trust ratios, AdamP projections, gradient norms) accumulate each
// piece in fp32 vectors, then in double across pieces and threads.
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <mutex>
#include <type_traits>

#include "common/vec.h"
#include "ops/optim/optim.h"

namespace opennpu::optim {
inline namespace CPU_CAPABILITY {
namespace {

// Elements per thread below which a call stays on one thread (about 20 us of streaming).
constexpr int64_t kGrain = int64_t{1} << 15;

// Calls body(slot, begin, length) for the parts of each slot inside each thread's equal share of
// the concatenated element range.
template <typename Body>
void for_each_piece(const std::vector<Slot>& slots, const Body& body) {
  std::vector<int64_t> start(slots.size() + 1, 0);
  for (size_t i = 0; i < slots.size(); ++i) start[i + 1] = start[i] + slots[i].numel;
  at::parallel_for(0, start.back(), kGrain, [&](int64_t begin, int64_t end) {
    size_t t = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    while (begin < end) {
      const int64_t stop = std::min(end, start[t + 1]);
      if (stop > begin) body(t, begin - start[t], stop - begin);
      begin = stop;
      ++t;
    }
  });
}

// Runs fn(T{}) with T the C++ type of a parameter dtype.
template <typename Fn>
void dispatch(at::ScalarType dtype, const Fn& fn) {
  switch (dtype) {
    case at::kFloat:
      return fn(float{});
    case at::kHalf:
      return fn(at::Half{});
    case at::kBFloat16:
      return fn(at::BFloat16{});
    case at::kDouble:
      return fn(double{});
    default:
      TORCH_INTERNAL_ASSERT(false, "fused optimizer kernel: unexpected dtype ", dtype);
  }
}

template <typename T>
T* buffer(const Slot& s, int i, int64_t offset) {
  return s.buf[i] == nullptr ? nullptr : static_cast<T*>(s.buf[i]) + offset;
}

// m and v as stored: rounded to the parameter's dtype (nothing to do for fp32). LAMB and AdamP
// compute the update once in the pass that writes the moments and again, from memory, in a
// second pass; both must see the same values.
template <typename T>
inline void as_stored(AccVec<T>& a, AccVec<T>& b) {
  if constexpr (VecPair<T>::kReduced) {
    const auto rounded = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
    a = std::get<0>(rounded);
    b = std::get<1>(rounded);
  }
}

// The gradient as the update sees it: unscaled (AMP) and negated for maximize.
template <typename Vec>
inline Vec effective_grad(Vec g, const Vec& scale, bool scaled, bool maximize) {
  if (scaled) g = g * scale;
  return maximize ? g.neg() : g;
}

// ---------------------------------------------------------------------------------------------
// Adam / AdamW

template <typename T>
void adam_piece(const Slot& s, int64_t b, int64_t n, const AdamArgs& a) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  using IO = VecPair<T>;
  T* p = buffer<T>(s, 0, b);
  const T* g = buffer<T>(s, 1, b);
  T* m = buffer<T>(s, 2, b);
  T* v = buffer<T>(s, 3, b);
  T* vmax = a.amsgrad ? buffer<T>(s, 4, b) : nullptr;
  const bool scaled = a.grad_scale != 1.0;
  const bool decay = a.weight_decay != 0 && a.decoupled;
  const bool l2 = a.weight_decay != 0 && !a.decoupled;
  const Vec gscale(A(a.grad_scale)), keep(A(1 - a.lr * a.weight_decay)), wd(A(a.weight_decay));
  const Vec w1(A(1 - a.beta1)), beta2(A(a.beta2)), w2(A(1 - a.beta2)), eps(A(a.eps));
  const Vec step_size(A(s.s[0])), bc2_sqrt(A(s.s[1]));
  for_each_step<T>(n, [&](int64_t k, int64_t l) {
    Vec P[2], G[2], M[2], V[2], X[2];
    IO::load(p + k, P[0], P[1], l);
    IO::load(g + k, G[0], G[1], l);
    IO::load(m + k, M[0], M[1], l);
    IO::load(v + k, V[0], V[1], l);
    if (vmax) IO::load(vmax + k, X[0], X[1], l);
    for (int h = 0; h < 2; ++h) {
      Vec gh = effective_grad(G[h], gscale, scaled, a.maximize);
      if (decay) P[h] = P[h] * keep;
      if (l2) gh = gh + wd * P[h];
      M[h] = M[h] + w1 * (gh - M[h]);  // lerp(m, g, 1 - beta1)
      V[h] = V[h] * beta2 + w2 * gh * gh;
      Vec vh = V[h];
      if (vmax) vh = X[h] = at::vec::maximum(X[h], V[h]);
      const Vec denom = vh.sqrt() / bc2_sqrt + eps;
      P[h] = P[h] - step_size * (M[h] / denom);
    }
    IO::store(p + k, P[0], P[1], l);
    IO::store(m + k, M[0], M[1], l);
    IO::store(v + k, V[0], V[1], l);
    if (vmax) IO::store(vmax + k, X[0], X[1], l);
  });
}

void adam_kernel(const std::vector<Slot>& slots, const AdamArgs& args) {
  for_each_piece(slots, [&](size_t t, int64_t b, int64_t n) {
    dispatch(slots[t].dtype, [&](auto tag) { adam_piece<decltype(tag)>(slots[t], b, n, args); });
  });
}

// ---------------------------------------------------------------------------------------------
// SGD

template <typename T>
void sgd_piece(const Slot& s, int64_t b, int64_t n, const SgdArgs& a) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  using IO = VecPair<T>;
  T* p = buffer<T>(s, 0, b);
  const T* g = buffer<T>(s, 1, b);
  T* buf = buffer<T>(s, 2, b);
  const bool fresh = s.s[0] != 0;
  const bool scaled = a.grad_scale != 1.0;
  const Vec gscale(A(a.grad_scale)), wd(A(a.weight_decay)), mom(A(a.momentum));
  const Vec w(A(1 - a.dampening)), lr(A(a.lr));
  for_each_step<T>(n, [&](int64_t k, int64_t l) {
    Vec P[2], G[2], B[2];
    IO::load(p + k, P[0], P[1], l);
    IO::load(g + k, G[0], G[1], l);
    if (buf && !fresh) IO::load(buf + k, B[0], B[1], l);
    for (int h = 0; h < 2; ++h) {
      Vec gh = effective_grad(G[h], gscale, scaled, a.maximize);
      if (a.weight_decay != 0) gh = gh + wd * P[h];
      if (buf) {
        B[h] = fresh ? gh : B[h] * mom + w * gh;  // the first step copies the gradient
        gh = a.nesterov ? gh + mom * B[h] : B[h];
      }
      P[h] = P[h] - lr * gh;
    }
    IO::store(p + k, P[0], P[1], l);
    if (buf) IO::store(buf + k, B[0], B[1], l);
  });
}

void sgd_kernel(const std::vector<Slot>& slots, const SgdArgs& args) {
  for_each_piece(slots, [&](size_t t, int64_t b, int64_t n) {
    dispatch(slots[t].dtype, [&](auto tag) { sgd_piece<decltype(tag)>(slots[t], b, n, args); });
  });
}

// ---------------------------------------------------------------------------------------------
// RMSprop (torch) and RMSpropTF (TF / timm order of operations)

template <typename T>
void rmsprop_piece(const Slot& s, int64_t b, int64_t n, const RmspropArgs& a) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  using IO = VecPair<T>;
  T* p = buffer<T>(s, 0, b);
  const T* g = buffer<T>(s, 1, b);
  T* sq = buffer<T>(s, 2, b);
  T* ga = buffer<T>(s, 3, b);
  T* buf = buffer<T>(s, 4, b);
  const bool scaled = a.grad_scale != 1.0;
  const bool decoupled = a.tf && a.decoupled_decay;
  const Vec gscale(A(a.grad_scale)), wd(A(a.weight_decay)), alpha(A(a.alpha));
  const Vec w(A(1 - a.alpha)), eps(A(a.eps)), mom(A(a.momentum)), lr(A(a.lr));
  for_each_step<T>(n, [&](int64_t k, int64_t l) {
    Vec P[2], G[2], S[2], C[2], B[2];
    IO::load(p + k, P[0], P[1], l);
    IO::load(g + k, G[0], G[1], l);
    IO::load(sq + k, S[0], S[1], l);
    if (ga) IO::load(ga + k, C[0], C[1], l);
    if (buf) IO::load(buf + k, B[0], B[1], l);
    for (int h = 0; h < 2; ++h) {
      Vec gh = effective_grad(G[h], gscale, scaled, a.maximize);
      if (a.weight_decay != 0) {
        if (decoupled) {
          P[h] = P[h] - wd * P[h];  // torch_npu's decoupled decay: p -= wd * p (no lr)
        } else {
          gh = gh + wd * P[h];
        }
      }
      Vec avg;
      if (a.tf) {
        S[h] = S[h] + w * (gh * gh - S[h]);
        if (ga) C[h] = C[h] + w * (gh - C[h]);
        avg = ((ga ? S[h] - C[h] * C[h] : S[h]) + eps).sqrt();  // eps inside the root
      } else {
        S[h] = S[h] * alpha + w * gh * gh;
        if (ga) C[h] = C[h] + w * (gh - C[h]);  // lerp(grad_avg, g, 1 - alpha)
        avg = (ga ? S[h] - C[h] * C[h] : S[h]).sqrt() + eps;
      }
      if (buf) {
        if (a.tf && a.lr_in_momentum) {
          B[h] = B[h] * mom + lr * (gh / avg);
          P[h] = P[h] - B[h];
        } else {
          B[h] = B[h] * mom + gh / avg;
          P[h] = P[h] - lr * B[h];
        }
      } else {
        P[h] = P[h] - lr * (gh / avg);
      }
    }
    IO::store(p + k, P[0], P[1], l);
    IO::store(sq + k, S[0], S[1], l);
    if (ga) IO::store(ga + k, C[0], C[1], l);
    if (buf) IO::store(buf + k, B[0], B[1], l);
  });
}

void rmsprop_kernel(const std::vector<Slot>& slots, const RmspropArgs& args) {
  for_each_piece(slots, [&](size_t t, int64_t b, int64_t n) {
    dispatch(slots[t].dtype, [&](auto tag) { rmsprop_piece<decltype(tag)>(slots[t], b, n, args); });
  });
}

// ---------------------------------------------------------------------------------------------
// Adadelta

template <typename T>
void adadelta_piece(const Slot& s, int64_t b, int64_t n, const AdadeltaArgs& a) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  using IO = VecPair<T>;
  T* p = buffer<T>(s, 0, b);
  const T* g = buffer<T>(s, 1, b);
  T* sq = buffer<T>(s, 2, b);
  T* acc = buffer<T>(s, 3, b);
  const bool scaled = a.grad_scale != 1.0;
  const Vec gscale(A(a.grad_scale)), wd(A(a.weight_decay)), rho(A(a.rho)), w(A(1 - a.rho));
  const Vec eps(A(a.eps)), lr(A(a.lr));
  for_each_step<T>(n, [&](int64_t k, int64_t l) {
    Vec P[2], G[2], S[2], D[2];
    IO::load(p + k, P[0], P[1], l);
    IO::load(g + k, G[0], G[1], l);
    IO::load(sq + k, S[0], S[1], l);
    IO::load(acc + k, D[0], D[1], l);
    for (int h = 0; h < 2; ++h) {
      Vec gh = effective_grad(G[h], gscale, scaled, a.maximize);
      if (a.weight_decay != 0) gh = gh + wd * P[h];
      S[h] = S[h] * rho + w * gh * gh;
      const Vec delta = (D[h] + eps).sqrt() / (S[h] + eps).sqrt() * gh;
      D[h] = D[h] * rho + w * delta * delta;
      P[h] = P[h] - lr * delta;
    }
    IO::store(p + k, P[0], P[1], l);
    IO::store(sq + k, S[0], S[1], l);
    IO::store(acc + k, D[0], D[1], l);
  });
}

void adadelta_kernel(const std::vector<Slot>& slots, const AdadeltaArgs& args) {
  for_each_piece(slots, [&](size_t t, int64_t b, int64_t n) {
    dispatch(slots[t].dtype, [&](auto tag) { adadelta_piece<decltype(tag)>(slots[t], b, n, args); });
  });
}

// ---------------------------------------------------------------------------------------------
// LAMB / BERT-Adam: u = m / (sqrt(v) + eps) + wd * p

template <typename T>
void lamb_piece(const Slot& s, int64_t b, int64_t n, const LambArgs& a, LambPhase phase,
                double& sum_p2, double& sum_u2) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  using IO = VecPair<T>;
  T* p = buffer<T>(s, 0, b);
  const T* g = buffer<T>(s, 1, b);
  T* m = buffer<T>(s, 2, b);
  T* v = buffer<T>(s, 3, b);
  const bool moments = phase != LambPhase::kApply;
  const bool scaled = s.s[3] != 1.0;
  const Vec gscale(A(s.s[3])), beta1(A(a.beta1)), w1(A(1 - a.beta1));
  const Vec beta2(A(a.beta2)), w2(A(1 - a.beta2)), eps(A(a.eps)), wd(A(a.weight_decay));
  const Vec rate(A(s.s[2]));
  Vec acc_p(0), acc_u(0);
  for_each_step<T>(n, [&](int64_t k, int64_t l) {
    Vec P[2], M[2], V[2];
    IO::load(p + k, P[0], P[1], l);
    IO::load(m + k, M[0], M[1], l);
    IO::load(v + k, V[0], V[1], l);
    Vec G[2];
    if (moments) IO::load(g + k, G[0], G[1], l);
    if (moments) {
      for (int h = 0; h < 2; ++h) {
        const Vec gh = effective_grad(G[h], gscale, scaled, false);
        M[h] = M[h] * beta1 + w1 * gh;
        V[h] = V[h] * beta2 + w2 * gh * gh;
      }
      as_stored<T>(M[0], M[1]);
      as_stored<T>(V[0], V[1]);
    }
    for (int h = 0; h < 2; ++h) {
      Vec u = M[h] / (V[h].sqrt() + eps);
      if (a.weight_decay != 0) u = u + wd * P[h];
      if (phase == LambPhase::kMoments) {
        acc_p = at::vec::fmadd(P[h], P[h], acc_p);
        acc_u = at::vec::fmadd(u, u, acc_u);
      } else {
        P[h] = P[h] - rate * u;
      }
    }
    if (moments) {
      IO::store(m + k, M[0], M[1], l);
      IO::store(v + k, V[0], V[1], l);
    }
    if (phase != LambPhase::kMoments) IO::store(p + k, P[0], P[1], l);
  });
  sum_p2 = horizontal_sum(acc_p);
  sum_u2 = horizontal_sum(acc_u);
}

void lamb_kernel(std::vector<Slot>& slots, const LambArgs& args, LambPhase phase) {
  std::mutex mutex;
  for_each_piece(slots, [&](size_t t, int64_t b, int64_t n) {
    double sum_p2 = 0, sum_u2 = 0;
    dispatch(slots[t].dtype, [&](auto tag) {
      lamb_piece<decltype(tag)>(slots[t], b, n, args, phase, sum_p2, sum_u2);
    });
    if (phase == LambPhase::kMoments) {
      std::lock_guard<std::mutex> lock(mutex);
      slots[t].s[0] += sum_p2;
      slots[t].s[1] += sum_u2;
    }
  });
}

// ---------------------------------------------------------------------------------------------
// AdamP

// perturb = m / denom, or the Nesterov form (beta1 m + (1 - beta1) g) / denom.
template <typename Vec>
inline Vec adamp_perturb(const Vec& m, const Vec& v, const Vec& g, const Vec& beta1, const Vec& w1,
                         const Vec& bc2_sqrt, const Vec& eps, bool nesterov) {
  const Vec denom = v.sqrt() / bc2_sqrt + eps;
  return (nesterov ? beta1 * m + w1 * g : m) / denom;
}

// Calls seg(row, begin, length) for the row segments of [b, b + n) (rows of `len` elements).
template <typename Seg>
void for_each_row_segment(int64_t b, int64_t n, int64_t len, const Seg& seg) {
  for (int64_t i = b; i < b + n;) {
    const int64_t row = i / len;
    const int64_t stop = std::min(b + n, (row + 1) * len);
    seg(row, i, stop - i);
    i = stop;
  }
}

template <typename T>
void adamp_moments_piece(const Slot& s, int64_t b, int64_t n, const AdampArgs& a,
                         std::vector<double>& local, int64_t first_row) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  using IO = VecPair<T>;
  const bool scaled = a.grad_scale != 1.0;
  const Vec gscale(A(a.grad_scale)), beta1(A(a.beta1)), w1(A(1 - a.beta1));
  const Vec beta2(A(a.beta2)), w2(A(1 - a.beta2)), eps(A(a.eps)), bc2_sqrt(A(s.s[1]));
  const int64_t len = s.numel / s.rows;
  for_each_row_segment(b, n, len, [&](int64_t row, int64_t rb, int64_t rn) {
    const T* p = buffer<T>(s, 0, rb);
    const T* g = buffer<T>(s, 1, rb);
    T* m = buffer<T>(s, 2, rb);
    T* v = buffer<T>(s, 3, rb);
    Vec gp(0), gg(0), pp(0), pq(0);
    for_each_step<T>(rn, [&](int64_t k, int64_t l) {
      Vec P[2], G[2], M[2], V[2];
      IO::load(p + k, P[0], P[1], l);
      IO::load(g + k, G[0], G[1], l);
      IO::load(m + k, M[0], M[1], l);
      IO::load(v + k, V[0], V[1], l);
      Vec GH[2];
      for (int h = 0; h < 2; ++h) {
        GH[h] = effective_grad(G[h], gscale, scaled, false);
        M[h] = M[h] * beta1 + w1 * GH[h];
        V[h] = V[h] * beta2 + w2 * GH[h] * GH[h];
      }
      as_stored<T>(M[0], M[1]);
      as_stored<T>(V[0], V[1]);
      for (int h = 0; h < 2; ++h) {
        const Vec& gh = GH[h];
        const Vec q = adamp_perturb(M[h], V[h], gh, beta1, w1, bc2_sqrt, eps, a.nesterov);
        gp = at::vec::fmadd(gh, P[h], gp);
        gg = at::vec::fmadd(gh, gh, gg);
        pp = at::vec::fmadd(P[h], P[h], pp);
        pq = at::vec::fmadd(P[h], q, pq);
      }
      IO::store(m + k, M[0], M[1], l);
      IO::store(v + k, V[0], V[1], l);
    });
    double* out = local.data() + 4 * (row - first_row);
    out[0] += horizontal_sum(gp);
    out[1] += horizontal_sum(gg);
    out[2] += horizontal_sum(pp);
    out[3] += horizontal_sum(pq);
  });
}

void adamp_moments_kernel(const std::vector<Slot>& slots, const AdampArgs& args,
                          std::vector<std::vector<double>>& row_sums) {
  std::mutex mutex;
  for_each_piece(slots, [&](size_t t, int64_t b, int64_t n) {
    const Slot& s = slots[t];
    const int64_t len = s.numel / s.rows;
    const int64_t first_row = b / len, last_row = (b + n - 1) / len;
    std::vector<double> local(4 * (last_row - first_row + 1), 0.0);
    dispatch(s.dtype, [&](auto tag) {
      adamp_moments_piece<decltype(tag)>(s, b, n, args, local, first_row);
    });
    std::lock_guard<std::mutex> lock(mutex);
    for (size_t i = 0; i < local.size(); ++i) row_sums[t][4 * first_row + i] += local[i];
  });
}

template <typename T>
void adamp_apply_piece(const Slot& s, int64_t b, int64_t n, const AdampArgs& a,
                       const std::vector<double>& coef) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  using IO = VecPair<T>;
  const bool scaled = a.grad_scale != 1.0;
  const Vec gscale(A(a.grad_scale)), beta1(A(a.beta1)), w1(A(1 - a.beta1));
  const Vec eps(A(a.eps)), step_size(A(s.s[0])), bc2_sqrt(A(s.s[1])), keep(A(s.s[2]));
  const int64_t len = coef.size() > 1 ? s.numel / s.rows : s.numel;
  for_each_row_segment(b, n, len, [&](int64_t row, int64_t rb, int64_t rn) {
    T* p = buffer<T>(s, 0, rb);
    const T* g = buffer<T>(s, 1, rb);
    const T* m = buffer<T>(s, 2, rb);
    const T* v = buffer<T>(s, 3, rb);
    const bool project = !coef.empty();
    const Vec c(A(project ? coef[row] : 0.0));
    for_each_step<T>(rn, [&](int64_t k, int64_t l) {
      Vec P[2], G[2], M[2], V[2];
      IO::load(p + k, P[0], P[1], l);
      if (a.nesterov) IO::load(g + k, G[0], G[1], l);
      IO::load(m + k, M[0], M[1], l);
      IO::load(v + k, V[0], V[1], l);
      for (int h = 0; h < 2; ++h) {
        const Vec gh = a.nesterov ? effective_grad(G[h], gscale, scaled, false) : Vec(0);
        Vec q = adamp_perturb(M[h], V[h], gh, beta1, w1, bc2_sqrt, eps, a.nesterov);
        if (project) q = q - P[h] * c;  // the projection uses p before weight decay
        P[h] = P[h] * keep - step_size * q;
      }
      IO::store(p + k, P[0], P[1], l);
    });
  });
}

void adamp_apply_kernel(const std::vector<Slot>& slots, const AdampArgs& args,
                        const std::vector<std::vector<double>>& row_coef) {
  for_each_piece(slots, [&](size_t t, int64_t b, int64_t n) {
    dispatch(slots[t].dtype, [&](auto tag) {
      adamp_apply_piece<decltype(tag)>(slots[t], b, n, args, row_coef[t]);
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Gradient norms and scaling

// The norms the kernel computes; the kind is fixed per call, so the inner loop has no branch on it.
enum class NormKind { kTwo, kOne, kInf, kPow };

// Adds |g|^p of one vector of gradients into an accumulator (max |g| for kInf).
template <NormKind K, typename Vec>
inline void norm_add(Vec& acc, const Vec& g, const Vec& pw) {
  if constexpr (K == NormKind::kTwo) {
    acc = at::vec::fmadd(g, g, acc);  // g * g needs no abs; NaN and inf propagate
  } else if constexpr (K == NormKind::kOne) {
    acc = acc + g.abs();
  } else if constexpr (K == NormKind::kInf) {
    acc = at::vec::maximum(acc, g.abs());  // propagates NaN
  } else {
    acc = acc + g.abs().pow(pw);
  }
}

// Loads one unit of kStep gradient elements as two fp32 (or fp64) vectors. For bf16 the unit
// is read as int32 lanes, each holding two bf16 values, and widened with one shift (the low
// value) and one mask (the high value): a bf16 value is the upper half of the fp32 with the same
// bits, so both conversions are exact. The two vectors then hold the even and the odd elements
// rather than the first and the second half, which no reduction cares about. That is 2 ALU
// operations per cache line instead of the 4 of a widening conversion (vpmovzxwd + shift, twice),
// and a read-only pass is limited by how many lines the out-of-order window keeps in flight.
template <typename T>
inline void load_unit(const T* g, AccVec<T>& a, AccVec<T>& b) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    using IVec = at::vec::Vectorized<int32_t>;
    static_assert(IVec::size() == AccVec<T>::size() && 2 * IVec::size() == VecPair<T>::kStep);
    const IVec x = IVec::loadu(g);
    a = at::vec::cast<float>(x << IVec(16));
    b = at::vec::cast<float>(x & IVec(static_cast<int32_t>(0xFFFF0000u)));
  } else {
    VecPair<T>::load(g, a, b);
  }
}

template <typename T, NormKind K>
double grad_norm_piece(const Slot& s, int64_t b, int64_t n, double norm_type) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  using IO = VecPair<T>;
  const T* g = buffer<T>(s, 1, b);
  const Vec pw(static_cast<A>(norm_type));
  // kUnroll units (8 cache lines of bf16 with AVX-512) per iteration into 8 accumulators: the
  // pass is bound by outstanding loads, and the fewer instructions there are per line the more
  // lines the out-of-order window has in flight (one line per iteration: ~16 GB/s of reads on 2
  // threads where fp32 reached 20; 8 lines with the bf16 shift / mask above: ~21).
  constexpr int kUnroll = 8;
  constexpr int64_t kStep = IO::kStep;
  Vec acc[8];
  for (auto& a : acc) a = Vec(0);
  int64_t k = 0;
  for (; k + kUnroll * kStep <= n; k += kUnroll * kStep) {
    for (int h = 0; h < kUnroll; ++h) {
      Vec lo, hi;
      load_unit<T>(g + k + h * kStep, lo, hi);
      norm_add<K>(acc[(2 * h) % 8], lo, pw);
      norm_add<K>(acc[(2 * h + 1) % 8], hi, pw);
    }
  }
  for_each_step<T>(n - k, [&](int64_t j, int64_t l) {
    Vec G[2];
    IO::load(g + k + j, G[0], G[1], l);  // lanes past l are 0: neutral for sums and for max |g|
    norm_add<K>(acc[0], G[0], pw);
    norm_add<K>(acc[1], G[1], pw);
  });
  if constexpr (K == NormKind::kInf) {
    for (int i = 1; i < 8; ++i) acc[0] = at::vec::maximum(acc[0], acc[i]);
    return at::vec::vec_reduce_all<A>(
        [](auto& x, auto& y) { return at::vec::maximum(x, y); }, acc[0]);
  } else {
    for (int i = 1; i < 8; ++i) acc[0] = acc[0] + acc[i];
    return horizontal_sum(acc[0]);
  }
}

template <typename T>
double grad_norm_dispatch(const Slot& s, int64_t b, int64_t n, double norm_type) {
  if (std::isinf(norm_type)) return grad_norm_piece<T, NormKind::kInf>(s, b, n, norm_type);
  if (norm_type == 2) return grad_norm_piece<T, NormKind::kTwo>(s, b, n, norm_type);
  if (norm_type == 1) return grad_norm_piece<T, NormKind::kOne>(s, b, n, norm_type);
  return grad_norm_piece<T, NormKind::kPow>(s, b, n, norm_type);
}

double grad_norm_kernel(const std::vector<Slot>& slots, double norm_type) {
  const bool inf = std::isinf(norm_type);
  std::mutex mutex;
  double total = 0;
  for_each_piece(slots, [&](size_t t, int64_t b, int64_t n) {
    double part = 0;
    dispatch(slots[t].dtype, [&](auto tag) {
      part = grad_norm_dispatch<decltype(tag)>(slots[t], b, n, norm_type);
    });
    std::lock_guard<std::mutex> lock(mutex);
    if (std::isnan(part) || std::isnan(total)) {
      total = std::numeric_limits<double>::quiet_NaN();
    } else {
      total = inf ? std::max(total, part) : total + part;
    }
  });
  return total;
}

template <typename T>
bool grad_scale_piece(const Slot& s, int64_t b, int64_t n, double scale, bool check) {
  using A = acc_t<T>;
  using Vec = AccVec<T>;
  using IO = VecPair<T>;
  T* g = buffer<T>(s, 1, b);
  const bool write = scale != 1.0;
  const Vec factor(static_cast<A>(scale));
  Vec bad(0);  // x - x is 0 for finite x and NaN for inf and NaN, so one NaN taints the sum
  for_each_step<T>(n, [&](int64_t k, int64_t l) {
    Vec G[2];
    IO::load(g + k, G[0], G[1], l);
    if (check) bad = bad + (G[0] - G[0]) + (G[1] - G[1]);
    if (write) IO::store(g + k, G[0] * factor, G[1] * factor, l);
  });
  return check && std::isnan(horizontal_sum(bad));
}

bool grad_scale_kernel(const std::vector<Slot>& slots, double scale, bool check_finite) {
  std::atomic<bool> found{false};
  for_each_piece(slots, [&](size_t t, int64_t b, int64_t n) {
    bool bad = false;
    dispatch(slots[t].dtype, [&](auto tag) {
      bad = grad_scale_piece<decltype(tag)>(slots[t], b, n, scale, check_finite);
    });
    if (bad) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(adam, &adam_kernel);
OPENNPU_REGISTER_CPU_SLOT(sgd, &sgd_kernel);
OPENNPU_REGISTER_CPU_SLOT(rmsprop, &rmsprop_kernel);
OPENNPU_REGISTER_CPU_SLOT(adadelta, &adadelta_kernel);
OPENNPU_REGISTER_CPU_SLOT(lamb, &lamb_kernel);
OPENNPU_REGISTER_CPU_SLOT(adamp_moments, &adamp_moments_kernel);
OPENNPU_REGISTER_CPU_SLOT(adamp_apply, &adamp_apply_kernel);
OPENNPU_REGISTER_CPU_SLOT(grad_norm, &grad_norm_kernel);
OPENNPU_REGISTER_CPU_SLOT(grad_scale, &grad_scale_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::optim
