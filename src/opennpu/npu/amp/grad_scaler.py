"""`torch.npu.amp.GradScaler` (= `torch_npu.npu.amp.GradScaler` = `opennpu.optim.GradScaler`).

A ``torch.amp.GradScaler`` for the npu device with torch_npu's two additions:

* a fused optimizer (``optimizer.is_fused_optimizer``, opennpu's NpuFused* family) has all its
  gradients unscaled and checked for inf/NaN in one multi-tensor C++ pass over every group and
  dtype; other optimizers take torch.amp.GradScaler's usual path
  (``torch._amp_foreach_non_finite_check_and_unscale_``, which runs on npu tensors through the
  device's CPU kernels);
* ``dynamic=False`` is torch_npu's static loss scale: gradients are still divided by the scale, but
  never checked for inf/NaN, no step is skipped and ``update()`` leaves the scale as it is.

And torch_npu's two departures from torch.amp.GradScaler's semantics:

* an overflow is per iteration, not per optimizer: once any optimizer's gradients held an inf or
  NaN since the last ``update()``, every optimizer unscaled after it also skips its step;
* ``step()`` leaves every optimizer's gradients unscaled in place, fused ones included (torch.amp
  lets an optimizer with ``_step_supports_amp_scaling`` fold the scale into its step and keep
  scaled gradients, which then differ when gradients accumulate across steps).

The scale lives on the device of the first loss it scales (as in torch.amp.GradScaler), so the same
scaler serves a model on npu and one on CPU.
"""

from __future__ import annotations

import inspect

import torch
from torch.amp.grad_scaler import OptState

__all__ = ["GradScaler"]


def _torch_npu_order(init_scale: float = 2.0**16, growth_factor: float = 2.0,
                     backoff_factor: float = 0.5, growth_interval: int = 2000,
                     dynamic: bool = True, enabled: bool = True, *, device: str = "npu"):
    """torch_npu's positional order."""


def _torch_amp_order(device: str = "npu", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                     backoff_factor: float = 0.5, growth_interval: int = 2000,
                     enabled: bool = True, *, dynamic: bool = True):
    """torch.amp.GradScaler's positional order (a device string first)."""


_NPU_SIGNATURE = inspect.signature(_torch_npu_order)
_AMP_SIGNATURE = inspect.signature(_torch_amp_order)


class GradScaler(torch.amp.GradScaler):
    """``GradScaler(init_scale=2.**16, growth_factor=2.0, backoff_factor=0.5,
    growth_interval=2000, dynamic=True, enabled=True, *, device="npu")``, torch_npu's order; a
    device string as the first argument selects torch.amp.GradScaler's order instead,
    ``GradScaler(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled, *,
    dynamic=True)``, as opennpu.optim.GradScaler has always been called.

    As in torch_npu, an enabled scaler raises ValueError for ``growth_factor <= 1`` or
    ``backoff_factor >= 1``.
    """

    def __init__(self, *args, **kwargs) -> None:
        amp_order = bool(args) and isinstance(args[0], (str, torch.device))
        signature = _AMP_SIGNATURE if amp_order else _NPU_SIGNATURE
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"GradScaler{signature}: {e}") from None
        bound.apply_defaults()
        a = bound.arguments
        device = a["device"]
        device = device.type if isinstance(device, torch.device) else str(device)
        if a["enabled"]:  # torch_npu raises ValueError where torch.amp.GradScaler asserts
            if a["growth_factor"] <= 1.0:
                raise ValueError(f"The growth factor must be > 1.0, but got {a['growth_factor']}.")
            if a["backoff_factor"] >= 1.0:
                raise ValueError(
                    f"The backoff factor must be < 1.0, but got {a['backoff_factor']}.")
        super().__init__(device, init_scale=a["init_scale"], growth_factor=a["growth_factor"],
                         backoff_factor=a["backoff_factor"], growth_interval=a["growth_interval"],
                         enabled=a["enabled"])
        self._dynamic = bool(a["dynamic"])
        # Whether an inf/NaN was found in any optimizer's gradients since the last update().
        self._has_overflow = False

    def is_dynamic(self) -> bool:
        """False for a static loss scale (``dynamic=False``)."""
        return self._dynamic

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        fused = getattr(optimizer, "is_fused_optimizer", False)
        if self._dynamic:
            if fused:
                # found_inf and inv_scale are on the scale's device, which must be the parameters'.
                optimizer._unscale_grads_(inv_scale, found_inf)
                per_device = {found_inf.device: found_inf}
            else:
                per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            if not self._has_overflow:
                self._has_overflow = any(bool(t.item()) for t in per_device.values())
            if self._has_overflow:  # an earlier optimizer's overflow skips this one's step too
                for t in per_device.values():
                    t.fill_(1.0)
            return per_device
        else:  # static scale: divide, never check, so found_inf stays 0 and no step is skipped
            with torch.no_grad():
                if fused:
                    optimizer._scale_grads_(float(inv_scale))
                else:
                    for group in optimizer.param_groups:
                        for p in group["params"]:
                            if p.grad is None:
                                continue
                            if not allow_fp16 and p.grad.dtype == torch.float16:
                                raise ValueError("Attempting to unscale FP16 gradients.")
                            g = p.grad._values() if p.grad.is_sparse else p.grad
                            g.mul_(inv_scale.to(g.device))
        return {found_inf.device: found_inf}

    def step(self, optimizer, *args, **kwargs):
        if (self._enabled and getattr(optimizer, "_step_supports_amp_scaling", False)
                and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY):
            # Unscale in place first: torch.amp.GradScaler.step then hands the optimizer no scale
            # to fold in, and the gradients read as torch_npu leaves them (module docstring).
            self.unscale_(optimizer)
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None) -> None:
        if self._enabled and not self._dynamic and new_scale is None:
            scale, _ = self._check_scale_growth_tracker("update")
            new_scale = float(scale)  # a static scale stays as it is
        super().update(new_scale)
        self._has_overflow = False

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self._enabled:
            state["dynamic"] = self._dynamic
        return state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        # torch.amp.GradScaler's state dicts have no "dynamic": they keep this scaler's setting.
        self._dynamic = bool(state_dict.get("dynamic", self._dynamic))
