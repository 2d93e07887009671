// Entry points of npu_moe_token_permute, npu_moe_token_unpermute and their gradient ops:
// validation, the stable sort of the (token, slot) pairs, the index lists the kernels of
// token_permute_cpu.cpp run on, CPU registration. See token_permute.h for the math.
//
// padded_mode=True (indices as [E, capacity] token lists) is not implemented: every entry point
// rejects it with a clear error.
#include "ops/moe/token_permute.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "ops/moe/moe.h"

namespace opennpu::moe {

KernelSlots<GatherSumFn> gather_sum;
KernelSlots<GatherSumBackwardFn> gather_sum_backward;

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

void check_not_padded(const char* op, bool padded_mode) {
  OPENNPU_CHECK_ARG(!padded_mode, op, "padded_mode",
                    "must be False: opennpu implements the dropless layout only (indices [T] or "
                    "[T, K] of experts), but got True");
}

void check_2d(const char* op, const char* arg, const at::Tensor& t, const char* what) {
  OPENNPU_CHECK_ARG(t.defined(), op, arg, "must be a tensor, but got None");
  OPENNPU_CHECK_ARG(t.dim() == 2, op, arg, "must be 2-D ", what, ", but got shape ",
                    shape_str(t.sizes()));
}

// The kernels' source row of each of the T*K (token, slot) pairs: sorted_indices[q] when it is a
// row of the R permuted rows, -1 for a pair that num_out_tokens dropped (values in [R, N)).
// distinct: the values must not repeat (the gradients write each permuted row once).
std::vector<int64_t> pair_rows(const char* op, const at::Tensor& sorted_indices, int64_t rows,
                               bool distinct) {
  std::vector<int64_t> src = index_values(sorted_indices);
  const int64_t n = static_cast<int64_t>(src.size());
  const int64_t limit = std::max(n, rows);
  std::vector<bool> seen(distinct ? rows : 0, false);
  for (int64_t& v : src) {
    OPENNPU_CHECK_ARG(v >= 0 && v < limit, op, "sorted_indices",
                      "must hold positions in [0, ", limit,
                      ") (where each (token, slot) pair went, as npu_moe_token_permute returns "
                      "them), but got ", v);
    if (v >= rows) {
      v = -1;
      continue;
    }
    if (distinct) {
      OPENNPU_CHECK_ARG(!seen[v], op, "sorted_indices",
                        "must not repeat a position (it is a permutation of [0, ", n,
                        ")), but got ", v, " twice");
      seen[v] = true;
    }
  }
  return src;
}

// probs [T, K] as the kernels' weights (accumulator dtype, contiguous).
at::Tensor prob_weights(const char* op, const at::Tensor& probs, const at::Tensor& rows,
                        int64_t t, int64_t k) {
  check_floating(op, "probs", probs);
  check_same_device(op, "probs", probs, "permuted_tokens", rows);
  OPENNPU_CHECK_ARG(probs.dim() == 2 && probs.size(0) == t && probs.size(1) == k, op, "probs",
                    "must have shape [", t, ", ", k,
                    "] ([num_tokens, topk] with num_tokens * topk = sorted_indices.numel()), "
                    "but got ", shape_str(probs.sizes()));
  return probs.to(acc_dtype(rows)).contiguous();
}

// Checks of npu_moe_token_unpermute(_grad)'s permuted_tokens / sorted_indices / probs; returns
// (T, K).
std::pair<int64_t, int64_t> check_unpermute_args(const char* op, const char* rows_name,
                                                  const at::Tensor& rows,
                                                  const at::Tensor& sorted_indices,
                                                  const std::optional<at::Tensor>& probs) {
  check_index(op, "sorted_indices", sorted_indices);
  check_same_device(op, "sorted_indices", sorted_indices, rows_name, rows);
  OPENNPU_CHECK_ARG(sorted_indices.dim() == 1, op, "sorted_indices",
                    "must be 1-D [num_tokens * topk], but got shape ",
                    shape_str(sorted_indices.sizes()));
  const int64_t n = sorted_indices.size(0);
  if (!given(probs)) return {n, 1};
  OPENNPU_CHECK_ARG(probs->dim() == 2, op, "probs",
                    "must be 2-D [num_tokens, topk], but got shape ", shape_str(probs->sizes()));
  const int64_t k = probs->size(1);
  OPENNPU_CHECK_ARG(k > 0 ? n % k == 0 : n == 0, op, "sorted_indices",
                    "must have num_tokens * topk entries for topk = probs.size(1) = ", k,
                    ", but got ", n);
  return {k > 0 ? n / k : probs->size(0), k};
}

// grad_tokens [T, H] in dtype of the permute: sum over each token's K slots of the permuted
// rows' gradients (dropped slots add 0).
at::Tensor permute_grad(const char* op, const at::Tensor& grad_permuted,
                        const at::Tensor& sorted_indices, int64_t t, at::ScalarType dtype,
                        int64_t k, bool padded_mode) {
  check_not_padded(op, padded_mode);
  check_2d(op, "grad_permuted_tokens", grad_permuted, "[num_out_tokens, H]");
  check_floating(op, "grad_permuted_tokens", grad_permuted);
  check_index(op, "sorted_indices", sorted_indices);
  check_same_device(op, "sorted_indices", sorted_indices, "grad_permuted_tokens", grad_permuted);
  OPENNPU_CHECK_ARG(t >= 0, op, "tokens", "must have >= 0 rows, but got ", t);
  OPENNPU_CHECK_ARG(k >= 1, op, "num_topK", "must be >= 1, but got ", k);
  OPENNPU_CHECK_ARG(sorted_indices.numel() == t * k, op, "sorted_indices",
                    "must have num_tokens * topk = ", t, " * ", k, " = ", t * k,
                    " entries, but got ", sorted_indices.numel());
  OPENNPU_CHECK_ARG(at::isFloatingType(dtype), op, "tokens_dtype",
                    "must be a floating dtype (the gradient's), but got ", dtype);
  const at::Tensor rows = grad_permuted.to(dtype).contiguous();
  const std::vector<int64_t> src = pair_rows(op, sorted_indices, rows.size(0), false);
  at::Tensor out = at::empty({t, rows.size(1)}, rows.options());
  if (out.numel() > 0) gather_sum.get(op, rows)(rows, src.data(), nullptr, k, out);
  return out;
}

// (grad_permuted [R, H], grad_probs [T, K] or 0-dim) of npu_moe_token_unpermute.
std::tuple<at::Tensor, at::Tensor> unpermute_grad(const char* op, const at::Tensor& permuted,
                                                  int64_t r, at::ScalarType dtype,
                                                  const at::Tensor& grad,
                                                  const at::Tensor& sorted_indices,
                                                  const std::optional<at::Tensor>& probs,
                                                  bool padded_mode) {
  check_not_padded(op, padded_mode);
  check_2d(op, "grad_unpermuted_tokens", grad, "[num_tokens, H]");
  check_floating(op, "grad_unpermuted_tokens", grad);
  OPENNPU_CHECK_ARG(at::isFloatingType(dtype), op, "permuted_tokens_dtype",
                    "must be a floating dtype, but got ", dtype);
  OPENNPU_CHECK_ARG(r >= 0, op, "permuted_tokens", "must have >= 0 rows, but got ", r);
  const auto [t, k] = check_unpermute_args(op, "grad_unpermuted_tokens", grad, sorted_indices,
                                           probs);
  OPENNPU_CHECK_ARG(grad.size(0) == t, op, "grad_unpermuted_tokens",
                    "must have num_tokens = ", t, " rows (sorted_indices.numel() / topk), but "
                    "got shape ", shape_str(grad.sizes()));
  const int64_t h = grad.size(1);
  const at::Tensor g = grad.to(dtype).contiguous();
  at::Tensor rows;
  if (given(probs)) {
    OPENNPU_CHECK_ARG(permuted.defined(), op, "permuted_tokens",
                      "must be given with probs (grad_probs needs the rows), but got None");
    check_same_device(op, "permuted_tokens", permuted, "grad_unpermuted_tokens", grad);
    OPENNPU_CHECK_ARG(permuted.dim() == 2 && permuted.size(0) == r && permuted.size(1) == h, op,
                      "permuted_tokens", "must have shape [", r, ", ", h, "], but got ",
                      shape_str(permuted.sizes()));
    rows = permuted.to(dtype).contiguous();
  }
  const std::vector<int64_t> src = pair_rows(op, sorted_indices, r, true);
  const int64_t live = std::count_if(src.begin(), src.end(), [](int64_t v) { return v >= 0; });
  // every row is written when every permuted row has its pair; else the others are 0
  at::Tensor grad_rows = live == r ? at::empty({r, h}, g.options())
                                   : at::zeros({r, h}, g.options());
  at::Tensor weight, grad_w, grad_probs;
  if (given(probs)) {
    weight = prob_weights(op, *probs, g, t, k);
    grad_w = at::empty({t, k}, weight.options());
  }
  if (g.numel() > 0 && k > 0) {
    gather_sum_backward.get(op, g)(g, rows, src.data(),
                                    weight.defined() ? weight.const_data_ptr() : nullptr, k,
                                    grad_rows,
                                    grad_w.defined() ? grad_w.mutable_data_ptr() : nullptr);
  } else if (grad_w.defined()) {
    grad_w.zero_();
  }
  if (given(probs)) {
    grad_probs = grad_w.to(probs->scalar_type());
  } else {
    grad_probs = at::zeros({}, grad.options());
  }
  return {grad_rows, grad_probs};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> npu_moe_token_permute(const at::Tensor& tokens,
                                                          const at::Tensor& indices,
                                                          std::optional<int64_t> num_out_tokens,
                                                          bool padded_mode) {
  constexpr const char* op = "npu_moe_token_permute";
  check_not_padded(op, padded_mode);
  check_2d(op, "tokens", tokens, "[num_tokens, H]");
  check_strict_dtype(op, "tokens", tokens, {at::kHalf, at::kBFloat16, at::kFloat});
  check_index(op, "indices", indices);
  check_same_device(op, "indices", indices, "tokens", tokens);
  OPENNPU_CHECK_ARG((indices.dim() == 1 || indices.dim() == 2) && indices.size(0) == tokens.size(0),
                    op, "indices", "must be [num_tokens] or [num_tokens, topk] with num_tokens = "
                    "tokens.size(0) = ", tokens.size(0), ", but got shape ",
                    shape_str(indices.sizes()));
  const int64_t n = indices.numel();
  const int64_t k = indices.dim() == 1 ? 1 : indices.size(1);
  OPENNPU_CHECK_ARG(n <= kInt32Max, op, "indices",
                    "must have at most 2^31 - 1 entries (sorted_indices is int32), but got ", n);
  const int64_t requested = num_out_tokens.value_or(0);
  // op-plugin's rule: > 0 caps the rows at N; <= 0 counts back from N (0 = all N pairs).
  const int64_t out_rows = requested > 0 ? std::min(requested, n) : requested + n;
  OPENNPU_CHECK_ARG(out_rows >= 0, op, "num_out_tokens",
                    "must be >= -indices.numel() = ", -n, " (<= 0 counts back from all ", n,
                    " pairs), but got ", requested);

  const std::vector<int64_t> order = sort_by_expert(index_values(indices));
  at::Tensor sorted_indices = at::empty({n}, indices.options().dtype(at::kInt));
  int32_t* pos_of = sorted_indices.mutable_data_ptr<int32_t>();
  for (int64_t p = 0; p < n; ++p) pos_of[order[p]] = static_cast<int32_t>(p);

  at::Tensor permuted = at::empty({out_rows, tokens.size(1)}, tokens.options());
  std::vector<int64_t> src_row(order.begin(), order.begin() + out_rows);
  for (int64_t& r : src_row) r /= k;
  gather_rows(op, tokens.contiguous(), src_row.data(), out_rows, permuted);
  return {permuted, sorted_indices};
}

at::Tensor npu_moe_token_permute_grad(const at::Tensor& tokens,
                                      const at::Tensor& grad_permuted_tokens,
                                      const at::Tensor& indices, const at::Tensor& sorted_indices,
                                      bool padded_mode) {
  constexpr const char* op = "npu_moe_token_permute_grad";
  check_2d(op, "tokens", tokens, "[num_tokens, H]");
  check_index(op, "indices", indices);
  OPENNPU_CHECK_ARG(indices.dim() == 1 || indices.dim() == 2, op, "indices",
                    "must be [num_tokens] or [num_tokens, topk], but got shape ",
                    shape_str(indices.sizes()));
  const int64_t k = indices.dim() == 1 ? 1 : indices.size(1);
  return permute_grad(op, grad_permuted_tokens, sorted_indices, tokens.size(0),
                      tokens.scalar_type(), k, padded_mode);
}

at::Tensor npu_moe_token_permute_grad_v2(const at::Tensor& grad_permuted_tokens,
                                         const at::Tensor& sorted_indices,
                                         c10::SymInt tokens_size_0,
                                         at::ScalarType tokens_dtype, int64_t num_topK,
                                         bool padded_mode) {
  return permute_grad("npu_moe_token_permute_grad_v2", grad_permuted_tokens, sorted_indices,
                      tokens_size_0.expect_int(), tokens_dtype, num_topK, padded_mode);
}

at::Tensor npu_moe_token_unpermute(const at::Tensor& permuted_tokens,
                                   const at::Tensor& sorted_indices,
                                   const std::optional<at::Tensor>& probs, bool padded_mode,
                                   at::OptionalIntArrayRef /*restore_shape*/) {
  constexpr const char* op = "npu_moe_token_unpermute";
  check_not_padded(op, padded_mode);
  check_2d(op, "permuted_tokens", permuted_tokens, "[num_permuted, H]");
  check_floating(op, "permuted_tokens", permuted_tokens);
  check_strict_dtype(op, "permuted_tokens", permuted_tokens,
                     {at::kHalf, at::kBFloat16, at::kFloat});
  const auto [t, k] = check_unpermute_args(op, "permuted_tokens", permuted_tokens,
                                           sorted_indices, probs);
  const at::Tensor rows = permuted_tokens.contiguous();
  const std::vector<int64_t> src = pair_rows(op, sorted_indices, rows.size(0), false);
  const at::Tensor weight = given(probs) ? prob_weights(op, *probs, rows, t, k) : at::Tensor();
  at::Tensor out = at::empty({t, rows.size(1)}, rows.options());
  if (out.numel() == 0) return out;
  if (k == 0) return out.zero_();
  gather_sum.get(op, rows)(rows, src.data(), weight.defined() ? weight.const_data_ptr() : nullptr,
                         k, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> npu_moe_token_unpermute_grad(
    const at::Tensor& permuted_tokens, const at::Tensor& grad_unpermuted_tokens,
    const at::Tensor& sorted_indices, const std::optional<at::Tensor>& probs, bool padded_mode,
    at::OptionalIntArrayRef /*restore_shape*/) {
  constexpr const char* op = "npu_moe_token_unpermute_grad";
  check_2d(op, "permuted_tokens", permuted_tokens, "[num_permuted, H]");
  check_floating(op, "permuted_tokens", permuted_tokens);
  return unpermute_grad(op, permuted_tokens, permuted_tokens.size(0),
                        permuted_tokens.scalar_type(), grad_unpermuted_tokens, sorted_indices,
                        probs, padded_mode);
}

std::tuple<at::Tensor, at::Tensor> npu_moe_token_unpermute_grad_v2(
    const at::Tensor& grad_unpermuted_tokens, const at::Tensor& sorted_indices,
    c10::SymInt permuted_tokens_size_0, at::ScalarType permuted_tokens_dtype,
    const std::optional<at::Tensor>& probs, bool padded_mode,
    at::OptionalIntArrayRef /*restore_shape*/, const std::optional<at::Tensor>& permuted_tokens) {
  return unpermute_grad("npu_moe_token_unpermute_grad_v2",
                        given(permuted_tokens) ? *permuted_tokens : at::Tensor(),
                        permuted_tokens_size_0.expect_int(), permuted_tokens_dtype,
                        grad_unpermuted_tokens,
                        sorted_indices, probs, padded_mode);
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_moe_token_permute", &npu_moe_token_permute);
  m.impl("npu_moe_token_permute_grad", &npu_moe_token_permute_grad);
  m.impl("npu_moe_token_permute_grad_v2", &npu_moe_token_permute_grad_v2);
  m.impl("npu_moe_token_unpermute", &npu_moe_token_unpermute);
  m.impl("npu_moe_token_unpermute_grad", &npu_moe_token_unpermute_grad);
  m.impl("npu_moe_token_unpermute_grad_v2", &npu_moe_token_unpermute_grad_v2);
}

}  // namespace opennpu::moe
