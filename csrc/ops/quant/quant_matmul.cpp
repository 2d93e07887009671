// Entry points of npu_quant_matmul, npu_trans_quant_param and npu_convert_weight_to_int4pack:
// validation, scale decoding, output allocation, the call of the device's kernel (the int32
// product and the fused epilogue, quant_matmul.h), CPU registration.
#include "ops/quant/quant_matmul.h"

#include <ATen/ExpandUtils.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <array>
#include <bit>
#include <limits>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "common/checks.h"
#include "common/dtype.h"

namespace opennpu::quant {

KernelSlots<QuantMatmulFn> quant_matmul;
KernelSlots<PackInt4Fn> pack_int4;
KernelSlots<UnpackInt4Fn> unpack_int4;
KernelSlots<A8W4MatmulFn> a8w4_matmul;
KernelSlots<FloatQuantMatmulFn> float_quant_matmul;

namespace {

constexpr const char* kQmm = "npu_quant_matmul";

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

// The output's batch dims: those of x1 and x2 broadcast.
std::vector<int64_t> broadcast_batch(const at::Tensor& x1, const at::Tensor& x2) {
  const c10::IntArrayRef a_batch = x1.sizes().slice(0, x1.dim() - 2);
  const c10::IntArrayRef w_batch = x2.sizes().slice(0, x2.dim() - 2);
  try {
    return at::infer_size(a_batch, w_batch);
  } catch (const c10::Error&) {
    OPENNPU_CHECK_ARG(false, kQmm, "x2", "must have batch dims that broadcast with those of 'x1' (",
                      shape_str(a_batch), "), but got ", shape_str(w_batch));
  }
  return {};
}

// bias: [n], or [batch, 1, n] for a 3-D output; int32 (added to the integer accumulator; integer
// operands only) or bfloat16 / float16 / float32 (added after the scales, float outputs).
void parse_bias(const at::Tensor& bs, const at::Tensor& x1, int64_t out_dim, int64_t batches,
                int64_t n, at::ScalarType out_dtype, bool float_operands, QuantMatmulEpilogue& e) {
  check_same_device(kQmm, "bias", bs, "x1", x1);
  const auto bt = bs.scalar_type();
  if (float_operands) {
    OPENNPU_CHECK_ARG(bt == at::kFloat || bt == at::kBFloat16 || bt == at::kHalf, kQmm, "bias",
                      "must be bfloat16, float16 or float32 with float8 / float4 operands, but "
                      "got ", bt);
  } else {
    OPENNPU_CHECK_ARG(bt == at::kInt || bt == at::kFloat || bt == at::kBFloat16 ||
                          bt == at::kHalf,
                      kQmm, "bias", "must be int32, bfloat16, float16 or float32, but got ", bt);
    OPENNPU_CHECK_ARG(bt == at::kInt || out_dtype == at::kHalf || out_dtype == at::kBFloat16,
                      kQmm, "bias", "must be int32 for ", out_dtype, " outputs (float biases are "
                      "added after dequantisation, to float16 / bfloat16 outputs), but got ", bt);
  }
  const bool batched = bs.dim() == 3 && out_dim == 3 && bs.size(0) == batches &&
                       bs.size(1) == 1 && bs.size(2) == n;
  OPENNPU_CHECK_ARG((bs.dim() == 1 && bs.size(0) == n) || batched, kQmm, "bias",
                    "must have shape [", n, "], or [batch, 1, ", n,
                    "] for a 3-D output (batch = ", batches, "), but got ", shape_str(bs.sizes()));
  const at::Tensor rows = bs.reshape({bs.dim() == 3 ? bs.size(0) : 1, n}).contiguous();
  if (bt == at::kInt) {
    e.bias_int = rows;
  } else {
    e.bias_float = rows.to(at::kFloat);
  }
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

// ----------------------------------------------------------------------------- float operands

namespace {

bool is_byte_sized(const at::Tensor& t) {
  const auto st = t.scalar_type();
  return st == at::kByte || st == at::kChar || st == at::kFloat8_e4m3fn ||
         st == at::kFloat8_e5m2 || st == at::kFloat8_e8m0fnu || st == at::kFloat4_e2m1fn_x2;
}

}  // namespace

// The float element format of x1 / x2 (its dtype, or x?_dtype reinterpreting a byte tensor), or
// nullopt for the integer paths.
std::optional<FloatCode> float_code(const char* op, const char* arg, const char* dtype_arg,
                                    const at::Tensor& t, std::optional<int64_t> declared) {
  const auto st = t.scalar_type();
  int64_t code = declared.value_or(static_cast<int64_t>(st));
  std::optional<FloatCode> f;
  if (code == kNpuHif8) f = FloatCode::kHif8;
  if (code == kNpuE1m2) f = FloatCode::kE1m2;
  if (code == static_cast<int64_t>(at::kFloat8_e4m3fn) || code == kNpuE4m3) f = FloatCode::kE4m3;
  if (code == static_cast<int64_t>(at::kFloat8_e5m2) || code == kNpuE5m2) f = FloatCode::kE5m2;
  if (code == static_cast<int64_t>(at::kFloat4_e2m1fn_x2) || code == kNpuE2m1) {
    f = FloatCode::kE2m1;
  }
  if (f.has_value() && declared.has_value()) {
    OPENNPU_CHECK_ARG(is_byte_sized(t), op, arg, "must hold one byte per element (int8, "
                      "uint8, float8 or float4_e2m1fn_x2) when '", dtype_arg, "' is ",
                      dtype_name(*declared), ", but got ", st);
  }
  return f;
}

// Whether a scale holds float8_e8m0 block scales (its dtype, or scale_dtype /
// pertoken_scale_dtype naming torch.float8_e8m0fnu / torch_npu.float8_e8m0fnu).
bool is_e8m0(const char* op, const char* arg, const char* dtype_arg, const at::Tensor& t,
             std::optional<int64_t> declared) {
  if (!declared.has_value()) return t.scalar_type() == at::kFloat8_e8m0fnu;
  const int64_t code = *declared;
  if (code == kNpuE8m0 || code == static_cast<int64_t>(at::kFloat8_e8m0fnu)) {
    OPENNPU_CHECK_ARG(is_byte_sized(t), op, arg, "must hold one byte per element (uint8, "
                      "int8 or float8_e8m0fnu) when '", dtype_arg,
                      "' is float8_e8m0fnu, but got ", t.scalar_type());
    return true;
  }
  OPENNPU_CHECK_ARG(code == static_cast<int64_t>(t.scalar_type()), op, dtype_arg,
                    "must be None, float8_e8m0fnu (torch 44 / torch_npu 293) or the dtype of '",
                    arg, "' (", t.scalar_type(), "), but got ", dtype_name(code));
  return false;
}

// op-plugin's test of a transposed operand: the last two dims are a transpose of a contiguous
// tensor (and not both of size 1). float4 codes are packed along the memory-contiguous dim.
bool is_transpose_last_two(const at::Tensor& t) {
  const int64_t d1 = t.dim() - 1, d2 = t.dim() - 2;
  if (t.stride(d2) != 1 || t.stride(d1) != t.size(d2)) return false;
  int64_t expected = t.size(d1) * t.size(d2);
  for (int64_t d = t.dim() - 3; d >= 0; --d) {
    if (t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return !(t.size(d1) == 1 && t.size(d2) == 1);
}

// An operand's bytes in memory orientation (FloatOperand), its batch count and logical dims.
FloatOperand float_operand(const at::Tensor& t, FloatCode code) {
  FloatOperand op;
  op.code = code;
  const bool fp4 = is_fp4(code);
  const at::Tensor bytes = t.scalar_type() == at::kByte ? t : t.view(at::kByte);
  op.trans = fp4 ? is_transpose_last_two(t)
                 : !t.is_contiguous() && t.mT().is_contiguous() && t.size(-1) > 1;
  op.codes = op.trans ? bytes.mT().contiguous() : bytes.contiguous();
  op.rows = op.codes.size(-2);
  op.cols = op.codes.size(-1) * (fp4 ? 2 : 1);
  op.batches = c10::multiply_integers(t.sizes().slice(0, t.dim() - 2));
  return op;
}

// e8m0 codes -> fp32: 2^(code - 127), code 255 NaN (as torch.float8_e8m0fnu converts).
at::Tensor decode_e8m0(const at::Tensor& t) {
  const at::Tensor codes = (t.scalar_type() == at::kByte ? t : t.view(at::kByte)).contiguous();
  at::Tensor out = at::empty(codes.sizes(), codes.options().dtype(at::kFloat));
  const uint8_t* in = codes.const_data_ptr<uint8_t>();
  float* o = out.mutable_data_ptr<float>();
  for (int64_t i = 0; i < codes.numel(); ++i) {
    o[i] = in[i] == 255 ? std::numeric_limits<float>::quiet_NaN()
                        : std::ldexp(1.f, static_cast<int>(in[i]) - 127);
  }
  return out;
}

namespace {

// op-plugin's check that a scale is laid out like its operand: the operand's last two dims and
// the scale's two dims before its `trailing` ones (MX [.., ceil(k / 64), 2]: 1; per-block: 0)
// both transposes (stride(d + 1) == stride(d) * size(d)) or neither. opennpu reads every layout
// by its logical shape; the check keeps a weight's [n, ceil(k / 64), 2] scale from being read as
// [ceil(k / 64), n, 2] where the two sizes happen to be equal. Dims of size 0 or 1 leave a
// layout's transposition undefined (op-plugin exempts [1, 1] ones; opennpu all of them).
void check_same_transpose(const char* op, const char* arg, const at::Tensor& s, const char* x_arg,
                          const at::Tensor& x, int64_t trailing) {
  const int64_t dx = x.dim() - 2, ds = s.dim() - 2 - trailing;
  if (x.size(dx) <= 1 || x.size(dx + 1) <= 1 || s.size(ds) <= 1 || s.size(ds + 1) <= 1) return;
  const bool x_trans = x.stride(dx + 1) == x.stride(dx) * x.size(dx);
  const bool s_trans = s.stride(ds + 1) == s.stride(ds) * s.size(ds);
  const char* dims = trailing == 0 ? "of its last two dims" : "of its dims -3 and -2";
  OPENNPU_CHECK_ARG(x_trans == s_trans, op, arg, x_trans ? "must be a transpose (" :
                    "must not be a transpose (", dims, "), as '", x_arg,
                    x_trans ? "' is one" : "' is not", " (op-plugin: \"Input ", x_arg,
                    " tensor and ", arg, " tensor's transpose are not same, please check "
                    "input\"), but got shape ", shape_str(s.sizes()), " with strides ",
                    shape_str(s.strides()));
}

}  // namespace

// An MX scale, logical [*batch, rows, ceil(k / 64), 2] (x1's, rows = m) or
// [*batch, ceil(k / 64), cols, 2] (x2's, cols = n), as fp32 per block of 32 along K:
// [batches or 1, other, ceil(k / 32)] (k_first false) or [batches or 1, ceil(k / 32), other].
at::Tensor mx_block_scale(const char* op, const char* arg, const at::Tensor& s, const char* x_arg,
                          const at::Tensor& x, c10::IntArrayRef batch, int64_t other, int64_t k,
                          bool k_first) {
  check_same_device(op, arg, s, x_arg, x);
  const int64_t pairs = (k + 2 * kMxBlock - 1) / (2 * kMxBlock);
  const int64_t blocks = (k + kMxBlock - 1) / kMxBlock;
  std::vector<int64_t> want(batch.begin(), batch.end());
  if (k_first) {
    want.insert(want.end(), {pairs, other, 2});
  } else {
    want.insert(want.end(), {other, pairs, 2});
  }
  const c10::IntArrayRef tail(want.data() + batch.size(), 3);
  const bool ok = s.sizes() == c10::IntArrayRef(want) || s.sizes() == tail;
  OPENNPU_CHECK_ARG(ok, op, arg, "must have shape ", shape_str(want),
                    batch.empty() ? "" : " (or without the batch dims)", " (float8_e8m0 scales "
                    "of blocks of 32 along k = ", k, ", two per pair: ", k_first ?
                    "[ceil(k / 64), n, 2]" : "[m, ceil(k / 64), 2]", ", as npu_dynamic_mx_quant "
                    "writes them), but got ", shape_str(s.sizes()));
  check_same_transpose(op, arg, s, x_arg, x, 1);
  const int64_t sb = s.dim() == 3 ? 1 : c10::multiply_integers(batch);
  at::Tensor f = decode_e8m0(s).reshape({sb, k_first ? pairs : other, k_first ? other : pairs, 2});
  if (k_first) {  // [sb, pairs, other, 2] -> [sb, 2 pairs, other]
    f = f.permute({0, 1, 3, 2}).reshape({sb, 2 * pairs, other}).narrow(1, 0, blocks);
  } else {
    f = f.reshape({sb, other, 2 * pairs}).narrow(2, 0, blocks);
  }
  return f.contiguous();
}

namespace {

// Per-block float32 scales (FloatBlockScales): the group sizes Ascend950 implements, [1, 128,
// 128] ("G-B", pertoken-perblock) and [128, 128, 128] ("B-B", perblock-perblock).
constexpr int64_t kBlockGroup = 128;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// group_sizes [gm, gn, gk] (three values) with its zeros inferred: gm 1 when x1's per-block
// scale pt has a row per row of x1, else 128; gn and gk 128.
std::array<int64_t, 3> infer_groups(const at::Tensor& pt, at::OptionalIntArrayRef group_sizes,
                                    int64_t m) {
  std::array<int64_t, 3> g{0, 0, 0};
  if (group_sizes.has_value()) {
    for (size_t i = 0; i < 3; ++i) g[i] = (*group_sizes)[i];
  }
  if (g[0] == 0) g[0] = pt.size(-2) == m ? 1 : kBlockGroup;
  if (g[1] == 0) g[1] = kBlockGroup;
  if (g[2] == 0) g[2] = kBlockGroup;
  return g;
}

// The group sizes the per-block scales' shapes imply (infer_groups), or nullopt when the shapes
// are not per-block ones.
std::optional<std::array<int64_t, 3>> block_groups(const at::Tensor& pt, const at::Tensor& scale,
                                                   at::OptionalIntArrayRef group_sizes,
                                                   int64_t m, int64_t k, int64_t n) {
  if (group_sizes.has_value() && group_sizes->size() != 3) return std::nullopt;
  if (pt.dim() < 2 || scale.dim() < 2) return std::nullopt;
  const std::array<int64_t, 3> g = infer_groups(pt, group_sizes, m);
  for (int64_t v : g) {
    if (v <= 0) return std::nullopt;
  }
  const bool fits = pt.size(-2) == ceil_div(m, g[0]) && pt.size(-1) == ceil_div(k, g[2]) &&
                    scale.size(-2) == ceil_div(k, g[2]) && scale.size(-1) == ceil_div(n, g[1]);
  if (!fits) return std::nullopt;
  return g;
}

// Whether float32 scales are per-block ones: group_sizes names groups, or (as op-plugin tells
// them apart) 'pertoken_scale' has x1's dims and 'scale' x2's, at least 2 -- except op-plugin's
// per-token [m, 1] with a per-channel [1, n] that is no per-block layout.
bool is_block_mode(const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& scale,
                   const std::optional<at::Tensor>& pertoken_scale,
                   at::OptionalIntArrayRef group_sizes, int64_t m, int64_t k, int64_t n) {
  if (group_sizes.has_value()) {
    for (int64_t g : *group_sizes) {
      if (g != 0) return true;
    }
  }
  if (!pertoken_scale.has_value()) return false;
  const at::Tensor& pt = *pertoken_scale;
  if (pt.dim() < 2 || scale.dim() < 2 || pt.dim() != x1.dim() || scale.dim() != x2.dim()) {
    return false;
  }
  const bool per_token = pt.dim() == 2 && pt.size(0) == m && pt.size(1) == 1 &&
                         scale.dim() == 2 && scale.size(0) == 1 &&
                         (scale.size(1) == n || scale.size(1) == 1);
  return !per_token || block_groups(pt, scale, group_sizes, m, k, n).has_value();
}

// npu_quant_matmul's per-block float32 scales: 'pertoken_scale' x1's [*x1 batch, ceil(m / gm),
// ceil(k / gk)], 'scale' x2's [*x2 batch, ceil(k / gk), ceil(n / gn)], laid out as transposes
// when their operands are; group_sizes [gm, gn, gk] None / zeros (inferred from the shapes),
// [1, 128, 128] or [128, 128, 128].
FloatBlockScales parse_block_scales(const at::Tensor& x1, const at::Tensor& x2,
                                    const at::Tensor& scale,
                                    const std::optional<at::Tensor>& pertoken_scale,
                                    at::OptionalIntArrayRef group_sizes, int64_t m, int64_t k,
                                    int64_t n) {
  OPENNPU_CHECK_ARG(pertoken_scale.has_value(), kQmm, "pertoken_scale",
                    "must be given with per-block scales (group_sizes ", *group_sizes,
                    "): x1's float32 [m or ceil(m / 128), ceil(k / 128)] block scales");
  const at::Tensor& pt = *pertoken_scale;
  check_same_device(kQmm, "pertoken_scale", pt, "x1", x1);
  if (group_sizes.has_value()) {
    const auto& g = *group_sizes;
    bool in_range = g.size() == 3;
    for (int64_t v : g) in_range = in_range && v >= 0 && v <= 65535;
    OPENNPU_CHECK_ARG(in_range, kQmm, "group_sizes", "must hold three values in [0, 65535] "
                      "([group_m, group_n, group_k]), but got ", g);
    const bool supported = (g[0] == 0 || g[0] == 1 || g[0] == kBlockGroup) &&
                           (g[1] == 0 || g[1] == kBlockGroup) && (g[2] == 0 || g[2] == kBlockGroup);
    OPENNPU_CHECK_ARG(supported, kQmm, "group_sizes", "must be [1, 128, 128] (pertoken-"
                      "perblock) or [128, 128, 128] (perblock-perblock), zeros inferred from "
                      "the scales' shapes, with float32 per-block scales (or [1, 1, 32] with "
                      "float8_e8m0 MX scales); other group sizes are not supported, but got ", g);
  }
  OPENNPU_CHECK_ARG(scale.scalar_type() == at::kFloat, kQmm, "scale",
                    "must be float32 per-block scales [ceil(k / 128), ceil(n / 128)], but got ",
                    scale.scalar_type());
  OPENNPU_CHECK_ARG(pt.scalar_type() == at::kFloat, kQmm, "pertoken_scale",
                    "must be float32 per-block scales [m or ceil(m / 128), ceil(k / 128)], but "
                    "got ", pt.scalar_type());
  OPENNPU_CHECK_ARG(pt.dim() == x1.dim(), kQmm, "pertoken_scale",
                    "must have the dims of 'x1' (", x1.dim(), ": its batch dims, then [m or "
                    "ceil(m / 128), ceil(k / 128)]) with per-block scales, but got shape ",
                    shape_str(pt.sizes()));
  OPENNPU_CHECK_ARG(scale.dim() == x2.dim(), kQmm, "scale",
                    "must have the dims of 'x2' (", x2.dim(), ": its batch dims, then "
                    "[ceil(k / 128), ceil(n / 128)]) with per-block scales, but got shape ",
                    shape_str(scale.sizes()));
  check_same_transpose(kQmm, "pertoken_scale", pt, "x1", x1, 0);
  check_same_transpose(kQmm, "scale", scale, "x2", x2, 0);
  const std::array<int64_t, 3> g = infer_groups(pt, group_sizes, m);
  const int64_t ms = ceil_div(m, g[0]), ks = ceil_div(k, g[2]), ns = ceil_div(n, g[1]);
  std::vector<int64_t> want1(x1.sizes().begin(), x1.sizes().end() - 2);
  std::vector<int64_t> want2(x2.sizes().begin(), x2.sizes().end() - 2);
  want1.insert(want1.end(), {ms, ks});
  want2.insert(want2.end(), {ks, ns});
  OPENNPU_CHECK_ARG(pt.sizes() == c10::IntArrayRef(want1), kQmm, "pertoken_scale",
                    "must have shape ", shape_str(want1), " (x1's batch dims, ceil(m / ", g[0],
                    "), ceil(k / ", g[2], ") for m = ", m, ", k = ", k, ", group_sizes [", g[0],
                    ", ", g[1], ", ", g[2], "]), but got ", shape_str(pt.sizes()));
  OPENNPU_CHECK_ARG(scale.sizes() == c10::IntArrayRef(want2), kQmm, "scale",
                    "must have shape ", shape_str(want2), " (x2's batch dims, ceil(k / ", g[2],
                    "), ceil(n / ", g[1], ") for k = ", k, ", n = ", n, ", group_sizes [", g[0],
                    ", ", g[1], ", ", g[2], "]), but got ", shape_str(scale.sizes()));
  FloatBlockScales b;
  b.gm = g[0];
  b.gn = g[1];
  b.gk = g[2];
  b.x1_block = pt.reshape({c10::multiply_integers(pt.sizes().slice(0, pt.dim() - 2)), ms, ks})
                   .contiguous();
  b.x2_block =
      scale.reshape({c10::multiply_integers(scale.sizes().slice(0, scale.dim() - 2)), ks, ns})
          .contiguous();
  return b;
}

}  // namespace

namespace {

// npu_quant_matmul with float8 / float4 operands (FloatQuantMatmulArgs): per-tensor / channel /
// token float32 scales (float8), or MX block scales (float8 / float4).
at::Tensor quant_matmul_float_operands(
    const at::Tensor& x1, const at::Tensor& x2, const at::Tensor& scale,
    const std::optional<at::Tensor>& offset, const std::optional<at::Tensor>& pertoken_scale,
    const std::optional<at::Tensor>& bias, std::optional<int64_t> output_dtype,
    std::optional<FloatCode> c1, std::optional<FloatCode> c2,
    std::optional<int64_t> pertoken_scale_dtype, std::optional<int64_t> scale_dtype,
    at::OptionalIntArrayRef group_sizes) {
  OPENNPU_CHECK_ARG(c1.has_value(), kQmm, "x1", "must be float8 / float4 codes like 'x2' ("
                    "int8 / int4 operands cannot be mixed with float ones), but got ",
                    x1.scalar_type());
  OPENNPU_CHECK_ARG(c2.has_value(), kQmm, "x2", "must be float8 / float4 codes like 'x1' ("
                    "int8 / int4 operands cannot be mixed with float ones), but got ",
                    x2.scalar_type());
  check_same_device(kQmm, "x2", x2, "x1", x1);
  OPENNPU_CHECK_ARG(x1.dim() >= 2 && x1.dim() <= 6, kQmm, "x1",
                    "must have 2 to 6 dims, but got shape ", shape_str(x1.sizes()));
  OPENNPU_CHECK_ARG(x2.dim() >= 2 && x2.dim() <= 6, kQmm, "x2",
                    "must have 2 to 6 dims, but got shape ", shape_str(x2.sizes()));
  at::ScalarType out_dtype = at::kFloat;
  {
    bool ok = false;
    for (at::ScalarType t : {at::kHalf, at::kBFloat16, at::kFloat}) {
      if (output_dtype.has_value() && *output_dtype == static_cast<int64_t>(t)) {
        ok = true;
        out_dtype = t;
      }
    }
    OPENNPU_CHECK_ARG(ok, kQmm, "output_dtype", "must be torch.float16, torch.bfloat16 or "
                      "torch.float32 with float8 / float4 operands, but got ",
                      output_dtype.has_value() ? dtype_name(*output_dtype) : "None");
  }
  OPENNPU_CHECK_ARG(!offset.has_value(), kQmm, "offset",
                    "must be None with float8 / float4 operands (it applies to int8 outputs)");

  FloatQuantMatmulArgs p;
  p.a = float_operand(x1, *c1);
  p.w = float_operand(x2, *c2);
  p.m = p.a.trans ? p.a.cols : p.a.rows;
  p.k = p.a.trans ? p.a.rows : p.a.cols;
  p.n = p.w.trans ? p.w.rows : p.w.cols;
  const int64_t k2 = p.w.trans ? p.w.cols : p.w.rows;
  const bool fp4_1 = is_fp4(*c1), fp4_2 = is_fp4(*c2);
  const bool hif8_1 = *c1 == FloatCode::kHif8, hif8_2 = *c2 == FloatCode::kHif8;
  OPENNPU_CHECK_ARG(k2 == p.k, kQmm, "x2", "must have k = ", p.k, " (that of 'x1', shape ",
                    shape_str(x1.sizes()), "), but its shape ", shape_str(x2.sizes()),
                    " gives k = ", k2, (fp4_1 || fp4_2) ? " (float4 codes are two per byte along "
                    "the memory-contiguous dim: dim -1, or dim -2 of a transpose)" : "");
  OPENNPU_CHECK_ARG(hif8_1 == hif8_2, kQmm, hif8_1 ? "x2_dtype" : "x1_dtype",
                    "must be torch_npu.hifloat8 like '", hif8_1 ? "x1_dtype" : "x2_dtype",
                    "' (hifloat8 operands are multiplied with hifloat8 ones only), but got ",
                    hif8_1 ? "x2 of another type" : "x1 of another type");
  const c10::IntArrayRef a_batch = x1.sizes().slice(0, x1.dim() - 2);
  const c10::IntArrayRef w_batch = x2.sizes().slice(0, x2.dim() - 2);
  p.out_batch = broadcast_batch(x1, x2);
  p.a_batch.assign(a_batch.begin(), a_batch.end());
  p.w_batch.assign(w_batch.begin(), w_batch.end());
  const int64_t m = p.m, k = p.k, n = p.n;
  const int64_t batches = c10::multiply_integers(p.out_batch);

  check_same_device(kQmm, "scale", scale, "x1", x1);
  const bool mx = is_e8m0(kQmm, "scale", "scale_dtype", scale, scale_dtype);
  const bool mx_pt = pertoken_scale.has_value() &&
                     is_e8m0(kQmm, "pertoken_scale", "pertoken_scale_dtype", *pertoken_scale,
                             pertoken_scale_dtype);
  OPENNPU_CHECK_ARG(mx == mx_pt, kQmm, mx ? "pertoken_scale" : "scale",
                    "must be float8_e8m0 block scales like '", mx ? "scale" : "pertoken_scale",
                    "' (MX scaling scales both operands: 'pertoken_scale' x1's, 'scale' x2's), "
                    "but got ", mx ? (pertoken_scale.has_value() ? "another type" : "None")
                                   : "float8_e8m0 scales only for x1");
  OPENNPU_CHECK_ARG(mx || (!fp4_1 && !fp4_2), kQmm, "scale",
                    "must be float8_e8m0 block scales (scale_dtype=torch_npu.float8_e8m0fnu, "
                    "with 'pertoken_scale' for x1) with float4 operands (MX only), but got ",
                    scale.scalar_type());
  OPENNPU_CHECK_ARG(!mx || !hif8_1, kQmm, "scale",
                    "must be float32 with hifloat8 operands (per-tensor / channel / token or "
                    "per-block scales; MX float8_e8m0 scales take float8 / float4 operands), "
                    "but got float8_e8m0 scales");
  QuantMatmulEpilogue& e = p.epilogue;
  e.m = m;
  if (mx) {
    if (group_sizes.has_value()) {
      const auto& g = *group_sizes;
      const bool ok = g.size() == 3 && (g[0] == 0 || g[0] == 1) && (g[1] == 0 || g[1] == 1) &&
                      (g[2] == 0 || g[2] == kMxBlock);
      OPENNPU_CHECK_ARG(ok, kQmm, "group_sizes", "must be None, [0, 0, 0] or [1, 1, 32] with MX "
                        "scales (blocks of 32 along k), but got ", g);
    }
    const at::Tensor sa = mx_block_scale(kQmm, "pertoken_scale", *pertoken_scale, "x1", x1,
                                         a_batch, m, k, false);  // [sb, m, blocks]
    const at::Tensor sw = mx_block_scale(kQmm, "scale", scale, "x2", x2, w_batch, n, k, true);
    // In memory orientation: K along x1's columns unless x1 is a transpose, along x2's rows
    // unless x2 is one.
    p.a.block_scale = p.a.trans ? sa.mT().contiguous() : sa;
    p.w.block_scale = p.w.trans ? sw.mT().contiguous() : sw;
    e.scale = at::ones({1}, x1.options().dtype(at::kFloat));
  } else if (is_block_mode(x1, x2, scale, pertoken_scale, group_sizes, m, k, n)) {
    p.block = parse_block_scales(x1, x2, scale, pertoken_scale, group_sizes, m, k, n);
    e.scale = at::ones({1}, x1.options().dtype(at::kFloat));
  } else {
    if (group_sizes.has_value()) {
      const auto& g = *group_sizes;
      OPENNPU_CHECK_ARG(g.size() == 3 && g[0] == 0 && g[1] == 0 && g[2] == 0, kQmm,
                        "group_sizes", "must be None or [0, 0, 0] with per-tensor / channel / "
                        "token float32 scales; per-block scales take a 2-D (or batched) "
                        "'pertoken_scale' [m or ceil(m / 128), ceil(k / 128)] and 'scale' "
                        "[ceil(k / 128), ceil(n / 128)], but got ", g, " with 'pertoken_scale' ",
                        pertoken_scale.has_value() ? shape_str(pertoken_scale->sizes())
                                                   : std::string("None"),
                        " and 'scale' ", shape_str(scale.sizes()));
    }
    OPENNPU_CHECK_ARG(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16,
                      kQmm, "scale", "must be float32 or bfloat16 with float8 / hifloat8 "
                      "operands (or float8_e8m0 MX block scales with 'pertoken_scale' ones), but "
                      "got ", scale.scalar_type());
    OPENNPU_CHECK_ARG(scale.numel() > 0, kQmm, "scale", "must not be empty");
    e.scale = channel_vector("scale", scale, n);
    if (pertoken_scale.has_value()) {
      const at::Tensor& pt = *pertoken_scale;
      check_same_device(kQmm, "pertoken_scale", pt, "x1", x1);
      OPENNPU_CHECK_ARG(pt.scalar_type() == at::kFloat, kQmm, "pertoken_scale",
                        "must be float32 (or float8_e8m0 MX block scales), but got ",
                        pt.scalar_type());
      if (pt.numel() == 1 && pt.dim() == 1 && m != 1) {
        // One x1 scale: the golden's double scale, scale * pertoken_scale in float32.
        e.scale = at::mul(e.scale, pt.to(at::kFloat));
      } else {
        e.pertoken = pertoken_vector(pt, x1, m);
      }
    }
  }
  if (bias.has_value()) {
    parse_bias(*bias, x1, std::max(x1.dim(), x2.dim()), batches, n, out_dtype, true, e);
  }
  std::vector<int64_t> out_shape = p.out_batch;
  out_shape.push_back(m);
  out_shape.push_back(n);
  at::Tensor out = at::empty(out_shape, x1.options().dtype(out_dtype));
  if (out.numel() == 0) return out;
  float_quant_matmul.get(kQmm, x1)(p, out);
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
  const std::optional<FloatCode> c1 = float_code(kQmm, "x1", "x1_dtype", x1, x1_dtype);
  const std::optional<FloatCode> c2 = float_code(kQmm, "x2", "x2_dtype", x2, x2_dtype);
  if (c1.has_value() || c2.has_value()) {
    OPENNPU_CHECK_ARG(!y_scale.has_value(), kQmm, "y_scale",
                      "must be None (an Ascend950 output scale, not supported by opennpu)");
    return quant_matmul_float_operands(x1, x2, scale, offset, pertoken_scale, bias, output_dtype,
                                       c1, c2, pertoken_scale_dtype, scale_dtype, group_sizes);
  }
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
                    "must be int8, int32 holding eight int4 codes per element, or float8 / "
                    "float4 codes (float8_e4m3fn, float8_e5m2, float4_e2m1fn_x2; hifloat8 is "
                    "not supported by opennpu), but got ",
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
  std::vector<int64_t> out_batch = broadcast_batch(x1, x2);
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
    parse_bias(*bias, x1, std::max(x1.dim(), x2.dim()), batches, n, out_dtype, false, e);
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

at::Tensor int4_words_to_codes(const char* op, const at::Tensor& words) {
  std::vector<int64_t> shape(words.sizes().begin(), words.sizes().end());
  const int64_t w = shape.empty() ? 1 : shape.back();
  if (!shape.empty()) shape.back() *= 8;
  at::Tensor codes = at::empty(shape, words.options().dtype(at::kChar));
  if (words.numel() == 0) return codes;
  const at::Tensor src = words.contiguous().reshape({-1, w});
  at::Tensor dst = codes.view({-1, 8 * w});
  unpack_int4.get(op, words)(src, dst);
  return codes;
}

TORCH_LIBRARY_IMPL(npu, CPU, m) {
  m.impl("npu_quant_matmul", &npu_quant_matmul);
  m.impl("npu_trans_quant_param", &npu_trans_quant_param);
  m.impl("npu_convert_weight_to_int4pack", &npu_convert_weight_to_int4pack);
}

}  // namespace opennpu::quant
