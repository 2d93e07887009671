// CPU kernels of npu_scaled_masked_softmax (compiled once per ISA; see common/cpu_dispatch.h).
//
// Rows of W elements, one memory pass each. Every row is described by a bound: columns
// [0, bound) follow the mask bytes (or are all unmasked when the row has none), columns
// [bound, W) are all masked. That one shape covers every case cheaply:
//   a mask with a byte per column    bytes, bound = W
//   a mask with one byte per row     no bytes, bound = W (unmasked) or 0 (fully masked)
//   fixed_triu_mask                  no bytes, bound = min(i + 1, W), i = the row's index in dim -2
// The vector passes run over the bound rounded up to whole steps (masking the columns past it by
// their index, so a bound never ends a pass with a partial step; only an odd W does); the rest of
// the row never reads x: its value is the constant exp(-10000 - max) / sum.
//
// Large outputs (16 MB and more, rows of whole cache lines) are written with non-temporal stores,
// and while a row computes, the rows 4 KB ahead are prefetched.
//
// Forward, per row, in acc_t: pass 1 loads x (and the mask bytes), forms s = x * scale or -10000
// into a per-thread row buffer and tracks the max; pass 2 turns the buffer into exp(s - max) and
// sums it; pass 3 scales by 1 / sum and stores y. Only pass 1 reads memory and only pass 3 writes
// it; the buffer (at most W floats) stays in L1/L2.
// Backward, per row: pass 1 accumulates sum(dy * y) over all W columns (masked ones included,
// as autograd through masked_fill does), pass 2 writes dx = scale * y * (dy - sum) with masked
// columns set to 0; pass 2 re-reads dy and y from cache.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "common/stream_store.h"
#include "common/vec.h"
#include "ops/softmax/softmax.h"

namespace opennpu::softmax {
inline namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Sets the lanes of (a, b) whose mask byte is nonzero to `fill`. `m` holds len <= kStep bytes
// (kStep = 2 * Vec::size()); bytes past len are never read.
template <typename T>
inline void mask_fill(const uint8_t* m, int64_t len, Vectorized<T>& a, Vectorized<T>& b,
                      const Vectorized<T>& fill) {
  using Vec = Vectorized<T>;
  constexpr int64_t kSize = Vec::size();
  T buf[2 * kSize];
  T f[kSize];
  fill.store(f);
  a.store(buf);
  b.store(buf + kSize);
  for (int64_t i = 0; i < len; ++i) {
    if (m[i] != 0) buf[i] = f[0];
  }
  a = Vec::loadu(buf);
  b = Vec::loadu(buf + kSize);
}

#if defined(CPU_CAPABILITY_AVX512)
// 32 mask bytes -> a 32-bit lane mask in one test instruction; a masked move per vector.
template <>
inline void mask_fill<float>(const uint8_t* m, int64_t len, Vectorized<float>& a,
                             Vectorized<float>& b, const Vectorized<float>& fill) {
  const __m256i bytes =
      len >= 32 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m))
                : _mm256_maskz_loadu_epi8(static_cast<__mmask32>((uint32_t{1} << len) - 1), m);
  const __mmask32 k = _mm256_test_epi8_mask(bytes, bytes);
  a = _mm512_mask_mov_ps(a, static_cast<__mmask16>(k), fill);
  b = _mm512_mask_mov_ps(b, static_cast<__mmask16>(k >> 16), fill);
}
#elif defined(CPU_CAPABILITY_AVX2)
// 16 mask bytes -> "keep" bytes (0xFF where the byte is 0), sign-extended to 32-bit lanes.
template <>
inline void mask_fill<float>(const uint8_t* m, int64_t len, Vectorized<float>& a,
                             Vectorized<float>& b, const Vectorized<float>& fill) {
  __m128i bytes;
  if (len >= 16) {
    bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m));
  } else {
    alignas(16) uint8_t tail[16] = {};
    std::memcpy(tail, m, static_cast<size_t>(len));
    bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
  }
  const __m128i keep = _mm_cmpeq_epi8(bytes, _mm_setzero_si128());
  const __m256 keep_a = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(keep));
  const __m256 keep_b = _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(keep, 8)));
  a = _mm256_blendv_ps(fill, a, keep_a);
  b = _mm256_blendv_ps(fill, b, keep_b);
}
#endif

