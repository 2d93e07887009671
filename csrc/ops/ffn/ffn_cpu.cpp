// CPU kernel of npu_ffn (compiled once per ISA; see common/cpu_dispatch.h and ffn.h).
//
// Every GEMM is a library call: on a tile, MKL's sgemm / half-precision GEMMs through
// common/blas.h, and ATen's at::_int_mm (oneDNN's int8 matmul) for the quantised path; what
// happens between the GEMMs (bias, dequantisation, activation, requantisation, rounding) runs
// vectorised on each thread's tile while it is still in cache. Or (FfnGemm::kATen, below)
// whole GEMMs through ATen with one vectorised activation pass over the intermediate.
//
// Numerics: float paths accumulate in fp32 and compute bias and activation in fp32; for fp16 /
// bf16 the intermediate is rounded once to x's dtype (the operand of the second GEMM, as on
// Ascend's cube unit, and as the native composition rounds it), then the output once. The
// weight-only and quantised paths round where op-plugin's golden (test_npu_ffn) does: see
// weight_tile(), dequant() and epilogue_a(). Where the
// CPU has no fp16 / bf16 matrix instructions, tiles are converted to fp32 instead, with the same
// rounding of the intermediate (and of dequantised weights), so results do not depend on the
// machine beyond GEMM summation order. The kATen path rounds the first GEMM (+ bias1) to x's
// dtype before the activation, as the native composition does (its error then equals native's
// GEMM rounding, not less): oneDNN, through ATen, gives no fp32 output for fp16 operands.
#include <ATen/Parallel.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "common/blas.h"
#include "common/half_gemm.h"
#include "common/vec.h"
#include "ops/activation/act_math.h"
#include "ops/ffn/ffn.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace opennpu::ffn {
inline namespace CPU_CAPABILITY {
namespace {

using activation::Act;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();

// Rows of a block: the intermediate of a block (kRowBlock x K2) stays in the last-level cache,
// and each weight element fetched for a tile is used for kRowBlock rows.
constexpr int64_t kRowBlock = 256;
// Columns of a tile: kRowBlock x kColTile fp32 is 1 MB, inside L2; BLAS packs the block of x
// once per tile, i.e. once per 2 * kColTile flops of each of its elements. (Measured on the
// development machine at T=128 and 1024, H=4096, I=11008: 1024 columns ran within 2-4% of the
// two GEMMs alone, 512 columns 5-12% slower, rows 256 or 512 alike.)
constexpr int64_t kColTile = 1024;
// Rows per chunk of the quantised path's whole GEMMs (Runner::run_whole). Each chunk re-packs
// the weights inside oneDNN, so chunks are large; the int32 results of a chunk, [4096, N]
// (235 MB at N = 14336, as large as the GEMM's own output), are the working set between GEMM
// and epilogue. Measured on the AMX machine, 2 threads: T=4096 1.10-1.14x the GEMMs alone
// with 4096-row chunks, 1.26-1.30x with 1024; at T=1024, 512-row chunks 1.2x against 1024's
// 1.02-1.13x, 340-row 2.3x (oneDNN's int8 kernels slow down sharply at some row counts).
// Re-measured with at::_int_mm alone (H=4096, I=11008, 2 threads), per 1024 rows against one
// 1024-row call: 512-row calls 1.05-1.10x, 256-row 1.5x, 128-row 1.8-2.4x. Chunks small
// enough for their int32 results to stay in cache would cost more than the whole int32 pass
// over uncached results (5-7% of the GEMMs at T=1024).
constexpr int64_t kWholeRows = 4096;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// Width of the column tiles of an n-column operand: about `target`, and a multiple of the
// thread count of tiles (so every thread gets as many), 16-column aligned.
int64_t tile_width(int64_t n, int64_t target) {
  if (n <= 16) return std::max<int64_t>(n, 1);
  const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
  int64_t tiles = round_up(ceil_div(n, target), threads);
  tiles = std::min(tiles, ceil_div(n, 16));
  return std::min(n, round_up(ceil_div(n, tiles), 16));
}

// v rounded to T's precision (identity for float).
template <typename T>
inline Vec round_to(const Vec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const auto reduced = at::vec::convert_from_float<T>(v, v);
    return std::get<0>(at::vec::convert_to_float<T>(reduced));
  }
}

// Stores / loads n <= kV elements of G from / to a float vector.
template <typename G>
inline void store_as(G* dst, const Vec& v, int64_t n) {
  if constexpr (std::is_same_v<G, float>) {
    v.store(dst, n);
  } else {
    at::vec::convert_from_float<G>(v, v).store(dst, n);
  }
}

template <typename G>
inline Vec load_from(const G* src, int64_t n) {
  if constexpr (std::is_same_v<G, float>) {
    return Vec::loadu(src, n);
  } else {
    if (n == kV) {  // the full-width load (loadu with a count goes through a buffer)
      Vec v;
      at::vec::load_to_float<G>(src, v);
      return v;
    }
    const auto reduced = at::vec::Vectorized<G>::loadu(src, n);
    return std::get<0>(at::vec::convert_to_float<G>(reduced));
  }
}

// How far ahead of the current element the passes over whole GEMM results (kATen) prefetch
// them: the results are far larger than L2, and the hardware prefetchers stop at each 4 KB
// page, which the epilogues' rows of 1024 int32 span exactly (measured on the epilogue alone,
// one thread: 1.0-1.1 -> 0.80-0.85 ns an element).
constexpr int64_t kPrefetchAhead = 256;

inline Vec load_int32(const int32_t* src, int64_t n) {
  return at::vec::convert_to_fp_of_same_size<float>(at::vec::Vectorized<int32_t>::loadu(src, n));
}

// Calls body(j, n) over [0, len) in vector steps (n < kV for the tail).
template <typename Body>
inline void for_each_vec(int64_t len, const Body& body) {
  int64_t j = 0;
  for (; j + kV <= len; j += kV) body(j, kV);
  if (j < len) body(j, len - j);
}

// act(z); P picks the exp (fp32 outputs: ATen's 1-ulp exp; fp16 / bf16: the 20-ulp polynomial).
template <FfnAct kA, typename P>
C10_ALWAYS_INLINE Vec act(const Vec& z) {
  if constexpr (kA == FfnAct::kRelu || kA == FfnAct::kReglu) {
    return at::vec::maximum(z, Vec(0.f));
  } else if constexpr (kA == FfnAct::kFastGelu) {
    return activation::act_value<Act::kFastGelu, P>(z);
  } else if constexpr (kA == FfnAct::kGelu || kA == FfnAct::kGeglu) {
    return activation::act_value<Act::kGeluTanh, P>(z);
  } else {
    return activation::act_value<Act::kSilu, P>(z);
  }
}

void int8_to_float(const int8_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  for (; i + 16 <= n; i += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm512_storeu_ps(dst + i, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Stores n <= kV floats that are already integers in [-128, 127] as int8.
C10_ALWAYS_INLINE void store_int8(int8_t* dst, const Vec& q, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q));
  if (n == kV) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), b);
    return;
  }
  _mm_mask_storeu_epi8(dst, static_cast<__mmask16>((1u << n) - 1), b);
