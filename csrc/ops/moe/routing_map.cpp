// The routing-map forms of the MoE dispatch / combine (Megatron's permute / unpermute with a
// [T, E] routing map instead of top-k indices; Ascend MoeTokenPermuteWithRoutingMap,
// MoeTokenUnpermuteWithRoutingMap and their grads), on the kernels of token_permute_cpu.cpp.
//
// Dropless: the routed (token, expert) pairs, expert-major with tokens ascending, are the
// permuted rows; sorted_indices[q] is the row of the q-th pair in token-major order.
// Drop-and-pad: expert e keeps capacity = num_out_tokens / E slots, filled with its routed tokens
// in ascending order and then, as op-plugin's golden does (a descending stable sort of the map),
// with unrouted tokens in ascending order; sorted_indices[slot] is the slot's token.
//
// Every op then reduces to a per-token list of (permuted row, expert) terms, at most kmax per
// token (padded with -1), which the gather-sum kernels take as a [T, kmax] table.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"
#include "ops/moe/moe.h"
#include "ops/moe/token_permute.h"

namespace opennpu::moe {
namespace {

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The [T, E] routing map as bytes (nonzero = routed), checked.
std::vector<uint8_t> routed(const char* op, const at::Tensor& map, int64_t t,
                            const at::Tensor& ref, const char* ref_name) {
  OPENNPU_CHECK_ARG(map.defined(), op, "routing_map", "must be a tensor, but got None");
  check_same_device(op, "routing_map", map, ref_name, ref);
  OPENNPU_CHECK_ARG(map.scalar_type() == at::kBool || at::isIntegralType(map.scalar_type(), false),
                    op, "routing_map",
                    "must be bool or an integer dtype (nonzero = routed), but got ",
                    map.scalar_type());
  OPENNPU_CHECK_ARG(map.dim() == 2 && (t < 0 || map.size(0) == t), op, "routing_map",
                    "must be 2-D [num_tokens, num_experts] with num_tokens = ", t,
                    ", but got shape ", shape_str(map.sizes()));
  const at::Tensor b = map.ne(0).to(at::kByte).contiguous();
  const uint8_t* p = b.const_data_ptr<uint8_t>();
  return std::vector<uint8_t>(p, p + b.numel());
}

// Per-token terms (permuted row, expert), kmax per token, -1 = none.
struct Terms {
  int64_t kmax = 0;
  std::vector<int64_t> row, expert;
};

Terms pack(const std::vector<std::vector<std::pair<int64_t, int64_t>>>& lists) {
  Terms terms;
  for (const auto& l : lists) terms.kmax = std::max<int64_t>(terms.kmax, l.size());
  const int64_t t = static_cast<int64_t>(lists.size());
  terms.row.assign(t * terms.kmax, -1);
  terms.expert.assign(t * terms.kmax, -1);
  for (int64_t i = 0; i < t; ++i) {
    for (size_t j = 0; j < lists[i].size(); ++j) {
      terms.row[i * terms.kmax + j] = lists[i][j].first;
      terms.expert[i * terms.kmax + j] = lists[i][j].second;
    }
  }
  return terms;
}

// Dropless terms: token-major pairs of the map, pair q's row sorted_indices[q].
Terms dropless_terms(const char* op, const std::vector<uint8_t>& map, int64_t t, int64_t e,
                     const std::vector<int64_t>& sorted_indices, int64_t rows) {
  const int64_t pairs = std::count(map.begin(), map.end(), uint8_t{1});
  OPENNPU_CHECK_ARG(static_cast<int64_t>(sorted_indices.size()) == pairs, op, "sorted_indices",
                    "must have one entry per routed pair (routing_map.sum() = ", pairs,
                    "), but got ", sorted_indices.size());
  std::vector<std::vector<std::pair<int64_t, int64_t>>> lists(t);
  std::vector<bool> seen(rows, false);
  int64_t q = 0;
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t x = 0; x < e; ++x) {
      if (!map[i * e + x]) continue;
      const int64_t r = sorted_indices[q++];
      OPENNPU_CHECK_ARG(r >= 0 && r < rows && !seen[r], op, "sorted_indices",
                        "must be a permutation of [0, ", rows, ") (the permuted rows), but got ",
                        r, r >= 0 && r < rows ? " twice" : "");
      seen[r] = true;
      lists[i].emplace_back(r, x);
    }
  }
  return pack(lists);
}

