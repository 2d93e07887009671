// The caching allocator of the npu devices. Each device has a pool of host blocks binned by rounded
// size; a freed block is cached for the next request of its size class and handed back to the host
// only by empty_cache() or when a request would exceed the device's capacity. The capacity
// (OPENNPU_DEVICE_MEMORY, by default the 64 GiB of an Ascend 910B) times the per-process fraction
// bounds the bytes a device holds (live + cached); beyond it an allocation raises
// torch.OutOfMemoryError with the pool's figures, as a real device does.
//
// Every host allocation is 64-byte aligned (c10::alloc_cpu), as a CPU tensor's is, so a CPU kernel
// takes the same vectorised paths (and produces the same bits) on npu memory as on CPU memory.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/alignment.h>
#include <c10/util/Exception.h>

#include <array>
#include <cctype>
#include <cstdlib>
#include <iomanip>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

constexpr size_t kKiB = 1024, kMiB = 1024 * kKiB, kGiB = 1024 * kMiB;
constexpr int64_t kDefaultCapacity = 64 * static_cast<int64_t>(kGiB);  // Ascend 910B HBM

// Size classes: 512 B steps up to 1 MiB, 128 KiB steps up to 64 MiB, 2 MiB steps beyond. A block
// is only reused for a request of its own class, so the waste per block is below one step.
size_t round_size(size_t nbytes) {
  auto round_up = [](size_t n, size_t step) { return (n + step - 1) / step * step; };
  if (nbytes <= kMiB) return round_up(nbytes, 512);
  if (nbytes <= 64 * kMiB) return round_up(nbytes, 128 * kKiB);
  return round_up(nbytes, 2 * kMiB);
}

// OPENNPU_DEVICE_MEMORY: bytes, or a number with a K/M/G/T suffix (powers of 1024; "GB", "GiB" and
// lower case accepted), e.g. "16G" or "512MiB".
int64_t parse_capacity() {
  const char* text = std::getenv("OPENNPU_DEVICE_MEMORY");
  if (text == nullptr || *text == '\0') return kDefaultCapacity;
  const std::string value(text);
  size_t digits = 0;
  while (digits < value.size() && (std::isdigit(static_cast<unsigned char>(value[digits])) || value[digits] == '.')) {
    ++digits;
  }
  std::string unit = value.substr(digits);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 0;
  if (unit.empty() || unit == "B") scale = 1;
  else if (unit == "K" || unit == "KB" || unit == "KIB") scale = static_cast<double>(kKiB);
  else if (unit == "M" || unit == "MB" || unit == "MIB") scale = static_cast<double>(kMiB);
  else if (unit == "G" || unit == "GB" || unit == "GIB") scale = static_cast<double>(kGiB);
  else if (unit == "T" || unit == "TB" || unit == "TIB") scale = static_cast<double>(kGiB) * 1024;
  double number = -1;
  if (digits > 0) {
    try {
      number = std::stod(value.substr(0, digits));
    } catch (const std::exception&) {
      number = -1;
    }
  }
  TORCH_CHECK(scale > 0 && number > 0, "opennpu: OPENNPU_DEVICE_MEMORY must be a positive size "
              "such as 68719476736, 64G or 512MiB, but got '", value, "'");
  return static_cast<int64_t>(number * scale);
}

std::string format_bytes(int64_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(2);
  const double b = static_cast<double>(bytes);
  if (bytes >= static_cast<int64_t>(kGiB)) out << b / kGiB << " GiB";
  else if (bytes >= static_cast<int64_t>(kMiB)) out << b / kMiB << " MiB";
  else if (bytes >= static_cast<int64_t>(kKiB)) out << b / kKiB << " KiB";
  else out << bytes << " bytes";
  return out.str();
}

struct Block;
using LiveMap = std::unordered_map<void*, Block*>;

struct Block {
  void* ptr;
  size_t size;  // rounded size: what the statistics count
  c10::DeviceIndex device;
  // While cached, the block keeps its node of the live map, so reusing a block allocates nothing.
  LiveMap::node_type live_node;
};

// Host memory adopted from a CPU storage: `original` (or `owner`) keeps it alive until the npu
// storage lets go. `counted` is false for memory that is already one of the pool's live blocks.
struct AdoptedMemory {
  c10::DataPtr original;
  c10::Storage owner;
  size_t size;
  c10::DeviceIndex device;
  bool counted;
};