#else
  alignas(64) float tmp[kV];
  q.store(tmp, n);
  for (int64_t l = 0; l < n; ++l) dst[l] = static_cast<int8_t>(tmp[l]);
#endif
}

// C[m, n] (contiguous) = A[m, k] B[k, n]: BLAS for float / fp16 / bf16 operands (fp32 C),
// at::_int_mm for int8 (int32 C).
template <typename G, typename Acc>
void tile_gemm(int64_t m, int64_t n, int64_t k, const G* a, int64_t lda, const G* b, int64_t ldb,
               Acc* c) {
  if constexpr (std::is_same_v<G, int8_t>) {
    if (k == 0) {
      std::fill(c, c + m * n, Acc(0));
      return;
    }
    const auto i8 = at::TensorOptions().dtype(at::kChar);
    at::Tensor out = at::from_blob(c, {m, n}, at::TensorOptions().dtype(at::kInt));
    at::_int_mm_out(out, at::from_blob(const_cast<int8_t*>(a), {m, k}, {lda, 1}, i8),
                    at::from_blob(const_cast<int8_t*>(b), {k, n}, {ldb, 1}, i8));
  } else {
    blas::gemm<G, float>(false, false, m, n, k, 1.f, a, lda, b, ldb, 0.f, c, n);
  }
}

// Tasks [begin, end) of a grid of rows x `chunks` column chunks (kColTile wide; n columns in a
// row) as at most three rectangles f(i0, i1, c0, nc): rows [i0, i1), columns [c0, c0 + nc).
// The epilogues' parallel passes split such a grid (so that a few long rows still spread over
// the threads) but are called once per rectangle, not once per 1024-column task (measured,
// int8, T=1024, one thread: epilogue A 8.1 -> 7.9 ms, B 1.5 -> 1.2 ms).
template <typename F>
void for_each_block(int64_t begin, int64_t end, int64_t chunks, int64_t n, const F& f) {
  int64_t t = begin;
  if (t < end && t % chunks != 0) {  // the end of a row
    const int64_t i = t / chunks, stop = std::min(end, (i + 1) * chunks);
    const int64_t c0 = (t % chunks) * kColTile;
    f(i, i + 1, c0, std::min((stop - i * chunks) * kColTile, n) - c0);
    t = stop;
  }
  if (t / chunks < end / chunks) {  // whole rows
    f(t / chunks, end / chunks, 0, n);
    t = end / chunks * chunks;
  }
  if (t < end) f(t / chunks, t / chunks + 1, 0, std::min((end - t) * kColTile, n));
}

