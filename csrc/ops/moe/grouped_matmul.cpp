// Entry points of npu_grouped_matmul (group_list as a Tensor) and npu_grouped_matmul.List
// (group_list as int[]): validation, the grouping, output allocation, CPU registration.
//
// What the arguments mean (torch_npu's "x / weight / y" scenarios; G = the number of groups, the
// length of `weight`, or E for one 3-D weight [E, K, N]):
//   - x holds G tensors: group g is x[g] @ w[g]. x[g] may have any rank >= 2 with a list output
//     (its leading dims are kept); with a group_list, its group sizes must equal the rows of x[g].
//   - x holds one 2-D tensor [M, K] and a group_list is given (group_type 0): group g is the g-th
//     row range of x that group_list cuts (cumulative ends with group_list_type 0, sizes with 1).
// split_item 0 / 1: one output per group (per x tensor); 2 / 3: one output, the groups' rows one
// after another ([sum of rows, N], every group with the same N; rows of x past the last group
// are 0).
// bias: one [N_g] tensor per weight, or one [E, N] tensor with a 3-D weight; x's dtype or float32,
// added in float32 before the output is rounded (A8W8: int32 into the accumulator, or float after
// the dequantisation).
// The path follows x's and weight's dtypes: float (both floating), A8W8 (int8 x and weights),
// A8W4 (int8 x, int4 weights), weight-only (float16 / bfloat16 x, int8 / int4 weights) or float8
// / MX (float8 / float4 codes: their dtypes, or bytes that x_dtype / weight_dtype name so); see
// grouped_matmul.h.
#include "ops/moe/grouped_matmul.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/relu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "ops/quant/quant_matmul.h"

