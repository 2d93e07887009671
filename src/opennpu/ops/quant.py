"""Quantisation family: npu_dynamic_quant, npu_add_rms_norm_dynamic_quant and npu_quantize; the
quantised matmul npu_quant_matmul with its helpers npu_trans_quant_param and npu_convert_weight_to_int4pack.

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


# float8 outputs of npu_dynamic_quant: torch's dtypes (or their codes) and torch_npu's codes.
_FP8_OF_CODE = {24: torch.float8_e4m3fn, 292: torch.float8_e4m3fn, 23: torch.float8_e5m2,
                291: torch.float8_e5m2}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# torch_npu.hifloat8: outputs are uint8 codes (csrc/ops/quant/hifloat8.h); DTYPE_MAX 2^15.
HIF8 = 290
HIF8_MAX = 32768.0


def _fp8_of(dtype):
    if isinstance(dtype, torch.dtype):
        return dtype if dtype in _FP8_MAX else None
    return _FP8_OF_CODE.get(dtype)


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
    scale 1. ``dst_type=torch.float8_e4m3fn`` / ``torch.float8_e5m2`` (or torch_npu's 292 / 291):
    y is float8, ``scale = rowmax * (1 / DTYPE_MAX)`` (448 / 57344; CANN's golden) and
    ``y = fp8(v / scale)`` rounded to nearest even. ``dst_type=torch_npu.hifloat8`` (290): the
    same with DTYPE_MAX 32768 (or ``dst_type_max`` in (0, 32768]) and ``y`` uint8 hifloat8 codes,
    rounded half away from zero (en_dtypes.hifloat8's cast). Not differentiable.
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


# npu_quantize's `dtype` codes: torch.qint8 / int8 -> int8, torch.quint8 / uint8 -> uint8,
# torch.qint32 / int32 -> int32 (div_mode=True); torch.quint4x2 / torch.int4 -> packed int32.
_QUANTIZE_OUT = {12: torch.int8, 1: torch.int8, 13: torch.uint8, 0: torch.uint8,
                 14: torch.int32, 3: torch.int32}
_DTYPE_CODE = {torch.qint8: 12, torch.quint8: 13, torch.qint32: 14, torch.int8: 1,
               torch.uint8: 0, torch.int32: 3, torch.quint4x2: 16, torch.int4: 40}


def _quantize_out(dtype, div_mode: bool):
    """(output dtype, int4 packed) of npu_quantize's ``dtype`` argument."""
    code = _DTYPE_CODE.get(dtype, -1) if isinstance(dtype, torch.dtype) else int(dtype)
    if code == HIF8:
        return torch.uint8, False
    if not div_mode and code in _INT4_CODES:
        return torch.int32, True
    if not div_mode and code not in (12, 1):
        return torch.int8, False  # rejected by the kernel; the fake only needs a shape
    return _QUANTIZE_OUT.get(code, torch.int8), False


def npu_quantize(input, scales, zero_points, dtype, axis: int = 1, div_mode: bool = True):
    """Affine quantisation with given scales and zero points. Returns the codes.

    ``div_mode=True`` (torch.quantize_per_channel's arithmetic): ``q = clamp(round(x * (1 /
    scale)) + zero_point)`` with the float32 reciprocal of each scale, along ``axis`` (any dim;
    ``scales`` / ``zero_points`` 1-D of that dim's size, or ``[1]``); ``dtype`` torch.qint8 /
    torch.quint8 / torch.qint32 (or torch.int8 / uint8 / int32) gives int8 / uint8 / int32 codes.
    ``div_mode=False`` (AscendQuantV2): ``q = clamp(round(fp32(x * scale) + zero_point))``, the
    product rounded to float32 before the add; ``axis=-2`` quantises along the second-to-last
    dim, every other axis (> -2) along the last; ``scales`` ``[C]`` / ``[1]`` or of x's rank with
    1 in every other dim; ``dtype`` torch.qint8 (int8) or torch.quint4x2 (int4 in ``[-8, 7]``,
    eight per int32 along the last dim, lowest bits first; the last dim must divide by 8).
    ``round`` is half to even, codes saturate at the type's range, a NaN input gives the zero
    point. ``dtype=torch_npu.hifloat8`` (290, either mode): uint8 hifloat8 codes of
    ``t = fp32(x / scale) + zero_point`` (div_mode; the true quotient) or
    ``fp32(x * scale) + zero_point``, cast half away from zero, unsaturated (``|t| >= 40960``
    -> inf; NaN -> the NaN code 0x80). x is float16 / bfloat16 / float32 (float64 is rounded to
    float32), computed in float32. Not differentiable.
    """
    return _ops.npu_quantize(input, scales, zero_points, dtype, axis, div_mode)


