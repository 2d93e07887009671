"""The portable path: every torch.ops.npu op as a composition of ATen ops, for devices without a
native opennpu kernel (CUDA, XPU, MPS), and as its Inductor decomposition there.

Where it sits in the dispatcher
    CPU          the C++ kernels (csrc/ops/<family>/<family>_cpu.cpp), unchanged
    npu          PrivateUse1 runs the CPU kernels on the same host bytes (csrc/device), unchanged
    CUDA/XPU/MPS the functions below, registered from Python for each of those dispatch keys
                 that has no native kernel (a *_cuda.cu kernel, once built, wins), so the
                 Autograd formulas of the family modules (register_autograd) apply unchanged:
                 autograd calls the backward op, which lands here too
    torch.compile a decomposition in Inductor's table per op: it traces the function below into
                 the graph when the inputs are on a portable device (so Inductor fuses it with its
                 neighbours into Triton kernels) and returns NotImplemented on CPU / npu, where the
                 op stays one fused extern kernel (registered by us: Inductor refuses an
                 implicit fallback for an op that has a decomposition). Both are registered when
                 Inductor's modules are first imported, so `import opennpu` stays light

Numerics follow the CPU kernels' contract: fp16 / bf16 are computed in float32 (float64 stays
float64) and every output is rounded once to its dtype; the quantisers round half to even and
send NaN quotients to code 0; add_rms_norm rounds the residual sum to x1's dtype before it
normalises it, add_rms_norm_dynamic_quant does not; masked softmax fills with -10000.

The compositions are written for the device of their inputs (no CPU-only tensor constructors,
no host synchronisation except where an argument is data that decides shapes: a Tensor
group_list of npu_grouped_matmul), and stay traceable under torch.compile(fullgraph=True).
They are deliberately independent of opennpu.testing.reference (the test oracles): the tests
compare the two, so a shared bug cannot hide.

Host-side pieces: dropout (keep_prob < 1) in npu_fusion_attention and its grad draws its keep
mask from opennpu's Philox generator through the CPU kernel of _npu_dropout_gen_mask (the same
bits and generator offsets as on CPU) and copies it to the device; _npu_dropout_gen_mask itself
does the same. Those calls, and npu_grouped_matmul with a Tensor group_list (sizes read on the
host), are not decomposed under torch.compile: the op stays in the graph and runs eagerly.
npu_grouped_matmul's A4W4 path and A8W4's offset are unimplemented on every device
(NotImplementedError).

force(): the switch tests use to run the portable path on CPU tensors. Inside it the portable
functions are also registered for the CPU key (torch.library, allow_override), and the
decompositions accept CPU inputs; leaving it deregisters them, which restores the C++ kernels.
OPENNPU_FORCE_PORTABLE=1 turns it on for the whole process at import. The normal path pays
nothing: no Python runs in front of the C++ CPU kernels unless forced.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import math
import os
import sys
import warnings

import torch
import torch.nn.functional as F

from . import flash_route
from .portable_optim import KERNELS as _optim_kernels
from .portable_optim import acc_dtype as _acc
from .quant import _FP8_MAX, HIF8, HIF8_MAX, _code_shape, _fp8_of, _is_int4, _quantize_out
from .quant import _QMM_E8M0_CODES, _qmm_float_kind, _transposed, _type_code

PORTABLE_KEYS = ("CUDA", "XPU", "MPS")
# qualname -> the device types whose kernel is the portable one (decomposed under compile); CPU,
# npu and any device with a native C++ kernel keep the fused op.
PORTABLE_DEVICES: dict[str, frozenset] = {}

IMPLS: dict[str, object] = {}  # "ns::name[.overload]" -> the portable function
# Run eagerly, never traced into graphs (npu_add_rms_norm_v2 writes its inputs: under
# torch.compile it is functionalised, and its functional form is decomposed).
NOT_DECOMPOSED = {"npu::_npu_dropout_gen_mask.Tensor", "npu::npu_fused_infer_attention_score.out",
                  "npu::npu_fused_infer_attention_score_v2.out",
                  "npu::npu_fusion_attention_v3.out", "npu::npu_fusion_attention_grad_v3.out",
                  "npu::npu_add_rms_norm_v2"}
# Ops whose portable form plans its copies from index data read on the host (the KV-cache ops),
# or reads its parameters' .grad (the fused optimizers): run eagerly, never traced into graphs,
# and unlike _npu_dropout_gen_mask forced onto CPU too.
HOST_SIDE: set[str] = set()
# Ops that write into their arguments: their kernel is the function itself (it returns the
# argument it wrote, not a copy).
MUTATING: set[str] = set()
# Calls whose composition would read tensor data on the host to decide shapes: the decomposition
# declines them (the op stays in the graph and runs its portable kernel eagerly).
# Dropout in attention draws from opennpu's host-side generator, so it is not traced either.
DECLINED = {
    "npu::npu_grouped_matmul": lambda args, kwargs: isinstance(kwargs.get("group_list"),
                                                                torch.Tensor),
    "npu::npu_fusion_attention": lambda args, kwargs: _argument(
        "npu::npu_fusion_attention", args, kwargs, "keep_prob", 1.0) < 1.0,
    "npu::npu_fusion_attention_grad": lambda args, kwargs: kwargs.get("keep_prob", 1.0) < 1.0,
    "npu::npu_fusion_attention_v2": lambda args, kwargs: kwargs.get("keep_prob", 1.0) < 1.0,
    "npu::npu_fusion_attention_grad_v2": lambda args, kwargs: kwargs.get("keep_prob", 1.0) < 1.0,
    # v3: sequence lengths are host tensors (read for the loop over sequences), seed / offset too
    "npu::npu_fusion_attention_v3": lambda args, kwargs: _argument(
        "npu::npu_fusion_attention_v3", args, kwargs, "keep_prob", 1.0) < 1.0 or _argument(
        "npu::npu_fusion_attention_v3", args, kwargs, "actual_seq_qlen", None) is not None,
    "npu::npu_fusion_attention_grad_v3": lambda args, kwargs: (
        kwargs.get("keep_prob", 1.0) < 1.0 or kwargs.get("actual_seq_qlen") is not None),
    "npu::npu_grouped_dynamic_mx_quant": lambda args, kwargs: True,  # group sizes read on host
    # a multinomial draw from a caller's generator runs eagerly
    "npu::npu_top_k_top_p_sample": lambda args, kwargs: _argument(
        "npu::npu_top_k_top_p_sample", args, kwargs, "post_sample", "qSample") == "multiNomial",
}


def _argument(qualname, args, kwargs, name, default):
    """The value of argument `name` of a call (positional or keyword)."""
    if name in kwargs:
        return kwargs[name]
    names = [a.name for a in _overload(qualname)._schema.arguments]
    index = names.index(name)
    return args[index] if index < len(args) else default
_forced = 0


def _portable(qualname):
    def register(fn):
        IMPLS[qualname] = fn
        return fn

    return register


def _up(t):
    return t.to(_acc(t.dtype))


def _reduce_dims(x, trailing):
    return tuple(range(x.dim() - trailing, x.dim()))


# ----------------------------------------------------------------------------- norm


def _rms(xf, gamma, epsilon):
    """(x * rstd * gamma, rstd) in xf's (accumulator) dtype; rstd keeps gamma's dims as 1."""
    rstd = torch.rsqrt(xf.square().mean(dim=_reduce_dims(xf, gamma.dim()), keepdim=True) + epsilon)
    return xf * rstd * gamma.to(xf.dtype), rstd


@_portable("npu::npu_rms_norm")
def npu_rms_norm(self, gamma, epsilon=1e-6):
    y, rstd = _rms(_up(self), gamma, epsilon)
    return y.to(self.dtype), rstd


@_portable("npu::npu_gemma_rms_norm")
def npu_gemma_rms_norm(self, gamma, epsilon=1e-6):
    y, rstd = _rms(_up(self), gamma.to(_acc(self.dtype)) + 1, epsilon)
    return y.to(self.dtype), rstd


@_portable("npu::npu_rms_norm_backward")
def npu_rms_norm_backward(dy, self, gamma, rstd):
    acc = _acc(self.dtype)
    g, x, w, r = dy.to(acc), self.to(acc), gamma.to(acc), rstd.to(acc)
    dims = _reduce_dims(x, gamma.dim())
    gw = g * w
    dx = gw * r - x * r.pow(3) * (gw * x).mean(dim=dims, keepdim=True)
    lead = tuple(range(x.dim() - gamma.dim()))
    dgamma = g * x * r
    if lead:
        dgamma = dgamma.sum(dim=lead)
    return dx.to(self.dtype), dgamma.reshape(gamma.shape)


@_portable("npu::npu_add_rms_norm")
def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    x = (x1 + x2).to(x1.dtype)  # rounded before it is normalised (torch_npu's golden)
    y, rstd = _rms(_up(x), gamma, epsilon)
    return y.to(x1.dtype), rstd, x


@_portable("npu::npu_add_rms_norm_cast")
def npu_add_rms_norm_cast(x1, x2, gamma, epsilon=1e-6):
    x = (x1 + x2).to(x1.dtype)
    y, rstd = _rms(_up(x), gamma, epsilon)
    return y, y.to(x1.dtype), rstd, x


@_portable("npu::npu_add_rms_norm_v2")
def npu_add_rms_norm_v2(x1, x2, gamma, epsilon=1e-6):
    rstd, y, x = npu_add_rms_norm_v2_functional(x1, x2, gamma, epsilon)
    x1.copy_(y)
    x2.copy_(x)
    return rstd


@_portable("npu::npu_add_rms_norm_v2_functional")
def npu_add_rms_norm_v2_functional(x1, x2, gamma, epsilon=1e-6):
    y, rstd, x = npu_add_rms_norm(x1, x2, gamma, epsilon)
    return rstd.float(), y, x


def _add_rms_norm_inplace(x1, x2, gamma, epsilon=1e-6):
    y, rstd, x = npu_add_rms_norm(x1, x2, gamma, epsilon)
    x2.copy_(x)
    return y.contiguous(), rstd.contiguous()


# Writes x2 (its kernel is the function itself); only ever put into post-grad graphs.
NOT_DECOMPOSED.add("opennpu::_add_rms_norm_inplace")
MUTATING.add("opennpu::_add_rms_norm_inplace")
_portable("opennpu::_add_rms_norm_inplace")(_add_rms_norm_inplace)


# ----------------------------------------------------------------------------- quantisation


def _quantize(v, qmax, int4, per_tensor):
    """(codes int8 / packed int32, scale float32) of float32 v: scale = absmax / qmax (0 -> 1),
    codes = clamp(round_half_even(v / scale)), NaN quotients -> 0."""
    if per_tensor:  # an empty tensor's absmax is 0 (scale 1)
        absmax = torch.cat([v.abs().reshape(-1), v.new_zeros(1)]).amax().reshape(1)
    else:
        absmax = v.abs().amax(dim=-1)
    scale = absmax / qmax
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    s = scale if per_tensor else scale.unsqueeze(-1)
    lo, hi = (-8, 7) if int4 else (-128, 127)
    codes = torch.nan_to_num(torch.round(v / s), nan=0.0).clamp(lo, hi).to(torch.int8)
    return (_pack_int4(codes) if int4 else codes), scale


def _quantize_code(dtype):
    return dtype if isinstance(dtype, int) else -1


def _hif8_encode(v):
    """float32 -> hifloat8 codes (uint8), csrc/ops/quant/hifloat8.h's rules on the float32 bits:
    a normal binade [2^e, 2^(e+1)), e in [-15, 15], keeps m = 3 / 3 / 3 / 2 / 1 mantissa bits
    for |e| = 0 / 1 / 2-3 / 4-7 / 8-15, rounded half away from zero (a carry moves to 2^(e+1));
    below 2^-15 the codes are 2^-22 .. 2^-16, reached from 1.5 * 2^e up ([2^-23, 2^-22) -> 2^-22,
    smaller -> 0); 2^16 and up (after rounding), and inf, -> +-inf (0x6F / 0xEF); NaN -> 0x80;
    anything that rounds to 0 -> 0x00."""
    bits = v.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mag = bits & 0x7FFFFFFF
    e0 = (mag >> 23) - 127  # float32 subnormals: -127
    mant = mag & 0x7FFFFF
    a = e0.abs()
    mbits = torch.where(a >= 8, 1, torch.where(a >= 4, 2, 3))
    r = (mant + (1 << (22 - mbits))) >> (23 - mbits)  # half an ulp added, truncated
    carry = r >> mbits
    e = e0 + carry
    r = r * (1 - carry)
    b = e.abs()
    s = (e < 0).to(torch.int64)  # the exponent's sign bit
    normal = torch.where(b == 0, 0x08 | r, torch.where(
        b == 1, 0x10 | (s << 3) | r, torch.where(
            b <= 3, 0x20 | (s << 4) | ((b & 1) << 3) | r, torch.where(
                b <= 7, 0x40 | (s << 4) | ((b & 3) << 2) | r,
                0x60 | (s << 4) | ((b & 7) << 1) | r))))
    normal = torch.where(e > 15, 0x6F, normal)
    m = torch.where(e0 == -23, 1, e0 + 23 + (mant >> 22))  # subnormal code 2^(m - 23)
    sub = torch.where(m == 8, 0x7E, m)  # 2^-15: the smallest normal
    code = torch.where(e0 < -23, 0, torch.where(e0 < -15, sub, normal))
    code = torch.where(mag >= 0x7F800000, 0x6F, code)
    code = torch.where(code != 0, code | ((bits >> 31) << 7), code)
    return torch.where(mag > 0x7F800000, 0x80, code).to(torch.uint8)


def _pack_int4(codes):
    """int8 codes in [-8, 7] -> int32 words holding 8 each, code k in bits [4k, 4k + 4)."""
    nibbles = (codes.to(torch.int64) & 0xF).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    words = (nibbles << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@_portable("npu::npu_dynamic_quant")
def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None,
                      quant_mode="pertoken", dst_type_max=0.0):
    v = input.float()
    if smooth_scales is not None:
        sm = smooth_scales.float()
        if group_index is not None:  # rows [ends[g-1], ends[g]) use smooth_scales[g]
            rows = v.reshape(-1, v.shape[-1])
            row = torch.arange(rows.shape[0], device=v.device)
            group = torch.searchsorted(group_index.to(torch.int64).contiguous(), row, right=True)
            v = (rows * sm[group.clamp(max=sm.shape[0] - 1)]).reshape(v.shape)
        else:
            v = v * sm
    fp8 = _fp8_of(dst_type)
    hif8 = dst_type == HIF8
    if fp8 is not None or hif8:  # scale = amax * (1 / qmax) (CANN's golden), y = fp8(v / scale)
        per_tensor = quant_mode == "pertensor"
        amax = (torch.cat([v.abs().reshape(-1), v.new_zeros(1)]).amax().reshape(1) if per_tensor
                else v.abs().amax(dim=-1))
        qmax = dst_type_max or (HIF8_MAX if hif8 else _FP8_MAX[fp8])
        scale = amax * torch.full((), 1.0 / qmax, device=v.device)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        t = v / (scale if per_tensor else scale.unsqueeze(-1))
        return (_hif8_encode(t) if hif8 else t.to(fp8)), scale
    int4 = _is_int4(dst_type)
    qmax = dst_type_max or (7.0 if int4 else 127.0)
    return _quantize(v, qmax, int4, quant_mode == "pertensor")


@_portable("npu::npu_add_rms_norm_dynamic_quant")
def npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None,
                                   beta=None, epsilon=1e-6, output_mask=None, y_dtype=None):
    x = x1.float() + x2.float()  # the float32 sum, normalised unrounded (torch_npu's golden)
    y, _ = _rms(x, gamma, epsilon)
    if beta is not None:
        y = y + beta.float()
    if output_mask is None:
        on = (True, smooth_scale1 is not None and smooth_scale2 is not None)
    else:
        on = (bool(output_mask[0]), bool(output_mask[1]))
    int4 = _is_int4(y_dtype)
    outs = []
    for enabled, smooth in zip(on, (smooth_scale1, smooth_scale2)):
        if enabled:
            outs.append(_quantize(y if smooth is None else y * smooth.float(),
                                  7.0 if int4 else 127.0, int4, False))
        else:  # a disabled branch gives 0-dim tensors
            outs.append((x1.new_zeros((), dtype=torch.int32 if int4 else torch.int8),
                         x1.new_zeros((), dtype=torch.float32)))
    return outs[0][0], outs[1][0], x.to(x1.dtype), outs[0][1], outs[1][1]


def _unpack_int4(words):
    """int32 words -> their eight int4 codes (sign-extended, lowest bits first), last dim x 8."""
    shifts = torch.arange(28, -4, -4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) << shifts) >> 28).flatten(-2)


_QMM_DTYPES = {None: torch.int8, 1: torch.int8, 3: torch.int32, 5: torch.float16,
               15: torch.bfloat16}


@_portable("npu::npu_quant_matmul")
def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                     output_dtype=None, x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None,
                     scale_dtype=None, group_sizes=None, y_scale=None):
    if x1.dtype == torch.int8 and x2.dtype == torch.int32 and y_scale is None:
        out_dtype = output_dtype if isinstance(output_dtype, torch.dtype) else \
            _QMM_DTYPES[output_dtype]
        return _a8w4(x1, x2, scale, offset, pertoken_scale, out_dtype)
    kind1, kind2 = _qmm_float_kind(x1, x1_dtype), _qmm_float_kind(x2, x2_dtype)
    if kind1 is not None and kind2 is not None and y_scale is None and offset is None:
        return _float_quant_matmul(x1, x2, scale, pertoken_scale, bias, output_dtype, kind1,
                                   kind2, scale_dtype, pertoken_scale_dtype, group_sizes)
    if y_scale is not None or (group_sizes is not None and any(group_sizes)):
        raise NotImplementedError("npu_quant_matmul: per-group / MX scaling (group_sizes, "
                                  "y_scale) is not implemented by opennpu")
    if x1.dtype == torch.int32:  # int4 words; x2 [k, n / 8] or the transpose [k / 8, n]
        a = _unpack_int4(x1)
        w = _unpack_int4(x2) if x2.shape[-2] == a.shape[-1] else _unpack_int4(x2.mT).mT
    else:
        a, w = x1, x2
    acc = torch.matmul(a.double(), w.double())  # exact: |sums| < 2^53
    out_dtype = output_dtype if isinstance(output_dtype, torch.dtype) else \
        _QMM_DTYPES[output_dtype]
    return _dequantise(acc, scale, offset, pertoken_scale, bias, out_dtype)


_QMM_FLOAT_OUT = {None: None, 5: torch.float16, 6: torch.float32, 15: torch.bfloat16}


def _float_operand(t, kind):
    """float8 / hifloat8 / float4 codes of npu_quant_matmul as float32 (exact), in t's logical
    shape (float4: the packed dim doubled: the last, or the one before for a transpose)."""
    if kind == "hif8":
        return _hif8_values(t.view(torch.uint8).long())
    if kind not in ("fp4", "fp4_e1m2"):
        return t.view(kind).float()
    trans = _transposed(t)
    b = (t.mT if trans else t).view(torch.uint8).long()
    values = _fp4_values if kind == "fp4" else _e1m2_values
    v = torch.stack([values(b & 15), values(b >> 4)], -1).flatten(-2)
    return v.mT if trans else v


def _fp4_values(c):
    """float4_e2m1 codes (int64 nibbles) as float32, computed rather than looked up (no constant
    tensor to move to the device): sign bit 3, exponent bits 1-2 with bias 1, mantissa bit 0;
    exponent 0 is subnormal (0 or 0.5). The values: +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}."""
    e, m = (c >> 1) & 3, (c & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2((e - 1).float()) * (1 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag)


def _e1m2_values(c):
    """float4_e1m2 codes (int64 nibbles) as float32: sign bit 3, exponent bit 2 with bias 1,
    mantissa bits 0-1: +-{0, 0.25, ..., 1.75}, multiples of 0.25."""
    mag = (c & 7).float() * 0.25
    return torch.where((c & 8) != 0, -mag, mag)


def _hif8_values(c):
    """hifloat8 codes (int64 bytes) as float32 (csrc/ops/quant/quant_matmul.h, FloatCode::kHif8):
    sign bit 7; dot field '11' / '10' / '01' / '001' / '0001' (exponent widths 4 / 3 / 2 / 1 / 0,
    mantissa widths 1 / 2 / 3 / 3 / 3), '0000' subnormal 2^(M - 23); the exponent sign-magnitude
    with an implicit leading 1; 0x80 NaN, 0x6F / 0xEF +-inf."""
    dot = (c >> 3) & 15
    d = torch.where(dot >= 12, 4, torch.where(dot >= 8, 3, torch.where(
        dot >= 4, 2, torch.where(dot >= 2, 1, 0))))
    mbits = torch.where(d == 4, 1, torch.where(d == 3, 2, 3))
    mant = c & ((1 << mbits) - 1)
    field = (c >> mbits) & ((1 << d) - 1)
    half = torch.where(d > 0, 1 << (d - 1).clamp(min=0), 0)
    magnitude = half | (field & (half - 1).clamp(min=0))
    e = torch.where((d > 0) & ((field >> (d - 1).clamp(min=0)) & 1 == 1), -magnitude, magnitude)
    v = torch.exp2(e.float()) * (1 + mant.float() / (1 << mbits).float())
    v = torch.where(dot == 0, torch.exp2(((c & 7) - 23).float()) * ((c & 7) != 0), v)
    v = torch.where((c & 128) != 0, -v, v)
    v = torch.where((c & 127) == 0x6F, torch.where((c & 128) != 0, -torch.inf, torch.inf), v)
    return torch.where(c == 0x80, torch.nan, v)


def _qmm_block_groups(x1, x2, scale, pertoken, group_sizes, m, k, n):
    """npu_quant_matmul's per-block float32 scales (csrc/ops/quant/quant_matmul.cpp,
    is_block_mode): their group sizes [gm, gn, gk], or None for per-tensor / channel / token."""
    named = group_sizes is not None and any(group_sizes)
    if not named and (pertoken is None or pertoken.dim() < 2 or scale.dim() < 2 or
                      pertoken.dim() != x1.dim() or scale.dim() != x2.dim()):
        return None
    g = list(group_sizes) if group_sizes is not None else [0, 0, 0]
    g = [g[0] or (1 if pertoken is not None and pertoken.shape[-2] == m else 128),
         g[1] or 128, g[2] or 128]
    fits = pertoken is not None and \
        tuple(pertoken.shape[-2:]) == (-(-m // g[0]), -(-k // g[2])) and \
        tuple(scale.shape[-2:]) == (-(-k // g[2]), -(-n // g[1]))
    per_token = pertoken is not None and pertoken.dim() == 2 and \
        tuple(pertoken.shape) == (m, 1) and scale.dim() == 2 and scale.shape[0] == 1 and \
        scale.shape[1] in (1, n)
    if not named and per_token and not fits:
        return None
    if not fits or g[0] not in (1, 128) or g[1:] != [128, 128]:
        raise RuntimeError(f"npu_quant_matmul: per-block scales must be pertoken_scale [m or "
                           f"ceil(m / 128), ceil(k / 128)] and scale [ceil(k / 128), ceil(n / "
                           f"128)] (group_sizes [1 or 128, 128, 128]), but got group_sizes "
                           f"{group_sizes}")
    return g


def _block_scaled_matmul(a, w, s1, s2, g):
    """The per-block golden: sum over K blocks of fp32((P_kb * s1) * s2), in order, in fp32."""
    gm, gn, gk = g
    m, k, n = a.shape[-2], a.shape[-1], w.shape[-1]
    acc = None
    for kb in range(-(-k // gk)):
        p = torch.matmul(a[..., kb * gk:(kb + 1) * gk], w[..., kb * gk:(kb + 1) * gk, :])
        r = s1[..., kb].float().repeat_interleave(gm, -1)[..., :m].unsqueeze(-1)
        c = s2[..., kb, :].float().repeat_interleave(gn, -1)[..., :n].unsqueeze(-2)
        t = p * r * c
        acc = t + 0.0 if acc is None else acc + t
    if acc is None:
        acc = torch.zeros(*torch.broadcast_shapes(a.shape[:-2], w.shape[:-2]), m, n,
                          device=a.device)
    return acc


def _e8m0(t):
    """float8_e8m0 codes as float32: 2^(code - 127), 255 NaN."""
    return t.view(torch.uint8).view(torch.float8_e8m0fnu).float()


def _float_quant_matmul(x1, x2, scale, pertoken, bias, output_dtype, kind1, kind2, scale_dtype,
                        pertoken_dtype, group_sizes=None):
    """npu_quant_matmul's float8 / MX paths (csrc/ops/quant/quant_matmul.h): the decoded
    operands (MX: times their e8m0 block scales of 32 along k) multiplied in float32, then
    * scale (* pertoken) (+ bias), rounded once."""
    out_dtype = output_dtype if isinstance(output_dtype, torch.dtype) else \
        _QMM_FLOAT_OUT[output_dtype]
    a, w = _float_operand(x1, kind1), _float_operand(x2, kind2)
    k = a.shape[-1]
    mx = _type_code(scale_dtype) in _QMM_E8M0_CODES or (
        scale_dtype is None and scale.dtype == torch.float8_e8m0fnu)
    if mx:  # pertoken [*, m, ceil(k / 64), 2], scale [*, ceil(k / 64), n, 2]
        sa = _e8m0(pertoken).flatten(-2).repeat_interleave(32, -1)[..., :k]
        sw = _e8m0(scale).transpose(-1, -2).flatten(-3, -2).repeat_interleave(32, -2)[..., :k, :]
        acc = torch.matmul(a * sa, w * sw)
        y = acc
    elif (g := _qmm_block_groups(x1, x2, scale, pertoken, group_sizes, a.shape[-2], k,
                                 w.shape[-1])) is not None:
        y = _block_scaled_matmul(a, w, pertoken, scale, g)
    else:
        acc = torch.matmul(a, w)
        s = scale.float().reshape(-1)
        if pertoken is not None and pertoken.dim() == 1 and pertoken.numel() == 1 and \
                a.shape[-2] != 1:
            s = s * pertoken.float()  # the golden's double scale
            pertoken = None
        y = acc * s
        if pertoken is not None:
            y = y * pertoken.float().reshape(-1, 1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def _a8w4(x, words, scale, bias, pertoken, out_dtype):
    """A8W4 as op-plugin's goldens compute it (csrc/ops/quant/quant_matmul.h): x = 16 hi + lo + 8
    (hi = floor(x / 16), lo = (x & 15) - 8); per K group (scale's rows) the exact products of hi
    and lo with the int4 weight, times the group's scale in float32, rounded to float16 and summed
    in float16 in group order; y = (acc_hi * 16 + acc_lo (+ bias)) (* pertoken), rounded once."""
    if scale.dtype == torch.int64:  # float32 bits in the low 32 (npu_trans_quant_param / uint64)
        scale = (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    scale = scale.float()
    m, k = x.shape
    groups = scale.shape[0]
    w = _unpack_int4(words).double()  # [k, n]
    xi = x.to(torch.int32)
    split = torch.stack([torch.div(xi, 16, rounding_mode="floor"), (xi & 15) - 8], 1)
    split = split.reshape(2 * m, groups, k // groups).transpose(0, 1).double()
    prods = torch.bmm(split, w.reshape(groups, k // groups, -1))  # [G, 2m, n], exact
    terms = (prods.float() * scale.unsqueeze(1)).half()
    acc = torch.zeros_like(terms[0])
    for term in terms.unbind(0):
        acc = (acc.float() + term.float()).half()
    acc = acc.float().reshape(m, 2, w.shape[-1])
    y = acc[:, 0] * 16 + acc[:, 1]
    if bias is not None:
        y = y + bias.float().reshape(-1)
    if pertoken is not None:
        y = y * pertoken.float().reshape(-1, 1)
    return y.to(out_dtype)


def _dequantise(acc, scale, offset, pertoken_scale, bias, out_dtype):
    """npu_quant_matmul's epilogue (also npu_grouped_matmul's A8W8 one) over the exact integer
    product `acc` (float64): + int32 bias, then * scale (* pertoken) (+ float bias) (+ offset) in
    float32, rounded once to out_dtype (int8: half to even, saturated); int32 outputs are the
    accumulator (+ int32 bias)."""
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.double()
    if out_dtype == torch.int32:
        return acc.to(torch.int32)
    if scale.dtype == torch.int64:  # npu_trans_quant_param's encoding
        s = (scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32).reshape(-1)
        packed = (scale >> 37) & 0x1FF
        packed = torch.where(packed >= 256, packed - 512, packed).float().reshape(-1)
        off = packed if out_dtype == torch.int8 else None
    else:
        s = scale.float().reshape(-1)
        off = None if offset is None else offset.float().reshape(-1)
    y = acc.float() * s
    if pertoken_scale is not None:
        y = y * pertoken_scale.reshape(-1, 1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    if off is not None:
        y = y + off
    if out_dtype == torch.int8:
        return torch.nan_to_num(torch.round(y), nan=0.0).clamp(-128, 127).to(torch.int8)
    return y.to(out_dtype)


@_portable("npu::npu_trans_quant_param")
def npu_trans_quant_param(scale, offset=None, round_mode=0):
    bits = scale.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    if round_mode == 1:  # to the nearest fp19, ties to even (finite values only)
        finite = (bits & 0x7F800000) != 0x7F800000
        bits = torch.where(finite, (bits + 0xFFF + ((bits >> 13) & 1)) & 0xFFFFFFFF, bits)
    v = (bits & 0xFFFFE000) | (1 << 46)
    if offset is None:
        return v
    q = torch.nan_to_num(offset.float(), nan=0.0).round().clamp(-256, 255).to(torch.int64)
    if scale.dim() == 1:
        v, q = v.reshape(-1), q.reshape(-1)
    else:
        q = q.reshape(-1).expand(scale.numel()).reshape(scale.shape)
    return (v & 0x4000FFFFFFFF) | ((q & 0x1FF) << 37)


# dst_type code -> (mantissa bits, emax, min normal exponent, max finite, torch dtype or None: fp4)
_MX_FORMAT = {23: (2, 15, -14, 57344.0, torch.float8_e5m2), 24: (3, 8, -6, 448.0,
                                                                 torch.float8_e4m3fn),
              45: (1, 2, 0, 6.0, None), 296: (1, 2, 0, 6.0, None), 297: (2, 0, 0, 1.75, None)}
_MX_FORMAT.update({291: _MX_FORMAT[23], 292: _MX_FORMAT[24]})


def _mx_quantize(x, axis, bs, code, round_mode, scale_alg, low_bound):
    """(codes uint8 per element, e8m0 codes [..., blocks] with the axis moved last)."""
    mbits, emax, min_exp, max_norm, fp8 = _MX_FORMAT[code]
    v = x.float().movedim(axis, -1)
    d = v.shape[-1]
    nb = (d + bs - 1) // bs
    blk = F.pad(v, (0, nb * bs - d)).unflatten(-1, (nb, bs))
    amax = blk.abs().amax(dim=-1)
    if scale_alg == 1:  # the exponent of amax / max_norm, rounded up
        bits = (torch.clamp(amax, min=low_bound) / max_norm).view(torch.int32)
        biased, frac = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        up = ((biased > 0) & (biased < 254) & (frac > 0)) | ((biased == 0) & (frac > 0x400000))
        exp = biased + up.int() - 127
    else:
        exp = torch.frexp(torch.where(amax > 0, amax, torch.ones_like(amax)))[1] - 1 - emax
    exp = torch.where(amax == 0, torch.full_like(exp, -127), exp).clamp(min=-127)
    bad = (exp > 127) | ~torch.isfinite(amax)
    t = blk * torch.exp2(-exp.clamp(max=127).float()).unsqueeze(-1)
    if fp8 is not None:  # torch's conversion rounds to nearest even, subnormals included
        q = t.clamp(-max_norm, max_norm).to(fp8).view(torch.uint8)
    else:
        a = t.abs()
        e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))[1].clamp(min=min_exp + 1) - 1
        step = torch.exp2((e - mbits).float())
        m = {"rint": torch.round, "floor": torch.floor}.get(
            round_mode, lambda u: torch.sign(u) * torch.floor(u.abs() + 0.5))(t / step)
        r = (m * step).clamp(-max_norm, max_norm).abs()
        if emax == 2:  # e2m1: exponent field E (bias 1) and one mantissa bit
            big = r >= 1
            field = torch.where(big, torch.frexp(torch.where(big, r, torch.ones_like(r)))[1], 0)
            frac = torch.where(big, r / torch.exp2((field - 1).float()) - 1, r) * 2
            mag = (field * 2 + frac.int()).to(torch.uint8)
        else:  # e1m2: multiples of 0.25
            mag = (r * 4).to(torch.uint8)
        q = torch.where(torch.signbit(t), mag | 8, mag)
    q = torch.where(bad.unsqueeze(-1), torch.zeros_like(q), q)
    codes = q.flatten(-2)[..., :d].movedim(-1, axis)
    return codes, torch.where(bad, torch.full_like(exp, 255), exp + 127).to(torch.uint8)


def _mx_outputs(x, axis, bs, code, round_mode, scale_alg, low_bound):
    axis = axis % x.dim()
    codes, scale = _mx_quantize(x, axis, bs, code, round_mode, scale_alg, low_bound)
    scale = F.pad(scale, (0, scale.shape[-1] % 2)).unflatten(-1, (-1, 2)).movedim(-2, axis)
    fp8 = _MX_FORMAT[code][4]
    y = codes.view(fp8) if fp8 is not None else codes[..., 0::2] | (codes[..., 1::2] << 4)
    return y, scale


@_portable("npu::npu_dynamic_mx_quant")
def npu_dynamic_mx_quant(input, *, axis=-1, round_mode="rint", dst_type=296, block_size=32,
                         scale_alg=0, dst_type_max=0.0, max_low_bound=0.0):
    return _mx_outputs(input, axis, block_size, dst_type, round_mode, scale_alg or 0,
                       max_low_bound)


@_portable("npu::npu_dynamic_mx_quant_with_dual_axis")
def npu_dynamic_mx_quant_with_dual_axis(input, *, round_mode="rint", dst_type=296, scale_alg=0,
                                        dst_type_max=0.0):
    return (*_mx_outputs(input, -1, 32, dst_type, round_mode, scale_alg, 0.0),
            *_mx_outputs(input, -2, 32, dst_type, round_mode, scale_alg, 0.0))


@_portable("npu::npu_grouped_dynamic_mx_quant")
def npu_grouped_dynamic_mx_quant(x, group_index, *, round_mode="rint", dst_type=23, blocksize=32,
                                 scale_alg=0, dst_type_max=0.0):
    ends = group_index.tolist()  # host read: group sizes decide the layout (not decomposed)
    n = x.shape[1]
    scale = x.new_zeros((x.shape[0] // 64 + len(ends), n, 2), dtype=torch.uint8)
    ys, start = [], 0
    for g, end in enumerate(ends):
        y, s = _mx_outputs(x[start:end], 0, 32, dst_type, round_mode, scale_alg or 0, 0.0)
        first = start // 64 + g
        scale[first:first + s.shape[0]] = s
        scale[first + s.shape[0]:end // 64 + g + 1] = 127  # scale 1 up to the next group
        ys.append(y.view(torch.uint8))
        start = end
    return torch.cat(ys).view(_MX_FORMAT[dst_type][4]), scale


@_portable("npu::npu_dynamic_block_quant")
def npu_dynamic_block_quant(x, *, min_scale=0.0, round_mode="rint", dst_type=1, row_block_size=1,
                            col_block_size=128, dst_type_max=0.0):
    fp8 = _MX_FORMAT[dst_type][4] if dst_type in (23, 24, 291, 292) else None
    hif8 = dst_type == HIF8
    want = "round" if hif8 else "rint"
    if round_mode != want:
        raise RuntimeError(
            f'npu_dynamic_block_quant: argument \'round_mode\' must be "{want}" for '
            + ('hifloat8 outputs ("hybrid" is not supported by opennpu)' if hif8 else
               'int8 / float8 outputs ("round" is hifloat8\'s)') + f', but got "{round_mode}"')
    qmax = dst_type_max or (HIF8_MAX if hif8 else {torch.float8_e4m3fn: 448.0,
                                                   torch.float8_e5m2: 57344.0}.get(fp8, 127.0))
    v = (x if x.dim() == 3 else x.unsqueeze(0)).float()
    rows, cols = v.shape[1], v.shape[2]
    rp, cp = (-rows) % row_block_size, (-cols) % col_block_size
    blocks = F.pad(v, (0, cp, 0, rp)).unflatten(2, (-1, col_block_size)).unflatten(
        1, (-1, row_block_size))
    amax = blocks.abs().amax(dim=(2, 4))
    bound = torch.full((), min_scale, dtype=torch.float32, device=x.device)
    inv = torch.minimum(qmax * amax.reciprocal(), bound.reciprocal())  # 127 * (1 / amax)
    inv = torch.where(amax == 0, torch.zeros_like(inv), inv)
    scale = torch.where(amax == 0, bound.clamp(min=0).expand_as(amax),
                        torch.maximum(amax / qmax, bound))
    t = v * inv.repeat_interleave(row_block_size, 1).repeat_interleave(col_block_size, 2)[
        :, :rows, :cols]
    y = (t.clamp(-qmax, qmax).to(fp8) if fp8 is not None else
         _hif8_encode(t.clamp(-qmax, qmax)) if hif8 else
         torch.nan_to_num(torch.round(t), nan=0.0).clamp(-qmax, qmax).to(torch.int8))
    return (y, scale) if x.dim() == 3 else (y[0], scale[0])


@_portable("npu::npu_quantize")
def npu_quantize(self, scales, zero_points, dtype, axis=1, div_mode=True):
    x = self.float()
    out, int4 = _quantize_out(dtype, div_mode)
    ax = (axis % x.dim()) if div_mode else (x.dim() - 2 if axis == -2 else x.dim() - 1)
    shape = [1] * x.dim()
    shape[ax] = -1

    def per_axis(t):
        return t.float().reshape(shape)

    z = per_axis(zero_points) if zero_points is not None else x.new_zeros(())
    if _quantize_code(dtype) == HIF8:  # hifloat8: fp32(x / scale or x * scale) + zero, cast
        return _hif8_encode((x / per_axis(scales) if div_mode else x * per_axis(scales)) + z)
    if div_mode:  # torch.quantize_per_channel: x * (float32 1 / scale), rounded, + zero point
        t = torch.round(x * (1.0 / per_axis(scales))) + z
    else:  # AscendQuantV2: the product rounded to float32, then + zero point
        t = x * per_axis(scales) + z
    t = torch.round(torch.where(torch.isnan(t), z.expand_as(t), t))
    if out == torch.int32 and not int4:  # saturate beyond +-2^31 as an int64 clamp does
        return t.clamp(-2.0**31, 2.0**31).to(torch.int64).clamp(-2**31, 2**31 - 1).to(out)
    lo, hi = (-8, 7) if int4 else ((0, 255) if out == torch.uint8 else (-128, 127))
    codes = t.clamp(lo, hi).to(torch.int32 if out == torch.uint8 else torch.int8)
    return _pack_int4(codes) if int4 else codes.to(out)


@_portable("npu::npu_convert_weight_to_int4pack")
def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    torch._assert_async(((weight >= -8) & (weight <= 7)).all(),
                        "npu_convert_weight_to_int4pack: weight must hold int4 values in [-8, 7]")
    return _pack_int4(weight)


# ----------------------------------------------------------------------------- activations


def _silu_grad(a):
    """d silu(a) / da, with its limits at a = +-inf (the product term formed with a clamped)."""
    s = torch.sigmoid(a)
    return s + a.clamp(-200, 200) * s * (1 - s)


def _gelu(z, approximate):
    return F.gelu(z, approximate="tanh" if approximate == 1 else "none")


def _gelu_grad(z, approximate):
    zc = z.clamp(-200, 200)
    if approximate == 1:
        c = math.sqrt(2 / math.pi)
        t = torch.tanh(c * (zc + 0.044715 * zc.pow(3)))
        return 0.5 * (1 + t) + 0.5 * zc * (1 - t * t) * c * (1 + 3 * 0.044715 * zc * zc)
    cdf = 0.5 * (1 + torch.erf(z * (1 / math.sqrt(2))))
    return cdf + zc * torch.exp(-0.5 * zc * zc) / math.sqrt(2 * math.pi)


@_portable("npu::npu_swiglu")
def npu_swiglu(self, dim=-1):
    a, b = _up(self).chunk(2, dim=dim)
    return (F.silu(a) * b).to(self.dtype)


@_portable("npu::npu_swiglu_backward")
def npu_swiglu_backward(grad_output, self, dim=-1):
    a, b = _up(self).chunk(2, dim=dim)
    g = grad_output.to(a.dtype)
    return torch.cat([g * b * _silu_grad(a), g * F.silu(a)], dim=dim).to(self.dtype)


@_portable("npu::npu_geglu")
def npu_geglu(self, dim=-1, approximate=1, activate_left=False):
    a, b = _up(self).chunk(2, dim=dim)
    if activate_left:
        g = _gelu(a, approximate)
        out = g * b
    else:
        g = _gelu(b, approximate)
        out = a * g
    return out.to(self.dtype), g.to(self.dtype)


@_portable("npu::npu_geglu_grad")
def npu_geglu_grad(grad_output, self, gelu, dim=-1, approximate=1, activate_left=False):
    a, b = _up(self).chunk(2, dim=dim)
    g = grad_output.to(a.dtype)
    if activate_left:
        parts = [g * b * _gelu_grad(a, approximate), g * _gelu(a, approximate)]
    else:
        parts = [g * _gelu(b, approximate), g * a * _gelu_grad(b, approximate)]
    return torch.cat(parts, dim=dim).to(self.dtype)


def _fast_gelu(self):
    x = _up(self)
    return (x * torch.sigmoid(1.702 * x)).to(self.dtype)


IMPLS["npu::fast_gelu"] = _fast_gelu
IMPLS["npu::npu_fast_gelu"] = _fast_gelu


@_portable("npu::npu_fast_gelu_backward")
def npu_fast_gelu_backward(grad, self):
    x = _up(self)
    s = torch.sigmoid(1.702 * x)
    return (grad.to(x.dtype) * (s + 1.702 * x.clamp(-200, 200) * s * (1 - s))).to(self.dtype)


@_portable("opennpu::_silu_mul")
def _silu_mul(gate, up):
    return (F.silu(_up(gate)) * _up(up)).to(gate.dtype)


# F.linear itself (the CPU kernel's oneDNN choice is a CPU matter).
_portable("opennpu::_linear")(F.linear)


@_portable("opennpu::_silu_mul_backward")
def _silu_mul_backward(grad, gate, up):
    a, b, g = _up(gate), _up(up), _up(grad)
    return (g * b * _silu_grad(a)).to(gate.dtype), (g * F.silu(a)).to(gate.dtype)


# ----------------------------------------------------------------------------- rotary


def _rotate(x, mode):
    """half: cat(-x2, x1); interleave: pairs (-x[2i+1], x[2i])."""
    if mode == "half":
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)


@_portable("npu::npu_rotary_mul")
def npu_rotary_mul(self, r1, r2, rotary_mode="half", rotate=None):
    x = _up(self)
    rx = x @ rotate.to(x.dtype) if rotate is not None else _rotate(x, rotary_mode)
    out = x * r1.to(x.dtype) + rx * r2.to(x.dtype)
    return out.sum_to_size(self.shape).to(self.dtype)


def _rotary_dx(grad, self, r1, r2, mode):
    g = _up(grad)
    dx = g * r1.to(g.dtype) - _rotate(g * r2.to(g.dtype), mode)  # rotate^T = -rotate
    return dx.sum_to_size(self.shape).to(self.dtype)


@_portable("npu::npu_rotary_mul_backward")
def npu_rotary_mul_backward(grad, self, r1, r2, rotary_mode="half"):
    g, x = _up(grad), _up(self)
    dr1 = (x * g).sum_to_size(r1.shape)
    dr2 = (_rotate(x, rotary_mode) * g).sum_to_size(r2.shape)
    return (_rotary_dx(grad, self, r1, r2, rotary_mode), dr1.to(self.dtype),
            dr2.to(self.dtype))


@_portable("opennpu::_rotary_mul_backward_dx")
def _rotary_mul_backward_dx(grad, self, r1, r2, rotary_mode="half"):
    return _rotary_dx(grad, self, r1, r2, rotary_mode)


def _deinterleave(x):
    """(x[0], x[2], ..., x[1], x[3], ...) along the last dim."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


