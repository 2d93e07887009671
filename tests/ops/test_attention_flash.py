"""npu_fusion_attention on CUDA through ATen's flash kernels (opennpu.ops.flash_route).

The fit rules are checked here on CPU tensors (with the device check patched); the kernels
themselves against the CPU kernel of the same op, wherever a GPU is visible
(bash scripts/gpu_check.sh)."""

import math

import pytest
import torch

import opennpu
from opennpu.ops import flash_route

npu = torch.ops.npu
BIG = 2147483647
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def cuda_capable(monkeypatch):
    monkeypatch.setattr(flash_route, "_available", lambda query: True)


def _qkv(layout, b=2, n=4, nkv=2, sq=8, skv=8, d=16, dtype=torch.float16, device="cpu"):
    shapes = {"BSH": ((b, sq, n * d), (b, skv, nkv * d)), "SBH": ((sq, b, n * d), (skv, b, nkv * d)),
              "BSND": ((b, sq, n, d), (b, skv, nkv, d)), "BNSD": ((b, n, sq, d), (b, nkv, skv, d)),
              "TND": ((b * sq, n, d), (b * skv, nkv, d))}[layout]
    q = torch.randn(shapes[0], dtype=dtype, device=device)
    k, v = (torch.randn(shapes[1], dtype=dtype, device=device) for _ in range(2))
    return q, k, v


def _plan(q, k, v, layout, n=4, **kw):
    return flash_route.plan(q, k, v, n, layout, **kw)


MASK = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_fitting_calls_are_planned(cuda_capable, layout):
    q, k, v = _qkv(layout)
    call = _plan(q, k, v, layout)
    assert (call.heads, call.kv_heads, call.head_dim, call.left, call.right) == (4, 2, 16, -1, -1)
    call = _plan(q, k, v, layout, atten_mask=MASK, sparse_mode=3)
    assert (call.left, call.right) == (-1, 0)
    call = _plan(q, k, v, layout, atten_mask=MASK, sparse_mode=4, pre_tokens=3, next_tokens=1)
    assert (call.left, call.right) == (3, 1)
    call = _plan(q, k, v, layout, atten_mask=MASK, sparse_mode=4, pre_tokens=BIG, next_tokens=0)
    assert (call.left, call.right) == (-1, 0)


@pytest.mark.parametrize("sq,skv", [(8, 8), (5, 12), (12, 5), (1, 9), (9, 1), (3, 3)])
@pytest.mark.parametrize("mode,pre,nxt", [(2, BIG, 0), (3, BIG, 0), (4, 2, 1), (4, 0, 0),
                                          (4, BIG, 3), (4, 3, BIG), (4, 1, 6), (4, 7, 4)])
def test_the_planned_window_shows_exactly_the_modes_keys(cuda_capable, sq, skv, mode, pre, nxt):
    """Flash's rule (bottom-right band; a side >= seqlen_k is unbounded) on the planned window
    gives the mask of sparse_mode; where no window is planned, the mode's own numbers as a
    window would show other keys (so the composition is needed)."""
    i, j, shift = torch.arange(sq)[:, None], torch.arange(skv), skv - sq

    def flash_visible(left, right):
        left, right = (-1 if w >= skv else w for w in (left, right))
        visible = torch.ones(sq, skv, dtype=torch.bool)
        if left >= 0:
            visible &= j >= i + shift - left
        if right >= 0:
            visible &= j <= i + shift + right
        return visible

    want = {2: j <= i, 3: j <= i + shift,
            4: (j <= i + shift + nxt) & (j >= i + shift - pre)}[mode].expand(sq, skv)
    window = flash_route._window(mode, True, sq, skv, pre, nxt)
    if window is not None:
        assert torch.equal(flash_visible(*window), want)
    else:
        naive = {2: (-1, -shift), 4: (pre, nxt)}[mode]
        assert min(naive) < -1 or not torch.equal(flash_visible(*naive), want)


