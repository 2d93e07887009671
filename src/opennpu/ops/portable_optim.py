"""The portable path of the fused optimizers: every torch.ops.opennpu optimizer op (the steps of
opennpu.optim / torch_npu.optim, the gradient norm, scale and unscale) as a composition of
torch._foreach_* ops, for devices without a native kernel (CUDA, XPU, MPS). portable.py registers
them (KERNELS) for those dispatch keys, and for CPU under portable.force(), where the tests compare
them with the C++ kernels (csrc/ops/optim/optim_cpu.cpp), whose semantics they follow:

- gradients are read from params[i].grad; a parameter without one is skipped (its state and step
  count untouched); empty tensors are skipped after their step count has advanced;
- fp16 / bf16 tensors are computed in float32 working copies and every stored value is rounded
  once (float64 stays float64); LAMB, BERT-Adam and AdamP reuse the moments as stored, rounded;
- grad_scale multiplies each gradient as it is read (p.grad keeps its values), maximize negates it;
- scalars enter the arithmetic rounded to the compute dtype, as the C++ kernels' A(x) casts do;
- state_steps are one-element float32 CPU tensors (host counters by contract), incremented here;
  the per-tensor bias corrections and schedules are computed from them on the host, in double.

On a CUDA device each foreach call is one horizontally fused multi-tensor kernel per dtype (torch's
multi_tensor_apply); elsewhere, and for the few per-tensor parts (LAMB's trust ratios applied per
tensor, AdamP's per-channel projections), torch loops over the tensors. Nothing reads device memory
on the host: data-dependent choices (trust ratios, clipping factors, AdamP's projection) are made on
the device with torch.where. _fused_grad_norm returns its 0-dim float32 result on the gradients'
device (the C++ kernel: on CPU); _fused_unscale_grads_ keeps found_inf where it is.

The fused CUDA optimizers of torch (torch._fused_adam_ and friends) are not used: they unscale the
gradients in place, compute bias corrections in float32 on the device and read device step
tensors, so their results differ from this contract.
"""

from __future__ import annotations

import math

import torch

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# c10's names, as the C++ messages print them
_DTYPE_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16",
                torch.float64: "Double", torch.int8: "Char", torch.uint8: "Byte",
                torch.int16: "Short", torch.int32: "Int", torch.int64: "Long", torch.bool: "Bool",
                torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}
_LAYOUT_NAMES = {torch.strided: "Strided", torch.sparse_coo: "Sparse",
                 torch.sparse_csr: "SparseCsr", torch.sparse_csc: "SparseCsc",
                 torch.sparse_bsr: "SparseBsr", torch.sparse_bsc: "SparseBsc"}


def _text(piece):
    """A message piece as the C++ checks print it (doubles as std::ostream does)."""
    if isinstance(piece, float):
        return format(piece, "g")
    if isinstance(piece, torch.dtype):
        return _DTYPE_NAMES.get(piece, str(piece).replace("torch.", ""))
    if isinstance(piece, torch.layout):
        return _LAYOUT_NAMES.get(piece, str(piece))
    return str(piece)


def _error(op, arg, *pieces):
    return RuntimeError(f"{op}: argument '{arg}' " + "".join(_text(p) for p in pieces))


def _shape(t):
    return list(t.shape)


def _dense(t):
    if t.is_contiguous():
        return True
    # non-overlapping and dense: some permutation of the dims is contiguous
    dims = sorted(range(t.dim()), key=lambda d: t.stride(d))
    expected = 1
    for d in dims:
        if t.size(d) != 1 and t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def _same_layout(a, b):
    return (a.is_contiguous() and b.is_contiguous()) or a.stride() == b.stride()