// X: x's dtype; W: the weights'; G: the GEMM operands'; O: the output's.
template <typename X, typename W, typename G, typename O>
class Runner {
  static constexpr bool kQuant = std::is_same_v<X, int8_t>;
  static constexpr bool kWeightOnly = !kQuant && std::is_same_v<W, int8_t>;
  static constexpr bool kConvertX = !std::is_same_v<X, G>;
  static constexpr bool kConvertW = !std::is_same_v<W, G>;
  // The precision the intermediate is rounded to and the exp it uses; the quantised path
  // rounds to int8, with an exact fp32 activation so that ties fall where the reference's do;
  // the weight-only path keeps the intermediate in fp32 (op-plugin's golden: both GEMMs and the
  // activation in float32, only the output rounded).
  using P = std::conditional_t<kQuant || kWeightOnly, float, X>;
  using Acc = std::conditional_t<std::is_same_v<G, int8_t>, int32_t, float>;

  struct Scratch {
    blas::TileBuffer<Acc> acc;
    blas::TileBuffer<G> w;  // converted / dequantised weight tiles
    blas::TileBuffer<float> row;
  };

 public:
  explicit Runner(const FfnArgs& a)
      : a_(a),
        k1_(a.x.size(1)),
        n1_(a.w1.size(2)),
        k2_(a.w2.size(1)),
        n2_(a.w2.size(2)),
        glu_(is_glu(a.act)),
        wa_(tile_width(k2_, glu_ ? kColTile / 2 : kColTile)),
        wb_(tile_width(n2_, kColTile)) {}

  // Whole GEMMs (FfnGemm::kATen; the quantised path): per expert, rows in chunks of at most
  // kWholeRows, GEMM 1 over all columns by ONE multi-threaded library call (at::_int_mm)
  // into an accumulator buffer, epilogue A over it on all threads, GEMM 2 likewise, epilogue B
  // into the output. Measured against the tiles (on an AMX machine, T=1024, H=4096, I=11008):
  // per-thread tiles call oneDNN single-threaded, once per 256-row block and column tile, and
  // it re-packs each weight tile every time; one call per chunk packs once per chunk. The
  // accumulator chunk is written once and read once, in cache-sized pieces per thread.
  // (Column slabs of these calls, to keep the int32 results in cache, measured 1.5x slower:
  // oneDNN runs strided weight slices far below its whole-width speed.)
  void run_whole() {
    static_assert(!kConvertX && !kConvertW, "whole GEMMs multiply x and the weights as they are");
    const int64_t experts = a_.w1.size(0);
    const int64_t chunk = kWholeRows;
    int64_t mb_max = 0;
    for (int64_t e = 0; e < experts; ++e) {
      mb_max = std::max(mb_max, std::min(chunk, a_.offsets[e + 1] - a_.offsets[e]));
    }
    if (mb_max == 0 || n2_ == 0) return;
    h_ = blas::TileBuffer<G>(mb_max * k2_);
    const blas::TileBuffer<Acc> acc(mb_max * std::max(n1_, n2_));
    const int64_t chunks_a = ceil_div(k2_, kColTile), chunks_b = ceil_div(n2_, kColTile);
    for (int64_t e = 0; e < experts; ++e) {
      const W* w1 = a_.w1.template const_data_ptr<W>() + e * k1_ * n1_;
      const W* w2 = a_.w2.template const_data_ptr<W>() + e * k2_ * n2_;
      for (int64_t r0 = a_.offsets[e]; r0 < a_.offsets[e + 1]; r0 += chunk) {
        const int64_t mb = std::min(chunk, a_.offsets[e + 1] - r0);
        tile_gemm<G, Acc>(mb, n1_, k1_, a_.x.template const_data_ptr<X>() + r0 * k1_, k1_, w1,
                          n1_, acc.data());
        at::parallel_for(0, mb * chunks_a, 1, [&](int64_t begin, int64_t end) {
          for_each_block(begin, end, chunks_a, k2_, [&](int64_t i0, int64_t i1, int64_t j0,
                                                        int64_t nc) {
            epilogue_a(e, i0, i1, j0, nc, acc.data() + j0, acc.data() + k2_ + j0, n1_);
          });
        });
        tile_gemm<G, Acc>(mb, n2_, k2_, h_.data(), k2_, w2, n2_, acc.data());
        at::parallel_for(0, mb * chunks_b, 1, [&](int64_t begin, int64_t end) {
          for_each_block(begin, end, chunks_b, n2_, [&](int64_t i0, int64_t i1, int64_t c0,
                                                        int64_t nc) {
            epilogue_b(e, r0, i0, i1, c0, nc, acc.data() + c0, n2_);
          });
        });
      }
    }
  }

