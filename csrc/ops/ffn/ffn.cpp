// Entry point of npu_ffn: validation, parameter tables, output allocation, CPU registration.
//
// Three paths, chosen by dtypes:
//   float        x and weights float32 / float16 / bfloat16 (the same dtype); no quant params.
//   weight-only  x float, weights int8 with antiquant_scale1/2 (+ antiquant_offset1/2):
//                W' = (W + antiquant_offset) * antiquant_scale, rounded to x's dtype.
//   quantised    x and weights int8, int32 biases, scale (+ offset), deq_scale1/2:
//                y = ((act((x W1 + b1) deq_scale1) scale + offset) W2 + b2) deq_scale2, the
//                intermediate rounded half to even and saturated to int8; output float16
//                (default) or bfloat16 (output_dtype).
// Checked always: the shapes that make the math well defined (K1 = N2, N1 = K2 or 2 * K2 by
// activation, expert counts and token lists, parameter shapes), the parameter set of each path
// and the dtype pairings the contract lists. Strict mode adds Ascend's hardware limits.
#include "ops/ffn/ffn.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <cstring>
#include <optional>
#include <string>

#include "common/checks.h"

namespace opennpu::ffn {

KernelSlots<FfnFn> ffn;

namespace {

constexpr const char* kOp = "npu_ffn";
constexpr int64_t kMaxExperts = 256;

FfnAct parse_activation(c10::string_view name) {
  const std::string s(name);
  if (s == "fastgelu") return FfnAct::kFastGelu;
  if (s == "gelu") return FfnAct::kGelu;
  if (s == "relu") return FfnAct::kRelu;
  if (s == "silu") return FfnAct::kSilu;
  if (s == "geglu") return FfnAct::kGeglu;
  if (s == "swiglu") return FfnAct::kSwiglu;
  if (s == "reglu") return FfnAct::kReglu;
  OPENNPU_CHECK_ARG(false, kOp, "activation",
                    "must be one of fastgelu, gelu, relu, silu, geglu, swiglu, reglu, but got '",
                    s, "'");
  return FfnAct::kFastGelu;
}

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// A per-channel parameter has shape [n] without experts, [E, n] with them.
void check_channel_shape(const char* arg, const at::Tensor& t, bool experts, int64_t e,
                         int64_t n) {
  if (experts) {
    OPENNPU_CHECK_ARG(t.dim() == 2 && t.size(0) == e && t.size(1) == n, kOp, arg,
                      "must have shape [E, N] = [", e, ", ", n, "] with experts, but got ",
                      shape_str(t.sizes()));
  } else {
    OPENNPU_CHECK_ARG(t.dim() == 1 && t.size(0) == n, kOp, arg, "must have shape [", n,
                      "] without experts, but got ", shape_str(t.sizes()));
  }
}

// A per-channel parameter as a float32 [E, n] table.
at::Tensor channel_table(const char* arg, const at::Tensor& t, bool experts, int64_t e,
                         int64_t n) {
  check_channel_shape(arg, t, experts, e, n);
  return t.to(at::kFloat).reshape({e, n}).contiguous();
}

void check_dtype_in(const char* arg, const at::Tensor& t,
                    std::initializer_list<at::ScalarType> allowed, const char* what) {
  bool ok = false;
  for (auto d : allowed) ok = ok || t.scalar_type() == d;
  OPENNPU_CHECK_ARG(ok, kOp, arg, "must be ", what, ", but got ", t.scalar_type());
}

// deq_scale as float32 [E, n]. int64 / uint64 hold Ascend's packed form (npu_trans_quant_param):
// the float32 bits of the scale, truncated to 19 bits (mask 0xFFFFE000), in the low 32 bits;
// the upper bits (offset, flags) do not apply to npu_ffn and are ignored.
at::Tensor deq_table(const char* arg, const at::Tensor& t, bool experts, int64_t e, int64_t n) {
  if (t.scalar_type() != at::kLong && t.scalar_type() != at::kUInt64) {
    return channel_table(arg, t, experts, e, n);
  }
  check_channel_shape(arg, t, experts, e, n);
  const at::Tensor raw = t.view(at::kLong).reshape({e, n}).contiguous();
  at::Tensor out = at::empty({e, n}, t.options().dtype(at::kFloat));
  const int64_t* src = raw.const_data_ptr<int64_t>();
  float* dst = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < e * n; ++i) {
    const uint32_t low = static_cast<uint32_t>(static_cast<uint64_t>(src[i]) & 0xFFFFE000u);
    std::memcpy(dst + i, &low, sizeof(float));
  }
  return out;
}

// The row offsets of the experts (E + 1 entries) from expert_tokens (counts) or
// expert_tokens_index (cumulative ends, e.g. np.cumsum of the counts).
std::vector<int64_t> expert_offsets(at::OptionalIntArrayRef tokens, at::OptionalIntArrayRef index,
                                    bool experts, int64_t e, int64_t m) {
  OPENNPU_CHECK_ARG(!(tokens.has_value() && index.has_value()), kOp, "expert_tokens_index",
                    "cannot be given together with 'expert_tokens' (counts or cumulative ends, "
                    "not both)");
  const bool given = tokens.has_value() || index.has_value();
  const char* arg = index.has_value() ? "expert_tokens_index" : "expert_tokens";
  if (!experts) {
    OPENNPU_CHECK_ARG(!given, kOp, arg,
                      "needs expert weights: weight1 [E, K1, N1] and weight2 [E, K2, N2], but "
                      "the weights are 2-D");
    return {0, m};
  }
  OPENNPU_CHECK_ARG(given, kOp, "expert_tokens",
                    "is required with expert weights [E, K, N] (or give expert_tokens_index)");
  const c10::IntArrayRef list = tokens.has_value() ? *tokens : *index;
  OPENNPU_CHECK_ARG(static_cast<int64_t>(list.size()) <= kMaxExperts, kOp, arg,
                    "may have at most ", kMaxExperts, " entries, but got ", list.size());
  OPENNPU_CHECK_ARG(static_cast<int64_t>(list.size()) == e, kOp, arg,
                    "must have one entry per expert (E = ", e, " from weight1), but got ",
                    list.size());
  std::vector<int64_t> offsets{0};
  for (size_t i = 0; i < list.size(); ++i) {
    if (tokens.has_value()) {
      OPENNPU_CHECK_ARG(list[i] >= 0, kOp, arg, "must hold token counts >= 0, but entry ", i,
                        " is ", list[i]);
      // Compared with the rows left, so that counts near the int64 limit cannot wrap around.
      OPENNPU_CHECK_ARG(list[i] <= m - offsets.back(), kOp, arg, "must sum to the M = ", m,
                        " rows of x, but entry ", i, " is ", list[i], " after ", offsets.back(),
                        " tokens in the entries before it");
      offsets.push_back(offsets.back() + list[i]);
    } else {
      OPENNPU_CHECK_ARG(list[i] >= offsets.back(), kOp, arg,
                        "must be non-decreasing cumulative token counts >= 0, but entry ", i,
                        " is ", list[i], " after ", offsets.back());
      offsets.push_back(list[i]);
    }
  }
  OPENNPU_CHECK_ARG(offsets.back() == m, kOp, arg, "must account for all M = ", m,
                    " rows of x (", tokens.has_value() ? "sum" : "last entry", " = M), but got ",
                    offsets.back());
  return offsets;
}

void check_absent(const std::optional<at::Tensor>& t, const char* arg, const char* path,
                  const char* why) {
  OPENNPU_CHECK_ARG(!t.has_value() || !t->defined(), kOp, arg, "must be None in the ", path,
                    " path (", why, ")");
}

}  // namespace

