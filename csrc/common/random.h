// opennpu's random generator for fused ops with dropout (npu_fusion_attention).
//
// Like torch_npu's device generator it hands out Philox (seed, offset) pairs: an op that needs
// `n` random 32-bit words reserves them, and the offset advances so no two ops share a stream.
// manual_seed(s) restarts the stream at offset 0, so the first op after it draws with (s, 0) and
// a run is reproducible. The default seed is PyTorch's Philox default, 67280421310721.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <utility>

namespace opennpu {

void manual_seed(uint64_t seed);
uint64_t initial_seed();
// (seed, offset) of the next draw, without reserving it.
std::pair<uint64_t, uint64_t> rng_state();
void set_rng_state(uint64_t seed, uint64_t offset);
// Reserves `words` 32-bit words (rounded up to whole 4-word Philox blocks); returns their
// (seed, offset), offset counted in Philox blocks. While a PhiloxSourceGuard is alive on this
// thread the words come from its source instead of opennpu's own stream.
std::pair<uint64_t, uint64_t> reserve_philox(uint64_t words);

// The same for a fused op whose inputs live on `device`: each device type draws from its own
// generator, and ops call this one. CPU and npu (PrivateUse1): reserve_philox above (the npu
// fallback routes it to the npu device's generator with a PhiloxSourceGuard). Other devices have
// no opennpu kernel that draws, and raise.
//
// A CUDA kernel would draw from that device's default CUDA generator instead
// (at::cuda::detail::getDefaultCUDAGenerator(index), under its mutex, philox_cuda_state(words
// rounded up to a multiple of 4)), whose offset counts 32-bit words: divided by 4 it is this
// file's block offset, so the kernel's keep bits equal _npu_dropout_gen_mask's for the returned
// (seed, offset). That generator lives in libtorch_cuda, so its branch belongs in a .cu file
// (registered for the device type, as KernelSlots do for kernels). Under CUDA graph capture the
// pair is known only on the device (at::cuda::philox::unpack); the op's seed / offset outputs
// would then have to be written by the kernel.
std::pair<uint64_t, uint64_t> reserve_philox(c10::Device device, uint64_t words);

// Another Philox stream: the npu device generator, whose (seed, offset) a fused op running on npu
// tensors must draw from, as torch_npu's ops do (torch.npu.manual_seed governs their dropout).
class PhiloxSource {
 public:
  virtual std::pair<uint64_t, uint64_t> reserve_philox(uint64_t words) = 0;

 protected:
  ~PhiloxSource() = default;
};

// Routes this thread's reserve_philox to `source` for the guard's lifetime (nests).
class PhiloxSourceGuard {
 public:
  explicit PhiloxSourceGuard(PhiloxSource* source);
  ~PhiloxSourceGuard();
  PhiloxSourceGuard(const PhiloxSourceGuard&) = delete;
  PhiloxSourceGuard& operator=(const PhiloxSourceGuard&) = delete;

 private:
  PhiloxSource* previous_;
};

}  // namespace opennpu
