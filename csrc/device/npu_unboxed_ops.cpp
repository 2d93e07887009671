// Unboxed npu kernels for the ops a training step calls most (matmuls, GELU, reductions, the
// losses, AdamW's in-place updates and its _foreach_* ops), through one generic wrapper.
//
// Each does what the boxed fallback (npu_fallback.cpp) does for the common case: CPU aliases of the
// npu arguments (one CPU storage per npu storage), the op's CPU kernel with the device current and
// CPU allocations served by its pool, results mapped back (an argument's alias becomes that npu
// tensor, a view of an argument's memory an npu view, a fresh output is adopted in place), without
// boxing the arguments and results into IValues twice. A call with anything else (an npu tensor
// on another device or not strided, a CPU tensor that is not 0-dim, another device) goes to the
// boxed fallback as it is, so errors and unusual cases behave exactly as before.
//
// The _foreach_* ops have no CPU kernel of their own (their per-tensor loop is a
// CompositeExplicitAutograd kernel): registered here, one call runs that loop on the CPU aliases,
// where it would otherwise dispatch every per-tensor op back to npu.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_foreach_add_ops.h>
#include <ATen/ops/_foreach_addcdiv_ops.h>
#include <ATen/ops/_foreach_addcmul_ops.h>
#include <ATen/ops/_foreach_div_ops.h>
#include <ATen/ops/_foreach_lerp_ops.h>
#include <ATen/ops/_foreach_mul_ops.h>
#include <ATen/ops/_foreach_sqrt_ops.h>
#include <ATen/ops/addcdiv_ops.h>
#include <ATen/ops/addcmul_ops.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/fill_ops.h>
#include <ATen/ops/gelu_backward_ops.h>
#include <ATen/ops/gelu_ops.h>
#include <ATen/ops/lerp_ops.h>
#include <ATen/ops/mm_ops.h>
#include <ATen/ops/mse_loss_backward_ops.h>
#include <ATen/ops/mse_loss_ops.h>
#include <ATen/ops/mul_ops.h>
#include <ATen/ops/sqrt_ops.h>
#include <ATen/ops/sum_ops.h>
#include <ATen/core/boxing/impl/boxing.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "device/npu_device.h"
#include "device/npu_run.h"

namespace opennpu::device {

namespace {

// The CPU aliases of one call's npu arguments, and the mapping of its results back.
class AliasCall {
 public:
  // False once an argument needs the boxed fallback (see the file comment).
  bool ok() const { return ok_; }
  c10::DeviceIndex device() const { return device_; }

  at::Tensor map(const at::Tensor& t) {
    if (!t.defined()) return t;
    const c10::Device d = t.device();
    if (d.type() == kNpu) {
      if (device_ < 0) device_ = d.index();
      if (d.index() != device_ || t.layout() != c10::kStrided) {
        ok_ = false;
        return t;
      }
      for (const auto& [npu, cpu] : tensors_) {
        if (npu == t.unsafeGetTensorImpl()) return cpu;
      }
      at::Tensor cpu = make_cpu_alias(t, storage_alias(t.storage()));
      tensors_.emplace_back(t.unsafeGetTensorImpl(), cpu);
      return cpu;
    }
    if (d.is_cpu() && t.dim() == 0) {
      cpu_inputs_.push_back(t.unsafeGetTensorImpl());
      cpu_input_storages_.push_back(t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr);
      return t;
    }
    ok_ = false;
    return t;
  }
  std::optional<at::Tensor> map(const std::optional<at::Tensor>& t) {
    if (!t.has_value()) return t;
    return map(*t);
  }
  std::vector<at::Tensor> map(at::TensorList list) {
    std::vector<at::Tensor> out;
    out.reserve(list.size());
    for (const at::Tensor& t : list) out.push_back(map(t));
    return out;
  }
  // Everything else passes as it is.
  template <typename T>
  std::decay_t<T> map(const T& v) { return v; }

  // A result of the CPU kernel as an npu tensor.
  at::Tensor result(at::Tensor t) {
    if (!t.defined()) return t;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    for (const auto& [npu, cpu] : tensors_) {
      if (cpu.unsafeGetTensorImpl() == impl) return at::Tensor(c10::intrusive_ptr<c10::TensorImpl>::reclaim_copy(npu));
    }
    if (!t.device().is_cpu() || !t.has_storage()) return t;
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    for (size_t i = 0; i < cpu_inputs_.size(); ++i) {
      if (cpu_inputs_[i] == impl || cpu_input_storages_[i] == storage) return t;  // a CPU input's
    }
    for (const auto& [npu, cpu] : storages_) {
      if (cpu.unsafeGetStorageImpl() == storage) return make_npu_view(npu, t);
    }
    for (const auto& [from, to] : adopted_) {
      if (from == storage) return make_npu_view(to, t);
    }
    // Fresh memory: use_count 1 means no one else holds the impl (or its storage).
    c10::Storage npu = adopt_storage(t.storage(), device_, /*in_place=*/t.storage().use_count() == 1);
    adopted_.emplace_back(storage, npu);
    if (t.use_count() == 1 && npu.unsafeGetStorageImpl() == storage) {
      impl->_change_backend_component_keys(c10::Device(kNpu, device_));
      impl->set_storage_keep_dtype(npu);  // also sets the impl's device
      return t;
    }
    return make_npu_view(npu, t);
  }
  std::vector<at::Tensor> result(std::vector<at::Tensor> list) {
    for (at::Tensor& t : list) t = result(std::move(t));
    return list;
  }

