"""Quantisation: dynamic_quant (int8 and int4), quantize (static per-channel scales: int8 with
div_mode, int8 and packed int4 AscendQuant style), add_rms_norm_dynamic_quant, add_rms_norm_cast,
quant_matmul (int8 codes, per-channel and per-token scales; against dequantise-then-GEMM; A8W4
per-group int4 weights against its torch composition; float8 e4m3 with per-channel x per-token
scales and MX fp8 / fp4 with e8m0 block scales, against dequantise-then-GEMM),
grouped_matmul's quantised paths (A8W8 per-token and weight-only A16W8, MoE-shaped: against
dequantise-then-grouped-GEMM; MX fp8 / fp4 with e8m0 block scales, a few experts, M = 256 in
all, K = N = 2048: against dequantise-then-grouped-GEMM).

Baselines are the compositions the fused ops replace (opennpu.testing.reference): the golden's
float32 quantiser (x * smooth, rowmax, divide, round, clamp, cast) and, for the fused op, torchair's
pattern npu_add_rms_norm -> npu_dynamic_quant written in torch; each in eager and torch.compile.
"""

from __future__ import annotations

import functools
import itertools

import torch
from opennpu.testing import reference
from opennpu.testing.timing import compiled

from ..common import Case, Timed, randn
from .norm import shapes

EPS = 1e-6
npu = torch.ops.npu


def _smooth(h, dtype):
    return (torch.rand(h) + 0.5).to(dtype)


def dynamic_quant_fwd(t, h, dtype, int4, threads):
    x, smooth = randn(t, h, dtype=dtype), _smooth(h, dtype)
    dst_type = torch.quint4x2 if int4 else None
    native = functools.partial(native_dynamic_quant, int4=int4)
    native_compiled = compiled(native, x, smooth, threads=threads)

    # int4 words are not comparable by magnitude (one code in the top nibble moves a word by
    # 2^28), so only the int8 rows report errors against the oracle.
    return Timed(
        ours=lambda: npu.npu_dynamic_quant(x, smooth_scales=smooth, dst_type=dst_type),
        baselines={"eager": lambda: native(x, smooth), "compile": lambda: native_compiled(x, smooth)},
        reference=None if int4 else lambda: reference.dynamic_quant(x, smooth),
    )


def native_dynamic_quant(x, smooth, int4=False):
    """The golden's quantiser in torch; for int4 it also packs eight codes per int32."""
    if not int4:
        return reference.native_dynamic_quant(x, smooth)
    v = x.float() * smooth.float()
    scale = v.abs().amax(dim=-1, keepdim=True) / 7
    codes = torch.round(v / scale).clamp(-8, 7).to(torch.int32)
    nibbles = (codes & 0xF).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=x.device)
    return (nibbles << shifts).sum(dim=-1, dtype=torch.int32), scale.squeeze(-1)


def native_quantize(x, scale, zero, div_mode, int4=False):
    """npu_quantize's arithmetic as torch ops: per-channel (last dim) scale and zero point,
    round half to even, clamp, cast (and for int4 the pack of eight codes per int32)."""
    v = x.float()
    t = torch.round(v * (1.0 / scale)) + zero if div_mode else torch.round(v * scale + zero)
    if not int4:
        return t.clamp(-128, 127).to(torch.int8)
    codes = t.clamp(-8, 7).to(torch.int32)
    nibbles = (codes & 0xF).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=x.device)
    return (nibbles << shifts).sum(dim=-1, dtype=torch.int32)


def quantize_fwd(t, h, dtype, div_mode, int4, threads):
    x = randn(t, h, dtype=dtype) * 20
    scale = torch.rand(h) + 0.1
    zero = torch.randint(-4, 4, (h,)).float()
    zp = zero.to(torch.int32) if div_mode else zero
    qtype = torch.quint4x2 if int4 else torch.qint8
    native = functools.partial(native_quantize, div_mode=div_mode, int4=int4)
    native_compiled = compiled(native, x, scale, zero, threads=threads)
    # codes are compared exactly by the tests; the int4 words are not comparable by magnitude
    return Timed(ours=lambda: npu.npu_quantize(x, scale, zp, qtype, -1, div_mode),
                 baselines={"eager": lambda: native(x, scale, zero),
                            "compile": lambda: native_compiled(x, scale, zero)},
                 reference=None if int4 else lambda: native(x, scale, zero))


