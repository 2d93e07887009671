// Flash-style CPU kernels of npu_fusion_attention and its gradient.
//
// Forward: one task per (batch, query head, block of kQBlock query rows). A task walks the key
// blocks its rows can see, computes the score tile Q K^T with one BLAS GEMM, applies scale, pse
// and the visibility rules, and folds the tile into the running softmax (online max and sum,
// rescaling the output accumulator when the max grows), then adds P V with a second GEMM. Memory
// per thread is one kQBlock x kKvBlock tile plus the kQBlock x Dv accumulator: no Sq x Skv buffer
// ever exists. softmax_max / softmax_sum keep the statistics so the backward can recompute P.
//
// Backward: one task per (batch, query head); it owns its dq rows and a private dk/dv slice for
// that head, so no two threads write the same memory (the caller sums dk/dv over each GQA group).
// For each (query block, key block) it recomputes P = exp(s - max) / sum, and with five GEMMs
// accumulates dV += P'^T dO, dP = dO V^T, dS = P * (dP' - rowsum(dO * O)) * scale,
// dQ += dS K and dK += dS^T Q, where P' and dP' carry the dropout keep mask / keep_prob.
//
// Tasks are handed out dynamically (an atomic counter), heaviest first, because causal and band
// masks make later query blocks more expensive than earlier ones.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm_cpu_dispatch.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "common/vec.h"
#include "ops/attention/attention.h"

namespace opennpu::attention {
inline namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

constexpr int64_t kQBlock = 128;
constexpr int64_t kKvBlock = 512;

// Row-major tile GEMMs through ATen's CPU matmul (at::cpu::mm_out / addmm_out call the BLAS,
// MKL in PyTorch's x86 builds, without a trip through the dispatcher). Operands are wrapped in
// place with from_blob: a [rows, cols] block with leading dimension ld is strides {ld, 1}.
template <typename T>
at::Tensor wrap(const T* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<T*>(data), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
}

// C = A B + beta C, with beta 0 (C overwritten) or 1 (accumulate).
template <typename T>
void gemm(const at::Tensor& a, const at::Tensor& b, T beta, T* c, int64_t m, int64_t n, int64_t ldc) {
  at::Tensor out = wrap(c, m, n, ldc);
  if (beta == T(0)) {
    at::cpu::mm_out(out, a, b);
  } else {
    at::cpu::addmm_out(out, out, a, b, 1, 1);
  }
}
// C[m, n] = A[m, k] B[n, k]^T + beta C
template <typename T>
void gemm_abt(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
              T beta, T* c, int64_t ldc) {
  gemm<T>(wrap(a, m, k, lda), wrap(b, n, k, ldb).t(), beta, c, m, n, ldc);
}
// C[m, n] = A[m, k] B[k, n] + beta C
template <typename T>
void gemm_ab(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
             T beta, T* c, int64_t ldc) {
  gemm<T>(wrap(a, m, k, lda), wrap(b, k, n, ldb), beta, c, m, n, ldc);
}
// C[m, n] = A[k, m]^T B[k, n] + beta C
template <typename T>
void gemm_atb(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
              T beta, T* c, int64_t ldc) {
  gemm<T>(wrap(a, k, m, lda).t(), wrap(b, k, n, ldb), beta, c, m, n, ldc);
}

// exp of the softmax: ATen's exp_u20 polynomial for fp32 (relative error ~1e-6, far below the
// rounding of anything computed from a weighted sum of values; it maps -inf to 0), exact for fp64.
template <typename T>
inline Vectorized<T> softmax_exp(const Vectorized<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// s[j] += scale * pse[j] over [0, n): the scores come from (scale * Q) K^T, so this completes
// scale * (Q K^T + pse).
template <typename T>
void add_scaled_pse(T* s, const T* pse, int64_t n, T scale) {
  using Vec = Vectorized<T>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    at::vec::fmadd(Vec::loadu(pse + j), Vec(scale), Vec::loadu(s + j)).store(s + j);
  }
  for (; j < n; ++j) s[j] += scale * pse[j];
}

// dst[r, :] = scale * q[r, :] for a block of query rows (row stride ld), so the score GEMM yields
// scaled logits directly.
template <typename T>
void scale_query_rows(const T* q, int64_t ld, int64_t rows, int64_t d, T scale, T* dst) {
  using Vec = Vectorized<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + r * ld;
    T* out = dst + r * d;
    int64_t j = 0;
    for (; j + Vec::size() <= d; j += Vec::size()) (Vec::loadu(src + j) * Vec(scale)).store(out + j);
    for (; j < d; ++j) out[j] = src[j] * scale;
  }
}

template <typename T>
T row_max(const T* s, int64_t n) {
  using Vec = Vectorized<T>;
  Vec vmax(static_cast<T>(kNegInf));
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) vmax = at::vec::maximum(vmax, Vec::loadu(s + j));
  T m = at::vec::vec_reduce_all<T>([](auto& a, auto& b) { return at::vec::maximum(a, b); }, vmax);
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