// Lanes >= len of (a, b) become `fill` (the partial last step of a row, or the columns past a
// row's bound).
template <typename T>
inline void fill_tail(int64_t len, Vectorized<T>& a, Vectorized<T>& b, const Vectorized<T>& fill) {
  using Vec = Vectorized<T>;
  const Vec idx = Vec::arange(T(0), T(1));
  a = Vec::blendv(fill, a, idx < Vec(static_cast<T>(len)));
  b = Vec::blendv(fill, b, (idx + Vec(static_cast<T>(Vec::size()))) < Vec(static_cast<T>(len)));
}

// One row's mask: columns [0, bound) are masked where bytes[j] != 0 (none when bytes is null),
// columns [bound, W) are all masked.
struct RowMask {
  const uint8_t* bytes;
  int64_t bound;
};

// Walks consecutive rows like an odometer over the (coalesced) leading dims, so the divisions
// that locate a row's mask happen once per parallel chunk.
class MaskCursor {
 public:
  MaskCursor(const MaskLayout& layout, const uint8_t* mask, int64_t w, int64_t first_row)
      : layout_(layout), mask_(mask), w_(w) {
    if (layout.kind == MaskLayout::Kind::kTriu) {
      triu_row_ = first_row % layout.triu_rows;
      return;
    }
    index_.resize(layout.sizes.size());
    int64_t row = first_row;
    for (int64_t d = static_cast<int64_t>(index_.size()) - 1; d >= 0; --d) {
      index_[d] = row % layout.sizes[d];
      row /= layout.sizes[d];
      offset_ += index_[d] * layout.strides[d];
    }
  }

  RowMask row() const {
    if (layout_.kind == MaskLayout::Kind::kTriu) return {nullptr, std::min(triu_row_ + 1, w_)};
    if (layout_.col_stride == 0) return {nullptr, mask_[offset_] != 0 ? 0 : w_};
    return {mask_ + offset_, w_};
  }

  void next() {
    if (layout_.kind == MaskLayout::Kind::kTriu) {
      if (++triu_row_ == layout_.triu_rows) triu_row_ = 0;
      return;
    }
    for (int64_t d = static_cast<int64_t>(index_.size()) - 1; d >= 0; --d) {
      offset_ += layout_.strides[d];
      if (++index_[d] < layout_.sizes[d]) return;
      offset_ -= layout_.strides[d] * layout_.sizes[d];
      index_[d] = 0;
    }
  }

 private:
  const MaskLayout& layout_;
  const uint8_t* mask_;
  int64_t w_;
  std::vector<int64_t> index_;
  int64_t offset_ = 0;
  int64_t triu_row_ = 0;
};

// A per-thread row buffer of at least n acc_t values, 64-byte aligned, padded to whole steps.
template <typename T>
class RowBuffer {
 public:
  explicit RowBuffer(int64_t n) : storage_(static_cast<size_t>(n) + 64 / sizeof(T)) {
    auto p = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = reinterpret_cast<T*>((p + 63) & ~uintptr_t{63});
  }
  T* data() { return data_; }

 private:
  std::vector<T> storage_;
  T* data_;
};

template <typename scalar_t>
int64_t padded_width(int64_t w) {
  constexpr int64_t kStep = VecPair<scalar_t>::kStep;
  return (w + kStep - 1) / kStep * kStep;
}

