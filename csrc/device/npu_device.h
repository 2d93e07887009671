// The emulated `npu` device (PrivateUse1 renamed "npu"): the pieces of its runtime that the files in
// csrc/device/ share. Device memory is host memory; every ATen op runs its CPU kernel on the same
// bytes (npu_fallback.cpp), so nothing here models a separate address space.
#pragma once

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/Generator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace opennpu {
class PhiloxSource;
}

namespace opennpu::device {

constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;
// Upper bound of OPENNPU_DEVICE_COUNT; fixed-size tables are indexed by device.
constexpr int kMaxDevices = 64;

// ---- npu_device_count.cpp ------------------------------------------------------------------
// Devices visible to this process: OPENNPU_DEVICE_COUNT (default 8) physical devices, narrowed and
// re-indexed from 0 by ASCEND_RT_VISIBLE_DEVICES. Re-read on every query until the runtime is
// initialised (the first npu allocation or set_device), then fixed, as CANN does.
c10::DeviceIndex device_count() noexcept;
void initialize_devices();  // idempotent; fixes the visible devices
bool devices_initialized() noexcept;
// Throws a clear error unless 0 <= index < device_count().
void check_device_index(int64_t index);
// The physical id of each visible device (ASCEND_RT_VISIBLE_DEVICES order).
std::vector<int64_t> visible_physical_ids();
// OPENNPU_DEVICE_COUNT: the devices the machine has, before ASCEND_RT_VISIBLE_DEVICES.
int64_t physical_device_count();

// ---- npu_affinity.cpp ----------------------------------------------------------------------
// CPU_AFFINITY_CONF core binding. A thread is bound to a device's cores when it
// sets that device explicitly (explicit_request) or, once, when it first runs a kernel on one.
void bind_thread_to_device(c10::DeviceIndex index, bool explicit_request);
// torch_npu.utils.set_thread_affinity (empty: the current device's range) / reset_thread_affinity
// (the cores of the last explicit set_device). Both do nothing while binding is off.
void set_thread_affinity(std::vector<int64_t> cores);
void reset_thread_affinity();

// ---- npu_guard.cpp -------------------------------------------------------------------------
// The calling thread's current device (0 until set_device).
c10::DeviceIndex current_device() noexcept;
void set_current_device(c10::DeviceIndex index);  // checked
c10::Device npu_device(c10::DeviceIndex index);   // npu:index, index resolved (-1 = current)

// ---- npu_stream.cpp ------------------------------------------------------------------------
// Streams are ids; id 0 is each device's default stream. Work runs on the host in program order, so
// every stream is always complete.
c10::Stream current_stream(c10::DeviceIndex index);
c10::Stream exchange_stream(c10::Stream stream);  // returns the previous one of stream's device
c10::Stream new_stream(c10::DeviceIndex index);
// Events hold the host time at which they were last recorded.
void record_event(void** event, const c10::Stream& stream, c10::DeviceIndex index, c10::EventFlag flag);
void destroy_event(void* event) noexcept;
double event_elapsed_ms(void* start, void* end);
int64_t event_recorded_ns(void* event);  // host steady-clock time of the last record

// ---- npu_allocator.cpp ---------------------------------------------------------------------
// The caching allocator of one device: its DataPtrs carry device npu:index.
c10::Allocator* device_allocator(c10::DeviceIndex index);
// Allocates `nbytes` from device `index`'s pool with a DataPtr on `data_ptr_device` (npu:index, or
// CPU for allocations a CPU kernel makes on an npu op's behalf; see CpuAllocationRedirect).
c10::DataPtr allocate(c10::DeviceIndex index, size_t nbytes, c10::Device data_ptr_device);

// While alive, CPU allocations of this thread (c10::GetCPUAllocator()) come from device `index`'s
// pool: the CPU kernel that runs an npu op then allocates its outputs (and temporaries) as device
// memory, counted and capped like it, with DataPtrs still on CPU until adopt_storage moves them.
class CpuAllocationRedirect {
 public:
  explicit CpuAllocationRedirect(c10::DeviceIndex index);
  ~CpuAllocationRedirect();
  CpuAllocationRedirect(const CpuAllocationRedirect&) = delete;
  CpuAllocationRedirect& operator=(const CpuAllocationRedirect&) = delete;

