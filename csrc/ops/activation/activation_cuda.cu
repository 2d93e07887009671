// CUDA kernels of the activation family: the GLU (npu_swiglu, npu_geglu, _silu_mul) and unary
// (fast_gelu) forward and backward slots, and the CUDA registration of the family's entry points
// (validation and allocation are activation.cpp's, shared with the CPU).
//
// Numerics as on the CPU (act_math.h): fp16/bf16 loaded into fp32 (opmath), the activation and
// its product computed there, each output rounded once. Every sigmoid-gated form is
// act(z) = z * s, act'(z) = s + z * s * (1 - s) * u'(z), s = sigmoid(u(z)); exact GELU uses the
// normal cdf and pdf. Elementwise over [outer, m], a grid-stride loop, 64-bit indices; a thread
// moves 16-byte packs where m, the strides and the pointers allow, else one element.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/cuda_rows.cuh"
#include "ops/activation/activation.h"

namespace opennpu::activation {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ __forceinline__ T sigmoid(T u) {
  return T(1) / (T(1) + exp(-u));
}

// Value and derivative of act at z (T = float or double).
template <typename T>
__device__ __forceinline__ void act_value_grad(Act act, T z, T& value, T& grad) {
  constexpr T kSqrt2OverPi = T(0.79788456080286535588);
  constexpr T kGeluCubic = T(0.044715);
  constexpr T kFastGeluScale = T(1.702);
  constexpr T kInvSqrt2 = T(0.70710678118654752440);
  constexpr T kInvSqrt2Pi = T(0.39894228040143267794);
  constexpr T kGradClampZ = T(200);  // past it the gate's derivative term is 0 (see act_math.h)
  if (act == Act::kGeluErf) {
    const T cdf = T(0.5) * (T(1) + erf(z * kInvSqrt2));
    value = z * cdf;
    grad = cdf + z * kInvSqrt2Pi * exp(T(-0.5) * z * z);
    return;
  }
  T u, du;
  const T zc = fmin(fmax(z, -kGradClampZ), kGradClampZ);
  if (act == Act::kSilu) {
    u = z;
    du = T(1);
  } else if (act == Act::kFastGelu) {
    u = kFastGeluScale * z;
    du = kFastGeluScale;
  } else {  // tanh GELU as z * sigmoid(2 sqrt(2/pi) (z + 0.044715 z^3))
    u = T(2) * kSqrt2OverPi * (z + kGeluCubic * z * z * z);
    du = T(2) * kSqrt2OverPi * (T(1) + T(3) * kGeluCubic * zc * zc);
  }
  const T s = sigmoid(u);
  value = z * s;
  grad = s + zc * s * (T(1) - s) * du;
}

template <typename T>
__device__ __forceinline__ T act_value(Act act, T z) {
  T value, grad;
  act_value_grad(act, z, value, grad);
  return value;
}

template <typename scalar_t>
__global__ void glu_fwd_kernel(const scalar_t* h, const scalar_t* o, int64_t stride, int64_t outer,
                               int64_t m, Act act, scalar_t* out, scalar_t* gelu_out) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t n = outer * m;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / m, j = i - row * m;
    const opmath_t a = act_value(act, static_cast<opmath_t>(h[row * stride + j]));
    out[i] = static_cast<scalar_t>(a * static_cast<opmath_t>(o[row * stride + j]));
    if (gelu_out != nullptr) gelu_out[i] = static_cast<scalar_t>(a);
  }
}

template <typename scalar_t>
__global__ void glu_bwd_kernel(const scalar_t* grad, const scalar_t* h, const scalar_t* o, int64_t stride,
                               int64_t outer, int64_t m, Act act, scalar_t* dh, scalar_t* dout,
                               int64_t dstride) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t n = outer * m;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / m, j = i - row * m;
    opmath_t value, derivative;
    act_value_grad(act, static_cast<opmath_t>(h[row * stride + j]), value, derivative);
    const opmath_t g = static_cast<opmath_t>(grad[i]);
    dh[row * dstride + j] = static_cast<scalar_t>(g * static_cast<opmath_t>(o[row * stride + j]) * derivative);
    dout[row * dstride + j] = static_cast<scalar_t>(g * value);
  }
}

template <typename scalar_t>
__global__ void unary_kernel(const scalar_t* grad, const scalar_t* x, int64_t n, Act act, scalar_t* y) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    opmath_t value, derivative;
    act_value_grad(act, static_cast<opmath_t>(x[i]), value, derivative);
    y[i] = static_cast<scalar_t>(grad == nullptr ? value : static_cast<opmath_t>(grad[i]) * derivative);
  }
}

