// CPU kernels of npu_rotary_mul (compiled once per ISA; see common/cpu_dispatch.h).
//
// Per row of D elements, in acc_t:
//   half:        y1 = x1*c1 - x2*s1            y2 = x2*c2 + x1*s2        (c = r1, s = r2 rows)
//   interleave:  y = x*c + swap(x)*sign*s      swap exchanges lanes 2i, 2i+1; sign = (-1, +1, ...)
// Backward: dx = c*g + rotate^T(s*g) with rotate^T = -rotate, dr1 += x*g, dr2 += rotate(x)*g,
// summed over the rows that share one r row (the broadcast dims), each r row owned by one thread.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <vector>
#include <limits>
#include <type_traits>

#include "common/stream_store.h"
#include "common/vec.h"
#include "ops/norm/norm_rows.h"
#include "ops/rotary/rotary.h"

namespace opennpu::rotary {
inline namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Exchanges neighbouring lanes (2i <-> 2i+1): one in-register permute on AVX2/AVX-512.
template <typename T>
inline Vectorized<T> swap_pairs(const Vectorized<T>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) return _mm512_permute_ps(v, 0xB1);
  if constexpr (std::is_same_v<T, double>) return _mm512_permute_pd(v, 0x55);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) return _mm256_permute_ps(v, 0xB1);
  if constexpr (std::is_same_v<T, double>) return _mm256_permute_pd(v, 0x5);
#endif
  std::array<T, Vectorized<T>::size()> a;
  v.store(a.data());
  for (size_t i = 0; i + 1 < a.size(); i += 2) std::swap(a[i], a[i + 1]);
  return Vectorized<T>::loadu(a.data());
}

// (-1, +1, -1, +1, ...): rotate(x) = swap_pairs(x) * kSign for the interleave mode.
template <typename Vec>
inline Vec alternating_sign() {
  using T = typename Vec::value_type;
  std::array<T, Vec::size()> a;
  for (size_t i = 0; i < a.size(); ++i) a[i] = (i % 2 == 0) ? T(-1) : T(1);
  return Vec::loadu(a.data());
}

// Element offset of row `row` for a tensor with the given leading-dim strides.
inline int64_t row_offset(int64_t row, const std::vector<int64_t>& sizes,
                          const std::vector<int64_t>& strides) {
  int64_t offset = 0;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    const int64_t i = row % sizes[d];
    row /= sizes[d];
    offset += i * strides[d];
  }
  return offset;
}

// Walks consecutive rows of x, r1 and r2 like an odometer: the divisions of row_offset happen once
// per parallel chunk instead of once per row (they cost as much as a 128-element row).
class RowCursor {
 public:
  RowCursor(const RowLayout& layout, int64_t first_row) : layout_(layout) {
    const auto nd = layout.sizes.size();
    index_.resize(nd);
    int64_t row = first_row;
    for (int64_t d = static_cast<int64_t>(nd) - 1; d >= 0; --d) {
      index_[d] = row % layout.sizes[d];
      row /= layout.sizes[d];
    }
    x = row_offset(first_row, layout.sizes, layout.x_strides);
    r1 = row_offset(first_row, layout.sizes, layout.r1_strides);
    r2 = row_offset(first_row, layout.sizes, layout.r2_strides);
  }

  void next() {
    for (int64_t d = static_cast<int64_t>(index_.size()) - 1; d >= 0; --d) {
      x += layout_.x_strides[d];
      r1 += layout_.r1_strides[d];
      r2 += layout_.r2_strides[d];
      if (++index_[d] < layout_.sizes[d]) return;
      x -= layout_.x_strides[d] * layout_.sizes[d];
      r1 -= layout_.r1_strides[d] * layout_.sizes[d];
      r2 -= layout_.r2_strides[d] * layout_.sizes[d];
      index_[d] = 0;
    }
  }

  int64_t x = 0, r1 = 0, r2 = 0;  // current row starts, in elements

 private:
  const RowLayout& layout_;
  std::vector<int64_t> index_;
};

