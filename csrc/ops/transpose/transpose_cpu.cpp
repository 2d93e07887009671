// CPU kernel of the confusion transpose (compiled once per ISA; see common/cpu_dispatch.h).
//
// Executes a CopyPlan (transpose.h): a strided source view, its dims already in output order,
// gathered into a contiguous output. Pure data movement, chosen by element size. Three cases:
//
// - Long runs (the innermost source dim is contiguous and moves >= 32 KiB at once, including the
//   plain copy of an unpermuted tensor): run chunks copied in parallel.
// - Short runs (the innermost dim stays innermost, e.g. BSND -> BNSD, (0, 2, 1, 3)): one copy per
//   run, in tiles over the output-innermost dim A and the dim B with the smallest source stride,
//   so both sides touch a few KiB contiguously per stream.
// - Element transpose (the innermost dim moves, e.g. a 2-D (1, 0)): tiles over A and B moved as
//   square blocks transposed in SIMD registers: on AVX-512 16 x 16 for 4-byte units and 32 x 32
//   for 2-byte units (rows of one 64-byte line), otherwise AVX2/SSE2 shuffles.
//
// Outputs of stream_min_bytes() and more (common/stream_store.h: the size of the last-level
// cache) are written with non-temporal (streaming) stores of whole 64-byte lines: such an output
// does not stay in cache anyway, and streaming saves the read-for-ownership of each output line
// (a third of the memory traffic of a copy). Blocks narrower than a line go
// through an L1 staging buffer, as do output rows that are not line-aligned (their partial end
// lines are stored normally). Run copies stream only into pages already mapped (see
// pages_resident in common/stream_store.h). Smaller outputs use ordinary stores, so the next op
// finds them in cache.
//
// Why not ATen: out.copy_(x.permute(perm)) reached 68-84% of copy bandwidth on large BSND -> BNSD
// copies and 8-45% on 2-D transposes (its blocked 2-D path is single-threaded) on the development
// machine, well below this kernel. On short-run copies whose output stays in cache (seed example
// one) the two are within a few percent, this kernel ahead on 4 of 5 shapes measured (called
// below the autograd layer), so this kernel runs every plan. Tile shapes were measured there
// (2 vCPUs, AVX-512, 2 MiB L2 per core).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define OPENNPU_TRANSPOSE_SIMD 1
#endif

#include "common/stream_store.h"
#include "ops/transpose/transpose.h"

