// Entry points of the fused optimizers: list validation, per-tensor scalars (step counts, bias
// corrections, trust ratios, AdamP projections), CPU registration in the opennpu namespace.
//
// The lists hold the parameters of one param group that have optimizer state, with their state
// tensors at the same index; gradients come from params[i].grad(). A parameter without a gradient
// this step is skipped: its state and step count stay as they are (torch.optim's behaviour).
#include "ops/optim/optim.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <numbers>

#include "common/checks.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace opennpu::optim {

KernelSlots<AdamFn> adam;
KernelSlots<SgdFn> sgd;
KernelSlots<RmspropFn> rmsprop;
KernelSlots<AdadeltaFn> adadelta;
KernelSlots<LambFn> lamb;
KernelSlots<AdampMomentsFn> adamp_moments;
KernelSlots<AdampApplyFn> adamp_apply;
KernelSlots<GradNormFn> grad_norm;
KernelSlots<GradScaleFn> grad_scale;

namespace {

// A state list: its argument name and tensors (an empty list when the state is not in use).
struct StateList {
  const char* name;
  at::TensorList tensors;
};

// A gradient whose layout differs from its parameter's (a transposed gradient, or a contiguous
// one on a permuted parameter): the kernels walk parameter, state and gradient with one index,
// so they read and write `copy`, laid out as the parameter; calls that write gradients copy it
// back into `original` (write_back_grads).
struct RelaidGrad {
  at::Tensor original;
  at::Tensor copy;
};

// The slots of a call. `index` maps each slot back to its position in the lists; `relaid` keeps
// alive the gradient copies made for gradients whose layout differs from their parameter's.
struct Slots {
  c10::Device device{c10::kCPU};  // every parameter's (their kernels run there)
  std::vector<Slot> slots;
  std::vector<size_t> index;
  std::vector<RelaidGrad> relaid;
};

// After a kernel that scaled gradients in place: the re-laid copies go back to the gradients.
void write_back_grads(const Slots& s) {
  for (const auto& grad : s.relaid) grad.original.copy_(grad.copy);
}

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_contiguous() && b.is_contiguous()) return true;
  return a.strides().equals(b.strides());
}