  void run() {
    const int64_t experts = a_.w1.size(0);
    int64_t mb_max = 0;
    for (int64_t e = 0; e < experts; ++e) {
      mb_max = std::max(mb_max, std::min(kRowBlock, a_.offsets[e + 1] - a_.offsets[e]));
    }
    if (mb_max == 0 || n2_ == 0) return;
    const int64_t threads = std::max<int64_t>(at::get_num_threads(), 1);
    const int64_t tile_cols_a = glu_ ? 2 * wa_ : wa_;
    h_ = blas::TileBuffer<G>(mb_max * k2_);
    if constexpr (kConvertX) xbuf_ = blas::TileBuffer<G>(mb_max * k1_);
    scratch_.reserve(threads);
    for (int64_t t = 0; t < threads; ++t) {
      Scratch s;
      s.acc = blas::TileBuffer<Acc>(mb_max * std::max(tile_cols_a, wb_));
      if constexpr (kConvertW) s.w = blas::TileBuffer<G>(std::max(k1_ * wa_, k2_ * wb_));
      if constexpr (kWeightOnly) s.row = blas::TileBuffer<float>(std::max(wa_, wb_));
      scratch_.push_back(std::move(s));
    }
    for (int64_t e = 0; e < experts; ++e) {
      for (int64_t r0 = a_.offsets[e]; r0 < a_.offsets[e + 1]; r0 += kRowBlock) {
        block(e, r0, std::min(kRowBlock, a_.offsets[e + 1] - r0));
      }
    }
  }

 private:
  Scratch& scratch() { return scratch_[at::get_thread_num()]; }

  static const float* row_of(const at::Tensor& t, int64_t e) {
    return t.defined() ? t.const_data_ptr<float>() + e * t.size(1) : nullptr;
  }

  // Columns [c0, c0 + nc) of expert e's weight [K, N] as a GEMM operand (pointer, ld): the
  // weight itself, or a converted / dequantised copy in the thread's scratch.
  std::pair<const G*, int64_t> weight_tile(const at::Tensor& w, int64_t e, int64_t c0, int64_t nc,
                                           const at::Tensor& aq_scale,
                                           const at::Tensor& aq_offset) {
    const int64_t k = w.size(1), n = w.size(2);
    const W* src = w.const_data_ptr<W>() + e * k * n + c0;
    if constexpr (!kConvertW) {
      return {src, n};
    } else {
      Scratch& s = scratch();
      G* dst = s.w.data();
      if constexpr (kWeightOnly) {
        const float* scale = row_of(aq_scale, e) + c0;
        const float* offset = aq_offset.defined() ? row_of(aq_offset, e) + c0 : nullptr;
        float* row = s.row.data();
        for (int64_t r = 0; r < k; ++r) {
          int8_to_float(src + r * n, row, nc);
          for_each_vec(nc, [&](int64_t j, int64_t len) {
            // In x's dtype, one rounding per operation, as op-plugin's golden computes it:
            // round(round(W + offset) * scale).
            Vec v = Vec::loadu(row + j, len);
            if (offset) v = round_to<X>(v + Vec::loadu(offset + j, len));
            store_as<G>(dst + r * nc + j, round_to<X>(v * Vec::loadu(scale + j, len)), len);
          });
        }
      } else {
        for (int64_t r = 0; r < k; ++r) {
          for_each_vec(nc, [&](int64_t j, int64_t len) {
            store_as<G>(dst + r * nc + j, load_from<W>(src + r * n + j, len), len);
          });
        }
      }
      return {dst, nc};
    }
  }

