// The streaming-store policy's host part (common/stream_store.h).
#include "common/stream_store.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <string>

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace opennpu {
namespace {

// "32768K" / "2M" / "512" (sysfs cache sizes) in bytes; 0 when unreadable.
int64_t parse_size(const std::string& text) {
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || value <= 0) return 0;
  switch (*end) {
    case 'K': case 'k': return value << 10;
    case 'M': case 'm': return value << 20;
    case 'G': case 'g': return value << 30;
    default: return value;
  }
}

// sysfs first: it gives the cache one core shares with its neighbours (on a Zen 3 VM with 2 vCPUs,
// 32 MiB, one CCX's L3), where glibc's sysconf(_SC_LEVEL3_CACHE_SIZE) answered 256 MiB (the L3 of
// every CCX of the package put together, which no core can use alone). sysconf is the fallback.
int64_t query_last_level_cache() {
#ifdef __linux__
  // The highest-level data or unified cache of CPU 0.
  int64_t best = 0, best_level = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream type_file(dir + "/type"), size_file(dir + "/size"), level_file(dir + "/level");
    std::string type, size;
    int64_t level = 0;
    if (!(type_file >> type) || !(size_file >> size) || !(level_file >> level)) continue;
    if (type == "Instruction" || level < best_level) continue;
    if (const int64_t bytes = parse_size(size); bytes > 0) {
      best = bytes;
      best_level = level;
    }
  }
  if (best > 0) return best;
#endif
#if defined(__linux__) && defined(_SC_LEVEL3_CACHE_SIZE)
  for (const int name : {_SC_LEVEL3_CACHE_SIZE, _SC_LEVEL2_CACHE_SIZE}) {
    const long bytes = sysconf(name);
    if (bytes > 0) return bytes;
  }
#endif
  return 0;
}

int64_t default_stream_min_bytes() {
  // OPENNPU_STREAM_MIN_BYTES overrides it (bytes; 0: every output large enough for a line streams,
  // a huge value: none does), e.g. to time a kernel both ways.
  if (const char* env = std::getenv("OPENNPU_STREAM_MIN_BYTES"); env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long long bytes = std::strtoll(env, &end, 10);
    TORCH_CHECK(end != env && *end == '\0' && bytes >= 0,
                "opennpu: OPENNPU_STREAM_MIN_BYTES must be a byte count >= 0, but got '", env, "'");
    return bytes;
  }
  const int64_t llc = last_level_cache_bytes();
  return llc > 0 ? llc : kDefaultStreamMinBytes;
}

std::atomic<int64_t>& threshold() {
  static std::atomic<int64_t> bytes{default_stream_min_bytes()};
  return bytes;
}

}  // namespace

int64_t last_level_cache_bytes() {
  static const int64_t bytes = query_last_level_cache();
  return bytes;
}

int64_t stream_min_bytes() { return threshold().load(std::memory_order_relaxed); }

int64_t set_stream_min_bytes(int64_t bytes) {
  return threshold().exchange(bytes < 0 ? default_stream_min_bytes() : bytes);
}

bool pages_resident(const void* p, int64_t n) {
#ifdef __linux__
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const char* base = static_cast<const char*>(p);
  for (int64_t quarter = 1; quarter <= 3; ++quarter) {
    const uintptr_t at = reinterpret_cast<uintptr_t>(base + n / 4 * quarter);
    unsigned char resident = 0;
    if (mincore(reinterpret_cast<void*>(at & ~(page - 1)), 1, &resident) != 0) return true;
    if ((resident & 1) == 0) return false;
  }
  return true;
#else
  (void)p;
  (void)n;
  return true;
#endif
}

}  // namespace opennpu