  // An in-place op's self: its alias must still describe the npu tensor (in-place kernels of the
  // ops registered here neither resize nor re-stride it).
  void check_unchanged(const at::Tensor& self) const {
    for (const auto& [npu, cpu] : tensors_) {
      if (npu != self.unsafeGetTensorImpl()) continue;
      TORCH_INTERNAL_ASSERT(cpu.sizes() == self.sizes() && cpu.strides() == self.strides() &&
                            cpu.storage_offset() == self.storage_offset() &&
                            cpu.const_data_ptr() == self.const_data_ptr(),
                            "npu: an in-place kernel changed its argument's metadata");
    }
  }

 private:
  c10::Storage storage_alias(const c10::Storage& npu) {
    c10::StorageImpl* impl = npu.unsafeGetStorageImpl();
    for (const auto& [n, cpu] : storages_) {
      if (n.unsafeGetStorageImpl() == impl) return cpu;
    }
    c10::Storage cpu = make_cpu_alias_storage(npu);
    storages_.emplace_back(npu, cpu);
    return cpu;
  }

  bool ok_ = true;
  c10::DeviceIndex device_ = -1;
  c10::SmallVector<std::pair<c10::Storage, c10::Storage>, 4> storages_;        // npu, CPU alias
  c10::SmallVector<std::pair<c10::TensorImpl*, at::Tensor>, 4> tensors_;       // npu, CPU alias
  c10::SmallVector<const c10::TensorImpl*, 2> cpu_inputs_;
  c10::SmallVector<const c10::StorageImpl*, 2> cpu_input_storages_;
  c10::SmallVector<std::pair<const c10::StorageImpl*, c10::Storage>, 2> adopted_;
};

// The npu kernel of aten op Op (an at::_ops struct). Returns: a fresh Tensor or Tensor[], the
// first argument (in-place ops, Tensor&), or nothing (in-place _foreach_* ops).
template <typename Op, typename Sig = typename Op::schema>
struct NpuKernel;

template <typename Op, typename Ret, typename... Args>
struct NpuKernel<Op, Ret(Args...)> {
  static Ret call(c10::DispatchKeySet keys, Args... args) {
    AliasCall call;
    std::tuple<decltype(call.map(args))...> cpu_args{call.map(args)...};  // left to right
    if (!call.ok() || call.device() < 0) return boxed(keys, args...);
    auto kernel = [&] {
      return std::apply([](auto&... a) -> decltype(auto) {
        return Op::redispatch(c10::DispatchKeySet(c10::DispatchKey::CPU), a...);
      }, cpu_args);
    };
    if constexpr (std::is_void_v<Ret>) {
      run_on_device(call.device(), kernel);
    } else if constexpr (std::is_lvalue_reference_v<Ret>) {
      run_on_device(call.device(), kernel);
      auto& self = std::get<0>(std::forward_as_tuple(args...));
      call.check_unchanged(self);
      return self;
    } else {
      return call.result(run_on_device(call.device(), kernel));
    }
  }

  static Ret boxed(c10::DispatchKeySet keys, Args... args) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow(Op::name, Op::overload_name);
    static const c10::BoxedKernel fallback = c10::BoxedKernel::makeFromFunction<&run_boxed_fallback>();
    return c10::impl::BoxedKernelWrapper<Ret(Args...)>::call(fallback, op, keys, args...);
  }
};

template <typename Op>
void impl(torch::Library& m) {
  std::string name = Op::name;
  name = name.substr(6);  // "aten::"
  if (std::string(Op::overload_name).size() > 0) name += std::string(".") + Op::overload_name;
  m.impl(name.c_str(), TORCH_FN(NpuKernel<Op>::call));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  // Forward and backward of Linear + GELU + MSE.
  impl<at::_ops::addmm>(m);
  impl<at::_ops::mm>(m);
  impl<at::_ops::gelu>(m);
  impl<at::_ops::gelu_backward>(m);
  impl<at::_ops::sum_dim_IntList>(m);
  impl<at::_ops::mse_loss>(m);
  impl<at::_ops::mse_loss_backward>(m);
  impl<at::_ops::mul_Scalar>(m);
  impl<at::_ops::fill__Scalar>(m);
  // The for-loop optimizers' per-parameter updates.
  impl<at::_ops::sqrt>(m);
  impl<at::_ops::lerp__Scalar>(m);
  impl<at::_ops::addcmul_>(m);
  impl<at::_ops::addcdiv_>(m);
  // The foreach optimizers' (AdamW, Adam, SGD with momentum ...) updates: one call per list.
  impl<at::_ops::_foreach_add__Scalar>(m);
  impl<at::_ops::_foreach_mul__Scalar>(m);
  impl<at::_ops::_foreach_div__ScalarList>(m);
  impl<at::_ops::_foreach_lerp__Scalar>(m);
  impl<at::_ops::_foreach_addcmul__Scalar>(m);
  impl<at::_ops::_foreach_addcdiv__ScalarList>(m);
  impl<at::_ops::_foreach_sqrt>(m);
}

}  // namespace opennpu::device
