// Flash-style CPU kernels of npu_fusion_attention and its gradient.
//
// Forward: one task per (batch, query head, block of 64 or 128 query rows; see kQBlock). A task
// walks the key blocks its rows can see, computes the score tile scale * Q K^T with one BLAS
// GEMM, applies pse and the visibility rules, and folds the tile into the running softmax
// (online max and sum, rescaling the output accumulator when the max grows), then adds P V with
// a second GEMM. Memory per thread is one kQBlock x kKvBlock tile plus the kQBlock x Dv
// accumulator: no Sq x Skv buffer ever exists. softmax_max / softmax_sum keep the statistics so
// the backward can recompute P.
//
// Backward: one task per (batch, query head); it owns its dq rows and a private dk/dv slice for
// that head, so no two threads write the same memory; the group's last head to finish sums the
// slices of its GQA group, in head order, into dk/dv. For each (query block, key block) it
// recomputes P = exp(s - max) / sum, and with five GEMMs accumulates dV += P'^T dO,
// dP = dO V^T, dS = P * (dP' - rowsum(dO * O)) * scale, dQ += dS K and dK += dS^T Q, where P'
// and dP' carry the dropout keep mask / keep_prob.
//
// The GEMMs run through BLAS (BlasTiles, BlasBwdTiles) or, for fp16/bf16, on packed operands
// (BrgemmTiles, BrgemmBwdTiles): oneDNN's brgemm on half-precision matrix units (AMX), or for
// bf16 on CPUs with AVX512_BF16 but no AMX our vdpbf16ps tile GEMM (common/vnni_gemm.h).
// fp16/bf16 inputs are multiplied as they are, with fp32 accumulation; see kRoundsOperands for
// what is rounded. Whether they stay fp16/bf16 and which tiles run is this file's plan
// (attention_plan_kernel, at the end), which the entry points ask before converting q/k/v.
//
// Tasks are handed out dynamically (an atomic counter), heaviest first, because causal and band
// masks make later query blocks more expensive than earlier ones.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/blas.h"
#include "common/cpu_dispatch.h"
#include "common/vec.h"
#include "common/vnni_gemm.h"
#include "ops/attention/attention.h"
#include "ops/transpose/transpose.h"

namespace opennpu::attention {
inline namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// The forward's query rows per task: at most kQBlock; each tile path (BlasTiles, BrgemmTiles)
// picks its own (query_rows). Where the visible keys differ between rows (causal and band
// masks), small blocks waste less of the score tiles on the diagonal, where a block's last row
// sees up to rows - 1 more keys than its first; elsewhere larger blocks read each K/V tile for
// more rows. One thread, bf16, 16/4 heads, D=64, causal: S=512 1.68 ms with 256 rows, 1.41 with
// 64; 2 threads, 32/8 heads, D=128, S=4096: causal 115 / 107 / 100 ms with 256 / 128 / 64 rows,
// no mask 190 / 184 / 199 ms. The fp32 (MKL) path is fastest at 128 rows throughout.
constexpr int64_t kQBlock = 128;
constexpr int64_t kKvBlock = 512;
// The backward's blocks, smaller than the forward's: a step's tiles (S, dP, and P' and dS rounded
// and packed) then stay in L2. With 256 x 512 the bf16 backward took 15% longer on one thread.
// kBwdQBlock is the most query rows per block; each tile path picks its own (query_rows).
constexpr int64_t kBwdQBlock = 128;
constexpr int64_t kBwdKvBlock = 256;
static_assert(kBwdQBlock <= kQBlock);
// How far a block's row max may exceed the reference its exps are taken against (see
// attention_fwd_tiles) before the row is recomputed against the new max.
constexpr float kStaleMaxSlack = 8.0f;

// exp of the softmax: exp_fast for fp32 (relative error <= 2.3e-7, far below the rounding of
// anything computed from a weighted sum of values; it maps -inf to 0), exact for fp64.
template <typename T>
inline Vectorized<T> softmax_exp(const Vectorized<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return exp_fast(x);
  } else {
    return x.exp();
  }
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(scale * s - m) of score lanes. Where the results are rounded to fp16/bf16 before the GEMM
// that reads them (kReduced; the sum that normalises them adds the rounded values), it is
// exp2_reduced of (scale * s - m) * log2(e): the one-fma logit (exact but for one rounding, also
// for the huge logits of additive masks near -FLT_MAX, where folding log2(e) into the fma's
// constants would overflow), one more rounding (a relative 6e-8 in exp per unit of |t|, nothing against fp16's
// half ulp of 4.9e-4 in the range a softmax reaches). Otherwise softmax_exp of the logit.
template <typename T, bool kReduced>
struct ScaledExp {
  static_assert(!kReduced || std::is_same_v<T, float>);
  Vectorized<T> scale, neg_m;
  ScaledExp(T scale_, T m) : scale(scale_), neg_m(-m) {}
  Vectorized<T> operator()(const Vectorized<T>& s) const {
    const Vectorized<T> x = at::vec::fmadd(s, scale, neg_m);
    if constexpr (kReduced) {
      return exp2_reduced(x * Vectorized<T>(static_cast<T>(1.44269504088896340736)));
    } else {
      return softmax_exp(x);
    }
  }
};

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

// The max of the non-NaN entries of s[0, n) (-inf if there are none), as exp_sum_max finds it.
template <typename T>
T row_max(const T* s, int64_t n) {
  using Vec = Vectorized<T>;
  Vec vmax(static_cast<T>(kNegInf));
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) vmax = max_skip_nan(Vec::loadu(s + j), vmax);
  if (j < n) {
    const Vec tail = Vec::set(Vec(static_cast<T>(kNegInf)), Vec::loadu(s + j, n - j), n - j);
    vmax = max_skip_nan(tail, vmax);
  }
  return at::vec::vec_reduce_all<T>([](auto& a, auto& b) { return at::vec::maximum(a, b); }, vmax);
}

template <typename T>
bool any_nan(const T* s, int64_t n) {
  return std::any_of(s, s + n, [](T x) { return x != x; });
}

// out[j] = exp(scale * s[j] - m), rounded to Out (T, or fp16/bf16 for the P V GEMM; out may be
// s itself); returns the sum in T and sets raw_max = max(s[j]), in the same pass (NaN entries
// are skipped there: they reach the sum, the output and the statistics as NaN). Masked -inf
// entries become 0. scale > 0, or 1 when the scores are scaled already; one fma, so the scaled
// logit is never rounded on its own. kNativeBf16: bf16 rounded by store_bf16_native (neither
// exp returns subnormals: results below FLT_MIN, or 2^-125, are 0). kReduced: see ScaledExp.
// Returns two sums: exact, of the exps as computed (the softmax statistic), and used, of the
// values stored in out. They differ where out is fp16/bf16: the output is normalised by `used`,
// so the rounded weights the P V GEMM reads sum to 1 (up to the fp32 sum's own rounding) and
// their rounding errors cancel in the normalisation instead of adding to the output's (bf16
// causal attention: the max error goes from 1.6-2.0x the rounding floor to ~1.0x).
template <typename T>
struct ExpSums {
  T exact;
  T used;
};

template <typename T, typename Out, bool kReduced, bool kNativeBf16 = false>
ExpSums<T> exp_sum_max(const T* s, int64_t n, T m, T scale, Out* out, T& raw_max) {
  using Vec = Vectorized<T>;
  using Pair = VecPair<Out>;
  static_assert(std::is_same_v<acc_t<Out>, T>);
  constexpr bool kRoundsOut = !std::is_same_v<Out, T>;
  // usum += the pair as stored at p (rounded to Out; lanes past k are 0).
  const auto add_stored = [](Vec& usum, const Out* p, int64_t k) {
    if constexpr (kRoundsOut) {
      Vec r0, r1;
      Pair::load(p, r0, r1, k);
      usum = usum + r0 + r1;
    }
  };
  const ScaledExp<T, kReduced> exp_of(scale, m);
  Vec vsum(0), usum(0), vmax(static_cast<T>(kNegInf));
  int64_t j = 0;
  for (; j + Pair::kStep <= n; j += Pair::kStep) {
    const Vec x0 = Vec::loadu(s + j), x1 = Vec::loadu(s + j + Vec::size());
    vmax = max_skip_nan(max_skip_nan(x0, x1), vmax);
    const Vec e0 = exp_of(x0), e1 = exp_of(x1);
    vsum = vsum + e0 + e1;
    store_pair<kNativeBf16>(out + j, e0, e1);
    add_stored(usum, out + j, Pair::kStep);
  }
  if (j < n) {  // the tail as one masked step (causal rows end anywhere; scalar exps cost ~15%)
    const int64_t rest = n - j, rest0 = std::min<int64_t>(rest, Vec::size());
    Vec x0, x1;
    VecPair<T>::load(s + j, x0, x1, rest);
    // Lanes past n become -inf: they never raise the max and their exp, 0, adds nothing.
    x0 = Vec::set(Vec(static_cast<T>(kNegInf)), x0, rest0);
    x1 = Vec::set(Vec(static_cast<T>(kNegInf)), x1, rest - rest0);
    vmax = max_skip_nan(max_skip_nan(x0, x1), vmax);
    const Vec e0 = exp_of(x0), e1 = exp_of(x1);
    vsum = vsum + e0 + e1;
    store_pair<kNativeBf16>(out + j, e0, e1, rest);
    add_stored(usum, out + j, rest);
  }
  raw_max = at::vec::vec_reduce_all<T>([](auto& a, auto& b) { return at::vec::maximum(a, b); }, vmax);
  const T exact = horizontal_sum(vsum);
  return {exact, kRoundsOut ? horizontal_sum(usum) : exact};
}

template <typename T>
void scale_row(T* x, int64_t n, T factor) {
  using Vec = Vectorized<T>;
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) (Vec::loadu(x + j) * Vec(factor)).store(x + j);
  for (; j < n; ++j) x[j] *= factor;
}