struct Pool {
  std::unordered_map<size_t, std::vector<Block*>> cached;  // free blocks by size class
  MemoryStats stats;
  double fraction = 1.0;
};

// One lock for all pools: allocations are short and this machine's devices share one host.
struct AllocatorState {
  std::mutex mutex;
  std::array<Pool, kMaxDevices> pools;
  LiveMap live;                            // live blocks by pointer (DataPtr context == pointer)
  int64_t capacity = -1;                   // parsed on first use
};

// Leaked on purpose: tensors can be freed by static destructors that run after ours would.
AllocatorState& state() {
  static auto* s = new AllocatorState();
  return *s;
}

void update_peaks(MemoryStats& s) {
  s.allocated_peak = std::max(s.allocated_peak, s.allocated_current);
  s.reserved_peak = std::max(s.reserved_peak, s.reserved_current);
  s.active_blocks_peak = std::max(s.active_blocks_peak, s.active_blocks);
  s.segments_peak = std::max(s.segments_peak, s.segments);
}

int64_t capacity_locked(AllocatorState& st) {
  if (st.capacity < 0) st.capacity = parse_capacity();
  return st.capacity;
}

int64_t limit_locked(AllocatorState& st, const Pool& pool) {
  return static_cast<int64_t>(static_cast<double>(capacity_locked(st)) * pool.fraction);
}

void release_cached_locked(Pool& pool) {
  for (auto& [size, blocks] : pool.cached) {
    for (Block* block : blocks) {
      c10::free_cpu(block->ptr);
      pool.stats.reserved_current -= static_cast<int64_t>(block->size);
      pool.stats.segments -= 1;
      pool.stats.num_host_frees += 1;
      delete block;
    }
  }
  pool.cached.clear();
}

// Makes room for `size` more bytes on `device` (releasing its cache if that is what it takes) or
// raises torch.OutOfMemoryError.
void reserve_locked(AllocatorState& st, Pool& pool, c10::DeviceIndex device, size_t size) {
  const int64_t limit = limit_locked(st, pool);
  if (pool.stats.reserved_current + static_cast<int64_t>(size) <= limit) return;
  if (!pool.cached.empty()) {
    release_cached_locked(pool);
    pool.stats.num_alloc_retries += 1;
    if (pool.stats.reserved_current + static_cast<int64_t>(size) <= limit) return;
  }
  pool.stats.num_ooms += 1;
  const int64_t capacity = capacity_locked(st);
  const int64_t free_bytes = std::max<int64_t>(0, limit - pool.stats.reserved_current);
  TORCH_CHECK_WITH(OutOfMemoryError, false, "NPU out of memory. Tried to allocate ",
                   format_bytes(static_cast<int64_t>(size)), " (NPU ", static_cast<int>(device),
                   "; ", format_bytes(capacity), " total capacity; ",
                   format_bytes(pool.stats.allocated_current), " already allocated; ",
                   format_bytes(free_bytes), " free; ", format_bytes(pool.stats.reserved_current),
                   " reserved in total by PyTorch; per-process memory fraction ",
                   pool.fraction, "). The emulated device's capacity is set with "
                   "OPENNPU_DEVICE_MEMORY and torch.npu.set_per_process_memory_fraction.");
}

// torch.profiler(profile_memory=True) sees npu allocations and frees as on CUDA: the block's
// size (as the stats count it), and the device's totals after the change.
void report_to_profiler(void* ptr, int64_t delta, const MemoryStats& s, c10::DeviceIndex device) {
  if (!c10::memoryProfilingEnabled()) return;
  c10::reportMemoryUsageToProfiler(ptr, delta, static_cast<size_t>(s.allocated_current),
                                   static_cast<size_t>(s.reserved_current), c10::Device(kNpu, device));
}

// The deleter of every pool block (its context is its pointer, so raw_deallocate works too).
void free_block(void* ptr) {
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  auto it = st.live.find(ptr);
  TORCH_INTERNAL_ASSERT(it != st.live.end(), "npu allocator: freeing an unknown block");
  Block* block = it->second;
  block->live_node = st.live.extract(it);
  Pool& pool = st.pools[block->device];
  pool.stats.allocated_current -= static_cast<int64_t>(block->size);
  pool.stats.active_blocks -= 1;
  pool.stats.num_frees += 1;
  pool.cached[block->size].push_back(block);
  report_to_profiler(ptr, -static_cast<int64_t>(block->size), pool.stats, block->device);
}

