"""Fusion attention: npu_fusion_attention (+ npu_fusion_attention_grad) and _npu_dropout_gen_mask.

Contract: shared/spec/torch_npu_api.md section 1.10; seed 000 section
torch_npu.npu_fusion_attention (TorchFlashAttention vs NPUFlashAttention). The oracle is
opennpu.testing.reference.attention_reference in float64, with the complete visibility mask built
independently by reference.full_visibility_mask from the sparse-mode rules.

The CPU kernel's tiles, blocks and knobs are tested in test_attention_cpu_tiles.py; the helpers
both files share are in attention_helpers.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from attention_helpers import (
    BF16,
    CAUSAL_2048,
    F16,
    F32,
    F64,
    LAYOUTS,
    MAX,
    PREFIX_3072,
    check_attention,
    expected_numels,
    fa,
    fa_grad,
    gen_keep,
    make_qkv,
    make_tnd,
    mask_for,
    spans,
    tnd_full_masks,
    tnd_keep_from_bits,
    unpack_bits,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from op_helpers import (
    LOW_DTYPES,
    SETTINGS,
    assert_not_worse_than_native,
    check_compiled_matches_eager,
    dtype_id,
    leaf_copies,
    max_err,
    opcheck,
    randn,
)

import opennpu
from opennpu.testing import reference as R
from opennpu.testing.tolerances import assert_close


def _raises(fn, *pieces):
    """fn raises RuntimeError whose message contains every piece, in order."""
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


# ----------------------------------------------------------------------------- parity per dtype


def test_matches_reference(dtype):
    # BSH with GQA (4 query heads on 2 kv heads), Dv < D, Sq != Skv, across a 128-row query tile
    q, k, v = make_qkv(2, 4, 2, 131, 77, 32, 16, "BSH", dtype)
    check_attention(q, k, v, 4, "BSH", scale=0.18)


def test_matches_reference_masked(dtype):
    q, k, v = make_qkv(2, 4, 2, 83, 129, 16, 16, "BNSD", dtype)
    user = torch.rand(2, 1, 83, 129) < 0.3
    check_attention(q, k, v, 4, "BNSD", scale=0.25, atten_mask=user,
                    mask_full=R.full_visibility_mask(0, 83, 129, 2, 1, user))


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("masked", [False, True], ids=["full", "masked"])
def test_low_precision_not_worse_than_native(dtype, masked):
    # The seed's eager composition in the low dtype (fp32 softmax, low-precision matmuls) is the
    # baseline; the fused op computes in fp32 and rounds once.
    q, k, v = (torch.randn(2, 4, 128, 64, dtype=dtype) for _ in range(3))
    mask = torch.randn(1, 1, 128, 128) >= 0 if masked else None
    to_bsh = lambda t: R.attention_from_bnsd(t, "BSH").contiguous()  # noqa: E731
    out = fa(to_bsh(q), to_bsh(k), to_bsh(v), 4, "BSH", atten_mask=mask, scale=0.125)[0]
    ref = R.attention_reference(q, k, v, 4, "BNSD", mask_full=mask, scale=0.125)[0]
    ref = R.attention_from_bnsd(ref, "BSH")
    assert_close(out, ref)
    native = R.native_flash_attention_seed(q, k, v, mask, scale=0.125)
    assert_not_worse_than_native(out, native, ref)



# ----------------------------------------------------------------------------- layouts & sizes

HEADS = [(4, 4), (4, 2), (4, 1)]
SIZES = [  # (B, Sq, Skv, D, Dv)
    (1, 1, 1, 8, 8),
    (2, 7, 83, 16, 8),
    (2, 83, 7, 16, 16),
]
# across the 128-row query tiles: every layout, with GQA only
LARGE_SIZES = [(1, 129, 257, 32, 24), (1, 257, 129, 64, 64)]
LAYOUT_CASES = ([(layout, heads, size) for size in SIZES for heads in HEADS for layout in LAYOUTS]
                + [(layout, (4, 2), size) for size in LARGE_SIZES for layout in LAYOUTS])


@pytest.mark.parametrize("layout,heads,size", LAYOUT_CASES, ids=[
    "{}-N{}-{}-B{}-Sq{}-Skv{}-D{}-Dv{}".format(layout, *heads, *size)
    for layout, heads, size in LAYOUT_CASES])
def test_layouts_gqa_sizes(layout, heads, size):
    b, sq, skv, d, dv = size
    q, k, v = make_qkv(b, *heads, sq, skv, d, dv, layout)
    user = torch.rand(sq, skv) < 0.25  # [Sq, Skv] mask, mode 0
    check_attention(q, k, v, heads[0], layout, scale=d ** -0.5, atten_mask=user,
                    mask_full=R.full_visibility_mask(0, sq, skv, user_mask=user),
                    grad_scale=8.0)


@pytest.mark.parametrize("heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
def test_every_layout_gives_the_same_attention(heads):
    # one problem in all five layouts: the results agree after converting them back
    q, k, v = make_qkv(2, heads[0], heads[1], 9, 11, 8, 4, "BNSD")
    dy = torch.randn(2, heads[0], 9, 4)
    base = fa(q, k, v, heads[0], "BNSD", scale=0.3)
    base_g = fa_grad(q, k, v, dy, heads[0], "BNSD", scale_value=0.3)
    for layout in ("BSH", "SBH", "BSND"):
        lq, lk, lv, ldy = (R.attention_from_bnsd(t, layout).contiguous() for t in (q, k, v, dy))
        res = fa(lq, lk, lv, heads[0], layout, scale=0.3)
        assert_close(R.attention_to_bnsd(res[0], layout, 4), base[0], msg=layout)
        torch.testing.assert_close(res[1], base[1], rtol=0, atol=0)  # stats are always BNS8
        g = fa_grad(lq, lk, lv, ldy, heads[0], layout, scale_value=0.3)
        for name, got, want, d in zip(("dq", "dk", "dv"), g, base_g, (8, 8, 4)):
            assert_close(R.attention_to_bnsd(got, layout, d), want, msg=f"{layout} {name}")
    # TND: batch folded into tokens, one sequence per batch
    tq, tk, tv, tdy = (t.permute(0, 2, 1, 3).flatten(0, 1) for t in (q, k, v, dy))
    res = fa(tq, tk, tv, heads[0], "TND", scale=0.3, actual_seq_qlen=[9, 18],
             actual_seq_kvlen=[11, 22], softmax_layout="TND")
    assert_close(res[0], base[0].permute(0, 2, 1, 3).flatten(0, 1))
    assert_close(res[1], base[1].permute(0, 2, 1, 3).flatten(0, 1))
    g = fa_grad(tq, tk, tv, tdy, heads[0], "TND", scale_value=0.3, actual_seq_qlen=[9, 18],
                actual_seq_kvlen=[11, 22])
    for name, got, want in zip(("dq", "dk", "dv"), g, base_g):
        assert_close(got, want.permute(0, 2, 1, 3).flatten(0, 1), msg=f"TND {name}")


def test_layout_string_is_case_insensitive():
    q, k, v = make_qkv(1, 2, 2, 5, 6, 8, 8, "BSH")
    torch.testing.assert_close(fa(q, k, v, 2, "bsh")[0], fa(q, k, v, 2, "BSH")[0], rtol=0, atol=0)



@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
def test_nan_inputs_propagate(dtype):
    # A NaN in q makes its row's scores NaN; a NaN in a key makes that key's score NaN in every
    # row that sees it. As in the float64 composition, those rows come out NaN (forward and
    # gradients) and no other row does. The row maxima skip NaN, so the NaN must reach the result
    # through the sums. 300 queries (several query blocks) x 600 keys (two key blocks), bottom-right
    # causal: row i sees keys 0..i + 300.
    sq, skv, d = 300, 600, 16
    q, k, v = make_qkv(1, 4, 2, sq, skv, d, d, "BNSD", dtype)
    q[0, 1, 10, 3] = float("nan")  # one row of head 1
    k[0, 0, 550, 5] = float("nan")  # second key block, heads 0 and 1: rows 250..299
    k[0, 1, 350, 0] = float("nan")  # first key block, heads 2 and 3: rows 50..299
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fa(*leaves, 4, "BNSD", scale=0.25, atten_mask=CAUSAL_2048, sparse_mode=3)[0]
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    visible = torch.ones(sq, skv, dtype=torch.bool).tril(skv - sq)
    rq, rk, rv = ref_leaves[0], *(t.repeat_interleave(2, 1) for t in ref_leaves[1:])
    # masked_fill, not an additive mask: NaN + -inf would leak an invisible NaN key into the row
    ref = (rq @ rk.transpose(-1, -2) * 0.25).masked_fill(~visible, float("-inf")).softmax(-1) @ rv
    nan_rows = ref.isnan().all(-1)[0]
    assert nan_rows.sum(-1).tolist() == [50, 51, 250, 250]
    assert torch.equal(out.isnan(), ref.isnan())
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dy)
    want = torch.autograd.grad(ref, ref_leaves, dy.double())
    # Every NaN row's gradients are NaN. Beyond those the float64 composition has more NaN than
    # the math: its dense dS @ K multiplies the 0 of a masked score by a NaN key; ours does the
    # same only within the tiles a row visits, so its NaN are a subset.
    assert (got[0].isnan().all(-1) >= out.isnan().all(-1)).all()
    for g, w in zip(got, want):
        assert (g.isnan() <= w.isnan()).all()
        assert g.isnan().any()


def test_sink_of_minus_inf_is_no_sink():
    # exp(-inf - max) = 0: a sink of -inf takes no probability mass
    q, k, v = make_qkv(1, 2, 2, 40, 700, 8, 8, "BNSD")
    plain = fa(q, k, v, 2, "BNSD", scale=0.5)
    sunk = fa(q, k, v, 2, "BNSD", scale=0.5, sink=torch.full((2,), float("-inf")))
    torch.testing.assert_close(sunk[0], plain[0], rtol=0, atol=0)
    torch.testing.assert_close(sunk[2], plain[2], rtol=0, atol=0)




def test_ignored_flags():
    # gen_mask_parallel, sync and inner_precise do not change the result
    q, k, v = make_qkv(1, 2, 2, 6, 7, 8, 8, "BSH")
    base = fa(q, k, v, 2, "BSH", scale=0.3)[0]
    for kw in (dict(gen_mask_parallel=False), dict(sync=True), dict(inner_precise=1),
               dict(inner_precise=2)):
        torch.testing.assert_close(fa(q, k, v, 2, "BSH", scale=0.3, **kw)[0], base, rtol=0,
                                   atol=0)


@pytest.mark.parametrize("case", ["B0", "Sq0", "Skv0"])
def test_empty(case):
    b, sq, skv = {"B0": (0, 5, 6), "Sq0": (2, 0, 6), "Skv0": (2, 5, 0)}[case]
    q, k, v = make_qkv(b, 2, 2, sq, skv, 8, 8, "BSH")
    res = check_attention(q, k, v, 2, "BSH", scale=0.5)
    assert res[6] == 0
    if case == "Skv0":  # rows that see no key: zeros, max -inf, sum 0
        assert res[0].abs().max() == 0
        assert (res[1] == float("-inf")).all() and (res[2] == 0).all()


@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_non_contiguous_inputs(layout):
    # q, k, v sliced out of one fused projection; the mask a transposed view
    b, n, s, d = 2, 2, 9, 8
    if layout == "BSH":
        qkv = torch.randn(b, s, 3 * n * d)
        q, k, v = qkv[..., : n * d], qkv[..., n * d: 2 * n * d], qkv[..., 2 * n * d:]
    else:
        qkv = torch.randn(b, s, 3, n, d).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
    assert not q.is_contiguous()
    mask = (torch.rand(s, s) < 0.3).t()
    assert not mask.is_contiguous()
    check_attention(q, k, v, n, layout, scale=0.3, atten_mask=mask,
                    mask_full=R.full_visibility_mask(0, s, s, user_mask=mask))


# ----------------------------------------------------------------------------- sparse modes

SPARSE_CASES = [  # (mode, pre_tockens, next_tockens, prefix)
    (0, MAX, MAX, None),
    (0, 5, 3, None),
    (0, 0, 0, None),  # the diagonal only
    (0, 10, -3, None),  # negative next: the band sits below the diagonal
    (0, -2, 9, None),  # negative pre: above it
    (1, 2, 1, None),  # pre/next ignored
    (2, 2, 1, None),
    (3, 2, 1, None),
    (4, MAX, MAX, None),
    (4, 6, 2, None),
    (4, 30, -4, None),
    (4, 0, MAX, None),
    (5, MAX, MAX, [0, 40]),
    (5, 3, 1, [17, 500]),  # prefix beyond Skv: every key
    (6, MAX, MAX, [5, 0]),
    (6, MAX, MAX, [60, 1]),
]
SEQ_PAIRS = [(83, 83), (40, 129), (129, 40)]  # Sq == Skv, fewer queries, more queries


@pytest.mark.parametrize("case", SPARSE_CASES,
                         ids=lambda c: f"mode{c[0]}-pre{c[1]}-next{c[2]}-prefix{c[3]}".replace(
                             str(MAX), "max"))
@pytest.mark.parametrize("seqs", SEQ_PAIRS, ids=lambda s: f"Sq{s[0]}-Skv{s[1]}")
def test_sparse_modes(case, seqs):
    mode, pre, nxt, prefix = case
    sq, skv = seqs
    q, k, v = make_qkv(2, 2, 1, sq, skv, 16, 8, "BNSD")
    user = torch.rand(2, 1, sq, skv) < 0.3
    full = R.full_visibility_mask(mode, sq, skv, 2, 1, user, pre, nxt, prefix)
    check_attention(q, k, v, 2, "BNSD", scale=0.25, atten_mask=mask_for(mode, user),
                    sparse_mode=mode, pre_tockens=pre, next_tockens=nxt, prefix=prefix,
                    mask_full=full, grad_scale=8.0)


@pytest.mark.parametrize("mode", range(7))
def test_without_mask_everything_is_visible(mode):
    # atten_mask None: sparse_mode, pre/next and prefix are ignored (as in torch_npu)
    q, k, v = make_qkv(2, 2, 2, 20, 33, 8, 8, "BSH")
    res = fa(q, k, v, 2, "BSH", scale=0.3, sparse_mode=mode, pre_tockens=1, next_tockens=0,
             prefix=[1, 1])
    plain = fa(q, k, v, 2, "BSH", scale=0.3)
    torch.testing.assert_close(res[0], plain[0], rtol=0, atol=0)
    assert_close(res[0], R.attention_reference(q, k, v, 2, "BSH", scale=0.3)[0])


@pytest.mark.parametrize("mode", [2, 3, 4, 6])
def test_compressed_modes_do_not_read_the_mask(mode):
    q, k, v = make_qkv(1, 2, 2, 30, 45, 8, 8, "BSND")
    kw = dict(sparse_mode=mode, scale=0.3, pre_tockens=7, next_tockens=2, prefix=[4])
    want = fa(q, k, v, 2, "BSND", atten_mask=mask_for(mode, None), **kw)
    for other in (~mask_for(mode, None), torch.ones(1, dtype=torch.uint8),
                  torch.zeros(30, 45, dtype=torch.bool)):
        got = fa(q, k, v, 2, "BSND", atten_mask=other, **kw)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    full = R.full_visibility_mask(mode, 30, 45, 1, 1, None, 7, 2, [4])
    assert_close(want[0], R.attention_reference(q, k, v, 2, "BSND", mask_full=full, scale=0.3)[0])


@pytest.mark.parametrize("shape", ["BNSS", "B1SS", "11SS", "SS"])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8], ids=dtype_id)
def test_mask_shapes_and_dtypes(shape, mask_dtype):
    b, n, sq, skv = 2, 4, 11, 13
    mshape = {"BNSS": (b, n, sq, skv), "B1SS": (b, 1, sq, skv), "11SS": (1, 1, sq, skv),
              "SS": (sq, skv)}[shape]
    user = torch.rand(mshape) < 0.4
    q, k, v = make_qkv(b, n, 2, sq, skv, 8, 8, "SBH")
    for mode in (0, 1):
        check_attention(q, k, v, n, "SBH", scale=0.3, atten_mask=user.to(mask_dtype),
                        sparse_mode=mode, pre_tockens=4, next_tockens=2,
                        mask_full=R.full_visibility_mask(mode, sq, skv, b, n, user, 4, 2))


@pytest.mark.parametrize("shape", ["BNSS", "B1SS", "11SS"])
def test_prefix_mode_5_mask_shapes(shape):
    # torch_npu documents BNSS / B1SS; opennpu also broadcasts a 11SS mask
    b, n, sq, skv = 2, 2, 9, 14
    mshape = {"BNSS": (b, n, sq, skv), "B1SS": (b, 1, sq, skv), "11SS": (1, 1, sq, skv)}[shape]
    user = torch.rand(mshape) < 0.3
    q, k, v = make_qkv(b, n, n, sq, skv, 8, 8, "BSND")
    check_attention(q, k, v, n, "BSND", scale=0.3, atten_mask=user.to(torch.uint8),
                    sparse_mode=5, prefix=[2, 8],
                    mask_full=R.full_visibility_mask(5, sq, skv, b, n, user, prefix=[2, 8]))


def test_expanded_and_sliced_masks():
    # a zero-stride (expanded) BNSS mask and a slice of a wider mask read like their contents
    q, k, v = make_qkv(2, 3, 3, 6, 7, 8, 8, "BNSD")
    user = torch.rand(1, 1, 6, 7) < 0.4
    want = fa(q, k, v, 3, "BNSD", atten_mask=user)[0]
    a = fa(q, k, v, 3, "BNSD", atten_mask=user.expand(2, 3, 6, 7))[0]
    torch.testing.assert_close(a, want, rtol=0, atol=0)
    wide = torch.zeros(2, 3, 9, 20, dtype=torch.bool)
    wide[:, :, 2:8, 5:12] = user
    sliced = wide[:, :, 2:8, 5:12]
    assert not sliced.is_contiguous()
    torch.testing.assert_close(fa(q, k, v, 3, "BNSD", atten_mask=sliced)[0], want, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["mask rows", "mode3 Sq>Skv", "empty band", "mode4 above",
                                  "all masked"])
def test_fully_masked_rows_give_zeros(case):
    b, n, sq, skv = 2, 2, 12, 9
    user = torch.rand(b, 1, sq, skv) < 0.3
    kw = {}
    if case == "mask rows":
        user[:, :, ::3] = True  # every third row sees nothing
        mode = 1
    elif case == "mode3 Sq>Skv":  # bottom-right causal: the first Sq - Skv rows see nothing
        mode = 3
    elif case == "empty band":  # i <= j <= i - 1 is empty for every row
        mode, kw = 0, dict(pre_tockens=0, next_tockens=-1)
    elif case == "mode4 above":  # the band j >= i + shift + 5 ends past Skv for late rows
        mode, kw = 4, dict(pre_tockens=-5, next_tockens=MAX)
    else:
        user[:] = True
        mode = 0
    full = R.full_visibility_mask(mode, sq, skv, b, 1, user, kw.get("pre_tockens", MAX),
                                  kw.get("next_tockens", MAX))
    dead = full.expand(b, n, sq, skv).all(-1)
    assert dead.any()
    q, k, v = make_qkv(b, n, n, sq, skv, 8, 8, "BNSD")
    out, smax, ssum = check_attention(q, k, v, n, "BNSD", scale=0.3, sparse_mode=mode,
                                      atten_mask=mask_for(mode, user), mask_full=full, **kw)[:3]
    assert out[dead].abs().max() == 0
    assert (smax[dead] == float("-inf")).all() and (ssum[dead] == 0).all()
    # A row's max term is exp(fma(s, scale, -max)) with max = s * scale rounded: exp of that
    # product's rounding error, so the sum may fall 1 ulp short of 1 (it did on the AVX2 kernels).
    assert torch.isfinite(smax[~dead]).all() and (ssum[~dead] >= 1 - 2 ** -23).all()


# ----------------------------------------------------------------------------- TND (varlen)

TND_CASES = {  # name: (actual_seq_qlen, actual_seq_kvlen, extra q tokens past the last end)
    "plain": ([5, 12, 30], [7, 20, 29], 0),
    "empty-and-trailing-zeros": ([3, 3, 40, 0, 0], [5, 5, 90, 0, 0], 0),
    "empty-kv": ([4, 10], [0, 9], 0),
    "leading-empty": ([0, 6, 20], [0, 8, 20], 0),
    "tokens-past-end": ([6, 11], [6, 13], 4),
    "one-long": ([129], [257], 0),
    "crosses-tiles": ([129, 200, 300], [300, 320, 340], 2),
}
tnd_cases = pytest.mark.parametrize("case", list(TND_CASES))


def tnd_inputs(case, nq=4, nkv=2, d=16, dv=8, dtype=F32):
    qlen, kvlen, extra = TND_CASES[case]
    tq = max(qlen) + extra
    tkv = max(kvlen) + (3 if extra else 0)
    return make_tnd(tq, tkv, nq, nkv, d, dv, dtype), qlen, kvlen


@tnd_cases
@pytest.mark.parametrize("softmax_layout", ["", "TND"], ids=["NTD", "TND"])
def test_tnd_matches_reference(case, softmax_layout):
    (q, k, v), qlen, kvlen = tnd_inputs(case)
    res = check_attention(q, k, v, 4, "TND", scale=0.25, actual_seq_qlen=qlen,
                          actual_seq_kvlen=kvlen, softmax_layout=softmax_layout, grad_scale=8.0)
    covered = sum(s for _, s in spans(qlen))
    assert (res[0][covered:] == 0).all()  # tokens no sequence covers


@tnd_cases
def test_tnd_equals_per_sequence_bnsd_calls(case):
    (q, k, v), qlen, kvlen = tnd_inputs(case, dtype=BF16)
    out, smax, ssum = fa(q, k, v, 4, "TND", scale=0.25, actual_seq_qlen=qlen,
                         actual_seq_kvlen=kvlen, softmax_layout="TND")[:3]
    out_ntd, smax_ntd, ssum_ntd = fa(q, k, v, 4, "TND", scale=0.25, actual_seq_qlen=qlen,
                                     actual_seq_kvlen=kvlen)[:3]
    torch.testing.assert_close(out_ntd, out, rtol=0, atol=0)
    t = q.shape[0]
    # the default ("") statistics are N-major: memory [N, T, 8] reinterpreted as [T, N, 8]
    for ntd, tnd in ((smax_ntd, smax), (ssum_ntd, ssum)):
        assert ntd.shape == tnd.shape == (t, 4, 8)
        torch.testing.assert_close(ntd.reshape(4, t, 8).transpose(0, 1), tnd, rtol=0, atol=0)
    for (qs, sq), (ks, skv) in zip(spans(qlen), spans(kvlen)):
        if sq == 0:
            continue
        as_bnsd = lambda x, s, n: x[s:s + n].permute(1, 0, 2)[None]  # noqa: E731
        one = fa(as_bnsd(q, qs, sq), as_bnsd(k, ks, skv), as_bnsd(v, ks, skv), 4, "BNSD",
                 scale=0.25)
        torch.testing.assert_close(out[qs:qs + sq], one[0][0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(smax[qs:qs + sq], one[1][0].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(ssum[qs:qs + sq], one[2][0].transpose(0, 1), rtol=0, atol=0)


TND_SPARSE = [  # (mode, pre, next, prefix)
    (0, MAX, MAX, None), (0, 4, 2, None), (1, 1, 1, None), (2, MAX, MAX, None),
    (3, MAX, MAX, None), (4, 7, 3, None), (4, 2, -1, None), (6, MAX, MAX, [3, 0, 50, 2, 0]),
    (7, MAX, MAX, None), (7, 9, 4, None), (8, MAX, MAX, None), (8, 3, 0, None),
]


@pytest.mark.parametrize("case", TND_SPARSE,
                         ids=lambda c: f"mode{c[0]}-pre{c[1]}-next{c[2]}".replace(str(MAX), "max"))
@pytest.mark.parametrize("lens", [
    ([0, 12, 12, 40, 0], [0, 20, 20, 35, 0]),  # empty first, empty middle, trailing zero
    ([30, 31, 50, 80, 90], [10, 40, 60, 60, 100]),  # Sq > Skv, Skv > Sq, an empty key range
], ids=["with-empty", "ragged"])
def test_tnd_sparse_modes(case, lens):
    mode, pre, nxt, prefix = case
    qlen, kvlen = lens
    q, k, v = make_tnd(max(qlen) + 2, max(kvlen), 4, 1, 8, 8)
    max_sq = max(s for _, s in spans(qlen))
    max_skv = max(s for _, s in spans(kvlen))
    user = torch.rand(max_sq + 3, max_skv + 5) < 0.3  # larger than [maxSq, maxSkv] is allowed
    masks = tnd_full_masks(mode, qlen, kvlen, user, pre, nxt, prefix)
    check_attention(q, k, v, 4, "TND", scale=0.3, atten_mask=mask_for(mode, user),
                    sparse_mode=mode, pre_tockens=pre, next_tockens=nxt, prefix=prefix,
                    actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, mask_full=masks,
                    softmax_layout="TND", grad_scale=8.0)


@pytest.mark.parametrize("mode", [7, 8])
def test_tnd_split_modes_band_sequence(mode):
    # 7: the last non-empty sequence is the band, 8: the first; the others are causal
    qlen, kvlen = [0, 10, 25, 25, 0], [0, 16, 30, 30, 0]
    q, k, v = make_tnd(25, 30, 2, 2, 8, 8)
    kw = dict(scale=0.3, atten_mask=CAUSAL_2048, pre_tockens=3, next_tockens=1,
              actual_seq_qlen=qlen, actual_seq_kvlen=kvlen)
    got = fa(q, k, v, 2, "TND", sparse_mode=mode, **kw)[0]
    band = fa(q, k, v, 2, "TND", sparse_mode=4, **kw)[0]
    causal = fa(q, k, v, 2, "TND", sparse_mode=3 if mode == 7 else 2, **kw)[0]
    band_rows, other_rows = (slice(10, 25), slice(0, 10)) if mode == 7 else (slice(0, 10),
                                                                           slice(10, 25))
    torch.testing.assert_close(got[band_rows], band[band_rows], rtol=0, atol=0)
    torch.testing.assert_close(got[other_rows], causal[other_rows], rtol=0, atol=0)
    assert max_err(band[band_rows], causal[band_rows]) > 1e-3  # the modes differ there


def test_tnd_without_mask_ignores_sparse_mode():
    q, k, v = make_tnd(20, 24, 2, 1, 8, 8)
    kw = dict(actual_seq_qlen=[8, 20], actual_seq_kvlen=[10, 24], scale=0.3)
    plain = fa(q, k, v, 2, "TND", **kw)[0]
    for mode in (2, 3, 4, 6, 7, 8):
        got = fa(q, k, v, 2, "TND", sparse_mode=mode, pre_tockens=0, next_tockens=0,
                 prefix=[0, 0], **kw)[0]
        torch.testing.assert_close(got, plain, rtol=0, atol=0)


def test_tnd_dtype(dtype):
    (q, k, v), qlen, kvlen = tnd_inputs("empty-and-trailing-zeros", dtype=dtype)
    check_attention(q, k, v, 4, "TND", scale=0.25, actual_seq_qlen=qlen, actual_seq_kvlen=kvlen,
                    grad_scale=8.0)


# ----------------------------------------------------------------------------- pse and sink

PSE_SHAPES = ["BNSS", "1NSS", "B1SS", "11SS", "BN1S", "111S"]


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_pse_near_float_min(dtype):
    # transformers' padding masks add finfo(dtype).min, with scale 1 as the attention rule
    # passes them: logits near -FLT_MAX, whose exp must be taken from the logit minus the max in
    # one step (scaled by log2(e) first, they would overflow to inf - inf = NaN). A key masked
    # so is weighted 0; a row with every key masked so sees them all alike (the float64
    # reference too: its ulp there is 4e22), so it is the mean of v.
    b, n, sq, skv = 1, 2, 5, 40
    q, k, v = make_qkv(b, n, n, sq, skv, 8, 8, "BNSD", dtype)
    pse = torch.zeros(b, n, sq, skv, dtype=dtype)
    pse[..., 30:] = torch.finfo(dtype).min  # padding keys
    pse[..., 3, :] = torch.finfo(dtype).min  # a row that only sees padding
    out = fa(q, k, v, n, "BNSD", pse=pse, scale=1.0)[0].float()
    assert not out.isnan().any()
    plain = fa(q, k[..., :30, :], v[..., :30, :], n, "BNSD", scale=1.0)[0].float()
    rows = [0, 1, 2, 4]
    assert_close(out[..., rows, :], plain[..., rows, :], dtype=dtype)
    assert_close(out[..., 3, :], v.float().mean(-2), dtype=dtype)


@pytest.mark.parametrize("pattern", PSE_SHAPES)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_pse_broadcast_shapes(pattern, dtype):
    b, n, sq, skv = 2, 4, 10, 13
    shape = tuple(1 if c == "1" else s for c, s in zip(pattern, (b, n, sq, skv)))
    pse = randn(*shape, dtype=dtype)
    q, k, v = make_qkv(b, n, 2, sq, skv, 8, 8, "BSH", dtype)
    user = torch.rand(sq, skv) < 0.3
    check_attention(q, k, v, n, "BSH", pse=pse, scale=0.3, atten_mask=user,
                    mask_full=R.full_visibility_mask(0, sq, skv, user_mask=user),
                    grad_scale=8.0)


def test_pse_is_added_before_scaling():
    # scale * (QK^T + pse), not scale * QK^T + pse
    q, k, v = make_qkv(1, 2, 2, 5, 6, 8, 8, "BNSD")
    pse = randn(1, 2, 5, 6)
    got = fa(q, k, v, 2, "BNSD", pse=pse, scale=0.5)
    assert_close(got[0], R.attention_reference(q, k, v, 2, "BNSD", pse=pse, scale=0.5)[0])
    kt = k.transpose(-1, -2)
    assert_close(got[1][..., 0], (0.5 * (q @ kt + pse)).amax(-1))
    assert max_err(got[1][..., 0], (0.5 * (q @ kt) + pse).amax(-1)) > 1e-2


@pytest.mark.parametrize("layout", ["BNSD", "SBH"])
@pytest.mark.parametrize("dtype", [F32, F16], ids=dtype_id)
def test_sink(layout, dtype):
    b, n, sq, skv = 2, 4, 9, 12
    q, k, v = make_qkv(b, n, 2, sq, skv, 8, 8, layout, dtype)
    sink = torch.randn(n) * 2  # float32 whatever the inputs' dtype
    user = torch.rand(b, 1, sq, skv) < 0.3
    user[:, :, 2] = True  # a row that sees no key still has the sink: output 0, sum 1
    full = R.full_visibility_mask(1, sq, skv, b, 1, user)
    res = check_attention(q, k, v, n, layout, sink=sink, scale=0.3, atten_mask=user,
                          sparse_mode=1, mask_full=full, grad_scale=8.0)
    out, smax, ssum = (R.attention_to_bnsd(res[0], layout, 8), res[1][..., 0], res[2][..., 0])
    assert (out[:, :, 2] == 0).all()
    assert (smax[:, :, 2] == sink[None]).all() and (ssum[:, :, 2] == 1).all()
    # the sink only takes probability mass: each row is the row without it times
    # S / (S + exp(sink)), S = sum exp(logits) = softmax_sum * exp(softmax_max) of the plain call
    plain = fa(q, k, v, n, layout, scale=0.3, atten_mask=user, sparse_mode=1)
    s = plain[2][..., 0].double() * plain[1][..., 0].double().exp()
    ratio = s / (s + sink.double()[None, :, None].exp())
    want = R.attention_to_bnsd(plain[0], layout, 8).double() * ratio[..., None]
    assert_close(out, want, scale=2)


def test_sink_tnd():
    (q, k, v), qlen, kvlen = tnd_inputs("empty-and-trailing-zeros")
    check_attention(q, k, v, 4, "TND", sink=torch.randn(4), scale=0.25, actual_seq_qlen=qlen,
                    actual_seq_kvlen=kvlen, softmax_layout="TND", grad_scale=8.0)


def test_pse_and_sink_with_gqa_and_causal():
    q, k, v = make_qkv(2, 4, 1, 33, 40, 16, 8, "BSND")
    pse = randn(1, 4, 33, 40)
    full = R.full_visibility_mask(3, 33, 40)
    check_attention(q, k, v, 4, "BSND", pse=pse, sink=torch.randn(4), scale=0.25,
                    atten_mask=CAUSAL_2048, sparse_mode=3, mask_full=full, grad_scale=8.0)


# ----------------------------------------------------------------------------- gradients


def gradcheck(fn, inputs, **kw):
    return torch.autograd.gradcheck(fn, inputs, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradcheck_float64(layout):
    # the full Jacobian for BNSD, a random projection of it (fast mode) for the other layouts
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 2, 1, 3, 4, 3, 2, layout, F64))
    pse = randn(1, 2, 3, 4, dtype=F64, requires_grad=True)
    user = torch.tensor([[0, 1, 0, 0], [1, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)

    def fn(q, k, v, pse):
        return fa(q, k, v, 2, layout, pse=pse, atten_mask=user, scale=0.7)[0]

    assert gradcheck(fn, (q, k, v, pse), fast_mode=layout != "BNSD")


@pytest.mark.parametrize("mode", [3, 7])
def test_gradcheck_float64_tnd(mode):
    # GQA, an empty sequence and a key token no sequence uses
    q, k, v = (t.requires_grad_() for t in make_tnd(5, 7, 2, 1, 3, 2, F64))

    def fn(q, k, v):
        return fa(q, k, v, 2, "TND", atten_mask=CAUSAL_2048, sparse_mode=mode, scale=0.7,
                  pre_tockens=1, next_tockens=0, actual_seq_qlen=[2, 2, 5],
                  actual_seq_kvlen=[3, 3, 6])[0]

    assert gradcheck(fn, (q, k, v), fast_mode=mode == 7)


def test_gradcheck_sink():
    # sink is float32 by contract: a coarser step keeps its finite differences meaningful
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 3, 4, 3, 3, "BNSD", F64))
    sink = torch.tensor([0.5, -1.0], requires_grad=True)

    def fn(q, k, v, sink):
        return fa(q, k, v, 2, "BNSD", sink=sink, scale=0.7)[0]

    with pytest.warns(UserWarning, match="double precision"):
        assert gradcheck(fn, (q, k, v, sink), eps=1e-3, atol=1e-4, rtol=1e-3, fast_mode=True)


def test_grad_op_matches_autograd_and_recomputes_without_stats():
    q, k, v = make_qkv(2, 4, 2, 37, 41, 16, 8, "BSH")
    pse = randn(2, 1, 37, 41)
    user = torch.rand(2, 4, 37, 41) < 0.3
    kw = dict(pse=pse, atten_mask=user, pre_tockens=9, next_tockens=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, pse)]
    res = fa(*leaves[:3], 4, "BSH", pse=leaves[3], atten_mask=user, scale=0.25, pre_tockens=9,
             next_tockens=4)
    dy = torch.randn_like(res[0])
    auto = torch.autograd.grad(res[0], leaves, dy)
    direct = fa_grad(q, k, v, dy, 4, "BSH", softmax_max=res[1].detach(),
                     softmax_sum=res[2].detach(), attention_in=res[0].detach(),
                     scale_value=0.25, **kw)
    assert len(direct) == 5
    for name, a, g in zip(("dq", "dk", "dv", "dpse"), auto, direct):
        torch.testing.assert_close(g, a, rtol=0, atol=0, msg=name)
    assert direct[4].shape == (0,) and direct[4].dtype == F32  # no sink: empty dsink
    for given in ({}, {"softmax_max": res[1].detach()}, {"attention_in": res[0].detach()}):
        recomputed = fa_grad(q, k, v, dy, 4, "BSH", scale_value=0.25, **given, **kw)
        for name, a, g in zip(("dq", "dk", "dv", "dpse"), auto, recomputed):
            assert_close(g, a, msg=f"{name} {sorted(given)}")
    full = R.full_visibility_mask(0, 37, 41, 2, 4, user, 9, 4)
    ref_leaves = leaf_copies(leaves, F64)
    ref = R.attention_reference(*ref_leaves[:3], 4, "BSH", pse=ref_leaves[3], mask_full=full,
                                scale=0.25)[0]
    want = torch.autograd.grad(ref, ref_leaves, dy.double())
    for name, g, w in zip(("dq", "dk", "dv", "dpse"), direct, want):
        assert_close(g, w, scale=8, msg=name)


@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=dtype_id)
def test_grad_op_output_contract(dtype):
    q, k, v = make_qkv(2, 4, 2, 6, 7, 8, 4, "BNSD", dtype)
    dy = randn(2, 4, 6, 4, dtype=dtype)
    dq, dk, dv, dpse, dsink = fa_grad(q, k, v, dy, 4, "BNSD", scale_value=0.3)
    for g, t in ((dq, q), (dk, k), (dv, v)):
        assert g.shape == t.shape and g.dtype == dtype and g.is_contiguous()
    assert dpse.shape == (0,) and dsink.shape == (0,) and dsink.dtype == F32
    pse = randn(1, 4, 1, 7, dtype=dtype)
    sink = torch.randn(4)
    *_, dpse, dsink = fa_grad(q, k, v, dy, 4, "BNSD", pse=pse, sink=sink, scale_value=0.3)
    assert dpse.shape == pse.shape and dpse.dtype == dtype
    assert dsink.shape == (4,) and dsink.dtype == F32


def test_grad_op_with_tnd_softmax_layouts():
    # the backward reads the statistics in the softmax_layout they were produced in (and a
    # mismatched layout really is read differently)
    (q, k, v), qlen, kvlen = tnd_inputs("empty-and-trailing-zeros")
    kw = dict(actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, scale=0.25)
    grads = []
    for sl in ("", "TND"):
        res = fa(q, k, v, 4, "TND", softmax_layout=sl, **kw)
        dy = torch.ones_like(res[0])
        grads.append(fa_grad(q, k, v, dy, 4, "TND", softmax_max=res[1], softmax_sum=res[2],
                             attention_in=res[0], scale_value=0.25, softmax_layout=sl,
                             actual_seq_qlen=qlen, actual_seq_kvlen=kvlen))
    for a, b in zip(grads[0][:3], grads[1][:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    res = fa(q, k, v, 4, "TND", **kw)  # N-major statistics read as T-major
    wrong = fa_grad(q, k, v, torch.ones_like(res[0]), 4, "TND", softmax_max=res[1],
                    softmax_sum=res[2], attention_in=res[0], scale_value=0.25,
                    softmax_layout="TND", actual_seq_qlen=qlen, actual_seq_kvlen=kvlen)
    assert max_err(wrong[0], grads[0][0]) > 1e-3


def test_autograd_only_requested_inputs():
    q, k, v = make_qkv(1, 2, 2, 5, 6, 8, 8, "BSH")
    q.requires_grad_()
    out = fa(q, k, v, 2, "BSH")[0]
    (gq,) = torch.autograd.grad(out.sum(), [q])
    assert gq.shape == q.shape and k.grad is None and v.grad is None


def test_double_backward_is_a_clear_error():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 5, 6, 8, 8, "BSH", F64))
    out = fa(q, k, v, 2, "BSH")[0]
    (gq,) = torch.autograd.grad(out.sum(), [q], create_graph=True)
    with pytest.raises(RuntimeError, match="npu_fusion_attention_grad: double backward"):
        gq.sum().backward()
    dy = torch.randn_like(out)
    dq = fa_grad(q, k, v, dy, 2, "BSH")[0]
    with pytest.raises(RuntimeError, match="npu_fusion_attention_grad: double backward"):
        dq.sum().backward()


# ----------------------------------------------------------------------------- dropout




@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_dropout_uses_the_gen_mask_bits(layout, dtype):
    b, n, sq, skv = 2, 4, 37, 45
    q, k, v = make_qkv(b, n, 2, sq, skv, 16, 8, layout, dtype)
    user = torch.rand(b, 1, sq, skv) < 0.2
    opennpu.manual_seed(1234)
    numels = b * n * sq * skv
    keep = gen_keep(q, numels, 0.7, 1234, 0).view(b, n, sq, skv)
    assert 0.6 < keep.float().mean() < 0.8
    res = check_attention(q, k, v, n, layout, scale=0.25, keep_prob=0.7, atten_mask=user,
                          mask_full=R.full_visibility_mask(0, sq, skv, b, 1, user), keep=keep,
                          grad_scale=8.0, stats_scale=4.0)
    assert res[4:] == (1234, 0, numels)
    # the generator moved on by one Philox word per score (4 words per offset step)
    assert opennpu.get_rng_state() == (1234, (numels + 3) // 4)


def test_dropout_backward_op_regenerates_the_mask():
    q, k, v = make_qkv(2, 2, 2, 20, 30, 8, 8, "BSND")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    opennpu.manual_seed(7)
    out, smax, ssum, _, seed, offset, numels = fa(*leaves, 2, "BSND", keep_prob=0.5, scale=0.3)
    dy = torch.randn_like(out)
    auto = torch.autograd.grad(out, leaves, dy)
    kw = dict(scale_value=0.3, keep_prob=0.5, seed=seed, offset=offset, numels=numels)
    direct = fa_grad(q, k, v, dy, 2, "BSND", softmax_max=smax, softmax_sum=ssum,
                     attention_in=out.detach(), **kw)
    recomputed = fa_grad(q, k, v, dy, 2, "BSND", **kw)
    for a, g, r in zip(auto, direct, recomputed):
        torch.testing.assert_close(g, a, rtol=0, atol=0)
        assert_close(r, a)
    # another (seed, offset) is another mask: different gradients
    other = fa_grad(q, k, v, dy, 2, "BSND", **{**kw, "offset": offset + 1000})
    assert max_err(other[0], auto[0]) > 1e-2
    # the gradient generation does not draw from the generator
    assert opennpu.get_rng_state() == (7, (numels + 3) // 4)


def test_dropout_is_reproducible_and_advances():
    q, k, v = make_qkv(1, 2, 2, 16, 24, 8, 8, "BSH")
    numels = 2 * 16 * 24
    opennpu.manual_seed(99)
    assert opennpu.initial_seed() == 99 and opennpu.get_rng_state() == (99, 0)
    first = fa(q, k, v, 2, "BSH", keep_prob=0.6)
    state = opennpu.get_rng_state()
    assert state == (99, (numels + 3) // 4)
    second = fa(q, k, v, 2, "BSH", keep_prob=0.6)
    assert second[4:6] == state
    assert max_err(first[0], second[0]) > 1e-2  # a fresh mask
    opennpu.manual_seed(99)
    again = fa(q, k, v, 2, "BSH", keep_prob=0.6)
    torch.testing.assert_close(again[0], first[0], rtol=0, atol=0)
    assert again[4:] == first[4:]
    opennpu.set_rng_state(state)
    torch.testing.assert_close(fa(q, k, v, 2, "BSH", keep_prob=0.6)[0], second[0], rtol=0,
                               atol=0)
    # the second draw is the gen-mask stream at the advanced offset
    keep = gen_keep(q, numels, 0.6, 99, state[1]).view(1, 2, 16, 24)
    want = R.attention_reference(q, k, v, 2, "BSH", keep=keep, keep_prob=0.6)[0]
    assert_close(second[0], want)
    opennpu.manual_seed(100)
    assert max_err(fa(q, k, v, 2, "BSH", keep_prob=0.6)[0], first[0]) > 1e-2


def test_keep_prob_one_draws_nothing():
    q, k, v = make_qkv(1, 2, 2, 6, 7, 8, 8, "BSH")
    opennpu.manual_seed(5)
    res = fa(q, k, v, 2, "BSH", keep_prob=1.0, seed=11, offset=3,
             dropout_mask=torch.zeros(16, dtype=torch.uint8))  # ignored without dropout
    assert res[4:6] == (11, 3)  # the values passed in
    assert opennpu.get_rng_state() == (5, 0)
    torch.testing.assert_close(res[0], fa(q, k, v, 2, "BSH")[0], rtol=0, atol=0)


def test_explicit_dropout_mask():
    b, n, sq, skv = 2, 2, 10, 13
    q, k, v = make_qkv(b, n, n, sq, skv, 8, 8, "BNSD")
    numels = b * n * sq * skv
    opennpu.manual_seed(3)
    mask = opennpu._npu_dropout_gen_mask(q, [numels], 0.25, 123, 8)
    keep = unpack_bits(mask, numels).view(b, n, sq, skv)
    res = check_attention(q, k, v, n, "BNSD", scale=0.3, keep_prob=0.75, dropout_mask=mask,
                          seed=123, offset=8, keep=keep, grad_scale=8.0)
    assert res[4:] == (123, 8, numels)
    assert opennpu.get_rng_state() == (3, 0)  # nothing drawn
    # any bit pattern is used as given (the forward reads the mask, it does not regenerate it)
    bits = torch.randint(0, 256, (numels // 8 + 1,), dtype=torch.uint8)
    got = fa(q, k, v, n, "BNSD", keep_prob=0.75, dropout_mask=bits, seed=1, offset=2)[0]
    want = R.attention_reference(q, k, v, n, "BNSD", keep_prob=0.75,
                                 keep=unpack_bits(bits, numels).view(b, n, sq, skv))[0]
    assert_close(got, want)


def test_dropout_tnd_numbering():
    # TND mask bits: sequences one after another, each (n, i, j)
    (q, k, v), qlen, kvlen = tnd_inputs("empty-and-trailing-zeros", nq=2, nkv=1)
    numels = expected_numels(q, k, 2, "TND", qlen, kvlen)
    opennpu.manual_seed(21)
    keep = tnd_keep_from_bits(gen_keep(q, numels, 0.8, 21, 0), 2, qlen, kvlen)
    masks = tnd_full_masks(3, qlen, kvlen)
    res = check_attention(q, k, v, 2, "TND", scale=0.25, keep_prob=0.8, atten_mask=CAUSAL_2048,
                          sparse_mode=3, actual_seq_qlen=qlen, actual_seq_kvlen=kvlen,
                          mask_full=masks, keep=keep, grad_scale=8.0)
    assert res[4:] == (21, 0, numels)


def test_dropout_with_sink_and_pse():
    b, n, sq, skv = 1, 2, 9, 11
    q, k, v = make_qkv(b, n, 1, sq, skv, 8, 8, "BSH")
    opennpu.manual_seed(8)
    keep = gen_keep(q, b * n * sq * skv, 0.6, 8, 0).view(b, n, sq, skv)
    check_attention(q, k, v, n, "BSH", scale=0.3, keep_prob=0.6, keep=keep, pse=randn(1, n, 1, 11),
                    sink=torch.randn(n), grad_scale=8.0)


def test_dropout_keeps_about_keep_prob():
    # the fraction of kept probabilities follows keep_prob; kept ones are scaled by 1/keep_prob
    q = torch.ones(1, 1, 1, 1)
    k = torch.zeros(1, 1, 20000, 1)  # uniform attention over 20000 keys
    v = torch.ones(1, 1, 20000, 1)
    for keep_prob in (0.9, 0.5, 0.1):
        opennpu.manual_seed(4)
        out = fa(q, k, v, 1, "BNSD", keep_prob=keep_prob)[0]
        # out = (kept count / 20000) / keep_prob: about 1
        assert abs(out.item() - 1) < 0.05, (keep_prob, out.item())


# ----------------------------------------------------------------------------- gen mask


def test_gen_mask_size_padding_and_bit_order():
    x = torch.empty(0)
    for size, numels in (([5], 5), ([3, 5, 7], 105), ([128], 128), ([129], 129), ([], 1),
                         ([0], 0), ([2, 0], 0)):
        mask = opennpu._npu_dropout_gen_mask(x, size, 0.0, 1, 0)
        assert mask.dtype == torch.uint8 and mask.dim() == 1
        assert mask.numel() == (numels + 127) // 128 * 16, size
        bits = unpack_bits(mask, mask.numel() * 8)
        assert (bits[:numels] == 1).all() and (bits[numels:] == 0).all(), size
    assert (opennpu._npu_dropout_gen_mask(x, [300], 1.0, 1, 0) == 0).all()
    # little-endian bits: with 3 elements kept the first byte is 0b00000111
    assert opennpu._npu_dropout_gen_mask(x, [3], 0.0, 1, 0)[0].item() == 7


def test_gen_mask_stream():
    x = torch.empty(0)
    a = unpack_bits(opennpu._npu_dropout_gen_mask(x, [4000], 0.3, 77, 0), 4000)
    assert abs(a.float().mean().item() - 0.7) < 0.05
    # deterministic; offset counts 4-element Philox blocks; another seed is another stream
    torch.testing.assert_close(
        unpack_bits(opennpu._npu_dropout_gen_mask(x, [4000], 0.3, 77, 0), 4000), a)
    b = unpack_bits(opennpu._npu_dropout_gen_mask(x, [3996], 0.3, 77, 1), 3996)
    torch.testing.assert_close(b, a[4:])
    c = unpack_bits(opennpu._npu_dropout_gen_mask(x, [4000], 0.3, 78, 0), 4000)
    assert (c != a).float().mean() > 0.2
    # a higher drop probability only drops more (one threshold on the same draws)
    d = unpack_bits(opennpu._npu_dropout_gen_mask(x, [4000], 0.6, 77, 0), 4000)
    assert (d <= a).all() and d.sum() < a.sum()
    # the generator is not used
    opennpu.manual_seed(1)
    opennpu._npu_dropout_gen_mask(x, [4000], 0.3, 77, 0)
    assert opennpu.get_rng_state() == (1, 0)


def test_gen_mask_fraction_large():
    mask = opennpu._npu_dropout_gen_mask(torch.empty(0), [1 << 20], 0.15, 2024, 5)
    kept = unpack_bits(mask, 1 << 20).float().mean().item()
    assert abs(kept - 0.85) < 0.003  # 8 standard deviations


def test_gen_mask_input_keyword_and_torch_npu_alias():
    import torch_npu

    x = torch.empty(0)
    a = torch_npu._npu_dropout_gen_mask(input=x, size=[50], p=0.5, seed=3, offset=0)
    torch.testing.assert_close(a, opennpu._npu_dropout_gen_mask(x, [50], 0.5, 3, 0))


def test_gen_mask_rejects_bad_input():
    x = torch.empty(0)
    for p in (-0.1, 1.5):
        _raises(lambda: opennpu._npu_dropout_gen_mask(x, [8], p, 1, 0),
                "_npu_dropout_gen_mask: argument 'p' must be a drop probability in [0, 1]")
    _raises(lambda: opennpu._npu_dropout_gen_mask(x, [4, -1], 0.5, 1, 0),
            "_npu_dropout_gen_mask: argument 'size' must have non-negative sizes")


# ----------------------------------------------------------------------------- seed 000


def trans_bnsd2bsh(tensor):
    """Seed 000's trans_BNSD2BSH."""
    tensor = torch.transpose(tensor, 1, 2)
    return torch.reshape(tensor, (tensor.shape[0], tensor.shape[1], -1))