// s[j] = exp(s[j] - m) (masked -inf entries become 0); returns the sum.
template <typename T>
T exp_and_sum(T* s, int64_t n, T m) {
  using Vec = Vectorized<T>;
  Vec vsum(0);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = softmax_exp(Vec::loadu(s + j) - Vec(m));
    e.store(s + j);
    vsum = vsum + e;
  }
  T sum = horizontal_sum(vsum);
  if (j < n) {
    const Vec e = softmax_exp(Vec::loadu(s + j, n - j) - Vec(m));
    e.store(s + j, n - j);
    T tail[Vec::size()];
    e.store(tail, n - j);
    for (int64_t t = 0; t < n - j; ++t) sum += tail[t];
  }
  return sum;
}

// s[j] = exp(s[j] - m) * inv_sum: the probabilities the forward produced, recomputed.
template <typename T>
void exp_scaled(T* s, int64_t n, T m, T inv_sum) {
  using Vec = Vectorized<T>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    (softmax_exp(Vec::loadu(s + j) - Vec(m)) * Vec(inv_sum)).store(s + j);
  }
  if (j < n) (softmax_exp(Vec::loadu(s + j, n - j) - Vec(m)) * Vec(inv_sum)).store(s + j, n - j);
}

// s[j] *= scale over [0, n); returns the max of the scaled values (one pass instead of two).
inline float scale_and_max(float* s, int64_t n, float scale) {
  using Vec = Vectorized<float>;
  Vec vmax(kNegInf);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec x = Vec::loadu(s + j) * Vec(scale);
    x.store(s + j);
    vmax = at::vec::maximum(vmax, x);
  }
  float m = at::vec::vec_reduce_all<float>([](auto& a, auto& b) { return at::vec::maximum(a, b); }, vmax);
  for (; j < n; ++j) {
    s[j] *= scale;
    m = std::max(m, s[j]);
  }
  return m;
}

// low[j] = round(exp(s[j] - m)) for the P V GEMM; returns the fp32 sum (one pass).
template <typename scalar_t>
float exp_sum_round(const float* s, int64_t n, float m, scalar_t* low) {
  using Vec = Vectorized<float>;
  Vec vsum(0);
  int64_t j = 0;
  for (; j + 2 * Vec::size() <= n; j += 2 * Vec::size()) {
    const Vec e0 = (Vec::loadu(s + j) - Vec(m)).exp_u20();
    const Vec e1 = (Vec::loadu(s + j + Vec::size()) - Vec(m)).exp_u20();
    vsum = vsum + e0 + e1;
    at::vec::convert_from_float<scalar_t>(e0, e1).store(low + j);
  }
  float sum = horizontal_sum(vsum);
  for (; j < n; ++j) {
    const float e = std::exp(s[j] - m);
    sum += e;
    low[j] = static_cast<scalar_t>(e);
  }
  return sum;
}

template <typename T>
void scale_row(T* x, int64_t n, T factor) {
  using Vec = Vectorized<T>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) * Vec(factor)).store(x + j);
  for (; j < n; ++j) x[j] *= factor;
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  using Vec = Vectorized<T>;
  Vec acc(0);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
  T sum = horizontal_sum(acc);
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// The state of one (batch, head, query block) tile: which keys each row may see, and the
// pointers of the operands for that head.
// T: the accumulator type (scores, pse); In: the dtype q/k/v are read in (T, or fp16/bf16 for
// the packed reduced-precision forward).
template <typename T, typename In = T>
struct HeadBlock {
  const AttentionProblem& p;
  int64_t b, n, i0, rows;
  int64_t sq, skv;
  const In* q;  // row i0 of this head
  const In* k;  // key row 0 of this head's kv head
  const In* v;
  const uint8_t* mask_row0;  // user mask row i0 (null when not read)
  const T* pse_row0;         // pse row i0 (null when absent)
  int64_t pse_stride_i;
  KeyInterval iv[kQBlock];
  int64_t key_lo, key_hi;    // union of the rows' intervals (key_lo > key_hi: nothing visible)

  HeadBlock(const AttentionProblem& prob, const In* q_base, const In* k_base, const In* v_base,
            const T* pse_base, int64_t b_, int64_t n_, int64_t i0_, int64_t i1_)
      : p(prob), b(b_), n(n_), i0(i0_), rows(i1_ - i0_), sq(prob.q_len[b_]), skv(prob.kv_len[b_]) {
    const int64_t kvh = n / p.group();
    q = q_base + b * p.q.stride_b + (p.q_start[b] + i0) * p.q.stride_s + n * p.q.stride_n;
    k = k_base + b * p.k.stride_b + p.kv_start[b] * p.k.stride_s + kvh * p.k.stride_n;
    v = v_base + b * p.v.stride_b + p.kv_start[b] * p.v.stride_s + kvh * p.v.stride_n;
    mask_row0 = p.user_mask == nullptr
                    ? nullptr
                    : p.user_mask + b * p.mask_stride_b + n * p.mask_stride_n + i0 * p.mask_stride_i;
    pse_row0 = pse_base == nullptr
                   ? nullptr
                   : pse_base + b * p.pse_stride_b + n * p.pse_stride_n + i0 * p.pse_stride_i;
    pse_stride_i = p.pse_stride_i;
    key_lo = skv;
    key_hi = -1;
    for (int64_t r = 0; r < rows; ++r) {
      iv[r] = visible_keys(p, b, i0 + r);
      if (iv[r].lo <= iv[r].hi) {
        key_lo = std::min(key_lo, iv[r].lo);
        key_hi = std::max(key_hi, iv[r].hi);
      }
    }
  }

