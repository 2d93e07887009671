"""`torch_npu.optim`: the fused optimizers of opennpu.optim under their torch_npu names."""

from opennpu.optim import (NpuFusedAdadelta, NpuFusedAdam, NpuFusedAdamP, NpuFusedAdamW,
                           NpuFusedBertAdam, NpuFusedLamb, NpuFusedOptimizerBase,
                           NpuFusedRMSprop, NpuFusedRMSpropTF, NpuFusedSGD)

__all__ = [
    "NpuFusedOptimizerBase", "NpuFusedSGD", "NpuFusedAdadelta", "NpuFusedLamb", "NpuFusedAdam",
    "NpuFusedAdamW", "NpuFusedAdamP", "NpuFusedBertAdam", "NpuFusedRMSprop", "NpuFusedRMSpropTF",
]