// Full quantisation's P codes (AttentionProblem::p_quant): e -> int8 code of e * factor, the
// product rounded to float16 and then half to even (Ascend's float16 softmax output cast to
// int8), saturated at 127 (e >= 0); NaN stays NaN. Only for float P (fp32 inputs).
template <typename P>
void quantise_probs(P* probs, int64_t n, float factor) {
  if constexpr (std::is_same_v<P, float>) {
    // ATen's fp16 conversions round half to even (vcvtps2ph), as c10::Half does; minimum
    // propagates NaN.
    using Vec = Vectorized<float>;
    const Vec f(factor), top(127.0f);
    int64_t j = 0;
    for (; j + 2 * Vec::size() <= n; j += 2 * Vec::size()) {
      const auto h = at::vec::convert_from_float<at::Half>(Vec::loadu(probs + j) * f,
                                                           Vec::loadu(probs + j + Vec::size()) * f);
      const auto [a, b] = at::vec::convert_to_float<at::Half>(h);
      at::vec::minimum(a.round(), top).store(probs + j);
      at::vec::minimum(b.round(), top).store(probs + j + Vec::size());
    }
    for (; j < n; ++j) {
      const float h = static_cast<float>(c10::Half(probs[j] * factor));
      probs[j] = std::min(std::nearbyint(h), 127.0f);
    }
  } else {
    TORCH_INTERNAL_ASSERT(false, "quantised P needs float32 probabilities");
  }
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

// Row 0 of kv head kvh of batch b in a k- or v-shaped tensor (view st).
template <typename In>
In* kv_rows(In* base, const SeqView& st, const AttentionProblem& p, int64_t b, int64_t kvh) {
  return base + b * st.stride_b + p.kv_start[b] * st.stride_s + kvh * st.stride_n;
}

// iv narrowed to the first and last key the user mask row m leaves visible (lo > hi: none). Keys
// outside are then neither multiplied nor exponentiated, as past a causal diagonal: a causal or
// padding mask passed as a tensor (seed 000's chain, transformers' padded batches) saves what
// sparse_mode saves. Keys inside stay masked one by one by logits(). Scanned 8 bytes at a time
// (a word holds a 0 byte iff (w - 0x01..01) & ~w & 0x80..80 is nonzero), so a causal mask costs
// about 1/16 of a byte test per score, against D multiply-adds saved per skipped one.
KeyInterval unmasked_span(const uint8_t* m, KeyInterval iv) {
  constexpr uint64_t kOnes = 0x0101010101010101ull, kHighs = 0x8080808080808080ull;
  const auto all_masked = [m](int64_t at) {
    uint64_t w;
    std::memcpy(&w, m + at, sizeof(w));
    return ((w - kOnes) & ~w & kHighs) == 0;
  };
  while (iv.lo <= iv.hi && m[iv.hi] != 0) {
    if (iv.hi - iv.lo >= 8 && all_masked(iv.hi - 7)) {
      iv.hi -= 8;
    } else {
      --iv.hi;
    }
  }
  while (iv.lo <= iv.hi && m[iv.lo] != 0) {
    if (iv.hi - iv.lo >= 8 && all_masked(iv.lo)) {
      iv.lo += 8;
    } else {
      ++iv.lo;
    }
  }
  return iv;
}

// The state of one (batch, head, query block) tile: which keys each row may see, and the
// pointers of the operands for that head.
// T: the accumulator type (scores, pse); In: the dtype q/k/v are read in (T, or fp16/bf16).
template <typename T, typename In>
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
    k = kv_rows(k_base, p.k, p, b, kvh);
    v = kv_rows(v_base, p.v, p, b, kvh);
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
      if (mask_row0 != nullptr) iv[r] = unmasked_span(mask_row0 + r * p.mask_stride_i, iv[r]);
      if (iv[r].lo <= iv[r].hi) {
        key_lo = std::min(key_lo, iv[r].lo);
        key_hi = std::max(key_hi, iv[r].hi);
      }
    }
  }

  // Turns row r of the score tile (keys j0..j0+len: scale * Q K^T, or Q K^T when apply_scale)
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

// Whether the visible key interval changes from row to row (causal and band masks), judged by
// the first and last query rows of each batch.
bool rows_see_different_keys(const AttentionProblem& p) {
  for (int64_t b = 0; b < p.batch; ++b) {
    if (p.q_len[b] == 0) continue;
    const KeyInterval first = visible_keys(p, b, 0), last = visible_keys(p, b, p.q_len[b] - 1);
    if (first.lo != last.lo || first.hi != last.hi) return true;
  }
  return false;
}

// (batch, head, query block) tasks, head after head, so that the threads taking a head's blocks
// one after another find its K and V in cache (scheduled the other way round, every task fetched
// them from memory again, which cost ~5% of the fp32 forward in MKL's operand packing). Within a
// head the later (under causal masks more expensive) blocks come first, so the run ends with the
// cheapest tasks.
std::vector<Task> query_block_tasks(const AttentionProblem& p, int64_t block_rows) {
  TORCH_INTERNAL_ASSERT(block_rows > 0 && block_rows <= kQBlock);
  std::vector<Task> tasks;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t blocks = (p.q_len[b] + block_rows - 1) / block_rows;
    for (int64_t n = 0; n < p.heads_q; ++n) {
      for (int64_t blk = blocks - 1; blk >= 0; --blk) {
        const int64_t i0 = blk * block_rows;
        tasks.push_back({b, n, i0, std::min(i0 + block_rows, p.q_len[b])});
      }
    }
  }
  return tasks;
}

// fp16/bf16 inputs (In) keep their dtype: every GEMM multiplies them as they are, with fp32
// accumulation and fp32 results, and the softmax, the statistics and every accumulator stay fp32.
// The probabilities P (and, in the backward, dS) are rounded to In once, right before the GEMM
// that consumes them, as the native fp16/bf16 composition rounds them too (it also rounds the
// scores and each intermediate, which stay fp32 here).
template <typename T, typename In>
constexpr bool kRoundsOperands = !std::is_same_v<T, In>;

// P: the dtype of the probabilities P (In, or T where PvPrecision::kFp32 keeps them).
template <typename T, typename P>
struct FwdScratch {
  blas::TileBuffer<T> scores{kQBlock * kKvBlock};
  blas::TileBuffer<P> probs{kQBlock * kKvBlock};  // P, the A operand of P V
  blas::TileBuffer<T> acc;
  blas::TileBuffer<T> factor{kKvBlock};
  blas::TileBuffer<uint8_t> keep{kKvBlock};
  // Per row: the reference the exps are taken against (see attention_fwd_tiles), the sum of
  // exp(logit - m) (the statistic), the sum of P as the P V GEMM reads it (rounded where P is
  // fp16/bf16; it normalises the output, see exp_sum_max), and the true maximum so far (top >= m).
  T m[kQBlock];
  T l[kQBlock];
  T l_used[kQBlock];
  T top[kQBlock];
  blas::TileBuffer<T> row_out;  // one output row before rounding
  explicit FwdScratch(int64_t dv)
      : acc(kQBlock * std::max<int64_t>(dv, 1)), row_out(std::max<int64_t>(dv, 1)) {}
};

// The online-softmax state of a task's rows before any key: the sink (when given) is the first
// logit each row has seen, with exp(sink - max) = 1 in the running sum.
template <typename T, typename P>
void start_rows(const AttentionProblem& p, const Task& task, int64_t rows, int64_t dv,
                FwdScratch<T, P>& w) {
  const T m0 = p.sink != nullptr ? static_cast<T>(p.sink[task.n]) : static_cast<T>(kNegInf);
  std::fill(w.m, w.m + rows, m0);
  std::copy(w.m, w.m + rows, w.top);
  // exp(sink - sink) = 1, or nothing for a sink of -inf (every first-block l is then 0).
  std::fill(w.l, w.l + rows, m0 == static_cast<T>(kNegInf) ? T(0) : T(1));
  std::copy(w.l, w.l + rows, w.l_used);
  std::fill(w.acc.data(), w.acc.data() + rows * dv, T(0));
}

// out = acc / l_used for the task's rows (rounded once to the output dtype In), and the 8-copy
// statistics: the true row max and the sum rebased to it. A row that saw no key (and has no
// sink) has l = 0: its output is 0, not NaN.
template <typename T, typename In, typename P>
void finish_rows(const AttentionProblem& p, const Task& task, int64_t rows, int64_t dv,
                 FwdScratch<T, P>& w, In* out, T* smax, T* ssum) {
  const int64_t b = task.b, n = task.n;
  In* o = out + b * p.out.stride_b + (p.q_start[b] + task.i0) * p.out.stride_s + n * p.out.stride_n;
  for (int64_t r = 0; r < rows; ++r) {
    const T inv = w.l_used[r] == T(0) ? T(0) : T(1) / w.l_used[r];  // NaN stays NaN
    const T* a = w.acc.data() + r * dv;
    In* dst = o + r * p.out.stride_s;
    if constexpr (kRoundsOperands<T, In>) {
      at::vec::map([inv](Vectorized<T> x) { return x * Vectorized<T>(inv); }, w.row_out.data(), a, dv);
      at::vec::convert(w.row_out.data(), dst, dv);
    } else {
      at::vec::map([inv](Vectorized<T> x) { return x * Vectorized<T>(inv); }, dst, a, dv);
    }
    const int64_t idx = p.stat_index(b, n, task.i0 + r);
    const T rebased = w.top[r] == w.m[r] ? w.l[r] : w.l[r] * std::exp(w.m[r] - w.top[r]);
    std::fill(smax + 8 * idx, smax + 8 * idx + 8, w.top[r]);
    std::fill(ssum + 8 * idx, ssum + 8 * idx + 8, rebased);
  }
}

