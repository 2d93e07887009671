"""`torch.npu.amp` (= `torch_npu.npu.amp`): autocast, GradScaler, custom_fwd / custom_bwd.

``torch.npu.amp.autocast`` and ``torch.autocast("npu")`` apply CUDA's autocast op lists (as
torch_npu does), for float16 (the default) and bfloat16; the GradScaler unscales opennpu's fused
optimizers in one pass and has torch_npu's static loss scale (``dynamic=False``).
"""

from . import autocast_mode, common, grad_scaler  # noqa: F401
from .autocast_mode import autocast, custom_bwd, custom_fwd
from .grad_scaler import GradScaler

__all__ = ["GradScaler", "autocast", "custom_bwd", "custom_fwd"]
