// Run-time selection of CPU kernels compiled for several instruction sets.
//
// Every csrc/ops/<family>/<family>_cpu.cpp is compiled once per ISA (AVX2+FMA baseline and
// AVX-512 on x86-64; the compiler default elsewhere), each time inside the inline namespace
// CPU_CAPABILITY, exactly as ATen compiles its own native/cpu kernels. Each compilation registers
// its entry points into a CpuKernel table at load time; callers take the best one this CPU runs.
// The choice follows at::get_cpu_capability(), so ATEN_CPU_CAPABILITY=avx2 forces the baseline
// for ATen and opennpu alike. The ISA is never taken from the build machine.
#pragma once

#include <c10/util/Exception.h>

namespace opennpu {

enum class CpuIsa { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

// The best ISA that both this CPU and ATen's capability setting allow (computed once).
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

template <typename Fn>
struct CpuKernel {
  Fn* by_isa[3] = {nullptr, nullptr, nullptr};

  Fn* get(const char* name) const {
    for (int isa = static_cast<int>(cpu_isa()); isa >= 0; --isa) {
      if (by_isa[isa] != nullptr) return by_isa[isa];
    }
    TORCH_CHECK(false, "opennpu: no CPU kernel for ", name, " was compiled for ",
                cpu_isa_name(cpu_isa()), " or a lower instruction set on this machine");
  }
};

}  // namespace opennpu

#if defined(CPU_CAPABILITY_AVX512)
#define OPENNPU_CPU_ISA_INDEX 2
#elif defined(CPU_CAPABILITY_AVX2)
#define OPENNPU_CPU_ISA_INDEX 1
#else
#define OPENNPU_CPU_ISA_INDEX 0
#endif

#define OPENNPU_CPU_CONCAT_(a, b) a##b
#define OPENNPU_CPU_CONCAT(a, b) OPENNPU_CPU_CONCAT_(a, b)

// In a <family>_cpu.cpp, at namespace scope: fill this ISA's slot of `table` with `fn`.
#define OPENNPU_REGISTER_CPU_KERNEL(table, fn)                                           \
  static const bool OPENNPU_CPU_CONCAT(table##_registered_, __LINE__) = [] {           \
    table.by_isa[OPENNPU_CPU_ISA_INDEX] = fn;                                            \
    return true;                                                                         \
  }()