// The forward's two tile GEMMs through BLAS (blas::gemm) straight from q, k and v. The scores
// come out unscaled (the softmax pass scales them): with alpha = scale, MKL scales while it
// packs the operands, which made its packing ~40% slower.
template <typename T, typename In>
struct BlasTiles {
  using Probs = In;  // the dtype add_pv takes P in
  static int64_t query_rows(const AttentionProblem&) { return 128; }
  const AttentionProblem& p;
  static int64_t width(int64_t len) { return len; }
  void release() const {}
  // s[rows, len] = Q K^T for keys j0..j0+len (block blk)
  void scores(const HeadBlock<T, In>& hb, int64_t /*blk*/, int64_t j0, int64_t len, T* s) const {
    blas::gemm<In, T>(false, true, hb.rows, len, p.head_dim, T(1), hb.q,
                      p.q.stride_s, hb.k + j0 * p.k.stride_s, p.k.stride_s, T(0), s, len);
  }
  // acc[rows, Dv] += P V
  void add_pv(const HeadBlock<T, In>& hb, int64_t /*blk*/, int64_t j0, int64_t len,
              const In* probs, T* acc) const {
    blas::gemm<In, T>(false, false, hb.rows, p.head_dim_v, len, T(1), probs, len,
                      hb.v + j0 * p.v.stride_s, p.v.stride_s, T(1), acc, p.head_dim_v);
  }
};

// Operand layouts for oneDNN's brgemm (ATen's cpublas) on half-precision matrix units. Its B
// operand is in the VNNI layout: B[k, n] at ((k / 2) * ldb + n) * 2 + k % 2, so the reduction
// dimension k comes in pairs and must be even (an odd one is padded with a zero row).
inline int64_t vnni_width(int64_t len) { return len + (len & 1); }

// src^T in VNNI, where src is [len, cols] with row stride stride_s and cols is even: the 32-bit
// pairs (src[j, 2i], src[j, 2i + 1]) transposed to [cols / 2][vnni_width(len)][2], one 4-byte-unit
// transpose with the confusion-transpose kernel; an odd len gets a zero column j = len.
// staging holds cols * (len + 1) elements.
template <typename In>
void pack_transposed_vnni(transpose::PermuteCopyFn* transpose, const In* src, int64_t stride_s,
                          int64_t len, int64_t cols, In* dst, In* staging) {
  const int64_t len_pad = vnni_width(len);
  In* staged = len == len_pad ? dst : staging;
  transpose(reinterpret_cast<const char*>(src), reinterpret_cast<char*>(staged),
            {4, 1, {cols / 2, len}, {1, stride_s / 2}});
  if (staged == dst) return;
  for (int64_t i = 0; i < cols / 2; ++i) {
    std::copy(staged + 2 * i * len, staged + 2 * (i + 1) * len, dst + 2 * i * len_pad);
    dst[2 * i * len_pad + 2 * len] = In(0);
    dst[2 * i * len_pad + 2 * len + 1] = In(0);
  }
}

// src [len, cols] (row stride stride_s) in VNNI as it stands: [vnni_width(len) / 2][cols][2],
// rows 2i and 2i + 1 interleaved element by element; an odd len gets a zero row.
template <typename In>
void pack_row_pairs_vnni(const In* src, int64_t stride_s, int64_t len, int64_t cols, In* dst) {
  static_assert(sizeof(In) == 2);
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < len / 2; ++i) {
    const auto* lo = reinterpret_cast<const uint16_t*>(src + 2 * i * stride_s);
    const auto* hi = reinterpret_cast<const uint16_t*>(src + (2 * i + 1) * stride_s);
    uint32_t* o = out + i * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = lo[c] | (static_cast<uint32_t>(hi[c]) << 16);
  }
  if (len & 1) {
    const auto* lo = reinterpret_cast<const uint16_t*>(src + (len - 1) * stride_s);
    uint32_t* o = out + (len / 2) * cols;
    for (int64_t c = 0; c < cols; ++c) o[c] = lo[c];
  }
}

// Key blocks of `block` keys, one slot per (batch, kv head, block), for operands packed once
// before the tasks start and shared by every query head of the group.
struct KeyBlockSlots {
  const AttentionProblem& p;
  int64_t block;                    // keys per block
  std::vector<int64_t> first_slot;  // slot of (b, kv head 0, block 0)

  KeyBlockSlots(const AttentionProblem& prob, int64_t block_keys)
      : p(prob), block(block_keys), first_slot(prob.batch + 1, 0) {
    for (int64_t b = 0; b < p.batch; ++b) first_slot[b + 1] = first_slot[b] + p.heads_kv * blocks(b);
  }
  int64_t count() const { return first_slot[p.batch]; }
  int64_t blocks(int64_t b) const { return (p.kv_len[b] + block - 1) / block; }
  int64_t slot(int64_t b, int64_t kvh, int64_t blk) const {
    return first_slot[b] + kvh * blocks(b) + blk;
  }
  // Padded length of key block blk of batch b: the leading dimension of its packed operands.
  int64_t block_width(int64_t b, int64_t blk) const {
    return vnni_width(std::min(block, p.kv_len[b] - blk * block));
  }
  // pack(b, kvh, j0, len, slot) for every slot, in parallel.
  template <typename Pack>
  void for_each(const Pack& pack) const {
    at::parallel_for(0, count(), 1, [&](int64_t begin, int64_t end) {
      for (int64_t sl = begin; sl < end; ++sl) {
        const int64_t b = std::upper_bound(first_slot.begin(), first_slot.end(), sl) - first_slot.begin() - 1;
        const int64_t kvh = (sl - first_slot[b]) / blocks(b), blk = (sl - first_slot[b]) % blocks(b);
        const int64_t j0 = blk * block;
        pack(b, kvh, j0, std::min(block, p.kv_len[b] - j0), sl);
      }
    });
  }
  // Row j0 of kv head kvh of batch b in k or v (strides st).
  template <typename In>
  const In* rows(const In* base, const SeqView& st, int64_t b, int64_t kvh, int64_t j0) const {
    return kv_rows(base, st, p, b, kvh) + j0 * st.stride_s;
  }
};

// The tile GEMM behind BrgemmTiles / BrgemmBwdTiles, C[M, N] = A[M, K] B[K, N] (+ C when add_c)
// with A row-major, B in VNNI, K even and an fp32 C, and the forward's packing of V into VNNI
// panels of `panel` columns ([len_pad / 2][width][2] each, at c * len_pad for the panel whose
// first column is c).
// OneDnnBrgemm: oneDNN's brgemm through ATen's cpublas, offered where the CPU has matrix units
// (could_pack: AMX); V goes through oneDNN's own transform, whose panels must be 16, 32, 48 or 64
// columns wide (Dv a multiple of 16).
struct OneDnnBrgemm {
  static constexpr bool kAnyValueWidth = false;
  static bool available(at::ScalarType dtype) { return at::native::cpublas::could_pack(dtype); }
  template <typename In>
  static void gemm(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                   bool add_c, const In* a, const In* b, float* c) {
    at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add_c, a, b, c);
  }
  static void release() { at::native::cpublas::brgemm_release(); }
  // V [len, Dv] (row stride stride_s) -> panels; staging holds (len + 1) * Dv elements.
  template <typename In>
  static void pack_v(const In* v, int64_t stride_s, int64_t len, int64_t dv, int64_t panel,
                     at::ScalarType dtype, In* dst, In* staging) {
    const int64_t len_pad = vnni_width(len);
    for (int64_t j = 0; j < len; ++j) std::copy(v + j * stride_s, v + j * stride_s + dv, staging + j * dv);
    if (len_pad > len) std::fill(staging + len * dv, staging + len_pad * dv, In(0));
    for (int64_t c = 0; c < dv; c += panel) {
      const int64_t w = std::min(panel, dv - c);
      at::native::cpublas::pack(len_pad, w, dv, w, dtype, dtype, staging + c, dst + c * len_pad);
    }
  }
};

// Avx512Bf16Dot: blas::vnni_gemm_bf16 (vdpbf16ps), for bf16 where the CPU has AVX512_BF16 but
// no matrix units (AMD Zen 4, Intel Cooper Lake), where the BLAS tiles' bf16 GEMM (MKL's) ran at
// fp32 speed. One thread of a Zen 4, bf16, 16/4 heads, D=64, causal, forward: S=512 9.0 -> 3.7
// ms, S=2048 113 -> 51 ms (SDPA: 15 and 141 ms). V is packed as row pairs, panels of any width.
struct Avx512Bf16Dot {
  static constexpr bool kAnyValueWidth = true;
  static bool available(at::ScalarType dtype) {
    return dtype == at::kBFloat16 && has_avx512_bf16();  // false outside the AVX-512 build
  }
  template <typename In>
  static void gemm(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                   bool add_c, const In* a, const In* b, float* c) {
    static_assert(std::is_same_v<In, at::BFloat16>);
    blas::vnni_gemm_bf16(m, n, k, lda, ldb, ldc, add_c, a, b, c);
  }
  static void release() {}
  template <typename In>
  static void pack_v(const In* v, int64_t stride_s, int64_t len, int64_t dv, int64_t panel,
                     at::ScalarType /*dtype*/, In* dst, In* /*staging*/) {
    for (int64_t c = 0; c < dv; c += panel) {
      pack_row_pairs_vnni(v + c, stride_s, len, std::min(panel, dv - c), dst + c * vnni_width(len));
    }
  }
};

// The forward's GEMMs through brgemm. K^T and V are packed once per key block (see
// KeyBlockSlots), each padded to an even length with zero keys (which the softmax masks out):
// - K^T [D, len] with pack_transposed_vnni. Needs D even.
// - V [len, Dv] in panels of 64 columns (Gemm::pack_v), multiplied panel by panel.
// Gemm: OneDnnBrgemm or Avx512Bf16Dot.
template <typename In, typename Gemm>
struct BrgemmTiles {
  using T = float;
  static int64_t query_rows(const AttentionProblem& p) {
    return rows_see_different_keys(p) ? 64 : 128;
  }
  using Probs = In;
  static constexpr int64_t kPanel = 64;
  const AttentionProblem& p;
  KeyBlockSlots slots;
  blas::TileBuffer<In> packed_k, packed_v;

  static int64_t width(int64_t len) { return vnni_width(len); }
  static bool supports(const AttentionProblem& p, at::ScalarType dtype) {
    return p.head_dim % 2 == 0 && (Gemm::kAnyValueWidth || p.head_dim_v % 16 == 0) &&
           Gemm::available(dtype);
  }

