// Fused optimizers (torch_npu.optim): multi-tensor steps, gradient norms and (un)scaling.
//
// One call updates every parameter of a param group, whatever their dtypes: the entry points
// (optim.cpp) turn the tensor lists into Slots, and the kernels (optim_cpu.cpp) split the
// concatenation of all slots into equal element ranges, one per thread, so a list of 10,000 small
// tensors and a list of three huge ones are balanced alike. Each element is read and written once
// per step (p, g and the states in; p and the states out), in fp32 for fp16/bf16 parameters.
//
// Gradients are read from params[i].grad() by the entry points; a parameter without one is
// skipped, its state and step left untouched, as torch.optim does.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <vector>

#include "common/kernel_slots.h"

namespace opennpu::optim {

constexpr int kMaxBuffers = 6;

// One tensor of a multi-tensor call. buf[0] is the parameter, buf[1] its gradient, buf[2..] the
// states, in the order each kernel documents; all share the parameter's dtype and memory layout
// (dense, so they are walked as flat arrays of `numel` elements). s[] holds the per-tensor
// scalars (bias corrections, trust ratios, ...), meaning per kernel.
struct Slot {
  at::ScalarType dtype = at::kFloat;
  int64_t numel = 0;
  int64_t rows = 1;  // AdamP: size(0) of a parameter with 2+ dims (its channel view)
  std::array<void*, kMaxBuffers> buf{};
  std::array<double, 4> s{};
};

// Adam / AdamW (torch.optim.Adam semantics). buf: p, g, exp_avg, exp_avg_sq[, max_exp_avg_sq].
// s[0] = lr / (1 - beta1^t), s[1] = sqrt(1 - beta2^t).
struct AdamArgs {
  double lr, beta1, beta2, weight_decay, eps, grad_scale;
  bool amsgrad, maximize, decoupled;
};
using AdamFn = void(const std::vector<Slot>& slots, const AdamArgs& args);

// SGD (torch.optim.SGD). buf: p, g[, momentum_buffer]. s[0] = 1 when the buffer is new this step
// (it is then set to the gradient, as torch does, instead of being decayed).
struct SgdArgs {
  double lr, momentum, dampening, weight_decay, grad_scale;
  bool nesterov, maximize;
};
using SgdFn = void(const std::vector<Slot>& slots, const SgdArgs& args);

// RMSprop: torch.optim.RMSprop, or the TF / timm variant of NpuFusedRMSpropTF (tf = true: square
// average updated as sa += (1 - alpha)(g^2 - sa), eps inside the square root, optionally lr folded
// into the momentum buffer and decay decoupled). buf: p, g, square_avg, grad_avg (centered),
// momentum_buffer (momentum > 0); absent buffers are null.
struct RmspropArgs {
  double lr, alpha, eps, weight_decay, momentum, grad_scale;
  bool centered, maximize, tf, lr_in_momentum, decoupled_decay;
};
using RmspropFn = void(const std::vector<Slot>& slots, const RmspropArgs& args);

// Adadelta (torch.optim.Adadelta). buf: p, g, square_avg, acc_delta.
struct AdadeltaArgs {
  double lr, rho, eps, weight_decay, grad_scale;
  bool maximize;
};
using AdadeltaFn = void(const std::vector<Slot>& slots, const AdadeltaArgs& args);

// LAMB / BERT-Adam update u = m / (sqrt(v) + eps) + wd * p, no bias correction.
// buf: p, g, exp_avg, exp_avg_sq. Phase kMoments updates m and v and accumulates, per tensor,
// sum(p^2) into s[0] and sum(u^2) into s[1] (p is not written); phase kApply recomputes u from
// the updated m, v and writes p -= s[2] * u; phase kFused does both in one pass (s[2] known up
// front: the trust ratio is 1). s[3] is the tensor's gradient scale (AMP unscaling times the
// clipping factor, which BERT-Adam computes per dtype).
enum class LambPhase { kMoments, kApply, kFused };
struct LambArgs {
  double beta1, beta2, eps, weight_decay;
};
using LambFn = void(std::vector<Slot>& slots, const LambArgs& args, LambPhase phase);

// AdamP (Heo et al. 2021, as in torch_npu's NpuFusedAdamP). buf: p, g, exp_avg, exp_avg_sq.
// Phase 1 updates m and v, and accumulates per row r of each tensor (rows = size(0) for 2+ dims,
// else 1) into row_sums[slot][4 r + k]: k = 0 g.p, 1 g.g, 2 p.p, 3 p.perturb. Phase 2 writes
// p = p * s[2] - s[0] * (perturb - p * coef[row]) with coef from row_coef[slot] (empty = no
// projection). s[0] = lr / (1 - beta1^t), s[1] = sqrt(1 - beta2^t).
struct AdampArgs {
  double beta1, beta2, eps, grad_scale;
  bool nesterov;
};
using AdampMomentsFn = void(const std::vector<Slot>& slots, const AdampArgs& args,
                            std::vector<std::vector<double>>& row_sums);
using AdampApplyFn = void(const std::vector<Slot>& slots, const AdampArgs& args,
                          const std::vector<std::vector<double>>& row_coef);

// Gradient norms and scaling. buf: p (unused), g.
// Returns sum(|g * scale|^p) over all slots, or max |g * scale| when p is inf (NaN propagates).
using GradNormFn = double(const std::vector<Slot>& slots, double norm_type);
// g *= scale for every slot; returns whether any element of g was inf or NaN (before scaling).
using GradScaleFn = bool(const std::vector<Slot>& slots, double scale, bool check_finite);

// An uninitialised 1-d buffer for a param group's packed optimizer states (optim/_base.py
// _pack), with transparent huge pages requested before its first touch (Linux; elsewhere a plain
// at::empty). A step streams 3-5 runs of the same length as the parameters; with 4 KiB pages
// every run crosses a page, and costs a TLB walk, every 4 KiB. torch's own allocator asks for
// huge pages only when THP_MEM_ALLOC_ENABLE is set.
at::Tensor state_buffer(int64_t numel, at::ScalarType dtype);

extern KernelSlots<AdamFn> adam;
extern KernelSlots<SgdFn> sgd;
extern KernelSlots<RmspropFn> rmsprop;
extern KernelSlots<AdadeltaFn> adadelta;
extern KernelSlots<LambFn> lamb;
extern KernelSlots<AdampMomentsFn> adamp_moments;
extern KernelSlots<AdampApplyFn> adamp_apply;
extern KernelSlots<GradNormFn> grad_norm;
extern KernelSlots<GradScaleFn> grad_scale;

}  // namespace opennpu::optim