  // Turns row r of the score tile (keys j0..j0+len, scale * Q K^T, or Q K^T when apply_scale)
  // into the masked logits. Returns the visible sub-range [a, e); entries outside it and
  // user-masked ones are -inf.
  std::pair<int64_t, int64_t> logits(int64_t r, T* s, int64_t j0, int64_t len, T scale,
                                     bool apply_scale = false) const {
    const int64_t a = std::clamp<int64_t>(iv[r].lo - j0, 0, len);
    const int64_t e = std::clamp<int64_t>(iv[r].hi + 1 - j0, a, len);
    std::fill(s, s + a, static_cast<T>(kNegInf));
    std::fill(s + e, s + len, static_cast<T>(kNegInf));
    if (a == e) return {a, e};
    if (apply_scale) scale_row(s + a, e - a, scale);
    if (pse_row0 != nullptr) add_scaled_pse(s + a, pse_row0 + r * pse_stride_i + j0 + a, e - a, scale);
    if (mask_row0 != nullptr) {
      const uint8_t* m = mask_row0 + r * p.mask_stride_i + j0;
      for (int64_t j = a; j < e; ++j) {
        if (m[j] != 0) s[j] = static_cast<T>(kNegInf);
      }
    }
    return {a, e};
  }

  // Index of the first dropout bit of row r (key 0).
  int64_t bit_row(int64_t r) const {
    return p.bit_start[b] + (n * sq + i0 + r) * skv;
  }
};

// keep[j] / keep_prob for keys j0..j0+len of row r: from dropout_mask when given, else Philox.
template <typename T>
void dropout_factors(const AttentionProblem& p, int64_t first_bit, int64_t len, uint8_t* keep,
                     T* factor, uint64_t threshold) {
  if (p.dropout_mask != nullptr) {
    for (int64_t j = 0; j < len; ++j) {
      const int64_t bit = first_bit + j;
      keep[j] = (p.dropout_mask[bit >> 3] >> (bit & 7)) & 1;
    }
  } else {
    philox_keep_bits(p.seed, p.offset, first_bit, len, threshold, keep);
  }
  const T inv_keep = static_cast<T>(1.0 / p.keep_prob);
  for (int64_t j = 0; j < len; ++j) factor[j] = keep[j] ? inv_keep : T(0);
}

template <typename T>
void multiply_rows(T* x, const T* f, int64_t n) {
  using Vec = Vectorized<T>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) * Vec::loadu(f + j)).store(x + j);
  for (; j < n; ++j) x[j] *= f[j];
}

// Runs work(task) for every task on all threads, handing tasks out in order as threads free up.
template <typename Setup, typename Work>
void run_dynamic(int64_t num_tasks, const Setup& make_state, const Work& work) {
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, std::max<int64_t>(threads, 1), 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t t = next.fetch_add(1); t < num_tasks; t = next.fetch_add(1)) work(state, t);
  });
}

struct Task {
  int64_t b, n, i0, i1;
};

// (batch, head, query block) tasks, later (more expensive under causal masks) blocks first.
std::vector<Task> query_block_tasks(const AttentionProblem& p) {
  int64_t max_blocks = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    max_blocks = std::max(max_blocks, (p.q_len[b] + kQBlock - 1) / kQBlock);
  }
  std::vector<Task> tasks;
  for (int64_t blk = max_blocks - 1; blk >= 0; --blk) {
    for (int64_t b = 0; b < p.batch; ++b) {
      const int64_t i0 = blk * kQBlock;
      if (i0 >= p.q_len[b]) continue;
      const int64_t i1 = std::min(i0 + kQBlock, p.q_len[b]);
      for (int64_t n = 0; n < p.heads_q; ++n) tasks.push_back({b, n, i0, i1});
    }
  }
  return tasks;
}

template <typename T>
struct FwdScratch {
  std::vector<T> scores = std::vector<T>(kQBlock * kKvBlock);
  std::vector<T> acc;
  std::vector<T> factor = std::vector<T>(kKvBlock);
  std::vector<uint8_t> keep = std::vector<uint8_t>(kKvBlock);
  std::vector<T> q_scaled;
  T m[kQBlock];
  T l[kQBlock];
  FwdScratch(int64_t d, int64_t dv)
      : acc(kQBlock * std::max<int64_t>(dv, 1)), q_scaled(kQBlock * std::max<int64_t>(d, 1)) {}
};