def _interleave_rope(x, cos, sin):
    q = _deinterleave(x)
    return q * cos.to(x.dtype) + _rotate(q, "half") * sin.to(x.dtype)


@_portable("npu::npu_interleave_rope")
def npu_interleave_rope(x, cos, sin):
    return _interleave_rope(_up(x), cos, sin).to(x.dtype)


# ----------------------------------------------------------------------------- softmax

_MASK_FILL = -10000.0


def _softmax_mask(x, mask, fixed_triu_mask):
    if fixed_triu_mask:
        h, w = x.shape[-2:]
        return torch.ones(h, w, dtype=torch.bool, device=x.device).triu(diagonal=1)
    return mask.bool()


@_portable("npu::npu_scaled_masked_softmax")
def npu_scaled_masked_softmax(x, mask, scale=1, fixed_triu_mask=False):
    s = (_up(x) * scale).masked_fill(_softmax_mask(x, mask, fixed_triu_mask), _MASK_FILL)
    return torch.softmax(s, dim=-1).to(x.dtype)


@_portable("npu::npu_scaled_masked_softmax_backward")
def npu_scaled_masked_softmax_backward(y_grad, y, mask, scale, fixed_triu_mask):
    dy, yf = _up(y_grad), _up(y)
    dx = scale * yf * (dy - (dy * yf).sum(dim=-1, keepdim=True))
    return dx.masked_fill(_softmax_mask(y, mask, fixed_triu_mask), 0.0).to(y_grad.dtype)


