"""torchair.llm_datadist: create_npu_tensors wraps device memory that LLM-DataDist (Ascend's
KV-cache transfer library) allocated; neither that library nor its device addresses exist here,
so it raises NotImplementedError naming itself."""

from __future__ import annotations

import torch


def create_npu_tensors(shape: list[int], dtype: torch.dtype, addresses: list[int]) -> list[torch.Tensor]:
    raise NotImplementedError("torchair.llm_datadist.create_npu_tensors: it wraps device memory "
                              "allocated by Ascend's LLM-DataDist, which opennpu does not have")
