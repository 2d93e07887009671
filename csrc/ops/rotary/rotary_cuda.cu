// CUDA kernels of npu_rotary_mul (forward, backward) and the CUDA registration of the entry
// points built on them: npu_rotary_mul, npu_rotary_mul_backward, npu_interleave_rope,
// npu_apply_rotary_pos_emb and opennpu::_rotary_mul_backward_dx (rotary.cpp validates and
// allocates for every device). npu_kv_rmsnorm_rope_cache keeps the portable path on CUDA.
//
// Every mode rotates pairs of positions (p0, p1) of a row of D = 2h elements:
//   half:        (k, k + h)      interleave: (2k, 2k + 1)        k in [0, h)
//   y[p0] = x[p0] * c[p0] - x[p1] * s[p0],   y[p1] = x[p1] * c[p1] + x[p0] * s[p1]
// de-interleave reads its pair at (2k, 2k + 1) and writes it at (k, k + h), with c / s at the
// output positions. One thread owns one pair of one row, so the in-place forward
// (npu_apply_rotary_pos_emb) reads both lanes before it writes them.
// Backward (dx = c * g - rotate(s * g), dr1 += x * g, dr2 += rotate(x) * g):
//   dx[p0] = c[p0] g[p0] + s[p1] g[p1],  dx[p1] = c[p1] g[p1] - s[p0] g[p0]
//   dr2[p0] += -x[p1] g[p0],             dr2[p1] += x[p0] g[p1]
// dr1 / dr2 sum over the rows that share one r row (the broadcast dims): a block owns one r row
// and a share of those rows, threads along y split the share and reduce in shared memory; with
// several shares per r row (few r rows, e.g. decode), each writes its own partial row, summed
// after. Arithmetic in fp32 (fp64 for fp64), each output rounded once.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>

#include "common/cuda_rows.cuh"
#include "ops/rotary/rotary.h"

namespace opennpu::rotary {
namespace {

constexpr int kMaxDims = 8;

// Leading-dim sizes and the element strides of up to three tensors over them.
struct Dims {
  int nd = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[3][kMaxDims] = {};

  __device__ __forceinline__ void offsets(int64_t row, int64_t (&out)[3]) const {
    out[0] = out[1] = out[2] = 0;
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t i = row % sizes[d];
      row /= sizes[d];
      out[0] += i * strides[0][d];
      out[1] += i * strides[1][d];
      out[2] += i * strides[2][d];
    }
  }
};

// Dims of `sizes` with three stride lists; adjacent dims that every tensor walks as one are
// merged, so common layouts need one or two dims.
Dims make_dims(const char* op, const std::vector<int64_t>& sizes, const std::vector<int64_t>* strides[3]) {
  Dims dims;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1) continue;
    const int last = dims.nd - 1;
    bool merge = last >= 0;
    for (int t = 0; merge && t < 3; ++t) merge = dims.strides[t][last] == (*strides[t])[d] * sizes[d];
    if (merge) {
      dims.sizes[last] *= sizes[d];
      for (int t = 0; t < 3; ++t) dims.strides[t][last] = (*strides[t])[d];
      continue;
    }
    TORCH_CHECK(dims.nd < kMaxDims, op, ": the CUDA kernel takes at most ", kMaxDims,
                " leading dims that cannot be merged, but 'self' has more");
    dims.sizes[dims.nd] = sizes[d];
    for (int t = 0; t < 3; ++t) dims.strides[t][dims.nd] = (*strides[t])[d];
    ++dims.nd;
  }
  return dims;
}

__device__ __forceinline__ void pair_positions(Mode mode, int64_t k, int64_t h, int64_t& p0, int64_t& p1) {
  if (mode == Mode::kHalf) {
    p0 = k;
    p1 = k + h;
  } else {
    p0 = 2 * k;
    p1 = 2 * k + 1;
  }
}

// The forward's rows: output row `row` (contiguous, 2h wide) and the starts of its x, r1 and r2
// rows, which the leading-dim strides of `dims` place.
template <typename scalar_t, typename r_t>
struct FwdRows {
  const scalar_t* x;
  const r_t* c;
  const r_t* s;
  Dims dims;
  int64_t rows, h;
  scalar_t* y;

