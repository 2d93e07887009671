"""The torch_npu.optim family on opennpu's multi-tensor C++ steps.

Update math: torch.optim's for the optimizers that have a torch counterpart (Adam, AdamW, SGD,
RMSprop, Adadelta: same state names, so state dicts move between the two), torch_npu's for the
others (RMSpropTF, LAMB, AdamP, BERT-Adam; shared/spec/torch_npu_api.md section 2.3). State
tensors have the parameter's dtype (as in torch.optim); the arithmetic is float32 for float16 and
bfloat16 parameters. Unlike torch_npu, bfloat16 parameters are accepted.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import required

from ._base import NpuFusedOptimizerBase, _GroupLists, check_betas, check_nonnegative

_ops = torch.ops.opennpu


def _zeros(p):
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _init_missing(state, p, names, factory=_zeros):
    for name in names:
        if name not in state:
            state[name] = factory(p)


class NpuFusedAdam(NpuFusedOptimizerBase):
    """Adam (torch.optim.Adam semantics) as one fused C++ step per param group.

    ``weight_decay`` is an L2 penalty added to the gradient; ``amsgrad`` keeps the running
    maximum of the second moment; ``maximize`` ascends. Bias-corrected:
    ``p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.
    """

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, *, maximize=False):
        check_nonnegative("lr", lr, "learning rate")
        check_nonnegative("eps", eps, "epsilon value")
        check_betas(betas)
        check_nonnegative("weight_decay", weight_decay, "weight_decay value")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled_weight_decay=self._decoupled)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("decoupled_weight_decay", self._decoupled)

    def _state_names(self, group):
        if group["amsgrad"]:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")

    def _init_state(self, p, state, group):
        _init_missing(state, p, self._state_names(group))

    def _group_step(self, group, lists: _GroupLists, grad_scale: float):
        beta1, beta2 = group["betas"]
        s = lists.states
        _ops._fused_adam_(lists.params, s["exp_avg"], s["exp_avg_sq"],
                          s.get("max_exp_avg_sq", []), lists.steps, lr=float(group["lr"]),
                          beta1=float(beta1), beta2=float(beta2),
                          weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
                          amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]),
                          decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
                          grad_scale=grad_scale)


class NpuFusedAdamW(NpuFusedAdam):
    """AdamW (torch.optim.AdamW semantics): decoupled weight decay ``p *= 1 - lr * wd`` first,
    then the Adam step. Default ``weight_decay=1e-2``. A torch.optim.AdamW state dict loads into
    it and back (same state names and group keys)."""

    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize)


class NpuFusedSGD(NpuFusedOptimizerBase):
    """SGD (torch.optim.SGD semantics): momentum, dampening, Nesterov, L2 weight decay.

    The momentum buffer starts as the first gradient (undamped), as in torch.optim.
    """

    def __init__(self, params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False):
        if lr is not required:
            check_nonnegative("lr", lr, "learning rate")
        check_nonnegative("momentum", momentum, "momentum value")
        check_nonnegative("weight_decay", weight_decay, "weight_decay value")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)

    def _uses_step(self):
        return False

    def _state_names(self, group):
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _ready(self, state, names):
        # torch.optim.SGD may leave momentum_buffer = None in a state dict.
        return all(state.get(name) is not None for name in names)

    def _init_state(self, p, state, group):
        # Filled with the gradient by the first step (the index is passed as a fresh buffer).
        state["momentum_buffer"] = torch.empty_like(p, memory_format=torch.preserve_format)

    def _group_step(self, group, lists: _GroupLists, grad_scale: float):
        _ops._fused_sgd_(lists.params, lists.states.get("momentum_buffer", []), lists.fresh,
                         lr=float(group["lr"]), momentum=float(group["momentum"]),
                         dampening=float(group["dampening"]),
                         weight_decay=float(group["weight_decay"]),
                         nesterov=bool(group["nesterov"]), maximize=bool(group["maximize"]),
                         grad_scale=grad_scale)


class NpuFusedRMSprop(NpuFusedOptimizerBase):
    """RMSprop (torch.optim.RMSprop semantics): ``eps`` outside the square root; ``centered``
    subtracts the squared mean gradient; optional momentum and L2 weight decay."""

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0, momentum=0,
                 centered=False, *, maximize=False):
        check_nonnegative("lr", lr, "learning rate")
        check_nonnegative("eps", eps, "epsilon value")
        check_nonnegative("momentum", momentum, "momentum value")
        check_nonnegative("weight_decay", weight_decay, "weight_decay value")
        check_nonnegative("alpha", alpha, "alpha value")
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, centered=centered, maximize=maximize)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("momentum", 0)
            group.setdefault("centered", False)
            group.setdefault("maximize", False)

    def _state_names(self, group):
        names = ["square_avg"]
        if group["momentum"] > 0:
            names.append("momentum_buffer")
        if group["centered"]:
            names.append("grad_avg")
        return tuple(names)

    def _init_state(self, p, state, group):
        _init_missing(state, p, self._state_names(group))

    def _group_step(self, group, lists: _GroupLists, grad_scale: float, **tf):
        s = lists.states
        _ops._fused_rmsprop_(lists.params, s["square_avg"], s.get("grad_avg", []),
                             s.get("momentum_buffer", []), lists.steps, lr=float(group["lr"]),
                             alpha=float(group["alpha"]), eps=float(group["eps"]),
                             weight_decay=float(group["weight_decay"]),
                             momentum=float(group["momentum"]), centered=bool(group["centered"]),
                             maximize=bool(group.get("maximize", False)), grad_scale=grad_scale,
                             **tf)


class NpuFusedRMSpropTF(NpuFusedRMSprop):
    """RMSprop in TensorFlow's form (timm's RMSpropTF, torch_npu's NpuFusedRMSpropTF).

    ``square_avg`` starts at ones and moves as ``sa += (1 - alpha) * (g^2 - sa)``; ``eps`` is
    inside the square root; with ``lr_in_momentum`` (default) the buffer accumulates
    ``lr * g / avg`` and ``p -= buf``; ``decoupled_decay`` applies ``p -= weight_decay * p``
    instead of an L2 gradient term.
    """

    def __init__(self, params, lr=1e-2, alpha=0.9, eps=1e-10, weight_decay=0, momentum=0.0,
                 centered=False, decoupled_decay=False, lr_in_momentum=True):
        check_nonnegative("lr", lr, "learning rate")
        check_nonnegative("eps", eps, "epsilon value")
        check_nonnegative("momentum", momentum, "momentum value")
        check_nonnegative("weight_decay", weight_decay, "weight_decay value")
        check_nonnegative("alpha", alpha, "alpha value")
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, centered=centered, decoupled_decay=decoupled_decay,
                        lr_in_momentum=lr_in_momentum)
        NpuFusedOptimizerBase.__init__(self, params, defaults)

    def _init_state(self, p, state, group):
        if "square_avg" not in state:
            state["square_avg"] = torch.ones_like(p, memory_format=torch.preserve_format)
        _init_missing(state, p, self._state_names(group))

    def _group_step(self, group, lists: _GroupLists, grad_scale: float):
        super()._group_step(group, lists, grad_scale, tf_style=True,
                            lr_in_momentum=bool(group["lr_in_momentum"]),
                            decoupled_decay=bool(group["decoupled_decay"]))


class NpuFusedAdadelta(NpuFusedOptimizerBase):
    """Adadelta (torch.optim.Adadelta semantics)."""

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0, *, maximize=False):
        check_nonnegative("lr", lr, "learning rate")
        if not 0.0 <= rho <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        check_nonnegative("eps", eps, "epsilon value")
        check_nonnegative("weight_decay", weight_decay, "weight_decay value")
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    def _state_names(self, group):
        return ("square_avg", "acc_delta")

    def _init_state(self, p, state, group):
        _init_missing(state, p, self._state_names(group))

    def _group_step(self, group, lists: _GroupLists, grad_scale: float):
        s = lists.states
        _ops._fused_adadelta_(lists.params, s["square_avg"], s["acc_delta"], lists.steps,
                              lr=float(group["lr"]), rho=float(group["rho"]),
                              eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                              maximize=bool(group.get("maximize", False)), grad_scale=grad_scale)


class _MomentsOptimizer(NpuFusedOptimizerBase):
    """State exp_avg / exp_avg_sq (LAMB, AdamP, BERT-Adam)."""

    def _state_names(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _init_state(self, p, state, group):
        _init_missing(state, p, self._state_names(group))


class NpuFusedLamb(_MomentsOptimizer):
    """LAMB (pytorch-lamb, as torch_npu's NpuFusedLamb): no bias correction.

    ``u = m / (sqrt(v) + eps) + weight_decay * p``; per tensor the trust ratio
    ``clamp(|p|, 0, 10) / |u|`` (1 when either norm is 0, always 1 with ``adam=True``);
    ``p -= lr * trust * u``. With ``use_global_grad_norm`` the gradients are divided by the norm
    of all gradients when it exceeds 1 (as the division is folded into the step, ``p.grad`` is
    left unchanged).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0,
                 adam=False, use_global_grad_norm=False):
        check_nonnegative("lr", lr, "learning rate")
        check_betas(betas)
        check_nonnegative("eps", eps, "epsilon value")
        check_nonnegative("weight_decay", weight_decay, "weight_decay value")
        self.adam = adam
        self.use_global_grad_norm = use_global_grad_norm
        self._grad_factor = 1.0
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _before_step(self, inv_scale):
        self._grad_factor = inv_scale
        if self.use_global_grad_norm:
            params = self._all_params()
            if any(p.grad is not None for p in params):
                norm = float(_ops._fused_grad_norm(params, 2.0)) * inv_scale
                if norm > 1:
                    self._grad_factor = inv_scale / norm

    def _group_step(self, group, lists: _GroupLists, grad_scale: float):
        beta1, beta2 = group["betas"]
        _ops._fused_lamb_(lists.params, lists.states["exp_avg"], lists.states["exp_avg_sq"],
                          lists.steps, lr=float(group["lr"]), beta1=float(beta1),
                          beta2=float(beta2), eps=float(group["eps"]),
                          weight_decay=float(group["weight_decay"]),
                          use_trust_ratio=not self.adam, grad_scale=self._grad_factor)