def test_seed_torch_flash_attention_vs_npu_fusion_attention():
    # TorchFlashAttention.supported_op_exec vs NPUFlashAttention.npu_exec, the seed's shapes
    query = torch.randn(1, 32, 128, 128, dtype=F16)
    key = torch.randn(1, 32, 128, 128, dtype=F16)
    value = torch.randn(1, 32, 128, 128, dtype=F16)
    atten_mask = torch.randn(1, 1, 128, 128, dtype=F16) >= 0
    q_npu, k_npu, v_npu = (trans_bnsd2bsh(t) for t in (query, key, value))
    native = R.native_flash_attention_seed(query, key, value, atten_mask=atten_mask)
    result, softmax_max, softmax_sum, softmax_out, seed, offset, numels = fa(
        q_npu, k_npu, v_npu, head_num=32, input_layout="BSH", scale=0.099, atten_mask=atten_mask)
    assert result.shape == native.shape == (1, 128, 4096) and result.dtype == F16
    assert softmax_max.shape == softmax_sum.shape == (1, 32, 128, 8)
    assert softmax_out.numel() == 0 and (seed, offset, numels) == (0, 0, 32 * 128 * 128)
    ref = trans_bnsd2bsh(R.attention_reference(query, key, value, 32, "BNSD",
                                               mask_full=atten_mask, scale=0.099)[0])
    assert_close(result, ref)
    assert_close(result, native, scale=4)  # the native fp16 composition agrees ...
    assert_not_worse_than_native(result, native, ref)  # ... and is no closer to the oracle