# ----------------------------------------------------------------------------- transpose


@_portable("npu::npu_confusion_transpose")
def npu_confusion_transpose(self, perm, shape, transpose_first):
    if transpose_first:
        return self.permute(perm).reshape(shape).contiguous()
    return self.reshape(shape).permute(perm).contiguous()


@_portable("npu::npu_confusion_transpose_backward")
def npu_confusion_transpose_backward(grad, perm, shape, transpose_first):
    perm = [p % len(perm) for p in perm]
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    if transpose_first:
        return grad.permute(inv).reshape(shape).contiguous()
    return grad.reshape([shape[p] for p in perm]).permute(inv).contiguous()


# ----------------------------------------------------------------------------- mixture of experts


@_portable("npu::npu_moe_gating_top_k_softmax")
def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    p = torch.softmax(_up(x), dim=-1)
    # ranked as rounded to x's dtype, ties to the lower expert (torch_npu's golden)
    ranked = p.to(x.dtype) if x.dtype in (torch.float16, torch.bfloat16) else p
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :k]
    y = p.gather(-1, order).to(x.dtype)
    expert_idx = order.to(torch.int32)
    if finished is not None:
        expert_idx = expert_idx.masked_fill(finished.bool().unsqueeze(-1), x.shape[-1])
    rows = x.numel() // torch.sym_max(x.shape[-1], 1) if x.dim() else 1
    row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device)
    return y, expert_idx, row_idx.view(k, rows).t().reshape(y.shape)


@_portable("npu::npu_moe_gating_top_k_softmax_v2")
def npu_moe_gating_top_k_softmax_v2(x, *, k=1, finished=None, renorm=0, output_softmax=False):
    xf = _up(x)
    if renorm:  # the top k logits, then their softmax
        order = torch.sort(xf, dim=-1, descending=True, stable=True).indices[..., :k]
        y = torch.softmax(xf.gather(-1, order), dim=-1)
    else:  # the top k of the softmax, ranked unrounded
        p = torch.softmax(xf, dim=-1)
        order = torch.sort(p, dim=-1, descending=True, stable=True).indices[..., :k]
        y = p.gather(-1, order)
    expert_idx = order.to(torch.int32)
    if finished is not None:
        expert_idx = expert_idx.masked_fill(finished.bool().unsqueeze(-1), x.shape[-1])
    if not renorm and output_softmax:
        softmax = torch.softmax(xf, dim=-1).float()
    else:
        softmax = x.new_empty((0,), dtype=torch.float32)
    return y.to(x.dtype), expert_idx, softmax


@_portable("npu::npu_moe_init_routing")
def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    n, k = expert_idx.shape
    sorted_experts, order = torch.sort(expert_idx.reshape(-1).to(torch.int64), stable=True)
    dst_to_src = row_idx.reshape(-1).to(torch.int64)[order]
    positions = torch.arange(n * k, dtype=torch.int64, device=x.device)
    expanded_row_idx = torch.zeros_like(positions).scatter(0, dst_to_src, positions)
    kept = dst_to_src[:torch.sym_min(active_num, n) * k]
    expanded_x = x[kept % torch.sym_max(n, 1)]
    return expanded_x, expanded_row_idx.to(torch.int32), sorted_experts.to(torch.int32)


def _static_quant_fp16(x, scale, offset):
    """op-plugin's static quantisation golden: float16 steps, round half to even, int8."""
    h = torch.float16
    v = (x.to(h) * scale.reshape(()).to(h)).to(h) + offset.reshape(()).to(h)
    return torch.nan_to_num(torch.round(v.to(h).float()), nan=0.0).clamp(-128, 127).to(torch.int8)


@_portable("npu::npu_moe_init_routing_v2")
def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                            expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                            expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=-1,
                            active_expert_range=(), row_idx_type=0, x_dtype=None):
    if quant_mode not in (-1, 0, 1) or x_dtype is not None:
        raise NotImplementedError("npu_moe_init_routing_v2: quant_mode 2..17 and x_dtype are not "
                                  "implemented")
    n, h = x.shape
    k = expert_idx.shape[1]
    nk = n * k
    dev = x.device
    start, end = active_expert_range if len(active_expert_range) == 2 else (0, expert_num)
    experts = expert_num if expert_num > 0 else end
    span = end - start
    e = expert_idx.reshape(-1).to(torch.int64)
    big = torch.cat([e, e.new_full((1,), start)]).amax() + 1
    keys = torch.where(e < start, big, e)
    sorted_keys, order = torch.sort(keys, stable=True)
    in_range = (sorted_keys >= start) & (sorted_keys < end)
    valid = in_range.sum()
    pos = torch.arange(nk, device=dev)
    token = torch.div(order, max(k, 1), rounding_mode="floor")
    drop_pad = drop_pad_mode == 1
    if drop_pad:
        rows = experts * expert_capacity
        first = torch.searchsorted(sorted_keys.contiguous(), sorted_keys.contiguous())
        rank = pos - first
        placed = in_range & (rank < expert_capacity)
        target = torch.where(placed, (sorted_keys - start) * expert_capacity + rank, rows)
    else:
        rows = nk if active_num <= 0 else min(active_num, nk)
        limit = valid if active_num <= 0 else torch.clamp(valid, max=active_num)
        placed = pos < limit
        target = torch.where(placed, pos, rows)
    # where each output row's token comes from (a dump row past the end takes the rest)
    src = torch.full((rows + 1,), -1, dtype=torch.int64, device=dev)
    src = src.scatter(0, target, token)[:rows]
    row_valid = src >= 0
    gathered = x[src.clamp(min=0)]
    gathered = torch.where(row_valid.unsqueeze(-1), gathered, gathered.new_zeros(()))
    if row_idx_type == 1:
        expanded_row_idx = order
    else:
        where_to = torch.where(in_range if not drop_pad else placed,
                               pos if not drop_pad else target, -1)
        expanded_row_idx = torch.empty_like(order).scatter(0, order, where_to)
    expanded_row_idx = expanded_row_idx.to(expert_idx.dtype)
    counts_per = torch.zeros(span + 1, dtype=torch.int64, device=dev).scatter_add(
        0, torch.where(in_range, sorted_keys - start, span), torch.ones_like(sorted_keys))[:span]
    if not expert_tokens_num_flag:
        counts_per = torch.zeros_like(counts_per)
    if expert_tokens_num_type == 2:
        nonzero_first = torch.sort((counts_per == 0).to(torch.int8), stable=True).indices
        cnt = counts_per[nonzero_first]
        ids = torch.where(cnt > 0, nonzero_first + start, 0)
        pairs = torch.stack([ids, cnt], dim=1)
        counts = torch.cat([pairs, pairs.new_zeros(experts - span, 2)])
    else:
        counts = counts_per.cumsum(0) if expert_tokens_num_type == 0 else counts_per
    expanded_scale = x.new_zeros((rows,), dtype=torch.float32)
    if quant_mode == -1:
        out = gathered
        if scale is not None:
            expanded_scale = torch.where(row_valid, scale.float()[src.clamp(min=0)], 0.0)
    elif quant_mode == 0:
        out = torch.where(row_valid.unsqueeze(-1), _static_quant_fp16(gathered, scale, offset), 0)
    else:
        v = gathered.float()
        if scale is not None and scale.dim() == 2 and scale.shape[0] > 1:  # per active expert
            row_expert = torch.zeros(rows + 1, dtype=torch.int64, device=dev).scatter(
                0, target, sorted_keys - start)[:rows]
            v = v * scale.float()[row_expert.clamp(0, span - 1)]
        elif scale is not None:
            v = v * scale.float().reshape(1, h)
        codes, row_scale = _quantize(v, 127.0, False, False)
        out = torch.where(row_valid.unsqueeze(-1), codes, 0)
        expanded_scale = torch.where(row_valid, row_scale, 0.0)
    if drop_pad:
        out = out.reshape(experts, expert_capacity, h)
    return out, expanded_row_idx, counts, expanded_scale


@_portable("npu::npu_moe_compute_expert_tokens")
def npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    s = sorted_expert_for_source_row
    bounds = torch.arange(num_expert, dtype=torch.int64, device=s.device)
    return torch.searchsorted(s.to(torch.int64).contiguous(), bounds, right=True).to(s.dtype)


@_portable("npu::npu_moe_finalize_routing")
def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
                             expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0, k=1):
    rows, src_to_dst, expert = expanded_permuted_rows, expanded_src_to_dst_row, export_for_source_row
    h = rows.shape[-1]
    flat = _up(rows).reshape(-1, h)
    if scales is not None:
        n, k = scales.shape
    elif expert is not None:
        n, k = expert.shape
    elif skip1 is not None or skip2 is not None:
        n = (skip1 if skip1 is not None else skip2).shape[0]
        k = src_to_dst.numel() // torch.sym_max(n, 1)
    else:  # only the routing: k (op-plugin's argument, default 1) gives the rows
        k = k or 1
        n = src_to_dst.numel() // k
    drop_pad_mode = drop_pad_mode or 0
    src = src_to_dst.to(torch.int64)
    src = src.view(n, k) if drop_pad_mode >= 2 else src.view(k, n).t()
    # index -1 (a dropped slot in the drop-pad modes) picks the appended zero row
    padded = torch.cat([flat, flat.new_zeros(1, h)])
    terms = padded[src.clamp(min=-1) % (flat.shape[0] + 1)]
    if bias is not None:
        terms = terms + bias.to(flat.dtype)[expert.to(torch.int64)]
        terms = torch.where((src >= 0).unsqueeze(-1), terms, 0.0)
    if scales is not None:
        terms = terms * scales.to(flat.dtype).unsqueeze(-1)
    out = terms.sum(dim=1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.to(flat.dtype)
    return out.to(rows.dtype)


def _permute_rows(num_out_tokens, n):
    if num_out_tokens is not None and num_out_tokens > 0:
        return torch.sym_min(num_out_tokens, n)
    return n + (num_out_tokens or 0)


def _no_padded_mode(op, padded_mode):
    if padded_mode:
        raise NotImplementedError(f"{op}: padded_mode=True is not implemented")


@_portable("npu::npu_moe_token_permute")
def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    _no_padded_mode("npu_moe_token_permute", padded_mode)
    n = indices.numel()
    k = 1 if indices.dim() == 1 else indices.shape[1]
    order = torch.sort(indices.reshape(-1).to(torch.int64), stable=True).indices
    positions = torch.arange(n, dtype=torch.int32, device=tokens.device)
    sorted_indices = torch.empty_like(positions).scatter(0, order, positions)
    kept = order[:_permute_rows(num_out_tokens, n)]
    return tokens[torch.div(kept, torch.sym_max(k, 1), rounding_mode="floor")], sorted_indices


def _pair_rows(rows, sorted_indices):
    """rows[sorted_indices] in the accumulator dtype, with positions past rows' end as 0 rows."""
    flat = _up(rows)
    padded = torch.cat([flat, flat.new_zeros(1, flat.shape[1])])
    src = sorted_indices.reshape(-1).to(torch.int64)
    return padded[torch.where(src < flat.shape[0], src, flat.shape[0])]


def _permute_grad(grad_permuted_tokens, sorted_indices, rows, dtype, k):
    terms = _pair_rows(grad_permuted_tokens.to(dtype), sorted_indices)
    return terms.view(rows, k, -1).sum(dim=1).to(dtype)


@_portable("npu::npu_moe_token_permute_grad")
def npu_moe_token_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices,
                               padded_mode=False):
    _no_padded_mode("npu_moe_token_permute_grad", padded_mode)
    k = 1 if indices.dim() == 1 else indices.shape[1]
    return _permute_grad(grad_permuted_tokens, sorted_indices, tokens.shape[0], tokens.dtype, k)


@_portable("npu::npu_moe_token_permute_grad_v2")
def npu_moe_token_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_size_0,
                                  tokens_dtype, num_topK, padded_mode=False):
    _no_padded_mode("npu_moe_token_permute_grad_v2", padded_mode)
    return _permute_grad(grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype,
                         num_topK)


@_portable("npu::npu_moe_token_unpermute")
def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                            restore_shape=None):
    _no_padded_mode("npu_moe_token_unpermute", padded_mode)
    terms = _pair_rows(permuted_tokens, sorted_indices)
    h = permuted_tokens.shape[1]
    if probs is None:
        return terms.to(permuted_tokens.dtype)
    terms = terms.view(probs.shape[0], probs.shape[1], h) * probs.to(terms.dtype).unsqueeze(-1)
    return terms.sum(dim=1).to(permuted_tokens.dtype)


def _unpermute_grad(grad, sorted_indices, rows, dtype, probs, permuted_tokens):
    src = sorted_indices.reshape(-1).to(torch.int64)
    k = probs.shape[1] if probs is not None else 1
    g = _up(grad.to(dtype))
    per_pair = g.repeat_interleave(k, dim=0) if k != 1 else g
    weighted = per_pair * probs.reshape(-1, 1).to(g.dtype) if probs is not None else per_pair
    # pairs past the rows (dropped) land in an extra row that is cut off
    dst = torch.where(src < rows, src, rows)
    grad_rows = g.new_zeros(rows + 1, g.shape[1]).index_copy(0, dst, weighted)[:rows].to(dtype)
    if probs is None:
        return grad_rows, grad.new_zeros(())
    dots = (per_pair * _pair_rows(permuted_tokens.to(dtype), sorted_indices)).sum(dim=-1)
    return grad_rows, dots.view(probs.shape).to(probs.dtype)


@_portable("npu::npu_moe_token_unpermute_grad")
def npu_moe_token_unpermute_grad(permuted_tokens, grad_unpermuted_tokens, sorted_indices,
                                 probs=None, padded_mode=False, restore_shape=None):
    _no_padded_mode("npu_moe_token_unpermute_grad", padded_mode)
    return _unpermute_grad(grad_unpermuted_tokens, sorted_indices, permuted_tokens.shape[0],
                           permuted_tokens.dtype, probs, permuted_tokens)


@_portable("npu::npu_moe_token_unpermute_grad_v2")
def npu_moe_token_unpermute_grad_v2(grad_unpermuted_tokens, sorted_indices,
                                    permuted_tokens_size_0, permuted_tokens_dtype, probs=None,
                                    padded_mode=False, restore_shape=None, permuted_tokens=None):
    _no_padded_mode("npu_moe_token_unpermute_grad_v2", padded_mode)
    return _unpermute_grad(grad_unpermuted_tokens, sorted_indices, permuted_tokens_size_0,
                           permuted_tokens_dtype, probs, permuted_tokens)


def _routed_pairs(routing_map, count):
    """(token, expert) of the first `count` routed pairs of the map, token-major."""
    t, e = routing_map.shape
    flat = routing_map.reshape(-1) != 0
    idx = torch.arange(t * e, device=routing_map.device)
    order = torch.sort(torch.where(flat, idx, idx + t * e), stable=True).indices[:count]
    return torch.div(order, e, rounding_mode="floor"), order % e


def _slot_experts(slots, experts, device):
    capacity = slots // max(experts, 1)
    return torch.div(torch.arange(slots, device=device), max(capacity, 1), rounding_mode="floor")


