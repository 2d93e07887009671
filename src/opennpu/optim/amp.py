"""GradScaler with torch_npu's fused-optimizer path.

torch_npu's GradScaler unscales a fused optimizer's combined gradient buffers in one call per
dtype (it checks ``optimizer.is_fused_optimizer``). This one does the same for opennpu's fused
optimizers in a single C++ pass over every gradient of every group and dtype (unscale and inf
check together); other optimizers take torch.amp.GradScaler's usual path.
"""

from __future__ import annotations

import torch


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` (default device ``"cpu"``) whose ``unscale_`` handles a fused
    optimizer in one multi-tensor C++ call."""

    def __init__(self, device: str = "cpu", init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        if not getattr(optimizer, "is_fused_optimizer", False):
            return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        optimizer._unscale_grads_(inv_scale, found_inf)
        return {found_inf.device: found_inf}