@pytest.mark.parametrize("sq,skv", [(8, 8), (5, 12), (12, 5), (1, 9), (9, 1), (3, 3), (7, 2)])
@pytest.mark.parametrize("left,right", [(-1, -1), (-1, 0), (2, 1), (0, 0), (-1, 3), (3, -1), (1, 6)])
def test_rows_that_see_no_key_are_foreseen(sq, skv, left, right):
    """_may_see_no_key (which lets the statistics skip their +inf test) is True exactly where
    flash's band leaves a row without keys."""
    i, j, shift = torch.arange(sq)[:, None], torch.arange(skv), skv - sq
    visible = torch.ones(sq, skv, dtype=torch.bool)
    if left >= 0:
        visible &= j >= i + shift - left
    if right >= 0:
        visible &= j <= i + shift + right
    assert flash_route._may_see_no_key(right, [(sq, skv)]) == bool((~visible.any(1)).any())
    assert flash_route._may_see_no_key(right, [(sq, skv), (sq, sq + 8)]) == bool(
        (~visible.any(1)).any())


@pytest.mark.parametrize("see_no_key", [True, False])
def test_statistics_are_the_log_sum_exp_and_one(see_no_key):
    lse = torch.randn(2, 3, 5).transpose(1, 2)  # any strides
    if see_no_key:
        lse[0, 1, 2] = lse[1, 4, 0] = float("inf")  # rows without keys, as the kernels write them
    smax, ssum = flash_route._statistics(lse, see_no_key)
    assert smax.shape == ssum.shape == (2, 5, 3, 8) and smax.is_contiguous() and ssum.is_contiguous()
    dead = torch.isinf(lse)[..., None].expand(2, 5, 3, 8)
    want_max = lse[..., None].expand(2, 5, 3, 8).masked_fill(dead, float("-inf"))
    assert torch.equal(smax, want_max) and torch.equal(ssum, (~dead).float())
    assert torch.equal(flash_route._statistics(lse, see_no_key, width=1)[0], want_max[..., :1])


def test_top_left_causal_fits_only_where_it_is_bottom_right(cuda_capable):
    q, k, v = _qkv("BSND", sq=8, skv=8)
    assert (_plan(q, k, v, "BSND", atten_mask=MASK, sparse_mode=2).right) == 0
    q, k, v = _qkv("BSND", sq=8, skv=5)  # Skv < Sq: j <= i is the band (-1, 3) at bottom right
    assert (_plan(q, k, v, "BSND", atten_mask=MASK, sparse_mode=2).right) == 3
    q, k, v = _qkv("BSND", sq=5, skv=8)
    assert _plan(q, k, v, "BSND", atten_mask=MASK, sparse_mode=2) is None


@pytest.mark.parametrize("why", ["float32", "pse", "sink", "dropout", "mask content", "prefix",
                                 "head size 12", "head size 512", "empty", "value head size",
                                 "negative band", "heads not a multiple"])
def test_calls_that_do_not_fit_keep_the_composition(cuda_capable, why):
    layout, kw, q_kv = "BSND", {}, {}
    if why == "float32":
        q_kv = dict(dtype=torch.float32)
    elif why == "head size 12":
        q_kv = dict(d=12)
    elif why == "head size 512":
        q_kv = dict(d=512)
    elif why == "empty":
        q_kv = dict(sq=0)
    elif why == "heads not a multiple":
        q_kv = dict(nkv=3, n=4)
    q, k, v = _qkv(layout, **q_kv)
    if why == "pse":
        kw = dict(pse=torch.zeros(1, 4, 8, 8, dtype=q.dtype))
    elif why == "sink":
        kw = dict(sink=torch.zeros(4))
    elif why == "dropout":
        kw = dict(keep_prob=0.9)
    elif why == "mask content":
        kw = dict(atten_mask=torch.zeros(8, 8, dtype=torch.bool), sparse_mode=0)
    elif why == "prefix":
        kw = dict(atten_mask=MASK, sparse_mode=6)
    elif why == "negative band":
        kw = dict(atten_mask=MASK, sparse_mode=4, pre_tokens=2, next_tokens=-1)
    elif why == "value head size":
        v = v[..., :8]
    assert _plan(q, k, v, layout, **kw) is None


