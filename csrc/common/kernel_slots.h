// One entry point per op, a kernel slot per device: the shape of ATen's DispatchStub.
//
// A family's <family>.cpp validates the arguments, allocates the outputs with the input's options
// and calls `slots.get(op, input)(...)`, which picks the kernel for the input's device:
// - CPU and the npu device (PrivateUse1, whose memory is host memory): the best CPU kernel this
//   machine runs, chosen by ISA (common/cpu_dispatch.h); filled by <family>_cpu.cpp, compiled once
//   per ISA, with OPENNPU_REGISTER_CPU_SLOT;
// - CUDA: filled by <family>_cuda.cu with OPENNPU_REGISTER_CUDA_SLOT where the build has CUDA.
// The .cu file also registers the family's entry points for the CUDA dispatch key, so an op with a
// CUDA kernel runs it on CUDA tensors; every other op keeps the portable ATen composition there
// (src/opennpu/ops/portable.py). Checks and allocation are written once, for every device.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>

#include "common/cpu_dispatch.h"

namespace opennpu {

template <typename Fn>
struct KernelSlots {
  CpuKernel<Fn> cpu;
  Fn* cuda = nullptr;

  // The kernel for the device `on` lives on. op names the op in the error.
  Fn* get(const char* op, const at::Tensor& on) const { return get(op, on.device()); }

  Fn* get(const char* op, c10::Device device) const {
    switch (device.type()) {
      case c10::DeviceType::CPU:
      case c10::DeviceType::PrivateUse1:
        return cpu.get(op);
      case c10::DeviceType::CUDA:
        TORCH_CHECK(cuda != nullptr, op, ": no CUDA kernel was built into opennpu for this op");
        return cuda;
      default:
        TORCH_CHECK(false, op, ": no opennpu kernel for device type ", device.type());
    }
  }
};

}  // namespace opennpu

// In a <family>_cpu.cpp, at namespace scope: fill this ISA's CPU slot of `slots` with `fn`.
#define OPENNPU_REGISTER_CPU_SLOT(slots, fn)                                             \
  static const bool OPENNPU_CPU_CONCAT(slots##_cpu_registered_, __LINE__) = [] {       \
    slots.cpu.by_isa[OPENNPU_CPU_ISA_INDEX] = fn;                                        \
    return true;                                                                         \
  }()

// In a <family>_cuda.cu, at namespace scope: fill the CUDA slot of `slots` with `fn`.
#define OPENNPU_REGISTER_CUDA_SLOT(slots, fn)                                            \
  static const bool OPENNPU_CPU_CONCAT(slots##_cuda_registered_, __LINE__) = [] {      \
    slots.cuda = fn;                                                                     \
    return true;                                                                         \
  }()
