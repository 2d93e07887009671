"""opennpu.optim.GradScaler: the npu device's GradScaler (torch.npu.amp.GradScaler), which
unscales a fused optimizer's gradients in one C++ pass and supports torch_npu's static loss scale.
It accepts torch.amp.GradScaler's order, ``GradScaler("cpu", init_scale=...)``, as well as
torch_npu's; see opennpu/npu/amp/grad_scaler.py."""

from __future__ import annotations

from opennpu.npu.amp.grad_scaler import GradScaler

__all__ = ["GradScaler"]
