// Entry points of the MoE routing ops: validation, the routing sort, CPU registration.
//
// npu_moe_init_routing sorts the N*K (token, slot) pairs by expert with a stable counting sort
// (one histogram pass, one scatter pass: O(N*K + E), no comparisons) and then gathers the rows of
// x in that order in parallel; npu_moe_compute_expert_tokens binary-searches the sorted experts.
// Both are integer work with no SIMD in it, so they live here rather than in moe_cpu.cpp.
#include "ops/moe/moe.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"

namespace opennpu::moe {

KernelSlots<GatingFn> gating;
KernelSlots<GatingV2Fn> gating_v2;
KernelSlots<FinalizeFn> finalize;
KernelSlots<GatherRowsFn> gather_rows_slots;

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
// torch_npu's limit on npu_moe_gating_top_k_softmax's k.
constexpr int64_t kStrictMaxK = 1024;

void check_shape(const char* op, const char* arg, const at::Tensor& t,
                 c10::IntArrayRef expected, const char* what) {
  OPENNPU_CHECK_ARG(t.sizes().equals(expected), op, arg, "must have shape ",
                    shape_str(expected), " (", what, "), but got ", shape_str(t.sizes()));
}

}  // namespace

void check_index(const char* op, const char* arg, const at::Tensor& t) {
  OPENNPU_CHECK_ARG(t.defined(), op, arg, "must be a tensor, but got None");
  OPENNPU_CHECK_ARG(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, arg,
                    "must be int32 (or int64), but got ", t.scalar_type());
  check_strict_dtype(op, arg, t, {at::kInt});
}

std::vector<int64_t> index_values(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kLong).contiguous();
  const int64_t* p = c.const_data_ptr<int64_t>();
  return std::vector<int64_t>(p, p + c.numel());
}

// ----------------------------------------------------------------------------- gating

