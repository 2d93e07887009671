"""`torch_npu.npu`: of Ascend's device module, only `amp` (the GradScaler) so far.

opennpu runs on CPU (and CUDA) and registers no `npu` device yet, so the device functions
(`is_available`, `set_device`, streams, memory statistics, ...) are not provided.
"""

from . import amp  # noqa: F401  (torch_npu.npu.amp.GradScaler)

__all__ = ["amp"]