def test_seed_backward_fp32():
    # the same composition in fp32 with autograd vs npu_fusion_attention's gradients
    b, n, s, d = 1, 8, 128, 64
    bnsd = [randn(b, n, s, d, requires_grad=True) for _ in range(3)]
    atten_mask = torch.randn(1, 1, s, s) >= 0
    native = R.native_flash_attention_seed(*bnsd, atten_mask=atten_mask)
    bsh = [trans_bnsd2bsh(t.detach()).requires_grad_() for t in bnsd]
    ours = fa(*bsh, head_num=n, input_layout="BSH", scale=0.099, atten_mask=atten_mask)[0]
    assert_close(ours, native, scale=2)
    dy = torch.randn_like(ours)
    want = torch.autograd.grad(native, bnsd, dy)
    got = torch.autograd.grad(ours, bsh, dy)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, trans_bnsd2bsh(w), scale=4, msg=name)


def test_torch_npu_alias():
    import torch_npu

    q, k, v = make_qkv(1, 2, 2, 5, 6, 8, 8, "BSH")
    got = torch_npu.npu_fusion_attention(q, k, v, head_num=2, input_layout="BSH", scale=0.3)
    want = fa(q, k, v, 2, "BSH", scale=0.3)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    dy = torch.randn_like(got[0])
    g = torch_npu.npu_fusion_attention_grad(q, k, v, dy, 2, "BSH", scale_value=0.3)
    torch.testing.assert_close(g[0], fa_grad(q, k, v, dy, 2, "BSH", scale_value=0.3)[0])


