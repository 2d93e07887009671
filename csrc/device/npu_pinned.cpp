// Pinned ("page-locked") host memory for the npu device: tensor.pin_memory(), pin_memory=True
// factories and DataLoader(pin_memory=True). npu memory is host memory already, so pinning only
// records which host pointers were allocated as pinned, for Tensor.is_pinned().
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <mutex>
#include <unordered_set>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

struct PinnedRegistry {
  std::mutex mutex;
  std::unordered_set<const void*> pointers;
};

PinnedRegistry& registry() {
  static auto* r = new PinnedRegistry();  // leaked: pinned tensors may outlive static destructors
  return *r;
}

void free_pinned(void* ptr) {
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.pointers.erase(ptr);
  }
  c10::free_cpu(ptr);
}

struct PinnedHostAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
    void* ptr = c10::alloc_cpu(nbytes);
    {
      auto& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.pointers.insert(ptr);
    }
    return c10::DataPtr(ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

c10::Allocator* pinned_host_allocator() {
  static auto* allocator = new PinnedHostAllocator();
  return allocator;
}

bool is_pinned_host_ptr(const void* ptr) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.pointers.count(ptr) != 0;
}

}  // namespace opennpu::device
