// Host side of a fused bias + GELU extension (CUDA kernels in fused_bias_kernel.cu).
#include <torch/extension.h>

torch::Tensor fused_bias_gelu(torch::Tensor x, torch::Tensor bias);
torch::Tensor fused_bias_gelu_backward(torch::Tensor grad, torch::Tensor x, torch::Tensor bias);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &fused_bias_gelu, "bias + GELU (CUDA)", py::arg("x"), py::arg("bias"));
  m.def("backward", &fused_bias_gelu_backward, "bias + GELU backward (CUDA)");
  // m.def("disabled", &fused_bias_gelu);
}