def test_tnd_needs_cumulative_lengths_that_cover_the_tensors(cuda_capable):
    q, k, v = _qkv("TND", b=3, sq=4, skv=4)
    call = _plan(q, k, v, "TND", actual_seq_qlen=[4, 8, 12], actual_seq_kvlen=[2, 8, 12],
                 atten_mask=MASK, sparse_mode=3)
    assert (call.cum_q, call.cum_kv, call.right) == ([4, 8, 12], [2, 8, 12], 0)
    assert _plan(q, k, v, "TND", actual_seq_qlen=[4, 8, 10], actual_seq_kvlen=[4, 8, 12]) is None
    # a sequence without queries is fine; one whose queries see no key is not
    assert _plan(q, k, v, "TND", actual_seq_qlen=[4, 4, 12], actual_seq_kvlen=[4, 8, 12]) is not None
    assert _plan(q, k, v, "TND", actual_seq_qlen=[4, 8, 12], actual_seq_kvlen=[4, 4, 12]) is None
    # top-left causal only where every sequence is square; split-varlen modes keep the composition
    assert _plan(q, k, v, "TND", actual_seq_qlen=[4, 8, 12], actual_seq_kvlen=[2, 8, 12],
                 atten_mask=MASK, sparse_mode=2) is None
    assert _plan(q, k, v, "TND", actual_seq_qlen=[4, 8, 12], actual_seq_kvlen=[4, 8, 12],
                 atten_mask=MASK, sparse_mode=2) is not None
    assert _plan(q, k, v, "TND", actual_seq_qlen=[4, 8, 12], actual_seq_kvlen=[4, 8, 12],
                 atten_mask=MASK, sparse_mode=7) is None


def test_cpu_tensors_never_take_the_route():
    q, k, v = _qkv("BSND")
    assert _plan(q, k, v, "BSND") is None


# ------------------------------------------------------------------------------------ on a GPU

CASES = [  # (layout, n, nkv, sq, skv, d, sparse_mode or None, pre, next)
    ("BSH", 4, 4, 33, 33, 64, None, BIG, BIG),
    ("SBH", 4, 2, 17, 40, 128, 3, BIG, 0),
    ("BSND", 8, 2, 64, 64, 128, 2, BIG, 0),
    ("BSND", 4, 1, 50, 20, 64, 3, BIG, 0),  # Sq > Skv: the first rows see no key
    ("BNSD", 4, 4, 128, 128, 128, 4, 16, 4),
    ("BNSD", 2, 2, 9, 300, 256, None, BIG, BIG),
]


def _stats_lse(smax, ssum):
    m, s = smax[..., 0].double(), ssum[..., 0].double()
    return torch.where(s > 0, m + torch.log(s), torch.full_like(m, -math.inf))


