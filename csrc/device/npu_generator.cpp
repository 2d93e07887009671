// npu random number generators. Each wraps a CPUGeneratorImpl (mt19937 plus the cached normal
// samples) under an npu device: random ops on npu run their CPU kernels, which the fallback hands
// this engine, so torch.npu.manual_seed(s) followed by torch.randn(n, device="npu") draws the very
// numbers torch.manual_seed(s); torch.randn(n) draws on CPU.
//
// Each also keeps a Philox offset for the fused ops with dropout (npu_fusion_attention), as
// torch_npu's device generator does: on npu such an op draws (current seed, offset) and advances
// the offset; manual_seed restarts it at 0. The state (get_state / set_state) is the CPU
// generator's byte tensor followed by that offset (8 bytes).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstring>
#include <mutex>

#include "common/random.h"
#include "device/npu_device.h"

namespace opennpu::device {

namespace {

class NpuGeneratorImpl final : public c10::GeneratorImpl, public PhiloxSource {
 public:
  NpuGeneratorImpl(c10::DeviceIndex index, uint64_t seed)
      : c10::GeneratorImpl(c10::Device(kNpu, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        engine_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

  // Every access to the engine holds its mutex, the one CPU kernels hold while drawing.
  void set_current_seed(uint64_t seed) override {
    std::lock_guard<std::mutex> lock(engine_.mutex());
    engine_.set_current_seed(seed);
    philox_offset_ = 0;
  }
  std::pair<uint64_t, uint64_t> reserve_philox(uint64_t words) override {
    std::lock_guard<std::mutex> lock(engine_.mutex());
    const std::pair<uint64_t, uint64_t> drawn{engine_.current_seed(), philox_offset_};
    philox_offset_ += (words + 3) / 4;  // whole 4-word Philox blocks, as opennpu's own stream
    return drawn;
  }
  void set_offset(uint64_t offset) override {
    std::lock_guard<std::mutex> lock(engine_.mutex());
    engine_.set_offset(offset);
  }
  uint64_t get_offset() const override {
    std::lock_guard<std::mutex> lock(engine_.mutex());
    return engine_.get_offset();
  }
  uint64_t current_seed() const override {
    std::lock_guard<std::mutex> lock(engine_.mutex());
    return engine_.current_seed();
  }
  uint64_t seed() override {
    std::lock_guard<std::mutex> lock(engine_.mutex());
    return engine_.seed();
  }
  void set_state(const c10::TensorImpl& new_state) override {
    const int64_t n = new_state.numel();
    TORCH_CHECK(new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>() && n > kOffsetBytes,
                "npu generator set_state: expected the uint8 state get_state returns, got ",
                new_state.dtype(), " with ", n, " elements");
    const auto* bytes = static_cast<const uint8_t*>(new_state.data());
    at::Tensor engine_state = at::empty({n - kOffsetBytes}, at::kByte);
    std::memcpy(engine_state.data_ptr(), bytes, static_cast<size_t>(n - kOffsetBytes));
    std::lock_guard<std::mutex> lock(engine_.mutex());
    engine_.unsafeGetGeneratorImpl()->set_state(*engine_state.unsafeGetTensorImpl());
    std::memcpy(&philox_offset_, bytes + (n - kOffsetBytes), kOffsetBytes);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    std::lock_guard<std::mutex> lock(engine_.mutex());
    auto engine_state = engine_.unsafeGetGeneratorImpl()->get_state();
    const int64_t n = engine_state->numel();
    at::Tensor state = at::empty({n + kOffsetBytes}, at::kByte);
    auto* bytes = static_cast<uint8_t*>(state.data_ptr());
    std::memcpy(bytes, engine_state->data(), static_cast<size_t>(n));
    std::memcpy(bytes + n, &philox_offset_, kOffsetBytes);
    return state.getIntrusivePtr();
  }
  static c10::DeviceType device_type() { return kNpu; }

  const at::Generator& engine() const { return engine_; }

 private:
  NpuGeneratorImpl* clone_impl() const override {
    std::lock_guard<std::mutex> lock(engine_.mutex());
    auto* copy = new NpuGeneratorImpl(device().index(), 0);
    copy->engine_ = engine_.clone();
    copy->philox_offset_ = philox_offset_;
    return copy;
  }

  static constexpr int64_t kOffsetBytes = sizeof(uint64_t);
  mutable at::Generator engine_;  // a CPUGeneratorImpl
  uint64_t philox_offset_ = 0;    // in 4-word Philox blocks; guarded by engine_'s mutex
};

}  // namespace

const at::Generator& default_generator(c10::DeviceIndex index) {
  const c10::DeviceIndex device = npu_device(index).index();
  static std::array<at::Generator, kMaxDevices> generators;
  static std::array<std::once_flag, kMaxDevices> created;
  std::call_once(created[device], [device] {
    // The default seed is the CPU default generator's, so unseeded npu draws match unseeded CPU
    // draws too.
    generators[device] = at::make_generator<NpuGeneratorImpl>(device, c10::default_rng_seed_val);
  });
  return generators[device];
}

at::Generator new_generator(c10::DeviceIndex index) {
  return at::make_generator<NpuGeneratorImpl>(npu_device(index).index(), c10::default_rng_seed_val);
}

PhiloxSource* philox_source_of(const at::Generator& npu_generator) {
  return at::check_generator<NpuGeneratorImpl>(npu_generator);
}

at::Generator cpu_engine_of(const at::Generator& npu_generator) {
  TORCH_CHECK(npu_generator.device().type() == kNpu, "Expected a 'npu' device type for generator "
              "but found '", npu_generator.device().type(), "'");
  return at::check_generator<NpuGeneratorImpl>(npu_generator)->engine();
}

}  // namespace opennpu::device
