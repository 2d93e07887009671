"""apex.amp on the npu device: initialize, scale_loss, state_dict / load_state_dict.

Opt levels (apex's properties; each can be overridden by the keyword of the same name):

=====  ===============  =====================  ===================  ==============  ===========
level  cast_model_type  patch_torch_functions  keep_batchnorm_fp32  master_weights  loss_scale
=====  ===============  =====================  ===================  ==============  ===========
O0     float32          False                  None                 False           1.0
O1     None             True                   None                 False           "dynamic"
O2     float16          False                  True                 True            "dynamic"
O3     float16          False                  False                False           1.0
=====  ===============  =====================  ===================  ==============  ===========

How each property is realised here:

* ``patch_torch_functions`` (O1): each model's forward runs under ``torch.autocast("npu",
  torch.float16)``, i.e. CUDA's autocast op lists. Apex instead patches torch's functions for the
  whole program, so ops outside the models' forwards (typically the loss) were cast too; here they
  run at the dtypes of their inputs. This is the approximation of O1.
* ``cast_model_type`` (O2, O3): the models' floating parameters and buffers are cast in place
  (the Parameter objects stay the same), BatchNorm modules excepted under
  ``keep_batchnorm_fp32``; the forward casts floating inputs to that type and floating outputs to
  ``cast_model_outputs`` (float32 by default), as apex's patched forward does.
* ``master_weights`` (O2): each optimizer's reduced-precision parameters are replaced in its
  param groups by float32 copies (the master weights). Leaving ``scale_loss`` copies the model's
  gradients into the masters' float32 gradients and unscales them there; ``optimizer.step()``
  updates the masters and copies them back into the model; ``optimizer.zero_grad()`` clears the
  model's gradients too. Parameters already in float32 are stepped directly.
* ``loss_scale``: "dynamic" starts at 2**16 (capped by ``max_loss_scale``), halves on an inf/NaN
  gradient (never below ``min_loss_scale``) and the optimizers' next step is skipped; after 2000
  steps without one it doubles. A float is a static scale: gradients are divided by it and
  nothing is checked or skipped.

Ascend's additions ``combine_grad``, ``combine_ddp``, ``ddp_replica_count``,
``check_combined_tensors`` and ``user_cast_preferred`` choose how Ascend packs gradients into
contiguous buffers for its fused kernels; they are accepted and change nothing here, where
opennpu's NpuFused* optimizers take the gradients where they are.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["initialize", "scale_loss", "state_dict", "load_state_dict", "master_params"]

_OPT_LEVELS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, keep_batchnorm_fp32=None,
               master_weights=False, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}
_SCALE_WINDOW = 2000
_REDUCED = (torch.float16, torch.bfloat16)


class _LossScaler:
    """One loss's scale (apex keeps one per ``loss_id``)."""

    def __init__(self, loss_scale, min_loss_scale, max_loss_scale):
        self.dynamic = loss_scale == "dynamic"
        self.loss_scale = min(max_loss_scale, 2.0**16) if self.dynamic else float(loss_scale)
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.unskipped = 0

    def update(self, overflow: bool) -> bool:
        """Adjusts the scale after one unscale; True when the step must be skipped."""
        if overflow and self.dynamic:
            halved = self.loss_scale / 2.0
            self.loss_scale = max(self.min_loss_scale, halved) if self.min_loss_scale else halved
            self.unskipped = 0
            return True
        self.unskipped += 1
        if self.dynamic and self.unskipped == _SCALE_WINDOW:
            self.loss_scale = min(self.max_loss_scale, self.loss_scale * 2.0)
            self.unskipped = 0
        return False


@dataclass
class _OptimizerAmp:
    """What initialize attached to one optimizer."""

    masters: list = field(default_factory=list)  # (model parameter, float32 master) pairs
    skip_next_step: bool = False


@dataclass
class _AmpState:
    enabled: bool = False
    properties: dict = field(default_factory=dict)
    scalers: list = field(default_factory=list)


_state = _AmpState()


def _as_list(x):
    return (list(x), True) if isinstance(x, (list, tuple)) else ([x], False)


