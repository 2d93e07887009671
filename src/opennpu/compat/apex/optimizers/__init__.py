"""`apex.optimizers`: the NpuFused* optimizers of Ascend's apex fork, which are opennpu's
(``opennpu.optim``, also ``torch_npu.optim``): one multi-tensor C++ step per parameter group."""

from opennpu.optim import (NpuFusedAdadelta, NpuFusedAdam, NpuFusedAdamP, NpuFusedAdamW,
                           NpuFusedBertAdam, NpuFusedLamb, NpuFusedRMSprop, NpuFusedRMSpropTF,
                           NpuFusedSGD)

__all__ = [
    "NpuFusedSGD", "NpuFusedAdadelta", "NpuFusedLamb", "NpuFusedAdam", "NpuFusedAdamW",
    "NpuFusedAdamP", "NpuFusedBertAdam", "NpuFusedRMSprop", "NpuFusedRMSpropTF",
]
