"""npu_quant_matmul's per-block float32 scales (Ascend950's pertoken-perblock "G-B",
group_sizes [1, 128, 128], and perblock-perblock "B-B", [128, 128, 128]), hifloat8 operands and
float4_e1m2 MX operands.

The per-block oracle is op-plugin's golden (test_mm_all_reduce_base_perblock.py,
_per_block_cpu_compute), transcribed: out starts at zeros and, per (m block, n block, k block) in
that order, out += matmul(x1 block, x2 block) * x1_scale[mb, kb] * x2_scale[kb, nb] in float32.
With small-integer codes each block's matmul is exact, and the kernel must match the golden bit
for bit whatever the (float32) scales; with full-range codes within fp32 accumulation error.

hifloat8's decoding (arXiv 2409.16626; the field layout op-plugin's test_npu_quant_matmul.py
decodes, and en_dtypes.hifloat8, which op-plugin's goldens use) and float4_e1m2's are checked for
every code against an independent table below, and against en_dtypes where it is installed.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch._dynamo.testing
from op_helpers import opcheck

import opennpu

F16, BF16, F32, U8 = torch.float16, torch.bfloat16, torch.float32, torch.uint8
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
HIF8, E1M2, E8M0 = 290, 297, 293


def _raises(fn, *pieces):
    with pytest.raises(RuntimeError, match=".*".join(re.escape(p) for p in pieces)):
        fn()


# ----------------------------------------------------------------------------- code tables

def hif8_value(c: int) -> float:
    """hifloat8 code -> value, from the format's definition (sign, prefix-coded dot field,
    sign-magnitude exponent with an implicit leading 1, mantissa; subnormals 2^(M - 23))."""
    if c == 0x80:
        return math.nan
    sign = -1.0 if c & 0x80 else 1.0
    if c & 0x7F == 0x6F:
        return sign * math.inf
    body = c & 0x7F
    for prefix, plen, d in (("11", 2, 4), ("10", 2, 3), ("01", 2, 2), ("001", 3, 1),
                            ("0001", 4, 0)):
        if format(body, "07b").startswith(prefix):
            rest = format(body, "07b")[plen:]
            e_bits, m_bits = rest[:d], rest[d:]
            e = 0
            if d:
                magnitude = int("1" + e_bits[1:], 2)
                e = -magnitude if e_bits[0] == "1" else magnitude
            mant = int(m_bits, 2) / 2 ** len(m_bits)
            return sign * (1 + mant) * 2.0 ** e
    m = body & 7  # '0000': subnormal
    return sign * (0.0 if m == 0 else 2.0 ** (m - 23))


HIF8_TABLE = torch.tensor([hif8_value(c) for c in range(256)], dtype=torch.float64)
E1M2_TABLE = torch.tensor([(-1 if c & 8 else 1) * 0.25 * (c & 7) for c in range(16)],
                          dtype=torch.float64)


def hif8_codes(*shape, gen, small=True):
    """hifloat8 bytes: small integers in [-5, 5] (exact in any block sum), or any finite code."""
    if small:
        values = torch.tensor([0, 1, 2, 3, 4, 5, -1, -2, -3, -4, -5], dtype=torch.float64)
        codes = torch.tensor([int((HIF8_TABLE == v).nonzero()[0]) for v in values.tolist()])
        return codes[torch.randint(0, len(values), shape, generator=gen)].to(U8)
    finite = torch.nonzero(HIF8_TABLE.isfinite()).flatten()
    return finite[torch.randint(0, len(finite), shape, generator=gen)].to(U8)


def fp8(*shape, dtype=E4, gen=None, small=True):
    if small:
        return torch.randint(-5, 5, shape, generator=gen).to(dtype)
    bits = torch.randint(0, 256, shape, dtype=torch.int32, generator=gen).to(U8)
    v = bits.view(dtype).float()
    return torch.where(v.isfinite(), v, 0.0).to(dtype)


def operand(kind, rows, cols, gen, trans=False, small=True):
    """(the tensor op-plugin passes, its kw, its float64 values) of logical shape [rows, cols]
    (memory [cols, rows] when `trans`)."""
    mem = (cols, rows) if trans else (rows, cols)
    if kind == "hif8":
        t = hif8_codes(*mem, gen=gen, small=small)
        v = HIF8_TABLE[t.long()]
    else:
        t = fp8(*mem, dtype=kind, gen=gen, small=small)
        v = t.double()
    return (t.t() if trans else t), (v.t() if trans else v)


def dtype_kw(kind1, kind2):
    kw = {}
    if kind1 == "hif8":
        kw["x1_dtype"] = HIF8
    if kind2 == "hif8":
        kw["x2_dtype"] = HIF8
    return kw


# ----------------------------------------------------------------------------- the golden

def per_block_golden(a, w, s1, s2, group_sizes):
    """op-plugin's per-block golden in float32 (2-D, or batched with the scales' batch dims)."""
    gm, gn, gk = group_sizes
    a, w, s1, s2 = a.float(), w.float(), s1.float(), s2.float()
    batch = torch.broadcast_shapes(a.shape[:-2], w.shape[:-2])
    m, k, n = a.shape[-2], a.shape[-1], w.shape[-1]
    nb = math.prod(batch)
    a = a.expand(*batch, m, k).reshape(nb, m, k)
    w = w.expand(*batch, k, n).reshape(nb, k, n)
    s1 = s1.expand(*batch, *s1.shape[-2:]).reshape(nb, *s1.shape[-2:])
    s2 = s2.expand(*batch, *s2.shape[-2:]).reshape(nb, *s2.shape[-2:])
    out = torch.zeros(a.shape[0], m, n)
    for i in range(a.shape[0]):
        for mi in range(-(-m // gm)):
            ms, me = mi * gm, min((mi + 1) * gm, m)
            for ni in range(-(-n // gn)):
                ns, ne = ni * gn, min((ni + 1) * gn, n)
                for ki in range(-(-k // gk)):
                    ks, ke = ki * gk, min((ki + 1) * gk, k)
                    out[i, ms:me, ns:ne] += torch.matmul(a[i, ms:me, ks:ke], w[i, ks:ke, ns:ne]) \
                        * s1[i, mi, ki] * s2[i, ki, ni]
    return out.reshape(*batch, m, n)


def block_scales(m, k, n, gm, gen, batch1=(), batch2=(), trans1=False, trans2=False):
    """float32 per-block scales [*batch1, ceil(m / gm), ceil(k / 128)] and [*batch2,
    ceil(k / 128), ceil(n / 128)], laid out as transposes where their operands are."""
    ms, ks, ns = -(-m // gm), -(-k // 128), -(-n // 128)
    s1 = torch.rand(*batch1, ks, ms, generator=gen).mT if trans1 else \
        torch.rand(*batch1, ms, ks, generator=gen)
    s2 = torch.rand(*batch2, ns, ks, generator=gen).mT if trans2 else \
        torch.rand(*batch2, ks, ns, generator=gen)
    return s1 + 0.25, s2 + 0.25


KINDS = [(E4, E4), (E5, E5), (E4, E5), ("hif8", "hif8")]
KIND_IDS = ["e4m3", "e5m2", "mixed", "hif8"]


@pytest.mark.parametrize("out_dtype", (F16, BF16, F32), ids=str)
@pytest.mark.parametrize("kinds", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("gm", [1, 128], ids=["G-B", "B-B"])
@pytest.mark.parametrize("trans1,trans2", [(False, False), (False, True), (True, False)],
                         ids=["nn", "nt", "tn"])
def test_per_block_matches_op_plugin_golden_bit_for_bit(out_dtype, kinds, gm, trans1, trans2):
    gen = torch.Generator().manual_seed(31)
    m, k, n = 270, 300, 260  # partial last blocks along every dim, two output tiles each way
    x1, a = operand(kinds[0], m, k, gen, trans1)
    x2, w = operand(kinds[1], k, n, gen, trans2)
    s1, s2 = block_scales(m, k, n, gm, gen, trans1=trans1, trans2=trans2)
    out = opennpu.npu_quant_matmul(x1, x2, s2, pertoken_scale=s1, output_dtype=out_dtype,
                                   **dtype_kw(*kinds))
    golden = per_block_golden(a, w, s1, s2, (gm, 128, 128))
    assert out.dtype == out_dtype and out.shape == (m, n)
    assert torch.equal(out, golden.to(out_dtype))
    # group_sizes named rather than inferred: the same
    again = opennpu.npu_quant_matmul(x1, x2, s2, pertoken_scale=s1, output_dtype=out_dtype,
                                     group_sizes=[gm, 128, 128], **dtype_kw(*kinds))
    assert torch.equal(again, out)


@pytest.mark.parametrize("kinds", [(E4, E5), ("hif8", "hif8")], ids=["fp8", "hif8"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 128, 5), (7, 129, 127), (129, 257, 3),
                                   (0, 64, 3), (2, 64, 0), (4, 0, 6)])
def test_per_block_odd_and_empty_sizes(kinds, m, k, n):
    gen = torch.Generator().manual_seed(32)
    x1, a = operand(kinds[0], m, k, gen)
    x2, w = operand(kinds[1], k, n, gen)
    for gm in (1, 128):
        s1, s2 = block_scales(m, k, n, gm, gen)
        out = opennpu.npu_quant_matmul(x1, x2, s2, pertoken_scale=s1, output_dtype=F32,
                                       group_sizes=[gm, 128, 128], **dtype_kw(*kinds))
        assert out.shape == (m, n)
        assert torch.equal(out, per_block_golden(a, w, s1, s2, (gm, 128, 128)))


def test_per_block_full_range_codes_within_fp32_accumulation():
    gen = torch.Generator().manual_seed(33)
    m, k, n = 9, 400, 140
    for kinds in [(E4, E5), ("hif8", "hif8")]:
        x1, a = operand(kinds[0], m, k, gen, small=False)
        x2, w = operand(kinds[1], k, n, gen, small=False)
        s1, s2 = block_scales(m, k, n, 1, gen)
        s1, s2 = s1 * 1e-3, s2 * 1e-3
        out = opennpu.npu_quant_matmul(x1, x2, s2, pertoken_scale=s1, output_dtype=F32,
                                       **dtype_kw(*kinds))
        exact = torch.zeros(m, n, dtype=torch.float64)
        bound = torch.zeros(m, n, dtype=torch.float64)
        for kb in range(-(-k // 128)):
            sl = slice(kb * 128, (kb + 1) * 128)
            scale = s1.double()[:, kb:kb + 1] * s2.double()[kb].repeat_interleave(128)[:n]
            exact += (a[:, sl] @ w[sl]) * scale
            bound += (a[:, sl].abs() @ w[sl].abs()) * scale.abs()
        assert bool(((out.double() - exact).abs() <= 2 * k * 2.0 ** -24 * bound + 1e-30).all())


def test_per_block_batches_broadcast_and_bias():
    gen = torch.Generator().manual_seed(34)
    b, m, k, n = 3, 5, 200, 140
    x1 = fp8(b, m, k, gen=gen)
    a = x1.double()
    x2, w = operand(E5, k, n, gen)  # 2-D: broadcast over the batch, its scale 2-D
    s1, s2 = block_scales(m, k, n, 1, gen, batch1=(b,))
    bias = torch.randn(n, generator=gen)
    out = opennpu.npu_quant_matmul(x1, x2, s2, pertoken_scale=s1, bias=bias, output_dtype=BF16)
    golden = per_block_golden(a, w, s1, s2, (1, 128, 128)) + bias
    assert out.shape == (b, m, n) and torch.equal(out, golden.to(BF16))
    # batched x2 with batched scales, [b, 1, n] bias, B-B
    x2b = fp8(b, k, n, dtype=E5, gen=gen)
    s1b, s2b = block_scales(m, k, n, 128, gen, batch1=(b,), batch2=(b,))
    bias3 = torch.randn(b, 1, n, generator=gen)
    out = opennpu.npu_quant_matmul(x1, x2b, s2b, pertoken_scale=s1b, bias=bias3, output_dtype=F32)
    golden = per_block_golden(a, x2b.double(), s1b, s2b, (128, 128, 128)) + bias3
    assert torch.equal(out, golden)


def test_per_block_non_contiguous_and_npu_device():
    gen = torch.Generator().manual_seed(35)
    m, k, n = 6, 150, 20
    x1 = fp8(m, 2 * k, gen=gen)[:, ::2]  # strided, not a transpose: read as [m, k]
    x2 = fp8(k, n, dtype=E5, gen=gen)
    s1, s2 = block_scales(m, k, n, 1, gen)
    out = opennpu.npu_quant_matmul(x1, x2, s2, pertoken_scale=s1, output_dtype=F32)
    assert torch.equal(out, per_block_golden(x1.double(), x2.double(), s1, s2, (1, 128, 128)))
    on_npu = opennpu.npu_quant_matmul(x1.to("npu"), x2.to("npu"), s2.to("npu"),
                                      pertoken_scale=s1.to("npu"), output_dtype=F32)
    assert on_npu.device.type == "npu" and torch.equal(on_npu.cpu(), out)


def test_per_block_op_plugin_pertile_case():
    """op-plugin's test_npu_quant_matmul_fp8_pertile shapes (x1 [M, 320] e5m2, scale [3, 20],
    pertoken_scale [M, 3]; its golden multiplies by scale * pertoken_scale, which does not
    broadcast, and it reads an unassigned scale_clone), on fewer rows."""
    gen = torch.Generator().manual_seed(36)
    x1 = torch.randint(-5, 5, (64, 320), generator=gen).to(E5)
    x2 = torch.randint(-5, 5, (320, 2560), generator=gen).to(E5)
    scale = torch.randint(-5, 5, (3, 20), generator=gen).float()
    pertoken = torch.randint(-5, 5, (64, 3), generator=gen).float()
    out = opennpu.npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken, output_dtype=F32)
    golden = per_block_golden(x1.double(), x2.double(), pertoken, scale, (1, 128, 128))
    assert torch.equal(out, golden)


def test_per_block_portable_opcheck_and_compile():
    from opennpu.ops import portable

    gen = torch.Generator().manual_seed(37)
    m, k, n = 5, 200, 140
    x1, _ = operand(E4, m, k, gen)
    x2, _ = operand(E5, k, n, gen, trans=True)
    h1, _ = operand("hif8", m, k, gen)
    h2, _ = operand("hif8", k, n, gen)
    s1, s2 = block_scales(m, k, n, 1, gen, trans2=True)
    t1, t2 = block_scales(m, k, n, 128, gen)
    kw = dict(pertoken_scale=s1, bias=torch.ones(n), output_dtype=BF16)
    hkw = dict(pertoken_scale=t1, output_dtype=F32, x1_dtype=HIF8, x2_dtype=HIF8)
    out = opennpu.npu_quant_matmul(x1, x2, s2, **kw)
    hout = opennpu.npu_quant_matmul(h1, h2, t2, **hkw)
    with portable.force():
        assert torch.equal(opennpu.npu_quant_matmul(x1, x2, s2, **kw), out)
        assert torch.equal(opennpu.npu_quant_matmul(h1, h2, t2, **hkw), hout)
    # float8 operands as bytes with x1_dtype / x2_dtype (opcheck compares inputs with allclose)
    opcheck(torch.ops.npu.npu_quant_matmul.default, [
        ((x1.view(U8), x2.view(U8), s2), dict(x1_dtype=24, x2_dtype=23, **kw)),
        ((h1, h2, t2), dict(group_sizes=[128, 128, 128], **hkw)),
    ])
    # fullgraph, dynamic shapes: a second m needs no new frame
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda a, b, s, t: opennpu.npu_quant_matmul(a, b, s, pertoken_scale=t, output_dtype=F32,
                                                    x1_dtype=HIF8, x2_dtype=HIF8) + 1,
        fullgraph=True, dynamic=True, backend=counter)
    for rows in (m, 3 * m + 1):
        r1, _ = operand("hif8", rows, k, gen)
        u1, _ = block_scales(rows, k, n, 1, gen)
        eager = opennpu.npu_quant_matmul(r1, h2, t2, pertoken_scale=u1, output_dtype=F32,
                                         x1_dtype=HIF8, x2_dtype=HIF8) + 1
        assert torch.equal(compiled(r1, h2, t2, u1), eager)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_per_block_bad_inputs():
    gen = torch.Generator().manual_seed(38)
    qmm = opennpu.npu_quant_matmul
    m, k, n = 4, 256, 256
    x1, x2 = fp8(m, k, gen=gen), fp8(k, n, gen=gen)
    s1, s2 = block_scales(m, k, n, 1, gen)
    _raises(lambda: qmm(x1, x2, s2, pertoken_scale=s1, output_dtype=F32, group_sizes=[1, 64, 128]),
            "argument 'group_sizes' must be [1, 128, 128] (pertoken-perblock) or [128, 128, 128]",
            "[1, 64, 128]")
    _raises(lambda: qmm(x1, x2, s2, pertoken_scale=s1, output_dtype=F32, group_sizes=[1, 128]),
            "argument 'group_sizes' must hold three values in [0, 65535]")
    _raises(lambda: qmm(x1, x2, s2, pertoken_scale=s1, output_dtype=F32,
                        group_sizes=[1, 128, 70000]), "argument 'group_sizes' must hold three")
    _raises(lambda: qmm(x1, x2, s2[:1], pertoken_scale=s1, output_dtype=F32),
            "argument 'scale' must have shape [2, 2]", "got [1, 2]")
    _raises(lambda: qmm(x1, x2, s2, pertoken_scale=s1[:, :1], output_dtype=F32,
                        group_sizes=[1, 128, 128]),
            "argument 'pertoken_scale' must have shape [4, 2]", "got [4, 1]")
    _raises(lambda: qmm(x1, x2, s2.bfloat16(), pertoken_scale=s1, output_dtype=F32),
            "argument 'scale' must be float32 per-block scales", "BFloat16")
    _raises(lambda: qmm(x1, x2, s2, pertoken_scale=s1.double(), output_dtype=F32),
            "argument 'pertoken_scale' must be float32 per-block scales", "Double")
    _raises(lambda: qmm(x1, x2, s2, output_dtype=F32, group_sizes=[1, 128, 128]),
            "argument 'pertoken_scale' must be given with per-block scales")
    _raises(lambda: qmm(x1.unsqueeze(0), x2, s2, pertoken_scale=s1, output_dtype=F32,
                        group_sizes=[1, 128, 128]),
            "argument 'pertoken_scale' must have the dims of 'x1' (3")
    # op-plugin's test_npu_quant_matmul_fp8_pertile_invaild_trans: x2 a transpose, scale not
    xa, xb = fp8(10, 256, dtype=E5, gen=gen), fp8(512, 256, dtype=E5, gen=gen)
    _raises(lambda: qmm(xa, xb.t(), torch.rand(4, 2), pertoken_scale=torch.rand(10, 2),
                        output_dtype=F32),
            "argument 'scale' must be a transpose", "transpose are not same, please check input")
    _raises(lambda: qmm(x1, x2, s2.t().contiguous().t(), pertoken_scale=s1, output_dtype=F32),
            "argument 'scale' must not be a transpose")
    # hifloat8 pairs only with hifloat8; not with MX scales; float4 needs MX scales
    h = hif8_codes(m, k, gen=gen)
    _raises(lambda: qmm(h, x2, s2, pertoken_scale=s1, x1_dtype=HIF8, output_dtype=F32),
            "argument 'x2_dtype' must be torch_npu.hifloat8 like 'x1_dtype'")
    e8 = torch.full((m, 4, 2), 127, dtype=U8)
    _raises(lambda: qmm(h, hif8_codes(n, k, gen=gen).t(), torch.full((4, n, 2), 127, dtype=U8),
                        pertoken_scale=e8, x1_dtype=HIF8, x2_dtype=HIF8, scale_dtype=E8M0,
                        pertoken_scale_dtype=E8M0, output_dtype=F32),
            "argument 'scale' must be float32 with hifloat8 operands")
    _raises(lambda: qmm(torch.zeros(m, k // 2, dtype=U8), torch.zeros(k, n // 2, dtype=U8), s2,
                        pertoken_scale=s1, x1_dtype=E1M2, x2_dtype=E1M2, output_dtype=F32),
            "argument 'scale' must be float8_e8m0 block scales", "float4 operands")
    _raises(lambda: qmm(h.float(), x2, s2, x1_dtype=HIF8, output_dtype=F32),
            "argument 'x1' must hold one byte per element", "Float")


# ----------------------------------------------------------------------------- hifloat8

def test_hifloat8_decodes_every_code():
    """Each of the 256 codes through a k = 1 product with 1.0: its exact value (0x80 NaN,
    0x6F / 0xEF +-inf, 0x00 zero, subnormals 2^(M - 23), the largest finite 2^15)."""
    x1 = torch.arange(256, dtype=torch.int32).to(U8).reshape(256, 1)
    one = torch.tensor([[0x08]], dtype=U8)  # 1.0: dot '0001', E = 0, mantissa 0
    assert hif8_value(0x08) == 1.0
    out = opennpu.npu_quant_matmul(x1, one, torch.ones(1), x1_dtype=HIF8, x2_dtype=HIF8,
                                   output_dtype=F32)
    assert torch.equal(out.double().flatten().nan_to_num(7.0), HIF8_TABLE.nan_to_num(7.0))
    assert out.flatten()[0x80].isnan() and out.flatten()[0x6F] == math.inf
    assert out.flatten()[0xEF] == -math.inf and out.flatten()[0x6E] == 2.0 ** 15
    assert out.flatten()[0x01] == 2.0 ** -22 and out.flatten()[0x07] == 2.0 ** -16
    from opennpu.ops import portable
    with portable.force():
        again = opennpu.npu_quant_matmul(x1, one, torch.ones(1), x1_dtype=HIF8, x2_dtype=HIF8,
                                         output_dtype=F32)
    assert torch.equal(again.nan_to_num(7.0), out.nan_to_num(7.0))


def test_hifloat8_table_matches_en_dtypes():
    en_dtypes = pytest.importorskip("en_dtypes")
    import numpy as np

    ref = np.arange(256, dtype=np.uint8).view(en_dtypes.hifloat8).astype(np.float64)
    assert np.array_equal(HIF8_TABLE.numpy(), ref, equal_nan=True)
    ref4 = np.arange(16, dtype=np.uint8).view(en_dtypes.float4_e1m2).astype(np.float64)
    assert np.array_equal(E1M2_TABLE.numpy(), ref4)


@pytest.mark.parametrize("scales", ["tensor", "channel", "token", "double"])
def test_hifloat8_per_tensor_channel_token_scales(scales):
    """op-plugin's hif8 perchannel / pertoken / doublescale cases (their golden: matmul of the
    decoded operands in float32, times the scales)."""
    gen = torch.Generator().manual_seed(39)
    m, k, n = 12, 64, 36
    x1, a = operand("hif8", m, k, gen)
    x2, w = operand("hif8", k, n, gen)
    scale = torch.randn(n, generator=gen) if scales in ("channel", "token") else \
        torch.randn(1, generator=gen)
    pt = {"token": torch.randn(m, generator=gen), "double": torch.randn(1, generator=gen)}.get(
        scales)
    for out_dtype in (F16, BF16, F32):
        out = opennpu.npu_quant_matmul(x1, x2, scale, pertoken_scale=pt, x1_dtype=HIF8,
                                       x2_dtype=HIF8, output_dtype=out_dtype)
        golden = torch.matmul(a.float(), w.float()) * (scale * pt if scales == "double" else
                                                       scale)
        if scales == "token":
            golden = golden * pt.unsqueeze(-1)
        assert torch.equal(out, golden.to(out_dtype))


# ----------------------------------------------------------------------------- float4_e1m2

def e1m2_bytes(*shape, gen):
    return torch.randint(0, 256, shape, dtype=torch.int32, generator=gen).to(U8)


def unpack_e1m2(b):
    b = b.long()
    return torch.stack([E1M2_TABLE[b & 15], E1M2_TABLE[b >> 4]], -1).flatten(-2)


def test_e1m2_decodes_every_code_in_the_mx_path():
    """Each of the 16 codes (low nibble; high nibble 0) times 1.0, scales 2^0: its value."""
    x1 = torch.arange(16, dtype=torch.int32).to(U8).reshape(16, 1)  # [m = 16, k / 2 = 1]
    x2 = torch.tensor([[1.0], [0.0]]).to(E4)  # [k = 2, n = 1]
    sa, sw = torch.full((16, 1, 2), 127, dtype=U8), torch.full((1, 1, 2), 127, dtype=U8)
    out = opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, x1_dtype=E1M2,
                                   scale_dtype=E8M0, pertoken_scale_dtype=E8M0, output_dtype=F32)
    assert torch.equal(out.double().flatten(), E1M2_TABLE)  # code 8 (-0) sums to +0


def mx_e1m2_operands(m, k, n, gen, trans2=False):
    x1 = e1m2_bytes(m, k // 2, gen=gen)
    if trans2:
        x2 = e1m2_bytes(n, k // 2, gen=gen)
        w = unpack_e1m2(x2).t()
        x2 = x2.t()
    else:
        x2 = e1m2_bytes(k, n // 2, gen=gen)
        w = unpack_e1m2(x2)
    pairs = -(-k // 64)
    sa = torch.randint(124, 131, (m, pairs, 2), dtype=torch.int32, generator=gen).to(U8)
    sw = torch.randint(124, 131, (n, pairs, 2), dtype=torch.int32, generator=gen).to(U8)
    sw = sw.transpose(0, 1) if trans2 else sw.transpose(0, 1).contiguous()
    return x1, x2, unpack_e1m2(x1), w, sa, sw


def mx_dequant(a, w, sa, sw):
    k = a.shape[-1]
    kk = torch.arange(k)
    ea = torch.exp2(sa.double() - 127)[..., kk // 64, (kk // 32) % 2]
    ew = torch.exp2(sw.double() - 127).movedim(-1, -2)[..., kk // 64, (kk // 32) % 2, :]
    return a * ea, w * ew


@pytest.mark.parametrize("trans2", [False, True], ids=["kn", "nk_t"])
@pytest.mark.parametrize("mixed", [False, True], ids=["e1m2", "e1m2_x_e2m1"])
def test_mx_e1m2_quant_matmul_exact(trans2, mixed):
    gen = torch.Generator().manual_seed(40)
    m, k, n = 6, 160, 10
    x1, x2, a, w, sa, sw = mx_e1m2_operands(m, k, n, gen, trans2)
    kw = dict(x1_dtype=E1M2, x2_dtype=296 if mixed else E1M2, scale_dtype=E8M0,
              pertoken_scale_dtype=E8M0, output_dtype=F32)
    if mixed:  # x2 read as float4_e2m1
        fp4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
        fp4 = torch.cat([fp4, -fp4])
        b = (x2.t() if trans2 else x2).long()
        w = torch.stack([fp4[b & 15], fp4[b >> 4]], -1).flatten(-2)
        w = w.t() if trans2 else w
    out = opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, **kw)
    da, dw = mx_dequant(a, w, sa, sw)
    assert out.shape == (m, n) and torch.equal(out, (da @ dw).float())  # sums exact in fp32
    from opennpu.ops import portable
    with portable.force():
        assert torch.equal(opennpu.npu_quant_matmul(x1, x2, sw, pertoken_scale=sa, **kw), out)
    opcheck(torch.ops.npu.npu_quant_matmul.default, [((x1, x2, sw), dict(pertoken_scale=sa,
                                                                          **kw))])


def test_mx_e1m2_end_to_end_with_dynamic_mx_quant_and_compile():
    gen = torch.Generator().manual_seed(41)
    m, k, n = 8, 128, 12
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    xq, xs = opennpu.npu_dynamic_mx_quant(x, dst_type=E1M2)
    wq, ws = opennpu.npu_dynamic_mx_quant(w, dst_type=E1M2)
    kw = dict(x1_dtype=E1M2, x2_dtype=E1M2, scale_dtype=E8M0, pertoken_scale_dtype=E8M0,
              output_dtype=F32)
    y = opennpu.npu_quant_matmul(xq, wq.t(), ws.transpose(0, 1), pertoken_scale=xs, **kw)
    da, dw = mx_dequant(unpack_e1m2(xq), unpack_e1m2(wq).t(), xs, ws.transpose(0, 1))
    exact = da @ dw
    assert bool(((y.double() - exact).abs() <= k * 2.0 ** -23 * (da.abs() @ dw.abs())).all())
    rel = ((y.double() - x.double() @ w.double().T).norm() / (x.double() @ w.double().T).norm())
    assert rel < 0.5  # float4_e1m2 keeps 2 mantissa bits but a one-binade range per block
    torch._dynamo.reset()
    fn = torch.compile(lambda a, b, s, t: opennpu.npu_quant_matmul(a, b, s, pertoken_scale=t,
                                                                   **kw) * 2, fullgraph=True)
    assert torch.equal(fn(xq, wq.t(), ws.transpose(0, 1), xs), y * 2)
    torch._dynamo.reset()


E1M2_TIES = [  # (x, the code npu_dynamic_mx_quant writes with the block's scale 2^0)
    (0.125, 0x0), (0.375, 0x2), (0.625, 0x2), (0.875, 0x4), (1.125, 0x4), (1.375, 0x6),
    (1.625, 0x6), (1.8, 0x7), (1.875, 0x7), (1.99, 0x7), (-0.125, 0x8), (-0.375, 0xA),
    (-1.875, 0xF), (0.1, 0x0), (0.13, 0x1), (1.0, 0x4), (1.75, 0x7)]


def test_e1m2_quantiser_rounds_ties_to_even_and_saturates():
    """npu_dynamic_mx_quant to float4_e1m2: a block whose largest magnitude is in [1, 2) has
    scale 2^0 (e8m0 127); its elements round to the 0.25 grid, ties to even, and saturate at
    1.75."""
    x = torch.tensor([v for v, _ in E1M2_TIES] + [0.0] * (32 - len(E1M2_TIES)))
    y, s = opennpu.npu_dynamic_mx_quant(x.reshape(1, 32), dst_type=E1M2)
    assert int(s.flatten()[0]) == 127
    codes = torch.stack([y.flatten() & 15, y.flatten() >> 4], -1).flatten()
    assert codes[:len(E1M2_TIES)].tolist() == [c for _, c in E1M2_TIES]


def test_e1m2_quantiser_matches_en_dtypes_casts():
    """A dense sweep of (-2, 2) (the saturating [1.875, 2) included) quantised to float4_e1m2
    at scale 2^0 (a 1.0 in each block fixes it): en_dtypes' casts, code for code."""
    en_dtypes = pytest.importorskip("en_dtypes")
    import numpy as np

    v = torch.linspace(-1.9999, 1.9999, 31 * 1024)
    x = torch.cat([v.reshape(-1, 31), torch.ones(1024, 1)], 1)
    y, s = opennpu.npu_dynamic_mx_quant(x, dst_type=E1M2)
    assert bool((s[..., 0] == 127).all())
    codes = torch.stack([y & 15, y >> 4], -1).flatten(-2)[:, :31].flatten()
    ref = x[:, :31].numpy().astype(en_dtypes.float4_e1m2).view(np.uint8) & 15
    assert torch.equal(codes, torch.from_numpy(ref.flatten().astype(np.uint8)))