// The online-softmax state of a task's rows before any key: the sink (when given) is the first
// logit each row has seen, with exp(sink - max) = 1 in the running sum.
template <typename T>
void start_rows(const AttentionProblem& p, const Task& task, int64_t rows, int64_t dv,
                FwdScratch<T>& w) {
  const bool sink = p.sink != nullptr;
  std::fill(w.m, w.m + rows, sink ? static_cast<T>(p.sink[task.n]) : static_cast<T>(kNegInf));
  std::fill(w.l, w.l + rows, sink ? T(1) : T(0));
  std::fill(w.acc.begin(), w.acc.begin() + rows * dv, T(0));
}

// out = acc / l for the task's rows, and the 8-copy statistics. A row that saw no key (and has no
// sink) has l = 0: its output is 0, not NaN.
template <typename T, typename Stat>
void finish_rows(const AttentionProblem& p, const Task& task, int64_t rows, int64_t dv,
                 const FwdScratch<T>& w, T* out, Stat* smax, Stat* ssum) {
  const int64_t b = task.b, n = task.n;
  T* o = out + b * p.out.stride_b + (p.q_start[b] + task.i0) * p.out.stride_s + n * p.out.stride_n;
  for (int64_t r = 0; r < rows; ++r) {
    const T inv = w.l[r] > T(0) ? T(1) / w.l[r] : T(0);
    const T* a = w.acc.data() + r * dv;
    T* dst = o + r * p.out.stride_s;
    for (int64_t d = 0; d < dv; ++d) dst[d] = a[d] * inv;
    const int64_t idx = p.stat_index(b, n, task.i0 + r);
    std::fill(smax + 8 * idx, smax + 8 * idx + 8, static_cast<Stat>(w.m[r]));
    std::fill(ssum + 8 * idx, ssum + 8 * idx + 8, static_cast<Stat>(w.l[r]));
  }
}

template <typename T>
void attention_fwd_impl(const AttentionProblem& p, const at::Tensor& q_t, const at::Tensor& k_t,
                        const at::Tensor& v_t, at::Tensor& out_t, at::Tensor& max_t,
                        at::Tensor& sum_t) {
  const T* q = q_t.const_data_ptr<T>();
  const T* k = k_t.const_data_ptr<T>();
  const T* v = v_t.const_data_ptr<T>();
  const T* pse = static_cast<const T*>(p.pse);
  T* out = out_t.data_ptr<T>();
  T* smax = max_t.data_ptr<T>();  // float32, float64 for float64 inputs
  T* ssum = sum_t.data_ptr<T>();
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const T scale = static_cast<T>(p.scale);
  const uint64_t threshold = keep_threshold(p.keep_prob);
  const std::vector<Task> tasks = query_block_tasks(p);

  run_dynamic(
      static_cast<int64_t>(tasks.size()), [&] { return FwdScratch<T>(D, Dv); },
      [&](FwdScratch<T>& w, int64_t t) {
        const Task& task = tasks[t];
        const HeadBlock<T> hb(p, q, k, v, pse, task.b, task.n, task.i0, task.i1);
        const int64_t rows = hb.rows;
        start_rows(p, task, rows, Dv, w);
        scale_query_rows(hb.q, p.q.stride_s, rows, D, scale, w.q_scaled.data());

        for (int64_t j0 = hb.key_lo; j0 <= hb.key_hi; j0 += kKvBlock) {
          const int64_t len = std::min(kKvBlock, hb.key_hi + 1 - j0);
          T* s = w.scores.data();
          gemm_abt<T>(rows, len, D, w.q_scaled.data(), D, hb.k + j0 * p.k.stride_s, p.k.stride_s,
                      T(0), s, len);
          for (int64_t r = 0; r < rows; ++r) {
            T* sr = s + r * len;
            const auto [a, e] = hb.logits(r, sr, j0, len, scale);
            const T m_new = std::max(w.m[r], a < e ? row_max(sr + a, e - a) : static_cast<T>(kNegInf));
            if (m_new == static_cast<T>(kNegInf)) {  // nothing visible yet: contributes nothing
              std::fill(sr, sr + len, T(0));
              continue;
            }
            const T alpha = std::exp(w.m[r] - m_new);  // 0 when the row had no max yet
            const T sum = exp_and_sum(sr, len, m_new);
            w.l[r] = w.l[r] * alpha + sum;
            w.m[r] = m_new;
            if (alpha != T(1)) scale_row(w.acc.data() + r * Dv, Dv, alpha);
            if (p.dropout) {
              dropout_factors(p, hb.bit_row(r) + j0, len, w.keep.data(), w.factor.data(), threshold);
              multiply_rows(sr, w.factor.data(), len);
            }
          }
          gemm_ab<T>(rows, Dv, len, s, len, hb.v + j0 * p.v.stride_s, p.v.stride_s, T(1),
                     w.acc.data(), Dv);
        }

        finish_rows(p, task, rows, Dv, w, out, smax, ssum);
      });
}

