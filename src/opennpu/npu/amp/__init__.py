"""`torch.npu.amp` (= `torch_npu.npu.amp`): GradScaler, mapped onto opennpu.optim.GradScaler.

`autocast` is not provided yet: torch_npu's is `torch.autocast("npu")` with Ascend's CUDA-like op
lists and float16 by default, and the npu device has no autocast op lists registered so far;
`torch.autocast("cpu")` casts a different set of ops, so an alias would silently change a script's
numerics.
"""

from .grad_scaler import GradScaler

__all__ = ["GradScaler"]
