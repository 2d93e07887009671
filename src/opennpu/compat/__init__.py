"""Compatibility layers: the torch_npu (and later torchair) names mapped onto opennpu.

`import torch_npu` reaches `opennpu.compat.torch_npu` through the import hook in
`_opennpu_compat` (installed with opennpu) whenever the real torch_npu is not installed.
"""

from __future__ import annotations

import torch

from opennpu.ops._registry import accepts_input_keyword


def op_alias(name: str):
    """`torch.ops.npu.<name>`, callable as torch_npu calls it.

    torch_npu binds `self` arguments to Python's `input=` keyword too (its tests call
    `torch_npu.fast_gelu(input=x)`); the dispatcher only knows `self`, so `input` is renamed.
    """
    packet = getattr(torch.ops.npu, name)
    schema = getattr(packet, packet.overloads()[0])._schema  # e.g. _npu_dropout_gen_mask.Tensor
    if "self" not in (arg.name for arg in schema.arguments):
        return packet
    call = accepts_input_keyword(packet)
    call.__name__ = call.__qualname__ = name
    return call


def npu_op_names() -> list[str]:
    """Names of every op registered in torch.ops.npu."""
    return sorted(n for n in dir(torch.ops.npu) if isinstance(getattr(torch.ops.npu, n, None),
                                                              torch._ops.OpOverloadPacket))