// Validates the lists and collects the parameters that have a gradient. A state list must be
// empty (state unused) or as long as params. `counters` is the state_steps list of the ops that
// count steps (it must be as long as params), null for the others (SGD, norm and scale calls).
// Step counters are host scalars by contract (one-element float32 CPU tensors, whatever the
// parameters' device): the entry points read them to compute bias corrections and schedules.
Slots collect(const char* op, at::TensorList params, std::initializer_list<StateList> states,
              const at::TensorList* counters) {
  const at::TensorList steps = counters != nullptr ? *counters : at::TensorList();
  for (const auto& state : states) {
    OPENNPU_CHECK_ARG(state.tensors.empty() || state.tensors.size() == params.size(), op,
                      state.name, "must hold one tensor per parameter (", params.size(),
                      ") or none, but got ", state.tensors.size());
  }
  OPENNPU_CHECK_ARG(counters == nullptr || steps.size() == params.size(), op, "state_steps",
                    "must hold one tensor per parameter (", params.size(), "), but got ",
                    steps.size());
  OPENNPU_CHECK_ARG(states.size() + 2 <= kMaxBuffers, op, "params", "too many state lists");
  Slots out;
  out.slots.reserve(params.size());
  out.index.reserve(params.size());
  for (const auto i : c10::irange(params.size())) {
    const at::Tensor& p = params[i];
    OPENNPU_CHECK_ARG(p.defined(), op, "params", "[", i, "] must be a tensor, but got None");
    at::Tensor g = p.grad();
    if (!g.defined()) continue;
    if (out.slots.empty()) out.device = p.device();
    OPENNPU_CHECK_ARG(p.device() == out.device, op, "params", "[", i,
                      "] must be on the device of the other parameters, ", out.device, ", but got ",
                      p.device());
    const auto dtype = p.scalar_type();
    OPENNPU_CHECK_ARG(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                          dtype == at::kDouble,
                      op, "params", "[", i, "] must be float32, float16, bfloat16 or float64, ",
                      "but got ", dtype);
    OPENNPU_CHECK_ARG(p.is_non_overlapping_and_dense(), op, "params", "[", i,
                      "] must be dense (contiguous in some dim order), but got strides ",
                      shape_str(p.strides()), " for shape ", shape_str(p.sizes()));
    OPENNPU_CHECK_ARG(g.layout() == at::kStrided, op, "params", "[", i,
                      "] must have a dense gradient (sparse gradients are not supported), but "
                      "got layout ", g.layout());
    OPENNPU_CHECK_ARG(g.scalar_type() == dtype && g.device() == p.device(), op, "params", "[", i,
                      "] must have a gradient of its dtype and device (", dtype, ", ",
                      p.device(), "), but got ", g.scalar_type(), ", ", g.device());
    OPENNPU_CHECK_ARG(g.sizes().equals(p.sizes()), op, "params", "[", i,
                      "] must have a gradient of its shape ", shape_str(p.sizes()), ", but got ",
                      shape_str(g.sizes()));
    if (!same_layout(g, p)) {
      at::Tensor relaid = at::empty_like(p).copy_(g);
      out.relaid.push_back({g, relaid});
      g = relaid;
    }
    Slot slot;
    slot.dtype = dtype;
    slot.numel = p.numel();
    slot.rows = p.dim() > 1 ? p.size(0) : 1;
    slot.buf[0] = p.data_ptr();
    slot.buf[1] = g.data_ptr();
    int b = 2;
    for (const auto& state : states) {
      if (!state.tensors.empty()) {
        const at::Tensor& t = state.tensors[i];
        OPENNPU_CHECK_ARG(t.defined() && t.scalar_type() == dtype && t.device() == p.device() &&
                              t.sizes().equals(p.sizes()) && same_layout(t, p),
                          op, state.name, "[", i, "] must be a tensor of the dtype, device, shape ",
                          "and layout of params[", i, "] (", dtype, ", ", p.device(), ", ",
                          shape_str(p.sizes()), "), but got ",
                          t.defined() ? c10::str(t.scalar_type(), ", ", t.device(), ", ",
                                                 shape_str(t.sizes()), " strides ",
                                                 shape_str(t.strides()))
                                      : std::string("None"));
        slot.buf[b] = t.data_ptr();
      }
      ++b;
    }
    if (counters != nullptr) {
      const at::Tensor& s = steps[i];
      OPENNPU_CHECK_ARG(s.defined() && s.scalar_type() == at::kFloat && s.numel() == 1 &&
                            s.device().is_cpu(),
                        op, "state_steps", "[", i,
                        "] must be a one-element float32 CPU tensor, but got ",
                        s.defined() ? c10::str(s.scalar_type(), " ", shape_str(s.sizes()), " on ",
                                               s.device())
                                    : std::string("None"));
    }
    out.slots.push_back(slot);
    out.index.push_back(i);
  }
  return out;
}

// Increments the step count of every slot's parameter and returns the new counts.
std::vector<double> advance_steps(const Slots& s, at::TensorList steps) {
  std::vector<double> counts(s.slots.size());
  for (const auto k : c10::irange(s.slots.size())) {
    float* step = steps[s.index[k]].data_ptr<float>();
    *step += 1;
    counts[k] = *step;
  }
  return counts;
}

// Slots that cover no element are dropped before the kernels (their step still counts).
std::vector<Slot> nonempty(const std::vector<Slot>& slots) {
  std::vector<Slot> out;
  out.reserve(slots.size());
  for (const auto& s : slots) {
    if (s.numel > 0) out.push_back(s);
  }
  return out;
}

void check_grad_scale(const char* op, double grad_scale) {
  OPENNPU_CHECK_ARG(std::isfinite(grad_scale) && grad_scale > 0, op, "grad_scale",
                    "must be a finite positive number (the factor the gradients are multiplied "
                    "by), but got ", grad_scale);
}