namespace opennpu::transpose {
inline namespace CPU_CAPABILITY {
namespace {

// A run at least this long is copied by itself (no tiling), in chunks of kChunkBytes.
constexpr int64_t kLongRunBytes = 32 << 10;
constexpr int64_t kChunkBytes = 64 << 10;
// Element transpose tiles with streaming stores: one 64-byte line of each output row (kBand
// source rows) by this many bytes of each source row, visited along A first.
constexpr int64_t kStreamTileRowBytes = 4096;
// With ordinary stores: up to this many source rows by max(one line, kTileBytes / rows) of each
// source row, visited along B first.
constexpr int64_t kPlainTileRows = 2048;
constexpr int64_t kTileBytes = 16 << 10;
// Short-run tiles: runs per side such that each side covers about this many bytes.
constexpr int64_t kRunTileSideBytes = 8192;
// Streaming into rows that are not line-aligned: tiles of this many bytes per output row, and
// about kStagedTileBytes in all.
constexpr int64_t kStagedRowBytes = 2048;
constexpr int64_t kStagedTileBytes = 256 << 10;
// Runs up to this long are copied inline rather than by memcpy.
constexpr int64_t kInlineRunBytes = 1024;
// Work below this many bytes per parallel chunk stays on one thread.
constexpr int64_t kParallelBytes = 64 << 10;
constexpr int64_t kLine = kLineBytes;

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

#ifdef OPENNPU_TRANSPOSE_SIMD

// Vector stores, streaming (the address is then aligned to the vector size) or ordinary.
template <bool kStream>
inline void store(char* p, __m128i v) {
  if constexpr (kStream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), v);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
  }
}
template <bool kStream>
inline void store(char* p, __m256 v) {
  if constexpr (kStream) {
    _mm256_stream_ps(reinterpret_cast<float*>(p), v);
  } else {
    _mm256_storeu_ps(reinterpret_cast<float*>(p), v);
  }
}
template <bool kStream>
inline void store(char* p, __m256d v) {
  if constexpr (kStream) {
    _mm256_stream_pd(reinterpret_cast<double*>(p), v);
  } else {
    _mm256_storeu_pd(reinterpret_cast<double*>(p), v);
  }
}
#ifdef CPU_CAPABILITY_AVX512
template <bool kStream>
inline void store(char* p, __m512 v) {
  if constexpr (kStream) {
    _mm512_stream_ps(reinterpret_cast<float*>(p), v);
  } else {
    _mm512_storeu_ps(reinterpret_cast<float*>(p), v);
  }
}
#endif

#endif  // OPENNPU_TRANSPOSE_SIMD

// Block<kBytes>::run<kStream> transposes a kV x kV block of kBytes units: row a of src (kV
// contiguous units at src + a * ld_src) becomes column a of dst (rows at dst + b * ld_dst).
// Shuffles only, so every bit pattern (NaN payloads included) moves unchanged. kV = 0: none.
template <int kBytes>
struct Block {
  static constexpr int kV = 0;
  template <bool kStream>
  static void run(const char*, int64_t, char*, int64_t) {}
};

#ifdef OPENNPU_TRANSPOSE_SIMD

#ifdef CPU_CAPABILITY_AVX512
// out[c] = column c of the 16 x 16 matrix of 32-bit lanes whose rows are r[0..15].
inline void transpose_16x16(const __m512 r[16], __m512 out[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: rows 2i, 2i+1 interleaved
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // u[4q + j], lane L: rows 4q..4q+3 of column 4L + j
    u[4 * q + 0] = _mm512_shuffle_ps(t[4 * q], t[4 * q + 2], 0x44);
    u[4 * q + 1] = _mm512_shuffle_ps(t[4 * q], t[4 * q + 2], 0xEE);
    u[4 * q + 2] = _mm512_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0x44);
    u[4 * q + 3] = _mm512_shuffle_ps(t[4 * q + 1], t[4 * q + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {  // column 4L + j gathers lane L of u[j], u[4+j], u[8+j], u[12+j]
    const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
    const __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
    out[j] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    out[4 + j] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    out[8 + j] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    out[12 + j] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

template <>
struct Block<4> {
  static constexpr int kV = 16;
  template <bool kStream>
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m512 r[16], out[16];
    for (int i = 0; i < 16; ++i) {
      r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(src + i * ld_src));
    }
    transpose_16x16(r, out);
    for (int c = 0; c < 16; ++c) store<kStream>(dst + c * ld_dst, out[c]);
  }
};

// 32 x 32 units of 16 bits: rows 2i and 2i+1 interleaved form 32-bit units (one per column), so
// the block is two 16 x 16 transposes of 32-bit units, each giving 16 whole 64-byte output rows.
template <>
struct Block<2> {
  static constexpr int kV = 32;
  template <bool kStream>
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m512 lo[16], hi[16], out[16];
    for (int i = 0; i < 16; ++i) {
      const __m512i a = _mm512_loadu_si512(src + (2 * i) * ld_src);
      const __m512i b = _mm512_loadu_si512(src + (2 * i + 1) * ld_src);
      // lane k = 4L + m of lo[i]: rows (2i, 2i+1) of column 8L + m; of hi[i]: column 8L + 4 + m
      lo[i] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(a, b));
      hi[i] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(a, b));
    }
    transpose_16x16(lo, out);
    for (int k = 0; k < 16; ++k) store<kStream>(dst + (8 * (k / 4) + k % 4) * ld_dst, out[k]);
    transpose_16x16(hi, out);
    for (int k = 0; k < 16; ++k) store<kStream>(dst + (8 * (k / 4) + 4 + k % 4) * ld_dst, out[k]);
  }
};
#else
template <>
struct Block<4> {
  static constexpr int kV = 8;
  template <bool kStream>
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) {
      r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(src + i * ld_src));
    }
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
      store<kStream>(dst + c * ld_dst, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
      store<kStream>(dst + (c + 4) * ld_dst, _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
    }
  }
};
#endif