# ----------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("layout", [*LAYOUTS, "TND"])
def test_fake_kernels_match_real_outputs(layout):
    from torch._subclasses.fake_tensor import FakeTensorMode

    if layout == "TND":
        q, k, v = make_tnd(9, 12, 4, 2, 8, 4)
        kw = dict(actual_seq_qlen=[3, 3, 9, 0], actual_seq_kvlen=[5, 6, 12, 0])
    else:
        q, k, v = make_qkv(2, 4, 2, 5, 7, 8, 4, layout)
        kw = {}
    real = fa(q, k, v, 4, layout, **kw)
    dy = torch.randn_like(real[0])
    real_g = fa_grad(q, k, v, dy, 4, layout, **kw)
    with FakeTensorMode() as mode:
        fq, fk, fv, fdy = (mode.from_tensor(t) for t in (q, k, v, dy))
        fake = fa(fq, fk, fv, 4, layout, **kw)
        fake_g = fa_grad(fq, fk, fv, fdy, 4, layout, **kw)
    for r, f in zip(real[:4] + real_g, fake[:4] + fake_g):
        assert r.shape == f.shape and r.dtype == f.dtype, (r.shape, f.shape, r.dtype, f.dtype)
    assert fake[4:] == real[4:]



def test_opcheck_npu_fusion_attention():
    samples = []
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 2, 6, 7, 8, 4, "BSH"))
    samples.append(((q, k, v, 4, "BSH"), dict(pse=randn(1, 4, 6, 7, requires_grad=True),
                                              atten_mask=torch.rand(6, 7) < 0.3, scale=0.3)))
    q, k, v = make_qkv(1, 2, 1, 5, 9, 8, 8, "BNSD")
    samples.append(((q, k, v, 2, "BNSD"), dict(atten_mask=CAUSAL_2048[:8, :8], sparse_mode=3,
                                               sink=torch.randn(2, requires_grad=True))))
    q, k, v = (t.requires_grad_() for t in make_tnd(9, 11, 2, 2, 8, 8))
    samples.append(((q, k, v, 2, "TND"), dict(actual_seq_qlen=[4, 9], actual_seq_kvlen=[5, 11],
                                              softmax_layout="TND")))
    # dropout through an explicit mask does not touch the generator
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 4, 5, 8, 8, "BSND"))
    mask = opennpu._npu_dropout_gen_mask(q, [40], 0.2, 9, 0)
    samples.append(((q, k, v, 2, "BSND"), dict(keep_prob=0.8, dropout_mask=mask, seed=9)))
    opcheck(torch.ops.npu.npu_fusion_attention.default, samples)