def add_rms_norm_dynamic_quant_fwd(t, h, dtype, threads):
    x1, x2, smooth = randn(t, h, dtype=dtype), randn(t, h, dtype=dtype), _smooth(h, dtype)
    w = (1 + 0.1 * torch.randn(h)).to(dtype)
    native = reference.native_add_rms_norm_dynamic_quant
    native_compiled = compiled(native, x1, x2, w, smooth, threads=threads)

    def ours():  # (y1, x, scale1), as the native pair returns them
        y1, _, x, s1, _ = npu.npu_add_rms_norm_dynamic_quant(
            x1, x2, w, smooth_scale1=smooth, epsilon=EPS, output_mask=[True, False])
        return y1, x, s1

    def expected():
        y1, _, x, s1, _ = reference.add_rms_norm_dynamic_quant(x1, x2, w, smooth, epsilon=EPS)
        return y1, x, s1

    return Timed(
        ours=ours,
        baselines={"eager": lambda: native(x1, x2, w, smooth, EPS),
                   "compile": lambda: native_compiled(x1, x2, w, smooth, EPS)},
        reference=expected,
    )


def add_rms_norm_cast_fwd(t, h, dtype, threads):
    x1, x2 = randn(t, h, dtype=dtype), randn(t, h, dtype=dtype)
    w = (1 + 0.1 * torch.randn(h)).to(dtype)
    native = reference.native_add_rms_norm_cast
    native_compiled = compiled(native, x1, x2, w, threads=threads)

    def ours():  # (y1 fp32, y2, x)
        y1, y2, _, x = npu.npu_add_rms_norm_cast(x1, x2, w, EPS)
        return y1, y2, x

    def expected():
        y1, y2, _, x = reference.add_rms_norm_cast(x1, x2, w, EPS)
        return y1, y2, x

    return Timed(
        ours=ours,
        baselines={"eager": lambda: native(x1, x2, w, EPS),
                   "compile": lambda: native_compiled(x1, x2, w, EPS)},
        reference=expected,
    )


def quant_matmul_fwd(m, k, n, dtype, threads):
    gen = torch.Generator().manual_seed(0)
    x1 = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen).t()  # Ascend's x2.t()
    scale, pt = torch.rand(n, generator=gen) * 1e-3, torch.rand(m, generator=gen)
    native = functools.partial(reference.native_quant_matmul, output_dtype=dtype)
    native_compiled = compiled(native, x1, w, scale, pt, threads=threads)
    return Timed(
        ours=lambda: npu.npu_quant_matmul(x1, w, scale, pertoken_scale=pt, output_dtype=dtype),
        baselines={"eager": lambda: native(x1, w, scale, pt),
                   "compile": lambda: native_compiled(x1, w, scale, pt)},
        reference=lambda: reference.quant_matmul(x1, w, scale, pertoken_scale=pt,
                                                 output_dtype=dtype),
    )