template <>
struct Block<8> {
  static constexpr int kV = 4;
  template <bool kStream>
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m256d r[4];
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm256_loadu_pd(reinterpret_cast<const double*>(src + i * ld_src));
    }
    const __m256d lo01 = _mm256_unpacklo_pd(r[0], r[1]);  // columns 0 | 2 of rows 0, 1
    const __m256d hi01 = _mm256_unpackhi_pd(r[0], r[1]);  // columns 1 | 3
    const __m256d lo23 = _mm256_unpacklo_pd(r[2], r[3]);
    const __m256d hi23 = _mm256_unpackhi_pd(r[2], r[3]);
    store<kStream>(dst, _mm256_permute2f128_pd(lo01, lo23, 0x20));
    store<kStream>(dst + ld_dst, _mm256_permute2f128_pd(hi01, hi23, 0x20));
    store<kStream>(dst + 2 * ld_dst, _mm256_permute2f128_pd(lo01, lo23, 0x31));
    store<kStream>(dst + 3 * ld_dst, _mm256_permute2f128_pd(hi01, hi23, 0x31));
  }
};

#ifndef CPU_CAPABILITY_AVX512
template <>
struct Block<2> {
  static constexpr int kV = 8;
  template <bool kStream>
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m128i r[8], s[8], q[8];
    for (int i = 0; i < 8; ++i) {
      r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
    }
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
      store<kStream>(dst + (2 * c) * ld_dst, _mm_unpacklo_epi64(q[c], q[4 + c]));
      store<kStream>(dst + (2 * c + 1) * ld_dst, _mm_unpackhi_epi64(q[c], q[4 + c]));
    }
  }
};
#endif

template <>
struct Block<1> {
  static constexpr int kV = 16;
  template <bool kStream>
  static void run(const char* src, int64_t ld_src, char* dst, int64_t ld_dst) {
    __m128i r[16], lo[8], hi[8], c[16];
    for (int i = 0; i < 16; ++i) {
      r[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
    }
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
      // lo01: columns 4g, 4g+1 of rows 0-7; hi01: columns 4g+2, 4g+3; lo23, hi23: rows 8-15
      const __m128i lo01 = _mm_unpacklo_epi32(c[4 * g], c[4 * g + 1]);
      const __m128i hi01 = _mm_unpackhi_epi32(c[4 * g], c[4 * g + 1]);
      const __m128i lo23 = _mm_unpacklo_epi32(c[4 * g + 2], c[4 * g + 3]);
      const __m128i hi23 = _mm_unpackhi_epi32(c[4 * g + 2], c[4 * g + 3]);
      store<kStream>(dst + (4 * g + 0) * ld_dst, _mm_unpacklo_epi64(lo01, lo23));
      store<kStream>(dst + (4 * g + 1) * ld_dst, _mm_unpackhi_epi64(lo01, lo23));
      store<kStream>(dst + (4 * g + 2) * ld_dst, _mm_unpacklo_epi64(hi01, hi23));
      store<kStream>(dst + (4 * g + 3) * ld_dst, _mm_unpackhi_epi64(hi01, hi23));
    }
  }
};

#endif  // OPENNPU_TRANSPOSE_SIMD

// Units of one 64-byte line along A: the tile's width in output rows, so that each output row
// receives whole lines (a band of kBand source rows moved as kBand / kV blocks side by side).
template <int kBytes>
constexpr int64_t band_units() {
  return std::max<int64_t>(Block<kBytes>::kV, kLine / kBytes);
}

// Streams one 64-byte line from an aligned buffer to an aligned destination.
inline void stream_line(char* dst, const char* line) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_si512(reinterpret_cast<__m512i*>(dst),
                      _mm512_load_si512(reinterpret_cast<const __m512i*>(line)));
#elif defined(OPENNPU_TRANSPOSE_SIMD)
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_load_si256(reinterpret_cast<const __m256i*>(line)));
  _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32),
                      _mm256_load_si256(reinterpret_cast<const __m256i*>(line + 32)));
#else
  std::memcpy(dst, line, kLine);
#endif
}

