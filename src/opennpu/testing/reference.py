"""Reference implementations (pure torch) of opennpu's ops.

Two kinds of function live here:
- `<op>(...)`: the oracle. Inputs are up-cast to float32 (float64 stays float64), the math follows
  the torch_npu contract, and outputs are returned in float32/float64 *without* rounding, so
  tests and benchmarks measure every implementation's error against the same exact-ish values.
- `native_<op>(...)`: the eager PyTorch code the seed documents show ("torch原生"), run in the
  input dtype. These are the baselines the fused ops replace (benchmarks, demo, accuracy bound).
"""

from __future__ import annotations

import struct

import torch
import torch.nn.functional as F


def _up(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


# ----------------------------------------------------------------------------- RMSNorm


def rms_norm(x, gamma, epsilon=1e-6):
    """(y, rstd): y = x * rstd * gamma over gamma's trailing dims; rstd keeps them as 1."""
    xf, gf = _up(x), _up(gamma)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)
    return xf * rstd * gf, rstd


def gemma_rms_norm(x, gamma, epsilon=1e-6):
    return rms_norm(x, _up(gamma) + 1, epsilon)


def add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    """(y, rstd, x): the sum is rounded to x1's dtype first, as torch_npu's golden does."""
    x = x1 + x2
    y, rstd = rms_norm(x, gamma, epsilon)
    return y, rstd, _up(x)


def rms_norm_backward(dy, x, gamma, rstd):
    """(dx, dgamma) from the contract's closed form."""
    dyf, xf, gf, rf = _up(dy), _up(x), _up(gamma), _up(rstd)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    lead = tuple(range(x.dim() - gamma.dim()))
    n = gamma.numel()
    dx = dyf * gf * rf - xf * rf.pow(3) * (dyf * gf * xf).sum(dim=dims, keepdim=True) / n
    dgamma = (dyf * xf * rf).sum(dim=lead) if lead else dyf * xf * rf
    return dx, dgamma


def native_rms_norm(x, weight, eps=1e-6):
    """Seed 000's TorchRMSNorm.forward."""
    output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return output.type_as(x) * weight


def native_add_rms_norm(x1, x2, weight, eps=1e-6):
    x = x1 + x2
    return native_rms_norm(x, weight, eps), x


def add_rms_norm_cast(x1, x2, gamma, epsilon=1e-6):
    """(y1, y2, rstd, x): add_rms_norm's y twice (float32 and, once rounded, x1's dtype)."""
    y, rstd, x = add_rms_norm(x1, x2, gamma, epsilon)
    return y, y, rstd, x


def native_add_rms_norm_cast(x1, x2, weight, eps=1e-6):
    """npu_add_rms_norm followed by .to(float32), the pair torchair fuses into the cast op."""
    y, x = native_add_rms_norm(x1, x2, weight, eps)
    return y.float(), y, x


# ----------------------------------------------------------------------------- quantisation
# The quantiser written out step by step: scale = rowmax(|v|) / DTYPE_MAX (0 -> 1), codes =
# clamp(round(v / scale)) with torch.round (half to even), all in float32.

INT8_RANGE, INT4_RANGE = (-128, 127), (-8, 7)


def quantize(v, qmax=127.0, code_range=INT8_RANGE, per_tensor=False):
    """(codes as int8 in v's shape, scale float32): symmetric quantisation of float32 v per row
    (last dim) or over the whole tensor."""
    v = v.float()
    if per_tensor:  # (an empty tensor's max is 0, so its scale is 1)
        absmax = v.abs().amax() if v.numel() else v.new_zeros(())
    else:
        absmax = v.abs().amax(dim=-1, keepdim=True)
    scale = absmax / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    # NaN quotients (a NaN in the row, or inf / inf) give code 0, as opennpu's kernels define it
    codes = torch.nan_to_num(torch.round(v / scale), nan=0.0).clamp(*code_range).to(torch.int8)
    return codes, (scale.reshape(1) if per_tensor else scale.squeeze(-1))


def is_int4(dtype) -> bool:
    return dtype in (torch.quint4x2, torch.int4, 16, 40)