// stream: y's full steps are written with streaming stores (the caller checked that each half
// row starts on a cache line, so every other step covers whole lines by itself).
template <typename scalar_t, typename r_t>
void rotary_row(const scalar_t* x, const r_t* c, const r_t* s, scalar_t* y, int64_t D, Mode mode,
                bool stream = false) {
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  using RIO = VecPair<r_t>;
  const int64_t h = D / 2;
  const auto store = [stream](scalar_t* p, const Vec& a, const Vec& b, int64_t l) {
    store_output(p, a, b, l, stream && l == IO::kStep);
  };
  // Rotate-half of output lanes [k, k + l) of both halves, given the first-half inputs (a) and
  // the second-half inputs (b): y1 = a*c1 - b*s1, y2 = b*c2 + a*s2.
  const auto half_step = [&](int64_t k, int64_t l, const Vec& a0, const Vec& a1, const Vec& b0,
                             const Vec& b1) {
    Vec c10, c11, c20, c21, s10, s11, s20, s21;
    RIO::load(c + k, c10, c11, l);
    RIO::load(c + h + k, c20, c21, l);
    RIO::load(s + k, s10, s11, l);
    RIO::load(s + h + k, s20, s21, l);
    store(y + k, a0 * c10 - b0 * s10, a1 * c11 - b1 * s11, l);
    store(y + h + k, at::vec::fmadd(a0, s20, b0 * c20), at::vec::fmadd(a1, s21, b1 * c21), l);
  };
  if (mode == Mode::kHalf) {
    for_each_step<scalar_t>(h, [&](int64_t k, int64_t l) {
      Vec a0, a1, b0, b1;
      IO::load(x + k, a0, a1, l);
      IO::load(x + h + k, b0, b1, l);
      half_step(k, l, a0, a1, b0, b1);
    });
  } else if (mode == Mode::kDeinterleave) {
    // Output lane k < h takes the pair (x[2k], x[2k+1]) as (a, b). One step reads 2 * kStep
    // elements of x and splits evens from odds.
    constexpr int64_t kStep = IO::kStep;
    for_each_step<scalar_t>(h, [&](int64_t k, int64_t l) {
      Vec q0, q1, q2(0), q3(0);
      const int64_t n = 2 * l;
      IO::load(x + 2 * k, q0, q1, std::min(n, kStep));
      if (n > kStep) IO::load(x + 2 * k + kStep, q2, q3, n - kStep);
      const auto [e0, o0] = at::vec::deinterleave2(q0, q1);
      const auto [e1, o1] = at::vec::deinterleave2(q2, q3);
      half_step(k, l, e0, e1, o0, o1);
    });
  } else {
    const Vec sign = alternating_sign<Vec>();
    for_each_step<scalar_t>(D, [&](int64_t k, int64_t l) {
      Vec a0, a1, c0, c1, s0, s1;
      IO::load(x + k, a0, a1, l);
      RIO::load(c + k, c0, c1, l);
      RIO::load(s + k, s0, s1, l);
      store(y + k, at::vec::fmadd(swap_pairs(a0) * sign, s0, a0 * c0),
            at::vec::fmadd(swap_pairs(a1) * sign, s1, a1 * c1), l);
    });
  }
}