void fused_adam_(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList max_exp_avg_sqs, at::TensorList state_steps, double lr,
                 double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                 bool maximize, bool decoupled_weight_decay, double grad_scale) {
  constexpr const char* op = "_fused_adam_";
  check_grad_scale(op, grad_scale);
  OPENNPU_CHECK_ARG(!amsgrad || max_exp_avg_sqs.size() == params.size(), op, "max_exp_avg_sqs",
                    "must hold one tensor per parameter when amsgrad=True, but got ",
                    max_exp_avg_sqs.size());
  OPENNPU_CHECK_ARG(exp_avgs.size() == params.size() && exp_avg_sqs.size() == params.size(), op,
                    "exp_avgs", "and 'exp_avg_sqs' must hold one tensor per parameter (",
                    params.size(), "), but got ", exp_avgs.size(), " and ", exp_avg_sqs.size());
  Slots s = collect(op,
                    params, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs},
                             {"max_exp_avg_sqs", amsgrad ? max_exp_avg_sqs : at::TensorList()}},
                    &state_steps);
  const auto steps = advance_steps(s, state_steps);
  for (const auto k : c10::irange(s.slots.size())) {
    s.slots[k].s[0] = lr / (1 - std::pow(beta1, steps[k]));
    s.slots[k].s[1] = std::sqrt(1 - std::pow(beta2, steps[k]));
  }
  const AdamArgs args{lr, beta1, beta2, weight_decay, eps, grad_scale, amsgrad, maximize,
                      decoupled_weight_decay};
  adam.get(op, s.device)(nonempty(s.slots), args);
}

void fused_sgd_(at::TensorList params, at::TensorList momentum_buffers,
                at::IntArrayRef fresh_buffers, double lr, double momentum, double dampening,
                double weight_decay, bool nesterov, bool maximize, double grad_scale) {
  constexpr const char* op = "_fused_sgd_";
  check_grad_scale(op, grad_scale);
  OPENNPU_CHECK_ARG(momentum == 0 || momentum_buffers.size() == params.size(), op,
                    "momentum_buffers", "must hold one tensor per parameter when momentum != 0, "
                    "but got ", momentum_buffers.size());
  Slots s = collect(op, params,
                    {{"momentum_buffers", momentum == 0 ? at::TensorList() : momentum_buffers}},
                    nullptr);
  std::vector<bool> fresh(params.size(), false);
  for (const int64_t i : fresh_buffers) {
    OPENNPU_CHECK_ARG(i >= 0 && i < static_cast<int64_t>(params.size()), op, "fresh_buffers",
                      "must index params (0 to ", params.size() - 1, "), but got ", i);
    fresh[i] = true;
  }
  for (const auto k : c10::irange(s.slots.size())) s.slots[k].s[0] = fresh[s.index[k]] ? 1 : 0;
  const SgdArgs args{lr, momentum, dampening, weight_decay, grad_scale, nesterov, maximize};
  sgd.get(op, s.device)(nonempty(s.slots), args);
}

void fused_rmsprop_(at::TensorList params, at::TensorList square_avgs, at::TensorList grad_avgs,
                    at::TensorList momentum_buffers, at::TensorList state_steps, double lr,
                    double alpha, double eps, double weight_decay, double momentum,
                    bool centered, bool maximize, bool tf_style, bool lr_in_momentum,
                    bool decoupled_decay, double grad_scale) {
  constexpr const char* op = "_fused_rmsprop_";
  check_grad_scale(op, grad_scale);
  OPENNPU_CHECK_ARG(square_avgs.size() == params.size(), op, "square_avgs",
                    "must hold one tensor per parameter (", params.size(), "), but got ",
                    square_avgs.size());
  OPENNPU_CHECK_ARG(!centered || grad_avgs.size() == params.size(), op, "grad_avgs",
                    "must hold one tensor per parameter when centered=True, but got ",
                    grad_avgs.size());
  OPENNPU_CHECK_ARG(momentum == 0 || momentum_buffers.size() == params.size(), op,
                    "momentum_buffers", "must hold one tensor per parameter when momentum > 0, "
                    "but got ", momentum_buffers.size());
  Slots s = collect(op, params,
                    {{"square_avgs", square_avgs},
                     {"grad_avgs", centered ? grad_avgs : at::TensorList()},
                     {"momentum_buffers", momentum != 0 ? momentum_buffers : at::TensorList()}},
                    &state_steps);
  advance_steps(s, state_steps);
  const RmspropArgs args{lr,       alpha,    eps,      weight_decay,   momentum,       grad_scale,
                         centered, maximize, tf_style, lr_in_momentum, decoupled_decay};
  rmsprop.get(op, s.device)(nonempty(s.slots), args);
}