namespace opennpu::moe {

KernelSlots<GroupedGemmFn> grouped_gemm;
KernelSlots<GroupedGemmPlanFn> grouped_gemm_plan;
KernelSlots<AntiquantWeightFn> antiquant_weight;

namespace {

constexpr const char* kOp = "npu_grouped_matmul";

std::string list_arg(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

using OptionalList = std::optional<at::TensorList>;

at::TensorList given(const OptionalList& list) {
  return list.has_value() ? *list : at::TensorList();
}

// The quantised arguments of a call (absent lists are empty).
struct QuantLists {
  at::TensorList scale, offset, antiquant_scale, antiquant_offset, per_token_scale;
  at::TensorList activation_input, activation_quant_scale, activation_quant_offset;
};

QuantLists quant_lists(const OptionalList& scale, const OptionalList& offset,
                       const OptionalList& antiquant_scale, const OptionalList& antiquant_offset,
                       const OptionalList& per_token_scale, const OptionalList& activation_input,
                       const OptionalList& activation_quant_scale,
                       const OptionalList& activation_quant_offset) {
  return {given(scale), given(offset), given(antiquant_scale), given(antiquant_offset),
          given(per_token_scale), given(activation_input), given(activation_quant_scale),
          given(activation_quant_offset)};
}

// Which computation the dtypes of x and weight ask for.
enum class Path { kFloat, kA8W8, kA8W4, kAntiquant, kFloatCodes };

// The element formats of float8 / float4 x and weights (their dtypes, or x_dtype / weight_dtype
// reinterpreting bytes), and the dtype arguments of their scales; x and w are nullopt on the
// other paths.
struct FloatTypes {
  std::optional<quant::FloatCode> x, w;
  std::optional<int64_t> scale_dtype, per_token_scale_dtype;
};

FloatTypes float_types(at::TensorList x, at::TensorList weight, std::optional<int64_t> x_dtype,
                       std::optional<int64_t> weight_dtype) {
  FloatTypes ft;
  if (!x.empty() && x[0].defined()) {
    ft.x = quant::float_code(kOp, "x[0]", "x_dtype", x[0], x_dtype);
  }
  if (!weight.empty() && weight[0].defined()) {
    ft.w = quant::float_code(kOp, "weight[0]", "weight_dtype", weight[0], weight_dtype);
  }
  OPENNPU_CHECK_ARG(ft.x != quant::FloatCode::kHif8 && ft.w != quant::FloatCode::kHif8, kOp,
                    ft.x == quant::FloatCode::kHif8 ? "x_dtype" : "weight_dtype",
                    "must not be torch_npu.hifloat8 (290): hifloat8 x / weights are not "
                    "supported by opennpu's npu_grouped_matmul (npu_quant_matmul reads them)");
  return ft;
}

const char* path_name(Path path) {
  switch (path) {
    case Path::kA8W8: return "the A8W8 path (int8 x and weights)";
    case Path::kA8W4: return "the A8W4 path (int8 x, int4 weights)";
    case Path::kAntiquant: return "the weight-only path (float16 / bfloat16 x, int8 / int4 weights)";
    case Path::kFloatCodes: return "the float8 / MX path (float8 / float4 x and weights)";
    default: return "the non-quantised path (floating x and weights)";
  }
}

// A list argument the path does not take must be absent.
void check_absent(const char* name, at::TensorList list, Path path, const char* what) {
  OPENNPU_CHECK_ARG(list.empty(), kOp, name, "must be None on ", path_name(path), ": ", what,
                    ", but got a list of ", list.size(), " tensors");
}

// The dtype codes of the Tensor overload (int?: a torch.dtype passed from Python arrives as its
// ScalarType number; torch_npu's own codes for packed types such as float4_e2m1fn_x2 or
// float8_e8m0fnu lie past ATen's ScalarTypes).
std::optional<at::ScalarType> dtype_from_code(const char* name, std::optional<int64_t> code) {
  if (!code.has_value()) return std::nullopt;
  const int64_t c = *code;
  OPENNPU_CHECK_ARG(c >= 0 && c < static_cast<int64_t>(at::ScalarType::NumOptions), kOp, name,
                    "must be None or a torch dtype; the code ", c, " is not one of PyTorch's "
                    "dtypes (of torch_npu's own codes opennpu reads float8_e5m2 291, "
                    "float8_e4m3fn 292, float4_e2m1fn_x2 296 and float4_e1m2fn_x2 297 as "
                    "x_dtype / weight_dtype, with byte tensors, and float8_e8m0fnu 293 as "
                    "scale_dtype / per_token_scale_dtype; other types such as hifloat8 are not "
                    "supported)");
  return static_cast<at::ScalarType>(c);
}

// x_dtype / weight_dtype / scale_dtype / per_token_scale_dtype name the dtype the Ascend kernel
// reads a tensor list as: accepted when None or a name of the tensors' own dtype (int32 weights:
// also torch.quint4x2 / torch.int4, the int4 codes they pack; int64 scales: also torch.uint64,
// Ascend's name for npu_trans_quant_param's encoding). On the float8 / MX path x_dtype /
// weight_dtype name float8 / float4 codes and the scales' dtypes are read there instead.
void check_declared_dtype(const char* name, std::optional<int64_t> code, at::TensorList tensors,
                          const char* tensors_name) {
  const std::optional<at::ScalarType> declared = dtype_from_code(name, code);
  if (!declared.has_value()) return;
  OPENNPU_CHECK_ARG(!tensors.empty() && tensors[0].defined(), kOp, name,
                    "must be None when ", tensors_name, " is not given, but got ", *declared);
  const at::ScalarType own = tensors[0].scalar_type();
  const bool int4_name = *declared == at::kQUInt4x2 || *declared == c10::ScalarType::Int4;
  const bool same = *declared == own || (int4_name && own == at::kInt) ||
                    (*declared == at::kUInt64 && own == at::kLong);
  OPENNPU_CHECK_ARG(same, kOp, name, "must be None or the dtype of ", tensors_name, " (", own,
                    ") on this path (byte tensors reinterpreted as float8 / float4 codes take "
                    "the float8 / MX path), but got ", *declared);
}

// Whether a 2-D weight view is the transpose of a contiguous [N, K] tensor (op-plugin's
// "weight transposed" layout; an int4 weight then packs its codes along K).
bool is_transposed(const at::Tensor& w) {
  return !w.is_contiguous() && w.stride(0) == 1 && w.stride(1) == w.size(0);
}

// The logical [K, N] of a 2-D weight view: int32 weights hold eight int4 codes per element along
// their storage's last dim (N, or K when transposed); float4 weights (fp4) two per byte along
// their memory-contiguous dim (N, or K for the transpose of a contiguous [N, K / 2]).
std::pair<int64_t, int64_t> weight_kn(const at::Tensor& w, bool fp4 = false) {
  if (fp4) {
    return quant::is_transpose_last_two(w) ? std::make_pair(2 * w.size(0), w.size(1))
                                           : std::make_pair(w.size(0), 2 * w.size(1));
  }
  if (w.scalar_type() != at::kInt) return {w.size(0), w.size(1)};
  return is_transposed(w) ? std::make_pair(8 * w.size(0), w.size(1))
                          : std::make_pair(w.size(0), 8 * w.size(1));
}

// Group sizes from group_list values: cumulative ends (type 0) or sizes (type 1).
std::vector<int64_t> group_sizes(const std::vector<int64_t>& values, int64_t type) {
  OPENNPU_CHECK_ARG(type == 0 || type == 1, kOp, "group_list_type",
                    "must be 0 (group_list holds cumulative row ends) or 1 (group sizes), or 2 "
                    "with a group_list tensor of [group, size] pairs, but got ", type);
  std::vector<int64_t> sizes(values.size());
  int64_t previous = 0;
  for (size_t g = 0; g < values.size(); ++g) {
    const int64_t v = values[g];
    if (type == 0) {
      OPENNPU_CHECK_ARG(v >= previous, kOp, "group_list",
                        "must be non-negative and non-decreasing (cumulative row ends, "
                        "group_list_type 0), but entry ", g, " is ", v, " after ", previous);
      sizes[g] = v - previous;
      previous = v;
    } else {
      OPENNPU_CHECK_ARG(v >= 0, kOp, "group_list",
                        "must hold non-negative group sizes (group_list_type 1), but entry ", g,
                        " is ", v);
      sizes[g] = v;
    }
  }
  return sizes;
}

// Whether BLAS can read a 2-D view as it is, row-major (rows contiguous) or column-major. The
// stride of a dim of size 0 or 1 never addresses a second element, so it is ignored: a [1, 1]
// view with strides (2, 2) is both (at::Tensor::contiguous() returns such views unchanged).
bool fits_row_major(const at::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  return (cols <= 1 || t.stride(1) == 1) && (rows <= 1 || t.stride(0) >= std::max<int64_t>(cols, 1));
}

bool fits_col_major(const at::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  return (rows <= 1 || t.stride(0) == 1) && (cols <= 1 || t.stride(1) >= std::max<int64_t>(rows, 1));
}

// A 2-D matrix whose layout BLAS takes as it is, else a row-major copy.
at::Tensor fit(const at::Tensor& t) {
  if (fits_row_major(t) || fits_col_major(t)) return t;
  return t.contiguous();
}

struct Operand {
  const void* ptr;
  int64_t ld;
  bool trans;
};

// The BLAS description of a 2-D view already passed through fit().
Operand operand(const at::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  if (fits_row_major(t)) {
    return {t.const_data_ptr(), rows <= 1 ? std::max<int64_t>(cols, 1) : t.stride(0), false};
  }
  TORCH_INTERNAL_ASSERT(fits_col_major(t));
  return {t.const_data_ptr(), cols <= 1 ? std::max<int64_t>(rows, 1) : t.stride(1), true};
}

// A GEMM of a @ b (both passed through fit(), kept alive by the caller) writing `out`, ldout.
GemmGroup gemm_of(const at::Tensor& a, const at::Tensor& b, void* out, int64_t ldout) {
  const Operand oa = operand(a), ob = operand(b);
  GemmGroup gemm;
  gemm.a = oa.ptr;
  gemm.lda = oa.ld;
  gemm.ta = oa.trans;
  gemm.b = ob.ptr;
  gemm.ldb = ob.ld;
  gemm.tb = ob.trans;
  gemm.out = out;
  gemm.ldout = ldout;
  return gemm;
}

// Grouping on K (group_type 2): x [M, K] (x may be a transposed view) and weight [K, N], one
// tensor each; group g is y[g] = x[:, K_g] @ weight[K_g, :] over the g-th column range of x (the
// g-th row range of weight) that group_list cuts; one output [G, M, N] (split_item 2 / 3). A
// group with no columns gives zeros; columns past the last group are not used.
std::vector<at::Tensor> grouped_matmul_on_k(at::TensorList x, at::TensorList weight,
                                            const std::optional<at::TensorList>& bias,
                                            const std::optional<std::vector<int64_t>>& group_values,
                                            int64_t split, std::optional<int64_t> group_list_type) {
  OPENNPU_CHECK_ARG(split >= 2, kOp, "split_item",
                    "must be 2 or 3 (one output [G, M, N]) with group_type 2 (grouping on K) in "
                    "opennpu, but got ", split);
  OPENNPU_CHECK_ARG(x.size() == 1 && x[0].dim() == 2, kOp, "x",
                    "must hold one 2-D tensor [M, K] with group_type 2 (grouping on K), but got ",
                    x.size(), " tensors", x.size() == 1 ? " of shape " + shape_str(x[0].sizes())
                                                         : std::string());
  OPENNPU_CHECK_ARG(weight.size() == 1 && weight[0].dim() == 2, kOp, "weight",
                    "must hold one 2-D tensor [K, N] with group_type 2 (grouping on K), but got ",
                    weight.size(), " tensors", weight.size() == 1
                        ? " of shape " + shape_str(weight[0].sizes()) : std::string());
  OPENNPU_CHECK_ARG(!bias.has_value() || bias->empty(), kOp, "bias",
                    "must be None with group_type 2 (grouping on K) in opennpu, but got ",
                    bias.has_value() ? bias->size() : 0, " tensors");
  OPENNPU_CHECK_ARG(group_values.has_value(), kOp, "group_list",
                    "must be given with group_type 2 (it cuts K into the groups), but got None");
  const at::Tensor& xk = x[0];
  const at::Tensor& w = weight[0];
  const int64_t m = xk.size(0), k_total = xk.size(1), n = w.size(1);
  OPENNPU_CHECK_ARG(w.size(0) == k_total, kOp, "weight[0]", "must have K = ", k_total,
                    " rows (x[0] is ", shape_str(xk.sizes()), "), but got shape ",
                    shape_str(w.sizes()));
  const std::vector<int64_t> sizes = group_sizes(*group_values, group_list_type.value_or(0));
  const int64_t groups = static_cast<int64_t>(sizes.size());
  int64_t total = 0;
  for (int64_t g = 0; g < groups; ++g) {
    OPENNPU_CHECK_ARG(sizes[g] <= k_total - total, kOp, "group_list",
                      "must cover at most the K = ", k_total, " columns of x[0], but group ", g,
                      " holds ", sizes[g], " after ", total, " in the groups before it");
    total += sizes[g];
  }
  at::Tensor y = at::zeros({groups, m, n}, xk.options());
  std::vector<GemmGroup> gemms;
  std::vector<at::Tensor> keep;
  int64_t k0 = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t kg = sizes[g];
    const int64_t start = k0;
    k0 += kg;
    if (kg == 0 || m == 0 || n == 0) continue;  // y[g] stays 0
    const at::Tensor a = fit(xk.narrow(1, start, kg));
    const at::Tensor b = fit(w.narrow(0, start, kg));
    keep.push_back(a);
    keep.push_back(b);
    GemmGroup gemm = gemm_of(a, b, y[g].mutable_data_ptr(), n);
    gemm.m = m;
    gemm.n = n;
    gemm.k = kg;
    gemms.push_back(gemm);
  }
  grouped_gemm.get(kOp, xk)(xk.scalar_type(), gemms);
  return {y};
}

// One GEMM of the float paths: out [m, n] = a [m, k] @ b [k, n] (+ bias, in the accumulator
// dtype), a and b in `dtype`.
struct GemmTask {
  at::Tensor a, b, bias, out;
};

// The tasks' GEMMs: those without bias as one whole ATen GEMM each where the device's plan says
// so (plan.whole_aten), the rest on grouped_gemm's tiles, which add the bias in the accumulator
// dtype before the single rounding.
void run_gemms(const at::Tensor& on, at::ScalarType dtype, const GroupedGemmPlan& plan,
               const std::vector<GemmTask>& tasks) {
  std::vector<GemmGroup> gemms;
  std::vector<at::Tensor> keep;  // copies made for BLAS layouts
  for (const GemmTask& t : tasks) {
    const int64_t m = t.a.size(0), k = t.a.size(1), n = t.b.size(1);
    if (m == 0 || n == 0) continue;
    if (plan.whole_aten && !t.bias.defined()) {
      at::Tensor out = t.out;
      at::mm_out(out, t.a, t.b);
      continue;
    }
    const at::Tensor a = fit(t.a), b = fit(t.b);
    keep.push_back(a);
    keep.push_back(b);
    GemmGroup gemm = gemm_of(a, b, t.out.mutable_data_ptr(), n);
    gemm.bias = t.bias.defined() ? t.bias.const_data_ptr() : nullptr;
    gemm.m = m;
    gemm.n = n;
    gemm.k = k;
    gemms.push_back(gemm);
  }
  if (!gemms.empty()) grouped_gemm.get(kOp, on)(dtype, gemms);
}

// The output dtype of the A8W8 path: int8 (None), float16, bfloat16, float32 or int32.
at::ScalarType a8w8_output_dtype(std::optional<at::ScalarType> output_dtype) {
  if (!output_dtype.has_value()) return at::kChar;
  const at::ScalarType t = *output_dtype;
  OPENNPU_CHECK_ARG(t == at::kChar || t == at::kHalf || t == at::kBFloat16 || t == at::kFloat ||
                        t == at::kInt,
                    kOp, "output_dtype", "must be None (int8), torch.int8, torch.float16, "
                    "torch.bfloat16, torch.float32 or torch.int32 with int8 x and weights, but "
                    "got ", t);
  return t;
}

// per_token_scale: one float32 [M_i] (or [M_i, 1]) per x tensor, a scale per row; as
// contiguous [M_i] (undefined entries when the list is absent).
std::vector<at::Tensor> per_token_scales(at::TensorList x, const QuantLists& q) {
  std::vector<at::Tensor> token_of(x.size());
  if (!q.per_token_scale.empty()) {
    OPENNPU_CHECK_ARG(q.per_token_scale.size() == x.size(), kOp, "per_token_scale",
                      "must hold one tensor per x tensor (", x.size(), "), but got ",
                      q.per_token_scale.size());
    for (size_t i = 0; i < x.size(); ++i) {
      const std::string name = list_arg("per_token_scale", i);
      const at::Tensor& t = q.per_token_scale[i];
      check_same_device(kOp, name.c_str(), t, "x[0]", x[0]);
      OPENNPU_CHECK_ARG(t.scalar_type() == at::kFloat, kOp, name.c_str(),
                        "must be float32, but got ", t.scalar_type(),
                        " (float8_e8m0 per-token scales belong to the MX path: float8 / float4 x "
                        "and weights)");
      int64_t m_rows = 1;  // the rows of x[i]: all dims but the last
      for (int64_t d = 0; d + 1 < x[i].dim(); ++d) m_rows *= x[i].size(d);
      OPENNPU_CHECK_ARG((t.dim() == 1 && t.size(0) == m_rows) ||
                            (t.dim() == 2 && t.size(0) == m_rows && t.size(1) == 1),
                        kOp, name.c_str(), "must be [M] = [", m_rows, "] (or [M, 1]), one scale "
                        "per row of x[", i, "], but got shape ", shape_str(t.sizes()));
      token_of[i] = t.reshape({m_rows}).contiguous();
    }
  }
  return token_of;
}

// The x rows of group g, 2-D: rows [row0, row0 + m) of x[0] (x split by group_list), or x[g] with
// its leading dims flattened.
at::Tensor group_rows(at::TensorList x, bool split_x, int64_t g, int64_t row0, int64_t m) {
  return split_x ? x[0].narrow(0, row0, m) : x[g].reshape({m, x[g].size(-1)});
}

// A group's product dims in npu_quant_matmul's arguments (integer or float operands), and the
// rows its epilogue indexes per-token scales by.
template <typename QuantArgs>
void set_dims(QuantArgs& p, int64_t m, int64_t k, int64_t n) {
  p.m = m;
  p.k = k;
  p.n = n;
  p.epilogue.m = m;
}

// `scale` as per-channel scales, one tensor per weight tensor ([N] / [1], or [E, N] / [E, 1] for
// a 3-D weight; float32, bfloat16 or npu_trans_quant_param's int64, whose packed offset applies to
// int8 outputs): fp32 scale[g] and offset[g] (undefined without one) per group. A8W8 and the
// float8 path.
struct ChannelScales {
  std::vector<at::Tensor> scale, offset;
};

// act_type's activation of float32 values y: 1 relu, 2 gelu with the tanh approximation,
// 4 fast_gelu (the npu_fast_gelu op), 5 silu (in place where ATen has the in-place form).
at::Tensor activation(at::Tensor y, int64_t act) {
  static const auto fast_gelu = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("npu::npu_fast_gelu", "")
                                    .typed<at::Tensor(const at::Tensor&)>();
  switch (act) {
    case 1: return y.relu_();
    case 2: return at::gelu_(y, "tanh");
    case 4: return fast_gelu.call(y);
    case 5: return at::silu_(y);
    default: return y;
  }
}

ChannelScales channel_scales(at::TensorList x, at::TensorList weight, const QuantLists& q,
                             bool single_weight, const std::vector<int64_t>& n_of,
                             at::ScalarType out_dtype) {
  const int64_t groups = static_cast<int64_t>(n_of.size());
  ChannelScales cs;
  cs.scale.resize(groups);
  cs.offset.resize(groups);
  OPENNPU_CHECK_ARG(q.scale.size() == weight.size(), kOp, "scale",
                    "must hold one tensor per weight tensor (", weight.size(), "), but got ",
                    q.scale.size());
  for (size_t i = 0; i < q.scale.size(); ++i) {
    const std::string name = list_arg("scale", i);
    const at::Tensor& s = q.scale[i];
    check_same_device(kOp, name.c_str(), s, "x[0]", x[0]);
    OPENNPU_CHECK_ARG(s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16 ||
                          s.scalar_type() == at::kLong,
                      kOp, name.c_str(), "must be float32, bfloat16 or int64 "
                      "(npu_trans_quant_param's encoding), but got ", s.scalar_type());
    const int64_t n = n_of.empty() ? 0 : n_of[single_weight ? 0 : i];
    const bool shape_ok = single_weight
        ? s.dim() == 2 && s.size(0) == groups && (s.size(1) == n || s.size(1) == 1)
        : s.dim() == 1 && (s.size(0) == n || s.size(0) == 1);
    OPENNPU_CHECK_ARG(shape_ok, kOp, name.c_str(), "must be ",
                      single_weight ? "[E, N] = [" + std::to_string(groups) + ", " +
                                          std::to_string(n) + "] (or [E, 1]) for the 3-D weight"
                                    : "1-D [N] = [" + std::to_string(n) + "] (or [1]), per "
                                      "channel of weight[" + std::to_string(i) + "]",
                      ", but got shape ", shape_str(s.sizes()),
                      s.dim() == 3 ? " (per-group [E, G, N] scales belong to the A8W4 path: "
                                     "int4 weights)" : "");
    at::Tensor values, offsets;
    if (s.scalar_type() == at::kLong) {
      std::tie(values, offsets) = quant::decode_int64_scale(s);
      values = values.view(s.sizes());
      if (offsets.defined()) {
        OPENNPU_CHECK_ARG(out_dtype == at::kChar, kOp, name.c_str(),
                          "carries an offset (npu_trans_quant_param(scale, offset)), which "
                          "applies only to int8 outputs, but the output dtype is ", out_dtype);
        offsets = offsets.view(s.sizes());
      }
    } else {
      values = s.to(at::kFloat).contiguous();
    }
    if (single_weight) {
      for (int64_t g = 0; g < groups; ++g) {
        cs.scale[g] = values[g];
        if (offsets.defined()) cs.offset[g] = offsets[g];
      }
    } else {
      cs.scale[i] = values;
      cs.offset[i] = offsets;
    }
  }
  return cs;
}

// A8W8: scale, per_token_scale, bias of each group as npu_quant_matmul's epilogue, then one
// quant_matmul product per non-empty group straight into its output rows.
void run_a8w8(at::TensorList x, at::TensorList weight, const QuantLists& q,
              const std::vector<at::Tensor>& bias_of, bool single_weight, bool split_x,
              const std::vector<int64_t>& rows, const std::vector<int64_t>& k_of,
              const std::vector<int64_t>& n_of, const std::vector<at::Tensor>& out_of,
              at::ScalarType out_dtype) {
  const int64_t groups = static_cast<int64_t>(rows.size());
  const bool int_out = out_dtype == at::kInt;
  OPENNPU_CHECK_ARG(int_out || !q.scale.empty(), kOp, "scale",
                    "must be given with int8 x and weights unless output_dtype is torch.int32 "
                    "(the raw int32 accumulator), but got None for output dtype ", out_dtype);
  OPENNPU_CHECK_ARG(!int_out || q.scale.empty(), kOp, "scale",
                    "must be None with output_dtype torch.int32 (the raw int32 accumulator), but "
                    "got a list of ", q.scale.size(), " tensors");
  OPENNPU_CHECK_ARG(!int_out || q.per_token_scale.empty(), kOp, "per_token_scale",
                    "must be None with output_dtype torch.int32 (the raw int32 accumulator), but "
                    "got a list of ", q.per_token_scale.size(), " tensors");
  OPENNPU_CHECK_ARG(q.offset.empty(), kOp, "offset",
                    "must be None: op-plugin's asymmetric A8W4 offset is not implemented by "
                    "opennpu (an int8 output's offset travels in an int64 scale made by "
                    "npu_trans_quant_param(scale, offset)), but got a list of ", q.offset.size(),
                    " tensors");
  const ChannelScales cs =
      q.scale.empty() ? ChannelScales{std::vector<at::Tensor>(groups),
                                      std::vector<at::Tensor>(groups)}
                      : channel_scales(x, weight, q, single_weight, n_of, out_dtype);
  const std::vector<at::Tensor>& scale_of = cs.scale;
  const std::vector<at::Tensor>& offset_of = cs.offset;
  const std::vector<at::Tensor> token_of = per_token_scales(x, q);
  // bias: int32 (added to the accumulator) or float (added after the dequantisation, float
  // outputs only).
  std::vector<at::Tensor> bias_int(groups), bias_float(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const at::Tensor& b = bias_of[g];
    if (!b.defined()) continue;
    const at::ScalarType bt = b.scalar_type();
    const std::string name = list_arg("bias", single_weight ? 0 : g);
    OPENNPU_CHECK_ARG(bt == at::kInt || bt == at::kFloat || bt == at::kBFloat16 || bt == at::kHalf,
                      kOp, name.c_str(), "must be int32, float32, bfloat16 or float16 with int8 x "
                      "and weights, but got ", bt);
    OPENNPU_CHECK_ARG(bt == at::kInt || !(out_dtype == at::kChar || out_dtype == at::kInt), kOp,
                      name.c_str(), "must be int32 for ", out_dtype, " outputs (a float bias is "
                      "added after the dequantisation, to float outputs), but got ", bt);
    (bt == at::kInt ? bias_int : bias_float)[g] =
        b.to(bt == at::kInt ? at::kInt : at::kFloat).reshape({1, b.numel()}).contiguous();
  }

  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m = rows[g], row0 = start;
    start += m;
    if (m == 0 || n_of[g] == 0) continue;
    quant::QuantMatmulArgs op;
    op.a = group_rows(x, split_x, g, row0, m).contiguous();
    const at::Tensor w = single_weight ? weight[0][g] : weight[g];
    op.w_trans = is_transposed(w);
    op.w = op.w_trans ? w.t().contiguous() : w.contiguous();
    set_dims(op, m, k_of[g], n_of[g]);
    quant::QuantMatmulEpilogue& e = op.epilogue;
    e.scale = scale_of[g];
    e.offset = offset_of[g];
    e.bias_int = bias_int[g];
    e.bias_float = bias_float[g];
    const at::Tensor& token = token_of[split_x ? 0 : g];
    if (token.defined()) e.pertoken = split_x ? token.narrow(0, row0, m) : token;
    at::Tensor out = out_of[g];
    quant::quant_matmul.get(kOp, x[0])(op, out);
  }
}

// A8W4 (op-plugin's golden; see quant::A8W4Args): per group, int8 x rows against int4 weight
// words [K, N / 8] with per-group scales [G, N] (int64: float32 bits in the low 32, as the
// golden's uint64 packing; or float32), an optional float bias [N] and per-token scales.
void run_a8w4(at::TensorList x, at::TensorList weight, const QuantLists& q,
              const std::vector<at::Tensor>& bias_of, bool single_weight, bool split_x,
              const std::vector<int64_t>& rows, const std::vector<int64_t>& k_of,
              const std::vector<int64_t>& n_of, const std::vector<at::Tensor>& out_of) {
  const int64_t groups = static_cast<int64_t>(rows.size());
  OPENNPU_CHECK_ARG(q.offset.empty(), kOp, "offset",
                    "must be None: op-plugin's asymmetric A8W4 offset is not implemented by "
                    "opennpu, but got a list of ", q.offset.size(), " tensors");
  OPENNPU_CHECK_ARG(!q.scale.empty(), kOp, "scale",
                    "must be given with int8 x and int4 weights (A8W4: per-group scales [E, G, N] "
                    "or [G, N] per weight), but got None");
  OPENNPU_CHECK_ARG(q.scale.size() == weight.size(), kOp, "scale",
                    "must hold one tensor per weight tensor (", weight.size(), "), but got ",
                    q.scale.size());
  std::vector<at::Tensor> scale_of(groups);
  for (size_t i = 0; i < q.scale.size(); ++i) {
    const std::string name = list_arg("scale", i);
    const at::Tensor& s = q.scale[i];
    check_same_device(kOp, name.c_str(), s, "x[0]", x[0]);
    OPENNPU_CHECK_ARG(s.scalar_type() == at::kLong || s.scalar_type() == at::kFloat, kOp,
                      name.c_str(), "must be int64 (float32 bits in the low 32 bits, op-plugin's "
                      "uint64 scale) or float32 with A8W4, but got ", s.scalar_type());
    const int64_t lead = single_weight ? 1 : 0;
    const int64_t n = n_of.empty() ? 0 : n_of[single_weight ? 0 : i];
    OPENNPU_CHECK_ARG(s.dim() == lead + 2 && (!single_weight || s.size(0) == groups) &&
                          s.size(-1) == n && s.size(-2) >= 1,
                      kOp, name.c_str(), "must be ", single_weight
                          ? "[E, G, N] = [" + std::to_string(groups) + ", G, " + std::to_string(n) +
                                "]" : "[G, N] = [G, " + std::to_string(n) + "]",
                      " (per-group scales, A8W4), but got shape ", shape_str(s.sizes()));
    at::Tensor values = s.scalar_type() == at::kLong
                            ? quant::decode_int64_scale(s).first.view(s.sizes())
                            : s.to(at::kFloat);
    values = values.contiguous();
    if (single_weight) {
      for (int64_t g = 0; g < groups; ++g) scale_of[g] = values[g];
    } else {
      scale_of[i] = values;
    }
  }
  const std::vector<at::Tensor> token_of = per_token_scales(x, q);
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m = rows[g], row0 = start;
    start += m;
    const at::Tensor w = single_weight ? weight[0][g] : weight[g];
    const std::string wname = single_weight ? "weight[0]" : list_arg("weight", g);
    OPENNPU_CHECK_ARG(!is_transposed(w), kOp, wname.c_str(), "must be int4 words [K, N / 8] "
                      "(codes along N) with A8W4; the transposed layout is not implemented by "
                      "opennpu, but got a transposed view of shape ", shape_str(w.sizes()));
    const int64_t k = k_of[g], n = n_of[g], gk = scale_of[g].size(0);
    OPENNPU_CHECK_ARG(k % gk == 0 && k / gk <= quant::kA8W4MaxGroup, kOp, "scale",
                      "must cut K = ", k, " of group ", g, " into equal groups of at most ",
                      quant::kA8W4MaxGroup, " rows, but has ", gk, " rows");
    if (m == 0 || n == 0) continue;
    quant::A8W4Args p;
    p.m = m;
    p.k = k;
    p.n = n;
    p.group_size = k / gk;
    p.x = group_rows(x, split_x, g, row0, m).contiguous();
    p.w = w.contiguous();
    p.scale = scale_of[g];
    const at::Tensor& b = bias_of[g];
    if (b.defined()) {
      const std::string name = list_arg("bias", single_weight ? 0 : g);
      OPENNPU_CHECK_ARG(b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16 ||
                            b.scalar_type() == at::kHalf,
                        kOp, name.c_str(), "must be float32 (or float16 / bfloat16) with A8W4, "
                        "but got ", b.scalar_type());
      p.bias = b.to(at::kFloat).contiguous();
    }
    const at::Tensor& token = token_of[split_x ? 0 : g];
    if (token.defined()) p.pertoken = (split_x ? token.narrow(0, row0, m) : token).contiguous();
    at::Tensor out = out_of[g];
    quant::a8w4_matmul.get(kOp, x[0])(p, out);
  }
}