template <typename T>
struct BwdScratch {
  std::vector<T> p_tile = std::vector<T>(kQBlock * kKvBlock);   // P (then P' with dropout)
  std::vector<T> ds_tile = std::vector<T>(kQBlock * kKvBlock);  // dP, then dS
  std::vector<T> factor = std::vector<T>(kQBlock * kKvBlock);
  std::vector<uint8_t> keep = std::vector<uint8_t>(kKvBlock);
  std::vector<T> q_scaled;
  T row_dot[kQBlock];  // rowsum(dO * O)
  T m[kQBlock];
  T inv_l[kQBlock];
  explicit BwdScratch(int64_t d) : q_scaled(kQBlock * std::max<int64_t>(d, 1)) {}
};

template <typename T>
void attention_bwd_impl(const AttentionProblem& p, const at::Tensor& q_t, const at::Tensor& k_t,
                        const at::Tensor& v_t, const at::Tensor& dy_t, const at::Tensor& out_t,
                        const at::Tensor& max_t, const at::Tensor& sum_t, at::Tensor& dq_t,
                        at::Tensor& dk_t, at::Tensor& dv_t, at::Tensor& dpse_t,
                        at::Tensor& dsink_t) {
  const T* q = q_t.const_data_ptr<T>();
  const T* k = k_t.const_data_ptr<T>();
  const T* v = v_t.const_data_ptr<T>();
  const T* dy = dy_t.const_data_ptr<T>();
  const T* o = out_t.const_data_ptr<T>();
  const T* pse = static_cast<const T*>(p.pse);
  const T* smax = max_t.const_data_ptr<T>();
  const T* ssum = sum_t.const_data_ptr<T>();
  T* dq = dq_t.data_ptr<T>();
  T* dk = dk_t.data_ptr<T>();
  T* dv = dv_t.data_ptr<T>();
  T* dpse = dpse_t.defined() ? dpse_t.data_ptr<T>() : nullptr;
  float* dsink = dsink_t.defined() ? dsink_t.data_ptr<float>() : nullptr;
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const T scale = static_cast<T>(p.scale);
  const uint64_t threshold = keep_threshold(p.keep_prob);
  // dpse is [B, Nq, Sp, Skv]: Sp = 1 sums the rows, Sp = Sq keeps them.
  const int64_t dpse_rows = dpse_t.defined() ? dpse_t.size(2) : 0;
  const int64_t total_kv = p.tnd ? dk_t.size(1) : 0;  // TND: Tkv rows per head

  run_dynamic(
      p.batch * p.heads_q, [&] { return BwdScratch<T>(D); },
      [&](BwdScratch<T>& w, int64_t t) {
        const int64_t b = t / p.heads_q, n = t % p.heads_q;
        const int64_t sq = p.q_len[b], skv = p.kv_len[b];
        // This head's private dk/dv rows (see AttentionBwdFn).
        const int64_t head_row0 = p.tnd ? n * total_kv + p.kv_start[b] : (b * p.heads_q + n) * skv;
        T* dk_h = dk + head_row0 * D;
        T* dv_h = dv + head_row0 * Dv;
        T* dpse_h = dpse == nullptr ? nullptr : dpse + (b * p.heads_q + n) * dpse_rows * skv;
        double dsink_acc = 0;
        for (int64_t i0 = 0; i0 < sq; i0 += kQBlock) {
          const HeadBlock<T> hb(p, q, k, v, pse, b, n, i0, std::min(i0 + kQBlock, sq));
          const int64_t rows = hb.rows;
          const T* dy_blk = dy + b * p.out.stride_b + (p.q_start[b] + i0) * p.out.stride_s + n * p.out.stride_n;
          const T* o_blk = o + b * p.out.stride_b + (p.q_start[b] + i0) * p.out.stride_s + n * p.out.stride_n;
          T* dq_blk = dq + b * p.q.stride_b + (p.q_start[b] + i0) * p.q.stride_s + n * p.q.stride_n;
          scale_query_rows(hb.q, p.q.stride_s, rows, D, scale, w.q_scaled.data());
          for (int64_t r = 0; r < rows; ++r) {
            w.row_dot[r] = dot(dy_blk + r * p.out.stride_s, o_blk + r * p.out.stride_s, Dv);
            const int64_t idx = p.stat_index(b, n, i0 + r);
            const T l = static_cast<T>(ssum[8 * idx]);
            w.m[r] = static_cast<T>(smax[8 * idx]);
            w.inv_l[r] = l > T(0) ? T(1) / l : T(0);
            if (p.sink != nullptr && l > T(0)) {
              // d loss / d sink = -p_sink * rowsum(dO * O), p_sink = exp(sink - max) / sum.
              dsink_acc -= std::exp(static_cast<T>(p.sink[n]) - w.m[r]) * w.inv_l[r] * w.row_dot[r];
            }
          }
          for (int64_t j0 = hb.key_lo; j0 <= hb.key_hi; j0 += kKvBlock) {
            const int64_t len = std::min(kKvBlock, hb.key_hi + 1 - j0);
            T* pt = w.p_tile.data();
            T* dst = w.ds_tile.data();
            gemm_abt<T>(rows, len, D, w.q_scaled.data(), D, hb.k + j0 * p.k.stride_s, p.k.stride_s,
                        T(0), pt, len);
            for (int64_t r = 0; r < rows; ++r) {
              T* pr = pt + r * len;
              const auto [a, e] = hb.logits(r, pr, j0, len, scale);
              if (a == e || w.inv_l[r] == T(0)) {
                std::fill(pr, pr + len, T(0));
              } else {
                exp_scaled(pr, len, w.m[r], w.inv_l[r]);
              }
            }
            // dP = dO V^T
            gemm_abt<T>(rows, len, Dv, dy_blk, p.out.stride_s, hb.v + j0 * p.v.stride_s,
                        p.v.stride_s, T(0), dst, len);
            if (p.dropout) {
              for (int64_t r = 0; r < rows; ++r) {
                dropout_factors(p, hb.bit_row(r) + j0, len, w.keep.data(), w.factor.data() + r * len,
                                threshold);
              }
            }
            using Vec = Vectorized<T>;
            for (int64_t r = 0; r < rows; ++r) {
              T* pr = pt + r * len;
              T* dr = dst + r * len;
              const T* f = w.factor.data() + r * len;
              const Vec rd(w.row_dot[r]);
              int64_t j = 0;
              // dS = P * (dP * factor - rowsum(dO * O)) * scale
              for (; j + Vec::size() <= len; j += Vec::size()) {
                Vec dpj = Vec::loadu(dr + j);
                if (p.dropout) dpj = dpj * Vec::loadu(f + j);
                (Vec::loadu(pr + j) * (dpj - rd) * Vec(scale)).store(dr + j);
              }
              for (; j < len; ++j) {
                const T dpj = p.dropout ? dr[j] * f[j] : dr[j];
                dr[j] = pr[j] * (dpj - w.row_dot[r]) * scale;
              }
              if (dpse_h != nullptr) {
                T* g = dpse_h + (dpse_rows == 1 ? 0 : (i0 + r) * skv) + j0;
                for (int64_t jj = 0; jj < len; ++jj) g[jj] += dr[jj];
              }
            }
            if (p.dropout) multiply_rows(pt, w.factor.data(), rows * len);  // P' for dV
            // dV += P'^T dO;  dQ += dS K;  dK += dS^T Q
            gemm_atb<T>(len, Dv, rows, pt, len, dy_blk, p.out.stride_s, T(1), dv_h + j0 * Dv, Dv);
            gemm_ab<T>(rows, D, len, dst, len, hb.k + j0 * p.k.stride_s, p.k.stride_s, T(1), dq_blk,
                       p.q.stride_s);
            gemm_atb<T>(len, D, rows, dst, len, hb.q, p.q.stride_s, T(1), dk_h + j0 * D, D);
          }
        }
        if (dsink != nullptr) dsink[b * p.heads_q + n] = static_cast<float>(dsink_acc);
      });
}