  // fn(x row, r1 row, r2 row, y row) for the rows of this thread's y index (a grid-stride loop).
  template <typename Fn>
  __device__ __forceinline__ void for_each_row(const Fn& fn) const {
    for (int64_t row = blockIdx.x * int64_t(blockDim.y) + threadIdx.y; row < rows;
         row += int64_t(gridDim.x) * blockDim.y) {
      int64_t off[3];
      dims.offsets(row, off);
      fn(x + off[0], c + off[1], s + off[2], y + row * 2 * h);
    }
  }
};

template <typename scalar_t, typename r_t>
__global__ void rotary_fwd_kernel(FwdRows<scalar_t, r_t> rows, Mode mode) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t h = rows.h;
  rows.for_each_row([&](const scalar_t* xr, const r_t* cr, const r_t* sr, scalar_t* yr) {
    for (int64_t k = threadIdx.x; k < h; k += blockDim.x) {
      int64_t p0, p1;
      pair_positions(mode, k, h, p0, p1);
      const acc_t a = static_cast<acc_t>(xr[p0]), b = static_cast<acc_t>(xr[p1]);
      if (mode == Mode::kDeinterleave) {  // outputs (and c / s) at the half positions
        p0 = k;
        p1 = k + h;
      }
      yr[p0] = static_cast<scalar_t>(a * static_cast<acc_t>(cr[p0]) - b * static_cast<acc_t>(sr[p0]));
      yr[p1] = static_cast<scalar_t>(b * static_cast<acc_t>(cr[p1]) + a * static_cast<acc_t>(sr[p1]));
    }
  });
}

// The forward with 16-byte packs: a thread owns kVec consecutive pairs (half / de-interleave: k
// in [k0, k0 + kVec); interleave: the kVec / 2 pairs of elements [e0, e0 + kVec)) of one row, so
// each load and store moves a pack. Used where every row start and the tables allow packs.
template <typename scalar_t, typename r_t, int kVec>
__global__ void rotary_fwd_packed_kernel(FwdRows<scalar_t, r_t> rows, Mode mode) {
  using acc_t = at::opmath_type<scalar_t>;
  using P = cuda::Pack<scalar_t, kVec>;
  using R = cuda::Pack<r_t, kVec>;
  const int64_t h = rows.h;
  const int64_t units = mode == Mode::kInterleave ? 2 * h / kVec : h / kVec;
  rows.for_each_row([&](const scalar_t* xr, const r_t* cr, const r_t* sr, scalar_t* yr) {
    for (int64_t u = threadIdx.x; u < units; u += blockDim.x) {
      if (mode == Mode::kInterleave) {
        const int64_t e0 = u * kVec;
        const P xv = cuda::load_stream(reinterpret_cast<const P*>(xr + e0));
        const R cv = cuda::load_shared(reinterpret_cast<const R*>(cr + e0));
        const R sv = cuda::load_shared(reinterpret_cast<const R*>(sr + e0));
        P out;
#pragma unroll
        for (int j = 0; j < kVec; j += 2) {
          const acc_t a = static_cast<acc_t>(xv.v[j]), b = static_cast<acc_t>(xv.v[j + 1]);
          out.v[j] = static_cast<scalar_t>(a * static_cast<acc_t>(cv.v[j]) - b * static_cast<acc_t>(sv.v[j]));
          out.v[j + 1] = static_cast<scalar_t>(b * static_cast<acc_t>(cv.v[j + 1]) + a * static_cast<acc_t>(sv.v[j + 1]));
        }
        cuda::store_stream(reinterpret_cast<P*>(yr + e0), out);
        continue;
      }
      const int64_t k0 = u * kVec;
      acc_t a[kVec], b[kVec];
      if (mode == Mode::kHalf) {
        const P lo = cuda::load_stream(reinterpret_cast<const P*>(xr + k0));
        const P hi = cuda::load_stream(reinterpret_cast<const P*>(xr + h + k0));
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          a[j] = static_cast<acc_t>(lo.v[j]);
          b[j] = static_cast<acc_t>(hi.v[j]);
        }
      } else {  // de-interleave: the pairs (x[2k], x[2k + 1]) of k in [k0, k0 + kVec)
        const P p0 = cuda::load_stream(reinterpret_cast<const P*>(xr + 2 * k0));
        const P p1 = cuda::load_stream(reinterpret_cast<const P*>(xr + 2 * k0 + kVec));
#pragma unroll
        for (int j = 0; j < kVec / 2; ++j) {
          a[j] = static_cast<acc_t>(p0.v[2 * j]);
          b[j] = static_cast<acc_t>(p0.v[2 * j + 1]);
          a[kVec / 2 + j] = static_cast<acc_t>(p1.v[2 * j]);
          b[kVec / 2 + j] = static_cast<acc_t>(p1.v[2 * j + 1]);
        }
      }
      const R c1 = cuda::load_shared(reinterpret_cast<const R*>(cr + k0));
      const R c2 = cuda::load_shared(reinterpret_cast<const R*>(cr + h + k0));
      const R s1 = cuda::load_shared(reinterpret_cast<const R*>(sr + k0));
      const R s2 = cuda::load_shared(reinterpret_cast<const R*>(sr + h + k0));
      P out1, out2;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        out1.v[j] = static_cast<scalar_t>(a[j] * static_cast<acc_t>(c1.v[j]) - b[j] * static_cast<acc_t>(s1.v[j]));
        out2.v[j] = static_cast<scalar_t>(b[j] * static_cast<acc_t>(c2.v[j]) + a[j] * static_cast<acc_t>(s2.v[j]));
      }
      cuda::store_stream(reinterpret_cast<P*>(yr + k0), out1);
      cuda::store_stream(reinterpret_cast<P*>(yr + h + k0), out2);
    }
  });
}

