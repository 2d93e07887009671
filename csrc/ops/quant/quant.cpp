// Entry points of the quantisation family: validation, output allocation, CPU registration.
#include "ops/quant/quant.h"

#include <ATen/Parallel.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <string_view>

#include "common/checks.h"
#include "ops/quant/hifloat8.h"

namespace opennpu::quant {

KernelSlots<DynamicQuantFn> dynamic_quant;
KernelSlots<AddRmsNormDynamicQuantFn> add_rms_norm_dynamic_quant;
KernelSlots<QuantizeFn> quantize;

namespace {

// The `int?` dtype codes torch.ops passes for torch.int8, torch.quint4x2 and torch.int4.
constexpr int64_t kInt8Code = static_cast<int64_t>(at::kChar);
constexpr int64_t kQuint4x2Code = static_cast<int64_t>(at::kQUInt4x2);
constexpr int64_t kInt4Code = static_cast<int64_t>(c10::ScalarType::Int4);

// int8 unless `dtype` names a 4-bit type (quint4x2, or torch.int4): then int4 packed in int32.
bool parse_int4(const char* op, const char* arg, std::optional<int64_t> dtype) {
  if (!dtype.has_value() || *dtype == kInt8Code) return false;
  if (*dtype == kQuint4x2Code || *dtype == kInt4Code) return true;
  const bool known = *dtype >= 0 && *dtype < static_cast<int64_t>(c10::ScalarType::NumOptions);
  OPENNPU_CHECK_ARG(false, op, arg,
                    "must be None, torch.int8, torch.quint4x2 (int4 packed eight per int32) or "
                    "(npu_dynamic_quant) torch.float8_e4m3fn / torch.float8_e5m2 (or torch_npu's "
                    "292 / 291) / torch_npu.hifloat8 (290), but got ",
                    known ? c10::toString(static_cast<c10::ScalarType>(*dtype)) : "dtype code ",
                    known ? "" : std::to_string(*dtype));
  return false;
}

// npu_dynamic_quant's float outputs: dst_type torch.float8_e4m3fn (24, or torch_npu's 292) ->
// kFp8E4m3, torch.float8_e5m2 (23 / 291) -> kFp8E5m2, torch_npu.hifloat8 (290) -> kFp8Hif8,
// anything else 0.
int parse_fp8(std::optional<int64_t> dtype) {
  if (!dtype.has_value()) return 0;
  if (*dtype == static_cast<int64_t>(at::kFloat8_e4m3fn) || *dtype == 292) return kFp8E4m3;
  if (*dtype == static_cast<int64_t>(at::kFloat8_e5m2) || *dtype == 291) return kFp8E5m2;
  if (*dtype == kHif8DtypeCode) return kFp8Hif8;
  return 0;
}

QuantSpec make_spec(bool int4, double dst_type_max) {
  const float code_max = int4 ? 7.f : 127.f;
  return QuantSpec{dst_type_max != 0.0 ? static_cast<float>(dst_type_max) : code_max,
                   int4 ? -8.f : -128.f, code_max, int4};
}

void check_int4_width(const char* op, const char* x_name, const at::Tensor& x, bool int4,
                      const char* dtype_arg) {
  if (!int4) return;
  const int64_t n = x.dim() > 0 ? x.size(-1) : 1;
  OPENNPU_CHECK_ARG(n % 8 == 0, op, x_name, "must have a last dim divisible by 8 for int4 output (",
                    dtype_arg, "=torch.quint4x2), but got shape ", shape_str(x.sizes()));
}

// A 1-D float vector of length n (gamma, beta, smooth scales), as contiguous float32.
at::Tensor check_row_vector(const char* op, const char* arg, const at::Tensor& t,
                            const char* x_name, const at::Tensor& x, int64_t n) {
  check_floating(op, arg, t);
  check_same_device(op, arg, t, x_name, x);
  OPENNPU_CHECK_ARG(t.dim() == 1 && t.size(0) == n, op, arg, "must have shape [", n,
                    "] (the last dim of '", x_name, "'), but got ", shape_str(t.sizes()));
  OPENNPU_CHECK_STRICT(t.scalar_type() == x.scalar_type(), op, arg, "must have the dtype of '",
                       x_name, "' (", x.scalar_type(), "), but got ", t.scalar_type());
  return t.to(at::kFloat).contiguous();
}

// Output shape of the codes: x's shape, with the last dim / 8 for int4 (int32 words).
std::vector<int64_t> code_shape(const at::Tensor& x, bool int4) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  if (int4 && !shape.empty()) shape.back() /= 8;
  return shape;
}

std::vector<int64_t> leading_shape(const at::Tensor& x) {
  return std::vector<int64_t>(x.sizes().begin(), x.sizes().end() - (x.dim() > 0 ? 1 : 0));
}

at::Tensor as_kernel_input(const at::Tensor& t) {
  return (t.scalar_type() == at::kDouble ? t.to(at::kFloat) : t).contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> npu_dynamic_quant(
    const at::Tensor& input, const std::optional<at::Tensor>& smooth_scales,
    const std::optional<at::Tensor>& group_index, std::optional<int64_t> dst_type,
    std::string_view quant_mode, double dst_type_max) {
  constexpr const char* op = "npu_dynamic_quant";
  check_floating(op, "input", input);
  OPENNPU_CHECK_ARG(input.dim() >= 1, op, "input", "must have at least 1 dim, but got a 0-dim tensor");
  check_strict_dtype(op, "input", input, {at::kHalf, at::kBFloat16});
  check_strict_rank(op, "input", input, 2, 8);
  const int fp8 = parse_fp8(dst_type);
  const bool int4 = fp8 == 0 && parse_int4(op, "dst_type", dst_type);
  check_int4_width(op, "input", input, int4, "dst_type");
  OPENNPU_CHECK_ARG(quant_mode == "pertoken" || quant_mode == "pertensor", op, "quant_mode",
                    "must be \"pertoken\" or \"pertensor\" (\"perchannel\" is not supported by "
                    "opennpu yet), but got \"", quant_mode, "\"");
  const bool per_tensor = quant_mode == "pertensor";
  // DTYPE_MAX: hifloat8's is 2^15 = 32768 (op-plugin's npu_dynamic_block_quant and
  // npu_grouped_dynamic_block_quant docs; CANN accepts dst_type_max in [0, 32768] for it).
  const float code_max = fp8 == kFp8E4m3   ? 448.f
                         : fp8 == kFp8E5m2 ? 57344.f
                         : fp8 == kFp8Hif8 ? kHif8Max
                         : int4            ? 7.f
                                           : 127.f;
  OPENNPU_CHECK_ARG(dst_type_max == 0.0 || (dst_type_max > 0.0 && dst_type_max <= code_max), op,
                    "dst_type_max", "must be 0 (use ", code_max, ", the output type's maximum) or in (0, ",
                    code_max, "], but got ", dst_type_max);

  const int64_t n = input.size(-1);
  const int64_t rows = c10::multiply_integers(input.sizes().slice(0, input.dim() - 1));
  at::Tensor smooth, group_ends;
  if (group_index.has_value()) {
    const at::Tensor& gi = *group_index;
    OPENNPU_CHECK_ARG(smooth_scales.has_value(), op, "group_index",
                      "needs smooth_scales ([groups, ", n, "]), but smooth_scales is None");
    OPENNPU_CHECK_ARG(!per_tensor, op, "group_index",
                      "works only with quant_mode=\"pertoken\", but quant_mode is \"", quant_mode,
                      "\"");
    OPENNPU_CHECK_ARG(gi.scalar_type() == at::kInt || gi.scalar_type() == at::kLong, op,
                      "group_index", "must be int32 (or int64), but got ", gi.scalar_type());
    OPENNPU_CHECK_STRICT(gi.scalar_type() == at::kInt, op, "group_index",
                         "must be int32, but got ", gi.scalar_type());
    check_same_device(op, "group_index", gi, "input", input);
    OPENNPU_CHECK_ARG(gi.dim() == 1 && gi.numel() >= 1, op, "group_index",
                      "must be 1-D with at least one group, but got shape ", shape_str(gi.sizes()));
    const at::Tensor& sm = *smooth_scales;
    check_floating(op, "smooth_scales", sm);
    check_same_device(op, "smooth_scales", sm, "input", input);
    OPENNPU_CHECK_ARG(sm.dim() == 2 && sm.size(0) == gi.numel() && sm.size(1) == n, op,
                      "smooth_scales", "must have shape [", gi.numel(), ", ", n,
                      "] ([len(group_index), last dim of 'input']) with group_index, but got ",
                      shape_str(sm.sizes()));
    OPENNPU_CHECK_STRICT(sm.size(0) <= 1024, op, "smooth_scales",
                         "must have at most 1024 groups, but got ", sm.size(0));
    OPENNPU_CHECK_STRICT(sm.scalar_type() == input.scalar_type(), op, "smooth_scales",
                         "must have the dtype of 'input' (", input.scalar_type(), "), but got ",
                         sm.scalar_type());
    group_ends = gi.to(at::kLong).contiguous();
    // The group ends decide which rows each smooth row scales: checked on the host (a copy,
    // and a wait for it, where they live on a GPU), used by the kernel where they are.
    const at::Tensor host_ends = group_ends.is_cuda() ? group_ends.cpu() : group_ends;
    const int64_t* ends = host_ends.const_data_ptr<int64_t>();
    int64_t previous = 0;
    for (int64_t g = 0; g < group_ends.numel(); ++g) {
      OPENNPU_CHECK_ARG(ends[g] >= previous && ends[g] <= rows, op, "group_index",
                        "must be non-decreasing row counts in [0, ", rows,
                        "] (cumulative ends of each group's rows), but element ", g, " is ",
                        ends[g], previous > 0 ? " after " : "", previous > 0 ? std::to_string(previous) : "");
      previous = ends[g];
    }
    OPENNPU_CHECK_ARG(previous == rows, op, "group_index",
                      "must end at the number of rows of 'input' (", rows,
                      "), so that every row has a group, but its last element is ", previous);
    smooth = sm.to(at::kFloat).contiguous();
  } else if (smooth_scales.has_value()) {
    smooth = check_row_vector(op, "smooth_scales", *smooth_scales, "input", input, n);
  }

  const at::Tensor x = as_kernel_input(input);
  // hifloat8 codes are uint8 bytes, as torch_npu returns them (torch has no hifloat8 dtype).
  const auto y_dtype = fp8 == kFp8E4m3   ? at::kFloat8_e4m3fn
                       : fp8 == kFp8E5m2 ? at::kFloat8_e5m2
                       : fp8 == kFp8Hif8 ? at::kByte
                       : int4            ? at::kInt
                                         : at::kChar;
  at::Tensor y = at::empty(code_shape(input, int4), input.options().dtype(y_dtype));
  at::Tensor scale = per_tensor ? at::empty({1}, input.options().dtype(at::kFloat))
                                : at::empty(leading_shape(input), input.options().dtype(at::kFloat));
  if (rows == 0) {
    if (per_tensor) scale.fill_(1.0);
    return {y, scale};
  }
  if (n == 0) {  // nothing to quantise: every (empty) row's max is 0, its scale 1
    scale.fill_(1.0);
    return {y, scale};
  }
  QuantSpec spec = make_spec(int4, dst_type_max);
  if (fp8 != 0) {
    spec.fp8 = fp8;
    spec.qmax = dst_type_max != 0.0 ? static_cast<float>(dst_type_max) : code_max;
    spec.lo = -code_max;
    spec.hi = code_max;
  }
  dynamic_quant.get(op, x)(x.view({rows, n}), smooth, group_ends, per_tensor, spec, y, scale);
  return {y, scale};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
npu_add_rms_norm_dynamic_quant(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& gamma,
                               const std::optional<at::Tensor>& smooth_scale1,
                               const std::optional<at::Tensor>& smooth_scale2,
                               const std::optional<at::Tensor>& beta, double epsilon,
                               std::optional<std::array<bool, 2>> output_mask,
                               std::optional<int64_t> y_dtype) {
  constexpr const char* op = "npu_add_rms_norm_dynamic_quant";
  check_floating(op, "x1", x1);
  check_floating(op, "x2", x2);
  check_same_device(op, "x2", x2, "x1", x1);
  OPENNPU_CHECK_ARG(x1.dim() >= 1, op, "x1", "must have at least 1 dim, but got a 0-dim tensor");
  OPENNPU_CHECK_ARG(x2.scalar_type() == x1.scalar_type(), op, "x2",
                    "must have the dtype of 'x1' (", x1.scalar_type(), "), but got ",
                    x2.scalar_type());
  OPENNPU_CHECK_ARG(x2.sizes().equals(x1.sizes()), op, "x2", "must have the shape of 'x1' (",
                    shape_str(x1.sizes()), "), but got ", shape_str(x2.sizes()));
  check_strict_dtype(op, "x1", x1, {at::kHalf, at::kBFloat16});
  check_strict_rank(op, "x1", x1, 2, 8);
  OPENNPU_CHECK_STRICT(x1.numel() > 0, op, "x1", "must not be empty, but got shape ",
                       shape_str(x1.sizes()));
  OPENNPU_CHECK_ARG(epsilon >= 0, op, "epsilon", "must be >= 0, but got ", epsilon);
  const int64_t n = x1.size(-1);
  const at::Tensor g = check_row_vector(op, "gamma", gamma, "x1", x1, n);
  const at::Tensor b = beta.has_value() ? check_row_vector(op, "beta", *beta, "x1", x1, n)
                                        : at::Tensor();
  const at::Tensor s1 = smooth_scale1.has_value()
                            ? check_row_vector(op, "smooth_scale1", *smooth_scale1, "x1", x1, n)
                            : at::Tensor();
  const at::Tensor s2 = smooth_scale2.has_value()
                            ? check_row_vector(op, "smooth_scale2", *smooth_scale2, "x1", x1, n)
                            : at::Tensor();
  // Which branches run: output_mask when given; otherwise branch 1, and branch 2 only when both
  // smooth scales are given (torch_npu's rule).
  bool branch1 = true, branch2 = s1.defined() && s2.defined();
  if (output_mask.has_value()) {
    branch1 = (*output_mask)[0];
    branch2 = (*output_mask)[1];
    OPENNPU_CHECK_ARG(branch1 || branch2, op, "output_mask",
                      "must enable at least one branch, but got [False, False]");
    OPENNPU_CHECK_ARG(branch1 || !s1.defined(), op, "output_mask",
                      "must be True at index 0 when smooth_scale1 is given, but got [False, ",
                      branch2 ? "True" : "False", "]");
    OPENNPU_CHECK_ARG(branch2 || !s2.defined(), op, "output_mask",
                      "must be True at index 1 when smooth_scale2 is given, but got [",
                      branch1 ? "True" : "False", ", False]");
  }
  const bool int4 = parse_int4(op, "y_dtype", y_dtype);
  check_int4_width(op, "x1", x1, int4, "y_dtype");

  const auto code_dtype = int4 ? at::kInt : at::kChar;
  const auto f32 = x1.options().dtype(at::kFloat);
  // A disabled branch returns 0-dim tensors (one element, zero), as torch_npu does.
  auto codes = [&](bool on) {
    return on ? at::empty(code_shape(x1, int4), x1.options().dtype(code_dtype))
              : at::zeros(c10::IntArrayRef{}, x1.options().dtype(code_dtype));
  };
  auto scales = [&](bool on) {
    return on ? at::empty(leading_shape(x1), f32) : at::zeros(c10::IntArrayRef{}, f32);
  };
  at::Tensor y1 = codes(branch1), y2 = codes(branch2);
  at::Tensor scale1 = scales(branch1), scale2 = scales(branch2);
  at::Tensor x_out = at::empty(x1.sizes(), x1.options());
  if (x1.numel() == 0) {
    if (n == 0) {  // rows with nothing in them: scale 1, as for an all-zero row
      if (branch1) scale1.fill_(1.0);
      if (branch2) scale2.fill_(1.0);
    }
    return {y1, y2, x_out, scale1, scale2};
  }
  const at::Tensor a = as_kernel_input(x1), c = as_kernel_input(x2);
  at::Tensor x_kernel = x1.scalar_type() == at::kDouble ? at::empty(a.sizes(), a.options()) : x_out;
  add_rms_norm_dynamic_quant.get(op, a)(a, c, g, b, s1, s2, epsilon, branch1, branch2,
                                         make_spec(int4, 0.0), y1, y2, x_kernel, scale1, scale2);
  if (x1.scalar_type() == at::kDouble) at::add_out(x_out, x1, x2);  // the exact fp64 sum
  return {y1, y2, x_out, scale1, scale2};
}


namespace {

// npu_quantize's `dtype` code -> the output. div_mode (aclnnQuantize): qint8 / quint8 / qint32 or
// int8 / uint8 / int32 give codes of those widths; otherwise (AscendQuantV2): qint8 / int8, or
// quint4x2 / torch.int4 for int4 packed eight per int32. Either mode: torch_npu.hifloat8 (290),
// uint8 bytes.
QuantizeOut parse_quantize_dtype(int64_t dtype, bool div_mode) {
  constexpr const char* op = "npu_quantize";
  if (dtype == kHif8DtypeCode) return QuantizeOut::kHif8;
  const auto is = [&](c10::ScalarType t) { return dtype == static_cast<int64_t>(t); };
  if (is(at::kQInt8) || is(at::kChar)) return QuantizeOut::kInt8;
  if (div_mode && (is(at::kQUInt8) || is(at::kByte))) return QuantizeOut::kUInt8;
  if (div_mode && (is(at::kQInt32) || is(at::kInt))) return QuantizeOut::kInt32;
  if (!div_mode && (is(at::kQUInt4x2) || is(c10::ScalarType::Int4))) return QuantizeOut::kInt4;
  const bool known = dtype >= 0 && dtype < static_cast<int64_t>(c10::ScalarType::NumOptions);
  OPENNPU_CHECK_ARG(false, op, "dtype",
                    div_mode ? "must be torch.qint8, torch.quint8 or torch.qint32 (or torch.int8 / "
                               "torch.uint8 / torch.int32) with div_mode=True"
                             : "must be torch.qint8 (or torch.int8) or torch.quint4x2 (int4 packed "
                               "eight per int32) with div_mode=False",
                    ", or torch_npu.hifloat8 (290); float8 outputs are not supported by opennpu, "
                    "but got ",
                    known ? c10::toString(static_cast<c10::ScalarType>(dtype)) : "dtype code ",
                    known ? "" : std::to_string(dtype));
  return QuantizeOut::kInt8;
}

// scales / zero_points as float32 [n] for the quantised axis of size `size` (n == size, or 1 for
// one value over the whole tensor). `expect` describes the accepted shapes for the message.
at::Tensor quantize_param(const char* arg, const at::Tensor& t, const at::Tensor& x, bool ok,
                          const std::string& expect) {
  constexpr const char* op = "npu_quantize";
  check_same_device(op, arg, t, "self", x);
  OPENNPU_CHECK_ARG(ok, op, arg, "must be ", expect, ", but got shape ", shape_str(t.sizes()));
  return t.to(at::kFloat).contiguous().view({t.numel()});
}

}  // namespace

at::Tensor npu_quantize(const at::Tensor& self, const at::Tensor& scales,
                        const std::optional<at::Tensor>& zero_points, int64_t dtype, int64_t axis,
                        bool div_mode) {
  constexpr const char* op = "npu_quantize";
  check_floating(op, "self", self);
  OPENNPU_CHECK_ARG(self.dim() >= 1, op, "self", "must have at least 1 dim (the quantised axis), "
                    "but got a 0-dim tensor");
  check_strict_dtype(op, "self", self, {at::kFloat, at::kHalf, at::kBFloat16});
  const QuantizeOut out = parse_quantize_dtype(dtype, div_mode);
  const int64_t ndim = self.dim();
  // The quantised axis: any dim with div_mode; otherwise -2 or, for every axis above -2, the
  // last (AscendQuantV3's rule).
  int64_t ax;
  if (div_mode) {
    ax = wrap_dim(op, "axis", axis, ndim);
  } else {
    OPENNPU_CHECK_ARG(axis >= -2 && axis < std::max<int64_t>(ndim, 2) && (axis != -2 || ndim >= 2),
                      op, "axis", "must be -2 (the second-to-last dim, for an input of at least 2 "
                      "dims) or in [-1, ", std::max<int64_t>(ndim, 2) - 1, "] (the last dim) with "
                      "div_mode=False for an input of ", ndim, " dims, but got ", axis);
    ax = axis == -2 ? ndim - 2 : ndim - 1;
  }
  const int64_t size = self.size(ax);

  check_floating(op, "scales", scales);
  std::string expect;
  bool ok;
  // [size] or [1]; without div_mode also a shape that broadcasts against x's (aligned at the
  // right, at most x's rank) with 1 in every dim but the quantised one.
  const auto per_axis = [&](const at::Tensor& t) {
    if (t.dim() == 1) return t.size(0) == size || t.size(0) == 1;
    if (div_mode || t.dim() == 0 || t.dim() > ndim) return false;
    for (int64_t d = 0; d < t.dim(); ++d) {
      const int64_t xd = ndim - t.dim() + d;
      if (t.size(d) != 1 && !(xd == ax && t.size(d) == size)) return false;
    }
    return true;
  };
  expect = "1-D [" + std::to_string(size) + "] (dim " + std::to_string(ax) + " of 'self') or [1]" +
           (div_mode ? "" : ", or broadcastable to 'self' with 1 in every dim but dim " +
                                std::to_string(ax));
  ok = per_axis(scales);
  at::Tensor s = quantize_param("scales", scales, self, ok, expect);
  at::Tensor z;
  if (zero_points.has_value()) {
    const at::Tensor& zp = *zero_points;
    const at::ScalarType zt = zp.scalar_type();
    OPENNPU_CHECK_ARG(zt == at::kChar || zt == at::kByte || zt == at::kInt || zt == at::kLong ||
                          (at::isFloatingType(zt) && !at::isFloat8Type(zt)),
                      op, "zero_points", "must be int8, uint8, int32 or a float16 / bfloat16 / "
                      "float32 tensor, but got ", zt);
    if (div_mode) {
      check_strict_dtype(op, "zero_points", zp, {at::kChar, at::kByte, at::kInt, at::kBFloat16});
    } else {
      OPENNPU_CHECK_STRICT(zt == scales.scalar_type(), op, "zero_points",
                           "must have the dtype of 'scales' (", scales.scalar_type(),
                           ") with div_mode=False, but got ", zt);
    }
    z = quantize_param("zero_points", zp, self, per_axis(zp) && zp.numel() == scales.numel(),
                       expect + ", with as many elements as 'scales' (" +
                           std::to_string(scales.numel()) + ")");
  }
  if (!div_mode) {
    OPENNPU_CHECK_STRICT(scales.scalar_type() == self.scalar_type(), op, "scales",
                         "must have the dtype of 'self' (", self.scalar_type(),
                         ") with div_mode=False, but got ", scales.scalar_type());
  }

  std::vector<int64_t> shape(self.sizes().begin(), self.sizes().end());
  if (out == QuantizeOut::kInt4) {
    OPENNPU_CHECK_ARG(shape.back() % 8 == 0, op, "self", "must have a last dim divisible by 8 "
                      "for dtype=torch.quint4x2 (eight int4 codes per int32), but got shape ",
                      shape_str(self.sizes()));
    shape.back() /= 8;
  }
  const at::ScalarType y_dtype = out == QuantizeOut::kInt8                                ? at::kChar
                                 : out == QuantizeOut::kUInt8 || out == QuantizeOut::kHif8 ? at::kByte
                                                                                          : at::kInt;
  at::Tensor y = at::empty(shape, self.options().dtype(y_dtype));
  if (self.numel() == 0) return y;
  const at::Tensor x = as_kernel_input(self);
  // One scale for every element: the rows of the last dim as `outer` (the kernel splits outer x
  // channels over threads), each one span with the same factor and zero point.
  const bool one = s.numel() == 1;
  const int64_t outer = one ? self.numel() / self.size(-1)
                            : c10::multiply_integers(self.sizes().slice(0, ax));
  const int64_t channels = one ? 1 : size;
  const int64_t inner = one ? self.size(-1) : c10::multiply_integers(self.sizes().slice(ax + 1));
  quantize.get(op, self)(x.view({outer, channels, inner}), s, z, div_mode, out, y);
  return y;
}

at::Tensor to_hifloat8(const at::Tensor& x) {
  TORCH_INTERNAL_ASSERT(x.scalar_type() == at::kFloat && !x.is_cuda());
  const at::Tensor c = x.contiguous();
  at::Tensor y = at::empty(c.sizes(), c.options().dtype(at::kByte));
  const float* px = c.const_data_ptr<float>();
  uint8_t* py = y.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, c.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) py[i] = float_to_hifloat8_table(px[i]);
  });
  return y;
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_dynamic_quant", &npu_dynamic_quant);
  m.impl("npu_add_rms_norm_dynamic_quant", &npu_add_rms_norm_dynamic_quant);
  m.impl("npu_quantize", &npu_quantize);
}

}  // namespace opennpu::quant