// Where one row reads and writes. `ahead` points kAheadBytes or more past the row's first input
// (clamped to the last row), and is prefetched while the row computes; `stream` selects
// non-temporal stores for the full steps of the output.
template <typename scalar_t>
struct RowIO {
  const scalar_t* in;   // forward: x; backward: dy
  const scalar_t* in2;  // backward: y
  scalar_t* out;
  int64_t ahead;  // element offset from `in` (and `in2`) of the rows to prefetch
  bool stream;
};

// How far ahead rows are prefetched: whole rows, at least this many bytes.
constexpr int64_t kAheadBytes = 4096;

template <typename scalar_t>
int64_t ahead_rows(int64_t w) {
  const int64_t row_bytes = std::max<int64_t>(w, 1) * static_cast<int64_t>(sizeof(scalar_t));
  return (kAheadBytes + row_bytes - 1) / row_bytes;
}

// The columns the vector passes of a row cover: its bound rounded up to whole steps, within W.
template <typename scalar_t>
int64_t vector_columns(int64_t bound, int64_t w) {
  constexpr int64_t kStep = VecPair<scalar_t>::kStep;
  return std::min((bound + kStep - 1) / kStep * kStep, w);
}

// y[from, w) = value, rounded to scalar_t as the vector stores round; `from` is a whole number of
// steps, and `stream` continues the row's non-temporal stores (a cache line must not be written
// partly by streaming and partly by ordinary stores).
template <typename scalar_t, bool kNative>
void fill_columns(scalar_t* y, int64_t from, int64_t w, acc_t<scalar_t> value, bool stream) {
  using Vec = AccVec<scalar_t>;
  const Vec v(value);
  for_each_step<scalar_t>(w - from, [&](int64_t i, int64_t len) {
    if (stream && len == VecPair<scalar_t>::kStep) {
      stream_step<kNative>(y + from + i, v, v);
    } else {
      store_pair<kNative>(y + from + i, v, v, len);
    }
  });
}

template <typename scalar_t, bool kMaskBytes, bool kNative>
void softmax_fwd_row(const RowIO<scalar_t>& io, RowMask rm, int64_t w, acc_t<scalar_t> scale,
                     acc_t<scalar_t>* buf) {
  using T = acc_t<scalar_t>;
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  constexpr int64_t kStep = IO::kStep;
  constexpr T kFill = static_cast<T>(kMaskFill);
  const T kNegInf = -std::numeric_limits<T>::infinity();
  const scalar_t* x = io.in;
  scalar_t* y = io.out;
  const int64_t bound = rm.bound;
  const int64_t p = vector_columns<scalar_t>(bound, w);

  // Pass 1: s = x * scale (or -10000 where masked) into buf, lanes past p padded with -inf.
  const Vec vscale(scale), vfill(kFill), vneginf(kNegInf);
  Vec mx0(kNegInf), mx1(kNegInf);
  for_each_step<scalar_t>(p, [&](int64_t i, int64_t len) {
    Vec a, b;
    IO::load(x + i, a, b, len);
    a = a * vscale;
    b = b * vscale;
    if constexpr (kMaskBytes) mask_fill<T>(rm.bytes + i, len, a, b, vfill);
    if (i + len > bound) fill_tail<T>(bound - i, a, b, vfill);
    if (len < kStep) fill_tail<T>(len, a, b, vneginf);
    a.store(buf + i);
    b.store(buf + i + Vec::size());
    mx0 = at::vec::maximum(mx0, a);
    mx1 = at::vec::maximum(mx1, b);
  });
  T mx = at::vec::vec_reduce_all<T>(
      [](const Vec& u, const Vec& v) { return at::vec::maximum(u, v); }, at::vec::maximum(mx0, mx1));
  if (bound < w && mx < kFill) mx = kFill;  // the masked suffix; a NaN max stays NaN
  if (!std::isfinite(mx)) {
    // A NaN, +inf, or (with nothing masked) an all -inf row: softmax is NaN throughout, as in
    // torch.softmax (exp_u20 would not propagate the NaN by itself).
    fill_columns<scalar_t, kNative>(y, 0, w, std::numeric_limits<T>::quiet_NaN(), io.stream);
    return;
  }

  // Pass 2: buf = exp(s - max) over whole steps (padding lanes give exp(-inf) = 0), and the sum;
  // the rows ahead stream into the cache meanwhile.
  const Vec vmx(mx);
  Vec s0(0), s1(0);
  const int64_t padded = (p + kStep - 1) / kStep * kStep;
  for (int64_t i = 0; i < padded; i += kStep) {
    prefetch_step<3>(x + io.ahead + i);  // into L1: the next row streams in while this one computes
    const Vec e0 = exp_for<scalar_t>(Vec::loadu(buf + i) - vmx);
    const Vec e1 = exp_for<scalar_t>(Vec::loadu(buf + i + Vec::size()) - vmx);
    e0.store(buf + i);
    e1.store(buf + i + Vec::size());
    s0 = s0 + e0;
    s1 = s1 + e1;
  }
  T sum = horizontal_sum(s0 + s1);
  const T suffix_e = p < w ? std::exp(kFill - mx) : T(0);
  sum += static_cast<T>(w - p) * suffix_e;
  const Vec vinv(T(1) / sum);

  // Pass 3: y = e / sum; the masked suffix is one constant.
  for_each_step<scalar_t>(p, [&](int64_t i, int64_t len) {
    const Vec a = Vec::loadu(buf + i) * vinv;
    const Vec b = Vec::loadu(buf + i + Vec::size()) * vinv;
    if (io.stream && len == kStep) {
      stream_step<kNative>(y + i, a, b);
    } else {
      store_pair<kNative>(y + i, a, b, len);
    }
  });
  if (p < w) fill_columns<scalar_t, kNative>(y, p, w, suffix_e / sum, io.stream);
}

