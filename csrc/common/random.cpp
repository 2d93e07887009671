#include "common/random.h"

#include <c10/util/Exception.h>

#include <mutex>

namespace opennpu {
namespace {

struct PhiloxState {
  std::mutex lock;
  uint64_t seed = 67280421310721ULL;
  uint64_t offset = 0;
};

PhiloxState& state() {
  static PhiloxState s;
  return s;
}

}  // namespace

void manual_seed(uint64_t seed) { set_rng_state(seed, 0); }

uint64_t initial_seed() {
  std::lock_guard<std::mutex> guard(state().lock);
  return state().seed;
}

std::pair<uint64_t, uint64_t> rng_state() {
  std::lock_guard<std::mutex> guard(state().lock);
  return {state().seed, state().offset};
}

void set_rng_state(uint64_t seed, uint64_t offset) {
  std::lock_guard<std::mutex> guard(state().lock);
  state().seed = seed;
  state().offset = offset;
}

namespace {
thread_local PhiloxSource* current_source = nullptr;
}  // namespace

PhiloxSourceGuard::PhiloxSourceGuard(PhiloxSource* source) : previous_(current_source) {
  current_source = source;
}

PhiloxSourceGuard::~PhiloxSourceGuard() { current_source = previous_; }

std::pair<uint64_t, uint64_t> reserve_philox(uint64_t words) {
  if (current_source != nullptr) return current_source->reserve_philox(words);
  std::lock_guard<std::mutex> guard(state().lock);
  const std::pair<uint64_t, uint64_t> drawn{state().seed, state().offset};
  state().offset += (words + 3) / 4;
  return drawn;
}

std::pair<uint64_t, uint64_t> reserve_philox(c10::Device device, uint64_t words) {
  switch (device.type()) {
    case c10::DeviceType::CPU:
    case c10::DeviceType::PrivateUse1:
      return reserve_philox(words);
    default:
      TORCH_CHECK(false, "opennpu: no Philox generator for fused ops on device type ",
                  device.type(), " (see common/random.h)");
  }
}

}  // namespace opennpu
