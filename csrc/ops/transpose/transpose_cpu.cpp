// CPU kernel of the confusion transpose (compiled once per ISA; see common/cpu_dispatch.h).
//
// Executes a CopyPlan (transpose.h): a strided source view, its dims already in output order,
// gathered into a contiguous output. Pure data movement, chosen by element size. Three cases:
//
// - Long runs (the innermost source dim is contiguous and moves >= 32 KiB at once, including the
//   plain copy of an unpermuted tensor): memcpy of run chunks, in parallel.
// - Short runs (the innermost dim stays innermost, e.g. BSND -> BNSD, (0, 2, 1, 3)): memcpy per
//   run, in tiles over the output-innermost dim A and the dim B with the smallest source stride,
//   so both sides touch a few KiB contiguously per stream.
// - Element transpose (the innermost dim moves, e.g. a 2-D (1, 0)): cache-blocked tiles over A
//   and B, each moved as V x V blocks transposed in SIMD registers (AVX2/SSE2 shuffles).
//
// Why not ATen: out.copy_(x.permute(perm)) reached 68% of copy bandwidth on BSND -> BNSD fp32 and
// 8-45% on 2-D transposes (ATen's blocked 2-D transpose path is single-threaded) on the
// development machine, 2 threads; this kernel is used for every plan.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define OPENNPU_TRANSPOSE_SIMD 1
#endif

#include "ops/transpose/transpose.h"

namespace opennpu::transpose {
inline namespace CPU_CAPABILITY {
namespace {

// A run at least this long is copied by itself (no tiling), in chunks of kChunkBytes.
constexpr int64_t kLongRunBytes = 32 << 10;
constexpr int64_t kChunkBytes = 64 << 10;
// Tile side for the element transpose, in bytes per tile row (64 fp32, 128 bf16 ...).
constexpr int64_t kTileSideBytes = 256;
// Tile side for short runs: runs per side such that each side covers about this many bytes.
constexpr int64_t kRunTileSideBytes = 2048;
// Work below this many bytes per parallel chunk stays on one thread.
constexpr int64_t kParallelBytes = 64 << 10;

template <int kBytes>
inline void move_unit(char* dst, const char* src) {
  std::memcpy(dst, src, kBytes);  // a constant size: one load and one store
}

// dst[b * ld_dst + a] = src[a * ld_src + b * step_src] for a < na, b < nb (strides in bytes).
template <int kBytes>
void scalar_block(const char* src, int64_t ld_src, int64_t step_src, char* dst, int64_t ld_dst,
                  int64_t na, int64_t nb) {
  for (int64_t b = 0; b < nb; ++b) {
    char* d = dst + b * ld_dst;
    const char* s = src + b * step_src;
    for (int64_t a = 0; a < na; ++a) move_unit<kBytes>(d + a * kBytes, s + a * ld_src);
  }
}

// Block<kBytes>::run transposes a kV x kV block of kBytes units: row a of src (kV contiguous
// units at src + a * ld_src) becomes column a of dst (rows at dst + b * ld_dst). Shuffles only,
// so every bit pattern (NaN payloads included) moves unchanged. kV = 0: no SIMD block.
template <int kBytes>
struct Block {
  static constexpr int kV = 0;
  static void run(const char*, int64_t, char*, int64_t) {}
};

#ifdef OPENNPU_TRANSPOSE_SIMD

template <>
struct Block<4> {
  static constexpr int kV = 8;
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(src + i * ld_src));
    for (int i = 0; i < 4; ++i) {  // t[2i], t[2i+1]: rows 2i and 2i+1 interleaved
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // u[4h + c]: rows 4h..4h+3 of column c (low lane), c+4 (high)
      u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
      u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
      u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
      u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
      _mm256_storeu_ps(reinterpret_cast<float*>(dst + c * ld_dst),
                       _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
      _mm256_storeu_ps(reinterpret_cast<float*>(dst + (c + 4) * ld_dst),
                       _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
    }
  }
};

template <>
struct Block<8> {
  static constexpr int kV = 4;
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m256d r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm256_loadu_pd(reinterpret_cast<const double*>(src + i * ld_src));
    const __m256d lo01 = _mm256_unpacklo_pd(r[0], r[1]);  // columns 0 | 2 of rows 0, 1
    const __m256d hi01 = _mm256_unpackhi_pd(r[0], r[1]);  // columns 1 | 3
    const __m256d lo23 = _mm256_unpacklo_pd(r[2], r[3]);
    const __m256d hi23 = _mm256_unpackhi_pd(r[2], r[3]);
    auto store = [&](int c, __m256d v) { _mm256_storeu_pd(reinterpret_cast<double*>(dst + c * ld_dst), v); };
    store(0, _mm256_permute2f128_pd(lo01, lo23, 0x20));
    store(1, _mm256_permute2f128_pd(hi01, hi23, 0x20));
    store(2, _mm256_permute2f128_pd(lo01, lo23, 0x31));
    store(3, _mm256_permute2f128_pd(hi01, hi23, 0x31));
  }
};

template <>
struct Block<2> {
  static constexpr int kV = 8;
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m128i r[8], s[8], q[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
    for (int i = 0; i < 4; ++i) {  // 32-bit units: (row 2i, row 2i+1) of columns 0-3 | 4-7
      s[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
      s[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {  // 64-bit units: rows 4h..4h+3 of columns (0,1) (2,3) (4,5) (6,7)
      q[4 * h + 0] = _mm_unpacklo_epi32(s[4 * h], s[4 * h + 2]);
      q[4 * h + 1] = _mm_unpackhi_epi32(s[4 * h], s[4 * h + 2]);
      q[4 * h + 2] = _mm_unpacklo_epi32(s[4 * h + 1], s[4 * h + 3]);
      q[4 * h + 3] = _mm_unpackhi_epi32(s[4 * h + 1], s[4 * h + 3]);
    }
    for (int c = 0; c < 4; ++c) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * c) * ld_dst),
                       _mm_unpacklo_epi64(q[c], q[4 + c]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * c + 1) * ld_dst),
                       _mm_unpackhi_epi64(q[c], q[4 + c]));
    }
  }
};

