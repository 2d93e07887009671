// scaled_dot_product_attention on npu: its composite asks _fused_sdp_choice_stub for a backend only
// on devices that registered one, and otherwise takes the math path, which rounds differently
// from CPU's flash kernel. The npu entry makes CPU's choice, so npu attention runs the kernel CPU
// runs and gives CPU's bits. CPU's choice reads only sizes, strides, dtypes and the global SDP
// flags, so it is asked directly on the npu tensors: that also holds for the fake tensors of
// torch.compile's tracing, which have no memory to alias (and whose CPU aliases the tracing mode
// would reject as real tensors).
#include <ATen/core/Tensor.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/ops/_fused_sdp_choice_native.h>

namespace opennpu::device {

namespace {

int64_t npu_fused_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p,
                             bool is_causal, std::optional<double> scale, bool enable_gqa) {
  return at::native::_fused_sdp_choice_cpp(query, key, value, attn_mask, dropout_p, is_causal,
                                           scale, enable_gqa);
}

}  // namespace

}  // namespace opennpu::device

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &opennpu::device::npu_fused_sdp_choice)
}  // namespace at::native
