"""`torch_npu.atb`: the ATB ops that op-plugin puts in this module rather than on torch_npu itself
(its _atb_ops.ATB_API_LIST), as the torch.ops.atb packets. opennpu implements
npu_paged_cache_load of them; the others (MLA, ring MLA, ...) are not implemented."""

from __future__ import annotations

import torch

import opennpu  # noqa: F401  (registers torch.ops.atb)

npu_paged_cache_load = torch.ops.atb.npu_paged_cache_load

__all__ = ["npu_paged_cache_load"]
