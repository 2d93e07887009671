// torch.autocast("npu"): the cast policy of the AutocastPrivateUse1 dispatch key.
//
// The npu device applies CUDA's autocast op lists (as torch_npu does on Ascend), not the CPU's: a
// script moved from CUDA to npu keeps its mixed-precision numerics. The lists are the AT_FORALL_*
// macros of the installed torch's ATen/autocast_mode.h, which AutocastCUDA is built from too, so
// they follow torch upgrades. Left out are the cuDNN-only entries of AutocastCUDA
// (cudnn_convolution, cudnn_convolution_transpose, _cudnn_rnn): those ops never reach npu.
//
// Every other op falls through to the next key unchanged; ops whose kernels accept mixed input
// dtypes (cat, stack, add, ...) then promote as they do outside autocast.
#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <optional>

namespace opennpu::device {

// AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE spells its signatures with ATen's unqualified names.
using at::DimnameList;
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

namespace {

// binary_cross_entropy on probabilities computed in reduced precision loses most of its accuracy,
// so, as on CUDA, autocast refuses it instead of choosing a dtype behind the caller's back.
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy (torch.nn.BCELoss) is unsafe to autocast "
              "on npu: under torch.autocast(\"npu\") use binary_cross_entropy_with_logits "
              "(torch.nn.BCEWithLogitsLoss), which combines the sigmoid and the loss and is "
              "autocast to float32, or leave the autocast region for this loss.");
}

}  // namespace

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

// The macros below expand to m.impl(...) with at::autocast::WrapFunction<policy, PrivateUse1,...>:
// the wrapper casts the floating-point tensor arguments on npu per the policy, excludes the
// autocast key for the nested call and redispatches to the op.
#define OPENNPU_AUTOCAST_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define OPENNPU_AUTOCAST_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define OPENNPU_AUTOCAST_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define OPENNPU_AUTOCAST_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  // mm, matmul, linear, convolutions, bmm, addmm, baddbmm, RNN cells, attention: fp16 / bf16.
  AT_FORALL_LOWER_PRECISION_FP(OPENNPU_AUTOCAST_LOWER_PRECISION)
  // Pointwise transcendental ops, norms and losses: float32.
  AT_FORALL_FP32(OPENNPU_AUTOCAST_FP32)
  // softmax, log_softmax, sum, prod, cumsum, ...: float32 through their dtype= argument.
  AT_FORALL_FP32_SET_OPT_DTYPE(OPENNPU_AUTOCAST_FP32_SET_OPT_DTYPE)
  // norm overloads without a dtype argument: redispatched to the overload that takes one.
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  // Multi-input ops: the widest floating dtype among the inputs.
  AT_FORALL_PROMOTE(OPENNPU_AUTOCAST_PROMOTE)

  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN(binary_cross_entropy_banned));
}

#undef OPENNPU_AUTOCAST_LOWER_PRECISION
#undef OPENNPU_AUTOCAST_FP32
#undef OPENNPU_AUTOCAST_FP32_SET_OPT_DTYPE
#undef OPENNPU_AUTOCAST_PROMOTE

}  // namespace opennpu::device
