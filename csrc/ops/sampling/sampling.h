// Sampling: npu_top_k_top_p (Ascend ApplyTopKTopP) and npu_top_k_top_p_sample (Ascend
// TopKTopPSample), the token filters and samplers of an inference server's last step.
//
// Both work on rows of a [batch, vocab] logits tensor, one row per thread task, in fp32 whatever
// the input dtype. Instead of sorting the whole vocabulary (what the golden compositions do), a
// row selects its few largest entries (nth_element, then a sort of those alone) and sorts more
// only where top-p needs it; the results equal the goldens' stable sorts, ties included (equal
// values keep the order of their indices, as torch.sort(stable=True) does).
//
// The entry points (sampling.cpp) validate the arguments and turn the per-row tensors (k, p,
// min_p) into host arrays of row parameters; the CPU kernels (sampling_cpu.cpp) do the rows.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "common/kernel_slots.h"

namespace opennpu::sampling {

// npu_top_k_top_p. Per row b of logits [B, V] (contiguous):
//   k != nullptr: keep the values >= the k[b]-th largest (1 <= k[b] <= V; ties at the threshold
//                 are all kept), the rest become -inf;
//   one_minus_p != nullptr: softmax (fp32) of what top-k kept, sorted ascending (stable), running
//                 sum in that order; positions whose sum is <= one_minus_p[b] (1 - p rounded to
//                 p's dtype, as the golden computes it) become -inf, except the largest.
// out: [B, V] contiguous, logits' dtype.
struct FilterArgs {
  const int64_t* k = nullptr;
  const float* one_minus_p = nullptr;
};
using TopKTopPFn = void(const at::Tensor& logits, const FilterArgs& args, at::Tensor& out);

// npu_top_k_top_p_sample: what the sampling step does after the filters.
enum class Post {
  kArgmax,       // post_sample 'None' (or q absent): the most probable kept token
  kQSample,      // argmax of prob / (|q| + eps), q [B, V] indexed by kept position
  kMultinomial,  // argmax of prob / e, e ~ Exp(1) [B, V] (torch.multinomial's one-sample draw)
};

struct SampleArgs {
  const int64_t* top_k = nullptr;  // per row; outside [1, min(V, k_max)] skips top-k
  const float* top_p = nullptr;    // per row; >= 1 skips top-p, <= 0 keeps one token
  const float* min_p = nullptr;    // per row or nullptr; <= 0 skips, >= 1 keeps one token
  const float* q = nullptr;        // [B, V] contiguous fp32 for kQSample / kMultinomial
  Post post = Post::kArgmax;
  float eps = 1e-8f;
  int64_t k_max = 1024;            // ks_max rounded up to a multiple of 8, at most 1024
  int64_t top_k_guess = 32;        // how many tokens top-p without top-k sorts first (<= 0: all)
  bool input_is_logits = true;     // softmax before top-p (else the values are probabilities)
};
// index: [B] int64. kept: [B, V] fp32 (the kept tokens' logits, the rest -inf or 0), or an
// undefined tensor when the caller does not want it.
using SampleFn = void(const at::Tensor& logits, const SampleArgs& args, at::Tensor& index,
                      at::Tensor& kept);

extern KernelSlots<TopKTopPFn> top_k_top_p;
extern KernelSlots<SampleFn> top_k_top_p_sample;

}  // namespace opennpu::sampling