def acc_dtype(dtype):
    """The dtype a composition computes in: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32



def _host_float(device):
    """The dtype of device-side scalars computed in double by the C++ entry points."""
    return torch.float32 if device.type == "mps" else torch.float64


def _check_grad_scale(op, grad_scale):
    if not (math.isfinite(grad_scale) and grad_scale > 0):
        raise _error(op, "grad_scale", "must be a finite positive number (the factor the gradients "
                     "are multiplied by), but got ", grad_scale)


def _check_moments(op, params, exp_avgs, exp_avg_sqs):
    if len(exp_avgs) != len(params) or len(exp_avg_sqs) != len(params):
        raise _error(op, "exp_avgs", "and 'exp_avg_sqs' must hold one tensor per parameter (",
                     len(params), "), but got ", len(exp_avgs), " and ", len(exp_avg_sqs))


def _collect(op, params, states, steps):
    """optim.cpp's collect(): validates the lists and returns the indices of the parameters that
    have a gradient. `states` maps each state list's argument name to its tensors (an empty list
    when the state is not in use); steps is None for the ops that count no steps (SGD, norm and
    scale), else it must hold one counter per parameter."""
    n = len(params)
    for name, tensors in states.items():
        if tensors and len(tensors) != n:
            raise _error(op, name, "must hold one tensor per parameter (", n, ") or none, but got ",
                         len(tensors))
    if steps is not None and len(steps) != n:
        raise _error(op, "state_steps", "must hold one tensor per parameter (", n, "), but got ",
                     len(steps))
    index = []
    device = None
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            continue
        if device is None:
            device = p.device
        if p.device != device:
            raise _error(op, "params", f"[{i}] must be on the device of the other parameters, ",
                         device, ", but got ", p.device)
        dtype = p.dtype
        if dtype not in _FLOATS:
            raise _error(op, "params", f"[{i}] must be float32, float16, bfloat16 or float64, but "
                         "got ", dtype)
        if not _dense(p):
            raise _error(op, "params", f"[{i}] must be dense (contiguous in some dim order), but "
                         "got strides ", list(p.stride()), " for shape ", _shape(p))
        if g.layout != torch.strided:
            raise _error(op, "params", f"[{i}] must have a dense gradient (sparse gradients are "
                         "not supported), but got layout ", g.layout)
        if g.dtype != dtype or g.device != p.device:
            raise _error(op, "params", f"[{i}] must have a gradient of its dtype and device (",
                         dtype, ", ", p.device, "), but got ", g.dtype,
                         ", ", g.device)
        if g.shape != p.shape:
            raise _error(op, "params", f"[{i}] must have a gradient of its shape ", _shape(p),
                         ", but got ", _shape(g))
        for name, tensors in states.items():
            if not tensors:
                continue
            t = tensors[i]
            if not (t.dtype == dtype and t.device == p.device and t.shape == p.shape
                    and _same_layout(t, p)):
                raise _error(op, name, f"[{i}] must be a tensor of the dtype, device, shape and "
                             f"layout of params[{i}] (", dtype, ", ", p.device, ", ",
                             _shape(p), "), but got ", t.dtype, ", ", t.device, ", ",
                             _shape(t), " strides ", list(t.stride()))
        if steps is not None:
            s = steps[i]
            if not (s.dtype == torch.float32 and s.numel() == 1 and s.device.type == "cpu"):
                raise _error(op, "state_steps", f"[{i}] must be a one-element float32 CPU tensor, "
                             "but got ", s.dtype, " ", _shape(s), " on ", s.device)
        index.append(i)
    return index


def _read_steps(steps, index):
    """The counts of state_steps[index] as host floats (CPU tensors: no device synchronisation)."""
    if not index:
        return []
    return torch.cat([steps[i].reshape(1) for i in index]).tolist()


def _advance(steps, index):
    """Increments the float32 step counters of `index` and returns the new counts."""
    if not index:
        return []
    torch._foreach_add_([steps[i] for i in index], 1.0)
    return _read_steps(steps, index)


class _Group:
    """The tensors of one dtype in a call, in its compute dtype: p (P), the gradient (G, read
    only unless `owned`) and the states (S, in the order given), as float32 copies for fp16 / bf16
    (written back, rounded once, by store()) and as the tensors themselves otherwise. `index`
    holds the positions (in the lists given to _groups) of its tensors."""

    def __init__(self, dtype, index, params, grads, states):
        self.dtype, self.acc, self.index = dtype, acc_dtype(dtype), index
        self.low = dtype != self.acc
        self.params, self.states = params, states
        self.P = self._up(params)
        self.G = self._up(grads)
        self.owned = self.low  # G is a copy: in-place updates are allowed
        self.S = [self._up(s) for s in states]

    def _up(self, tensors):
        if not self.low:
            return list(tensors)
        out = [torch.empty_like(t, dtype=self.acc) for t in tensors]
        torch._foreach_copy_(out, tensors)
        return out

    def effective_grad(self, scale, maximize=False):
        """G * scale (when scale != 1), negated for maximize: the gradient as the update reads
        it (a list this group owns once anything changed)."""
        if scale != 1.0:
            if self.owned:
                torch._foreach_mul_(self.G, scale)
            else:
                self.G, self.owned = torch._foreach_mul(self.G, scale), True
        if maximize:
            if self.owned:
                torch._foreach_neg_(self.G)
            else:
                self.G, self.owned = torch._foreach_neg(self.G), True
        return self.G

    def round_states(self, which):
        """Stores the states `which` (indices into S) rounded to the dtype and reloads them: the
        values as stored, which LAMB and AdamP compute their update from."""
        if self.low:
            for k in which:
                torch._foreach_copy_(self.states[k], self.S[k])
                torch._foreach_copy_(self.S[k], self.states[k])

    def store(self, states=None):
        """Writes P and the states (default: all) back to the tensors, rounded once."""
        if self.low:
            torch._foreach_copy_(self.params, self.P)
            for k in range(len(self.S)) if states is None else states:
                torch._foreach_copy_(self.states[k], self.S[k])


def _by_dtype(params, index):
    """{dtype: positions k in `index`} of the parameters that have elements, dtypes in the C++
    order (float32, float16, bfloat16, float64)."""
    found = {}
    for k, i in enumerate(index):
        if params[i].numel() > 0:
            found.setdefault(params[i].dtype, []).append(k)
    return {dtype: found[dtype] for dtype in _FLOATS if dtype in found}


def _groups(params, index, states=()):
    """A _Group per dtype of the parameters `index` that have elements, with the state lists
    `states` (aligned with params)."""
    out = []
    for dtype, ks in _by_dtype(params, index).items():
        chosen = [index[k] for k in ks]
        out.append(_Group(dtype, ks, [params[i] for i in chosen], [params[i].grad for i in chosen],
                          [[s[i] for i in chosen] for s in states]))
    return out


def _grads(params, index):
    """The gradients with elements of the parameters `index`, one list per dtype."""
    return [[params[index[k]].grad for k in ks] for ks in _by_dtype(params, index).values()]


def _pick(values, group):
    return [values[k] for k in group.index]


# ----------------------------------------------------------------------------- steps


def _fused_adam_(params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, decoupled_weight_decay, grad_scale=1.0):
    op = "_fused_adam_"
    _check_grad_scale(op, grad_scale)
    if amsgrad and len(max_exp_avg_sqs) != len(params):
        raise _error(op, "max_exp_avg_sqs", "must hold one tensor per parameter when amsgrad=True, "
                     "but got ", len(max_exp_avg_sqs))
    if len(exp_avgs) != len(params) or len(exp_avg_sqs) != len(params):
        raise _error(op, "exp_avgs", "and 'exp_avg_sqs' must hold one tensor per parameter (",
                     len(params), "), but got ", len(exp_avgs), " and ", len(exp_avg_sqs))
    states = [exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if amsgrad else [])
    index = _collect(op, params, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
                                  "max_exp_avg_sqs": max_exp_avg_sqs if amsgrad else []},
                     state_steps)
    counts = _advance(state_steps, index)
    step_size = [lr / (1 - beta1 ** t) for t in counts]
    bc2_sqrt = [math.sqrt(1 - beta2 ** t) for t in counts]
    for grp in _groups(params, index, states):
        P, (M, V, *X) = grp.P, grp.S
        g = grp.effective_grad(grad_scale, maximize)
        if weight_decay != 0:
            if decoupled_weight_decay:
                torch._foreach_mul_(P, 1 - lr * weight_decay)
            else:
                g = torch._foreach_add(g, P, alpha=weight_decay)
        torch._foreach_lerp_(M, g, 1 - beta1)
        torch._foreach_mul_(V, beta2)
        torch._foreach_addcmul_(V, g, g, value=1 - beta2)
        if amsgrad:
            torch._foreach_maximum_(X[0], V)
        denom = torch._foreach_sqrt(X[0] if amsgrad else V)
        torch._foreach_div_(denom, _pick(bc2_sqrt, grp))
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(M, denom)
        torch._foreach_mul_(update, [-s for s in _pick(step_size, grp)])
        torch._foreach_add_(P, update)
        grp.store()


def _fused_sgd_(params, momentum_buffers, fresh_buffers, *, lr, momentum, dampening, weight_decay,
                nesterov, maximize, grad_scale=1.0):
    op = "_fused_sgd_"
    _check_grad_scale(op, grad_scale)
    if momentum != 0 and len(momentum_buffers) != len(params):
        raise _error(op, "momentum_buffers", "must hold one tensor per parameter when momentum != "
                     "0, but got ", len(momentum_buffers))
    buffers = momentum_buffers if momentum != 0 else []
    index = _collect(op, params, {"momentum_buffers": buffers}, None)
    fresh = set()
    for i in fresh_buffers:
        if not 0 <= i < len(params):
            raise _error(op, "fresh_buffers", f"must index params (0 to {len(params) - 1}), but "
                         f"got {i}")
        fresh.add(i)
    is_fresh = [i in fresh for i in index]
    for grp in _groups(params, index, [buffers] if buffers else []):
        P = grp.P
        g = grp.effective_grad(grad_scale, maximize)
        if weight_decay != 0:
            g = torch._foreach_add(g, P, alpha=weight_decay)
        if buffers:
            B = grp.S[0]
            new = _pick(is_fresh, grp)
            first = [k for k, f in enumerate(new) if f]
            rest = [k for k, f in enumerate(new) if not f]
            if first:  # a new buffer is the gradient, as torch.optim.SGD starts it
                torch._foreach_copy_([B[k] for k in first], [g[k] for k in first])
            if rest:
                old = [B[k] for k in rest]
                torch._foreach_mul_(old, momentum)
                torch._foreach_add_(old, [g[k] for k in rest], alpha=1 - dampening)
            g = torch._foreach_add(g, B, alpha=momentum) if nesterov else B
        torch._foreach_add_(P, g, alpha=-lr)
        grp.store()


def _fused_rmsprop_(params, square_avgs, grad_avgs, momentum_buffers, state_steps, *, lr, alpha,
                    eps, weight_decay, momentum, centered, maximize, tf_style=False,
                    lr_in_momentum=False, decoupled_decay=False, grad_scale=1.0):
    op = "_fused_rmsprop_"
    _check_grad_scale(op, grad_scale)
    if len(square_avgs) != len(params):
        raise _error(op, "square_avgs", "must hold one tensor per parameter (", len(params),
                     "), but got ", len(square_avgs))
    if centered and len(grad_avgs) != len(params):
        raise _error(op, "grad_avgs", "must hold one tensor per parameter when centered=True, but "
                     "got ", len(grad_avgs))
    if momentum != 0 and len(momentum_buffers) != len(params):
        raise _error(op, "momentum_buffers", "must hold one tensor per parameter when momentum > "
                     "0, but got ", len(momentum_buffers))
    averages = grad_avgs if centered else []
    buffers = momentum_buffers if momentum != 0 else []
    index = _collect(op, params, {"square_avgs": square_avgs, "grad_avgs": averages,
                                  "momentum_buffers": buffers}, state_steps)
    _advance(state_steps, index)
    states = [square_avgs] + ([averages] if centered else []) + ([buffers] if buffers else [])
    w = 1 - alpha
    for grp in _groups(params, index, states):
        P, S = grp.P, grp.S[0]
        C = grp.S[1] if centered else None
        B = grp.S[-1] if buffers else None
        g = grp.effective_grad(grad_scale, maximize)
        if weight_decay != 0:
            if tf_style and decoupled_decay:
                torch._foreach_add_(P, P, alpha=-weight_decay)  # p -= wd * p (no lr)
            else:
                g = torch._foreach_add(g, P, alpha=weight_decay)
        if tf_style:
            torch._foreach_lerp_(S, torch._foreach_mul(g, g), w)
        else:
            torch._foreach_mul_(S, alpha)
            torch._foreach_addcmul_(S, g, g, value=w)
        if centered:
            torch._foreach_lerp_(C, g, w)
            avg = torch._foreach_addcmul(S, C, C, value=-1)
        else:
            avg = torch._foreach_add(S, eps) if tf_style else torch._foreach_sqrt(S)
        if tf_style:  # eps inside the square root
            if centered:
                torch._foreach_add_(avg, eps)
            torch._foreach_sqrt_(avg)
        else:
            if centered:
                torch._foreach_sqrt_(avg)
            torch._foreach_add_(avg, eps)
        step = torch._foreach_div(g, avg)
        if B is not None:
            torch._foreach_mul_(B, momentum)
            if tf_style and lr_in_momentum:
                torch._foreach_add_(B, step, alpha=lr)
                torch._foreach_sub_(P, B)
            else:
                torch._foreach_add_(B, step)
                torch._foreach_add_(P, B, alpha=-lr)
        else:
            torch._foreach_add_(P, step, alpha=-lr)
        grp.store()


def _fused_adadelta_(params, square_avgs, acc_deltas, state_steps, *, lr, rho, eps, weight_decay,
                     maximize, grad_scale=1.0):
    op = "_fused_adadelta_"
    _check_grad_scale(op, grad_scale)
    if len(square_avgs) != len(params) or len(acc_deltas) != len(params):
        raise _error(op, "square_avgs", "and 'acc_deltas' must hold one tensor per parameter (",
                     len(params), "), but got ", len(square_avgs), " and ", len(acc_deltas))
    index = _collect(op, params, {"square_avgs": square_avgs, "acc_deltas": acc_deltas},
                     state_steps)
    _advance(state_steps, index)
    for grp in _groups(params, index, [square_avgs, acc_deltas]):
        P, (S, D) = grp.P, grp.S
        g = grp.effective_grad(grad_scale, maximize)
        if weight_decay != 0:
            g = torch._foreach_add(g, P, alpha=weight_decay)
        torch._foreach_mul_(S, rho)
        torch._foreach_addcmul_(S, g, g, value=1 - rho)
        std = torch._foreach_add(S, eps)
        torch._foreach_sqrt_(std)
        delta = torch._foreach_add(D, eps)
        torch._foreach_sqrt_(delta)
        torch._foreach_div_(delta, std)
        torch._foreach_mul_(delta, g)
        torch._foreach_mul_(D, rho)
        torch._foreach_addcmul_(D, delta, delta, value=1 - rho)
        torch._foreach_add_(P, delta, alpha=-lr)
        grp.store()


def _moments(grp, g, beta1, beta2):
    """m = beta1 m + (1 - beta1) g, v = beta2 v + (1 - beta2) g^2 (LAMB, BERT-Adam, AdamP: no
    lerp), stored rounded and reloaded as stored."""
    M, V = grp.S[0], grp.S[1]
    torch._foreach_mul_(M, beta1)
    torch._foreach_add_(M, g, alpha=1 - beta1)
    torch._foreach_mul_(V, beta2)
    torch._foreach_addcmul_(V, g, g, value=1 - beta2)
    grp.round_states((0, 1))


def _lamb_update(grp, g, beta1, beta2, eps, weight_decay):
    """LAMB / BERT-Adam: m, v updated (stored, rounded), and u = m / (sqrt(v) + eps) + wd * p
    from the stored values."""
    P, (M, V) = grp.P, grp.S
    _moments(grp, g, beta1, beta2)
    u = torch._foreach_sqrt(V)
    torch._foreach_add_(u, eps)
    u = torch._foreach_div(M, u)
    if weight_decay != 0:
        torch._foreach_add_(u, P, alpha=weight_decay)
    return u


def _fused_lamb_(params, exp_avgs, exp_avg_sqs, state_steps, *, lr, beta1, beta2, eps,
                 weight_decay, use_trust_ratio, grad_scale=1.0):
    op = "_fused_lamb_"
    _check_grad_scale(op, grad_scale)
    _check_moments(op, params, exp_avgs, exp_avg_sqs)
    index = _collect(op, params, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, state_steps)
    _advance(state_steps, index)
    for grp in _groups(params, index, [exp_avgs, exp_avg_sqs]):
        u = _lamb_update(grp, grp.effective_grad(grad_scale), beta1, beta2, eps, weight_decay)
        if use_trust_ratio:
            # per tensor clamp(|p|, max=10) / |u|, 1 where either is 0; applied tensor by tensor
            weight = torch.stack(torch._foreach_norm(grp.P)).clamp(max=10.0)
            adam = torch.stack(torch._foreach_norm(u))
            trust = torch.where((weight == 0) | (adam == 0), 1.0, weight / adam)
            torch._foreach_mul_(u, list((trust * lr).unbind(0)))
            torch._foreach_sub_(grp.P, u)
        else:
            torch._foreach_add_(grp.P, u, alpha=-lr)
        grp.store(states=())


_BERT_SCHEDULES = ("warmup_linear", "warmup_cosine", "warmup_constant", "warmup_poly")


def _bert_schedule(op, name, x, warmup):
    if x < warmup:
        return x / warmup
    if name == "warmup_linear":
        return max((x - 1) / (warmup - 1), 0.0)
    if name == "warmup_cosine":
        return 0.5 * (1 + math.cos(math.pi * x))
    if name == "warmup_constant":
        return 1.0
    if name == "warmup_poly":
        return (1 - x) ** 0.5
    raise _error(op, "schedule", "must be one of ", ", ".join(_BERT_SCHEDULES), ", but got ", name)


def _fused_bert_adam_(params, exp_avgs, exp_avg_sqs, state_steps, *, lr, beta1, beta2, eps,
                      weight_decay, max_grad_norm, schedule, warmup, t_total, grad_scale=1.0):
    op = "_fused_bert_adam_"
    _check_grad_scale(op, grad_scale)
    _check_moments(op, params, exp_avgs, exp_avg_sqs)
    _bert_schedule(op, schedule, 1.0, warmup)  # validates the name
    index = _collect(op, params, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, state_steps)
    # the learning rate follows the step count before this step
    rates = [lr * (_bert_schedule(op, schedule, t / t_total, warmup) if t_total != -1 else 1.0)
             for t in _read_steps(state_steps, index)]
    _advance(state_steps, index)
    for grp in _groups(params, index, [exp_avgs, exp_avg_sqs]):
        factor = grad_scale
        if max_grad_norm > 0:
            # the gradients of each dtype clipped together by the norm of the unscaled gradients
            host = _host_float(grp.P[0].device)
            norm = torch.linalg.vector_norm(
                torch.stack(torch._foreach_norm(grp.G, 2, dtype=host))) * grad_scale
            coef = max_grad_norm / (norm + 1e-6)
            factor = torch.where(coef < 1, grad_scale * coef, grad_scale).to(grp.acc)
            g = torch._foreach_mul(grp.G, factor)
        else:
            g = grp.effective_grad(grad_scale)
        u = _lamb_update(grp, g, beta1, beta2, eps, weight_decay)
        torch._foreach_mul_(u, _pick(rates, grp))
        torch._foreach_sub_(grp.P, u)
        grp.store(states=())


def _fused_adamp_(params, exp_avgs, exp_avg_sqs, state_steps, *, lr, beta1, beta2, eps,
                  weight_decay, delta, wd_ratio, nesterov, grad_scale=1.0):
    op = "_fused_adamp_"
    _check_grad_scale(op, grad_scale)
    _check_moments(op, params, exp_avgs, exp_avg_sqs)
    index = _collect(op, params, {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}, state_steps)
    counts = _advance(state_steps, index)
    step_size = [lr / (1 - beta1 ** t) for t in counts]
    bc2_sqrt = [math.sqrt(1 - beta2 ** t) for t in counts]
    keep = 1 - lr * weight_decay if weight_decay > 0 else 1.0
    keep_projected = 1 - lr * weight_decay * wd_ratio if weight_decay > 0 else 1.0
    for grp in _groups(params, index, [exp_avgs, exp_avg_sqs]):
        P, (M, V) = grp.P, grp.S
        g = grp.effective_grad(grad_scale)
        _moments(grp, g, beta1, beta2)
        denom = torch._foreach_sqrt(V)
        torch._foreach_div_(denom, _pick(bc2_sqrt, grp))
        torch._foreach_add_(denom, eps)
        if nesterov:
            perturb = torch._foreach_mul(M, beta1)
            torch._foreach_add_(perturb, g, alpha=1 - beta1)
            torch._foreach_div_(perturb, denom)
        else:
            perturb = torch._foreach_div(M, denom)
        for p, q, gk, size in zip(P, perturb, g, _pick(step_size, grp)):
            scale = keep
            if p.dim() > 1:
                q, projected = _adamp_project(p, q, gk, eps, delta)
                scale = torch.where(projected, torch.full((), keep_projected, dtype=p.dtype,
                                                          device=p.device), keep)
            p.mul_(scale).sub_(q, alpha=size)
        grp.store(states=())


def _adamp_project(p, q, g, eps, delta):
    """AdamP's projection of one parameter with 2+ dims: (the perturbation with its radial part
    removed where the gradient is nearly orthogonal to the weight, else unchanged; whether it
    was). Tried per channel (rows = size(0)): max |cos(g, p)| < delta / sqrt(row width), then for
    the whole tensor: |cos| < delta / sqrt(numel). Decided on the device."""
    host = _host_float(p.device)
    rows = p.shape[0]
    pr, qr, gr = (t.reshape(rows, -1).to(host) for t in (p, q, g))
    gp, gg, pp, pq = ((a * b).sum(1) for a, b in ((gr, pr), (gr, gr), (pr, pr), (pr, qr)))

    def cosine(gp, gg, pp):
        return gp.abs() / (gg.sqrt() + eps) / (pp.sqrt() + eps)

    row_cos = cosine(gp, gg, pp)
    max_cos = torch.where(row_cos.isnan(), 0.0, row_cos).amax()  # NaN rows are passed over
    per_row = max_cos < delta / math.sqrt(p.numel() // rows)
    whole = cosine(gp.sum(), gg.sum(), pp.sum()) < delta / math.sqrt(p.numel())
    norm_rows = pp.sqrt() + eps
    norm_all = pp.sum().sqrt() + eps
    coef = torch.where(per_row, pq / (norm_rows * norm_rows), pq.sum() / (norm_all * norm_all))
    coef = coef.to(p.dtype).view(rows, *([1] * (p.dim() - 1)))
    projected = per_row | whole
    return torch.where(projected, q - p * coef, q), projected


# ----------------------------------------------------------------------------- norms and scaling


def _fused_grad_norm(params, norm_type=2.0):
    op = "_fused_grad_norm"
    if not (norm_type > 0):
        raise _error(op, "norm_type", "must be positive or inf, but got ", norm_type)
    index = _collect(op, params, {}, None)
    grads = _grads(params, index)
    if not grads:
        device = params[index[0]].device if index else torch.device("cpu")
        return torch.zeros((), dtype=torch.float32, device=device)
    host = _host_float(grads[0][0].device)
    # per-tensor norms accumulated in float64 (float32 on MPS), then combined: the C++ kernel sums
    # float32 partial sums in double; one float32 sum over a long tensor would lose digits
    norms = torch.cat([torch.stack(torch._foreach_norm(g, norm_type, dtype=host)) for g in grads])
    if math.isinf(norm_type):
        total = norms.amax()
    else:
        total = torch.linalg.vector_norm(norms, norm_type)
    return total.to(torch.float32)


def _fused_scale_grads_(params, scale):
    index = _collect("_fused_scale_grads_", params, {}, None)
    if scale == 1.0:
        return
    for grads in _grads(params, index):
        if grads[0].dtype in (torch.float16, torch.bfloat16):
            # in float32, rounded once (torch's CPU foreach rounds the scalar to the dtype first)
            wide = [torch.empty_like(g, dtype=torch.float32) for g in grads]
            torch._foreach_copy_(wide, grads)
            torch._foreach_mul_(wide, scale)
            torch._foreach_copy_(grads, wide)
        else:
            torch._foreach_mul_(grads, scale)


def _fused_unscale_grads_(params, found_inf, inv_scale):
    op = "_fused_unscale_grads_"
    if not (found_inf.numel() == 1 and found_inf.dtype == torch.float32):
        raise _error(op, "found_inf", "must be a one-element float32 tensor, but got ",
                     found_inf.dtype, " ", _shape(found_inf))
    if not (inv_scale.numel() == 1 and inv_scale.dtype == torch.float32):
        raise _error(op, "inv_scale", "must be a one-element float32 tensor, but got ",
                     inv_scale.dtype, " ", _shape(inv_scale))
    index = _collect(op, params, {}, None)
    grads = _grads(params, index)
    if not grads:
        return
    device = grads[0][0].device
    # torch's GradScaler kernel: g *= inv_scale, found_inf = 1 if any g (before) is inf or NaN
    found = found_inf.reshape(1)
    if found_inf.device != device:
        found = found.to(device)
    inv = inv_scale.reshape(1).to(device)
    for same in grads:
        if same[0].dtype == torch.bfloat16:
            # torch's CUDA kernel takes float16 / float32 only: unscale float32 copies (exact),
            # then round once, as the C++ kernel does
            wide = [g.float() for g in same]
            torch._amp_foreach_non_finite_check_and_unscale_(wide, found, inv)
            torch._foreach_copy_(same, wide)
        else:
            torch._amp_foreach_non_finite_check_and_unscale_(same, found, inv)
    if found_inf.device != device:
        found_inf.copy_(found.reshape(found_inf.shape))


KERNELS = {f"opennpu::{fn.__name__}": fn for fn in (
    _fused_adam_, _fused_sgd_, _fused_rmsprop_, _fused_adadelta_, _fused_lamb_, _fused_bert_adam_,
    _fused_adamp_, _fused_grad_norm, _fused_scale_grads_, _fused_unscale_grads_)}
