// Unboxed npu kernels for the hottest tiny ops: the arithmetic binary ops. They do what the boxed
// fallback does (CPU aliases of the npu arguments, the CPU kernel, the fresh output adopted in
// place) without boxing arguments and results into IValues twice, which is most of the fallback's
// cost on a 16-element tensor. Any other op, and anything unusual here, takes the fallback.
#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sub.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <torch/library.h>

#include <utility>

#include "device/npu_device.h"
#include "device/npu_run.h"

namespace opennpu::device {

namespace {

// The CPU view of one argument of a binary op, and the call's device.
class BinaryArgs {
 public:
  BinaryArgs(const char* op, const at::Tensor& self, const at::Tensor& other) {
    device_ = device_of(self);
    if (device_ < 0) device_ = device_of(other);
    TORCH_INTERNAL_ASSERT(device_ >= 0, op, ": dispatched to npu without an npu tensor");
    check(op, "self", self);
    check(op, "other", other);
    if (self.device().type() == kNpu) {
      self_storage_ = make_cpu_alias_storage(self.storage());
      self_ = make_cpu_alias(self, self_storage_);
    } else {
      self_ = self;
    }
    if (other.device().type() == kNpu) {
      // One CPU storage per npu storage, as in the fallback (overlap checks see the sharing).
      const bool shared = self.device().type() == kNpu && other.storage().is_alias_of(self.storage());
      other_ = make_cpu_alias(other, shared ? self_storage_ : make_cpu_alias_storage(other.storage()));
    } else {
      other_ = other;
    }
  }

  const at::Tensor& self() const { return self_; }
  const at::Tensor& other() const { return other_; }
  c10::DeviceIndex device() const { return device_; }

  // Runs `kernel` on the CPU aliases with the call's device current and CPU allocations served by
  // its pool.
  template <typename Kernel>
  auto run(Kernel&& kernel) const {
    return run_on_device(device_, std::forward<Kernel>(kernel));
  }

  // The CPU kernel's fresh output, made an npu tensor in place (nothing else holds it).
  at::Tensor adopt(at::Tensor out) const {
    c10::TensorImpl* impl = out.unsafeGetTensorImpl();
    if (out.use_count() == 1 && out.storage().use_count() == 1) {
      c10::Storage storage = adopt_storage(out.storage(), device_, /*in_place=*/true);
      impl->_change_backend_component_keys(c10::Device(kNpu, device_));
      impl->set_storage_keep_dtype(std::move(storage));
      return out;
    }
    return make_npu_view(adopt_storage(out.storage(), device_, /*in_place=*/false), out);
  }

 private:
  static c10::DeviceIndex device_of(const at::Tensor& t) {
    return t.defined() && t.device().type() == kNpu ? t.device().index() : -1;
  }

  void check(const char* op, const char* name, const at::Tensor& t) const {
    const c10::Device d = t.device();
    const bool ok = (d.type() == kNpu && d.index() == device_ && t.layout() == c10::kStrided) ||
                    (d.is_cpu() && t.dim() == 0);
    TORCH_CHECK(ok, "Expected all tensors to be on the same device, but found at least two "
                "devices, ", c10::Device(kNpu, device_), " and ", d, "! (when checking argument '",
                name, "' of aten::", op, ")");
  }

  c10::DeviceIndex device_ = -1;
  c10::Storage self_storage_;
  at::Tensor self_, other_;
};

template <const char* Name, at::Tensor (*CpuOp)(const at::Tensor&, const at::Tensor&, const c10::Scalar&)>
at::Tensor binary_alpha(const at::Tensor& self, const at::Tensor& other, const c10::Scalar& alpha) {
  BinaryArgs args(Name, self, other);
  return args.adopt(args.run([&] { return CpuOp(args.self(), args.other(), alpha); }));
}

template <const char* Name, at::Tensor (*CpuOp)(const at::Tensor&, const at::Tensor&)>
at::Tensor binary(const at::Tensor& self, const at::Tensor& other) {
  BinaryArgs args(Name, self, other);
  return args.adopt(args.run([&] { return CpuOp(args.self(), args.other()); }));
}

// In-place: the CPU kernel writes self's bytes through its alias; self keeps its metadata.
template <const char* Name, at::Tensor& (at::Tensor::*CpuOp)(const at::Tensor&, const c10::Scalar&) const>
at::Tensor& binary_alpha_(at::Tensor& self, const at::Tensor& other, const c10::Scalar& alpha) {
  TORCH_CHECK(self.device().type() == kNpu, "Expected all tensors to be on the same device, but "
              "found at least two devices, ", other.device(), " and ", self.device(), "!");
  BinaryArgs args(Name, self, other);
  args.run([&] { (args.self().*CpuOp)(args.other(), alpha); return 0; });
  return self;
}

template <const char* Name, at::Tensor& (at::Tensor::*CpuOp)(const at::Tensor&) const>
at::Tensor& binary_(at::Tensor& self, const at::Tensor& other) {
  TORCH_CHECK(self.device().type() == kNpu, "Expected all tensors to be on the same device, but "
              "found at least two devices, ", other.device(), " and ", self.device(), "!");
  BinaryArgs args(Name, self, other);
  args.run([&] { (args.self().*CpuOp)(args.other()); return 0; });
  return self;
}

at::Tensor cpu_add(const at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha) { return at::add(a, b, alpha); }
at::Tensor cpu_sub(const at::Tensor& a, const at::Tensor& b, const c10::Scalar& alpha) { return at::sub(a, b, alpha); }
at::Tensor cpu_mul(const at::Tensor& a, const at::Tensor& b) { return at::mul(a, b); }
at::Tensor cpu_div(const at::Tensor& a, const at::Tensor& b) { return at::div(a, b); }

constexpr char kAdd[] = "add.Tensor", kSub[] = "sub.Tensor", kMul[] = "mul.Tensor", kDiv[] = "div.Tensor";
constexpr char kAdd_[] = "add_.Tensor", kSub_[] = "sub_.Tensor", kMul_[] = "mul_.Tensor", kDiv_[] = "div_.Tensor";

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl(kAdd, TORCH_FN((binary_alpha<kAdd, &cpu_add>)));
  m.impl(kSub, TORCH_FN((binary_alpha<kSub, &cpu_sub>)));
  m.impl(kMul, TORCH_FN((binary<kMul, &cpu_mul>)));
  m.impl(kDiv, TORCH_FN((binary<kDiv, &cpu_div>)));
  m.impl(kAdd_, TORCH_FN((binary_alpha_<kAdd_, &at::Tensor::add_>)));
  m.impl(kSub_, TORCH_FN((binary_alpha_<kSub_, &at::Tensor::sub_>)));
  m.impl(kMul_, TORCH_FN((binary_<kMul_, &at::Tensor::mul_>)));
  m.impl(kDiv_, TORCH_FN((binary_<kDiv_, &at::Tensor::div_>)));
}

}  // namespace opennpu::device
