// The npu DeviceGuardImplInterface: the thread's current device, and the stream and event calls
// that c10::Stream / c10::Event (torch.Stream, torch.Event, torch.accelerator) route through it.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

// Each thread starts on device 0, as a CUDA thread does.
thread_local c10::DeviceIndex tls_current_device = 0;

struct NpuGuardImpl final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }

  c10::Device exchangeDevice(c10::Device device) const override {
    const c10::Device previous = getDevice();
    if (device.index() != previous.index()) setDevice(device);
    return previous;
  }
  c10::Device getDevice() const override { return c10::Device(kNpu, current_device()); }
  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.type() == kNpu, "npu guard: expected an npu device, but got ", device);
    set_current_device(device.has_index() ? device.index() : current_device());
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.has_index() && device.index() >= 0 && device.index() < device_count()) {
      tls_current_device = device.index();
    }
  }
  c10::DeviceIndex deviceCount() const noexcept override { return device_count(); }

  c10::Stream getStream(c10::Device device) const override {
    return current_stream(device.index());
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    return c10::Stream(c10::Stream::DEFAULT, npu_device(device.index()));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*isHighPriority*/) const override {
    return new_stream(device.index());
  }
  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return new_stream(device.index());
  }
  c10::Stream exchangeStream(c10::Stream stream) const override { return exchange_stream(stream); }

  // Work runs in program order on the host: every stream and event is complete when queried.
  bool queryStream(const c10::Stream& /*stream*/) const override { return true; }
  void synchronizeStream(const c10::Stream& /*stream*/) const override {}
  void synchronizeDevice(c10::DeviceIndex index) const override { check_device_index(index); }

  void record(void** event, const c10::Stream& stream, c10::DeviceIndex index,
              c10::EventFlag flag) const override {
    record_event(event, stream, index, flag);
  }
  void block(void* /*event*/, const c10::Stream& /*stream*/) const override {}
  bool queryEvent(void* /*event*/) const override { return true; }
  void synchronizeEvent(void* /*event*/) const override {}
  void destroyEvent(void* event, c10::DeviceIndex /*index*/) const noexcept override {
    destroy_event(event);
  }
  double elapsedTime(void* start, void* end, c10::DeviceIndex /*index*/) const override {
    return event_elapsed_ms(start, end);
  }
  void recordDataPtrOnStream(const c10::DataPtr& /*data*/, const c10::Stream& /*stream*/) const override {}
};

}  // namespace

c10::DeviceIndex current_device() noexcept { return tls_current_device; }

void set_current_device(c10::DeviceIndex index) {
  initialize_devices();
  check_device_index(index);
  tls_current_device = index;
}

c10::Device npu_device(c10::DeviceIndex index) {
  if (index < 0) index = current_device();
  check_device_index(index);
  return c10::Device(kNpu, index);
}

C10_REGISTER_GUARD_IMPL(PrivateUse1, NpuGuardImpl);

}  // namespace opennpu::device
