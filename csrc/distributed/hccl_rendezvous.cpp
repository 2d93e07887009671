// torch.ops.opennpu._hccl_rendezvous_* : the same-host exchange behind hccl's cross-rank check of
// each collective (src/opennpu/distributed). Every rank of a group on one host maps one shared
// file; before collective number n each rank publishes its fingerprint of the collective in its
// slot and sleeps on a futex until every rank has published number n, then reads them all. One
// store and one futex wake per rank, no trip through gloo's worker threads and the network stack.
//
// Invariants:
// - A rank publishes number n+1 only after it read every slot's number n. So a slot's
//   fingerprint for n+1 may overwrite the one for n-1 (double buffering by parity), never the
//   one for n that a slower rank may still be reading.
// - The fingerprint is written before the release store of the slot's sequence number; a reader
//   that acquires number >= n sees the fingerprint of n.
// - Waiting is bounded by the caller's timeout; the error names the ranks that did not arrive.
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/library.h>

namespace opennpu::distributed {

namespace {

constexpr int64_t kMaxFingerprint = 16;

struct alignas(64) Header {
  std::atomic<uint32_t> generation;  // the futex word: bumped by every publish
  uint32_t size;
  uint32_t fingerprint_len;
};

struct alignas(64) Slot {
  std::atomic<uint64_t> sequence;  // the last collective number this rank published (0: none)
  int64_t fingerprint[2][kMaxFingerprint];
};

static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "the rendezvous needs address-free atomics in shared memory");

size_t region_bytes(int64_t size) { return sizeof(Header) + sizeof(Slot) * static_cast<size_t>(size); }

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE_FLAG: the word is shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

class Rendezvous {
 public:
  Rendezvous(const std::string& path, int64_t size, int64_t rank, int64_t fingerprint_len, bool create)
      : size_(size), rank_(rank), fingerprint_len_(fingerprint_len) {
    const int fd = create ? ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600) : ::open(path.c_str(), O_RDWR);
    TORCH_CHECK(fd >= 0, "hccl: cannot ", create ? "create" : "open", " the rendezvous file ", path, ": ",
                std::strerror(errno));
    const size_t bytes = region_bytes(size);
    if (create && ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      const int err = errno;
      ::close(fd);
      TORCH_CHECK(false, "hccl: cannot size the rendezvous file ", path, ": ", std::strerror(err));
    }
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(base != MAP_FAILED, "hccl: cannot map the rendezvous file ", path, ": ", std::strerror(err));
    base_ = base;
    bytes_ = bytes;
    header_ = static_cast<Header*>(base);
    slots_ = reinterpret_cast<Slot*>(static_cast<char*>(base) + sizeof(Header));
    if (create) {  // ftruncate zero-filled it: generation 0, every sequence 0
      header_->size = static_cast<uint32_t>(size);
      header_->fingerprint_len = static_cast<uint32_t>(fingerprint_len);
    }
  }

  ~Rendezvous() { ::munmap(base_, bytes_); }

  // Publishes this rank's fingerprint of its next collective; returns the collective's number.
  int64_t publish(c10::IntArrayRef mine) {
    TORCH_CHECK(static_cast<int64_t>(mine.size()) == fingerprint_len_, "hccl rendezvous: expected a fingerprint of ",
                fingerprint_len_, " values, got ", mine.size());
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(collected_ == published_, "hccl rendezvous: collective ", published_,
                " was published but not collected before the next one");
    const uint64_t n = ++published_;
    Slot& own = slots_[rank_];
    std::memcpy(own.fingerprint[n & 1], mine.data(), sizeof(int64_t) * mine.size());
    own.sequence.store(n, std::memory_order_release);
    header_->generation.fetch_add(1, std::memory_order_acq_rel);
    futex(&header_->generation, FUTEX_WAKE, INT_MAX, nullptr);
    return static_cast<int64_t>(n);
  }