// Drop-and-pad terms: slot s (expert s / capacity) holds token sorted_indices[s].
Terms padded_terms(const char* op, const std::vector<int64_t>& sorted_indices, int64_t t,
                   int64_t e) {
  const int64_t slots = static_cast<int64_t>(sorted_indices.size());
  OPENNPU_CHECK_ARG(e > 0 && slots % e == 0, op, "sorted_indices",
                    "must have num_experts * capacity entries for num_experts = ", e,
                    ", but got ", slots);
  const int64_t capacity = slots / e;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> lists(t);
  for (int64_t s = 0; s < slots; ++s) {
    const int64_t token = sorted_indices[s];
    OPENNPU_CHECK_ARG(token >= 0 && token < t, op, "sorted_indices",
                      "must hold tokens in [0, ", t, ") with drop_and_pad, but got ", token);
    lists[token].emplace_back(s, s / capacity);
  }
  return pack(lists);
}

// The weights probs[token, expert] of every term, in the accumulator dtype of `like`.
at::Tensor term_weights(const at::Tensor& probs, const Terms& terms, int64_t t,
                        const at::Tensor& like) {
  const at::Tensor p = probs.to(at::kDouble).contiguous();
  const double* pp = p.const_data_ptr<double>();
  const int64_t e = probs.size(1);
  at::Tensor w = at::empty({t * terms.kmax}, p.options());
  double* pw = w.mutable_data_ptr<double>();
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t j = 0; j < terms.kmax; ++j) {
      const int64_t x = terms.expert[i * terms.kmax + j];
      pw[i * terms.kmax + j] = x >= 0 ? pp[i * e + x] : 0.0;
    }
  }
  return w.to(acc_dtype(like));
}

// [T, E] from per-term values (0 where no term).
at::Tensor scatter_terms(const at::Tensor& values, const Terms& terms, int64_t t, int64_t e,
                         at::ScalarType dtype) {
  const at::Tensor v = values.to(at::kDouble).contiguous();
  const double* pv = v.const_data_ptr<double>();
  at::Tensor out = at::zeros({t, e}, v.options());
  double* po = out.mutable_data_ptr<double>();
  for (int64_t q = 0; q < t * terms.kmax; ++q) {
    if (terms.expert[q] >= 0) po[(q / terms.kmax) * e + terms.expert[q]] += pv[q];
  }
  return out.to(dtype);
}

