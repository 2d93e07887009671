"""npu_fusion_attention_v2 / _v3 and their gradient ops: torch_npu's other argument forms of
npu_fusion_attention, on the same kernels.

v3 takes actual_seq_qlen / actual_seq_kvlen as host tensors and returns seed / offset as tensors;
v2 renames pre/next_tockens, makes the options keyword-only and adds the MLA parts query_rope /
key_rope (scores q k^T + q_rope k_rope^T) and pse_type. Each is checked against
npu_fusion_attention on the same inputs (bit for bit: the same kernels run), v2's rope parts
against npu_fusion_attention on [q, q_rope] / [k, k_rope] concatenated per head and against the
float64 reference.
"""

from __future__ import annotations

import re

import pytest
import torch
from attention_helpers import BF16, CAUSAL_2048, F16, F32, F64, fa, fa_grad, make_qkv, make_tnd
from op_helpers import check_compiled_matches_eager, dtype_id, opcheck, randn

import opennpu
from opennpu.testing import reference as R
from opennpu.testing.tolerances import assert_close

V2, V2_GRAD = opennpu.npu_fusion_attention_v2, opennpu.npu_fusion_attention_grad_v2
V3, V3_GRAD = opennpu.npu_fusion_attention_v3, opennpu.npu_fusion_attention_grad_v3
OPS = torch.ops.npu


def _raises(fn, *pieces):
    with pytest.raises(RuntimeError, match=".*".join(map(re.escape, pieces))):
        fn()


def _equal(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(y, torch.Tensor):
            assert torch.equal(x, y), f"output {i} differs"
        else:
            assert x == y, f"output {i}: {x} vs {y}"


def _cat_rope(x, rope, heads, layout):
    """[x, rope] per head (the independent construction of the test)."""
    if layout in ("BSH", "SBH"):
        a = x.reshape(*x.shape[:2], heads, -1)
        b = rope.reshape(*rope.shape[:2], heads, -1)
        return torch.cat([a, b], -1).reshape(*x.shape[:2], -1)
    return torch.cat([x, rope], -1)


# ----------------------------------------------------------------------------- v3


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_v3_equals_v1(layout, dtype):
    q, k, v = make_qkv(2, 4, 2, 7, 9, 8, 8, layout, dtype)
    kw = dict(atten_mask=CAUSAL_2048, sparse_mode=3, scale=0.3, pse=None)
    want = fa(q, k, v, 4, layout, **kw)
    got = V3(q, k, v, 4, layout, **kw)
    _equal(got[:4], want[:4])
    for t in got[4:]:
        assert t.dtype == torch.int64 and t.shape == (1,) and int(t) == 0


@pytest.mark.parametrize("softmax_layout", ["", "TND"], ids=["NTD", "TND"])
@pytest.mark.parametrize("len_dtype", [torch.int64, torch.int32], ids=dtype_id)
def test_v3_tnd_takes_tensor_lengths(len_dtype, softmax_layout):
    q, k, v = make_tnd(12, 15, 4, 2, 8, 8)
    qlen, kvlen = [3, 3, 12, 0], [5, 9, 15, 0]  # an empty sequence and an unused batch
    kw = dict(atten_mask=CAUSAL_2048, sparse_mode=3, scale=0.5, softmax_layout=softmax_layout)
    want = fa(q, k, v, 4, "TND", actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, **kw)
    got = V3(q, k, v, 4, "TND", actual_seq_qlen=torch.tensor(qlen, dtype=len_dtype),
             actual_seq_kvlen=torch.tensor(kvlen, dtype=len_dtype), **kw)
    _equal(got[:4], want[:4])


def test_v3_non_contiguous_lengths():
    q, k, v = make_tnd(10, 12, 2, 2, 8)
    lens = torch.tensor([[4, 0], [10, 0]])[:, 0]  # strided view
    kvlens = torch.tensor([5, 12])
    got = V3(q, k, v, 2, "TND", actual_seq_qlen=lens, actual_seq_kvlen=kvlens)
    want = fa(q, k, v, 2, "TND", actual_seq_qlen=[4, 10], actual_seq_kvlen=[5, 12])
    _equal(got[:3], want[:3])


def test_v3_dropout_returns_seed_and_offset_tensors_and_grad_regenerates_the_mask():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 6, 7, 8, 8, "BNSD", F64))
    opennpu.manual_seed(5)
    out, smax, ssum, _, seed, offset = V3(q, k, v, 2, "BNSD", keep_prob=0.7)
    opennpu.manual_seed(5)
    want = fa(q, k, v, 2, "BNSD", keep_prob=0.7)
    assert torch.equal(out, want[0])
    assert int(seed) == want[4] and int(offset) == want[5] and seed.dtype == torch.int64
    dy = torch.randn_like(out)
    got = V3_GRAD(q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=ssum, attention_in=out,
                  keep_prob=0.7, seed=seed, offset=offset)
    ref = fa_grad(q, k, v, dy, 2, "BNSD", softmax_max=smax, softmax_sum=ssum, attention_in=out,
                  keep_prob=0.7, seed=want[4], offset=want[5], numels=want[6])
    _equal(got, ref)
    # autograd takes the same path
    grads = torch.autograd.grad(out, (q, k, v), dy)
    for g, r in zip(grads, ref[:3]):
        assert torch.equal(g, r)


