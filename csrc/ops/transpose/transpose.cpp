// Entry points of the confusion-transpose family: validation, the copy plan, CPU registration.
//
// Shapes are taken literally, as torch_npu does (its output shape is `shape` itself): every size
// must be given, -1 is not inferred.
#include "ops/transpose/transpose.h"

#include <ATen/TensorUtils.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>

#include "common/checks.h"

namespace opennpu::transpose {

KernelSlots<PermuteCopyFn> permute_copy;
KernelSlots<StreamCopyFn> stream_copy;

namespace {

// What a shape belongs to, for messages (formatted only when a check fails).
struct Named {
  const char* name;
  c10::IntArrayRef shape;
};

std::ostream& operator<<(std::ostream& out, const Named& n) {
  if (std::string(n.name) == "shape") return out << "'shape' " << n.shape;
  return out << "'" << n.name << "' (shape " << n.shape << ")";
}

// `perm` is a permutation of [0, rank) (negative dims count from the end, as in torch.permute);
// returns it with the negative dims wrapped. `of` names what perm permutes, for the messages.
std::vector<int64_t> check_perm(const char* op, c10::IntArrayRef perm, int64_t rank,
                                const Named& of) {
  OPENNPU_CHECK_ARG(static_cast<int64_t>(perm.size()) == rank, op, "perm", "must have ", rank,
                    " entries (one per dim of ", of, "), but got ", perm.size(), ": ", perm);
  std::vector<int64_t> wrapped(perm.begin(), perm.end());
  std::vector<bool> seen(rank, false);
  for (auto& d : wrapped) {
    OPENNPU_CHECK_ARG(d >= -rank && d < rank, op, "perm", "must hold dims in [", -rank, ", ",
                      rank - 1, "] (a permutation of the dims of ", of, "), but got ", perm);
    if (d < 0) d += rank;
    OPENNPU_CHECK_ARG(!seen[d], op, "perm", "must be a permutation of the dims of ", of,
                      " (each of 0..", rank - 1, " once), but got ", perm, " (dim ", d,
                      " repeated)");
    seen[d] = true;
  }
  return wrapped;
}

// prod(shape), or -1 when it overflows int64 (then it equals no tensor's numel).
int64_t numel_of(c10::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (__builtin_mul_overflow(n, s, &n)) return -1;
  }
  return n;
}

// Every size >= 0 and prod(shape) == numel; `of` describes where numel comes from.
void check_shape(const char* op, const char* arg, c10::IntArrayRef shape, int64_t numel,
                 const Named& of) {
  for (int64_t s : shape) {
    OPENNPU_CHECK_ARG(s >= 0, op, arg, "must hold sizes >= 0 (every size given; -1 is not ",
                      "inferred), but got ", shape);
  }
  const int64_t n = numel_of(shape);
  OPENNPU_CHECK_ARG(n == numel, op, arg, "must hold as many elements as ", of, " (", numel,
                    "), but got ", shape, " (", n < 0 ? std::string("overflow") : std::to_string(n),
                    " elements)");
}

// The bytes-moving unit: the widest of 8, 4, 2, 1 bytes that divides the element size.
int64_t unit_of(int64_t element_size) {
  for (int64_t unit : {8, 4, 2}) {
    if (element_size % unit == 0) return unit;
  }
  return 1;
}

// The plan of `dst = view.permute(perm).contiguous()` for a source view with these sizes and
// strides (in elements): dims in output order, size-1 dims dropped, dims that stay adjacent in
// the source merged, and the innermost dims contiguous on both sides folded into runs.
CopyPlan make_plan(c10::IntArrayRef sizes, c10::IntArrayRef strides,
                   const std::vector<int64_t>& perm, int64_t element_size) {
  CopyPlan plan;
  plan.unit = unit_of(element_size);
  const int64_t per_element = element_size / plan.unit;
  std::vector<int64_t> n, s;
  auto push = [&](int64_t size, int64_t stride) {
    if (size == 1) return;
    if (!n.empty() && s.back() == size * stride) {  // still adjacent: merge into the outer dim
      n.back() *= size;
      s.back() = stride;
    } else {
      n.push_back(size);
      s.push_back(stride);
    }
  };
  for (int64_t d : perm) push(sizes[d], strides[d] * per_element);
  push(per_element, 1);  // elements wider than 8 bytes (complex128) are runs of units
  if (!n.empty() && s.back() == 1) {
    plan.run = n.back();
    n.pop_back();
    s.pop_back();
  }
  // A run of 2, 4 or 8 bytes is one wider unit: the element transpose then moves it in SIMD
  // registers instead of calling memcpy per run (e.g. bf16 pairs, or complex64 as 8 bytes).
  const int64_t run_bytes = plan.run * plan.unit;
  bool divisible = true;
  for (int64_t stride : s) divisible = divisible && stride % plan.run == 0;
  if (plan.run > 1 && (run_bytes == 2 || run_bytes == 4 || run_bytes == 8) && divisible) {
    for (auto& stride : s) stride /= plan.run;
    plan.unit = run_bytes;
    plan.run = 1;
  }
  plan.sizes = std::move(n);
  plan.src_strides = std::move(s);
  return plan;
}

// out (contiguous, out_shape) <- permute(view, perm), the view given by sizes/strides over src.
at::Tensor permute_into_new(const char* op, const at::Tensor& src, c10::IntArrayRef sizes,
                            c10::IntArrayRef strides, const std::vector<int64_t>& perm,
                            c10::IntArrayRef out_shape) {
  at::Tensor out = at::empty(out_shape, src.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const CopyPlan plan = make_plan(sizes, strides, perm, src.element_size());
  permute_copy.get(op, src)(static_cast<const char*>(src.const_data_ptr()),
                           static_cast<char*>(out.mutable_data_ptr()), plan);
  return out;
}

// The shared core: forward with (perm, shape, transpose_first), and the backward, which is the
// same movement with the inverse permutation. out_shape is what the caller returns.
at::Tensor confusion_transpose(const char* op, const at::Tensor& self,
                               const std::vector<int64_t>& perm, c10::IntArrayRef shape,
                               bool transpose_first, c10::IntArrayRef out_shape) {
  if (transpose_first) {
    return permute_into_new(op, self, self.sizes(), self.strides(), perm, out_shape);
  }
  // self.view(shape): its strides when self's layout allows the view, else a contiguous copy
  // first (as reshape would make).
  if (auto strides = at::detail::computeStride(self.sizes(), self.strides(), shape)) {
    return permute_into_new(op, self, shape, *strides, perm, out_shape);
  }
  const at::Tensor dense = self.contiguous();
  std::vector<int64_t> strides(shape.size());
  for (int64_t d = static_cast<int64_t>(shape.size()) - 1, acc = 1; d >= 0; --d) {
    strides[d] = acc;
    acc *= shape[d];
  }
  return permute_into_new(op, dense, shape, strides, perm, out_shape);
}

std::vector<int64_t> permuted(c10::IntArrayRef shape, const std::vector<int64_t>& perm) {
  std::vector<int64_t> out;
  out.reserve(perm.size());
  for (int64_t d : perm) out.push_back(shape[d]);
  return out;
}

}  // namespace

at::Tensor npu_confusion_transpose(const at::Tensor& self, c10::IntArrayRef perm,
                                   c10::IntArrayRef shape, bool transpose_first) {
  constexpr const char* op = "npu_confusion_transpose";
  check_shape(op, "shape", shape, self.numel(), Named{"self", self.sizes()});
  if (transpose_first) {
    const auto p = check_perm(op, perm, self.dim(), Named{"self", self.sizes()});
    return confusion_transpose(op, self, p, shape, true, shape);
  }
  const auto p = check_perm(op, perm, static_cast<int64_t>(shape.size()),
                            Named{"shape", shape});
  return confusion_transpose(op, self, p, shape, false, permuted(shape, p));
}

// Called by autograd as (grad, perm, self.sizes(), !transpose_first). With inv[perm[i]] = i:
// flag False: grad.view([shape[perm[i]]...]).permute(inv); True: grad.permute(inv).reshape(shape).
// The result has the shape `shape`.
at::Tensor npu_confusion_transpose_backward(const at::Tensor& grad, c10::IntArrayRef perm,
                                            c10::IntArrayRef shape, bool transpose_first) {
  constexpr const char* op = "npu_confusion_transpose_backward";
  for (int64_t s : shape) {
    OPENNPU_CHECK_ARG(s >= 0, op, "shape", "must hold sizes >= 0, but got ", shape);
  }
  const int64_t numel = numel_of(shape);
  OPENNPU_CHECK_ARG(grad.numel() == numel, op, "grad",
                    "must hold as many elements as 'shape' ", shape_str(shape), " (",
                    numel < 0 ? std::string("overflow") : std::to_string(numel),
                    "), but got shape ", shape_str(grad.sizes()), " (", grad.numel(),
                    " elements)");
  if (transpose_first) {
    const auto p = check_perm(op, perm, grad.dim(), Named{"grad", grad.sizes()});
    std::vector<int64_t> inv(p.size());
    for (size_t i = 0; i < p.size(); ++i) inv[p[i]] = static_cast<int64_t>(i);
    return confusion_transpose(op, grad, inv, shape, true, shape);
  }
  const auto p = check_perm(op, perm, static_cast<int64_t>(shape.size()),
                            Named{"shape", shape});
  std::vector<int64_t> inv(p.size());
  for (size_t i = 0; i < p.size(); ++i) inv[p[i]] = static_cast<int64_t>(i);
  const auto viewed = permuted(shape, p);  // the forward output's shape
  return confusion_transpose(op, grad, inv, viewed, false, shape);
}

// self <- src byte for byte with streaming stores (no read of self's lines first): the copy the
// benchmark harness measures its second memory roof with. Both contiguous, of one dtype and size.
at::Tensor& stream_copy_(at::Tensor& self, const at::Tensor& src) {
  constexpr const char* op = "_stream_copy_";
  OPENNPU_CHECK_ARG(self.is_contiguous(), op, "self", "must be contiguous, but got strides ",
                    self.strides());
  OPENNPU_CHECK_ARG(src.is_contiguous(), op, "src", "must be contiguous, but got strides ",
                    src.strides());
  OPENNPU_CHECK_ARG(src.scalar_type() == self.scalar_type(), op, "src", "must have the dtype of 'self' (",
                    self.scalar_type(), "), but got ", src.scalar_type());
  OPENNPU_CHECK_ARG(src.sizes() == self.sizes(), op, "src", "must have the shape of 'self' (",
                    shape_str(self.sizes()), "), but got ", shape_str(src.sizes()));
  OPENNPU_CHECK_ARG(src.device() == self.device(), op, "src", "must be on the device of 'self' (",
                    self.device(), "), but got ", src.device());
  if (self.numel() == 0) return self;
  stream_copy.get(op, self)(static_cast<const char*>(src.const_data_ptr()),
                            static_cast<char*>(self.mutable_data_ptr()), self.nbytes());
  return self;
}

TORCH_LIBRARY_IMPL(opennpu, CPU, m) { m.impl("_stream_copy_", &stream_copy_); }

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_confusion_transpose", &npu_confusion_transpose);
  m.impl("npu_confusion_transpose_backward", &npu_confusion_transpose_backward);
}

}  // namespace opennpu::transpose
