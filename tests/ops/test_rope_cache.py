"""npu_interleave_rope, npu_apply_rotary_pos_emb and npu_kv_rmsnorm_rope_cache(_v2, _v2_functional):
the inference ropes, against op-plugin's goldens (test_npu_apply_rotary_pos_emb.py,
test_npu_kv_rms_norm_rope_cache.py, and the formula of torch_npu-npu_interleave_rope.md)."""

from __future__ import annotations

import pytest
import torch

import opennpu  # noqa: F401
import torch_npu

npu = torch.ops.npu
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _interleave_ref(x, cos, sin):
    """The doc's formula: x reshaped [..., D/2, 2], transposed, then q*cos + rotate_half(q)*sin."""
    D = x.shape[-1]
    q = x.float().unflatten(-1, (D // 2, 2)).transpose(-1, -2).flatten(-2)
    return (q * cos.float() + _rotate_half(q) * sin.float()).to(x.dtype)


def _rotary_ref(x, cos, sin, mode):
    xf = x.float()
    if mode == "half":
        r = _rotate_half(xf)
    else:
        p = xf.unflatten(-1, (-1, 2))
        r = torch.stack((-p[..., 1], p[..., 0]), -1).flatten(-2)
    return (xf * cos.float() + r * sin.float()).to(x.dtype)


# ----------------------------------------------------------------------------- interleave_rope


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,cshape", [((4, 8, 1, 64), (4, 1, 1, 64)),
                                          ((2, 3, 7, 64), (2, 1, 7, 64)),
                                          ((3, 2, 5, 6), (3, 1, 1, 6)),
                                          ((1, 1, 3, 130), (1, 1, 3, 130)),
                                          ((0, 2, 3, 64), (0, 1, 3, 64))])
def test_interleave_rope_matches_formula(dtype, shape, cshape):
    x, cos, sin = torch.randn(shape, dtype=dtype), torch.randn(cshape, dtype=dtype), torch.randn(
        cshape, dtype=dtype)
    out = torch_npu.npu_interleave_rope(x, cos, sin)
    assert out.shape == x.shape and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(out, _interleave_ref(x, cos, sin), atol=tol, rtol=tol)


def test_interleave_rope_non_contiguous_and_npu():
    x = torch.randn(2, 5, 3, 64).transpose(1, 2)  # [2, 3, 5, 64] strided
    cos, sin = torch.randn(2, 1, 5, 64), torch.randn(2, 1, 5, 64)
    ref = _interleave_ref(x, cos, sin)
    torch.testing.assert_close(npu.npu_interleave_rope(x, cos, sin), ref)
    out = npu.npu_interleave_rope(x.to("npu"), cos.to("npu"), sin.to("npu"))
    assert out.device.type == "npu"
    torch.testing.assert_close(out.cpu(), ref)


def test_interleave_rope_bad_inputs():
    with pytest.raises(RuntimeError, match="npu_interleave_rope.*'x'.*even last dim"):
        npu.npu_interleave_rope(torch.randn(1, 1, 1, 5), torch.randn(1, 1, 1, 5),
                                torch.randn(1, 1, 1, 5))
    with pytest.raises(RuntimeError, match="npu_interleave_rope.*'cos'.*broadcast"):
        npu.npu_interleave_rope(torch.randn(2, 1, 3, 8), torch.randn(3, 1, 3, 8),
                                torch.randn(2, 1, 3, 8))
    with pytest.raises(RuntimeError, match="npu_interleave_rope.*'cos'.*last dim D = 8"):
        npu.npu_interleave_rope(torch.randn(2, 1, 3, 8), torch.randn(2, 1, 3, 1),
                                torch.randn(2, 1, 3, 8))


# ----------------------------------------------------------------------------- apply_rotary_pos_emb