def test_v3_autograd_tnd_matches_v1():
    q, k, v = make_tnd(9, 11, 2, 1, 8, 4, dtype=F64)
    sink = torch.randn(2, dtype=torch.float32)
    lens = dict(actual_seq_qlen=[4, 9], actual_seq_kvlen=[5, 11])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = V3(*leaves, 2, "TND", atten_mask=CAUSAL_2048, sparse_mode=2, sink=sink,
             actual_seq_qlen=torch.tensor(lens["actual_seq_qlen"]),
             actual_seq_kvlen=torch.tensor(lens["actual_seq_kvlen"]))[0]
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dy)
    leaves1 = [t.clone().requires_grad_() for t in (q, k, v)]
    out1 = fa(*leaves1, 2, "TND", atten_mask=CAUSAL_2048, sparse_mode=2, sink=sink, **lens)[0]
    want = torch.autograd.grad(out1, leaves1, dy)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_v3_gradcheck_float64():
    q, k, v = make_qkv(1, 2, 1, 3, 5, 4, 4, "BSND", F64)
    pse = torch.randn(1, 2, 3, 5, dtype=F64)
    torch.autograd.gradcheck(
        lambda a, b, c, p: V3(a, b, c, 2, "BSND", pse=p, scale=0.5)[0],
        [t.requires_grad_() for t in (q, k, v, pse)])
    qt, kt, vt = make_tnd(5, 6, 2, 2, 4, dtype=F64)
    lens = dict(actual_seq_qlen=torch.tensor([2, 5]), actual_seq_kvlen=torch.tensor([3, 6]))
    torch.autograd.gradcheck(
        lambda a, b, c: V3(a, b, c, 2, "TND", atten_mask=CAUSAL_2048, sparse_mode=3, **lens)[0],
        [t.requires_grad_() for t in (qt, kt, vt)])


