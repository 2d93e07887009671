// CPU kernels of the RMSNorm family (compiled once per ISA; see common/cpu_dispatch.h).
//
// One row is n contiguous elements. Forward: pass 1 accumulates sum(x^2) in acc_t over the row,
// pass 2 writes y; the second read hits L1/L2 (a row is at most a few tens of KiB), so memory sees
// one read of x and one write of y. Pass 2 prefetches the next row of the thread's chunk into L2
// (rms_norm_write_row), so that the core reads memory while it writes y. Backward: pass 1 accumulates sum(dy * gamma * x), pass 2
// writes dx and adds dy * x * rstd into a per-thread dgamma row, reduced across threads at the end.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <vector>

#include "common/stream_store.h"
#include "common/vec.h"
#include "ops/norm/norm.h"
#include "ops/norm/norm_rows.h"

namespace opennpu::norm {
inline namespace CPU_CAPABILITY {
namespace {

void rms_norm_fwd_kernel(const at::Tensor& x, const at::Tensor& gamma, double eps, at::Tensor& y,
                         at::Tensor& rstd) {
  const int64_t n = gamma.numel();
  const int64_t rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "npu_rms_norm", [&] {
    using T = acc_t<scalar_t>;
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    const T* pg = gamma.const_data_ptr<T>();
    scalar_t* py = y.mutable_data_ptr<scalar_t>();
    T* pr = rstd.mutable_data_ptr<T>();
    // y is written once and never read back: streamed where it outgrows the last-level cache.
    const bool stream = stream_output(py, y.nbytes());
    with_bf16_stores<scalar_t>([&](auto native) {
      constexpr bool kNative = decltype(native)::value;
      at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          pr[r] = rms_norm_row<scalar_t, kNative>(px + r * n, pg, py + r * n, n,
                                                  static_cast<T>(eps), stream,
                                                  r + 1 < end ? px + (r + 1) * n : nullptr);
        }
        if (stream) stream_fence();
      });
    });
  });
}

void add_rms_norm_fwd_kernel(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& gamma,
                             double eps, at::Tensor& y, at::Tensor& rstd, at::Tensor& x) {
  const int64_t n = gamma.numel();
  const int64_t rows = x1.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x1.scalar_type(), "npu_add_rms_norm", [&] {
        using T = acc_t<scalar_t>;
        const scalar_t* pa = x1.const_data_ptr<scalar_t>();
        const scalar_t* pb = x2.const_data_ptr<scalar_t>();
        const T* pg = gamma.const_data_ptr<T>();
        scalar_t* py = y.mutable_data_ptr<scalar_t>();
        scalar_t* px = x.mutable_data_ptr<scalar_t>();
        T* pr = rstd.mutable_data_ptr<T>();
        // Two passes per row, as in rms_norm: pass 1 reads x1 and x2 from memory, stores their
        // rounded sum and accumulates its squares (add_row_sum_of_squares); pass 2 reads the sum
        // back from L1 / L2 and writes y. Large outputs are streamed (common/stream_store.h): y is
        // written once. The sum x is read back by pass 2, which a streamed line would have to
        // come back from memory for: when x streams, pass 1 stores the row's sum to an L1
        // scratch row (the same rounded values) and pass 2 streams it to x along with y.
        const bool stream_y = stream_output(py, y.nbytes());
        // In place (x is x1's or x2's buffer: the compile backend's _add_rms_norm_inplace), each
        // line of x was just read and is in cache: ordinary stores only dirty it.
        const bool stream_x = px != pa && px != pb && stream_output(px, x.nbytes());
        with_bf16_stores<scalar_t>([&](auto native) {
          constexpr bool kNative = decltype(native)::value;
          at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
            // The scratch row is line-aligned, so that its loads do not straddle lines.
            std::vector<char> scratch_bytes(stream_x ? n * sizeof(scalar_t) + kLineBytes : 0);
            scalar_t* scratch = reinterpret_cast<scalar_t*>(
                (reinterpret_cast<uintptr_t>(scratch_bytes.data()) + kLineBytes - 1) /
                kLineBytes * kLineBytes);
            for (int64_t r = begin; r < end; ++r) {
              scalar_t* xr = px + r * n;
              scalar_t* yr = py + r * n;
              scalar_t* sum = stream_x ? scratch : xr;
              const T rstd = rstd_of<T>(
                  add_row_sum_of_squares<scalar_t, kNative>(pa + r * n, pb + r * n, sum, n), n,
                  static_cast<T>(eps));
              pr[r] = rstd;
              // x's lines stream with y's where both stream and share the line offset (rows of
              // whole lines in aligned tensors); otherwise y, then x on its own.
              const bool together = stream_x && stream_y && same_line_offset(xr, yr);
              const bool next = r + 1 < end;
              rms_norm_write_row<scalar_t, kNative>(sum, pg, yr, n, rstd, stream_y,
                                                    together ? xr : nullptr,
                                                    next ? pa + (r + 1) * n : nullptr,
                                                    next ? pb + (r + 1) * n : nullptr);
              if (stream_x && !together) {
                stream_bytes(reinterpret_cast<char*>(xr), reinterpret_cast<const char*>(sum),
                             n * sizeof(scalar_t));
              }
            }
            if (stream_x || stream_y) stream_fence();
          });
        });
      });
}

