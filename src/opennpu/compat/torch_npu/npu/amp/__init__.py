"""`torch_npu.npu.amp`: GradScaler, mapped onto opennpu.optim.GradScaler.

`autocast` is not provided: torch_npu's is `torch.autocast("npu")` with Ascend's CUDA-like op
lists and float16 by default. opennpu has no `npu` device, and `torch.autocast("cpu")` casts a
different set of ops, so an alias would silently change a script's numerics; use
`torch.autocast("cpu", dtype=torch.bfloat16)` (or `"cuda"`) explicitly instead.
"""

from .grad_scaler import GradScaler

__all__ = ["GradScaler"]
