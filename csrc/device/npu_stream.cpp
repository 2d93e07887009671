// Streams and events of the npu device. Kernels run synchronously on the calling host thread, so
// a stream is only an id that orders nothing beyond program order, and an event is the host time
// at which it was recorded: elapsed_time between two events measures the host work between them.
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>

#include <array>
#include <atomic>
#include <chrono>
#include <mutex>
#include <unordered_set>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

// Each thread's current stream id per device; 0 is the default stream.
thread_local std::array<c10::StreamId, kMaxDevices> tls_current_stream{};

// Ids handed out by new_stream, per device; never reused, so a Stream stays distinct.
std::array<std::atomic<c10::StreamId>, kMaxDevices> next_stream_id{};

struct NpuEvent {
  c10::DeviceIndex device = -1;
  bool timing = false;  // EventFlag::BACKEND_DEFAULT, i.e. Event(enable_timing=True)
  std::chrono::steady_clock::time_point recorded_at;
};

// Every NpuEvent alive, so that the event ids Python passes to the ops below are checked before
// they are dereferenced.
struct LiveEvents {
  std::mutex mutex;
  std::unordered_set<const void*> events;
};

LiveEvents& live_events() {
  static auto* live = new LiveEvents();  // leaked: events may be destroyed during exit
  return *live;
}

const NpuEvent* checked_event(void* event, const char* what) {
  TORCH_CHECK(event != nullptr, what, ": the event has not been recorded");
  auto& live = live_events();
  std::lock_guard<std::mutex> lock(live.mutex);
  TORCH_CHECK(live.events.count(event) != 0, what, ": ", event, " is not a live npu event");
  return static_cast<const NpuEvent*>(event);
}

}  // namespace

c10::Stream current_stream(c10::DeviceIndex index) {
  const c10::Device device = npu_device(index);
  return c10::Stream(c10::Stream::UNSAFE, device, tls_current_stream[device.index()]);
}

c10::Stream exchange_stream(c10::Stream stream) {
  TORCH_CHECK(stream.device_type() == kNpu, "npu: cannot make a ", stream.device(),
              " stream current");
  const c10::Device device = npu_device(stream.device_index());
  const c10::Stream previous(c10::Stream::UNSAFE, device, tls_current_stream[device.index()]);
  tls_current_stream[device.index()] = stream.id();
  return previous;
}

c10::Stream new_stream(c10::DeviceIndex index) {
  const c10::Device device = npu_device(index);
  const c10::StreamId id = ++next_stream_id[device.index()];
  return c10::Stream(c10::Stream::UNSAFE, device, id);
}

void record_event(void** event, const c10::Stream& stream, c10::DeviceIndex index,
                  c10::EventFlag flag) {
  TORCH_CHECK(stream.device_type() == kNpu, "npu: an npu event cannot be recorded on a ",
              stream.device(), " stream");
  TORCH_CHECK(index < 0 || index == stream.device_index(), "npu: the event belongs to npu:",
              static_cast<int>(index), " but the stream to ", stream.device());
  auto* npu_event = static_cast<NpuEvent*>(*event);
  if (npu_event == nullptr) {
    npu_event = new NpuEvent();
    npu_event->device = stream.device_index();
    npu_event->timing = flag == c10::EventFlag::BACKEND_DEFAULT;
    *event = npu_event;
    auto& live = live_events();
    std::lock_guard<std::mutex> lock(live.mutex);
    live.events.insert(npu_event);
  }
  npu_event->recorded_at = std::chrono::steady_clock::now();
}

void destroy_event(void* event) noexcept {
  if (event == nullptr) return;
  {
    auto& live = live_events();
    std::lock_guard<std::mutex> lock(live.mutex);
    live.events.erase(event);
  }
  delete static_cast<NpuEvent*>(event);
}

double event_elapsed_ms(void* start, void* end) {
  TORCH_CHECK(start != nullptr && end != nullptr,
              "Both events must be recorded before calculating elapsed time.");
  const auto* a = checked_event(start, "Event.elapsed_time");
  const auto* b = checked_event(end, "Event.elapsed_time");
  TORCH_CHECK(a->timing && b->timing,
              "Both events must be created with argument 'enable_timing=True'.");
  return std::chrono::duration<double, std::milli>(b->recorded_at - a->recorded_at).count();
}

int64_t event_recorded_ns(void* event) {
  const auto* npu_event = checked_event(event, "Event.recorded_time()");
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             npu_event->recorded_at.time_since_epoch()).count();
}

}  // namespace opennpu::device