// The float8 / MX path: npu_quant_matmul's float-operand product (quant::FloatQuantMatmulArgs)
// once per non-empty group, straight into its output rows.
//   float8 x and weights: `scale` per channel as on A8W8 (float32, bfloat16 or int64 without an
//     offset), optional float32 `per_token_scale` [M] per x tensor: y = acc * scale (* pt).
//   MX (float8 or float4 codes): float8_e8m0 block scales of 32 along K, as npu_dynamic_mx_quant
//     writes them: `per_token_scale` (x's) [M, ceil(K / 64), 2] per x tensor, `scale` (the
//     weights') [ceil(K / 64), N, 2] per 2-D weight or [E, ceil(K / 64), N, 2] for a 3-D one (a
//     transpose of dims -3 and -2 where the weight is a transposed view); the decoded operands
//     are scaled in fp32 before the GEMM.
// bias: float32, bfloat16 or float16, added after the scales; the output float16, bfloat16 or
// float32, rounded once.
void run_float_codes(at::TensorList x, at::TensorList weight, const QuantLists& q,
                     const FloatTypes& ft, const std::vector<at::Tensor>& bias_of,
                     bool single_weight, bool split_x, const std::vector<int64_t>& rows,
                     const std::vector<int64_t>& k_of, const std::vector<int64_t>& n_of,
                     const std::vector<at::Tensor>& out_of, at::ScalarType out_dtype) {
  const int64_t groups = static_cast<int64_t>(rows.size());
  const bool fp4 = quant::is_fp4(*ft.x) || quant::is_fp4(*ft.w);
  OPENNPU_CHECK_ARG(q.offset.empty(), kOp, "offset",
                    "must be None with float8 / float4 x and weights, but got a list of ",
                    q.offset.size(), " tensors");
  OPENNPU_CHECK_ARG(!q.scale.empty(), kOp, "scale",
                    "must be given with float8 / float4 x and weights (float32 / bfloat16 / "
                    "int64 per-channel scales, or float8_e8m0 MX block scales with "
                    "per_token_scale), but got None");
  OPENNPU_CHECK_ARG(q.scale.size() == weight.size(), kOp, "scale",
                    "must hold one tensor per weight tensor (", weight.size(), "), but got ",
                    q.scale.size());
  // torch.uint64 names an int64 (npu_trans_quant_param) scale, as on the other paths.
  std::optional<int64_t> scale_dtype = ft.scale_dtype;
  if (scale_dtype == static_cast<int64_t>(at::kUInt64) && q.scale[0].scalar_type() == at::kLong) {
    scale_dtype.reset();
  }
  const bool mx = quant::is_e8m0(kOp, "scale[0]", "scale_dtype", q.scale[0], scale_dtype);
  OPENNPU_CHECK_ARG(!ft.per_token_scale_dtype.has_value() || !q.per_token_scale.empty(), kOp,
                    "per_token_scale_dtype", "must be None when per_token_scale is not given, "
                    "but got ", *ft.per_token_scale_dtype);
  const bool mx_pt = !q.per_token_scale.empty() &&
                     quant::is_e8m0(kOp, "per_token_scale[0]", "per_token_scale_dtype",
                                    q.per_token_scale[0], ft.per_token_scale_dtype);
  OPENNPU_CHECK_ARG(mx == mx_pt, kOp, mx ? "per_token_scale" : "scale",
                    "must be float8_e8m0 block scales like ", mx ? "scale" : "per_token_scale",
                    " (MX scaling scales both operands: per_token_scale x's, scale the weights'), "
                    "but got ", mx ? (q.per_token_scale.empty() ? "None" : "another type")
                                   : "float8_e8m0 scales only for x");
  OPENNPU_CHECK_ARG(mx || !fp4, kOp, "scale",
                    "must be float8_e8m0 block scales (scale_dtype / per_token_scale_dtype = "
                    "torch_npu.float8_e8m0fnu) with float4_e2m1 x or weights (MX only), but got ",
                    q.scale[0].scalar_type());

  // Per x tensor: MX block scales of x [1, M_i, ceil(K / 32)], or float32 per-token scales.
  const int64_t nx = static_cast<int64_t>(x.size());
  std::vector<at::Tensor> token_of, x_block(nx);
  if (mx) {
    OPENNPU_CHECK_ARG(q.per_token_scale.size() == x.size(), kOp, "per_token_scale",
                      "must hold one tensor per x tensor (", x.size(), "), but got ",
                      q.per_token_scale.size());
    for (int64_t i = 0; i < nx; ++i) {
      const std::string name = list_arg("per_token_scale", i);
      const at::Tensor& t = q.per_token_scale[i];
      OPENNPU_CHECK_ARG(
          i == 0 || quant::is_e8m0(kOp, name.c_str(), "per_token_scale_dtype", t,
                                   ft.per_token_scale_dtype),
          kOp, name.c_str(), "must be float8_e8m0 block scales like per_token_scale[0], but got ",
          t.scalar_type());
      const at::Tensor x2d = x[i].reshape({-1, x[i].size(-1)});
      const int64_t k = x2d.size(1) * (quant::is_fp4(*ft.x) ? 2 : 1);
      x_block[i] = quant::mx_block_scale(kOp, name.c_str(), t, list_arg("x", i).c_str(), x2d, {},
                                         x2d.size(0), k, false);
    }
  } else {
    token_of = per_token_scales(x, q);
  }
  // Per group: MX block scales of the weight [ceil(K / 32), N], or per-channel scales.
  std::vector<at::Tensor> w_block(groups);
  ChannelScales cs;
  if (mx) {
    for (size_t i = 0; i < q.scale.size(); ++i) {
      const std::string name = list_arg("scale", i);
      const at::Tensor& s = q.scale[i];
      OPENNPU_CHECK_ARG(i == 0 || quant::is_e8m0(kOp, name.c_str(), "scale_dtype", s,
                                                 scale_dtype),
                        kOp, name.c_str(), "must be float8_e8m0 block scales like scale[0], but "
                        "got ", s.scalar_type());
      const std::string wname = list_arg("weight", i);
      const int64_t g0 = single_weight ? 0 : static_cast<int64_t>(i);
      OPENNPU_CHECK_ARG(s.dim() == (single_weight ? 4 : 3), kOp, name.c_str(), "must be ",
                        single_weight ? "4-D [E, ceil(K / 64), N, 2] for the 3-D weight"
                                      : "3-D [ceil(K / 64), N, 2]", " (float8_e8m0 MX scales), "
                        "but got shape ", shape_str(s.sizes()));
      const at::Tensor f = quant::mx_block_scale(
          kOp, name.c_str(), s, wname.c_str(), weight[i],
          single_weight ? c10::IntArrayRef(weight[0].sizes().data(), 1) : c10::IntArrayRef(),
          n_of[g0], k_of[g0], true);
      if (single_weight) {
        for (int64_t g = 0; g < groups; ++g) w_block[g] = f[g];
      } else {
        w_block[i] = f[0];
      }
    }
  } else {
    cs = channel_scales(x, weight, q, single_weight, n_of, out_dtype);
  }
  std::vector<at::Tensor> bias_float(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const at::Tensor& b = bias_of[g];
    if (!b.defined()) continue;
    const std::string name = list_arg("bias", single_weight ? 0 : g);
    OPENNPU_CHECK_ARG(b.scalar_type() == at::kFloat || b.scalar_type() == at::kBFloat16 ||
                          b.scalar_type() == at::kHalf,
                      kOp, name.c_str(), "must be float32, bfloat16 or float16 with float8 / "
                      "float4 x and weights, but got ", b.scalar_type());
    bias_float[g] = b.to(at::kFloat).reshape({1, b.numel()}).contiguous();
  }

  const at::Tensor one = at::ones({1}, x[0].options().dtype(at::kFloat));
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m = rows[g], row0 = start;
    start += m;
    if (m == 0 || n_of[g] == 0) continue;
    const int64_t xi = split_x ? 0 : g;
    quant::FloatQuantMatmulArgs p;
    p.a = quant::float_operand(group_rows(x, split_x, g, row0, m), *ft.x);
    p.w = quant::float_operand(single_weight ? weight[0][g] : weight[g], *ft.w);
    set_dims(p, m, k_of[g], n_of[g]);
    quant::QuantMatmulEpilogue& e = p.epilogue;
    e.bias_float = bias_float[g];
    if (mx) {
      // Block scales in the operands' memory orientation (K along x's columns unless x is a
      // transposed view, along the weight's rows unless it is one).
      const at::Tensor sa = split_x ? x_block[0][0].narrow(0, row0, m) : x_block[xi][0];
      p.a.block_scale = (p.a.trans ? sa.t() : sa).contiguous().unsqueeze(0);
      p.w.block_scale = (p.w.trans ? w_block[g].t() : w_block[g]).contiguous().unsqueeze(0);
      e.scale = one;
    } else {
      e.scale = cs.scale[g];
      const at::Tensor& token = token_of[xi];
      if (token.defined()) e.pertoken = split_x ? token.narrow(0, row0, m) : token;
    }
    at::Tensor out = out_of[g];
    quant::float_quant_matmul.get(kOp, x[0])(p, out);
  }
}

