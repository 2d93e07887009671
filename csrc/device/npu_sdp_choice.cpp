// scaled_dot_product_attention on npu: its composite asks _fused_sdp_choice_stub for a backend only
// on devices that registered one, and otherwise takes the math path, which rounds differently
// from CPU's flash kernel. The npu entry asks the CPU choice (the _fused_sdp_choice op on CPU
// aliases), so npu attention runs the kernel CPU runs and gives CPU's bits.
#include <ATen/core/Tensor.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice.h>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

at::Tensor cpu_alias(const at::Tensor& t) {
  if (!t.defined() || t.device().type() != kNpu) return t;
  return make_cpu_alias(t, make_cpu_alias_storage(t.storage()));
}

int64_t npu_fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p,
                             bool is_causal, std::optional<double> scale, bool enable_gqa) {
  std::optional<at::Tensor> mask;
  if (attn_mask.has_value()) mask = cpu_alias(*attn_mask);
  return at::_fused_sdp_choice(cpu_alias(query), cpu_alias(key), cpu_alias(value), mask, dropout_p,
                               is_causal, scale, enable_gqa);
}

}  // namespace

}  // namespace opennpu::device

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &opennpu::device::npu_fused_sdp_choice)
}  // namespace at::native
