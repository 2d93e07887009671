// npu_moe_init_routing_v2 (Ascend MoeInitRoutingV2 / V3): npu_moe_init_routing's stable expert
// sort (moe.cpp's sort_by_expert) with an active expert range, per-expert token counts, a
// drop-pad layout with a capacity per expert, and optional int8 quantisation of the rows.
//
//   key of pair q = expert_idx[q], or +inf for an expert below the range (sorted last);
//   order = stable sort of the N*K pairs by key; valid = #pairs with start <= expert < end.
//   dropless:  expanded_x[p] = x[order[p] / K] for p < min(active_num, valid) (all valid pairs
//              when active_num <= 0); rows up to min(active_num, N*K) exist, the rest are 0.
//   drop-pad:  pair p of expert e with rank j among its expert's pairs goes to slot
//              (e - start) * capacity + j of [expert_num, capacity, H] when j < capacity.
//   expanded_row_idx: row_idx_type 0: the slot / position of each pair (-1: not placed);
//                     row_idx_type 1: order itself (the pair of each sorted position).
//
// Quantisation: quant_mode 0 (static) is x * scale + offset in float16 steps, rounded half to
// even and saturated to int8, as op-plugin's golden computes it; quant_mode 1 (dynamic) is
// npu_dynamic_quant of the routed rows (scale [H] / [1, H], or per expert [experts, H]).
// The MXFP8 / HIF8 / MXFP4 / FP8 / INT4 modes (Ascend950 formats) and x_dtype are not
// implemented: a clear error says so.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string_view>
#include <vector>

#include "common/checks.h"
#include "ops/moe/moe.h"

