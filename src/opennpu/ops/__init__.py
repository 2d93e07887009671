"""Public wrappers, fake kernels and autograd of every torch.ops.npu op, one module per family
(and of torch_npu's ATB ops, torch.ops.atb, in `atb`: their names stay in that module)."""

from . import (activation, atb, attention, ffn, infer_attention, kvcache, linear, moe, norm, quant,
               rotary, sampling, softmax, transpose)
from .activation import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .ffn import *  # noqa: F401,F403
from .infer_attention import *  # noqa: F401,F403
from .kvcache import *  # noqa: F401,F403
from .moe import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .quant import *  # noqa: F401,F403
from .rotary import *  # noqa: F401,F403
from .sampling import *  # noqa: F401,F403
from .softmax import *  # noqa: F401,F403
from .transpose import *  # noqa: F401,F403

# After the families: the portable path (CUDA / XPU / MPS kernels and Inductor decompositions).
from . import portable  # noqa: E402,F401

__all__ = [*norm.__all__, *activation.__all__, *rotary.__all__, *softmax.__all__,
           *attention.__all__, *infer_attention.__all__, *transpose.__all__, *ffn.__all__,
           *moe.__all__, *quant.__all__, *kvcache.__all__, *sampling.__all__]