// ---------------------------------------------------------------------------------------------
// fp16/bf16 forward on CPUs with native half-precision matrix units (AMX / AVX512-BF16/FP16, as
// reported by cpublas::could_pack): both GEMMs run in the input dtype through ATen's oneDNN
// brgemm with fp32 accumulation. K^T and V are packed once per (batch, kv head, key block) into
// the VNNI layout the kernel wants; the scores, the online softmax and the output accumulator
// stay fp32. Only P is rounded to the input dtype before P V, as the native composition rounds
// it (which also rounds the scores, which stay fp32 here).

// oneDNN's packing (transform) writes panels whose leading dimension is 16, 32, 48 or 64 columns,
// so B operands are packed, and multiplied, in panels of at most kPanel columns. Key blocks are
// padded to whole panels with zero K columns / V rows, which the softmax masks out.
constexpr int64_t kPanel = 64;
constexpr int64_t pad_keys(int64_t x) { return (x + kPanel - 1) / kPanel * kPanel; }

template <typename scalar_t>
void attention_fwd_packed_impl(const AttentionProblem& p, const at::Tensor& q_t,
                               const at::Tensor& k_t, const at::Tensor& v_t, at::Tensor& out_t,
                               at::Tensor& max_t, at::Tensor& sum_t) {
  using T = float;
  const scalar_t* q = q_t.const_data_ptr<scalar_t>();
  const scalar_t* k = k_t.const_data_ptr<scalar_t>();
  const scalar_t* v = v_t.const_data_ptr<scalar_t>();
  const T* pse = static_cast<const T*>(p.pse);
  T* out = out_t.data_ptr<T>();
  float* smax = max_t.data_ptr<float>();
  float* ssum = sum_t.data_ptr<float>();
  const int64_t D = p.head_dim, Dv = p.head_dim_v;
  const T scale = static_cast<T>(p.scale);
  const uint64_t threshold = keep_threshold(p.keep_prob);
  const at::ScalarType dtype = q_t.scalar_type();

  // Packed blocks: (batch, kv head, key block) -> slot; each slot holds D x kKvBlock of K^T and
  // kKvBlock x Dv of V.
  std::vector<int64_t> first_slot(p.batch + 1, 0);
  for (int64_t b = 0; b < p.batch; ++b) {
    first_slot[b + 1] = first_slot[b] + p.heads_kv * ((p.kv_len[b] + kKvBlock - 1) / kKvBlock);
  }
  const int64_t slots = first_slot[p.batch];
  std::vector<scalar_t> packed_k(slots * D * kKvBlock), packed_v(slots * kKvBlock * Dv);
  auto slot_of = [&](int64_t b, int64_t kvh, int64_t blk) {
    return first_slot[b] + kvh * ((p.kv_len[b] + kKvBlock - 1) / kKvBlock) + blk;
  };
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> tmp(std::max(D, Dv) * kKvBlock);
    for (int64_t slot = begin; slot < end; ++slot) {
      const int64_t b = std::upper_bound(first_slot.begin(), first_slot.end(), slot) - first_slot.begin() - 1;
      const int64_t blocks = (p.kv_len[b] + kKvBlock - 1) / kKvBlock;
      const int64_t kvh = (slot - first_slot[b]) / blocks, blk = (slot - first_slot[b]) % blocks;
      const int64_t j0 = blk * kKvBlock;
      const int64_t len = std::min(kKvBlock, p.kv_len[b] - j0), len_pad = pad_keys(len);
      const scalar_t* kb = k + b * p.k.stride_b + (p.kv_start[b] + j0) * p.k.stride_s + kvh * p.k.stride_n;
      const scalar_t* vb = v + b * p.v.stride_b + (p.kv_start[b] + j0) * p.v.stride_s + kvh * p.v.stride_n;
      // K^T [D, len_pad] with zero padding columns, packed in kPanel-column panels.
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t j = 0; j < len_pad; ++j) tmp[d * len_pad + j] = j < len ? kb[j * p.k.stride_s + d] : scalar_t(0);
      }
      for (int64_t c = 0; c < len_pad; c += kPanel) {
        at::native::cpublas::pack(D, kPanel, len_pad, kPanel, dtype, dtype, tmp.data() + c,
                                  packed_k.data() + slot * D * kKvBlock + c * D);
      }
      // V [len_pad, Dv] with zero padding rows, packed in panels of up to kPanel columns.
      for (int64_t j = 0; j < len_pad; ++j) {
        for (int64_t d = 0; d < Dv; ++d) tmp[j * Dv + d] = j < len ? vb[j * p.v.stride_s + d] : scalar_t(0);
      }
      for (int64_t c = 0; c < Dv; c += kPanel) {
        const int64_t w = std::min(kPanel, Dv - c);
        at::native::cpublas::pack(len_pad, w, Dv, w, dtype, dtype, tmp.data() + c,
                                  packed_v.data() + slot * kKvBlock * Dv + c * len_pad);
      }
    }
  });

  struct Scratch {
    FwdScratch<T> f;
    std::vector<scalar_t> p_low;  // P rounded to the input dtype
    explicit Scratch(int64_t d, int64_t dv) : f(d, dv), p_low(kQBlock * kKvBlock) {}
    ~Scratch() { at::native::cpublas::brgemm_release(); }
  };
  const std::vector<Task> tasks = query_block_tasks(p);
  run_dynamic(
      static_cast<int64_t>(tasks.size()), [&] { return Scratch(D, Dv); },
      [&](Scratch& sc, int64_t t) {
        FwdScratch<T>& w = sc.f;
        const Task& task = tasks[t];
        const HeadBlock<T, scalar_t> hb(p, q, k, v, pse, task.b, task.n, task.i0, task.i1);
        const int64_t rows = hb.rows, kvh = task.n / p.group();
        start_rows(p, task, rows, Dv, w);
        const int64_t blk_lo = hb.key_hi >= hb.key_lo ? hb.key_lo / kKvBlock : 1;
        const int64_t blk_hi = hb.key_hi >= hb.key_lo ? hb.key_hi / kKvBlock : 0;
        for (int64_t blk = blk_lo; blk <= blk_hi; ++blk) {
          const int64_t j0 = blk * kKvBlock;
          const int64_t len = std::min(kKvBlock, hb.skv - j0), len_pad = pad_keys(len);
          const int64_t slot = slot_of(task.b, kvh, blk);
          T* s = w.scores.data();
          for (int64_t c = 0; c < len_pad; c += kPanel) {
            at::native::cpublas::brgemm(rows, kPanel, D, p.q.stride_s, kPanel, len_pad, false, hb.q,
                                        packed_k.data() + slot * D * kKvBlock + c * D, s + c);
          }
          bool any = false;
          for (int64_t r = 0; r < rows; ++r) {
            T* sr = s + r * len_pad;
            scalar_t* pl = sc.p_low.data() + r * len_pad;
            // Plain rows (no pse, no user mask, no dropout) take two fused passes: scale + max,
            // then exp + sum + rounding for the P V GEMM.
            const bool plain = hb.pse_row0 == nullptr && hb.mask_row0 == nullptr && !p.dropout;
            T row_m;
            int64_t a, e;
            if (plain) {
              a = std::clamp<int64_t>(hb.iv[r].lo - j0, 0, len_pad);
              e = std::clamp<int64_t>(hb.iv[r].hi + 1 - j0, a, len_pad);
              std::fill(sr, sr + a, static_cast<T>(kNegInf));
              std::fill(sr + e, sr + len_pad, static_cast<T>(kNegInf));
              row_m = a < e ? scale_and_max(sr + a, e - a, scale) : static_cast<T>(kNegInf);
            } else {
              std::tie(a, e) = hb.logits(r, sr, j0, len_pad, scale, /*apply_scale=*/true);
              row_m = a < e ? row_max(sr + a, e - a) : static_cast<T>(kNegInf);
            }
            const T m_new = std::max(w.m[r], row_m);
            if (m_new == static_cast<T>(kNegInf)) {
              std::fill(pl, pl + len_pad, scalar_t(0));
              continue;
            }
            any = true;
            const T alpha = std::exp(w.m[r] - m_new);
            if (alpha != T(1)) scale_row(w.acc.data() + r * Dv, Dv, alpha);
            if (plain) {
              w.l[r] = w.l[r] * alpha + exp_sum_round(sr, len_pad, m_new, pl);
              w.m[r] = m_new;
              continue;
            }
            const T sum = exp_and_sum(sr, len_pad, m_new);
            w.l[r] = w.l[r] * alpha + sum;
            w.m[r] = m_new;
            if (p.dropout) {
              dropout_factors(p, hb.bit_row(r) + j0, len, w.keep.data(), w.factor.data(), threshold);
              std::fill(w.factor.begin() + len, w.factor.begin() + len_pad, T(0));
              multiply_rows(sr, w.factor.data(), len_pad);
            }
            at::vec::convert(sr, pl, len_pad);
          }
          for (int64_t c = 0; any && c < Dv; c += kPanel) {
            const int64_t width = std::min(kPanel, Dv - c);
            at::native::cpublas::brgemm(rows, width, len_pad, len_pad, width, Dv, true,
                                        sc.p_low.data(), packed_v.data() + slot * kKvBlock * Dv + c * len_pad,
                                        w.acc.data() + c);
          }
        }
        finish_rows(p, task, rows, Dv, w, out, smax, ssum);
      });
}

