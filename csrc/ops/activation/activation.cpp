// Entry points of the activation family: validation, output allocation, the kernel of the input's
// device (common/kernel_slots.h), CPU registration.
#include "ops/activation/activation.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "common/checks.h"

namespace opennpu::activation {

KernelSlots<GluFwdFn> glu_fwd;
KernelSlots<GluBwdFn> glu_bwd;
KernelSlots<UnaryFwdFn> unary_fwd;
KernelSlots<UnaryBwdFn> unary_bwd;

namespace {

// The [outer, 2, m] view of a GLU input split along `dim`.
struct GluShape {
  int64_t outer = 1;
  int64_t m = 1;
  std::vector<int64_t> out_sizes;
};

GluShape glu_shape(const char* op, const at::Tensor& self, int64_t dim) {
  check_floating(op, "self", self);
  OPENNPU_CHECK_ARG(self.dim() >= 1, op, "self",
                    "must have at least 1 dim to split in halves, but got a 0-dim tensor");
  const int64_t d = wrap_dim(op, "dim", dim, self.dim());
  OPENNPU_CHECK_ARG(self.size(d) % 2 == 0, op, "self", "must have an even size along dim ", dim,
                    ", but got shape ", shape_str(self.sizes()));
  check_strict_dtype(op, "self", self, {at::kHalf, at::kBFloat16, at::kFloat});
  check_strict_rank(op, "self", self, 1, 8);
  GluShape s;
  for (int64_t i = 0; i < d; ++i) s.outer *= self.size(i);
  s.m = self.size(d) / 2;
  for (int64_t i = d + 1; i < self.dim(); ++i) s.m *= self.size(i);
  s.out_sizes.assign(self.sizes().begin(), self.sizes().end());
  s.out_sizes[d] /= 2;
  return s;
}

Act gelu_act(const char* op, int64_t approximate) {
  OPENNPU_CHECK_ARG(approximate == 0 || approximate == 1, op, "approximate",
                    "must be 0 (erf GELU) or 1 (tanh GELU), but got ", approximate);
  return approximate == 1 ? Act::kGeluTanh : Act::kGeluErf;
}

// grad_output of a GLU backward: floating, on self's device, in the forward output's shape.
at::Tensor check_glu_grad(const char* op, const char* name, const at::Tensor& grad,
                          const at::Tensor& self, const GluShape& s) {
  check_floating(op, name, grad);
  check_same_device(op, name, grad, "self", self);
  OPENNPU_CHECK_ARG(grad.sizes().equals(s.out_sizes), op, name,
                    "must have the forward output's shape ", shape_str(s.out_sizes),
                    ", but got ", shape_str(grad.sizes()));
  return grad.to(self.scalar_type()).contiguous();
}

// The halves of x [outer, 2, m] (contiguous): H is the first when activate_left.
GluHalves split_halves(const at::Tensor& x, const GluShape& s, bool activate_left) {
  return {x, x, activate_left ? 0 : s.m, activate_left ? s.m : 0, 2 * s.m};
}

at::Tensor glu_forward(const char* op, const at::Tensor& self, const GluShape& s, Act act,
                       bool activate_left, at::Tensor gelu_out) {
  const at::Tensor x = self.contiguous();
  at::Tensor out = at::empty(s.out_sizes, x.options());
  if (out.numel() > 0) {
    glu_fwd.get(op, x)(split_halves(x, s, activate_left), s.outer, s.m, act, out, gelu_out);
  }
  return out;
}

at::Tensor glu_backward(const char* op, const at::Tensor& grad, const at::Tensor& self,
                        const GluShape& s, Act act, bool activate_left) {
  const at::Tensor x = self.contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (dx.numel() > 0) {
    glu_bwd.get(op, x)(grad, split_halves(x, s, activate_left), s.outer, s.m, act,
                        split_halves(dx, s, activate_left));
  }
  return dx;
}

// gate and up of the two-tensor SwiGLU: floating, one dtype, one shape, one device.
void check_gate_up(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  check_floating(op, "gate", gate);
  check_floating(op, "up", up);
  check_same_device(op, "up", up, "gate", gate);
  check_same_shape(op, "up", up, "gate", gate);
  OPENNPU_CHECK_ARG(up.scalar_type() == gate.scalar_type(), op, "up",
                    "must have gate's dtype ", gate.scalar_type(), ", but got ", up.scalar_type());
}

}  // namespace

at::Tensor npu_swiglu(const at::Tensor& self, int64_t dim) {
  constexpr const char* op = "npu_swiglu";
  const GluShape s = glu_shape(op, self, dim);
  return glu_forward(op, self, s, Act::kSilu, /*activate_left=*/true, at::Tensor());
}

at::Tensor npu_swiglu_backward(const at::Tensor& grad_output, const at::Tensor& self,
                               int64_t dim) {
  constexpr const char* op = "npu_swiglu_backward";
  const GluShape s = glu_shape(op, self, dim);
  const at::Tensor g = check_glu_grad(op, "grad_output", grad_output, self, s);
  return glu_backward(op, g, self, s, Act::kSilu, /*activate_left=*/true);
}

std::tuple<at::Tensor, at::Tensor> npu_geglu(const at::Tensor& self, int64_t dim,
                                             int64_t approximate, bool activate_left) {
  constexpr const char* op = "npu_geglu";
  const GluShape s = glu_shape(op, self, dim);
  const Act act = gelu_act(op, approximate);
  at::Tensor gelu = at::empty(s.out_sizes, self.options());
  at::Tensor out = glu_forward(op, self, s, act, activate_left, gelu);
  return {out, gelu};
}

// The gelu input is validated but not read: the derivative is recomputed from self in fp32,
// which is more accurate than differentiating through the rounded fp16/bf16 gelu output.
at::Tensor npu_geglu_grad(const at::Tensor& grad_output, const at::Tensor& self,
                          const at::Tensor& gelu, int64_t dim, int64_t approximate,
                          bool activate_left) {
  constexpr const char* op = "npu_geglu_grad";
  const GluShape s = glu_shape(op, self, dim);
  const Act act = gelu_act(op, approximate);
  const at::Tensor g = check_glu_grad(op, "grad_output", grad_output, self, s);
  OPENNPU_CHECK_ARG(gelu.sizes().equals(s.out_sizes), op, "gelu",
                    "must have the forward output's shape ", shape_str(s.out_sizes),
                    ", but got ", shape_str(gelu.sizes()));
  return glu_backward(op, g, self, s, act, activate_left);
}

// silu(gate) * up: npu_swiglu with its halves in two tensors (what the compile backend's
// silu_mul rule puts in place of Llama's MLP activation, whose gate and up come from separate
// linears). Computed in fp32 and rounded once, like npu_swiglu.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  constexpr const char* op = "_silu_mul";
  check_gate_up(op, gate, up);
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor out = at::empty(g.sizes(), g.options());
  if (out.numel() > 0) {
    at::Tensor no_gelu;
    glu_fwd.get(op, g)({g, u, 0, 0, g.numel()}, 1, g.numel(), Act::kSilu, out, no_gelu);
  }
  return out;
}

