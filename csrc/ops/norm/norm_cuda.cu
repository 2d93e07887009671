// CUDA kernels of the RMSNorm family (npu_rms_norm and its backward, npu_gemma_rms_norm,
// npu_add_rms_norm(_v2, _cast)) and the CUDA registration of the family's entry points
// (validation and allocation are norm.cpp's, shared with the CPU).
//
// One thread block per row of n elements (a grid-stride loop over rows). Numerics as on the CPU
// (norm_rows.h): fp16/bf16 loaded into fp32 (fp64 stays fp64), sum of squares accumulated there,
// rstd = 1 / sqrt(sum / n + eps) with IEEE division and square root, y = x * rstd * gamma rounded
// once. add_rms_norm rounds x1 + x2 to x1's dtype and normalises that rounded sum. The reduction
// order differs from the CPU's, so fp32 results agree to a few ulps, not bit for bit.
//
// Forward: pass 1 reads the row (keeping up to kCached packs per thread in registers), pass 2
// writes y from the registers, re-reading from L2 only what did not fit. Backward: the same two
// passes for dx; dgamma = sum over rows of dy * x * rstd, accumulated per block (in registers for
// the columns a thread keeps, else in the block's own fp32 row of a [blocks, n] buffer:
// deterministic, no atomics), then summed over blocks.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/cuda_rows.cuh"
#include "ops/norm/norm.h"

namespace opennpu::norm {
namespace {

using cuda::Pack;

constexpr int kCached = 4;  // packs per thread kept in registers between the two passes

// What one forward launch reads and writes; null pointers are the parts an op does not have.
template <typename scalar_t>
struct FwdArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* x1;
  const scalar_t* x2;  // add_rms_norm: the residual; else null
  const acc_t* gamma;
  int64_t rows, n;
  acc_t eps;
  scalar_t* x_sum;  // add_rms_norm: x1 + x2 rounded to scalar_t
  scalar_t* y;
  acc_t* y_acc;  // add_rms_norm_cast: y in the accumulator dtype
  acc_t* rstd;
};

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(cuda::kMaxRowThreads) rms_norm_fwd_kernel(FwdArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, kVec>;
  using G = Pack<acc_t, kVec>;
  __shared__ acc_t shared[32];
  const int64_t stride = int64_t(blockDim.x) * kVec;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t base = row * a.n;
    // Pack k of this thread starts at element threadIdx.x * kVec + k * stride of the row.
    auto load_x = [&](int64_t i) {
      P p = cuda::load_stream(reinterpret_cast<const P*>(a.x1 + base + i));
      if (a.x2 != nullptr) {
        const P q = cuda::load_stream(reinterpret_cast<const P*>(a.x2 + base + i));
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          p.v[j] = static_cast<scalar_t>(static_cast<acc_t>(p.v[j]) + static_cast<acc_t>(q.v[j]));
        }
        cuda::store_stream(reinterpret_cast<P*>(a.x_sum + base + i), p);
      }
      return p;
    };
    P cache[kCached];
    acc_t sum = 0;
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t i = threadIdx.x * int64_t(kVec) + k * stride;
      if (i < a.n) {
        cache[k] = load_x(i);
#pragma unroll
        for (int j = 0; j < kVec; ++j) sum += static_cast<acc_t>(cache[k].v[j]) * static_cast<acc_t>(cache[k].v[j]);
      }
    }
    for (int64_t i = threadIdx.x * int64_t(kVec) + kCached * stride; i < a.n; i += stride) {
      const P p = load_x(i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum += static_cast<acc_t>(p.v[j]) * static_cast<acc_t>(p.v[j]);
    }
    sum = cuda::block_reduce(sum, shared, cuda::SumOp{});
    const acc_t rstd = acc_t(1) / sqrt(sum / static_cast<acc_t>(a.n) + a.eps);
    if (threadIdx.x == 0) a.rstd[row] = rstd;

    auto store_y = [&](int64_t i, const P& p) {
      const G g = cuda::load_shared(reinterpret_cast<const G*>(a.gamma + i));
      P out;
      G out_acc;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        out_acc.v[j] = static_cast<acc_t>(p.v[j]) * rstd * g.v[j];
        out.v[j] = static_cast<scalar_t>(out_acc.v[j]);
      }
      cuda::store_stream(reinterpret_cast<P*>(a.y + base + i), out);
      if (a.y_acc != nullptr) cuda::store_stream(reinterpret_cast<G*>(a.y_acc + base + i), out_acc);
    };
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t i = threadIdx.x * int64_t(kVec) + k * stride;
      if (i < a.n) store_y(i, cache[k]);
    }
    // This thread wrote x_sum's packs itself in pass 1, so it reads back its own stores.
    const scalar_t* again = a.x2 != nullptr ? a.x_sum : a.x1;
    for (int64_t i = threadIdx.x * int64_t(kVec) + kCached * stride; i < a.n; i += stride) {
      store_y(i, *reinterpret_cast<const P*>(again + base + i));
    }
  }
}

