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