void free_adopted(void* context) {
  auto* adopted = static_cast<AdoptedMemory*>(context);
  if (adopted->counted) {
    auto& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    MemoryStats& s = st.pools[adopted->device].stats;
    s.allocated_current -= static_cast<int64_t>(adopted->size);
    s.reserved_current -= static_cast<int64_t>(adopted->size);
    s.adopted_current -= static_cast<int64_t>(adopted->size);
    s.active_blocks -= 1;
    s.num_frees += 1;
  }
  delete adopted;  // releases the original memory
}

struct NpuDeviceAllocator final : c10::Allocator {
  c10::DeviceIndex index = 0;
  c10::DataPtr allocate(size_t nbytes) override {
    return opennpu::device::allocate(index, nbytes, c10::Device(kNpu, index));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

std::array<NpuDeviceAllocator, kMaxDevices>& device_allocators() {
  static auto* allocators = [] {
    auto* a = new std::array<NpuDeviceAllocator, kMaxDevices>();
    for (int i = 0; i < kMaxDevices; ++i) (*a)[i].index = static_cast<c10::DeviceIndex>(i);
    return a;
  }();
  return *allocators;
}

// c10::GetAllocator(PrivateUse1): allocates on the calling thread's current device (used for npu
// storages created without a tensor, e.g. torch.UntypedStorage(n, device="npu")).
struct CurrentDeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const c10::DeviceIndex index = current_device();
    return opennpu::device::allocate(index, nbytes, c10::Device(kNpu, index));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CurrentDeviceAllocator current_device_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &current_device_allocator)

// ---- the CPU allocation redirect -------------------------------------------------------------

// The device whose pool serves this thread's CPU allocations, or -1.
thread_local int tls_redirect_device = -1;

// Installed as the process's CPU allocator; forwards to the previous one except inside a
// CpuAllocationRedirect. Its raw deleter frees either kind of pointer.
struct RedirectingCpuAllocator final : c10::Allocator {
  c10::Allocator* base = nullptr;
  c10::DataPtr allocate(size_t nbytes) override {
    if (tls_redirect_device >= 0) {
      return opennpu::device::allocate(static_cast<c10::DeviceIndex>(tls_redirect_device), nbytes,
                                       c10::Device(c10::DeviceType::CPU));
    }
    return base->allocate(nbytes);
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    base->copy_data(dest, src, count);
  }
  static void raw_delete(void* ptr);
};

RedirectingCpuAllocator& redirecting_cpu_allocator() {
  static auto* allocator = new RedirectingCpuAllocator();
  return *allocator;
}

void RedirectingCpuAllocator::raw_delete(void* ptr) {
  bool ours = false;
  {
    auto& st = state();
    std::lock_guard<std::mutex> lock(st.mutex);
    ours = st.live.count(ptr) != 0;
  }
  if (ours) {
    free_block(ptr);
  } else {
    c10::DeleterFnPtr base_deleter = redirecting_cpu_allocator().base->raw_deleter();
    TORCH_INTERNAL_ASSERT(base_deleter != nullptr, "npu: the CPU allocator has no raw deleter");
    base_deleter(ptr);
  }
}

struct InstallRedirect {
  InstallRedirect() {
    auto& allocator = redirecting_cpu_allocator();
    allocator.base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&allocator, /*priority=*/0);
  }
};
InstallRedirect install_redirect;

}  // namespace

c10::Allocator* device_allocator(c10::DeviceIndex index) {
  check_device_index(index);
  return &device_allocators()[index];
}

c10::DataPtr allocate(c10::DeviceIndex index, size_t nbytes, c10::Device data_ptr_device) {
  initialize_devices();
  check_device_index(index);
  if (nbytes == 0) return c10::DataPtr(nullptr, data_ptr_device);
  // c10's CUDA caching allocator's bound and message; it also keeps round_size from overflowing.
  constexpr size_t kOneExbibyte = size_t(1) << 60;
  TORCH_CHECK_WITH(OutOfMemoryError, nbytes < kOneExbibyte,
                   "NPU out of memory. Tried to allocate more than 1EB memory.");
  const size_t size = round_size(nbytes);
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  Pool& pool = st.pools[index];
  Block* block = nullptr;
  auto bin = pool.cached.find(size);
  if (bin != pool.cached.end() && !bin->second.empty()) {
    block = bin->second.back();
    bin->second.pop_back();
  } else {
    reserve_locked(st, pool, index, size);
    void* ptr = c10::alloc_cpu(size);
    block = new Block{ptr, size, index, {}};
    pool.stats.reserved_current += static_cast<int64_t>(size);
    pool.stats.segments += 1;
    pool.stats.num_host_allocs += 1;
  }
  if (block->live_node.empty()) {
    st.live.emplace(block->ptr, block);
  } else {
    st.live.insert(std::move(block->live_node));
  }
  pool.stats.allocated_current += static_cast<int64_t>(size);
  pool.stats.active_blocks += 1;
  pool.stats.num_allocs += 1;
  update_peaks(pool.stats);
  report_to_profiler(block->ptr, static_cast<int64_t>(size), pool.stats, index);
  return c10::DataPtr(block->ptr, block->ptr, &free_block, data_ptr_device);
}