template <typename scalar_t>
struct BwdArgs {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* dy;
  const scalar_t* x;
  const acc_t* gamma;
  const acc_t* rstd;
  int64_t rows, n;
  scalar_t* dx;
  acc_t* dgamma_rows;  // [gridDim.x, n], zero-filled
};

template <typename scalar_t, int kVec>
__global__ void __launch_bounds__(cuda::kMaxRowThreads) rms_norm_bwd_kernel(BwdArgs<scalar_t> a) {
  using acc_t = at::opmath_type<scalar_t>;
  using P = Pack<scalar_t, kVec>;
  using G = Pack<acc_t, kVec>;
  __shared__ acc_t shared[32];
  const int64_t stride = int64_t(blockDim.x) * kVec;
  const int64_t first = threadIdx.x * int64_t(kVec);
  acc_t* dgamma = a.dgamma_rows + blockIdx.x * a.n;
  // A thread owns the same columns in every row: dgamma of its first kCached packs is summed over
  // the block's rows in registers and stored once; columns past them add into the block's row.
  acc_t dgamma_cached[kCached][kVec] = {};
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t base = row * a.n;
    P dy_cached[kCached], x_cached[kCached];
    acc_t dot = 0;  // sum(dy * gamma * x)
    auto add_dot = [&](const P& d, const P& x, int64_t i) {
      const G g = cuda::load_shared(reinterpret_cast<const G*>(a.gamma + i));
#pragma unroll
      for (int j = 0; j < kVec; ++j) dot += static_cast<acc_t>(d.v[j]) * g.v[j] * static_cast<acc_t>(x.v[j]);
    };
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t i = first + k * stride;
      if (i < a.n) {
        dy_cached[k] = *reinterpret_cast<const P*>(a.dy + base + i);
        x_cached[k] = *reinterpret_cast<const P*>(a.x + base + i);
        add_dot(dy_cached[k], x_cached[k], i);
      }
    }
    for (int64_t i = first + kCached * stride; i < a.n; i += stride) {
      add_dot(*reinterpret_cast<const P*>(a.dy + base + i), *reinterpret_cast<const P*>(a.x + base + i), i);
    }
    dot = cuda::block_reduce(dot, shared, cuda::SumOp{});
    const acc_t rs = a.rstd[row];
    const acc_t coef = rs * rs * rs * dot / static_cast<acc_t>(a.n);
    // dx = dy * gamma * rstd - x * coef; returns dy * x * rstd, this row's dgamma terms.
    auto write_dx = [&](const P& d, const P& x, int64_t i, acc_t (&terms)[kVec]) {
      const G g = cuda::load_shared(reinterpret_cast<const G*>(a.gamma + i));
      P out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const acc_t dj = static_cast<acc_t>(d.v[j]), xj = static_cast<acc_t>(x.v[j]);
        out.v[j] = static_cast<scalar_t>(dj * g.v[j] * rs - xj * coef);
        terms[j] = dj * xj * rs;
      }
      cuda::store_stream(reinterpret_cast<P*>(a.dx + base + i), out);
    };
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t i = first + k * stride;
      if (i < a.n) {
        acc_t terms[kVec];
        write_dx(dy_cached[k], x_cached[k], i, terms);
#pragma unroll
        for (int j = 0; j < kVec; ++j) dgamma_cached[k][j] += terms[j];
      }
    }
    for (int64_t i = first + kCached * stride; i < a.n; i += stride) {
      acc_t terms[kVec];
      write_dx(*reinterpret_cast<const P*>(a.dy + base + i), *reinterpret_cast<const P*>(a.x + base + i), i, terms);
      G sum = *reinterpret_cast<const G*>(dgamma + i);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum.v[j] += terms[j];
      *reinterpret_cast<G*>(dgamma + i) = sum;
    }
  }
#pragma unroll
  for (int k = 0; k < kCached; ++k) {
    const int64_t i = first + k * stride;
    if (i < a.n) {
      G sum;
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum.v[j] = dgamma_cached[k][j];
      *reinterpret_cast<G*>(dgamma + i) = sum;
    }
  }
}