// Whether rotary_fwd_packed_kernel<kVec> may run: whole packs per row and every pack aligned.
bool packs_fit(const Dims& dims, int64_t h, Mode mode, int vec, std::initializer_list<std::pair<const void*, int64_t>> bases) {
  if ((mode == Mode::kInterleave ? 2 * h : h) % vec != 0) return false;
  for (int t = 0; t < 3; ++t) {
    for (int d = 0; d < dims.nd; ++d) {
      if (dims.strides[t][d] % vec != 0) return false;
    }
  }
  for (const auto& [pointer, pack_bytes] : bases) {
    if (!cuda::aligned_to(pointer, pack_bytes)) return false;
  }
  return true;
}

// Kept dims index r rows (q), broadcast dims index the rows summed into each (b); x and grad are
// contiguous, so both share one offset.
struct BwdDims {
  Dims kept, bcast;  // strides[0] used
  int64_t r_rows, inner, h;
};

template <typename scalar_t, typename r_t>
__global__ void rotary_bwd_kernel(const scalar_t* g, const scalar_t* x, const r_t* c, const r_t* s, BwdDims a,
                                  Mode mode, scalar_t* dx, at::opmath_type<scalar_t>* dc,
                                  at::opmath_type<scalar_t>* ds) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned char shared_bytes[];
  acc_t* shared = reinterpret_cast<acc_t*>(shared_bytes);  // [blockDim.y][blockDim.x][4]
  const int64_t q = blockIdx.x;
  const int64_t D = 2 * a.h;
  int64_t kept_off[3];
  a.kept.offsets(q, kept_off);
  const r_t* cr = c + q * D;
  const r_t* sr = s + q * D;
  // This share's partial rows (the final dr rows when gridDim.y == 1).
  acc_t* dcr = dc + (blockIdx.y * a.r_rows + q) * D;
  acc_t* dsr = ds + (blockIdx.y * a.r_rows + q) * D;
  for (int64_t k0 = 0; k0 < a.h; k0 += blockDim.x) {  // every thread of the block runs each round
    const int64_t k = k0 + threadIdx.x;
    int64_t p0 = 0, p1 = 0;
    pair_positions(mode, k, a.h, p0, p1);
    acc_t c0 = 0, c1 = 0, s0 = 0, s1 = 0, dc0 = 0, dc1 = 0, ds0 = 0, ds1 = 0;
    if (k < a.h) {
      c0 = static_cast<acc_t>(cr[p0]);
      c1 = static_cast<acc_t>(cr[p1]);
      s0 = static_cast<acc_t>(sr[p0]);
      s1 = static_cast<acc_t>(sr[p1]);
      for (int64_t b = blockIdx.y * int64_t(blockDim.y) + threadIdx.y; b < a.inner;
           b += int64_t(gridDim.y) * blockDim.y) {
        int64_t bcast_off[3];
        a.bcast.offsets(b, bcast_off);
        const int64_t off = kept_off[0] + bcast_off[0];
        const acc_t g0 = static_cast<acc_t>(g[off + p0]), g1 = static_cast<acc_t>(g[off + p1]);
        const acc_t x0 = static_cast<acc_t>(x[off + p0]), x1 = static_cast<acc_t>(x[off + p1]);
        dx[off + p0] = static_cast<scalar_t>(c0 * g0 + s1 * g1);
        dx[off + p1] = static_cast<scalar_t>(c1 * g1 - s0 * g0);
        dc0 += x0 * g0;
        dc1 += x1 * g1;
        ds0 -= x1 * g0;
        ds1 += x0 * g1;
      }
    }
    acc_t* mine = shared + (threadIdx.y * blockDim.x + threadIdx.x) * 4;
    mine[0] = dc0;
    mine[1] = dc1;
    mine[2] = ds0;
    mine[3] = ds1;
    __syncthreads();
    if (threadIdx.y == 0 && k < a.h) {
      for (unsigned t = 1; t < blockDim.y; ++t) {
        const acc_t* other = shared + (t * blockDim.x + threadIdx.x) * 4;
        dc0 += other[0];
        dc1 += other[1];
        ds0 += other[2];
        ds1 += other[3];
      }
      dcr[p0] = dc0;
      dcr[p1] = dc1;
      dsr[p0] = ds0;
      dsr[p1] = ds1;
    }
    __syncthreads();
  }
}