class NpuFusedAdamP(_MomentsOptimizer):
    """AdamP (Heo et al., "Slowing Down the Weight Norm Increase in Momentum-based Optimizers",
    as torch_npu's NpuFusedAdamP): bias-corrected Adam whose step, for parameters with 2+ dims
    whose gradient is nearly orthogonal to the weight (max |cos| < delta / sqrt(width), per
    output channel, else over the whole tensor), loses its radial component; their weight decay
    ``p *= 1 - lr * weight_decay * ratio`` then uses ``ratio = wd_ratio``."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 delta=0.1, wd_ratio=0.1, nesterov=False):
        check_nonnegative("lr", lr, "learning rate")
        check_betas(betas)
        check_nonnegative("eps", eps, "epsilon value")
        check_nonnegative("weight_decay", weight_decay, "weight_decay value")
        check_nonnegative("delta", delta, "delta value")
        check_nonnegative("wd_ratio", wd_ratio, "wd_ratio value")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, delta=delta,
                        wd_ratio=wd_ratio, nesterov=nesterov)
        super().__init__(params, defaults)

    def _group_step(self, group, lists: _GroupLists, grad_scale: float):
        beta1, beta2 = group["betas"]
        _ops._fused_adamp_(lists.params, lists.states["exp_avg"], lists.states["exp_avg_sq"],
                           lists.steps, lr=float(group["lr"]), beta1=float(beta1),
                           beta2=float(beta2), eps=float(group["eps"]),
                           weight_decay=float(group["weight_decay"]), delta=float(group["delta"]),
                           wd_ratio=float(group["wd_ratio"]), nesterov=bool(group["nesterov"]),
                           grad_scale=grad_scale)


BERT_SCHEDULES = ("warmup_linear", "warmup_cosine", "warmup_constant", "warmup_poly")


class NpuFusedBertAdam(_MomentsOptimizer):
    """BERT's Adam (pytorch-pretrained-BERT, as torch_npu's NpuFusedBertAdam).

    No bias correction; ``u = m / (sqrt(v) + e) + weight_decay * p``; ``p -= lr_t * u`` with
    ``lr_t = lr * schedule(step / t_total, warmup)`` (constant ``lr`` when ``t_total == -1``).
    With ``max_grad_norm > 0`` the gradients of each dtype in a group are clipped together to
    that norm (torch_npu clips each combined buffer); the factor is folded into the step, so
    ``p.grad`` keeps its values.
    """

    def __init__(self, params, lr=required, warmup=-1, t_total=-1, schedule="warmup_linear",
                 b1=0.9, b2=0.999, e=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        if lr is not required:
            check_nonnegative("lr", lr, "learning rate")
        if (warmup < 0.0 and warmup != -1) or warmup >= 1.0:
            raise ValueError(f"Invalid warmup: {warmup} - should be in [0.0, 1.0[ or -1")
        if schedule not in BERT_SCHEDULES:
            raise ValueError(f"Invalid schedule parameter: {schedule}")
        if not 0.0 <= b1 < 1.0:
            raise ValueError(f"Invalid b1 parameter: {b1} - should be in [0.0, 1.0[")
        if not 0.0 <= b2 < 1.0:
            raise ValueError(f"Invalid b2 parameter: {b2} - should be in [0.0, 1.0[")
        check_nonnegative("e", e, "epsilon value")
        defaults = dict(lr=lr, schedule=schedule, warmup=warmup, t_total=t_total, b1=b1, b2=b2,
                        e=e, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        self.max_grad_norm = max_grad_norm
        super().__init__(params, defaults)

    def _group_step(self, group, lists: _GroupLists, grad_scale: float):
        _ops._fused_bert_adam_(lists.params, lists.states["exp_avg"], lists.states["exp_avg_sq"],
                               lists.steps, lr=float(group["lr"]), beta1=float(group["b1"]),
                               beta2=float(group["b2"]), eps=float(group["e"]),
                               weight_decay=float(group["weight_decay"]),
                               max_grad_norm=float(group["max_grad_norm"]),
                               schedule=group["schedule"], warmup=float(group["warmup"]),
                               t_total=float(group["t_total"]), grad_scale=grad_scale)