@_portable("npu::npu_moe_token_permute_with_routing_map")
def npu_moe_token_permute_with_routing_map(tokens, routing_map, *, probs=None,
                                           num_out_tokens=None, drop_and_pad=False):
    t, e = routing_map.shape
    requested = t if num_out_tokens is None else num_out_tokens
    unit = e if drop_and_pad else t
    rows = requested // unit * unit if unit else 0
    dev = tokens.device
    if drop_and_pad:
        capacity = rows // e if e else 0
        slot_token = torch.sort((routing_map != 0).to(torch.int8).t(), dim=-1, descending=True,
                                stable=True).indices[:, :capacity].reshape(-1)
        permuted_probs = (probs[slot_token, _slot_experts(rows, e, dev)] if probs is not None
                          else tokens.new_empty((0,)))
        return tokens[slot_token], permuted_probs, slot_token.to(torch.int32)
    token, expert = _routed_pairs(routing_map, rows)  # token-major pair q
    order = torch.sort(expert * t + token, stable=True).indices  # expert-major position p
    positions = torch.arange(rows, dtype=torch.int32, device=dev)
    sorted_indices = torch.empty_like(positions).scatter(0, order, positions)
    permuted_probs = (probs[token[order], expert[order]] if probs is not None
                      else tokens.new_empty((0,)))
    return tokens[token[order]], permuted_probs, sorted_indices


def _routing_terms(sorted_indices, rows, t, routing_map, probs, drop_and_pad):
    """(token, expert, row) of every term: drop_and_pad, slot s of token sorted_indices[s];
    dropless, token-major pair q in row sorted_indices[q]."""
    si = sorted_indices.reshape(-1).to(torch.int64)
    dev = si.device
    if drop_and_pad:
        e = routing_map.shape[1] if routing_map is not None else probs.shape[1]
        return si, _slot_experts(rows, e, dev), torch.arange(rows, device=dev)
    if routing_map is not None:
        token, expert = _routed_pairs(routing_map, rows)
    else:
        k = rows // t if t else 0
        q = torch.arange(rows, device=dev)
        token, expert = torch.div(q, max(k, 1), rounding_mode="floor"), q % max(k, 1)
    return token, expert, si


def _unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, probs,
                                routing_map, drop_and_pad):
    rows, h = permuted_tokens.shape
    t = restore_shape[0]
    token, expert, row = _routing_terms(sorted_indices, rows, t, routing_map, probs,
                                        drop_and_pad)
    terms = _up(permuted_tokens)[row]
    w = probs[token, expert] if probs is not None else None
    if w is not None:
        terms = terms * w.to(terms.dtype).unsqueeze(-1)
    out = terms.new_zeros((t, h)).index_add(0, token, terms).to(permuted_tokens.dtype)
    return out, w


@_portable("npu::npu_moe_token_unpermute_with_routing_map")
def npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
                                             probs=None, routing_map=None, drop_and_pad=False):
    return _unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, probs,
                                       routing_map, drop_and_pad)[0]


@_portable("npu::_npu_moe_token_unpermute_with_routing_map")
def _npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
                                              probs=None, routing_map=None, drop_and_pad=False):
    out, w = _unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, probs,
                                         routing_map, drop_and_pad)
    if drop_and_pad:
        token_id, out_index = torch.sort(sorted_indices, stable=True)
        out_index = out_index.to(sorted_indices.dtype)
    else:
        out_index, token_id = sorted_indices.clone(), sorted_indices.clone()
    permute_probs = w if w is not None else permuted_tokens.new_empty((0,))
    return out, out_index, token_id, permute_probs


@_portable("npu::npu_moe_token_permute_with_routing_map_grad")
def npu_moe_token_permute_with_routing_map_grad(permuted_token_out_grad, probs_grad,
                                                sorted_indices, routing_map, experts_num,
                                                tokens_num, drop_and_pad):
    g = permuted_token_out_grad
    rows = g.shape[0]
    token, expert, row = _routing_terms(sorted_indices, rows, tokens_num, routing_map, None,
                                        drop_and_pad)
    gf = _up(g)
    tokens_grad = gf.new_zeros((tokens_num, g.shape[1])).index_add(0, token, gf[row]).to(g.dtype)
    if probs_grad is None:
        return tokens_grad, g.new_empty((0,))
    flat = probs_grad.new_zeros((tokens_num * experts_num,), dtype=torch.float64)
    flat = flat.index_add(0, token * experts_num + expert, probs_grad.double()[row])
    return tokens_grad, flat.view(tokens_num, experts_num).to(probs_grad.dtype)


@_portable("npu::npu_moe_token_unpermute_with_routing_map_grad")
def npu_moe_token_unpermute_with_routing_map_grad(unpermuted_tokens_grad, out_index,
                                                  permuted_token_id, routing_map,
                                                  permuted_tokens, probs, drop_and_pad,
                                                  restore_shape):
    g = unpermuted_tokens_grad
    t, h = g.shape
    rows = out_index.shape[0]
    si = out_index
    if drop_and_pad:  # each slot's token back from the sorted order
        si = torch.empty_like(permuted_token_id).scatter(0, out_index.to(torch.int64),
                                                         permuted_token_id)
    token, expert, row = _routing_terms(si, rows, t, routing_map, probs, drop_and_pad)
    gf = _up(g)[token]
    if probs is not None:
        gf_w = gf * probs[token, expert].to(gf.dtype).unsqueeze(-1)
    else:
        gf_w = gf
    grad_rows = gf.new_zeros((rows, h)).index_copy(0, row, gf_w).to(g.dtype)
    if probs is None:
        return grad_rows, g.new_empty((0,))
    dots = (gf * _up(permuted_tokens.to(g.dtype))[row]).sum(-1)
    e = probs.shape[1]
    flat = dots.new_zeros((t * e,)).index_add(0, token * e + expert, dots)
    return grad_rows, flat.view(t, e).to(g.dtype)


def _gmm_weight(w, antiquant_scale, antiquant_offset, dtype):
    """A group's weight [K, N] for the float GEMM: the float weight itself, or the int8 / packed
    int4 codes dequantised into x's dtype (float16: code + offset rounded to float16 first, as
    op-plugin's golden computes in float16), one scale row per K / G rows."""
    if antiquant_scale is None:
        return w
    if w.dtype == torch.int32:  # int4 words along N, or along K for a transposed view
        transposed = not w.is_contiguous() and w.stride(0) == 1 and w.stride(1) == w.shape[0]
        w = _unpack_int4(w.mT).mT if transposed else _unpack_int4(w)
    v = w.float()
    rows = antiquant_scale.reshape(-1, v.shape[-1]).float()
    repeat = v.shape[0] // rows.shape[0]
    if antiquant_offset is not None:
        v = v + antiquant_offset.reshape(rows.shape).float().repeat_interleave(repeat, 0)
        if dtype == torch.float16:
            v = v.half().float()
    return (v * rows.repeat_interleave(repeat, 0)).to(dtype)


def _grouped_matmul(x, weight, bias, group_list, split_item, group_list_type, kw):
    if any(kw.get(name) for name in ("offset", "activation_input", "activation_quant_scale",
                                     "activation_quant_offset")) or x[0].dtype == torch.int32:
        raise NotImplementedError(
            "npu_grouped_matmul: offset (asymmetric A8W4), int4 x (A4W4) and the activation_* "
            "inputs are not implemented")
    split_item = split_item or 0
    single_weight = len(weight) == 1 and weight[0].dim() == 3
    ws = list(weight[0].unbind(0)) if single_weight else list(weight)

    def per_group(lst):  # one entry per group: the rows of a 3-D weight's [E, ...] tensor
        if not lst:
            return [None] * len(ws)
        return list(lst[0].unbind(0)) if single_weight else list(lst)

    bs, scales = per_group(bias), per_group(kw.get("scale"))
    aq_scales = per_group(kw.get("antiquant_scale"))
    aq_offsets = per_group(kw.get("antiquant_offset"))
    tokens = kw.get("per_token_scale")
    kind_x = _qmm_float_kind(x[0], _type_code(kw.get("x_dtype")))
    kind_w = _qmm_float_kind(weight[0], _type_code(kw.get("weight_dtype")))
    if "hif8" in (kind_x, kind_w):
        raise RuntimeError("npu_grouped_matmul: argument 'x_dtype' must not be torch_npu.hifloat8 "
                           "(290): hifloat8 x / weights are not supported by opennpu's "
                           "npu_grouped_matmul")
    float_codes = kind_x is not None and kind_w is not None
    # MX per-token scales keep their [m, ceil(k / 64), 2] shape; float32 ones are [m] (or [m, 1])
    mx = float_codes and tokens and (_type_code(kw.get("per_token_scale_dtype")) in
                                     _QMM_E8M0_CODES or tokens[0].dtype == torch.float8_e8m0fnu)
    flat = (lambda t: t) if mx else (lambda t: t.reshape(-1))  # noqa: E731
    a8w8 = x[0].dtype == torch.int8 and not float_codes
    a8w4 = a8w8 and bool(ws) and ws[0].dtype == torch.int32
    if ws and ws[0].dtype in (torch.int8, torch.int32) and not a8w8 and not float_codes \
            and not kw.get("antiquant_scale"):
        raise RuntimeError("npu_grouped_matmul: argument 'antiquant_scale' must be given with "
                           "int8 / int4 weights and floating x (the weight-only path)")
    out_dtype = torch.int8 if a8w8 else x[0].dtype
    od = kw.get("output_dtype")
    if od is not None:
        out_dtype = od if isinstance(od, torch.dtype) else _SCALAR_TYPES[od]
    act = kw.get("act_type") or 0
    if act not in _GMM_ACTIVATIONS:
        raise RuntimeError("npu_grouped_matmul: argument 'act_type' must be 0 (none), 1 (relu), 2 "
                           "(gelu, tanh approximation), 4 (fast_gelu) or 5 (silu); 3 is "
                           f"unsupported, as on Ascend; but got {act}")
    if act and not (a8w8 and not a8w4 and tokens):
        raise RuntimeError("npu_grouped_matmul: argument 'act_type' applies only to int8 x and "
                           "weights with per_token_scale (the per-token quantised path, as on "
                           f"Ascend), but got {act} without them")
    if act and out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError("npu_grouped_matmul: argument 'output_dtype' must be torch.float16, "
                           f"torch.bfloat16 or torch.float32 with act_type {act}, but got "
                           f"{out_dtype}")
    tail = 0
    groups = list(range(len(ws)))  # the weight of each row range below
    if group_list is not None and len(x) == 1:
        if group_list_type == 2:
            groups, sizes = _gmm_pairs(group_list, len(ws), x[0].shape[0], split_item)
        else:
            values = group_list.tolist() if isinstance(group_list, torch.Tensor) \
                else list(group_list)
            values = [int(v) for v in values]
            sizes = values if group_list_type == 1 else \
                [b - a for a, b in zip([0, *values[:-1]], values)]
        xs = list(x[0][:sum(sizes)].split(sizes))
        tail = x[0].shape[0] - sum(sizes)
        ts = list(flat(tokens[0])[:sum(sizes)].split(sizes)) if tokens else [None] * len(sizes)
    else:
        xs = list(x)
        ts = [flat(t) for t in tokens] if tokens else [None] * len(ws)
    ys = []
    for xg, gi, t in zip(xs, groups, ts):
        w, b, s, aqs, aqo = ws[gi], bs[gi], scales[gi], aq_scales[gi], aq_offsets[gi]
        if float_codes:  # float8 / MX: npu_quant_matmul's float path per group
            if s.dtype == torch.int64:  # npu_trans_quant_param's encoding: the float32 bits
                s = (s & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
            xg2 = xg.reshape(-1, xg.shape[-1])
            y = _float_quant_matmul(xg2, w, s, t, b, out_dtype, kind_x, kind_w,
                                    kw.get("scale_dtype"), kw.get("per_token_scale_dtype"))
            ys.append(y.reshape(*xg.shape[:-1], y.shape[-1]))
        elif a8w4:
            y = _a8w4(xg.reshape(-1, xg.shape[-1]), w, s, b, t, out_dtype)
            ys.append(y.reshape(*xg.shape[:-1], y.shape[-1]))
        elif a8w8:
            if s is None and out_dtype != torch.int32:
                raise RuntimeError("npu_grouped_matmul: argument 'scale' must be given with int8 "
                                   "x and weights unless output_dtype is torch.int32")
            acc = xg.reshape(-1, xg.shape[-1]).double() @ w.double()  # exact: |sums| < 2^53
            if act:  # the epilogue's float32 values, activated, rounded once
                y = _GMM_ACTIVATIONS[act](_dequantise(acc, s, None, t, b, torch.float32))
                y = y.to(out_dtype)
            else:
                y = _dequantise(acc, s, None, t, b, out_dtype)
            ys.append(y.reshape(*xg.shape[:-1], y.shape[-1]))
        else:
            acc = _acc(xg.dtype)
            y = xg.to(acc) @ _gmm_weight(w, aqs, aqo, xg.dtype).to(acc)
            ys.append((y if b is None else y + b.to(acc)).to(xg.dtype))
    if split_item >= 2:
        n = ys[0].shape[-1] if ys else weight[0].shape[-1]
        out = torch.cat([y.flatten(0, -2) for y in ys]) if ys else \
            x[0].new_zeros(0, n, dtype=out_dtype)
        return [torch.cat([out, out.new_zeros(tail, out.shape[-1])])]
    return ys


# act_type -> the activation npu_grouped_matmul applies to the per-token path's float32 values
_GMM_ACTIVATIONS = {0: None, 1: torch.relu,
                    2: lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
                    4: _fast_gelu, 5: torch.nn.functional.silu}


def _gmm_pairs(group_list, groups, m, split_item):
    """group_list_type 2: the [E, 2] (group index, rows) pairs as the weight index and row count
    of each consecutive range of x's rows, with the C++ entry's checks and words."""
    if not isinstance(group_list, torch.Tensor) or group_list.dim() != 2 or \
            group_list.shape[-1] != 2:
        shape = list(group_list.shape) if isinstance(group_list, torch.Tensor) else "an int list"
        raise RuntimeError("npu_grouped_matmul: argument 'group_list' must be [E, 2] (group "
                           "index, group size) pairs with group_list_type 2, but got shape "
                           f"{shape}")
    if (split_item or 0) < 2:
        raise RuntimeError("npu_grouped_matmul: argument 'split_item' must be 2 or 3 (one output) "
                           f"with group_list_type 2, but got {split_item or 0}")
    pairs = [(int(g), int(n)) for g, n in group_list.tolist()]
    total = 0
    for i, (g, n) in enumerate(pairs):
        if not 0 <= g < groups:
            raise RuntimeError("npu_grouped_matmul: argument 'group_list' must hold group indices "
                               f"in [0, {groups}) in its first column, but entry {i} has {g}")
        if n < 0 or n > m - total:
            raise RuntimeError("npu_grouped_matmul: argument 'group_list' must hold non-negative "
                               "group sizes in its second column that sum to x's "
                               f"{m} rows, but entry {i} has {n} after {total}")
        total += n
    return [g for g, _ in pairs], [n for _, n in pairs]


def _grouped_matmul_over_k(x, weight, group_list, group_list_type):
    """group_type 2: group g multiplies x's columns and weight's rows of the g-th K range;
    the result stacks the groups' [M, N] products (an empty range gives zeros)."""
    (xk,), (wk,) = x, weight
    values = group_list.tolist() if isinstance(group_list, torch.Tensor) else list(group_list)
    values = [int(v) for v in values]
    sizes = values if group_list_type == 1 else [b - a for a, b in zip([0, *values[:-1]], values)]
    acc = _acc(xk.dtype)
    starts = [sum(sizes[:g]) for g in range(len(sizes))]
    ys = [xk[:, a:a + n].to(acc) @ wk[a:a + n].to(acc) for a, n in zip(starts, sizes)]
    return [torch.stack(ys).to(xk.dtype)]


def _check_gmm_dtype_arguments(x, weight, kw):
    """The C++ entry's checks of the dtype arguments (torch_npu's current schema): None or a
    name of the tensors' own dtype (int4 names for int32 weights, uint64 for an int64 scale),
    except on the float8 / MX path (x / weight float8 / float4 codes), which reads them."""
    if _qmm_float_kind(x[0], _type_code(kw.get("x_dtype"))) is not None or \
            _qmm_float_kind(weight[0], _type_code(kw.get("weight_dtype"))) is not None:
        return
    for name, tensors in (("x_dtype", x), ("weight_dtype", weight), ("scale_dtype", kw.get("scale")),
                          ("per_token_scale_dtype", kw.get("per_token_scale"))):
        code = kw.get(name)
        if code is None:
            continue
        own = tensors[0].dtype if tensors else None
        names = {_dtype_code(own)} | ({_QUINT4X2, _INT4} if own == torch.int32 else set()) | \
            ({_UINT64} if own == torch.int64 else set())
        if own is None or code not in names:
            raise RuntimeError(f"npu_grouped_matmul: argument '{name}' must be None or the dtype "
                               f"of its tensors ({own}): reinterpreting storage (the MX / fp8 / "
                               f"fp4 paths) is not implemented by opennpu, but got {code}")


def _dtype_code(dtype: torch.dtype) -> int | None:
    return _SCALAR_TYPES.index(dtype) if dtype in _SCALAR_TYPES else None


# c10::ScalarType numbering of the dtypes grouped_matmul's dtype arguments can name.
_SCALAR_TYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                 torch.float32, torch.float64, None, None, None, torch.bool, None, None, None,
                 torch.bfloat16)
_QUINT4X2, _UINT64, _INT4 = 16, 29, 40  # ScalarType numbers of torch.quint4x2, uint64, int4


@_portable("npu::npu_grouped_matmul")
def npu_grouped_matmul(x, weight, *, bias=None, group_list=None, split_item=0, group_type=None,
                       group_list_type=0, **kw):
    _check_gmm_dtype_arguments(x, weight, kw)
    if group_type is None:
        raise RuntimeError("npu_grouped_matmul: argument 'group_type' is missing: Requires manual "
                           "passing group_type, current is None (pass -1 for x[i] @ weight[i] or 0 "
                           "to group x's rows by group_list)")
    if group_type == 2:
        return _grouped_matmul_over_k(x, weight, group_list, group_list_type or 0)
    return _grouped_matmul(x, weight, bias, group_list, split_item, group_list_type, kw)


@_portable("npu::npu_grouped_matmul.List")
def npu_grouped_matmul_list(x, weight, *, bias=None, group_list=None, split_item=0,
                            group_type=None, group_list_type=0, **kw):
    if group_type == 2:
        return _grouped_matmul_over_k(x, weight, group_list, group_list_type or 0)
    return _grouped_matmul(x, weight, bias, group_list, split_item, group_list_type, kw)


# ----------------------------------------------------------------------------- FFN

_FFN_GLU = ("geglu", "swiglu", "reglu")


def _ffn_activation(h, activation):
    def act(z, name):
        if name == "fastgelu":
            return z * torch.sigmoid(1.702 * z)
        if name in ("gelu", "geglu"):
            return F.gelu(z, approximate="tanh")
        if name in ("relu", "reglu"):
            return F.relu(z)
        return F.silu(z)

    if activation in _FFN_GLU:
        a, b = h.chunk(2, dim=-1)
        return a * act(b, activation)
    return act(h, activation)


def _deq_scale(t):
    """deq_scale values: int64 / uint64 hold the float32 bits (19 significant) in the low word."""
    if t.dtype in (torch.int64, torch.uint64):
        return (t.view(torch.int64) & 0xFFFFE000).to(torch.int32).view(torch.float32)
    return t.float()