def test_v3_out_forms():
    q, k, v = make_qkv(2, 4, 2, 5, 6, 8, 4, "BSH")
    want = V3(q, k, v, 4, "BSH", scale=0.2, atten_mask=CAUSAL_2048, sparse_mode=2)
    outs = dict(attention_score=torch.empty(0), softmax_max=torch.empty(0),
                softmax_sum=torch.empty(0), softmax_out=torch.empty(0),
                seed=torch.empty(0, dtype=torch.int64), offset=torch.empty(0, dtype=torch.int64))
    got = OPS.npu_fusion_attention_v3.out(q, k, v, 4, "BSH", scale=0.2, atten_mask=CAUSAL_2048,
                                          sparse_mode=2, workspace=torch.empty(0), **outs)
    _equal(got, want)
    assert all(g is o for g, o in zip(got, outs.values()))
    dy = torch.randn_like(want[0])
    gwant = V3_GRAD(q, k, v, dy, 4, "BSH", scale_value=0.2, atten_mask=CAUSAL_2048,
                    sparse_mode=2, softmax_max=want[1], softmax_sum=want[2], attention_in=want[0])
    gouts = dict(dq=torch.empty(0), dk=torch.empty(3), dv=torch.empty(0), dpse=torch.empty(0),
                 dsink=torch.empty(0))
    ggot = opennpu.npu_fusion_attention_grad_v3.out(
        q, k, v, dy, 4, "BSH", scale_value=0.2, atten_mask=CAUSAL_2048, sparse_mode=2,
        softmax_max=want[1], softmax_sum=want[2], attention_in=want[0], **gouts)
    _equal(ggot, gwant)
    assert all(g is o for g, o in zip(ggot, gouts.values()))


def test_v3_out_is_not_differentiable():
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 3, 4, 8, 8, "BNSD"))
    outs = dict(attention_score=torch.empty(0), softmax_max=torch.empty(0),
                softmax_sum=torch.empty(0), softmax_out=torch.empty(0),
                seed=torch.empty(0, dtype=torch.int64), offset=torch.empty(0, dtype=torch.int64))
    _raises(lambda: OPS.npu_fusion_attention_v3.out(q, k, v, 2, "BNSD", **outs),
            "npu_fusion_attention_v3.out", "not differentiable", "query")


def test_v3_bad_input():
    q, k, v = make_tnd(10, 12, 4, 2, 8)
    lens = torch.tensor([4, 10])
    _raises(lambda: V3(q, k, v, 4, "TND", actual_seq_qlen=torch.tensor([[4, 10]]),
                       actual_seq_kvlen=torch.tensor([5, 12])),
            "npu_fusion_attention_v3", "actual_seq_qlen", "1-D integer tensor", "[1, 2]")
    _raises(lambda: V3(q, k, v, 4, "TND", actual_seq_qlen=lens,
                       actual_seq_kvlen=torch.tensor([5.0, 12.0])),
            "npu_fusion_attention_v3", "actual_seq_kvlen", "integer", "Float")
    _raises(lambda: V3(q, k, v, 4, "TND", actual_seq_qlen=lens),
            "npu_fusion_attention_v3", "actual_seq_kvlen", "is required")
    _raises(lambda: V3(q, k, v, 4, "TND", actual_seq_qlen=lens,
                       actual_seq_kvlen=torch.tensor([5, 13])),
            "npu_fusion_attention_v3", "actual_seq_kvlen", "13", "T = 12")
    qb, kb, vb = make_qkv(1, 2, 2, 3, 4, 8, 8, "BNSD")
    out = V3(qb, kb, vb, 2, "BNSD")
    _raises(lambda: V3_GRAD(qb, kb, vb, out[0], 2, "BNSD", keep_prob=0.5,
                            seed=torch.tensor([1, 2]), offset=out[5]),
            "npu_fusion_attention_grad_v3", "seed", "one-element integer tensor")
    _raises(lambda: V3_GRAD(qb, kb, vb, out[0][..., :4], 2, "BNSD"),
            "npu_fusion_attention_grad_v3", "dy", "must have the shape of attention_out")
    _raises(lambda: OPS.npu_fusion_attention_v3.out(
        qb, kb, vb, 2, "BNSD", attention_score=torch.empty(0, dtype=F64),
        softmax_max=torch.empty(0), softmax_sum=torch.empty(0), softmax_out=torch.empty(0),
        seed=torch.empty(0, dtype=torch.int64), offset=torch.empty(0, dtype=torch.int64)),
        "npu_fusion_attention_v3", "attention_score", "must be Float", "Double")


def test_v3_empty():
    q, k, v = make_qkv(0, 2, 2, 3, 4, 8, 8, "BSND")
    out = V3(q, k, v, 2, "BSND")
    assert out[0].shape == (0, 3, 2, 8) and out[1].shape == (0, 2, 3, 8)