template <typename scalar_t, bool kMaskBytes, bool kNative>
void softmax_bwd_row(const RowIO<scalar_t>& io, RowMask rm, int64_t w, acc_t<scalar_t> scale) {
  using T = acc_t<scalar_t>;
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  constexpr int64_t kStep = IO::kStep;
  const scalar_t* dy = io.in;
  const scalar_t* y = io.in2;
  scalar_t* dx = io.out;
  const int64_t bound = rm.bound;
  const int64_t p = vector_columns<scalar_t>(bound, w);
  if (bound > 0) {
    // Pass 1: sum(dy * y) over the whole row (partial steps load zeros past the end).
    Vec s0(0), s1(0);
    for_each_step<scalar_t>(w, [&](int64_t i, int64_t len) {
      Vec d0, d1, y0, y1;
      IO::load(dy + i, d0, d1, len);
      IO::load(y + i, y0, y1, len);
      s0 = at::vec::fmadd(d0, y0, s0);
      s1 = at::vec::fmadd(d1, y1, s1);
    });
    // Pass 2 (from cache): dx = scale * y * (dy - dot), 0 where masked.
    const Vec vdot(horizontal_sum(s0 + s1)), vscale(scale), zero(0);
    for_each_step<scalar_t>(p, [&](int64_t i, int64_t len) {
      prefetch_step<3>(dy + io.ahead + i);
      prefetch_step<3>(y + io.ahead + i);
      Vec d0, d1, y0, y1;
      IO::load(dy + i, d0, d1, len);
      IO::load(y + i, y0, y1, len);
      Vec g0 = vscale * y0 * (d0 - vdot);
      Vec g1 = vscale * y1 * (d1 - vdot);
      if constexpr (kMaskBytes) mask_fill<T>(rm.bytes + i, len, g0, g1, zero);
      if (i + len > bound) fill_tail<T>(bound - i, g0, g1, zero);
      if (io.stream && len == kStep) {
        stream_step<kNative>(dx + i, g0, g1);
      } else {
        store_pair<kNative>(dx + i, g0, g1, len);
      }
    });
  }
  if (p < w) fill_columns<scalar_t, kNative>(dx, p, w, T(0), io.stream);
}