@_portable("npu::npu_ffn")
def npu_ffn(x, weight1, weight2, activation, *, expert_tokens=None, expert_tokens_index=None,
            bias1=None, bias2=None, scale=None, offset=None, deq_scale1=None, deq_scale2=None,
            antiquant_scale1=None, antiquant_scale2=None, antiquant_offset1=None,
            antiquant_offset2=None, inner_precise=None, output_dtype=None):
    experts = weight1.dim() == 3
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if expert_tokens is not None:
        offsets = [0]
        for count in expert_tokens:
            offsets.append(offsets[-1] + count)
    elif expert_tokens_index is not None:
        offsets = [0, *expert_tokens_index]
    else:
        offsets = [0, m]
    quant = x.dtype == torch.int8
    out_dtype = (output_dtype if output_dtype is not None else torch.float16) if quant else x.dtype
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32

    def per_expert(t, e):
        return None if t is None else (t[e] if experts else t)

    pieces = []
    for e in range(len(offsets) - 1):
        rows = x2[offsets[e]:offsets[e + 1]].to(cd)
        w1, w2 = (weight1[e], weight2[e]) if experts else (weight1, weight2)
        b1, b2 = per_expert(bias1, e), per_expert(bias2, e)
        w1, w2 = w1.to(cd), w2.to(cd)
        if quant:
            h = rows @ w1 + (b1.to(cd) if b1 is not None else 0)
            h = _ffn_activation(h * _deq_scale(per_expert(deq_scale1, e)).to(cd), activation)
            s = scale[e] if experts and scale.dim() == 1 else per_expert(scale, e)
            o = (offset[e] if experts else offset[0]).to(cd) if offset is not None else 0.0
            q = torch.round(h * s.to(cd) + o).clamp(-128, 127)
            y = (q @ w2 + (b2.to(cd) if b2 is not None else 0))
            pieces.append(y * _deq_scale(per_expert(deq_scale2, e)).to(cd))
            continue
        if weight1.dtype == torch.int8:  # weight-only quantisation, dequantised in x's dtype
            deq = []
            for w, sc, off in ((w1, antiquant_scale1, antiquant_offset1),
                               (w2, antiquant_scale2, antiquant_offset2)):
                sc, off = per_expert(sc, e), per_expert(off, e)
                w = (w + (off.to(cd) if off is not None else 0)) * sc.to(cd)
                deq.append(w.to(x.dtype).to(cd))
            w1, w2 = deq
        h = _ffn_activation(rows @ w1 + (b1.to(cd) if b1 is not None else 0), activation)
        h = h.to(x.dtype).to(cd)  # what the second GEMM takes
        pieces.append(h @ w2 + (b2.to(cd) if b2 is not None else 0))
    n2 = weight2.shape[-1]
    covered = offsets[-1]
    if covered < m:
        pieces.append(x2.new_zeros((m - covered, n2), dtype=cd))
    out = torch.cat(pieces) if pieces else x2.new_zeros((m, n2), dtype=cd)
    return out.to(out_dtype).reshape(*x.shape[:-1], n2)


# ----------------------------------------------------------------------------- attention

_MAX_TOKENS = 2147483647


def _to_bnsd(t, layout, heads, head_dim):
    if layout == "BSH":
        return t.unflatten(2, (heads, head_dim)).transpose(1, 2)
    if layout == "SBH":
        return t.unflatten(2, (heads, head_dim)).permute(1, 2, 0, 3)
    if layout == "BSND":
        return t.transpose(1, 2)
    return t  # BNSD


def _from_bnsd(t, layout):
    if layout == "BSH":
        return t.transpose(1, 2).flatten(2)
    if layout == "SBH":
        return t.permute(2, 0, 1, 3).flatten(2)
    if layout == "BSND":
        return t.transpose(1, 2)
    return t


def _visibility(mode, sq, skv, b, user, pre, nxt, prefix, device):
    """The complete masked-out pattern (True = masked) for sparse_mode, broadcastable to
    [B, N, Sq, Skv]: 0 user | outside the band i - pre <= j <= i + next; 1 user; 2 j > i;
    3 j > i + shift; 4 outside the band around i + shift; 5 user | (j > i + shift and j >=
    prefix[b]); 6 as 5 without the user mask; shift = Skv - Sq. Modes 2-4 and 6 do not read
    the mask."""
    i = torch.arange(sq, device=device).unsqueeze(-1)
    j = torch.arange(skv, device=device)
    shift = skv - sq
    if mode == 0:
        rule = (j > i + nxt) | (j < i - pre)
    elif mode == 1:
        rule = None
    elif mode == 2:
        rule = j > i
    elif mode == 3:
        rule = j > i + shift
    elif mode == 4:
        rule = (j > i + shift + nxt) | (j < i + shift - pre)
    elif mode in (5, 6):
        past_prefix = torch.stack([j >= p for p in list(prefix)[:b]])  # [b, skv], no host copy
        rule = (j > i + shift) & past_prefix[:, None, None, :]
    else:
        raise NotImplementedError(f"npu_fusion_attention: sparse_mode {mode} (portable path)")
    if mode in (0, 1, 5) and user is not None:
        u = user.bool()
        return u if rule is None else u | rule
    return rule


def _attention_core(q, k, v, pse, masked, scale, sink, keep=None, keep_prob=1.0):
    """BNSD operands in the accumulator dtype (k / v with Nkv heads); `keep` the bool dropout
    keep mask broadcastable to [B, N, Sq, Skv]. Returns (out, P with the sink column, row max,
    row sum, P' = P * keep / keep_prob without the sink column)."""
    group = q.shape[1] // max(k.shape[1], 1)
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2)
    if pse is not None:
        s = s + pse.to(s.dtype)
    s = s * scale
    skv = s.shape[-1]
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
        alive = ~masked.expand(s.shape).all(dim=-1, keepdim=True)
    else:
        alive = torch.ones_like(s[..., :1], dtype=torch.bool)
    if sink is not None:  # one extra logit per head, no value row
        col = sink.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        s = torch.cat([s, col], dim=-1)
        alive = torch.ones_like(alive)
    if skv == 0 and sink is None:
        alive = torch.zeros_like(alive)
    safe = s.masked_fill(~alive, 0.0)  # rows that see nothing: finite, zeroed afterwards
    row_max = safe.amax(dim=-1, keepdim=True) if safe.shape[-1] else safe.new_zeros(*s.shape[:-1], 1)
    e = torch.exp(safe - row_max)
    row_sum = e.sum(dim=-1, keepdim=True)
    p = e / row_sum * alive
    p_kv = p[..., :skv]
    if keep is not None:
        p_kv = p_kv * keep.to(p.dtype) / keep_prob
    out = p_kv @ v
    smax = torch.where(alive, row_max, float("-inf")).squeeze(-1)
    ssum = (row_sum * alive).squeeze(-1)
    return out, p, smax, ssum, p_kv


def _attention_backward_core(q, k, v, dy, pse, masked, scale, sink, keep=None, keep_prob=1.0,
                             out_given=None):
    """(dq, dk, dv, dpse_full, dsink) for BNSD operands in the accumulator dtype. With dropout
    (P' = P * keep / keep_prob): dV = P'^T dO, dP = (dO V^T) * keep / keep_prob, and the softmax
    gradient dS = P * (dP - rowsum(dO * O)) (rowsum(P * dP) = rowsum(dO * O))."""
    nkv = k.shape[1]
    group = q.shape[1] // max(nkv, 1)
    out, p, _, _, p_drop = _attention_core(q, k, v, pse, masked, scale, sink, keep, keep_prob)
    skv = k.shape[2]
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    dp = dy @ vr.transpose(-1, -2)
    if keep is not None:
        dp = dp * keep.to(dp.dtype) / keep_prob
    if out_given is not None:  # the forward's output (attention_in), as the CPU kernel uses it
        out = out_given
    delta = (dy * out).sum(dim=-1, keepdim=True)
    dlogit = p[..., :skv] * (dp - delta)  # gradient with respect to the scaled logits
    dq = scale * (dlogit @ kr)
    dk = scale * (dlogit.transpose(-1, -2) @ q)
    dv = p_drop.transpose(-1, -2) @ dy
    dk = dk.unflatten(1, (nkv, group)).sum(dim=2)
    dv = dv.unflatten(1, (nkv, group)).sum(dim=2)
    dsink = None
    if sink is not None:  # d/d sink of the extra logit: p_sink * (0 - delta)
        dsink = (-(p[..., skv:] * delta)).sum(dim=(0, 2, 3))
    return dq, dk, dv, scale * dlogit, dsink


def _batch_and_seq(t, layout):
    """(batch, sequence length) of a BSH / SBH / BSND / BNSD tensor."""
    if layout == "SBH":
        return t.shape[1], t.shape[0]
    return t.shape[0], t.shape[2 if layout == "BNSD" else 1]


def _layout_dims(query, key, value, head_num, layout):
    """(head size, key/value head count, value head size) of a BSH/SBH/BSND/BNSD call."""
    if layout in ("BSH", "SBH"):
        d = query.shape[2] // head_num
        nkv = key.shape[2] // d
        return d, nkv, value.shape[2] // nkv
    return query.shape[-1], None, value.shape[-1]


def _spans(ends):
    """[(start, length)] of cumulative ends; a trailing run of zeros ends the list."""
    out, prev = [], 0
    for end in ends:
        if end < prev:
            out.append((prev, 0))
            continue
        out.append((prev, end - prev))
        prev = end
    return out


def _tnd_sequences(actual_seq_qlen, actual_seq_kvlen, sparse_mode):
    """(q start, sq, kv start, skv, the sequence's sparse mode) of a TND call (modes 7/8: 3/2
    per sequence with the band, mode 4, on the last / first non-empty one)."""
    sq_spans, kv_spans = _spans(actual_seq_qlen), _spans(actual_seq_kvlen)
    nonempty = [i for i, (_, s) in enumerate(sq_spans) if s > 0]
    out = []
    for i, ((qs, sq), (ks, skv)) in enumerate(zip(sq_spans, kv_spans)):
        mode = sparse_mode
        if sparse_mode == 7:
            mode = 4 if i == nonempty[-1] else 3
        elif sparse_mode == 8:
            mode = 4 if i == nonempty[0] else 2
        out.append((qs, sq, ks, skv, mode))
    return out


def _keep_bits(device, numels, keep_prob, seed, offset, dropout_mask=None):
    """The dropout keep mask as `numels` bools, bit k = score k in the kernel's order ([B, N, Sq,
    Skv] row-major; TND: the sequences one after another, each [N, sq, skv]). The bits are the
    CPU kernel's (opennpu's Philox stream, _npu_dropout_gen_mask), made on the host and copied."""
    if dropout_mask is None:
        dropout_mask = torch.ops.npu._npu_dropout_gen_mask.Tensor(
            torch.empty(0), [numels], 1.0 - keep_prob, seed, offset)
    bits = dropout_mask.to(device=device, dtype=torch.int64)
    shifts = torch.arange(8, device=device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).flatten()[:numels].bool()


def _reserve_philox(numels):
    """(seed, offset) of the next draw of opennpu's generator, advanced past `numels` words (one
    Philox word per score, four per block), as the CPU kernel reserves them."""
    seed, offset = torch.ops.opennpu.get_rng_state()
    torch.ops.opennpu.set_rng_state(seed, offset + (numels + 3) // 4)
    return seed, offset


def _tnd_numels(head_num, seqs):
    return sum(head_num * sq * skv for _, sq, _, skv, _ in seqs if sq)


def _fa_bnsd_operands(query, key, value, head_num, layout):
    acc = _acc(query.dtype)
    d, nkv, dv = _layout_dims(query, key, value, head_num, layout)
    return (_to_bnsd(query.to(acc), layout, head_num, d),
            _to_bnsd(key.to(acc), layout, nkv or -1, d),
            _to_bnsd(value.to(acc), layout, nkv or -1, dv))


def _stats8(stat):
    return stat.unsqueeze(-1).expand(*stat.shape, 8).contiguous()


@_portable("npu::npu_fusion_attention")
def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=_MAX_TOKENS,
                         next_tockens=_MAX_TOKENS, inner_precise=0, prefix=None,
                         actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None,
                         dropout_mask=None, seed=0, offset=0):
    layout = input_layout.upper()
    acc = _acc(query.dtype)
    sk = sink.to(acc) if sink is not None else None
    dropout = keep_prob < 1.0
    flash = flash_route.plan(query, key, value, head_num, layout, pse=pse, atten_mask=atten_mask,
                             keep_prob=keep_prob, pre_tokens=pre_tockens,
                             next_tokens=next_tockens, sparse_mode=sparse_mode, sink=sink,
                             actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen)
    if layout == "TND":
        t, n = query.shape[0], head_num
        seqs = _tnd_sequences(actual_seq_qlen, actual_seq_kvlen, sparse_mode)
        numels = _tnd_numels(n, seqs)
        if flash is not None:
            out, smax, ssum = flash_route.forward(flash, query, key, value, scale, softmax_layout)
            return out, smax, ssum, query.new_empty([0]), seed, offset, numels
        keep = None
        if dropout:
            if dropout_mask is None:
                seed, offset = _reserve_philox(numels)
            keep = _keep_bits(query.device, numels, keep_prob, seed, offset, dropout_mask)
        outs, maxes, sums, covered, pos = [], [], [], 0, 0
        for qs, sq, ks, skv, mode in seqs:
            if sq == 0:
                continue
            qb = query[qs:qs + sq].to(acc).permute(1, 0, 2)[None]
            kb = key[ks:ks + skv].to(acc).permute(1, 0, 2)[None]
            vb = value[ks:ks + skv].to(acc).permute(1, 0, 2)[None]
            masked = None
            if atten_mask is not None:
                user = atten_mask[..., :sq, :skv]
                masked = _visibility(mode, sq, skv, 1, user, pre_tockens, next_tockens,
                                     prefix[len(outs):] if prefix else None, query.device)
            kb_keep = None
            if keep is not None:
                kb_keep = keep[pos:pos + n * sq * skv].view(1, n, sq, skv)
            pos += n * sq * skv
            out, _, smax, ssum, _ = _attention_core(qb, kb, vb, None, masked, scale, sk, kb_keep,
                                                    keep_prob)
            outs.append(out[0].permute(1, 0, 2))
            maxes.append(smax[0].t())
            sums.append(ssum[0].t())
            covered = qs + sq
        rest = t - covered
        outs.append(query.new_zeros((rest, n, value.shape[-1]), dtype=acc))
        maxes.append(torch.full((rest, n), float("-inf"), dtype=acc, device=query.device))
        sums.append(query.new_zeros((rest, n), dtype=acc))
        out, smax, ssum = torch.cat(outs), torch.cat(maxes), torch.cat(sums)
        if softmax_layout == "":  # [N, T, 8] storage viewed as [T, N, 8]
            smax, ssum = smax.t().reshape(t, n), ssum.t().reshape(t, n)
        return (out.to(query.dtype), _stats8(smax), _stats8(ssum), query.new_empty([0]),
                seed, offset, numels)
    if flash is not None:
        out, smax, ssum = flash_route.forward(flash, query, key, value, scale)
        batch, sq = _batch_and_seq(query, layout)
        numels = batch * head_num * sq * _batch_and_seq(key, layout)[1]
        return out, smax, ssum, query.new_empty([0]), seed, offset, numels
    q, k, v = _fa_bnsd_operands(query, key, value, head_num, layout)
    b, _, sq, _ = q.shape
    skv = k.shape[2]
    numels = b * head_num * sq * skv
    masked = None
    if atten_mask is not None:
        masked = _visibility(sparse_mode, sq, skv, b, atten_mask, pre_tockens, next_tockens,
                             prefix, query.device)
    keep = None
    if dropout:
        if dropout_mask is None:
            seed, offset = _reserve_philox(numels)
        keep = _keep_bits(query.device, numels, keep_prob, seed, offset,
                          dropout_mask).view(b, head_num, sq, skv)
    out, _, smax, ssum, _ = _attention_core(q, k, v, pse, masked, scale, sk, keep, keep_prob)
    return (_from_bnsd(out, layout).to(query.dtype), _stats8(smax), _stats8(ssum),
            query.new_empty([0]), seed, offset, numels)


@_portable("npu::npu_fusion_attention_grad")
def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None,
                              padding_mask=None, atten_mask=None, softmax_max=None,
                              softmax_sum=None, softmax_in=None, attention_in=None,
                              scale_value=1.0, keep_prob=1.0, pre_tockens=_MAX_TOKENS,
                              next_tockens=_MAX_TOKENS, inner_precise=0, seed=0, offset=0,
                              numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                              sparse_mode=0, gen_mask_parallel=True, sync=False,
                              softmax_layout="", sink=None):
    # On CUDA, a call that fits flash attention runs its backward (flash_route: it needs
    # attention_in and the statistics). Otherwise P is recomputed from Q and K in fp32 (the saved
    # statistics are not needed); rowsum(dO * O) takes the forward's output attention_in where
    # given, as the CPU kernel does; dropout regenerates the mask from (seed, offset).
    layout = input_layout.upper()
    acc = _acc(query.dtype)
    sk = sink.to(acc) if sink is not None else None
    scale = scale_value
    dropout = keep_prob < 1.0
    flash = flash_route.plan(query, key, value, head_num, layout, pse=pse, atten_mask=atten_mask,
                             keep_prob=keep_prob, pre_tokens=pre_tockens,
                             next_tokens=next_tockens, sparse_mode=sparse_mode, sink=sink,
                             actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen)
    grads = flash and flash_route.backward(flash, query, key, value, dy, attention_in, softmax_max,
                                           softmax_sum, scale, softmax_layout)
    if grads:
        return (*grads, query.new_empty([0]), query.new_zeros([0], dtype=torch.float32))
    no_pse = query.new_empty([0])
    no_sink = query.new_zeros([0], dtype=torch.float32)
    if layout == "TND":
        n = head_num
        seqs = _tnd_sequences(actual_seq_qlen, actual_seq_kvlen, sparse_mode)
        total = _tnd_numels(n, seqs)
        keep = _keep_bits(query.device, total, keep_prob, seed, offset) if dropout else None
        dq = torch.zeros_like(query, dtype=acc)
        dk = torch.zeros_like(key, dtype=acc)
        dv = torch.zeros_like(value, dtype=acc)
        dsink = sk.new_zeros(sk.shape) if sk is not None else None
        pos = 0
        for i, (qs, sq, ks, skv, mode) in enumerate(seqs):
            if sq == 0:
                continue
            qb = query[qs:qs + sq].to(acc).permute(1, 0, 2)[None]
            kb = key[ks:ks + skv].to(acc).permute(1, 0, 2)[None]
            vb = value[ks:ks + skv].to(acc).permute(1, 0, 2)[None]
            gb = dy[qs:qs + sq].to(acc).permute(1, 0, 2)[None]
            ob = (attention_in[qs:qs + sq].to(acc).permute(1, 0, 2)[None]
                  if attention_in is not None else None)
            masked = None
            if atten_mask is not None:
                masked = _visibility(mode, sq, skv, 1, atten_mask[..., :sq, :skv], pre_tockens,
                                     next_tockens, prefix[i:] if prefix else None, query.device)
            kb_keep = None
            if keep is not None:
                kb_keep = keep[pos:pos + n * sq * skv].view(1, n, sq, skv)
            pos += n * sq * skv
            g = _attention_backward_core(qb, kb, vb, gb, None, masked, scale, sk, kb_keep,
                                         keep_prob, ob)
            dq[qs:qs + sq] = g[0][0].permute(1, 0, 2)
            dk[ks:ks + skv] = g[1][0].permute(1, 0, 2)
            dv[ks:ks + skv] = g[2][0].permute(1, 0, 2)
            if dsink is not None:
                dsink = dsink + g[4]
        return (dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), no_pse,
                dsink.float() if dsink is not None else no_sink)
    q, k, v = _fa_bnsd_operands(query, key, value, head_num, layout)
    d, nkv, dvh = _layout_dims(query, key, value, head_num, layout)
    g = _to_bnsd(dy.to(acc), layout, head_num, dvh)
    b, _, sq, _ = q.shape
    skv = k.shape[2]
    masked = None
    if atten_mask is not None:
        masked = _visibility(sparse_mode, sq, skv, b, atten_mask, pre_tockens,
                             next_tockens, prefix, query.device)
    keep = None
    if dropout:
        keep = _keep_bits(query.device, b * head_num * sq * skv, keep_prob, seed,
                          offset).view(b, head_num, sq, skv)
    out_given = (_to_bnsd(attention_in.to(acc), layout, head_num, dvh)
                 if attention_in is not None else None)
    dq, dk, dv, dlogit, dsink = _attention_backward_core(q, k, v, g, pse, masked, scale, sk,
                                                         keep, keep_prob, out_given)
    dpse = dlogit.sum_to_size(pse.shape).to(pse.dtype) if pse is not None else no_pse
    return (_from_bnsd(dq, layout).to(query.dtype), _from_bnsd(dk, layout).to(key.dtype),
            _from_bnsd(dv, layout).to(value.dtype), dpse,
            dsink.float() if dsink is not None else no_sink)


def _rope_operands(query, key, query_rope, key_rope, head_num, layout):
    """v2's MLA parts: [q, q_rope] and [k, k_rope] concatenated per head, so one product gives
    q k^T + q_rope k_rope^T."""
    if query_rope is None and key_rope is None:
        return query, key
    if query_rope is None or key_rope is None:
        raise RuntimeError("npu_fusion_attention_v2: query_rope and key_rope must be given "
                           "together")
    if layout in ("BSH", "SBH"):
        kv_heads = key.shape[2] // (query.shape[2] // head_num)
        return (torch.cat([query.unflatten(2, (head_num, -1)),
                           query_rope.unflatten(2, (head_num, -1))], -1).flatten(2),
                torch.cat([key.unflatten(2, (kv_heads, -1)),
                           key_rope.unflatten(2, (kv_heads, -1))], -1).flatten(2))
    return torch.cat([query, query_rope], -1), torch.cat([key, key_rope], -1)


