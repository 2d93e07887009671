// CPU core binding for the npu devices, as torch_npu's CPU_AFFINITY_CONF does it:
//   CPU_AFFINITY_CONF=<mode>[,force:<0|1>][,npu<id>:<first>-<last>]...[,npu_affine:<0|1>]
// mode 0 (or unset) binds nothing; 1 (coarse) binds each thread that works for device d to d's
// core range; 2 (fine) binds those threads to the range's first core when they run one intra-op
// thread (torch.set_num_threads(1)), otherwise as mode 1.
//
// Why it matters more here than on Ascend: PyTorch's autograd engine runs an accelerator's backward
// nodes on its own per-device thread, and on the emulated device that thread runs the kernels
// themselves. Unbound, the OS often wakes it on another core than the one whose caches hold the
// forward's activations; bound with the caller to the same range, it stays with them.
//
// Which threads are bound: a thread that calls torch.npu.set_device (or torch.accelerator's
// set_device_index) is bound to that device's range; any other thread is bound once, when it runs
// its first kernel on an npu device (this is how the autograd engine's device threads are bound:
// they never set a device). Threads created later inherit their creator's binding, as on Linux.
//
// Core ranges: by default the CPUs this process may run on (its affinity when first asked), in
// ascending order, split evenly over the physical npu devices (OPENNPU_DEVICE_COUNT); when there
// are fewer CPUs than devices, device p gets CPU p mod #CPUs. torch_npu splits all of the
// machine's cores; splitting the allowed ones gives the same ranges on an unrestricted machine
// and usable ones in a container. `npu<id>:<a>-<b>` (repeatable, several ranges per device add
// up) replaces device <id>'s range; ids are physical (as before ASCEND_RT_VISIBLE_DEVICES
// renumbers them). A range holding a CPU the process may not use is skipped with a warning unless
// `force:1`, which binds to the usable part. `npu_affine` (NUMA affinity of a real card) has no
// meaning on the emulated devices and is accepted without effect.
//
// Without CPU_AFFINITY_CONF (mode 0), one policy still applies: the backward runs where the
// forward ran, as a CPU backward does, beside the forward's activations in the core's caches.
// PyTorch's autograd engine would run an accelerator's backward nodes on its own per-device
// thread (the caller blocked in backward() meanwhile), which the OS often wakes on another core,
// and each handoff costs a wake-up. So an ordinary thread, at its first kernel on an npu device,
// turns off multithreaded backward for itself (autograd's thread-local
// set_multithreading_enabled(False), which a user's later setting overrides): a backward it calls
// runs every node in the calling thread. The emulated device has no streams for the engine's
// device thread to keep apart. Where the engine's thread still runs npu kernels (a backward
// called from a thread that ran none, or multithreading turned back on), it follows its caller:
// each kernel an ordinary thread runs on device d notes the CPU it ran on; when the engine's npu:d
// thread next runs a kernel and that CPU has changed, it moves itself there (sched_setaffinity to
// that one CPU). OPENNPU_BACKWARD_FOLLOWS_CALLER=0 turns both off.
#include <c10/core/AutogradState.h>
#include <c10/util/Exception.h>
#include <ATen/Parallel.h>

#include <sched.h>
#include <sys/prctl.h>

#include <array>
#include <atomic>
#include <cstring>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

struct AffinityConfig {
  int mode = 0;
  bool backward_follows_caller = true;  // mode 0 only
  bool force = false;
  std::vector<int> allowed;                   // the process's CPUs when the config was read
  std::map<int64_t, std::vector<int>> custom; // physical device id -> its cores
};

[[noreturn]] void bad_config(const std::string& text, const std::string& why) {
  TORCH_CHECK(false, "opennpu: CPU_AFFINITY_CONF='", text, "': ", why, " (expected "
              "<mode>[,force:<0|1>][,npu<id>:<first>-<last>]...[,npu_affine:<0|1>], mode 0, 1 "
              "or 2)");
}

bool parse_int(const std::string& s, long long& value) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 9) return false;
  value = std::stoll(s);
  return true;
}