// The weight-only path's antiquant_scale / antiquant_offset of each group: fp32 [G, N] and the
// rows of K each of the G scale rows covers.
struct Antiquant {
  std::vector<at::Tensor> scale, offset;
  std::vector<int64_t> group_size;
};

Antiquant antiquant_params(at::TensorList x, at::TensorList weight, const QuantLists& q,
                           bool single_weight, const std::vector<int64_t>& k_of,
                           const std::vector<int64_t>& n_of) {
  const int64_t groups = static_cast<int64_t>(k_of.size());
  const bool int4 = weight[0].scalar_type() == at::kInt;
  const at::ScalarType dtype = x[0].scalar_type();
  OPENNPU_CHECK_ARG(!q.antiquant_scale.empty(), kOp, "antiquant_scale",
                    "must be given with ", int4 ? "int4 (int32)" : "int8", " weights and ", dtype,
                    " x (the weight-only path: weight = (w + antiquant_offset) * "
                    "antiquant_scale), but got None");
  Antiquant params;
  params.scale.resize(groups);
  params.offset.resize(groups);
  params.group_size.resize(groups);
  for (const char* which : {"antiquant_scale", "antiquant_offset"}) {
    const bool is_scale = which[10] == 's';
    const at::TensorList list = is_scale ? q.antiquant_scale : q.antiquant_offset;
    if (list.empty()) continue;
    OPENNPU_CHECK_ARG(list.size() == weight.size(), kOp, which,
                      "must hold one tensor per weight tensor (", weight.size(), "), but got ",
                      list.size());
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string name = list_arg(which, i);
      const at::Tensor& t = list[i];
      check_same_device(kOp, name.c_str(), t, "x[0]", x[0]);
      OPENNPU_CHECK_ARG(t.scalar_type() == dtype, kOp, name.c_str(), "must have x's dtype (",
                        dtype, "), but got ", t.scalar_type());
      const int64_t n = n_of.empty() ? 0 : n_of[single_weight ? 0 : i];
      const int64_t lead = single_weight ? 1 : 0;  // the E dim of a 3-D weight's [E, (G,) N]
      const bool shape_ok = (t.dim() == lead + 1 || t.dim() == lead + 2) &&
                            (!single_weight || t.size(0) == groups) && t.size(-1) == n &&
                            (t.dim() == lead + 1 || t.size(lead) >= 1);
      OPENNPU_CHECK_ARG(shape_ok, kOp, name.c_str(), "must be ", single_weight
                            ? "[E, N] = [" + std::to_string(groups) + ", " + std::to_string(n) +
                                  "] (per channel) or [E, G, N] (per group, int4 weights)"
                            : "[N] = [" + std::to_string(n) + "] (per channel) or [G, N] (per "
                              "group, int4 weights)",
                        ", but got shape ", shape_str(t.sizes()));
      const int64_t g_rows = t.dim() == lead + 2 ? t.size(lead) : 1;
      OPENNPU_CHECK_ARG(g_rows == 1 || int4, kOp, name.c_str(),
                        "must be per channel with int8 weights (op-plugin: per-group antiquant "
                        "needs int4 weights), but got shape ", shape_str(t.sizes()));
      const at::Tensor f = t.to(at::kFloat).reshape(single_weight
                                                       ? std::vector<int64_t>{groups, g_rows, n}
                                                       : std::vector<int64_t>{g_rows, n})
                               .contiguous();
      for (int64_t g = single_weight ? 0 : static_cast<int64_t>(i);
           g < (single_weight ? groups : static_cast<int64_t>(i) + 1); ++g) {
        const int64_t k = k_of[g];
        OPENNPU_CHECK_ARG(k % g_rows == 0, kOp, name.c_str(), "must cut K = ", k,
                          " into equal groups, but its ", g_rows, " rows do not divide it");
        (is_scale ? params.scale : params.offset)[g] = single_weight ? f[g] : f;
        if (is_scale) {
          params.group_size[g] = std::max<int64_t>(k / g_rows, 1);
        } else {
          OPENNPU_CHECK_ARG(params.scale[g].size(0) == g_rows, kOp, name.c_str(),
                            "must have the shape of antiquant_scale, ",
                            shape_str(params.scale[g].sizes()), " per group, but got shape ",
                            shape_str(t.sizes()));
        }
      }
    }
  }
  return params;
}