  BrgemmTiles(const AttentionProblem& prob, const In* k, const In* v, at::ScalarType dtype)
      : p(prob), slots(prob, kKvBlock) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    packed_k = blas::TileBuffer<In>(slots.count() * D * kKvBlock);
    packed_v = blas::TileBuffer<In>(slots.count() * kKvBlock * Dv);
    const auto& transpose = transpose::permute_copy.cpu.get("npu_fusion_attention");
    slots.for_each([&](int64_t b, int64_t kvh, int64_t j0, int64_t len, int64_t sl) {
      thread_local std::vector<In> tmp;
      tmp.resize(std::max(D, Dv) * (kKvBlock + 1));
      pack_transposed_vnni(transpose, slots.rows(k, p.k, b, kvh, j0), p.k.stride_s, len, D,
                           packed_k.data() + sl * D * kKvBlock, tmp.data());
      Gemm::pack_v(slots.rows(v, p.v, b, kvh, j0), p.v.stride_s, len, Dv, kPanel, dtype,
                   packed_v.data() + sl * kKvBlock * Dv, tmp.data());
    });
  }

  void release() const { Gemm::release(); }
  // s[rows, width(len)] = Q K^T (unscaled) for the first len keys of key block blk
  void scores(const HeadBlock<T, In>& hb, int64_t blk, int64_t /*j0*/, int64_t len, T* s) const {
    const int64_t w = width(len), D = p.head_dim;
    const In* kb = packed_k.data() + slots.slot(hb.b, hb.n / p.group(), blk) * D * kKvBlock;
    Gemm::gemm(hb.rows, w, D, p.q.stride_s, slots.block_width(hb.b, blk), w, false, hb.q, kb, s);
  }
  // acc[rows, Dv] += P V, P [rows, width(len)] over the first len keys of key block blk
  void add_pv(const HeadBlock<T, In>& hb, int64_t blk, int64_t /*j0*/, int64_t len, const In* probs,
              T* acc) const {
    const int64_t w = width(len), Dv = p.head_dim_v, panel_rows = slots.block_width(hb.b, blk);
    const In* vb = packed_v.data() + slots.slot(hb.b, hb.n / p.group(), blk) * kKvBlock * Dv;
    for (int64_t c = 0; c < Dv; c += kPanel) {
      const int64_t cols = std::min(kPanel, Dv - c);
      Gemm::gemm(hb.rows, cols, w, w, cols, Dv, true, probs, vb + c * panel_rows, acc + c);
    }
  }
};

// fp16/bf16 tiles (BlasTiles or BrgemmTiles) whose P V product takes P in fp32 instead
// (PvPrecision::kFp32): an sgemm on V converted to fp32 once, per key block (KeyBlockSlots,
// [len, Dv] each, shared by a GQA group's heads), so P is never rounded. The scores stay on the
// inner tiles.
template <typename In, typename Inner>
struct Fp32PvTiles {
  using T = float;
  using Probs = float;
  const Inner& inner;
  const AttentionProblem& p;
  KeyBlockSlots slots;
  blas::TileBuffer<float> v32;

  Fp32PvTiles(const Inner& tiles, const AttentionProblem& prob, const In* v)
      : inner(tiles), p(prob), slots(prob, kKvBlock),
        v32(slots.count() * kKvBlock * prob.head_dim_v) {
    const int64_t Dv = p.head_dim_v;
    slots.for_each([&](int64_t b, int64_t kvh, int64_t j0, int64_t len, int64_t sl) {
      const In* src = slots.rows(v, p.v, b, kvh, j0);
      float* dst = v32.data() + sl * kKvBlock * Dv;
      for (int64_t j = 0; j < len; ++j) at::vec::convert(src + j * p.v.stride_s, dst + j * Dv, Dv);
    });
  }
  static int64_t query_rows(const AttentionProblem& p) { return Inner::query_rows(p); }
  static int64_t width(int64_t len) { return Inner::width(len); }
  void release() const { inner.release(); }
  void scores(const HeadBlock<T, In>& hb, int64_t blk, int64_t j0, int64_t len, T* s) const {
    inner.scores(hb, blk, j0, len, s);
  }
  // acc[rows, Dv] += P V over the first len keys of key block blk; P's rows are width(len) long.
  void add_pv(const HeadBlock<T, In>& hb, int64_t blk, int64_t /*j0*/, int64_t len,
              const float* probs, T* acc) const {
    const int64_t Dv = p.head_dim_v;
    const float* vb = v32.data() + slots.slot(hb.b, hb.n / p.group(), blk) * kKvBlock * Dv;
    blas::gemm<float, float>(false, false, hb.rows, Dv, len, 1.0f, probs, width(len), vb, Dv,
                             1.0f, acc, Dv);
  }
};

// T: the accumulator (fp32, or fp64 for fp64 inputs); In: the dtype q/k/v are read and the
// output written in. Tiles: BlasTiles, BrgemmTiles or Fp32PvTiles; P (Tiles::Probs) is rounded
// to In unless it is T.
template <typename T, typename In, typename Tiles>
void attention_fwd_tiles(const AttentionProblem& p, const In* q, const In* k, const In* v,
                         const Tiles& tiles, In* out, T* smax, T* ssum) {
  const T* pse = static_cast<const T*>(p.pse);
  const int64_t Dv = p.head_dim_v;
  const T scale = static_cast<T>(p.scale);
  const uint64_t threshold = keep_threshold(p.keep_prob);
  const std::vector<Task> tasks = query_block_tasks(p, Tiles::query_rows(p));
  using P = typename Tiles::Probs;
  struct Scratch : FwdScratch<T, P> {
    const Tiles& tiles;
    Scratch(int64_t dv, const Tiles& t) : FwdScratch<T, P>(dv), tiles(t) {}
    ~Scratch() { tiles.release(); }
  };

  run_dynamic(
      static_cast<int64_t>(tasks.size()), [&] { return Scratch(Dv, tiles); },
      [&](Scratch& w, int64_t t) {
        const Task& task = tasks[t];
        const HeadBlock<T, In> hb(p, q, k, v, pse, task.b, task.n, task.i0, task.i1);
        const int64_t rows = hb.rows;
        // The score tiles are unscaled. Rows with neither pse nor a user mask fold scale into
        // the exp pass (max(scale * s) = scale * max(s) for scale > 0); the others are scaled
        // first, by logits().
        const bool fuse_scale = hb.pse_row0 == nullptr && hb.mask_row0 == nullptr && scale > T(0);
        const T exp_scale = fuse_scale ? scale : T(1);
        const bool native_bf16 = has_avx512_bf16();
        // P is rounded to In (kRoundsOperands) unless kept in T: with or without dropout, every
        // exp is.
        constexpr bool kReducedExp = kRoundsOperands<T, P>;
        const bool quant_p = p.p_quant > 0.0f;
        const T slack_above = quant_p ? T(0) : static_cast<T>(kStaleMaxSlack);
        start_rows(p, task, rows, Dv, w);

        const int64_t blk_hi = hb.key_lo <= hb.key_hi ? hb.key_hi / kKvBlock : -1;
        for (int64_t blk = std::max<int64_t>(hb.key_lo, 0) / kKvBlock; blk <= blk_hi; ++blk) {
          // Keys past the last one any row of the task sees (causal masks) are not computed.
          const int64_t j0 = blk * kKvBlock, len = std::min(kKvBlock, hb.key_hi + 1 - j0);
          const int64_t width = Tiles::width(len);  // row length of the tiles (len, or padded)
          T* s = w.scores.data();
          tiles.scores(hb, blk, j0, len, s);
          for (int64_t r = 0; r < rows; ++r) {
            T* sr = s + r * width;
            P* pr = w.probs.data() + r * width;
            const auto [a, e] = hb.logits(r, sr, j0, width, scale, /*apply_scale=*/!fuse_scale);
            // exp(sc * s - m_ref) over the visible keys [a, e) into out, 0 elsewhere; the sum.
            T raw_max;
            const auto exp_row = [&, a = a, e = e](T m_ref, T sc, auto* dst) {
              using Out = std::remove_pointer_t<decltype(dst)>;
              std::fill(dst, dst + a, Out(0));
              std::fill(dst + e, dst + width, Out(0));
              if constexpr (kNativeBf16Build && std::is_same_v<Out, at::BFloat16>) {
                if (native_bf16) {
                  return exp_sum_max<T, Out, kReducedExp, true>(sr + a, e - a, m_ref, sc, dst + a,
                                                                raw_max);
                }
              }
              return exp_sum_max<T, Out, kReducedExp>(sr + a, e - a, m_ref, sc, dst + a, raw_max);
            };
            T row_m = static_cast<T>(kNegInf);
            bool row_m_known = false;
            // One pass instead of two: the exps are taken against a reference while the block's
            // max is found, and kept unless that max exceeds the reference by more than
            // kStaleMaxSlack (P up to e^8: harmless in fp32 and to fp16/bf16's relative
            // rounding). The reference is the row's m from earlier blocks, or in its first block
            // the max of the row above, which must then also be within kStaleMaxSlack above the
            // row's max (so P, with its largest entry >= e^-8, stays clear of fp16's
            // subnormals). finish_rows rebases the statistics to the true max. Where P is
            // rounded (kReducedExp), a row's first block is taken against the row's own max:
            // its largest weight is then exactly 1 and carries no rounding error, where against
            // the row above's max every weight is rounded (bf16 causal attention: mean error
            // 1.56x the rounding floor instead of about 1.5x, SDPA's).
            // Quantised P (p.p_quant) takes no stale reference either, and no slack above the
            // reference: its exps must stay <= 1.
            const bool first = w.m[r] == static_cast<T>(kNegInf);
            const T m_ref = first && r > 0 && !kReducedExp && !quant_p ? w.top[r - 1] : w.m[r];
            if (fuse_scale && !p.dropout && m_ref != static_cast<T>(kNegInf)) {
              const ExpSums<T> sums = exp_row(m_ref, scale, pr);
              row_m = raw_max * scale;
              if (row_m <= m_ref + slack_above && (!first || row_m >= m_ref - kStaleMaxSlack)) {
                w.l[r] += sums.exact;  // l is 0 in a row's first block, unless NaN (see below)
                w.l_used[r] += sums.used;
                w.m[r] = m_ref;
                w.top[r] = std::max(w.top[r], row_m);
                continue;
              }
              row_m_known = true;  // too far from the reference: redo against the row's max
            }
            if (!row_m_known && a < e) row_m = row_max(sr + a, e - a) * exp_scale;
            const T m_new = std::max(w.top[r], row_m);
            if (m_new == static_cast<T>(kNegInf)) {  // nothing visible yet: contributes nothing
              // ... unless what it sees is NaN (a NaN in q, or in every key it sees): the
              // maxima skip NaN, so l carries it, and the output and statistics become NaN.
              if (a < e && any_nan(sr + a, e - a)) {
                w.l[r] = w.l_used[r] = std::numeric_limits<T>::quiet_NaN();
              }
              std::fill(pr, pr + width, P(0));
              continue;
            }
            const T alpha = std::exp(w.m[r] - m_new);  // 0 when the row had no max yet
            if (alpha != T(1)) scale_row(w.acc.data() + r * Dv, Dv, alpha);
            // With dropout the exps stay in T (sr) and are rounded after the keep factors, so
            // both sums are the exact one there.
            const ExpSums<T> sums = p.dropout ? exp_row(m_new, exp_scale, sr)
                                              : exp_row(m_new, exp_scale, pr);
            w.l[r] = w.l[r] * alpha + sums.exact;
            w.l_used[r] = w.l_used[r] * alpha + sums.used;
            if (p.dropout) {
              dropout_factors(p, hb.bit_row(r) + j0, len, w.keep.data(), w.factor.data(), threshold);
              multiply_rows(sr, w.factor.data(), len);
              at::vec::convert(sr, pr, width);
            }
            w.m[r] = w.top[r] = m_new;
          }
          if (quant_p) quantise_probs(w.probs.data(), rows * width, p.p_quant);
          tiles.add_pv(hb, blk, j0, len, w.probs.data(), w.acc.data());
        }

        finish_rows(p, task, rows, Dv, w, out, smax, ssum);
      });
}

