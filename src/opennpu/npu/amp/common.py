"""`torch.npu.amp.common` (= `torch_npu.npu.amp.common`)."""

from __future__ import annotations

__all__ = ["amp_definitely_not_available"]


def amp_definitely_not_available() -> bool:
    """False: autocast works on every npu device (it runs on the host)."""
    return False
