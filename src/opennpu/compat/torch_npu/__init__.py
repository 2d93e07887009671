"""`torch_npu`, provided by opennpu on machines without Ascend's torch_npu.

Every operator of `torch.ops.npu` is exposed under its torch_npu name (`torch_npu.npu_rms_norm`,
`torch_npu.fast_gelu`, ...) with torch_npu's keywords, so Ascend scripts run unchanged on CPU.
"""

from __future__ import annotations

import torch

import opennpu
from opennpu import _device, distributed as _distributed
from opennpu.compat import npu_op_names, op_alias

# `import torch_npu` asks for Ascend's device: npu is registered even beside a visible CUDA GPU
# (which then loses autograd in this process; _device.py says why).
if _device.register(explicit=True):
    _distributed.register()

__version__ = f"{opennpu.__version__}+opennpu"
IS_OPENNPU = True

# torch_npu's codes (c10_npu::DType) of the types that op arguments such as npu_quant_matmul's
# x1_dtype / scale_dtype name; ops read them as they read torch's dtype codes.
hifloat8 = 290
float8_e8m0fnu = 293
float4_e2m1fn_x2 = 296
float4_e1m2fn_x2 = 297

for _name in npu_op_names():
    globals()[_name] = op_alias(_name)

__all__ = npu_op_names()
del _name

# The ATB ops op-plugin puts on torch_npu itself (its _atb_ops.API_LIST): the torch.ops.atb
# packets, as torch_npu sets them; npu_paged_cache_load lives in torch_npu.atb.
for _name in ("_npu_reshape_and_cache", "_npu_reshape_and_cache_siso", "_npu_paged_attention",
              "_npu_paged_attention_get_workspace", "_npu_flash_attention",
              "_npu_rotary_embedding"):
    globals()[_name] = getattr(torch.ops.atb, _name)
del _name

from opennpu import npu  # noqa: E402  (torch_npu.npu is torch.npu; the import hook maps its submodules)

from . import optim  # noqa: E402  (torch_npu.optim.*)
from . import atb  # noqa: E402  (torch_npu.atb.*: ATB ops outside torch_npu's top level)
from . import utils  # noqa: E402  (torch_npu.utils)
from . import _C  # noqa: E402  (torch_npu._C: the runtime bindings with a meaning off Ascend)
from . import distributed  # noqa: E402  (torch_npu.distributed: the hccl additions)
from .utils import storage as _storage  # noqa: E402,F401  (loads pre-2.1 torch_npu checkpoints)
from opennpu.npu.streams import _erase_stream as erase_stream  # noqa: E402
from ._format import empty_with_format, get_npu_format, get_storage_size  # noqa: E402
from ._format import npu_format_cast, npu_format_cast_  # noqa: E402
from ._format import install_serialization as _install_serialization  # noqa: E402
from ._format import install_tensor_methods as _install_tensor_methods  # noqa: E402

_install_tensor_methods()
_install_serialization()
__all__ += ["empty_with_format", "erase_stream", "get_npu_format", "get_storage_size",
            "npu_format_cast", "npu_format_cast_"]