  // Every rank's fingerprint of collective n (the last one published), rank after rank, once
  // every rank has published it; waits at most timeout_s. timeout_s = 0 only polls: it returns
  // an empty list where a rank has not published yet.
  std::vector<int64_t> collect(int64_t number, double timeout_s) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto n = static_cast<uint64_t>(number);
    TORCH_CHECK(n == published_ && n == collected_ + 1, "hccl rendezvous: collective ", number,
                " is not the one awaiting collection (published ", published_, ", collected ", collected_, ")");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (true) {
      const uint32_t generation = header_->generation.load(std::memory_order_acquire);
      if (all_arrived(n)) {
        break;
      }
      if (timeout_s == 0) {
        return {};
      }
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::steady_clock::duration::zero()) {
        throw_timeout(n, timeout_s);
      }
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      const timespec wait{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      futex(&header_->generation, FUTEX_WAIT, generation, &wait);  // EAGAIN / ETIMEDOUT / EINTR: re-check
    }
    std::vector<int64_t> every(static_cast<size_t>(size_ * fingerprint_len_));
    for (int64_t r = 0; r < size_; ++r) {
      std::memcpy(every.data() + r * fingerprint_len_, slots_[r].fingerprint[n & 1], sizeof(int64_t) * fingerprint_len_);
    }
    collected_ = n;
    return every;
  }

 private:
  bool all_arrived(uint64_t n) const {
    for (int64_t r = 0; r < size_; ++r) {
      if (slots_[r].sequence.load(std::memory_order_acquire) < n) {
        return false;
      }
    }
    return true;
  }

  [[noreturn]] void throw_timeout(uint64_t n, double timeout_s) const {
    std::string missing;
    for (int64_t r = 0; r < size_; ++r) {
      if (slots_[r].sequence.load(std::memory_order_acquire) < n) {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    // DistBackendError, as gloo's own timeouts (torch.distributed.DistBackendError in Python).
    C10_THROW_ERROR(DistBackendError,
                    c10::str("hccl: Timed out after ", timeout_s, " s waiting for rank(s) ", missing,
                             " to reach collective number ", n,
                             " of this group (a rank died, hangs, or called fewer collectives)"));
  }

  int64_t size_, rank_, fingerprint_len_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  Header* header_ = nullptr;
  Slot* slots_ = nullptr;
  uint64_t published_ = 0;  // the last collective number this rank published
  uint64_t collected_ = 0;  // the last one it read every rank's fingerprint of
  std::mutex mutex_;
};

std::mutex registry_mutex;
std::vector<std::shared_ptr<Rendezvous>> registry;  // handle = index; closed handles hold nullptr

std::shared_ptr<Rendezvous> lookup(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(registry.size()) && registry[handle],
              "hccl rendezvous: no open rendezvous with handle ", handle);
  return registry[handle];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(opennpu, m) {
  // Maps the group's rendezvous file (create=True: the one rank that creates and sizes it).
  m.def("_hccl_rendezvous_open(str path, int size, int rank, int fingerprint_len, bool create) -> int",
        [](const std::string& path, int64_t size, int64_t rank, int64_t fingerprint_len, bool create) -> int64_t {
          TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "hccl rendezvous: rank ", rank, " out of range for size ", size);
          TORCH_CHECK(fingerprint_len >= 1 && fingerprint_len <= kMaxFingerprint,
                      "hccl rendezvous: fingerprint length must be 1..", kMaxFingerprint, ", got ", fingerprint_len);
          auto rendezvous = std::make_shared<Rendezvous>(path, size, rank, fingerprint_len, create);
          std::lock_guard<std::mutex> lock(registry_mutex);
          registry.push_back(std::move(rendezvous));
          return static_cast<int64_t>(registry.size()) - 1;
        });
  // Publishes this rank's fingerprint of its next collective: returns the collective's number.
  m.def("_hccl_rendezvous_publish(int handle, int[] fingerprint) -> int",
        [](int64_t handle, c10::IntArrayRef fingerprint) { return lookup(handle)->publish(fingerprint); });
  // Every rank's fingerprint of collective `number`, waiting (GIL released) at most timeout_s;
  // timeout_s = 0 polls (empty list: not every rank has published it yet).
  m.def("_hccl_rendezvous_collect(int handle, int number, float timeout_s) -> int[]",
        [](int64_t handle, int64_t number, double timeout_s) { return lookup(handle)->collect(number, timeout_s); });
  m.def("_hccl_rendezvous_close(int handle) -> ()", [](int64_t handle) {
    std::lock_guard<std::mutex> lock(registry_mutex);
    if (handle >= 0 && handle < static_cast<int64_t>(registry.size())) {
      registry[handle].reset();  // unmapped once an exchange still running on it returns
    }
  });
}

}  // namespace opennpu::distributed
