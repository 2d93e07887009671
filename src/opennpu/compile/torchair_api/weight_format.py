"""torchair.use_internal_format_weight and torchair.npu_format_cast_via_cpu.

On Ascend both put weights into the private storage formats of the Cube unit (FRACTAL_NZ and
the like). opennpu's tensors always have the logical (ND) layout, as torch_npu.npu_format_cast
documents (opennpu.compat.torch_npu._format): use_internal_format_weight is an accepted no-op
that checks its argument, and npu_format_cast_via_cpu returns the tensor itself after checking
that the format is an ACL format.
"""

from __future__ import annotations

import torch


def use_internal_format_weight(model: torch.nn.Module) -> None:
    """No-op here (weights keep the ND layout, the only one opennpu has); checks `model`."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"use_internal_format_weight: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")


def npu_format_cast_via_cpu(self: torch.Tensor, acl_format: int,
                            customize_dtype: int | None = None,
                            input_dtype: int | None = None) -> torch.Tensor:
    """`self` unchanged (ND is the only layout here) once `acl_format` is checked to be an ACL
    format number; `customize_dtype` / `input_dtype` (GE dtype codes) are accepted."""
    from opennpu.compat.torch_npu._format import _check

    _check("npu_format_cast_via_cpu", self, acl_format, on_npu=False)
    for name, value in (("customize_dtype", customize_dtype), ("input_dtype", input_dtype)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"npu_format_cast_via_cpu: {name} must be None or an int, got "
                            f"{type(value).__name__}")
    return self
