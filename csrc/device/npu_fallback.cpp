// Zero-copy execution of every ATen op on npu tensors.
//
// npu memory is host memory, so an op needs no kernel of its own: the boxed fallback below runs the
// op's CPU kernel on CPU tensors that alias the npu tensors' bytes, and turns the results back into
// npu tensors, copying nothing:
//
//  1. Checks that all tensor arguments are on one npu device (0-dim CPU tensors, and the CPU
//     indices of Tensor?[] lists, are accepted as on CUDA) and sets that device current.
//  2. Replaces each npu tensor by a CPU alias: a CPU TensorImpl with the same sizes, strides,
//     offset, dtype and conj/neg bits, on a CPU StorageImpl over the npu storage's memory (one per
//     npu storage, so two arguments that share memory still share it in the kernel, and overlap
//     and is-same checks see what they see on CPU). Generators become their CPU engines, an npu
//     Device argument becomes CPU.
//  3. Redispatches the op to its CPU kernel, with this thread's CPU allocations served by the
//     device's caching allocator (CpuAllocationRedirect): outputs and temporaries are device
//     memory from the start, counted and capped as such.
//  4. Writes back what the kernel changed in its arguments' metadata: an out= tensor it resized
//     (the new block moves into the npu storage), a tensor it re-strided (t_, squeeze_, set_ ...).
//  5. Maps the results: an argument's alias returned (in-place and out= ops) becomes that npu
//     tensor itself; a tensor on an argument's memory (a view) becomes an npu tensor on the same
//     npu storage; a fresh CPU tensor is adopted in place (its storage's DataPtr is re-labelled
//     npu, its dispatch keys switched), so `a + b` on npu costs one CPU kernel and no copy.
//
// Because the kernel sees ordinary CPU tensors, it takes exactly the CPU code path (TensorIterator
// promotes and casts on CPU only), and an npu program computes the bits a CPU program computes.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/stack.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <atomic>
#include <mutex>
#include <string>

#include "common/random.h"
#include "device/npu_device.h"
#include "device/npu_run.h"

namespace opennpu::device {

namespace {

std::atomic<int64_t> fallback_calls{0};
std::atomic<int64_t> adopted_outputs{0};
std::atomic<int64_t> view_outputs{0};

// The DataPtr context of a CPU alias storage: a reference to the npu StorageImpl it reads.
void release_npu_storage(void* npu_storage_impl) {
  c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(npu_storage_impl));
}

// Arguments torch_npu takes as CPU tensors next to npu ones (host data the op reads before it
// launches): the kernel gets them as they are.
bool host_argument(const c10::FunctionSchema& schema, const c10::Argument& argument) {
  const std::string& op = schema.name();
  const std::string& arg = argument.name();
  if (op == "npu::npu_fusion_attention_v3" || op == "npu::npu_fusion_attention_grad_v3") {
    return arg == "actual_seq_qlen" || arg == "actual_seq_kvlen" || arg == "seed" ||
           arg == "offset";
  }
  // ATB's lengths (torch_npu's tests pass them from the host)
  if (op == "atb::_npu_paged_attention" || op == "atb::_npu_paged_attention_get_workspace") {
    return arg == "context_lens";
  }
  if (op == "atb::_npu_flash_attention") return arg == "seq_len";
  return false;
}

bool is_optional_generator(const c10::Argument& argument) {
  const auto* optional = argument.type()->castRaw<c10::OptionalType>();
  return optional != nullptr && optional->getElementType()->kind() == c10::TypeKind::GeneratorType;
}

struct AliasedStorage {
  c10::Storage npu;
  c10::Storage cpu;
  void* data;     // the memory both shared when the kernel started
  size_t nbytes;
};

struct AliasedTensor {
  at::Tensor npu;
  at::Tensor cpu;
  size_t storage;  // index into FallbackCall::storages of cpu's storage at the start
};

class FallbackCall {
 public:
  FallbackCall(const c10::OperatorHandle& op, torch::jit::Stack* stack)
      : op_(op), schema_(op.schema()), stack_(stack),
        args_begin_(stack->size() - schema_.arguments().size()) {}

  void run() {
    find_device();
    replace_arguments();
    run_on_device(device_, [&] {
      // Fused ops with dropout draw their Philox words from the device's generator.
      PhiloxSourceGuard philox(philox_source_of(default_generator(device_)));
      op_.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack_);
    });
    write_back_arguments();
    map_returns();
  }

 private:
  c10::IValue& arg(size_t i) { return (*stack_)[args_begin_ + i]; }