void check_probs(const char* op, const at::Tensor& probs, int64_t t, int64_t e,
                 const at::Tensor& ref, const char* ref_name) {
  check_floating(op, "probs", probs);
  check_same_device(op, "probs", probs, ref_name, ref);
  OPENNPU_CHECK_ARG(probs.dim() == 2 && probs.size(0) == t && (e < 0 || probs.size(1) == e), op,
                    "probs", "must have the routing map's shape [", t, ", ", e, "], but got ",
                    shape_str(probs.sizes()));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> npu_moe_token_permute_with_routing_map(
    const at::Tensor& tokens, const at::Tensor& routing_map,
    const std::optional<at::Tensor>& probs, std::optional<int64_t> num_out_tokens,
    bool drop_and_pad) {
  constexpr const char* op = "npu_moe_token_permute_with_routing_map";
  OPENNPU_CHECK_ARG(tokens.dim() == 2, op, "tokens", "must be 2-D [num_tokens, H], but got shape ",
                    shape_str(tokens.sizes()));
  const int64_t t = tokens.size(0), h = tokens.size(1);
  const std::vector<uint8_t> map = routed(op, routing_map, t, tokens, "tokens");
  const int64_t e = routing_map.size(1);
  if (given(probs)) check_probs(op, *probs, t, e, tokens, "tokens");
  const int64_t requested = num_out_tokens.value_or(t);
  OPENNPU_CHECK_ARG(requested >= 0, op, "num_out_tokens", "must be >= 0, but got ", requested);
  // op-plugin's output rows: num_out_tokens rounded down to a multiple of T (dropless) or E.
  const int64_t unit = drop_and_pad ? e : t;
  const int64_t rows = unit > 0 ? requested / unit * unit : 0;

  std::vector<int64_t> src_row(rows), sorted(rows);
  std::vector<int64_t> prob_at(rows);  // flat index into probs of each row
  if (drop_and_pad) {
    const int64_t capacity = e > 0 ? rows / e : 0;
    OPENNPU_CHECK_ARG(capacity <= t, op, "num_out_tokens",
                      "must give a capacity (num_out_tokens / num_experts) of at most num_tokens "
                      "= ", t, " with drop_and_pad, but gives ", capacity);
    for (int64_t x = 0; x < e; ++x) {
      int64_t j = 0;
      for (int pass = 1; pass >= 0 && j < capacity; --pass) {  // routed tokens, then the rest
        for (int64_t i = 0; i < t && j < capacity; ++i) {
          if (map[i * e + x] != pass) continue;
          const int64_t s = x * capacity + j++;
          src_row[s] = sorted[s] = i;
          prob_at[s] = i * e + x;
        }
      }
    }
  } else {
    const int64_t pairs = std::count(map.begin(), map.end(), uint8_t{1});
    OPENNPU_CHECK_ARG(rows == pairs, op, "num_out_tokens",
                      "must give routing_map.sum() = ", pairs, " rows without drop_and_pad "
                      "(rounded down to a multiple of num_tokens = ", t, "), but gives ", rows);
    std::vector<int64_t> q_of(t * e, -1);  // token-major index of each routed pair
    for (int64_t q = 0, i = 0; i < t * e; ++i) {
      if (map[i]) q_of[i] = q++;
    }
    int64_t p = 0;
    for (int64_t x = 0; x < e; ++x) {
      for (int64_t i = 0; i < t; ++i) {
        if (!map[i * e + x]) continue;
        src_row[p] = i;
        prob_at[p] = i * e + x;
        sorted[q_of[i * e + x]] = p++;
      }
    }
  }
  at::Tensor permuted = at::empty({rows, h}, tokens.options());
  gather_rows(op, tokens.contiguous(), src_row.data(), rows, permuted);
  at::Tensor permuted_probs = at::empty({0}, tokens.options());
  if (given(probs)) {
    const at::Tensor flat = probs->contiguous().view({-1});
    at::Tensor index = at::empty({rows}, tokens.options().dtype(at::kLong));
    int64_t* pi = index.mutable_data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) pi[r] = prob_at[r];
    permuted_probs = flat.index_select(0, index);
  }
  at::Tensor sorted_indices = at::empty({rows}, tokens.options().dtype(at::kInt));
  int32_t* ps = sorted_indices.mutable_data_ptr<int32_t>();
  for (int64_t r = 0; r < rows; ++r) ps[r] = static_cast<int32_t>(sorted[r]);
  return {permuted, permuted_probs, sorted_indices};
}

std::tuple<at::Tensor, at::Tensor> npu_moe_token_permute_with_routing_map_grad(
    const at::Tensor& permuted_token_out_grad, const std::optional<at::Tensor>& probs_grad,
    const at::Tensor& sorted_indices, const at::Tensor& routing_map, c10::SymInt experts_num,
    c10::SymInt tokens_num, bool drop_and_pad) {
  constexpr const char* op = "npu_moe_token_permute_with_routing_map_grad";
  const at::Tensor& grad = permuted_token_out_grad;
  check_floating(op, "permuted_token_out_grad", grad);
  OPENNPU_CHECK_ARG(grad.dim() == 2, op, "permuted_token_out_grad",
                    "must be 2-D [rows, H], but got shape ", shape_str(grad.sizes()));
  const int64_t t = tokens_num.expect_int(), e = experts_num.expect_int();
  OPENNPU_CHECK_ARG(t >= 0 && e >= 0, op, "tokens_num",
                    "and experts_num must be >= 0, but got ", t, " and ", e);
  check_index(op, "sorted_indices", sorted_indices);
  const std::vector<uint8_t> map = routed(op, routing_map, t, grad, "permuted_token_out_grad");
  OPENNPU_CHECK_ARG(routing_map.size(1) == e, op, "routing_map",
                    "must have experts_num = ", e, " columns, but got ", routing_map.size(1));
  const std::vector<int64_t> si = index_values(sorted_indices);
  const int64_t rows = grad.size(0);
  OPENNPU_CHECK_ARG(static_cast<int64_t>(si.size()) == rows, op, "sorted_indices",
                    "must have one entry per permuted row (", rows, "), but got ", si.size());
  const Terms terms = drop_and_pad ? padded_terms(op, si, t, e)
                                   : dropless_terms(op, map, t, e, si, rows);
  const at::Tensor g = grad.contiguous();
  at::Tensor tokens_grad = at::empty({t, grad.size(1)}, grad.options());
  if (tokens_grad.numel() > 0) {
    if (terms.kmax > 0) {
      gather_sum.get(op, g)(g, terms.row.data(), nullptr, terms.kmax, tokens_grad);
    } else {
      tokens_grad.zero_();
    }
  }
  at::Tensor probs_out = at::empty({0}, grad.options());
  if (given(probs_grad)) {
    const at::Tensor& pg = *probs_grad;
    OPENNPU_CHECK_ARG(pg.dim() == 1 && pg.size(0) == rows, op, "probs_grad",
                      "must be [rows] = [", rows, "] (the gradient of permuted_probs), but got ",
                      shape_str(pg.sizes()));
    const at::Tensor v = pg.to(at::kDouble).contiguous();
    const double* pv = v.const_data_ptr<double>();
    at::Tensor per_term = at::zeros({t * terms.kmax}, v.options());
    double* pt = per_term.mutable_data_ptr<double>();
    for (int64_t q = 0; q < t * terms.kmax; ++q) {
      if (terms.row[q] >= 0) pt[q] = pv[terms.row[q]];
    }
    probs_out = scatter_terms(per_term, terms, t, e, pg.scalar_type());
  }
  return {tokens_grad, probs_out};
}