def test_opcheck_v3():
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 2, 6, 7, 8, 4, "BSH"))
    qt, kt, vt = (t.requires_grad_() for t in make_tnd(9, 11, 2, 2, 8, 8))
    opcheck(OPS.npu_fusion_attention_v3.default, [
        ((q, k, v, 4, "BSH"), dict(pse=randn(1, 4, 6, 7, requires_grad=True), scale=0.3,
                                   atten_mask=torch.rand(6, 7) < 0.3)),
        ((qt, kt, vt, 2, "TND"), dict(actual_seq_qlen=torch.tensor([4, 9]),
                                      actual_seq_kvlen=torch.tensor([5, 11]),
                                      softmax_layout="TND", sink=torch.randn(2))),
    ])
    res = fa(q.detach(), k.detach(), v.detach(), 4, "BSH")
    dy = torch.randn_like(res[0])
    opcheck(OPS.npu_fusion_attention_grad_v3.default, [
        ((q.detach(), k.detach(), v.detach(), dy, 4, "BSH"),
         dict(softmax_max=res[1], softmax_sum=res[2], attention_in=res[0])),
    ])
    outs = dict(attention_score=torch.empty(0), softmax_max=torch.empty(0),
                softmax_sum=torch.empty(0), softmax_out=torch.empty(0),
                seed=torch.empty(0, dtype=torch.int64), offset=torch.empty(0, dtype=torch.int64))
    torch.library.opcheck(OPS.npu_fusion_attention_v3.out,
                          (q.detach(), k.detach(), v.detach(), 4, "BSH"), outs,
                          test_utils=("test_schema", "test_faketensor"))


def test_v3_compile_fullgraph():
    def block(q, k, v, pse):
        out, smax, *_ = V3(q, k, v, 4, "BSH", pse=pse, scale=0.25,
                           atten_mask=CAUSAL_2048, sparse_mode=3)
        return out * 2, smax

    def make_inputs(shape):
        b, s = shape
        q, k, v = (t.requires_grad_() for t in make_qkv(b, 4, 2, s, s + 3, 8, 8, "BSH"))
        return [q, k, v, randn(1, 4, 1, s + 3, requires_grad=True)]

    check_compiled_matches_eager(block, make_inputs, [(2, 5), (3, 9)])


# ----------------------------------------------------------------------------- v2


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_v2_without_rope_equals_v1(layout, dtype):
    q, k, v = make_qkv(2, 4, 2, 7, 9, 8, 8, layout, dtype)
    mask = torch.rand(7, 9) < 0.3
    want = fa(q, k, v, 4, layout, atten_mask=mask, pre_tockens=3, next_tockens=1, scale=0.3)
    got = V2(q, k, v, 4, layout, atten_mask=mask, pre_tokens=3, next_tokens=1, scale=0.3)
    _equal(got, want)


ROPE_LAYOUTS = ["BSH", "SBH", "BSND", "BNSD"]


def _rope_inputs(layout, dtype=F32, b=2, nq=4, nkv=2, sq=5, skv=7, d=8, dr=4, dv=6):
    q, k, v = make_qkv(b, nq, nkv, sq, skv, d, dv, layout, dtype)
    qr, kr, _ = make_qkv(b, nq, nkv, sq, skv, dr, dv, layout, dtype)
    return q, k, v, qr, kr


@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
def test_v2_rope_equals_v1_on_concatenated_heads(layout):
    q, k, v, qr, kr = _rope_inputs(layout)
    kw = dict(atten_mask=CAUSAL_2048, sparse_mode=3, scale=0.2)
    got = V2(q, k, v, 4, layout, query_rope=qr, key_rope=kr, **kw)
    want = fa(_cat_rope(q, qr, 4, layout), _cat_rope(k, kr, 2, layout), v, 4, layout, **kw)
    _equal(got, want)


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=dtype_id)
def test_v2_rope_matches_reference(dtype):
    q, k, v, qr, kr = _rope_inputs("BNSD", dtype)
    out = V2(q, k, v, 4, "BNSD", query_rope=qr, key_rope=kr, scale=0.3)[0]
    up = [t.double() for t in (q, k, v, qr, kr)]
    kk = up[1].repeat_interleave(2, 1)
    krr = up[4].repeat_interleave(2, 1)
    s = (up[0] @ kk.transpose(-1, -2) + up[3] @ krr.transpose(-1, -2)) * 0.3
    want = torch.softmax(s, -1) @ up[2].repeat_interleave(2, 1)
    assert_close(out, want, dtype=dtype)