def test_opcheck_npu_fusion_attention_grad():
    q, k, v = make_qkv(2, 4, 2, 6, 7, 8, 4, "SBH")
    res = fa(q, k, v, 4, "SBH", scale=0.3)
    dy = torch.randn_like(res[0])
    stats = dict(softmax_max=res[1], softmax_sum=res[2], attention_in=res[0])
    pse = randn(2, 1, 1, 7)
    samples = [((q, k, v, dy, 4, "SBH"), dict(scale_value=0.3, **stats)),
               ((q, k, v, dy, 4, "SBH"), dict(pse=pse, sink=torch.randn(4), keep_prob=0.5,
                                              seed=1, offset=0, numels=2 * 4 * 6 * 7))]
    opcheck(torch.ops.npu.npu_fusion_attention_grad.default, samples)


def test_opcheck_dropout_gen_mask():
    x = torch.empty(3)
    samples = [((x, [100], 0.3, 5, 0), {}), ((x, [2, 7, 9], 0.0, 1, 2), {})]
    opcheck(torch.ops.npu._npu_dropout_gen_mask.Tensor, samples)


# ----------------------------------------------------------------------------- torch.compile


def test_compile_fullgraph_dynamic_matches_eager():
    # Fails as of e65e750: the schema returns numels as `int`, so the fake kernel's symbolic
    # B*N*Sq*Skv is guarded to a constant and every new shape recompiles (2 frames, not 1).
    def block(q, k, v, pse, mask):
        out, smax, ssum, *_ = opennpu.npu_fusion_attention(
            q, k, v, 4, "BSH", pse=pse, atten_mask=mask, scale=0.25, pre_tockens=6,
            next_tockens=2)
        return out * 2, smax

    def make_inputs(shape):
        b, s = shape
        q, k, v = (t.requires_grad_() for t in make_qkv(b, 4, 2, s, s + 3, 8, 8, "BSH"))
        return [q, k, v, randn(1, 4, 1, s + 3, requires_grad=True), torch.rand(s, s + 3) < 0.3]

    check_compiled_matches_eager(block, make_inputs, [(2, 5), (3, 9)])