std::vector<at::Tensor> grouped_matmul(at::TensorList x, at::TensorList weight,
                                       const std::optional<at::TensorList>& bias,
                                       const QuantLists& q, const FloatTypes& ft,
                                       const std::optional<std::vector<int64_t>>& group_values,
                                       std::optional<int64_t> split_item,
                                       std::optional<int64_t> group_type,
                                       std::optional<int64_t> group_list_type,
                                       std::optional<int64_t> act_type,
                                       std::optional<at::ScalarType> output_dtype) {
  OPENNPU_CHECK_ARG(!x.empty(), kOp, "x", "must hold at least one tensor, but got an empty list");
  OPENNPU_CHECK_ARG(!weight.empty(), kOp, "weight",
                    "must hold at least one tensor, but got an empty list");
  const int64_t split = split_item.value_or(0);
  OPENNPU_CHECK_ARG(split >= 0 && split <= 3, kOp, "split_item",
                    "must be 0 or 1 (one output per group) or 2 or 3 (one output), but got ",
                    split);
  const bool single_out = split >= 2;
  const int64_t act = act_type.value_or(0);
  OPENNPU_CHECK_ARG(act >= 0 && act <= 5 && act != 3, kOp, "act_type",
                    "must be 0 (none), 1 (relu), 2 (gelu, tanh approximation), 4 (fast_gelu) or "
                    "5 (silu); 3 is unsupported, as on Ascend; but got ", act);
  if (group_type.has_value()) {
    const int64_t gt = *group_type;
    // op-plugin's words ("The group type must be -1, 0 or 2"), which its tests match.
    OPENNPU_CHECK_ARG(gt == -1 || gt == 0 || gt == 2, kOp, "group_type",
                      "is invalid. The group type must be -1 (no grouping: x[i] @ weight[i]), 0 "
                      "(x's rows grouped by group_list) or 2 (grouping on K), but now is [", gt,
                      "]");
    OPENNPU_CHECK_ARG(gt != -1 || !group_values.has_value(), kOp, "group_list",
                      "must be None with group_type -1 (no grouping), but got ",
                      group_values ? group_values->size() : 0, " entries");
  }

  // The path, from the dtypes of x and weight; the arguments each path takes.
  for (size_t i = 0; i < x.size(); ++i) {
    const std::string name = list_arg("x", i);
    OPENNPU_CHECK_ARG(x[i].defined(), kOp, name.c_str(), "must be a tensor, but got None");
    OPENNPU_CHECK_ARG(x[i].scalar_type() == x[0].scalar_type(), kOp, name.c_str(),
                      "must have the dtype of x[0] (", x[0].scalar_type(), "), but got ",
                      x[i].scalar_type());
    check_same_device(kOp, name.c_str(), x[i], "x[0]", x[0]);
  }
  OPENNPU_CHECK_ARG(weight[0].defined(), kOp, "weight[0]", "must be a tensor, but got None");
  const at::ScalarType dtype = x[0].scalar_type();
  const at::ScalarType wtype = weight[0].scalar_type();
  const bool weight_codes = wtype == at::kChar || wtype == at::kInt;
  Path path = Path::kFloat;
  if (ft.x.has_value() || ft.w.has_value()) {
    OPENNPU_CHECK_ARG(ft.x.has_value(), kOp, "x[0]", "must be float8 / float4 codes like "
                      "weight[0] (float8_e4m3fn, float8_e5m2, float4_e2m1fn_x2, or bytes with "
                      "x_dtype naming one), but got ", dtype);
    OPENNPU_CHECK_ARG(ft.w.has_value(), kOp, "weight[0]", "must be float8 / float4 codes like "
                      "x[0] (float8_e4m3fn, float8_e5m2, float4_e2m1fn_x2, or bytes with "
                      "weight_dtype naming one), but got ", wtype);
    path = Path::kFloatCodes;
  } else if (dtype == at::kChar) {
    OPENNPU_CHECK_ARG(wtype == at::kChar || wtype == at::kInt, kOp, "weight[0]",
                      "must be int8 (A8W8) or int32 holding eight int4 codes per element (A8W4) "
                      "with int8 x, but got ", wtype);
    path = wtype == at::kChar ? Path::kA8W8 : Path::kA8W4;
  } else {
    OPENNPU_CHECK_ARG(dtype != at::kInt, kOp, "x[0]",
                      "is int32 (eight int4 codes per element, the A4W4 path), which opennpu does "
                      "not implement");
    OPENNPU_CHECK_ARG(at::isFloatingType(dtype) && !at::isFloat8Type(dtype), kOp, "x[0]",
                      "must be float16, bfloat16, float32, int8, or float8 / float4 codes, but "
                      "got ", dtype);
    if (weight_codes) path = Path::kAntiquant;
  }
  check_absent("activation_input", q.activation_input, path, "fused-activation inputs are not "
               "implemented by opennpu");
  check_absent("activation_quant_scale", q.activation_quant_scale, path,
               "fused-activation inputs are not implemented by opennpu");
  check_absent("activation_quant_offset", q.activation_quant_offset, path,
               "fused-activation inputs are not implemented by opennpu");
  at::ScalarType out_dtype = dtype;
  if (path == Path::kFloat) {
    check_floating(kOp, "x[0]", x[0]);
    check_strict_dtype(kOp, "x[0]", x[0], {at::kHalf, at::kBFloat16, at::kFloat});
    const char* what = "it belongs to the quantised paths (int8 x and weights, or float16 / "
                       "bfloat16 x with int8 / int4 weights)";
    check_absent("scale", q.scale, path, what);
    check_absent("offset", q.offset, path, what);
    check_absent("antiquant_scale", q.antiquant_scale, path, what);
    check_absent("antiquant_offset", q.antiquant_offset, path, what);
    check_absent("per_token_scale", q.per_token_scale, path, what);
    OPENNPU_CHECK_ARG(!output_dtype.has_value() || *output_dtype == dtype, kOp, "output_dtype",
                      "must be None or x's dtype (", dtype, ") on the non-quantised path, but "
                      "got ", *output_dtype);
  } else if (path == Path::kFloatCodes) {
    const char* what = "it belongs to the weight-only path (float16 / bfloat16 x with int8 / "
                       "int4 weights)";
    check_absent("antiquant_scale", q.antiquant_scale, path, what);
    check_absent("antiquant_offset", q.antiquant_offset, path, what);
    OPENNPU_CHECK_ARG(output_dtype.has_value() && (*output_dtype == at::kHalf ||
                                                   *output_dtype == at::kBFloat16 ||
                                                   *output_dtype == at::kFloat),
                      kOp, "output_dtype", "must be torch.float16, torch.bfloat16 or "
                      "torch.float32 with float8 / float4 x and weights, but got ",
                      output_dtype.has_value() ? c10::toString(*output_dtype) : "None");
    out_dtype = *output_dtype;
  } else if (path == Path::kAntiquant) {
    OPENNPU_CHECK_ARG(dtype == at::kHalf || dtype == at::kBFloat16, kOp, "x[0]",
                      "must be float16 or bfloat16 with int8 / int4 weights (the weight-only "
                      "path), but got ", dtype);
    const char* what = "it belongs to the A8W8 path (int8 x and weights)";
    check_absent("scale", q.scale, path, what);
    check_absent("offset", q.offset, path, what);
    check_absent("per_token_scale", q.per_token_scale, path, what);
    OPENNPU_CHECK_ARG(!output_dtype.has_value() || *output_dtype == dtype, kOp, "output_dtype",
                      "must be None or x's dtype (", dtype, ") on the weight-only path, but got ",
                      *output_dtype);
  } else {
    const char* what = "it belongs to the weight-only path (float16 / bfloat16 x with int8 / "
                       "int4 weights)";
    check_absent("antiquant_scale", q.antiquant_scale, path, what);
    check_absent("antiquant_offset", q.antiquant_offset, path, what);
    if (path == Path::kA8W4) {
      OPENNPU_CHECK_ARG(output_dtype.has_value() && (*output_dtype == at::kHalf ||
                                                     *output_dtype == at::kBFloat16),
                        kOp, "output_dtype", "must be torch.float16 or torch.bfloat16 with int8 x "
                        "and int4 weights (A8W4), but got ",
                        output_dtype.has_value() ? c10::toString(*output_dtype) : "None");
      out_dtype = *output_dtype;
    } else {
      out_dtype = a8w8_output_dtype(output_dtype);
    }
  }
  // Ascend computes the fused activation only on the per-token quantised path.
  OPENNPU_CHECK_ARG(act == 0 || (path == Path::kA8W8 && !q.per_token_scale.empty()), kOp,
                    "act_type", "applies only to int8 x and weights with per_token_scale (the "
                    "per-token quantised path, as on Ascend), but got ", act, " without them");
  OPENNPU_CHECK_ARG(act == 0 || out_dtype == at::kHalf || out_dtype == at::kBFloat16 ||
                        out_dtype == at::kFloat,
                    kOp, "output_dtype", "must be torch.float16, torch.bfloat16 or torch.float32 "
                    "with act_type ", act, ", but got ", out_dtype);
  const bool single_weight = weight.size() == 1 && weight[0].dim() == 3;
  const int64_t groups = single_weight ? weight[0].size(0) : static_cast<int64_t>(weight.size());
  for (size_t i = 0; i < weight.size(); ++i) {
    const std::string name = list_arg("weight", i);
    const at::Tensor& w = weight[i];
    OPENNPU_CHECK_ARG(w.defined(), kOp, name.c_str(), "must be a tensor, but got None");
    if (path == Path::kFloat) {
      OPENNPU_CHECK_ARG(w.scalar_type() == dtype, kOp, name.c_str(), "must have x's dtype (",
                        dtype, "), but got ", w.scalar_type());
    } else {
      OPENNPU_CHECK_ARG(w.scalar_type() == wtype, kOp, name.c_str(),
                        "must have the dtype of weight[0] (", wtype, "), but got ",
                        w.scalar_type());
    }
    OPENNPU_CHECK_ARG(w.dim() == 2 || single_weight, kOp, name.c_str(),
                      "must be 2-D [K, N] (or one 3-D [E, K, N] tensor as the only weight), but "
                      "got shape ", shape_str(w.sizes()));
    check_same_device(kOp, name.c_str(), w, "x[0]", x[0]);
  }
  const auto weight_of = [&](int64_t g) { return single_weight ? weight[0][g] : weight[g]; };
  if (group_type.value_or(-1) == 2) {
    OPENNPU_CHECK_ARG(path == Path::kFloat, kOp, "group_type",
                      "must be -1 or 0 on the quantised paths (op-plugin: grouping on K, 2, is "
                      "non-quantised only), but got 2");
    return grouped_matmul_on_k(x, weight, bias, group_values, split, group_list_type);
  }

  // The groups' rows: separate x tensors, or row ranges of x[0].
  const int64_t nx = static_cast<int64_t>(x.size());
  const bool split_x = group_values.has_value() && nx == 1;
  std::vector<int64_t> rows(groups), x_rows(nx);
  if (split_x) {
    OPENNPU_CHECK_ARG(x[0].dim() == 2, kOp, "x[0]",
                      "must be 2-D [M, K] when group_list splits it into groups, but got shape ",
                      shape_str(x[0].sizes()));
    rows = group_sizes(*group_values, group_list_type.value_or(0));
    OPENNPU_CHECK_ARG(static_cast<int64_t>(rows.size()) == groups, kOp, "group_list",
                      "must have one entry per group (", groups, single_weight ?
                      ", weight[0].size(0)" : ", len(weight)", "), but got ", rows.size());
    // Summed against the rows left, so that sizes near the int64 limit cannot wrap around.
    const int64_t m_total = x[0].size(0);
    int64_t total = 0;
    for (size_t g = 0; g < rows.size(); ++g) {
      OPENNPU_CHECK_ARG(rows[g] <= m_total - total, kOp, "group_list",
                        "must cover at most the ", m_total, " rows of x[0], but group ", g,
                        " holds ", rows[g], " rows after ", total, " in the groups before it");
      total += rows[g];
    }
    OPENNPU_CHECK_STRICT(total == x[0].size(0), kOp, "group_list",
                         "must cover all ", x[0].size(0), " rows of x[0], but its groups hold ",
                         total);
  } else {
    OPENNPU_CHECK_ARG(nx == groups, kOp, "x",
                      "must hold one tensor per group (", groups, ") or, with a group_list, one "
                      "tensor to split into the groups, but got ", nx, " tensors",
                      nx == 1 ? " and no group_list" : "");
    for (int64_t i = 0; i < nx; ++i) {
      const std::string name = list_arg("x", i);
      OPENNPU_CHECK_ARG(x[i].dim() == 2 || (!single_out && x[i].dim() > 2), kOp, name.c_str(),
                        "must be 2-D [M, K]", single_out ? " with split_item 2 or 3" :
                        " (or have more leading dims)", ", but got shape ",
                        shape_str(x[i].sizes()));
      check_strict_rank(kOp, name.c_str(), x[i], 2, 6);
      x_rows[i] = 1;
      for (int64_t d = 0; d + 1 < x[i].dim(); ++d) x_rows[i] *= x[i].size(d);
      rows[i] = x_rows[i];
    }
    if (group_values.has_value()) {
      const std::vector<int64_t> sizes = group_sizes(*group_values, group_list_type.value_or(0));
      OPENNPU_CHECK_ARG(sizes.size() == rows.size(), kOp, "group_list",
                        "must have one entry per x tensor (", rows.size(), "), but got ",
                        sizes.size());
      for (int64_t i = 0; i < nx; ++i) {
        OPENNPU_CHECK_ARG(sizes[i] == rows[i], kOp, "group_list",
                          "must give each group the rows of its x tensor, but group ", i, " has ",
                          sizes[i], " rows and x[", i, "] has ", rows[i]);
      }
    }
  }

  // Shapes: K of every group, and N (equal across groups for a single output). float4 codes are
  // two per byte: x [.., M, K / 2] (packed along K), weights as weight_kn says.
  const bool fp4_x = ft.x.has_value() && quant::is_fp4(*ft.x);
  const bool fp4_w = ft.w.has_value() && quant::is_fp4(*ft.w);
  if (fp4_x) {
    for (int64_t i = 0; i < nx; ++i) {
      const std::string name = list_arg("x", i);
      OPENNPU_CHECK_ARG(!quant::is_transpose_last_two(x[i]), kOp, name.c_str(), "must hold "
                        "float4 codes packed along K ([M, K / 2] bytes), but got a transposed "
                        "view of shape ", shape_str(x[i].sizes()));
    }
  }
  std::vector<int64_t> k_of(groups), n_of(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const at::Tensor w = weight_of(g);
    std::tie(k_of[g], n_of[g]) = weight_kn(w, fp4_w);
    const at::Tensor& xg = split_x ? x[0] : x[g];
    const std::string name = split_x ? std::string("x[0]") : list_arg("x", g);
    OPENNPU_CHECK_ARG(xg.size(-1) * (fp4_x ? 2 : 1) == k_of[g], kOp, name.c_str(),
                      "must have K = ", k_of[g], fp4_x ? " (float4 codes, two per byte)" : "",
                      " columns (weight", single_weight ? "[0][" : "[", g, "] is ",
                      shape_str(w.sizes()), "), but got shape ", shape_str(xg.sizes()));
    OPENNPU_CHECK_ARG(!single_out || n_of[g] == n_of[0], kOp, "weight",
                      "must give every group the same N with split_item 2 or 3 (one output), but "
                      "group 0 has N = ", n_of[0], " and group ", g, " has N = ", n_of[g]);
  }

  // Bias: [N_g] per weight tensor, or [E, N] for a 3-D weight: one [N] tensor per group here.
  std::vector<at::Tensor> bias_of(groups);
  if (bias.has_value() && !bias->empty()) {
    OPENNPU_CHECK_ARG(bias->size() == weight.size(), kOp, "bias",
                      "must hold one tensor per weight tensor (", weight.size(), "), but got ",
                      bias->size());
    for (size_t i = 0; i < bias->size(); ++i) {
      const std::string name = list_arg("bias", i);
      const at::Tensor& b = (*bias)[i];
      check_same_device(kOp, name.c_str(), b, "x[0]", x[0]);
      if (single_weight) {
        OPENNPU_CHECK_ARG(b.dim() == 2 && b.size(0) == groups && b.size(1) == n_of[0], kOp,
                          name.c_str(), "must be [E, N] = [", groups, ", ", n_of[0],
                          "] for the 3-D weight, but got shape ", shape_str(b.sizes()));
        for (int64_t g = 0; g < groups; ++g) bias_of[g] = b[g];
      } else {
        OPENNPU_CHECK_ARG(b.dim() == 1 && b.size(0) == n_of[i], kOp, name.c_str(),
                          "must be 1-D [N] = [", n_of[i], "] (the columns of weight[", i,
                          "]), but got shape ", shape_str(b.sizes()));
        bias_of[i] = b;
      }
    }
  }
  // The float paths keep it in the accumulator dtype (x's dtype or that one given).
  const auto acc = acc_dtype(x[0]);
  std::vector<at::Tensor> bias_acc(groups);
  if (path == Path::kFloat || path == Path::kAntiquant) {
    for (int64_t g = 0; g < groups; ++g) {
      const at::Tensor& b = bias_of[g];
      if (!b.defined()) continue;
      const std::string name = list_arg("bias", single_weight ? 0 : g);
      check_floating(kOp, name.c_str(), b);
      OPENNPU_CHECK_ARG(b.scalar_type() == dtype || b.scalar_type() == acc, kOp, name.c_str(),
                        "must have x's dtype (", dtype, ") or ", acc, ", but got ",
                        b.scalar_type());
      bias_acc[g] = b.to(acc).contiguous();
    }
  }
  Antiquant antiquant;
  if (path == Path::kAntiquant) {
    antiquant = antiquant_params(x, weight, q, single_weight, k_of, n_of);
  }

  // Outputs, and one GEMM per non-empty group.
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> out_of(groups);  // [rows, N] view of each group's output
  const at::TensorOptions options = x[0].options().dtype(out_dtype);
  if (single_out) {
    int64_t total = 0;
    for (int64_t m : rows) total += m;
    const int64_t out_rows = split_x ? x[0].size(0) : total;
    const int64_t n = groups > 0 ? n_of[0] : weight[0].size(-1);
    at::Tensor y = total < out_rows ? at::zeros({out_rows, n}, options)
                                    : at::empty({out_rows, n}, options);
    int64_t start = 0;
    for (int64_t g = 0; g < groups; ++g) {
      out_of[g] = y.narrow(0, start, rows[g]);
      start += rows[g];
    }
    outputs.push_back(y);
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      std::vector<int64_t> shape{rows[g], n_of[g]};
      if (!split_x) {
        shape.assign(x[g].sizes().begin(), x[g].sizes().end());
        shape.back() = n_of[g];
      }
      at::Tensor y = at::empty(shape, options);
      out_of[g] = y.view({rows[g], n_of[g]});
      outputs.push_back(y);
    }
  }

  if (path == Path::kA8W8 && act != 0) {
    // The epilogue's float32 values, the activation in float32, one rounding into the output.
    std::vector<at::Tensor> value_of(groups);
    for (int64_t g = 0; g < groups; ++g) {
      value_of[g] = at::empty({rows[g], n_of[g]}, x[0].options().dtype(at::kFloat));
    }
    run_a8w8(x, weight, q, bias_of, single_weight, split_x, rows, k_of, n_of, value_of,
             at::kFloat);
    for (int64_t g = 0; g < groups; ++g) {
      if (value_of[g].numel() > 0) out_of[g].copy_(activation(value_of[g], act));
    }
    return outputs;
  }
  if (path == Path::kA8W8) {
    run_a8w8(x, weight, q, bias_of, single_weight, split_x, rows, k_of, n_of, out_of, out_dtype);
    return outputs;
  }
  if (path == Path::kA8W4) {
    run_a8w4(x, weight, q, bias_of, single_weight, split_x, rows, k_of, n_of, out_of);
    return outputs;
  }
  if (path == Path::kFloatCodes) {
    run_float_codes(x, weight, q, ft, bias_of, single_weight, split_x, rows, k_of, n_of, out_of,
                    out_dtype);
    return outputs;
  }
  // The float GEMMs: all groups in one call; on the weight-only path one group at a time, its
  // weight dequantised into x's dtype just before (skipping empty groups, and holding one
  // dequantised weight at a time), or into fp32 where the plan multiplies fp32 copies.
  const GroupedGemmPlan plan = grouped_gemm_plan.get(kOp, x[0])(dtype);
  const bool fp32_gemm = path == Path::kAntiquant && plan.antiquant_fp32;
  std::vector<GemmTask> tasks;
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m = rows[g];
    const int64_t row0 = start;
    start += m;
    if (m == 0 || n_of[g] == 0) continue;
    GemmTask task;
    task.a = group_rows(x, split_x, g, row0, m);
    task.bias = bias_acc[g];
    task.out = out_of[g];
    if (path == Path::kFloat) {
      task.b = weight_of(g);
      tasks.push_back(task);
      continue;
    }
    const at::Tensor w = weight_of(g);
    const bool trans = is_transposed(w);
    const at::Tensor codes = trans ? w.t() : w.contiguous();  // [N, K] or [K, N] storage
    at::Tensor deq = at::empty({trans ? n_of[g] : k_of[g], trans ? k_of[g] : n_of[g]},
                               x[0].options().dtype(fp32_gemm ? at::kFloat : dtype));
    antiquant_weight.get(kOp, x[0])(codes, wtype == at::kInt, !trans, antiquant.scale[g],
                                    antiquant.offset[g], antiquant.group_size[g], dtype, deq);
    task.b = trans ? deq.t() : deq;
    if (!fp32_gemm) {
      run_gemms(x[0], dtype, plan, {task});
      continue;
    }
    // fp32 operands holding x's and the weight's fp16 / bf16 values exactly: the same fp32
    // accumulation, then + bias and one rounding into the output.
    at::Tensor y = at::mm(task.a.to(at::kFloat), task.b);
    if (task.bias.defined()) y.add_(task.bias);
    task.out.copy_(y);
  }
  run_gemms(x[0], dtype, plan, tasks);
  return outputs;
}

