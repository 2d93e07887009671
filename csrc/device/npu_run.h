// Running a CPU kernel on behalf of an npu op (the fallback, the unboxed kernels).
#pragma once

#include "device/npu_device.h"

namespace opennpu::device {

// Runs `kernel` with npu:device current and this thread's CPU allocations served by its pool;
// the previous current device comes back afterwards, also on an exception.
template <typename Kernel>
decltype(auto) run_on_device(c10::DeviceIndex device, Kernel&& kernel) {
  // The first kernel a thread runs binds it to the device's cores under CPU_AFFINITY_CONF (this
  // is how the autograd engine's npu threads, which never set a device, get bound).
  bind_thread_to_device(device, /*explicit_request=*/false);
  const c10::DeviceIndex previous = current_device();
  if (previous != device) set_current_device(device);
  struct Restore {
    c10::DeviceIndex index;
    ~Restore() { if (current_device() != index) set_current_device(index); }
  } restore{previous};
  CpuAllocationRedirect redirect(device);
  return kernel();
}

}  // namespace opennpu::device