def _rope_split(grad, rope, heads, layout):
    """The inverse of _rope_operands for one gradient: (the q/k part, the rope part)."""
    if rope is None:
        return grad, grad.new_empty([0])
    if layout in ("BSH", "SBH"):
        g = grad.unflatten(2, (heads, -1))
        r = rope.shape[2] // heads
        return g[..., :g.shape[-1] - r].flatten(2), g[..., g.shape[-1] - r:].flatten(2)
    r = rope.shape[-1]
    return grad[..., :grad.shape[-1] - r], grad[..., grad.shape[-1] - r:]


def _pse_of_type(pse, pse_type, scale):
    """pse_type 1: scale * (qk + pse), the kernels' form; 0: scale * qk + pse = scale * (qk +
    pse / scale). 2 / 3 (ALiBi from slopes) are not implemented."""
    if pse_type not in (0, 1):
        raise RuntimeError(f"npu_fusion_attention_v2: pse_type {pse_type} is not supported by "
                           "opennpu (0 and 1 are)")
    if pse is None or pse_type == 1:
        return pse
    return _up(pse) / scale


@_portable("npu::npu_fusion_attention_v2")
def npu_fusion_attention_v2(query, key, value, head_num, input_layout, *, pse=None,
                            padding_mask=None, atten_mask=None, query_rope=None, key_rope=None,
                            scale=1.0, keep_prob=1.0, pre_tokens=_MAX_TOKENS,
                            next_tokens=_MAX_TOKENS, inner_precise=0, prefix=None,
                            actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                            gen_mask_parallel=True, sync=False, pse_type=1, q_start_idx=None,
                            kv_start_idx=None, softmax_layout="", sink=None, dropout_mask=None,
                            seed=0, offset=0):
    q, k = _rope_operands(query, key, query_rope, key_rope, head_num, input_layout.upper())
    return npu_fusion_attention(q, k, value, head_num, input_layout,
                                _pse_of_type(pse, pse_type, scale), padding_mask, atten_mask,
                                scale, keep_prob, pre_tokens, next_tokens, inner_precise, prefix,
                                actual_seq_qlen, actual_seq_kvlen, sparse_mode, gen_mask_parallel,
                                sync, softmax_layout, sink, dropout_mask, seed, offset)


@_portable("npu::npu_fusion_attention_grad_v2")
def npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout, *, pse=None,
                                 query_rope=None, key_rope=None, pre_tokens=_MAX_TOKENS,
                                 next_tokens=_MAX_TOKENS, pse_type=1, q_start_idx=None,
                                 kv_start_idx=None, scale_value=1.0, **kwargs):
    layout = input_layout.upper()
    q, k = _rope_operands(query, key, query_rope, key_rope, head_num, layout)
    dq, dk, dv, dpse, dsink = npu_fusion_attention_grad(
        q, k, value, dy, head_num, input_layout, pse=_pse_of_type(pse, pse_type, scale_value),
        pre_tockens=pre_tokens, next_tockens=next_tokens, scale_value=scale_value, **kwargs)
    if pse is not None and pse_type == 0:
        dpse = (_up(dpse) / scale_value).to(pse.dtype)
    kv_heads = key.shape[2] // (query.shape[2] // head_num) if layout in ("BSH", "SBH") else 0
    dq, dq_rope = _rope_split(dq, query_rope, head_num, layout)
    dk, dk_rope = _rope_split(dk, key_rope, kv_heads, layout)
    return dq, dk, dv, dpse, dq_rope, dk_rope, dsink


def _host_list(t):
    return None if t is None else [int(v) for v in t.tolist()]


@_portable("npu::npu_fusion_attention_v3")
def npu_fusion_attention_v3(query, key, value, head_num, input_layout, pse=None,
                            padding_mask=None, atten_mask=None, scale=1.0, keep_prob=1.0,
                            pre_tockens=_MAX_TOKENS, next_tockens=_MAX_TOKENS, inner_precise=0,
                            prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                            sparse_mode=0, gen_mask_parallel=True, sync=False,
                            softmax_layout="", sink=None):
    out, smax, ssum, sout, seed, offset, _ = npu_fusion_attention(
        query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
        keep_prob, pre_tockens, next_tockens, inner_precise, prefix,
        _host_list(actual_seq_qlen), _host_list(actual_seq_kvlen), sparse_mode,
        gen_mask_parallel, sync, softmax_layout, sink)
    as_tensor = lambda v: torch.full([1], v, dtype=torch.int64, device=query.device)  # noqa: E731
    return out, smax, ssum, sout, as_tensor(seed), as_tensor(offset)


@_portable("npu::npu_fusion_attention_grad_v3")
def npu_fusion_attention_grad_v3(query, key, value, dy, head_num, input_layout, *, seed=None,
                                 offset=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                 keep_prob=1.0, **kwargs):
    dropout = keep_prob < 1.0  # seed / offset are read (on the host) only for dropout
    return npu_fusion_attention_grad(
        query, key, value, dy, head_num, input_layout,
        seed=int(seed.item()) if dropout and seed is not None else 0,
        offset=int(offset.item()) if dropout and offset is not None else 0,
        actual_seq_qlen=_host_list(actual_seq_qlen), actual_seq_kvlen=_host_list(actual_seq_kvlen),
        keep_prob=keep_prob, **kwargs)


def _write_outputs(outs, values):
    for out, value in zip(outs, values):
        out.resize_(value.shape).copy_(value)
    return tuple(outs)


@_portable("npu::npu_fusion_attention_v3.out")
def npu_fusion_attention_v3_out(query, key, value, head_num, input_layout, *args,
                                workspace=None, attention_score, softmax_max, softmax_sum,
                                softmax_out, seed, offset, **kwargs):
    args = args[:16]  # without a positional workspace (unused)
    values = torch.ops.npu.npu_fusion_attention_v3(query, key, value, head_num, input_layout,
                                                   *args, **kwargs)
    return _write_outputs((attention_score, softmax_max, softmax_sum, softmax_out, seed, offset),
                          values)


@_portable("npu::npu_fusion_attention_grad_v3.out")
def npu_fusion_attention_grad_v3_out(query, key, value, dy, head_num, input_layout, *,
                                     workspace=None, dq, dk, dv, dpse, dsink, **kwargs):
    values = torch.ops.npu.npu_fusion_attention_grad_v3(query, key, value, dy, head_num,
                                                        input_layout, **kwargs)
    return _write_outputs((dq, dk, dv, dpse, dsink), values)


@_portable("npu::_npu_dropout_gen_mask.Tensor")
def _npu_dropout_gen_mask(self, size, p, seed, offset, *, parallel=True, sync=None):
    """The CPU kernel's bits (the Philox stream is defined there), copied to self's device."""
    probe = torch.empty(0)
    bits = torch.ops.npu._npu_dropout_gen_mask.Tensor(probe, size, p, seed, offset,
                                                       parallel=parallel, sync=sync)
    return bits.to(self.device)


# ----------------------------------------------------------------------------- inference attention