// group_list_type 2: group_list [E, 2] holds (group index, group size) pairs, x's rows taken in
// the list's order (a sparse expert list: only the experts with rows, in any order, an index
// possibly repeated), one output ([M, N], split_item 2 or 3) in x's row order. Read as the
// per-group sizes of group_list_type 1; where the list is not in group order, x's rows (and the
// per-row scales) are gathered into group order first and the output's rows put back.
std::vector<at::Tensor> grouped_matmul_paired(at::TensorList x, at::TensorList weight,
                                              const std::optional<at::TensorList>& bias,
                                              const QuantLists& q, const FloatTypes& ft,
                                              const at::Tensor& group_list,
                                              std::optional<int64_t> split_item,
                                              std::optional<int64_t> group_type,
                                              std::optional<int64_t> act_type,
                                              std::optional<at::ScalarType> output_dtype) {
  OPENNPU_CHECK_ARG(group_list.dim() == 2 && group_list.size(1) == 2, kOp, "group_list",
                    "must be [E, 2] (group index, group size) pairs with group_list_type 2, but "
                    "got shape ", shape_str(group_list.sizes()));
  check_strict_dtype(kOp, "group_list", group_list, {at::kLong});
  OPENNPU_CHECK_ARG(group_type.value_or(-1) == 0, kOp, "group_type",
                    "must be 0 (x's rows grouped) with group_list_type 2, but got ",
                    group_type.value_or(-1));
  OPENNPU_CHECK_ARG(split_item.value_or(0) >= 2, kOp, "split_item",
                    "must be 2 or 3 (one output) with group_list_type 2, but got ",
                    split_item.value_or(0));
  OPENNPU_CHECK_ARG(x.size() == 1 && x[0].defined() && x[0].dim() == 2, kOp, "x",
                    "must be one 2-D tensor [M, K] with group_list_type 2");
  OPENNPU_CHECK_ARG(!weight.empty() && weight[0].defined(), kOp, "weight",
                    "must hold at least one tensor");
  const int64_t groups = weight.size() == 1 && weight[0].dim() == 3
                             ? weight[0].size(0) : static_cast<int64_t>(weight.size());
  const at::Tensor pairs = group_list.to(at::kLong).contiguous();
  const int64_t* pv = pairs.const_data_ptr<int64_t>();
  const int64_t entries = pairs.size(0), m = x[0].size(0);
  std::vector<int64_t> sizes(groups, 0);
  bool in_order = true;
  int64_t total = 0, last = 0;
  for (int64_t i = 0; i < entries; ++i) {
    const int64_t g = pv[2 * i], n = pv[2 * i + 1];
    OPENNPU_CHECK_ARG(g >= 0 && g < groups, kOp, "group_list",
                      "must hold group indices in [0, ", groups, ") in its first column, but "
                      "entry ", i, " has ", g);
    OPENNPU_CHECK_ARG(n >= 0 && n <= m - total, kOp, "group_list",
                      "must hold non-negative group sizes in its second column that sum to x's ",
                      m, " rows, but entry ", i, " has ", n, " after ", total);
    sizes[g] += n;
    total += n;
    if (n > 0) {  // entries of no rows (npu_moe_init_routing_v2 pads with (0, 0)) place nothing
      in_order = in_order && g >= last;
      last = g;
    }
  }
  OPENNPU_CHECK_ARG(total == m, kOp, "group_list", "must hold group sizes that sum to x's ", m,
                    " rows, but they sum to ", total);
  if (in_order) {  // x's rows are already in group order
    return grouped_matmul(x, weight, bias, q, ft, sizes, split_item, group_type, 1, act_type,
                          output_dtype);
  }
  // perm[j]: the x row that goes j-th in group order (entries stably sorted by group index)
  std::vector<int64_t> order(entries), start(entries);
  for (int64_t i = 0, r = 0; i < entries; r += pv[2 * i + 1], ++i) start[i] = r;
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return pv[2 * a] < pv[2 * b]; });
  at::Tensor perm = at::empty({m}, at::kLong);
  int64_t* pp = perm.mutable_data_ptr<int64_t>();
  for (int64_t i : order) {
    for (int64_t r = 0; r < pv[2 * i + 1]; ++r) *pp++ = start[i] + r;
  }
  perm = perm.to(x[0].device());
  const std::vector<at::Tensor> xs{x[0].index_select(0, perm)};
  std::vector<at::Tensor> row_scales;  // per_token_scale: one row per row of x
  QuantLists qs = q;
  for (const at::Tensor& t : q.per_token_scale) {
    row_scales.push_back(t.defined() && t.dim() >= 1 && t.size(0) == m ? t.index_select(0, perm)
                                                                        : t);
  }
  qs.per_token_scale = row_scales;
  std::vector<at::Tensor> out = grouped_matmul(xs, weight, bias, qs, ft, sizes, split_item,
                                               group_type, 1, act_type, output_dtype);
  at::Tensor y = at::empty_like(out[0]);
  y.index_copy_(0, perm, out[0]);  // row perm[j] of the result is row j of the grouped product
  return {y};
}

}  // namespace