void fused_adadelta_(at::TensorList params, at::TensorList square_avgs, at::TensorList acc_deltas,
                     at::TensorList state_steps, double lr, double rho, double eps,
                     double weight_decay, bool maximize, double grad_scale) {
  constexpr const char* op = "_fused_adadelta_";
  check_grad_scale(op, grad_scale);
  OPENNPU_CHECK_ARG(square_avgs.size() == params.size() && acc_deltas.size() == params.size(), op,
                    "square_avgs", "and 'acc_deltas' must hold one tensor per parameter (",
                    params.size(), "), but got ", square_avgs.size(), " and ", acc_deltas.size());
  Slots s = collect(op, params, {{"square_avgs", square_avgs}, {"acc_deltas", acc_deltas}},
                    &state_steps);
  advance_steps(s, state_steps);
  const AdadeltaArgs args{lr, rho, eps, weight_decay, grad_scale, maximize};
  adadelta.get(op, s.device)(nonempty(s.slots), args);
}

void check_moments(const char* op, at::TensorList params, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs) {
  OPENNPU_CHECK_ARG(exp_avgs.size() == params.size() && exp_avg_sqs.size() == params.size(), op,
                    "exp_avgs", "and 'exp_avg_sqs' must hold one tensor per parameter (",
                    params.size(), "), but got ", exp_avgs.size(), " and ", exp_avg_sqs.size());
}

// LAMB (pytorch-lamb order, as NpuFusedLamb): no bias correction; per tensor the trust ratio
// clamp(|p|, 0, 10) / |u| (1 when either is 0, or always 1 when use_trust_ratio is false).
void fused_lamb_(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList state_steps, double lr, double beta1, double beta2, double eps,
                 double weight_decay, bool use_trust_ratio, double grad_scale) {
  constexpr const char* op = "_fused_lamb_";
  check_grad_scale(op, grad_scale);
  check_moments(op, params, exp_avgs, exp_avg_sqs);
  Slots s = collect(op, params, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}},
                    &state_steps);
  advance_steps(s, state_steps);
  std::vector<Slot> slots = nonempty(s.slots);
  for (auto& slot : slots) {
    slot.s = {0, 0, lr, grad_scale};
  }
  const LambArgs args{beta1, beta2, eps, weight_decay};
  if (!use_trust_ratio) {
    lamb.get(op, s.device)(slots, args, LambPhase::kFused);
    return;
  }
  lamb.get(op, s.device)(slots, args, LambPhase::kMoments);
  for (auto& slot : slots) {
    const double weight_norm = std::min(std::sqrt(slot.s[0]), 10.0);
    const double adam_norm = std::sqrt(slot.s[1]);
    const double trust = (weight_norm == 0 || adam_norm == 0) ? 1.0 : weight_norm / adam_norm;
    slot.s[2] = lr * trust;
  }
  lamb.get(op, s.device)(slots, args, LambPhase::kApply);
}

// The learning-rate factor of NpuFusedBertAdam's schedules at progress x = step / t_total.
double bert_schedule(const char* op, c10::string_view name, double x, double warmup) {
  if (x < warmup) return x / warmup;
  if (name == "warmup_linear") return std::max((x - 1) / (warmup - 1), 0.0);
  if (name == "warmup_cosine") return 0.5 * (1 + std::cos(std::numbers::pi * x));
  if (name == "warmup_constant") return 1.0;
  if (name == "warmup_poly") return std::pow(1 - x, 0.5);
  OPENNPU_CHECK_ARG(false, op, "schedule",
                    "must be one of warmup_linear, warmup_cosine, warmup_constant, warmup_poly, "
                    "but got ", name);
  return 1.0;
}