  [[noreturn]] void mixed_devices(const at::Tensor& t, const c10::Argument& argument) {
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two "
                "devices, ", c10::Device(kNpu, device_), " and ", t.device(), "! (when checking "
                "argument '", argument.name(), "' of ", schema_.operator_name(), ")");
  }

  // Pass 1: the npu device of the call, and the devices of all tensors checked against it.
  void find_device() {
    const auto& arguments = schema_.arguments();
    auto note = [&](const at::Tensor& t) {
      if (t.defined() && t.device().type() == kNpu) {
        if (device_ < 0) device_ = t.device().index();
      }
    };
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::IValue& v = arg(i);
      if (v.isTensor()) {
        note(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) note(t);
      } else if (v.isList()) {
        for (const c10::IValue& e : v.toListRef()) if (e.isTensor()) note(e.toTensor());
      } else if (v.isDevice() && v.toDevice().type() == kNpu && device_ < 0) {
        device_ = npu_device(v.toDevice().has_index() ? v.toDevice().index() : -1).index();
      }
    }
    TORCH_CHECK(device_ >= 0, "npu: ", schema_.operator_name(), " was dispatched to the npu device "
                "but has no npu tensor or device argument");
    for (size_t i = 0; i < arguments.size(); ++i) {
      const c10::IValue& v = arg(i);
      const bool written = arguments[i].alias_info() != nullptr && arguments[i].alias_info()->isWrite();
      auto check = [&](const at::Tensor& t, bool cpu_allowed) {
        if (!t.defined()) return;
        const c10::Device d = t.device();
        if (d.type() == kNpu) {
          if (d.index() != device_) mixed_devices(t, arguments[i]);
          TORCH_CHECK(t.layout() == c10::kStrided, "npu: ", schema_.operator_name(),
                      ": only strided npu tensors are supported, but '", arguments[i].name(),
                      "' has layout ", t.layout());
        } else if (d.is_cpu() && (t.dim() == 0 || (cpu_allowed && !written))) {
          // 0-dim CPU tensors (scalars, optimizer step counters) are read and written in place by
          // the CPU kernel, as CUDA kernels accept CPU scalars.
          cpu_inputs_.push_back(t.unsafeGetTensorImpl());
          cpu_input_storages_.push_back(t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr);
        } else {
          mixed_devices(t, arguments[i]);
        }
      };
      if (v.isTensor()) {
        check(v.toTensor(), host_argument(schema_, arguments[i]));
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList()) check(t, false);
      } else if (v.isList()) {
        // Tensor?[] (index, index_put_): indices may stay on CPU, as with CUDA tensors.
        for (const c10::IValue& e : v.toListRef()) if (e.isTensor()) check(e.toTensor(), true);
      }
    }
  }

  size_t alias_storage(const at::Tensor& t) {
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    for (size_t i = 0; i < storages_.size(); ++i) {
      if (storages_[i].npu.unsafeGetStorageImpl() == impl) return i;
    }
    c10::Storage cpu = make_cpu_alias_storage(t.storage());
    storages_.push_back({t.storage(), cpu, cpu.unsafeGetStorageImpl()->data_ptr().get(), cpu.nbytes()});
    return storages_.size() - 1;
  }

  at::Tensor alias_of(const at::Tensor& t) {
    if (!t.defined() || t.device().type() != kNpu) return t;
    for (const AliasedTensor& a : tensors_) {
      if (a.npu.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()) return a.cpu;
    }
    const size_t storage = alias_storage(t);
    at::Tensor cpu = make_cpu_alias(t, storages_[storage].cpu);
    tensors_.push_back({t, cpu, storage});
    // Kernels that take parameters read and scale their .grad (opennpu's fused optimizer steps):
    // the alias carries an alias of the gradient.
    const at::Tensor& grad = t.unsafeGetTensorImpl()->grad();
    if (grad.defined() && grad.device().type() == kNpu) {
      at::Tensor grad_alias = alias_of(grad);
      cpu.mutable_grad() = grad_alias;
    }
    return cpu;
  }

  // Pass 2: npu tensors -> CPU aliases; generators -> CPU engines; npu devices -> CPU.
  void replace_arguments() {
    const auto& arguments = schema_.arguments();
    for (size_t i = 0; i < arguments.size(); ++i) {
      c10::IValue& v = arg(i);
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        if (t.defined() && t.device().type() == kNpu) v = alias_of(t);
      } else if (v.isTensorList()) {
        c10::List<at::Tensor> list;
        list.reserve(v.toTensorList().size());
        for (const at::Tensor& t : v.toTensorList()) list.push_back(alias_of(t));
        v = std::move(list);
      } else if (v.isList()) {
        auto original = v.toList();
        c10::impl::GenericList list(original.elementType());
        list.reserve(original.size());
        for (const c10::IValue& e : original) list.push_back(e.isTensor() ? c10::IValue(alias_of(e.toTensor())) : e);
        v = std::move(list);
      } else if (v.isGenerator()) {
        v = cpu_engine_of(v.toGenerator());
      } else if (v.isNone() && is_optional_generator(arguments[i])) {
        v = cpu_engine_of(default_generator(device_));
      } else if (v.isDevice()) {
        if (v.toDevice().type() == kNpu) {
          v = c10::Device(c10::DeviceType::CPU);
        } else if (v.toDevice().is_cpu()) {
          explicit_cpu_device_ = true;
        }
      }
    }
  }

  // Moves memory that the kernel put in a CPU alias storage (a resize) into its npu storage.
  void move_reallocated_memory(AliasedStorage& s) {
    c10::StorageImpl* cpu = s.cpu.unsafeGetStorageImpl();
    void* now = cpu->data_ptr().get();
    if (now == s.data && cpu->nbytes() == s.nbytes) return;
    const size_t nbytes = cpu->nbytes();
    // The block (allocated under the redirect, so pool memory) becomes the npu storage's; the alias
    // keeps a non-owning pointer for any CPU view the results map from.
    c10::Storage moved(c10::make_intrusive<c10::StorageImpl>(
        c10::StorageImpl::use_byte_size_t(), nbytes,
        cpu->set_data_ptr(c10::DataPtr(now, c10::Device(c10::DeviceType::CPU))),
        c10::GetCPUAllocator(), /*resizable=*/true));
    adopt_storage(moved, device_, /*in_place=*/true);
    c10::StorageImpl* npu = s.npu.unsafeGetStorageImpl();
    npu->set_data_ptr_noswap(std::move(moved.unsafeGetStorageImpl()->_mutable_data_ptr_no_checks()));
    npu->set_nbytes(nbytes);
    s.data = now;
    s.nbytes = nbytes;
  }

  // The npu storage for CPU storage `impl` of a result or re-pointed argument: an argument's, or
  // fresh memory adopted (in place when nothing else holds it).
  c10::Storage npu_storage_for(const c10::Storage& cpu_storage, bool sole_owner) {
    c10::StorageImpl* impl = cpu_storage.unsafeGetStorageImpl();
    for (const AliasedStorage& s : storages_) {
      if (s.cpu.unsafeGetStorageImpl() == impl) return s.npu;
    }
    for (const auto& [from, to] : adopted_) {
      if (from == impl) return to;
    }
    c10::Storage npu = adopt_storage(cpu_storage, device_, sole_owner);
    adopted_.emplace_back(impl, npu);
    return npu;
  }

  // Pass 4: what the kernel changed in its (mutable) arguments, applied to the npu tensors.
  void write_back_arguments() {
    for (AliasedStorage& s : storages_) move_reallocated_memory(s);
    for (AliasedTensor& a : tensors_) {
      c10::TensorImpl* cpu = a.cpu.unsafeGetTensorImpl();
      c10::TensorImpl* npu = a.npu.unsafeGetTensorImpl();
      if (cpu->storage().unsafeGetStorageImpl() != storages_[a.storage].cpu.unsafeGetStorageImpl()) {
        npu->set_storage_keep_dtype(npu_storage_for(cpu->storage(), /*sole_owner=*/false));
      }
      if (cpu->sizes() != npu->sizes() || cpu->strides() != npu->strides() ||
          cpu->storage_offset() != npu->storage_offset()) {
        npu->set_sizes_and_strides(cpu->sizes(), cpu->strides(), cpu->storage_offset());
      }
    }
  }

  at::Tensor map_result(at::Tensor t) {
    if (!t.defined()) return t;
    c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    for (const AliasedTensor& a : tensors_) {
      if (a.cpu.unsafeGetTensorImpl() == impl) return a.npu;  // in-place / out= result
    }
    if (!t.device().is_cpu() || !t.has_storage() || explicit_cpu_device_) return t;
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    for (size_t i = 0; i < cpu_inputs_.size(); ++i) {
      if (cpu_inputs_[i] == impl || cpu_input_storages_[i] == storage) return t;  // a CPU input's
    }
    for (const AliasedStorage& s : storages_) {
      if (s.cpu.unsafeGetStorageImpl() == storage) {
        view_outputs.fetch_add(1, std::memory_order_relaxed);
        return make_npu_view(s.npu, t);
      }
    }
    // Fresh memory. `t` was moved off the stack: use_count 1 means no one else holds the impl.
    adopted_outputs.fetch_add(1, std::memory_order_relaxed);
    const bool sole_storage_owner = t.storage().use_count() == 1;
    c10::Storage npu = npu_storage_for(t.storage(), sole_storage_owner);
    if (t.use_count() == 1 && npu.unsafeGetStorageImpl() == storage) {
      impl->_change_backend_component_keys(c10::Device(kNpu, device_));
      impl->set_storage_keep_dtype(npu);  // also sets the impl's device
      return t;
    }
    return make_npu_view(npu, t);
  }

  c10::IValue map_result_value(c10::IValue v) {
    if (v.isTensor()) return map_result(std::move(v).toTensor());
    if (v.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& t : v.toTensorList()) list.push_back(map_result(t));
      return list;
    }
    if (v.isList()) {
      auto original = v.toList();
      c10::impl::GenericList list(original.elementType());
      for (const c10::IValue& e : original) list.push_back(e.isTensor() ? c10::IValue(map_result(e.toTensor())) : e);
      return list;
    }
    return v;
  }

  // Pass 5: results back to npu.
  void map_returns() {
    const size_t num_returns = schema_.returns().size();
    TORCH_INTERNAL_ASSERT(stack_->size() >= num_returns);
    for (size_t i = stack_->size() - num_returns; i < stack_->size(); ++i) {
      (*stack_)[i] = map_result_value(std::move((*stack_)[i]));
    }
  }

  const c10::OperatorHandle& op_;
  const c10::FunctionSchema& schema_;
  torch::jit::Stack* stack_;
  const size_t args_begin_;
  c10::DeviceIndex device_ = -1;
  bool explicit_cpu_device_ = false;
  c10::SmallVector<AliasedStorage, 4> storages_;
  c10::SmallVector<AliasedTensor, 4> tensors_;
  c10::SmallVector<const c10::TensorImpl*, 2> cpu_inputs_;
  c10::SmallVector<const c10::StorageImpl*, 2> cpu_input_storages_;
  c10::SmallVector<std::pair<const c10::StorageImpl*, c10::Storage>, 2> adopted_;
};

