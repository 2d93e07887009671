// Building blocks of the row kernels in csrc/ops/<family>/<family>_cuda.cu: vector packs, block
// reductions and launch shapes. A row kernel gives one thread block a row of n contiguous
// elements; each thread walks the row in packs of kVec elements (16 bytes of the input dtype)
// when every pointer is aligned to a pack and n is a multiple of kVec, else one element at a time.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace opennpu::cuda {

// kVec elements loaded or stored with one (or, for 32-byte packs, two) vector instructions.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// Elements of T in one 16-byte pack.
template <typename T>
constexpr int pack_size() {
  return static_cast<int>(16 / sizeof(T));
}

// Loads and stores with cache hints, for packs of 2, 4, 8, 16 or 32 bytes (other sizes: plain):
// load_stream / store_stream for data each kernel touches once (evict first: it should not push
// out what is reused), load_shared for what every row reads again (gamma, cos / sin tables:
// the read-only path, kept in L1).
template <int kBytes>
struct WordOf {
  using type = void;  // no cache-hint intrinsic for this size: plain loads and stores
};
template <>
struct WordOf<16> {
  using type = uint4;
};
template <>
struct WordOf<8> {
  using type = uint2;
};
template <>
struct WordOf<4> {
  using type = unsigned int;
};
template <>
struct WordOf<2> {
  using type = unsigned short;
};
// The word a pack moves in: 16 bytes for packs of 16 or 32 bytes, else the pack's own size.
template <typename P>
using PackWord = typename WordOf<sizeof(P) % 16 == 0 ? 16 : static_cast<int>(sizeof(P))>::type;

// A pack loaded word by word with load_word (an intrinsic's wrapper), or plainly.
template <typename P, typename LoadWord>
__device__ __forceinline__ P load_pack(const P* p, const LoadWord& load_word) {
  using Word = PackWord<P>;
  if constexpr (std::is_void_v<Word>) {
    return *p;
  } else {
    P out;
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(P) / sizeof(Word)); ++i) {
      reinterpret_cast<Word*>(&out)[i] = load_word(reinterpret_cast<const Word*>(p) + i);
    }
    return out;
  }
}

template <typename P>
__device__ __forceinline__ P load_stream(const P* p) {
  return load_pack(p, [](const auto* word) { return __ldcs(word); });
}

template <typename P>
__device__ __forceinline__ P load_shared(const P* p) {
  return load_pack(p, [](const auto* word) { return __ldg(word); });
}

template <typename P>
__device__ __forceinline__ void store_stream(P* p, const P& value) {
  using Word = PackWord<P>;
  if constexpr (std::is_void_v<Word>) {
    *p = value;
  } else {
#pragma unroll
    for (int i = 0; i < static_cast<int>(sizeof(P) / sizeof(Word)); ++i) {
      __stcs(reinterpret_cast<Word*>(p) + i, reinterpret_cast<const Word*>(&value)[i]);
    }
  }
}

inline bool aligned_to(const void* p, int64_t bytes) {
  return p == nullptr || reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

// Sum (or max, with a NaN-propagating max) of one value per thread over the block, whose size is
// a multiple of 32, at most 1024. `shared` holds 32 slots; every thread of the block gets the
// result. Safe to call repeatedly.
template <typename T, typename Op>
__device__ __forceinline__ T block_reduce(T value, T* shared, const Op& op) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warps = (blockDim.x + 31) / 32;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  __syncthreads();  // the previous call's readers are done with shared[0]
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < warps ? shared[lane] : Op::template identity<T>();
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
    if (lane == 0) shared[0] = value;
  }
  __syncthreads();
  return shared[0];
}

struct SumOp {
  template <typename T>
  __device__ __forceinline__ static T identity() { return T(0); }
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

// max that returns NaN when either side is NaN (as at::vec::maximum on the CPU).
struct NanMaxOp {
  template <typename T>
  __device__ __forceinline__ static T identity() { return -std::numeric_limits<T>::infinity(); }
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return (a != a || a > b) ? a : b; }
};

// Threads per block for rows of `units` packs: a multiple of 32, at most kMaxRowThreads (row
// kernels declare it as their launch bound, so their registers fit a block that size).
constexpr int kMaxRowThreads = 512;
inline int threads_for_row(int64_t units) {
  const int64_t warps = std::clamp<int64_t>((units + 31) / 32, 1, kMaxRowThreads / 32);
  return static_cast<int>(warps * 32);
}

// Blocks for a grid-stride loop over `rows` rows: every SM busy, at most one block per row.
inline unsigned blocks_for_rows(int64_t rows, int threads) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t per_sm = std::max<int64_t>(1, 2048 / threads);
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, sms * per_sm * 4)));
}

}  // namespace opennpu::cuda
