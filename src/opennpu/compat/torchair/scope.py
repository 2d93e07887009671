"""torchair.scope (see opennpu.compile.torchair_api.scope)."""
from opennpu.compile.torchair_api.scope import (data_dump, limit_core_num, npu_stream_switch,
                                                npu_wait_tensor, op_never_timeout, super_kernel)

__all__ = ["data_dump", "limit_core_num", "npu_stream_switch", "npu_wait_tensor",
           "op_never_timeout", "super_kernel"]