template <typename scalar_t, typename r_t>
void rotary_fwd_impl(const at::Tensor& x, const at::Tensor& r1, const at::Tensor& r2,
                     const RowLayout& layout, Mode mode, at::Tensor& out) {
  const int64_t D = x.size(-1);
  const int64_t rows = out.numel() / D;
  const scalar_t* px = x.const_data_ptr<scalar_t>();
  const r_t* pc = r1.const_data_ptr<r_t>();
  const r_t* ps = r2.const_data_ptr<r_t>();
  scalar_t* py = out.mutable_data_ptr<scalar_t>();
  // Outputs larger than the last-level cache are streamed (common/stream_store.h) where every
  // half row starts on a cache line: the steps of a row then cover whole lines, the full ones
  // streamed and a shorter last one stored normally.
  const bool stream = (D / 2) * static_cast<int64_t>(sizeof(scalar_t)) % kLineBytes == 0 &&
                      D % 2 == 0 && stream_aligned(py) && stream_output(py, out.nbytes());
  const int64_t L = static_cast<int64_t>(layout.sizes.size());
  if (L >= 2 && layout.sizes[L - 2] > 1 && layout.sizes[L - 1] > 1 &&
      layout.x_strides[L - 2] < layout.x_strides[L - 1]) {
    // x's last two leading dims are transposed in memory (a BNSD view of BSND memory: output
    // rows N * D apart in x). Visited in output order, x was read 20-35% slower than a
    // contiguous x; in tiles of kTile positions x is read in memory order (all heads of a
    // position, which share its cos / sin row) and each head's kTile output rows are adjacent.
    constexpr int64_t kTile = 16;
    const int64_t N = layout.sizes[L - 2], S = layout.sizes[L - 1];
    const int64_t tiles = (S + kTile - 1) / kTile;
    const std::vector<int64_t> outer(layout.sizes.begin(), layout.sizes.end() - 2);
    const auto outer_strides = [&](const std::vector<int64_t>& st) {
      return std::vector<int64_t>(st.begin(), st.end() - 2);
    };
    const auto ox = outer_strides(layout.x_strides), o1 = outer_strides(layout.r1_strides),
               o2 = outer_strides(layout.r2_strides);
    const int64_t xn = layout.x_strides[L - 2], xs = layout.x_strides[L - 1];
    const int64_t c_n = layout.r1_strides[L - 2], c_s = layout.r1_strides[L - 1];
    const int64_t s_n = layout.r2_strides[L - 2], s_s = layout.r2_strides[L - 1];
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / (kTile * N * D));
    at::parallel_for(0, rows / (N * S) * tiles, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t o = t / tiles, s0 = (t % tiles) * kTile, s1 = std::min(S, s0 + kTile);
        const scalar_t* x0 = px + row_offset(o, outer, ox);
        const r_t* c0 = pc + row_offset(o, outer, o1);
        const r_t* sn0 = ps + row_offset(o, outer, o2);
        for (int64_t i = s0; i < s1; ++i) {
          for (int64_t n = 0; n < N; ++n) {
            rotary_row<scalar_t, r_t>(x0 + n * xn + i * xs, c0 + n * c_n + i * c_s,
                                      sn0 + n * s_n + i * s_s, py + ((o * N + n) * S + i) * D, D,
                                      mode, stream);
          }
        }
      }
      if (stream) stream_fence();
    });
    return;
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / D);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    RowCursor row(layout, begin);
    for (int64_t r = begin; r < end; ++r, row.next()) {
      rotary_row<scalar_t, r_t>(px + row.x, pc + row.r1, ps + row.r2, py + r * D, D, mode,
                                stream);
    }
    if (stream) stream_fence();
  });
}