# ----------------------------------------------------------------------------- fake kernels


def _code_shape(x, int4: bool) -> list:
    shape = list(x.shape)
    if int4:
        shape[-1] = shape[-1] // 8
    return shape


@register_fake("npu::npu_dynamic_quant")
def _dynamic_quant_fake(input, *, smooth_scales=None, group_index=None, dst_type=None,
                        quant_mode="pertoken", dst_type_max=0.0):
    int4, fp8 = _is_int4(dst_type), _fp8_of(dst_type)
    if dst_type == HIF8:
        fp8 = torch.uint8
    y = input.new_empty(_code_shape(input, int4),
                        dtype=fp8 or (torch.int32 if int4 else torch.int8))
    scale_shape = [1] if quant_mode == "pertensor" else list(input.shape[:-1])
    return y, input.new_empty(scale_shape, dtype=torch.float32)


@register_fake("npu::npu_quantize")
def _quantize_fake(self, scales, zero_points, dtype, axis=1, div_mode=True):
    out, int4 = _quantize_out(dtype, div_mode)
    return self.new_empty(_code_shape(self, int4), dtype=out)


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


# ----------------------------------------------------------------------------- quantised matmul

# The `int?` codes torch.ops gives the output dtypes of npu_quant_matmul.
_DTYPE_OF_CODE = {1: torch.int8, 3: torch.int32, 5: torch.float16, 6: torch.float32,
                  15: torch.bfloat16}


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                     output_dtype=None, x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None,
                     scale_dtype=None, group_sizes=None, y_scale=None):
    """Quantised matmul with int32 accumulation. Returns ``x1 @ x2`` dequantised or requantised.

    ``x1`` int8 ``[..., m, k]``, ``x2`` int8 ``[..., k, n]`` (any layout; batch dims broadcast),
    or both int32 holding eight int4 codes each (lowest bits first): ``x1 [..., m, k/8]``, ``x2
    [..., k, n/8]`` or the transpose of a contiguous ``[..., n, k/8]``. The product is exact in
    int32; then ``v = acc (+ bias)`` for an int32 ``bias`` and, in float32,
    ``y = v * scale (* pertoken_scale) (+ bias) (+ offset)``, rounded once to ``output_dtype``
    (None / torch.int8: round half to even, saturated; torch.float16, torch.bfloat16; torch.int32
    returns ``v`` unscaled). ``scale`` ``[1]`` or ``[n]`` float32 / bfloat16, or int64 from
    npu_trans_quant_param (which may carry the offset); ``offset`` float32 ``[1]`` / ``[n]``,
    int8 outputs only; ``pertoken_scale`` float32 ``[m]``; ``bias`` ``[n]`` (or ``[batch, 1,
    n]``): int32 (added to the accumulator) or bfloat16 / float16 / float32 (added after the
    scales, float outputs). ``group_sizes`` must be None or [0, 0, 0] and ``y_scale`` None
    (per-group scaling of integer operands is not implemented), except for A8W4 and MX.

    Float operands (Ascend950's paths): ``x1`` / ``x2`` float8_e4m3fn or float8_e5m2 (mixed
    allowed; or int8 / uint8 bytes with ``x1_dtype`` / ``x2_dtype`` torch.float8_* or torch_npu's
    291 / 292), hifloat8 (bytes with ``x1_dtype`` and ``x2_dtype`` torch_npu.hifloat8 = 290; both
    operands), or float4_e2m1 / float4_e1m2 (torch.float4_e2m1fn_x2, or bytes with ``x?_dtype``
    296 / 297, torch_npu.float4_e2m1fn_x2 / float4_e1m2fn_x2; MX only): two codes per byte,
    element 2j in the low nibble, along the
    memory-contiguous dim (``x1`` [m, k / 2], or the transpose [m / 2, k] of a contiguous
    [k, m / 2]; ``x2`` [k, n / 2], or the transpose [k / 2, n] of a contiguous [n, k / 2]).
    ``output_dtype`` float16 / bfloat16 / float32; ``bias`` float [n] / [batch, 1, n]; no
    ``offset``. The product is one float32 GEMM of the exactly decoded operands (float32
    accumulation), then ``y = acc * scale (* pertoken_scale) (+ bias)``: per-tensor / channel
    float32 ``scale`` [1] / [n], ``pertoken_scale`` float32 [m] (or [1]: the golden's double
    scale ``scale * pertoken_scale``). MX (float8 or float4 operands): both scales float8_e8m0
    (torch.float8_e8m0fnu, or uint8 / int8 with ``scale_dtype`` / ``pertoken_scale_dtype``
    torch_npu.float8_e8m0fnu = 293), one per block of 32 along k as npu_dynamic_mx_quant
    writes them: ``pertoken_scale`` [(batch,) m, ceil(k / 64), 2] for x1, ``scale`` [(batch,)
    ceil(k / 64), n, 2] for x2 (the transpose of [n, ceil(k / 64), 2] when x2 is a transpose);
    the operands are multiplied by their block scales in float32 (exact powers of two) before
    the GEMM, a last block shorter than 32 allowed; ``group_sizes`` None, [0, 0, 0] or
    [1, 1, 32]. Per-block float32 scales (float8 / hifloat8): ``pertoken_scale`` [(batch,)
    m or ceil(m / 128), ceil(k / 128)] and ``scale`` [(batch,) ceil(k / 128), ceil(n / 128)]
    (``group_sizes`` [1, 128, 128] / [128, 128, 128], zeros inferred from the shapes; a scale is
    a transpose when its operand is), as op-plugin's per-block golden: the sum over 128-deep K
    blocks, in order in float32, of each block's product times its x1 scale, times its x2 scale.
    ``y_scale`` is not implemented.

    A8W4 (int8 ``x1`` [m, k], int4 ``x2`` words [k, n / 8]): ``scale`` [k / group_k, n] (int64
    from npu_trans_quant_param, or float32), ``group_sizes`` [0, 0, group_k] (None: k /
    scale.size(0)), ``offset`` float32 [n] (the additive term), ``pertoken_scale`` [m],
    ``output_dtype`` float16 / bfloat16, as op-plugin's golden computes it: x = 16 hi + lo + 8
    split into two int4 halves; per K group the exact products with the weight, times the scale,
    rounded to float16 and summed in float16; ``y = (acc_hi * 16 + acc_lo + offset) *
    pertoken_scale``. That is the product of ``x1 - 8``: A8W4 weights come with ``8 * sum_k(w *
    scale)`` folded into ``offset``. Not differentiable.
    """
    return _ops.npu_quant_matmul(
        x1, x2, scale, offset=offset, pertoken_scale=pertoken_scale, bias=bias,
        output_dtype=output_dtype, x1_dtype=x1_dtype, x2_dtype=x2_dtype,
        pertoken_scale_dtype=pertoken_scale_dtype, scale_dtype=scale_dtype,
        group_sizes=group_sizes, y_scale=y_scale)


