"""GradScaler with torch_npu's fused-optimizer path.

torch_npu's GradScaler unscales a fused optimizer's combined gradient buffers in one call per
dtype (it checks ``optimizer.is_fused_optimizer``). This one does the same for opennpu's fused
optimizers in a single C++ pass over every gradient of every group and dtype (unscale and inf
check together); other optimizers take torch.amp.GradScaler's usual path.

``dynamic=False`` is torch_npu's static loss scale: gradients are still divided by the scale, but
never checked for inf/NaN, no step is skipped and ``update()`` leaves the scale as it is.
"""

from __future__ import annotations

import torch


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (default device ``"cpu"``) whose ``unscale_`` handles a fused
    optimizer in one multi-tensor C++ call; ``dynamic=False`` keeps the scale fixed."""

    def __init__(self, device: str = "cpu", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *,
                 dynamic: bool = True) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self._dynamic = bool(dynamic)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        fused = getattr(optimizer, "is_fused_optimizer", False)
        if self._dynamic:
            if not fused:
                return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            optimizer._unscale_grads_(inv_scale, found_inf)
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

    def update(self, new_scale=None) -> None:
        if self._enabled and not self._dynamic and new_scale is None:
            scale, _ = self._check_scale_growth_tracker("update")
            new_scale = scale.clone()  # a static scale stays as it is
        super().update(new_scale)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self._enabled:
            state["dynamic"] = self._dynamic
        return state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        # torch.amp.GradScaler's state dicts have no "dynamic": they keep this scaler's setting.
        self._dynamic = bool(state_dict.get("dynamic", self._dynamic))
