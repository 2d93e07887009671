"""Plain-torch reference steps of the fused optimizers without a torch.optim counterpart.

Written from the contract (shared/spec/torch_npu_api.md section 2.3: torch_npu's NpuFusedRMSpropTF,
NpuFusedLamb, NpuFusedAdamP and NpuFusedBertAdam), one parameter at a time with ordinary tensor
ops. Math in float64; state kept in the parameter's dtype and parameters rounded once per step,
as the fused kernels store them. Used by the tests (and usable by anyone checking a kernel).
"""

from __future__ import annotations

import math

import torch


class _Reference:
    def __init__(self, params, **hyper):
        self.params = list(params)
        self.h = hyper
        self.state = [dict() for _ in self.params]

    @torch.no_grad()
    def step(self):
        for p, state in zip(self.params, self.state):
            if p.grad is None:
                continue
            p64, g64 = p.double(), p.grad.double()
            new_p, new_state = self._update(p64, g64, {k: (v.double() if torch.is_tensor(v) else v)
                                                       for k, v in state.items()}, p)
            p.copy_(new_p)
            for k, v in new_state.items():
                state[k] = v.to(p.dtype) if torch.is_tensor(v) else v


class RMSpropTF(_Reference):
    """square_avg from ones; sa += (1 - a)(g^2 - sa); avg = sqrt(sa [- ga^2] + eps)."""

    def _update(self, p, g, s, orig):
        h = self.h
        lr, alpha, eps, wd, mom = h["lr"], h["alpha"], h["eps"], h["weight_decay"], h["momentum"]
        sa = s.get("square_avg", torch.ones_like(p))
        if wd != 0:
            if h.get("decoupled_decay"):
                p = p - wd * p
            else:
                g = g + wd * p
        sa = sa + (1 - alpha) * (g * g - sa)
        out = {"square_avg": sa}
        if h.get("centered"):
            ga = s.get("grad_avg", torch.zeros_like(p))
            ga = ga + (1 - alpha) * (g - ga)
            out["grad_avg"] = ga
            avg = (sa - ga * ga + eps).sqrt()
        else:
            avg = (sa + eps).sqrt()
        if mom > 0:
            buf = s.get("momentum_buffer", torch.zeros_like(p))
            if h.get("lr_in_momentum", True):
                buf = buf * mom + lr * g / avg
                p = p - buf
            else:
                buf = buf * mom + g / avg
                p = p - lr * buf
            out["momentum_buffer"] = buf
        else:
            p = p - lr * g / avg
        return p, out


class Lamb(_Reference):
    """No bias correction; trust = clamp(|p|, 0, 10) / |m / (sqrt(v) + eps) + wd p|."""

    def __init__(self, params, **hyper):
        super().__init__(params, **hyper)
        self.grad_factor = 1.0

    @torch.no_grad()
    def step(self):
        self.grad_factor = 1.0
        if self.h.get("use_global_grad_norm"):
            grads = [p.grad.double() for p in self.params if p.grad is not None]
            norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
            if norm > 1:
                self.grad_factor = 1 / norm
        super().step()

    def _update(self, p, g, s, orig):
        h = self.h
        (b1, b2), eps, wd = h["betas"], h["eps"], h["weight_decay"]
        g = g * self.grad_factor
        m = s.get("exp_avg", torch.zeros_like(p)) * b1 + (1 - b1) * g
        v = s.get("exp_avg_sq", torch.zeros_like(p)) * b2 + (1 - b2) * g * g
        # The kernel computes u from the moments as stored (rounded to the parameter's dtype).
        m_r, v_r = m.to(orig.dtype).double(), v.to(orig.dtype).double()
        u = m_r / (v_r.sqrt() + eps)
        if wd != 0:
            u = u + wd * p
        w_norm, u_norm = p.norm().clamp(0, 10), u.norm()
        trust = 1.0 if (h.get("adam") or w_norm == 0 or u_norm == 0) else w_norm / u_norm
        return p - h["lr"] * trust * u, {"exp_avg": m, "exp_avg_sq": v}


class AdamP(_Reference):
    """Adam with projection for parameters with 2+ dims (channel view, then layer view)."""

    def _update(self, p, g, s, orig):
        h = self.h
        (b1, b2), eps, lr = h["betas"], h["eps"], h["lr"]
        step = s.get("step", 0) + 1
        m = s.get("exp_avg", torch.zeros_like(p)) * b1 + (1 - b1) * g
        v = s.get("exp_avg_sq", torch.zeros_like(p)) * b2 + (1 - b2) * g * g
        m_r, v_r = m.to(orig.dtype).double(), v.to(orig.dtype).double()
        denom = v_r.sqrt() / math.sqrt(1 - b2**step) + eps
        perturb = (b1 * m_r + (1 - b1) * g if h.get("nesterov") else m_r) / denom
        ratio = 1.0
        if p.dim() > 1:
            for view in (lambda x: x.reshape(x.shape[0], -1), lambda x: x.reshape(1, -1)):
                gv, pv = view(g), view(p)
                cos = ((gv * pv).sum(1).abs() / (gv.norm(dim=1) + eps) / (pv.norm(dim=1) + eps))
                if cos.max() < h["delta"] / math.sqrt(pv.shape[1]):
                    shape = [-1] + [1] * (p.dim() - 1)
                    p_n = p / (pv.norm(dim=1) + eps).reshape(shape)
                    perturb = perturb - p_n * view(p_n * perturb).sum(1).reshape(shape)
                    ratio = h["wd_ratio"]
                    break
        if h["weight_decay"] > 0:
            p = p * (1 - lr * h["weight_decay"] * ratio)
        p = p - lr / (1 - b1**step) * perturb
        return p, {"exp_avg": m, "exp_avg_sq": v, "step": step}


def bert_schedule(name: str, x: float, warmup: float) -> float:
    if x < warmup:
        return x / warmup
    return {"warmup_linear": lambda: max((x - 1.0) / (warmup - 1.0), 0.0),
            "warmup_cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * x)),
            "warmup_constant": lambda: 1.0,
            "warmup_poly": lambda: (1.0 - x) ** 0.5}[name]()


class BertAdam(_Reference):
    """Gradients of each dtype clipped together to max_grad_norm; no bias correction;
    lr scheduled on the step count before the step."""

    @torch.no_grad()
    def step(self):
        self.factors = {}
        if self.h["max_grad_norm"] > 0:
            for dtype in {p.dtype for p in self.params if p.grad is not None}:
                norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in self.params
                                     if p.grad is not None and p.dtype == dtype))
                coef = self.h["max_grad_norm"] / (norm + 1e-6)
                self.factors[dtype] = coef if coef < 1 else 1.0
        super().step()

    def _update(self, p, g, s, orig):
        h = self.h
        g = g * self.factors.get(orig.dtype, 1.0)
        m = s.get("exp_avg", torch.zeros_like(p)) * h["b1"] + (1 - h["b1"]) * g
        v = s.get("exp_avg_sq", torch.zeros_like(p)) * h["b2"] + (1 - h["b2"]) * g * g
        m_r, v_r = m.to(orig.dtype).double(), v.to(orig.dtype).double()
        u = m_r / (v_r.sqrt() + h["e"])
        if h["weight_decay"] > 0:
            u = u + h["weight_decay"] * p
        step = s.get("step", 0)
        lr = h["lr"]
        if h["t_total"] != -1:
            lr = lr * bert_schedule(h["schedule"], step / h["t_total"], h["warmup"])
        return p - lr * u, {"exp_avg": m, "exp_avg_sq": v, "step": step + 1}
