// Entry points of npu_scaled_masked_softmax (+ backward): validation, mask geometry, CPU
// registration.
#include "ops/softmax/softmax.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "common/checks.h"
#include "common/dtype.h"

namespace opennpu::softmax {

KernelSlots<SoftmaxFwdFn> softmax_fwd;
KernelSlots<SoftmaxBwdFn> softmax_bwd;

namespace {

// Ascend's limit (seed 000: "the last dim of atten_mask and atten_scores is 32..8192 and a
// multiple of 32"; the kernels take 4-D NCHW tensors).
constexpr int64_t kStrictMinWidth = 32;
constexpr int64_t kStrictMaxWidth = 8192;
constexpr int64_t kStrictWidthMultiple = 32;

void check_input(const char* op, const char* name, const at::Tensor& t) {
  check_floating(op, name, t);
  OPENNPU_CHECK_ARG(t.dim() >= 1, op, name,
                    "must have at least 1 dim (the softmax runs over the last), but got a 0-dim "
                    "tensor");
}

void check_strict_shape(const char* op, const char* name, const at::Tensor& t) {
  check_strict_rank(op, name, t, 4, 4);
  const int64_t w = t.dim() > 0 ? t.size(-1) : 0;
  OPENNPU_CHECK_STRICT(w >= kStrictMinWidth && w <= kStrictMaxWidth &&
                           w % kStrictWidthMultiple == 0,
                       op, name, "must have a last dim in [", kStrictMinWidth, ", ",
                       kStrictMaxWidth, "] that is a multiple of ", kStrictWidthMultiple,
                       ", but got ", w, " (shape ", shape_str(t.sizes()), ")");
}

double check_scale(const char* op, const c10::Scalar& scale) {
  OPENNPU_CHECK_ARG(!scale.isComplex(), op, "scale", "must be a real number, but got ",
                    scale.toComplexDouble());
  return scale.toDouble();
}

// The mask (unless fixed_triu_mask replaces it): bool or uint8, on x's device, broadcastable to x.
void check_mask(const char* op, const at::Tensor& mask, bool fixed_triu_mask, const char* x_name,
                const at::Tensor& x) {
  OPENNPU_CHECK_STRICT(!fixed_triu_mask, op, "fixed_triu_mask",
                       "must be False (reserved on Ascend), but got True");
  if (fixed_triu_mask) {
    OPENNPU_CHECK_ARG(x.dim() >= 2, op, x_name,
                      "must have at least 2 dims with fixed_triu_mask=True (the mask is "
                      "triu(ones(H, W), 1) over the last two), but got shape ",
                      shape_str(x.sizes()));
    return;  // the mask argument is ignored
  }
  const auto dtype = mask.scalar_type();
  OPENNPU_CHECK_ARG(dtype == at::kBool || dtype == at::kByte, op, "mask",
                    "must be bool or uint8 (True / nonzero = masked out), but got ", dtype);
  check_same_device(op, "mask", mask, x_name, x);
  bool ok = mask.dim() <= x.dim();
  for (int64_t i = 1; ok && i <= mask.dim(); ++i) {
    ok = mask.size(-i) == 1 || mask.size(-i) == x.size(-i);
  }
  OPENNPU_CHECK_ARG(ok, op, "mask", "must broadcast to the shape of '", x_name, "' ",
                    shape_str(x.sizes()), ", but got ", shape_str(mask.sizes()));
  OPENNPU_CHECK_STRICT(dtype == at::kBool, op, "mask", "must be bool, but got ", dtype);
  check_strict_shape(op, "mask", mask);
}

// The mask's geometry against x; `mask` may be replaced by a contiguous copy (of its own shape,
// never the broadcast one) when its last dim is strided.
MaskLayout mask_layout(const at::Tensor& x, at::Tensor& mask, bool fixed_triu_mask) {
  MaskLayout layout;
  if (fixed_triu_mask) {
    layout.kind = MaskLayout::Kind::kTriu;
    layout.triu_rows = x.size(-2);
    return layout;
  }
  const int64_t w = x.size(-1);
  at::Tensor expanded = mask.expand(x.sizes());
  if (w > 1 && expanded.stride(-1) != 0 && expanded.stride(-1) != 1) {
    mask = mask.contiguous();
    expanded = mask.expand(x.sizes());
  }
  layout.kind = MaskLayout::Kind::kTensor;
  layout.col_stride = (w == 1 || expanded.stride(-1) == 0) ? 0 : 1;
  // Coalesce the leading dims: an outer dim folds into the next one when its stride is the
  // inner stride times the inner size (e.g. the two broadcast dims of a [1, 1, S, W] mask).
  for (int64_t d = 0; d + 1 < x.dim(); ++d) {
    const int64_t size = x.size(d);
    const int64_t stride = expanded.stride(d);
    if (size == 1) continue;
    if (!layout.sizes.empty() && layout.strides.back() == stride * size) {
      layout.sizes.back() *= size;
      layout.strides.back() = stride;
    } else {
      layout.sizes.push_back(size);
      layout.strides.push_back(stride);
    }
  }
  return layout;
}

const uint8_t* mask_bytes(const at::Tensor& mask, const MaskLayout& layout) {
  if (layout.kind == MaskLayout::Kind::kTriu) return nullptr;
  return static_cast<const uint8_t*>(mask.const_data_ptr());
}

}  // namespace

at::Tensor npu_scaled_masked_softmax(const at::Tensor& x, const at::Tensor& mask,
                                     const c10::Scalar& scale, bool fixed_triu_mask) {
  constexpr const char* op = "npu_scaled_masked_softmax";
  check_input(op, "x", x);
  const double s = check_scale(op, scale);
  check_strict_dtype(op, "x", x, {at::kHalf, at::kBFloat16, at::kFloat});
  check_strict_shape(op, "x", x);
  check_mask(op, mask, fixed_triu_mask, "x", x);

  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc, at::MemoryFormat::Contiguous);
  if (y.numel() == 0) return y;
  at::Tensor m = mask;
  const MaskLayout layout = mask_layout(xc, m, fixed_triu_mask);
  softmax_fwd.get(op, xc)(xc, mask_bytes(m, layout), layout, s, y);
  return y;
}