namespace {

// The checks both gating ops share (x, k in [k_min, E], finished); returns finished, contiguous,
// or an undefined tensor.
at::Tensor check_gating_args(const char* op, const at::Tensor& x,
                             const std::optional<at::Tensor>& finished, int64_t k, int64_t k_min) {
  check_floating(op, "x", x);
  OPENNPU_CHECK_ARG(x.dim() >= 1, op, "x",
                    "must have at least 1 dim (the experts are the last), but got a 0-dim tensor");
  check_strict_dtype(op, "x", x, {at::kHalf, at::kBFloat16, at::kFloat});
  check_strict_rank(op, "x", x, 2, 3);
  const int64_t e = x.size(-1);
  OPENNPU_CHECK_ARG(k >= k_min && k <= e, op, "k", "must be in [", k_min, ", ", e,
                    "] (the number of experts, x.size(-1)), but got ", k);
  OPENNPU_CHECK_STRICT(k <= kStrictMaxK, op, "k", "must be at most ", kStrictMaxK, ", but got ", k);
  OPENNPU_CHECK_ARG(e <= kInt32Max, op, "x", "must have at most ", kInt32Max,
                    " experts (int32 indices), but got ", e);
  if (!finished.has_value() || !finished->defined()) return at::Tensor();
  const at::Tensor& done = *finished;
  OPENNPU_CHECK_ARG(done.scalar_type() == at::kBool, op, "finished", "must be bool, but got ",
                    done.scalar_type());
  check_same_device(op, "finished", done, "x", x);
  check_shape(op, "finished", done, x.sizes().slice(0, x.dim() - 1), "x.shape[:-1]");
  return done.contiguous();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_moe_gating_top_k_softmax(
    const at::Tensor& x, const std::optional<at::Tensor>& finished, int64_t k) {
  constexpr const char* op = "npu_moe_gating_top_k_softmax";
  const at::Tensor done = check_gating_args(op, x, finished, k, 1);
  const int64_t e = x.size(-1);
  const int64_t rows = x.numel() / e;
  OPENNPU_CHECK_ARG(rows * k <= kInt32Max, op, "x",
                    "must have rows * k <= 2^31 - 1 (row_idx is int32), but got ", rows, " rows");

  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = k;
  at::Tensor y = at::empty(out_shape, x.options());
  at::Tensor expert_idx = at::empty(out_shape, x.options().dtype(at::kInt));
  at::Tensor row_idx = at::empty(out_shape, x.options().dtype(at::kInt));
  if (rows == 0) return {y, expert_idx, row_idx};
  const at::Tensor xc = x.contiguous().view({rows, e});
  at::Tensor y2 = y.view({rows, k}), i2 = expert_idx.view({rows, k}), r2 = row_idx.view({rows, k});
  gating.get(op, xc)(xc, done.defined() ? done.const_data_ptr<bool>() : nullptr, k, y2, i2, r2);
  return {y, expert_idx, row_idx};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_moe_gating_top_k_softmax_v2(
    const at::Tensor& x, int64_t k, const std::optional<at::Tensor>& finished,
    std::optional<int64_t> renorm_opt, std::optional<bool> output_softmax) {
  constexpr const char* op = "npu_moe_gating_top_k_softmax_v2";
  const at::Tensor done = check_gating_args(op, x, finished, k, 0);
  const int64_t e = x.size(-1);
  const int64_t renorm = renorm_opt.value_or(0);
  OPENNPU_CHECK_ARG(renorm == 0 || renorm == 1, op, "renorm",
                    "must be 0 (top k of the softmax) or 1 (softmax of the top k logits), but got ",
                    renorm);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = k;
  at::Tensor y = at::empty(out_shape, x.options());
  at::Tensor expert_idx = at::empty(out_shape, x.options().dtype(at::kInt));
  // The full softmax (float32) only for renorm 0 with output_softmax; else an empty [0].
  const bool want_softmax = renorm == 0 && output_softmax.value_or(false);
  at::Tensor softmax = at::empty(want_softmax ? x.sizes() : c10::IntArrayRef{0},
                                 x.options().dtype(at::kFloat));
  const int64_t rows = e > 0 ? x.numel() / e : 0;
  if (rows == 0 || (k == 0 && !want_softmax)) return {y, expert_idx, softmax};
  const at::Tensor xc = x.contiguous().view({rows, e});
  at::Tensor y2 = y.view({rows, k}), i2 = expert_idx.view({rows, k});
  at::Tensor probs = want_softmax ? (acc_dtype(x) == at::kFloat ? softmax.view({rows, e})
                                                                : at::empty({rows, e}, x.options()))
                                  : at::Tensor();
  gating_v2.get(op, xc)(xc, done.defined() ? done.const_data_ptr<bool>() : nullptr, k,
                        renorm == 1, y2, i2, probs);
  if (want_softmax && acc_dtype(x) != at::kFloat) softmax.copy_(probs.view(x.sizes()));
  return {y, expert_idx, softmax};
}

// ----------------------------------------------------------------------------- init routing

// A stable sort of the N*K (token, slot) pairs by expert: order[p] = the flat position
// (i * K + j) of the p-th pair. Counting sort over [lo, hi] when that range is small next to N*K,
// else std::stable_sort.
std::vector<int64_t> sort_by_expert(const std::vector<int64_t>& expert) {
  const int64_t n = static_cast<int64_t>(expert.size());
  std::vector<int64_t> order(n);
  if (n == 0) return order;
  const auto [lo_it, hi_it] = std::minmax_element(expert.begin(), expert.end());
  const int64_t lo = *lo_it, hi = *hi_it;
  if (hi - lo < std::max<int64_t>(4 * n, 1 << 16)) {
    std::vector<int64_t> start(hi - lo + 2, 0);
    for (int64_t v : expert) ++start[v - lo + 1];
    std::partial_sum(start.begin(), start.end(), start.begin());
    for (int64_t p = 0; p < n; ++p) order[start[expert[p] - lo]++] = p;
  } else {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&expert](int64_t a, int64_t b) { return expert[a] < expert[b]; });
  }
  return order;
}

void gather_rows(const char* op, const at::Tensor& x, const int64_t* src_row, int64_t rows,
                 at::Tensor& out) {
  if (rows == 0 || x.size(1) == 0) return;
  gather_rows_slots.get(op, x)(x, src_row, rows, out);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_moe_init_routing(const at::Tensor& x,
                                                                     const at::Tensor& row_idx,
                                                                     const at::Tensor& expert_idx,
                                                                     c10::SymInt active_num_sym) {
  constexpr const char* op = "npu_moe_init_routing";
  const int64_t active_num = active_num_sym.expect_int();
  OPENNPU_CHECK_ARG(x.defined(), op, "x", "must be a tensor, but got None");
  OPENNPU_CHECK_ARG(x.dim() == 2, op, "x", "must be 2-D [num_rows, H], but got shape ",
                    shape_str(x.sizes()));
  check_strict_dtype(op, "x", x, {at::kHalf, at::kBFloat16, at::kFloat});
  check_index(op, "expert_idx", expert_idx);
  check_index(op, "row_idx", row_idx);
  check_same_device(op, "expert_idx", expert_idx, "x", x);
  check_same_device(op, "row_idx", row_idx, "x", x);
  OPENNPU_CHECK_ARG(expert_idx.dim() == 2 && expert_idx.size(0) == x.size(0), op, "expert_idx",
                    "must be 2-D [num_rows, k] with num_rows = x.size(0) = ", x.size(0),
                    ", but got shape ", shape_str(expert_idx.sizes()));
  check_shape(op, "row_idx", row_idx, expert_idx.sizes(), "the shape of expert_idx");
  OPENNPU_CHECK_ARG(active_num >= 0, op, "active_num", "must be >= 0, but got ", active_num);
  const int64_t n = x.size(0), h = x.size(1), k = expert_idx.size(1), nk = n * k;
  OPENNPU_CHECK_ARG(nk <= kInt32Max, op, "expert_idx",
                    "must have at most 2^31 - 1 entries (int32 outputs), but got ", nk);

  const std::vector<int64_t> expert = index_values(expert_idx);
  const std::vector<int64_t> source = index_values(row_idx);
  for (int64_t v : expert) {
    OPENNPU_CHECK_ARG(v >= std::numeric_limits<int32_t>::min() && v <= kInt32Max, op,
                      "expert_idx", "must hold int32 values, but got ", v);
  }
  const std::vector<int64_t> order = sort_by_expert(expert);

  at::Tensor expanded_row_idx = at::empty({nk}, x.options().dtype(at::kInt));
  at::Tensor expanded_expert_idx = at::empty({nk}, x.options().dtype(at::kInt));
  int32_t* pos_of = expanded_row_idx.mutable_data_ptr<int32_t>();
  int32_t* sorted = expanded_expert_idx.mutable_data_ptr<int32_t>();
  std::vector<int64_t> gather_row(nk);  // x row of each expanded row
  std::vector<bool> seen(nk, false);
  for (int64_t p = 0; p < nk; ++p) {
    const int64_t flat = order[p];
    const int64_t src = source[flat];
    OPENNPU_CHECK_ARG(src >= 0 && src < nk && !seen[src], op, "row_idx",
                      "must be a permutation of [0, num_rows * k) = [0, ", nk,
                      ") (e.g. arange(num_rows * k).view(k, num_rows).t()), but got ",
                      src < 0 || src >= nk ? "the value " : "a repeated value ", src);
    seen[src] = true;
    sorted[p] = static_cast<int32_t>(expert[flat]);
    pos_of[src] = static_cast<int32_t>(p);
    gather_row[p] = src % n;
  }

  const int64_t out_rows = std::min(active_num, n) * k;
  at::Tensor expanded_x = at::empty({out_rows, h}, x.options());
  gather_rows(op, x.contiguous(), gather_row.data(), out_rows, expanded_x);
  return {expanded_x, expanded_row_idx, expanded_expert_idx};
}

// ----------------------------------------------------------------------------- expert tokens

at::Tensor npu_moe_compute_expert_tokens(const at::Tensor& sorted_expert_for_source_row,
                                         int64_t num_expert) {
  constexpr const char* op = "npu_moe_compute_expert_tokens";
  const at::Tensor& sorted = sorted_expert_for_source_row;
  check_index(op, "sorted_expert_for_source_row", sorted);
  OPENNPU_CHECK_ARG(sorted.dim() == 1, op, "sorted_expert_for_source_row",
                    "must be 1-D, but got shape ", shape_str(sorted.sizes()));
  // Expert ids are int32 on Ascend, so the count fits one; Ascend's kernel also caps it at 2048.
  OPENNPU_CHECK_ARG(num_expert >= 0 && num_expert <= kInt32Max, op, "num_expert",
                    "must be in [0, 2147483647] (a count of int32 expert ids), but got ", num_expert);
  OPENNPU_CHECK_STRICT(num_expert >= 1 && num_expert <= 2048, op, "num_expert",
                       "must be in [1, 2048], but got ", num_expert);
  const std::vector<int64_t> values = index_values(sorted);
  const auto unsorted = std::is_sorted_until(values.begin(), values.end());
  OPENNPU_CHECK_ARG(unsorted == values.end(), op, "sorted_expert_for_source_row",
                    "must be sorted in non-decreasing order (e.g. npu_moe_init_routing's "
                    "expanded_expert_idx), but position ", unsorted - values.begin(), " holds ",
                    unsorted == values.end() ? 0 : *unsorted, " after ",
                    unsorted == values.end() ? 0 : *(unsorted - 1));
  OPENNPU_CHECK_ARG(sorted.scalar_type() == at::kLong ||
                        static_cast<int64_t>(values.size()) <= kInt32Max,
                    op, "sorted_expert_for_source_row", "must have at most 2^31 - 1 entries");
  // out[e] = the number of rows of experts <= e, i.e. one past the last row of expert e.
  at::Tensor out = at::empty({num_expert}, sorted.options().dtype(at::kLong));
  int64_t* ends = out.mutable_data_ptr<int64_t>();
  for (int64_t e = 0; e < num_expert; ++e) {
    ends[e] = std::upper_bound(values.begin(), values.end(), e) - values.begin();
  }
  return out.to(sorted.scalar_type());
}

// ----------------------------------------------------------------------------- finalize routing

at::Tensor npu_moe_finalize_routing(const at::Tensor& expanded_permuted_rows,
                                    const std::optional<at::Tensor>& skip1_opt,
                                    const std::optional<at::Tensor>& skip2_opt,
                                    const std::optional<at::Tensor>& bias_opt,
                                    const std::optional<at::Tensor>& scales_opt,
                                    const at::Tensor& expanded_src_to_dst_row,
                                    const std::optional<at::Tensor>& expert_opt,
                                    std::optional<int64_t> drop_pad_mode_opt,
                                    std::optional<int64_t> k_opt) {
  constexpr const char* op = "npu_moe_finalize_routing";
  const at::Tensor& rows = expanded_permuted_rows;
  const auto given = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined();
  };
  const at::Tensor skip1 = given(skip1_opt) ? *skip1_opt : at::Tensor();
  const at::Tensor skip2 = given(skip2_opt) ? *skip2_opt : at::Tensor();
  const at::Tensor bias = given(bias_opt) ? *bias_opt : at::Tensor();
  const at::Tensor scales = given(scales_opt) ? *scales_opt : at::Tensor();
  const at::Tensor expert = given(expert_opt) ? *expert_opt : at::Tensor();
  const at::Tensor& src = expanded_src_to_dst_row;
  const int64_t mode = drop_pad_mode_opt.value_or(0);
  OPENNPU_CHECK_ARG(mode >= 0 && mode <= 3, op, "drop_pad_mode",
                    "must be 0 (dropless, expanded_src_to_dst_row column-major), 1 (drop-pad, "
                    "column-major), 2 (dropless, row-major) or 3 (drop-pad, row-major), but got ",
                    mode);
  const bool drop_pad = mode == 1 || mode == 3;
  const bool row_major = mode >= 2;

  check_floating(op, "expanded_permuted_rows", rows);
  check_strict_dtype(op, "expanded_permuted_rows", rows, {at::kHalf, at::kBFloat16, at::kFloat});
  OPENNPU_CHECK_ARG(rows.dim() == 2 || (drop_pad && rows.dim() == 3), op,
                    "expanded_permuted_rows", "must be ",
                    drop_pad ? "[E, C, H] (or [E * C, H]) with drop_pad_mode " :
                               "2-D [num_rows * k, H] with drop_pad_mode ",
                    mode, ", but got shape ", shape_str(rows.sizes()));
  const int64_t h = rows.size(-1);
  const int64_t r = rows.dim() == 3 ? rows.size(0) * rows.size(1) : rows.size(0);
  check_index(op, "expanded_src_to_dst_row", src);
  OPENNPU_CHECK_ARG(src.dim() == 1, op, "expanded_src_to_dst_row",
                    "must be 1-D [num_rows * k], but got shape ", shape_str(src.sizes()));
  const int64_t nk = src.size(0);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"skip1", skip1},
                                {"skip2", skip2}, {"bias", bias}, {"scales", scales},
                                {"export_for_source_row", expert},
                                {"expanded_src_to_dst_row", src}}) {
    if (t.defined()) check_same_device(op, name, t, "expanded_permuted_rows", rows);
  }
  OPENNPU_CHECK_STRICT(skip1.defined() || !skip2.defined(), op, "skip2",
                       "must be None when skip1 is None");

  // num_rows and k: from scales [N, K]; else op-plugin's k argument when it is not 1 (num_rows =
  // len(expanded_src_to_dst_row) / k, as op-plugin sizes its output); else expert_for_source_row
  // [N, K], else the skips [N, H], else k = 1 (torch_npu's golden: K = scales.shape[1] if scales
  // is not None else 1).
  const int64_t k_arg = k_opt.value_or(1);
  OPENNPU_CHECK_ARG(k_arg >= 1, op, "k", "must be >= 1 (the slots per token), but got ", k_arg);
  int64_t n = -1, k = -1;
  if (scales.defined()) {
    OPENNPU_CHECK_ARG(scales.dim() == 2, op, "scales", "must be 2-D [num_rows, k], but got shape ",
                      shape_str(scales.sizes()));
    n = scales.size(0);
    k = scales.size(1);
    OPENNPU_CHECK_ARG(k_arg == 1 || k_arg == k, op, "k",
                      "must be 1 (the default) or scales.size(1) = ", k,
                      " when scales is given, but got ", k_arg);
  } else if (k_arg != 1) {
    OPENNPU_CHECK_ARG(nk % k_arg == 0, op, "expanded_src_to_dst_row",
                      "must have num_rows * k entries for k = ", k_arg, ", but got ", nk);
    k = k_arg;
    n = nk / k;
  } else if (expert.defined()) {
    OPENNPU_CHECK_ARG(expert.dim() == 2, op, "export_for_source_row",
                      "must be 2-D [num_rows, k], but got shape ", shape_str(expert.sizes()));
    n = expert.size(0);
    k = expert.size(1);
  } else if (skip1.defined() || skip2.defined()) {
    const at::Tensor& s = skip1.defined() ? skip1 : skip2;
    OPENNPU_CHECK_ARG(s.dim() == 2, op, skip1.defined() ? "skip1" : "skip2",
                      "must be 2-D [num_rows, H], but got shape ", shape_str(s.sizes()));
    n = s.size(0);
    OPENNPU_CHECK_ARG(n > 0 ? nk % n == 0 : nk == 0, op, "expanded_src_to_dst_row",
                      "must have num_rows * k entries for num_rows = ", n,
                      " (the rows of skip1 / skip2), but got ", nk);
    k = n > 0 ? nk / n : 1;
  } else {
    n = nk;
    k = 1;
  }
  OPENNPU_CHECK_ARG(n * k == nk, op, "expanded_src_to_dst_row",
                    "must have num_rows * k = ", n, " * ", k, " = ", n * k,
                    " entries, but got ", nk);
  const std::vector<int64_t> nk_shape{n, k}, nh_shape{n, h};
  if (scales.defined()) check_floating(op, "scales", scales);
  if (expert.defined()) {
    check_index(op, "export_for_source_row", expert);
    check_shape(op, "export_for_source_row", expert, nk_shape, "[num_rows, k]");
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"skip1", skip1},
                                {"skip2", skip2}}) {
    if (!t.defined()) continue;
    check_shape(op, name, t, nh_shape, "[num_rows, H] of the output");
    OPENNPU_CHECK_ARG(t.scalar_type() == rows.scalar_type(), op, name,
                      "must have the dtype of expanded_permuted_rows (", rows.scalar_type(),
                      "), but got ", t.scalar_type());
  }
  const auto acc = acc_dtype(rows);
  at::Tensor bias_acc;
  std::vector<int64_t> experts;
  if (bias.defined()) {
    check_floating(op, "bias", bias);
    OPENNPU_CHECK_ARG(bias.dim() == 2 && bias.size(1) == h, op, "bias",
                      "must be 2-D [E, H] with H = ", h, ", but got shape ",
                      shape_str(bias.sizes()));
    OPENNPU_CHECK_ARG(expert.defined(), op, "export_for_source_row",
                      "must be given with a bias (it picks each term's bias row), but got None");
    OPENNPU_CHECK_STRICT(bias.scalar_type() == rows.scalar_type(), op, "bias",
                         "must have the dtype of expanded_permuted_rows (", rows.scalar_type(),
                         "), but got ", bias.scalar_type());
    experts = index_values(expert);
    for (int64_t e : experts) {
      OPENNPU_CHECK_ARG(e >= 0 && e < bias.size(0), op, "export_for_source_row",
                        "must hold experts in [0, ", bias.size(0), ") (the rows of bias), but got ",
                        e);
    }
    bias_acc = bias.to(acc).contiguous();
  }
  OPENNPU_CHECK_STRICT(!scales.defined() || scales.scalar_type() == rows.scalar_type(), op,
                       "scales", "must have the dtype of expanded_permuted_rows (",
                       rows.scalar_type(), "), but got ", scales.scalar_type());

  // Each term's source row, as [N, K] (mode 0 / 1: src[j * N + i]; mode 2 / 3: src[i * K + j]).
  const std::vector<int64_t> src_values = index_values(src);
  std::vector<int32_t> term_src(nk), term_expert(experts.empty() ? 0 : nk);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t v = src_values[row_major ? i * k + j : j * n + i];
      OPENNPU_CHECK_ARG(v >= (drop_pad ? -1 : 0) && v < r, op, "expanded_src_to_dst_row",
                        "must hold rows of expanded_permuted_rows in [", drop_pad ? -1 : 0, ", ",
                        r, ")", drop_pad ? " (-1 = dropped)" : "", ", but got ", v);
      term_src[i * k + j] = static_cast<int32_t>(v);
      if (!experts.empty()) term_expert[i * k + j] = static_cast<int32_t>(experts[i * k + j]);
    }
  }

  at::Tensor out = at::empty(nh_shape, rows.options());
  if (out.numel() == 0) return out;
  const at::Tensor rows2 = rows.contiguous().view({r, h});
  const at::Tensor s1 = skip1.defined() ? skip1.contiguous() : at::Tensor();
  const at::Tensor s2 = skip2.defined() ? skip2.contiguous() : at::Tensor();
  const at::Tensor sc = scales.defined() ? scales.to(acc).contiguous() : at::Tensor();
  finalize.get(op, rows2)(rows2, s1, s2, bias_acc, sc, term_src.data(),
                       term_expert.empty() ? nullptr : term_expert.data(), k, out);
  return out;
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_moe_gating_top_k_softmax", &npu_moe_gating_top_k_softmax);
  m.impl("npu_moe_gating_top_k_softmax_v2", &npu_moe_gating_top_k_softmax_v2);
  m.impl("npu_moe_init_routing", &npu_moe_init_routing);
  m.impl("npu_moe_compute_expert_tokens", &npu_moe_compute_expert_tokens);
  m.impl("npu_moe_finalize_routing", &npu_moe_finalize_routing);
}

}  // namespace opennpu::moe