@pytest.mark.parametrize("layout", ["BSH", "BSND", "TND"])
def test_v2_rope_gradients(layout):
    if layout == "TND":
        q, k, v = make_tnd(9, 11, 4, 2, 8, 6)
        qr, kr, _ = make_tnd(9, 11, 4, 2, 4)
        kw = dict(actual_seq_qlen=[4, 9], actual_seq_kvlen=[5, 11], atten_mask=CAUSAL_2048,
                  sparse_mode=3)
    else:
        q, k, v, qr, kr = _rope_inputs(layout)
        kw = dict(atten_mask=CAUSAL_2048, sparse_mode=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, qr, kr)]
    out = V2(*leaves[:3], 4, layout, query_rope=leaves[3], key_rope=leaves[4], scale=0.3, **kw)[0]
    dy = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dy)
    cat = [t.clone().requires_grad_() for t in (_cat_rope(q, qr, 4, layout),
                                                _cat_rope(k, kr, 2, layout), v)]
    out1 = fa(*cat, 4, layout, scale=0.3, **kw)[0]
    assert torch.equal(out, out1)
    dqc, dkc, dvc = torch.autograd.grad(out1, cat, dy)
    assert torch.equal(_cat_rope(got[0], got[3], 4, layout), dqc)
    assert torch.equal(_cat_rope(got[1], got[4], 2, layout), dkc)
    assert torch.equal(got[2], dvc)
    assert got[3].shape == qr.shape and got[4].shape == kr.shape


def test_v2_grad_op_outputs():
    q, k, v, qr, kr = _rope_inputs("BSH")
    res = V2(q, k, v, 4, "BSH", query_rope=qr, key_rope=kr)
    dy = torch.randn_like(res[0])
    stats = dict(softmax_max=res[1], softmax_sum=res[2], attention_in=res[0])
    dq, dk, dv, dpse, dqr, dkr, dsink = V2_GRAD(q, k, v, dy, 4, "BSH", query_rope=qr,
                                                key_rope=kr, **stats)
    assert (dq.shape, dk.shape, dv.shape, dqr.shape, dkr.shape) == (
        q.shape, k.shape, v.shape, qr.shape, kr.shape)
    assert dpse.numel() == 0 and dsink.numel() == 0 and dsink.dtype == F32
    # without rope: empty rope gradients, the rest equal to v1's grad
    res = fa(q, k, v, 4, "BSH")
    stats = dict(softmax_max=res[1], softmax_sum=res[2], attention_in=res[0])
    got = V2_GRAD(q, k, v, dy, 4, "BSH", **stats)
    want = fa_grad(q, k, v, dy, 4, "BSH", **stats)
    _equal(got[:4], want[:4])
    assert got[4].numel() == 0 and got[5].numel() == 0
    assert torch.equal(got[6], want[4])


def test_v2_pse_type_0_adds_pse_after_scaling():
    q, k, v = make_qkv(2, 4, 2, 5, 7, 8, 8, "BNSD", F64)
    pse = torch.randn(1, 4, 5, 7, dtype=F64)
    out = V2(q, k, v, 4, "BNSD", pse=pse, pse_type=0, scale=0.4)[0]
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.4 + pse
    want = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
    assert_close(out, want, dtype=F64)
    _equal(V2(q, k, v, 4, "BNSD", pse=pse, pse_type=1, scale=0.4),
           fa(q, k, v, 4, "BNSD", pse=pse, scale=0.4))