def test_apply_rotary_pos_emb_op_plugin_golden():
    # op-plugin's test: uniform [0, 1) fp16, BSND, half; query and key updated in place.
    q = torch.rand(2, 16, 4, 128, dtype=torch.float16)
    k = torch.rand(2, 16, 4, 128, dtype=torch.float16)
    cos, sin = torch.rand(2, 16, 1, 128, dtype=torch.float16), torch.rand(2, 16, 1, 128,
                                                                          dtype=torch.float16)
    rq, rk = _rotary_ref(q, cos, sin, "half"), _rotary_ref(k, cos, sin, "half")
    oq, ok = torch_npu.npu_apply_rotary_pos_emb(q, k, cos, sin, "BSND", "half")
    assert oq is q and ok is k
    assert torch.equal(q, rq) and torch.equal(k, rk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout,qs,ks,cs", [
    ("BSND", (2, 5, 3, 64), (2, 5, 1, 64), (2, 5, 1, 64)),
    ("SBND", (5, 2, 3, 16), (5, 2, 2, 16), (5, 2, 1, 16)),
    ("BNSD", (2, 3, 5, 10), (2, 1, 5, 10), (2, 1, 5, 10)),
    ("TND", (7, 3, 128), (7, 2, 128), (7, 1, 128)),
    ("BSND", (1, 5, 2, 64), (1, 5, 2, 64), (1, 5, 1, 64)),
    ("TND", (0, 3, 8), (0, 1, 8), (0, 1, 8)),
])
@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_apply_rotary_pos_emb_layouts(dtype, layout, qs, ks, cs, mode):
    q, k = torch.randn(qs, dtype=dtype), torch.randn(ks, dtype=dtype)
    cos, sin = torch.randn(cs, dtype=dtype), torch.randn(cs, dtype=dtype)
    rq, rk = _rotary_ref(q, cos, sin, mode), _rotary_ref(k, cos, sin, mode)
    oq, ok = npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout=layout, rotary_mode=mode)
    tol = 1e-6 if dtype == torch.float32 else 0
    torch.testing.assert_close(q, rq, atol=tol, rtol=tol)
    torch.testing.assert_close(k, rk, atol=tol, rtol=tol)
    assert oq is q and ok is k


def test_apply_rotary_pos_emb_non_contiguous_is_written_in_place():
    base = torch.randn(2, 3, 5, 16)
    q = base.transpose(1, 2)  # [2, 5, 3, 16] strided (BSND view of BNSD memory)
    k = torch.randn(2, 5, 1, 16)
    cos, sin = torch.randn(2, 5, 1, 16), torch.randn(2, 5, 1, 16)
    rq = _rotary_ref(q, cos, sin, "half")
    npu.npu_apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(base.transpose(1, 2), rq)


def test_apply_rotary_pos_emb_on_npu():
    q, k = torch.randn(1, 4, 2, 64), torch.randn(1, 4, 2, 64)
    cos, sin = torch.randn(1, 4, 1, 64), torch.randn(1, 4, 1, 64)
    rq = _rotary_ref(q, cos, sin, "half")
    qn, kn = q.to("npu"), k.to("npu")
    npu.npu_apply_rotary_pos_emb(qn, kn, cos.to("npu"), sin.to("npu"))
    torch.testing.assert_close(qn.cpu(), rq)


def test_apply_rotary_pos_emb_bad_inputs():
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    c = torch.randn(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="npu_apply_rotary_pos_emb.*'rotary_mode'.*quarter"):
        npu.npu_apply_rotary_pos_emb(q, k, c, c, "BSND", "quarter")
    with pytest.raises(RuntimeError, match="npu_apply_rotary_pos_emb.*'layout'.*'BSH'"):
        npu.npu_apply_rotary_pos_emb(q, k, c, c, "BSH")
    with pytest.raises(RuntimeError, match="npu_apply_rotary_pos_emb.*'query'.*3-D for layout 'TND'"):
        npu.npu_apply_rotary_pos_emb(q, k, c, c, "TND")
    with pytest.raises(RuntimeError, match="npu_apply_rotary_pos_emb.*'key'.*except in N"):
        npu.npu_apply_rotary_pos_emb(q, torch.randn(1, 3, 2, 8), c, c)
    with pytest.raises(RuntimeError, match="npu_apply_rotary_pos_emb.*'cos'.*dtype of 'query'"):
        npu.npu_apply_rotary_pos_emb(q, k, c.half(), c)


