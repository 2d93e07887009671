// Fusion attention family: npu_fusion_attention (+ npu_fusion_attention_grad) and the dropout
// mask generator _npu_dropout_gen_mask.
//
// The host side (attention.cpp) validates the torch_npu arguments and turns every layout (BSH,
// SBH, BSND, BNSD, TND) into one description, AttentionProblem: per batch, where each head's rows
// start and how many there are, plus element strides between heads and rows. The head dimension
// is always contiguous. The kernels accumulate in fp32 (fp64 for fp64 inputs). fp16/bf16 inputs
// reach them in their own dtype where the CPU multiplies half precision natively (AMX,
// AVX512-BF16/FP16: see attention_plan, whose CPU implementation is in attention_cpu.cpp), so
// every GEMM runs at half-precision speed; elsewhere they are converted to fp32 once up front,
// which costs O(S*D) next to the O(S^2*D) work. Every GEMM is a BLAS call.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "common/kernel_slots.h"

namespace opennpu::attention {

// A [B, N, S, D]-like view of one q/k/v-shaped tensor: element (b, n, s, d) lives at
// data + row_offset(b, s) + n * stride_n + d, with row_offset(b, s) = b * stride_b +
// (seq_start[b] + s) * stride_s (seq_start is 0 except in the TND layout, where stride_b is 0).
struct SeqView {
  int64_t stride_b = 0;
  int64_t stride_n = 0;
  int64_t stride_s = 0;
};

enum SparseMode : int64_t {
  kDefaultMask = 0,      // user mask plus the pre/next band, origin top-left
  kAllMask = 1,          // the user mask alone
  kLeftUpCausal = 2,     // j > i masked
  kRightDownCausal = 3,  // j > i + (Skv - Sq) masked
  kBand = 4,             // pre/next band with its origin at the bottom-right corner
  kPrefix = 5,           // right-down causal, the first prefix[b] keys always visible; user mask too
  kPrefixCompressed = 6, // the same without reading a mask
  kVarlenRightDown = 7,  // TND: right-down causal; the last non-empty sequence is a band (mode 4)
  kVarlenLeftUp = 8,     // TND: left-up causal; the first non-empty sequence is a band (mode 4)
};

// Which tiles fp16/bf16 problems take (OPENNPU_ATTENTION_TILES). kAuto: oneDNN's brgemm where it
// is offered (AMX), else for bf16 the AVX512_BF16 tile GEMM where the CPU has the extension, else
// BLAS. kAvx512Bf16 ("avx512_bf16"): the AVX512_BF16 tiles also where oneDNN's brgemm is offered
// (to test or compare them; a bf16 call that cannot take them is an error). kBlas ("blas"): the
// BLAS tiles.
enum class TilePath { kAuto, kAvx512Bf16, kBlas };

// The dtype of P in the forward's P V product where fp16/bf16 are computed in their dtype
// (OPENNPU_ATTENTION_PV). kHalf ("half"): P rounded to the dtype, for a half-precision GEMM
// with V as it is. kFp32 ("fp32"): P kept in fp32, multiplied with V converted to fp32 once, so
// the output's error is the rounding floor (1.0x the float64 result rounded, against 1.6x on
// average for kHalf in bf16). kAuto: kFp32 on the BLAS tiles, whose half-precision GEMMs (MKL's)
// run no faster than sgemm where measured, kHalf on the brgemm / AVX512_BF16 tiles, where an
// fp32 P V would give up their half-precision rate for half the FLOPs. docs/performance.md.
enum class PvPrecision { kAuto, kFp32, kHalf };

struct AttentionProblem {
  int64_t batch = 0;
  int64_t heads_q = 0;
  int64_t heads_kv = 0;
  int64_t head_dim = 0;    // D of query and key
  int64_t head_dim_v = 0;  // D of value and the output
  // Per batch: first row (TND: token index; else 0) and length of the query and key sequences.
  std::vector<int64_t> q_start, q_len, kv_start, kv_len;
  SeqView q, k, v, out;  // out also describes dy and attention_in, which share its layout

  double scale = 1.0;
  TilePath tiles = TilePath::kAuto;
  PvPrecision pv = PvPrecision::kAuto;

  // Visibility: a key j is visible from query i iff lo(i) <= j <= hi(i) (computed per batch from
  // the sparse mode, pre/next tokens and prefix) and the user mask, when read, is false there.
  int64_t sparse_mode = kDefaultMask;
  bool apply_band = false;  // false: every key is visible (no atten_mask given)
  int64_t pre_tokens = 0;
  int64_t next_tokens = 0;
  std::vector<int64_t> prefix;  // modes 5 and 6
  int64_t band_batch = -1;      // modes 7 and 8: the one sequence that is a band
  const uint8_t* user_mask = nullptr;  // bool/uint8, nonzero = masked out
  int64_t mask_stride_b = 0, mask_stride_n = 0, mask_stride_i = 0;  // last dim contiguous

  // pse (accumulator dtype), broadcast over any of b/n/i by a zero stride; added before scaling.
  const void* pse = nullptr;
  int64_t pse_stride_b = 0, pse_stride_n = 0, pse_stride_i = 0;
  // sink: float32 [heads_q], one extra logit per head in every softmax row (no value row).
  const float* sink = nullptr;