template <typename T, typename In>
void attention_fwd_impl(const AttentionProblem& p, const at::Tensor& q_t, const at::Tensor& k_t,
                        const at::Tensor& v_t, at::Tensor& out_t, at::Tensor& max_t,
                        at::Tensor& sum_t) {
  const In* q = q_t.const_data_ptr<In>();
  const In* k = k_t.const_data_ptr<In>();
  const In* v = v_t.const_data_ptr<In>();
  In* out = out_t.data_ptr<In>();
  T* smax = max_t.data_ptr<T>();  // float32, float64 for float64 inputs
  T* ssum = sum_t.data_ptr<T>();
  if constexpr (kRoundsOperands<T, In>) {
    // The tiles as chosen, or with fp32 P V (Fp32PvTiles; see PvPrecision for kAuto's choice).
    const auto run = [&](const auto& tiles) {
      using Tiles = std::decay_t<decltype(tiles)>;
      if (p.pv == PvPrecision::kFp32 ||
          (p.pv == PvPrecision::kAuto && std::is_same_v<Tiles, BlasTiles<T, In>>)) {
        const Fp32PvTiles<In, Tiles> fp32_pv(tiles, p, v);
        return attention_fwd_tiles<T, In>(p, q, k, v, fp32_pv, out, smax, ssum);
      }
      attention_fwd_tiles<T, In>(p, q, k, v, tiles, out, smax, ssum);
    };
    const at::ScalarType dtype = q_t.scalar_type();
    const TilePath path = p.tiles;
    if (path == TilePath::kAuto && BrgemmTiles<In, OneDnnBrgemm>::supports(p, dtype)) {
      return run(BrgemmTiles<In, OneDnnBrgemm>(p, k, v, dtype));
    }
    if constexpr (std::is_same_v<In, at::BFloat16>) {
      if (path != TilePath::kBlas && BrgemmTiles<In, Avx512Bf16Dot>::supports(p, dtype)) {
        return run(BrgemmTiles<In, Avx512Bf16Dot>(p, k, v, dtype));
      }
    }
    return run(BlasTiles<T, In>{p});
  }
  attention_fwd_tiles<T, In>(p, q, k, v, BlasTiles<T, In>{p}, out, smax, ssum);
}

// rowsum(dO * O) of one row, in the accumulator type.
template <typename T, typename In>
T dot_rows(const In* a, const In* b, int64_t n) {
  if constexpr (kRoundsOperands<T, In>) {
    return at::vec::map2_reduce_all<In>([](auto x, auto y) { return x * y; },
                                        [](auto x, auto y) { return x + y; }, a, b, n);
  } else {
    return dot(a, b, n);
  }
}

// One (query block, key block) step of the backward after its two GEMMs: rows x ld tiles of
// masked logits s (-inf where a key is invisible; a row that sees nothing is all -inf with m = 0,
// inv_l = 0) and of dP = dO V^T, and what turns them into P' and dS:
//   P = exp(exp_scale * s - m) * inv_l,  P' = P * factor,  dS = P * (dP * factor - row_dot) * scale
// (factor: dropout's keep / keep_prob, absent without dropout). dS of the first len columns is
// also added into dpse rows when dpse is given (row r at dpse + r * dpse_stride).
template <typename T>
struct GradRows {
  T* s;
  T* dp;
  const T* factor;
  const T* m;
  const T* inv_l;
  const T* row_dot;
  T exp_scale, scale;
  T* dpse;
  int64_t dpse_stride;
  int64_t len;
};

// P' and dS of row r, columns j..j+n (n <= 2 * Vec::size()), as two vectors each (the formulas
// above); dS is also added into the row's dpse. kReduced: P' and dS are rounded to fp16/bf16
// (ScaledExp).
template <bool kReduced, typename T>
__attribute__((always_inline)) inline void gradient_step(const GradRows<T>& g, int64_t ld, int64_t r,
                                                         int64_t j, int64_t n,
                   Vectorized<T>* pv, Vectorized<T>* dsv) {
  using Vec = Vectorized<T>;
  using F = VecPair<T>;
  Vec s[2], dp[2], f[2];
  F::load(g.s + r * ld + j, s[0], s[1], n);
  F::load(g.dp + r * ld + j, dp[0], dp[1], n);
  if (g.factor != nullptr) F::load(g.factor + r * ld + j, f[0], f[1], n);
  const Vec inv_l(g.inv_l[r]), rd(g.row_dot[r]), scale(g.scale);
  const ScaledExp<T, kReduced> exp_of(g.exp_scale, g.m[r]);
  for (int h = 0; h < 2; ++h) {
    const Vec pr = exp_of(s[h]) * inv_l;
    if (g.factor != nullptr) {
      dsv[h] = pr * (dp[h] * f[h] - rd) * scale;
      pv[h] = pr * f[h];
    } else {
      dsv[h] = pr * (dp[h] - rd) * scale;
      pv[h] = pr;
    }
  }
  if (g.dpse != nullptr && j < g.len) {
    T* d = g.dpse + r * g.dpse_stride + j;
    const int64_t nd = std::min(n, g.len - j);
    Vec acc[2];
    F::load(d, acc[0], acc[1], nd);
    F::store(d, acc[0] + dsv[0], acc[1] + dsv[1], nd);
  }
}

// P' and dS in T, in place of s and dp, in one pass.
template <bool kReduced, typename T>
void gradients_in_place(const GradRows<T>& g, int64_t rows, int64_t ld) {
  using F = VecPair<T>;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < ld; j += F::kStep) {
      const int64_t n = std::min<int64_t>(F::kStep, ld - j);
      Vectorized<T> pv[2], dsv[2];
      gradient_step<kReduced>(g, ld, r, j, n, pv, dsv);
      F::store(g.s + r * ld + j, pv[0], pv[1], n);
      F::store(g.dp + r * ld + j, dsv[0], dsv[1], n);
    }
  }
}

// dst (In) = src (T) over n elements, rounded once.
template <typename T, typename In>
void store_row(const T* src, int64_t n, In* dst) {
  if constexpr (std::is_same_v<T, In>) {
    std::copy(src, src + n, dst);
  } else {
    at::vec::convert(src, dst, n);
  }
}

// dst row j (In, row stride dst_stride) = the sum over h < count of src + h * src_stride row j
// ([rows, cols] in T), added in order h = 0, 1, ...; tmp holds one row.
template <typename T, typename In>
void sum_heads(const T* src, int64_t count, int64_t src_stride, int64_t rows, int64_t cols, In* dst,
               int64_t dst_stride, T* tmp) {
  for (int64_t j = 0; j < rows; ++j) {
    std::copy(src + j * cols, src + (j + 1) * cols, tmp);
    for (int64_t h = 1; h < count; ++h) {
      at::vec::map2([](auto a, auto b) { return a + b; }, tmp, tmp, src + h * src_stride + j * cols, cols);
    }
    store_row(tmp, cols, dst + j * dst_stride);
  }
}

// The accumulators one backward task owns, all in T: its query block's dQ rows (scratch, stored
// into dq when the block is done) and its head's private dK/dV slice (see AttentionBwdFn).
template <typename T>
struct BwdTargets {
  T* dq_acc;  // the query block's dQ rows, [rows, D]
  T* dk_h;    // [skv, D]
  T* dv_h;    // [skv, Dv]
};

