// Copies to, from and between npu tensors (_copy_from, which Tensor.copy_, .to(), .cpu() and
// .npu() end in). All sides are host memory, so a copy is ATen's CPU copy between CPU tensors that
// alias the two tensors' bytes: dtype conversion, broadcasting, strides and conj/neg bits are
// handled exactly as on CPU, and npu:i -> npu:j is one memcpy-speed pass like any other.
#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>

#include "device/npu_device.h"

namespace opennpu::device {

namespace {

std::atomic<int64_t> copies{0};
std::atomic<int64_t> copied_bytes{0};

// CPU tensors over `src` and `dst`; npu tensors on one storage get aliases on one CPU storage, so
// copy_'s overlap checks see the overlap they would see on CPU.
std::pair<at::Tensor, at::Tensor> cpu_views(const at::Tensor& src, const at::Tensor& dst) {
  auto check = [](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() || t.device().type() == kNpu, "npu: cannot copy ",
                name == std::string("self") ? "from" : "to", " a ", t.device(),
                " tensor; copies between npu and ", t.device(), " go through cpu");
    TORCH_CHECK(t.layout() == c10::kStrided, "npu: copy supports strided tensors only, but got ",
                t.layout());
  };
  check(src, "self");
  check(dst, "dst");
  at::Tensor dst_cpu = dst;
  c10::Storage dst_alias;
  if (dst.device().type() == kNpu) {
    dst_alias = make_cpu_alias_storage(dst.storage());
    dst_cpu = make_cpu_alias(dst, dst_alias);
  }
  at::Tensor src_cpu = src;
  if (src.device().type() == kNpu) {
    const bool shared = dst.device().type() == kNpu && src.storage().is_alias_of(dst.storage());
    src_cpu = make_cpu_alias(src, shared ? dst_alias : make_cpu_alias_storage(src.storage()));
  }
  return {src_cpu, dst_cpu};
}

at::Tensor npu_copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  auto [src_cpu, dst_cpu] = cpu_views(self, dst);
  {
    const c10::DeviceIndex index = dst.device().type() == kNpu ? dst.device().index() : self.device().index();
    CpuAllocationRedirect redirect(index);  // temporaries of a converting or overlapping copy
    dst_cpu.copy_(src_cpu, non_blocking);
  }
  copies.fetch_add(1, std::memory_order_relaxed);
  copied_bytes.fetch_add(static_cast<int64_t>(dst.numel() * dst.element_size()), std::memory_order_relaxed);
  return dst;
}

at::Tensor npu_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return npu_copy_from(self, dst, false);
}

}  // namespace

CopyStats copy_stats() { return {copies.load(), copied_bytes.load()}; }

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_copy_from", TORCH_FN(npu_copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(npu_copy_from_and_resize));
}

}  // namespace opennpu::device
