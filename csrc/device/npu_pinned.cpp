// Pinned ("page-locked") host memory for the npu device: tensor.pin_memory(), pin_memory=True
// factories and DataLoader(pin_memory=True). npu memory is host memory already, so pinning only
// has to give what callers observe of pinned memory on a real device:
//   - freed blocks are cached and reused (ATen's CachingHostAllocatorImpl, as CUDA's host
//     allocator), so a DataLoader's per-batch pinned buffers do not pay fresh page faults;
//   - Tensor.is_pinned() is true for any address inside a pinned block, views included.
// A cached block is reused only once the work that read it is complete. npu work runs
// synchronously on the host, so that is always the case when the block is freed.
#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

// Start -> size of every block currently obtained from the system (in use or cached).
struct PinnedRegistry {
  std::mutex mutex;
  std::map<const char*, size_t> blocks;
};

PinnedRegistry& registry() {
  static auto* r = new PinnedRegistry();  // leaked: pinned tensors may outlive static destructors
  return *r;
}

// An event of npu work: complete as soon as it exists (work runs in program order on the host).
struct CompletedEvent {};

struct NpuHostAllocatorImpl final : at::CachingHostAllocatorImpl<c10::Stream, CompletedEvent> {
 private:
  void allocate_host_memory(size_t size, void** ptr) override {
    *ptr = c10::alloc_cpu(size);
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.blocks.emplace(static_cast<const char*>(*ptr), size);
  }

  void free_block(at::HostBlock<c10::Stream>* block) override {
    {
      auto& r = registry();
      std::lock_guard<std::mutex> lock(r.mutex);
      r.blocks.erase(static_cast<const char*>(block->ptr_));
    }
    c10::free_cpu(block->ptr_);
  }

  void record_stream(std::optional<std::vector<CompletedEvent>>& events,
                     c10::Stream /*stream*/) override {
    events->emplace_back();
  }

  bool query_event(CompletedEvent& /*event*/) override { return true; }

  c10::Stream get_current_stream() const override { return current_stream(current_device()); }

  bool stream_is_capturing(c10::Stream /*stream*/) const override { return false; }
};

}  // namespace

DECLARE_HOST_ALLOCATOR(NpuCachingHostAllocator, NpuHostAllocatorImpl, free_pinned_block,
                       npu_caching_host_allocator)

}  // namespace opennpu::device

// torch.accelerator / at::getHostAllocator(PrivateUse1) see the same allocator as pin_memory().
REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, &opennpu::device::npu_caching_host_allocator)

namespace opennpu::device {

c10::Allocator* pinned_host_allocator() { return &npu_caching_host_allocator; }

void empty_pinned_cache() { npu_caching_host_allocator.empty_cache(); }

at::HostStats pinned_host_stats() { return npu_caching_host_allocator.get_stats(); }

void reset_pinned_host_stats(bool peak_only) {
  if (peak_only) {
    npu_caching_host_allocator.reset_peak_stats();
  } else {
    npu_caching_host_allocator.reset_accumulated_stats();
  }
}

bool is_pinned_host_ptr(const void* ptr) {
  const auto* address = static_cast<const char*>(ptr);
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto after = r.blocks.upper_bound(address);
  if (after == r.blocks.begin()) return false;
  const auto& [start, size] = *std::prev(after);
  return address < start + size;
}

}  // namespace opennpu::device
