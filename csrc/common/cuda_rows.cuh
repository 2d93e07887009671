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
