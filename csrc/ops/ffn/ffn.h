// npu_ffn: y = act(x W1 + b1) W2 + b2, dense or with experts, float, weight-only int8 or int8.
//
// The entry point (ffn.cpp) validates every argument and turns the optional per-channel
// parameters into float32 [E, N] tables (E = 1 without experts), so the kernel sees one layout:
// x [M, K1], weights [E, K1, N1] / [E, K2, N2], expert e owning rows offsets[e] .. offsets[e+1].
//
// The kernel (ffn_cpu.cpp) walks each expert's rows in blocks. Per block, phase A splits the
// intermediate's columns among the threads; each thread multiplies the block by its columns of
// W1 into a cache-sized tile (BLAS / ATen GEMM), then applies bias, dequantisation, activation
// (and requantisation) to that tile in place and writes the block's intermediate in the
// second GEMM's operand dtype. Phase B splits the output's columns: the intermediate times a
// column tile of W2, plus bias (and dequantisation), rounded into the output. The intermediate
// is written once and read once; the activation never makes a separate pass over memory.
// Where ATen's whole GEMMs are faster than tiles (FfnGemm::kATen in ffn_cpu.cpp, which chooses
// the GEMMs per dtype and CPU), the intermediate is written by the first GEMM, then activated in
// one pass, then read by the second.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "common/kernel_slots.h"

namespace opennpu::ffn {

enum class FfnAct {
  kFastGelu,  // z * sigmoid(1.702 z)
  kGelu,      // tanh-approximated GELU
  kRelu,
  kSilu,
  kGeglu,   // GLU forms: the intermediate [a | b] (halves of N1) gives a * act(b)
  kSwiglu,
  kReglu,
};

inline bool is_glu(FfnAct act) {
  return act == FfnAct::kGeglu || act == FfnAct::kSwiglu || act == FfnAct::kReglu;
}

struct FfnArgs {
  at::Tensor x;   // [M, K1], contiguous: float32 / float16 / bfloat16, or int8 (quantised path)
  at::Tensor w1;  // [E, K1, N1], contiguous: x's dtype, or int8 (weight-only and quantised)
  at::Tensor w2;  // [E, K2, N2]
  std::vector<int64_t> offsets;  // E + 1 row offsets
  FfnAct act = FfnAct::kFastGelu;
  // Optional (undefined when absent). Float paths: float32 biases; quantised: int32.
  at::Tensor bias1, bias2;  // [E, N1], [E, N2]
  // Quantised path: float32 dequantisation scales, quantisation scale and offset.
  at::Tensor deq1, deq2;  // [E, N1], [E, N2]
  at::Tensor qscale;      // [E, K2] (per-tensor scales expanded)
  at::Tensor qoffset;     // [E]
  // Weight-only path: W' = (W + offset) * scale, float32; offsets may be undefined.
  at::Tensor aq_scale1, aq_offset1;  // [E, N1]
  at::Tensor aq_scale2, aq_offset2;  // [E, N2]
  at::Tensor out;  // [M, N2]: x's dtype, or float16 / bfloat16 for the quantised path
};

using FfnFn = void(const FfnArgs& args);
extern KernelSlots<FfnFn> ffn;

}  // namespace opennpu::ffn