// dst[b * ld_dst + a] = src[a * ld_src + b] (units; the source is contiguous along b): na x nb.
// kStream: dst rows and the band starts are line-aligned; whole lines are streamed out, straight
// from the SIMD blocks when a block row is a line (fp32 on AVX-512), else through a staging
// buffer of kV lines in L1 (streaming stores must not leave lines partly written).
template <int kBytes, bool kStream>
void transpose_tile(const char* src, int64_t ld_src, char* dst, int64_t ld_dst, int64_t na,
                    int64_t nb) {
  constexpr int kV = Block<kBytes>::kV;
  constexpr int64_t kBand = band_units<kBytes>();
  constexpr bool kStage = kStream && kV * kBytes < kLine;
  int64_t a = 0;
  if constexpr (kV > 0) {
    alignas(64) char stage[kStage ? kV * kLine : 1];
    for (; a + kBand <= na; a += kBand) {
      int64_t b = 0;
      for (; b + kV <= nb; b += kV) {
        if constexpr (kStage) {
          for (int64_t sub = 0; sub < kBand; sub += kV) {
            Block<kBytes>::template run<false>(src + (a + sub) * ld_src + b * kBytes, ld_src,
                                               stage + sub * kBytes, kLine);
          }
          for (int r = 0; r < kV; ++r) {
            stream_line(dst + (b + r) * ld_dst + a * kBytes, stage + r * kLine);
          }
        } else {
          for (int64_t sub = a; sub < a + kBand; sub += kV) {
            Block<kBytes>::template run<kStream>(src + sub * ld_src + b * kBytes, ld_src,
                                                 dst + b * ld_dst + sub * kBytes, ld_dst);
          }
        }
      }
      scalar_block<kBytes>(src + a * ld_src + b * kBytes, ld_src, kBytes,
                           dst + b * ld_dst + a * kBytes, ld_dst, kBand, nb - b);
    }
  }
  scalar_block<kBytes>(src + a * ld_src, ld_src, kBytes, dst + a * kBytes, ld_dst, na - a, nb);
}

// Streaming with output rows that are not line-aligned (n_a * kBytes not a multiple of a line):
// each kV x na piece (na * kBytes <= kStagedRowBytes) is transposed into an L1 staging buffer,
// then each output row is written with stream_bytes (common/stream_store.h). Tiles advance along A, so the line a
// tile leaves partial is completed by the next one while it is still in cache.
template <int kBytes>
void transpose_tile_staged(const char* src, int64_t ld_src, char* dst, int64_t ld_dst,
                           int64_t na, int64_t nb) {
  constexpr int kV = Block<kBytes>::kV;
  int64_t b = 0;
  if constexpr (kV > 0) {
    alignas(64) char stage[kV * kStagedRowBytes];
    const int64_t na_blocks = na / kV * kV;
    for (; b + kV <= nb; b += kV) {
      for (int64_t a = 0; a < na_blocks; a += kV) {
        Block<kBytes>::template run<false>(src + a * ld_src + b * kBytes, ld_src,
                                           stage + a * kBytes, kStagedRowBytes);
      }
      scalar_block<kBytes>(src + na_blocks * ld_src + b * kBytes, ld_src, kBytes,
                           stage + na_blocks * kBytes, kStagedRowBytes, na - na_blocks, kV);
      for (int r = 0; r < kV; ++r) {
        stream_bytes(dst + (b + r) * ld_dst, stage + r * kStagedRowBytes, na * kBytes);
      }
    }
  }
  scalar_block<kBytes>(src + b * kBytes, ld_src, kBytes, dst + b * ld_dst, ld_dst, na, nb - b);
}

// Copies one run; kStream: dst and bytes are multiples of a line (streaming stores). Short runs
// are copied inline (a call to memcpy per run of a few hundred bytes costs more than the copy).
template <bool kStream>
inline void copy_run(char* dst, const char* src, int64_t bytes) {
#ifdef OPENNPU_TRANSPOSE_SIMD
  if constexpr (kStream) {
    for (int64_t i = 0; i < bytes; i += kLine) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), lo);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), hi);
    }
    return;
  } else {
    if (bytes <= kInlineRunBytes) {
      int64_t i = 0;
      for (; i + 32 <= bytes; i += 32) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
      }
      std::memcpy(dst + i, src + i, bytes - i);
      return;
    }
  }
#endif
  std::memcpy(dst, src, bytes);
}

