"""`torch_npu.utils`: the parts of it that scripts and checkpoints reach."""

from . import _module  # noqa: E402,F401  (torch_npu.utils._module._parallel_apply)
from .affinity import _reset_thread_affinity as reset_thread_affinity  # noqa: E402
from .affinity import _set_thread_affinity as set_thread_affinity  # noqa: E402