// One row of the backward: writes dx and accumulates into the r row's dr1/dr2 (acc_t).
template <typename scalar_t, typename r_t>
void rotary_bwd_row(const scalar_t* g, const scalar_t* x, const r_t* c, const r_t* s,
                    scalar_t* dx, acc_t<scalar_t>* dc, acc_t<scalar_t>* ds, int64_t D, Mode mode) {
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  using RIO = VecPair<r_t>;
  using AIO = VecPair<acc_t<scalar_t>>;
  if (mode == Mode::kHalf) {
    const int64_t h = D / 2;
    for_each_step<scalar_t>(h, [&](int64_t k, int64_t l) {
      Vec g10, g11, g20, g21, a0, a1, b0, b1, c10, c11, c20, c21, s10, s11, s20, s21;
      IO::load(g + k, g10, g11, l);
      IO::load(g + h + k, g20, g21, l);
      IO::load(x + k, a0, a1, l);
      IO::load(x + h + k, b0, b1, l);
      RIO::load(c + k, c10, c11, l);
      RIO::load(c + h + k, c20, c21, l);
      RIO::load(s + k, s10, s11, l);
      RIO::load(s + h + k, s20, s21, l);
      // dx1 = c1*g1 + s2*g2,  dx2 = c2*g2 - s1*g1
      IO::store(dx + k, at::vec::fmadd(s20, g20, c10 * g10), at::vec::fmadd(s21, g21, c11 * g11), l);
      IO::store(dx + h + k, c20 * g20 - s10 * g10, c21 * g21 - s11 * g11, l);
      Vec p0, p1;
      // dr1 += x*g;  dr2 += rotate(x)*g = (-x2*g1 | x1*g2)
      AIO::load(dc + k, p0, p1, l);
      AIO::store(dc + k, at::vec::fmadd(a0, g10, p0), at::vec::fmadd(a1, g11, p1), l);
      AIO::load(dc + h + k, p0, p1, l);
      AIO::store(dc + h + k, at::vec::fmadd(b0, g20, p0), at::vec::fmadd(b1, g21, p1), l);
      AIO::load(ds + k, p0, p1, l);
      AIO::store(ds + k, p0 - b0 * g10, p1 - b1 * g11, l);
      AIO::load(ds + h + k, p0, p1, l);
      AIO::store(ds + h + k, at::vec::fmadd(a0, g20, p0), at::vec::fmadd(a1, g21, p1), l);
    });
  } else {
    const Vec sign = alternating_sign<Vec>();
    for_each_step<scalar_t>(D, [&](int64_t k, int64_t l) {
      Vec g0, g1, a0, a1, c0, c1, s0, s1, p0, p1;
      IO::load(g + k, g0, g1, l);
      IO::load(x + k, a0, a1, l);
      RIO::load(c + k, c0, c1, l);
      RIO::load(s + k, s0, s1, l);
      // dx = c*g - rotate(s*g)
      IO::store(dx + k, c0 * g0 - swap_pairs(s0 * g0) * sign, c1 * g1 - swap_pairs(s1 * g1) * sign, l);
      AIO::load(dc + k, p0, p1, l);
      AIO::store(dc + k, at::vec::fmadd(a0, g0, p0), at::vec::fmadd(a1, g1, p1), l);
      AIO::load(ds + k, p0, p1, l);
      AIO::store(ds + k, at::vec::fmadd(swap_pairs(a0) * sign, g0, p0),
                 at::vec::fmadd(swap_pairs(a1) * sign, g1, p1), l);
    });
  }
}

