// PrivateUse1HooksInterface for npu: what ATen asks of an accelerator beyond the guard (default
// generators, pinned host memory, primary contexts, storage resizing).
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <cstring>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

struct NpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  // The emulated devices need no initialisation: every valid device has its context.
  bool hasPrimaryContext(c10::DeviceIndex index) const override {
    return index >= 0 && index < device_count();
  }
  void init() const override { initialize_devices(); }

  c10::DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(c10::DeviceIndex index) const override {
    set_current_device(index);
    bind_thread_to_device(index, /*explicit_request=*/true);
  }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    const c10::DeviceIndex previous = current_device();
    set_current_device(index);
    return previous;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return new_generator(index);
  }

  // Device memory lives on the host; a pointer alone does not say which device's pool holds it,
  // so it is attributed to the current device.
  c10::Device getDeviceFromPtr(void* /*data*/) const override {
    return c10::Device(kNpu, current_device());
  }

  bool isPinnedPtr(const void* data) const override { return is_pinned_host_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_host_allocator(); }

  // UntypedStorage.resize_() of an npu storage: a new block from the storage's device, with the
  // old bytes copied (as resize_bytes_cpu does for CPU storages).
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_bytes) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    const c10::DeviceIndex index = impl->device().index();
    c10::DataPtr data = allocate(index, new_bytes, c10::Device(kNpu, index));
    const size_t keep = std::min(new_bytes, impl->nbytes());
    if (keep > 0 && impl->data() != nullptr) std::memcpy(data.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(data));
    impl->set_nbytes(new_bytes);
  }
};

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new NpuHooks()); }
};
RegisterHooks register_hooks;

}  // namespace

}  // namespace opennpu::device
