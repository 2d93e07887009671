"""`torch_npu.utils`: the parts of it that scripts and checkpoints reach."""

from . import _module  # noqa: E402,F401  (torch_npu.utils._module._parallel_apply)
