// Block quantisation to FP8 / FP4 with shared power-of-two scales (OCP microscaling, "MX"):
// npu_dynamic_mx_quant, npu_dynamic_mx_quant_with_dual_axis, npu_grouped_dynamic_mx_quant; and
// npu_dynamic_block_quant (fp32 scales per row x column block, int8 / fp8 codes).
//
// MX, as CANN's aclnnDynamicMxQuant defines it and its golden computes it: blocks of `bs`
// elements along an axis share the exponent
//   scale_alg 0 (OCP):    shared_exp = floor(log2(max|V|)) - emax(element type)
//   scale_alg 1 (cuBLAS): S = max|V| / max_norm, shared_exp = the exponent of S rounded up
// clamped to [-127, 127] (an all-zero block: -127; above 127, or a NaN / inf in the block: NaN,
// and every element of the block 0), stored as float8_e8m0 (shared_exp + 127, NaN 0xFF).
// Elements V / 2^shared_exp are rounded to the element format (round_mode: "rint" ties to even,
// "round" ties away from zero, "floor") at its precision, subnormals included, and saturated to
// its largest finite value; NaN becomes +0. Exponents are read from the float bits (the golden's
// floor(np.log2(.)) in float32 can round up within ~2^-21 below a power of two).
//
// Scale layout: x's shape with the axis replaced by ceil(ceil(d / bs) / 2) and a trailing 2:
// blocks 2p and 2p + 1 of one line are mxscale[..., p, ..., 0] and [..., p, ..., 1] (an odd block
// count is padded with code 0, i.e. 2^-127).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "common/kernel_slots.h"

namespace opennpu::quant {

struct MxFormat {
  int mbits;       // mantissa bits
  int emax;        // exponent of the largest normal value
  int min_exp;     // exponent of the smallest normal value (subnormal spacing: 2^(min_exp - mbits))
  float max_norm;  // largest finite value
  bool fp4;        // two codes per byte, element 2j in the low nibble
  bool e8m0_codes; // float8 codes are taken from c10's float8 conversions (fp8 formats)
  bool e4m3;       // which fp8 format (when !fp4)
};

enum class MxRound { kRint, kRound, kFloor };

// x [pre, d, post] (contiguous; fp32, fp16 or bf16): blocks of bs along d. codes: one uint8 per
// element of x (fp8 bytes), or for fp4 two codes a byte, element 2j in the low nibble (x's last
// dim is then even). scales: uint8
// [pre, pairs, post, 2] starting at `scales`, pairs = ceil(ceil(d / bs) / 2); padding blocks are
// written as 0.
using MxQuantFn = void(const at::Tensor& x, int64_t pre, int64_t d, int64_t post, int64_t bs,
                       const MxFormat& fmt, MxRound round, int64_t scale_alg, float max_low_bound,
                       uint8_t* codes, uint8_t* scales);

// npu_dynamic_block_quant: x [batch, rows, cols] (contiguous); per block of rb x cb elements
// amax = max|x|, inv = min(qmax * (1 / amax), 1 / min_scale) (two roundings, as the golden's
// torch expression 127.0 / amax), scale = max(amax / qmax, min_scale)
// (an all-zero block: scale max(0, min_scale), codes 0); codes = x * inv rounded half to even
// (int8, saturated to [-qmax, qmax]) or clamped to [-qmax, qmax] and converted (fp8 != 0:
// 1 = float8_e4m3fn, 2 = float8_e5m2, both half to even; 3 = hifloat8 bytes, half away from
// zero, round_mode "round", hifloat8.h).
using BlockQuantFn = void(const at::Tensor& x, int64_t rb, int64_t cb, float qmax,
                          float min_scale, int fp8, at::Tensor& y, at::Tensor& scale);

extern KernelSlots<MxQuantFn> mx_quant;
extern KernelSlots<BlockQuantFn> block_quant;

}  // namespace opennpu::quant
