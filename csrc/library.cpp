// The one TORCH_LIBRARY(npu, m): every schema of opennpu's torch_npu-compatible ops.
// Schemas are copied from the torch_npu contract (shared/spec/torch_npu_api.md), keyword names
// included, so torch.ops.npu.<op>(...) calls written for Ascend bind unchanged.
// Kernels register per device in csrc/ops/<family>/<family>.cpp (CPU) and *_cuda.cu (CUDA);
// fake kernels and autograd live in src/opennpu/ops/<family>.py.
#include <torch/library.h>

#include "common/checks.h"
#include "common/cpu_dispatch.h"

TORCH_LIBRARY(npu, m) {
  // RMSNorm: returns (y, rstd); rstd is float32 with the normalised dims kept as size 1.
  m.def("npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)");
  // Returns (dx, dgamma); dgamma is float32 in gamma's shape.
  m.def("npu_rms_norm_backward(Tensor dy, Tensor self, Tensor gamma, Tensor rstd) -> (Tensor, Tensor)");
  // Gemma RMSNorm: y = x * rstd * (1 + gamma); returns (y, rstd).
  m.def("npu_gemma_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)");
  // Residual add + RMSNorm: returns (y, rstd, x1 + x2).
  m.def("npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor, Tensor)");

  // SwiGLU over halves of `dim`: silu(first) * second.
  m.def("npu_swiglu(Tensor self, int dim=-1) -> Tensor");
  // Gradient of npu_swiglu with respect to its full input.
  m.def("npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor");
  // GeGLU: returns (out, gelu); approximate 0 = erf, 1 = tanh; activate_left picks the gelu half.
  m.def("npu_geglu(Tensor self, int dim=-1, int approximate=1, bool activate_left=False) -> (Tensor, Tensor)");
  // Gradient of npu_geglu's `out` with respect to its input.
  m.def("npu_geglu_grad(Tensor grad_output, Tensor self, Tensor gelu, int dim=-1, int approximate=1, bool activate_left=False) -> Tensor");
  // FastGELU: x * sigmoid(1.702 x). fast_gelu and npu_fast_gelu are the same op.
  m.def("fast_gelu(Tensor self) -> Tensor");
  m.def("npu_fast_gelu(Tensor self) -> Tensor");
  // Gradient of (npu_)fast_gelu.
  m.def("npu_fast_gelu_backward(Tensor grad, Tensor self) -> Tensor");

  // Rotary embedding: x * r1 + rotate(x) * r2; modes 'half' and 'interleave', or x @ rotate.
  m.def("npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode='half', Tensor? rotate=None) -> Tensor");
  // Returns (dx, dr1, dr2); dr1/dr2 are reduced over the dims r1/r2 broadcast along.
  m.def("npu_rotary_mul_backward(Tensor grad, Tensor self, Tensor r1, Tensor r2, str rotary_mode='half') -> (Tensor, Tensor, Tensor)");

  // softmax(where(mask, -10000, x * scale), dim=-1); mask True = masked out, broadcast to x;
  // fixed_triu_mask=True masks columns j > i (triu(ones(H, W), 1)) and ignores `mask`.
  m.def("npu_scaled_masked_softmax(Tensor x, Tensor mask, Scalar scale=1, bool fixed_triu_mask=False) -> Tensor");
  // dx = scale * y * (dy - sum_last(dy * y)), 0 at masked positions; dtype of y_grad.
  m.def("npu_scaled_masked_softmax_backward(Tensor y_grad, Tensor y, Tensor mask, Scalar scale, bool fixed_triu_mask) -> Tensor");
}

// opennpu's own helpers, outside the torch_npu namespace.
TORCH_LIBRARY(opennpu, m) {
  // Strict mode: also enforce the documented Ascend limits (shapes, dtypes, ranks).
  m.def("set_strict(bool enabled) -> ()", [](bool enabled) { opennpu::set_strict_mode(enabled); });
  m.def("is_strict() -> bool", []() { return opennpu::strict_mode(); });
  // The instruction set the CPU kernels run with ("AVX512", "AVX2" or "DEFAULT").
  m.def("cpu_isa() -> str", []() { return std::string(opennpu::cpu_isa_name(opennpu::cpu_isa())); });
}