// The same three kernels with 16-byte packs: a thread owns kVec consecutive elements of one row
// (GLU: of one half's row). Used where m (or n) and every row start allow whole aligned packs.
template <typename scalar_t, int kVec>
__global__ void glu_fwd_packed_kernel(const scalar_t* h, const scalar_t* o, int64_t stride, int64_t outer,
                                      int64_t m, Act act, scalar_t* out, scalar_t* gelu_out) {
  using opmath_t = at::opmath_type<scalar_t>;
  using P = cuda::Pack<scalar_t, kVec>;
  const int64_t row_packs = m / kVec, packs = outer * row_packs;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < packs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = p / row_packs, j = (p - row * row_packs) * kVec;
    const P hv = cuda::load_stream(reinterpret_cast<const P*>(h + row * stride + j));
    const P ov = cuda::load_stream(reinterpret_cast<const P*>(o + row * stride + j));
    P y, a;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const opmath_t value = act_value(act, static_cast<opmath_t>(hv.v[k]));
      a.v[k] = static_cast<scalar_t>(value);
      y.v[k] = static_cast<scalar_t>(value * static_cast<opmath_t>(ov.v[k]));
    }
    cuda::store_stream(reinterpret_cast<P*>(out + p * kVec), y);
    if (gelu_out != nullptr) cuda::store_stream(reinterpret_cast<P*>(gelu_out + p * kVec), a);
  }
}

template <typename scalar_t, int kVec>
__global__ void glu_bwd_packed_kernel(const scalar_t* grad, const scalar_t* h, const scalar_t* o, int64_t stride,
                                      int64_t outer, int64_t m, Act act, scalar_t* dh, scalar_t* dout,
                                      int64_t dstride) {
  using opmath_t = at::opmath_type<scalar_t>;
  using P = cuda::Pack<scalar_t, kVec>;
  const int64_t row_packs = m / kVec, packs = outer * row_packs;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < packs; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = p / row_packs, j = (p - row * row_packs) * kVec;
    const P gv = cuda::load_stream(reinterpret_cast<const P*>(grad + p * kVec));
    const P hv = cuda::load_stream(reinterpret_cast<const P*>(h + row * stride + j));
    const P ov = cuda::load_stream(reinterpret_cast<const P*>(o + row * stride + j));
    P dhv, dov;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      opmath_t value, derivative;
      act_value_grad(act, static_cast<opmath_t>(hv.v[k]), value, derivative);
      const opmath_t g = static_cast<opmath_t>(gv.v[k]);
      dhv.v[k] = static_cast<scalar_t>(g * static_cast<opmath_t>(ov.v[k]) * derivative);
      dov.v[k] = static_cast<scalar_t>(g * value);
    }
    cuda::store_stream(reinterpret_cast<P*>(dh + row * dstride + j), dhv);
    cuda::store_stream(reinterpret_cast<P*>(dout + row * dstride + j), dov);
  }
}

template <typename scalar_t, int kVec>
__global__ void unary_packed_kernel(const scalar_t* grad, const scalar_t* x, int64_t n, Act act, scalar_t* y) {
  using opmath_t = at::opmath_type<scalar_t>;
  using P = cuda::Pack<scalar_t, kVec>;
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < n / kVec; p += int64_t(gridDim.x) * blockDim.x) {
    const P xv = cuda::load_stream(reinterpret_cast<const P*>(x + p * kVec));
    P gv;
    if (grad != nullptr) gv = cuda::load_stream(reinterpret_cast<const P*>(grad + p * kVec));
    P out;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      opmath_t value, derivative;
      act_value_grad(act, static_cast<opmath_t>(xv.v[k]), value, derivative);
      out.v[k] = static_cast<scalar_t>(grad == nullptr ? value : static_cast<opmath_t>(gv.v[k]) * derivative);
    }
    cuda::store_stream(reinterpret_cast<P*>(y + p * kVec), out);
  }
}

// Whole aligned packs of kVec: `counts` (row lengths, strides, offsets) are multiples of kVec and
// every pointer is 16-byte aligned.
template <typename scalar_t>
bool packs_fit(std::initializer_list<int64_t> counts, std::initializer_list<const void*> pointers) {
  constexpr int kVec = cuda::pack_size<scalar_t>();
  for (int64_t c : counts) {
    if (c % kVec != 0) return false;
  }
  for (const void* p : pointers) {
    if (!cuda::aligned_to(p, 16)) return false;
  }
  return true;
}