void attention_fwd_packed_kernel(const AttentionProblem& p, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                                 at::Tensor& softmax_max, at::Tensor& softmax_sum) {
  if (q.scalar_type() == at::kBFloat16) {
    attention_fwd_packed_impl<at::BFloat16>(p, q, k, v, out, softmax_max, softmax_sum);
  } else {
    attention_fwd_packed_impl<at::Half>(p, q, k, v, out, softmax_max, softmax_sum);
  }
}

void attention_fwd_kernel(const AttentionProblem& p, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, at::Tensor& out, at::Tensor& softmax_max,
                          at::Tensor& softmax_sum) {
  if (q.scalar_type() == at::kDouble) {
    attention_fwd_impl<double>(p, q, k, v, out, softmax_max, softmax_sum);
  } else {
    attention_fwd_impl<float>(p, q, k, v, out, softmax_max, softmax_sum);
  }
}

void attention_bwd_kernel(const AttentionProblem& p, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& dy, const at::Tensor& out,
                          const at::Tensor& softmax_max, const at::Tensor& softmax_sum,
                          at::Tensor& dq, at::Tensor& dk_heads, at::Tensor& dv_heads,
                          at::Tensor& dpse, at::Tensor& dsink) {
  if (q.scalar_type() == at::kDouble) {
    attention_bwd_impl<double>(p, q, k, v, dy, out, softmax_max, softmax_sum, dq, dk_heads,
                               dv_heads, dpse, dsink);
  } else {
    attention_bwd_impl<float>(p, q, k, v, dy, out, softmax_max, softmax_sum, dq, dk_heads,
                              dv_heads, dpse, dsink);
  }
}

}  // namespace

OPENNPU_REGISTER_CPU_KERNEL(attention_fwd_cpu, attention_fwd_kernel);
OPENNPU_REGISTER_CPU_KERNEL(attention_bwd_cpu, attention_bwd_kernel);
OPENNPU_REGISTER_CPU_KERNEL(attention_fwd_packed_cpu, attention_fwd_packed_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::attention