std::vector<int> process_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
    }
  }
  return cpus;
}

AffinityConfig parse_config() {
  AffinityConfig config;
  const char* follow = std::getenv("OPENNPU_BACKWARD_FOLLOWS_CALLER");
  config.backward_follows_caller = follow == nullptr || std::strcmp(follow, "0") != 0;
  const char* env = std::getenv("CPU_AFFINITY_CONF");
  if (env == nullptr || *env == '\0') return config;
  const std::string text(env);
  std::vector<std::string> fields;
  std::stringstream stream(text);
  for (std::string field; std::getline(stream, field, ',');) fields.push_back(field);
  long long value = 0;
  if (fields.empty() || !parse_int(fields[0], value) || value > 2) bad_config(text, "bad mode");
  config.mode = static_cast<int>(value);
  for (size_t i = 1; i < fields.size(); ++i) {
    const std::string& field = fields[i];
    const auto colon = field.find(':');
    if (colon == std::string::npos) bad_config(text, "'" + field + "' has no ':'");
    const std::string key = field.substr(0, colon), rest = field.substr(colon + 1);
    if (key == "force" || key == "npu_affine") {
      if (!parse_int(rest, value) || value > 1) bad_config(text, "'" + field + "' must be 0 or 1");
      if (key == "force") config.force = value == 1;
    } else if (key.rfind("npu", 0) == 0) {
      long long id = 0, first = 0, last = 0;
      const auto dash = rest.find('-');
      if (!parse_int(key.substr(3), id) || id >= kMaxDevices || dash == std::string::npos ||
          !parse_int(rest.substr(0, dash), first) || !parse_int(rest.substr(dash + 1), last) ||
          first > last || last >= CPU_SETSIZE) {
        bad_config(text, "'" + field + "' is not npu<id>:<first>-<last> with first <= last");
      }
      auto& cores = config.custom[id];
      for (long long c = first; c <= last; ++c) cores.push_back(static_cast<int>(c));
    } else {
      bad_config(text, "unknown field '" + field + "'");
    }
  }
  for (auto& [id, cores] : config.custom) {
    std::sort(cores.begin(), cores.end());
    cores.erase(std::unique(cores.begin(), cores.end()), cores.end());
  }
  config.allowed = process_cpus();
  return config;
}

// Read once. A malformed value warns and binds nothing: binding is a tuning knob, and the threads
// that apply it (the autograd engine's among them) have no caller to raise an error to.
const AffinityConfig& config() {
  static const AffinityConfig* parsed = [] {  // leaked on purpose
    try {
      return new AffinityConfig(parse_config());
    } catch (const c10::Error& e) {
      TORCH_WARN(e.what_without_backtrace(), "; no core binding");
      auto* off = new AffinityConfig();
      off->backward_follows_caller = false;
      return off;
    }
  }();
  return *parsed;
}

std::vector<int> device_range(const AffinityConfig& c, c10::DeviceIndex index) {
  const int64_t physical = visible_physical_ids().at(static_cast<size_t>(index));
  if (auto it = c.custom.find(physical); it != c.custom.end()) return it->second;
  const int64_t cpus = static_cast<int64_t>(c.allowed.size()), devices = std::max<int64_t>(physical_device_count(), 1);
  if (cpus == 0) return {};
  if (cpus < devices) return std::vector<int>(1, c.allowed[static_cast<size_t>(physical % cpus)]);
  const int64_t first = physical * cpus / devices, last = (physical + 1) * cpus / devices;
  return std::vector<int>(c.allowed.begin() + first, c.allowed.begin() + last);
}

// Binds the calling thread to `cores` (the part the process may use, with force), or warns.
void bind_calling_thread(const AffinityConfig& c, std::vector<int> cores, const std::string& what) {
  std::vector<int> usable;
  std::set_intersection(cores.begin(), cores.end(), c.allowed.begin(), c.allowed.end(),
                        std::back_inserter(usable));
  if (usable.empty() || (usable.size() != cores.size() && !c.force)) {
    TORCH_WARN_ONCE("opennpu: CPU_AFFINITY_CONF: ", what, " names CPUs this process may not run "
                    "on; that binding is skipped (force:1 binds to the usable part)");
    return;
  }
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int cpu : usable) CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    TORCH_WARN_ONCE("opennpu: CPU_AFFINITY_CONF: sched_setaffinity failed for ", what);
  }
}

