// The npu kernels that create tensors or change their metadata without computing anything:
// factories on the device allocator, views, resize_ and set_. They share ATen's CPU
// implementations (which only touch metadata and the storage's own allocator), applied to the npu
// tensors directly; everything that computes goes through the fallback (npu_fallback.cpp).
#include <ATen/EmptyTensor.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

c10::DeviceIndex target_device(std::optional<c10::Device> device) {
  if (device.has_value()) {
    TORCH_CHECK(device->type() == kNpu, "npu: cannot allocate a ", *device, " tensor here");
    return npu_device(device->has_index() ? device->index() : -1).index();
  }
  return npu_device(-1).index();
}

void check_factory_options(std::optional<c10::Layout> layout, std::optional<bool> pin_memory) {
  TORCH_CHECK(layout.value_or(c10::kStrided) == c10::kStrided,
              "npu: only strided tensors are supported, but got layout ", *layout);
  TORCH_CHECK(!pin_memory.value_or(false), "Only dense CPU tensors can be pinned");
}

at::Tensor npu_empty(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                     std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                     std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  check_factory_options(layout, pin_memory);
  const c10::DeviceIndex index = target_device(device);
  return at::detail::empty_generic(size, device_allocator(index),
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor npu_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                             std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                             std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_factory_options(layout, pin_memory);
  const c10::DeviceIndex index = target_device(device);
  return at::detail::empty_strided_generic(size, stride, device_allocator(index),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

const at::Tensor& npu_resize_(const at::Tensor& self, c10::IntArrayRef size,
                              std::optional<c10::MemoryFormat> memory_format) {
  // The CPU implementation grows the storage through the storage's allocator: the npu
  // storage's device allocator.
  return at::native::resize_(self, size, memory_format);
}

at::Tensor& npu_set_storage(at::Tensor& self, c10::Storage source, c10::SymInt storage_offset,
                            c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  TORCH_CHECK(source.device().type() == kNpu, "set_: cannot set the storage of an npu tensor to a ",
              source.device(), " storage");
  return at::native::set_storage_cpu_(self, std::move(source), storage_offset.expect_int(),
                                      C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor& npu_set_empty(at::Tensor& self) {
  const c10::DeviceIndex index = self.device().index();
  c10::Storage empty(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), 0, device_allocator(index)->allocate(0),
      device_allocator(index), /*resizable=*/true));
  return at::native::set_storage_cpu_(self, std::move(empty), 0, {0}, {});
}

void npu_record_stream(at::Tensor& /*self*/, c10::Stream /*stream*/) {
  // Memory is freed in program order on the host: nothing to defer.
}

// `param.data = t.npu()` (and back): PyTorch lets .data swap between dense tensors of its own
// backends only; an npu tensor has CPU's TensorImpl type and layout, so dense npu and CPU tensors
// are interchangeable, as torch_npu allows.
bool npu_has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense_host = [](c10::DispatchKeySet keys) {
    return keys.has(c10::DispatchKey::CPU) || keys.has(c10::DispatchKey::PrivateUse1);
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) ||
         (dense_host(self.key_set()) && dense_host(from.key_set()));
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", TORCH_FN(npu_empty));
  m.impl("empty_strided", TORCH_FN(npu_empty_strided));
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("resize_", TORCH_FN(npu_resize_));
  m.impl("set_.source_Storage", TORCH_FN(at::native::set_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(npu_set_storage));
  m.impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  m.impl("set_", TORCH_FN(npu_set_empty));
  m.impl("record_stream", TORCH_FN(npu_record_stream));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(npu_has_compatible_shallow_copy_type));
}

}  // namespace opennpu::device
