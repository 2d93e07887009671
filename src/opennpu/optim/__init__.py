"""Fused optimizers: the torch_npu.optim family on multi-tensor C++ steps.

Each class is a ``torch.optim.Optimizer``; a step is one C++ call per param group that updates
every parameter (fp32, fp16 and bf16 together) in one multi-threaded pass over memory. Also
``optimizer.clip_grad_norm_fused_(max_norm, norm_type)`` and a GradScaler that unscales a fused
optimizer's gradients in one pass. Exposed as ``torch_npu.optim`` by the compatibility import.
"""

from ._base import NpuFusedOptimizerBase
from .amp import GradScaler
from .optimizers import (NpuFusedAdadelta, NpuFusedAdam, NpuFusedAdamP, NpuFusedAdamW,
                         NpuFusedBertAdam, NpuFusedLamb, NpuFusedRMSprop, NpuFusedRMSpropTF,
                         NpuFusedSGD)

__all__ = [
    "NpuFusedOptimizerBase", "NpuFusedSGD", "NpuFusedAdadelta", "NpuFusedLamb", "NpuFusedAdam",
    "NpuFusedAdamW", "NpuFusedAdamP", "NpuFusedBertAdam", "NpuFusedRMSprop", "NpuFusedRMSpropTF",
    "GradScaler",
]
