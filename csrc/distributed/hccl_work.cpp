// torch.ops.opennpu._hccl_npu_work: the Work of an hccl collective that gloo runs on CPU aliases of
// npu tensors (src/opennpu/distributed). It completes, fails and waits as gloo's Work does, but
// its future's value and result() are the npu tensors the caller passed, not gloo's aliases of
// them, as a device backend's Work must give. The future is gloo's future continued in C++: its
// callback runs on gloo's thread without the GIL, so completion never waits for Python.
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/library.h>

#include <mutex>
#include <utility>
#include <vector>

namespace opennpu::distributed {

namespace {

class NpuWork : public c10d::Work {
 public:
  NpuWork(c10::intrusive_ptr<c10d::Work> gloo, std::vector<at::Tensor> npu)
      : c10d::Work(-1, gloo->retrieveOpType()), gloo_(std::move(gloo)), npu_(std::move(npu)) {}

  bool isCompleted() override { return gloo_->isCompleted(); }
  bool isSuccess() const override { return gloo_->isSuccess(); }
  std::exception_ptr exception() const override { return gloo_->exception(); }
  int sourceRank() const override { return gloo_->sourceRank(); }
  std::vector<at::Tensor> result() override { return npu_; }
  void synchronize() override { gloo_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override { return gloo_->wait(timeout); }
  void abort() override { gloo_->abort(); }
  uint64_t getSequencenumber() const override { return gloo_->getSequencenumber(); }

  // Gloo's future, its value replaced by the npu tensors (an error passes through unchanged:
  // value() rethrows it inside then(), which hands it to the child). Raises where gloo's Work
  // has no future, as gloo's does.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!future_) {
      future_ = gloo_->getFuture()->then(
          [npu = npu_](c10::ivalue::Future& done) -> c10::IValue {
            done.value();
            return c10::IValue(npu);
          },
          c10::ListType::create(c10::TensorType::get()));
    }
    return future_;
  }

 private:
  c10::intrusive_ptr<c10d::Work> gloo_;
  std::vector<at::Tensor> npu_;
  std::mutex mutex_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(opennpu, m) {
  m.def("_hccl_npu_work(__torch__.torch.classes.c10d.Work gloo_work, Tensor[] npu_tensors) -> "
        "__torch__.torch.classes.c10d.Work",
        [](const c10::intrusive_ptr<c10d::Work>& gloo_work, std::vector<at::Tensor> npu_tensors)
            -> c10::intrusive_ptr<c10d::Work> {
          TORCH_CHECK(gloo_work, "opennpu::_hccl_npu_work: argument 'gloo_work' must be a Work, got None");
          return c10::make_intrusive<NpuWork>(gloo_work, std::move(npu_tensors));
        });
}

}  // namespace opennpu::distributed