def npu_trans_quant_param(scale, offset=None, round_mode=0):
    """float32 ``scale`` (and ``offset``) packed into int64 as npu_quant_matmul reads them:
    the fp32 bits of scale cut to fp19 (``bits & 0xFFFFE000``; ``round_mode=1`` first rounds to
    the nearest fp19, ties to even) in bits 0..31, bit 46 set, and
    ``clamp(round_half_even(offset), -256, 255)`` as 9 bits at bit 37. Shape: scale's, or
    ``[max(len(scale), len(offset))]`` for a 1-D scale with an offset. Not differentiable.
    """
    return _ops.npu_trans_quant_param(scale, offset, round_mode)


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    """int32 ``weight`` ``[..., n]`` (2-D or 3-D) of values in [-8, 7] packed eight per int32
    along the last dim, lowest bits first: ``[..., n / 8]``, as npu_quant_matmul and the int4
    paths read it. ``inner_k_tiles`` is reserved (unused). Not differentiable."""
    return _ops.npu_convert_weight_to_int4pack(weight, inner_k_tiles)


def _dtype_of(code, default):
    if code is None:
        return default
    if isinstance(code, torch.dtype):
        return code
    return _DTYPE_OF_CODE.get(int(code), default)


# Operand / scale type codes of npu_quant_matmul's float paths: torch's ScalarType codes and
# torch_npu's DType (torch_npu.hifloat8 290, float8_e5m2 291, float8_e4m3fn 292, float8_e8m0fnu
# 293, float4_e2m1fn_x2 296, float4_e1m2fn_x2 297).
_QMM_FP8_CODES = {24: torch.float8_e4m3fn, 292: torch.float8_e4m3fn, 23: torch.float8_e5m2,
                  291: torch.float8_e5m2, 290: "hif8"}
