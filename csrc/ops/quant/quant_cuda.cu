// CUDA kernel of npu_dynamic_quant and its CUDA registration (quant.cpp validates and allocates
// for every device); npu_add_rms_norm_dynamic_quant keeps the portable path on CUDA.
//
// One thread block per row (a grid-stride loop over rows; each thread keeps up to four 16-byte
// steps of its row in registers between the passes), the same numerics as the CPU kernel
// (quant_cpu.cpp): v = x (* smooth) in fp32, pass 1 takes rowmax(|v|) with a NaN-propagating max,
// scale = rowmax / qmax (fp8: rowmax * (1 / qmax), as CANN's golden forms it; 0 becomes 1), pass 2
// writes clamp(round_half_even(v / scale), lo, hi) of the IEEE quotient (multiplied by 1 / scale,
// divided only near ties, see code_of), NaN quotients as code 0;
// float8 codes are the quotient rounded to nearest even by c10's conversion, hifloat8 codes
// (uint8) the quotient through hifloat8.h's encoder, the CPU kernel's. int4 packs eight
// codes per int32, lowest bits first. Per tensor: pass 1 per row into a row buffer, its max on
// the device, then pass 2 with that one scale.
#include <ATen/Dispatch.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include "common/cuda_rows.cuh"
#include "ops/quant/hifloat8.h"
#include "ops/quant/quant.h"

