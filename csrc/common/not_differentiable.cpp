// The Autograd kernel of opennpu's functional ops that have no gradient (torch_npu registers
// none either; src/opennpu/ops/_registry.py mark_not_differentiable registers it through
// opennpu::_mark_not_differentiable). In C++ so that the common call, with grad mode off or no
// argument requiring grad (inference: every decode step, every quantised matmul), costs one
// scan of the arguments on its way below autograd, not a Python frame. Where an argument
// requires grad, the op runs below autograd and its floating outputs (as new tensors sharing
// their storage) get a node whose backward raises the op's message, instead of silently giving
// no gradient.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/stack.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace opennpu {
namespace {

struct NotDifferentiableBackward final : torch::autograd::Node {
  explicit NotDifferentiableBackward(std::string message) : message_(std::move(message)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*grads*/) override {
    TORCH_CHECK(false, message_);
  }
  std::string name() const override { return "NotDifferentiableBackward"; }

 private:
  std::string message_;
};

// Calls fn(tensor) for every defined tensor in the IValues [first, last): tensors, tensor lists
// and optional-tensor lists.
template <typename Fn>
void for_each_tensor(const c10::IValue* first, const c10::IValue* last, const Fn& fn) {
  for (const c10::IValue* v = first; v != last; ++v) {
    if (v->isTensor()) {
      if (v->toTensor().defined()) fn(v->toTensor());
    } else if (v->isList()) {
      for (const c10::IValue& e : v->toListRef()) {
        if (e.isTensor() && e.toTensor().defined()) fn(e.toTensor());
      }
    }
  }
}

class NotDifferentiableKernel final : public c10::OperatorKernel {
 public:
  explicit NotDifferentiableKernel(std::string message) : message_(std::move(message)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                  torch::jit::Stack* stack) {
    const size_t n_args = op.schema().arguments().size();
    std::vector<at::Tensor> need_grad;
    if (at::GradMode::is_enabled()) {
      const c10::IValue* args = stack->data() + stack->size() - n_args;
      for_each_tensor(args, args + n_args, [&](const at::Tensor& t) {
        if (t.requires_grad()) need_grad.push_back(t);
      });
    }
    {
      at::AutoDispatchBelowAutograd below;
      op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    }
    if (need_grad.empty()) return;
    auto node = std::shared_ptr<NotDifferentiableBackward>(
        new NotDifferentiableBackward(message_), torch::autograd::deleteNode);
    node->set_next_edges(torch::autograd::collect_next_edges(need_grad));
    const auto tie = [&](const at::Tensor& t) {
      at::Tensor tied = t.detach();
      torch::autograd::set_history(tied, node);
      return tied;
    };
    const size_t n_out = op.schema().returns().size();
    for (c10::IValue* v = stack->data() + stack->size() - n_out; v != stack->data() + stack->size(); ++v) {
      if (v->isTensor()) {
        const at::Tensor& t = v->toTensor();
        if (t.defined() && t.is_floating_point()) *v = tie(t);
      } else if (v->isTensorList()) {
        std::vector<at::Tensor> outs = v->toTensorVector();
        for (at::Tensor& t : outs) {
          if (t.defined() && t.is_floating_point()) t = tie(t);
        }
        *v = c10::IValue(outs);
      }
    }
  }

 private:
  std::string message_;
};

// Registers the kernel for "ns::name[.overload]" under the Autograd key; the libraries live as
// long as the process (the registrations with them).
void mark_not_differentiable(c10::string_view qualname, c10::string_view message) {
  static std::mutex lock;
  static std::vector<std::unique_ptr<torch::Library>> libraries;
  const std::string full(qualname);
  const size_t cut = full.find("::");
  TORCH_CHECK(cut != std::string::npos, "_mark_not_differentiable: argument 'qualname' must be "
              "'namespace::name[.overload]', but got '", full, "'");
  const std::string ns = full.substr(0, cut), name = full.substr(cut + 2);
  const std::lock_guard<std::mutex> guard(lock);
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, ns,
                                                  c10::DispatchKey::Autograd, __FILE__, __LINE__);
  library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunctor(
                                  std::make_unique<NotDifferentiableKernel>(std::string(message))));
  libraries.push_back(std::move(library));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(opennpu, m) {
  // The Autograd kernel of a functional op without a gradient (see the top of this file).
  m.def("_mark_not_differentiable(str qualname, str message) -> ()", &mark_not_differentiable);
}

}  // namespace opennpu