_QMM_FP4_CODES = {45: "fp4", 296: "fp4", 297: "fp4_e1m2"}
# The float4 kinds _qmm_float_kind names (two codes per byte).
_FP4_KINDS = ("fp4", "fp4_e1m2")
_QMM_E8M0_CODES = {44, 293}
_CODE_OF_DTYPE = {torch.float8_e5m2: 23, torch.float8_e4m3fn: 24, torch.float8_e8m0fnu: 44,
                  torch.float4_e2m1fn_x2: 45, torch.float32: 6, torch.float16: 5,
                  torch.bfloat16: 15, torch.int8: 1, torch.int32: 3, torch.uint8: 0}


def _type_code(declared):
    """An `int?` dtype argument as its code (a torch.dtype passed through Python stays one)."""
    if declared is None or not isinstance(declared, torch.dtype):
        return declared
    return _CODE_OF_DTYPE.get(declared, -1)


def _qmm_float_kind(t, declared):
    """npu_quant_matmul's element format of x1 / x2: a float8 dtype, "hif8" (hifloat8), "fp4"
    (float4_e2m1), "fp4_e1m2" (float4_e1m2), or None (integer)."""
    code = _type_code(declared)
    if code is None:
        if t.dtype == torch.float4_e2m1fn_x2:
            return "fp4"
        return t.dtype if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else None
    if code in _QMM_FP4_CODES:
        return _QMM_FP4_CODES[code]
    return _QMM_FP8_CODES.get(code)


def _transposed(t):
    """op-plugin's test of a transposed operand: its last two dims are the transpose of a
    contiguous tensor (float4 codes are packed two per byte along the memory-contiguous dim)."""
    r, c = t.shape[-2], t.shape[-1]
    if t.stride(-2) != 1 or t.stride(-1) != r:
        return False
    expected = r * c
    for d in range(t.dim() - 3, -1, -1):
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return not (r == 1 and c == 1)


@register_fake("npu::npu_quant_matmul")
def _quant_matmul_fake(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                       output_dtype=None, x1_dtype=None, x2_dtype=None,
                       pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                       y_scale=None):
    torch._check(x1.dim() >= 2 and x2.dim() >= 2,
                 lambda: "npu_quant_matmul: x1 and x2 must have 2 to 6 dims")
    m = x1.shape[-2]
    kind1, kind2 = _qmm_float_kind(x1, x1_dtype), _qmm_float_kind(x2, x2_dtype)
    if kind1 is not None or kind2 is not None:  # float8 / float4 codes
        if kind1 in _FP4_KINDS and _transposed(x1):
            m = 2 * m
        n = x2.shape[-1] if kind2 not in _FP4_KINDS or _transposed(x2) else 2 * x2.shape[-1]
        default = torch.float32
    elif x1.dtype == torch.int32:  # int4 words: [k, n / 8], or the transpose [k / 8, n]
        packed_k = x2.shape[-2] == 8 * x1.shape[-1]
        n = 8 * x2.shape[-1] if packed_k else x2.shape[-1]
        default = torch.int8
    elif x2.dtype == torch.int32:  # A8W4: int4 weight words [k, n / 8]
        n = 8 * x2.shape[-1]
        default = torch.int8
    else:
        n = x2.shape[-1]
        default = torch.int8
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    return x1.new_empty([*batch, m, n], dtype=_dtype_of(output_dtype, default))


@register_fake("npu::npu_trans_quant_param")
def _trans_quant_param_fake(scale, offset=None, round_mode=0):
    shape = list(scale.shape)
    if offset is not None and scale.dim() == 1:
        shape = [max(scale.numel(), offset.numel())]
    return scale.new_empty(shape, dtype=torch.int64)


