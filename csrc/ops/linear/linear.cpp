// opennpu::_linear: F.linear (y = input @ weight^T + bias) for the compile backend's float32
// linears on CPU, run by oneDNN where it beats MKL's sgemm, which ATen's aten::mm uses for float32.
//
// Why: on an AMD Zen 4 (2 threads; MKL runs its generic x86 code paths on AMD CPUs) oneDNN's
// float32 inner product with a plain [N, K] weight ran 1.1-2.0x MKL's sgemm for M >= 64 rows at
// transformer shapes (K 1024-11008, N 1024-11008), but 0.8-0.9x for N = 256 from M = 128, and
// 0.2-0.6x for M = 16-32 with weights up to 1024 x 2816, where reordering the weight on each call
// costs more than the product. So the choice is made per call, on the shape: kOneDnnMinRows rows
// or more and kOneDnnMinOutFeatures outputs or more go to oneDNN.
//
// Numerics: both libraries multiply and accumulate in float32 (oneDNN's fp32 math mode is left at
// its default, strict fp32: no bf16 / tf32 down-conversion), so the results differ only in
// summation order. That order is not as good: measured against float64 with unit-variance data,
// oneDNN's mean error was 1.6-2.1x MKL's (max 2-3x; K = 1024-4096), both far inside the float32
// product's bound. This is why the graph rule that calls this op is opt-in. Other dtypes, the
// empty cases and layouts oneDNN would copy first go to at::linear unchanged.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Context.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include "common/checks.h"

namespace opennpu::linear {
namespace {

constexpr int64_t kOneDnnMinRows = 64;
constexpr int64_t kOneDnnMinOutFeatures = 512;

// mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars,
// str? algorithm) -> Tensor, ATen's oneDNN linear (the op Inductor's weight prepacking targets);
// absent from builds without oneDNN.
const c10::OperatorHandle* onednn_linear_op() {
  static const std::optional<c10::OperatorHandle> handle =
      at::hasMKLDNN() ? c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""})
                      : std::nullopt;
  return handle ? &*handle : nullptr;
}

bool onednn_wins(const at::Tensor& input, const at::Tensor& weight,
                 const std::optional<at::Tensor>& bias) {
  const int64_t k = weight.size(1), n = weight.size(0);
  const int64_t rows = k == 0 ? 0 : input.numel() / k;
  return input.device().is_cpu() && input.scalar_type() == at::kFloat &&
         weight.scalar_type() == at::kFloat && (!bias || bias->scalar_type() == at::kFloat) &&
         rows >= kOneDnnMinRows && n >= kOneDnnMinOutFeatures && input.is_contiguous() && weight.is_contiguous() &&
         (!bias || bias->is_contiguous()) && at::globalContext().userEnabledMkldnn() &&
         onednn_linear_op() != nullptr;
}

at::Tensor onednn_linear(const at::Tensor& input, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  std::vector<c10::IValue> stack{input, weight, bias, std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  onednn_linear_op()->callBoxed(&stack);
  return stack.at(0).toTensor();
}

}  // namespace

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  constexpr const char* op = "_linear";
  OPENNPU_CHECK_ARG(weight.dim() == 2, op, "weight", "must be 2-D [out_features, in_features], "
                    "but got shape ", shape_str(weight.sizes()));
  OPENNPU_CHECK_ARG(input.dim() >= 1 && input.size(-1) == weight.size(1), op, "input",
                    "must end in weight's in_features (", weight.size(1), "), but got shape ",
                    shape_str(input.sizes()));
  OPENNPU_CHECK_ARG(input.scalar_type() == weight.scalar_type(), op, "weight",
                    "must have input's dtype (", input.scalar_type(), "), but got ",
                    weight.scalar_type());
  if (bias) {
    OPENNPU_CHECK_ARG(bias->dim() == 1 && bias->size(0) == weight.size(0), op, "bias",
                      "must be 1-D of weight's out_features (", weight.size(0), "), but got shape ",
                      shape_str(bias->sizes()));
    OPENNPU_CHECK_ARG(bias->scalar_type() == input.scalar_type(), op, "bias",
                      "must have input's dtype (", input.scalar_type(), "), but got ",
                      bias->scalar_type());
  }
  check_same_device(op, "weight", weight, "input", input);
  if (bias) check_same_device(op, "bias", *bias, "input", input);
  if (onednn_wins(input, weight, bias)) return onednn_linear(input, weight, bias);
  return at::linear(input, weight, bias);
}

TORCH_LIBRARY_IMPL(opennpu, CPU, m) { m.impl("_linear", &linear); }

}  // namespace opennpu::linear