  // Full int8 quantisation of P (fused infer attention's quant_scale1; 0: off, forward only,
  // fp32 inputs): before P V, every exp e = exp(s - m) becomes the int8 code of e * p_quant
  // (rounded to float16, then half to even, saturated to 127), as Ascend quantises softmax's
  // output before its int8 P V matmul; the row sums stay the exps' own. m is never below the
  // max of the block being quantised, so e <= 1; as on Ascend's flash tiles, codes of earlier
  // key blocks are rescaled when a later block raises the row's max.
  float p_quant = 0.0f;

  // Dropout: keep_prob < 1 keeps element k of the flattened (b, n, i, j) score space iff its
  // Philox draw is below the threshold (or its bit in dropout_mask is set).
  bool dropout = false;
  double keep_prob = 1.0;
  uint64_t seed = 0;
  uint64_t offset = 0;
  const uint8_t* dropout_mask = nullptr;
  std::vector<int64_t> bit_start;  // per batch: index of the (b, n=0, i=0, j=0) mask bit

  // softmax_max / softmax_sum rows: value r of (b, n, i) is at 8 * stat_index(b, n, i) + r.
  // Non-TND: ((b * Nq + n) * Sq + i); TND "NTD" (default): n * T + q_start[b] + i;
  // TND "TND": (q_start[b] + i) * Nq + n.
  bool stats_token_major = false;
  int64_t stats_rows_per_head = 0;  // Sq (non-TND) or T (TND)
  bool tnd = false;

  int64_t group() const { return heads_q / heads_kv; }
  int64_t stat_index(int64_t b, int64_t n, int64_t i) const {
    if (!tnd) return (b * heads_q + n) * stats_rows_per_head + i;
    if (stats_token_major) return (q_start[b] + i) * heads_q + n;
    return n * stats_rows_per_head + q_start[b] + i;
  }
};

// The inclusive key interval [lo, hi] visible from query row i of batch b before the user mask
// (empty when lo > hi), clamped to [0, Skv - 1].
struct KeyInterval {
  int64_t lo;
  int64_t hi;
};
KeyInterval visible_keys(const AttentionProblem& p, int64_t b, int64_t i);

// Philox-4x32-10 keep decisions shared by the kernels and _npu_dropout_gen_mask, so a mask
// generated by one is reproduced bit for bit by the other: bit k uses word k % 4 of the block at
// counter offset + k / 4 under key seed, and is 1 (kept) iff that word < keep_threshold(p_keep)
// = keep_prob * 2^32 (so keep_prob 1 keeps every bit and 0 none).
uint64_t keep_threshold(double keep_prob);
// Writes keep[0..count) (0 or 1) for bits first..first+count-1.
void philox_keep_bits(uint64_t seed, uint64_t offset, int64_t first, int64_t count,
                      uint64_t threshold, uint8_t* keep);

// q, k, v (and dy, out in the backward) are fp32, fp64, or fp16/bf16 (see above).
// Forward: out (q's dtype, layout p.out), softmax_max/softmax_sum (float32, 8 copies).
using AttentionFwdFn = void(const AttentionProblem& p, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, at::Tensor& out, at::Tensor& softmax_max,
                            at::Tensor& softmax_sum);

// Backward: dq, dk, dv in the dtype and layouts of q, k, v (p.q, p.k, p.v), written whole
// except for TND tokens no sequence covers, which the caller zeroes. dk_heads / dv_heads are the
// kernel's scratch: per query head ([B, Nq, Skv, D] or [Nq, Tkv, D], contiguous, accumulator
// dtype), summed over each group into dk / dv. dpse (if defined) is [B, Nq, Sp, Skv] with Sp in
// {1, Sq}, zeroed; dsink (if defined) is [B, Nq] float32 partials.
using AttentionBwdFn = void(const AttentionProblem& p, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& dy, const at::Tensor& out,
                            const at::Tensor& softmax_max, const at::Tensor& softmax_sum,
                            at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& dk_heads,
                            at::Tensor& dv_heads, at::Tensor& dpse, at::Tensor& dsink);

// How a call runs on its device, decided by that device's kernels so the entry points decide
// nothing device-specific: the dtype q/k/v reach attention_fwd / attention_bwd in (the input's
// for half-precision GEMMs, see the top of this file, or the accumulator dtype) and the tile
// path (AttentionProblem::tiles). Shared with npu_fused_infer_attention_score
// (infer_attention.cpp), which runs its prefill on these kernels.
struct AttentionPlan {
  at::ScalarType compute = at::kFloat;
  TilePath tiles = TilePath::kAuto;
  PvPrecision pv = PvPrecision::kAuto;  // applies where compute is fp16/bf16
};

// An .out overload's output `dst` takes `src` (resized to src's shape where it differs; the
// dtype must match, else an error naming op and arg).
void copy_out(at::Tensor& dst, const at::Tensor& src, const char* op, const char* arg);

// dtype: q's (fp16, bf16, fp32 or fp64); head_dim, head_dim_v: D and Dv. check_forced_tiles:
// raise where a forced tile path cannot run this call (npu_fusion_attention and its gradient);
// without it the kernels take the BLAS tiles there instead (the infer op's prefill). The CPU
// implementation reads OPENNPU_ATTENTION_HALF_GEMM, OPENNPU_HALF_GEMM (common/half_gemm.h) and
// OPENNPU_ATTENTION_TILES on every call.
using AttentionPlanFn = AttentionPlan(const char* op, at::ScalarType dtype, int64_t head_dim,
                                      int64_t head_dim_v, bool check_forced_tiles);

extern KernelSlots<AttentionPlanFn> attention_plan;
extern KernelSlots<AttentionFwdFn> attention_fwd;
extern KernelSlots<AttentionBwdFn> attention_bwd;

}  // namespace opennpu::attention