void npu_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet /*keys*/, torch::jit::Stack* stack) {
  fallback_calls.fetch_add(1, std::memory_order_relaxed);
  FallbackCall(op, stack).run();
}

}  // namespace

void run_boxed_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  npu_fallback(op, keys, stack);
}

c10::Storage make_cpu_alias_storage(const c10::Storage& npu_storage) {
  // Resizing the alias (an out= argument a kernel grows) allocates through the CPU allocator,
  // which the fallback's CpuAllocationRedirect points at the device pool.
  static c10::Allocator* const cpu_allocator = c10::GetCPUAllocator();
  c10::StorageImpl* impl = npu_storage.unsafeGetStorageImpl();
  void* data = impl->_mutable_data_ptr_no_checks().get();
  c10::raw::intrusive_ptr::incref(impl);
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), impl->nbytes(),
      c10::DataPtr(data, impl, &release_npu_storage, c10::Device(c10::DeviceType::CPU)),
      cpu_allocator, impl->resizable()));
}

at::Tensor make_cpu_alias(const at::Tensor& t, c10::Storage cpu_storage) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(cpu_storage), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  if (t.is_conj()) impl->_set_conj(true);
  if (t.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

at::Tensor make_npu_view(const c10::Storage& npu_storage, const at::Tensor& like) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::TensorImpl::VIEW, c10::Storage(npu_storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      like.dtype());
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  if (like.is_conj()) impl->_set_conj(true);
  if (like.is_neg()) impl->_set_neg(true);
  return at::Tensor(std::move(impl));
}

