// Entry points of npu_quant_matmul, npu_trans_quant_param and npu_convert_weight_to_int4pack:
// validation, scale decoding, output allocation, the call of the device's kernel (the int32
// product and the fused epilogue, quant_matmul.h), CPU registration.
#include "ops/quant/quant_matmul.h"

#include <ATen/ExpandUtils.h>
#include <ATen/ops/empty.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <bit>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "common/checks.h"

namespace opennpu::quant {

KernelSlots<QuantMatmulFn> quant_matmul;
KernelSlots<PackInt4Fn> pack_int4;
KernelSlots<A8W4MatmulFn> a8w4_matmul;

namespace {

constexpr const char* kQmm = "npu_quant_matmul";
std::string dtype_name(int64_t code) {
  if (code >= 0 && code < static_cast<int64_t>(c10::ScalarType::NumOptions)) {
    return c10::toString(static_cast<c10::ScalarType>(code));
  }
  return "dtype code " + std::to_string(code) + " (an Ascend-only type such as hifloat8 or float4)";
}

// x1_dtype / x2_dtype / scale_dtype / pertoken_scale_dtype: None, or the tensor's own dtype
// (torch.quint4x2 / torch.int4 also name the int4 codes of an int32 tensor).
void check_declared_dtype(const char* arg, std::optional<int64_t> declared, const at::Tensor& t,
                          const char* tensor_arg) {
  if (!declared.has_value()) return;
  const int64_t own = static_cast<int64_t>(t.scalar_type());
  const bool int4_name = *declared == static_cast<int64_t>(at::kQUInt4x2) ||
                         *declared == static_cast<int64_t>(c10::ScalarType::Int4);
  OPENNPU_CHECK_ARG(*declared == own || (int4_name && t.scalar_type() == at::kInt), kQmm, arg,
                    "must be None or the dtype of '", tensor_arg, "' (", t.scalar_type(),
                    "); reinterpreting it as another type (hifloat8, float4_e2m1, float8_e8m0) "
                    "is not supported by opennpu, but got ", dtype_name(*declared));
}

at::ScalarType parse_output_dtype(std::optional<int64_t> output_dtype) {
  if (!output_dtype.has_value()) return at::kChar;
  const int64_t code = *output_dtype;
  for (at::ScalarType t : {at::kChar, at::kHalf, at::kBFloat16, at::kInt}) {
    if (code == static_cast<int64_t>(t)) return t;
  }
  OPENNPU_CHECK_ARG(false, kQmm, "output_dtype",
                    "must be None, torch.int8, torch.float16, torch.bfloat16 or torch.int32, "
                    "but got ", dtype_name(code));
  return at::kChar;
}

// A 1-D (or [1, t]) per-channel vector of length 1 or n, as contiguous fp32 [t].
at::Tensor channel_vector(const char* arg, const at::Tensor& t, int64_t n) {
  OPENNPU_CHECK_ARG((t.dim() == 1 || (t.dim() == 2 && t.size(0) == 1)) &&
                        (t.numel() == 1 || t.numel() == n),
                    kQmm, arg, "must have shape [1] or [", n, "] (n, the last dim of the output), "
                    "or [1, 1] / [1, ", n, "], but got ", shape_str(t.sizes()));
  return t.reshape({t.numel()}).to(at::kFloat).contiguous();
}

}  // namespace

std::pair<at::Tensor, at::Tensor> decode_int64_scale(const at::Tensor& packed) {
  const at::Tensor p = packed.reshape({packed.numel()}).contiguous();
  at::Tensor scale = at::empty({p.numel()}, p.options().dtype(at::kFloat));
  at::Tensor offset = at::empty({p.numel()}, p.options().dtype(at::kFloat));
  const int64_t* in = p.const_data_ptr<int64_t>();
  bool any_offset = false;
  for (int64_t i = 0; i < p.numel(); ++i) {
    const uint64_t v = static_cast<uint64_t>(in[i]);
    scale.mutable_data_ptr<float>()[i] = std::bit_cast<float>(static_cast<uint32_t>(v));
    int32_t o = static_cast<int32_t>((v >> 37) & 0x1FF);
    if (o >= 256) o -= 512;
    offset.mutable_data_ptr<float>()[i] = static_cast<float>(o);
    any_offset = any_offset || o != 0;
  }
  return {scale, any_offset ? offset : at::Tensor()};
}

namespace {

// pertoken_scale: float32 [m] or [m, 1] -> contiguous [m].
at::Tensor pertoken_vector(const at::Tensor& pt, const at::Tensor& x1, int64_t m) {
  check_same_device(kQmm, "pertoken_scale", pt, "x1", x1);
  OPENNPU_CHECK_ARG(pt.scalar_type() == at::kFloat, kQmm, "pertoken_scale",
                    "must be float32, but got ", pt.scalar_type());
  OPENNPU_CHECK_ARG(
      (pt.dim() == 1 && pt.size(0) == m) || (pt.dim() == 2 && pt.size(0) == m && pt.size(1) == 1),
      kQmm, "pertoken_scale", "must have shape [", m, "] (m, dim -2 of 'x1') or [", m,
      ", 1], but got ", shape_str(pt.sizes()));
  return pt.reshape({m}).contiguous();
}

// npu_quant_matmul's A8W4 path (int8 x1, int4 x2 words, per-group scales; see A8W4Args).
at::Tensor a8w4_quant_matmul(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& scale,
                             const std::optional<at::Tensor>& offset,
                             const std::optional<at::Tensor>& pertoken_scale,
                             const std::optional<at::Tensor>& bias,
                             std::optional<int64_t> output_dtype,
                             at::OptionalIntArrayRef group_sizes) {
  check_same_device(kQmm, "x2", x2, "x1", x1);
  OPENNPU_CHECK_ARG(x1.dim() == 2, kQmm, "x1", "must be 2-D [m, k] with int4 'x2' (A8W4), but got "
                    "shape ", shape_str(x1.sizes()));
  const int64_t m = x1.size(0), k = x1.size(1);
  OPENNPU_CHECK_ARG(x2.dim() == 2 && x2.size(0) == k, kQmm, "x2",
                    "must be int4 words [k, n / 8] = [", k, ", n / 8] (npu_convert_weight_to_"
                    "int4pack of a [k, n] weight) with int8 'x1' (A8W4), but got shape ",
                    shape_str(x2.sizes()));
  const int64_t n = 8 * x2.size(1);
  OPENNPU_CHECK_ARG(output_dtype.has_value() &&
                        (*output_dtype == static_cast<int64_t>(at::kHalf) ||
                         *output_dtype == static_cast<int64_t>(at::kBFloat16)),
                    kQmm, "output_dtype", "must be torch.float16 or torch.bfloat16 with int8 'x1' "
                    "and int4 'x2' (A8W4), but got ",
                    output_dtype.has_value() ? dtype_name(*output_dtype) : "None");
  const auto out_dtype = static_cast<at::ScalarType>(*output_dtype);
  check_same_device(kQmm, "scale", scale, "x1", x1);
  OPENNPU_CHECK_ARG(scale.scalar_type() == at::kLong || scale.scalar_type() == at::kFloat, kQmm,
                    "scale", "must be int64 (npu_trans_quant_param's encoding) or float32 with "
                    "A8W4, but got ", scale.scalar_type());
  OPENNPU_CHECK_ARG(scale.dim() == 2 && scale.size(1) == n && scale.size(0) >= 1, kQmm, "scale",
                    "must be [k / group_size, n] = [G, ", n, "] with A8W4 (per-group scales), but "
                    "got shape ", shape_str(scale.sizes()));
  int64_t group = scale.size(0) > 0 ? k / scale.size(0) : 0;
  if (group_sizes.has_value() && group_sizes->size() == 3 && (*group_sizes)[2] != 0) {
    group = (*group_sizes)[2];
  }
  OPENNPU_CHECK_ARG(!group_sizes.has_value() ||
                        (group_sizes->size() == 3 && (*group_sizes)[0] <= 1 &&
                         (*group_sizes)[1] <= 1 && (*group_sizes)[0] >= 0 &&
                         (*group_sizes)[1] >= 0 && (*group_sizes)[2] >= 0),
                    kQmm, "group_sizes", "must be [0, 0, group_k] (or None: k / scale.size(0)) "
                    "with A8W4, but got ", *group_sizes);
  OPENNPU_CHECK_ARG(group > 0 && k % group == 0 && k / group == scale.size(0), kQmm, "scale",
                    "must have k / group_size = ", group > 0 ? k / group : 0, " rows (k = ", k,
                    ", group_size = ", group, ", which must divide k), but got shape ",
                    shape_str(scale.sizes()));
  OPENNPU_CHECK_ARG(group <= kA8W4MaxGroup, kQmm, "group_sizes",
                    "must have a K group of at most ", kA8W4MaxGroup,
                    " rows (opennpu's exact fp32 products), but got ", group);
  OPENNPU_CHECK_ARG(!bias.has_value(), kQmm, "bias", "must be None with A8W4 (its additive "
                    "term is 'offset', float32 [n]), but got a tensor");
  A8W4Args p;
  p.m = m;
  p.k = k;
  p.n = n;
  p.group_size = group;
  p.scale = (scale.scalar_type() == at::kLong ? decode_int64_scale(scale).first.view(scale.sizes())
                                              : scale.to(at::kFloat))
                .contiguous();
  if (offset.has_value()) {
    check_same_device(kQmm, "offset", *offset, "x1", x1);
    OPENNPU_CHECK_ARG(offset->scalar_type() == at::kFloat, kQmm, "offset",
                      "must be float32 with A8W4, but got ", offset->scalar_type());
    p.bias = channel_vector("offset", *offset, n).expand({n}).contiguous();
  }
  if (pertoken_scale.has_value()) {
    p.pertoken = pertoken_vector(*pertoken_scale, x1, m);
  }
  at::Tensor out = at::empty({m, n}, x1.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  p.x = x1.contiguous();
  p.w = x2.contiguous();
  a8w4_matmul.get(kQmm, x1)(p, out);
  return out;
}

}  // namespace

at::Tensor npu_quant_matmul(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& scale,
                            const std::optional<at::Tensor>& offset,
                            const std::optional<at::Tensor>& pertoken_scale,
                            const std::optional<at::Tensor>& bias,
                            std::optional<int64_t> output_dtype, std::optional<int64_t> x1_dtype,
                            std::optional<int64_t> x2_dtype,
                            std::optional<int64_t> pertoken_scale_dtype,
                            std::optional<int64_t> scale_dtype, at::OptionalIntArrayRef group_sizes,
                            const std::optional<at::Tensor>& y_scale) {
  if (x1.scalar_type() == at::kChar && x2.scalar_type() == at::kInt) {
    check_declared_dtype("x1_dtype", x1_dtype, x1, "x1");
    check_declared_dtype("x2_dtype", x2_dtype, x2, "x2");
    OPENNPU_CHECK_ARG(!y_scale.has_value(), kQmm, "y_scale",
                      "must be None (an Ascend950 output scale, not supported by opennpu)");
    return a8w4_quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype,
                             group_sizes);
  }
  // Operand dtypes: int8 x int8, or int32 x int32 holding eight int4 codes per element.
  OPENNPU_CHECK_ARG(x1.scalar_type() == at::kChar || x1.scalar_type() == at::kInt, kQmm, "x1",
                    "must be int8, or int32 holding eight int4 codes per element; float8, "
                    "hifloat8 and float4 operands are not supported by opennpu, but got ",
                    x1.scalar_type());
  OPENNPU_CHECK_ARG(x2.scalar_type() == x1.scalar_type(), kQmm, "x2",
                    "must have the dtype of 'x1' (", x1.scalar_type(), "), but got ",
                    x2.scalar_type());
  check_same_device(kQmm, "x2", x2, "x1", x1);
  check_declared_dtype("x1_dtype", x1_dtype, x1, "x1");
  check_declared_dtype("x2_dtype", x2_dtype, x2, "x2");
  check_declared_dtype("scale_dtype", scale_dtype, scale, "scale");
  if (pertoken_scale.has_value()) {
    check_declared_dtype("pertoken_scale_dtype", pertoken_scale_dtype, *pertoken_scale,
                         "pertoken_scale");
  }
  if (group_sizes.has_value()) {
    bool grouped = false;
    for (int64_t g : *group_sizes) grouped = grouped || g != 0;
    OPENNPU_CHECK_ARG(group_sizes->size() == 3 && !grouped, kQmm, "group_sizes",
                      "must be None or [0, 0, 0]: per-group quantisation (A8W4 / A4W4 groups, "
                      "MX blocks) is not supported by opennpu yet, but got ", *group_sizes);
  }
  OPENNPU_CHECK_ARG(!y_scale.has_value(), kQmm, "y_scale",
                    "must be None (an Ascend950 output scale, not supported by opennpu)");
  OPENNPU_CHECK_ARG(x1.dim() >= 2 && x1.dim() <= 6, kQmm, "x1",
                    "must have 2 to 6 dims, but got shape ", shape_str(x1.sizes()));
  OPENNPU_CHECK_ARG(x2.dim() >= 2 && x2.dim() <= 6, kQmm, "x2",
                    "must have 2 to 6 dims, but got shape ", shape_str(x2.sizes()));
  const bool int4 = x1.scalar_type() == at::kInt;
  const at::ScalarType out_dtype = parse_output_dtype(output_dtype);

