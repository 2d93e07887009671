// Entry points of the MX quantisers and npu_dynamic_block_quant: validation, output allocation,
// the scale layouts, CPU registration (numerics in mx_quant.h).
#include "ops/quant/mx_quant.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "common/checks.h"
#include "ops/quant/hifloat8.h"

namespace opennpu::quant {

KernelSlots<MxQuantFn> mx_quant;
KernelSlots<BlockQuantFn> block_quant;

namespace {

// dst_type codes: torch's ScalarType (torch.float8_e5m2 = 23, torch.float8_e4m3fn = 24,
// torch.float4_e2m1fn_x2 = 45) and torch_npu's DType (291 float8_e5m2, 292 float8_e4m3fn,
// 296 float4_e2m1fn_x2, 297 float4_e1m2, 290 hifloat8).
constexpr int64_t kE5m2 = 23, kE4m3 = 24, kFp4x2 = 45;
constexpr int64_t kNpuHif8 = 290, kNpuE5m2 = 291, kNpuE4m3 = 292, kNpuE2m1 = 296, kNpuE1m2 = 297;

struct MxType {
  MxFormat fmt;
  at::ScalarType dtype;  // of y: Float8_e4m3fn / Float8_e5m2, or Byte (two fp4 codes per byte)
  const char* name;
};

MxType parse_mx_type(const char* op, const char* arg, int64_t code, bool fp8_only) {
  if (code == kE4m3 || code == kNpuE4m3) {
    return {{3, 8, -6, 448.f, false, true, true}, at::kFloat8_e4m3fn, "float8_e4m3fn"};
  }
  if (code == kE5m2 || code == kNpuE5m2) {
    return {{2, 15, -14, 57344.f, false, true, false}, at::kFloat8_e5m2, "float8_e5m2"};
  }
  if (!fp8_only && (code == kNpuE2m1 || code == kFp4x2)) {
    return {{1, 2, 0, 6.f, true, false, false}, at::kByte, "float4_e2m1"};
  }
  if (!fp8_only && code == kNpuE1m2) {
    return {{2, 0, 0, 1.75f, true, false, false}, at::kByte, "float4_e1m2"};
  }
  OPENNPU_CHECK_ARG(false, op, arg, "must be ",
                    fp8_only ? "torch.float8_e5m2 (23 / 291) or torch.float8_e4m3fn (24 / 292)"
                             : "torch.float8_e5m2 (23 / 291), torch.float8_e4m3fn (24 / 292), "
                               "float4_e2m1 (296) or float4_e1m2 (297)",
                    ", but got ", code, code == kNpuHif8 ? " (hifloat8, not supported)" : "");
  return {};
}

MxRound parse_round(const char* op, std::string_view mode, const MxType& t) {
  if (mode == "rint") return MxRound::kRint;
  OPENNPU_CHECK_ARG(t.fmt.fp4 && (mode == "round" || mode == "floor"), op, "round_mode",
                    t.fmt.fp4 ? "must be \"rint\", \"round\" or \"floor\""
                              : "must be \"rint\" for float8 outputs",
                    ", but got \"", mode, "\"");
  return mode == "round" ? MxRound::kRound : MxRound::kFloor;
}

void check_mx_input(const char* op, const char* arg, const at::Tensor& x) {
  OPENNPU_CHECK_ARG(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                        x.scalar_type() == at::kBFloat16,
                    op, arg, "must be float16, bfloat16 or float32, but got ", x.scalar_type());
}

int64_t check_scale_alg(const char* op, std::optional<int64_t> scale_alg, const MxType& t) {
  const int64_t alg = scale_alg.value_or(0);
  OPENNPU_CHECK_ARG(alg == 0 || (alg == 1 && !t.fmt.fp4), op, "scale_alg",
                    "must be 0 (OCP) or, for float8 outputs, 1 (cuBLAS-style rounding up); "
                    "2 (Ascend950's float4 variant) is not supported by opennpu, but got ", alg,
                    " for ", t.name);
  return alg;
}

void check_dst_type_max(const char* op, double dst_type_max) {
  OPENNPU_CHECK_ARG(dst_type_max == 0.0, op, "dst_type_max",
                    "must be 0.0 (it applies only to scale_alg=2, which opennpu does not "
                    "support), but got ", dst_type_max);
}

// y (float8, or bytes of two fp4 codes) and mxscale for quantising x along `axis`.
std::tuple<at::Tensor, at::Tensor> mx_quantize(const char* op, const at::Tensor& input,
                                               int64_t axis, const MxType& t, MxRound round,
                                               int64_t bs, int64_t scale_alg, float low_bound) {
  const int64_t dim = input.dim();
  const int64_t d = input.size(axis);
  const int64_t pre = c10::multiply_integers(input.sizes().slice(0, axis));
  const int64_t post = c10::multiply_integers(input.sizes().slice(axis + 1));
  const int64_t pairs = ((d + bs - 1) / bs + 1) / 2;
  std::vector<int64_t> scale_shape(input.sizes().begin(), input.sizes().end());
  scale_shape[axis] = pairs;
  scale_shape.push_back(2);
  at::Tensor mxscale = at::zeros(scale_shape, input.options().dtype(at::kByte));
  std::vector<int64_t> y_shape(input.sizes().begin(), input.sizes().end());
  if (t.fmt.fp4) {
    OPENNPU_CHECK_ARG(dim >= 1 && y_shape.back() % 2 == 0, op, "input",
                      "must have an even last dim for ", t.name,
                      " outputs (two codes per byte), but got shape ", shape_str(input.sizes()));
    y_shape.back() /= 2;
  }
  at::Tensor y = at::empty(y_shape, input.options().dtype(t.dtype));
  if (input.numel() == 0) return {y, mxscale};
  const at::Tensor x = input.contiguous();
  mx_quant.get(op, x)(x, pre, d, post, bs, t.fmt, round, scale_alg, low_bound,
                       static_cast<uint8_t*>(y.data_ptr()), mxscale.mutable_data_ptr<uint8_t>());
  return {y, mxscale};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> npu_dynamic_mx_quant(
    const at::Tensor& input, int64_t axis, std::string_view round_mode, int64_t dst_type,
    int64_t block_size, std::optional<int64_t> scale_alg, double dst_type_max,
    double max_low_bound) {
  constexpr const char* op = "npu_dynamic_mx_quant";
  check_mx_input(op, "input", input);
  OPENNPU_CHECK_ARG(input.dim() >= 1, op, "input", "must have at least 1 dim, but got a 0-dim tensor");
  const int64_t ax = wrap_dim(op, "axis", axis, input.dim());
  const MxType t = parse_mx_type(op, "dst_type", dst_type, false);
  OPENNPU_CHECK_ARG(block_size > 0 && block_size % 32 == 0 && block_size <= 1024, op,
                    "block_size", "must be a multiple of 32 in [32, 1024], but got ", block_size);
  const int64_t alg = check_scale_alg(op, scale_alg, t);
  check_dst_type_max(op, dst_type_max);
  OPENNPU_CHECK_ARG(max_low_bound >= 0.0 && (max_low_bound == 0.0 || alg == 1), op,
                    "max_low_bound", "must be >= 0, and 0.0 unless scale_alg=1, but got ",
                    max_low_bound, " with scale_alg=", alg);
  return mx_quantize(op, input, ax, t, parse_round(op, round_mode, t), block_size, alg,
                     static_cast<float>(max_low_bound));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> npu_dynamic_mx_quant_with_dual_axis(
    const at::Tensor& input, std::string_view round_mode, int64_t dst_type, int64_t scale_alg,
    std::optional<double> dst_type_max) {
  constexpr const char* op = "npu_dynamic_mx_quant_with_dual_axis";
  check_mx_input(op, "input", input);
  OPENNPU_CHECK_ARG(input.dim() >= 2, op, "input", "must have at least 2 dims, but got shape ",
                    shape_str(input.sizes()));
  const MxType t = parse_mx_type(op, "dst_type", dst_type, false);
  const int64_t alg = check_scale_alg(op, scale_alg, t);
  check_dst_type_max(op, dst_type_max.value_or(0.0));
  const MxRound round = parse_round(op, round_mode, t);
  auto [y1, s1] = mx_quantize(op, input, input.dim() - 1, t, round, 32, alg, 0.f);
  auto [y2, s2] = mx_quantize(op, input, input.dim() - 2, t, round, 32, alg, 0.f);
  return {y1, s1, y2, s2};
}

std::tuple<at::Tensor, at::Tensor> npu_grouped_dynamic_mx_quant(
    const at::Tensor& x, const at::Tensor& group_index, std::string_view round_mode,
    int64_t dst_type, int64_t blocksize, std::optional<int64_t> scale_alg,
    std::optional<double> dst_type_max) {
  constexpr const char* op = "npu_grouped_dynamic_mx_quant";
  check_mx_input(op, "x", x);
  OPENNPU_CHECK_ARG(x.dim() == 2, op, "x", "must be 2-D [M, N], but got shape ",
                    shape_str(x.sizes()));
  check_same_device(op, "group_index", group_index, "x", x);
  OPENNPU_CHECK_ARG(group_index.scalar_type() == at::kInt || group_index.scalar_type() == at::kLong,
                    op, "group_index", "must be int32 (or int64), but got ",
                    group_index.scalar_type());
  OPENNPU_CHECK_ARG(group_index.dim() == 1 && group_index.numel() >= 1, op, "group_index",
                    "must be 1-D with at least one group, but got shape ",
                    shape_str(group_index.sizes()));
  const MxType t = parse_mx_type(op, "dst_type", dst_type, true);
  OPENNPU_CHECK_ARG(blocksize == 32, op, "blocksize", "must be 32, but got ", blocksize);
  const int64_t alg = check_scale_alg(op, scale_alg, t);
  check_dst_type_max(op, dst_type_max.value_or(0.0));
  const MxRound round = parse_round(op, round_mode, t);
  const int64_t m = x.size(0), n = x.size(1), groups = group_index.numel();
  const at::Tensor ends_t = group_index.to(at::kLong).contiguous();
  const int64_t* ends = ends_t.const_data_ptr<int64_t>();
  int64_t previous = 0;
  for (int64_t g = 0; g < groups; ++g) {
    OPENNPU_CHECK_ARG(ends[g] >= previous && ends[g] <= m, op, "group_index",
                      "must be non-decreasing row counts in [0, ", m,
                      "] (cumulative ends of each group's rows), but element ", g, " is ",
                      ends[g]);
    previous = ends[g];
  }
  OPENNPU_CHECK_ARG(previous == m, op, "group_index",
                    "must end at the number of rows of 'x' (", m, "), but its last element is ",
                    previous);
  // Group g's scale rows start at pair (ends[g-1] // 64 + g) (two blocks of 32 rows per pair):
  // ceil(rows / 32) real blocks, one padding block of code 0 to make them even, then pairs of
  // code 127 (scale 1) up to the next group's start.
  const int64_t total_pairs = m / 64 + groups;
  at::Tensor mxscale = at::empty({total_pairs, n, 2}, x.options().dtype(at::kByte));
  at::Tensor y = at::empty({m, n}, x.options().dtype(t.dtype));
  const at::Tensor xc = x.contiguous();
  uint8_t* ps = mxscale.mutable_data_ptr<uint8_t>();
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first_pair = start / 64 + g, next_pair = ends[g] / 64 + g + 1;
    const int64_t rows = ends[g] - start;
    const int64_t pairs = ((rows + 31) / 32 + 1) / 2;
    std::fill(ps + first_pair * n * 2, ps + (first_pair + pairs) * n * 2, uint8_t{0});
    std::fill(ps + (first_pair + pairs) * n * 2, ps + next_pair * n * 2, uint8_t{127});
    if (rows > 0 && n > 0) {
      mx_quant.get(op, xc)(xc.narrow(0, start, rows), 1, rows, n, 32, t.fmt, round, alg, 0.f,
                           static_cast<uint8_t*>(y.data_ptr()) + start * n,
                           ps + first_pair * n * 2);
    }
    start = ends[g];
  }
  return {y, mxscale};
}

std::tuple<at::Tensor, at::Tensor> npu_dynamic_block_quant(
    const at::Tensor& x, double min_scale, std::string_view round_mode, int64_t dst_type,
    int64_t row_block_size, int64_t col_block_size, double dst_type_max) {
  constexpr const char* op = "npu_dynamic_block_quant";
  check_mx_input(op, "x", x);
  OPENNPU_CHECK_ARG(x.dim() == 2 || x.dim() == 3, op, "x", "must be 2-D or 3-D, but got shape ",
                    shape_str(x.sizes()));
  OPENNPU_CHECK_ARG(min_scale >= 0.0, op, "min_scale", "must be >= 0, but got ", min_scale);
  OPENNPU_CHECK_ARG(row_block_size >= 1 && col_block_size >= 1, op,
                    row_block_size < 1 ? "row_block_size" : "col_block_size",
                    "must be >= 1, but got ", row_block_size < 1 ? row_block_size : col_block_size);
  int fp8 = 0;
  float qmax = 127.f;
  at::ScalarType y_dtype = at::kChar;
  if (dst_type == kE4m3 || dst_type == kNpuE4m3) {
    fp8 = 1, qmax = 448.f, y_dtype = at::kFloat8_e4m3fn;
  } else if (dst_type == kE5m2 || dst_type == kNpuE5m2) {
    fp8 = 2, qmax = 57344.f, y_dtype = at::kFloat8_e5m2;
  } else if (dst_type == kNpuHif8) {  // HiF8_MAX = 32768 (op-plugin's doc); uint8 codes
    fp8 = 3, qmax = kHif8Max, y_dtype = at::kByte;
  } else {
    OPENNPU_CHECK_ARG(dst_type == static_cast<int64_t>(at::kChar), op, "dst_type",
                      "must be 1 (torch.int8), torch.float8_e4m3fn (24 / 292), "
                      "torch.float8_e5m2 (23 / 291) or torch_npu.hifloat8 (290), but got ",
                      dst_type);
  }
  // hifloat8 is cast with "round" (half away from zero; Ascend's "hybrid" mode is not
  // implemented), int8 / float8 with "rint" (half to even).
  if (fp8 == 3) {
    OPENNPU_CHECK_ARG(round_mode == "round", op, "round_mode",
                      "must be \"round\" for hifloat8 outputs (\"hybrid\" is not supported by "
                      "opennpu), but got \"", round_mode, "\"");
  } else {
    OPENNPU_CHECK_ARG(round_mode == "rint", op, "round_mode",
                      "must be \"rint\" for int8 / float8 outputs (\"round\" is hifloat8's), "
                      "but got \"", round_mode, "\"");
  }
  OPENNPU_CHECK_ARG(dst_type_max == 0.0 || (dst_type_max > 0.0 && dst_type_max <= qmax), op,
                    "dst_type_max", "must be 0 (use ", qmax, ") or in (0, ", qmax, "], but got ",
                    dst_type_max);
  if (dst_type_max != 0.0) qmax = static_cast<float>(dst_type_max);
  const bool three = x.dim() == 3;
  const at::Tensor x3 = (three ? x : x.unsqueeze(0)).contiguous();
  const int64_t rows = x3.size(1), cols = x3.size(2);
  const int64_t srows = (rows + row_block_size - 1) / row_block_size;
  const int64_t scols = (cols + col_block_size - 1) / col_block_size;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(y_dtype));
  at::Tensor scale = at::empty({x3.size(0), srows, scols}, x.options().dtype(at::kFloat));
  if (x.numel() > 0) {
    at::Tensor y3 = three ? y : y.unsqueeze(0);
    block_quant.get(op, x3)(x3, row_block_size, col_block_size, qmax,
                            static_cast<float>(min_scale), fp8, y3, scale);
  }
  return {y, three ? scale : scale.squeeze(0)};
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_dynamic_mx_quant", &npu_dynamic_mx_quant);
  m.impl("npu_dynamic_mx_quant_with_dual_axis", &npu_dynamic_mx_quant_with_dual_axis);
  m.impl("npu_grouped_dynamic_mx_quant", &npu_grouped_dynamic_mx_quant);
  m.impl("npu_dynamic_block_quant", &npu_dynamic_block_quant);
}

}  // namespace opennpu::quant