// BERT-Adam (pytorch-pretrained-BERT, as NpuFusedBertAdam): gradients of each dtype clipped
// together to max_grad_norm (torch_npu clips each combined buffer), no bias correction, lr
// scheduled on the step count before this step.
void fused_bert_adam_(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                      at::TensorList state_steps, double lr, double beta1, double beta2,
                      double eps, double weight_decay, double max_grad_norm,
                      c10::string_view schedule, double warmup, double t_total,
                      double grad_scale) {
  constexpr const char* op = "_fused_bert_adam_";
  check_grad_scale(op, grad_scale);
  check_moments(op, params, exp_avgs, exp_avg_sqs);
  bert_schedule(op, schedule, 1.0, warmup);  // validates the name
  Slots s = collect(op, params, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}},
                    &state_steps);
  for (const auto k : c10::irange(s.slots.size())) {
    const double step = *state_steps[s.index[k]].data_ptr<float>();
    const double factor = t_total != -1 ? bert_schedule(op, schedule, step / t_total, warmup) : 1;
    s.slots[k].s = {0, 0, lr * factor, grad_scale};
  }
  advance_steps(s, state_steps);
  std::vector<Slot> slots = nonempty(s.slots);
  if (max_grad_norm > 0) {
    for (const auto dtype : {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble}) {
      std::vector<Slot> same;
      for (const auto& slot : slots) {
        if (slot.dtype == dtype) same.push_back(slot);
      }
      if (same.empty()) continue;
      // The norm of the unscaled gradients: the kernel returns sum(g^2) of the raw values.
      const double norm = std::sqrt(grad_norm.get(op, s.device)(same, 2.0)) * grad_scale;
      const double coef = max_grad_norm / (norm + 1e-6);
      if (coef < 1) {
        for (auto& slot : slots) {
          if (slot.dtype == dtype) slot.s[3] = grad_scale * coef;
        }
      }
    }
  }
  lamb.get(op, s.device)(slots, LambArgs{beta1, beta2, eps, weight_decay}, LambPhase::kFused);
}

// AdamP (as NpuFusedAdamP): Adam with bias correction; for parameters with 2+ dims, when the
// gradient is nearly orthogonal to the weight (max |cos| < delta / sqrt(view width), tried per
// channel, then for the whole tensor), the radial part of the step is projected out and the
// weight decay scaled by wd_ratio.
void fused_adamp_(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList state_steps, double lr, double beta1, double beta2, double eps,
                  double weight_decay, double delta, double wd_ratio, bool nesterov,
                  double grad_scale) {
  constexpr const char* op = "_fused_adamp_";
  check_grad_scale(op, grad_scale);
  check_moments(op, params, exp_avgs, exp_avg_sqs);
  Slots s = collect(op, params, {{"exp_avgs", exp_avgs}, {"exp_avg_sqs", exp_avg_sqs}},
                    &state_steps);
  const auto steps = advance_steps(s, state_steps);
  std::vector<Slot> slots;
  std::vector<int64_t> dims;
  for (const auto k : c10::irange(s.slots.size())) {
    Slot slot = s.slots[k];
    if (slot.numel == 0) continue;
    slot.s[0] = lr / (1 - std::pow(beta1, steps[k]));
    slot.s[1] = std::sqrt(1 - std::pow(beta2, steps[k]));
    slots.push_back(slot);
    dims.push_back(params[s.index[k]].dim());
  }
  const AdampArgs args{beta1, beta2, eps, grad_scale, nesterov};
  std::vector<std::vector<double>> sums(slots.size());
  for (const auto k : c10::irange(slots.size())) sums[k].assign(4 * slots[k].rows, 0.0);
  adamp_moments.get(op, s.device)(slots, args, sums);

  auto cosine = [eps](double gp, double gg, double pp) {
    return std::abs(gp) / (std::sqrt(gg) + eps) / (std::sqrt(pp) + eps);
  };
  std::vector<std::vector<double>> coef(slots.size());
  for (const auto k : c10::irange(slots.size())) {
    Slot& slot = slots[k];
    double ratio = 1;
    if (dims[k] > 1) {
      const int64_t rows = slot.rows;
      const std::vector<double>& r = sums[k];
      double max_cos = 0;
      double tot[4] = {0, 0, 0, 0};
      for (int64_t i = 0; i < rows; ++i) {
        max_cos = std::max(max_cos, cosine(r[4 * i], r[4 * i + 1], r[4 * i + 2]));
        for (int j = 0; j < 4; ++j) tot[j] += r[4 * i + j];
      }
      const double width = static_cast<double>(slot.numel / rows);
      if (max_cos < delta / std::sqrt(width)) {
        coef[k].resize(rows);
        for (int64_t i = 0; i < rows; ++i) {
          const double n = std::sqrt(r[4 * i + 2]) + eps;
          coef[k][i] = r[4 * i + 3] / (n * n);
        }
        ratio = wd_ratio;
      } else if (cosine(tot[0], tot[1], tot[2]) < delta / std::sqrt(double(slot.numel))) {
        const double n = std::sqrt(tot[2]) + eps;
        coef[k].assign(1, tot[3] / (n * n));
        ratio = wd_ratio;
      }
    }
    slot.s[2] = weight_decay > 0 ? 1 - lr * weight_decay * ratio : 1.0;
  }
  adamp_apply.get(op, s.device)(slots, args, coef);
}