unsigned blocks_for(int64_t n) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, sms * 32)));
}

template <typename scalar_t>
void launch_unary(const scalar_t* grad, const scalar_t* x, int64_t n, Act act, scalar_t* y) {
  constexpr int kVec = cuda::pack_size<scalar_t>();
  if (packs_fit<scalar_t>({n}, {grad, x, y})) {
    unary_packed_kernel<scalar_t, kVec><<<blocks_for(n / kVec), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        grad, x, n, act, y);
  } else {
    unary_kernel<scalar_t><<<blocks_for(n), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(grad, x, n, act, y);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void glu_fwd_cuda(const GluHalves& x, int64_t outer, int64_t m, Act act, at::Tensor& out, at::Tensor& gelu_out) {
  const c10::cuda::CUDAGuard guard(out.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "glu_fwd_cuda", [&] {
    const scalar_t* h = x.h.const_data_ptr<scalar_t>() + x.h_offset;
    const scalar_t* o = x.o.const_data_ptr<scalar_t>() + x.o_offset;
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    scalar_t* a = gelu_out.defined() ? gelu_out.mutable_data_ptr<scalar_t>() : nullptr;
    constexpr int kVec = cuda::pack_size<scalar_t>();
    if (packs_fit<scalar_t>({m, x.stride}, {h, o, y, a})) {
      glu_fwd_packed_kernel<scalar_t, kVec><<<blocks_for(outer * m / kVec), kThreads, 0,
                                              at::cuda::getCurrentCUDAStream()>>>(h, o, x.stride, outer, m, act, y, a);
    } else {
      glu_fwd_kernel<scalar_t><<<blocks_for(outer * m), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          h, o, x.stride, outer, m, act, y, a);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void glu_bwd_cuda(const at::Tensor& grad, const GluHalves& x, int64_t outer, int64_t m, Act act,
                  const GluHalves& dx) {
  const c10::cuda::CUDAGuard guard(grad.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "glu_bwd_cuda", [&] {
    const scalar_t* g = grad.const_data_ptr<scalar_t>();
    const scalar_t* h = x.h.const_data_ptr<scalar_t>() + x.h_offset;
    const scalar_t* o = x.o.const_data_ptr<scalar_t>() + x.o_offset;
    scalar_t* dh = dx.h.mutable_data_ptr<scalar_t>() + dx.h_offset;
    scalar_t* dout = dx.o.mutable_data_ptr<scalar_t>() + dx.o_offset;
    constexpr int kVec = cuda::pack_size<scalar_t>();
    if (packs_fit<scalar_t>({m, x.stride, dx.stride}, {g, h, o, dh, dout})) {
      glu_bwd_packed_kernel<scalar_t, kVec><<<blocks_for(outer * m / kVec), kThreads, 0,
                                              at::cuda::getCurrentCUDAStream()>>>(g, h, o, x.stride, outer, m, act,
                                                                                  dh, dout, dx.stride);
    } else {
      glu_bwd_kernel<scalar_t><<<blocks_for(outer * m), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          g, h, o, x.stride, outer, m, act, dh, dout, dx.stride);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void unary_fwd_cuda(const at::Tensor& x, Act act, at::Tensor& y) {
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "unary_fwd_cuda", [&] {
    launch_unary<scalar_t>(nullptr, x.const_data_ptr<scalar_t>(), x.numel(), act, y.mutable_data_ptr<scalar_t>());
  });
}

void unary_bwd_cuda(const at::Tensor& grad, const at::Tensor& x, Act act, at::Tensor& dx) {
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "unary_bwd_cuda", [&] {
    launch_unary<scalar_t>(grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), x.numel(), act,
                           dx.mutable_data_ptr<scalar_t>());
  });
}

}  // namespace

OPENNPU_REGISTER_CUDA_SLOT(glu_fwd, &glu_fwd_cuda);
OPENNPU_REGISTER_CUDA_SLOT(glu_bwd, &glu_bwd_cuda);
OPENNPU_REGISTER_CUDA_SLOT(unary_fwd, &unary_fwd_cuda);
OPENNPU_REGISTER_CUDA_SLOT(unary_bwd, &unary_bwd_cuda);

TORCH_LIBRARY_IMPL(npu, CUDA, m) { register_npu_entry_points(m); }

TORCH_LIBRARY_IMPL(opennpu, CUDA, m) { register_opennpu_entry_points(m); }

}  // namespace opennpu::activation
