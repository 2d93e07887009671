"""torchair.ge (see opennpu.compile.torchair_api.ge)."""
from opennpu.compile.torchair_api.ge import (Cast, Clone, Const, DataType, Format, Tensor,
                                             TensorSpec, custom_op)

__all__ = ["custom_op", "Const", "Cast", "DataType", "Format", "Tensor", "TensorSpec", "Clone"]