  void block(int64_t e, int64_t r0, int64_t mb) {
    const G* xa;
    if constexpr (kConvertX) {
      const X* src = a_.x.const_data_ptr<X>() + r0 * k1_;
      G* dst = xbuf_.data();
      at::parallel_for(0, mb, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          for_each_vec(k1_, [&](int64_t j, int64_t len) {
            store_as<G>(dst + i * k1_ + j, load_from<X>(src + i * k1_ + j, len), len);
          });
        }
      });
      xa = dst;
    } else {
      xa = a_.x.const_data_ptr<X>() + r0 * k1_;
    }
    at::parallel_for(0, ceil_div(k2_, wa_), 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) phase_a(e, xa, mb, t * wa_);
    });
    at::parallel_for(0, ceil_div(n2_, wb_), 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) phase_b(e, r0, mb, t * wb_);
    });
  }

  // Intermediate columns [j0, j0 + nc) of the block: GEMM tile(s), then the epilogue in place.
  void phase_a(int64_t e, const G* xa, int64_t mb, int64_t j0) {
    const int64_t nc = std::min(wa_, k2_ - j0);
    Acc* left = scratch().acc.data();
    Acc* right = left + mb * nc;
    auto [w, ldw] = weight_tile(a_.w1, e, j0, nc, a_.aq_scale1, a_.aq_offset1);
    tile_gemm<G, Acc>(mb, nc, k1_, xa, k1_, w, ldw, left);
    if (glu_) {
      auto [w2, ldw2] = weight_tile(a_.w1, e, k2_ + j0, nc, a_.aq_scale1, a_.aq_offset1);
      tile_gemm<G, Acc>(mb, nc, k1_, xa, k1_, w2, ldw2, right);
    }
    epilogue_a(e, 0, mb, j0, nc, left, right, nc);
  }

  // Rows [i0, i1) of epilogue A on columns [j0, j0 + nc) of the intermediate, from GEMM results
  // whose row i starts at left + i * ld (and right + i * ld for the GLU forms' second half).
  void epilogue_a(int64_t e, int64_t i0, int64_t i1, int64_t j0, int64_t nc, const Acc* left,
                  const Acc* right, int64_t ld) {
    switch (a_.act) {
      case FfnAct::kFastGelu:
        return epilogue_a<FfnAct::kFastGelu>(e, i0, i1, j0, nc, left, right, ld);
      case FfnAct::kGelu: return epilogue_a<FfnAct::kGelu>(e, i0, i1, j0, nc, left, right, ld);
      case FfnAct::kRelu: return epilogue_a<FfnAct::kRelu>(e, i0, i1, j0, nc, left, right, ld);
      case FfnAct::kSilu: return epilogue_a<FfnAct::kSilu>(e, i0, i1, j0, nc, left, right, ld);
      case FfnAct::kGeglu: return epilogue_a<FfnAct::kGeglu>(e, i0, i1, j0, nc, left, right, ld);
      case FfnAct::kSwiglu:
        return epilogue_a<FfnAct::kSwiglu>(e, i0, i1, j0, nc, left, right, ld);
      case FfnAct::kReglu: return epilogue_a<FfnAct::kReglu>(e, i0, i1, j0, nc, left, right, ld);
    }
  }

  // One GEMM's per-channel parameters for expert e as raw pointers, taken once per epilogue
  // call: the tensor accessors check dtype and storage each time, and the epilogues run per
  // vector (measured: they tripled the int8 epilogue's cost when called there).
  struct Channels {
    const float* bias = nullptr;     // float paths
    const int32_t* ibias = nullptr;  // quantised path
    const float* deq = nullptr;      // quantised path
  };

  static Channels channels(const at::Tensor& bias, const at::Tensor& deq, int64_t e, int64_t n) {
    Channels c;
    if (bias.defined()) {
      if constexpr (kQuant) {
        c.ibias = bias.const_data_ptr<int32_t>() + e * n;
      } else {
        c.bias = bias.const_data_ptr<float>() + e * n;
      }
    }
    if constexpr (kQuant) c.deq = deq.const_data_ptr<float>() + e * n;
    return c;
  }

  // The GEMM result at acc (column c) in fp32: + bias (int32 for the quantised path, added
  // before the dequantisation scale, as Ascend's formula has it), times the scale. The
  // quantised path rounds as op-plugin's golden (test_npu_ffn) does: the first GEMM's sum
  // (+ bias) times deq_scale1 in fp32, rounded to the output dtype O; the second GEMM's sum
  // (+ bias) first converted to O (kSecond), then times deq_scale2 in fp32, rounded to O.
  template <bool kSecond = false>
  static C10_ALWAYS_INLINE Vec dequant(const Acc* acc, const Channels& ch, int64_t c, int64_t len) {
    if constexpr (kQuant) {
      auto v = at::vec::Vectorized<int32_t>::loadu(acc, len);
      if (ch.ibias != nullptr) v = v + at::vec::Vectorized<int32_t>::loadu(ch.ibias + c, len);
      Vec f = at::vec::convert_to_fp_of_same_size<float>(v);
      if constexpr (kSecond) f = round_to<O>(f);
      return round_to<O>(f * Vec::loadu(ch.deq + c, len));
    } else {
      const Vec v = Vec::loadu(acc, len);
      return ch.bias != nullptr ? v + Vec::loadu(ch.bias + c, len) : v;
    }
  }

  template <FfnAct kA>
  void epilogue_a(int64_t e, int64_t i0, int64_t i1, int64_t j0, int64_t nc, const Acc* left,
                  const Acc* right, int64_t ld) {
    constexpr bool kGlu = kA == FfnAct::kGeglu || kA == FfnAct::kSwiglu || kA == FfnAct::kReglu;
    const float* qscale = kQuant ? row_of(a_.qscale, e) + j0 : nullptr;
    const float qoffset = kQuant ? a_.qoffset.const_data_ptr<float>()[e] : 0.f;
    const Channels ch = channels(a_.bias1, a_.deq1, e, n1_);
    G* const h_data = h_.data();
    for (int64_t i = i0; i < i1; ++i) {
      G* h = h_data + i * k2_ + j0;
      const Acc* l = left + i * ld;
      const Acc* r = right + i * ld;
      // The per-vector body and what it calls (dequant, act, the int8 helpers) are forced
      // inline: GCC kept them out of line, every vector going through memory between them
      // (measured: the int8 epilogue over a 1024 x 11008 block, 10.8 -> 8.1 ms on one thread).
      for_each_vec(nc, [&](int64_t j, int64_t len) C10_ALWAYS_INLINE_ATTRIBUTE {
        // act in precision Q: P's, or for the quantised path's first try the cheap one.
        const auto value = [&]<typename Q>() C10_ALWAYS_INLINE_ATTRIBUTE {
          if constexpr (kGlu) {
            return dequant(l + j, ch, j0 + j, len) *
                   act<kA, Q>(dequant(r + j, ch, k2_ + j0 + j, len));
          } else {
            return act<kA, Q>(dequant(l + j, ch, j0 + j, len));
          }
        };
        if constexpr (kQuant) {
          __builtin_prefetch(l + j + kPrefetchAhead);
          if constexpr (kGlu) __builtin_prefetch(r + j + kPrefetchAhead);
          // op-plugin's golden (test_npu_ffn) computes the requantisation in the output dtype
          // O: the activation's result rounded to O, times the scale in O, plus the offset in
          // O, each operation rounded to O; then round half to even and saturate to int8. The
          // activation is the exact fp32 one: after the roundings to O, the cheap one's error
          // could move a code by a whole step of O, which no margin on t can bound.
          const Vec qs = round_to<O>(Vec::loadu(qscale + j, len)), qo(round_to<O>(Vec(qoffset)));
          const Vec y = round_to<O>(value.template operator()<P>());
          const Vec t = round_to<O>(round_to<O>(y * qs) + qo);
          store_int8(h + j, at::vec::clamp(t.round(), Vec(-128.f), Vec(127.f)), len);
        } else {
          store_as<G>(h + j, round_to<P>(value.template operator()<P>()), len);
        }
      });
    }
  }

  // Output columns [c0, c0 + nc) of the block.
  void phase_b(int64_t e, int64_t r0, int64_t mb, int64_t c0) {
    const int64_t nc = std::min(wb_, n2_ - c0);
    Acc* acc = scratch().acc.data();
    auto [w, ldw] = weight_tile(a_.w2, e, c0, nc, a_.aq_scale2, a_.aq_offset2);
    tile_gemm<G, Acc>(mb, nc, k2_, h_.data(), k2_, w, ldw, acc);
    epilogue_b(e, r0, 0, mb, c0, nc, acc, nc);
  }

  // Rows [i0, i1) of the block at r0, output columns [c0, c0 + nc), from the second GEMM's
  // results whose row i starts at acc + i * ld: + bias2 (and dequantisation), rounded once.
  void epilogue_b(int64_t e, int64_t r0, int64_t i0, int64_t i1, int64_t c0, int64_t nc,
                  const Acc* acc, int64_t ld) {
    O* out = a_.out.mutable_data_ptr<O>() + r0 * n2_ + c0;
    const Channels ch = channels(a_.bias2, a_.deq2, e, n2_);
    for (int64_t i = i0; i < i1; ++i) {
      for_each_vec(nc, [&](int64_t j, int64_t len) C10_ALWAYS_INLINE_ATTRIBUTE {
        if constexpr (kQuant) __builtin_prefetch(acc + i * ld + j + kPrefetchAhead);
        store_as<O>(out + i * n2_ + j, dequant<true>(acc + i * ld + j, ch, c0 + j, len), len);
      });
    }
  }

  const FfnArgs& a_;
  const int64_t k1_, n1_, k2_, n2_;
  const bool glu_;
  const int64_t wa_, wb_;  // column tile widths of phase A (intermediate) and B (output)
  blas::TileBuffer<G> h_;     // the block's intermediate [mb, K2]
  blas::TileBuffer<G> xbuf_;  // the block of x converted to G
  std::vector<Scratch> scratch_;
};