at::Tensor npu_ffn(const at::Tensor& x, const at::Tensor& weight1, const at::Tensor& weight2,
                   c10::string_view activation, at::OptionalIntArrayRef expert_tokens,
                   at::OptionalIntArrayRef expert_tokens_index,
                   const std::optional<at::Tensor>& bias1, const std::optional<at::Tensor>& bias2,
                   const std::optional<at::Tensor>& scale, const std::optional<at::Tensor>& offset,
                   const std::optional<at::Tensor>& deq_scale1,
                   const std::optional<at::Tensor>& deq_scale2,
                   const std::optional<at::Tensor>& antiquant_scale1,
                   const std::optional<at::Tensor>& antiquant_scale2,
                   const std::optional<at::Tensor>& antiquant_offset1,
                   const std::optional<at::Tensor>& antiquant_offset2,
                   std::optional<int64_t> inner_precise,
                   std::optional<at::ScalarType> output_dtype) {
  const FfnAct act = parse_activation(activation);
  const bool glu = is_glu(act);

  // ---- dtypes and path
  const at::ScalarType xt = x.scalar_type();
  OPENNPU_CHECK_ARG(is_float_dtype(xt) || xt == at::kChar, kOp, "x",
                    "must be float32, float16, bfloat16 or int8 (quantised), but got ", xt);
  const bool quant = xt == at::kChar;
  for (const auto& [arg, w] : {std::pair<const char*, const at::Tensor&>{"weight1", weight1},
                               {"weight2", weight2}}) {
    check_same_device(kOp, arg, w, "x", x);
    if (quant) {
      OPENNPU_CHECK_ARG(w.scalar_type() == at::kChar, kOp, arg,
                        "must be int8 when x is int8 (quantised path), but got ",
                        w.scalar_type());
    } else {
      OPENNPU_CHECK_ARG(w.scalar_type() == xt || w.scalar_type() == at::kChar, kOp, arg,
                        "must have x's dtype (", xt,
                        ") or be int8 (weight-only quantisation), but got ", w.scalar_type());
    }
  }
  OPENNPU_CHECK_ARG(weight1.scalar_type() == weight2.scalar_type(), kOp, "weight2",
                    "must have weight1's dtype (", weight1.scalar_type(), "), but got ",
                    weight2.scalar_type());
  const bool weight_only = !quant && weight1.scalar_type() == at::kChar;
  const char* path = quant ? "quantised (int8 x)" : weight_only ? "weight-only (int8 weights)"
                                                                : "non-quantised";

  // ---- shapes
  OPENNPU_CHECK_ARG(x.dim() >= 2, kOp, "x", "must have at least 2 dims [M, K1], but got ",
                    x.dim(), " (shape ", shape_str(x.sizes()), ")");
  OPENNPU_CHECK_ARG(weight1.dim() == 2 || weight1.dim() == 3, kOp, "weight1",
                    "must be [K1, N1] or, with experts, [E, K1, N1], but got ",
                    shape_str(weight1.sizes()));
  OPENNPU_CHECK_ARG(weight2.dim() == weight1.dim(), kOp, "weight2", "must have ", weight1.dim(),
                    " dims like weight1 (", weight1.dim() == 3 ? "[E, K2, N2]" : "[K2, N2]",
                    "), but got ", shape_str(weight2.sizes()));
  const bool experts = weight1.dim() == 3;
  const int64_t e = experts ? weight1.size(0) : 1;
  if (experts) {
    OPENNPU_CHECK_ARG(weight2.size(0) == e, kOp, "weight2", "must have E = ", e,
                      " experts like weight1, but got ", shape_str(weight2.sizes()));
  }
  const int64_t k1 = weight1.size(-2), n1 = weight1.size(-1);
  const int64_t k2 = weight2.size(-2), n2 = weight2.size(-1);
  OPENNPU_CHECK_ARG(x.size(-1) == k1, kOp, "x", "must have K1 = ", k1,
                    " (weight1's rows) as its last dim, but got shape ", shape_str(x.sizes()));
  OPENNPU_CHECK_ARG(n2 == k1, kOp, "weight2", "must have N2 = K1 = ", k1,
                    " columns (the output has x's shape), but got ", shape_str(weight2.sizes()));
  if (glu) {
    OPENNPU_CHECK_ARG(n1 == 2 * k2, kOp, "weight1", "must have N1 = 2 * K2 = ", 2 * k2,
                      " columns for activation '", std::string(activation),
                      "' (halves a | b give a * act(b)), but got ", shape_str(weight1.sizes()));
  } else {
    OPENNPU_CHECK_ARG(n1 == k2, kOp, "weight1", "must have N1 = K2 = ", k2,
                      " columns for activation '", std::string(activation), "', but got ",
                      shape_str(weight1.sizes()));
  }
  const int64_t rows = c10::multiply_integers(x.sizes().slice(0, x.dim() - 1));
  std::vector<int64_t> offsets =
      expert_offsets(expert_tokens, expert_tokens_index, experts, e, rows);

  // ---- parameters of each path
  const auto has = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  FfnArgs args;
  args.act = act;
  if (quant || !weight_only) {
    const char* why = quant ? "quantised inputs take scale / offset / deq_scale"
                            : "x and the weights are not quantised";
    check_absent(antiquant_scale1, "antiquant_scale1", path, why);
    check_absent(antiquant_scale2, "antiquant_scale2", path, why);
    check_absent(antiquant_offset1, "antiquant_offset1", path, why);
    check_absent(antiquant_offset2, "antiquant_offset2", path, why);
  }
  if (!quant) {
    const char* why = weight_only ? "weight-only quantisation takes antiquant_scale / "
                                    "antiquant_offset"
                                  : "x and the weights are not quantised";
    check_absent(scale, "scale", path, why);
    check_absent(offset, "offset", path, why);
    check_absent(deq_scale1, "deq_scale1", path, why);
    check_absent(deq_scale2, "deq_scale2", path, why);
  }
  for (const auto& [arg, b, n] : {std::tuple<const char*, const std::optional<at::Tensor>&,
                                             int64_t>{"bias1", bias1, n1},
                                  {"bias2", bias2, n2}}) {
    if (!has(b)) continue;
    check_same_device(kOp, arg, *b, "x", x);
    if (quant) {
      OPENNPU_CHECK_ARG(b->scalar_type() == at::kInt, kOp, arg,
                        "must be int32 in the quantised path, but got ", b->scalar_type());
      check_channel_shape(arg, *b, experts, e, n);
    } else {
      check_dtype_in(arg, *b, {at::kFloat, at::kHalf, at::kBFloat16},
                     "float32, float16 or bfloat16");
    }
  }
  if (quant) {
    args.bias1 = has(bias1) ? bias1->reshape({e, n1}).contiguous() : at::Tensor();
    args.bias2 = has(bias2) ? bias2->reshape({e, n2}).contiguous() : at::Tensor();
  } else {
    args.bias1 = has(bias1) ? channel_table("bias1", *bias1, experts, e, n1) : at::Tensor();
    args.bias2 = has(bias2) ? channel_table("bias2", *bias2, experts, e, n2) : at::Tensor();
  }

  at::ScalarType out_dtype = xt;
  if (quant) {
    out_dtype = output_dtype.value_or(at::kHalf);
    OPENNPU_CHECK_ARG(out_dtype == at::kHalf || out_dtype == at::kBFloat16, kOp, "output_dtype",
                      "must be None, torch.float16 or torch.bfloat16 in the quantised path, but "
                      "got ", out_dtype);
    OPENNPU_CHECK_ARG(has(scale), kOp, "scale",
                      "is required in the quantised path (it quantises the intermediate to int8)");
    OPENNPU_CHECK_ARG(has(deq_scale1), kOp, "deq_scale1", "is required in the quantised path");
    OPENNPU_CHECK_ARG(has(deq_scale2), kOp, "deq_scale2", "is required in the quantised path");
    for (const auto& [arg, t] : {std::pair<const char*, const at::Tensor&>{"deq_scale1", *deq_scale1},
                                 {"deq_scale2", *deq_scale2}}) {
      check_same_device(kOp, arg, t, "x", x);
      if (out_dtype == at::kHalf) {
        check_dtype_in(arg, t, {at::kLong, at::kUInt64, at::kFloat},
                       "int64, uint64 or float32 for a float16 output");
      } else {
        check_dtype_in(arg, t, {at::kBFloat16}, "bfloat16 for a bfloat16 output");
      }
    }
    OPENNPU_CHECK_ARG(deq_scale1->scalar_type() == deq_scale2->scalar_type(), kOp, "deq_scale2",
                      "must have deq_scale1's dtype (", deq_scale1->scalar_type(), "), but got ",
                      deq_scale2->scalar_type());
    args.deq1 = deq_table("deq_scale1", *deq_scale1, experts, e, n1);
    args.deq2 = deq_table("deq_scale2", *deq_scale2, experts, e, n2);
    check_same_device(kOp, "scale", *scale, "x", x);
    check_dtype_in("scale", *scale, {at::kFloat}, "float32");
    // Per-tensor: [1] / [E]; per-channel: [K2] / [E, K2] (K2 = N1 without a GLU activation).
    const bool per_tensor = experts ? scale->dim() == 1 : scale->numel() == 1 && scale->dim() == 1;
    if (per_tensor) {
      OPENNPU_CHECK_ARG(scale->size(0) == e, kOp, "scale", "must have shape [",
                        experts ? "E" : "1", "] = [", e, "] (per tensor) or [", experts ? "E, " : "",
                        k2, "] (per channel), but got ", shape_str(scale->sizes()));
      args.qscale = scale->reshape({e, 1}).expand({e, k2}).contiguous();
    } else {
      args.qscale = channel_table("scale", *scale, experts, e, k2);
    }
    if (has(offset)) {
      check_same_device(kOp, "offset", *offset, "x", x);
      check_dtype_in("offset", *offset, {at::kFloat}, "float32");
      OPENNPU_CHECK_ARG(offset->dim() == 1 && offset->size(0) == e, kOp, "offset",
                        "must have shape [", e, "] (one per ", experts ? "expert" : "tensor",
                        "), but got ", shape_str(offset->sizes()));
      args.qoffset = offset->contiguous();
    } else {
      args.qoffset = at::zeros({e}, x.options().dtype(at::kFloat));
    }
    OPENNPU_CHECK_STRICT(per_tensor || deq_scale1->scalar_type() != at::kFloat, kOp,
                         "deq_scale1", "must be int64 or uint64 with a per-channel scale");
  } else if (weight_only) {
    OPENNPU_CHECK_ARG(has(antiquant_scale1), kOp, "antiquant_scale1",
                      "is required with int8 weights and ", xt, " x (weight-only path)");
    OPENNPU_CHECK_ARG(has(antiquant_scale2), kOp, "antiquant_scale2",
                      "is required with int8 weights and ", xt, " x (weight-only path)");
    for (const auto& [arg, t, n] :
         {std::tuple<const char*, const std::optional<at::Tensor>&, int64_t>{
              "antiquant_scale1", antiquant_scale1, n1},
          {"antiquant_scale2", antiquant_scale2, n2},
          {"antiquant_offset1", antiquant_offset1, n1},
          {"antiquant_offset2", antiquant_offset2, n2}}) {
      if (!has(t)) continue;
      check_same_device(kOp, arg, *t, "x", x);
      check_dtype_in(arg, *t, {at::kFloat, at::kHalf, at::kBFloat16},
                     "float16, bfloat16 or float32");
      check_strict_dtype(kOp, arg, *t, {xt});
    }
    args.aq_scale1 = channel_table("antiquant_scale1", *antiquant_scale1, experts, e, n1);
    args.aq_scale2 = channel_table("antiquant_scale2", *antiquant_scale2, experts, e, n2);
    if (has(antiquant_offset1)) {
      args.aq_offset1 = channel_table("antiquant_offset1", *antiquant_offset1, experts, e, n1);
    }
    if (has(antiquant_offset2)) {
      args.aq_offset2 = channel_table("antiquant_offset2", *antiquant_offset2, experts, e, n2);
    }
  }

  const int64_t precise = inner_precise.value_or(0);
  OPENNPU_CHECK_ARG(precise == 0 || precise == 1, kOp, "inner_precise",
                    "must be 0 (high precision) or 1 (high performance), but got ", precise);

  // ---- strict mode: Ascend's documented limits
  check_strict_dtype(kOp, "x", x, {at::kHalf, at::kBFloat16, at::kChar});
  check_strict_rank(kOp, "x", x, 2, 8);
  OPENNPU_CHECK_STRICT(k1 < 65536, kOp, "weight1", "must have K1 < 65536, but got ", k1);
  OPENNPU_CHECK_STRICT(k2 < 65536, kOp, "weight2", "must have K2 < 65536, but got ", k2);
  OPENNPU_CHECK_STRICT(!glu || (!experts && xt == at::kHalf && precise == 1), kOp, "activation",
                       "'", std::string(activation),
                       "' is supported only without experts, for float16 with inner_precise=1");
  OPENNPU_CHECK_STRICT(quant || weight_only || xt != at::kBFloat16 || precise == 0, kOp,
                       "inner_precise", "must be 0 for bfloat16, but got ", precise);
  if (!quant && xt == at::kBFloat16 && has(bias1)) check_strict_dtype(kOp, "bias1", *bias1, {at::kFloat});
  if (!quant && xt == at::kBFloat16 && has(bias2)) check_strict_dtype(kOp, "bias2", *bias2, {at::kFloat});
  if (!quant && xt == at::kHalf && has(bias1)) check_strict_dtype(kOp, "bias1", *bias1, {at::kHalf});
  if (!quant && xt == at::kHalf && has(bias2)) check_strict_dtype(kOp, "bias2", *bias2, {at::kHalf});

  // ---- run
  std::vector<int64_t> out_sizes(x.sizes().begin(), x.sizes().end());
  out_sizes.back() = n2;
  at::Tensor out = at::empty(out_sizes, x.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  args.x = x.reshape({rows, k1}).contiguous();
  args.w1 = weight1.reshape({e, k1, n1}).contiguous();
  args.w2 = weight2.reshape({e, k2, n2}).contiguous();
  args.offsets = std::move(offsets);
  args.out = out.view({rows, n2});
  ffn.get(kOp, args.x)(args);
  return out;
}

TORCH_LIBRARY_IMPL(npu, CPU, m) { m.impl("npu_ffn", &npu_ffn); }

}  // namespace opennpu::ffn
