#include "common/cpu_dispatch.h"

#include <ATen/Version.h>

#include <string>

namespace opennpu {

CpuIsa cpu_isa() {
  // at::get_cpu_capability() already intersects what the CPU supports with ATEN_CPU_CAPABILITY.
  static const CpuIsa isa = [] {
    const std::string cap = at::get_cpu_capability();
    if (cap == "AVX512") return CpuIsa::kAvx512;
    if (cap == "AVX2") return CpuIsa::kAvx2;
#if defined(__x86_64__)
    // x86-64 builds carry no scalar-only kernels: ATEN_CPU_CAPABILITY=default (ATen's own scalar
    // kernels) still runs opennpu's AVX2 baseline when the CPU has it.
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAvx2;
#endif
    return CpuIsa::kDefault;
  }();
  return isa;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "AVX512";
    case CpuIsa::kAvx2:
      return "AVX2";
    case CpuIsa::kDefault:
      break;
  }
  return "DEFAULT";
}

}  // namespace opennpu
