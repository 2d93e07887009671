// CUDA kernels of the activation family: the GLU (npu_swiglu, npu_geglu, _silu_mul) and unary
// (fast_gelu) forward and backward slots, and the CUDA registration of the family's entry points
// (validation and allocation are activation.cpp's, shared with the CPU).
//
// Numerics as on the CPU (act_math.h): fp16/bf16 loaded into fp32 (opmath), the activation and
// its product computed there, each output rounded once. Every sigmoid-gated form is
// act(z) = z * s, act'(z) = s + z * s * (1 - s) * u'(z), s = sigmoid(u(z)); exact GELU uses the
// normal cdf and pdf. Elementwise over [outer, m], a grid-stride loop, 64-bit indices.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

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

unsigned blocks_for(int64_t n) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, sms * 32)));
}

void glu_fwd_cuda(const GluHalves& x, int64_t outer, int64_t m, Act act, at::Tensor& out, at::Tensor& gelu_out) {
  const c10::cuda::CUDAGuard guard(out.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "glu_fwd_cuda", [&] {
    glu_fwd_kernel<scalar_t><<<blocks_for(outer * m), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.h.const_data_ptr<scalar_t>() + x.h_offset, x.o.const_data_ptr<scalar_t>() + x.o_offset, x.stride,
        outer, m, act, out.mutable_data_ptr<scalar_t>(),
        gelu_out.defined() ? gelu_out.mutable_data_ptr<scalar_t>() : nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void glu_bwd_cuda(const at::Tensor& grad, const GluHalves& x, int64_t outer, int64_t m, Act act,
                  const GluHalves& dx) {
  const c10::cuda::CUDAGuard guard(grad.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "glu_bwd_cuda", [&] {
    glu_bwd_kernel<scalar_t><<<blocks_for(outer * m), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        grad.const_data_ptr<scalar_t>(), x.h.const_data_ptr<scalar_t>() + x.h_offset,
        x.o.const_data_ptr<scalar_t>() + x.o_offset, x.stride, outer, m, act,
        dx.h.mutable_data_ptr<scalar_t>() + dx.h_offset, dx.o.mutable_data_ptr<scalar_t>() + dx.o_offset, dx.stride);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void unary_fwd_cuda(const at::Tensor& x, Act act, at::Tensor& y) {
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "unary_fwd_cuda", [&] {
    unary_kernel<scalar_t><<<blocks_for(x.numel()), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        nullptr, x.const_data_ptr<scalar_t>(), x.numel(), act, y.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void unary_bwd_cuda(const at::Tensor& grad, const at::Tensor& x, Act act, at::Tensor& dx) {
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "unary_bwd_cuda", [&] {
    unary_kernel<scalar_t><<<blocks_for(x.numel()), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), x.numel(), act, dx.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
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
