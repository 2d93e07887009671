"""torchair.register_fx_node_ge_converter: an accepted no-op.

In TorchAir the decorated function converts an FX node into Ascend IR (GE) ops; GE's graph is
what runs. opennpu runs the FX graph itself (Inductor, or op by op), so a converter is never
called: the decorator checks its argument, keeps the converter in `ge_converters` (for
inspection) and returns the function unchanged. A custom op needs a CPU/npu kernel and a fake
(meta) implementation to be compiled here, which torch.library provides.
"""

from __future__ import annotations

from typing import Callable

import torch

ge_converters: dict[object, Callable] = {}


def register_fx_node_ge_converter(aten_op) -> Callable[[Callable], Callable]:
    """Decorator for a GE converter of `aten_op` (an OpOverload or OpOverloadPacket): no-op."""
    if not isinstance(aten_op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(f"register_fx_node_ge_converter: aten_op must be an operator such as "
                        f"torch.ops.aten.sin.default, got {type(aten_op).__name__} ({aten_op!r})")

    def register(converter: Callable) -> Callable:
        if not callable(converter):
            raise TypeError(f"register_fx_node_ge_converter({aten_op}): the decorated converter "
                            f"must be callable, got {type(converter).__name__}")
        ge_converters[aten_op] = converter
        return converter

    return register
