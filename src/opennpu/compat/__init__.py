"""Compatibility layers: the torch_npu (and later torchair) names mapped onto opennpu.

`import torch_npu` reaches `opennpu.compat.torch_npu` through the import hook in
`_opennpu_compat` (installed with opennpu) whenever the real torch_npu is not installed.
"""

from __future__ import annotations

import torch


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _unrepresentable_int(schema, args, kwargs):
    """(argument, value) of the first int or int[] argument outside int64, or None."""
    bound = list(zip((a.name for a in schema.arguments), args)) + list(kwargs.items())
    for arg, value in bound:
        values = value if isinstance(value, (list, tuple)) else (value,)
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool) and not _INT64_MIN <= v <= _INT64_MAX:
                return arg, value
    return None


def _alias(name: str, op, schema):
    """A callable over `op` (an OpOverloadPacket or OpOverload) with torch_npu's conventions.

    torch_npu binds `self` arguments to Python's `input=` keyword too (its tests call
    `torch_npu.fast_gelu(input=x)`); the dispatcher only knows `self`, so `input` is renamed.
    An out overload also takes torch_npu's `out=` (one tensor, or a list in the order of the
    schema's out arguments: `.out(..., out=[attention_out, softmax_lse])`). An integer that int64
    cannot hold fails in PyTorch's argument parser with a message that names neither the op nor
    the argument; the alias names both.
    """
    names = [arg.name for arg in schema.arguments]
    renames_input = "self" in names
    outs = [arg.name for arg in schema.arguments if arg.is_out] if "out" not in names else []

    def call(*args, **kwargs):
        if renames_input and "input" in kwargs:
            kwargs["self"] = kwargs.pop("input")
        if outs and "out" in kwargs:
            out = kwargs.pop("out")
            out = [out] if isinstance(out, torch.Tensor) else list(out)
            if len(out) != len(outs):
                raise TypeError(f"{name}: out= must hold {len(outs)} tensor(s) "
                                f"({', '.join(outs)}), but got {len(out)}")
            kwargs.update(zip(outs, out))
        if torch.compiler.is_compiling():  # traced: the graph holds the op, not this wrapper
            return op(*args, **kwargs)
        try:
            return op(*args, **kwargs)
        except (RuntimeError, TypeError, OverflowError) as error:
            bad = _unrepresentable_int(schema, args, kwargs)
            if bad is None:
                raise
            raise RuntimeError(f"{name}: argument '{bad[0]}' must hold integers in int64 "
                               f"[-2**63, 2**63 - 1], but got {bad[1]}") from error

    call.__name__ = call.__qualname__ = name
    call.__doc__ = op.__doc__
    return call


def op_alias(name: str):
    """`torch.ops.npu.<name>`, callable as torch_npu calls it (see `_alias`), with each ATen
    overload as an attribute, as torch_npu exposes them: `torch_npu.<name>.default`,
    `torch_npu.npu_fused_infer_attention_score.out(..., out=[attention_out, softmax_lse])`."""
    packet = getattr(torch.ops.npu, name)
    overloads = packet.overloads()
    call = _alias(name, packet, getattr(packet, overloads[0])._schema)  # e.g. _npu_dropout_gen_mask.Tensor
    for overload in overloads:
        op = getattr(packet, overload)
        setattr(call, overload, _alias(f"{name}.{overload}", op, op._schema))
    return call


def npu_op_names() -> list[str]:
    """Names of every op registered in torch.ops.npu."""
    return sorted(n for n in dir(torch.ops.npu) if isinstance(getattr(torch.ops.npu, n, None),
                                                              torch._ops.OpOverloadPacket))
