// How many npu devices the process sees: OPENNPU_DEVICE_COUNT physical devices (default 8, an
// Atlas 800T A2 server's), narrowed by ASCEND_RT_VISIBLE_DEVICES as CANN does.
#include <c10/util/Exception.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

constexpr int64_t kDefaultDeviceCount = 8;

}  // namespace

int64_t physical_device_count() {
  const char* text = std::getenv("OPENNPU_DEVICE_COUNT");
  if (text == nullptr || *text == '\0') return kDefaultDeviceCount;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (*end != '\0' || value < 0 || value > kMaxDevices) {
    // device_count() must not throw (DeviceGuardImplInterface::deviceCount is noexcept): warn and
    // keep the default rather than failing every later call.
    TORCH_WARN("opennpu: OPENNPU_DEVICE_COUNT must be an integer in [0, ", kMaxDevices,
               "], but got '", text, "'; using ", kDefaultDeviceCount);
    return kDefaultDeviceCount;
  }
  return value;
}

namespace {

// ASCEND_RT_VISIBLE_DEVICES: a comma list of physical ids in ascending order. As in CANN, parsing
// stops at the first entry that is not such an id (not a number, out of range, or not above the
// previous one); the ids before it stay visible and are renumbered 0, 1, ...
std::vector<int64_t> parse_visible_devices(int64_t physical) {
  std::vector<int64_t> ids;
  const char* text = std::getenv("ASCEND_RT_VISIBLE_DEVICES");
  if (text == nullptr) {
    for (int64_t i = 0; i < physical; ++i) ids.push_back(i);
    return ids;
  }
  const std::string list(text);
  size_t pos = 0;
  while (pos <= list.size()) {
    const size_t comma = std::min(list.find(',', pos), list.size());
    std::string entry = list.substr(pos, comma - pos);
    while (!entry.empty() && std::isspace(static_cast<unsigned char>(entry.front()))) entry.erase(0, 1);
    while (!entry.empty() && std::isspace(static_cast<unsigned char>(entry.back()))) entry.pop_back();
    if (entry.empty() || entry.size() > 6) break;
    bool digits = true;
    for (char c : entry) digits = digits && std::isdigit(static_cast<unsigned char>(c));
    if (!digits) break;
    const int64_t id = std::stoll(entry);
    if (id >= physical || (!ids.empty() && id <= ids.back())) break;
    ids.push_back(id);
    pos = comma + 1;
  }
  return ids;
}

// The visible devices once the runtime is initialised (first allocation or set_device); until
// then every query re-reads the environment, so a script may still set ASCEND_RT_VISIBLE_DEVICES
// after `import torch`, as with torch_npu.
std::atomic<const std::vector<int64_t>*> frozen_ids{nullptr};

}  // namespace

void initialize_devices() {
  if (frozen_ids.load(std::memory_order_acquire) != nullptr) return;
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: device queries may run during static destruction.
    frozen_ids.store(new std::vector<int64_t>(parse_visible_devices(physical_device_count())),
                     std::memory_order_release);
  });
}

bool devices_initialized() noexcept { return frozen_ids.load(std::memory_order_acquire) != nullptr; }

std::vector<int64_t> visible_physical_ids() {
  if (const auto* ids = frozen_ids.load(std::memory_order_acquire)) return *ids;
  return parse_visible_devices(physical_device_count());
}

c10::DeviceIndex device_count() noexcept {
  if (const auto* ids = frozen_ids.load(std::memory_order_acquire)) {
    return static_cast<c10::DeviceIndex>(ids->size());
  }
  try {
    return static_cast<c10::DeviceIndex>(parse_visible_devices(physical_device_count()).size());
  } catch (...) {  // only std::bad_alloc can come out of the parse
    return 0;
  }
}

void check_device_index(int64_t index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "Invalid device index npu:", index,
              ": this process sees ", static_cast<int>(device_count()),
              " npu device(s) (device_count(); set with OPENNPU_DEVICE_COUNT and "
              "ASCEND_RT_VISIBLE_DEVICES)");
}

}  // namespace opennpu::device