std::vector<at::Tensor> npu_grouped_matmul(
    at::TensorList x, at::TensorList weight, const std::optional<at::TensorList>& bias,
    const std::optional<at::TensorList>& scale, const std::optional<at::TensorList>& offset,
    const std::optional<at::TensorList>& antiquant_scale,
    const std::optional<at::TensorList>& antiquant_offset,
    const std::optional<at::TensorList>& per_token_scale,
    const std::optional<at::Tensor>& group_list,
    const std::optional<at::TensorList>& activation_input,
    const std::optional<at::TensorList>& activation_quant_scale,
    const std::optional<at::TensorList>& activation_quant_offset,
    std::optional<int64_t> split_item, std::optional<int64_t> group_type,
    std::optional<int64_t> group_list_type, std::optional<int64_t> act_type,
    at::OptionalIntArrayRef tuning_config, std::optional<int64_t> output_dtype,
    std::optional<int64_t> x_dtype, std::optional<int64_t> weight_dtype,
    std::optional<int64_t> scale_dtype, std::optional<int64_t> per_token_scale_dtype) {
  (void)tuning_config;  // a tiling hint (expected tokens per expert); nothing to tune here
  const QuantLists q = quant_lists(scale, offset, antiquant_scale, antiquant_offset,
                                   per_token_scale, activation_input, activation_quant_scale,
                                   activation_quant_offset);
  // float8 / float4 x and weights (their dtypes, or bytes named so) take the float8 / MX path,
  // which reads the scales' dtype arguments itself; elsewhere every dtype argument must name its
  // tensors' own dtype.
  FloatTypes ft = float_types(x, weight, x_dtype, weight_dtype);
  ft.scale_dtype = scale_dtype;
  ft.per_token_scale_dtype = per_token_scale_dtype;
  if (!ft.x.has_value() && !ft.w.has_value()) {
    check_declared_dtype("x_dtype", x_dtype, x, "x");
    check_declared_dtype("weight_dtype", weight_dtype, weight, "weight");
    check_declared_dtype("scale_dtype", scale_dtype, q.scale, "scale");
    check_declared_dtype("per_token_scale_dtype", per_token_scale_dtype, q.per_token_scale,
                         "per_token_scale");
  }
  // op-plugin requires it on this overload, in these words (its tests match them).
  OPENNPU_CHECK_ARG(group_type.has_value(), kOp, "group_type",
                    "is missing: Requires manual passing group_type, current is None (pass -1 for "
                    "x[i] @ weight[i] or 0 to group x's rows by group_list)");
  std::optional<std::vector<int64_t>> values;
  if (group_list.has_value() && group_list->defined()) {
    const at::Tensor& gl = *group_list;
    OPENNPU_CHECK_ARG(gl.scalar_type() == at::kLong || gl.scalar_type() == at::kInt, kOp,
                      "group_list", "must be int64 (or int32), but got ", gl.scalar_type());
    if (group_list_type.value_or(0) == 2) {
      return grouped_matmul_paired(x, weight, bias, q, ft, gl, split_item, group_type, act_type,
                                   dtype_from_code("output_dtype", output_dtype));
    }
    OPENNPU_CHECK_ARG(gl.dim() == 1, kOp, "group_list", "must be 1-D (one entry per group), but "
                      "got shape ", shape_str(gl.sizes()),
                      gl.dim() == 2 ? " ([group, size] pairs need group_list_type 2)" : "");
    check_strict_dtype(kOp, "group_list", gl, {at::kLong});
    const at::Tensor c = gl.to(at::kLong).contiguous();
    values.emplace(c.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>() + c.numel());
  }
  return grouped_matmul(x, weight, bias, q, ft, values, split_item, group_type, group_list_type,
                        act_type, dtype_from_code("output_dtype", output_dtype));
}