template <typename scalar_t, typename r_t>
void rotary_bwd_impl(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& r1,
                     const at::Tensor& r2, Mode mode, at::Tensor& dx, at::Tensor& dr1,
                     at::Tensor& dr2) {
  using T = acc_t<scalar_t>;
  const int64_t nd = x.dim();
  const int64_t D = x.size(-1);
  // Split the leading dims: "kept" dims index r rows, "broadcast" dims (r size 1) are summed over.
  std::vector<int64_t> kept_sizes, kept_x_strides, bcast_sizes, bcast_x_strides;
  int64_t stride = D;
  std::vector<int64_t> x_strides(nd - 1);
  for (int64_t d = nd - 2; d >= 0; --d) {
    x_strides[d] = stride;
    stride *= x.size(d);
  }
  for (int64_t d = 0; d < nd - 1; ++d) {
    if (r1.size(d) == x.size(d)) {
      kept_sizes.push_back(x.size(d));
      kept_x_strides.push_back(x_strides[d]);
    } else {
      bcast_sizes.push_back(x.size(d));
      bcast_x_strides.push_back(x_strides[d]);
    }
  }
  int64_t inner = 1;
  for (auto s : bcast_sizes) inner *= s;
  const int64_t r_rows = r1.numel() / D;
  const scalar_t* pg = grad.const_data_ptr<scalar_t>();
  const scalar_t* px = x.const_data_ptr<scalar_t>();
  const r_t* pc = r1.const_data_ptr<r_t>();
  const r_t* ps = r2.const_data_ptr<r_t>();
  scalar_t* pdx = dx.mutable_data_ptr<scalar_t>();
  T* pdc = dr1.mutable_data_ptr<T>();
  T* pds = dr2.mutable_data_ptr<T>();
  // Visit order. When the broadcast dims are inner in memory (BSND with 1S1D cos/sin: the heads
  // of one position are adjacent), one r row's x rows are contiguous: walk r rows, then heads.
  // When they are outer (BNSD with 11SD), walking heads per r row would jump a whole [S, D]
  // plane per row; instead take r rows in blocks whose dr1/dr2 rows stay in L2 and sweep each
  // head's contiguous run of the block.
  auto min_stride = [](const std::vector<int64_t>& strides) {
    int64_t m = std::numeric_limits<int64_t>::max();
    for (auto s : strides) m = std::min(m, s);
    return m;
  };
  const bool bcast_outer = min_stride(bcast_x_strides) > min_stride(kept_x_strides);
  const int64_t block = bcast_outer ? 64 : 1;
  const int64_t grain = std::max<int64_t>(block, (int64_t{1} << 14) / (D * inner));
  at::parallel_for(0, r_rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> kept_offset(block);
    for (int64_t q0 = begin; q0 < end; q0 += block) {
      const int64_t q1 = std::min(end, q0 + block);
      for (int64_t q = q0; q < q1; ++q) {
        kept_offset[q - q0] = row_offset(q, kept_sizes, kept_x_strides);
      }
      for (int64_t b = 0; b < inner; ++b) {
        const int64_t head = row_offset(b, bcast_sizes, bcast_x_strides);
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t off = kept_offset[q - q0] + head;
          rotary_bwd_row<scalar_t, r_t>(pg + off, px + off, pc + q * D, ps + q * D, pdx + off,
                                        pdc + q * D, pds + q * D, D, mode);
        }
      }
    }
  });
}

// Rounds n acc_t values to int8 codes round_half_even(v * scale) clamped to [-128, 127].
template <typename T>
void quantize_row(const T* v, const T* scale, int8_t* q, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec lo(T(-128)), hi(T(127));
  T buf[W];
  for (int64_t i = 0; i < n; i += W) {
    const int64_t l = std::min<int64_t>(W, n - i);
    const Vec y = at::vec::clamp((Vec::loadu(v + i, l) * Vec::loadu(scale + i, l)).round(), lo, hi);
    y.store(buf, l);
    for (int64_t j = 0; j < l; ++j) q[i + j] = static_cast<int8_t>(buf[j]);
  }
}

// Converts n acc_t values to scalar_t (rounded once).
template <typename scalar_t>
void round_row(const acc_t<scalar_t>* v, scalar_t* y, int64_t n) {
  using IO = VecPair<acc_t<scalar_t>>;
  for_each_step<scalar_t>(n, [&](int64_t i, int64_t l) {
    AccVec<scalar_t> a, b;
    IO::load(v + i, a, b, l);
    VecPair<scalar_t>::store(y + i, a, b, l);
  });
}