thread_local c10::DeviceIndex tls_bound_device = -1;

// The follow-the-caller policy (mode 0). A thread's role is found once, from its name: the
// autograd engine names its device threads pt_autograd_<index>.
enum class Role : uint8_t { kUnknown, kEngine, kCaller };
thread_local Role tls_role = Role::kUnknown;
thread_local int tls_pinned_cpu = -1;
// The CPU of each device's last kernel on a caller thread, plus one: 0 = none yet.
std::array<std::atomic<int>, kMaxDevices> caller_cpu_plus_one{};

Role find_role() {
  char name[16] = {};
  prctl(PR_GET_NAME, name, 0, 0, 0);
  return std::strncmp(name, "pt_autograd_", 12) == 0 ? Role::kEngine : Role::kCaller;
}

void follow_caller(c10::DeviceIndex index) {
  if (tls_role == Role::kUnknown) {
    tls_role = find_role();
    if (tls_role == Role::kCaller) c10::AutogradState::get_tls_state().set_multithreading_enabled(false);
  }
  std::atomic<int>& noted = caller_cpu_plus_one[static_cast<size_t>(index)];
  if (tls_role == Role::kCaller) {
    const int cpu = sched_getcpu();
    if (cpu >= 0 && noted.load(std::memory_order_relaxed) != cpu + 1) {
      noted.store(cpu + 1, std::memory_order_relaxed);
    }
    return;
  }
  const int cpu = noted.load(std::memory_order_relaxed) - 1;
  if (cpu < 0 || cpu == tls_pinned_cpu) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof(set), &set) == 0) tls_pinned_cpu = cpu;
}

std::mutex main_cores_mutex;
std::vector<int> main_cores;  // what the last explicit set_device bound (reset_thread_affinity)

std::string describe(c10::DeviceIndex index) { return "npu:" + std::to_string(index) + "'s range"; }

}  // namespace

void bind_thread_to_device(c10::DeviceIndex index, bool explicit_request) {
  const AffinityConfig& c = config();
  if (index < 0) return;
  if (c.mode == 0) {
    if (c.backward_follows_caller && !explicit_request) follow_caller(index);
    return;
  }
  if (tls_bound_device == index || (!explicit_request && tls_bound_device >= 0)) return;
  std::vector<int> cores = device_range(c, index);
  if (cores.empty()) return;
  if (c.mode == 2 && at::get_num_threads() == 1) cores = std::vector<int>(1, cores.front());
  bind_calling_thread(c, cores, describe(index));
  tls_bound_device = index;
  if (explicit_request) {
    std::lock_guard<std::mutex> lock(main_cores_mutex);
    main_cores = cores;
  }
}

void set_thread_affinity(std::vector<int64_t> cores) {
  const AffinityConfig& c = config();
  if (c.mode == 0) return;
  if (cores.empty()) {  // the current device's range
    const std::vector<int> range = device_range(c, current_device());
    bind_calling_thread(c, range, describe(current_device()));
    return;
  }
  std::vector<int> sorted;
  for (int64_t core : cores) {
    TORCH_CHECK(core >= 0 && core < CPU_SETSIZE, "set_thread_affinity: a core id must be in [0, ",
                CPU_SETSIZE, "), but got ", core);
    sorted.push_back(static_cast<int>(core));
  }
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  bind_calling_thread(c, sorted, "set_thread_affinity's cores");
}

void reset_thread_affinity() {
  const AffinityConfig& c = config();
  if (c.mode == 0) return;
  std::vector<int> cores;
  {
    std::lock_guard<std::mutex> lock(main_cores_mutex);
    cores = main_cores;
  }
  if (cores.empty()) cores = device_range(c, current_device());
  bind_calling_thread(c, cores, "the main thread's range");
}

}  // namespace opennpu::device