# ----------------------------------------------------------------------------- bad input

QB, KB, VB = make_qkv(2, 4, 2, 5, 6, 8, 8, "BNSD")  # BNSD: B 2, N 4 (kv 2), Sq 5, Skv 6, D 8
QH, KH, VH = make_qkv(2, 4, 2, 5, 6, 8, 8, "BSH")
QT, KT, VT = make_tnd(10, 12, 4, 2, 8, 8)
TND_LENS = dict(actual_seq_qlen=[4, 10], actual_seq_kvlen=[5, 12])


def call(op, q=None, k=None, v=None, n=4, layout="BNSD", **kw):
    """The forward (op "fwd") or the grad op ("bwd", with a matching dy) on the BNSD defaults."""
    q = QB if q is None else q
    k = KB if k is None else k
    v = VB if v is None else v
    if op == "fwd":
        return lambda: fa(q, k, v, n, layout, **kw)
    if "scale" in kw:
        kw["scale_value"] = kw.pop("scale")
    for unused in ("dropout_mask",):
        kw.pop(unused, None)
    dy_shape = list(q.shape)
    return lambda: fa_grad(q, k, v, torch.zeros(dy_shape), n, layout, **kw)


OPS = pytest.mark.parametrize("op", ["fwd", "bwd"])


def name(op):
    return "npu_fusion_attention" if op == "fwd" else "npu_fusion_attention_grad"


