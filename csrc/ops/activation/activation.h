// Activation family: npu_swiglu, npu_geglu, fast_gelu / npu_fast_gelu and their gradients.
//
// A GLU op splits its input along `dim` into halves A | B. Viewed contiguously, the input is
// [outer, 2, m] (outer = product of the dims before `dim`, m = half of `dim` times the product of
// the dims after it), so every `dim` reduces to the same kernel over [outer, 2, m] -> [outer, m].
// One half is "activated": out = act(H) * O, where H is A when activate_left, else B.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include <torch/library.h>

#include "common/kernel_slots.h"

namespace opennpu::activation {

enum class Act {
  kSilu,      // z * sigmoid(z)
  kFastGelu,  // z * sigmoid(1.702 z)
  kGeluTanh,  // z * sigmoid(2 sqrt(2/pi) (z + 0.044715 z^3)) = tanh-approximated GELU, exactly
  kGeluErf,   // z * Phi(z), the exact GELU
};

// Where the two halves of a GLU lie, as [outer, m] row blocks: row o of the activated half H
// starts at element h_offset + o * stride of `h`, row o of the other half O at o_offset + o * stride
// of `o`. npu_swiglu's x [outer, 2, m] holds both (h = o = x, stride 2m); the two-tensor form
// (opennpu::_silu_mul) has them in separate tensors (stride m). The tensors are contiguous.
struct GluHalves {
  at::Tensor h, o;
  int64_t h_offset = 0, o_offset = 0, stride = 0;
};

// out[o, j] = act(H[o, j]) * O[o, j] ([outer, m], contiguous); gelu_out (optional, may be
// undefined) receives act(H).
using GluFwdFn = void(const GluHalves& x, int64_t outer, int64_t m, Act act, at::Tensor& out,
                      at::Tensor& gelu_out);
// dH = g * O * act'(H), dO = g * act(H), written where `dx` places the halves (grad [outer, m],
// contiguous, in x's dtype).
using GluBwdFn = void(const at::Tensor& grad, const GluHalves& x, int64_t outer, int64_t m,
                      Act act, const GluHalves& dx);
// y = act(x), elementwise over contiguous tensors.
using UnaryFwdFn = void(const at::Tensor& x, Act act, at::Tensor& y);
// dx = grad * act'(x).
using UnaryBwdFn = void(const at::Tensor& grad, const at::Tensor& x, Act act, at::Tensor& dx);

// The family's kernels, one slot per device (common/kernel_slots.h).
extern KernelSlots<GluFwdFn> glu_fwd;
extern KernelSlots<GluBwdFn> glu_bwd;
extern KernelSlots<UnaryFwdFn> unary_fwd;
extern KernelSlots<UnaryBwdFn> unary_bwd;

// The entry points (activation.cpp): validate, allocate with the input's options, call the slot
// for the input's device. Registered for CPU here and for CUDA by activation_cuda.cu.
at::Tensor npu_swiglu(const at::Tensor& self, int64_t dim);
at::Tensor npu_swiglu_backward(const at::Tensor& grad_output, const at::Tensor& self, int64_t dim);
std::tuple<at::Tensor, at::Tensor> npu_geglu(const at::Tensor& self, int64_t dim, int64_t approximate,
                                             bool activate_left);
at::Tensor npu_geglu_grad(const at::Tensor& grad_output, const at::Tensor& self, const at::Tensor& gelu,
                          int64_t dim, int64_t approximate, bool activate_left);
at::Tensor fast_gelu(const at::Tensor& self);
at::Tensor npu_fast_gelu(const at::Tensor& self);
at::Tensor npu_fast_gelu_backward(const at::Tensor& grad, const at::Tensor& self);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad, const at::Tensor& gate,
                                                     const at::Tensor& up);

// The entry points above, for one dispatch key's library (npu:: ops, then opennpu:: helpers).
void register_npu_entry_points(torch::Library& m);
void register_opennpu_entry_points(torch::Library& m);

}  // namespace opennpu::activation