// FfnGemm::kATen: per expert, H = x_e W1_e + b1_e by ATen (oneDNN for fp16 / bf16, rounded
// once to x's dtype, bias included, exactly as F.linear rounds it), then one pass over H in
// place: act in fp32, rounded once (GLU forms write a * act(b) over the left half a, reading
// each b before nothing overwrites it), then y_e = H' W2_e + b2_e by ATen into the output.
// fp16 / bf16 reach these ATen GEMMs only where the CPU GEMM policy (common/half_gemm.h) keeps
// them in their dtype, or when OPENNPU_FFN_GEMM=aten forces it (choose_gemm).
template <typename X>
void run_aten(const FfnArgs& a) {
  const int64_t experts = a.w1.size(0), n1 = a.w1.size(2), k2 = a.w2.size(1);
  const bool glu = is_glu(a.act);
  int64_t m_max = 0;
  for (int64_t e = 0; e < experts; ++e) m_max = std::max(m_max, a.offsets[e + 1] - a.offsets[e]);
  if (m_max == 0) return;
  const at::ScalarType xt = a.x.scalar_type();
  // Biases back in x's dtype for the fused GEMM bias (exact for x-dtype biases; an fp32 bias is
  // rounded to x's dtype, as the native composition's F.linear would need it).
  const at::Tensor b1 = a.bias1.defined() ? a.bias1.to(xt) : at::Tensor();
  const at::Tensor b2 = a.bias2.defined() ? a.bias2.to(xt) : at::Tensor();
  at::Tensor h = at::empty({m_max, n1}, a.x.options());
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = a.offsets[e], m = a.offsets[e + 1] - r0;
    if (m == 0) continue;
    at::Tensor he = h.narrow(0, 0, m);
    const at::Tensor xe = a.x.narrow(0, r0, m);
    if (b1.defined()) {
      at::addmm_out(he, b1[e], xe, a.w1[e]);
    } else {
      at::mm_out(he, xe, a.w1[e]);
    }
    X* hp = he.mutable_data_ptr<X>();
    const auto pass = [&]<FfnAct kA>() {
      // Columns in chunks, so that a few long rows still spread over the threads; below 64K
      // elements (decode) the pass runs on the calling thread: a parallel region costs more
      // than that work, and far more when the machine's cores are shared.
      constexpr int64_t kChunk = 1024;
      constexpr int64_t kInlineChunks = (int64_t{1} << 16) / kChunk;
      const int64_t chunks = ceil_div(k2, kChunk);
      at::parallel_for(0, m * chunks, kInlineChunks, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const int64_t i = t / chunks, j0 = (t % chunks) * kChunk;
          X* row = hp + i * n1;
          for_each_vec(std::min(kChunk, k2 - j0), [&](int64_t j, int64_t len) {
            const Vec left = load_from<X>(row + j0 + j, len);
            Vec y;
            if constexpr (kA == FfnAct::kGeglu || kA == FfnAct::kSwiglu || kA == FfnAct::kReglu) {
              y = left * act<kA, X>(load_from<X>(row + k2 + j0 + j, len));
            } else {
              y = act<kA, X>(left);
            }
            store_as<X>(row + j0 + j, y, len);
          });
        }
      });
    };
    switch (a.act) {
      case FfnAct::kFastGelu: pass.template operator()<FfnAct::kFastGelu>(); break;
      case FfnAct::kGelu: pass.template operator()<FfnAct::kGelu>(); break;
      case FfnAct::kRelu: pass.template operator()<FfnAct::kRelu>(); break;
      case FfnAct::kSilu: pass.template operator()<FfnAct::kSilu>(); break;
      case FfnAct::kGeglu: pass.template operator()<FfnAct::kGeglu>(); break;
      case FfnAct::kSwiglu: pass.template operator()<FfnAct::kSwiglu>(); break;
      case FfnAct::kReglu: pass.template operator()<FfnAct::kReglu>(); break;
    }
    const at::Tensor ge = glu ? he.narrow(1, 0, k2) : he;
    at::Tensor oe = a.out.narrow(0, r0, m);
    if (b2.defined()) {
      at::addmm_out(oe, b2[e], ge, a.w2[e]);
    } else {
      at::mm_out(oe, ge, a.w2[e]);
    }
  }
}