  // Shapes: x1 [..., m, k] (int4: [..., m, k / 8]); x2 [..., k, n] (int4: [..., k, n / 8], or
  // [..., k / 8, n] as the transpose of a contiguous [..., n, k / 8]).
  QuantMatmulArgs op;
  op.int4 = int4;
  op.m = x1.size(-2);
  op.k = int4 ? 8 * x1.size(-1) : x1.size(-1);
  const at::Tensor x2t = x2.mT();
  const bool x2_is_transpose = !x2.is_contiguous() && x2t.is_contiguous();
  if (int4 && x2.size(-2) != op.k) {
    OPENNPU_CHECK_ARG(8 * x2.size(-2) == op.k && x2_is_transpose, kQmm, "x2",
                      "must be int4 words of shape [..., k, n / 8] or the transpose of a "
                      "contiguous [..., n, k / 8], with k = ", op.k,
                      " (8 x the last dim of 'x1'), but got shape ", shape_str(x2.sizes()),
                      x2_is_transpose ? " (a transpose)" : "");
    op.w_trans = true;
    op.n = x2.size(-1);
  } else {
    OPENNPU_CHECK_ARG(x2.size(-2) == op.k, kQmm, "x2", "must have k = ", op.k,
                      int4 ? " (8 x the last dim of 'x1')" : " (the last dim of 'x1')",
                      " rows (dim -2), but got shape ", shape_str(x2.sizes()));
    op.w_trans = !int4 && x2_is_transpose;
    op.n = int4 ? 8 * x2.size(-1) : x2.size(-1);
  }
  const c10::IntArrayRef a_batch = x1.sizes().slice(0, x1.dim() - 2);
  const c10::IntArrayRef w_batch = x2.sizes().slice(0, x2.dim() - 2);
  std::vector<int64_t> out_batch;
  try {
    out_batch = at::infer_size(a_batch, w_batch);
  } catch (const c10::Error&) {
    OPENNPU_CHECK_ARG(false, kQmm, "x2", "must have batch dims that broadcast with those of 'x1' (",
                      shape_str(a_batch), "), but got ", shape_str(w_batch));
  }
  const int64_t m = op.m, n = op.n;
  const int64_t batches = c10::multiply_integers(out_batch);