// Runs row(io, rm) for every row with the I/O pointers of each row, in parallel chunks; each
// chunk gets its own `row = make_row()` (which may own scratch memory).
template <typename scalar_t, typename MakeRow>
void for_each_row(const scalar_t* in, const scalar_t* in2, scalar_t* out, int64_t rows, int64_t w,
                  const uint8_t* mask, const MaskLayout& layout, const MakeRow& make_row) {
  // Streaming needs rows of whole cache lines: every line is then written by streaming stores
  // alone (a partial step at a row's end covers whole lines too).
  const int64_t row_bytes = w * static_cast<int64_t>(sizeof(scalar_t));
  const bool stream =
      row_bytes % kLineBytes == 0 && stream_aligned(out) && stream_output(out, rows * row_bytes);
  const int64_t ahead = ahead_rows<scalar_t>(w);
  at::parallel_for(0, rows, grain_rows(w), [&](int64_t begin, int64_t end) {
    auto row = make_row();
    MaskCursor cursor(layout, mask, w, begin);
    for (int64_t r = begin; r < end; ++r, cursor.next()) {
      const int64_t o = r * w;
      // the rows to prefetch; clamped so the address stays inside the tensor
      const int64_t ahead_offset = (std::min(r + ahead, rows - 1) - r) * w;
      const RowIO<scalar_t> io{in + o, in2 == nullptr ? nullptr : in2 + o, out + o, ahead_offset,
                               stream};
      row(io, cursor.row());
    }
    if (stream) stream_fence();
  });
}

void softmax_fwd_kernel(const at::Tensor& x, const uint8_t* mask, const MaskLayout& layout,
                        double scale, at::Tensor& y) {
  const int64_t w = x.size(-1);
  const int64_t rows = x.numel() / w;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "npu_scaled_masked_softmax", [&] {
        using T = acc_t<scalar_t>;
        const T s = static_cast<T>(scale);
        with_bf16_stores<scalar_t>([&](auto native) {
          constexpr bool kNative = decltype(native)::value;
          for_each_row<scalar_t>(
              x.const_data_ptr<scalar_t>(), nullptr, y.mutable_data_ptr<scalar_t>(), rows, w, mask,
              layout, [&] {
                // the chunk's row buffer, owned by the returned closure
                return [&, buf = std::make_shared<RowBuffer<T>>(padded_width<scalar_t>(w))](
                           const RowIO<scalar_t>& io, RowMask rm) {
                  if (rm.bytes != nullptr) {
                    softmax_fwd_row<scalar_t, true, kNative>(io, rm, w, s, buf->data());
                  } else {
                    softmax_fwd_row<scalar_t, false, kNative>(io, rm, w, s, buf->data());
                  }
                };
              });
        });
      });
}

void softmax_bwd_kernel(const at::Tensor& dy, const at::Tensor& y, const uint8_t* mask,
                        const MaskLayout& layout, double scale, at::Tensor& dx) {
  const int64_t w = y.size(-1);
  const int64_t rows = y.numel() / w;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, y.scalar_type(), "npu_scaled_masked_softmax_backward", [&] {
        using T = acc_t<scalar_t>;
        const T s = static_cast<T>(scale);
        with_bf16_stores<scalar_t>([&](auto native) {
          constexpr bool kNative = decltype(native)::value;
          for_each_row<scalar_t>(
              dy.const_data_ptr<scalar_t>(), y.const_data_ptr<scalar_t>(),
              dx.mutable_data_ptr<scalar_t>(), rows, w, mask, layout, [&] {
                return [&](const RowIO<scalar_t>& io, RowMask rm) {
                  if (rm.bytes != nullptr) {
                    softmax_bwd_row<scalar_t, true, kNative>(io, rm, w, s);
                  } else {
                    softmax_bwd_row<scalar_t, false, kNative>(io, rm, w, s);
                  }
                };
              });
        });
      });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(softmax_fwd, &softmax_fwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(softmax_bwd, &softmax_bwd_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::softmax