template <typename Fn>
void dispatch_r(const at::Tensor& x, const at::Tensor& r, const Fn& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "npu_rotary_mul", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    if (r.scalar_type() == x.scalar_type()) {
      fn(scalar_t{}, scalar_t{});
    } else {
      fn(scalar_t{}, acc_t{});
    }
  });
}

// Threads along a row's pairs (a multiple of 32 up to 128) and rows (or shares) along y.
dim3 block_for_pairs(int64_t h) {
  const int tx = static_cast<int>(std::min<int64_t>(128, (h + 31) / 32 * 32));
  return dim3(tx, 256 / tx);
}

void rotary_fwd_cuda(const at::Tensor& x, const at::Tensor& r1, const at::Tensor& r2, const RowLayout& layout,
                     Mode mode, at::Tensor& out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const std::vector<int64_t>* strides[3] = {&layout.x_strides, &layout.r1_strides, &layout.r2_strides};
  const Dims dims = make_dims("npu_rotary_mul", layout.sizes, strides);
  const int64_t h = x.size(-1) / 2;
  const int64_t rows = out.numel() / (2 * h);
  const dim3 block = block_for_pairs(h);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const unsigned blocks = static_cast<unsigned>(
      std::clamp<int64_t>((rows + block.y - 1) / block.y, 1, sms * 32));
  dispatch_r(x, r1, [&](auto s, auto r) {
    using scalar_t = decltype(s);
    using r_t = decltype(r);
    constexpr int kVec = cuda::pack_size<scalar_t>();
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const r_t* pc = r1.const_data_ptr<r_t>();
    const r_t* ps = r2.const_data_ptr<r_t>();
    scalar_t* py = out.mutable_data_ptr<scalar_t>();
    const FwdRows<scalar_t, r_t> fwd_rows{px, pc, ps, dims, rows, h, py};
    const int64_t pack_bytes = sizeof(scalar_t) * kVec, r_pack_bytes = sizeof(r_t) * kVec;
    if (packs_fit(dims, h, mode, kVec, {{px, pack_bytes}, {py, pack_bytes}, {pc, r_pack_bytes}, {ps, r_pack_bytes}})) {
      const int64_t units = (mode == Mode::kInterleave ? 2 * h : h) / kVec;
      // Threads along a row's packs (a power of two up to 128), rows along y.
      int tx = 1;
      while (tx < units && tx < 128) tx *= 2;
      const dim3 packed_block(tx, 256 / tx);
      const unsigned packed_blocks = static_cast<unsigned>(
          std::clamp<int64_t>((rows + packed_block.y - 1) / packed_block.y, 1, sms * 32));
      rotary_fwd_packed_kernel<scalar_t, r_t, kVec><<<packed_blocks, packed_block, 0,
                                                      at::cuda::getCurrentCUDAStream()>>>(fwd_rows, mode);
    } else {
      rotary_fwd_kernel<scalar_t, r_t><<<blocks, block, 0, at::cuda::getCurrentCUDAStream()>>>(fwd_rows, mode);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void rotary_bwd_cuda(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& r1, const at::Tensor& r2,
                     Mode mode, at::Tensor& dx, at::Tensor& dr1, at::Tensor& dr2) {
  constexpr const char* op = "npu_rotary_mul_backward";
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t nd = x.dim();
  const int64_t D = x.size(-1);
  // x's contiguous strides, split into the dims r keeps and the dims it broadcasts along.
  std::vector<int64_t> kept_sizes, kept_strides, bcast_sizes, bcast_strides;
  std::vector<int64_t> x_strides(nd - 1);
  int64_t stride = D;
  for (int64_t d = nd - 2; d >= 0; --d) {
    x_strides[d] = stride;
    stride *= x.size(d);
  }
  for (int64_t d = 0; d < nd - 1; ++d) {
    const bool kept = r1.size(d) == x.size(d);
    (kept ? kept_sizes : bcast_sizes).push_back(x.size(d));
    (kept ? kept_strides : bcast_strides).push_back(x_strides[d]);
  }
  const std::vector<int64_t>* kept3[3] = {&kept_strides, &kept_strides, &kept_strides};
  const std::vector<int64_t>* bcast3[3] = {&bcast_strides, &bcast_strides, &bcast_strides};
  BwdDims a{make_dims(op, kept_sizes, kept3), make_dims(op, bcast_sizes, bcast3), r1.numel() / D, 1, D / 2};
  for (int64_t s : bcast_sizes) a.inner *= s;

  const dim3 block = block_for_pairs(a.h);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // Enough shares per r row to fill the GPU, each with at least one row per thread along y.
  const int64_t max_shares = std::max<int64_t>(1, (a.inner + block.y - 1) / block.y);
  const int64_t shares = std::clamp<int64_t>((sms * 8 + a.r_rows - 1) / a.r_rows, 1, std::min<int64_t>(max_shares, 65535));
  TORCH_CHECK(a.r_rows <= std::numeric_limits<int>::max(), op, ": too many rows of r1 for the CUDA kernel (",
              a.r_rows, ")");
  at::Tensor dc = dr1, ds = dr2;
  if (shares > 1) {
    dc = at::empty({shares, a.r_rows * D}, dr1.options());
    ds = at::empty({shares, a.r_rows * D}, dr2.options());
  }
  dispatch_r(x, r1, [&](auto s, auto r) {
    using scalar_t = decltype(s);
    using r_t = decltype(r);
    using acc_t = at::opmath_type<scalar_t>;
    const size_t shared = size_t(block.x) * block.y * 4 * sizeof(acc_t);
    rotary_bwd_kernel<scalar_t, r_t><<<dim3(static_cast<unsigned>(a.r_rows), static_cast<unsigned>(shares)), block,
                                       shared, at::cuda::getCurrentCUDAStream()>>>(
        grad.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), r1.const_data_ptr<r_t>(),
        r2.const_data_ptr<r_t>(), a, mode, dx.mutable_data_ptr<scalar_t>(), dc.mutable_data_ptr<acc_t>(),
        ds.mutable_data_ptr<acc_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (shares > 1) {
    at::Tensor dr1_flat = dr1.view({a.r_rows * D});
    at::Tensor dr2_flat = dr2.view({a.r_rows * D});
    at::sum_out(dr1_flat, dc, /*dim=*/0);
    at::sum_out(dr2_flat, ds, /*dim=*/0);
  }
}

}  // namespace

OPENNPU_REGISTER_CUDA_SLOT(rotary_fwd, &rotary_fwd_cuda);
OPENNPU_REGISTER_CUDA_SLOT(rotary_bwd, &rotary_bwd_cuda);

TORCH_LIBRARY_IMPL(npu, CUDA, m) { register_npu_entry_points(m); }

TORCH_LIBRARY_IMPL(opennpu, CUDA, m) { register_opennpu_entry_points(m); }

}  // namespace opennpu::rotary