template <>
struct Block<1> {
  static constexpr int kV = 16;
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m128i r[16], lo[8], hi[8], c[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
    for (int k = 0; k < 8; ++k) {  // 16-bit units (row 2k, row 2k+1): columns 0-7 | 8-15
      lo[k] = _mm_unpacklo_epi8(r[2 * k], r[2 * k + 1]);
      hi[k] = _mm_unpackhi_epi8(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; ++k) {  // c[4g + k]: 32-bit units, rows 4k..4k+3, columns 4g..4g+3
      c[0 + k] = _mm_unpacklo_epi16(lo[2 * k], lo[2 * k + 1]);
      c[4 + k] = _mm_unpackhi_epi16(lo[2 * k], lo[2 * k + 1]);
      c[8 + k] = _mm_unpacklo_epi16(hi[2 * k], hi[2 * k + 1]);
      c[12 + k] = _mm_unpackhi_epi16(hi[2 * k], hi[2 * k + 1]);
    }
    for (int g = 0; g < 4; ++g) {
      const __m128i lo01 = _mm_unpacklo_epi32(c[4 * g], c[4 * g + 1]);      // cols 4g, 4g+1; rows 0-7
      const __m128i hi01 = _mm_unpackhi_epi32(c[4 * g], c[4 * g + 1]);      // cols 4g+2, 4g+3
      const __m128i lo23 = _mm_unpacklo_epi32(c[4 * g + 2], c[4 * g + 3]);  // rows 8-15
      const __m128i hi23 = _mm_unpackhi_epi32(c[4 * g + 2], c[4 * g + 3]);
      auto store = [&](int col, __m128i v) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + col * ld_dst), v);
      };
      store(4 * g + 0, _mm_unpacklo_epi64(lo01, lo23));
      store(4 * g + 1, _mm_unpackhi_epi64(lo01, lo23));
      store(4 * g + 2, _mm_unpacklo_epi64(hi01, hi23));
      store(4 * g + 3, _mm_unpackhi_epi64(hi01, hi23));
    }
  }
};

#endif  // OPENNPU_TRANSPOSE_SIMD

// dst[b * ld_dst + a] = src[a * ld_src + b] (units; the source is contiguous along b): na x nb.
template <int kBytes>
void transpose_tile(const char* src, int64_t ld_src, char* dst, int64_t ld_dst, int64_t na,
                    int64_t nb) {
  constexpr int kV = Block<kBytes>::kV;
  int64_t a = 0;
  if constexpr (kV > 0) {
    for (; a + kV <= na; a += kV) {
      int64_t b = 0;
      for (; b + kV <= nb; b += kV) {
        Block<kBytes>::run(src + a * ld_src + b * kBytes, ld_src, dst + b * ld_dst + a * kBytes,
                           ld_dst);
      }
      scalar_block<kBytes>(src + a * ld_src + b * kBytes, ld_src, kBytes,
                           dst + b * ld_dst + a * kBytes, ld_dst, kV, nb - b);
    }
  }
  scalar_block<kBytes>(src + a * ld_src, ld_src, kBytes, dst + a * kBytes, ld_dst, na - a, nb);
}

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Source offset (bytes) of the flat index `i` over dims (sizes, strides), innermost last.
int64_t offset_of(int64_t i, const std::vector<int64_t>& sizes,
                  const std::vector<int64_t>& strides) {
  int64_t off = 0;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0 && i > 0; --d) {
    off += (i % sizes[d]) * strides[d];
    i /= sizes[d];
  }
  return off;
}