def test_apply_rotary_pos_emb_compiles_and_keeps_the_writes():
    def step(q, k, cos, sin):
        torch_npu.npu_apply_rotary_pos_emb(q, k, cos, sin)
        return q * 2, k + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    args = [torch.randn(2, 3, 2, 8), torch.randn(2, 3, 1, 8), torch.randn(2, 3, 1, 8),
            torch.randn(2, 3, 1, 8)]
    eager = [a.clone() for a in args]
    out, ref = compiled(*args), step(*eager)
    for a, b in zip((*out, args[0], args[1]), (*ref, eager[0], eager[1])):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- kv_rmsnorm_rope_cache


def _kv_golden(kv, gamma, cos, sin, index, k_cache, ckv_cache, k_scale=None, c_scale=None,
               v=None, eps=1e-5, mode="Norm"):
    """op-plugin's golden (test_npu_kv_rms_norm_rope_cache.py), Norm mode from the doc."""
    B, _, S, _ = kv.shape
    k_cache, ckv_cache = k_cache.clone(), ckv_cache.clone()
    Dr = cos.shape[-1]
    if v is None:
        rms, rope = kv.float().split([gamma.shape[0], Dr], -1)
        y = rms / torch.sqrt((rms ** 2).mean(-1, keepdim=True) + eps) * gamma.float()
        k = rope.view(B, 1, S, Dr // 2, 2).transpose(4, 3).reshape(B, 1, S, Dr)
        k = k * cos.float() + _rotate_half(k) * sin.float()
        k_out, c_out = k.to(kv.dtype), y.to(kv.dtype)
    else:
        y = kv.float()
        y = y / torch.sqrt((y ** 2).mean(-1, keepdim=True) + eps) * gamma.float()
        k = y[..., :Dr].view(B, 1, S, Dr // 2, 2).transpose(4, 3).reshape(B, 1, S, Dr)
        k = torch.cat([k * cos.float() + _rotate_half(k) * sin.float(), y[..., Dr:]], -1)
        y = v.float()
        k_out, c_out = k.to(kv.dtype), v

    def quant(t, scale, cache):
        if scale is None:
            return t.to(cache.dtype)
        return (t * scale).round().clip(-128, 127).to(torch.int8)

    kq, cq = quant(k, k_scale, k_cache), quant(y, c_scale, ckv_cache)
    if mode == "Norm":
        for b in range(B):
            for s in range(S):
                k_cache[b, 0, index[b, s]] = kq[b, 0, s]
                ckv_cache[b, 0, index[b, s]] = cq[b, 0, s]
        return k_cache, ckv_cache, k_out, c_out
    nb, bs = k_cache.shape[:2]

    def put(cache, row, val):
        W = val.numel()
        if "NZ" in mode:
            d0 = 32 // cache.element_size()
            cache.view(-1).view(nb, W // d0, bs, d0)[row // bs, :, row % bs, :] = val.reshape(-1, d0)
        else:
            cache.view(nb * bs, W)[row] = val

    for b in range(B):
        for s in range(S):
            if "BLK" in mode:
                page = index[b * (index.numel() // B) + s // bs]
                if page < 0:
                    continue
                row = (page // bs) * bs + s % bs
            else:
                row = index[b * S + s]
                if row < 0:
                    continue
            put(k_cache, row, kq[b, 0, s])
            put(ckv_cache, row, cq[b, 0, s])
    return k_cache, ckv_cache, k_out, c_out


def _kv_inputs(dtype, mode, quant, with_v, B=3, S=5, bs=4, nb=16, L=9, Dr=32, Dc=64):
    g = torch.Generator().manual_seed(7)
    if with_v:
        kv, gamma = torch.randn(B, 1, S, Dc, dtype=dtype, generator=g), torch.randn(Dc, dtype=dtype,
                                                                                   generator=g)
        v = torch.randn(B, 1, S, 32, dtype=dtype, generator=g)
        Wk, Wc = Dc, 32
    else:
        kv = torch.randn(B, 1, S, Dc + Dr, dtype=dtype, generator=g)
        gamma, v, Wk, Wc = torch.randn(Dc, dtype=dtype, generator=g), None, Dr, Dc
    cos = torch.randn(B, 1, S, Dr, dtype=dtype, generator=g)
    sin = torch.randn(B, 1, S, Dr, dtype=dtype, generator=g)
    cdt = torch.int8 if quant else dtype
    if mode == "Norm":
        kc, cc = torch.zeros(B, 1, L, Wk, dtype=cdt), torch.zeros(B, 1, L, Wc, dtype=cdt)
        index = torch.stack([torch.randperm(L, generator=g)[:S] for _ in range(B)])
    else:
        kc, cc = torch.zeros(nb, bs, 1, Wk, dtype=cdt), torch.zeros(nb, bs, 1, Wc, dtype=cdt)
        if "BLK" in mode:
            index = torch.randperm(nb, generator=g)[:B * ((S + bs - 1) // bs)] * bs
            index[1] = -1
        else:
            index = torch.randperm(nb * bs, generator=g)[:B * S]
            index[2] = -1
    ks = torch.rand(Wk, generator=g) * 4 if quant else None
    cs = torch.rand(Wc, generator=g) * 4 if quant else None
    return kv, gamma, cos, sin, index, kc, cc, ks, cs, v


MODES = ("Norm", "PA", "PA_BNSD", "PA_NZ", "PA_BLK_BNSD", "PA_BLK_NZ")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("quant", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("with_v", [False, True], ids=["v1", "v2"])
def test_kv_rmsnorm_rope_cache_matches_golden(dtype, mode, quant, with_v):
    kv, gamma, cos, sin, index, kc, cc, ks, cs, v = _kv_inputs(dtype, mode, quant, with_v)
    ref = _kv_golden(kv, gamma, cos, sin, index, kc, cc, ks, cs, v, 1e-5, mode)
    out = torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, kc, cc,
                                              k_rope_scale=ks, c_kv_scale=cs, v=v,
                                              cache_mode=mode, is_output_kv=True)
    assert out[0] is kc and out[1] is cc  # written in place, returned
    ulp = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for got, want in zip(out, ref):
        assert got.shape == want.shape and got.dtype == want.dtype
        if got.dtype == torch.int8:  # a code may differ by one where the value sits on a .5
            assert (got.int() - want.int()).abs().max() <= 1
            assert (got != want).float().mean() < 0.02
        else:
            torch.testing.assert_close(got, want, atol=ulp, rtol=ulp)


def test_kv_rmsnorm_rope_cache_v2_and_functional_forms():
    kv, gamma, cos, sin, index, kc, cc, ks, cs, v = _kv_inputs(torch.bfloat16, "PA_NZ", False,
                                                               False)
    ref = _kv_golden(kv, gamma, cos, sin, index, kc, cc, mode="PA_NZ")
    k0, c0 = kc.clone(), cc.clone()
    k, c, k_new, c_new = npu.npu_kv_rmsnorm_rope_cache_v2_functional(
        kv, gamma, cos, sin, index, kc, cc, cache_mode="PA_NZ")
    assert torch.equal(kc, k0) and torch.equal(cc, c0)  # inputs untouched
    for got, want in zip((k_new, c_new, k, c), ref):
        torch.testing.assert_close(got, want, atol=8e-3, rtol=8e-3)
    k2, c2 = torch_npu.npu_kv_rmsnorm_rope_cache_v2(kv, gamma, cos, sin, index, kc, cc,
                                                    cache_mode="PA_NZ")
    assert torch.equal(kc, k_new) and torch.equal(cc, c_new)
    assert torch.equal(k2, k) and torch.equal(c2, c)
    with pytest.raises(RuntimeError, match="npu_kv_rmsnorm_rope_cache_v2.*'k_cache_dtype'"):
        npu.npu_kv_rmsnorm_rope_cache_v2(kv, gamma, cos, sin, index, kc, cc, k_cache_dtype=1)


def test_kv_rmsnorm_rope_cache_vllm_ascend_call_on_npu():
    # vllm-ascend's MLA decode: kv [tokens, 1, 1, 576], cos [tokens, 1, 1, 64], 'PA' caches,
    # results discarded (only the cache writes matter); strided kv from a fused projection.
    T, nb, bs = 5, 4, 8
    proj = torch.randn(T, 576 + 7, dtype=torch.bfloat16)
    kv = proj[:, :576].view(T, 1, 1, 576)
    gamma = torch.randn(512, dtype=torch.bfloat16)
    cos, sin = torch.randn(T, 1, 1, 64, dtype=torch.bfloat16), torch.randn(T, 1, 1, 64,
                                                                           dtype=torch.bfloat16)
    slots = torch.tensor([3, 17, -1, 30, 8])
    k_cache = torch.zeros(nb, bs, 1, 64, dtype=torch.bfloat16)
    ckv_cache = torch.zeros(nb, bs, 1, 512, dtype=torch.bfloat16)
    ref = _kv_golden(kv, gamma, cos, sin, slots, k_cache, ckv_cache, mode="PA")
    kn, cn = k_cache.to("npu"), ckv_cache.to("npu")
    torch_npu.npu_kv_rmsnorm_rope_cache(kv.to("npu"), gamma.to("npu"), cos.to("npu"),
                                        sin.to("npu"), slots.to("npu"), kn, cn,
                                        epsilon=1e-5, cache_mode="PA")
    torch.testing.assert_close(kn.cpu(), ref[0], atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(cn.cpu(), ref[1], atol=8e-3, rtol=8e-3)


def test_kv_rmsnorm_rope_cache_empty_and_broadcast_cos():
    kv = torch.randn(0, 1, 3, 96)
    out = npu.npu_kv_rmsnorm_rope_cache(kv, torch.randn(64), torch.randn(0, 1, 3, 32),
                                        torch.randn(0, 1, 3, 32), torch.zeros(0, dtype=torch.long),
                                        torch.zeros(2, 4, 1, 32), torch.zeros(2, 4, 1, 64),
                                        cache_mode="PA")
    assert out[2].shape == (0, 1, 3, 32) and out[3].shape == (0, 1, 3, 64)
    # cos / sin with batch 1 broadcast over the batch
    kv, gamma, cos, sin, index, kc, cc, _, _, _ = _kv_inputs(torch.float32, "PA", False, False)
    ref = _kv_golden(kv, gamma, cos[:1].expand_as(cos), sin[:1].expand_as(sin), index, kc, cc,
                     mode="PA")
    out = npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos[:1], sin[:1], index, kc, cc,
                                        cache_mode="PA")
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want)


def test_kv_rmsnorm_rope_cache_bad_inputs_leave_caches_untouched():
    kv, gamma, cos, sin, index, kc, cc, _, _, _ = _kv_inputs(torch.float32, "PA", False, False)
    k0, c0 = kc.clone(), cc.clone()
    call = npu.npu_kv_rmsnorm_rope_cache
    with pytest.raises(RuntimeError, match="npu_kv_rmsnorm_rope_cache.*'cache_mode'.*'PA_XX'"):
        call(kv, gamma, cos, sin, index, kc, cc, cache_mode="PA_XX")
    bad = index.clone()
    bad[-1] = 16 * 4
    with pytest.raises(RuntimeError, match="npu_kv_rmsnorm_rope_cache.*'index'.*block_num"):
        call(kv, gamma, cos, sin, bad, kc, cc, cache_mode="PA")
    with pytest.raises(RuntimeError, match="npu_kv_rmsnorm_rope_cache.*'ckv_cache'.*block_size"):
        call(kv, gamma, cos, sin, index, kc, cc[..., :8], cache_mode="PA")
    with pytest.raises(RuntimeError, match="npu_kv_rmsnorm_rope_cache.*'kv'.*rms_size \\+ rope_size"):
        call(kv[..., :-2], gamma, cos, sin, index, kc, cc, cache_mode="PA")
    with pytest.raises(RuntimeError, match="npu_kv_rmsnorm_rope_cache.*'k_cache'.*int8"):
        call(kv, gamma, cos, sin, index, kc, cc, k_rope_scale=torch.ones(32), cache_mode="PA")
    with pytest.raises(RuntimeError, match="npu_kv_rmsnorm_rope_cache.*'k_rope_offset'"):
        call(kv, gamma, cos, sin, index, kc, cc, k_rope_offset=torch.ones(32), cache_mode="PA")
    with pytest.raises(RuntimeError, match="npu_kv_rmsnorm_rope_cache.*'index'.*one offset"):
        call(kv, gamma, cos, sin, index[:-1], kc, cc, cache_mode="PA")
    assert torch.equal(kc, k0) and torch.equal(cc, c0)


def test_kv_rmsnorm_rope_cache_compiles_and_keeps_the_cache_writes():
    def step(kv, gamma, cos, sin, index, kc, cc):
        _, _, k, c = torch_npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, kc, cc,
                                                         cache_mode="PA")
        return k + 1, c * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    args = list(_kv_inputs(torch.float32, "PA", False, False)[:7])
    eager = [a.clone() for a in args]
    out, ref = compiled(*args), step(*eager)
    for a, b in zip((*out, args[5], args[6]), (*ref, eager[5], eager[6])):
        torch.testing.assert_close(a, b)
    assert not torch.equal(args[5], torch.zeros_like(args[5]))
    torch._dynamo.reset()


def test_opcheck():
    x, c = torch.randn(2, 3, 4, 8), torch.randn(2, 1, 4, 8)
    torch.library.opcheck(npu.npu_interleave_rope.default, (x, c, c))
    kv, gamma, cos, sin, index, kc, cc, _, _, _ = _kv_inputs(torch.float32, "PA_NZ", False, False)
    torch.library.opcheck(npu.npu_kv_rmsnorm_rope_cache_v2_functional.default,
                          (kv, gamma, cos, sin, index, kc, cc), {"cache_mode": "PA_NZ"})
    torch.library.opcheck(npu.npu_kv_rmsnorm_rope_cache_v2.default,
                          (kv, gamma, cos, sin, index, kc, cc), {"cache_mode": "PA_NZ"})
    # The torch_npu schemas of these two do not declare the in-place writes torch_npu makes,
    # which opcheck's schema test would flag: the other checks apply.
    utils = ("test_faketensor", "test_aot_dispatch_dynamic")
    q, k = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 1, 8)
    cs = torch.randn(2, 3, 1, 8)
    torch.library.opcheck(npu.npu_apply_rotary_pos_emb.default, (q, k, cs, cs), test_utils=utils)
    torch.library.opcheck(npu.npu_kv_rmsnorm_rope_cache.default,
                          (kv, gamma, cos, sin, index, kc, cc), {"cache_mode": "PA_NZ"},
                          test_utils=utils)


def test_not_differentiable():
    x = torch.randn(1, 1, 2, 4, requires_grad=True)
    out = npu.npu_interleave_rope(x, torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4))
    with pytest.raises(RuntimeError, match="npu_interleave_rope: not differentiable"):
        out.sum().backward()


@pytest.mark.parametrize("mode", MODES)
def test_portable_compositions_match_the_kernels(mode):
    from opennpu.ops import portable

    kv, gamma, cos, sin, index, kc, cc, ks, cs, v = _kv_inputs(torch.float32, mode, True, False)
    ours = npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, kc.clone(), cc.clone(),
                                         k_rope_scale=ks, c_kv_scale=cs, cache_mode=mode)
    x, c = torch.randn(2, 3, 4, 8), torch.randn(2, 1, 4, 8)
    q, k = torch.randn(2, 4, 3, 8), torch.randn(2, 4, 1, 8)
    rope = npu.npu_interleave_rope(x, c, c)
    q1, k1 = q.clone(), k.clone()
    npu.npu_apply_rotary_pos_emb(q1, k1, c.transpose(1, 2), c.transpose(1, 2))
    with portable.force():
        theirs = npu.npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, kc.clone(), cc.clone(),
                                               k_rope_scale=ks, c_kv_scale=cs, cache_mode=mode)
        rope_p = npu.npu_interleave_rope(x, c, c)
        npu.npu_apply_rotary_pos_emb(q, k, c.transpose(1, 2), c.transpose(1, 2))
    for a, b in zip(ours, theirs):
        if a.dtype == torch.int8:
            assert (a.int() - b.int()).abs().max() <= 1
        else:
            torch.testing.assert_close(a, b)
    torch.testing.assert_close(rope, rope_p)
    torch.testing.assert_close(q1, q)
    torch.testing.assert_close(k1, k)