def test_v2_gradcheck_float64_rope_pse():
    q, k, v, qr, kr = _rope_inputs("BSND", F64, b=1, nq=2, nkv=1, sq=3, skv=4, d=4, dr=2, dv=3)
    pse = torch.randn(1, 2, 1, 4, dtype=F64)

    def fn(a, b, c, p, r1, r2):
        return V2(a, b, c, 2, "BSND", pse=p, query_rope=r1, key_rope=r2, pse_type=0,
                  scale=0.5)[0]

    torch.autograd.gradcheck(fn, [t.requires_grad_() for t in (q, k, v, pse, qr, kr)])


def test_v2_sink_gradient_equals_v1():
    q, k, v = make_qkv(1, 2, 2, 3, 4, 8, 8, "BNSD")
    sink = torch.randn(2)
    s2, s1 = sink.clone().requires_grad_(), sink.clone().requires_grad_()
    out2 = V2(q, k, v, 2, "BNSD", sink=s2)[0]
    out1 = fa(q, k, v, 2, "BNSD", sink=s1)[0]
    dy = torch.randn_like(out1)
    assert torch.equal(torch.autograd.grad(out2, s2, dy)[0], torch.autograd.grad(out1, s1, dy)[0])


def test_v2_only_requested_gradients():
    q, k, v, qr, kr = _rope_inputs("BNSD")
    qr.requires_grad_()
    out = V2(q, k, v, 4, "BNSD", query_rope=qr, key_rope=kr)[0]
    (g,) = torch.autograd.grad(out.sum(), qr)
    assert g.shape == qr.shape
    assert not V2(q, k, v, 4, "BNSD")[0].requires_grad


def test_v2_dropout_matches_v1():
    q, k, v = make_qkv(1, 2, 2, 6, 7, 8, 8, "BSH")
    opennpu.manual_seed(3)
    want = fa(q, k, v, 2, "BSH", keep_prob=0.6)
    opennpu.manual_seed(3)
    got = V2(q, k, v, 2, "BSH", keep_prob=0.6)
    _equal(got, want)
    mask = opennpu._npu_dropout_gen_mask(q, [want[6]], 0.4, 9, 0)
    _equal(V2(q, k, v, 2, "BSH", keep_prob=0.6, dropout_mask=mask, seed=9),
           fa(q, k, v, 2, "BSH", keep_prob=0.6, dropout_mask=mask, seed=9))


def test_v2_bad_input():
    q, k, v, qr, kr = _rope_inputs("BNSD")
    _raises(lambda: V2(q, k, v, 4, "BNSD", query_rope=qr),
            "npu_fusion_attention_v2", "key_rope", "must be given together with query_rope")
    _raises(lambda: V2(q, k, v, 4, "BNSD", query_rope=qr, key_rope=kr[..., :3]),
            "npu_fusion_attention_v2", "key_rope", "rope head size of query_rope (4)", "3")
    _raises(lambda: V2(q, k, v, 4, "BNSD", query_rope=qr[:, :, :4], key_rope=kr),
            "npu_fusion_attention_v2", "query_rope", "must have the shape of 'query'")
    _raises(lambda: V2(q, k, v, 4, "BNSD", query_rope=qr.double(), key_rope=kr),
            "npu_fusion_attention_v2", "query_rope", "dtype of 'query'", "Double")
    _raises(lambda: V2(q, k, v, 4, "BNSD", pse_type=2), "npu_fusion_attention_v2", "pse_type",
            "2", "not supported")
    _raises(lambda: V2(q, k, v, 4, "BNSD", pse_type=7), "npu_fusion_attention_v2", "pse_type",
            "must be 0, 1, 2 or 3")
    _raises(lambda: V2(q, k, v, 4, "BNSD", pse=torch.zeros(1, 4, 5, 7), pse_type=0, scale=0.0),
            "npu_fusion_attention_v2", "scale", "nonzero")
    qh, kh, vh, qrh, krh = _rope_inputs("BSH")
    _raises(lambda: V2(qh, kh, vh, 4, "BSH", query_rope=qrh, key_rope=krh[..., :6]),
            "npu_fusion_attention_v2", "key_rope", "2 key heads x 4")
    with pytest.raises(TypeError):
        V2(q, k, v, 4, "BNSD", None)  # pse is keyword-only
    res = V2(q, k, v, 4, "BNSD", query_rope=qr, key_rope=kr)
    _raises(lambda: V2_GRAD(q, k, v, res[0], 4, "BNSD", query_rope=qr),
            "npu_fusion_attention_grad_v2", "key_rope", "must be given together")