// Launches kernel<kVec> with 16-byte packs where n and every pointer allow, else one element per
// step. The accumulator-dtype tensors (gamma, y_acc) need packs of kVec acc_t aligned too.
template <typename scalar_t, typename Launch>
void with_pack_width(int64_t n, std::initializer_list<const void*> io, std::initializer_list<const void*> acc_io,
                     const Launch& launch) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kVec = cuda::pack_size<scalar_t>();
  bool packed = n % kVec == 0;
  for (const void* p : io) packed = packed && cuda::aligned_to(p, sizeof(scalar_t) * kVec);
  for (const void* p : acc_io) packed = packed && cuda::aligned_to(p, sizeof(acc_t) * kVec);
  if (packed) {
    launch(std::integral_constant<int, kVec>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

template <typename scalar_t>
void launch_fwd(const FwdArgs<scalar_t>& a) {
  with_pack_width<scalar_t>(a.n, {a.x1, a.x2, a.x_sum, a.y}, {a.gamma, a.y_acc}, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    const int threads = cuda::threads_for_row((a.n + kVec - 1) / kVec / kCached);
    rms_norm_fwd_kernel<scalar_t, kVec><<<cuda::blocks_for_rows(a.rows, threads), threads, 0,
                                          at::cuda::getCurrentCUDAStream()>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename scalar_t>
FwdArgs<scalar_t> fwd_args(const at::Tensor& x1, const at::Tensor& gamma, double eps, at::Tensor& y,
                           at::Tensor& rstd) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n = gamma.numel();
  return FwdArgs<scalar_t>{x1.const_data_ptr<scalar_t>(), nullptr, gamma.const_data_ptr<acc_t>(),
                           x1.numel() / n, n, static_cast<acc_t>(eps), nullptr,
                           y.mutable_data_ptr<scalar_t>(), nullptr, rstd.mutable_data_ptr<acc_t>()};
}

void rms_norm_fwd_cuda(const at::Tensor& x, const at::Tensor& gamma, double eps, at::Tensor& y, at::Tensor& rstd) {
  const c10::cuda::CUDAGuard guard(x.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "npu_rms_norm", [&] {
    launch_fwd(fwd_args<scalar_t>(x, gamma, eps, y, rstd));
  });
}

void add_rms_norm_fwd_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& gamma, double eps,
                           at::Tensor& y, at::Tensor& rstd, at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x1.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x1.scalar_type(), "npu_add_rms_norm", [&] {
    auto a = fwd_args<scalar_t>(x1, gamma, eps, y, rstd);
    a.x2 = x2.const_data_ptr<scalar_t>();
    a.x_sum = x.mutable_data_ptr<scalar_t>();
    launch_fwd(a);
  });
}

void add_rms_norm_cast_fwd_cuda(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& gamma, double eps,
                                at::Tensor& y1, at::Tensor& y2, at::Tensor& rstd, at::Tensor& x) {
  const c10::cuda::CUDAGuard guard(x1.device());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x1.scalar_type(), "npu_add_rms_norm_cast", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto a = fwd_args<scalar_t>(x1, gamma, eps, y2, rstd);
    a.x2 = x2.const_data_ptr<scalar_t>();
    a.x_sum = x.mutable_data_ptr<scalar_t>();
    a.y_acc = y1.mutable_data_ptr<acc_t>();
    launch_fwd(a);
  });
}

void rms_norm_bwd_cuda(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gamma, const at::Tensor& rstd,
                       at::Tensor& dx, at::Tensor& dgamma) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = gamma.numel();
  const int64_t rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "npu_rms_norm_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    BwdArgs<scalar_t> a{dy.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), gamma.const_data_ptr<acc_t>(),
                        rstd.const_data_ptr<acc_t>(), rows, n, dx.mutable_data_ptr<scalar_t>(), nullptr};
    with_pack_width<scalar_t>(n, {a.dy, a.x, a.dx}, {a.gamma}, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      const int threads = cuda::threads_for_row((n + kVec * kCached - 1) / (kVec * kCached));
      // Half the forward's blocks at most: each adds its own [n] dgamma row, summed after.
      const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(rows, sms * std::max(1, 1024 / threads)));
      // Packs of dgamma rows stay aligned: the buffer is fresh and n is a multiple of kVec.
      at::Tensor dgamma_rows = at::zeros({blocks, n}, dgamma.options());
      a.dgamma_rows = dgamma_rows.mutable_data_ptr<acc_t>();
      rms_norm_bwd_kernel<scalar_t, kVec><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      at::Tensor dgamma_flat = dgamma.view({n});
      at::sum_out(dgamma_flat, dgamma_rows, /*dim=*/0);
    });
  });
}

}  // namespace

OPENNPU_REGISTER_CUDA_SLOT(rms_norm_fwd, &rms_norm_fwd_cuda);
OPENNPU_REGISTER_CUDA_SLOT(add_rms_norm_fwd, &add_rms_norm_fwd_cuda);
OPENNPU_REGISTER_CUDA_SLOT(add_rms_norm_cast_fwd, &add_rms_norm_cast_fwd_cuda);
OPENNPU_REGISTER_CUDA_SLOT(rms_norm_bwd, &rms_norm_bwd_cuda);

TORCH_LIBRARY_IMPL(npu, CUDA, m) { register_npu_entry_points(m); }

}  // namespace opennpu::norm