// Orders this thread's streaming stores before the parallel region ends.
template <bool kStream>
inline void stream_fence() {
#ifdef OPENNPU_TRANSPOSE_SIMD
  if constexpr (kStream) _mm_sfence();
#endif
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

bool line_aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kLine == 0; }

// Every run of run_bytes by itself, split into chunks; for long runs and the plain copy.
template <bool kStream>
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
                       copy_run<kStream>(dst + r * run_bytes + lo,
                                         src + offset_of(r, sizes, src_strides) + lo, n);
                     }
                     stream_fence<kStream>();
                   });
}

// The tiled cases. A is the output-innermost dim; B the dim with the smallest source stride.
struct Tiling {
  int64_t n_a, s_a;       // size and source stride (bytes) of A; its output stride is run_bytes
  int64_t n_b, s_b, o_b;  // size, source and output strides of B (1, 0, 0 when there is none)
  int64_t t_a, t_b;       // tile sides
  bool b_fastest = false;  // tile order: along B first (else along A first)
  bool staged = false;     // streaming into rows that are not line-aligned
  std::vector<int64_t> batch_sizes, batch_src, batch_dst;  // every other dim
};

template <int kBytes, bool kStream>
void copy_tiles(const char* src, char* dst, const Tiling& g, int64_t run_bytes) {
  int64_t batches = 1;
  for (int64_t s : g.batch_sizes) batches *= s;
  const int64_t tiles_a = div_up(g.n_a, g.t_a), tiles_b = div_up(g.n_b, g.t_b);
  const int64_t tile_bytes = g.t_a * g.t_b * run_bytes;
  const bool runs = run_bytes > kBytes;
  const bool unit_stride_b = !runs && g.s_b == kBytes;
  const bool b_fastest = g.b_fastest;
  at::parallel_for(
      0, batches * tiles_b * tiles_a, std::max<int64_t>(1, kParallelBytes / tile_bytes),
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t batch = i / (tiles_a * tiles_b);
          const int64_t j = i % (tiles_a * tiles_b);
          const int64_t ia = b_fastest ? j / tiles_b : j % tiles_a;
          const int64_t ib = b_fastest ? j % tiles_b : j / tiles_a;
          const int64_t a0 = ia * g.t_a, b0 = ib * g.t_b;
          const int64_t na = std::min(g.t_a, g.n_a - a0), nb = std::min(g.t_b, g.n_b - b0);
          const char* s =
              src + offset_of(batch, g.batch_sizes, g.batch_src) + a0 * g.s_a + b0 * g.s_b;
          char* d =
              dst + offset_of(batch, g.batch_sizes, g.batch_dst) + b0 * g.o_b + a0 * run_bytes;
          if (runs) {
            for (int64_t b = 0; b < nb; ++b) {
              for (int64_t a = 0; a < na; ++a) {
                copy_run<kStream>(d + b * g.o_b + a * run_bytes, s + a * g.s_a + b * g.s_b,
                                  run_bytes);
              }
            }
          } else if (unit_stride_b && kStream && g.staged) {
            transpose_tile_staged<kBytes>(s, g.s_a, d, g.o_b, na, nb);
          } else if (unit_stride_b) {
            transpose_tile<kBytes, kStream>(s, g.s_a, d, g.o_b, na, nb);
          } else {
            scalar_block<kBytes>(s, g.s_a, g.s_b, d, g.o_b, na, nb);
          }
        }
        stream_fence<kStream>();
      });
}