def test_opcheck_v2():
    q, k, v, qr, kr = (t.requires_grad_() for t in _rope_inputs("BSH"))
    opcheck(OPS.npu_fusion_attention_v2.default, [
        ((q, k, v, 4, "BSH"), dict(query_rope=qr, key_rope=kr, scale=0.3,
                                   atten_mask=CAUSAL_2048, sparse_mode=3)),
        ((q, k, v, 4, "BSH"), dict(pse=randn(1, 4, 5, 7, requires_grad=True), pse_type=0,
                                   sink=torch.randn(4))),
    ])
    q, k, v, qr, kr = (t.detach() for t in (q, k, v, qr, kr))
    res = V2(q, k, v, 4, "BSH", query_rope=qr, key_rope=kr)
    opcheck(OPS.npu_fusion_attention_grad_v2.default, [
        ((q, k, v, torch.randn_like(res[0]), 4, "BSH"),
         dict(query_rope=qr, key_rope=kr, softmax_max=res[1], softmax_sum=res[2],
              attention_in=res[0])),
    ])


def test_v2_compile_fullgraph():
    def block(q, k, v, qr, kr):
        out, smax, *_ = V2(q, k, v, 4, "BSND", query_rope=qr, key_rope=kr, scale=0.25,
                           atten_mask=CAUSAL_2048, sparse_mode=3)
        return out * 2, smax

    def make_inputs(shape):
        b, s = shape
        return [t.requires_grad_() for t in _rope_inputs("BSND", b=b, sq=s, skv=s + 2)]

    # no size equal to another (duck sizing would specialise on it)
    check_compiled_matches_eager(block, make_inputs, [(3, 5), (5, 9)])


def test_torch_npu_aliases():
    import torch_npu

    q, k, v = make_qkv(1, 2, 2, 3, 4, 8, 8, "BSH")
    _equal(torch_npu.npu_fusion_attention_v3(q, k, v, 2, "BSH")[:4], fa(q, k, v, 2, "BSH")[:4])
    _equal(torch_npu.npu_fusion_attention_v2(q, k, v, head_num=2, input_layout="BSH"),
           fa(q, k, v, 2, "BSH"))
    for name in ("npu_fusion_attention_grad_v2", "npu_fusion_attention_grad_v3"):
        assert callable(getattr(torch_npu, name))


def test_variants_on_the_npu_device():
    """On npu the sequence lengths (and v3's seed / offset in the backward) may stay on the
    host, as torch_npu takes them."""
    q, k, v = make_tnd(9, 11, 2, 1, 8)
    lens = dict(actual_seq_qlen=torch.tensor([4, 9]), actual_seq_kvlen=torch.tensor([5, 11]))
    want = V3(q, k, v, 2, "TND", **lens)
    leaves = [t.to("npu").requires_grad_() for t in (q, k, v)]
    got = V3(*leaves, 2, "TND", **lens)
    assert got[0].device.type == "npu"
    _equal([t.cpu() for t in got[:4]], want[:4])
    got[0].sum().backward()
    assert leaves[0].grad.device.type == "npu"
    _raises(lambda: V3(*leaves, 2, "TND", actual_seq_qlen=lens["actual_seq_qlen"],
                       actual_seq_kvlen=lens["actual_seq_kvlen"], atten_mask=CAUSAL_2048,
                       sparse_mode=3, sink=torch.randn(2)),
            "same device")