// npu_add_rms_norm_cast: add_rms_norm's row (sum rounded to x1's dtype, then normalised), with
// y stored twice from the same accumulator vectors: y1 in the accumulator dtype, y2 in x1's.
void add_rms_norm_cast_fwd_kernel(const at::Tensor& x1, const at::Tensor& x2,
                                  const at::Tensor& gamma, double eps, at::Tensor& y1,
                                  at::Tensor& y2, at::Tensor& rstd, at::Tensor& x) {
  const int64_t n = gamma.numel();
  const int64_t rows = x1.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x1.scalar_type(), "npu_add_rms_norm_cast", [&] {
        using T = acc_t<scalar_t>;
        using Vec = AccVec<scalar_t>;
        using IO = VecPair<scalar_t>;
        const scalar_t* pa = x1.const_data_ptr<scalar_t>();
        const scalar_t* pb = x2.const_data_ptr<scalar_t>();
        const T* pg = gamma.const_data_ptr<T>();
        T* py1 = y1.mutable_data_ptr<T>();
        scalar_t* py2 = y2.mutable_data_ptr<scalar_t>();
        scalar_t* px = x.mutable_data_ptr<scalar_t>();
        T* pr = rstd.mutable_data_ptr<T>();
        at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            scalar_t* xr = px + r * n;
            T* y1r = py1 + r * n;
            scalar_t* y2r = py2 + r * n;
            add_row(pa + r * n, pb + r * n, xr, n);
            pr[r] = rms_norm_row_to<scalar_t>(
                xr, pg, n, static_cast<T>(eps),
                [&](int64_t i, const Vec& a, const Vec& b, int64_t len) {
                  VecPair<T>::store(y1r + i, a, b, len);
                  IO::store(y2r + i, a, b, len);
                });
          }
        });
      });
}

void rms_norm_bwd_kernel(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& gamma,
                         const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dgamma) {
  const int64_t n = gamma.numel();
  const int64_t rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, x.scalar_type(), "npu_rms_norm_backward", [&] {
        using T = acc_t<scalar_t>;
        using Vec = AccVec<scalar_t>;
        using IO = VecPair<scalar_t>;
        using AccIO = VecPair<T>;
        const scalar_t* pdy = dy.const_data_ptr<scalar_t>();
        const scalar_t* px = x.const_data_ptr<scalar_t>();
        const T* pg = gamma.const_data_ptr<T>();
        const T* pr = rstd.const_data_ptr<T>();
        scalar_t* pdx = dx.mutable_data_ptr<scalar_t>();
        // dgamma sums over every row. Each thread adds rows into a block row, and every
        // kRowsPerBlock rows folds the block into its own partial row; the partial rows are summed
        // after the parallel region. Two-level summation keeps the fp32 error ~kRowsPerBlock
        // times smaller than one running sum over thousands of rows.
        constexpr int64_t kRowsPerBlock = 32;
        const int64_t threads = at::get_num_threads();
        at::Tensor partial = at::zeros({threads, n}, dgamma.options());
        at::Tensor block = at::zeros({threads, n}, dgamma.options());
        T* ppart = partial.mutable_data_ptr<T>();
        T* pblock = block.mutable_data_ptr<T>();
        auto fold = [n](T* dst, T* src) {
          for_each_step<T>(n, [&](int64_t i, int64_t len) {
            Vec a0, a1, b0, b1;
            AccIO::load(dst + i, a0, a1, len);
            AccIO::load(src + i, b0, b1, len);
            AccIO::store(dst + i, a0 + b0, a1 + b1, len);
            AccIO::store(src + i, Vec(0), Vec(0), len);
          });
        };
        at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
          const int64_t tid = at::get_thread_num();
          T* dg = pblock + tid * n;
          for (int64_t r = begin; r < end; ++r) {
            if ((r - begin) % kRowsPerBlock == 0 && r != begin) fold(ppart + tid * n, dg);
            const scalar_t* dyr = pdy + r * n;
            const scalar_t* xr = px + r * n;
            Vec s0(0), s1(0);
            for_each_step<scalar_t>(n, [&](int64_t i, int64_t len) {
              Vec d0, d1, x0, x1, g0, g1;
              IO::load(dyr + i, d0, d1, len);
              IO::load(xr + i, x0, x1, len);
              AccIO::load(pg + i, g0, g1, len);
              s0 = at::vec::fmadd(d0 * g0, x0, s0);
              s1 = at::vec::fmadd(d1 * g1, x1, s1);
            });
            const T rs = pr[r];
            const Vec vrs(rs);
            // x * rstd^3 * mean(dy * gamma * x)
            const Vec coef(rs * rs * rs * horizontal_sum(s0 + s1) / static_cast<T>(n));
            for_each_step<scalar_t>(n, [&](int64_t i, int64_t len) {
              Vec d0, d1, x0, x1, g0, g1, p0, p1;
              IO::load(dyr + i, d0, d1, len);
              IO::load(xr + i, x0, x1, len);
              AccIO::load(pg + i, g0, g1, len);
              IO::store(pdx + r * n + i, d0 * g0 * vrs - x0 * coef, d1 * g1 * vrs - x1 * coef, len);
              AccIO::load(dg + i, p0, p1, len);
              AccIO::store(dg + i, at::vec::fmadd(d0 * x0, vrs, p0), at::vec::fmadd(d1 * x1, vrs, p1),
                           len);
            });
          }
          fold(ppart + tid * n, dg);
        });
        at::Tensor dgamma_flat = dgamma.view({n});
        at::sum_out(dgamma_flat, partial, /*dim=*/0);
      });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(rms_norm_fwd, &rms_norm_fwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(add_rms_norm_fwd, &add_rms_norm_fwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(rms_norm_bwd, &rms_norm_bwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(add_rms_norm_cast_fwd, &add_rms_norm_cast_fwd_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::norm