// The backward's tile GEMMs through BLAS, on tiles of width len. fp16/bf16 P' and dS are rounded
// to In right before their GEMMs (kRoundsOperands).
template <typename T, typename In>
struct BlasBwdTiles {
  const AttentionProblem& p;
  static int64_t query_rows(const AttentionProblem&) { return kBwdQBlock; }
  static int64_t width(int64_t len) { return len; }
  struct Local {
    blas::TileBuffer<In> p_low{kRoundsOperands<T, In> ? kBwdQBlock * kBwdKvBlock : 0};
    blas::TileBuffer<In> ds_low{kRoundsOperands<T, In> ? kBwdQBlock * kBwdKvBlock : 0};
    void release() const {}
  };
  Local local() const { return {}; }
  void start_head(Local&, const BwdTargets<T>& to, int64_t skv) const {
    std::fill(to.dk_h, to.dk_h + skv * p.head_dim, T(0));
    std::fill(to.dv_h, to.dv_h + skv * p.head_dim_v, T(0));
  }
  void start_rows(Local&, const HeadBlock<T, In>&, const In* /*dy_blk*/) const {}
  // s[rows, len] = Q K^T (unscaled, as in the forward)
  void scores(const HeadBlock<T, In>& hb, int64_t /*blk*/, int64_t j0, int64_t len, T* s) const {
    blas::gemm<In, T>(false, true, hb.rows, len, p.head_dim, T(1), hb.q, p.q.stride_s,
                      hb.k + j0 * p.k.stride_s, p.k.stride_s, T(0), s, len);
  }
  // dp[rows, len] = dO V^T
  void dprobs(const HeadBlock<T, In>& hb, const In* dy_blk, int64_t /*blk*/, int64_t j0, int64_t len,
              T* dp) const {
    blas::gemm<In, T>(false, true, hb.rows, len, p.head_dim_v, T(1), dy_blk, p.out.stride_s,
                      hb.v + j0 * p.v.stride_s, p.v.stride_s, T(0), dp, len);
  }
  void gradients(Local&, const GradRows<T>& g, int64_t rows, int64_t ld) const {
    gradients_in_place<kRoundsOperands<T, In>>(g, rows, ld);
  }
  // dV += P'^T dO;  dQ += dS K;  dK += dS^T Q, from gradients()'s P' (pt) and dS (ds)
  void accumulate(Local& w, const HeadBlock<T, In>& hb, const In* dy_blk, int64_t /*blk*/,
                  int64_t j0, int64_t len, const T* pt, const T* ds, const BwdTargets<T>& to) const {
    const int64_t rows = hb.rows, D = p.head_dim, Dv = p.head_dim_v;
    const In* probs;
    const In* dscores;
    if constexpr (kRoundsOperands<T, In>) {
      at::vec::convert(pt, w.p_low.data(), rows * len);
      at::vec::convert(ds, w.ds_low.data(), rows * len);
      probs = w.p_low.data();
      dscores = w.ds_low.data();
    } else {
      probs = pt;
      dscores = ds;
    }
    blas::gemm<In, T>(true, false, len, Dv, rows, T(1), probs, len, dy_blk, p.out.stride_s, T(1),
                      to.dv_h + j0 * Dv, Dv);
    blas::gemm<In, T>(false, false, rows, D, len, T(1), dscores, len, hb.k + j0 * p.k.stride_s,
                      p.k.stride_s, T(1), to.dq_acc, D);
    blas::gemm<In, T>(true, false, len, D, rows, T(1), dscores, len, hb.q, p.q.stride_s, T(1),
                      to.dk_h + j0 * D, D);
  }
  void finish_head(Local&, const BwdTargets<T>&, int64_t /*skv*/) const {}
};

// The same five GEMMs through brgemm, with every B operand in VNNI and every reduction dimension
// even (tiles of width vnni_width(len), query blocks padded to an even row count):
// - S = Q K^T and dP = dO V^T: K^T and V^T packed once per key block (pack_transposed_vnni).
// - dQ += dS K: K packed once per key block as row pairs (pack_row_pairs_vnni), dS rounded row-major.
// - dV^T += dO^T P' and dK^T += Q^T dS: the transposed products, so that P' and dS are B operands
//   packed as row pairs while they are rounded (no transpose of a whole tile); Q^T and dO^T are
//   transposed once per query block, and dK^T / dV^T accumulate per head in fp32 and are
//   transposed into dk/dv once at the end of the head.
// Padding keys and rows are zero in the operands, so they add nothing.
template <typename In, typename Gemm>
struct BrgemmBwdTiles {
  using T = float;
  const AttentionProblem& p;
  KeyBlockSlots slots;
  blas::TileBuffer<In> packed_kt, packed_vt, packed_k;
  transpose::PermuteCopyFn* transpose;

  static int64_t width(int64_t len) { return vnni_width(len); }
  static bool supports(const AttentionProblem& p, at::ScalarType dtype) {
    return p.head_dim % 2 == 0 && p.head_dim_v % 2 == 0 && Gemm::available(dtype);
  }
  // As in the forward, smaller blocks waste less of the causal diagonal. AVX512_BF16 tiles, one
  // thread of a Zen 4, bf16, 16/4 heads, D=64, causal: S=512 12.5 -> 10.9 ms with 64 rows,
  // unchanged at S=1024/2048; oneDNN's brgemm keeps the 128 rows it was measured with on AMX.
  static int64_t query_rows(const AttentionProblem& p) {
    return std::is_same_v<Gemm, Avx512Bf16Dot> && rows_see_different_keys(p) ? 64 : kBwdQBlock;
  }

  BrgemmBwdTiles(const AttentionProblem& prob, const In* k, const In* v)
      : p(prob), slots(prob, kBwdKvBlock), transpose(transpose::permute_copy.cpu.get("npu_fusion_attention_grad")) {
    const int64_t D = p.head_dim, Dv = p.head_dim_v;
    packed_kt = blas::TileBuffer<In>(slots.count() * D * kBwdKvBlock);
    packed_vt = blas::TileBuffer<In>(slots.count() * Dv * kBwdKvBlock);
    packed_k = blas::TileBuffer<In>(slots.count() * kBwdKvBlock * D);
    slots.for_each([&](int64_t b, int64_t kvh, int64_t j0, int64_t len, int64_t sl) {
      thread_local std::vector<In> tmp;
      tmp.resize(std::max(D, Dv) * (kBwdKvBlock + 1));
      const In* kb = slots.rows(k, p.k, b, kvh, j0);
      pack_transposed_vnni(transpose, kb, p.k.stride_s, len, D, packed_kt.data() + sl * D * kBwdKvBlock, tmp.data());
      pack_transposed_vnni(transpose, slots.rows(v, p.v, b, kvh, j0), p.v.stride_s, len, Dv,
                           packed_vt.data() + sl * Dv * kBwdKvBlock, tmp.data());
      pack_row_pairs_vnni(kb, p.k.stride_s, len, D, packed_k.data() + sl * kBwdKvBlock * D);
    });
  }

  struct Local {
    static constexpr int64_t kRowsPad = kBwdQBlock + 1;
    blas::TileBuffer<In> ds_row{kBwdQBlock * (kBwdKvBlock + 1)};  // dS rounded, [rows, width]
    blas::TileBuffer<In> p_pairs{kRowsPad * (kBwdKvBlock + 1)};
    blas::TileBuffer<In> ds_pairs{kRowsPad * (kBwdKvBlock + 1)};
    blas::TileBuffer<In> qt, dyt, staging;  // Q^T, dO^T [D or Dv, rows_pad]
    std::vector<T> dkt, dvt;                // dK^T, dV^T [D or Dv, skv + 1]
    int64_t rows_pad = 0, ldt = 0;
    Local(int64_t D, int64_t Dv)
        : qt(D * kRowsPad), dyt(Dv * kRowsPad), staging(std::max(D, Dv) * kRowsPad) {}
    void release() const { Gemm::release(); }
  };
  Local local() const { return Local(p.head_dim, p.head_dim_v); }

