"""Fusion attention on the CPU kernel's own structure: the tile GEMM paths (brgemm, MKL half
precision, AVX512_BF16 tiles) and their OPENNPU_ATTENTION_* knobs, 128-row query and 256/512-key
blocks and their tails, the online softmax's rescaling across key blocks, the skipped masked
prefix / suffix of a row, and the backward's thread-count independence.

The torch_npu contract itself (parity, layouts, masks, dtypes, errors, autograd, compile) is in
test_attention.py; both use the helpers of attention_helpers.py.
"""

from __future__ import annotations

import pytest
import torch
from attention_helpers import (BF16, CAUSAL_2048, F16, F32, MAX, check_attention, fa, fa_grad,
                               gen_keep, make_qkv, mask_for)
from op_helpers import assert_not_worse_than_native, dtype_id

import opennpu
from opennpu.testing import reference as R

# ----------------------------------------------------------------------------- tile GEMM paths


def test_low_precision_rounds_once(monkeypatch):
    # Without half-precision matrix units (or with them turned off), fp16/bf16 are computed in
    # fp32: the output is the fp32 result rounded once.
    monkeypatch.setenv("OPENNPU_ATTENTION_HALF_GEMM", "0")
    q, k, v = make_qkv(2, 2, 2, 40, 50, 16, 16, "BSND", BF16)
    ours = fa(q, k, v, 2, "BSND", scale=0.3)[0]
    in_fp32 = fa(q.float(), k.float(), v.float(), 2, "BSND", scale=0.3)[0]
    torch.testing.assert_close(ours, in_fp32.to(BF16), rtol=0, atol=0)


# Where the CPU multiplies fp16/bf16 natively (AMX / AVX512-BF16/FP16), they stay in their dtype:
# brgemm on packed K^T / V when D is even and Dv a multiple of 16, MKL's half-precision GEMMs
# otherwise (elsewhere both cases run in fp32). Skv = 1029 spans two 512-key blocks and an odd
# tail, which the brgemm packing pads with a zero key.
HALF_GEMM_SHAPES = [(32, 32), (32, 16), (33, 32), (32, 24)]  # (D, Dv)