  // Scales, offset, bias.
  check_same_device(kQmm, "scale", scale, "x1", x1);
  OPENNPU_CHECK_ARG(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16 ||
                        scale.scalar_type() == at::kLong,
                    kQmm, "scale", "must be float32, bfloat16 or int64 (npu_trans_quant_param's "
                    "encoding), but got ", scale.scalar_type());
  OPENNPU_CHECK_ARG(scale.numel() > 0, kQmm, "scale", "must not be empty");
  QuantMatmulEpilogue& e = op.epilogue;
  e.m = m;
  at::Tensor packed_offset;
  if (scale.scalar_type() == at::kLong) {
    channel_vector("scale", scale.to(at::kFloat), n);  // the shape check
    std::tie(e.scale, packed_offset) = decode_int64_scale(scale);
  } else {
    e.scale = channel_vector("scale", scale, n);
  }
  if (offset.has_value()) {
    check_same_device(kQmm, "offset", *offset, "x1", x1);
    OPENNPU_CHECK_ARG(out_dtype == at::kChar, kQmm, "offset",
                      "applies only to int8 outputs (output_dtype None or torch.int8), but "
                      "output_dtype is ", out_dtype);
    OPENNPU_CHECK_ARG(offset->scalar_type() == at::kFloat, kQmm, "offset",
                      "must be float32, but got ", offset->scalar_type());
    e.offset = channel_vector("offset", *offset, n);
  }
  // An int64 scale carries its own offset (npu_trans_quant_param(scale, offset)); it is the one
  // used, as Ascend reads it from there.
  if (packed_offset.defined()) {
    OPENNPU_CHECK_ARG(out_dtype == at::kChar, kQmm, "scale",
                      "carries an offset (npu_trans_quant_param(scale, offset)), which applies "
                      "only to int8 outputs, but output_dtype is ", out_dtype);
    e.offset = packed_offset;
  }
  if (pertoken_scale.has_value()) {
    const at::Tensor& pt = *pertoken_scale;
    OPENNPU_CHECK_ARG(out_dtype != at::kInt, kQmm, "pertoken_scale",
                      "does not apply to int32 outputs (the raw accumulator)");
    e.pertoken = pertoken_vector(pt, x1, m);
  }
  if (bias.has_value()) {
    const at::Tensor& bs = *bias;
    check_same_device(kQmm, "bias", bs, "x1", x1);
    const auto bt = bs.scalar_type();
    OPENNPU_CHECK_ARG(bt == at::kInt || bt == at::kFloat || bt == at::kBFloat16 ||
                          bt == at::kHalf,
                      kQmm, "bias", "must be int32, bfloat16, float16 or float32, but got ", bt);
    OPENNPU_CHECK_ARG(bt == at::kInt || out_dtype == at::kHalf || out_dtype == at::kBFloat16,
                      kQmm, "bias", "must be int32 for ", out_dtype, " outputs (float biases are "
                      "added after dequantisation, to float16 / bfloat16 outputs), but got ", bt);
    const int64_t out_dim = std::max(x1.dim(), x2.dim());
    const bool batched = bs.dim() == 3 && out_dim == 3 && bs.size(0) == batches &&
                         bs.size(1) == 1 && bs.size(2) == n;
    OPENNPU_CHECK_ARG((bs.dim() == 1 && bs.size(0) == n) || batched, kQmm, "bias",
                      "must have shape [", n, "], or [batch, 1, ", n,
                      "] for a 3-D output (batch = ", batches, "), but got ",
                      shape_str(bs.sizes()));
    const at::Tensor rows = bs.reshape({bs.dim() == 3 ? bs.size(0) : 1, n}).contiguous();
    if (bt == at::kInt) {
      e.bias_int = rows;
    } else {
      e.bias_float = rows.to(at::kFloat);
    }
  }

