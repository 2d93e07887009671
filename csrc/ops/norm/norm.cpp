// Entry points of the RMSNorm family (npu_add_rms_norm_cast included): validation, output
// allocation, and their registration for CPU here (for CUDA in norm_cuda.cu).
#include "ops/norm/norm.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <limits>

#include "common/checks.h"
#include "common/dtype.h"

namespace opennpu::norm {

KernelSlots<RmsNormFwdFn> rms_norm_fwd;
KernelSlots<AddRmsNormFwdFn> add_rms_norm_fwd;
KernelSlots<RmsNormBwdFn> rms_norm_bwd;
KernelSlots<AddRmsNormCastFwdFn> add_rms_norm_cast_fwd;

namespace {

// Checks gamma against the trailing dims of x and returns the keep-dim shape of rstd.
std::vector<int64_t> check_norm_args(const char* op, const char* x_name, const at::Tensor& x,
                                     const at::Tensor& gamma, double epsilon) {
  check_floating(op, x_name, x);
  check_floating(op, "gamma", gamma);
  check_same_device(op, "gamma", gamma, x_name, x);
  const int64_t gdim = gamma.dim();
  OPENNPU_CHECK_ARG(gdim >= 1 && gdim <= x.dim() &&
                        x.sizes().slice(x.dim() - gdim).equals(gamma.sizes()),
                    op, "gamma",
                    "must have the shape of trailing dims of '", x_name, "' (",
                    shape_str(x.sizes()), "), e.g. [", x.dim() > 0 ? x.size(-1) : 0,
                    "], but got ", shape_str(gamma.sizes()));
  OPENNPU_CHECK_ARG(epsilon >= 0, op, "epsilon", "must be >= 0, but got ", epsilon);
  std::vector<int64_t> rstd_shape(x.sizes().begin(), x.sizes().end());
  for (int64_t d = x.dim() - gdim; d < x.dim(); ++d) rstd_shape[d] = 1;
  return rstd_shape;
}

// The (x, gamma) dtype pairs Ascend A2/A3 accept: gamma matches x, or gamma is fp32.
void check_strict_norm_dtypes(const char* op, const char* x_name, const at::Tensor& x,
                              const at::Tensor& gamma) {
  check_strict_dtype(op, x_name, x, {at::kHalf, at::kBFloat16, at::kFloat});
  OPENNPU_CHECK_STRICT(gamma.scalar_type() == x.scalar_type() ||
                           gamma.scalar_type() == at::kFloat,
                       op, "gamma", "must have the dtype of '", x_name, "' (", x.scalar_type(),
                       ") or float32, but got ", gamma.scalar_type());
}

// With nothing to normalise (gamma has 0 elements) every row's mean of squares is 0/0: rstd is
// NaN, as in the reference; y is empty anyway.
void fill_empty_norm_rstd(const at::Tensor& gamma_acc, at::Tensor& rstd) {
  if (gamma_acc.numel() == 0) rstd.fill_(std::numeric_limits<double>::quiet_NaN());
}

// x2 broadcasts to x1 (checked without throwing, so the op-named message is the one raised).
bool broadcasts_to(const at::Tensor& x2, const at::Tensor& x1) {
  if (x2.dim() > x1.dim()) return false;
  for (int64_t i = 1; i <= x2.dim(); ++i) {
    if (x2.size(-i) != 1 && x2.size(-i) != x1.size(-i)) return false;
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const char* op, const at::Tensor& self,
                                                    const at::Tensor& gamma_acc,
                                                    const std::vector<int64_t>& rstd_shape,
                                                    double epsilon) {
  const at::Tensor x = self.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty(rstd_shape, x.options().dtype(acc_dtype(x)));
  if (x.numel() > 0) {
    rms_norm_fwd.get(op, x)(x, gamma_acc, epsilon, y, rstd);
  } else {
    fill_empty_norm_rstd(gamma_acc, rstd);
  }
  return {y, rstd};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> npu_rms_norm(const at::Tensor& self, const at::Tensor& gamma,
                                                double epsilon) {
  constexpr const char* op = "npu_rms_norm";
  auto rstd_shape = check_norm_args(op, "self", self, gamma, epsilon);
  check_strict_norm_dtypes(op, "self", self, gamma);
  check_strict_rank(op, "self", self, 1, 8);
  const at::Tensor gamma_acc = gamma.to(acc_dtype(self)).contiguous();
  return rms_norm_forward(op, self, gamma_acc, rstd_shape, epsilon);
}

std::tuple<at::Tensor, at::Tensor> npu_gemma_rms_norm(const at::Tensor& self,
                                                      const at::Tensor& gamma, double epsilon) {
  constexpr const char* op = "npu_gemma_rms_norm";
  auto rstd_shape = check_norm_args(op, "self", self, gamma, epsilon);
  check_strict_norm_dtypes(op, "self", self, gamma);
  check_strict_rank(op, "self", self, 1, 8);
  // Gemma scales by (1 + gamma); the sum is formed in the accumulator dtype, as the golden does.
  const at::Tensor gamma_acc = gamma.to(acc_dtype(self)).add(1).contiguous();
  return rms_norm_forward(op, self, gamma_acc, rstd_shape, epsilon);
}

namespace {

// Validates npu_add_rms_norm's x1 / x2 (also used by npu_add_rms_norm_cast) and returns
// (x1, x2 broadcast to x1's shape), both contiguous.
std::pair<at::Tensor, at::Tensor> check_add_inputs(const char* op, const at::Tensor& x1,
                                                   const at::Tensor& x2, const at::Tensor& gamma) {
  check_floating(op, "x2", x2);
  check_same_device(op, "x2", x2, "x1", x1);
  OPENNPU_CHECK_ARG(x2.scalar_type() == x1.scalar_type(), op, "x2",
                    "must have the dtype of 'x1' (", x1.scalar_type(), "), but got ",
                    x2.scalar_type());
  OPENNPU_CHECK_ARG(broadcasts_to(x2, x1),
                    op, "x2", "must have (or broadcast to) the shape of 'x1' (",
                    shape_str(x1.sizes()), "), but got ", shape_str(x2.sizes()));
  OPENNPU_CHECK_STRICT(gamma.scalar_type() == x1.scalar_type(), op, "gamma",
                       "must have the dtype of 'x1' (", x1.scalar_type(), "), but got ",
                       gamma.scalar_type());
  OPENNPU_CHECK_STRICT(x2.sizes().equals(x1.sizes()), op, "x2", "must have the shape of 'x1' (",
                       shape_str(x1.sizes()), "), but got ", shape_str(x2.sizes()));
  check_strict_rank(op, "x1", x1, 1, 8);
  at::Tensor b = x2.sizes().equals(x1.sizes()) ? x2.contiguous()
                                                : x2.expand(x1.sizes()).contiguous();
  return {x1.contiguous(), std::move(b)};
}

}  // namespace

namespace {

// npu_add_rms_norm's (y, rstd, x) for op (npu_add_rms_norm and its v2 forms). `into`, when
// given, is x2 itself (contiguous, x1's shape, checked by the caller): the sum is written there.
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rms_norm(const char* op, const at::Tensor& x1,
                                                            const at::Tensor& x2,
                                                            const at::Tensor& gamma,
                                                            double epsilon,
                                                            at::Tensor* into = nullptr) {
  auto rstd_shape = check_norm_args(op, "x1", x1, gamma, epsilon);
  check_strict_dtype(op, "x1", x1, {at::kHalf, at::kBFloat16, at::kFloat});
  OPENNPU_CHECK_STRICT(x1.numel() > 0, op, "x1", "must not be empty, but got shape ",
                       shape_str(x1.sizes()));
  const auto [a, b] = check_add_inputs(op, x1, x2, gamma);
  const at::Tensor gamma_acc = gamma.to(acc_dtype(a)).contiguous();
  at::Tensor y = at::empty_like(a, at::MemoryFormat::Contiguous);
  at::Tensor x = into != nullptr ? *into : at::empty_like(a, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty(rstd_shape, a.options().dtype(acc_dtype(a)));
  if (a.numel() > 0) {
    // In place, b is x2 itself (contiguous): the kernel reads each element before it writes it.
    add_rms_norm_fwd.get(op, a)(a, into != nullptr ? x : b, gamma_acc, epsilon, y, rstd, x);
  } else {
    fill_empty_norm_rstd(gamma_acc, rstd);
  }
  return {y, rstd, x};
}

// The v2 forms write y and x back into x1 / x2, so x2 must have x1's shape (no broadcast).
void check_v2_shapes(const char* op, const at::Tensor& x1, const at::Tensor& x2) {
  OPENNPU_CHECK_ARG(x2.defined() && x1.defined() && x2.sizes().equals(x1.sizes()), op, "x2",
                    "must have the shape of 'x1' (", x1.defined() ? shape_str(x1.sizes()) : "None",
                    ": it receives x1 + x2), but got ",
                    x2.defined() ? shape_str(x2.sizes()) : "None");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_add_rms_norm(const at::Tensor& x1,
                                                                const at::Tensor& x2,
                                                                const at::Tensor& gamma,
                                                                double epsilon) {
  return add_rms_norm("npu_add_rms_norm", x1, x2, gamma, epsilon);
}

at::Tensor npu_add_rms_norm_v2(at::Tensor& x1, at::Tensor& x2, const at::Tensor& gamma,
                               double epsilon) {
  constexpr const char* op = "npu_add_rms_norm_v2";
  check_v2_shapes(op, x1, x2);
  auto [y, rstd, x] = add_rms_norm(op, x1, x2, gamma, epsilon);
  x1.copy_(y);
  x2.copy_(x);
  return rstd.to(at::kFloat);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_inplace(const at::Tensor& x1, at::Tensor& x2,
                                                       const at::Tensor& gamma, double epsilon) {
  constexpr const char* op = "_add_rms_norm_inplace";
  check_v2_shapes(op, x1, x2);
  OPENNPU_CHECK_ARG(x2.is_contiguous(), op, "x2",
                    "must be contiguous (it receives x1 + x2 in place), but got strides ",
                    shape_str(x2.strides()));
  // x1 may be x2 itself (x = 2 * x1) or separate memory, but not part of x2 elsewhere: its
  // elements would be read after x2's write reached them.
  const bool shared = x1.numel() > 0 && x1.has_storage() && x2.has_storage() &&
                      x1.storage().is_alias_of(x2.storage());
  const auto overlap = shared ? at::get_overlap_status(x1, x2) : at::MemOverlapStatus::No;
  OPENNPU_CHECK_ARG(overlap == at::MemOverlapStatus::No || overlap == at::MemOverlapStatus::Full,
                    op, "x1", "must be x2 itself or not share memory with x2 (which receives "
                    "x1 + x2 in place), but the two overlap partially");
  auto [y, rstd, x] = add_rms_norm(op, x1, x2, gamma, epsilon, &x2);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_add_rms_norm_v2_functional(
    const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& gamma, double epsilon) {
  constexpr const char* op = "npu_add_rms_norm_v2_functional";
  check_v2_shapes(op, x1, x2);
  auto [y, rstd, x] = add_rms_norm(op, x1, x2, gamma, epsilon);
  return {rstd.to(at::kFloat), y, x};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> npu_add_rms_norm_cast(
    const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& gamma, double epsilon) {
  constexpr const char* op = "npu_add_rms_norm_cast";
  auto rstd_shape = check_norm_args(op, "x1", x1, gamma, epsilon);
  // torch_npu takes fp16/bf16 only (the op exists to fuse the cast of a low-precision result).
  check_strict_dtype(op, "x1", x1, {at::kHalf, at::kBFloat16});
  const auto [a, b] = check_add_inputs(op, x1, x2, gamma);
  const auto acc = acc_dtype(a);
  const at::Tensor gamma_acc = gamma.to(acc).contiguous();
  at::Tensor y1 = at::empty(a.sizes(), a.options().dtype(acc));
  at::Tensor y2 = at::empty_like(a, at::MemoryFormat::Contiguous);
  at::Tensor x = at::empty_like(a, at::MemoryFormat::Contiguous);
  at::Tensor rstd = at::empty(rstd_shape, a.options().dtype(acc));
  if (a.numel() > 0) {
    add_rms_norm_cast_fwd.get(op, a)(a, b, gamma_acc, epsilon, y1, y2, rstd, x);
  } else {
    fill_empty_norm_rstd(gamma_acc, rstd);
  }
  return {y1, y2, rstd, x};
}

std::tuple<at::Tensor, at::Tensor> npu_rms_norm_backward(const at::Tensor& dy,
                                                         const at::Tensor& self,
                                                         const at::Tensor& gamma,
                                                         const at::Tensor& rstd) {
  constexpr const char* op = "npu_rms_norm_backward";
  auto rstd_shape = check_norm_args(op, "self", self, gamma, /*epsilon=*/0.0);
  check_floating(op, "dy", dy);
  check_same_device(op, "dy", dy, "self", self);
  check_same_shape(op, "dy", dy, "self", self);
  check_floating(op, "rstd", rstd);
  check_same_device(op, "rstd", rstd, "self", self);
  OPENNPU_CHECK_ARG(rstd.sizes().equals(rstd_shape), op, "rstd",
                    "must hold one value per normalised row of 'self' in the forward's shape ",
                    shape_str(rstd_shape), ", but got shape ", shape_str(rstd.sizes()));

  const auto acc = acc_dtype(self);
  const at::Tensor x = self.contiguous();
  const at::Tensor g = dy.to(x.scalar_type()).contiguous();
  const at::Tensor r = rstd.to(acc).contiguous();
  const at::Tensor gamma_acc = gamma.to(acc).contiguous();
  at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor dgamma = at::zeros(gamma.sizes(), gamma.options().dtype(acc));
  if (x.numel() > 0) rms_norm_bwd.get(op, x)(g, x, gamma_acc, r, dx, dgamma);
  return {dx, dgamma};
}

void register_npu_entry_points(torch::Library& m) {
  m.impl("npu_rms_norm", &npu_rms_norm);
  m.impl("npu_rms_norm_backward", &npu_rms_norm_backward);
  m.impl("npu_gemma_rms_norm", &npu_gemma_rms_norm);
  m.impl("npu_add_rms_norm", &npu_add_rms_norm);
  m.impl("npu_add_rms_norm_v2", &npu_add_rms_norm_v2);
  m.impl("npu_add_rms_norm_v2_functional", &npu_add_rms_norm_v2_functional);
  m.impl("npu_add_rms_norm_cast", &npu_add_rms_norm_cast);
}

TORCH_LIBRARY_IMPL(npu, CPU, m) { register_npu_entry_points(m); }

// CPU only (npu through its CPU fallback): the compile rule that inserts it checks the device.
TORCH_LIBRARY_IMPL(opennpu, CPU, m) { m.impl("_add_rms_norm_inplace", &add_rms_norm_inplace); }

}  // namespace opennpu::norm
