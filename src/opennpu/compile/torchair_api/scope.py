"""torchair.scope: scopes that annotate the ops inside them for Ascend's graph engine.

npu_stream_switch (run on a tagged stream), super_kernel (fuse into one kernel launch),
limit_core_num (AI/vector core budget), op_never_timeout and data_dump mark ops with GE
attributes; opennpu executes one stream of host work and has none of these resources, so each is
an accepted no-op context manager: it checks its arguments and runs its body unchanged, in eager
mode and inside torch.compile alike. npu_wait_tensor (make `self` wait for `dependency`'s stream)
returns `self`, as the one-stream order already holds.
"""

from __future__ import annotations

import torch


class NpuScope:
    """A no-op context manager that remembers the GE attributes TorchAir would set."""

    def __init__(self, attrs: dict[str, str]):
        self.attrs = attrs

    def __enter__(self):
        return None

    def __exit__(self, *exc_info):
        return False


def _check(fn: str, name: str, value, kinds) -> None:
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise TypeError(f"{fn}: {name} must be {kinds}, got bool")
    if not isinstance(value, kinds):
        raise TypeError(f"{fn}: {name} must be "
                        f"{getattr(kinds, '__name__', None) or ' or '.join(k.__name__ for k in kinds)}"
                        f", got {type(value).__name__}")


def npu_stream_switch(stream_tag: str, stream_priority: int = 0,
                      enable_inner_parallel: bool = True) -> NpuScope:
    _check("npu_stream_switch", "stream_tag", stream_tag, str)
    _check("npu_stream_switch", "stream_priority", stream_priority, int)
    _check("npu_stream_switch", "enable_inner_parallel", enable_inner_parallel, bool)
    return NpuScope({"_user_stream_label": stream_tag,
                     "_user_stream_priority": str(stream_priority),
                     "_enable_inner_parallel": str(enable_inner_parallel)})


def npu_wait_tensor(self: torch.Tensor, dependency: torch.Tensor) -> torch.Tensor:
    if not isinstance(self, torch.Tensor) or not isinstance(dependency, torch.Tensor):
        raise TypeError(f"npu_wait_tensor: self and dependency must be Tensors, got "
                        f"{type(self).__name__} and {type(dependency).__name__}")
    return self


def super_kernel(scope: str | None, options: str = "") -> NpuScope:
    scope = "" if scope is None else scope
    _check("super_kernel", "scope", scope, str)
    _check("super_kernel", "options", options, str)
    return NpuScope({"_super_kernel_scope": scope, "_super_kernel_options": options})


def limit_core_num(op_aicore_num: int, op_vectorcore_num: int) -> NpuScope:
    _check("limit_core_num", "op_aicore_num", op_aicore_num, int)
    _check("limit_core_num", "op_vectorcore_num", op_vectorcore_num, int)
    return NpuScope({"_op_aicore_num": str(op_aicore_num),
                     "_op_vectorcore_num": str(op_vectorcore_num)})


def op_never_timeout(enable: bool = True) -> NpuScope:
    _check("op_never_timeout", "enable", enable, bool)
    return NpuScope({"_op_exec_never_timeout": str(enable)})


def data_dump() -> NpuScope:
    return NpuScope({"torchair_enable_data_dump": "True"})
