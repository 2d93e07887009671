#include "common/half_gemm.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace opennpu {

HalfGemmSetting half_gemm_setting() {
  const char* env = std::getenv("OPENNPU_HALF_GEMM");
  if (env == nullptr || *env == '\0') return HalfGemmSetting::kAuto;
  const std::string value = env;
  if (value == "auto") return HalfGemmSetting::kAuto;
  if (value == "native") return HalfGemmSetting::kNative;
  if (value == "fp32") return HalfGemmSetting::kFp32;
  TORCH_CHECK(false, "opennpu: OPENNPU_HALF_GEMM must be auto, native or fp32, but got '", value,
              "'");
}

bool cpu_multiplies_natively(at::ScalarType t) {
#if defined(__x86_64__)
  // CPUID feature bits, read at run time.
  static const bool bf16 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("amx-bf16") || __builtin_cpu_supports("avx512bf16");
  }();
  static const bool fp16 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512fp16") != 0;
  }();
  if (t == at::kBFloat16) return bf16;
  if (t == at::kHalf) return fp16;
#else
  (void)t;
#endif
  return false;
}

bool half_gemm_in_fp32(at::ScalarType t) {
  if (t != at::kHalf && t != at::kBFloat16) return false;
  switch (half_gemm_setting()) {
    case HalfGemmSetting::kNative:
      return false;
    case HalfGemmSetting::kFp32:
      return true;
    case HalfGemmSetting::kAuto:
      break;
  }
  return !cpu_multiplies_natively(t);
}

}  // namespace opennpu
