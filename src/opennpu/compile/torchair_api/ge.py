"""torchair.ge: the Ascend IR (GE) graph-building API, for writing converters and custom ops.

Its functions build GE graph nodes inside a converter; without GE there is no graph to build,
so Const, Cast, Clone and custom_op raise NotImplementedError naming themselves. The types stay
importable, since converter signatures annotate with them (`self: Tensor`,
`meta_outputs: TensorSpec`): Tensor and TensorSpec are classes that cannot be instantiated here,
and DataType and Format carry GE's numeric codes.
"""

from __future__ import annotations

import enum


class DataType(enum.IntEnum):
    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_COMPLEX64 = 16
    DT_COMPLEX128 = 17
    DT_BF16 = 27


class Format(enum.IntEnum):
    FORMAT_NCHW = 0
    FORMAT_NHWC = 1
    FORMAT_ND = 2
    FORMAT_NC1HWC0 = 3
    FORMAT_FRACTAL_Z = 4
    FORMAT_FRACTAL_NZ = 29


class _GeOnly:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"torchair.ge.{type(self).__name__}: GE graph tensors exist "
                                  f"only inside Ascend's graph engine, which opennpu does not have")


class Tensor(_GeOnly):
    """A GE graph tensor (annotation only here)."""


class TensorSpec(_GeOnly):
    """The meta of a converter's outputs (annotation only here)."""


def _ge_only(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"torchair.ge.{name}: it builds Ascend IR (GE) graph nodes, "
                                  f"and opennpu has no graph engine; write the op as a torch "
                                  f"custom op (torch.library) with a CPU kernel and a fake "
                                  f"implementation instead")

    fn.__name__ = name
    return fn


Const = _ge_only("Const")
Cast = _ge_only("Cast")
Clone = _ge_only("Clone")
custom_op = _ge_only("custom_op")