CpuAllocationRedirect::CpuAllocationRedirect(c10::DeviceIndex index) : previous_(tls_redirect_device) {
  tls_redirect_device = index;
}

CpuAllocationRedirect::~CpuAllocationRedirect() { tls_redirect_device = previous_; }

c10::Storage adopt_storage(const c10::Storage& cpu_storage, c10::DeviceIndex index, bool in_place) {
  check_device_index(index);
  const c10::Device device(kNpu, index);
  c10::StorageImpl* impl = cpu_storage.unsafeGetStorageImpl();
  c10::DataPtr& data_ptr = impl->_mutable_data_ptr_no_checks();
  const bool pool_block = data_ptr.get_deleter() == &free_block;
  if (pool_block && in_place) {
    // Already device memory (a CPU kernel allocated it under CpuAllocationRedirect): only the
    // DataPtr's device changes. The block stays counted on the device that served it.
    data_ptr.unsafe_set_device(device);
    impl->set_allocator(&device_allocators()[index]);
    return cpu_storage;
  }
  const size_t size = impl->nbytes();
  auto* adopted = new AdoptedMemory{c10::DataPtr(), c10::Storage(), size, index, !pool_block && size > 0};
  if (adopted->counted) {
    auto& st = state();
    std::unique_lock<std::mutex> lock(st.mutex);
    Pool& pool = st.pools[index];
    try {
      reserve_locked(st, pool, index, size);
    } catch (...) {
      lock.unlock();
      delete adopted;
      throw;
    }
    pool.stats.allocated_current += static_cast<int64_t>(size);
    pool.stats.reserved_current += static_cast<int64_t>(size);
    pool.stats.adopted_current += static_cast<int64_t>(size);
    pool.stats.active_blocks += 1;
    pool.stats.num_allocs += 1;
    update_peaks(pool.stats);
  }
  void* ptr = data_ptr.get();
  if (in_place) {
    adopted->original = impl->set_data_ptr(c10::DataPtr(ptr, adopted, &free_adopted, device));
    impl->set_allocator(&device_allocators()[index]);
    return cpu_storage;
  }
  adopted->owner = cpu_storage;
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), size, c10::DataPtr(ptr, adopted, &free_adopted, device),
      &device_allocators()[index], /*resizable=*/true));
}

MemoryStats memory_stats(c10::DeviceIndex index) {
  check_device_index(index);
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  return st.pools[index].stats;
}

void reset_peak_memory_stats(c10::DeviceIndex index) {
  check_device_index(index);
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  MemoryStats& s = st.pools[index].stats;
  s.allocated_peak = s.allocated_current;
  s.reserved_peak = s.reserved_current;
  s.active_blocks_peak = s.active_blocks;
  s.segments_peak = s.segments;
}

void reset_accumulated_memory_stats(c10::DeviceIndex index) {
  check_device_index(index);
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  MemoryStats& s = st.pools[index].stats;
  s.num_allocs = s.num_frees = s.num_host_allocs = s.num_host_frees = 0;
  s.num_alloc_retries = s.num_ooms = 0;
}

void empty_cache() {
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  for (Pool& pool : st.pools) release_cached_locked(pool);
}

int64_t device_capacity(c10::DeviceIndex index) {
  check_device_index(index);
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  return capacity_locked(st);
}

void set_memory_fraction(double fraction, c10::DeviceIndex index) {
  check_device_index(index);
  TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "set_per_process_memory_fraction: the fraction "
              "must be in [0, 1], but got ", fraction);
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  st.pools[index].fraction = fraction;
}

double memory_fraction(c10::DeviceIndex index) {
  check_device_index(index);
  auto& st = state();
  std::lock_guard<std::mutex> lock(st.mutex);
  return st.pools[index].fraction;
}

}  // namespace opennpu::device
