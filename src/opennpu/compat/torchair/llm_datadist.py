"""torchair.llm_datadist (see opennpu.compile.torchair_api.llm_datadist)."""
from opennpu.compile.torchair_api.llm_datadist import create_npu_tensors

__all__ = ["create_npu_tensors"]