namespace {

// The terms of the unpermute ops: dropless from the map (or a uniform topk = rows / T without
// one), drop-and-pad from the slot tokens.
Terms unpermute_terms(const char* op, const std::vector<int64_t>& si, int64_t rows, int64_t t,
                      const std::optional<at::Tensor>& routing_map,
                      const std::optional<at::Tensor>& probs, bool drop_and_pad,
                      const at::Tensor& ref) {
  if (given(routing_map)) {
    const std::vector<uint8_t> map = routed(op, *routing_map, t, ref, "permuted_tokens");
    const int64_t e = routing_map->size(1);
    return drop_and_pad ? padded_terms(op, si, t, e) : dropless_terms(op, map, t, e, si, rows);
  }
  OPENNPU_CHECK_ARG(!given(probs) || drop_and_pad, op, "routing_map",
                    "must be given with probs without drop_and_pad (it places the weights), "
                    "but got None");
  if (drop_and_pad) {
    OPENNPU_CHECK_ARG(given(probs), op, "probs",
                      "or routing_map must be given with drop_and_pad (the number of experts), "
                      "but both are None");
    return padded_terms(op, si, t, probs->size(1));
  }
  OPENNPU_CHECK_ARG(t > 0 ? rows % t == 0 : rows == 0, op, "permuted_tokens",
                    "must have num_tokens * topk rows without a routing map (num_tokens = ", t,
                    "), but got ", rows);
  const int64_t k = t > 0 ? rows / t : 0;
  std::vector<std::vector<std::pair<int64_t, int64_t>>> lists(t);
  std::vector<bool> seen(rows, false);
  for (int64_t q = 0; q < t * k; ++q) {
    const int64_t r = si[q];
    OPENNPU_CHECK_ARG(r >= 0 && r < rows && !seen[r], op, "sorted_indices",
                      "must be a permutation of [0, ", rows, "), but got ", r);
    seen[r] = true;
    lists[q / k].emplace_back(r, q % k);
  }
  return pack(lists);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
_npu_moe_token_unpermute_with_routing_map(
    const at::Tensor& permuted_tokens, const at::Tensor& sorted_indices,
    c10::IntArrayRef restore_shape, const std::optional<at::Tensor>& probs,
    const std::optional<at::Tensor>& routing_map, bool drop_and_pad) {
  constexpr const char* op = "npu_moe_token_unpermute_with_routing_map";
  check_floating(op, "permuted_tokens", permuted_tokens);
  OPENNPU_CHECK_ARG(permuted_tokens.dim() == 2, op, "permuted_tokens",
                    "must be 2-D [rows, H], but got shape ", shape_str(permuted_tokens.sizes()));
  const int64_t rows = permuted_tokens.size(0), h = permuted_tokens.size(1);
  OPENNPU_CHECK_ARG(restore_shape.size() == 2 && restore_shape[0] >= 0 && restore_shape[1] == h,
                    op, "restore_shape", "must be [num_tokens, H] with H = ", h, ", but got ",
                    restore_shape);
  const int64_t t = restore_shape[0];
  check_index(op, "sorted_indices", sorted_indices);
  check_same_device(op, "sorted_indices", sorted_indices, "permuted_tokens", permuted_tokens);
  OPENNPU_CHECK_ARG(sorted_indices.dim() == 1, op, "sorted_indices",
                    "must be 1-D, but got shape ", shape_str(sorted_indices.sizes()));
  if (given(probs)) check_probs(op, *probs, t, given(routing_map) ? routing_map->size(1) : -1,
                                permuted_tokens, "permuted_tokens");
  const std::vector<int64_t> si = index_values(sorted_indices);
  OPENNPU_CHECK_ARG(drop_and_pad || static_cast<int64_t>(si.size()) == rows, op,
                    "sorted_indices", "must have one entry per permuted row (", rows,
                    "), but got ", si.size());
  OPENNPU_CHECK_ARG(!drop_and_pad || static_cast<int64_t>(si.size()) == rows, op,
                    "sorted_indices", "must have one token per slot (", rows, " slots), but got ",
                    si.size());
  const Terms terms = unpermute_terms(op, si, rows, t, routing_map, probs, drop_and_pad,
                                      permuted_tokens);
  const at::Tensor x = permuted_tokens.contiguous();
  at::Tensor out = at::empty({t, h}, x.options());
  const at::Tensor w = given(probs) ? term_weights(*probs, terms, t, x) : at::Tensor();
  if (out.numel() > 0) {
    if (terms.kmax > 0) {
      gather_sum.get(op, x)(x, terms.row.data(), w.defined() ? w.const_data_ptr() : nullptr,
                             terms.kmax, out);
    } else {
      out.zero_();
    }
  }
  // out_index / permuted_token_id: with drop_and_pad the stable argsort of the slot tokens and
  // those tokens sorted (what the gradient takes); dropless, sorted_indices itself (op-plugin's
  // gradient then gets sorted_indices for both). permute_probs: each row's prob.
  at::Tensor out_index = sorted_indices.clone(), token_id = sorted_indices.clone();
  if (drop_and_pad) {
    std::vector<int64_t> order(si.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return si[a] < si[b]; });
    const at::Tensor o = at::empty({rows}, x.options().dtype(at::kLong));
    const at::Tensor id = at::empty({rows}, x.options().dtype(at::kLong));
    for (int64_t i = 0; i < rows; ++i) {
      o.mutable_data_ptr<int64_t>()[i] = order[i];
      id.mutable_data_ptr<int64_t>()[i] = si[order[i]];
    }
    out_index.copy_(o);
    token_id.copy_(id);
  }
  // permute_probs (op-plugin's golden): dropless, the probs of the routed pairs token-major
  // (probs[routing_map]); drop_and_pad, each slot's prob.
  at::Tensor permute_probs = at::empty({0}, x.options());
  if (given(probs)) {
    std::vector<double> per_row(rows, 0.0);
    const at::Tensor p = probs->to(at::kDouble).contiguous();
    const double* pp = p.const_data_ptr<double>();
    int64_t pair = 0;
    for (int64_t q = 0; q < t * terms.kmax; ++q) {
      if (terms.row[q] < 0) continue;
      const double v = pp[(q / terms.kmax) * probs->size(1) + terms.expert[q]];
      per_row[drop_and_pad ? terms.row[q] : pair++] = v;
    }
    permute_probs = at::empty({rows}, p.options());
    std::copy(per_row.begin(), per_row.end(), permute_probs.mutable_data_ptr<double>());
    permute_probs = permute_probs.to(probs->scalar_type());
  }
  return {out, out_index, token_id, permute_probs};
}

at::Tensor npu_moe_token_unpermute_with_routing_map(
    const at::Tensor& permuted_tokens, const at::Tensor& sorted_indices,
    c10::IntArrayRef restore_shape, const std::optional<at::Tensor>& probs,
    const std::optional<at::Tensor>& routing_map, bool drop_and_pad) {
  return std::get<0>(_npu_moe_token_unpermute_with_routing_map(
      permuted_tokens, sorted_indices, restore_shape, probs, routing_map, drop_and_pad));
}

std::tuple<at::Tensor, at::Tensor> npu_moe_token_unpermute_with_routing_map_grad(
    const at::Tensor& unpermuted_tokens_grad, const at::Tensor& out_index,
    const at::Tensor& permuted_token_id, const std::optional<at::Tensor>& routing_map,
    const std::optional<at::Tensor>& permuted_tokens, const std::optional<at::Tensor>& probs,
    bool drop_and_pad, c10::IntArrayRef restore_shape) {
  constexpr const char* op = "npu_moe_token_unpermute_with_routing_map_grad";
  const at::Tensor& grad = unpermuted_tokens_grad;
  check_floating(op, "unpermuted_tokens_grad", grad);
  OPENNPU_CHECK_ARG(grad.dim() == 2, op, "unpermuted_tokens_grad",
                    "must be 2-D [num_tokens, H], but got shape ", shape_str(grad.sizes()));
  const int64_t t = grad.size(0), h = grad.size(1);
  OPENNPU_CHECK_ARG(restore_shape.size() == 2 && restore_shape[0] == t && restore_shape[1] == h,
                    op, "restore_shape", "must be the gradient's shape [", t, ", ", h,
                    "], but got ", restore_shape);
  check_index(op, "out_index", out_index);
  check_index(op, "permuted_token_id", permuted_token_id);
  OPENNPU_CHECK_ARG(out_index.dim() == 1 && permuted_token_id.sizes().equals(out_index.sizes()),
                    op, "permuted_token_id", "must be 1-D with out_index's length (",
                    out_index.numel(), "), but got shape ", shape_str(permuted_token_id.sizes()));
  const int64_t rows = out_index.size(0);
  // The slot tokens back from (out_index, permuted_token_id) with drop_and_pad; dropless, the
  // sorted_indices the forward got (passed as both).
  std::vector<int64_t> si = index_values(out_index);
  if (drop_and_pad) {
    const std::vector<int64_t> ids = index_values(permuted_token_id);
    std::vector<int64_t> slot_token(rows, -1);
    for (int64_t i = 0; i < rows; ++i) {
      OPENNPU_CHECK_ARG(si[i] >= 0 && si[i] < rows && slot_token[si[i]] < 0, op, "out_index",
                        "must be a permutation of [0, ", rows, "), but got ", si[i]);
      slot_token[si[i]] = ids[i];
    }
    si = slot_token;
  }
  const Terms terms = unpermute_terms(op, si, rows, t, routing_map, probs, drop_and_pad, grad);
  const at::Tensor g = grad.contiguous();
  at::Tensor rows_in;
  if (given(probs)) {
    OPENNPU_CHECK_ARG(given(permuted_tokens), op, "permuted_tokens",
                      "must be given with probs (probs_grad needs the rows), but got None");
    OPENNPU_CHECK_ARG(permuted_tokens->dim() == 2 && permuted_tokens->size(0) == rows &&
                          permuted_tokens->size(1) == h,
                      op, "permuted_tokens", "must have shape [", rows, ", ", h, "], but got ",
                      shape_str(permuted_tokens->sizes()));
    check_probs(op, *probs, t, given(routing_map) ? routing_map->size(1) : -1, g,
                "unpermuted_tokens_grad");
    rows_in = permuted_tokens->to(g.scalar_type()).contiguous();
  }
  int64_t live = 0;
  for (int64_t r : terms.row) live += r >= 0;
  at::Tensor grad_rows = live == rows ? at::empty({rows, h}, g.options())
                                      : at::zeros({rows, h}, g.options());
  const at::Tensor w = given(probs) ? term_weights(*probs, terms, t, g) : at::Tensor();
  at::Tensor grad_w = given(probs) ? at::zeros({t * terms.kmax}, w.options()) : at::Tensor();
  if (g.numel() > 0 && terms.kmax > 0) {
    gather_sum_backward.get(op, g)(g, rows_in, terms.row.data(),
                                    w.defined() ? w.const_data_ptr() : nullptr, terms.kmax,
                                    grad_rows,
                                    grad_w.defined() ? grad_w.mutable_data_ptr() : nullptr);
  }
  at::Tensor probs_grad = at::empty({0}, g.options());
  if (given(probs)) probs_grad = scatter_terms(grad_w, terms, t, probs->size(1), g.scalar_type());
  return {grad_rows, probs_grad};
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_moe_token_permute_with_routing_map", &npu_moe_token_permute_with_routing_map);
  m.impl("npu_moe_token_permute_with_routing_map_grad",
         &npu_moe_token_permute_with_routing_map_grad);
  m.impl("npu_moe_token_unpermute_with_routing_map", &npu_moe_token_unpermute_with_routing_map);
  m.impl("_npu_moe_token_unpermute_with_routing_map", &_npu_moe_token_unpermute_with_routing_map);
  m.impl("npu_moe_token_unpermute_with_routing_map_grad",
         &npu_moe_token_unpermute_with_routing_map_grad);
}

}  // namespace opennpu::moe
