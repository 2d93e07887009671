// Argument validation shared by every op's entry point.
//
// Every failure is a c10::Error (RuntimeError in Python) whose text names the op, the argument,
// what was expected and what came, e.g.
//   npu_rms_norm: argument 'gamma' must have the shape of the trailing dims of 'self' ([4, 8]),
//   but got [7]
// Strict mode (opennpu.set_strict(True) or OPENNPU_STRICT=1) additionally enforces the documented
// Ascend limits; those messages say "(strict mode)" so users know the math itself would work.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <initializer_list>
#include <sstream>
#include <string>

namespace opennpu {

bool strict_mode();
void set_strict_mode(bool enabled);

std::string shape_str(c10::IntArrayRef shape);

// Joins the pieces with operator<< (like c10::str) and prefixes "<op>: argument '<arg>' ".
template <typename... Args>
std::string arg_error(const char* op, const char* arg, const Args&... pieces) {
  std::ostringstream out;
  out << op << ": argument '" << arg << "' ";
  (out << ... << pieces);
  return out.str();
}

#define OPENNPU_CHECK_ARG(cond, op, arg, ...)                                   \
  TORCH_CHECK((cond), ::opennpu::arg_error((op), (arg), __VA_ARGS__))

#define OPENNPU_CHECK_STRICT(cond, op, arg, ...)                                \
  TORCH_CHECK(!::opennpu::strict_mode() || (cond),                              \
              ::opennpu::arg_error((op), (arg), __VA_ARGS__,                    \
                                   " (strict mode: Ascend constraint)"))

// fp16, bf16, fp32 (and fp64, which the kernels support for gradcheck and exact references).
void check_floating(const char* op, const char* arg, const at::Tensor& t);

// t lives on the same device as ref.
void check_same_device(const char* op, const char* arg, const at::Tensor& t,
                       const char* ref_arg, const at::Tensor& ref);

// t has the shape of ref (e.g. a gradient and the tensor it belongs to).
void check_same_shape(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                      const at::Tensor& ref);

// Wraps a possibly negative dim into [0, ndim), or fails naming the argument.
int64_t wrap_dim(const char* op, const char* arg, int64_t dim, int64_t ndim);

// Strict mode: the tensor's dtype is one of `allowed`.
void check_strict_dtype(const char* op, const char* arg, const at::Tensor& t,
                        std::initializer_list<c10::ScalarType> allowed);

// Strict mode: lo <= t.dim() <= hi.
void check_strict_rank(const char* op, const char* arg, const at::Tensor& t, int64_t lo,
                       int64_t hi);

}  // namespace opennpu
