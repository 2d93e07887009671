#include "common/checks.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace opennpu {
namespace {

bool strict_from_env() {
  const char* value = std::getenv("OPENNPU_STRICT");
  return value != nullptr && std::strcmp(value, "") != 0 && std::strcmp(value, "0") != 0;
}

std::atomic<bool>& strict_flag() {
  static std::atomic<bool> flag{strict_from_env()};
  return flag;
}

std::string dtype_list(std::initializer_list<c10::ScalarType> dtypes) {
  std::ostringstream out;
  const char* sep = "";
  for (auto dtype : dtypes) {
    out << sep << c10::toString(dtype);
    sep = ", ";
  }
  return out.str();
}

}  // namespace

bool strict_mode() { return strict_flag().load(std::memory_order_relaxed); }

void set_strict_mode(bool enabled) { strict_flag().store(enabled, std::memory_order_relaxed); }

std::string shape_str(c10::IntArrayRef shape) {
  std::ostringstream out;
  out << shape;
  return out.str();
}

void check_floating(const char* op, const char* arg, const at::Tensor& t) {
  OPENNPU_CHECK_ARG(t.defined(), op, arg, "must be a tensor, but got None");
  const auto dtype = t.scalar_type();
  OPENNPU_CHECK_ARG(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                        dtype == at::kDouble,
                    op, arg, "must be float16, bfloat16 or float32, but got ", dtype);
}

void check_same_device(const char* op, const char* arg, const at::Tensor& t,
                       const char* ref_arg, const at::Tensor& ref) {
  OPENNPU_CHECK_ARG(t.device() == ref.device(), op, arg, "must be on the device of '", ref_arg,
                    "' (", ref.device(), "), but got ", t.device());
}

void check_same_shape(const char* op, const char* arg, const at::Tensor& t, const char* ref_arg,
                      const at::Tensor& ref) {
  OPENNPU_CHECK_ARG(t.sizes().equals(ref.sizes()), op, arg, "must have the shape of '", ref_arg,
                    "' ", shape_str(ref.sizes()), ", but got ", shape_str(t.sizes()));
}

int64_t wrap_dim(const char* op, const char* arg, int64_t dim, int64_t ndim) {
  const int64_t lo = ndim > 0 ? -ndim : -1;
  const int64_t hi = ndim > 0 ? ndim - 1 : 0;
  OPENNPU_CHECK_ARG(dim >= lo && dim <= hi, op, arg, "must be in [", lo, ", ", hi,
                    "] for a tensor with ", ndim, " dims, but got ", dim);
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

void check_strict_dtype(const char* op, const char* arg, const at::Tensor& t,
                        std::initializer_list<c10::ScalarType> allowed) {
  bool ok = false;
  for (auto dtype : allowed) ok = ok || t.scalar_type() == dtype;
  OPENNPU_CHECK_STRICT(ok, op, arg, "must have dtype in {", dtype_list(allowed), "}, but got ",
                       t.scalar_type());
}

void check_strict_rank(const char* op, const char* arg, const at::Tensor& t, int64_t lo,
                       int64_t hi) {
  OPENNPU_CHECK_STRICT(t.dim() >= lo && t.dim() <= hi, op, arg, "must have ", lo, " to ", hi,
                       " dims, but got ", t.dim(), " (shape ", shape_str(t.sizes()), ")");
}

}  // namespace opennpu
