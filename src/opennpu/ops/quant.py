"""Quantisation family: npu_dynamic_quant and npu_add_rms_norm_dynamic_quant.

Numerics: inputs (float16, bfloat16, float32; float64 is rounded to float32 first) are computed
in float32. ``scale = rowmax(|v|) / DTYPE_MAX`` with ``v = x * smooth`` (or ``x``), DTYPE_MAX 127
for int8 and 7 for int4; a zero scale (an all-zero row) is replaced by 1. Codes are
``clamp(round(v / scale), -128, 127)`` (int4: ``[-8, 7]``), where ``round`` rounds half to even,
as ``torch.round`` in torch_npu's goldens (2.5 -> 2, 3.5 -> 4, -0.5 -> 0), and ``v / scale`` is a
true float32 division. int4 codes are packed eight per int32, code k in bits ``[4k, 4k+4)``
(lowest bits first, i.e. the low nibble of each little-endian byte first).

Neither op has a gradient in torch_npu, nor here: a backward through their outputs raises.
"""

from __future__ import annotations

import torch

from ._registry import mark_not_differentiable, register_fake

_ops = torch.ops.npu

# The `int?` codes torch.ops gives torch.quint4x2 and torch.int4 (int8 is 1).
_INT4_CODES = {16, 40}


def _is_int4(dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return dtype in (torch.quint4x2, torch.int4)
    return dtype in _INT4_CODES


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None,
                      quant_mode: str = "pertoken", dst_type_max: float | None = None):
    """Symmetric dynamic quantisation. Returns ``(y, scale)``.

    ``scale = rowmax(|input * smooth_scales|) / DTYPE_MAX`` per row (``quant_mode="pertoken"``,
    scale shape ``input.shape[:-1]``) or over the whole tensor (``"pertensor"``, shape ``[1]``);
    ``y = round_half_even(input * smooth_scales / scale)`` clamped to the code range.
    ``dst_type`` None / ``torch.int8`` gives int8 ``y`` of input's shape; ``torch.quint4x2`` (or
    ``torch.int4``) gives int32 with the last dim / 8, eight int4 codes per word, lowest bits
    first (the last dim must divide by 8). ``smooth_scales``: ``[H]``, or ``[G, H]`` with
    ``group_index`` (int32 ``[G]``, non-decreasing cumulative row ends, the last = number of rows;
    rows ``[group_index[g-1], group_index[g])`` use ``smooth_scales[g]``, MoE style).
    ``dst_type_max`` (default 0: 127 / 7) replaces DTYPE_MAX when non-zero. An all-zero row gets
    scale 1. Not differentiable.
    """
    # Float defaults stay out of the call (None = the schema's default): under torch.compile a
    # keyword-only float default is traced as a symbolic input and restarts the analysis.
    extra = {} if dst_type_max is None else {"dst_type_max": dst_type_max}
    return _ops.npu_dynamic_quant(input, smooth_scales=smooth_scales, group_index=group_index,
                                  dst_type=dst_type, quant_mode=quant_mode, **extra)


def npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None,
                                   beta=None, epsilon: float | None = None, output_mask=None,
                                   y_dtype=None):
    """Residual add, RMSNorm and up to two dynamic quantisations in one pass over each row.

    ``x = x1 + x2`` (float32; returned rounded to x1's dtype as ``x_out``),
    ``y = x / sqrt(mean(x^2) + epsilon) * gamma (+ beta)``; branch k quantises
    ``y * smooth_scale_k`` (or ``y``) as npu_dynamic_quant does (int8, or packed int4 with
    ``y_dtype=torch.quint4x2``). Returns ``(y1, y2, x_out, scale1, scale2)``; scales are float32
    of shape ``x1.shape[:-1]``. ``output_mask=[b1, b2]`` picks the branches (not both False; a
    given smooth scale needs its branch on); without it branch 1 always runs and branch 2 only
    when both smooth scales are given. A disabled branch returns 0-dim tensors (one zero each).
    gamma, beta and the smooth scales are 1-D of x1's last dim. ``epsilon`` defaults to 1e-6.
    Not differentiable.
    """
    extra = {} if epsilon is None else {"epsilon": epsilon}  # see npu_dynamic_quant
    return _ops.npu_add_rms_norm_dynamic_quant(
        x1, x2, gamma, smooth_scale1=smooth_scale1, smooth_scale2=smooth_scale2, beta=beta,
        output_mask=output_mask, y_dtype=y_dtype, **extra)


# ----------------------------------------------------------------------------- fake kernels


def _code_shape(x, int4: bool) -> list:
    shape = list(x.shape)
    if int4:
        shape[-1] = shape[-1] // 8
    return shape


@register_fake("npu::npu_dynamic_quant")
def _dynamic_quant_fake(input, *, smooth_scales=None, group_index=None, dst_type=None,
                        quant_mode="pertoken", dst_type_max=0.0):
    int4 = _is_int4(dst_type)
    y = input.new_empty(_code_shape(input, int4), dtype=torch.int32 if int4 else torch.int8)
    scale_shape = [1] if quant_mode == "pertensor" else list(input.shape[:-1])
    return y, input.new_empty(scale_shape, dtype=torch.float32)


@register_fake("npu::npu_add_rms_norm_dynamic_quant")
def _add_rms_norm_dynamic_quant_fake(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None,
                                     beta=None, epsilon=1e-6, output_mask=None, y_dtype=None):
    if output_mask is None:
        branches = (True, smooth_scale1 is not None and smooth_scale2 is not None)
    else:
        branches = (bool(output_mask[0]), bool(output_mask[1]))
    int4 = _is_int4(y_dtype)
    code_dtype = torch.int32 if int4 else torch.int8
    codes = [x1.new_empty(_code_shape(x1, int4) if on else [], dtype=code_dtype)
             for on in branches]
    scales = [x1.new_empty(list(x1.shape[:-1]) if on else [], dtype=torch.float32)
              for on in branches]
    return codes[0], codes[1], x1.new_empty(x1.shape), scales[0], scales[1]


_NO_GRADIENT = "torch_npu registers no gradient for it (inference op)"
mark_not_differentiable("npu_dynamic_quant", _NO_GRADIENT)
mark_not_differentiable("npu_add_rms_norm_dynamic_quant", _NO_GRADIENT)

__all__ = ["npu_dynamic_quant", "npu_add_rms_norm_dynamic_quant"]