def _fia_bnsd(t, layout, heads):
    """[B, N, S, D] (varlen: [T, N, D]) view of a q/k/v tensor in `layout`."""
    if layout == "BSH":
        return t.unflatten(2, (heads, t.shape[2] // heads)).transpose(1, 2)
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "NSD":
        return t.unsqueeze(0)
    if layout == "NTD":
        return t.transpose(0, 1)
    return t


def _fia_layout_out(t, layout):
    """[B, N, S, D] (varlen [T, N, D]) -> the output layout."""
    if layout == "BSH":
        return t.transpose(1, 2).flatten(2)
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "NBSD":
        return t.transpose(0, 1)
    if layout == "NSD":
        return t.squeeze(0)
    if layout == "NTD":
        return t.transpose(0, 1)
    return t


def _fia_quant_side(op, aq, kvn, width, batch, paged, blocks, block_size):
    """One side's antiquant factors (scale, offset, mode, row of a combined [2, ...] tensor or
    None, (scale, offset, mode) names) -> (kind, scale, offset) in fp32: "channel" [KVN, 1, W];
    "token" [B, 1 | KVN, S] (logical rows); "paged" [blocks, 1 | KVN, block_size]."""
    sc, off, mode, index, (sname, oname, mname) = aq
    token = mode in (1, 3, 4, 5)

    def take(t, name):
        ok = t.dtype == torch.float32 if token else t.dtype in (torch.float16, torch.bfloat16,
                                                                 torch.float32)
        if not ok:
            raise RuntimeError(f"{op}: argument '{name}' must be "
                               f"{'float32' if token else 'float16, bfloat16 or float32'} for "
                               f"{mname} {mode}, but got {t.dtype}")
        if index is None:
            return t
        if t.dim() < 1 or t.shape[0] != 2:
            raise RuntimeError(f"{op}: argument '{name}' must hold the key (row 0) and value "
                               f"(row 1) factors in a leading dim of 2, but got shape "
                               f"{list(t.shape)}")
        return t[index]

    if off is not None and off.shape != sc.shape:
        raise RuntimeError(f"{op}: argument '{oname}' must have the shape of '{sname}' "
                           f"{list(sc.shape)}, but got {list(off.shape)}")
    s = take(sc, sname)
    o = take(off, oname) if off is not None else None
    sz, h = list(s.shape), kvn * width
    target = None
    if mode == 0:
        if sz in ([], [1]):
            target = (1, 1, 1)
        elif sz in ([1, kvn, 1, width], [1, kvn, width], [1, h], [kvn, 1, width], [kvn, width],
                    [h]):
            target = (kvn, 1, width)
    elif mode == 1:
        if len(sz) == 3 and sz[:2] == [1, batch] or len(sz) == 2 and sz[0] == batch:
            target = (batch, 1, sz[-1])
    elif mode == 2 and sz == [kvn]:
        target = (kvn, 1, 1)
    elif mode == 3 and len(sz) == 3 and sz[:2] == [batch, kvn]:
        target = tuple(sz)
    elif mode == 4 and paged and sz == [blocks, block_size]:
        target = (blocks, 1, block_size)
    elif mode == 5 and paged and sz == [blocks, kvn, block_size]:
        target = tuple(sz)
    if target is None:
        raise RuntimeError(f"{op}: argument '{sname}' does not fit {mname} {mode} (B = {batch}, "
                           f"KV_N = {kvn}, D = {width}, paged: {paged}): shape {list(sc.shape)}")
    kind = "channel" if mode in (0, 2) else ("paged" if mode in (4, 5) else "token")
    return kind, s.float().reshape(target), (o.float().reshape(target) if o is not None else None)


def _fia_dequant(x, side, b, ids):
    """int8 rows [KVN, S, W] of batch b (`ids` its cache blocks when paged) -> fp32
    (x + offset) * scale."""
    kind, sc, off = side

    def factor(t):
        if kind == "channel":
            return t
        r = t[b] if kind == "token" else t[ids].transpose(0, 1).flatten(1)
        return r[:, :x.shape[1]].unsqueeze(-1)

    y = x.float()
    if off is not None:
        y = y + factor(off)
    return y * factor(sc)


def _fia(query, key, value, pse_shift, atten_mask, seq, seq_kv, block_table, query_rope,
         key_rope, sink, num_heads, scale, pre_tokens, next_tokens, input_layout,
         num_key_value_heads, sparse_mode, block_size, lse_flag, op, antiquant=None, p_quant=0.0):
    """p_quant > 0: full quantisation's exps become int8 codes of e * p_quant (float16 product,
    half to even, saturated at 127) before P V; the row sums stay the exps' own."""
    from .infer_attention import LAYOUTS, output_shapes

    lin, lout = LAYOUTS[input_layout.upper()]
    if num_key_value_heads and num_heads % num_key_value_heads:
        raise RuntimeError(f"{op}: argument 'num_key_value_heads' must divide num_heads "
                           f"{num_heads} (grouped-query attention), but got {num_key_value_heads}")
    routed = flash_route.infer(
        query, key, value, num_heads=num_heads, num_key_value_heads=num_key_value_heads, lin=lin,
        lout=lout, scale=scale, atten_mask=atten_mask, sparse_mode=sparse_mode,
        pre_tokens=pre_tokens, next_tokens=next_tokens, seq_q=seq, seq_kv=seq_kv,
        lse_flag=lse_flag, unrouted=any(t is not None for t in (pse_shift, block_table, query_rope,
                                                                 key_rope, sink, antiquant)) or p_quant > 0)
    if routed is not None:  # CUDA: the flash / cuDNN kernels
        return routed
    n, kvn = num_heads, num_key_value_heads or num_heads
    g = n // kvn
    acc = _acc(query.dtype)
    paged = block_table is not None
    varlen = lin in ("TND", "NTD")
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise NotImplementedError(f"{op}: sparse_mode {sparse_mode} (portable path)")
    q = _fia_bnsd(query, lin, n)
    qr = _fia_bnsd(query_rope, lin, n) if query_rope is not None else None

    def cache(t):  # [blocks, block_size, KVN, D]
        if t.dim() == 5:  # NZ [blocks, KVN, D / c, block_size, c]
            return t.permute(0, 3, 1, 2, 4).flatten(3)
        return t.unflatten(2, (kvn, t.shape[2] // kvn)) if t.dim() == 3 else t.transpose(1, 2)

    if paged:
        kc, vc = cache(key), cache(value)
        krc = cache(key_rope) if key_rope is not None else None
    else:
        kc, vc = _fia_bnsd(key, lin, kvn), _fia_bnsd(value, lin, kvn)
        krc = _fia_bnsd(key_rope, lin, kvn) if key_rope is not None else None
    if varlen:
        ends = list(seq)
        q_starts, q_lens = [0] + ends[:-1], [e - s for s, e in zip([0] + ends[:-1], ends)]
        batch = len(ends)
        if paged:
            kv_starts = [0] * batch
            kv_lens = [seq_kv[0] if len(seq_kv) == 1 else seq_kv[b] for b in range(batch)]
        else:
            kv_ends = list(seq_kv)
            kv_starts = [0] + kv_ends[:-1]
            kv_lens = [e - s for s, e in zip(kv_starts, kv_ends)]
        sq_all = q.shape[0]
    else:
        batch, sq_all = q.shape[0], q.shape[2]
        full = kc.shape[2] if not paged else None
        q_lens = [sq_all] * batch if seq is None or sq_all == 1 else \
            [seq[0] if len(seq) == 1 else seq[b] for b in range(batch)]
        kv_lens = [full] * batch if seq_kv is None else \
            [seq_kv[0] if len(seq_kv) == 1 else seq_kv[b] for b in range(batch)]
        q_starts = kv_starts = [0] * batch
    decode = max(q_lens, default=0) <= 1 and (varlen or sq_all == 1)
    ignore_sparse = decode and query_rope is None
    int8 = key.dtype == torch.int8
    if int8 != (antiquant is not None) or int8 and value.dtype != torch.int8:
        raise RuntimeError(f"{op}: int8 key and value need antiquant factors (and the factors an "
                           f"int8 key/value), but got key {key.dtype}, value {value.dtype} and "
                           f"{'no ' if antiquant is None else ''}factors")
    if int8:
        blocks = key.shape[0] if paged else 0
        kq = _fia_quant_side(op, antiquant[0], kvn, kc.shape[-1], batch, paged, blocks, block_size)
        vq = _fia_quant_side(op, antiquant[1], kvn, vc.shape[-1], batch, paged, blocks, block_size)
    shapes = output_shapes(query, value, input_layout, paged, n, num_key_value_heads, lse_flag)
    dv = shapes[0][-1] if lout not in ("BSH",) else shapes[0][-1] // n
    out_c = query.new_zeros((sq_all, n, dv) if varlen else (batch, n, sq_all, dv), dtype=acc)
    lse_c = query.new_full((sq_all, n, 1) if varlen else (batch, n, sq_all, 1), -math.inf,
                           dtype=torch.float32)
    for b in range(batch):
        sq, skv = q_lens[b], kv_lens[b]
        if sq == 0:
            continue
        if varlen:
            qb = q[q_starts[b]:q_starts[b] + sq].transpose(0, 1)
            qrb = qr[q_starts[b]:q_starts[b] + sq].transpose(0, 1) if qr is not None else None
        else:
            qb = q[b, :, :sq]
            qrb = qr[b, :, :sq] if qr is not None else None

        ids = block_table[b, :(skv + block_size - 1) // block_size].long() if paged else None

        def rows(c):
            if c is None:
                return None
            if paged:
                return c[ids].flatten(0, 1)[:skv].transpose(0, 1)
            if varlen:
                return c[kv_starts[b]:kv_starts[b] + skv].transpose(0, 1)
            return c[b, :, :skv]

        kb, vb, krb = rows(kc), rows(vc), rows(krc)
        if int8:
            kb, vb = _fia_dequant(kb, kq, b, ids), _fia_dequant(vb, vq, b, ids)
        kb = kb.to(acc).repeat_interleave(g, 0)
        vb = vb.to(acc).repeat_interleave(g, 0)
        s = qb.to(acc) @ kb.transpose(-1, -2)
        if qrb is not None:
            s = s + qrb.to(acc) @ krb.to(acc).repeat_interleave(g, 0).transpose(-1, -2)
        s = s * scale
        if pse_shift is not None:
            s = s + pse_shift[b if pse_shift.shape[0] > 1 else 0, :, :sq, :skv].to(acc)
        masked = None
        if not ignore_sparse and (sparse_mode != 0 or atten_mask is not None):
            masked = _visibility(sparse_mode, sq, skv, 1, None,
                                 pre_tokens, next_tokens, None, query.device)
        if atten_mask is not None and sparse_mode in (0, 1):
            m = atten_mask
            if decode and m.dim() == 2 and not varlen:
                m = m[b if m.shape[0] > 1 else 0].unsqueeze(0)
            elif m.dim() == 3:
                m = m[b if m.shape[0] > 1 else 0]
            elif m.dim() == 4:
                m = m[b if m.shape[0] > 1 else 0]
            m = m[..., :sq, :skv].bool() if m.shape[-2] > 1 else m[..., :1, :skv].bool()
            masked = m if masked is None else masked | m
        if masked is not None:
            s = s.masked_fill(masked, -math.inf)
        if sink is not None:
            s = torch.cat([s, sink.to(acc).view(n, 1, 1).expand(n, sq, 1)], -1)
            vb = torch.cat([vb, vb.new_zeros(n, 1, vb.shape[-1])], 1)
        mx = s.amax(-1, keepdim=True) if s.shape[-1] > 0 else s.new_full((n, sq, 1), -math.inf)
        mx_safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
        e = torch.exp(s - mx_safe)
        tot = e.sum(-1, keepdim=True)
        p = (e * p_quant).half().to(acc).round_().clamp_(max=127.0) if p_quant > 0 else e
        ob = torch.where(tot > 0, (p @ vb) / torch.where(tot > 0, tot, torch.ones_like(tot)), 0.0)
        lb = (torch.log(tot) + mx_safe).float()
        if varlen:
            out_c[q_starts[b]:q_starts[b] + sq] = ob.transpose(0, 1)
            lse_c[q_starts[b]:q_starts[b] + sq] = lb.transpose(0, 1)
        else:
            out_c[b, :, :sq] = ob
            lse_c[b, :, :sq] = lb
    out = _fia_layout_out(out_c, lout).to(query.dtype).contiguous()
    lse = lse_c if lse_flag else query.new_zeros(1, dtype=torch.float32)
    return out, lse


def _fia_antiquant_pair(op, k, v):
    """torch_npu's pairing rules of the key / value antiquant factors; None when none given."""
    (ks, ko, km, kidx, kn), (vs, vo, vm, _, vn) = k, v
    if kidx is None:
        for i in (0, 1):
            if (k[i] is None) != (v[i] is None):
                given, missing = (kn[i], vn[i]) if k[i] is not None else (vn[i], kn[i])
                raise RuntimeError(f"{op}: argument '{missing}' must be given together with "
                                   f"'{given}'")
    if ks is None:
        if ko is not None:
            raise RuntimeError(f"{op}: argument '{kn[1]}' needs '{kn[0]}' (an offset without a "
                               "scale)")
        return None
    if not (km == vm or (km == 0 and vm == 1)):
        raise RuntimeError(f"{op}: argument '{vn[2]}' must equal {kn[2]} ({km}), or be 1 with "
                           f"{kn[2]} 0, but got {vm}")
    return k, v


def _fia_quantised(op, names, scale, offset, out_dtype, call, query, key, value, query_rope,
                   key_rope, num_heads, input_layout, dequant=None):
    """call(query, key, value, query_rope, key_rope) -> (out, lse), with the output quantised when
    `scale` is given: float32 inputs, o * scale + offset in float32, then int8 through float16
    (half to even, saturated, NaN -> 0) or float8 directly. `dequant` (full quantisation's
    dequant_scale2) multiplies the float32 output first; unquantised, it is then float16."""
    from .infer_attention import LAYOUTS

    if scale is None:
        if offset is not None:
            raise RuntimeError(f"{op}: argument '{names[1]}' needs '{names[0]}' (an output "
                               f"quantisation offset without a scale)")
        out, lse = call(query, key, value, query_rope, key_rope)
        return (out.mul_(dequant).half(), lse) if dequant is not None else (out, lse)
    bf16 = query.dtype == torch.bfloat16
    if scale.dtype != torch.float32 and not (bf16 and scale.dtype == torch.bfloat16):
        raise RuntimeError(f"{op}: argument '{names[0]}' must be float32 (or bfloat16 with a "
                           f"bfloat16 query), but got {scale.dtype} with a {query.dtype} query")
    if offset is not None and (offset.dtype != scale.dtype or offset.shape != scale.shape):
        raise RuntimeError(f"{op}: argument '{names[1]}' must have the dtype and shape of "
                           f"'{names[0]}'")

    def f32(t):
        return t.float() if t is not None and t.is_floating_point() else t

    out, lse = call(f32(query), f32(key), f32(value), f32(query_rope), f32(key_rope))
    if dequant is not None:
        out.mul_(dequant)
    lout = LAYOUTS[input_layout.upper()][1]
    c = out.transpose(0, 1) if lout == "NBSD" else _fia_bnsd(out, lout, num_heads)  # views
    n, dv = c.shape[1], c.shape[-1]  # [B, N, S, D] or [T, N, D]
    if scale.numel() not in (1, n * dv):
        raise RuntimeError(f"{op}: argument '{names[0]}' must hold one factor (per tensor) or "
                           f"Q_N * D = {n * dv} factors (per channel), but got shape "
                           f"{tuple(scale.shape)}")

    def fit(t):
        t = t.float().reshape(n, dv) if t.numel() != 1 else t.float().reshape(1)
        return t.unsqueeze(1) if t.dim() == 2 and c.dim() == 4 else t

    c.mul_(fit(scale))
    if offset is not None:
        c.add_(fit(offset))
    if out_dtype == torch.uint8:  # hifloat8 codes
        return _hif8_encode(out), lse
    if out_dtype != torch.int8:
        return out.to(out_dtype), lse
    h = out.half().float().nan_to_num_(0.0, 127.0, -128.0).round_().clamp_(-128.0, 127.0)
    return h.to(torch.int8), lse


def _fia_reject(op, **tensors):
    for name, t in tensors.items():
        if t is not None:
            raise RuntimeError(f"{op}: argument '{name}' is not supported by opennpu; pass None")


@_portable("npu::npu_fused_infer_attention_score")
def npu_fused_infer_attention_score(
        query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
        actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None, dequant_scale2=None,
        quant_scale2=None, quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
        key_antiquant_scale=None, key_antiquant_offset=None, value_antiquant_scale=None,
        value_antiquant_offset=None, block_table=None, query_padding_size=None,
        kv_padding_size=None, key_shared_prefix=None, value_shared_prefix=None,
        actual_shared_prefix_len=None, query_rope=None, key_rope=None,
        key_rope_antiquant_scale=None, num_heads=1, scale=1.0, pre_tokens=_MAX_TOKENS,
        next_tokens=_MAX_TOKENS, input_layout="BSH", num_key_value_heads=0, sparse_mode=0,
        inner_precise=0, block_size=0, antiquant_mode=0, key_antiquant_mode=0,
        value_antiquant_mode=0, softmax_lse_flag=False):
    op = "npu_fused_infer_attention_score"
    _fia_reject(op, query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
                key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
                actual_shared_prefix_len=actual_shared_prefix_len)
    if any(t is not None for t in (key_antiquant_scale, value_antiquant_scale,
                                   key_antiquant_offset, value_antiquant_offset)):
        aq = _fia_antiquant_pair(
            op, (key_antiquant_scale, key_antiquant_offset, key_antiquant_mode, None,
                 ("key_antiquant_scale", "key_antiquant_offset", "key_antiquant_mode")),
            (value_antiquant_scale, value_antiquant_offset, value_antiquant_mode, None,
             ("value_antiquant_scale", "value_antiquant_offset", "value_antiquant_mode")))
    elif antiquant_scale is not None or antiquant_offset is not None:
        names = ("antiquant_scale", "antiquant_offset", "antiquant_mode")
        if antiquant_mode not in (0, 1):
            raise RuntimeError(f"{op}: argument 'antiquant_mode' must be 0 (per channel / tensor) "
                               f"or 1 (per token) with antiquant_scale, but got {antiquant_mode}")
        aq = _fia_antiquant_pair(op, (antiquant_scale, antiquant_offset, antiquant_mode, 0, names),
                                 (antiquant_scale, antiquant_offset, antiquant_mode, 1, names))
    else:
        aq = None
    fq = _fia_full_quant(op, query, key, value, dequant_scale1, quant_scale1, dequant_scale2,
                         aq is not None, query_rope, input_layout)
    if fq is not None:  # the int8 codes as float32, the output dequantised below
        query, key, value = query.float(), key.float(), value.float()
        scale = float(torch.tensor(scale * fq[0], dtype=torch.float32))
    out, lse = _fia_quantised(
        op, ("quant_scale2", "quant_offset2"), quant_scale2, quant_offset2, torch.int8,
        lambda q, k, v, qr, kr: _fia(
            q, k, v, pse_shift, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
            block_table, qr, kr, None, num_heads, scale, pre_tokens, next_tokens, input_layout,
            num_key_value_heads, sparse_mode, block_size, softmax_lse_flag, op, aq,
            fq[1] if fq is not None else 0.0),
        query, key, value, query_rope, key_rope, num_heads, input_layout,
        dequant=fq[2] if fq is not None else None)
    return out, lse


def _fia_full_quant(op, query, key, value, deq1, quant1, deq2, antiquant, query_rope, layout):
    """(dequant_scale1, quant_scale1, dequant_scale2) as floats for an int8 query (full
    quantisation; the native kernel's rules and messages), None otherwise."""
    int8 = query.dtype == torch.int8
    given = next((n for n, t in (("dequant_scale1", deq1), ("quant_scale1", quant1),
                                 ("dequant_scale2", deq2)) if t is not None), None)
    if not int8 and given is None:
        return None
    if not int8:
        raise RuntimeError(f"{op}: argument '{given}' needs an int8 query, key and value (full "
                           f"quantisation), but got a {query.dtype} query")
    for name, t in (("dequant_scale1", deq1), ("quant_scale1", quant1), ("dequant_scale2", deq2)):
        if t is None:
            raise RuntimeError(f"{op}: argument '{name}' is needed with an int8 query (full "
                               "quantisation: dequant_scale1, quant_scale1 and dequant_scale2)")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != torch.int8:
            raise RuntimeError(f"{op}: argument '{name}' must be int8 with an int8 query (full "
                               f"quantisation), but got {t.dtype}")
    if antiquant:
        raise RuntimeError(f"{op}: argument 'antiquant_scale' does not apply with an int8 query")
    if query_rope is not None:
        raise RuntimeError(f"{op}: argument 'query_rope' is not supported with an int8 query "
                           "(int8 MLA) by opennpu")
    if layout not in ("BSH", "BNSD", "BSND", "BNSD_BSND"):
        raise RuntimeError(f"{op}: argument 'input_layout' must be BSH, BNSD, BSND or BNSD_BSND "
                           f"with an int8 query (full quantisation, as on Ascend), but got "
                           f"'{layout}'")

    def dequant(name, t):
        if t.numel() != 1 or t.dtype not in (torch.float32, torch.int64, torch.uint64):
            raise RuntimeError(f"{op}: argument '{name}' must hold one factor (per tensor), "
                               f"float32 or int64 / uint64 (npu_trans_quant_param's encoding), "
                               f"but got a {t.dtype} tensor of shape {tuple(t.shape)}")
        return float(_deq_scale(t.reshape(1)))

    if quant1.numel() != 1 or quant1.dtype != torch.float32:
        raise RuntimeError(f"{op}: argument 'quant_scale1' must hold one float32 factor (per "
                           f"tensor), but got a {quant1.dtype} tensor of shape "
                           f"{tuple(quant1.shape)}")
    q1 = float(quant1)
    if not (q1 > 0 and math.isfinite(q1)):
        raise RuntimeError(f"{op}: argument 'quant_scale1' must be a positive finite factor, "
                           f"but got {q1}")
    return dequant("dequant_scale1", deq1), q1, dequant("dequant_scale2", deq2)


def _fia_out(functional):
    """The .out overload of an infer-attention op: `functional`'s outputs copied in."""
    def out_kernel(query, key, value, *, workspace=None, attention_out, softmax_lse, **kwargs):
        out, lse = functional(query, key, value, **kwargs)
        attention_out.resize_(out.shape).copy_(out)
        softmax_lse.resize_(lse.shape).copy_(lse)
        return attention_out, softmax_lse

    return out_kernel


npu_fused_infer_attention_score_out = _portable("npu::npu_fused_infer_attention_score.out")(
    _fia_out(torch.ops.npu.npu_fused_infer_attention_score))
npu_fused_infer_attention_score_v2_out = _portable("npu::npu_fused_infer_attention_score_v2.out")(
    _fia_out(torch.ops.npu.npu_fused_infer_attention_score_v2))


@_portable("npu::_npu_fused_infer_attention_score_get_max_workspace")
@_portable("npu::_npu_fused_infer_attention_score_v2_get_max_workspace")
def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs):
    return query.new_empty(0, dtype=torch.uint8)


def _fia_zero_outputs(query, value, input_layout, block_table, heads, kv_heads, lse_flag, dtype):
    from .infer_attention import output_shapes

    out, lse = output_shapes(query, value, input_layout, block_table is not None, heads, kv_heads,
                             lse_flag)
    return query.new_zeros(out, dtype=dtype), query.new_zeros(lse, dtype=torch.float32)


@_portable("npu::_npu_fused_infer_attention_score_infer_output")
def _npu_fused_infer_attention_score_infer_output(query, value, *, input_layout="BSH",
                                                  quant_scale2=None, block_table=None,
                                                  num_heads=1, num_key_value_heads=0,
                                                  softmax_lse_flag=False, query_rope=None):
    dtype = torch.int8 if quant_scale2 is not None else query.dtype
    return _fia_zero_outputs(query, value, input_layout, block_table, num_heads,
                             num_key_value_heads, softmax_lse_flag, dtype)


@_portable("npu::_npu_fused_infer_attention_score_v2_infer_output")
def _npu_fused_infer_attention_score_v2_infer_output(
        query, value, *, query_dtype=None, value_dtype=None, input_layout="BSH",
        quant_scale_out=None, block_table=None, num_query_heads=1, num_key_value_heads=0,
        return_softmax_lse=False, query_rope=None, out_dtype=None):
    from .infer_attention import v2_out_dtype

    return _fia_zero_outputs(query, value, input_layout, block_table, num_query_heads,
                             num_key_value_heads, return_softmax_lse,
                             v2_out_dtype(query, quant_scale_out, out_dtype, query_rope))


@_portable("npu::npu_fused_infer_attention_score_v2")
def npu_fused_infer_attention_score_v2(
        query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None, dequant_scale_query=None,
        dequant_scale_key=None, dequant_offset_key=None, dequant_scale_value=None,
        dequant_offset_value=None, dequant_scale_key_rope=None, quant_scale_out=None,
        quant_offset_out=None, quant_scale_p=None, learnable_sink=None, num_query_heads=1,
        num_key_value_heads=0, softmax_scale=1.0, pre_tokens=_MAX_TOKENS,
        next_tokens=_MAX_TOKENS, input_layout="BSH", sparse_mode=0, block_size=0,
        query_quant_mode=0, key_quant_mode=0, value_quant_mode=0, inner_precise=0,
        return_softmax_lse=False, **_dtypes):
    op = "npu_fused_infer_attention_score_v2"
    from .infer_attention import v2_out_dtype

    _fia_reject(op, quant_scale_p=quant_scale_p)
    out_dtype = v2_out_dtype(query, quant_scale_out, _dtypes.get("out_dtype"), query_rope)
    int8_query = query.dtype == torch.int8 or dequant_scale_query is not None or query_quant_mode
    if int8_query:  # int8 MLA: the native kernel's rules, in short
        if (query.dtype != torch.int8 or query_quant_mode != 3 or dequant_scale_query is None
                or query_rope is None or key_rope is None or quant_scale_out is not None
                or dequant_offset_key is not None or dequant_offset_value is not None):
            raise RuntimeError(f"{op}: an int8 query needs query_quant_mode 3, "
                               "dequant_scale_query, query_rope and key_rope, and takes no "
                               "quant_scale_out or key / value offsets")
        s = dequant_scale_query.float().reshape(*query.shape[:-1], 1)
        query, query_rope, key_rope = query.float() * s, query_rope.float(), key_rope.float()
    aq = _fia_antiquant_pair(
        op, (dequant_scale_key, dequant_offset_key, key_quant_mode, None,
             ("dequant_scale_key", "dequant_offset_key", "key_quant_mode")),
        (dequant_scale_value, dequant_offset_value, value_quant_mode, None,
         ("dequant_scale_value", "dequant_offset_value", "value_quant_mode")))
    out, lse = _fia_quantised(
        op, ("quant_scale_out", "quant_offset_out"), quant_scale_out, quant_offset_out, out_dtype,
        lambda q, k, v, qr, kr: _fia(
            q, k, v, pse_shift, atten_mask, actual_seq_qlen, actual_seq_kvlen, block_table, qr,
            kr, learnable_sink, num_query_heads, softmax_scale, pre_tokens, next_tokens,
            input_layout, num_key_value_heads, sparse_mode, block_size, return_softmax_lse, op,
            aq),
        query, key, value, query_rope, key_rope, num_query_heads, input_layout)
    return (out.to(out_dtype), lse) if int8_query else (out, lse)


# On CUDA the C++ router of npu_fused_infer_attention_score and _v2 (csrc/ops/attention/
# infer_attention_cuda.cu) runs decode calls on its kernel and sends the others here, under
# opennpu's names (the same schemas). Called eagerly from that kernel, never traced.
_portable("opennpu::_fia_portable")(npu_fused_infer_attention_score)
_portable("opennpu::_fia_v2_portable")(npu_fused_infer_attention_score_v2)
NOT_DECOMPOSED.update({"opennpu::_fia_portable", "opennpu::_fia_v2_portable"})


# ----------------------------------------------------------------------------- sampling


@_portable("npu::npu_top_k_top_p")
def npu_top_k_top_p(logits, p=None, k=None):
    """Stable ascending sort of the row; top-k masks the values below the k-th largest, top-p the
    entries whose running softmax mass (float32, from the smallest) is <= 1 - p; back in place."""
    if p is None and k is None:
        return logits.clone()
    vals, order = logits.sort(dim=-1, stable=True)
    if k is not None:
        kth = vals.gather(-1, (vals.shape[-1] - k.long()).unsqueeze(-1))
        vals = vals.masked_fill(vals < kth, -math.inf)
    if p is not None:
        mass = vals.float().softmax(-1).cumsum(-1)
        drop = mass <= (1 - p).unsqueeze(-1)
        drop[..., -1] = False
        vals = vals.masked_fill(drop, -math.inf)
    return torch.empty_like(vals).scatter_(-1, order, vals)


def _rows(t, rows):
    return t.reshape(rows).float()


@_portable("npu::npu_top_k_top_p_sample")
def npu_top_k_top_p_sample(logits, top_k, top_p, q=None, eps=1e-8, is_need_logits=False,
                           top_k_guess=32, min_ps=None, ks_max=1024, input_is_logits=True,
                           post_sample="qSample", generator=None):
    """The golden's row loop on the whole batch: entries sorted descending (stable), top-k as a
    prefix, top-p on the exclusive running sum, min-p against the kept maximum; rows with no
    filter but min_p < 1 stay in index order. q (and the multinomial's Exp(1) draws) is read at
    the kept entry's rank among the kept."""
    eps = 1e-8 if eps is None else eps
    ks_max = 1024 if ks_max is None else ks_max
    input_is_logits = True if input_is_logits is None else input_is_logits
    post_sample = "qSample" if post_sample is None else post_sample
    b, v = logits.shape
    x = logits.float()
    k_max = min((ks_max + 7) // 8 * 8, 1024)
    k = top_k.reshape(b).long()
    p = _rows(top_p, b)
    min_p = _rows(min_ps, b) if min_ps is not None else torch.full_like(p, -1.0)
    use_k = (k >= 1) & (k <= min(k_max, v))
    use_p = p < 1
    pos = torch.arange(v, device=logits.device)
    vals, order = x.sort(dim=-1, descending=True, stable=True)
    in_k = ~use_k.unsqueeze(-1) | (pos < k.unsqueeze(-1))
    if input_is_logits:
        prob = vals.masked_fill(~in_k, -math.inf).softmax(-1)
    else:
        prob = vals.masked_fill(~in_k, 0.0)
    mass = prob.cumsum(-1)
    in_p = ~((mass - prob) >= p.unsqueeze(-1))
    in_p = torch.where((p > 0).unsqueeze(-1), in_p, pos == 0)
    keep = in_k & (in_p | ~use_p.unsqueeze(-1))
    if input_is_logits:  # top_p <= 0 keeps the first alone, with probability 1
        one = (use_p & (p <= 0)).unsqueeze(-1) & (pos == 0)
        prob = torch.where(one, 1.0, prob)
    unsorted = (~use_k & ~use_p & (min_p < 1)).unsqueeze(-1)
    flat = x.softmax(-1) if input_is_logits else x
    prob = torch.where(unsorted, flat, prob)
    order = torch.where(unsorted, pos, order)
    keep = keep | unsorted
    top = prob.masked_fill(~keep, -math.inf).amax(-1, keepdim=True)
    mp = min_p.unsqueeze(-1)
    keep = torch.where(mp >= 1, keep & (pos == 0),
                       torch.where(mp > 0, keep & (prob >= top * mp), keep))
    rank = (keep.long().cumsum(-1) - 1).clamp(min=0)
    if post_sample == "qSample" and q is not None:
        score = prob / (q.float().gather(-1, rank).abs() + eps)
    elif post_sample == "multiNomial":
        draws = torch.empty(b, v, device=logits.device).exponential_(1.0, generator=generator)
        score = prob / draws.gather(-1, rank)
    else:
        score = prob
    pick = score.masked_fill(~keep, -math.inf).argmax(-1, keepdim=True)
    index = order.gather(-1, pick).reshape(b)
    if not is_need_logits:
        return index, x.new_empty(0)
    fill = -math.inf if input_is_logits else 0.0
    kept = torch.where(keep, x.gather(-1, order), fill)
    return index, torch.full_like(x, fill).scatter_(-1, order, kept)


# ----------------------------------------------------------------------------- registration


# ----------------------------------------------------------------------------- kvcache


def _host_side(qualname, mutating=False):
    NOT_DECOMPOSED.add(qualname)
    HOST_SIDE.add(qualname)
    if mutating:
        MUTATING.add(qualname)
    return _portable(qualname)


def _nd_index(indices):
    return tuple(indices.long().unbind(-1))


@_portable("npu::npu_scatter_nd_update")
def npu_scatter_nd_update(self, indices, updates):
    return self.clone(memory_format=torch.contiguous_format).index_put_(_nd_index(indices),
                                                                        updates)


@_host_side("npu::npu_scatter_nd_update_", mutating=True)
def npu_scatter_nd_update_(self, indices, updates):
    return self.index_put_(_nd_index(indices), updates)


def _scatter_cache(tok, cache, slots, nz):
    keep = slots >= 0
    slots = slots[keep].long()  # padding tokens (negative slots) skipped: a host-side count
    block_size = cache.shape[2] if nz else cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    rows = tok[keep]
    if nz:
        cache[blocks, :, offsets, :] = rows.reshape(-1, cache.shape[1], cache.shape[3])
    else:
        cache[blocks, offsets] = rows.reshape(-1, *cache.shape[2:])


@_host_side("npu::npu_scatter_pa_kv_cache", mutating=True)
def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *,
                            compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                            cache_mode="PA_NZ"):
    if compress_lens is not None or compress_seq_offsets is not None or seq_lens is not None:
        raise NotImplementedError("npu_scatter_pa_kv_cache: the compression scenario "
                                  "(compress_lens, compress_seq_offsets, seq_lens) is not "
                                  "implemented by opennpu")
    if cache_mode not in (None, "Norm", "PA_NZ"):
        raise RuntimeError("npu_scatter_pa_kv_cache: argument 'cache_mode' must be 'Norm', "
                           f"'PA_NZ' or None, but got '{cache_mode}'")
    nz = cache_mode == "PA_NZ"
    _scatter_cache(key, key_cache, slot_mapping, nz)
    _scatter_cache(value, value_cache, slot_mapping, nz)


@_host_side("npu::npu_scatter_pa_kv_cache_functional")
def npu_scatter_pa_kv_cache_functional(key, value, key_cache, value_cache, slot_mapping, **kw):
    k = key_cache.clone(memory_format=torch.contiguous_format)
    v = value_cache.clone(memory_format=torch.contiguous_format)
    npu_scatter_pa_kv_cache(key, value, k, v, slot_mapping, **kw)
    return k, v


@_host_side("npu::npu_apply_rotary_pos_emb", mutating=True)
def npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSND", rotary_mode="half"):
    """Written into query and key, which are returned (torch_npu's in-place contract)."""
    for x in (query, key):
        x.copy_(npu_rotary_mul(x, cos, sin, rotary_mode))
    return query, key


def _kv_rope_values(kv, gamma, cos, sin, v, epsilon):
    """(k, c) of npu_kv_rmsnorm_rope_cache in the accumulator dtype."""
    x = _up(kv)
    if v is None:
        dc = gamma.shape[0]
        return _interleave_rope(x[..., dc:], cos, sin), _rms(x[..., :dc], gamma, epsilon)[0]
    dr = cos.shape[-1]
    y = _rms(x, gamma, epsilon)[0]
    return torch.cat([_interleave_rope(y[..., :dr], cos, sin), y[..., dr:]], -1), _up(v)


def _kv_cache_rows(values, scale, cache):
    rows = values.reshape(-1, values.shape[-1])
    if scale is None:
        return rows.to(cache.dtype)
    return (rows * scale.reshape(-1).to(rows.dtype)).round().clamp(-128, 127).to(torch.int8)


def _kv_write(cache, rows, index, mode, batch, seq):
    """rows [B * S, W] into the (contiguous) cache at the rows index names (host-side counts)."""
    w = rows.shape[-1]
    tokens = torch.arange(batch * seq, device=rows.device)
    if mode == "Norm":
        idx = index.reshape(-1).long()
        keep = idx >= 0
        cache.view(batch, -1, w)[(tokens // seq)[keep], idx[keep]] = rows[keep]
        return
    bs = cache.shape[1]
    if "BLK" in mode:
        pages = index.numel() // batch
        s = tokens % seq
        start = index.reshape(-1).long()[(tokens // seq) * pages + s // bs]
        keep = start >= 0
        target = (start // bs) * bs + s % bs
    else:
        target = index.reshape(-1).long()
        keep = target >= 0
    target, rows = target[keep], rows[keep]
    if mode.endswith("NZ"):
        d0 = max(1, 32 // cache.element_size())
        cache.view(cache.shape[0], w // d0, bs, d0)[target // bs, :, target % bs, :] = (
            rows.reshape(-1, w // d0, d0))
    else:
        cache.view(-1, w)[target] = rows


def _kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale,
                           c_kv_scale, v, epsilon, cache_mode):
    if cache_mode not in ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ"):
        raise RuntimeError("npu_kv_rmsnorm_rope_cache: argument 'cache_mode' must be 'Norm', 'PA', "
                           "'PA_BNSD', 'PA_NZ', 'PA_BLK_BNSD' or 'PA_BLK_NZ', but got "
                           f"'{cache_mode}'")
    k, c = _kv_rope_values(kv, gamma, cos, sin, v, epsilon)
    batch, seq = kv.shape[0], kv.shape[2]
    _kv_write(k_cache, _kv_cache_rows(k, k_rope_scale, k_cache), index, cache_mode, batch, seq)
    _kv_write(ckv_cache, _kv_cache_rows(c, c_kv_scale, ckv_cache), index, cache_mode, batch, seq)
    return k.to(kv.dtype), c.to(kv.dtype)


@_host_side("npu::npu_kv_rmsnorm_rope_cache", mutating=True)
def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
                              k_rope_scale=None, c_kv_scale=None, k_rope_offset=None,
                              c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                              is_output_kv=False):
    k, c = _kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale,
                                  c_kv_scale, v, epsilon, cache_mode)
    return k_cache, ckv_cache, k, c


@_host_side("npu::npu_kv_rmsnorm_rope_cache_v2", mutating=True)
def npu_kv_rmsnorm_rope_cache_v2(kv, gamma, cos, sin, index, k_cache, ckv_cache, *,
                                 k_rope_scale=None, c_kv_scale=None, k_rope_offset=None,
                                 c_kv_offset=None, v=None, epsilon=1e-5, cache_mode="Norm",
                                 is_output_kv=False, k_cache_dtype=None, ckv_cache_dtype=None):
    return _kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_rope_scale,
                                  c_kv_scale, v, epsilon, cache_mode)


@_host_side("npu::npu_kv_rmsnorm_rope_cache_v2_functional")
def npu_kv_rmsnorm_rope_cache_v2_functional(kv, gamma, cos, sin, index, k_cache, ckv_cache,
                                            **kw):
    k_new = k_cache.clone(memory_format=torch.contiguous_format)
    c_new = ckv_cache.clone(memory_format=torch.contiguous_format)
    k, c = npu_kv_rmsnorm_rope_cache_v2(kv, gamma, cos, sin, index, k_new, c_new, **kw)
    return k, c, k_new, c_new


def _gather_plan(block_tables, seq_lens, seq_offset, cumsum, tokens, block_size, num_blocks):
    """(row, block, offset) lists on the host: the tokens of each sequence in order, block -1
    where the table has no valid block."""
    lens = seq_lens.tolist()
    if cumsum:
        lens = [b - a for a, b in zip(lens, lens[1:])]
    table = block_tables.tolist()
    starts = [0] * len(lens) if seq_offset is None else [o // block_size
                                                          for o in seq_offset.tolist()]
    blocks, offsets = [], []
    for i, n in enumerate(lens):
        for j in range(n):
            if len(blocks) >= tokens:
                return blocks, offsets
            k = starts[i] + j // block_size
            b = table[i][k] if k < len(table[i]) else -1
            blocks.append(b if 0 <= b < num_blocks else -1)
            offsets.append(j % block_size)
    return blocks, offsets


def _gather_cache(cache, out, blocks, offsets, nz):
    n = len(blocks)
    b = torch.tensor(blocks, device=cache.device, dtype=torch.long)
    o = torch.tensor(offsets, device=cache.device, dtype=torch.long)
    rows = cache[b.clamp(min=0), :, o, :] if nz else cache[b.clamp(min=0), o]
    rows = rows.reshape(n, *out.shape[1:])
    out[:n] = torch.where((b >= 0).view(-1, *([1] * (out.dim() - 1))), rows,
                          torch.zeros((), dtype=out.dtype, device=out.device))


@_host_side("npu::npu_gather_pa_kv_cache", mutating=True)
def npu_gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                           seq_offset=None, is_seq_lens_cumsum=False):
    h = key[0].numel() if key.dim() else 0
    nz = not (key_cache.shape[2] * key_cache.shape[3] == h)  # 'Norm' where both fit
    block_size = key_cache.shape[2] if nz else key_cache.shape[1]
    blocks, offsets = _gather_plan(block_tables, seq_lens, seq_offset, is_seq_lens_cumsum,
                                   key.shape[0], block_size, key_cache.shape[0])
    _gather_cache(key_cache, key, blocks, offsets, nz)
    _gather_cache(value_cache, value, blocks, offsets, nz)


@_host_side("npu::npu_gather_pa_kv_cache_functional")
def npu_gather_pa_kv_cache_functional(key_cache, value_cache, block_tables, seq_lens, key, value,
                                      **kw):
    k = key.clone(memory_format=torch.contiguous_format)
    v = value.clone(memory_format=torch.contiguous_format)
    npu_gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, k, v, **kw)
    return k, v



# ----------------------------------------------------------------------------- ATB (torch.ops.atb)
# Host-side like the KV-cache ops: slots, lengths and block tables are read on the host.


def _atb_layout_nz(tok, cache):
    """Whether `cache` holds tok's rows in the NZ blocking ('Norm' where both layouts fit)."""
    h = tok[0].numel() if tok.shape[0] else tok.shape[1:].numel()
    return not cache.shape[2] * cache.shape[3] == h


@_host_side("atb::_npu_reshape_and_cache", mutating=True)
def _atb_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    _scatter_cache(key, key_cache, slot_indices, _atb_layout_nz(key, key_cache))
    _scatter_cache(value, value_cache, slot_indices, _atb_layout_nz(value, value_cache))


@_host_side("atb::_npu_reshape_and_cache_siso", mutating=True)
def _atb_reshape_and_cache_siso(key, key_cache, slot_indices):
    _scatter_cache(key, key_cache, slot_indices, _atb_layout_nz(key, key_cache))


def _atb_heads(t, heads):
    return t if t.dim() == 3 else t.reshape(t.shape[0], heads, -1)


@_host_side("atb::_npu_paged_attention", mutating=True)
def _atb_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                         block_table, context_lens, out, *, workspace=None):
    q = _atb_heads(query, num_heads)
    block_size = key_cache.shape[1]
    table = block_table.long()
    result = q.new_zeros(q.shape[0], num_heads, value_cache.shape[-1], dtype=_acc(q.dtype))
    for b, n in enumerate(context_lens.tolist()):
        if n == 0:
            continue
        ids = table[b, :(n + block_size - 1) // block_size]
        k = key_cache[ids].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)  # [1, KVN, n, D]
        v = value_cache[ids].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0)
        o = _attention_core(_up(q[b]).unsqueeze(1).unsqueeze(0), _up(k), _up(v), None, None,
                            scale_value, None)[0]
        result[b] = o[0, :, 0]
    out.copy_(result.reshape(out.shape))


@_portable("atb::_npu_paged_attention_get_workspace")
def _atb_paged_attention_get_workspace(query, key_cache, value_cache, num_kv_heads, num_heads,
                                       scale_value, block_table, context_lens, out):
    return query.new_empty((0,), dtype=torch.uint8)


@_host_side("atb::_npu_flash_attention", mutating=True)
def _atb_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads,
                         out):
    q, k, v = (_atb_heads(query, num_heads), _atb_heads(key, num_kv_heads),
               _atb_heads(value, num_kv_heads))
    result = q.new_zeros(q.shape[0], num_heads, v.shape[-1], dtype=_acc(q.dtype))
    m = mask.to(_acc(q.dtype))
    masked = torch.isneginf(m)
    pse = m.masked_fill(masked, 0) / scale_value  # (q k + pse) * scale = scale q k + mask
    start = 0
    for b, n in enumerate(seq_len.tolist()):
        if n:
            def rows(t):
                return _up(t[start:start + n]).transpose(0, 1).unsqueeze(0)

            def window(t):
                t = t[..., :n, :n]
                if t.dim() >= 3 and t.shape[0] > 1:
                    t = t[b:b + 1]
                return t if t.dim() == 4 else t.reshape(1, 1, n, n) if t.dim() == 2 else t.unsqueeze(1)

            o = _attention_core(rows(q), rows(k), rows(v), window(pse), window(masked),
                                scale_value, None)[0]
            result[start:start + n] = o[0].transpose(0, 1)
        start += n
    out.copy_(result.reshape(out.shape))


@_host_side("atb::_npu_rotary_embedding", mutating=True)
def _atb_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    rot = cos_sin_cache.shape[-1]
    cs = cos_sin_cache.index_select(0, positions.reshape(-1).long())
    c, s_ = cs[:, :rot // 2], cs[:, rot // 2:]
    if is_neox_style:
        r1, r2, mode = torch.cat([c, c], -1), torch.cat([s_, s_], -1), "half"
    else:
        r1, r2, mode = c.repeat_interleave(2, -1), s_.repeat_interleave(2, -1), "interleave"
    tokens = cs.shape[0]
    for x in (query, key):
        if x.numel() == 0:
            continue
        heads = x.reshape(tokens, -1, head_size)
        part = heads[..., :rot]
        new = npu_rotary_mul(part, r1.unsqueeze(1), r2.unsqueeze(1), mode)
        x.copy_(torch.cat([new, heads[..., rot:]], -1).reshape(x.shape))


@_host_side("atb::npu_paged_cache_load.out", mutating=True)
def _atb_paged_cache_load_out(key_cache, value_cache, block_table, context_lens, *,
                              seq_starts=None, cumsum=False, key, value):
    npu_gather_pa_kv_cache(key_cache, value_cache, block_table, context_lens, key, value,
                           seq_offset=seq_starts, is_seq_lens_cumsum=cumsum)
    return key, value


@_host_side("atb::npu_paged_cache_load")
def _atb_paged_cache_load(key_cache, value_cache, block_table, context_lens, *, seq_starts=None,
                          cumsum=False):
    lens = context_lens.tolist()
    tokens = (lens[-1] - lens[0]) if cumsum else sum(lens)
    key = key_cache.new_zeros(tokens, *key_cache.shape[2:])
    value = value_cache.new_zeros(tokens, *value_cache.shape[2:])
    return _atb_paged_cache_load_out(key_cache, value_cache, block_table, context_lens,
                                     seq_starts=seq_starts, cumsum=cumsum, key=key, value=value)


# ----------------------------------------------------------------------------- fused optimizers

# opennpu::_fused_* (opennpu.optim's steps, gradient norm and (un)scaling): torch._foreach_*
# compositions in portable_optim.py. They read params[i].grad and write their arguments in place.
for _qualname, _fn in _optim_kernels.items():
    _host_side(_qualname, mutating=True)(_fn)

def _overload(qualname):
    ns_name, _, overload = qualname.partition(".")
    ns, name = ns_name.split("::")
    return getattr(getattr(getattr(torch.ops, ns), name), overload or "default")


def _first_device(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    return item.device.type
    return None


def _decomposition(qualname, fn, devices):
    """Traces fn into the graph for the devices where fn is the op's kernel (and CPU when
    forced); otherwise declines, and the op stays in the graph as the fused kernel."""
    declined = DECLINED.get(qualname)

    def decompose(*args, **kwargs):
        device = _first_device(args, kwargs)
        if device not in devices and not (_forced and device == "cpu"):
            return NotImplemented
        if declined is not None and declined(args, kwargs):
            return NotImplemented
        return _as_decomposition_result(args, kwargs, fn(*args, **kwargs))

    return decompose


_libraries: list[torch.library.Library] = []


def _register_kernels() -> None:
    libs = {}
    for qualname, fn in IMPLS.items():
        ns, name = qualname.split("::")
        lib = libs.get(ns)
        if lib is None:
            lib = libs[ns] = torch.library.Library(ns, "IMPL")
        # A device whose native kernel is built (csrc/ops/<family>/*_cuda.cu) keeps it.
        keys = [key for key in PORTABLE_KEYS
                if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)]
        for key in keys:
            lib.impl(name, fn if qualname in MUTATING else _as_kernel(fn), key)
        PORTABLE_DEVICES[qualname] = frozenset(key.lower() for key in keys)
    _libraries.extend(libs.values())


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _map_outputs(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map_outputs(v, fn) for v in value)
    return value


def _as_kernel(fn):
    """The kernel form of fn: every output contiguous (as the fake and C++ kernels lay them out)
    and in its own memory, neither an input's nor another output's (the schemas declare no
    aliasing; the compositions may return an input or a view of it, e.g. a `.to` to the same
    dtype)."""

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        taken = {t.untyped_storage().data_ptr() for t in _tensors((*args, *kwargs.values()))}

        def own(t):
            t = t.contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr and ptr in taken:
                t = t.clone()
            taken.add(t.untyped_storage().data_ptr())
            return t

        return _map_outputs(fn(*args, **kwargs), own)

    return kernel


def _as_decomposition_result(args, kwargs, result):
    """A traced composition returns no input and no view (the op is functional)."""
    inputs = {id(t) for t in _tensors((*args, *kwargs.values()))}
    seen = set()

    def own(t):
        if id(t) in inputs or id(t) in seen or t._is_view():
            t = t.clone()
        seen.add(id(t))
        return t

    return _map_outputs(result, own)


def _decomposed():
    return [(q, fn) for q, fn in IMPLS.items() if q not in NOT_DECOMPOSED]


def _register_decompositions(module) -> None:
    """Into torch._inductor.decomposition's table (what select_decomp_table() serves)."""
    for qualname, fn in _decomposed():
        module.decompositions[_overload(qualname)] = _decomposition(
            qualname, fn, PORTABLE_DEVICES[qualname])
    module.fast_random_decomps.cache_clear()  # a cached copy of the table; rebuilt with ours


def _register_fallbacks(module) -> None:
    """Where a decomposition declines (CPU, npu) the op reaches Inductor's lowering, whose
    implicit fallback refuses an op that also has a decomposition ("both a fallback and a decomp
    for same op"). Registered here instead, with the layout constraint the implicit fallback
    would pick (the op's tag, else Inductor's default for custom ops)."""
    from torch._library.utils import get_layout_constraint_tag

    for qualname, _ in _decomposed():
        op = _overload(qualname)
        if op not in module.lowerings:
            constraint = module.tag_to_layout_constraint(
                get_layout_constraint_tag(op, with_default=True))
            module.make_fallback(op, layout_constraint=constraint, warn=False,
                                 override_decomp=True)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after a module is first imported: Inductor's modules cost seconds to
    import, so `import opennpu` does not import them; the registrations happen when (and if)
    Inductor or its decomposition table is loaded."""

    def __init__(self):
        self.callbacks: dict[str, object] = {}

    def find_spec(self, name, path, target=None):
        callback = self.callbacks.pop(name, None)
        if callback is None:
            return None
        if not self.callbacks:
            sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            callback(module)

        spec.loader.exec_module = exec_then_register
        return spec


def _after_import(name: str, callback) -> None:
    if name in sys.modules:
        callback(sys.modules[name])
        return
    if not _HOOK.callbacks:
        sys.meta_path.insert(0, _HOOK)
    _HOOK.callbacks[name] = callback


_HOOK = _AfterImport()
_register_kernels()
_after_import("torch._inductor.decomposition", _register_decompositions)
_after_import("torch._inductor.lowering", _register_fallbacks)


@contextlib.contextmanager
def _forcing():
    global _forced
    libs = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        for qualname, fn in IMPLS.items():
            ns, name = qualname.split("::")
            if qualname in NOT_DECOMPOSED and qualname not in HOST_SIDE:
                continue  # its portable form calls the CPU kernel
            lib = libs.get(ns)
            if lib is None:
                lib = libs[ns] = torch.library.Library(ns, "IMPL")
            kernel = fn if qualname in MUTATING else _as_kernel(fn)
            lib.impl(name, kernel, "CPU", allow_override=True)
    _forced += 1
    try:
        yield
    finally:
        _forced -= 1
        for lib in libs.values():
            lib._destroy()  # the C++ CPU kernels are current again


def force(enabled: bool = True):
    """Context manager: CPU tensors take the portable path (eager: the portable functions replace
    the C++ CPU kernels; torch.compile: the decompositions accept CPU inputs). For tests.
    ``force(False)`` is a no-op context."""
    return _forcing() if enabled else contextlib.nullcontext()


def is_forced() -> bool:
    return _forced > 0


def missing_portable_kernels(keys=PORTABLE_KEYS) -> list[str]:
    """Every overload of torch.ops.npu (and torch.ops.atb) without a kernel for one of `keys`."""
    missing = []
    packets = [getattr(ns, name) for ns in (torch.ops.npu, torch.ops.atb) for name in dir(ns)]
    for packet in packets:
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            qualname = getattr(packet, overload)._schema.name
            if overload != "default":
                qualname = f"{qualname}.{overload}"
            for key in keys:
                if not torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key):
                    missing.append(f"{qualname} ({key})")
    return missing


def force_from_environment():
    """OPENNPU_FORCE_PORTABLE=1 (any value but "" and "0"): force the portable path from import
    on, for the whole process. Returns the entered context, or None."""
    if os.environ.get("OPENNPU_FORCE_PORTABLE", "") in ("", "0"):
        return None
    context = force(True)
    context.__enter__()
    return context


_process_force = force_from_environment()
