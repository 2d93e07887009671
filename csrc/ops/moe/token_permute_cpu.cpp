// CPU kernels of npu_moe_token_unpermute and of the permute / unpermute gradients (compiled once
// per ISA; see common/cpu_dispatch.h). All of them are memory-bound row moves:
//
// Gather-sum, per output row: the row's K source pointers and weights are gathered once, then one
// pass over H accumulates sum_k w_k * row_k in acc_t vectors and stores the result rounded once.
// K = 1 without weights is a plain row copy (memcpy).
//
// Its backward, per token: for each of its K slots, one pass over H writes w * grad to the slot's
// permuted row and accumulates dot(grad, row) for grad_w in acc_t vectors.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "common/vec.h"
#include "ops/moe/token_permute.h"

namespace opennpu::moe {
inline namespace CPU_CAPABILITY {
namespace {

void gather_sum_kernel(const at::Tensor& rows, const int64_t* src, const void* weight, int64_t k,
                       at::Tensor& out) {
  const int64_t t = out.size(0);
  const int64_t h = out.size(1);
  if (k == 1 && weight == nullptr) {  // a permutation of rows: bytes only
    const int64_t row_bytes = h * static_cast<int64_t>(out.element_size());
    const char* in = static_cast<const char*>(rows.const_data_ptr());
    char* o = static_cast<char*>(out.mutable_data_ptr());
    const int64_t grain =
        std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(row_bytes, 1));
    at::parallel_for(0, t, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (src[i] >= 0) {
          std::memcpy(o + i * row_bytes, in + src[i] * row_bytes, row_bytes);
        } else {
          std::memset(o + i * row_bytes, 0, row_bytes);
        }
      }
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(),
                                  "npu_moe_token_unpermute", [&] {
    using T = acc_t<scalar_t>;
    using Vec = AccVec<scalar_t>;
    using IO = VecPair<scalar_t>;
    const scalar_t* prow = rows.const_data_ptr<scalar_t>();
    const T* pw = static_cast<const T*>(weight);
    scalar_t* po = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, t, grain_rows(h * k), [&](int64_t begin, int64_t end) {
      std::vector<const scalar_t*> term_row(k);
      std::vector<Vec> term_w(k);
      for (int64_t i = begin; i < end; ++i) {
        int64_t live = 0;  // the slots that were not dropped, packed to the front
        for (int64_t j = 0; j < k; ++j) {
          const int64_t s = src[i * k + j];
          if (s < 0) continue;
          term_row[live] = prow + s * h;
          term_w[live] = Vec(pw != nullptr ? pw[i * k + j] : T(1));
          ++live;
        }
        scalar_t* o = po + i * h;
        for_each_step<scalar_t>(h, [&](int64_t c, int64_t len) {
          Vec a(0), b(0), u, v;
          for (int64_t j = 0; j < live; ++j) {
            IO::load(term_row[j] + c, u, v, len);
            a = at::vec::fmadd(term_w[j], u, a);
            b = at::vec::fmadd(term_w[j], v, b);
          }
          IO::store(o + c, a, b, len);
        });
      }
    });
  });
}

void gather_sum_backward_kernel(const at::Tensor& grad, const at::Tensor& rows,
                                const int64_t* src, const void* weight, int64_t k,
                                at::Tensor& grad_rows, void* grad_w) {
  const int64_t t = grad.size(0);
  const int64_t h = grad.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(),
                                  "npu_moe_token_unpermute_grad", [&] {
    using T = acc_t<scalar_t>;
    using Vec = AccVec<scalar_t>;
    using IO = VecPair<scalar_t>;
    const scalar_t* pg = grad.const_data_ptr<scalar_t>();
    const scalar_t* prow = grad_w != nullptr ? rows.const_data_ptr<scalar_t>() : nullptr;
    const T* pw = static_cast<const T*>(weight);
    T* pgw = static_cast<T*>(grad_w);
    scalar_t* pgr = grad_rows.mutable_data_ptr<scalar_t>();
    const int64_t row_bytes = h * static_cast<int64_t>(sizeof(scalar_t));
    at::parallel_for(0, t, grain_rows(h * k * 2), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const scalar_t* g = pg + i * h;
        for (int64_t j = 0; j < k; ++j) {
          const int64_t q = i * k + j;
          const int64_t s = src[q];
          if (s < 0) {
            if (pgw != nullptr) pgw[q] = T(0);
            continue;
          }
          scalar_t* dst = pgr + s * h;
          if (pw == nullptr && pgw == nullptr) {
            std::memcpy(dst, g, row_bytes);
            continue;
          }
          const Vec w(pw != nullptr ? pw[q] : T(1));
          const scalar_t* r = prow != nullptr ? prow + s * h : nullptr;
          Vec da(0), db(0);
          for_each_step<scalar_t>(h, [&](int64_t c, int64_t len) {
            Vec a, b;
            IO::load(g + c, a, b, len);
            IO::store(dst + c, w * a, w * b, len);
            if (r != nullptr) {
              Vec u, v;
              IO::load(r + c, u, v, len);
              da = at::vec::fmadd(a, u, da);
              db = at::vec::fmadd(b, v, db);
            }
          });
          if (pgw != nullptr) pgw[q] = horizontal_sum(da + db);
        }
      }
    });
  });
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(gather_sum, &gather_sum_kernel);
OPENNPU_REGISTER_CPU_SLOT(gather_sum_backward, &gather_sum_backward_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::moe