namespace opennpu::moe {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Static quantisation of op-plugin's golden: every step in float16 (x, scale and offset
// rounded to float16, the product and the sum rounded to float16), then round half to even and
// saturate to [-128, 127]. rows: [R, H] floating; a source row < 0 is a zero code row.
at::Tensor static_quant(const at::Tensor& rows, const std::vector<int64_t>& src_row, float scale,
                        float offset) {
  const at::Tensor x = rows.to(at::kFloat).contiguous();
  at::Tensor out = at::zeros(rows.sizes(), rows.options().dtype(at::kChar));
  const int64_t r_count = x.size(0), h = x.size(1);
  const float* px = x.const_data_ptr<float>();
  int8_t* po = out.mutable_data_ptr<int8_t>();
  const c10::Half s(scale), o(offset);
  at::parallel_for(0, r_count, std::max<int64_t>(1, 4096 / std::max<int64_t>(h, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (src_row[r] < 0) continue;
      for (int64_t c = 0; c < h; ++c) {
        const c10::Half v(px[r * h + c]);
        const c10::Half prod(static_cast<float>(v) * static_cast<float>(s));
        const float sum =
            static_cast<float>(c10::Half(static_cast<float>(prod) + static_cast<float>(o)));
        const float q = std::nearbyint(sum);  // half to even (the default rounding mode)
        po[r * h + c] = static_cast<int8_t>(std::isnan(q) ? 0.f : std::clamp(q, -128.f, 127.f));
      }
    }
  });
  return out;
}

// npu_dynamic_quant(rows, smooth_scales, group_index): (int8 codes, float32 scales).
std::tuple<at::Tensor, at::Tensor> dynamic_quant(const at::Tensor& rows,
                                                 const std::optional<at::Tensor>& smooth,
                                                 const std::optional<at::Tensor>& group_index) {
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("npu::npu_dynamic_quant", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const std::optional<at::Tensor>&,
              const std::optional<at::Tensor>&, std::optional<int64_t>, c10::string_view,
              double)>();
  return handle.call(rows, smooth, group_index, std::nullopt, "pertoken", 0.0);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> npu_moe_init_routing_v2(
    const at::Tensor& x, const at::Tensor& expert_idx, const std::optional<at::Tensor>& scale_opt,
    const std::optional<at::Tensor>& offset_opt, int64_t active_num, int64_t expert_capacity,
    int64_t expert_num, int64_t drop_pad_mode, int64_t expert_tokens_num_type,
    bool expert_tokens_num_flag, int64_t quant_mode, c10::IntArrayRef active_expert_range,
    int64_t row_idx_type, std::optional<int64_t> x_dtype) {
  constexpr const char* op = "npu_moe_init_routing_v2";
  OPENNPU_CHECK_ARG(x.defined(), op, "x", "must be a tensor, but got None");
  OPENNPU_CHECK_ARG(x.dim() == 2, op, "x", "must be 2-D [num_rows, H], but got shape ",
                    shape_str(x.sizes()));
  check_index(op, "expert_idx", expert_idx);
  check_same_device(op, "expert_idx", expert_idx, "x", x);
  OPENNPU_CHECK_ARG(expert_idx.dim() == 2 && expert_idx.size(0) == x.size(0), op, "expert_idx",
                    "must be 2-D [num_rows, k] with num_rows = x.size(0) = ", x.size(0),
                    ", but got shape ", shape_str(expert_idx.sizes()));
  OPENNPU_CHECK_ARG(quant_mode >= -1 && quant_mode <= 1, op, "quant_mode",
                    "must be -1 (no quantisation), 0 (static int8) or 1 (dynamic int8); the "
                    "MXFP8 / HIF8 / MXFP4 / FP8 / INT4 modes (2 to 17) are not implemented by "
                    "opennpu, but got ", quant_mode);
  OPENNPU_CHECK_ARG(!x_dtype.has_value(), op, "x_dtype",
                    "must be None: reinterpreting x's storage as an Ascend dtype (hifloat8, "
                    "float4) is not implemented by opennpu, but got ", x_dtype.value_or(0));
  OPENNPU_CHECK_ARG(drop_pad_mode == 0 || drop_pad_mode == 1, op, "drop_pad_mode",
                    "must be 0 (dropless) or 1 (drop / pad to expert_capacity), but got ",
                    drop_pad_mode);
  OPENNPU_CHECK_ARG(expert_tokens_num_type >= 0 && expert_tokens_num_type <= 2, op,
                    "expert_tokens_num_type",
                    "must be 0 (cumulative counts), 1 (counts) or 2 (expert, count) pairs, "
                    "but got ", expert_tokens_num_type);
  OPENNPU_CHECK_ARG(row_idx_type == 0 || row_idx_type == 1, op, "row_idx_type",
                    "must be 0 (where each pair went) or 1 (the pair of each sorted position), "
                    "but got ", row_idx_type);
  OPENNPU_CHECK_ARG(active_expert_range.empty() || active_expert_range.size() == 2, op,
                    "active_expert_range", "must be [] or [start, end], but got ",
                    active_expert_range.size(), " values");
  OPENNPU_CHECK_ARG(!active_expert_range.empty() || expert_num > 0, op, "expert_num",
                    "must be > 0 when active_expert_range is [] (the range is then [0, "
                    "expert_num)), but got ", expert_num);
  const int64_t start = active_expert_range.empty() ? 0 : active_expert_range[0];
  const int64_t end = active_expert_range.empty() ? expert_num : active_expert_range[1];
  const int64_t experts = expert_num > 0 ? expert_num : end;
  OPENNPU_CHECK_ARG(start >= 0 && start < end && end <= experts, op, "active_expert_range",
                    "must be [start, end] with 0 <= start < end <= expert_num (", experts,
                    "), but got [", start, ", ", end, "]");
  const int64_t range = end - start;
  const bool drop_pad = drop_pad_mode == 1;
  if (drop_pad) {
    OPENNPU_CHECK_ARG(expert_capacity >= 1, op, "expert_capacity",
                      "must be >= 1 with drop_pad_mode=1, but got ", expert_capacity);
    OPENNPU_CHECK_ARG(expert_tokens_num_type == 1, op, "expert_tokens_num_type",
                      "must be 1 (counts) with drop_pad_mode=1 (opennpu implements that "
                      "combination only), but got ", expert_tokens_num_type);
    OPENNPU_CHECK_ARG(row_idx_type == 0, op, "row_idx_type",
                      "must be 0 with drop_pad_mode=1, but got ", row_idx_type);
  }
  if (quant_mode >= 0) check_floating(op, "x", x);

  const int64_t n = x.size(0), h = x.size(1), k = expert_idx.size(1), nk = n * k;
  OPENNPU_CHECK_ARG(nk <= kInt32Max, op, "expert_idx",
                    "must have at most 2^31 - 1 entries (int32 outputs), but got ", nk);
  const int64_t rows_out = drop_pad ? experts * expert_capacity
                                    : (active_num <= 0 ? nk : std::min(active_num, nk));
  const auto x_out_dtype = quant_mode >= 0 ? at::kChar : x.scalar_type();
  // drop-pad: the padding slots stay 0; dropless rows are all written below
  const auto x_out = x.options().dtype(x_out_dtype);
  at::Tensor expanded_x = drop_pad ? at::zeros({experts, expert_capacity, h}, x_out)
                                   : at::empty({rows_out, h}, x_out);
  at::Tensor expanded_row_idx = at::empty({nk}, expert_idx.options());
  const auto int64 = x.options().dtype(at::kLong);
  at::Tensor counts = expert_tokens_num_type == 2 ? at::zeros({experts, 2}, int64)
                                                  : at::zeros({range}, int64);
  at::Tensor expanded_scale = at::zeros({rows_out}, x.options().dtype(at::kFloat));

  // Scale / offset: checked against the mode (quant -1: [num_rows] per-row values carried along;
  // 0: one scale and one offset; 1: [H] / [1, H] or per expert [active experts, H]).
  at::Tensor scale = given(scale_opt) ? *scale_opt : at::Tensor();
  const at::Tensor offset = given(offset_opt) ? *offset_opt : at::Tensor();
  if (scale.defined()) {
    check_floating(op, "scale", scale);
    check_same_device(op, "scale", scale, "x", x);
  }
  if (offset.defined()) check_same_device(op, "offset", offset, "x", x);
  if (nk == 0) {
    if (!drop_pad) expanded_x.zero_();
    return {expanded_x, expanded_row_idx, counts, expanded_scale};
  }
  bool per_expert_smooth = false;
  if (quant_mode == -1) {
    OPENNPU_CHECK_ARG(!offset.defined(), op, "offset", "must be None with quant_mode=-1");
    OPENNPU_CHECK_ARG(!scale.defined() || (scale.dim() == 1 && scale.size(0) == n), op, "scale",
                      "must be None or [num_rows] = [", n, "] with quant_mode=-1, but got ",
                      shape_str(scale.sizes()));
  } else if (quant_mode == 0) {
    OPENNPU_CHECK_ARG(scale.defined() && scale.numel() == 1, op, "scale",
                      "must hold one value with quant_mode=0 (opennpu implements per-tensor "
                      "static quantisation), but got ",
                      scale.defined() ? shape_str(scale.sizes()) : std::string("None"));
    OPENNPU_CHECK_ARG(offset.defined() && offset.numel() == 1, op, "offset",
                      "must hold one value with quant_mode=0, but got ",
                      offset.defined() ? shape_str(offset.sizes()) : std::string("None"));
    check_floating(op, "offset", offset);
  } else {
    OPENNPU_CHECK_ARG(!offset.defined(), op, "offset",
                      "must be None with quant_mode=1 (dynamic quantisation is symmetric)");
    if (scale.defined()) {
      const bool shared = (scale.dim() == 1 && scale.size(0) == h) ||
                          (scale.dim() == 2 && scale.size(0) == 1 && scale.size(1) == h);
      per_expert_smooth =
          !shared && scale.dim() == 2 && scale.size(0) == range && scale.size(1) == h;
      OPENNPU_CHECK_ARG(shared || per_expert_smooth, op, "scale",
                        "must be [H] / [1, H] or per active expert [", range, ", ", h,
                        "] with quant_mode=1, but got ", shape_str(scale.sizes()));
    }
  }

  // The stable sort: experts below the range get a key above every expert (they sort last).
  const std::vector<int64_t> values = index_values(expert_idx);
  const int64_t top = *std::max_element(values.begin(), values.end());
  std::vector<int64_t> keys(values);
  for (int64_t& v : keys) {
    if (v < start) v = std::max(top, start) + 1;
  }
  const std::vector<int64_t> order = sort_by_expert(keys);
  const int64_t valid = std::count_if(values.begin(), values.end(),
                                      [&](int64_t v) { return v >= start && v < end; });

  // Each output row's source row of x (-1 = a zero / padding row) and expanded_row_idx.
  std::vector<int64_t> src_row(rows_out, -1);
  std::vector<int64_t> place(nk, -1);  // where each pair went (row_idx_type 0)
  int64_t filled = 0;
  if (!drop_pad) {
    filled = active_num <= 0 ? valid : std::min(active_num, valid);
    for (int64_t p = 0; p < filled; ++p) src_row[p] = order[p] / k;
    for (int64_t p = 0; p < valid; ++p) place[order[p]] = p;
  } else {
    int64_t rank = 0;
    for (int64_t p = 0; p < valid; ++p) {
      rank = p > 0 && values[order[p]] == values[order[p - 1]] ? rank + 1 : 0;
      if (rank >= expert_capacity) continue;
      const int64_t slot = (values[order[p]] - start) * expert_capacity + rank;
      src_row[slot] = order[p] / k;
      place[order[p]] = slot;
    }
    filled = rows_out;
  }
  {
    const at::Tensor idx = at::empty({nk}, x.options().dtype(at::kLong));
    int64_t* pi = idx.mutable_data_ptr<int64_t>();
    for (int64_t q = 0; q < nk; ++q) pi[q] = row_idx_type == 1 ? order[q] : place[q];
    expanded_row_idx.copy_(idx);
  }

  // Tokens per active expert (all valid pairs, before any capacity or active_num cut).
  if (expert_tokens_num_flag) {
    std::vector<int64_t> per_expert(range, 0);
    for (int64_t p = 0; p < valid; ++p) ++per_expert[values[order[p]] - start];
    int64_t* pc = counts.mutable_data_ptr<int64_t>();
    if (expert_tokens_num_type == 2) {
      int64_t row = 0;
      for (int64_t g = 0; g < range; ++g) {
        if (per_expert[g] == 0) continue;
        pc[row * 2] = start + g;
        pc[row * 2 + 1] = per_expert[g];
        ++row;
      }
    } else {
      int64_t sum = 0;
      for (int64_t g = 0; g < range; ++g) {
        sum += per_expert[g];
        pc[g] = expert_tokens_num_type == 0 ? sum : per_expert[g];
      }
    }
  }

  const at::Tensor xc = x.contiguous();
  if (quant_mode == -1) {
    at::Tensor flat = expanded_x.view({rows_out, h});
    gather_rows(op, xc, src_row.data(), rows_out, flat);
    if (scale.defined()) {
      const at::Tensor s = scale.to(at::kFloat).contiguous();
      const float* ps = s.const_data_ptr<float>();
      float* po = expanded_scale.mutable_data_ptr<float>();
      for (int64_t r = 0; r < rows_out; ++r) po[r] = src_row[r] >= 0 ? ps[src_row[r]] : 0.f;
    }
    return {expanded_x, expanded_row_idx, counts, expanded_scale};
  }

  at::Tensor routed = at::empty({rows_out, h}, xc.options());
  gather_rows(op, xc, src_row.data(), rows_out, routed);
  if (quant_mode == 0) {
    expanded_x.view({rows_out, h}).copy_(static_quant(routed, src_row, scale.item<float>(),
                                                      offset.item<float>()));
    return {expanded_x, expanded_row_idx, counts, expanded_scale};
  }
  // Dynamic: npu_dynamic_quant of the placed rows; per-expert scales through its group_index
  // (cumulative row ends per active expert: the rows are grouped by expert in order).
  std::optional<at::Tensor> smooth, group_index;
  if (scale.defined()) smooth = per_expert_smooth ? scale : scale.reshape({h});
  if (per_expert_smooth) {
    at::Tensor ends = at::empty({range}, x.options().dtype(at::kLong));
    int64_t* pe = ends.mutable_data_ptr<int64_t>();
    if (drop_pad) {
      for (int64_t g = 0; g < range; ++g) pe[g] = (g + 1) * expert_capacity;
      pe[range - 1] = rows_out;
    } else {
      int64_t p = 0;
      for (int64_t g = 0; g < range; ++g) {
        while (p < filled && values[order[p]] - start <= g) ++p;
        pe[g] = p;
      }
    }
    group_index = ends;
  }
  const at::Tensor placed = routed.narrow(0, 0, filled);
  auto [codes, row_scale] = dynamic_quant(placed, smooth, group_index);
  at::Tensor flat = expanded_x.view({rows_out, h});
  flat.narrow(0, 0, filled).copy_(codes);
  if (filled < rows_out) flat.narrow(0, filled, rows_out - filled).zero_();
  expanded_scale.narrow(0, 0, filled).copy_(row_scale.reshape({filled}));
  float* ps = expanded_scale.mutable_data_ptr<float>();
  for (int64_t r = 0; r < filled; ++r) {
    if (src_row[r] < 0) ps[r] = 0.f;  // a padding slot: no token, no scale
  }
  return {expanded_x, expanded_row_idx, counts, expanded_scale};
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_moe_init_routing_v2", &npu_moe_init_routing_v2);
}

}  // namespace opennpu::moe