@register_fake("npu::npu_convert_weight_to_int4pack")
def _convert_weight_to_int4pack_fake(weight, inner_k_tiles=0):
    return weight.new_empty([*weight.shape[:-1], weight.shape[-1] // 8])


# ----------------------------------------------------------------------------- MX / block quant

# dst_type codes (torch's ScalarType and torch_npu's DType) -> dtype of y (uint8: two fp4 codes).
_MX_Y_DTYPE = {23: torch.float8_e5m2, 291: torch.float8_e5m2, 24: torch.float8_e4m3fn,
               292: torch.float8_e4m3fn, 45: torch.uint8, 296: torch.uint8, 297: torch.uint8}


def _mx_code(dst_type) -> int:
    if isinstance(dst_type, torch.dtype):  # a dtype passed for an `int` argument
        return {torch.float8_e5m2: 23, torch.float8_e4m3fn: 24, torch.float4_e2m1fn_x2: 45,
                torch.int8: 1}.get(dst_type, -1)
    return int(dst_type)


def npu_dynamic_mx_quant(input, *, axis=-1, round_mode="rint", dst_type=296, block_size=32,
                         scale_alg=0, dst_type_max=None, max_low_bound=None):
    """MX quantisation: blocks of ``block_size`` along ``axis`` share a power-of-two scale.

    ``shared_exp = floor(log2(max|V|)) - emax`` (``scale_alg=0``, OCP; ``1``: the exponent of
    ``max(max|V|, max_low_bound) / max_norm`` rounded up, float8 only), clamped to [-127, 127]
    (an all-zero block -127; NaN / inf: NaN scale, codes 0); elements ``V / 2^shared_exp``
    rounded (``round_mode`` "rint"; fp4 also "round", "floor") to ``dst_type`` and saturated:
    torch.float8_e4m3fn / e5m2 (24 / 23, or torch_npu's 292 / 291), float4_e2m1 (296, default)
    or float4_e1m2 (297) packed two per uint8 along the last dim (element 2j in the low nibble).
    Returns ``(y, mxscale)``, mxscale uint8 float8_e8m0 codes of shape input's with ``axis``
    replaced by ``ceil(ceil(d / block_size) / 2)`` and a trailing 2 (blocks 2p, 2p + 1). Not
    differentiable.
    """
    # float defaults stay out of the call (see npu_dynamic_quant)
    extra = {} if dst_type_max is None else {"dst_type_max": dst_type_max}
    if max_low_bound is not None:
        extra["max_low_bound"] = max_low_bound
    return _ops.npu_dynamic_mx_quant(input, axis=axis, round_mode=round_mode,
                                     dst_type=_mx_code(dst_type), block_size=block_size,
                                     scale_alg=scale_alg, **extra)


def npu_dynamic_mx_quant_with_dual_axis(input, *, round_mode="rint", dst_type=296, scale_alg=0,
                                        dst_type_max=None):
    """npu_dynamic_mx_quant of ``input`` along its last axis and along its second-to-last
    (blocks of 32): returns ``(y1, mxscale1, y2, mxscale2)``. Not differentiable."""
    extra = {} if dst_type_max is None else {"dst_type_max": dst_type_max}  # see above
    return _ops.npu_dynamic_mx_quant_with_dual_axis(
        input, round_mode=round_mode, dst_type=_mx_code(dst_type), scale_alg=scale_alg, **extra)


def npu_grouped_dynamic_mx_quant(x, group_index, *, round_mode="rint", dst_type=23, blocksize=32,
                                 scale_alg=0, dst_type_max=None):
    """MX float8 quantisation of ``x [M, N]`` along dim 0 within row groups (``group_index``:
    int32 cumulative row ends, the last = M), blocks of 32 rows. Group g's scales start at pair
    ``group_index[g-1] // 64 + g`` of ``mxscale [M // 64 + G, N, 2]``; an odd block count is
    padded with code 0 and the pairs up to the next group's start hold code 127 (scale 1).
    Returns ``(y, mxscale)``. Not differentiable."""
    extra = {} if dst_type_max is None else {"dst_type_max": dst_type_max}  # see above
    return _ops.npu_grouped_dynamic_mx_quant(
        x, group_index, round_mode=round_mode, dst_type=_mx_code(dst_type), blocksize=blocksize,
        scale_alg=scale_alg, **extra)


def npu_dynamic_block_quant(x, *, min_scale=None, round_mode="rint", dst_type=1,
                            row_block_size=1, col_block_size=128, dst_type_max=None):
    """Block quantisation of 2-D / 3-D ``x``: per ``row_block_size x col_block_size`` block,
    ``inv = min(QMAX / max|x|, 1 / min_scale)``, ``y = x * inv`` (int8: rounded half to even;
    or torch.float8_e4m3fn / e5m2; or torch_npu.hifloat8 = 290 with ``round_mode="round"``:
    uint8 codes, half away from zero), ``scale = max(max|x| / QMAX, min_scale)`` float32 of
    shape ``[..., ceil(rows / row_block_size), ceil(cols / col_block_size)]``; QMAX 127 / 448 /
    57344 / 32768 or ``dst_type_max``. ``round_mode`` is "rint" for int8 / float8. An all-zero
    block gets codes 0. Returns ``(y, scale)``. Not differentiable."""
    extra = {} if min_scale is None else {"min_scale": min_scale}
    if dst_type_max is not None:
        extra["dst_type_max"] = dst_type_max
    return _ops.npu_dynamic_block_quant(x, round_mode=round_mode, dst_type=_mx_code(dst_type),
                                        row_block_size=row_block_size,
                                        col_block_size=col_block_size, **extra)


def _mx_fakes(x, axis, dst_type, block_size):
    code = _mx_code(dst_type)
    y_dtype = _MX_Y_DTYPE.get(code, torch.uint8)
    y_shape = list(x.shape)
    if y_dtype == torch.uint8:
        y_shape[-1] = y_shape[-1] // 2
    axis = axis % x.dim()
    s_shape = list(x.shape)
    s_shape[axis] = ((s_shape[axis] + block_size - 1) // block_size + 1) // 2
    return x.new_empty(y_shape, dtype=y_dtype), x.new_empty([*s_shape, 2], dtype=torch.uint8)


@register_fake("npu::npu_dynamic_mx_quant")
def _dynamic_mx_quant_fake(input, *, axis=-1, round_mode="rint", dst_type=296, block_size=32,
                           scale_alg=0, dst_type_max=0.0, max_low_bound=0.0):
    return _mx_fakes(input, axis, dst_type, block_size)


@register_fake("npu::npu_dynamic_mx_quant_with_dual_axis")
def _dynamic_mx_quant_with_dual_axis_fake(input, *, round_mode="rint", dst_type=296, scale_alg=0,
                                          dst_type_max=0.0):
    return (*_mx_fakes(input, -1, dst_type, 32), *_mx_fakes(input, -2, dst_type, 32))


@register_fake("npu::npu_grouped_dynamic_mx_quant")
def _grouped_dynamic_mx_quant_fake(x, group_index, *, round_mode="rint", dst_type=23,
                                   blocksize=32, scale_alg=0, dst_type_max=0.0):
    y = x.new_empty(x.shape, dtype=_MX_Y_DTYPE.get(_mx_code(dst_type), torch.uint8))
    pairs = x.shape[0] // 64 + group_index.shape[0]
    return y, x.new_empty([pairs, x.shape[1], 2], dtype=torch.uint8)


@register_fake("npu::npu_dynamic_block_quant")
def _dynamic_block_quant_fake(x, *, min_scale=0.0, round_mode="rint", dst_type=1,
                              row_block_size=1, col_block_size=128, dst_type_max=0.0):
    code = _mx_code(dst_type)
    y = x.new_empty(x.shape, dtype=torch.uint8 if code == HIF8 else
                    _MX_Y_DTYPE.get(code, torch.int8))
    shape = list(x.shape)
    shape[-2] = (shape[-2] + row_block_size - 1) // row_block_size
    shape[-1] = (shape[-1] + col_block_size - 1) // col_block_size
    return y, x.new_empty(shape, dtype=torch.float32)


_NO_GRADIENT = "torch_npu registers no gradient for it (inference op)"
mark_not_differentiable("npu_dynamic_quant", _NO_GRADIENT)
mark_not_differentiable("npu_add_rms_norm_dynamic_quant", _NO_GRADIENT)
mark_not_differentiable("npu_quantize", _NO_GRADIENT)
mark_not_differentiable("npu_quant_matmul", _NO_GRADIENT)
mark_not_differentiable("npu_trans_quant_param", "integer output (a packed parameter)")
mark_not_differentiable("npu_convert_weight_to_int4pack", "integer input and output")
for _name in ("npu_dynamic_mx_quant", "npu_dynamic_mx_quant_with_dual_axis",
              "npu_grouped_dynamic_mx_quant", "npu_dynamic_block_quant"):
    mark_not_differentiable(_name, _NO_GRADIENT)

__all__ = ["npu_dynamic_quant", "npu_add_rms_norm_dynamic_quant", "npu_quantize", "npu_quant_matmul",
           "npu_trans_quant_param", "npu_convert_weight_to_int4pack", "npu_dynamic_mx_quant",
           "npu_dynamic_mx_quant_with_dual_axis", "npu_grouped_dynamic_mx_quant",
           "npu_dynamic_block_quant"]