// Norm of all gradients as one vector: (sum |g|^p)^(1/p), max |g| for p = inf; float32 0-dim.
at::Tensor fused_grad_norm(at::TensorList params, double norm_type) {
  constexpr const char* op = "_fused_grad_norm";
  OPENNPU_CHECK_ARG(norm_type > 0 && !std::isnan(norm_type), op, "norm_type",
                    "must be positive or inf, but got ", norm_type);
  Slots s = collect(op, params, {}, nullptr);
  double total = grad_norm.get(op, s.device)(nonempty(s.slots), norm_type);
  if (!std::isinf(norm_type)) {
    total = norm_type == 2 ? std::sqrt(total) : std::pow(total, 1 / norm_type);
  }
  return at::scalar_tensor(total, at::TensorOptions().dtype(at::kFloat));
}

void fused_scale_grads_(at::TensorList params, double scale) {
  Slots s = collect("_fused_scale_grads_", params, {}, nullptr);
  if (scale == 1.0) return;
  grad_scale.get("_fused_scale_grads_", s.device)(nonempty(s.slots), scale, false);
  write_back_grads(s);
}

// GradScaler's unscale in one pass over every gradient: g *= inv_scale, and found_inf = 1 when
// any gradient holds an inf or NaN (as torch._amp_foreach_non_finite_check_and_unscale_).
void fused_unscale_grads_(at::TensorList params, at::Tensor& found_inf,
                          const at::Tensor& inv_scale) {
  constexpr const char* op = "_fused_unscale_grads_";
  OPENNPU_CHECK_ARG(found_inf.numel() == 1 && found_inf.scalar_type() == at::kFloat, op,
                    "found_inf", "must be a one-element float32 tensor, but got ",
                    found_inf.scalar_type(), " ", shape_str(found_inf.sizes()));
  OPENNPU_CHECK_ARG(inv_scale.numel() == 1 && inv_scale.scalar_type() == at::kFloat, op,
                    "inv_scale", "must be a one-element float32 tensor, but got ",
                    inv_scale.scalar_type(), " ", shape_str(inv_scale.sizes()));
  Slots s = collect(op, params, {}, nullptr);
  const double scale = inv_scale.item<float>();
  if (grad_scale.get(op, s.device)(nonempty(s.slots), scale, true)) found_inf.fill_(1.0);
  write_back_grads(s);
}

}  // namespace

at::Tensor state_buffer(int64_t numel, at::ScalarType dtype) {
  OPENNPU_CHECK_ARG(numel >= 0, "_state_buffer", "numel", "must be >= 0, but got ", numel);
  at::Tensor buffer = at::empty({numel}, at::TensorOptions().dtype(dtype));
#ifdef __linux__
  // Only whole 2 MiB pages inside the allocation can be huge; the advice is a hint, and a kernel
  // without THP (or with it off) ignores or refuses it, which changes speed, never results.
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<uintptr_t>(buffer.data_ptr());
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t last = (begin + buffer.nbytes()) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#endif
  return buffer;
}

TORCH_LIBRARY_IMPL(opennpu, CPU, m) {
  m.impl("_fused_adam_", &fused_adam_);
  m.impl("_fused_sgd_", &fused_sgd_);
  m.impl("_fused_rmsprop_", &fused_rmsprop_);
  m.impl("_fused_adadelta_", &fused_adadelta_);
  m.impl("_fused_lamb_", &fused_lamb_);
  m.impl("_fused_bert_adam_", &fused_bert_adam_);
  m.impl("_fused_adamp_", &fused_adamp_);
  m.impl("_fused_grad_norm", &fused_grad_norm);
  m.impl("_fused_scale_grads_", &fused_scale_grads_);
  m.impl("_fused_unscale_grads_", &fused_unscale_grads_);
}

TORCH_LIBRARY_IMPL(opennpu, CompositeExplicitAutograd, m) {
  m.impl("_state_buffer", &state_buffer);
}

}  // namespace opennpu::optim
