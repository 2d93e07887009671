"""`torch_npu.utils._module`: torch_npu's parallel_apply under its name (torch's, which runs each
replica in a thread on its npu device, its current stream and npu autocast)."""

from torch.nn.parallel.parallel_apply import parallel_apply as _parallel_apply

__all__: list[str] = []
