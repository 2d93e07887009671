// CPU kernels of the activation family (compiled once per ISA; see common/cpu_dispatch.h).
//
// Every gated activation here except exact GELU has the form z * sigmoid(u(z)), so value and
// derivative share one exp:  act(z) = z * s,  act'(z) = s + z * s * (1 - s) * u'(z),  s = sigmoid(u).
// fp16/bf16 use the cheap exp (see exp_for): their outputs keep 8-11 bits, far above its error;
// except swiglu's SiLU, which computes torch_npu's golden float32 value exactly (silu_golden in
// act_math.h) so that the one rounding to bf16 / fp16 gives the golden's bits. bf16 outputs are rounded by the AVX512_BF16 instruction where the CPU has it (with_bf16_stores).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "common/stream_store.h"
#include "common/vec.h"
#include "ops/activation/act_math.h"
#include "ops/activation/activation.h"

namespace opennpu::activation {
inline namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kGrain = int64_t{1} << 14;

// Walks the flat output range [begin, end) of an [outer, m] result in runs that stay inside one
// outer row: body(o, j, len) covers columns j .. j+len of row o.
template <typename Body>
inline void for_each_run(int64_t begin, int64_t end, int64_t m, const Body& body) {
  for (int64_t i = begin; i < end;) {
    const int64_t o = i / m;
    const int64_t j = i - o * m;
    const int64_t len = std::min(m - j, end - i);
    body(o, j, len);
    i += len;
  }
}

template <Act kAct, typename scalar_t>
void glu_fwd_impl(const GluHalves& x, int64_t outer, int64_t m, at::Tensor& out,
                  at::Tensor& gelu_out) {
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  const scalar_t* ph = x.h.const_data_ptr<scalar_t>() + x.h_offset;
  const scalar_t* po = x.o.const_data_ptr<scalar_t>() + x.o_offset;
  scalar_t* py = out.mutable_data_ptr<scalar_t>();
  scalar_t* pg = gelu_out.defined() ? gelu_out.mutable_data_ptr<scalar_t>() : nullptr;
  // Outputs larger than the last-level cache are streamed (common/stream_store.h); gelu_out too
  // where its lines fall at the same offsets as out's.
  const bool stream = stream_output(py, out.nbytes());
  const bool stream_g = stream && pg != nullptr && same_line_offset(pg, py);
  with_bf16_stores<scalar_t>([&](auto native) {
    constexpr bool kNative = decltype(native)::value;
    at::parallel_for(0, outer * m, kGrain, [&](int64_t begin, int64_t end) {
      for_each_run(begin, end, m, [&](int64_t o, int64_t j, int64_t len) {
        const scalar_t* h = ph + o * x.stride + j;
        const scalar_t* other = po + o * x.stride + j;
        scalar_t* y = py + o * m + j;
        scalar_t* g = pg ? pg + o * m + j : nullptr;
        for_each_output_step<scalar_t>(y, len, stream, [&](int64_t k, int64_t l, bool streamed) {
          Vec h0, h1, b0, b1;
          IO::load(h + k, h0, h1, l);
          IO::load(other + k, b0, b1, l);
          Vec a0, a1;
          if constexpr (kAct == Act::kSilu && kGoldenSilu<scalar_t>) {
            a0 = silu_golden<scalar_t>(h0);
            a1 = silu_golden<scalar_t>(h1);
          } else {
            a0 = act_value<kAct, scalar_t>(h0);
            a1 = act_value<kAct, scalar_t>(h1);
          }
          store_output<kNative>(y + k, a0 * b0, a1 * b1, l, streamed);
          if (g) store_output<kNative>(g + k, a0, a1, l, streamed && stream_g);
        });
      });
      if (stream) stream_fence();
    });
  });
}

template <Act kAct, typename scalar_t>
void glu_bwd_impl(const at::Tensor& grad, const GluHalves& x, int64_t outer, int64_t m,
                  const GluHalves& dx) {
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  const scalar_t* pgrad = grad.const_data_ptr<scalar_t>();
  const scalar_t* ph = x.h.const_data_ptr<scalar_t>() + x.h_offset;
  const scalar_t* po = x.o.const_data_ptr<scalar_t>() + x.o_offset;
  scalar_t* pdh = dx.h.mutable_data_ptr<scalar_t>() + dx.h_offset;
  scalar_t* pdo = dx.o.mutable_data_ptr<scalar_t>() + dx.o_offset;
  with_bf16_stores<scalar_t>([&](auto native) {
    constexpr bool kNative = decltype(native)::value;
    at::parallel_for(0, outer * m, kGrain, [&](int64_t begin, int64_t end) {
      for_each_run(begin, end, m, [&](int64_t o, int64_t j, int64_t len) {
        const int64_t row = o * x.stride + j, drow = o * dx.stride + j;
        const scalar_t* gy = pgrad + o * m + j;
        for_each_step<scalar_t>(len, [&](int64_t k, int64_t l) {
          Vec g0, g1, h0, h1, b0, b1, a0, a1, d0, d1;
          IO::load(gy + k, g0, g1, l);
          IO::load(ph + row + k, h0, h1, l);
          IO::load(po + row + k, b0, b1, l);
          if constexpr (kAct == Act::kSilu && kGoldenSilu<scalar_t>) {
            // the golden's order: (other * swish') * grad and grad * swish
            silu_golden_grad<scalar_t>(h0, a0, d0);
            silu_golden_grad<scalar_t>(h1, a1, d1);
            store_pair<kNative>(pdh + drow + k, b0 * d0 * g0, b1 * d1 * g1, l);
          } else {
            act_value_grad<kAct, scalar_t>(h0, a0, d0);
            act_value_grad<kAct, scalar_t>(h1, a1, d1);
            store_pair<kNative>(pdh + drow + k, g0 * b0 * d0, g1 * b1 * d1, l);
          }
          store_pair<kNative>(pdo + drow + k, g0 * a0, g1 * a1, l);
        });
      });
    });
  });
}

template <Act kAct, typename scalar_t>
void unary_fwd_impl(const at::Tensor& x, at::Tensor& y) {
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  const scalar_t* px = x.const_data_ptr<scalar_t>();
  scalar_t* py = y.mutable_data_ptr<scalar_t>();
  with_bf16_stores<scalar_t>([&](auto native) {
    constexpr bool kNative = decltype(native)::value;
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for_each_step<scalar_t>(end - begin, [&](int64_t k, int64_t l) {
        Vec a, b;
        IO::load(px + begin + k, a, b, l);
        store_pair<kNative>(py + begin + k, act_value<kAct, scalar_t>(a),
                            act_value<kAct, scalar_t>(b), l);
      });
    });
  });
}