@OPS
def test_rejects_bad_layout(op):
    _raises(call(op, layout="BHS"), f"{name(op)}: argument 'input_layout' must be one of 'BSH', "
            "'SBH', 'BSND', 'BNSD', 'TND', but got 'BHS'")
    _raises(call(op, QH, KH, VH, layout="BNSD"),
            f"{name(op)}: argument 'query' must be 4-D for input_layout 'BNSD', but got shape "
            "[2, 5, 32]")
    _raises(call(op, QB, KB, VB, layout="BSH"), f"{name(op)}: argument 'query' must be 3-D")


@OPS
def test_rejects_bad_head_num(op):
    _raises(call(op, QH, KH, VH, n=3, layout="BSH"),
            f"{name(op)}: argument 'query' must have a hidden size (last dim) divisible by its "
            "head count 3, but got shape [2, 5, 32]")
    _raises(call(op, n=3), f"{name(op)}: argument 'head_num' must equal the head count of "
            "'query' (4), but got 3")
    _raises(call(op, n=0), f"{name(op)}: argument 'head_num' must be > 0, but got 0")
    _raises(call(op, QT, KT, VT, n=2, layout="TND", **TND_LENS),
            f"{name(op)}: argument 'head_num' must equal the head count of 'query' (4)")


@OPS
def test_rejects_kv_heads_not_dividing_head_num(op):
    k, v = randn(2, 3, 6, 8), randn(2, 3, 6, 8)
    _raises(call(op, QB, k, v), f"{name(op)}: argument 'key' must have a head count that "
            "divides head_num 4 (grouped-query attention), but got 3 heads")
    # BSH: key's hidden size 24 = 3 heads of D 8
    _raises(call(op, QH, randn(2, 6, 24), randn(2, 6, 24), layout="BSH"),
            f"{name(op)}: argument 'key' must have a head count that divides head_num 4")
    _raises(call(op, QH, randn(2, 6, 20), randn(2, 6, 20), layout="BSH"),
            f"{name(op)}: argument 'key' must have a hidden size divisible by the query head "
            "size 8, but got shape [2, 6, 20]")


@OPS
def test_rejects_inconsistent_qkv(op):
    _raises(call(op, QB, randn(2, 2, 6, 4), VB),
            f"{name(op)}: argument 'key' must have the head size of 'query' (8), but got 4")
    _raises(call(op, QB, KB, randn(2, 2, 7, 8)),
            f"{name(op)}: argument 'value' must have the batch, sequence and head counts of 'key'")
    _raises(call(op, QB, randn(3, 2, 6, 8), randn(3, 2, 6, 8)),
            f"{name(op)}: argument 'key' must have the batch size of 'query' (2), but got 3")
    _raises(call(op, QB, KB.double(), VB),
            f"{name(op)}: argument 'key' must have the dtype of 'query' (Float), but got Double")
    _raises(call(op, QB, KB, VB.half()),
            f"{name(op)}: argument 'value' must have the dtype of 'query' (Float), but got Half")
    _raises(call(op, QB.int(), KB.int(), VB.int()), f"{name(op)}: argument 'query' must be "
            "float16, bfloat16 or float32, but got Int")


@OPS
def test_rejects_bad_keep_prob(op):
    for kp in (0.0, 1.5, -0.2):
        _raises(call(op, keep_prob=kp), f"{name(op)}: argument 'keep_prob' must be in (0, 1], "
                f"but got {kp:g}")


@OPS
def test_rejects_bad_tnd_lengths(op):
    tnd = dict(q=QT, k=KT, v=VT, layout="TND")
    _raises(call(op, **tnd), f"{name(op)}: argument 'actual_seq_qlen' is required for "
            "input_layout 'TND'")
    _raises(call(op, **tnd, actual_seq_qlen=[4, 10]),
            f"{name(op)}: argument 'actual_seq_kvlen' is required for input_layout 'TND'")
    _raises(call(op, **tnd, actual_seq_qlen=[], actual_seq_kvlen=[]),
            f"{name(op)}: argument 'actual_seq_qlen' is required")
    _raises(call(op, **tnd, actual_seq_qlen=[4, 10], actual_seq_kvlen=[12]),
            f"{name(op)}: argument 'actual_seq_kvlen' must have as many entries as "
            "actual_seq_qlen (2), but got 1")
    _raises(call(op, **tnd, actual_seq_qlen=[6, 4], actual_seq_kvlen=[5, 12]),
            f"{name(op)}: argument 'actual_seq_qlen' must be non-decreasing cumulative sequence "
            "ends without the leading 0")
    _raises(call(op, **tnd, actual_seq_qlen=[4, 0, 10], actual_seq_kvlen=[5, 6, 12]),
            f"{name(op)}: argument 'actual_seq_qlen' must be non-decreasing cumulative sequence "
            "ends (a trailing run of zeros")
    _raises(call(op, **tnd, actual_seq_qlen=[4, 10], actual_seq_kvlen=[5, 13]),
            f"{name(op)}: argument 'actual_seq_kvlen' ends at 13 tokens, more than the tensor's "
            "T = 12")


@OPS
def test_rejects_bad_sparse_mode(op):
    mask = CAUSAL_2048
    for mode in (9, -1):
        _raises(call(op, atten_mask=mask, sparse_mode=mode),
                f"{name(op)}: argument 'sparse_mode' must be in [0, 8], but got {mode}")
    for mode in (7, 8):
        _raises(call(op, atten_mask=mask, sparse_mode=mode), f"{name(op)}: argument "
                f"'sparse_mode' {mode} (split varlen) needs input_layout 'TND', but got 'BNSD'")
    _raises(call(op, QT, KT, VT, layout="TND", atten_mask=torch.zeros(4, 6, dtype=torch.bool),
                 sparse_mode=5, prefix=[1, 1], **TND_LENS),
            f"{name(op)}: argument 'sparse_mode' 5 (prefix, uncompressed) is not available with "
            "input_layout 'TND'")


@OPS
def test_rejects_bad_prefix(op):
    user = torch.zeros(2, 1, 5, 6, dtype=torch.bool)
    for mode, mask in ((5, user), (6, PREFIX_3072)):
        _raises(call(op, atten_mask=mask, sparse_mode=mode), f"{name(op)}: argument 'prefix' "
                f"must list one prefix length per batch (2) for sparse_mode {mode}, but got None")
        _raises(call(op, atten_mask=mask, sparse_mode=mode, prefix=[1]),
                f"{name(op)}: argument 'prefix' must list one prefix length per batch (2)")
        _raises(call(op, atten_mask=mask, sparse_mode=mode, prefix=[1, -1]),
                f"{name(op)}: argument 'prefix' must be >= 0")


@OPS
def test_rejects_bad_mask(op):
    _raises(call(op, atten_mask=torch.zeros(5, 6)),
            f"{name(op)}: argument 'atten_mask' must be bool or uint8 (True / 1 = masked out), "
            "but got Float")
    _raises(call(op, atten_mask=torch.zeros(5, 6, dtype=torch.int32), sparse_mode=2),
            f"{name(op)}: argument 'atten_mask' must be bool or uint8")
    for shape in ((5, 7), (6, 5), (2, 4, 6), (2, 3, 5, 6), (3, 1, 5, 6), (1, 1, 1, 5, 6)):
        _raises(call(op, atten_mask=torch.zeros(shape, dtype=torch.bool)),
                f"{name(op)}: argument 'atten_mask' must be [B, N, Sq, Skv], [B, 1, Sq, Skv], "
                "[1, 1, Sq, Skv], [1, N, Sq, Skv] or [Sq, Skv] (with [Sq, Skv] = [5, 6]), but got")
    _raises(call(op, atten_mask=torch.zeros(5, 6, dtype=torch.bool), sparse_mode=5,
                 prefix=[1, 1]),
            f"{name(op)}: argument 'atten_mask' must be [B, N, Sq, Skv] or [B, 1, Sq, Skv] for "
            "sparse_mode 5, but got [5, 6]")
    for shape in ((5, 7), (6, 6), (1, 1, 6, 7)):  # TND: [maxSq, maxSkv] = [6, 7] or larger
        _raises(call(op, QT, KT, VT, layout="TND", atten_mask=torch.zeros(shape, dtype=torch.bool),
                     **TND_LENS),
                f"{name(op)}: argument 'atten_mask' must be [maxSq, maxSkv] for input_layout "
                "'TND' (at least [6, 7]), but got")


@OPS
def test_rejects_bad_pse(op):
    for shape in ((2, 4, 5, 7), (2, 3, 5, 6), (2, 4, 4, 6), (3, 4, 5, 6), (4, 5, 6)):
        _raises(call(op, pse=randn(*shape)), f"{name(op)}: argument 'pse' must be [B or 1, N or "
                "1, Sq or 1, Skv] = [2, 4, 5, 6], but got")
    _raises(call(op, pse=torch.zeros(2, 4, 5, 6, dtype=torch.int32)),
            f"{name(op)}: argument 'pse' must be float16, bfloat16 or float32, but got Int")
    _raises(call(op, QT, KT, VT, layout="TND", pse=randn(1, 4, 1, 12), **TND_LENS),
            f"{name(op)}: argument 'pse' is not supported with input_layout 'TND'")