def _cast_floating(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        cast = [_cast_floating(v, dtype) for v in value]
        return type(value)(*cast) if hasattr(value, "_fields") else type(value)(cast)
    if isinstance(value, dict):
        return type(value)((k, _cast_floating(v, dtype)) for k, v in value.items())
    return value


def _cast_model(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> None:
    """Casts the floating parameters and buffers of every module in place (the Parameter objects
    that optimizers hold stay the same), BatchNorm modules excepted when keep_batchnorm_fp32."""
    for module in model.modules():
        if keep_batchnorm_fp32 and isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point():
                setattr(module, name, b.to(dtype))


def _patch_forward(model: nn.Module, props: dict) -> None:
    forward = model.forward
    cast_type = props["cast_model_type"]
    autocast = props["patch_torch_functions"]
    output_type = props["cast_model_outputs"] or torch.float32

    @functools.wraps(forward)
    def amp_forward(*args, **kwargs):
        if cast_type is not None:
            args, kwargs = _cast_floating(args, cast_type), _cast_floating(kwargs, cast_type)
        if autocast:
            with torch.autocast("npu", dtype=torch.float16):
                out = forward(*args, **kwargs)
        else:
            out = forward(*args, **kwargs)
        return _cast_floating(out, output_type) if cast_type is not None else out

    model.forward = amp_forward


def _patch_optimizer(optimizer: torch.optim.Optimizer, use_masters: bool) -> None:
    if hasattr(optimizer, "_amp_opennpu"):
        raise RuntimeError("amp.initialize: this optimizer was already passed to amp.initialize")
    if any(len(s) for s in optimizer.state.values()):
        raise RuntimeError("amp.initialize: the optimizer has already stepped; call "
                           "amp.initialize before the first optimizer.step()")
    amp = _OptimizerAmp()
    if use_masters:
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                if p.dtype in _REDUCED:
                    master = nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
                    amp.masters.append((p, master))
                    params.append(master)
                else:
                    params.append(p)
            group["params"] = params  # a new list: fused optimizers rebuild their caches
    optimizer._amp_opennpu = amp
    step, zero_grad = optimizer.step, optimizer.zero_grad
    # torch.optim clears gradients to None by default, torch_npu's fused optimizers to zeros.
    zero_default = inspect.signature(zero_grad).parameters.get("set_to_none")
    zero_default = True if zero_default is None else zero_default.default

    @functools.wraps(step)
    def amp_step(*args, **kwargs):
        if amp.skip_next_step:  # the loss scale overflowed: the gradients are not usable
            amp.skip_next_step = False
            return None
        result = step(*args, **kwargs)
        with torch.no_grad():
            for model_p, master in amp.masters:
                model_p.copy_(master)
        return result

    @functools.wraps(zero_grad)
    def amp_zero_grad(*args, **kwargs):
        zero_grad(*args, **kwargs)
        set_to_none = kwargs.get("set_to_none", args[0] if args else zero_default)
        for model_p, _ in amp.masters:
            if model_p.grad is None:
                continue
            if set_to_none:
                model_p.grad = None
            else:
                model_p.grad.detach_().zero_()

    optimizer.step, optimizer.zero_grad = amp_step, amp_zero_grad


def initialize(models, optimizers=None, enabled=True, opt_level="O1", cast_model_type=None,
               patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
               loss_scale=None, cast_model_outputs=None, num_losses=1, verbosity=1,
               min_loss_scale=None, max_loss_scale=2.0**24, combine_grad=None, combine_ddp=None,
               ddp_replica_count=4, user_cast_preferred=None, check_combined_tensors=None):
    """``apex.amp.initialize``: prepares models and optimizers for the opt level and returns them
    in the structure they were given (models alone when ``optimizers`` is None)."""
    del verbosity, combine_grad, combine_ddp, ddp_replica_count, user_cast_preferred
    del check_combined_tensors  # Ascend's gradient-packing options: nothing to do here
    model_list, models_listed = _as_list(models)
    if optimizers is None:
        optimizer_list, optimizers_listed = [], False
    else:
        optimizer_list, optimizers_listed = _as_list(optimizers)

    def result():
        out_models = model_list if models_listed else model_list[0]
        if optimizers is None:
            return out_models
        return out_models, (optimizer_list if optimizers_listed else optimizer_list[0])

    if not enabled:
        _state.enabled = False
        return result()
    if opt_level not in _OPT_LEVELS:
        raise ValueError(f"amp.initialize: unexpected opt_level {opt_level!r}; options are "
                         f"{', '.join(_OPT_LEVELS)} (the letter O, not zero)")
    for m in model_list:
        if not isinstance(m, nn.Module):
            raise TypeError(f"amp.initialize: models must be torch.nn.Modules, got {type(m)}")
    for o in optimizer_list:
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"amp.initialize: optimizers must be torch.optim.Optimizers, got "
                            f"{type(o)}")
    if not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"amp.initialize: num_losses must be a positive int, got {num_losses!r}")

    props = dict(_OPT_LEVELS[opt_level])
    overrides = dict(cast_model_type=cast_model_type, patch_torch_functions=patch_torch_functions,
                     keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
                     loss_scale=loss_scale)
    for key, value in overrides.items():
        if value is not None:
            if key == "keep_batchnorm_fp32" and isinstance(value, str):
                if value not in ("True", "False"):
                    raise ValueError(f"amp.initialize: keep_batchnorm_fp32 must be True, False or "
                                     f"None, got {value!r}")
                value = value == "True"
            props[key] = value
    props["cast_model_outputs"] = cast_model_outputs
    if props["loss_scale"] != "dynamic":
        scale = float(props["loss_scale"])
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"amp.initialize: loss_scale must be \"dynamic\" or a positive "
                             f"float, got {props['loss_scale']!r}")
    if props["cast_model_type"] not in (None, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"amp.initialize: cast_model_type must be torch.float16, "
                         f"torch.bfloat16, torch.float32 or None, got {props['cast_model_type']}")

    for model in model_list:
        if props["cast_model_type"] is not None:
            _cast_model(model, props["cast_model_type"], bool(props["keep_batchnorm_fp32"]))
        if props["cast_model_type"] not in (None, torch.float32) or props["patch_torch_functions"]:
            _patch_forward(model, props)
    for optimizer in optimizer_list:
        _patch_optimizer(optimizer, bool(props["master_weights"]))

    _state.enabled = True
    _state.properties = props
    _state.scalers = [_LossScaler(props["loss_scale"], min_loss_scale, max_loss_scale)
                      for _ in range(num_losses)]
    return result()


