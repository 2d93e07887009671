"""`torch_npu.npu.amp.grad_scaler.GradScaler`: opennpu.optim.GradScaler with torch_npu's
constructor, `GradScaler(init_scale, growth_factor, backoff_factor, growth_interval, dynamic,
enabled)` (no device argument: the scale lives on the CPU, where opennpu's optimizers run)."""

from __future__ import annotations

from opennpu.optim import GradScaler as _GradScaler


class GradScaler(_GradScaler):
    """torch_npu's GradScaler: a fused optimizer's gradients are unscaled and checked for
    inf/NaN in one C++ pass; ``dynamic=False`` uses a static loss scale (gradients are divided by
    it, never checked, and the scale never changes)."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 dynamic: bool = True, enabled: bool = True) -> None:
        if enabled:  # torch_npu raises ValueError where torch.amp.GradScaler asserts
            if growth_factor <= 1.0:
                raise ValueError(f"The growth factor must be > 1.0, but got {growth_factor}.")
            if backoff_factor >= 1.0:
                raise ValueError(f"The backoff factor must be < 1.0, but got {backoff_factor}.")
        super().__init__("cpu", init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled, dynamic=dynamic)