  void start_head(Local& w, const BwdTargets<T>& /*to*/, int64_t skv) const {
    w.ldt = skv + 1;  // a padded tile's last column may land one past the last key
    w.dkt.assign(p.head_dim * w.ldt, T(0));
    w.dvt.assign(p.head_dim_v * w.ldt, T(0));
  }
  // Q^T and dO^T of the query block, [cols, rows_pad] with a zero column when rows is odd.
  void start_rows(Local& w, const HeadBlock<T, In>& hb, const In* dy_blk) const {
    w.rows_pad = vnni_width(hb.rows);
    transpose_rows(w, hb.q, p.q.stride_s, hb.rows, p.head_dim, w.qt.data());
    transpose_rows(w, dy_blk, p.out.stride_s, hb.rows, p.head_dim_v, w.dyt.data());
  }
  void transpose_rows(Local& w, const In* src, int64_t stride_s, int64_t rows, int64_t cols,
                      In* dst) const {
    In* staged = rows == w.rows_pad ? dst : w.staging.data();
    transpose(reinterpret_cast<const char*>(src), reinterpret_cast<char*>(staged),
              {static_cast<int64_t>(sizeof(In)), 1, {cols, rows}, {1, stride_s}});
    if (staged == dst) return;
    for (int64_t c = 0; c < cols; ++c) {
      std::copy(staged + c * rows, staged + (c + 1) * rows, dst + c * w.rows_pad);
      dst[c * w.rows_pad + rows] = In(0);
    }
  }
  const In* packed(const blas::TileBuffer<In>& buf, const HeadBlock<T, In>& hb, int64_t blk,
                   int64_t per_slot) const {
    return buf.data() + slots.slot(hb.b, hb.n / p.group(), blk) * per_slot;
  }
  // s[rows, width(len)] = Q K^T (unscaled)
  void scores(const HeadBlock<T, In>& hb, int64_t blk, int64_t /*j0*/, int64_t len, T* s) const {
    const int64_t w = width(len), D = p.head_dim;
    Gemm::gemm(hb.rows, w, D, p.q.stride_s, slots.block_width(hb.b, blk), w, false, hb.q,
               packed(packed_kt, hb, blk, D * kBwdKvBlock), s);
  }
  // dp[rows, width(len)] = dO V^T
  void dprobs(const HeadBlock<T, In>& hb, const In* dy_blk, int64_t blk, int64_t /*j0*/, int64_t len,
              T* dp) const {
    const int64_t w = width(len), Dv = p.head_dim_v;
    Gemm::gemm(hb.rows, w, Dv, p.out.stride_s, slots.block_width(hb.b, blk), w, false, dy_blk,
               packed(packed_vt, hb, blk, Dv * kBwdKvBlock), dp);
  }
  // P' and dS rounded to In once, straight into the layouts the GEMMs take: dS row-major, P'
  // and dS as row pairs. Two rows at a time, 2 x 16 columns per step; the fp32 tiles are read
  // once and never written.
  void gradients(Local& w, const GradRows<T>& g, int64_t rows, int64_t ld) const {
    if (has_avx512_bf16()) {
      gradients_rounded<true>(w, g, rows, ld);
    } else {
      gradients_rounded<false>(w, g, rows, ld);
    }
  }
  // kNativeBf16: bf16 rounded by store_bf16_native, which flushes fp32 subnormals to 0 (an
  // absolute change below 1.2e-38 in a P' or dS entry).
  template <bool kNativeBf16>
  void gradients_rounded(Local& w, const GradRows<T>& g, int64_t rows, int64_t ld) const {
    using Vec = Vectorized<T>;
    using Pair = VecPair<In>;
    // P' and dS of row r, columns j..j+n (n <= kStep); dS also stored row-major
    const auto row = [&](int64_t r, int64_t j, int64_t n, Vec* pv, Vec* dsv) {
      gradient_step</*kReduced=*/true>(g, ld, r, j, n, pv, dsv);
      store_pair<kNativeBf16>(w.ds_row.data() + r * ld + j, dsv[0], dsv[1], n);
    };
    // (a[i], b[i]) pairs of columns j..j+n into dst's row-pair layout
    const auto pairs = [&](In* dst, int64_t j, int64_t n, const Vec* a, const Vec* b) {
      for (int h = 0; h < 2; ++h) {
        const int64_t nh = std::clamp<int64_t>(n - h * Vec::size(), 0, Vec::size());
        if (nh == 0) break;
        const auto [lo, hi] = at::vec::interleave2(a[h], b[h]);
        store_pair<kNativeBf16>(dst + 2 * (j + h * Vec::size()), lo, hi, 2 * nh);
      }
    };
    for (int64_t r = 0; r < rows; r += 2) {
      In* p_out = w.p_pairs.data() + r * ld;
      In* ds_out = w.ds_pairs.data() + r * ld;
      for (int64_t j = 0; j < ld; j += Pair::kStep) {
        const int64_t n = std::min<int64_t>(Pair::kStep, ld - j);
        Vec p0[2], ds0[2], p1[2] = {Vec(0), Vec(0)}, ds1[2] = {Vec(0), Vec(0)};
        row(r, j, n, p0, ds0);
        if (r + 1 < rows) row(r + 1, j, n, p1, ds1);  // else the zero row padding rows to even
        pairs(p_out, j, n, p0, p1);
        pairs(ds_out, j, n, ds0, ds1);
      }
    }
  }
  void accumulate(Local& w, const HeadBlock<T, In>& hb, const In* /*dy_blk*/, int64_t blk, int64_t j0,
                  int64_t len, const T* /*pt*/, const T* /*ds*/, const BwdTargets<T>& to) const {
    const int64_t rows = hb.rows, wd = width(len), D = p.head_dim, Dv = p.head_dim_v;
    Gemm::gemm(Dv, wd, w.rows_pad, w.rows_pad, wd, w.ldt, true, w.dyt.data(), w.p_pairs.data(),
               w.dvt.data() + j0);
    Gemm::gemm(D, wd, w.rows_pad, w.rows_pad, wd, w.ldt, true, w.qt.data(), w.ds_pairs.data(),
               w.dkt.data() + j0);
    Gemm::gemm(rows, D, wd, wd, D, D, true, w.ds_row.data(),
               packed(packed_k, hb, blk, kBwdKvBlock * D), to.dq_acc);
  }
  // The head's dk/dv slices <- dK^T / dV^T (every row: those no query saw are 0)
  void finish_head(Local& w, const BwdTargets<T>& to, int64_t skv) const {
    if (skv == 0) return;
    const auto t = [&](const std::vector<T>& src, int64_t cols, T* dst) {
      transpose(reinterpret_cast<const char*>(src.data()), reinterpret_cast<char*>(dst),
                {static_cast<int64_t>(sizeof(T)), 1, {skv, cols}, {1, w.ldt}});
    };
    t(w.dkt, p.head_dim, to.dk_h);
    t(w.dvt, p.head_dim_v, to.dv_h);
  }
};

template <typename T, typename In>
struct BwdScratch {
  blas::TileBuffer<T> p_tile{kBwdQBlock * (kBwdKvBlock + 1)};   // P (then P' with dropout)
  blas::TileBuffer<T> ds_tile{kBwdQBlock * (kBwdKvBlock + 1)};  // dP, then dS
  blas::TileBuffer<T> factor{kBwdQBlock * (kBwdKvBlock + 1)};
  blas::TileBuffer<uint8_t> keep{kBwdKvBlock};
  blas::TileBuffer<T> dq_acc;  // [rows, D]
  blas::TileBuffer<T> row_sum;  // one summed dk/dv row
  T row_dot[kBwdQBlock];        // rowsum(dO * O)
  T m[kBwdQBlock];
  T inv_l[kBwdQBlock];
  BwdScratch(int64_t d, int64_t dv)
      : dq_acc(kBwdQBlock * std::max<int64_t>(d, 1)), row_sum(std::max<int64_t>({d, dv, 1})) {}
};

template <typename T, typename In>
struct BwdArgs {
  const In *q, *k, *v, *dy, *o;
  const T *smax, *ssum;
  In *dq, *dk, *dv;            // layouts p.q, p.k, p.v
  T *dk_heads, *dv_heads, *dpse;
  float* dsink;
  int64_t dpse_rows;  // dpse is [B, Nq, Sp, Skv]: Sp = 1 sums the rows, Sp = Sq keeps them.
  int64_t total_kv;   // TND: Tkv rows per head
};

// One task per (batch, query head), see the top of the file. Tiles: BlasBwdTiles or BrgemmBwdTiles;
// the tiles of a key block are width(len) wide, and columns past len are masked (P = dS = 0).
template <typename T, typename In, typename Tiles>
void attention_bwd_tiles(const AttentionProblem& p, const BwdArgs<T, In>& x, const Tiles& tiles) {
  const T* pse = static_cast<const T*>(p.pse);
  const int64_t Dv = p.head_dim_v;
  const T scale = static_cast<T>(p.scale);
  const uint64_t threshold = keep_threshold(p.keep_prob);
  const int64_t D = p.head_dim, g = p.group();
  const int64_t q_rows = Tiles::query_rows(p);
  TORCH_INTERNAL_ASSERT(q_rows > 0 && q_rows <= kBwdQBlock);
  struct Scratch : BwdScratch<T, In> {
    typename Tiles::Local local;
    Scratch(int64_t d, int64_t dv, typename Tiles::Local l) : BwdScratch<T, In>(d, dv), local(std::move(l)) {}
    ~Scratch() { local.release(); }
  };
  // Query heads of each (batch, kv head) still running; the last one sums the group's dk/dv.
  std::unique_ptr<std::atomic<int64_t>[]> heads_left(new std::atomic<int64_t>[p.batch * p.heads_kv]);
  for (int64_t i = 0; i < p.batch * p.heads_kv; ++i) heads_left[i].store(g);
  const auto head_row0 = [&](int64_t b, int64_t n) {  // of the per-head dk/dv slices
    return p.tnd ? n * x.total_kv + p.kv_start[b] : (b * p.heads_q + n) * p.kv_len[b];
  };

  run_dynamic(
      p.batch * p.heads_q, [&] { return Scratch(D, Dv, tiles.local()); },
      [&](Scratch& w, int64_t t) {
        const int64_t b = t / p.heads_q, n = t % p.heads_q, kvh = n / g;
        const int64_t sq = p.q_len[b], skv = p.kv_len[b];
        BwdTargets<T> to{w.dq_acc.data(), x.dk_heads + head_row0(b, n) * D, x.dv_heads + head_row0(b, n) * Dv};
        T* dpse_h = x.dpse == nullptr ? nullptr : x.dpse + (b * p.heads_q + n) * x.dpse_rows * skv;
        double dsink_acc = 0;
        tiles.start_head(w.local, to, skv);
        for (int64_t i0 = 0; i0 < sq; i0 += q_rows) {
          const HeadBlock<T, In> hb(p, x.q, x.k, x.v, pse, b, n, i0, std::min(i0 + q_rows, sq));
          const int64_t rows = hb.rows;
          const bool fuse_scale = hb.pse_row0 == nullptr && hb.mask_row0 == nullptr && scale > T(0);
          const T exp_scale = fuse_scale ? scale : T(1);
          const int64_t out_row0 = b * p.out.stride_b + (p.q_start[b] + i0) * p.out.stride_s + n * p.out.stride_n;
          const In* dy_blk = x.dy + out_row0;
          const In* o_blk = x.o + out_row0;
          In* dq_blk = x.dq + b * p.q.stride_b + (p.q_start[b] + i0) * p.q.stride_s + n * p.q.stride_n;
          std::fill(w.dq_acc.data(), w.dq_acc.data() + rows * D, T(0));
          for (int64_t r = 0; r < rows; ++r) {
            w.row_dot[r] = dot_rows<T>(dy_blk + r * p.out.stride_s, o_blk + r * p.out.stride_s, Dv);
            const int64_t idx = p.stat_index(b, n, i0 + r);
            const T l = x.ssum[8 * idx];
            // A row that saw no key has l = 0: m = 0 keeps its P = exp(-inf - m) * 0 at 0. A NaN
            // l (the row saw a NaN) makes every P of the row, and so its gradients, NaN.
            w.m[r] = l == T(0) ? T(0) : x.smax[8 * idx];
            w.inv_l[r] = l == T(0) ? T(0) : T(1) / l;
            if (p.sink != nullptr && l != T(0)) {
              // d loss / d sink = -p_sink * rowsum(dO * O), p_sink = exp(sink - max) / sum.
              dsink_acc -= std::exp(static_cast<T>(p.sink[n]) - w.m[r]) * w.inv_l[r] * w.row_dot[r];
            }
          }
          if (hb.key_lo <= hb.key_hi) tiles.start_rows(w.local, hb, dy_blk);
          const int64_t blk_hi = hb.key_lo <= hb.key_hi ? hb.key_hi / kBwdKvBlock : -1;
          for (int64_t blk = std::max<int64_t>(hb.key_lo, 0) / kBwdKvBlock; blk <= blk_hi; ++blk) {
            // Keys past the last one any row sees (causal masks) are not computed.
            const int64_t j0 = blk * kBwdKvBlock, len = std::min(kBwdKvBlock, hb.key_hi + 1 - j0);
            const int64_t ld = Tiles::width(len);
            T* pt = w.p_tile.data();
            T* dst = w.ds_tile.data();
            // Q K^T, unscaled; scale is folded as in the forward.
            tiles.scores(hb, blk, j0, len, pt);
            for (int64_t r = 0; r < rows; ++r) {
              // masked logits; a row seeing no key of the block is all -inf
              hb.logits(r, pt + r * ld, j0, ld, scale, /*apply_scale=*/!fuse_scale);
            }
            tiles.dprobs(hb, dy_blk, blk, j0, len, dst);  // dP = dO V^T
            if (p.dropout) {
              for (int64_t r = 0; r < rows; ++r) {
                T* f = w.factor.data() + r * ld;
                dropout_factors(p, hb.bit_row(r) + j0, len, w.keep.data(), f, threshold);
                std::fill(f + len, f + ld, T(0));
              }
            }
            const GradRows<T> g{pt, dst, p.dropout ? w.factor.data() : nullptr, w.m, w.inv_l,
                                w.row_dot, exp_scale, scale,
                                dpse_h == nullptr ? nullptr : dpse_h + (x.dpse_rows == 1 ? 0 : i0 * skv) + j0,
                                x.dpse_rows == 1 ? 0 : skv, len};
            tiles.gradients(w.local, g, rows, ld);
            tiles.accumulate(w.local, hb, dy_blk, blk, j0, len, pt, dst, to);
          }
          for (int64_t r = 0; r < rows; ++r) store_row(w.dq_acc.data() + r * D, D, dq_blk + r * p.q.stride_s);
        }
        tiles.finish_head(w.local, to, skv);
        // The group's last head sums its g slices, in head order (the result does not depend on
        // which thread finishes last), into dk/dv.
        if (heads_left[b * p.heads_kv + kvh].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          const int64_t n0 = kvh * g, stride = head_row0(b, n0 + 1) - head_row0(b, n0);
          sum_heads(x.dk_heads + head_row0(b, n0) * D, g, stride * D, skv, D,
                    kv_rows(x.dk, p.k, p, b, kvh), p.k.stride_s, w.row_sum.data());
          sum_heads(x.dv_heads + head_row0(b, n0) * Dv, g, stride * Dv, skv, Dv,
                    kv_rows(x.dv, p.v, p, b, kvh), p.v.stride_s, w.row_sum.data());
        }
        if (x.dsink != nullptr) x.dsink[b * p.heads_q + n] = static_cast<float>(dsink_acc);
      });
}