template <int kBytes>
void permute_copy_impl(const char* src, char* dst, const CopyPlan& plan) {
  const int64_t run_bytes = plan.run * kBytes;
  const int64_t k = static_cast<int64_t>(plan.sizes.size());
  std::vector<int64_t> src_strides(plan.src_strides);  // in bytes from here on
  for (auto& s : src_strides) s *= kBytes;
  int64_t total = run_bytes;
  for (int64_t s : plan.sizes) total *= s;
  const bool big = total >= stream_min_bytes() && line_aligned(dst);
#ifndef OPENNPU_TRANSPOSE_SIMD
  constexpr bool kCanStream = false;
#else
  constexpr bool kCanStream = true;
#endif

  // Run copies write the output sequentially: stream only into pages that are mapped already.
  const bool stream_runs = kCanStream && big && run_bytes % kLine == 0 &&
                           pages_resident(dst, total);
  if (k == 0 || run_bytes >= kLongRunBytes) {
    if (stream_runs) {
      copy_long_runs<kCanStream>(src, dst, plan.sizes, src_strides, run_bytes);
    } else {
      copy_long_runs<false>(src, dst, plan.sizes, src_strides, run_bytes);
    }
    return;
  }
  std::vector<int64_t> dst_strides(k);
  for (int64_t d = k - 1, acc = run_bytes; d >= 0; --d) {
    dst_strides[d] = acc;
    acc *= plan.sizes[d];
  }
  Tiling g;
  const int64_t a_dim = k - 1;
  int64_t b_dim = -1;
  for (int64_t d = 0; d < a_dim; ++d) {
    if (b_dim < 0 || src_strides[d] <= src_strides[b_dim]) b_dim = d;
  }
  g.n_a = plan.sizes[a_dim];
  g.s_a = src_strides[a_dim];
  g.n_b = b_dim < 0 ? 1 : plan.sizes[b_dim];
  g.s_b = b_dim < 0 ? 0 : src_strides[b_dim];
  g.o_b = b_dim < 0 ? 0 : dst_strides[b_dim];
  for (int64_t d = 0; d < a_dim; ++d) {
    if (d == b_dim) continue;
    g.batch_sizes.push_back(plan.sizes[d]);
    g.batch_src.push_back(src_strides[d]);
    g.batch_dst.push_back(dst_strides[d]);
  }

  if (plan.run > 1) {
    const int64_t side = std::max<int64_t>(1, kRunTileSideBytes / run_bytes);
    g.t_a = std::min(side, g.n_a);
    g.t_b = std::min(side, g.n_b);
    if (stream_runs) {
      copy_tiles<kBytes, kCanStream>(src, dst, g, run_bytes);
    } else {
      copy_tiles<kBytes, false>(src, dst, g, run_bytes);
    }
    return;
  }
  // Element transpose. Streaming needs every output row segment a band writes to start on a
  // line: line-aligned output rows (n_a * kBytes, the stride of every outer output dim, a
  // multiple of a line). Then a tile is one output line (kBand source rows) by 4 KiB of source
  // row, A first: long sequential reads, whole lines streamed out. With ordinary stores the
  // mirror image measured faster: ~one source line by up to 2048 source rows, B first, so each
  // output row receives a long sequential run per tile.
  constexpr int64_t kBand = band_units<kBytes>();
  if (kCanStream && big && Block<kBytes>::kV > 0 && (g.n_a * kBytes) % kLine == 0) {
    g.t_a = std::min(kBand, g.n_a);
    g.t_b = std::min(kStreamTileRowBytes / kBytes, g.n_b);
    copy_tiles<kBytes, kCanStream>(src, dst, g, run_bytes);
  } else if (kCanStream && big && Block<kBytes>::kV > 0) {
    g.t_a = std::min(kStagedRowBytes / kBytes, g.n_a);
    const int64_t depth = std::max<int64_t>(Block<kBytes>::kV, kStagedTileBytes / (g.t_a * kBytes));
    g.t_b = std::min(depth, g.n_b);
    g.staged = true;
    copy_tiles<kBytes, kCanStream>(src, dst, g, run_bytes);
  } else {
    g.t_a = std::min(kPlainTileRows, g.n_a);
    g.t_b = std::min(std::max(kLine, kTileBytes / g.t_a) / kBytes, g.n_b);
    g.b_fastest = true;
    copy_tiles<kBytes, false>(src, dst, g, run_bytes);
  }
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

// The streaming copy of the roofline: each thread streams one contiguous span (whole lines; the
// partial line at either end of a span stored normally), then fences.
void stream_copy_kernel(const char* src, char* dst, int64_t bytes) {
  at::parallel_for(0, bytes, kParallelBytes, [&](int64_t begin, int64_t end) {
    stream_bytes(dst + begin, src + begin, end - begin);
    ::opennpu::stream_fence();
  });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(permute_copy, &permute_copy_kernel);
OPENNPU_REGISTER_CPU_SLOT(stream_copy, &stream_copy_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::transpose