def _run_both(fn, *tensors):
    return fn(*[t.cuda() for t in tensors]), fn(*tensors)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_forward_and_backward_match_the_cpu_kernel(case, dtype):
    layout, n, nkv, sq, skv, d, mode, pre, nxt = case
    q, k, v = _qkv(layout, b=2, n=n, nkv=nkv, sq=sq, skv=skv, d=d, dtype=dtype)
    kw = dict(scale=d ** -0.5, pre_tockens=pre, next_tockens=nxt)
    if mode is not None:
        kw.update(atten_mask=MASK, sparse_mode=mode)
    assert flash_route.plan(q.cuda(), k.cuda(), v.cuda(), n, layout,
                            atten_mask=kw.get("atten_mask"), sparse_mode=mode or 0,
                            pre_tokens=pre, next_tokens=nxt) is not None

    def fwd(q, k, v):
        mask = kw.get("atten_mask")
        return npu.npu_fusion_attention(q, k, v, n, layout, **{**kw, "atten_mask": (
            mask.to(q.device) if mask is not None else None)})

    got, ref = _run_both(fwd, q, k, v)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(got[0].cpu(), ref[0], **tol)
    assert got[1].shape == ref[1].shape and got[2].shape == ref[2].shape
    torch.testing.assert_close(_stats_lse(got[1], got[2]).cpu(), _stats_lse(ref[1], ref[2]),
                               atol=1e-3, rtol=1e-4)

    dy = torch.randn_like(ref[0])

    def bwd(q, k, v, dy, out, smax, ssum):
        mask = kw.get("atten_mask")
        return npu.npu_fusion_attention_grad(
            q, k, v, dy, n, layout, atten_mask=mask.to(q.device) if mask is not None else None,
            softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=kw["scale"],
            pre_tockens=pre, next_tockens=nxt, sparse_mode=mode or 0)

    g_gpu = bwd(q.cuda(), k.cuda(), v.cuda(), dy.cuda(), *got[:3])
    g_cpu = bwd(q, k, v, dy, *ref[:3])
    for a, b in zip(g_gpu[:3], g_cpu[:3]):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a.cpu().float(), b.float(), atol=3e-2, rtol=3e-2)


@gpu
def test_tnd_varlen_causal_matches_the_cpu_kernel():
    n, d = 4, 64
    qlen, kvlen = [5, 17, 32], [5, 30, 32]
    q = torch.randn(32, n, d, dtype=torch.bfloat16)
    k, v = (torch.randn(32, 2, d, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(scale=0.125, atten_mask=MASK, sparse_mode=3, actual_seq_qlen=qlen,
              actual_seq_kvlen=kvlen)
    for layout in ("", "TND"):
        got, ref = _run_both(lambda q, k, v: npu.npu_fusion_attention(
            q, k, v, n, "TND", **{**kw, "atten_mask": MASK.to(q.device)}, softmax_layout=layout),
            q, k, v)
        torch.testing.assert_close(got[0].cpu(), ref[0], atol=1.6e-2, rtol=1.6e-2)
        torch.testing.assert_close(_stats_lse(got[1], got[2]).cpu(), _stats_lse(ref[1], ref[2]),
                                   atol=1e-3, rtol=1e-4)
        dy = torch.randn_like(ref[0])
        grads = [npu.npu_fusion_attention_grad(
            a.cuda() if dev else a, b.cuda() if dev else b, c.cuda() if dev else c,
            dy.cuda() if dev else dy, n, "TND", atten_mask=MASK.cuda() if dev else MASK,
            softmax_max=r[1], softmax_sum=r[2], attention_in=r[0], scale_value=0.125,
            sparse_mode=3, actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, softmax_layout=layout)
            for dev, r, (a, b, c) in ((True, got, (q, k, v)), (False, ref, (q, k, v)))]
        for a, b in zip(grads[0][:3], grads[1][:3]):
            torch.testing.assert_close(a.cpu().float(), b.float(), atol=3e-2, rtol=3e-2)


@gpu
def test_autograd_and_compile_on_cuda_use_the_route():
    q, k, v = (t.cuda().requires_grad_() for t in _qkv("BSND", sq=64, skv=64, d=64,
                                                      dtype=torch.bfloat16))

    def f(q, k, v):
        return opennpu.npu_fusion_attention(q, k, v, 4, "BSND", atten_mask=MASK.cuda(),
                                            sparse_mode=3, scale=0.125)[0]

    out = f(q, k, v)
    out.float().square().sum().backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, out, atol=1e-2, rtol=1e-2)
    compiled.float().square().sum().backward()
    for a, b in zip((q.grad, k.grad, v.grad), eager):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    # the same call without flash runs the composition, to the same result
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert flash_route.plan(q, k, v, 4, "BSND") is None
        torch.testing.assert_close(f(q, k, v), out, atol=1.6e-2, rtol=1.6e-2)
    finally:
        torch.backends.cuda.enable_flash_sdp(True)


@gpu
@pytest.mark.parametrize("cudnn", [True, False])
def test_the_kernel_sdpa_prefers_runs_and_matches(cudnn):
    q, k, v = _qkv("BSND", b=2, n=8, nkv=2, sq=256, skv=256, d=128, dtype=torch.bfloat16)
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        qc, kc, vc = q.cuda(), k.cuda(), v.cuda()
        call = flash_route.plan(qc, kc, vc, 8, "BSND", atten_mask=MASK, sparse_mode=3)
        expected, expected_bwd = ("cudnn" if flash_route._prefers_cudnn(call, qc, kc, vc, 0.1, training)
                                  else "flash" for training in (False, True))
        if not cudnn:
            assert expected == expected_bwd == "flash"
        got = npu.npu_fusion_attention(qc, kc, vc, 8, "BSND", atten_mask=MASK.cuda(),
                                       sparse_mode=3, scale=0.1)
        assert flash_route.last_kernel == expected
        ref = npu.npu_fusion_attention(q, k, v, 8, "BSND", atten_mask=MASK, sparse_mode=3,
                                       scale=0.1)
        torch.testing.assert_close(got[0].cpu(), ref[0], atol=1.6e-2, rtol=1.6e-2)
        dy = torch.randn_like(ref[0])
        def grad(dev, r):
            return npu.npu_fusion_attention_grad(
                *(t.to(dev) for t in (q, k, v, dy)), 8, "BSND", atten_mask=MASK.to(dev),
                softmax_max=r[1], softmax_sum=r[2], attention_in=r[0], scale_value=0.1,
                sparse_mode=3)

        flash_route.last_kernel = None
        grads = [grad("cuda", got)]
        assert flash_route.last_kernel == expected_bwd
        grads.append(grad("cpu", ref))
        for a, b in zip(grads[0][:3], grads[1][:3]):
            torch.testing.assert_close(a.cpu().float(), b.float(), atol=3e-2, rtol=3e-2)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)


