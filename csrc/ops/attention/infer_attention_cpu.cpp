// Decode kernel of npu_fused_infer_attention_score: one query row per sequence against a KV
// cache, memory-bound on reading K and V.
//
// One task per (batch, kv head, context split). A task serves the whole GQA group of its kv
// head, so every K/V row is read once for all g query heads. It walks the visible keys in chunks
// of at most kChunk rows that never cross a cache block (paged caches are read in place through
// the block table), and per chunk: scores of the g heads (vectorised dot products, fp32
// accumulation, K converted from fp16/bf16 in registers), the user mask, one online-softmax step
// per head (fp32 running max and sum, vectorised exp), then acc += P V with the V chunk read
// once per tile of heads (the accumulators of kHeadTile heads x 2 vectors stay in registers).
// When batch * kv heads gives the threads too little work, the context is split and the
// partial (max, sum, acc) of the splits are merged in a second pass. The output is rounded once.
// An int8 cache (antiquant) is dequantised chunk by chunk into fp32 rows of the task's scratch,
// (x + offset) * scale with per-channel or per-token factors, and those rows go through the same
// score and P V loops: no fp32 copy of the cache is made.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/vec.h"
#include "ops/attention/infer_attention.h"

namespace opennpu::attention {
inline namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using Vec = Vectorized<float>;

constexpr int64_t kChunk = 64;     // keys per softmax step
constexpr int kHeadTile = 4;       // query heads whose accumulators share registers
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename In>
struct Rows {
  const In* base;
  int64_t stride_blk, stride_s, stride_n;
};

template <typename In>
Rows<In> rows_of(const KvRows& r) {
  return {static_cast<const In*>(r.base), r.stride_blk, r.stride_s, r.stride_n};
}

// Row t0 of kv head h of batch b, valid for the rows t0 .. end of t0's block (paged) or beyond.
template <typename In>
const In* row_ptr(const Rows<In>& r, const DecodeProblem& d, int64_t b, int64_t h, int64_t t0) {
  const KvCache& c = d.cache;
  if (c.block_table != nullptr) {
    const int64_t blk = c.block_table[b * c.table_stride + t0 / c.block_size];
    return r.base + blk * r.stride_blk + (t0 % c.block_size) * r.stride_s + h * r.stride_n;
  }
  return r.base + b * r.stride_blk + (d.p->kv_start[b] + t0) * r.stride_s + h * r.stride_n;
}

// sum_d q[d] * k[d] for NH heads (q rows of length n at stride ldq, fp32), k in In.
template <int NH, typename In>
OPENNPU_VEC_INLINE void dots(const float* q, int64_t ldq, const In* k, int64_t n, Vec* acc) {
  using Pair = VecPair<In>;
  int64_t j = 0;
  for (; j + Pair::kStep <= n; j += Pair::kStep) {
    Vec k0, k1;
    Pair::load(k + j, k0, k1);
    for (int h = 0; h < NH; ++h) {
      acc[h] = at::vec::fmadd(Vec::loadu(q + h * ldq + j), k0, acc[h]);
      acc[h] = at::vec::fmadd(Vec::loadu(q + h * ldq + j + Vec::size()), k1, acc[h]);
    }
  }
  if (j < n) {  // q is zero-padded to a multiple of kStep, k's lanes past n load as 0
    Vec k0, k1;
    Pair::load(k + j, k0, k1, n - j);
    for (int h = 0; h < NH; ++h) {
      acc[h] = at::vec::fmadd(Vec::loadu(q + h * ldq + j), k0, acc[h]);
      acc[h] = at::vec::fmadd(Vec::loadu(q + h * ldq + j + Vec::size()), k1, acc[h]);
    }
  }
}

// s[h * kChunk + t] = scaled q_h . k_t (+ q_rope_h . k_rope_t) for NH heads, len keys.
template <int NH, typename In, typename RopeIn>
void chunk_scores(const float* q, const float* qr, int64_t ldq, int64_t ldqr, const In* k,
                  int64_t k_stride, const RopeIn* kr, int64_t kr_stride, int64_t D, int64_t Dr,
                  int64_t len, float* s) {
  for (int64_t t = 0; t < len; ++t) {
    Vec acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = Vec(0.0f);
    dots<NH>(q, ldq, k + t * k_stride, D, acc);
    if (Dr > 0) dots<NH>(qr, ldqr, kr + t * kr_stride, Dr, acc);
    for (int h = 0; h < NH; ++h) s[h * kChunk + t] = horizontal_sum(acc[h]);
  }
}

// acc_h[0, Dv) += sum_t p[h * kChunk + t] * v_t for NH heads.
template <int NH, typename In>
void chunk_pv(const float* p, const In* v, int64_t v_stride, int64_t len, int64_t Dv, float* acc,
              int64_t ld_acc) {
  using Pair = VecPair<In>;
  for (int64_t j = 0; j < Dv; j += Pair::kStep) {
    const int64_t n = std::min<int64_t>(Pair::kStep, Dv - j);
    Vec a0[NH], a1[NH];
    for (int h = 0; h < NH; ++h) {  // acc rows are padded to a multiple of kStep
      a0[h] = Vec::loadu(acc + h * ld_acc + j);
      a1[h] = Vec::loadu(acc + h * ld_acc + j + Vec::size());
    }
    const In* vj = v + j;
    if (n == Pair::kStep) {
      for (int64_t t = 0; t < len; ++t) {
        Vec v0, v1;
        Pair::load(vj + t * v_stride, v0, v1);
        for (int h = 0; h < NH; ++h) {
          const Vec w(p[h * kChunk + t]);
          a0[h] = at::vec::fmadd(w, v0, a0[h]);
          a1[h] = at::vec::fmadd(w, v1, a1[h]);
        }
      }
    } else {
      for (int64_t t = 0; t < len; ++t) {
        Vec v0, v1;
        Pair::load(vj + t * v_stride, v0, v1, n);
        for (int h = 0; h < NH; ++h) {
          const Vec w(p[h * kChunk + t]);
          a0[h] = at::vec::fmadd(w, v0, a0[h]);
          a1[h] = at::vec::fmadd(w, v1, a1[h]);
        }
      }
    }
    for (int h = 0; h < NH; ++h) {
      a0[h].store(acc + h * ld_acc + j);
      a1[h].store(acc + h * ld_acc + j + Vec::size());
    }
  }
}

// Calls f(std::integral_constant<int, NH>, h0) over head tiles of 4, 2, 1 covering [0, g).
template <typename F>
void for_head_tiles(int64_t g, const F& f) {
  int64_t h = 0;
  for (; h + 4 <= g; h += 4) f(std::integral_constant<int, 4>{}, h);
  if (h + 2 <= g) {
    f(std::integral_constant<int, 2>{}, h);
    h += 2;
  }
  if (h < g) f(std::integral_constant<int, 1>{}, h);
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Per-thread buffers: scaled q of the group, scores / probabilities, accumulators, and the
// dequantised K / V rows of a chunk (int8 caches).
struct Scratch {
  std::vector<float> q, qr, s, acc, m, l, kd, vd;
};

// Offset of the token factor of row t0 of (b, h) in a KvQuant::Kind::kToken table.
int64_t token_index(const KvQuant& qd, const DecodeProblem& d, int64_t b, int64_t h, int64_t t0) {
  const KvCache& c = d.cache;
  if (qd.paged) {
    const int64_t blk = c.block_table[b * c.table_stride + t0 / c.block_size];
    return blk * qd.stride_blk + (t0 % c.block_size) * qd.stride_s + h * qd.stride_n;
  }
  return b * qd.stride_blk + t0 * qd.stride_s + h * qd.stride_n;
}

// Rows t0 .. t0 + len of (b, h) (inside one cache block), n int8 values each at src_stride, as
// fp32 rows (x + offset) * scale at dst + t * ld.
void dequant_rows(const KvQuant& qd, const DecodeProblem& d, int64_t b, int64_t h, int64_t t0,
                  int64_t len, const int8_t* src, int64_t src_stride, int64_t n, float* dst,
                  int64_t ld) {
  if (qd.kind == KvQuant::Kind::kChannel) {
    const float* __restrict sc = qd.scale + h * n;
    const float* __restrict off = qd.offset == nullptr ? nullptr : qd.offset + h * n;
    for (int64_t t = 0; t < len; ++t) {
      const int8_t* __restrict x = src + t * src_stride;
      float* __restrict y = dst + t * ld;
      if (off != nullptr) {
        for (int64_t j = 0; j < n; ++j) y[j] = (static_cast<float>(x[j]) + off[j]) * sc[j];
      } else {
        for (int64_t j = 0; j < n; ++j) y[j] = static_cast<float>(x[j]) * sc[j];
      }
    }
    return;
  }
  const int64_t i0 = token_index(qd, d, b, h, t0);
  for (int64_t t = 0; t < len; ++t) {
    const float s = qd.scale[i0 + t * qd.stride_s];
    const float o = qd.offset == nullptr ? 0.0f : qd.offset[i0 + t * qd.stride_s];
    const int8_t* __restrict x = src + t * src_stride;
    float* __restrict y = dst + t * ld;
    for (int64_t j = 0; j < n; ++j) y[j] = (static_cast<float>(x[j]) + o) * s;
  }
}

// In: the dtype of q and out; KvT: of the K / V cache (In, or int8 with antiquant factors).
template <typename In, typename KvT = In>
struct DecodeKernel {
  static constexpr bool kInt8 = std::is_same_v<KvT, int8_t>;
  using KRow = std::conditional_t<kInt8, float, In>;  // what the score / P V loops read
  const DecodeProblem& d;
  const AttentionProblem& p;
  int64_t g, D, Dr, Dv, ldq, ldqr, ldacc;
  Rows<KvT> K, V;
  Rows<In> KR;

  explicit DecodeKernel(const DecodeProblem& dp)
      : d(dp), p(*dp.p), g(dp.p->group()), D(dp.p->head_dim), Dr(dp.rope_dim),
        Dv(dp.p->head_dim_v) {
    constexpr int64_t step = VecPair<In>::kStep;
    ldq = std::max<int64_t>(round_up(D, step), step);
    ldqr = std::max<int64_t>(round_up(Dr, step), step);
    ldacc = std::max<int64_t>(round_up(Dv, step), step);
    K = rows_of<KvT>(d.cache.k);
    V = rows_of<KvT>(d.cache.v);
    KR = rows_of<In>(d.cache.k_rope);
  }

  void prepare(Scratch& w) const {
    w.q.assign(g * ldq, 0.0f);
    w.qr.assign(g * ldqr, 0.0f);
    w.s.resize(g * kChunk);
    w.acc.resize(g * ldacc);
    w.m.resize(g);
    w.l.resize(g);
    if constexpr (kInt8) {
      w.kd.resize(kChunk * ldq);
      w.vd.resize(kChunk * ldacc);
    }
  }

  // Loads the group's query rows, times scale, as fp32.
  void load_q(Scratch& w, int64_t b, int64_t kvh) const {
    for (int64_t h = 0; h < g; ++h) {
      const int64_t n = kvh * g + h;
      const In* src = q_base_ + b * p.q.stride_b + p.q_start[b] * p.q.stride_s + n * p.q.stride_n;
      for (int64_t j = 0; j < D; ++j) w.q[h * ldq + j] = static_cast<float>(src[j]) * scale_;
      if (Dr > 0) {
        const In* r = qr_base_ + b * d.q_rope_view.stride_b + p.q_start[b] * d.q_rope_view.stride_s +
                      n * d.q_rope_view.stride_n;
        for (int64_t j = 0; j < Dr; ++j) w.qr[h * ldqr + j] = static_cast<float>(r[j]) * scale_;
      }
    }
  }

  // Online softmax over keys [t0, t1) of batch b, kv head kvh, from a fresh state (sink or
  // nothing); leaves m, l and the unnormalised acc in w.
  void run(Scratch& w, int64_t b, int64_t kvh, int64_t t0, int64_t t1, bool with_sink) const {
    for (int64_t h = 0; h < g; ++h) {
      const bool sink = with_sink && p.sink != nullptr;
      w.m[h] = sink ? p.sink[kvh * g + h] : kNegInf;
      w.l[h] = sink && w.m[h] != kNegInf ? 1.0f : 0.0f;
    }
    std::fill(w.acc.begin(), w.acc.end(), 0.0f);
    const uint8_t* mask = p.user_mask == nullptr ? nullptr : p.user_mask + b * p.mask_stride_b;
    const int64_t bs = d.cache.block_table != nullptr ? d.cache.block_size : kChunk;
    for (int64_t c0 = t0; c0 < t1;) {
      const int64_t len = std::min({kChunk, t1 - c0, bs - c0 % bs});
      const KvT* k_raw = row_ptr(K, d, b, kvh, c0);
      const KvT* v_raw = row_ptr(V, d, b, kvh, c0);
      const KRow* k;
      const KRow* v;
      int64_t k_stride, v_stride;
      if constexpr (kInt8) {
        dequant_rows(d.cache.kq, d, b, kvh, c0, len, k_raw, K.stride_s, D, w.kd.data(), ldq);
        dequant_rows(d.cache.vq, d, b, kvh, c0, len, v_raw, V.stride_s, Dv, w.vd.data(), ldacc);
        k = w.kd.data();
        v = w.vd.data();
        k_stride = ldq;
        v_stride = ldacc;
      } else {
        k = k_raw;
        v = v_raw;
        k_stride = K.stride_s;
        v_stride = V.stride_s;
      }
      const In* kr = Dr > 0 ? row_ptr(KR, d, b, kvh, c0) : nullptr;
      for_head_tiles(g, [&](auto nh, int64_t h0) {
        chunk_scores<decltype(nh)::value, KRow, In>(w.q.data() + h0 * ldq, w.qr.data() + h0 * ldqr,
                                                    ldq, ldqr, k, k_stride, kr, KR.stride_s, D, Dr,
                                                    len, w.s.data() + h0 * kChunk);
      });
      for (int64_t h = 0; h < g; ++h) {
        float* s = w.s.data() + h * kChunk;
        if (mask != nullptr) {
          // mask rows may differ per query head ([B, N, 1, S] masks)
          const uint8_t* mrow = mask + (kvh * g + h) * p.mask_stride_n + c0;
          for (int64_t t = 0; t < len; ++t) {
            if (mrow[t] != 0) s[t] = kNegInf;
          }
        }
        float cmax = kNegInf;
        for (int64_t t = 0; t < len; ++t) cmax = std::max(cmax, s[t]);
        const float m_new = std::max(w.m[h], cmax);
        if (m_new == kNegInf) {  // nothing visible yet: p = 0
          std::fill(s, s + len, 0.0f);
          continue;
        }
        const float alpha = w.m[h] == kNegInf ? 0.0f : std::exp(w.m[h] - m_new);
        Vec vsum(0.0f);
        const Vec vm(m_new);
        int64_t t = 0;
        for (; t + Vec::size() <= len; t += Vec::size()) {
          const Vec e = exp_fast(Vec::loadu(s + t) - vm);
          e.store(s + t);
          vsum = vsum + e;
        }
        float sum = horizontal_sum(vsum);
        for (; t < len; ++t) {
          s[t] = std::exp(s[t] - m_new);
          sum += s[t];
        }
        if (alpha != 1.0f) {
          float* a = w.acc.data() + h * ldacc;
          for (int64_t j = 0; j < ldacc; j += Vec::size()) (Vec::loadu(a + j) * Vec(alpha)).store(a + j);
        }
        w.l[h] = w.l[h] * alpha + sum;
        w.m[h] = m_new;
      }
      for_head_tiles(g, [&](auto nh, int64_t h0) {
        chunk_pv<decltype(nh)::value, KRow>(w.s.data() + h0 * kChunk, v, v_stride, len, Dv,
                                            w.acc.data() + h0 * ldacc, ldacc);
      });
      c0 += len;
    }
  }

  // out row of head n = acc / l rounded once; lse = m + log(l) (-inf when nothing was seen).
  void finish(int64_t b, int64_t n, const float* acc, float m, float l) const {
    const int64_t at = b * p.out.stride_b + p.q_start[b] * p.out.stride_s + n * p.out.stride_n;
    const float inv = l == 0.0f ? 0.0f : 1.0f / l;
    const auto store = [&]<typename O>(O* o) {
      using Pair = VecPair<O>;
      for (int64_t j = 0; j < Dv; j += Pair::kStep) {
        const int64_t cnt = std::min<int64_t>(Pair::kStep, Dv - j);
        const Vec a0 = Vec::loadu(acc + j) * Vec(inv);
        const Vec a1 = Vec::loadu(acc + j + Vec::size()) * Vec(inv);
        Pair::store(o + j, a0, a1, cnt);
      }
    };
    if (d.out_float) {
      store(static_cast<float*>(out_raw_) + at);
    } else {
      store(out_ + at);
    }
    if (d.lse != nullptr) {
      d.lse[p.stat_index(b, n, 0)] = l == 0.0f ? kNegInf : m + std::log(l);
    }
  }

  const In* q_base_ = nullptr;
  const In* qr_base_ = nullptr;
  In* out_ = nullptr;
  void* out_raw_ = nullptr;  // out_, or float32 rows when d.out_float
  float scale_ = 1.0f;
};

template <typename In, typename KvT = In>
void decode_impl(const DecodeProblem& d, void* out) {
  const AttentionProblem& p = *d.p;
  DecodeKernel<In, KvT> kern(d);
  kern.q_base_ = static_cast<const In*>(d.q);
  kern.qr_base_ = static_cast<const In*>(d.q_rope);
  kern.out_ = static_cast<In*>(out);
  kern.out_raw_ = out;
  kern.scale_ = static_cast<float>(p.scale);
  const int64_t g = kern.g;
  const int64_t pairs = p.batch * p.heads_kv;

  // Visible key range per batch (empty when the sequence has no query row).
  std::vector<int64_t> lo(p.batch), hi(p.batch);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    lo[b] = d.visible[b].lo;
    hi[b] = p.q_len[b] == 0 ? lo[b] - 1 : d.visible[b].hi;
    max_keys = std::max(max_keys, hi[b] + 1 - lo[b]);
  }
  // Context splits: enough tasks for every thread (4 per thread), each split >= 512 keys.
  const int64_t threads = at::get_num_threads();
  int64_t splits = 1;
  if (pairs < 4 * threads && max_keys > 1024) {
    splits = std::min<int64_t>((4 * threads + pairs - 1) / pairs, (max_keys + 511) / 512);
  }
  if (splits == 1) {
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      Scratch w;
      kern.prepare(w);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / p.heads_kv, kvh = t % p.heads_kv;
        if (p.q_len[b] == 0) continue;
        kern.load_q(w, b, kvh);
        kern.run(w, b, kvh, lo[b], hi[b] + 1, /*with_sink=*/true);
        for (int64_t h = 0; h < g; ++h) {
          kern.finish(b, kvh * g + h, w.acc.data() + h * kern.ldacc, w.m[h], w.l[h]);
        }
      }
    });
    return;
  }
  // Partials: per (pair, split, head) m, l and acc[ldacc].
  const int64_t rec = kern.ldacc + 2;
  std::vector<float> part(pairs * splits * g * rec);
  at::parallel_for(0, pairs * splits, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    kern.prepare(w);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pair = t / splits, sp = t % splits;
      const int64_t b = pair / p.heads_kv, kvh = pair % p.heads_kv;
      float* dst = part.data() + t * g * rec;
      const int64_t n_keys = std::max<int64_t>(hi[b] + 1 - lo[b], 0);
      const int64_t per = round_up((n_keys + splits - 1) / splits, kChunk);
      const int64_t t0 = lo[b] + std::min(n_keys, sp * per);
      const int64_t t1 = lo[b] + std::min(n_keys, (sp + 1) * per);
      if (p.q_len[b] == 0 || t0 >= t1) {
        for (int64_t h = 0; h < g; ++h) {
          dst[h * rec] = kNegInf;
          dst[h * rec + 1] = 0.0f;
        }
        continue;
      }
      kern.load_q(w, b, kvh);
      kern.run(w, b, kvh, t0, t1, /*with_sink=*/sp == 0);
      for (int64_t h = 0; h < g; ++h) {
        dst[h * rec] = w.m[h];
        dst[h * rec + 1] = w.l[h];
        std::copy(w.acc.data() + h * kern.ldacc, w.acc.data() + (h + 1) * kern.ldacc, dst + h * rec + 2);
      }
    }
  });
  at::parallel_for(0, pairs * g, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kern.ldacc);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t pair = t / g, h = t % g;
      const int64_t b = pair / p.heads_kv, kvh = pair % p.heads_kv;
      if (p.q_len[b] == 0) continue;
      const float* src = part.data() + pair * splits * g * rec + h * rec;
      float m = kNegInf;
      for (int64_t sp = 0; sp < splits; ++sp) m = std::max(m, src[sp * g * rec]);
      std::fill(acc.begin(), acc.end(), 0.0f);
      float l = 0.0f;
      if (m != kNegInf) {
        for (int64_t sp = 0; sp < splits; ++sp) {
          const float* r = src + sp * g * rec;
          if (r[0] == kNegInf) continue;
          const float f = std::exp(r[0] - m);
          l += r[1] * f;
          for (int64_t j = 0; j < kern.ldacc; ++j) acc[j] += r[2 + j] * f;
        }
      }
      kern.finish(b, kvh * g + h, acc.data(), m, l);
    }
  });
}

void infer_decode_kernel(const DecodeProblem& d, at::ScalarType dtype, void* out) {
  if (d.cache.int8) {
    switch (dtype) {
      case at::kBFloat16: return decode_impl<at::BFloat16, int8_t>(d, out);
      case at::kHalf: return decode_impl<at::Half, int8_t>(d, out);
      default: return decode_impl<float, int8_t>(d, out);
    }
  }
  switch (dtype) {
    case at::kBFloat16: return decode_impl<at::BFloat16>(d, out);
    case at::kHalf: return decode_impl<at::Half>(d, out);
    default: return decode_impl<float>(d, out);
  }
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(infer_decode, infer_decode_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::attention