// The GEMMs of the float paths, chosen per dtype and CPU by choose_gemm below.
enum class FfnGemm {
  // Fused tiles (see above) multiplied by MKL in x's dtype with fp32 accumulation and an fp32
  // tile: sgemm for float32, cblas_gemm_bf16bf16f32 / _f16f16f32 where the CPU multiplies
  // bf16 / fp16 natively. Bias and activation see the unrounded fp32 sums.
  kBlasTiles,
  // Fused tiles converted to fp32 and multiplied by sgemm: fp16 / bf16 where neither MKL nor
  // oneDNN has fast kernels for them. Same rounding points as kBlasTiles.
  kFp32Tiles,
  // Whole per-expert GEMMs through ATen (at::addmm_out / at::mm_out, i.e. oneDNN for fp16 /
  // bf16, the kernels the native composition runs) into an x-dtype intermediate, with bias1
  // fused into the GEMM as F.linear does, then ONE vectorised pass over the intermediate for
  // the activation, then the second GEMM (+ bias2) straight into the output. For fp16 on CPUs
  // whose MKL fp16 GEMM is slow but whose oneDNN is not (AVX512-FP16 without AMX-FP16), and
  // for fp32 with many rows per expert (whole sgemm calls beat the tiles there).
  // The quantised path's default reads it as: whole at::_int_mm GEMMs per chunk of rows into
  // an int32 buffer, each followed by one parallel pass (dequantise, activate, requantise /
  // dequantise into the output); kBlasTiles there means the per-thread tiles.
  kATen,
};


// The float paths' GEMMs. bf16 takes MKL's tiles where MKL multiplies bf16 with the CPU's own
// instructions (AMX), which beat oneDNN's at few rows and match it at many; where it does not
// (blas::mkl_multiplies_natively: e.g. an AMD Zen 4), and for fp16 (MKL's fp16 GEMM is slower
// than oneDNN's on AVX512-FP16 CPUs without AMX-FP16), whole ATen GEMMs (oneDNN), as the native
// composition runs. float32: MKL sgemm tiles up to kWholeGemmRows rows per expert, whole ATen
// GEMMs (the same sgemm) from there. OPENNPU_FFN_GEMM=blas|fp32|aten forces a path (the tests
// run every path on every machine); "blas" falls back to fp32 tiles where MKL has no fp16 / bf16
// GEMM; with none of those, OPENNPU_HALF_GEMM=fp32 forces the fp32 tiles and =native the
// choice a CPU with fp16 / bf16 arithmetic makes. The measurements behind these choices are in
// the commit history (git log -S kWholeGemmRows) and docs/performance.md.
constexpr int64_t kWholeGemmRows = 512;