std::vector<at::Tensor> npu_grouped_matmul_list(
    at::TensorList x, at::TensorList weight, const std::optional<at::TensorList>& bias,
    const std::optional<at::TensorList>& scale, const std::optional<at::TensorList>& offset,
    const std::optional<at::TensorList>& antiquant_scale,
    const std::optional<at::TensorList>& antiquant_offset,
    const std::optional<at::TensorList>& per_token_scale, at::OptionalIntArrayRef group_list,
    const std::optional<at::TensorList>& activation_input,
    const std::optional<at::TensorList>& activation_quant_scale,
    const std::optional<at::TensorList>& activation_quant_offset,
    std::optional<int64_t> split_item, std::optional<int64_t> group_type,
    std::optional<int64_t> group_list_type, std::optional<int64_t> act_type,
    std::optional<at::ScalarType> output_dtype) {
  const QuantLists q = quant_lists(scale, offset, antiquant_scale, antiquant_offset,
                                   per_token_scale, activation_input, activation_quant_scale,
                                   activation_quant_offset);
  OPENNPU_CHECK_ARG(act_type.value_or(0) == 0, kOp, "act_type",
                    "must be 0 or None with an int[] group_list (npu_grouped_matmul.List; as on "
                    "Ascend, activations need a Tensor group_list), but got ", *act_type);
  std::optional<std::vector<int64_t>> values;
  if (group_list.has_value()) values.emplace(group_list->begin(), group_list->end());
  return grouped_matmul(x, weight, bias, q, float_types(x, weight, std::nullopt, std::nullopt),
                        values, split_item, group_type, group_list_type, act_type, output_dtype);
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_grouped_matmul", &npu_grouped_matmul);
  m.impl("npu_grouped_matmul.List", &npu_grouped_matmul_list);
}

}  // namespace opennpu::moe
