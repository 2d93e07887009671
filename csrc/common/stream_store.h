// Non-temporal (streaming) stores for the outputs of memory-bound CPU kernels.
//
// An ordinary store to a line that is not in cache first reads the line (read-for-ownership):
// a kernel reading one tensor and writing one moves three bytes over the memory bus for every two
// it needs. A streaming store skips that read, so an output far larger than the last-level cache
// (which would not stay there for the next op anyway) costs only its write. Smaller outputs keep
// ordinary stores: the next op finds them in cache.
//
// The policy, in one place:
// - stream_output(out, bytes): stream an output of `bytes` at `out` when bytes >= stream_min_bytes()
//   (default: the last-level cache size, queried once; 16 MiB when the system does not say;
//   OPENNPU_STREAM_MIN_BYTES, read once, overrides it) and
//   its pages are mapped already (pages_resident: a freshly mapped output is zeroed by the kernel
//   on first touch, which leaves its lines in cache for streaming stores to evict; ordinary stores
//   are faster there).
// - Only whole 64-byte lines are streamed, each line by streaming stores alone (a line written
//   partly by streaming and partly by ordinary stores is flushed from the write-combining buffer
//   half full, and costs a read after all). for_each_output_step splits a row into its head (up to
//   the first line boundary), the whole lines (full vector steps, each 32-byte aligned at least:
//   the alignment _mm256_stream_* needs) and the tail; head and tail use ordinary stores. This
//   needs the elementwise results not to depend on how a row is cut into steps, which holds for
//   the elementwise passes that write outputs (a reduction keeps its own for_each_step).
// - A streamed output must not be read again by the kernel soon after (a streaming store evicts
//   the line): kernels that read their output back (add_rms_norm's sum) keep an L1 copy and stream
//   that with stream_bytes.
// - Each thread that streamed calls stream_fence() before its parallel chunk ends (sfence: orders
//   its streaming stores before what follows the kernel).
//
// The first part (the policy) is host code, usable anywhere; the second (the stores) is included
// only into <family>_cpu.cpp files, which are compiled once per ISA (CPU_CAPABILITY defined).
#pragma once

#include <cstdint>

namespace opennpu {

// Bytes of the last-level data cache one core shares (/sys, then sysconf; 0 when neither says).
// Queried once.
int64_t last_level_cache_bytes();

// Outputs at least this large are streamed (see stream_output). Default: last_level_cache_bytes(),
// or kDefaultStreamMinBytes when it is unknown.
constexpr int64_t kDefaultStreamMinBytes = int64_t{16} << 20;
int64_t stream_min_bytes();
// Sets the threshold (< 0: back to the default) and returns the previous one; tests use it to
// reach the streaming paths with small tensors (torch.ops.opennpu._set_stream_min_bytes).
int64_t set_stream_min_bytes(int64_t bytes);

// Whether the pages of [p, p + n) are mapped already (three interior pages are probed: malloc
// itself touches the first and the last page). True where the system cannot tell.
bool pages_resident(const void* p, int64_t n);

// Whether an output of `bytes` at `out` should be written with streaming stores.
inline bool stream_output(const void* out, int64_t bytes) {
  return bytes > 0 && bytes >= stream_min_bytes() && pages_resident(out, bytes);
}

constexpr int64_t kLineBytes = 64;

}  // namespace opennpu

#if defined(CPU_CAPABILITY)

#include <cstring>

#include "common/vec.h"

namespace opennpu {
inline namespace CPU_CAPABILITY {

// Stores one full step (kStep elements: 2 accumulator vectors) with streaming stores; p must be
// aligned to the stored vector width (32 bytes on AVX2, 64 on AVX-512). kNative: bf16 rounded as
// by store_pair<true>. Types without a streaming form (fp64 here) get ordinary stores.
template <bool kNative = false, typename scalar_t>
OPENNPU_VEC_INLINE void stream_step(scalar_t* p, const AccVec<scalar_t>& a,
                                    const AccVec<scalar_t>& b) {
  using Vec = AccVec<scalar_t>;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kNative && std::is_same_v<scalar_t, at::BFloat16>) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), bf16_native(a, b));
    return;
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    _mm512_stream_ps(p, a);
    _mm512_stream_ps(p + Vec::size(), b);
    return;
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>) {
    const __m512i packed = at::vec::convert_from_float<scalar_t>(a, b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), packed);
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<scalar_t, float>) {
    _mm256_stream_ps(p, a);
    _mm256_stream_ps(p + Vec::size(), b);
    return;
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>) {
    const __m256i packed = at::vec::convert_from_float<scalar_t>(a, b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), packed);
    return;
  }
#endif
  VecPair<scalar_t>::store(p, a, b);
}