@pytest.mark.parametrize("d,dv", HALF_GEMM_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
def test_half_precision_gemm_paths(dtype, d, dv):
    sq, skv = 21, 1029
    q, k, v = make_qkv(2, 4, 2, sq, skv, d, dv, "BSH", dtype)
    user = torch.rand(sq, skv) < 0.2
    check_attention(q, k, v, 4, "BSH", scale=d ** -0.5, atten_mask=user, grad_scale=8.0,
                    mask_full=R.full_visibility_mask(0, sq, skv, user_mask=user))
    # causal with pse, bottom-right aligned (Sq != Skv): rows see different numbers of blocks
    pse = torch.randn(2, 4, sq, skv, dtype=dtype)
    check_attention(q, k, v, 4, "BSH", scale=d ** -0.5, atten_mask=CAUSAL_2048, sparse_mode=3,
                    pse=pse, grad_scale=8.0, mask_full=R.full_visibility_mask(3, sq, skv))


@pytest.mark.parametrize("case", ["causal", "band", "dropout"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
def test_half_precision_backward_tiles(dtype, case):
    # The backward walks 128-row query blocks and 256-key blocks (brgemm with every reduction
    # padded to even: Sq = 259 ends in a 3-row block, Skv = 517 in a 5-key one). A band's first
    # visible key is not block-aligned; dropout scales P and dP in the same tiles.
    b, n, sq, skv = 1, 4, 259, 517
    q, k, v = make_qkv(b, n, 2, sq, skv, 64, 32, "BNSD", dtype)
    if case == "causal":
        check_attention(q, k, v, n, "BNSD", scale=0.125, atten_mask=CAUSAL_2048, sparse_mode=2,
                        grad_scale=8.0, mask_full=R.full_visibility_mask(2, sq, skv))
    elif case == "band":
        kw = dict(pre_tockens=300, next_tockens=40)
        full = R.full_visibility_mask(4, sq, skv, 1, 1, None, 300, 40)
        check_attention(q, k, v, n, "BNSD", scale=0.125, atten_mask=CAUSAL_2048, sparse_mode=4,
                        mask_full=full, grad_scale=8.0, **kw)
    else:
        opennpu.manual_seed(99)
        numels = b * n * sq * skv
        keep = gen_keep(q, numels, 0.8, 99, 0).view(b, n, sq, skv)
        check_attention(q, k, v, n, "BNSD", scale=0.125, keep_prob=0.8, keep=keep,
                        grad_scale=8.0, stats_scale=4.0)


def _avx512_bf16_tiles_run_here() -> bool:
    """The CPU has AVX512_BF16 and opennpu runs its AVX-512 kernels (not ATEN_CPU_CAPABILITY=avx2)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags and opennpu.cpu_isa() == "AVX512"


# bf16 on the AVX512_BF16 tile GEMM (vdpbf16ps), the path of CPUs with the extension but no AMX;
# OPENNPU_ATTENTION_TILES=avx512_bf16 also takes it where oneDNN's brgemm is offered, and raises
# where a call cannot (so these tests never pass on another path). Its tiles are 12 rows x 32
# columns: the shapes end in row tails (Sq = 37, 259, 130, with 64-row causal blocks in the
# backward), column tails of < 16 and 16..31 columns (Dv = 8, 24, 40; keys 1029 = two 512-key
# blocks + a 5-key tail, odd: padded with a zero key), and a second pass over K beyond 128 pairs
# (the forward's P V over 512-key blocks).
AVX512_BF16_CASES = [  # (B, Nq, Nkv, Sq, Skv, D, Dv, mode)
    (2, 4, 2, 37, 1029, 32, 24, "mask"),
    (1, 4, 1, 259, 517, 64, 40, "causal"),
    (1, 2, 2, 130, 70, 16, 8, "mask"),
    (1, 2, 1, 64, 64, 128, 128, "causal"),
]


@pytest.mark.skipif(not _avx512_bf16_tiles_run_here(),
                    reason="needs a CPU with AVX512_BF16 and opennpu's AVX-512 kernels")
@pytest.mark.parametrize("case", AVX512_BF16_CASES, ids=lambda c: "-".join(map(str, c)))
def test_avx512_bf16_tiles(monkeypatch, case):
    b, nq, nkv, sq, skv, d, dv, mode = case
    monkeypatch.setenv("OPENNPU_ATTENTION_TILES", "avx512_bf16")
    monkeypatch.delenv("OPENNPU_ATTENTION_HALF_GEMM", raising=False)
    q, k, v = make_qkv(b, nq, nkv, sq, skv, d, dv, "BNSD", BF16)
    if mode == "causal":
        check_attention(q, k, v, nq, "BNSD", scale=d ** -0.5, atten_mask=CAUSAL_2048,
                        sparse_mode=3, grad_scale=8.0, mask_full=R.full_visibility_mask(3, sq, skv))
    else:
        user = torch.rand(sq, skv) < 0.2
        check_attention(q, k, v, nq, "BNSD", scale=d ** -0.5, atten_mask=user, grad_scale=8.0,
                        mask_full=R.full_visibility_mask(0, sq, skv, user_mask=user))


# ----------------------------------------------------------------------------- P for P V

# fp16/bf16 computed in their dtype (OPENNPU_HALF_GEMM=native forces it on any CPU with MKL's half
# GEMMs) keep P in fp32 for the P V product on the BLAS tiles by default (OPENNPU_ATTENTION_PV=
# auto; =fp32 everywhere): an sgemm on V converted once per key block. =half rounds P to the
# dtype first, as the brgemm / AVX512_BF16 tiles still do under auto. On a CPU without MKL's
# half GEMMs both compute in fp32 and the comparison is skipped.


def _bf16_gemm_runs(monkeypatch, q, k, v, n):
    """Whether bf16 stays bf16 here under OPENNPU_HALF_GEMM=native (else it is fp32 rounded once)."""
    monkeypatch.setenv("OPENNPU_HALF_GEMM", "native")
    monkeypatch.setenv("OPENNPU_ATTENTION_TILES", "blas")
    monkeypatch.delenv("OPENNPU_ATTENTION_HALF_GEMM", raising=False)
    monkeypatch.setenv("OPENNPU_ATTENTION_PV", "half")
    rounded = fa(q, k, v, n, "BNSD", scale=0.125, atten_mask=CAUSAL_2048, sparse_mode=2)[0]
    in_fp32 = fa(q.float(), k.float(), v.float(), n, "BNSD", scale=0.125, atten_mask=CAUSAL_2048,
                 sparse_mode=2)[0].to(q.dtype)
    return not torch.equal(rounded, in_fp32)


@pytest.mark.parametrize("nkv", [4, 2], ids=["MHA", "GQA"])
def test_bf16_error_is_the_rounding_floor_with_fp32_p(monkeypatch, nkv):
    # Causal bf16 on the BLAS tiles against float64, measured against the floor (the float64
    # result rounded to bf16): with P in fp32 the output is within 1.25x of it at the max, 1.1x
    # on average. With P rounded to bf16 and normalised by the sum of the rounded values, the
    # max is within 1.25x too (normalising by the exact sum gave 1.5x here, 1.65-2.0x at 32
    # heads, S=2048), but the average stays about 1.5x: a default that rounds P here fails.
    torch.manual_seed(0)
    n, s, d = 4, 384, 64
    q, k, v = make_qkv(1, n, nkv, s, s, d, d, "BNSD", BF16)
    if not _bf16_gemm_runs(monkeypatch, q, k, v, n):
        pytest.skip("bf16 is computed in fp32 here even under OPENNPU_HALF_GEMM=native")
    ref = R.attention_reference(q.double(), k.double(), v.double(), n, "BNSD", scale=0.125,
                                mask_full=R.full_visibility_mask(2, s, s))[0]
    floor = (ref.to(BF16).double() - ref).abs()
    ratios = {}
    for pv in ("default", "fp32", "half"):
        if pv == "default":
            monkeypatch.delenv("OPENNPU_ATTENTION_PV")
        else:
            monkeypatch.setenv("OPENNPU_ATTENTION_PV", pv)
        out = fa(q, k, v, n, "BNSD", scale=0.125, atten_mask=CAUSAL_2048, sparse_mode=2)[0]
        err = (out.double() - ref).abs()
        ratios[pv] = (err.max() / floor.max()).item(), (err.mean() / floor.mean()).item()
    assert ratios["default"] == ratios["fp32"]
    assert ratios["fp32"][0] <= 1.25 and ratios["fp32"][1] <= 1.1, ratios
    assert ratios["half"][0] <= 1.25, ratios
    assert ratios["half"][1] >= 1.3, ratios  # the trade-off is real at this shape, on average


def _causal_bf16_on_default_tiles(nkv, seed):
    """q, k, v (bf16, BNSD, 8 query heads, 2 * nkv kv heads, S=768, D=128), the float64 causal
    reference and our output on the tiles the environment selects."""
    torch.manual_seed(seed)
    n, s, d = 8, 768, 128
    q, k, v = make_qkv(1, n, nkv * 2, s, s, d, d, "BNSD", BF16)
    ref = R.attention_reference(q.double(), k.double(), v.double(), n, "BNSD", scale=0.125,
                                mask_full=R.full_visibility_mask(2, s, s))[0]
    out = fa(q, k, v, n, "BNSD", scale=0.125, atten_mask=CAUSAL_2048, sparse_mode=2)[0]
    return q, k, v, ref, out


@pytest.mark.parametrize("nkv", [4, 2], ids=["MHA", "GQA"])
def test_bf16_max_error_is_the_rounding_floor_on_the_default_tiles(monkeypatch, nkv):
    # The tiles this CPU takes by default (AVX512_BF16 / brgemm, where P is rounded to bf16 under
    # auto; BLAS with fp32 P elsewhere): the max error stays within 1.25x of the floor because
    # the rounded P is normalised by its own sum.
    monkeypatch.delenv("OPENNPU_ATTENTION_PV", raising=False)
    monkeypatch.delenv("OPENNPU_ATTENTION_TILES", raising=False)
    q, k, v, ref, out = _causal_bf16_on_default_tiles(nkv, seed=1)
    floor = (ref.to(BF16).double() - ref).abs().max()
    assert (out.double() - ref).abs().max() <= 1.25 * floor


@pytest.mark.parametrize("nkv", [4, 2], ids=["MHA", "GQA"])
def test_bf16_rounded_p_is_as_accurate_as_sdpa_on_average(monkeypatch, nkv):
    # With P rounded to bf16 (the default on the AVX512_BF16 / brgemm tiles; forced here), a
    # row's first key block takes its exps against the row's own max, so its largest weight is
    # exactly 1 and unrounded. Taken against the row above's max, every weight was rounded: the
    # mean error was 1.06x that of torch's bf16 SDPA on the same inputs (1.56x the floor at
    # S=1024, 32 heads, against SDPA's 1.48x). On a CPU that computes bf16 in fp32, P is fp32.
    monkeypatch.setenv("OPENNPU_ATTENTION_PV", "half")
    monkeypatch.delenv("OPENNPU_ATTENTION_TILES", raising=False)
    q, k, v, ref, out = _causal_bf16_on_default_tiles(nkv, seed=2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.125, enable_gqa=nkv * 2 != q.shape[1])
    ours, native = ((t.double() - ref).abs().mean().item() for t in (out, sdpa))
    assert ours <= 1.02 * native, (ours, native)


@pytest.mark.parametrize("tiles", ["auto", "blas"])
@pytest.mark.parametrize("pv", ["fp32", "half"])
def test_both_p_settings_on_bf16_gemms_with_masks_pse_and_tails(monkeypatch, pv, tiles):
    # GQA, a user mask, pse, Skv = 1029 (two 512-key blocks and an odd tail), Dv != D, forward
    # and backward, on bf16 GEMMs with either P (on the brgemm tiles where this CPU has them).
    monkeypatch.setenv("OPENNPU_HALF_GEMM", "native")
    monkeypatch.setenv("OPENNPU_ATTENTION_TILES", tiles)
    monkeypatch.setenv("OPENNPU_ATTENTION_PV", pv)
    sq, skv, d, dv = 21, 1029, 32, 24
    q, k, v = make_qkv(2, 4, 2, sq, skv, d, dv, "BSH", BF16)
    user = torch.rand(sq, skv) < 0.2
    pse = torch.randn(2, 4, sq, skv, dtype=BF16)
    check_attention(q, k, v, 4, "BSH", scale=d ** -0.5, atten_mask=user, pse=pse, grad_scale=8.0,
                    mask_full=R.full_visibility_mask(0, sq, skv, user_mask=user))


def test_p_setting_is_checked(monkeypatch):
    monkeypatch.setenv("OPENNPU_ATTENTION_PV", "bf16")
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, "BNSD", BF16)
    with pytest.raises(RuntimeError, match="npu_fusion_attention: OPENNPU_ATTENTION_PV must be "
                                           "auto, fp32 or half, but got 'bf16'"):
        fa(q, k, v, 2, "BNSD")


@pytest.mark.parametrize("kind", ["causal", "padding", "rows_fully_masked"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_user_mask_prefix_and_suffix_are_skipped(dtype, kind):
    # Each row's span is narrowed to its first and last unmasked key (8 mask bytes at a time), so
    # tiles past a causal diagonal or over padding are skipped; keys inside stay masked one by
    # one. Skv = 531 ends mid-word and mid-block; rows that see nothing give 0.
    b, n, sq, skv = 2, 4, 150, 531
    q, k, v = make_qkv(b, n, 2, sq, skv, 32, 32, "BNSD", dtype)
    if kind == "causal":  # bottom-right aligned, as a tensor, with a few interior holes
        mask = torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq + 1) | (torch.rand(sq, skv) < 0.05)
        mask = mask.expand(b, 1, sq, skv)
    elif kind == "padding":  # right padding in batch 0, left padding in batch 1
        mask = torch.zeros(b, 1, sq, skv, dtype=torch.bool)
        mask[0, ..., 517:] = True
        mask[1, ..., :8] = True
    else:
        mask = torch.rand(b, 1, sq, skv) < 0.1
        mask[:, :, 7::11] = True  # rows with every key masked
    check_attention(q, k, v, n, "BNSD", scale=0.2, atten_mask=mask, grad_scale=8.0,
                    mask_full=R.full_visibility_mask(0, sq, skv, b, n, user_mask=mask))


def test_tile_path_setting_is_checked(monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, 16, "BNSD", F32)
    monkeypatch.setenv("OPENNPU_ATTENTION_TILES", "amx")
    with pytest.raises(RuntimeError, match="npu_fusion_attention: OPENNPU_ATTENTION_TILES must be "
                                           "auto, avx512_bf16 or blas, but got 'amx'"):
        fa(q, k, v, 2, "BNSD")
    dy = torch.randn_like(q)
    with pytest.raises(RuntimeError, match="npu_fusion_attention_grad: OPENNPU_ATTENTION_TILES"):
        fa_grad(q, k, v, dy, 2, "BNSD")
    # A bf16 call that cannot take the forced tiles (an odd head size, on any CPU) says so.
    monkeypatch.setenv("OPENNPU_ATTENTION_TILES", "avx512_bf16")
    q, k, v = make_qkv(1, 2, 2, 8, 8, 33, 16, "BNSD", BF16)
    with pytest.raises(RuntimeError, match="OPENNPU_ATTENTION_TILES=avx512_bf16 takes bf16 computed "
                                           "in bf16 .* but this call has D=33, Dv=16"):
        fa(q, k, v, 2, "BNSD")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_backward_does_not_depend_on_thread_count(dtype):
    # Each (batch, query head) is one thread's task, and a GQA group's dk/dv are summed by whichever
    # of its heads finishes last, always in head order: the gradients are bit-identical on one
    # thread and on several.
    q, k, v = make_qkv(2, 8, 2, 150, 300, 32, 32, "BNSD", dtype)
    dy = torch.randn(2, 8, 150, 32, dtype=dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            results.append(fa_grad(q, k, v, dy, 8, "BNSD", scale_value=0.2,
                                   atten_mask=CAUSAL_2048, sparse_mode=3)[:3])
    finally:
        torch.set_num_threads(threads)
    for name, one, several in zip(("dq", "dk", "dv"), *results):
        torch.testing.assert_close(several, one, rtol=0, atol=0, msg=name)


# ----------------------------------------------------------------------------- key blocks


@pytest.mark.parametrize("sq,skv,mode", [(129, 600, 0), (7, 1100, 3), (600, 600, 2), (3, 600, 4)])
def test_keys_across_512_tiles(sq, skv, mode):
    # more than one 512-key tile per row (online softmax rescaling), with and without masks
    q, k, v = make_qkv(1, 2, 1, sq, skv, 16, 16, "BSND")
    user = torch.rand(1, 1, sq, skv) < 0.2
    kw = dict(pre_tockens=400, next_tockens=30) if mode == 4 else {}
    full = R.full_visibility_mask(mode, sq, skv, 1, 1, user, kw.get("pre_tockens", MAX),
                                  kw.get("next_tockens", MAX))
    check_attention(q, k, v, 2, "BSND", scale=0.25, atten_mask=mask_for(mode, user),
                    sparse_mode=mode, mask_full=full, grad_scale=8.0, **kw)


@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_large_logits_are_stable(dtype):
    # logits in the hundreds, the row maximum growing from one 512-key tile to the next: the
    # online softmax rescales instead of overflowing
    sq, skv = 9, 1100
    q = torch.full((1, 1, sq, 4), 4.0, dtype=dtype)
    k = (torch.linspace(-1, 1, skv)[:, None] * torch.ones(4) + 0.05 * torch.randn(skv, 4))
    k, v = k[None, None].to(dtype), torch.randn(1, 1, skv, 4, dtype=dtype)
    check_attention(q, k, v, 1, "BNSD", scale=30.0, grad_scale=8.0, stats_scale=8.0)
    res = fa(q, k, v, 1, "BNSD", scale=30.0)
    assert res[1].min() > 400  # the logits really are large


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
def test_row_max_references(dtype):
    # The forward takes a row's exps against the max it already has (later key blocks) or the
    # max of the row above (first block), redoing the row when its own max is too far off. Rows
    # whose scale drifts slowly keep the reference (their true max above or below it), rows
    # alternating between tiny and large logits redo it; the statistics must still be the true
    # max and the sum relative to it.
    sq, skv, d = 40, 700, 16
    q, k, v = make_qkv(1, 2, 2, sq, skv, d, d, "BNSD", dtype)
    drift = torch.linspace(0.5, 2.0, sq)[:, None]
    jumps = torch.where(torch.arange(sq) % 2 == 0, 0.05, 6.0)[:, None]
    rows = torch.stack([drift, jumps])[None]  # head 0 drifts, head 1 jumps
    q = (q.float() * rows).to(dtype)
    check_attention(q, k, v, 2, "BNSD", scale=0.5, grads=False, stats_scale=8.0)
    # The backward recomputes P from those statistics. The large logits make dk large (~12), so
    # its error is judged against the native composition's rather than an absolute tolerance.
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fa(*leaves, 2, "BNSD", scale=0.5)[0]
    dy = torch.randn_like(out)
    ours = torch.autograd.grad(out, leaves, dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = R.attention_reference(*ref_leaves, 2, "BNSD", scale=0.5)[0]
    want = torch.autograd.grad(ref_out, ref_leaves, dy.double())
    native_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    native_out = R.native_flash_attention_seed(*native_leaves, None, scale=0.5, layout="BNSD")
    native = torch.autograd.grad(native_out, native_leaves, dy)
    for got, w, nat in zip(ours, want, native):
        assert_not_worse_than_native(got, nat, w)