 private:
  int previous_;
};

// Makes a CPU storage device memory of npu:index without copying. A storage the pool allocated
// (under a CpuAllocationRedirect) only changes its DataPtr's device; other host memory is wrapped
// in a DataPtr that keeps the original alive and is counted in the device's statistics. In place
// when `in_place` (the caller holds the only references), else a new StorageImpl is returned.
c10::Storage adopt_storage(const c10::Storage& cpu_storage, c10::DeviceIndex index, bool in_place);

// The statistics of one device, as torch.cuda.memory_stats names them.
struct MemoryStats {
  int64_t allocated_current = 0, allocated_peak = 0;  // bytes in live blocks
  int64_t reserved_current = 0, reserved_peak = 0;    // bytes in live + cached blocks
  int64_t active_blocks = 0, active_blocks_peak = 0;
  int64_t segments = 0, segments_peak = 0;            // host allocations held (live + cached)
  int64_t num_allocs = 0, num_frees = 0;              // block requests served / returned
  int64_t num_host_allocs = 0, num_host_frees = 0;    // host malloc / free calls
  int64_t num_alloc_retries = 0, num_ooms = 0;
  int64_t adopted_current = 0;                        // bytes of adopted (foreign) host memory
};
MemoryStats memory_stats(c10::DeviceIndex index);
void reset_peak_memory_stats(c10::DeviceIndex index);
void reset_accumulated_memory_stats(c10::DeviceIndex index);
void empty_cache();
int64_t device_capacity(c10::DeviceIndex index);    // bytes (OPENNPU_DEVICE_MEMORY)
void set_memory_fraction(double fraction, c10::DeviceIndex index);
double memory_fraction(c10::DeviceIndex index);

// ---- npu_pinned.cpp ------------------------------------------------------------------------
// pin_memory()'s caching allocator; empty_pinned_cache returns its cached blocks to the system.
c10::Allocator* pinned_host_allocator();
void empty_pinned_cache();
at::HostStats pinned_host_stats();
void reset_pinned_host_stats(bool peak_only);
bool is_pinned_host_ptr(const void* ptr);  // true inside any pinned block

// ---- npu_generator.cpp ---------------------------------------------------------------------
// npu generators are CPUGeneratorImpl engines (mt19937) under an npu device, so an npu op draws
// exactly the numbers its CPU kernel draws on CPU from the same seed.
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);
// The CPU generator that a CPU kernel running an npu op must be given in place of `npu_generator`.
at::Generator cpu_engine_of(const at::Generator& npu_generator);
// The generator's Philox stream, which fused ops with dropout draw from on npu.
PhiloxSource* philox_source_of(const at::Generator& npu_generator);

// ---- npu_copy.cpp --------------------------------------------------------------------------
// Counters of the copies the device has made (cross-device copies and npu copy_), for tests that
// check that an operation adds none.
struct CopyStats {
  int64_t copies = 0;
  int64_t bytes = 0;
};
CopyStats copy_stats();

// ---- npu_fallback.cpp ----------------------------------------------------------------------
struct FallbackStats {
  int64_t calls = 0;             // ops run through the boxed fallback
  int64_t adopted_outputs = 0;   // fresh CPU outputs turned into npu tensors without a copy
  int64_t view_outputs = 0;      // outputs that alias an npu input's storage
};
FallbackStats fallback_stats();
// The boxed fallback itself, for unboxed kernels that hand it the calls they do not handle.
void run_boxed_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack);
// Makes every aten op that has a CPU kernel run it on npu too (see the definition); returns how
// many ops that took. Idempotent; called once by opennpu._device.register().
int64_t route_cpu_kernels_to_fallback();

// A CPU tensor over the bytes of npu tensor `t` (same sizes, strides, offset, dtype, conj/neg
// bits), on `cpu_storage`: a CPU StorageImpl over the npu storage's memory (make_cpu_alias_storage).
c10::Storage make_cpu_alias_storage(const c10::Storage& npu_storage);
at::Tensor make_cpu_alias(const at::Tensor& t, c10::Storage cpu_storage);
// An npu tensor on `npu_storage` with `like`'s dtype, sizes, strides, offset and conj/neg bits.
at::Tensor make_npu_view(const c10::Storage& npu_storage, const at::Tensor& like);

}  // namespace opennpu::device