// The store of one step of for_each_output_step: streaming where `streamed`, else ordinary
// (the first len elements).
template <bool kNative = false, typename scalar_t>
OPENNPU_VEC_INLINE void store_output(scalar_t* p, const AccVec<scalar_t>& a,
                                     const AccVec<scalar_t>& b, int64_t len, bool streamed) {
  if (streamed) {
    stream_step<kNative>(p, a, b);
  } else {
    store_pair<kNative>(p, a, b, len);
  }
}

// Copies one step of a row (len <= kStep elements) from src to dst bit for bit: streamed where
// `streamed` (then len == kStep and dst is aligned to the vector width, as for store_output),
// else ordinary stores.
template <typename scalar_t>
OPENNPU_VEC_INLINE void copy_output(scalar_t* dst, const scalar_t* src, int64_t len,
                                    bool streamed) {
  constexpr int64_t kBytes = VecPair<scalar_t>::kStep * static_cast<int64_t>(sizeof(scalar_t));
  if (!streamed) {
    std::memcpy(dst, src, len * sizeof(scalar_t));
    return;
  }
  char* d = reinterpret_cast<char*>(dst);
  const char* s = reinterpret_cast<const char*>(src);
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(kBytes % 64 == 0);
  for (int64_t b = 0; b < kBytes; b += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + b), _mm512_loadu_si512(s + b));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  static_assert(kBytes % 32 == 0);
  for (int64_t b = 0; b < kBytes; b += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + b),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + b)));
  }
#else
  std::memcpy(d, s, kBytes);
#endif
}

// Prefetches the cache lines of one step (VecPair<scalar_t>::kStep elements) at p, into L1
// (kLocality 3) or L2 (2), __builtin_prefetch's locality. A prefetch never faults, so the step
// may run past the end of a row.
template <int kLocality, typename scalar_t>
OPENNPU_VEC_INLINE void prefetch_step(const scalar_t* p) {
  constexpr int64_t kBytes = VecPair<scalar_t>::kStep * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t b = 0; b < kBytes; b += kLineBytes) {
    __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, kLocality);
  }
}

// Whether a and b sit at the same offset within a cache line (one for_each_output_step split
// then serves both).
inline bool same_line_offset(const void* a, const void* b) {
  return reinterpret_cast<uintptr_t>(a) % kLineBytes == reinterpret_cast<uintptr_t>(b) % kLineBytes;
}

// Orders this thread's streaming stores before whatever follows the kernel.
inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// Whether p is aligned to a cache line.
inline bool stream_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % kLineBytes == 0;
}

// Calls body(i, len, streamed) over the steps of an output row y[0, n), like for_each_step.
// Without `stream`, exactly for_each_step's steps, none streamed. With it: the head up to y's
// first line boundary, then full steps over the whole lines after it (streamed: pass them to
// store_output), then the tail, head and tail in steps of at most kStep (never streamed).
template <typename scalar_t, typename Body>
inline void for_each_output_step(const scalar_t* y, int64_t n, bool stream, const Body& body) {
  constexpr int64_t kStep = VecPair<scalar_t>::kStep;
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(scalar_t));
  const auto address = reinterpret_cast<uintptr_t>(y);
  if (!stream || kLineBytes % kSize != 0 || address % kSize != 0) {
    for_each_step<scalar_t>(n, [&](int64_t i, int64_t len) { body(i, len, false); });
    return;
  }
  const int64_t head =
      std::min<int64_t>(n, static_cast<int64_t>((kLineBytes - address % kLineBytes) % kLineBytes) / kSize);
  const int64_t lines_end = head + (n - head) * kSize / kLineBytes * kLineBytes / kSize;
  auto plain = [&](int64_t from, int64_t to) {
    for (int64_t i = from; i < to; i += kStep) body(i, std::min(kStep, to - i), false);
  };
  plain(0, head);
  int64_t i = head;
  // Full steps within whole lines: streamed (their start is line-aligned plus a multiple of the
  // step, so aligned to the vector width); a last part step covers whole lines, stored normally.
  for (; i + kStep <= lines_end; i += kStep) body(i, kStep, true);
  plain(i, n);
}

// n bytes from src to dst: whole lines of dst streamed, the partial line at each end stored
// normally. (The streaming copy of the roofline, and of kernels that stream a row they keep in L1.)
inline void stream_bytes(char* dst, const char* src, int64_t n) {
  const int64_t misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % kLineBytes);
  const int64_t head = std::min(n, (kLineBytes - misalign) % kLineBytes);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + kLineBytes <= n; i += kLineBytes) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#elif defined(CPU_CAPABILITY_AVX2)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32)));
#else
    std::memcpy(dst + i, src + i, kLineBytes);  // no streaming stores without SIMD: a plain copy
#endif
  }
  std::memcpy(dst + i, src + i, n - i);
}

}  // namespace CPU_CAPABILITY
}  // namespace opennpu

#endif  // CPU_CAPABILITY
