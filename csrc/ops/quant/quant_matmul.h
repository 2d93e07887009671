// Quantised matmul: npu_quant_matmul (int8 / int4 operands, int32 accumulation, per-channel and
// per-token dequantisation or int8 requantisation), npu_trans_quant_param (the int64 scale
// encoding it accepts) and npu_convert_weight_to_int4pack (the packed int4 weights it reads).
//
// The entry points (quant_matmul.cpp) validate, decode the scales into a QuantMatmulEpilogue,
// allocate the output and call the kernel slot of the input's device. A kernel computes the
// int32 product exactly (how is its own choice: the CPU's is described in quant_matmul_cpu.cpp)
// and applies the epilogue once per output element.
#pragma once

#include <ATen/core/Tensor.h>

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "common/kernel_slots.h"

namespace opennpu::quant {

// The epilogue over rows of the accumulator acc [batches * m, n] (int32, or fp32 holding the
// exact int32 values or, for float operands, the fp32 product):
//   v = acc (+ bias_int[b, j]) (in int32), then for float and int8 outputs
//   y = v * scale[j] (* pertoken[i]) (+ bias_float[b, j]) (+ offset[j]) in fp32, rounded once to
//   the output dtype (int8: round half to even, saturated to [-128, 127]); int32 outputs are v.
// Vectors of length n have n elements or one (broadcast); bias tensors are [1 or batches, n].
struct QuantMatmulEpilogue {
  at::Tensor scale;     // fp32 [1] or [n] (unused for int32 outputs)
  at::Tensor pertoken;  // fp32 [m] or undefined
  at::Tensor bias_int;  // int32 [bb, n] or undefined
  at::Tensor bias_float;  // fp32 [bb, n] or undefined
  at::Tensor offset;    // fp32 [1] or [n] or undefined
  int64_t m = 1;        // rows per batch (pertoken index = row % m, bias batch = row / m)
};

// npu_quant_matmul after validation: out [*out_batch, m, n] = epilogue(a @ w) per output batch.
struct QuantMatmulArgs {
  at::Tensor a;  // x1's codes, contiguous [*a_batch, m, k] (int4: int32 words [*a_batch, m, k / 8])
  // x2's codes, contiguous [*w_batch, k, n], or [*w_batch, n, k] when w_trans (int4: int32
  // words, eight codes each along the last dim)
  at::Tensor w;
  bool int4 = false;
  bool w_trans = false;
  int64_t m = 0, k = 0, n = 0;  // k may be 0: the product is then 0
  // The output's batch dims and the operands', which broadcast to them.
  std::vector<int64_t> out_batch, a_batch, w_batch;
  QuantMatmulEpilogue epilogue;
};
// out: contiguous, non-empty, in the output dtype (int8, float16, bfloat16 or int32).
using QuantMatmulFn = void(const QuantMatmulArgs& args, at::Tensor& out);

// Float operands (Ascend950's float8 / MX paths): element codes of float8_e4m3fn, float8_e5m2 or
// float4_e2m1 / float4_e1m2 (two codes per byte, element 2j in the low nibble, along the
// operand's memory-contiguous dim, as npu_dynamic_mx_quant packs them).
// hifloat8 (kHif8): Ascend's tapered 8-bit float (arXiv 2409.16626; en_dtypes.hifloat8, the type
// op-plugin's goldens use): sign bit 7; a prefix-coded "dot" field in bits 6..3 ('11' D=4,
// '10' D=3, '01' D=2, '001' D=1, '0001' D=0, '0000' subnormal); a D-bit sign-magnitude exponent
// with an implicit leading 1 (|E| in [2^(D-1), 2^D - 1], E = 0 for D=0); the remaining bits the
// mantissa: value = +-2^E * 1.M. Subnormal: +-2^(M - 23), M the low 3 bits (M = 0: zero).
// 0x00 is 0, 0x80 NaN, 0x6F / 0xEF +-inf; the largest finite value is 2^15.
enum class FloatCode : uint8_t { kE4m3, kE5m2, kE2m1, kE1m2, kHif8 };
inline bool is_fp4(FloatCode c) { return c == FloatCode::kE2m1 || c == FloatCode::kE1m2; }

// One operand as stored: bytes [batches, rows, cols] (contiguous; float4: cols / 2 bytes per row)
// in memory orientation: x1 is [m, k] or, `trans`, [k, m]; x2 is [k, n] or, `trans`, [n, k].
// block_scale: fp32 (decoded float8_e8m0 powers of two) per block of 32 along K, in the same
// orientation: [batches or 1, rows, ceil(cols / 32)] when K runs along the columns, else
// [batches or 1, ceil(rows / 32), cols]; undefined without MX scaling.
struct FloatOperand {
  at::Tensor codes;  // uint8
  FloatCode code = FloatCode::kE4m3;
  bool trans = false;
  int64_t batches = 1, rows = 0, cols = 0;
  at::Tensor block_scale;
};

// npu_quant_matmul with float operands: out [*out_batch, m, n] = epilogue(A @ W), where A and W
// are the decoded codes (exact in fp32) times their block scales (exact powers of two, barring
// fp32 overflow / underflow, as op-plugin's golden scales the decoded operands in fp32), and
// the product is an fp32 GEMM (fp32 accumulation, the golden's torch.matmul in float32; for few
// rows the CPU kernel sums K panels of 512 with sgemm's beta = 1).
//
// Per-block float32 scales (Ascend950's "G-B" pertoken-perblock, group_sizes [1, 128, 128], and
// "B-B" perblock-perblock, [128, 128, 128]), when x1_block is defined: the operands are decoded
// without scaling and the product is the golden's (op-plugin's per-block CPU golden) sum over
// K blocks in order, in fp32,
//   acc[i, j] = sum_kb fp32(fp32(P_kb[i, j] * x1_block[i / gm, kb]) * x2_block[kb, j / gn]),
//   P_kb = A[:, kb-th gk columns] @ W[kb-th gk rows, :] (an fp32 GEMM of block depth gk),
// starting from +0, then the epilogue (scale 1, bias).
struct FloatBlockScales {
  at::Tensor x1_block;  // fp32 [batches, ceil(m / gm), ceil(k / gk)], contiguous
  at::Tensor x2_block;  // fp32 [batches, ceil(k / gk), ceil(n / gn)], contiguous
  // Each scale has its operand's batch dims (a_batch / w_batch), or none when they have none.
  int64_t gm = 1, gn = 128, gk = 128;
};

struct FloatQuantMatmulArgs {
  FloatOperand a, w;
  int64_t m = 0, k = 0, n = 0;
  std::vector<int64_t> out_batch, a_batch, w_batch;
  QuantMatmulEpilogue epilogue;  // acc is fp32; bias_int unused
  FloatBlockScales block;        // per-block float32 scales, or x1_block undefined
};
using FloatQuantMatmulFn = void(const FloatQuantMatmulArgs& args, at::Tensor& out);
extern KernelSlots<FloatQuantMatmulFn> float_quant_matmul;

// The float operands' arguments, read alike by npu_quant_matmul and npu_grouped_matmul (`op`
// names the op in their error messages).
//
// Type codes these ops read in their *_dtype arguments: torch's ScalarType and torch_npu's DType
// (torch_npu.hifloat8 = 290, float8_e5m2 291, float8_e4m3fn 292, float8_e8m0fnu 293,
// float4_e2m1fn_x2 296, float4_e1m2fn_x2 297).
constexpr int64_t kNpuHif8 = 290, kNpuE5m2 = 291, kNpuE4m3 = 292, kNpuE8m0 = 293, kNpuE2m1 = 296,
                  kNpuE1m2 = 297;
// MX: one float8_e8m0 scale per block of this many elements along K.
constexpr int64_t kMxBlock = 32;

// The float element format of an operand (its dtype, or `declared`, its *_dtype argument,
// reinterpreting a byte tensor), or nullopt for integer / non-quantised operands.
std::optional<FloatCode> float_code(const char* op, const char* arg, const char* dtype_arg,
                                    const at::Tensor& t, std::optional<int64_t> declared);
// Whether a scale holds float8_e8m0 block scales (its dtype, or `declared` naming
// float8_e8m0fnu); `declared` must otherwise be None or the scale's own dtype.
bool is_e8m0(const char* op, const char* arg, const char* dtype_arg, const at::Tensor& t,
             std::optional<int64_t> declared);
// op-plugin's test of a transposed operand: its last two dims are the transpose of a contiguous
// tensor (not both of size 1). float4 codes are packed along the memory-contiguous dim.
bool is_transpose_last_two(const at::Tensor& t);
// An operand's bytes in memory orientation (FloatOperand), its batch count and logical dims;
// block_scale left undefined.
FloatOperand float_operand(const at::Tensor& t, FloatCode code);
// e8m0 codes (any byte dtype) -> fp32: 2^(code - 127), code 255 NaN.
at::Tensor decode_e8m0(const at::Tensor& t);
// An MX scale of operand x (arg / x_arg: their names), logical [*batch, other, ceil(k / 64), 2]
// (x1's, other = m) or, k_first, [*batch, ceil(k / 64), other, 2] (x2's, other = n), the batch
// dims optional, laid out as a transpose when x is one: checked, and decoded to fp32 per block
// of 32 along K, [batches or 1, other, ceil(k / 32)] or, k_first, [batches or 1,
// ceil(k / 32), other] (FloatOperand::block_scale before the operand's orientation).
at::Tensor mx_block_scale(const char* op, const char* arg, const at::Tensor& s, const char* x_arg,
                          const at::Tensor& x, c10::IntArrayRef batch, int64_t other, int64_t k,
                          bool k_first);

// The longest K group A8W4 takes: every partial sum of a group (|x_hi|, |x_lo| <= 8 times
// |w| <= 8, over at most this many rows) stays an integer that fp32 holds exactly.
constexpr int64_t kA8W4MaxGroup = int64_t{1} << 18;

// A8W4: int8 x, int4 weights with per-group scales, as op-plugin's goldens of npu_quant_matmul's
// and npu_grouped_matmul's A8W4 tests compute it (Ascend's A8W4 kernels run int4 x int4 cubes):
// each x code splits as x = 16 * hi + lo + 8, hi = floor(x / 16) and lo = (x & 15) - 8 both in
// [-8, 7]; per K group g (group_size rows of w, in order) the exact int32 products
// H_g = hi[:, g] @ w[g] and L_g = lo[:, g] @ w[g] are scaled, P = fp16(fp32(H_g) * scale[g, j]),
// and summed in float16, acc = fp16(acc + P) (the golden's "atomic" float16 accumulator); then
// y = (fp32(acc_H) * 16 + fp32(acc_L) + bias[j]) * pertoken[i], rounded once to the output
// dtype. 16 * hi + lo = x - 8: the product is that of (x - 8); A8W4 weights are prepared with
// 8 * sum_k(w * scale) folded into the bias.
struct A8W4Args {
  at::Tensor x;         // int8 [m, k], contiguous
  at::Tensor w;         // int32 [k, n / 8]: eight int4 codes per word along n, contiguous
  at::Tensor scale;     // fp32 [k / group_size, n], contiguous
  at::Tensor bias;      // fp32 [n] or undefined
  at::Tensor pertoken;  // fp32 [m] or undefined
  int64_t m = 0, k = 0, n = 0, group_size = 1;
};
// out: [m, n] (a row-major view with a row stride, e.g. rows of a larger output), float16,
// bfloat16 or float32.
using A8W4MatmulFn = void(const A8W4Args& args, at::Tensor& out);

extern KernelSlots<A8W4MatmulFn> a8w4_matmul;

// weight int32 [..., n] with values in [-8, 7] -> int32 [..., n / 8], eight codes per word,
// lowest bits first.
using PackInt4Fn = void(const at::Tensor& weight, at::Tensor& packed);

extern KernelSlots<QuantMatmulFn> quant_matmul;

// npu_trans_quant_param's int64 encoding -> (fp32 scale [numel], fp32 offset [numel] or undefined
// when every offset is 0): the fp32 bits in bits 0..31, a 9-bit signed offset in bits 37..45.
// Shared by the ops that accept such a scale (npu_quant_matmul, npu_grouped_matmul).
std::pair<at::Tensor, at::Tensor> decode_int64_scale(const at::Tensor& packed);
extern KernelSlots<PackInt4Fn> pack_int4;

// int32 words [rows, w] (contiguous) -> int8 codes [rows, 8 w], each word's eight int4 codes
// lowest bits first, sign-extended.
using UnpackInt4Fn = void(const at::Tensor& words, at::Tensor& codes);
extern KernelSlots<UnpackInt4Fn> unpack_int4;

// int4 words [..., w] (int32, eight codes each) -> int8 codes [..., 8 w] (for the ops that take
// int4 data as int32 and compute on int8 codes, e.g. an int4 key/value cache).
at::Tensor int4_words_to_codes(const char* op, const at::Tensor& words);

}  // namespace opennpu::quant
