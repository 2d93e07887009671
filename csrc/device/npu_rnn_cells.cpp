// The fused RNN cells that ATen's LSTM / GRU (nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell) call on
// every accelerator, PrivateUse1 included: _thnn_fused_lstm_cell / _thnn_fused_gru_cell and
// their backwards. ATen has them for CUDA only; on CPU it runs the same cells unfused. Here they
// are compositions of ATen ops on the npu tensors (each op runs its CPU kernel in place), and
// autograd uses ATen's own formulas for them (derivatives.yaml), which call these backwards.
//
// Numerics: gates are summed as (input_gates + input_bias) + (hidden_gates + hidden_bias), the
// association of CPU's unfused cell (each linear adds its own bias); fp16 / bf16 compute in
// float32 and round once. The workspace handed from forward to backward holds float32 values.
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

at::Tensor compute_dtype(const at::Tensor& t) {
  const auto dtype = t.scalar_type();
  return (dtype == at::kHalf || dtype == at::kBFloat16) ? t.to(at::kFloat) : t;
}

void check_cell(const char* op, const at::Tensor& input_gates, const at::Tensor& hidden_gates,
                const at::Tensor& state, int64_t chunks, const std::optional<at::Tensor>& input_bias,
                const std::optional<at::Tensor>& hidden_bias) {
  TORCH_CHECK(input_gates.dim() == 2 && input_gates.sizes() == hidden_gates.sizes(), op,
              ": input_gates and hidden_gates must be the same [batch, ", chunks,
              " * hidden] matrix, but got ", input_gates.sizes(), " and ", hidden_gates.sizes());
  TORCH_CHECK(state.dim() == 2 && state.size(0) == input_gates.size(0) &&
                  state.size(1) * chunks == input_gates.size(1),
              op, ": the state must be [batch, hidden] = [", input_gates.size(0), ", ",
              input_gates.size(1) / chunks, "], but got ", state.sizes());
  const bool has_input_bias = input_bias.has_value() && input_bias->defined();
  const bool has_hidden_bias = hidden_bias.has_value() && hidden_bias->defined();
  TORCH_CHECK(has_input_bias == has_hidden_bias, op,
              ": input_bias and hidden_bias must both be given or both be None");
}

// gates (+ bias), in the compute dtype.
at::Tensor with_bias(const at::Tensor& gates, const std::optional<at::Tensor>& bias) {
  at::Tensor out = compute_dtype(gates);
  return (bias.has_value() && bias->defined()) ? out + compute_dtype(*bias) : out;
}

// ---- LSTM ---------------------------------------------------------------------------------
// workspace = [i, f, g, o] after their activations, [batch, 4 * hidden].

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  check_cell("_thnn_fused_lstm_cell", input_gates, hidden_gates, cx, 4, input_bias, hidden_bias);
  const at::Tensor gates = with_bias(input_gates, input_bias) + with_bias(hidden_gates, hidden_bias);
  auto chunks = gates.chunk(4, 1);
  const at::Tensor i = chunks[0].sigmoid(), f = chunks[1].sigmoid();
  const at::Tensor g = chunks[2].tanh(), o = chunks[3].sigmoid();
  const at::Tensor cy = f * compute_dtype(cx) + i * g;
  const at::Tensor hy = o * cy.tanh();
  return {hy.to(input_gates.scalar_type()), cy.to(cx.scalar_type()), at::cat({i, f, g, o}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy, const std::optional<at::Tensor>& grad_cy,
    const at::Tensor& cx, const at::Tensor& cy, const at::Tensor& workspace, bool has_bias) {
  auto gates = workspace.chunk(4, 1);
  const at::Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  const at::Tensor tanh_cy = compute_dtype(cy).tanh();
  const bool has_grad_hy = grad_hy.has_value() && grad_hy->defined();
  const at::Tensor ghy = has_grad_hy ? compute_dtype(*grad_hy) : at::zeros_like(tanh_cy);
  at::Tensor gcy = ghy * o * (1 - tanh_cy * tanh_cy);
  if (grad_cy.has_value() && grad_cy->defined()) gcy = gcy + compute_dtype(*grad_cy);
  const at::Tensor d_i = gcy * g * i * (1 - i);
  const at::Tensor d_f = gcy * compute_dtype(cx) * f * (1 - f);
  const at::Tensor d_g = gcy * i * (1 - g * g);
  const at::Tensor d_o = ghy * tanh_cy * o * (1 - o);
  const at::Tensor grad_gates = at::cat({d_i, d_f, d_g, d_o}, 1);
  const at::ScalarType dtype = cx.scalar_type();
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0).to(dtype) : at::Tensor();
  return {grad_gates.to(dtype), (gcy * f).to(dtype), grad_bias};
}

// ---- GRU ----------------------------------------------------------------------------------
// workspace = [r, z, n, hn, hx]: the reset, update and new gates after their activations, the
// hidden part of the new gate before the reset multiplies it, and hx; [batch, 5 * hidden].

std::tuple<at::Tensor, at::Tensor> fused_gru_cell(
    const at::Tensor& input_gates, const at::Tensor& hidden_gates, const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias, const std::optional<at::Tensor>& hidden_bias) {
  check_cell("_thnn_fused_gru_cell", input_gates, hidden_gates, hx, 3, input_bias, hidden_bias);
  // The reset gate scales only the hidden part of the new gate, so the two sums stay apart.
  auto ic = with_bias(input_gates, input_bias).chunk(3, 1);
  auto hc = with_bias(hidden_gates, hidden_bias).chunk(3, 1);
  const at::Tensor r = (ic[0] + hc[0]).sigmoid();
  const at::Tensor z = (ic[1] + hc[1]).sigmoid();
  const at::Tensor n = (ic[2] + r * hc[2]).tanh();
  const at::Tensor h = compute_dtype(hx);
  const at::Tensor hy = n + z * (h - n);
  return {hy.to(hx.scalar_type()), at::cat({r, z, n, hc[2], h}, 1)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  auto w = workspace.chunk(5, 1);
  const at::Tensor &r = w[0], &z = w[1], &n = w[2], &hn = w[3], &h = w[4];
  const at::Tensor gh = compute_dtype(grad_hy);
  const at::Tensor d_n = gh * (1 - z) * (1 - n * n);
  const at::Tensor d_z = gh * (h - n) * z * (1 - z);
  const at::Tensor d_r = d_n * hn * r * (1 - r);
  const at::ScalarType dtype = grad_hy.scalar_type();
  const at::Tensor grad_input_gates = at::cat({d_r, d_z, d_n}, 1);
  const at::Tensor grad_hidden_gates = at::cat({d_r, d_z, d_n * r}, 1);
  at::Tensor grad_input_bias, grad_hidden_bias;
  if (has_bias) {
    grad_input_bias = grad_input_gates.sum(0).to(dtype);
    grad_hidden_bias = grad_hidden_gates.sum(0).to(dtype);
  }
  return {grad_input_gates.to(dtype), grad_hidden_gates.to(dtype), (gh * z).to(dtype),
          grad_input_bias, grad_hidden_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", &fused_lstm_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", &fused_lstm_cell_backward);
  m.impl("_thnn_fused_gru_cell", &fused_gru_cell);
  m.impl("_thnn_fused_gru_cell_backward", &fused_gru_cell_backward);
}

}  // namespace opennpu::device