// (d gate, d up) of silu_mul: grad * up * silu'(gate) and grad * silu(gate).
std::tuple<at::Tensor, at::Tensor> silu_mul_backward(const at::Tensor& grad,
                                                     const at::Tensor& gate,
                                                     const at::Tensor& up) {
  constexpr const char* op = "_silu_mul_backward";
  check_gate_up(op, gate, up);
  check_floating(op, "grad", grad);
  check_same_device(op, "grad", grad, "gate", gate);
  check_same_shape(op, "grad", grad, "gate", gate);
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  const at::Tensor gy = grad.to(g.scalar_type()).contiguous();
  at::Tensor dgate = at::empty(g.sizes(), g.options()), dup = at::empty(g.sizes(), g.options());
  if (g.numel() > 0) {
    glu_bwd.get(op, g)(gy, {g, u, 0, 0, g.numel()}, 1, g.numel(), Act::kSilu,
                        {dgate, dup, 0, 0, g.numel()});
  }
  return {dgate, dup};
}

namespace {

at::Tensor fast_gelu_forward(const char* op, const at::Tensor& self) {
  check_floating(op, "self", self);
  check_strict_dtype(op, "self", self, {at::kHalf, at::kBFloat16, at::kFloat});
  check_strict_rank(op, "self", self, 0, 8);
  const at::Tensor x = self.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (y.numel() > 0) unary_fwd.get(op, x)(x, Act::kFastGelu, y);
  return y;
}

}  // namespace

at::Tensor fast_gelu(const at::Tensor& self) { return fast_gelu_forward("fast_gelu", self); }

at::Tensor npu_fast_gelu(const at::Tensor& self) {
  return fast_gelu_forward("npu_fast_gelu", self);
}

at::Tensor npu_fast_gelu_backward(const at::Tensor& grad, const at::Tensor& self) {
  constexpr const char* op = "npu_fast_gelu_backward";
  check_floating(op, "self", self);
  check_floating(op, "grad", grad);
  check_same_device(op, "grad", grad, "self", self);
  check_same_shape(op, "grad", grad, "self", self);
  const at::Tensor x = self.contiguous();
  const at::Tensor g = grad.to(x.scalar_type()).contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  if (dx.numel() > 0) unary_bwd.get(op, x)(g, x, Act::kFastGelu, dx);
  return dx;
}

void register_npu_entry_points(torch::Library& m) {
  m.impl("npu_swiglu", &npu_swiglu);
  m.impl("npu_swiglu_backward", &npu_swiglu_backward);
  m.impl("npu_geglu", &npu_geglu);
  m.impl("npu_geglu_grad", &npu_geglu_grad);
  m.impl("fast_gelu", &fast_gelu);
  m.impl("npu_fast_gelu", &npu_fast_gelu);
  m.impl("npu_fast_gelu_backward", &npu_fast_gelu_backward);
}

void register_opennpu_entry_points(torch::Library& m) {
  m.impl("_silu_mul", &silu_mul);
  m.impl("_silu_mul_backward", &silu_mul_backward);
}

TORCH_LIBRARY_IMPL(npu, CPU, m) { register_npu_entry_points(m); }

TORCH_LIBRARY_IMPL(opennpu, CPU, m) { register_opennpu_entry_points(m); }

}  // namespace opennpu::activation