# ------------------------------------------------------------- npu_fused_infer_attention_score

def _fia_args(layout="BSH", b=2, n=8, kvn=2, sq=1, skv=64, d=64, dtype=torch.float16, device="cpu"):
    shapes = {"BSH": ((b, sq, n * d), (b, skv, kvn * d)), "BSND": ((b, sq, n, d), (b, skv, kvn, d)),
              "BNSD": ((b, n, sq, d), (b, kvn, skv, d))}[layout]
    q = torch.randn(shapes[0], dtype=dtype, device=device)
    k, v = (torch.randn(shapes[1], dtype=dtype, device=device) for _ in range(2))
    return q, k, v


def _infer(q, k, v, lin="BSH", lout=None, n=8, kvn=2, mask=None, mode=0, pre=BIG, nxt=BIG,
           seq_q=None, seq_kv=None, unrouted=False):
    return flash_route.infer(q, k, v, num_heads=n, num_key_value_heads=kvn, lin=lin,
                             lout=lout or lin, scale=0.125, atten_mask=mask, sparse_mode=mode,
                             pre_tokens=pre, next_tokens=nxt, seq_q=seq_q, seq_kv=seq_kv,
                             lse_flag=True, unrouted=unrouted)


@pytest.fixture
def captured(cuda_capable, monkeypatch):
    seen = {}

    def attend(call, q, k, v, scale, used=None):
        seen.update(call=call, used=None if used is None else used.tolist())
        if call.cum_q is not None:  # varlen: [T, N, D] in, lse [N, T]
            return torch.zeros(*q.shape[:2], v.shape[-1], dtype=q.dtype), torch.zeros(
                q.shape[1], q.shape[0])
        return torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype), torch.zeros(
            q.shape[0], q.shape[2], q.shape[1])

    monkeypatch.setattr(flash_route, "_attend", attend)
    return seen