def _unscale(optimizer, inv_scale: float) -> bool:
    """Unscales the gradients the optimizer will step on (the masters' under master weights);
    True when one holds an inf or NaN."""
    amp = getattr(optimizer, "_amp_opennpu", None)
    if amp is None:
        raise RuntimeError("amp.scale_loss: the optimizer was not passed to amp.initialize")
    with torch.no_grad():
        for model_p, master in amp.masters:
            if model_p.grad is None:
                master.grad = None
            elif master.grad is None or master.grad.shape != master.shape:
                master.grad = model_p.grad.detach().float()
            else:
                master.grad.copy_(model_p.grad)
        groups: dict[tuple, list] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError("amp.scale_loss: sparse gradients are not supported")
                    groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        found = {}
        for (device, _), grads in groups.items():
            if device not in found:
                found[device] = torch.zeros(1, dtype=torch.float32, device=device)
            inv = torch.full((1,), inv_scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found[device], inv)
        return any(bool(f.item()) for f in found.values())


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    """``with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()``.

    Yields ``loss.float() * loss_scale``; on exit the optimizers' gradients are unscaled (unless
    ``delay_unscale``, for gradient accumulation), the scale is updated, and on an inf/NaN with a
    dynamic scale the optimizers' next ``step()`` is skipped."""
    del model, delay_overflow_check
    if not _state.enabled:
        yield loss
        return
    if not 0 <= loss_id < len(_state.scalers):
        raise ValueError(f"amp.scale_loss: loss_id {loss_id} is out of range: amp.initialize "
                         f"was called with num_losses={len(_state.scalers)}")
    scaler = _state.scalers[loss_id]
    optimizer_list, _ = _as_list(optimizers)
    yield loss.float() * scaler.loss_scale
    if delay_unscale:
        return
    inv_scale = 1.0 / scaler.loss_scale
    overflow = False
    for optimizer in optimizer_list:
        overflow |= _unscale(optimizer, inv_scale)
    if scaler.update(overflow):
        for optimizer in optimizer_list:
            optimizer._amp_opennpu.skip_next_step = True


def state_dict(destination=None):
    """``{"loss_scaler0": {"loss_scale": ..., "unskipped": ...}, ...}``, as apex's."""
    out = OrderedDict() if destination is None else destination
    for i, scaler in enumerate(_state.scalers):
        out[f"loss_scaler{i}"] = {"loss_scale": scaler.loss_scale, "unskipped": scaler.unskipped}
    return out


def load_state_dict(state_dict):
    """Restores the loss scales saved by :func:`state_dict` (after ``amp.initialize``)."""
    if len(state_dict) != len(_state.scalers):
        raise ValueError(f"amp.load_state_dict: the state dict has {len(state_dict)} loss "
                         f"scaler(s), amp.initialize made {len(_state.scalers)} (num_losses)")
    for key, value in state_dict.items():
        if not key.startswith("loss_scaler") or not key[len("loss_scaler"):].isdigit():
            raise ValueError(f"amp.load_state_dict: unexpected key {key!r}")
        i = int(key[len("loss_scaler"):])
        if not 0 <= i < len(_state.scalers):
            raise ValueError(f"amp.load_state_dict: {key!r} is out of range for "
                             f"num_losses={len(_state.scalers)}")
        _state.scalers[i].loss_scale = float(value["loss_scale"])
        _state.scalers[i].unskipped = int(value["unskipped"])


def master_params(optimizer):
    """The parameters the optimizer steps on (the float32 masters under master weights)."""
    for group in optimizer.param_groups:
        yield from group["params"]
