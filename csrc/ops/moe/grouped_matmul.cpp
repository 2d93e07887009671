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
// added in float32 before the output is rounded.
#include "ops/moe/grouped_matmul.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"

namespace opennpu::moe {

KernelSlots<GroupedGemmFn> grouped_gemm;

namespace {

constexpr const char* kOp = "npu_grouped_matmul";

std::string list_arg(const char* name, int64_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

// The quantisation / fused-activation arguments: opennpu implements the float paths only.
void check_absent(const char* name, const std::optional<at::TensorList>& list) {
  OPENNPU_CHECK_ARG(!list.has_value() || list->empty(), kOp, name,
                    "must be None: the quantised and fused-activation paths of "
                    "npu_grouped_matmul (scale, offset, antiquant_scale, antiquant_offset, "
                    "per_token_scale, activation_*) are not implemented by opennpu, but got a "
                    "list of ", list.has_value() ? list->size() : 0, " tensors");
}

using OptionalList = std::optional<at::TensorList>;

// Both overloads: the quantised and fused-activation arguments must be absent.
void check_no_quantisation(const OptionalList& scale, const OptionalList& offset,
                           const OptionalList& antiquant_scale, const OptionalList& antiquant_offset,
                           const OptionalList& per_token_scale, const OptionalList& activation_input,
                           const OptionalList& activation_quant_scale,
                           const OptionalList& activation_quant_offset) {
  check_absent("scale", scale);
  check_absent("offset", offset);
  check_absent("antiquant_scale", antiquant_scale);
  check_absent("antiquant_offset", antiquant_offset);
  check_absent("per_token_scale", per_token_scale);
  check_absent("activation_input", activation_input);
  check_absent("activation_quant_scale", activation_quant_scale);
  check_absent("activation_quant_offset", activation_quant_offset);
}

// The dtype codes of the Tensor overload (int?: a torch.dtype passed from Python arrives as its
// ScalarType number; torch_npu's own codes for packed types such as float4_e2m1fn_x2 or
// float8_e8m0fnu lie past ATen's ScalarTypes).
std::optional<at::ScalarType> dtype_from_code(const char* name, std::optional<int64_t> code) {
  if (!code.has_value()) return std::nullopt;
  const int64_t c = *code;
  OPENNPU_CHECK_ARG(c >= 0 && c < static_cast<int64_t>(at::ScalarType::NumOptions), kOp, name,
                    "must be None or a torch dtype; the code ", c, " is not one of PyTorch's "
                    "dtypes (torch_npu's packed / low-bit dtypes such as float4_e2m1fn_x2, "
                    "hifloat8 or float8_e8m0fnu belong to the quantised paths, which opennpu does "
                    "not implement)");
  return static_cast<at::ScalarType>(c);
}

// x_dtype / weight_dtype reinterpret the storage of x / weight (packed float4, hifloat8 ...), a
// quantised-path feature: accepted when None or equal to the tensors' own dtype (a no-op).
void check_storage_dtype(const char* name, std::optional<int64_t> code, at::TensorList tensors,
                         const char* tensors_name) {
  const std::optional<at::ScalarType> dtype = dtype_from_code(name, code);
  if (!dtype.has_value() || tensors.empty() || !tensors[0].defined()) return;
  OPENNPU_CHECK_ARG(*dtype == tensors[0].scalar_type(), kOp, name,
                    "must be None or the dtype of ", tensors_name, " (", tensors[0].scalar_type(),
                    "): reinterpreting ", tensors_name, "'s storage as another dtype belongs to "
                    "the quantised paths, which opennpu does not implement, but got ", *dtype);
}

// scale_dtype / per_token_scale_dtype describe tensors of the quantised paths, which must be None.
void check_quant_dtype_absent(const char* name, std::optional<int64_t> code,
                              const char* tensor_name) {
  OPENNPU_CHECK_ARG(!code.has_value(), kOp, name, "must be None: it gives the dtype of ",
                    tensor_name, ", an argument of the quantised paths of npu_grouped_matmul, "
                    "which opennpu does not implement, but got ", *code);
}

// Group sizes from group_list values: cumulative ends (type 0) or sizes (type 1).
std::vector<int64_t> group_sizes(const std::vector<int64_t>& values, int64_t type) {
  OPENNPU_CHECK_ARG(type == 0 || type == 1, kOp, "group_list_type",
                    "must be 0 (group_list holds cumulative row ends) or 1 (group sizes); 2 "
                    "([group, size] pairs) is an Ascend quantised-path format opennpu does not "
                    "implement, but got ", type);
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

std::vector<at::Tensor> grouped_matmul(at::TensorList x, at::TensorList weight,
                                       const std::optional<at::TensorList>& bias,
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
  OPENNPU_CHECK_ARG(act == 0, kOp, "act_type",
                    "must be 0: fused activations belong to Ascend's quantised path, which opennpu "
                    "does not implement (apply the activation to the output), but got ", act);
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

  // dtypes and the weights' groups.
  const at::ScalarType dtype = x[0].scalar_type();
  for (size_t i = 0; i < x.size(); ++i) {
    const std::string name = list_arg("x", i);
    OPENNPU_CHECK_ARG(x[i].defined(), kOp, name.c_str(), "must be a tensor, but got None");
    OPENNPU_CHECK_ARG(x[i].scalar_type() != at::kChar, kOp, name.c_str(),
                      "is int8: the quantised npu_grouped_matmul is not implemented by opennpu");
    check_floating(kOp, name.c_str(), x[i]);
    OPENNPU_CHECK_ARG(x[i].scalar_type() == dtype, kOp, name.c_str(),
                      "must have the dtype of x[0] (", dtype, "), but got ", x[i].scalar_type());
    check_same_device(kOp, name.c_str(), x[i], "x[0]", x[0]);
  }
  check_strict_dtype(kOp, "x[0]", x[0], {at::kHalf, at::kBFloat16, at::kFloat});
  OPENNPU_CHECK_ARG(!output_dtype.has_value() || *output_dtype == dtype, kOp, "output_dtype",
                    "must be None or x's dtype (", dtype, ") on the non-quantised path, but got ",
                    *output_dtype);
  const bool single_weight = weight.size() == 1 && weight[0].defined() && weight[0].dim() == 3;
  const int64_t groups = single_weight ? weight[0].size(0) : static_cast<int64_t>(weight.size());
  for (size_t i = 0; i < weight.size(); ++i) {
    const std::string name = list_arg("weight", i);
    const at::Tensor& w = weight[i];
    OPENNPU_CHECK_ARG(w.defined(), kOp, name.c_str(), "must be a tensor, but got None");
    OPENNPU_CHECK_ARG(w.scalar_type() == dtype, kOp, name.c_str(), "must have x's dtype (", dtype,
                      "), but got ", w.scalar_type(),
                      w.scalar_type() == at::kChar || w.scalar_type() == at::kInt
                          ? " (the quantised paths are not implemented by opennpu)" : "");
    OPENNPU_CHECK_ARG(w.dim() == 2 || single_weight, kOp, name.c_str(),
                      "must be 2-D [K, N] (or one 3-D [E, K, N] tensor as the only weight), but "
                      "got shape ", shape_str(w.sizes()));
    check_same_device(kOp, name.c_str(), w, "x[0]", x[0]);
  }
  const auto weight_of = [&](int64_t g) { return single_weight ? weight[0][g] : weight[g]; };
  if (group_type.value_or(-1) == 2) {
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

  // Shapes: K of every group, and N (equal across groups for a single output).
  std::vector<int64_t> k_of(groups), n_of(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const at::Tensor w = weight_of(g);
    k_of[g] = w.size(0);
    n_of[g] = w.size(1);
    const at::Tensor& xg = split_x ? x[0] : x[g];
    const std::string name = split_x ? std::string("x[0]") : list_arg("x", g);
    OPENNPU_CHECK_ARG(xg.size(-1) == k_of[g], kOp, name.c_str(), "must have K = ", k_of[g],
                      " columns (weight", single_weight ? "[0][" : "[", g, "] is ",
                      shape_str(w.sizes()), "), but got shape ", shape_str(xg.sizes()));
    OPENNPU_CHECK_ARG(!single_out || n_of[g] == n_of[0], kOp, "weight",
                      "must give every group the same N with split_item 2 or 3 (one output), but "
                      "group 0 has N = ", n_of[0], " and group ", g, " has N = ", n_of[g]);
  }

  // Bias: [N_g] per weight tensor, or [E, N] for a 3-D weight; kept in the accumulator dtype.
  const auto acc = acc_dtype(x[0]);
  std::vector<at::Tensor> bias_acc(groups);
  if (bias.has_value() && !bias->empty()) {
    OPENNPU_CHECK_ARG(bias->size() == weight.size(), kOp, "bias",
                      "must hold one tensor per weight tensor (", weight.size(), "), but got ",
                      bias->size());
    for (size_t i = 0; i < bias->size(); ++i) {
      const std::string name = list_arg("bias", i);
      const at::Tensor& b = (*bias)[i];
      check_floating(kOp, name.c_str(), b);
      OPENNPU_CHECK_ARG(b.scalar_type() == dtype || b.scalar_type() == acc, kOp, name.c_str(),
                        "must have x's dtype (", dtype, ") or ", acc, ", but got ",
                        b.scalar_type());
      check_same_device(kOp, name.c_str(), b, "x[0]", x[0]);
      if (single_weight) {
        OPENNPU_CHECK_ARG(b.dim() == 2 && b.size(0) == groups && b.size(1) == n_of[0], kOp,
                          name.c_str(), "must be [E, N] = [", groups, ", ", n_of[0],
                          "] for the 3-D weight, but got shape ", shape_str(b.sizes()));
        const at::Tensor all = b.to(acc).contiguous();
        for (int64_t g = 0; g < groups; ++g) bias_acc[g] = all[g];
      } else {
        OPENNPU_CHECK_ARG(b.dim() == 1 && b.size(0) == n_of[i], kOp, name.c_str(),
                          "must be 1-D [N] = [", n_of[i], "] (the columns of weight[", i,
                          "]), but got shape ", shape_str(b.sizes()));
        bias_acc[i] = b.to(acc).contiguous();
      }
    }
  }

  // Outputs, and one GEMM per non-empty group.
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> out_of(groups);  // [rows, N] view of each group's output
  const at::TensorOptions options = x[0].options();
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

  // fp32/fp16/bf16 groups without bias go to ATen's GEMM (MKL for fp32; oneDNN, AMX where the
  // CPU has it, for fp16/bf16, accumulating in fp32 and rounding once as our tiles do). It measured
  // faster at every group size tried, or level (2 threads, 8 groups: bf16 and fp16 at K=1024,
  // N=7168, M=16/128/512 rows each: bf16 11.3/19.3/48.1 ms against 15.9/26.3/84.5, fp16
  // 15.2/58.8/198 against 19.5/61.2/255; fp32 at M=4/64 rows, K=4096, N=14336: 122/283 ms
  // against 141/279, and K=7168, N=4096: 61.5/140 against 70.1/141). A bias stays on our tiles,
  // which add it in fp32 before the one rounding.
  const bool aten_gemm =
      dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat;
  std::vector<GemmGroup> gemms;
  std::vector<at::Tensor> keep;  // copies made for BLAS layouts
  const at::Tensor x0 = split_x ? fit(x[0]) : at::Tensor();
  int64_t start = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m = rows[g];
    const int64_t row0 = start;
    start += m;
    if (m == 0 || n_of[g] == 0) continue;
    if (aten_gemm && !bias_acc[g].defined()) {
      const at::Tensor a = split_x ? x[0].narrow(0, row0, m) : x[g].reshape({m, k_of[g]});
      at::mm_out(out_of[g], a, weight_of(g));
      continue;
    }
    at::Tensor a = split_x ? x0.narrow(0, row0, m) : fit(x[g].reshape({m, k_of[g]}));
    at::Tensor b = fit(weight_of(g));
    keep.push_back(a);
    keep.push_back(b);
    GemmGroup gemm = gemm_of(a, b, out_of[g].mutable_data_ptr(), n_of[g]);
    gemm.bias = bias_acc[g].defined() ? bias_acc[g].const_data_ptr() : nullptr;
    gemm.m = m;
    gemm.n = n_of[g];
    gemm.k = k_of[g];
    gemms.push_back(gemm);
  }
  grouped_gemm.get(kOp, x[0])(dtype, gemms);
  return outputs;
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
  check_no_quantisation(scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                        activation_input, activation_quant_scale, activation_quant_offset);
  check_storage_dtype("x_dtype", x_dtype, x, "x");
  check_storage_dtype("weight_dtype", weight_dtype, weight, "weight");
  check_quant_dtype_absent("scale_dtype", scale_dtype, "scale");
  check_quant_dtype_absent("per_token_scale_dtype", per_token_scale_dtype, "per_token_scale");
  // op-plugin requires it on this overload, in these words (its tests match them).
  OPENNPU_CHECK_ARG(group_type.has_value(), kOp, "group_type",
                    "is missing: Requires manual passing group_type, current is None (pass -1 for "
                    "x[i] @ weight[i] or 0 to group x's rows by group_list)");
  std::optional<std::vector<int64_t>> values;
  if (group_list.has_value() && group_list->defined()) {
    const at::Tensor& gl = *group_list;
    OPENNPU_CHECK_ARG(gl.scalar_type() == at::kLong || gl.scalar_type() == at::kInt, kOp,
                      "group_list", "must be int64 (or int32), but got ", gl.scalar_type());
    OPENNPU_CHECK_ARG(gl.dim() == 1, kOp, "group_list", "must be 1-D (one entry per group), but "
                      "got shape ", shape_str(gl.sizes()),
                      gl.dim() == 2 ? " ([group, size] pairs, group_list_type 2, are not "
                                      "implemented by opennpu)" : "");
    check_strict_dtype(kOp, "group_list", gl, {at::kLong});
    const at::Tensor c = gl.to(at::kLong).contiguous();
    values.emplace(c.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>() + c.numel());
  }
  return grouped_matmul(x, weight, bias, values, split_item, group_type, group_list_type, act_type,
                        dtype_from_code("output_dtype", output_dtype));
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
  check_no_quantisation(scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                        activation_input, activation_quant_scale, activation_quant_offset);
  std::optional<std::vector<int64_t>> values;
  if (group_list.has_value()) values.emplace(group_list->begin(), group_list->end());
  return grouped_matmul(x, weight, bias, values, split_item, group_type, group_list_type, act_type,
                        output_dtype);
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_grouped_matmul", &npu_grouped_matmul);
  m.impl("npu_grouped_matmul.List", &npu_grouped_matmul_list);
}

}  // namespace opennpu::moe