  std::vector<int64_t> out_shape = out_batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  at::Tensor out = at::empty(out_shape, x1.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  op.a = x1.contiguous();
  op.w = op.w_trans ? x2t.contiguous() : x2.contiguous();
  op.out_batch = std::move(out_batch);
  op.a_batch.assign(a_batch.begin(), a_batch.end());
  op.w_batch.assign(w_batch.begin(), w_batch.end());
  quant_matmul.get(kQmm, x1)(op, out);
  return out;
}

at::Tensor npu_trans_quant_param(const at::Tensor& scale, const std::optional<at::Tensor>& offset,
                                 std::optional<int64_t> round_mode) {
  constexpr const char* op = "npu_trans_quant_param";
  OPENNPU_CHECK_ARG(scale.scalar_type() == at::kFloat, op, "scale", "must be float32, but got ",
                    scale.scalar_type());
  OPENNPU_CHECK_ARG((scale.dim() == 1 || scale.dim() == 2) && scale.numel() > 0, op, "scale",
                    "must be a non-empty 1-D or 2-D tensor, but got shape ",
                    shape_str(scale.sizes()));
  const int64_t mode = round_mode.value_or(0);
  OPENNPU_CHECK_ARG(mode == 0 || mode == 1, op, "round_mode",
                    "must be 0 (truncate to fp19) or 1 (round to nearest even fp19), but got ",
                    mode);
  std::vector<int64_t> shape(scale.sizes().begin(), scale.sizes().end());
  at::Tensor off;
  if (offset.has_value()) {
    off = *offset;
    check_same_device(op, "offset", off, "scale", scale);
    OPENNPU_CHECK_ARG(off.scalar_type() == at::kFloat, op, "offset", "must be float32, but got ",
                      off.scalar_type());
    OPENNPU_CHECK_ARG((off.dim() == 1 || off.dim() == 2) && off.numel() > 0, op, "offset",
                      "must be a non-empty 1-D or 2-D tensor, but got shape ",
                      shape_str(off.sizes()));
    const int64_t t = std::max(scale.numel(), off.numel());
    OPENNPU_CHECK_ARG((off.numel() == 1 || off.numel() == t) &&
                          (scale.numel() == 1 || scale.numel() == t),
                      op, "offset", "must have 1 element or as many as 'scale' (",
                      scale.numel(), "), but got shape ", shape_str(off.sizes()));
    if (scale.dim() == 1) shape = {t};
    OPENNPU_CHECK_ARG(scale.dim() == 1 || scale.numel() == t, op, "offset",
                      "must not have more elements than a 2-D 'scale' (", scale.numel(),
                      "), but got shape ", shape_str(off.sizes()));
    off = off.reshape({off.numel()}).contiguous();
  }
  const at::Tensor s = scale.reshape({scale.numel()}).contiguous();
  at::Tensor out = at::empty(shape, scale.options().dtype(at::kLong));
  const float* ps = s.const_data_ptr<float>();
  const float* po = off.defined() ? off.const_data_ptr<float>() : nullptr;
  int64_t* pout = out.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < out.numel(); ++i) {
    uint32_t bits = std::bit_cast<uint32_t>(ps[s.numel() == 1 ? 0 : i]);
    if (mode == 1 && (bits & 0x7F800000u) != 0x7F800000u) {  // finite: round to 10 mantissa bits
      bits += 0xFFFu + ((bits >> 13) & 1u);
    }
    uint64_t v = (bits & 0xFFFFE000u) | (uint64_t{1} << 46);
    if (po != nullptr) {
      const float o = po[off.numel() == 1 ? 0 : i];
      const int64_t q = std::isnan(o) ? 0 : static_cast<int64_t>(
                                                 std::clamp(std::nearbyint(o), -256.f, 255.f));
      v = (v & 0x4000FFFFFFFFull) | ((static_cast<uint64_t>(q) & 0x1FFu) << 37);
    }
    pout[i] = static_cast<int64_t>(v);
  }
  return out;
}

at::Tensor npu_convert_weight_to_int4pack(const at::Tensor& weight, int64_t inner_k_tiles) {
  constexpr const char* op = "npu_convert_weight_to_int4pack";
  OPENNPU_CHECK_ARG(weight.scalar_type() == at::kInt, op, "weight",
                    "must be int32 codes in [-8, 7] (packing float32 weights to float4 is an "
                    "Ascend950 format, not supported by opennpu), but got ", weight.scalar_type());
  OPENNPU_CHECK_ARG(weight.dim() == 2 || weight.dim() == 3, op, "weight",
                    "must have 2 or 3 dims, but got shape ", shape_str(weight.sizes()));
  OPENNPU_CHECK_ARG(weight.size(-1) % 8 == 0, op, "weight",
                    "must have a last dim divisible by 8 (eight int4 codes per int32), but got "
                    "shape ", shape_str(weight.sizes()));
  OPENNPU_CHECK_ARG(inner_k_tiles >= 0, op, "inner_k_tiles",
                    "must be >= 0 (a reserved argument, unused), but got ", inner_k_tiles);
  std::vector<int64_t> shape(weight.sizes().begin(), weight.sizes().end());
  shape.back() /= 8;
  at::Tensor packed = at::empty(shape, weight.options());
  if (weight.numel() == 0) return packed;
  const auto [lo, hi] = weight.aminmax();
  const int64_t low = lo.item<int64_t>(), high = hi.item<int64_t>();
  OPENNPU_CHECK_ARG(low >= -8 && high <= 7, op, "weight",
                    "must hold int4 values in [-8, 7], but its values range over [", low, ", ",
                    high, "]");
  pack_int4.get(op, weight)(weight.contiguous(), packed);
  return packed;
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_quant_matmul", &npu_quant_matmul);
  m.impl("npu_trans_quant_param", &npu_trans_quant_param);
  m.impl("npu_convert_weight_to_int4pack", &npu_convert_weight_to_int4pack);
}

}  // namespace opennpu::quant