namespace opennpu::quant {
namespace {

using cuda::Pack;

constexpr int kCached = 4;  // steps of a row per thread kept in registers between the two passes

template <typename scalar_t>
struct QuantArgs {
  const scalar_t* x;
  const float* smooth;         // null, [n], or [groups, n]
  const int64_t* group_ends;   // null, or [groups]
  int64_t groups, rows, n;
  QuantSpec spec;
  const float* tensor_absmax;  // per tensor: the max over every row (pass 1 is skipped)
  float* row_absmax;           // per tensor, pass 1 only: each row's max goes here
  void* codes;
  float* scale;
};

template <typename scalar_t>
__device__ __forceinline__ const float* smooth_row(const QuantArgs<scalar_t>& a, int64_t row) {
  if (a.group_ends == nullptr) return a.smooth;
  int64_t lo = 0, hi = a.groups;  // first group whose end is past row
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (a.group_ends[mid] <= row) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return a.smooth + lo * a.n;
}

// kVec elements of v at i, in fp32: 16-byte packs of x (and packs of the smooth row) when
// kPacked, else one element at a time.
template <typename scalar_t, int kVec, bool kPacked>
__device__ __forceinline__ void load_v(const scalar_t* x, const float* smooth, int64_t i, float (&v)[kVec]) {
  if constexpr (kPacked) {
    const Pack<scalar_t, kVec> p = cuda::load_stream(reinterpret_cast<const Pack<scalar_t, kVec>*>(x + i));
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = static_cast<float>(p.v[j]);
    if (smooth != nullptr) {
      const Pack<float, kVec> m = cuda::load_shared(reinterpret_cast<const Pack<float, kVec>*>(smooth + i));
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = __fmul_rn(v[j], m.v[j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[j] = static_cast<float>(x[i + j]);
    if (smooth != nullptr) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[j] = __fmul_rn(v[j], smooth[i + j]);
    }
  }
}

__device__ __forceinline__ float scale_of(float absmax, const QuantSpec& spec) {
  const float s = spec.fp8 != 0 ? __fmul_rn(absmax, __fdiv_rn(1.f, spec.qmax)) : __fdiv_rn(absmax, spec.qmax);
  return s == 0.f ? 1.f : s;
}

// The divisor of a row: its scale, and 1 / scale where that is finite (a subnormal scale has no
// finite inverse; its quotients are divided for real).
struct Divisor {
  float scale, inverse;
  bool by_inverse;
};

__device__ __forceinline__ Divisor divisor_of(float scale) {
  const float inverse = __fdiv_rn(1.f, scale);
  return {scale, inverse, isfinite(inverse)};
}

// clamp(round_half_even(v / scale)) of the IEEE quotient, as the CPU kernel: t = v * (1 / scale)
// is within 2 ulps of v / scale and |t| <= ~127, so unless t lies within 2^-15 of a half-integer
// both round to the same integer; those (ties included) are divided for real. NaN gives code 0.
__device__ __forceinline__ float code_of(float v, const Divisor& d, const QuantSpec& spec) {
  float t;
  if (d.by_inverse) {
    t = __fmul_rn(v, d.inverse);
    if (fabsf(t - floorf(t) - 0.5f) < 1.f / 32768) t = __fdiv_rn(v, d.scale);
  } else {
    t = __fdiv_rn(v, d.scale);
  }
  const float q = fminf(fmaxf(rintf(t), spec.lo), spec.hi);
  return t != t ? 0.f : q;
}

// The codes of kVec values v (of one row, from element i) into the output.
template <typename scalar_t, int kVec>
__device__ __forceinline__ void store_codes(const QuantArgs<scalar_t>& a, int64_t row, int64_t i,
                                            const float (&v)[kVec], const Divisor& d) {
  if (a.spec.fp8 != 0) {
    Pack<uint8_t, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float t = __fdiv_rn(v[j], d.scale);  // float8 / hifloat8: the true quotient
      out.v[j] = a.spec.fp8 == kFp8E4m3   ? c10::Float8_e4m3fn(t).x
                 : a.spec.fp8 == kFp8E5m2 ? c10::Float8_e5m2(t).x
                                          : float_to_hifloat8(t);  // hifloat8.h, as the CPU
    }
    cuda::store_stream(reinterpret_cast<Pack<uint8_t, kVec>*>(static_cast<uint8_t*>(a.codes) + row * a.n + i), out);
  } else if (a.spec.int4) {
    if constexpr (kVec == 8) {
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        word |= (static_cast<uint32_t>(static_cast<int32_t>(code_of(v[j], d, a.spec))) & 0xFu) << (4 * j);
      }
      static_cast<int32_t*>(a.codes)[(row * a.n + i) / 8] = static_cast<int32_t>(word);
    }
  } else {
    Pack<int8_t, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.v[j] = static_cast<int8_t>(code_of(v[j], d, a.spec));
    cuda::store_stream(reinterpret_cast<Pack<int8_t, kVec>*>(static_cast<int8_t*>(a.codes) + row * a.n + i), out);
  }
}

// kVec: elements per step (int4: 8, one int32 word). Pass 1 keeps up to kCached steps of v per
// thread in registers, so pass 2 re-reads from memory only the rest of a long row.
template <typename scalar_t, int kVec, bool kPacked>
__global__ void __launch_bounds__(cuda::kMaxRowThreads) dynamic_quant_kernel(QuantArgs<scalar_t> a) {
  __shared__ float shared[32];
  const int64_t stride = int64_t(blockDim.x) * kVec;
  const int64_t first = threadIdx.x * int64_t(kVec);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const scalar_t* xr = a.x + row * a.n;
    const float* sm = smooth_row(a, row);
    float cache[kCached][kVec];
    float absmax = 0.f;
    if (a.tensor_absmax != nullptr) {
      absmax = *a.tensor_absmax;
#pragma unroll
      for (int k = 0; k < kCached; ++k) {
        if (first + k * stride < a.n) load_v<scalar_t, kVec, kPacked>(xr, sm, first + k * stride, cache[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < kCached; ++k) {
        if (first + k * stride < a.n) {
          load_v<scalar_t, kVec, kPacked>(xr, sm, first + k * stride, cache[k]);
#pragma unroll
          for (int j = 0; j < kVec; ++j) absmax = cuda::NanMaxOp{}(absmax, fabsf(cache[k][j]));
        }
      }
      for (int64_t i = first + kCached * stride; i < a.n; i += stride) {
        float v[kVec];
        load_v<scalar_t, kVec, kPacked>(xr, sm, i, v);
#pragma unroll
        for (int j = 0; j < kVec; ++j) absmax = cuda::NanMaxOp{}(absmax, fabsf(v[j]));
      }
      absmax = cuda::block_reduce(absmax, shared, cuda::NanMaxOp{});
      if (a.row_absmax != nullptr) {  // per tensor, pass 1
        if (threadIdx.x == 0) a.row_absmax[row] = absmax;
        continue;
      }
    }
    const float scale = scale_of(absmax, a.spec);
    if (threadIdx.x == 0 && (a.tensor_absmax == nullptr || row == 0)) a.scale[a.tensor_absmax ? 0 : row] = scale;
    const Divisor d = divisor_of(scale);
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      if (first + k * stride < a.n) store_codes<scalar_t, kVec>(a, row, first + k * stride, cache[k], d);
    }
    for (int64_t i = first + kCached * stride; i < a.n; i += stride) {
      float v[kVec];
      load_v<scalar_t, kVec, kPacked>(xr, sm, i, v);
      store_codes<scalar_t, kVec>(a, row, i, v, d);
    }
  }
}

template <typename scalar_t, int kVec, bool kPacked>
void launch(const QuantArgs<scalar_t>& a) {
  const int threads = cuda::threads_for_row((a.n + kVec * kCached - 1) / (kVec * kCached));
  dynamic_quant_kernel<scalar_t, kVec, kPacked><<<cuda::blocks_for_rows(a.rows, threads), threads, 0,
                                                  at::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// int4: eight elements per step (n is a multiple of 8); int8 / fp8: a 16-byte pack of x where
// n, x and the smooth rows allow, else one element.
template <typename scalar_t>
void launch_any(const QuantArgs<scalar_t>& a) {
  constexpr int kVec = cuda::pack_size<scalar_t>();
  if (a.spec.int4) {  // n is a multiple of 8
    const bool packed = cuda::aligned_to(a.x, sizeof(scalar_t) * 8) && cuda::aligned_to(a.smooth, sizeof(float) * 8);
    packed ? launch<scalar_t, 8, true>(a) : launch<scalar_t, 8, false>(a);
  } else if (a.n % kVec == 0 && cuda::aligned_to(a.x, 16) && cuda::aligned_to(a.smooth, sizeof(float) * kVec)) {
    launch<scalar_t, kVec, true>(a);
  } else {
    launch<scalar_t, 1, false>(a);
  }
}

void dynamic_quant_cuda(const at::Tensor& x, const at::Tensor& smooth, const at::Tensor& group_ends, bool per_tensor,
                        const QuantSpec& spec, at::Tensor& y, at::Tensor& scale) {
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "npu_dynamic_quant", [&] {
    QuantArgs<scalar_t> a{x.const_data_ptr<scalar_t>(),
                          smooth.defined() ? smooth.const_data_ptr<float>() : nullptr,
                          group_ends.defined() ? group_ends.const_data_ptr<int64_t>() : nullptr,
                          group_ends.defined() ? group_ends.numel() : 0,
                          x.size(0), x.size(1), spec, nullptr, nullptr, y.mutable_data_ptr(),
                          scale.mutable_data_ptr<float>()};
    if (!per_tensor) {
      launch_any(a);
      return;
    }
    at::Tensor row_absmax = at::empty({a.rows}, x.options().dtype(at::kFloat));
    a.row_absmax = row_absmax.mutable_data_ptr<float>();
    launch_any(a);
    // amax propagates NaN, as the per-row max does.
    const at::Tensor tensor_absmax = row_absmax.amax();
    a.row_absmax = nullptr;
    a.tensor_absmax = tensor_absmax.const_data_ptr<float>();
    launch_any(a);
  });
}

}  // namespace

OPENNPU_REGISTER_CUDA_SLOT(dynamic_quant, &dynamic_quant_cuda);

TORCH_LIBRARY_IMPL(npu, CUDA, m) { m.impl("npu_dynamic_quant", &npu_dynamic_quant); }

}  // namespace opennpu::quant