def native_a8w4(x, words, scale, offset, pertoken, out_dtype):
    """A8W4 in torch ops: unpack the int4 weight, split x into its two int4 halves, per K group
    an exact fp32 GEMM (integer sums below 2^24) scaled and summed in float16."""
    m, k = x.shape
    groups = scale.shape[0]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    w = ((words.unsqueeze(-1) << (28 - shifts)) >> 28).flatten(-2).float()  # [k, n]
    xi = x.to(torch.int32)
    split = torch.stack([xi >> 4, (xi & 15) - 8], 1).reshape(2 * m, groups, k // groups)
    prods = torch.bmm(split.transpose(0, 1).float(), w.reshape(groups, k // groups, -1))
    terms = (prods * scale.unsqueeze(1)).half()
    acc = terms[0]
    for term in terms[1:]:
        acc = (acc.float() + term.float()).half()
    acc = acc.float().reshape(m, 2, -1)
    return ((acc[:, 0] * 16 + acc[:, 1] + offset) * pertoken.unsqueeze(-1)).to(out_dtype)


def quant_matmul_a8w4_fwd(m, k, n, dtype, threads):
    gen = torch.Generator().manual_seed(0)
    x1 = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
    words = npu.npu_convert_weight_to_int4pack(
        torch.randint(-8, 8, (k, n), dtype=torch.int32, generator=gen))
    scale = torch.rand(k // 256, n, generator=gen) * 1e-2
    offset, pt = torch.randn(n, generator=gen), torch.rand(m, generator=gen)
    native = functools.partial(native_a8w4, out_dtype=dtype)
    native_compiled = compiled(native, x1, words, scale, offset, pt, threads=threads)
    return Timed(
        ours=lambda: npu.npu_quant_matmul(x1, words, scale, offset=offset, pertoken_scale=pt,
                                          output_dtype=dtype, group_sizes=[0, 0, 256]),
        baselines={"eager": lambda: native(x1, words, scale, offset, pt),
                   "compile": lambda: native_compiled(x1, words, scale, offset, pt)},
        reference=lambda: native(x1, words, scale, offset, pt),
    )


_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
               -6.0)


def native_float_quant_matmul(x1, x2, scale, pt, sa, sw, out_dtype, fp4):
    """Dequantise-then-GEMM in torch ops, as op-plugin's goldens: the float8 codes (float4: a
    nibble table) in float32, times the e8m0 block scales repeated 32 times along k (MX) or the
    per-channel / per-token scales after the GEMM."""
    def decode(t, trans):
        if not fp4:
            return t.float()
        mem = (t.mT if trans else t).view(torch.uint8).long()
        lut = torch.tensor(_FP4_VALUES, device=t.device)
        v = torch.stack([lut[mem & 15], lut[mem >> 4]], -1).flatten(-2)
        return v.mT if trans else v

    a, w = decode(x1, False), decode(x2, True)
    if sa is None:
        return (torch.matmul(a, w) * scale * pt.unsqueeze(-1)).to(out_dtype)
    k = a.shape[-1]
    ea = sa.view(torch.float8_e8m0fnu).float().flatten(-2).repeat_interleave(32, -1)[..., :k]
    ew = sw.view(torch.float8_e8m0fnu).float().transpose(-1, -2).flatten(-3, -2)
    ew = ew.repeat_interleave(32, -2)[..., :k, :]
    return torch.matmul(a * ea, w * ew).to(out_dtype)


def native_block_quant_matmul(x1, x2, s1, s2, out_dtype):
    """Dequantise-then-GEMM for per-block float32 scales (x1's [m, ceil(k / 128)], x2's
    [ceil(k / 128), ceil(n / 128)]): each operand times its scales repeated over the blocks, one
    float32 GEMM (the per-K-block sum of op-plugin's golden regrouped, as torch users write it)."""
    m, k = x1.shape
    n = x2.shape[-1]
    a = x1.float() * s1.repeat_interleave(128, -1)[:, :k]
    w = x2.float() * s2.repeat_interleave(128, 0)[:k].repeat_interleave(128, -1)[:, :n]
    return torch.matmul(a, w).to(out_dtype)


def quant_matmul_float_fwd(m, k, n, dtype, path, threads):
    """npu_quant_matmul's Ascend950 paths: fp8 (e4m3, per-channel x per-token float32 scales),
    fp8 per-block (npu_dynamic_block_quant's 1 x 128 / 128 x 128 float32 block scales), MX fp8 and
    MX fp4 (e8m0 block scales from npu_dynamic_mx_quant), weights as Ascend's x2.t()."""
    gen = torch.Generator().manual_seed(0)
    x, wt = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    kw = dict(output_dtype=dtype)
    scale = pt = sa = sw = None
    if path == "fp8_block":
        e4 = torch.float8_e4m3fn
        x1, s1 = npu.npu_dynamic_block_quant(x, dst_type=e4, row_block_size=1,
                                             col_block_size=128)
        wq, ws = npu.npu_dynamic_block_quant(wt, dst_type=e4, row_block_size=128,
                                             col_block_size=128)
        w, s2 = wq.t(), ws.t()  # x2 [k, n] and its scale [ceil(k / 128), ceil(n / 128)]
        native_compiled = compiled(native_block_quant_matmul, x1, w, s1, s2, dtype,
                                   threads=threads)
        return Timed(
            ours=lambda: npu.npu_quant_matmul(x1, w, s2, pertoken_scale=s1, output_dtype=dtype),
            baselines={"eager": lambda: native_block_quant_matmul(x1, w, s1, s2, dtype),
                       "compile": lambda: native_compiled(x1, w, s1, s2, dtype)},
            reference=lambda: native_block_quant_matmul(x1, w, s1, s2, dtype),
        )
    if path == "fp8":
        x1, w = x.to(torch.float8_e4m3fn), wt.to(torch.float8_e4m3fn).t()
        scale, pt = torch.rand(n, generator=gen) * 1e-3, torch.rand(m, generator=gen)
        kw["pertoken_scale"] = pt
    else:
        dst = 296 if path == "mxfp4" else torch.float8_e4m3fn
        x1, sa = npu.npu_dynamic_mx_quant(x, dst_type=dst)
        wq, ws = npu.npu_dynamic_mx_quant(wt, dst_type=dst)
        w, sw = wq.t(), ws.transpose(0, 1)
        kw.update(pertoken_scale=sa, scale_dtype=293, pertoken_scale_dtype=293)
        if path == "mxfp4":
            kw.update(x1_dtype=296, x2_dtype=296)
    s = sw if sw is not None else scale
    native = functools.partial(native_float_quant_matmul, out_dtype=dtype, fp4=path == "mxfp4")
    native_compiled = compiled(native, x1, w, scale, pt, sa, sw, threads=threads)
    return Timed(
        ours=lambda: npu.npu_quant_matmul(x1, w, s, **kw),
        baselines={"eager": lambda: native(x1, w, scale, pt, sa, sw),
                   "compile": lambda: native_compiled(x1, w, scale, pt, sa, sw)},
        reference=lambda: native(x1, w, scale, pt, sa, sw),
    )


def _expert_sizes(m, e, gen):
    """m token rows spread unevenly over e experts, a quarter of them empty (MoE routing)."""
    weights = torch.rand(e, generator=gen) * (torch.rand(e, generator=gen) > 0.25)
    weights[0] += 1e-3
    sizes = (weights / weights.sum() * m).floor().long()
    sizes[0] += m - int(sizes.sum())
    return sizes.tolist()


def native_grouped_dequant_gemm(x, w, scale, pertoken, sizes, out_dtype):
    """A8W8 as dequantise-then-grouped-GEMM: per expert, the float GEMM of the codes (exact
    while the sums stay below 2^24), * scale * per-token scale, rounded to out_dtype."""
    ys = []
    for g, (xg, pg) in enumerate(zip(x.split(sizes), pertoken.split(sizes))):
        ys.append(((xg.float() @ w[g].float()) * scale[g] * pg.unsqueeze(-1)).to(out_dtype))
    return torch.cat(ys)


def native_grouped_antiquant_gemm(x, w, scale, sizes):
    """Weight-only as dequantise-then-grouped-GEMM: every expert's weight to x's dtype, then
    one GEMM per expert."""
    w_deq = (w.to(x.dtype) * scale.unsqueeze(1)).to(x.dtype)
    return torch.cat([xg @ w_deq[g] for g, xg in enumerate(x.split(sizes))])


def grouped_matmul_quant_fwd(m, e, k, n, dtype, path, threads):
    gen = torch.Generator().manual_seed(0)
    sizes = _expert_sizes(m, e, gen)
    group_list = torch.tensor(sizes).cumsum(0)
    w = torch.randint(-128, 128, (e, k, n), dtype=torch.int8, generator=gen)
    if path == "a8w8":
        x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=gen)
        scale, pt = torch.rand(e, n, generator=gen) * 1e-3, torch.rand(m, generator=gen)
        native = functools.partial(native_grouped_dequant_gemm, sizes=sizes, out_dtype=dtype)
        args = (x, w, scale, pt)

        def ours():
            return npu.npu_grouped_matmul([x], [w], scale=[scale], per_token_scale=[pt],
                                          group_list=group_list, split_item=3, group_type=0,
                                          output_dtype=dtype)[0]
    else:
        x = randn(m, k, dtype=dtype)
        scale = (torch.rand(e, n, generator=gen) * 1e-2).to(dtype)
        native = functools.partial(native_grouped_antiquant_gemm, sizes=sizes)
        args = (x, w, scale)

        def ours():
            return npu.npu_grouped_matmul([x], [w], antiquant_scale=[scale],
                                          group_list=group_list, split_item=3, group_type=0)[0]
    native_compiled = compiled(native, *args, threads=threads)
    return Timed(ours=ours,
                 baselines={"eager": lambda: native(*args),
                            "compile": lambda: native_compiled(*args)},
                 reference=lambda: native(*args))


def native_grouped_float_gemm(x, w, sa, sw, sizes, out_dtype, fp4):
    """The MX grouped matmul as dequantise-then-grouped-GEMM: per expert, the dequantised rows
    of x times its dequantised weight (native_float_quant_matmul), the rows concatenated."""
    return torch.cat([native_float_quant_matmul(xg, w[g], None, None, ag, sw[g], out_dtype, fp4)
                      for g, (xg, ag) in enumerate(zip(x.split(sizes), sa.split(sizes)))])


def grouped_matmul_mx_fwd(m, e, k, n, dtype, path, threads):
    """npu_grouped_matmul's MX path: x and each expert's weight (Ascend's [N, K] layout,
    transposed) from npu_dynamic_mx_quant, e8m0 block scales, uneven expert sizes."""
    gen = torch.Generator().manual_seed(0)
    sizes = _expert_sizes(m, e, gen)
    group_list = torch.tensor(sizes).cumsum(0)
    dst = 296 if path == "mxfp4" else torch.float8_e4m3fn
    x, sa = npu.npu_dynamic_mx_quant(torch.randn(m, k, generator=gen), dst_type=dst)
    wq, ws = zip(*(npu.npu_dynamic_mx_quant(torch.randn(n, k, generator=gen), dst_type=dst)
                   for _ in range(e)))
    w, sw = torch.stack(wq).mT, torch.stack(ws).transpose(1, 2)  # [E, K, N], [E, K / 64, N, 2]
    kw = dict(scale_dtype=293, per_token_scale_dtype=293, output_dtype=dtype)
    if path == "mxfp4":
        kw.update(x_dtype=296, weight_dtype=296)
    native = functools.partial(native_grouped_float_gemm, sizes=sizes, out_dtype=dtype,
                               fp4=path == "mxfp4")
    args = (x, w, sa, sw)
    native_compiled = compiled(native, *args, threads=threads)
    return Timed(
        ours=lambda: npu.npu_grouped_matmul([x], [w], scale=[sw], per_token_scale=[sa],
                                            group_list=group_list, split_item=3, group_type=0,
                                            **kw)[0],
        baselines={"eager": lambda: native(*args), "compile": lambda: native_compiled(*args)},
        reference=lambda: native(*args))


def grouped_matmul_quant_shapes(quick: bool):
    if quick:
        return [(32, 8, 1024, 1024), (512, 8, 1024, 1024)]
    return [(16, 16, 4096, 1536), (256, 16, 4096, 1536), (2048, 16, 4096, 1536)]


def mx_quant_fwd(t, h, dtype, dst_type, threads):
    """MX quantisation against its torch composition (the oracle's ops: block maxima, exact
    exponents, rounding at the element precision), eager and compiled."""
    x = randn(t, h, dtype=dtype)

    def native(x):
        codes, scale = reference.dynamic_mx_quant(x, dst_type=dst_type)
        return codes, scale

    native_compiled = compiled(native, x, threads=threads)

    def ours():
        y, scale = npu.npu_dynamic_mx_quant(x, dst_type=dst_type)
        return y.view(torch.uint8) if dst_type != 296 else y, scale

    return Timed(ours=ours,
                 baselines={"eager": lambda: native(x), "compile": lambda: native_compiled(x)},
                 reference=None)


def block_quant_fwd(t, h, dtype, threads):
    x = randn(t, h, dtype=dtype)
    native = reference.dynamic_block_quant
    native_compiled = compiled(native, x, threads=threads)
    return Timed(ours=lambda: npu.npu_dynamic_block_quant(x),
                 baselines={"eager": lambda: native(x), "compile": lambda: native_compiled(x)},
                 reference=lambda: native(x))


def quant_matmul_shapes(quick: bool):
    if quick:
        return [(16, 2048, 2048), (256, 2048, 2048)]
    return [(1, 4096, 4096), (16, 4096, 4096), (512, 4096, 4096), (256, 4096, 11008)]


def cases(quick: bool, dtypes):
    for (t, h), dtype in itertools.product(shapes(quick), dtypes):
        e = dtype.itemsize
        shape = f"T={t} H={h}"
        # x read, smooth read, codes written (1 byte, or half a byte for int4), fp32 scale
        q_bytes = t * h * e + h * e + t * h + 4 * t
        yield Case("dynamic_quant", "fwd", shape, dtype, q_bytes,
                   functools.partial(dynamic_quant_fwd, t, h, dtype, False), ("npu_dynamic_quant",))
        yield Case("dynamic_quant", "fwd", shape + " int4", dtype, q_bytes - t * h // 2,
                   functools.partial(dynamic_quant_fwd, t, h, dtype, True), ("npu_dynamic_quant",))
        # x read, codes written (int4: half a byte each), scales / zero points read
        for name, div_mode, int4 in (("div", True, False), ("mul", False, False),
                                     ("mul int4", False, True)):
            yield Case("quantize", "fwd", f"{shape} {name}", dtype,
                       t * h * e + (t * h // 2 if int4 else t * h) + 8 * h,
                       functools.partial(quantize_fwd, t, h, dtype, div_mode, int4),
                       ("npu_quantize",))
        # x1, x2 read, x written, codes written, gamma and smooth read, fp32 scale
        fused_bytes = 3 * t * h * e + t * h + 2 * h * e + 4 * t
        yield Case("add_rms_norm_dynamic_quant", "fwd", shape, dtype, fused_bytes,
                   functools.partial(add_rms_norm_dynamic_quant_fwd, t, h, dtype),
                   ("npu_add_rms_norm_dynamic_quant",))
        if dtype != torch.float32:  # torch_npu's cast op is for fp16/bf16 inputs
            # x1, x2 read; y1 (fp32), y2, x written; gamma read; fp32 rstd
            cast_bytes = 4 * t * h * e + 4 * t * h + h * e + 4 * t
            yield Case("add_rms_norm_cast", "fwd", shape, dtype, cast_bytes,
                       functools.partial(add_rms_norm_cast_fwd, t, h, dtype),
                       ("npu_add_rms_norm_cast",))
    for (m, k, n), dtype in itertools.product(quant_matmul_shapes(quick), dtypes):
        if dtype == torch.float32:  # outputs are fp16 / bf16 (or int8 / int32)
            continue
        # codes read, scales read, output written
        qmm_bytes = m * k + k * n + 4 * (m + n) + m * n * dtype.itemsize
        yield Case("quant_matmul", "fwd", f"M={m} K={k} N={n}", dtype, qmm_bytes,
                   functools.partial(quant_matmul_fwd, m, k, n, dtype), ("npu_quant_matmul",),
                   flops=2 * m * k * n)
        # x codes and the int4 weight (half a byte per code) read, output written
        yield Case("quant_matmul", "fwd", f"M={m} K={k} N={n} a8w4", dtype,
                   m * k + k * n // 2 + 4 * n * (k // 256 + 1) + m * n * dtype.itemsize,
                   functools.partial(quant_matmul_a8w4_fwd, m, k, n, dtype), ("npu_quant_matmul",),
                   flops=2 * m * k * n)
        for path in ("fp8", "fp8_block", "mxfp8", "mxfp4"):
            code_bytes = (m * k + k * n) // (2 if path == "mxfp4" else 1)
            scale_bytes = 4 * (m + n) if path == "fp8" else (m + n) * (k // 32)
            if path == "fp8_block":
                scale_bytes = 4 * (m * -(-k // 128) + -(-k // 128) * -(-n // 128))
            yield Case("quant_matmul", "fwd", f"M={m} K={k} N={n} {path}", dtype,
                       code_bytes + scale_bytes + m * n * dtype.itemsize,
                       functools.partial(quant_matmul_float_fwd, m, k, n, dtype, path),
                       ("npu_quant_matmul",), flops=2 * m * k * n)
    for (m, e, k, n), dtype in itertools.product(grouped_matmul_quant_shapes(quick), dtypes):
        if dtype == torch.float32:  # outputs / x are fp16 / bf16
            continue
        for path in ("a8w8", "a16w8"):
            x_bytes = m * k * (1 if path == "a8w8" else dtype.itemsize)
            # x and the experts' int8 weights read, scales read, output written
            gmm_bytes = x_bytes + e * k * n + 4 * e * n + m * n * dtype.itemsize
            yield Case("grouped_matmul_quant", "fwd", f"M={m} E={e} K={k} N={n} {path}", dtype,
                       gmm_bytes, functools.partial(grouped_matmul_quant_fwd, m, e, k, n, dtype,
                                                    path),
                       ("npu_grouped_matmul",), flops=2 * m * k * n)
    for dtype in dtypes:
        if dtype == torch.float32:
            continue
        m, e, k, n = 256, 4, 2048, 2048
        for path in ("mxfp8", "mxfp4"):
            half = 2 if path == "mxfp4" else 1
            # codes of x and the experts' weights, their e8m0 scales, the output
            gmm_bytes = (m * k + e * k * n) // half + (m + e * n) * (k // 32) + \
                m * n * dtype.itemsize
            yield Case("grouped_matmul_quant", "fwd", f"M={m} E={e} K={k} N={n} {path}", dtype,
                       gmm_bytes, functools.partial(grouped_matmul_mx_fwd, m, e, k, n, dtype,
                                                    path),
                       ("npu_grouped_matmul",), flops=2 * m * k * n)
    for (t, h), dtype in itertools.product(shapes(quick), dtypes):
        e = dtype.itemsize
        # (CANN's DynamicMxQuant takes float32 x too; its block quant does not)
        for name, dst_type, code_bytes in (("e4m3", 24, t * h), ("fp4", 296, t * h // 2)):
            yield Case("dynamic_mx_quant", "fwd", f"T={t} H={h} {name}", dtype,
                       t * h * e + code_bytes + t * h // 32,
                       functools.partial(mx_quant_fwd, t, h, dtype, dst_type),
                       ("npu_dynamic_mx_quant",))
        if dtype == torch.float32:
            continue
        yield Case("dynamic_block_quant", "fwd", f"T={t} H={h}", dtype,
                   t * h * e + t * h + 4 * t * h // 128,
                   functools.partial(block_quant_fwd, t, h, dtype), ("npu_dynamic_block_quant",))
