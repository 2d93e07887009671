"""Public wrappers, fake kernels and autograd of every torch.ops.npu op, one module per family."""

from . import norm
from .norm import *  # noqa: F401,F403

__all__ = list(norm.__all__)