template <typename T, typename In>
void attention_bwd_impl(const AttentionProblem& p, const at::Tensor& q_t, const at::Tensor& k_t,
                        const at::Tensor& v_t, const at::Tensor& dy_t, const at::Tensor& out_t,
                        const at::Tensor& max_t, const at::Tensor& sum_t, at::Tensor& dq_t,
                        at::Tensor& dk_t, at::Tensor& dv_t, at::Tensor& dk_heads_t,
                        at::Tensor& dv_heads_t, at::Tensor& dpse_t, at::Tensor& dsink_t) {
  const BwdArgs<T, In> x{
      q_t.const_data_ptr<In>(), k_t.const_data_ptr<In>(), v_t.const_data_ptr<In>(),
      dy_t.const_data_ptr<In>(), out_t.const_data_ptr<In>(), max_t.const_data_ptr<T>(),
      sum_t.const_data_ptr<T>(), dq_t.data_ptr<In>(), dk_t.data_ptr<In>(), dv_t.data_ptr<In>(),
      dk_heads_t.data_ptr<T>(), dv_heads_t.data_ptr<T>(),
      dpse_t.defined() ? dpse_t.data_ptr<T>() : nullptr,
      dsink_t.defined() ? dsink_t.data_ptr<float>() : nullptr,
      dpse_t.defined() ? dpse_t.size(2) : 0, p.tnd ? dk_heads_t.size(1) : 0};
  if constexpr (kRoundsOperands<T, In>) {
    const at::ScalarType dtype = q_t.scalar_type();
    const TilePath path = p.tiles;
    if (path == TilePath::kAuto && BrgemmBwdTiles<In, OneDnnBrgemm>::supports(p, dtype)) {
      return attention_bwd_tiles<T, In>(p, x, BrgemmBwdTiles<In, OneDnnBrgemm>(p, x.k, x.v));
    }
    if constexpr (std::is_same_v<In, at::BFloat16>) {
      if (path != TilePath::kBlas && BrgemmBwdTiles<In, Avx512Bf16Dot>::supports(p, dtype)) {
        return attention_bwd_tiles<T, In>(p, x, BrgemmBwdTiles<In, Avx512Bf16Dot>(p, x.k, x.v));
      }
    }
  }
  attention_bwd_tiles<T, In>(p, x, BlasBwdTiles<T, In>{p});
}

void attention_fwd_kernel(const AttentionProblem& p, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, at::Tensor& out, at::Tensor& softmax_max,
                          at::Tensor& softmax_sum) {
  switch (q.scalar_type()) {
    case at::kDouble: return attention_fwd_impl<double, double>(p, q, k, v, out, softmax_max, softmax_sum);
    case at::kBFloat16: return attention_fwd_impl<float, at::BFloat16>(p, q, k, v, out, softmax_max, softmax_sum);
    case at::kHalf: return attention_fwd_impl<float, at::Half>(p, q, k, v, out, softmax_max, softmax_sum);
    default: return attention_fwd_impl<float, float>(p, q, k, v, out, softmax_max, softmax_sum);
  }
}

void attention_bwd_kernel(const AttentionProblem& p, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& dy, const at::Tensor& out,
                          const at::Tensor& softmax_max, const at::Tensor& softmax_sum,
                          at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dk_heads,
                          at::Tensor& dv_heads, at::Tensor& dpse, at::Tensor& dsink) {
  const auto run = [&](auto acc, auto in) {
    using T = decltype(acc);
    using In = decltype(in);
    attention_bwd_impl<T, In>(p, q, k, v, dy, out, softmax_max, softmax_sum, dq, dk, dv, dk_heads,
                              dv_heads, dpse, dsink);
  };
  switch (q.scalar_type()) {
    case at::kDouble: return run(double(), double());
    case at::kBFloat16: return run(float(), at::BFloat16());
    case at::kHalf: return run(float(), at::Half());
    default: return run(float(), float());
  }
}

// The CPU's plan for a call (AttentionPlan). fp16/bf16 inputs stay in their dtype, for
// half-precision GEMMs with fp32 accumulation, where the CPU GEMM policy (common/half_gemm.h)
// multiplies them natively and PyTorch's MKL provides those GEMMs (blas::half_gemm_available);
// elsewhere they are converted to fp32 once, and every product then runs in fp32 with the
// same single rounding of the output. OPENNPU_ATTENTION_HALF_GEMM=0 (this op only) or
// OPENNPU_HALF_GEMM=fp32 turns them off, OPENNPU_HALF_GEMM=native on, e.g. to compare both
// paths.
bool use_half_gemm(at::ScalarType t) {
  if (t != at::kBFloat16 && t != at::kHalf) return false;
  const char* env = std::getenv("OPENNPU_ATTENTION_HALF_GEMM");
  if (env != nullptr && std::string(env) == "0") return false;
  return blas::half_gemm_available(t);
}

// OPENNPU_ATTENTION_TILES (see TilePath), read on every call, as use_half_gemm reads its setting.
TilePath requested_tiles(const char* op) {
  const char* env = std::getenv("OPENNPU_ATTENTION_TILES");
  const std::string value = env == nullptr ? "" : env;
  if (value.empty() || value == "auto") return TilePath::kAuto;
  if (value == "avx512_bf16") return TilePath::kAvx512Bf16;
  if (value == "blas") return TilePath::kBlas;
  TORCH_CHECK(false, op, ": OPENNPU_ATTENTION_TILES must be auto, avx512_bf16 or blas, but got '",
              value, "'");
}

// OPENNPU_ATTENTION_PV=auto|fp32|half (unset: auto; see PvPrecision), read on every call.
PvPrecision requested_pv(const char* op) {
  const char* env = std::getenv("OPENNPU_ATTENTION_PV");
  const std::string value = env == nullptr ? "" : env;
  if (value.empty() || value == "auto") return PvPrecision::kAuto;
  if (value == "fp32") return PvPrecision::kFp32;
  if (value == "half") return PvPrecision::kHalf;
  TORCH_CHECK(false, op, ": OPENNPU_ATTENTION_PV must be auto, fp32 or half, but got '", value,
              "'");
}

AttentionPlan attention_plan_kernel(const char* op, at::ScalarType dtype, int64_t head_dim,
                                    int64_t head_dim_v, bool check_forced_tiles) {
  AttentionPlan plan;
  const at::ScalarType acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
  plan.compute = use_half_gemm(dtype) ? dtype : acc;
  plan.tiles = requested_tiles(op);
  plan.pv = requested_pv(op);
  // The AVX512_BF16 tile GEMM exists in this compilation only where it is the AVX-512 one, which
  // runs only on CPUs whose kernels are chosen as AVX-512 (cpu_isa), and needs the extension.
  const bool bf16_tiles = has_avx512_bf16();
  TORCH_CHECK(!check_forced_tiles || plan.tiles != TilePath::kAvx512Bf16 ||
                  dtype != at::kBFloat16 ||
                  (plan.compute == at::kBFloat16 && bf16_tiles && head_dim % 2 == 0 &&
                   head_dim_v % 2 == 0),
              op, ": OPENNPU_ATTENTION_TILES=avx512_bf16 takes bf16 computed in bf16 (not with "
              "OPENNPU_ATTENTION_HALF_GEMM=0) on a CPU with AVX512_BF16 and AVX-512 kernels, with "
              "even head sizes, but this call has D=", head_dim, ", Dv=", head_dim_v, " on ",
              cpu_isa_name(cpu_isa()), " kernels", bf16_tiles ? "" : " without AVX512_BF16");
  return plan;
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(attention_plan, attention_plan_kernel);
OPENNPU_REGISTER_CPU_SLOT(attention_fwd, attention_fwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(attention_bwd, attention_bwd_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::attention