@OPS
def test_rejects_bad_sink(op):
    for sink in (torch.zeros(4, dtype=F16), torch.zeros(4, dtype=F64), torch.zeros(5),
                 torch.zeros(1, 4)):
        _raises(call(op, sink=sink),
                f"{name(op)}: argument 'sink' must be a float32 [head_num] = [4] tensor, but got")


@OPS
def test_rejects_padding_mask_and_bad_softmax_layout(op):
    _raises(call(op, padding_mask=torch.zeros(2, 1, 5, 6)),
            f"{name(op)}: argument 'padding_mask' is not supported (torch_npu reserves it)")
    _raises(call(op, QH, KH, VH, layout="BSH", softmax_layout="TND"),
            f"{name(op)}: argument 'softmax_layout' \"TND\" needs input_layout 'TND', but got "
            "'BSH'")
    _raises(call(op, QT, KT, VT, layout="TND", softmax_layout="NTD", **TND_LENS),
            f"{name(op)}: argument 'softmax_layout' must be \"\" or \"TND\", but got \"NTD\"")
    _raises(call(op, inner_precise=3), f"{name(op)}: argument 'inner_precise' must be 0, 1 or 2")


def test_forward_rejects_bad_dropout_mask():
    numels = 2 * 4 * 5 * 6
    _raises(lambda: fa(QB, KB, VB, 4, "BNSD", keep_prob=0.5,
                       dropout_mask=torch.zeros(numels // 8 - 1, dtype=torch.uint8)),
            f"npu_fusion_attention: argument 'dropout_mask' must hold numels = {numels} bits "
            f"({numels // 8} bytes), but got {numels // 8 - 1} bytes")
    _raises(lambda: fa(QB, KB, VB, 4, "BNSD", keep_prob=0.5,
                       dropout_mask=torch.zeros(numels, dtype=torch.bool)),
            "npu_fusion_attention: argument 'dropout_mask' must be the uint8 bit mask of "
            "_npu_dropout_gen_mask, but got Bool")


def test_grad_rejects_bad_arguments():
    res = fa(QB, KB, VB, 4, "BNSD")
    dy = torch.zeros_like(res[0])
    g = lambda **kw: lambda: fa_grad(QB, KB, VB, kw.pop("dy", dy), 4, "BNSD", **kw)  # noqa: E731
    _raises(g(dy=torch.zeros(2, 4, 5, 7)), "npu_fusion_attention_grad: argument 'dy' must have "
            "the shape of attention_out [2, 4, 5, 8], but got [2, 4, 5, 7]")
    stats = dict(softmax_max=res[1], softmax_sum=res[2], attention_in=res[0])
    _raises(g(**{**stats, "softmax_max": res[1][..., :4]}), "npu_fusion_attention_grad: "
            "argument 'softmax_max' must be the [2, 4, 5, 8] tensor npu_fusion_attention "
            "returned, but got [2, 4, 5, 4]")
    _raises(g(**{**stats, "softmax_sum": res[2].half()}),
            "npu_fusion_attention_grad: argument 'softmax_sum' must be float32 (float64 for "
            "float64 inputs), but got Half")
    _raises(g(**{**stats, "attention_in": res[0][:1]}), "npu_fusion_attention_grad: argument "
            "'attention_in' must be the forward's attention_out [2, 4, 5, 8], but got [1, 4, 5, 8]")
    _raises(g(keep_prob=0.5, numels=7), "npu_fusion_attention_grad: argument 'numels' must be "
            "the forward's mask bit count 240, but got 7")
    fa_grad(QB, KB, VB, dy, 4, "BNSD", numels=7)  # numels only matters with dropout


@pytest.mark.parametrize("case", ["D 769", "Dv > D", "head_num 257", "fp64", "mask not 2048"])
def test_strict_mode_rejects_ascend_unsupported(case):
    calls = {
        "D 769": (lambda: fa(*make_qkv(1, 1, 1, 2, 2, 769), 1, "BNSD"), "'query'"),
        "Dv > D": (lambda: fa(*make_qkv(1, 1, 1, 2, 2, 8, 16), 1, "BNSD"), "'value'"),
        "head_num 257": (lambda: fa(*make_qkv(1, 257, 1, 2, 2, 1), 257, "BNSD"), "'head_num'"),
        "fp64": (lambda: fa(*make_qkv(1, 1, 1, 2, 2, 8, dtype=F64), 1, "BNSD"), "'query'"),
        "mask not 2048": (lambda: fa(*make_qkv(1, 1, 1, 2, 2, 8), 1, "BNSD", sparse_mode=2,
                                     atten_mask=torch.ones(2, 2, dtype=torch.bool).triu(1)),
                          "'atten_mask'"),
    }
    fn, arg = calls[case]
    fn()  # accepted by default
    with opennpu.strict(True):
        _raises(fn, f"npu_fusion_attention: argument {arg}", "(strict mode: Ascend constraint)")


def test_strict_mode_accepts_documented_usage():
    with opennpu.strict(True):
        q, k, v = make_qkv(1, 4, 2, 16, 16, 64, 32, "BSH", BF16)
        fa(q, k, v, 4, "BSH", atten_mask=CAUSAL_2048, sparse_mode=3)
        fa(q, k, v, 4, "BSH", atten_mask=PREFIX_3072, sparse_mode=6, prefix=[3])
        fa(q, k, v, 4, "BSH", atten_mask=torch.rand(16, 16) < 0.5)


# ----------------------------------------------------------------------------- hypothesis


@settings(**SETTINGS)
@given(
    layout=st.sampled_from(LAYOUTS),
    b=st.integers(1, 3), nkv=st.integers(1, 2), group=st.integers(1, 3),
    sq=st.integers(1, 70), skv=st.integers(1, 70), d=st.integers(1, 24), dv_less=st.integers(0, 8),
    mode=st.sampled_from([None, 0, 1, 2, 3, 4, 5, 6]),
    pre=st.integers(-5, 80), nxt=st.integers(-5, 80), prefix=st.integers(0, 80),
    pse=st.booleans(), sink=st.booleans(),
)
def test_hypothesis_sweep(layout, b, nkv, group, sq, skv, d, dv_less, mode, pre, nxt, prefix,
                          pse, sink):
    n = nkv * group
    dv = max(1, d - dv_less)
    q, k, v = make_qkv(b, n, nkv, sq, skv, d, dv, layout)
    kw = dict(scale=d ** -0.5)
    full = None
    if mode is not None:
        user = torch.rand(b, 1, sq, skv) < 0.3
        prefixes = [prefix] * b
        kw.update(atten_mask=mask_for(mode, user), sparse_mode=mode, pre_tockens=pre,
                  next_tockens=nxt, prefix=prefixes)
        full = R.full_visibility_mask(mode, sq, skv, b, 1, user, pre, nxt, prefixes)
    check_attention(q, k, v, n, layout, mask_full=full, grad_scale=8.0,
                    pse=randn(1, n, 1, skv) if pse else None,
                    sink=torch.randn(n) if sink else None, **kw)


@settings(**SETTINGS)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=5),
    trailing=st.integers(0, 2), extra=st.integers(0, 3), nkv=st.integers(1, 2),
    group=st.integers(1, 2), mode=st.sampled_from([None, 0, 2, 3, 4, 6, 7, 8]),
    pre=st.integers(-3, 50), nxt=st.integers(-3, 50), softmax_layout=st.sampled_from(["", "TND"]),
    sink=st.booleans(),
)
def test_hypothesis_tnd_sweep(lens, trailing, extra, nkv, group, mode, pre, nxt, softmax_layout,
                              sink):
    qlen, kvlen, tq, tk = [], [], 0, 0
    for a, c in lens:
        tq, tk = tq + a, tk + c
        qlen.append(tq)
        kvlen.append(tk)
    qlen, kvlen = qlen + [0] * trailing, kvlen + [0] * trailing
    n = nkv * group
    q, k, v = make_tnd(tq + extra, tk + extra, n, nkv, 8, 4)
    kw = dict(scale=0.3, actual_seq_qlen=qlen, actual_seq_kvlen=kvlen,
              softmax_layout=softmax_layout)
    masks = None
    if mode is not None and tq > 0:
        user = torch.rand(max(a for a, _ in lens) + 1, max(c for _, c in lens) + 1) < 0.3
        prefix = [3] * len(qlen)
        kw.update(atten_mask=mask_for(mode, user), sparse_mode=mode, pre_tockens=pre,
                  next_tockens=nxt, prefix=prefix)
        masks = tnd_full_masks(mode, qlen, kvlen, user, pre, nxt, prefix)
    check_attention(q, k, v, n, "TND", mask_full=masks, grad_scale=8.0,
                    sink=torch.randn(n) if sink else None, **kw)


def test_backward_rejects_a_dropout_mask_that_seed_and_offset_do_not_give():
    # npu_fusion_attention_grad regenerates the mask from (seed, offset); a different caller mask
    # would silently give the gradients of another forward
    b, n, sq, skv = 1, 2, 5, 7
    q, k, v = (t.requires_grad_() for t in make_qkv(b, n, n, sq, skv, 8, 8, "BNSD"))
    numels = b * n * sq * skv
    good = opennpu._npu_dropout_gen_mask(q, [numels], 0.25, 5, 4)
    fa(q, k, v, n, "BNSD", keep_prob=0.75, dropout_mask=good, seed=5, offset=4)[0].sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    other = opennpu._npu_dropout_gen_mask(q, [numels], 0.25, 6, 4)
    out = fa(q, k, v, n, "BNSD", keep_prob=0.75, dropout_mask=other, seed=5, offset=4)[0]
    with pytest.raises(RuntimeError, match="backward needs the dropout mask that"):
        out.sum().backward()