def pack_int4(codes):
    """int8 codes in [-8, 7], last dim a multiple of 8 -> int32 words, code k in bits [4k, 4k+4)."""
    nibbles = (codes.to(torch.int64) & 0xF).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(words):
    """The inverse of pack_int4: int32 words -> int8 codes (last dim x 8), sign-extended."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nibbles = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).flatten(-2).to(torch.int8)


def smoothed(x, smooth_scales=None, group_index=None):
    """x * smooth in float32; with group_index, rows [ends[g-1], ends[g]) use smooth_scales[g]."""
    v = _up(x).float()
    if smooth_scales is None:
        return v
    sm = smooth_scales.float()
    if group_index is None:
        return v * sm
    rows = v.reshape(-1, v.shape[-1])
    ends = group_index.tolist()
    group_of_row = torch.searchsorted(torch.tensor(ends), torch.arange(rows.shape[0]), right=True)
    return (rows * sm[group_of_row]).reshape(v.shape)


def dynamic_quant(x, smooth_scales=None, group_index=None, dst_type=None, quant_mode="pertoken",
                  dst_type_max=0.0):
    """(codes int8 unpacked, or float8, scale) of npu_dynamic_quant."""
    fp8 = {24: torch.float8_e4m3fn, 292: torch.float8_e4m3fn, 23: torch.float8_e5m2,
           291: torch.float8_e5m2}.get(dst_type, dst_type if isinstance(dst_type, torch.dtype)
                                       and dst_type.itemsize == 1 and dst_type.is_floating_point
                                       else None)
    if fp8 is not None:  # CANN's golden: scale = amax * (1 / qmax), y = fp8(v / scale)
        qmax = dst_type_max or (448.0 if fp8 == torch.float8_e4m3fn else 57344.0)
        v = smoothed(x, smooth_scales, group_index)
        per_tensor = quant_mode == "pertensor"
        amax = v.abs().amax().reshape(1) if per_tensor else v.abs().amax(dim=-1)
        scale = amax * torch.tensor(1.0 / qmax, dtype=torch.float32)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        return (v / (scale if per_tensor else scale.unsqueeze(-1))).to(fp8), scale
    int4 = is_int4(dst_type)
    qmax = dst_type_max or (7.0 if int4 else 127.0)
    return quantize(smoothed(x, smooth_scales, group_index), qmax,
                    INT4_RANGE if int4 else INT8_RANGE, per_tensor=quant_mode == "pertensor")


def add_rms_norm_dynamic_quant(x1, x2, gamma, smooth_scale1=None, smooth_scale2=None, beta=None,
                               epsilon=1e-6, output_mask=None, y_dtype=None):
    """(y1, y2, x, scale1, scale2) with codes unpacked and None for a disabled branch. The sum
    is formed in float32 (torch_npu's golden for this op) and normalised unrounded."""
    x = _up(x1) + _up(x2)
    rstd = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    y = x * rstd * _up(gamma)
    if beta is not None:
        y = y + _up(beta)
    if output_mask is None:
        on = (True, smooth_scale1 is not None and smooth_scale2 is not None)
    else:
        on = tuple(bool(m) for m in output_mask)
    code_range = INT4_RANGE if is_int4(y_dtype) else INT8_RANGE
    qmax = 7.0 if is_int4(y_dtype) else 127.0
    outs = []
    for enabled, smooth in zip(on, (smooth_scale1, smooth_scale2)):
        v = y if smooth is None else y * smooth.float()
        outs.append(quantize(v, qmax, code_range) if enabled else (None, None))
    return outs[0][0], outs[1][0], x, outs[0][1], outs[1][1]


def native_dynamic_quant(x, smooth_scales=None):
    """npu_dynamic_quant's eager composition (float32 math, int8 codes, per-row scale)."""
    v = x.float() if smooth_scales is None else x.float() * smooth_scales.float()
    scale = v.abs().amax(dim=-1, keepdim=True) / 127
    y = torch.round(v / scale).clamp(-128, 127).to(torch.int8)
    return y, scale.squeeze(-1)


def native_add_rms_norm_dynamic_quant(x1, x2, weight, smooth_scales=None, eps=1e-6):
    """The pair torchair fuses: npu_add_rms_norm's native code, then npu_dynamic_quant's, on
    branch 1. Returns (y1, x, scale1)."""
    y, x = native_add_rms_norm(x1, x2, weight, eps)
    codes, scale = native_dynamic_quant(y, smooth_scales)
    return codes, x, scale


# npu_quant_matmul: the int32 product computed exactly (in float64, then int64), then the dequantisation written
# out in float32 in the golden's order (acc * scale * pertoken_scale + bias + offset).

def decode_trans_quant_param(packed):
    """(scale float32, offset float32) of npu_trans_quant_param's int64 encoding."""
    bits = (packed.to(torch.int64) & 0xFFFFFFFF).tolist()
    scale = torch.tensor([struct.unpack("<f", struct.pack("<I", b))[0] for b in bits],
                         dtype=torch.float32)
    off = ((packed.to(torch.int64) >> 37) & 0x1FF).reshape(-1)
    return scale, torch.where(off >= 256, off - 512, off).float()


def trans_quant_param(scale, offset=None, round_mode=0):
    """npu_trans_quant_param bit by bit (Python integers)."""
    out = []
    s = scale.reshape(-1).tolist()
    o = None if offset is None else offset.reshape(-1).tolist()
    t = max(len(s), len(o) if o is not None else 0)
    for i in range(t):
        bits = struct.unpack("<I", struct.pack("<f", s[0 if len(s) == 1 else i]))[0]
        if round_mode == 1 and (bits & 0x7F800000) != 0x7F800000:
            bits = (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFFFFF
        v = (bits & 0xFFFFE000) | (1 << 46)
        if o is not None:
            x = o[0 if len(o) == 1 else i]
            q = 0 if x != x else int(max(-256.0, min(255.0, float(round(x)))))  # round: half even
            v = (v & 0x4000FFFFFFFF) | ((q & 0x1FF) << 37)
        out.append(v)
    shape = scale.shape if offset is None or scale.dim() == 2 else (t,)
    return torch.tensor(out, dtype=torch.int64).reshape(shape)


def quant_matmul(x1, x2, scale, offset=None, pertoken_scale=None, bias=None, output_dtype=None):
    """npu_quant_matmul: codes unpacked (int4 words of x2 along n, or along k when x2 is
    [k / 8, n]), multiplied exactly, then dequantised or requantised in float32."""
    if x1.dtype == torch.int32:
        a = unpack_int4(x1)
        w = unpack_int4(x2) if x2.shape[-2] == a.shape[-1] else unpack_int4(x2.mT).mT
    else:
        a, w = x1, x2
    acc = torch.matmul(a.double(), w.double()).to(torch.int64)  # exact: |sums| < 2^53
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.to(torch.int64)
    out_dtype = output_dtype or torch.int8
    if out_dtype == torch.int32:
        return acc.to(torch.int32)
    if scale.dtype == torch.int64:
        s, packed_offset = decode_trans_quant_param(scale)
        if packed_offset.any():
            offset = packed_offset
    else:
        s = scale.float().reshape(-1)
    y = acc.float() * s
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().reshape(-1, 1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    if offset is not None:
        y = y + offset.float().reshape(-1)
    if out_dtype == torch.int8:
        return torch.nan_to_num(torch.round(y), nan=0.0).clamp(-128, 127).to(torch.int8)
    return y.to(out_dtype)


def a8w4_matmul(x, w_codes, scale, bias=None, pertoken_scale=None, output_dtype=torch.float16):
    """A8W4 as op-plugin's goldens compute it (test_npu_quant_matmul.py a8w4_quant_golden and
    test_npu_grouped_matmul.py gmm_a8w4_golden), in numpy: x int8 [m, k] split into rows
    x // 16 and (x & 15) - 8; per K group j the int32 product with w_codes [k, n] (int4 values),
    times scale[j] (float32 [G, n]) in float32, cast to float16 and added to a float16
    accumulator; then acc_hi * 16 + acc_lo + bias in float32, times pertoken_scale [m, 1]."""
    import numpy as np

    xs = x.numpy().astype(np.int32)
    m, k = xs.shape
    split = np.concatenate([xs.reshape(m, 1, k) // 16, (xs.reshape(m, 1, k) & 0x0F) - 8],
                           axis=1).reshape(m * 2, k)
    sc = scale.float().numpy()
    groups = sc.shape[0]
    n = sc.shape[1]
    w = w_codes.numpy().astype(np.int32).reshape(groups, k // groups, n)
    xi = split.reshape(-1, groups, k // groups)
    acc = np.zeros([2 * m, n], dtype=np.float16)
    for j in range(groups):
        mm = np.matmul(xi[:, j, :], w[j]).astype(np.float32) * sc[j].reshape(1, -1)
        acc = (acc.astype(np.float16) + mm.astype(np.float16)).astype(np.float16)
    acc = acc.reshape(m, 2, n).astype(np.float32)
    y = acc[:, 0, :] * 16 + acc[:, 1, :]
    if bias is not None:
        y = y + bias.float().numpy().reshape(1, n)
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().numpy().reshape(-1, 1)
    return torch.from_numpy(np.ascontiguousarray(y)).to(output_dtype)


# MX (microscaling) quantisation as CANN's aclnnDynamicMxQuant golden computes it, with exact
# exponents (torch.frexp): (mbits, emax, min_exp, max_norm, fp4) per element format.
MX_FORMATS = {
    "float8_e4m3fn": (3, 8, -6, 448.0, False), "float8_e5m2": (2, 15, -14, 57344.0, False),
    "float4_e2m1": (1, 2, 0, 6.0, True), "float4_e1m2": (2, 0, 0, 1.75, True),
}
MX_TYPE_OF_CODE = {23: "float8_e5m2", 291: "float8_e5m2", 24: "float8_e4m3fn",
                   292: "float8_e4m3fn", 296: "float4_e2m1", 45: "float4_e2m1", 297: "float4_e1m2"}
_FP4_E2M1_CODE = {0.0: 0, 0.5: 1, 1.0: 2, 1.5: 3, 2.0: 4, 3.0: 5, 4.0: 6, 6.0: 7}


def _floor_log2(a):
    return torch.frexp(a)[1] - 1


def mx_shared_exp(amax, fmt, scale_alg=0, max_low_bound=0.0):
    """(shared exponent int64, NaN-scale mask) of float32 block maxima."""
    _, emax, _, max_norm, _ = MX_FORMATS[fmt]
    if scale_alg == 1:
        amax = torch.maximum(amax, torch.tensor(max_low_bound, dtype=torch.float32))
        bits = (amax / max_norm).view(torch.int32).to(torch.int64)
        e, m = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        exp = e + (((e > 0) & (e < 254) & (m > 0)) | ((e == 0) & (m > 0x400000))).long() - 127
    else:
        exp = _floor_log2(torch.where(amax == 0, torch.ones_like(amax), amax)).long() - emax
    exp = torch.where(amax == 0, torch.full_like(exp, -127), exp)
    nan = ~torch.isfinite(amax) | (exp > 127)
    return exp.clamp(-127, 127), nan


def mx_round(t, fmt, round_mode="rint"):
    """float32 t rounded to the element format at its precision (subnormals included),
    saturated, NaN -> +0; zeros keep their sign."""
    mbits, _, min_exp, max_norm, _ = MX_FORMATS[fmt]
    a = t.abs()
    e = _floor_log2(torch.where(a == 0, torch.ones_like(a), a)).clamp(min=min_exp)
    step = (2.0 ** (e - mbits).double()).float()
    m = t / step
    if round_mode == "rint":
        m = torch.round(m)
    elif round_mode == "round":
        m = torch.floor(m.abs() + 0.5) * torch.sign(m)
    else:
        m = torch.floor(m)
    r = (m * step).clamp(-max_norm, max_norm)
    return torch.nan_to_num(torch.where(a == 0, t, r), nan=0.0)


def mx_encode(r, fmt):
    """Codes (uint8, one per element) of values exactly representable in fmt."""
    if fmt.startswith("float8"):
        return r.to(getattr(torch, fmt)).view(torch.uint8)
    sign = torch.signbit(r).to(torch.uint8) << 3
    a = r.abs()
    if fmt == "float4_e2m1":
        table = torch.zeros(13, dtype=torch.uint8)
        for v, c in _FP4_E2M1_CODE.items():
            table[int(v * 2)] = c
        return sign | table[(a * 2).long()]
    return sign | (a * 4).to(torch.uint8)


def dynamic_mx_quant(x, axis=-1, dst_type=296, block_size=32, round_mode="rint", scale_alg=0,
                     max_low_bound=0.0):
    """(codes uint8 per element (fp4 unpacked), mxscale uint8 in op-plugin's layout)."""
    fmt = MX_TYPE_OF_CODE[dst_type]
    x = x.float()
    axis = axis % x.dim()
    xm = x.movedim(axis, -1)
    d = xm.shape[-1]
    nb = -(-d // block_size)
    blocks = F.pad(xm, (0, nb * block_size - d)).unflatten(-1, (nb, block_size))
    amax = blocks.abs().amax(dim=-1) if blocks.numel() else blocks.new_zeros(blocks.shape[:-1])
    exp, nan = mx_shared_exp(amax, fmt, scale_alg, max_low_bound)
    factor = (2.0 ** (-exp).double()).float().unsqueeze(-1)
    r = torch.where(nan.unsqueeze(-1), torch.zeros_like(blocks), mx_round(blocks * factor, fmt,
                                                                          round_mode))
    codes = mx_encode(r, fmt).flatten(-2)[..., :d].movedim(-1, axis)
    scale = torch.where(nan, torch.full_like(exp, 255), exp + 127).to(torch.uint8)
    scale = F.pad(scale, (0, nb % 2)).unflatten(-1, (-1, 2)).movedim(-2, axis)
    return codes, scale


def pack_fp4(codes):
    """Two fp4 codes per byte along the last dim, element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def grouped_dynamic_mx_quant(x, group_index, dst_type=23, round_mode="rint", scale_alg=0):
    """(codes, mxscale [M // 64 + G, N, 2]) of npu_grouped_dynamic_mx_quant."""
    m, n = x.shape
    ends = group_index.tolist()
    scale = torch.zeros(m // 64 + len(ends), n, 2, dtype=torch.uint8)
    codes, start = [], 0
    for g, end in enumerate(ends):
        first = start // 64 + g
        c, s = dynamic_mx_quant(x[start:end], axis=0, dst_type=dst_type, round_mode=round_mode,
                                scale_alg=scale_alg)
        codes.append(c)
        scale[first:first + s.shape[0]] = s
        scale[first + s.shape[0]:end // 64 + g + 1] = 127
        start = end
    return torch.cat(codes), scale


def dynamic_block_quant(x, min_scale=0.0, dst_type=1, row_block_size=1, col_block_size=128):
    """(y, scale) of npu_dynamic_block_quant: inv = min(qmax * (1 / amax), 1 / min_scale) per block,
    y = x * inv (int8: rounded half to even), scale = max(amax / qmax, min_scale)."""
    fp8 = {24: torch.float8_e4m3fn, 292: torch.float8_e4m3fn, 23: torch.float8_e5m2,
           291: torch.float8_e5m2}.get(dst_type)
    qmax = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}.get(fp8, 127.0)
    x3 = (x if x.dim() == 3 else x.unsqueeze(0)).float()
    b, r, c = x3.shape
    sr, sc = -(-r // row_block_size), -(-c // col_block_size)
    padded = F.pad(x3, (0, sc * col_block_size - c, 0, sr * row_block_size - r))
    blocks = padded.reshape(b, sr, row_block_size, sc, col_block_size)
    amax = blocks.abs().amax(dim=(2, 4))
    inv = torch.where(amax == 0, torch.zeros_like(amax),
                      torch.minimum(amax.reciprocal() * qmax,  # the golden's 127.0 / amax
                                    torch.tensor(min_scale, dtype=torch.float32).reciprocal()))
    scale = torch.where(amax == 0, torch.full_like(amax, max(0.0, min_scale)),
                        torch.clamp(amax / qmax, min=min_scale))
    full = inv.repeat_interleave(row_block_size, 1).repeat_interleave(col_block_size, 2)
    t = x3 * full[:, :r, :c]
    y = (t.clamp(-qmax, qmax).to(fp8) if fp8 is not None else
         torch.nan_to_num(torch.round(t), nan=0.0).clamp(-qmax, qmax).to(torch.int8))
    return (y if x.dim() == 3 else y[0]), (scale if x.dim() == 3 else scale[0])


def native_quant_matmul(x1, x2, scale, pertoken_scale=None, output_dtype=torch.bfloat16):
    """Dequantise-then-GEMM, the eager composition npu_quant_matmul replaces (fp32 GEMM of the
    codes, exact only while the sums stay below 2^24)."""
    y = (x1.float() @ x2.float()) * scale
    if pertoken_scale is not None:
        y = y * pertoken_scale.unsqueeze(-1)
    return y.to(output_dtype)


# ----------------------------------------------------------------------------- activations


def _halves(x, dim):
    a, b = torch.chunk(_up(x), 2, dim=dim)
    return a, b


def swiglu(x, dim=-1):
    a, b = _halves(x, dim)
    return F.silu(a) * b


def swiglu_backward(grad, x, dim=-1):
    a, b = _halves(x, dim)
    g = _up(grad)
    s = torch.sigmoid(a)
    da = g * b * (s + a.clamp(-200, 200) * s * (1 - s))  # limits at a = +-inf, as above
    db = g * a * s
    return torch.cat([da, db], dim=dim)


def native_swiglu(x, dim=-1):
    """Seed 000's TorchSwiGlu._swiglu."""
    x = torch.chunk(x, 2, dim)
    return F.silu(x[0]) * x[1]


def gelu(x, approximate=1):
    return F.gelu(x, approximate="tanh" if approximate == 1 else "none")


def geglu(x, dim=-1, approximate=1, activate_left=False):
    """(out, gelu_part): activate_left=False gives a * gelu(b), True gives gelu(a) * b."""
    a, b = _halves(x, dim)
    if activate_left:
        g = gelu(a, approximate)
        return g * b, g
    g = gelu(b, approximate)
    return a * g, g


def native_geglu(x, dim=-1, approximate=1, activate_left=False):
    a, b = torch.chunk(x, 2, dim)
    mode = "tanh" if approximate == 1 else "none"
    if activate_left:
        return F.gelu(a, approximate=mode) * b
    return a * F.gelu(b, approximate=mode)


def fast_gelu(x):
    """x * sigmoid(1.702 x) (= x / (1 + exp(-1.702 x)))."""
    xf = _up(x)
    return xf * torch.sigmoid(1.702 * xf)


def fast_gelu_backward(grad, x):
    """d/dx x * sigmoid(1.702 x); at x = +-inf its limits 1 and 0 (the product term, which
    vanishes for |x| > 200, is formed with x clamped there)."""
    xf = _up(x)
    s = torch.sigmoid(1.702 * xf)
    return _up(grad) * (s + 1.702 * xf.clamp(-200, 200) * s * (1 - s))


def native_fast_gelu(x):
    """The eager composition fast_gelu stands for."""
    return x * torch.sigmoid(1.702 * x)


def native_gelu(x):
    """Seed 000's 'torch原生' code for fast_gelu: nn.functional.gelu (a different function)."""
    return F.gelu(x)


# ----------------------------------------------------------------------------- rotary


def rotate(x, rotary_mode="half"):
    """rotate(x) of npu_rotary_mul: half cat(-x2, x1); interleave (-x[2i+1], x[2i])."""
    if rotary_mode == "half":
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


def rotate_transposed(g, rotary_mode="half"):
    """The adjoint of rotate: half cat(g2, -g1); interleave (g[2i+1], -g[2i])."""
    return -rotate(g, rotary_mode)


def rotary_mul(x, r1, r2, rotary_mode="half", rotate_matrix=None):
    xf, c, s = _up(x), _up(r1), _up(r2)
    rx = xf @ _up(rotate_matrix) if rotate_matrix is not None else rotate(xf, rotary_mode)
    return xf * c + rx * s


def _reduce_to(t, shape):
    return t.sum_to_size(shape)


def rotary_mul_backward(grad, x, r1, r2, rotary_mode="half"):
    g, xf, c, s = _up(grad), _up(x), _up(r1), _up(r2)
    dx = _reduce_to(g * c, x.shape) + _reduce_to(rotate_transposed(g * s, rotary_mode), x.shape)
    dr1 = _reduce_to(xf * g, r1.shape)
    dr2 = _reduce_to(rotate(xf, rotary_mode) * g, r2.shape)
    return dx, dr1, dr2


def native_rotary_mul(x, r1, r2):
    """Seed 000's torch_func for npu_rotary_mul ('half' mode)."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    x_new = torch.cat((-x2, x1), dim=-1)
    return r1 * x + r2 * x_new


# ----------------------------------------------------------------------------- fusion attention


def attention_to_bnsd(x, layout, head_dim=None, heads=-1):
    """A q/k/v-shaped tensor in `layout` (BSH, SBH, BSND, BNSD) viewed as [B, N, S, D].

    BSH/SBH need the head size `head_dim` to split H = N * D (and the head count `heads` when
    D is 0)."""
    if layout == "BSH":
        return x.unflatten(2, (heads, head_dim)).transpose(1, 2)
    if layout == "SBH":
        return x.unflatten(2, (heads, head_dim)).permute(1, 2, 0, 3)
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BNSD":
        return x
    raise ValueError(f"layout {layout!r}")


def attention_from_bnsd(x, layout):
    """The inverse of attention_to_bnsd: [B, N, S, D] -> `layout`."""
    if layout == "BSH":
        return x.transpose(1, 2).flatten(2)
    if layout == "SBH":
        return x.permute(2, 0, 1, 3).flatten(2)
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BNSD":
        return x
    raise ValueError(f"layout {layout!r}")


def _attention_bnsd(q, k, v, *, pse, mask_full, scale, sink, keep, keep_prob):
    """(out [B, N, Sq, Dv], softmax_max [B, N, Sq], softmax_sum [B, N, Sq]) for BNSD operands of
    the accumulator dtype; k/v may have fewer heads (GQA)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2)
    if pse is not None:
        s = s + pse
    s = s * scale
    b, n, sq, skv = s.shape
    masked = (torch.zeros(b, n, sq, skv, dtype=torch.bool) if mask_full is None
              else mask_full.expand(b, n, sq, skv))
    s = s.masked_fill(masked, float("-inf"))
    if sink is not None:  # one extra logit per head, no value row
        s = torch.cat([s, sink.to(s.dtype)[None, :, None, None].expand(b, n, sq, 1)], dim=-1)
        alive = torch.ones(b, n, sq, dtype=torch.bool)
    else:
        alive = ~masked.all(dim=-1)  # rows that see at least one key
    # Rows that see nothing: a finite stand-in keeps softmax (and its gradient) free of NaN; the
    # row is zeroed afterwards.
    safe = s.masked_fill(~alive[..., None], 0.0)
    row_max = (safe.amax(dim=-1, keepdim=True) if safe.shape[-1] > 0
               else safe.new_zeros(b, n, sq, 1))
    e = torch.exp(safe - row_max)
    row_sum = e.sum(dim=-1, keepdim=True)
    p = e / row_sum * alive[..., None]
    if sink is not None:
        p = p[..., :skv]
    if keep is not None:
        p = p * keep.to(p.dtype) / keep_prob
    out = p @ v
    neg_inf = torch.full_like(row_max, float("-inf"))
    softmax_max = torch.where(alive[..., None], row_max, neg_inf).squeeze(-1)
    softmax_sum = (row_sum * alive[..., None]).squeeze(-1)
    return out, softmax_max.detach(), softmax_sum.detach()


def attention_reference(q, k, v, head_num, layout, *, pse=None, mask_full=None, scale=1.0,
                        sink=None, keep=None, keep_prob=1.0, actual_seq_qlen=None,
                        actual_seq_kvlen=None):
    """(attention_out, softmax_max, softmax_sum) of npu_fusion_attention.

    out = Dropout(softmax(Mask(scale * (Q K^T + pse))), keep_prob) V per head; query head n uses
    key/value head n // (Nq // Nkv). `mask_full` is the complete bool visibility mask (True =
    masked out) broadcastable to [B, N, Sq, Skv], e.g. from full_visibility_mask; `keep` the
    0/1 dropout keep mask [B, N, Sq, Skv] (kept values are scaled by 1 / keep_prob); `sink`
    [N] one extra logit per softmax row. A row that sees no key gives 0, softmax_max -inf and
    softmax_sum 0.

    out is in `layout` (head size of value); the statistics are [B, N, Sq] (one copy, not 8).
    TND ([T, N, D]): actual_seq_qlen / actual_seq_kvlen are the cumulative ends (no leading 0,
    a trailing run of zeros ends the list), `mask_full` and `keep` are lists with one
    [N, sq_i, skv_i]-broadcastable tensor (or None) per sequence; tokens past the last end give
    0 output, and the statistics are [T, N] (token-major).
    """
    qf, kf, vf = _up(q), _up(k), _up(v)
    pf = _up(pse) if pse is not None else None
    sk = _up(sink) if sink is not None else None
    if layout == "TND":
        return _attention_tnd(qf, kf, vf, head_num, pf, mask_full, scale, sk, keep, keep_prob,
                              actual_seq_qlen, actual_seq_kvlen)
    d = q.shape[-1] // head_num if layout in ("BSH", "SBH") else q.shape[-1]
    kv_heads = k.shape[-1] // d if layout in ("BSH", "SBH") else None
    qb = attention_to_bnsd(qf, layout, d)
    kb = attention_to_bnsd(kf, layout, d)
    vb = attention_to_bnsd(vf, layout, v.shape[-1] // kv_heads if kv_heads else None,
                           kv_heads or -1)
    out, smax, ssum = _attention_bnsd(qb, kb, vb, pse=pf, mask_full=mask_full, scale=scale,
                                      sink=sk, keep=keep, keep_prob=keep_prob)
    return attention_from_bnsd(out, layout), smax, ssum


def _cumulative_to_spans(ends):
    """[(start, length)] of cumulative ends; a trailing run of zeros marks batches not computed."""
    spans, prev = [], 0
    for end in ends:
        if end < prev:  # the trailing zeros
            spans.append((prev, 0))
            continue
        spans.append((prev, end - prev))
        prev = end
    return spans


def _attention_tnd(q, k, v, head_num, pse, mask_full, scale, sink, keep, keep_prob, qlen, kvlen):
    assert pse is None, "pse is not supported with TND"
    t, n = q.shape[0], head_num
    outs, maxes, sums = [], [], []
    covered = 0
    for b, ((qs, sq), (ks, skv)) in enumerate(zip(_cumulative_to_spans(qlen),
                                                  _cumulative_to_spans(kvlen))):
        if sq == 0:
            continue
        qb = q[qs:qs + sq].permute(1, 0, 2)[None]
        kb = k[ks:ks + skv].permute(1, 0, 2)[None]
        vb = v[ks:ks + skv].permute(1, 0, 2)[None]
        m = mask_full[b] if mask_full is not None else None
        kp = keep[b] if keep is not None else None
        out, smax, ssum = _attention_bnsd(qb, kb, vb, pse=None, mask_full=m, scale=scale,
                                          sink=sink, keep=kp, keep_prob=keep_prob)
        outs.append(out[0].permute(1, 0, 2))
        maxes.append(smax[0].t())
        sums.append(ssum[0].t())
        covered = qs + sq
    rest = t - covered
    outs.append(q.new_zeros(rest, n, v.shape[-1]))
    maxes.append(torch.full((rest, n), float("-inf"), dtype=q.dtype))
    sums.append(torch.zeros(rest, n, dtype=q.dtype))
    return torch.cat(outs), torch.cat(maxes), torch.cat(sums)


def full_visibility_mask(sparse_mode, sq, skv, b=1, n=1, user_mask=None, pre=2147483647,
                         next=2147483647, prefix=None):  # noqa: A002 (torch_npu's name)
    """The complete bool mask [b, n, sq, skv] (True = masked out) npu_fusion_attention applies
    for `sparse_mode` when an atten_mask is given (modes 0-6; the TND modes 7/8 are modes 2-4
    per sequence). `user_mask` is the mask's content, used only where the mode reads it (0, 1,
    5), broadcastable to [b, n, sq, skv]. Built with triu/tril from the documented rules:
    0 user | outside the band i - pre <= j <= i + next; 1 user; 2 j > i; 3 j > i + shift;
    4 outside the band around i + shift; 5 user | (j > i + shift and j >= prefix[b]); 6 as 5
    without user; shift = skv - sq."""
    shift = skv - sq
    ones = torch.ones(sq, skv, dtype=torch.bool)
    lim = sq + skv + 1  # diagonals beyond this are all or nothing

    def above(c):  # j > i + c
        return torch.triu(ones, diagonal=max(min(c + 1, lim), -lim))

    def below(c):  # j < i - c
        return torch.tril(ones, diagonal=max(min(-c - 1, lim), -lim))

    user = torch.zeros(b, n, sq, skv, dtype=torch.bool)
    if user_mask is not None and sparse_mode in (0, 1, 5):  # the other modes do not read it
        user = user | user_mask.bool()
    if sparse_mode == 0:
        rule = above(next) | below(pre)
    elif sparse_mode == 1:
        rule = torch.zeros_like(ones)
    elif sparse_mode == 2:
        rule = above(0)
    elif sparse_mode == 3:
        rule = above(shift)
    elif sparse_mode == 4:
        rule = above(shift + next) | below(pre - shift)
    elif sparse_mode in (5, 6):
        cols = torch.arange(skv)
        rule = torch.stack([above(shift) & (cols >= prefix[i])[None] for i in range(b)])[:, None]
    else:
        raise ValueError(f"sparse_mode {sparse_mode}")
    return user | rule


def native_flash_attention_seed(query, key, value, atten_mask=None, scale=0.099, layout="BSH"):
    """Seed 000's TorchFlashAttention.supported_op_exec: BNSD inputs; the output is BSH
    ([B, S, N*D]), or BNSD with layout="BNSD"; masked positions get -inf. It runs in the inputs'
    dtype (the seed casts the fp32 softmax to float16, its dtype; here to query's dtype)."""
    qk = torch.matmul(query, key.transpose(2, 3)).mul(scale)
    if atten_mask is not None:
        qk.masked_fill_(atten_mask, torch.tensor(-float("inf")))
    softmax_res = torch.nn.functional.softmax(qk, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(softmax_res, value)
    if layout == "BNSD":
        return output
    output = output.transpose(1, 2)
    return output.reshape(output.shape[0], output.shape[1], -1)


# ----------------------------------------------------------------------------- confusion transpose
# Pure data movement: the oracle is exact in every dtype, so these run in the input dtype.


def confusion_transpose(x, perm, shape, transpose_first):
    """The contract's composition, materialised: permute then view, or view then permute."""
    if transpose_first:
        return x.permute(perm).contiguous().view(shape)
    return x.reshape(shape).permute(perm).contiguous()


def confusion_transpose_backward(grad, perm, shape, transpose_first):
    """The contract's backward: inv[perm[i]] = i; flag False: grad.view([shape[perm[i]]...])
    .permute(inv); True: grad.permute(inv).reshape(shape). Result shape `shape`."""
    perm = [p % len(perm) for p in perm]
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    if transpose_first:
        return grad.permute(inv).reshape(shape).contiguous()
    return grad.reshape([shape[p] for p in perm]).permute(inv).contiguous()


def native_confusion_transpose_1(data):
    """Seed 000, npu_confusion_transpose example one: BCHW -> (H, B, C*W) through a permute."""
    batch, channel, height, width = data.shape
    return torch.permute(data, (0, 2, 1, 3)).reshape(height, batch, channel * width)


def native_confusion_transpose_2(data):
    """Seed 000, example two: (B, H*C*W) transposed. Returns a view, as the seed does; the npu
    op materialises it (compare with `.contiguous()` of this)."""
    batch, channel, height, width = data.shape
    return data.view(batch, height * channel * width).transpose(1, 0)


# ----------------------------------------------------------------------------- scaled masked softmax

MASK_FILL = -10000.0  # torch_npu's golden fills masked positions with -10000, not -inf


def triu_mask(x):
    """fixed_triu_mask's mask over x's last two dims: True (masked) where column j > row i."""
    h, w = x.shape[-2:]
    return torch.ones(h, w, dtype=torch.bool, device=x.device).triu(diagonal=1)


def _softmax_mask(x, mask, fixed_triu_mask):
    return triu_mask(x) if fixed_triu_mask else mask.bool()


def scaled_masked_softmax(x, mask, scale=1.0, fixed_triu_mask=False):
    """softmax((x * scale).masked_fill(mask, -10000), dim=-1); mask True (nonzero) = masked out."""
    s = (_up(x) * scale).masked_fill(_softmax_mask(x, mask, fixed_triu_mask), MASK_FILL)
    return torch.softmax(s, dim=-1)


def scaled_masked_softmax_backward(y_grad, y, mask, scale, fixed_triu_mask=False):
    """scale * y * (dy - sum_last(dy * y)), zero at masked positions."""
    dy, yf = _up(y_grad), _up(y)
    dx = scale * yf * (dy - (dy * yf).sum(dim=-1, keepdim=True))
    return dx.masked_fill(_softmax_mask(y, mask, fixed_triu_mask), 0.0)


def native_scaled_masked_softmax(x, mask, scale=1.0):
    """Seed 000's 'torch原生' code for npu_scaled_masked_softmax (-inf fill: NaN rows where the
    mask covers a whole row, unlike torch_npu's -10000)."""
    return torch.softmax((x * scale).masked_fill(mask, -1 * torch.inf), dim=-1)


def native_scaled_masked_softmax_golden(x, mask, scale=1.0):
    """The contract's composition (torch_npu's golden, -10000 fill) in the input dtype."""
    return torch.softmax((x * scale).masked_fill(mask, MASK_FILL), dim=-1)


# ----------------------------------------------------------------------------- mixture of experts
# Index outputs are exact (int32 / int64 as the op returns them); float outputs are the fp32 oracle.


def moe_gating_top_k_softmax(x, finished=None, k=1):
    """(y, expert_idx, row_idx) of softmax(x) over the last dim. The ranking is torch_npu's
    golden: a stable descending sort (ties to the lower expert) of the probabilities as rounded
    to x's dtype; y holds the unrounded fp32 probabilities of the chosen experts."""
    p = torch.softmax(_up(x), dim=-1)
    ranked = p.to(x.dtype).to(p.dtype) if x.dtype in (torch.float16, torch.bfloat16) else p
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :k]
    y = p.gather(-1, order)
    expert_idx = order.to(torch.int32)
    if finished is not None:
        expert_idx = expert_idx.masked_fill(finished.unsqueeze(-1), x.shape[-1])
    rows = x.numel() // max(x.shape[-1], 1)
    row_idx = torch.arange(rows * k, dtype=torch.int32).view(k, rows).t().reshape(y.shape)
    return y, expert_idx, row_idx


def native_moe_gating(x, k):
    """The eager composition gating replaces: topk of the softmax, in x's dtype."""
    return torch.topk(torch.softmax(x, dim=-1), k, dim=-1)


def moe_init_routing(x, row_idx, expert_idx, active_num):
    """torch_npu's golden: a stable sort of expert_idx (row-major), expanded_row_idx the inverse
    of the sorted row_idx, expanded_x the first min(active_num, N) * k gathered rows of x."""
    n, k = expert_idx.shape
    sorted_experts, order = torch.sort(expert_idx.reshape(-1).long(), stable=True)
    dst_to_src = row_idx.reshape(-1).long()[order]
    expanded_row_idx = torch.empty(n * k, dtype=torch.int32)
    expanded_row_idx[dst_to_src] = torch.arange(n * k, dtype=torch.int32)
    expanded_x = x[dst_to_src[:min(active_num, n) * k] % max(n, 1)]
    return expanded_x, expanded_row_idx, sorted_experts.to(torch.int32)


def moe_compute_expert_tokens(sorted_experts, num_expert):
    """out[e] = the number of entries <= e."""
    bounds = torch.arange(num_expert, dtype=torch.long)
    return torch.searchsorted(sorted_experts.long(), bounds, right=True).to(sorted_experts.dtype)


def moe_finalize_routing(rows, skip1, skip2, bias, scales, src_to_dst, expert, drop_pad_mode=0,
                         k=1):
    """out[i] = skip1[i] + skip2[i] + sum_j scales[i, j] * (rows[src(i, j)] + bias[expert[i, j]]),
    src -1 (drop-pad modes) = a zero row. Without scales, k != 1 gives n = len(src) / k."""
    h = rows.shape[-1]
    flat = _up(rows).reshape(-1, h)
    k_arg = 1 if k is None else k
    if scales is not None:
        n, k = scales.shape
    elif k_arg != 1:
        n, k = src_to_dst.numel() // k_arg, k_arg
    elif expert is not None:
        n, k = expert.shape
    elif skip1 is not None or skip2 is not None:
        n = (skip1 if skip1 is not None else skip2).shape[0]
        k = src_to_dst.numel() // max(n, 1)
    else:
        n, k = src_to_dst.numel(), 1
    src = src_to_dst.long().view(n, k) if drop_pad_mode >= 2 else src_to_dst.long().view(k, n).t()
    terms = torch.cat([flat, flat.new_zeros(1, h)])[src.clamp(min=-1) % (flat.shape[0] + 1)]
    terms = torch.where((src >= 0).unsqueeze(-1), terms, 0.0)  # [n, k, h]
    if bias is not None:
        terms = terms + _up(bias).to(flat.dtype)[expert.long()]
    if scales is not None:
        terms = terms * _up(scales).to(flat.dtype).unsqueeze(-1)
    out = terms.sum(dim=1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + _up(skip)
    return out


def grouped_matmul(x, weight, bias=None, group_list=None, split_item=0, group_list_type=0):
    """npu_grouped_matmul's non-quantised paths, one matmul per group in fp32 (fp64 stays)."""
    single_weight = len(weight) == 1 and weight[0].dim() == 3
    ws = list(weight[0].unbind(0)) if single_weight else list(weight)
    bs = [None] * len(ws)
    if bias:
        bs = list(bias[0].unbind(0)) if single_weight else list(bias)
    if group_list is not None and len(x) == 1:
        values = [int(v) for v in group_list]
        sizes = values if group_list_type == 1 else [b - a for a, b in zip([0, *values[:-1]], values)]
        xs = list(x[0][:sum(sizes)].split(sizes))
        tail = x[0].shape[0] - sum(sizes)
    else:
        xs, tail = list(x), 0
    ys = []
    for xg, w, b in zip(xs, ws, bs):
        y = _up(xg) @ _up(w)
        ys.append(y if b is None else y + _up(b))
    if split_item >= 2:
        out = torch.cat([y.flatten(0, -2) for y in ys]) if ys else \
            _up(x[0]).new_zeros(0, ws[0].shape[-1] if ws else weight[0].shape[-1])
        return [torch.cat([out, out.new_zeros(tail, out.shape[-1])])]
    return ys


def moe_layer(x, w_gate, w13, w2, k, renormalize=True):
    """fp32 oracle of a Mixtral-style MoE layer: softmax top-k routing (optionally renormalised),
    expert e computes (silu(x @ w1_e) * (x @ w3_e)) @ w2_e with w13 = [w1 | w3] as [E, H, 2I]
    and w2 [E, I, H]; outputs are weighted by the routing probabilities and summed."""
    return native_moe_layer(_up(x), _up(w_gate), _up(w13), _up(w2), k, renormalize)


def native_moe_layer(x, w_gate, w13, w2, k, renormalize=True):
    """A plain PyTorch MoE layer (the Hugging Face Mixtral loop): gate, softmax in fp32, top-k,
    then per expert: gather its tokens, run its FFN, index_add_ the weighted rows back."""
    tokens, hidden = x.shape
    experts, inter = w13.shape[0], w13.shape[-1] // 2
    logits = x @ w_gate
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(x.dtype, torch.float32))
    weights, chosen = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    mask = F.one_hot(chosen, experts).permute(2, 1, 0)  # [E, k, T]
    for e in range(experts):
        slot, token = torch.where(mask[e])
        if token.numel() == 0:
            continue
        h = x[token] @ w13[e]
        h = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, token, (h @ w2[e]) * weights[token, slot, None])
    return out


def native_moe_finalize_routing(rows, skip1, scales, src_to_dst):
    """The eager composition finalize replaces (dropless, column-major rows, no bias):
    skip1 + sum_j scales[:, j] * rows[src_to_dst[j * N + i]], in rows' dtype."""
    n, k = scales.shape
    terms = rows[src_to_dst.long()].view(k, n, rows.shape[-1])
    return skip1 + (terms * scales.t().unsqueeze(-1).to(rows.dtype)).sum(0)
# ----------------------------------------------------------------------------- FFN

FFN_GLU = ("geglu", "swiglu", "reglu")


def ffn_activation(h, activation):
    """npu_ffn's activations; GLU forms take halves a | b of the last dim and give a * act(b)."""
    def act(z, name):
        if name in ("fastgelu",):
            return z * torch.sigmoid(1.702 * z)
        if name in ("gelu", "geglu"):
            return F.gelu(z, approximate="tanh")
        if name in ("relu", "reglu"):
            return F.relu(z)
        return F.silu(z)

    if activation in FFN_GLU:
        a, b = torch.chunk(h, 2, dim=-1)
        return a * act(b, activation)
    return act(h, activation)


def ffn_expert_offsets(m, expert_tokens=None, expert_tokens_index=None):
    """Row offsets (E + 1) from per-expert counts or their cumulative ends; [0, m] without."""
    if expert_tokens is not None:
        offsets = [0]
        for n in expert_tokens:
            offsets.append(offsets[-1] + int(n))
        return offsets
    if expert_tokens_index is not None:
        return [0, *(int(n) for n in expert_tokens_index)]
    return [0, m]


def ffn_deq_scale(t):
    """deq_scale as float64 values: int64 / uint64 hold torch_npu's packed form (the float32 bits
    of the scale, masked to 19 significant bits, in the low 32 bits)."""
    if t.dtype in (torch.int64, torch.uint64):
        low = (t.view(torch.int64) & 0xFFFFE000).to(torch.int32)  # wraps into int32's range
        return low.view(torch.float32).double()
    return t.double()


def _per_expert(t, e, experts):
    """Expert e's row of a per-expert parameter ([E, ...] with experts, shared without)."""
    if t is None:
        return None
    return t[e] if experts else t


def ffn(x, weight1, weight2, activation, *, expert_tokens=None, expert_tokens_index=None,
        bias1=None, bias2=None, scale=None, offset=None, deq_scale1=None, deq_scale2=None,
        antiquant_scale1=None, antiquant_scale2=None, antiquant_offset1=None,
        antiquant_offset2=None, inner_precise=None, output_dtype=None,
        round_intermediate=True, compute_dtype=torch.float64):
    """The npu_ffn oracle, one expert at a time, in float64 (or `compute_dtype`, for shapes
    where float64 is too slow), output unrounded.

    Float paths: ``act(x @ W1 + b1) @ W2 + b2``; with ``round_intermediate`` the intermediate
    is rounded to x's dtype before the second GEMM (what npu_ffn's second GEMM takes, and what
    the native composition does too), otherwise kept exact. Weight-only: ``W' = round(round(W +
    antiquant_offset) * antiquant_scale)`` in x's dtype, and the intermediate is never rounded
    (op-plugin's golden in test_npu_ffn: both GEMMs in float32). Quantised (int8 x), with the
    rounding points of op-plugin's golden (O = the output dtype, round_O = rounded to O):
    ``h = round_O(round_O((x @ W1 + b1) * deq_scale1) activated)``, ``q = round(round_O(
    round_O(h * round_O(scale)) + round_O(offset)))`` half to even, clamped to [-128, 127],
    then ``round_O(q @ W2 + b2) * deq_scale2``.
    """
    cd = compute_dtype
    lead, k1 = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k1)
    m = x2.shape[0]
    experts = weight1.dim() == 3
    offsets = ffn_expert_offsets(m, expert_tokens, expert_tokens_index)
    quant = x.dtype == torch.int8
    out = torch.zeros(m, weight2.shape[-1], dtype=cd)
    for e in range(len(offsets) - 1):
        rows = x2[offsets[e]:offsets[e + 1]].to(cd)
        w1, w2 = (weight1[e], weight2[e]) if experts else (weight1, weight2)
        w1, w2 = w1.to(cd), w2.to(cd)
        b1, b2 = _per_expert(bias1, e, experts), _per_expert(bias2, e, experts)
        if quant:
            od = output_dtype if output_dtype is not None else (
                torch.bfloat16 if deq_scale1.dtype == torch.bfloat16 else torch.float16)

            def r(t):  # rounded to the output dtype, back in the compute dtype
                return t.to(od).to(cd)

            h = rows @ w1 + (b1.to(cd) if b1 is not None else 0)
            deq1 = ffn_deq_scale(_per_expert(deq_scale1, e, experts)).to(cd)
            z = r((h * deq1).float()).float()
            # act(-inf) = its limit 0 (the formula's -inf * 0 is NaN): an fp16 overflow
            a = ffn_activation(z, activation)
            h = r(a if activation in FFN_GLU else torch.where(torch.isneginf(z), 0.0, a))
            s = scale[e] if experts and scale.dim() == 1 else _per_expert(scale, e, experts)
            o = (offset[e] if experts else offset[0]).to(cd) if offset is not None else 0.0
            o = r(torch.as_tensor(o, dtype=cd))
            q = torch.round(r(r(h * r(s.to(cd))) + o)).clamp(-128, 127)
            y = q @ w2 + (b2.to(cd) if b2 is not None else 0)
            deq2 = ffn_deq_scale(_per_expert(deq_scale2, e, experts)).to(cd)
            out[offsets[e]:offsets[e + 1]] = r(y) * deq2
            continue
        if weight1.dtype == torch.int8:
            ws = []
            for w, sc, off in ((w1, antiquant_scale1, antiquant_offset1),
                               (w2, antiquant_scale2, antiquant_offset2)):
                sc, off = _per_expert(sc, e, experts), _per_expert(off, e, experts)
                if off is not None:
                    w = (w + off.to(cd)).to(x.dtype).to(cd)
                w = w * sc.to(cd)
                ws.append(w.to(x.dtype).to(cd))
            w1, w2 = ws
        h = rows @ w1 + (b1.to(cd) if b1 is not None else 0)
        h = ffn_activation(h, activation)
        if round_intermediate and weight1.dtype != torch.int8:
            h = h.to(x.dtype).to(cd)
        out[offsets[e]:offsets[e + 1]] = h @ w2 + (b2.to(cd) if b2 is not None else 0)
    return out.reshape(*lead, weight2.shape[-1])


def native_ffn(x, weight1, weight2, activation, *, expert_tokens=None, bias1=None, bias2=None):
    """The eager composition npu_ffn replaces (aclnnFFN's "小算子" loop), in the input dtype:
    per expert, ``act(x_e @ W1_e + b1_e) @ W2_e + b2_e``."""
    if weight1.dim() == 2:
        h = ffn_activation(F.linear(x, weight1.t(), bias1), activation)
        return F.linear(h, weight2.t(), bias2)
    outs, start = [], 0
    for e, n in enumerate(expert_tokens):
        rows = x[start:start + n]
        start += n
        b1 = bias1[e] if bias1 is not None else None
        b2 = bias2[e] if bias2 is not None else None
        h = ffn_activation(F.linear(rows, weight1[e].t(), b1), activation)
        outs.append(F.linear(h, weight2[e].t(), b2))
    return torch.cat(outs)