int64_t route_cpu_kernels_to_fallback() {
  // An op with both a CPU kernel and a CompositeExplicitAutograd(NonFunctional) one runs the
  // composite on a backend without a kernel of its own: on npu, native_layer_norm would decompose
  // into math_native_layer_norm while CPU runs its fused kernel, and the results would differ in
  // the last bits. Registering the fallback as the npu kernel of every such op makes npu run each
  // op's CPU kernel wherever CPU does. Ops with no CPU kernel (copy_, _to_copy, clone, expand...)
  // keep their composites, as CPU does.
  static std::mutex mutex;
  static torch::Library* library = nullptr;
  static int64_t routed = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (library != nullptr) return routed;
  library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    const auto op = dispatcher.findOp(name);
    if (!op.has_value() || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) {
      continue;
    }
    std::string qualified = name.name.substr(6);
    if (!name.overload_name.empty()) qualified += "." + name.overload_name;
    library->impl(qualified.c_str(), torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
    ++routed;
  }
  return routed;
}

FallbackStats fallback_stats() {
  return {fallback_calls.load(), adopted_outputs.load(), view_outputs.load()};
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
}

// Composites that choose a kernel by the input's device type would send npu tensors to the
// *_overrideable ops (which have no kernel): run them on the CPU aliases instead, where they pick
// CPU's kernels (oneDNN / slow convolutions) exactly as on CPU.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&npu_fallback>());
}

}  // namespace opennpu::device