at::Tensor npu_scaled_masked_softmax_backward(const at::Tensor& y_grad, const at::Tensor& y,
                                              const at::Tensor& mask, const c10::Scalar& scale,
                                              bool fixed_triu_mask) {
  constexpr const char* op = "npu_scaled_masked_softmax_backward";
  check_input(op, "y_grad", y_grad);
  check_input(op, "y", y);
  check_same_device(op, "y", y, "y_grad", y_grad);
  check_same_shape(op, "y", y, "y_grad", y_grad);
  const double s = check_scale(op, scale);
  check_strict_dtype(op, "y_grad", y_grad, {at::kHalf, at::kBFloat16, at::kFloat});
  OPENNPU_CHECK_STRICT(y.scalar_type() == y_grad.scalar_type(), op, "y",
                       "must have the dtype of 'y_grad' (", y_grad.scalar_type(), "), but got ",
                       y.scalar_type());
  check_strict_shape(op, "y_grad", y_grad);
  check_mask(op, mask, fixed_triu_mask, "y_grad", y_grad);

  // The kernel reads dy and y in one dtype: theirs when they agree, else the accumulator dtype
  // (so neither is rounded); dx is returned in y_grad's dtype.
  const auto out_dtype = y_grad.scalar_type();
  const auto dtype = y.scalar_type() == out_dtype
                         ? out_dtype
                         : c10::promoteTypes(acc_dtype(y_grad), acc_dtype(y));
  const at::Tensor dy = y_grad.to(dtype).contiguous();
  const at::Tensor yc = y.to(dtype).contiguous();
  at::Tensor dx = at::empty_like(dy, at::MemoryFormat::Contiguous);
  if (dx.numel() > 0) {
    at::Tensor m = mask;
    const MaskLayout layout = mask_layout(dy, m, fixed_triu_mask);
    softmax_bwd.get(op, yc)(dy, yc, mask_bytes(m, layout), layout, s, dx);
  }
  return dx.to(out_dtype);
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_scaled_masked_softmax", &npu_scaled_masked_softmax);
  m.impl("npu_scaled_masked_softmax_backward", &npu_scaled_masked_softmax_backward);
}

}  // namespace opennpu::softmax
