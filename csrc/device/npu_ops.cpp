// torch.ops.opennpu._npu_* : the runtime queries that src/opennpu/npu (torch.npu) is built on.
// The library is loaded with torch.ops.load_library and has no Python extension module, so these
// are operators returning ints, floats and generators.
#include <torch/library.h>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

c10::DeviceIndex checked_index(int64_t device) {
  check_device_index(device);
  return static_cast<c10::DeviceIndex>(device);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(opennpu, m) {
  // Devices visible to the process, and the physical id of each (ASCEND_RT_VISIBLE_DEVICES).
  m.def("_npu_device_count() -> int", []() -> int64_t { return device_count(); });
  m.def("_npu_visible_devices() -> int[]", []() { return visible_physical_ids(); });
  // torch.npu.init(): fixes the visible devices (also done by the first allocation/set_device).
  // Releases the cached blocks of pin_memory()'s allocator (torch_npu._C._npu_hostEmptyCache).
  m.def("_npu_host_empty_cache() -> ()", []() { empty_pinned_cache(); });
  // Pinned allocator statistics: [current, peak, allocated, freed] of allocations,
  // allocated_bytes, active_requests and active_bytes, then num_host_alloc, num_host_free.
  m.def("_npu_host_memory_stats() -> int[]", []() {
    const at::HostStats s = pinned_host_stats();
    std::vector<int64_t> out;
    for (const auto* stat : {&s.allocations, &s.allocated_bytes, &s.active_requests, &s.active_bytes}) {
      out.insert(out.end(), {stat->current, stat->peak, stat->allocated, stat->freed});
    }
    out.insert(out.end(), {s.num_host_alloc, s.num_host_free});
    return out;
  });
  m.def("_npu_host_reset_stats(bool peak_only) -> ()",
        [](bool peak_only) { reset_pinned_host_stats(peak_only); });
  m.def("_npu_init() -> ()", []() { initialize_devices(); });
  m.def("_npu_is_initialized() -> bool", []() { return devices_initialized(); });
  // The calling thread's current device.
  m.def("_npu_current_device() -> int", []() -> int64_t { return current_device(); });
  m.def("_npu_set_device(int device) -> ()", [](int64_t device) {
    set_current_device(checked_index(device));
    bind_thread_to_device(static_cast<c10::DeviceIndex>(device), /*explicit_request=*/true);
  });
  // CPU_AFFINITY_CONF: torch_npu.utils.set_thread_affinity's core list (empty: the current
  // device's range) / reset_thread_affinity.
  m.def("_npu_set_thread_affinity(int[] cores) -> ()",
        [](std::vector<int64_t> cores) { set_thread_affinity(std::move(cores)); });
  m.def("_npu_reset_thread_affinity() -> ()", []() { reset_thread_affinity(); });
  // [allocated, allocated peak, reserved, reserved peak, active blocks, active blocks peak,
  //  segments, segments peak, allocs, frees, host allocs, host frees, alloc retries, ooms,
  //  adopted bytes] of one device, bytes where not counts.
  m.def("_npu_memory_stats(int device) -> int[]", [](int64_t device) {
    const MemoryStats s = memory_stats(checked_index(device));
    return std::vector<int64_t>{s.allocated_current, s.allocated_peak, s.reserved_current,
                                s.reserved_peak, s.active_blocks, s.active_blocks_peak,
                                s.segments, s.segments_peak, s.num_allocs, s.num_frees,
                                s.num_host_allocs, s.num_host_frees, s.num_alloc_retries,
                                s.num_ooms, s.adopted_current};
  });
  m.def("_npu_reset_peak_memory_stats(int device) -> ()",
        [](int64_t device) { reset_peak_memory_stats(checked_index(device)); });
  m.def("_npu_reset_accumulated_memory_stats(int device) -> ()",
        [](int64_t device) { reset_accumulated_memory_stats(checked_index(device)); });
  // Returns every cached (free) block of every device to the host.
  m.def("_npu_empty_cache() -> ()", []() { empty_cache(); });
  // The emulated capacity in bytes (OPENNPU_DEVICE_MEMORY, default 64 GiB) and the fraction of it
  // this process may hold.
  m.def("_npu_device_capacity(int device) -> int",
        [](int64_t device) -> int64_t { return device_capacity(checked_index(device)); });
  m.def("_npu_set_memory_fraction(float fraction, int device) -> ()",
        [](double fraction, int64_t device) { set_memory_fraction(fraction, checked_index(device)); });
  m.def("_npu_memory_fraction(int device) -> float",
        [](int64_t device) { return memory_fraction(checked_index(device)); });
  // The default generator of a device (torch.npu.default_generators).
  m.def("_npu_default_generator(int device) -> Generator?",
        [](int64_t device) { return default_generator(checked_index(device)); });
  // Event.recorded_time(): the host steady clock's nanoseconds when the event was last recorded.
  m.def("_npu_event_recorded_ns(int event) -> int", [](int64_t event) {
    return event_recorded_ns(reinterpret_cast<void*>(event));
  });
  // Milliseconds between two recorded npu events, given as torch.Event.event_id (torch.Event's own
  // elapsed_time accepts no subclass, such as torch.npu.Event). 0 = an event never recorded.
  m.def("_npu_event_elapsed_ms(int start, int end) -> float", [](int64_t start, int64_t end) {
    return event_elapsed_ms(reinterpret_cast<void*>(start), reinterpret_cast<void*>(end));
  });
  // [copies, bytes] made by _copy_from to, from or between npu tensors.
  m.def("_npu_copy_stats() -> int[]", []() {
    const CopyStats s = copy_stats();
    return std::vector<int64_t>{s.copies, s.bytes};
  });
  // Routes the aten ops that have CPU and composite kernels to the fallback (once); returns how many.
  m.def("_npu_route_cpu_kernels() -> int", []() { return route_cpu_kernels_to_fallback(); });
  // [ops run by the fallback, fresh outputs adopted, outputs that view an npu argument].
  m.def("_npu_fallback_stats() -> int[]", []() {
    const FallbackStats s = fallback_stats();
    return std::vector<int64_t>{s.calls, s.adopted_outputs, s.view_outputs};
  });
  // A CPU tensor over an npu tensor's memory (same sizes, strides, offset; no copy): what the
  // hccl process group hands gloo. Writes through either are seen by the other; the alias keeps
  // the npu storage alive.
  m.def("_npu_cpu_alias(Tensor self) -> Tensor", [](const at::Tensor& self) {
    TORCH_CHECK(self.device().type() == c10::DeviceType::PrivateUse1,
                "_npu_cpu_alias expects an npu tensor, got one on ", self.device());
    return make_cpu_alias(self, make_cpu_alias_storage(self.storage()));
  });
}

}  // namespace opennpu::device
