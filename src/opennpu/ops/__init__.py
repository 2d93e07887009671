"""Public wrappers, fake kernels and autograd of every torch.ops.npu op, one module per family."""

from . import activation, norm, rotary, softmax
from .activation import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .rotary import *  # noqa: F401,F403
from .softmax import *  # noqa: F401,F403

__all__ = [*norm.__all__, *activation.__all__, *rotary.__all__, *softmax.__all__]