FfnGemm choose_gemm(at::ScalarType xt, bool weight_only, int64_t rows_per_expert) {
  const char* env = std::getenv("OPENNPU_FFN_GEMM");
  const std::string forced = env != nullptr ? env : "";
  TORCH_CHECK(forced.empty() || forced == "auto" || forced == "blas" || forced == "fp32" ||
                  forced == "aten",
              "npu_ffn: OPENNPU_FFN_GEMM must be auto, blas, fp32 or aten, but got '", forced,
              "'");
  const bool half = xt == at::kHalf || xt == at::kBFloat16;
  // MKL's half-precision GEMM exists (cpu_multiplies_natively is a separate, speed question).
  const bool mkl_half = xt == at::kBFloat16 ? cblas_gemm_bf16bf16f32 != nullptr
                                            : cblas_gemm_f16f16f32 != nullptr;
  // The weight-only path dequantises weight tiles (rounded to x's dtype) and keeps the
  // intermediate in fp32, as op-plugin's golden does, so it always multiplies fp32 tiles.
  if (weight_only) return FfnGemm::kFp32Tiles;
  if (forced == "aten") return FfnGemm::kATen;
  if (!half) {
    const bool whole = forced.empty() || forced == "auto" ? rows_per_expert >= kWholeGemmRows
                                                           : false;
    return whole ? FfnGemm::kATen : FfnGemm::kBlasTiles;
  }
  if (forced == "fp32") return FfnGemm::kFp32Tiles;
  if (forced == "blas") return mkl_half ? FfnGemm::kBlasTiles : FfnGemm::kFp32Tiles;
  // The CPU GEMM policy (common/half_gemm.h; OPENNPU_HALF_GEMM): where the CPU has no fp16 /
  // bf16 arithmetic, fp32 tiles, with the same fp32 accumulation and rounding points as below.
  if (half_gemm_in_fp32(xt)) return FfnGemm::kFp32Tiles;
  if (xt == at::kHalf || !blas::mkl_multiplies_natively(xt)) return FfnGemm::kATen;
  return mkl_half ? FfnGemm::kBlasTiles : FfnGemm::kFp32Tiles;
}

// The quantised path: whole at::_int_mm GEMMs (kATen; their int32 passes cost less than the
// tiles' per-thread epilogues), or tiles with OPENNPU_FFN_GEMM=blas.
FfnGemm choose_quant_gemm() {
  const char* env = std::getenv("OPENNPU_FFN_GEMM");
  return env != nullptr && std::strcmp(env, "blas") == 0 ? FfnGemm::kBlasTiles : FfnGemm::kATen;
}

template <typename X, typename G>
void run_float(const FfnArgs& a) {
  if (a.w1.scalar_type() == at::kChar) {
    Runner<X, int8_t, G, X>(a).run();
  } else {
    Runner<X, X, G, X>(a).run();
  }
}

template <typename O>
void run_quant(const FfnArgs& a, FfnGemm gemm) {
  Runner<int8_t, int8_t, int8_t, O> runner(a);
  if (gemm == FfnGemm::kATen) {
    runner.run_whole();
  } else {
    runner.run();
  }
}

// fp16 / bf16: multiplied as they are (kBlasTiles), in fp32 tiles, or by ATen.
template <typename X>
void run_half(const FfnArgs& a, FfnGemm gemm) {
  switch (gemm) {
    case FfnGemm::kBlasTiles: return run_float<X, X>(a);
    case FfnGemm::kFp32Tiles: return run_float<X, float>(a);
    case FfnGemm::kATen: return run_aten<X>(a);
  }
}

void ffn_kernel(const FfnArgs& a) {
  const at::ScalarType xt = a.x.scalar_type();
  const FfnGemm gemm = xt == at::kChar
                           ? choose_quant_gemm()
                           : choose_gemm(xt, /*weight_only=*/a.w1.scalar_type() == at::kChar,
                                         /*rows_per_expert=*/a.x.size(0) / a.w1.size(0));
  switch (xt) {
    case at::kChar:
      if (a.out.scalar_type() == at::kBFloat16) {
        return run_quant<c10::BFloat16>(a, gemm);
      }
      return run_quant<c10::Half>(a, gemm);
    case at::kFloat:
      return gemm == FfnGemm::kATen ? run_aten<float>(a) : run_float<float, float>(a);
    case at::kHalf:
      return run_half<c10::Half>(a, gemm);
    case at::kBFloat16:
      return run_half<c10::BFloat16>(a, gemm);
    default:
      TORCH_INTERNAL_ASSERT(false, "npu_ffn: unexpected dtype ", a.x.scalar_type());
  }
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(ffn, &ffn_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::ffn