// Every run of run_bytes by itself, split into chunks; for long runs and the plain copy.
void copy_long_runs(const char* src, char* dst, const std::vector<int64_t>& sizes,
                    const std::vector<int64_t>& src_strides, int64_t run_bytes) {
  int64_t runs = 1;
  for (int64_t s : sizes) runs *= s;
  const int64_t chunks = div_up(run_bytes, kChunkBytes);
  at::parallel_for(0, runs * chunks, std::max<int64_t>(1, kParallelBytes / kChunkBytes),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       const int64_t r = i / chunks, c = i % chunks;
                       const int64_t lo = c * kChunkBytes;
                       const int64_t n = std::min(kChunkBytes, run_bytes - lo);
                       std::memcpy(dst + r * run_bytes + lo,
                                   src + offset_of(r, sizes, src_strides) + lo, n);
                     }
                   });
}

template <int kBytes>
void permute_copy_impl(const char* src, char* dst, const CopyPlan& plan) {
  const int64_t run_bytes = plan.run * kBytes;
  const int64_t k = static_cast<int64_t>(plan.sizes.size());
  std::vector<int64_t> src_strides(plan.src_strides);  // in bytes from here on
  for (auto& s : src_strides) s *= kBytes;
  if (k == 0 || run_bytes >= kLongRunBytes) {
    copy_long_runs(src, dst, plan.sizes, src_strides, run_bytes);
    return;
  }
  std::vector<int64_t> dst_strides(k);
  for (int64_t d = k - 1, acc = run_bytes; d >= 0; --d) {
    dst_strides[d] = acc;
    acc *= plan.sizes[d];
  }
  // A: the output-innermost dim. B: of the others, the one with the smallest source stride
  // (innermost in the source). Every other dim is a batch dim.
  const int64_t a_dim = k - 1;
  int64_t b_dim = -1;
  for (int64_t d = 0; d < a_dim; ++d) {
    if (b_dim < 0 || src_strides[d] <= src_strides[b_dim]) b_dim = d;
  }
  const int64_t n_a = plan.sizes[a_dim], s_a = src_strides[a_dim];
  const int64_t n_b = b_dim < 0 ? 1 : plan.sizes[b_dim];
  const int64_t s_b = b_dim < 0 ? 0 : src_strides[b_dim];
  const int64_t o_b = b_dim < 0 ? 0 : dst_strides[b_dim];
  std::vector<int64_t> batch_sizes, batch_src, batch_dst;
  for (int64_t d = 0; d < a_dim; ++d) {
    if (d == b_dim) continue;
    batch_sizes.push_back(plan.sizes[d]);
    batch_src.push_back(src_strides[d]);
    batch_dst.push_back(dst_strides[d]);
  }
  int64_t batches = 1;
  for (int64_t s : batch_sizes) batches *= s;

  const bool runs = plan.run > 1;
  const int64_t side = runs ? std::max<int64_t>(1, kRunTileSideBytes / run_bytes)
                            : std::max<int64_t>(1, kTileSideBytes / kBytes);
  const int64_t t_a = std::min(side, n_a), t_b = std::min(side, n_b);
  const int64_t tiles_a = div_up(n_a, t_a), tiles_b = div_up(n_b, t_b);
  const int64_t tile_bytes = t_a * t_b * run_bytes;
  const bool unit_stride_b = !runs && s_b == kBytes;

  at::parallel_for(
      0, batches * tiles_b * tiles_a, std::max<int64_t>(1, kParallelBytes / tile_bytes),
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t ia = i % tiles_a, ib = (i / tiles_a) % tiles_b;
          const int64_t batch = i / (tiles_a * tiles_b);
          const int64_t a0 = ia * t_a, b0 = ib * t_b;
          const int64_t na = std::min(t_a, n_a - a0), nb = std::min(t_b, n_b - b0);
          const char* s = src + offset_of(batch, batch_sizes, batch_src) + a0 * s_a + b0 * s_b;
          char* d = dst + offset_of(batch, batch_sizes, batch_dst) + b0 * o_b + a0 * run_bytes;
          if (runs) {
            for (int64_t b = 0; b < nb; ++b) {
              for (int64_t a = 0; a < na; ++a) {
                std::memcpy(d + b * o_b + a * run_bytes, s + a * s_a + b * s_b, run_bytes);
              }
            }
          } else if (unit_stride_b) {
            transpose_tile<kBytes>(s, s_a, d, o_b, na, nb);
          } else {
            scalar_block<kBytes>(s, s_a, s_b, d, o_b, na, nb);
          }
        }
      });
}

void permute_copy_kernel(const char* src, char* dst, const CopyPlan& plan) {
  switch (plan.unit) {
    case 1: return permute_copy_impl<1>(src, dst, plan);
    case 2: return permute_copy_impl<2>(src, dst, plan);
    case 4: return permute_copy_impl<4>(src, dst, plan);
    case 8: return permute_copy_impl<8>(src, dst, plan);
    default: TORCH_INTERNAL_ASSERT(false, "npu_confusion_transpose: unit of ", plan.unit, " bytes");
  }
}

}  // namespace

OPENNPU_REGISTER_CPU_KERNEL(permute_copy_cpu, &permute_copy_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::transpose