template <Act kAct, typename scalar_t>
void unary_bwd_impl(const at::Tensor& grad, const at::Tensor& x, at::Tensor& dx) {
  using Vec = AccVec<scalar_t>;
  using IO = VecPair<scalar_t>;
  const scalar_t* pgrad = grad.const_data_ptr<scalar_t>();
  const scalar_t* px = x.const_data_ptr<scalar_t>();
  scalar_t* pdx = dx.mutable_data_ptr<scalar_t>();
  with_bf16_stores<scalar_t>([&](auto native) {
    constexpr bool kNative = decltype(native)::value;
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for_each_step<scalar_t>(end - begin, [&](int64_t k, int64_t l) {
        Vec g0, g1, x0, x1, v0, v1, d0, d1;
        IO::load(pgrad + begin + k, g0, g1, l);
        IO::load(px + begin + k, x0, x1, l);
        act_value_grad<kAct, scalar_t>(x0, v0, d0);
        act_value_grad<kAct, scalar_t>(x1, v1, d1);
        store_pair<kNative>(pdx + begin + k, g0 * d0, g1 * d1, l);
      });
    });
  });
}

// Instantiates `impl<Act, scalar_t>` for the runtime (act, dtype) pair.
#define OPENNPU_DISPATCH_ACT(act, dtype, name, impl, ...)                                  \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, name, [&] {             \
    switch (act) {                                                                          \
      case Act::kSilu:                                                                      \
        return impl<Act::kSilu, scalar_t>(__VA_ARGS__);                                     \
      case Act::kFastGelu:                                                                  \
        return impl<Act::kFastGelu, scalar_t>(__VA_ARGS__);                                 \
      case Act::kGeluTanh:                                                                  \
        return impl<Act::kGeluTanh, scalar_t>(__VA_ARGS__);                                 \
      case Act::kGeluErf:                                                                   \
        return impl<Act::kGeluErf, scalar_t>(__VA_ARGS__);                                  \
    }                                                                                       \
  })

void glu_fwd_kernel(const GluHalves& x, int64_t outer, int64_t m, Act act, at::Tensor& out,
                    at::Tensor& gelu_out) {
  OPENNPU_DISPATCH_ACT(act, x.h.scalar_type(), "glu_fwd", glu_fwd_impl, x, outer, m, out,
                       gelu_out);
}

void glu_bwd_kernel(const at::Tensor& grad, const GluHalves& x, int64_t outer, int64_t m, Act act,
                    const GluHalves& dx) {
  OPENNPU_DISPATCH_ACT(act, x.h.scalar_type(), "glu_bwd", glu_bwd_impl, grad, x, outer, m, dx);
}

void unary_fwd_kernel(const at::Tensor& x, Act act, at::Tensor& y) {
  OPENNPU_DISPATCH_ACT(act, x.scalar_type(), "act_fwd", unary_fwd_impl, x, y);
}

void unary_bwd_kernel(const at::Tensor& grad, const at::Tensor& x, Act act, at::Tensor& dx) {
  OPENNPU_DISPATCH_ACT(act, x.scalar_type(), "act_bwd", unary_bwd_impl, grad, x, dx);
}

}  // namespace

OPENNPU_REGISTER_CPU_SLOT(glu_fwd, &glu_fwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(glu_bwd, &glu_bwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(unary_fwd, &unary_fwd_kernel);
OPENNPU_REGISTER_CPU_SLOT(unary_bwd, &unary_bwd_kernel);

}  // namespace CPU_CAPABILITY
}  // namespace opennpu::activation