def test_infer_routes_decode_with_key_lengths(captured):
    q, k, v = _fia_args()
    out, lse = _infer(q, k, v, seq_kv=[5, 64], mode=3, mask=MASK)  # decode: every key visible
    assert out.shape == q.shape and lse.shape == (2, 8, 1, 1)
    assert captured["used"] == [5, 64]
    assert (captured["call"].left, captured["call"].right) == (-1, -1)
    assert (captured["call"].cum_q, captured["call"].cum_kv) == ([1, 2], [64, 128])
    assert _infer(q, k, v, seq_kv=[7]) is not None and captured["used"] == [7, 7]


def test_infer_routes_prefill_bands(captured):
    q, k, v = _fia_args("BNSD", sq=64, skv=64)
    _infer(q, k, v, lin="BNSD", lout="BSND", mode=3)
    assert (captured["call"].left, captured["call"].right) == (-1, 0)
    _infer(q, k, v, lin="BNSD", mode=4, pre=8, nxt=0)
    assert (captured["call"].left, captured["call"].right) == (8, 0)
    _infer(q, k, v, lin="BNSD", mode=2, seq_kv=None)
    assert (captured["call"].left, captured["call"].right) == (-1, 0)


@pytest.mark.parametrize("why", ["paged or pse", "mask content", "query lengths", "key length 0",
                                 "key lengths per batch wrong", "top-left with key lengths",
                                 "finite top-left band", "int8 cache", "TND"])
def test_infer_keeps_the_composition(captured, why):
    q, k, v = _fia_args("BSH", sq=16, skv=64)
    kw = {}
    if why == "paged or pse":
        kw = dict(unrouted=True)
    elif why == "mask content":
        kw = dict(mask=torch.zeros(16, 64, dtype=torch.bool))
    elif why == "query lengths":
        kw = dict(seq_q=[16, 9])
    elif why == "key length 0":
        kw = dict(seq_kv=[0, 64])
    elif why == "key lengths per batch wrong":
        kw = dict(seq_kv=[3, 4, 5])
    elif why == "top-left with key lengths":
        kw = dict(mode=2, seq_kv=[16, 16])
    elif why == "finite top-left band":
        kw = dict(pre=4)
    elif why == "int8 cache":
        k, v = (torch.randint(-8, 8, k.shape, dtype=torch.int8) for _ in range(2))
    elif why == "TND":
        kw = dict(lin="TND")
    assert _infer(q, k, v, **kw) is None


FIA_CASES = [  # (layout, sq, skv, sparse_mode, actual_seq_lengths_kv)
    ("BSH", 1, 300, 0, [17, 300]),
    ("BNSD", 1, 80, 0, [80, 33]),
    ("BSND", 24, 100, 3, [50, 100]),
    ("BNSD", 1, 128, 0, None),
    ("BSND", 64, 64, 3, None),
    ("BNSD_BSND", 40, 96, 3, [70, 96]),
    ("BSH", 32, 32, 0, None),
]


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", FIA_CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_infer_attention_matches_the_cpu_kernel(case, dtype, monkeypatch):
    # decode calls (sq = 1) run the CUDA decode kernel (test_infer_attention_cuda.py); with it
    # switched off they take the route tested here
    monkeypatch.setenv("OPENNPU_FIA_DECODE", "0")
    layout, sq, skv, mode, seq_kv = case
    lin = layout.split("_")[0]
    q, k, v = _fia_args(lin, sq=sq, skv=skv, dtype=dtype)
    kw = dict(num_heads=8, num_key_value_heads=2, input_layout=layout, scale=0.125,
              sparse_mode=mode, actual_seq_lengths_kv=seq_kv, softmax_lse_flag=True)

    def fia(q, k, v):
        return npu.npu_fused_infer_attention_score(
            q, k, v, atten_mask=MASK.to(q.device) if mode else None, **kw)

    flash_route.last_kernel = None
    got, ref = _run_both(fia, q, k, v)
    assert flash_route.last_kernel in ("flash", "cudnn")
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(got[0].cpu(), ref[0], **tol)
    torch.testing.assert_close(got[1].cpu(), ref[1], atol=1e-3, rtol=1e-4)
