"""torchair.ops (see opennpu.compile.torchair_api.ops)."""
from opennpu.compile.torchair_api.ops import (npu_create_tagged_event,
                                              npu_fused_infer_attention_score,
                                              npu_fused_infer_attention_score_v2, npu_print,
                                              npu_record_tagged_stream, npu_tagged_event_record,
                                              npu_tagged_event_wait, record, wait)

__all__ = ["npu_create_tagged_event", "npu_fused_infer_attention_score",
           "npu_fused_infer_attention_score_v2", "npu_print", "npu_record_tagged_stream",
           "npu_tagged_event_record", "npu_tagged_event_wait", "record", "wait"]