template <typename scalar_t>
void kv_rope_rows_impl(const KvRopeRows& p) {
  using T = acc_t<scalar_t>;
  const auto* kv = static_cast<const scalar_t*>(p.kv);
  const auto* v = static_cast<const scalar_t*>(p.v);
  const auto* cs = static_cast<const scalar_t*>(p.cos);
  const auto* sn = static_cast<const scalar_t*>(p.sin);
  const auto* gamma = static_cast<const T*>(p.gamma);
  auto* k_out = static_cast<scalar_t*>(p.k_out);
  auto* c_out = static_cast<scalar_t*>(p.c_out);
  const T eps = static_cast<T>(p.eps);
  const int64_t D_kv = p.v ? p.Wk : p.Dc + p.Dr;
  at::parallel_for(0, p.T, grain_rows(D_kv + p.Wc), [&](int64_t begin, int64_t end) {
    // Per-thread fp32 rows: the normalised row (y), the rope input and output, v.
    std::vector<T> y(std::max(p.Dc, D_kv)), rin(p.Dr), k(p.Wk), c(p.Wc);
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* row = kv + t * p.kv_stride;
      const auto to_acc = [](T* dst) {
        return [dst](int64_t i, const AccVec<scalar_t>& a, const AccVec<scalar_t>& b, int64_t l) {
          VecPair<T>::store(dst + i, a, b, l);
        };
      };
      if (v == nullptr) {
        opennpu::norm::rms_norm_row_to<scalar_t>(row, gamma, p.Dc, eps, to_acc(c.data()));
        for_each_step<scalar_t>(p.Dr, [&](int64_t i, int64_t l) {
          AccVec<scalar_t> a, b;
          VecPair<scalar_t>::load(row + p.Dc + i, a, b, l);
          VecPair<T>::store(rin.data() + i, a, b, l);
        });
        rotary_row<T, scalar_t>(rin.data(), cs + p.cos_off[t], sn + p.sin_off[t], k.data(), p.Dr,
                                Mode::kDeinterleave);
      } else {
        opennpu::norm::rms_norm_row_to<scalar_t>(row, gamma, D_kv, eps, to_acc(y.data()));
        rotary_row<T, scalar_t>(y.data(), cs + p.cos_off[t], sn + p.sin_off[t], k.data(), p.Dr,
                                Mode::kDeinterleave);
        std::copy(y.begin() + p.Dr, y.begin() + D_kv, k.begin() + p.Dr);
        for_each_step<scalar_t>(p.Wc, [&](int64_t i, int64_t l) {
          AccVec<scalar_t> a, b;
          VecPair<scalar_t>::load(v + t * p.v_stride + i, a, b, l);
          VecPair<T>::store(c.data() + i, a, b, l);
        });
      }
      round_row<scalar_t>(k.data(), k_out + t * p.Wk, p.Wk);
      round_row<scalar_t>(c.data(), c_out + t * p.Wc, p.Wc);
      if (p.k_scale) {
        quantize_row<T>(k.data(), static_cast<const T*>(p.k_scale),
                        static_cast<int8_t*>(p.k_stage) + t * p.Wk, p.Wk);
      }
      if (p.c_scale) {
        quantize_row<T>(c.data(), static_cast<const T*>(p.c_scale),
                        static_cast<int8_t*>(p.c_stage) + t * p.Wc, p.Wc);
      }
    }
  });
}

void kv_rope_rows_kernel(const KvRopeRows& p) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, p.dtype, "npu_kv_rmsnorm_rope_cache",
                                  [&] { kv_rope_rows_impl<scalar_t>(p); });
}

void rotary_fwd_kernel(const at::Tensor& x, const at::Tensor& r1, const at::Tensor& r2,
                       const RowLayout& layout, Mode mode, at::Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "npu_rotary_mul", [&] {
    if (r1.scalar_type() == x.scalar_type()) {
      rotary_fwd_impl<scalar_t, scalar_t>(x, r1, r2, layout, mode, out);
    } else {
      rotary_fwd_impl<scalar_t, acc_t<scalar_t>>(x, r1, r2, layout, mode, out);
    }
  });
}

void rotary_bwd_kernel(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& r1,
                       const at::Tensor& r2, Mode mode, at::Tensor& dx, at::Tensor& dr1,
                       at::Tensor& dr2) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "npu_rotary_mul_backward", [&] {
        if (r1.scalar_type() == x.scalar_type()) {
          rotary_bwd_impl<scalar_t, scalar_t>(grad, x, r1, r2, mode, dx, dr1, dr2);
        } else {
          rotary_bwd_impl<scalar_t, acc_t<scalar_t>>(grad, x, r1, r2, mode, dx, dr1, dr2);
        }
      });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(rotary_fwd, &rotary_fwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(rotary_bwd, &rotary_bwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(kv_rope_rows, &kv_rope_rows_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::rotary
