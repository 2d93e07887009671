"""npu_top_k_top_p and npu_top_k_top_p_sample against references written from op-plugin's goldens
(test_npu_top_k_top_p.py: a sort-based composition; test_top_k_top_p_sample.py: a loop over rows),
their edge cases, the npu device, the portable path, opcheck, compile and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch._dynamo.testing

import opennpu  # noqa: F401
import torch_npu
from op_helpers import dtype_id, opcheck

npu = torch.ops.npu
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INF = math.inf


# ---------------------------------------------------------------------------------------------
# references

def ref_top_k_top_p(logits, p=None, k=None):
    """The golden: stable ascending sort; below the k-th largest -> -inf; then the entries whose
    float32 softmax mass summed from the smallest is <= 1 - p (in p's dtype) -> -inf, the
    largest kept; scattered back."""
    vals, order = logits.sort(dim=-1, stable=True)
    vals = vals.clone()
    if k is not None:
        kth = vals.gather(1, (vals.size(1) - k.long()).unsqueeze(1))
        vals[vals < kth] = -INF
    if p is not None:
        mass = vals.float().softmax(-1).cumsum(-1)
        drop = mass <= (1 - p).unsqueeze(1)
        drop[:, -1] = False
        vals[drop] = -INF
    return torch.empty_like(vals).scatter_(1, order, vals)


def ref_sample(logits, top_k, top_p, q=None, eps=1e-8, is_need_logits=False, min_ps=None,
               ks_max=1024, input_is_logits=True, post_sample="qSample", draws=None):
    """op-plugin's sample golden as a loop over rows (draws: the Exp(1) matrix of multiNomial)."""
    rows, vocab = logits.shape
    k_max = min(-(-ks_max // 8) * 8, 1024)
    fill = -INF if input_is_logits else 0.0
    index = torch.zeros(rows, dtype=torch.long)
    kept = torch.full((rows, vocab), fill) if is_need_logits else torch.empty(0)
    for b in range(rows):
        x = logits[b].float()
        k, p = int(top_k.reshape(-1)[b]), float(top_p.reshape(-1)[b])
        mp = float(min_ps.reshape(-1)[b]) if min_ps is not None else -1.0
        use_k, use_p = 1 <= k <= min(k_max, vocab), p < 1
        if not use_k and not use_p and mp < 1:
            idx = torch.arange(vocab)
            prob = x.softmax(0) if input_is_logits else x
        else:
            vals, idx = x.sort(descending=True, stable=True)
            if use_k:
                vals, idx = vals[:k], idx[:k]
            prob = vals.softmax(0) if input_is_logits else vals
            if use_p:
                if p > 0:
                    sel = ~((prob.cumsum(0) - prob) >= p)
                else:
                    sel = torch.arange(len(idx)) == 0
                    if input_is_logits:
                        prob = torch.where(sel, 1.0, prob)
                idx, prob = idx[sel], prob[sel]
        if mp >= 1:
            idx, prob = idx[:1], prob[:1]
        elif mp > 0:
            sel = prob >= prob.max() * mp
            idx, prob = idx[sel], prob[sel]
        n = len(idx)
        if post_sample == "qSample" and q is not None:
            score = prob / (q[b, :n].abs() + eps)
        elif post_sample == "multiNomial":
            score = prob / draws[b, :n]
        else:
            score = prob
        index[b] = idx[score.argmax()]
        if is_need_logits:
            kept[b, idx] = x[idx]
    return index, kept


def logits_of(rows, vocab, dtype, seed=0, lo=-5.0, hi=5.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, vocab, generator=g) * (hi - lo) + lo).to(dtype)


# ---------------------------------------------------------------------------------------------
# npu_top_k_top_p

SHAPES = [(1, 7), (4, 83), (3, 769), (2, 5125), (2, 32000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("mode", ["kp", "k", "p"])
def test_top_k_top_p_matches_reference(dtype, shape, mode):
    rows, vocab = shape
    x = logits_of(rows, vocab, dtype, seed=vocab)
    g = torch.Generator().manual_seed(1)
    p = torch.rand(rows, generator=g).to(dtype) if "p" in mode else None
    k = torch.randint(1, min(vocab, 1024) + 1, (rows,), generator=g,
                      dtype=torch.int32) if "k" in mode else None
    out = torch_npu.npu_top_k_top_p(x, p, k)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, ref_top_k_top_p(x, p, k))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_top_k_top_p_per_row_parameters_and_edges(dtype):
    vocab = 300
    x = logits_of(6, vocab, dtype, seed=3)
    x[5, :] = 0.5  # a row of ties
    p = torch.tensor([1.0, 0.0, 0.5, 0.9, 0.3, 0.6], dtype=dtype)
    k = torch.tensor([vocab, 1, 7, 1024 % vocab, vocab, 3], dtype=torch.int64)
    out = opennpu.npu_top_k_top_p(x, p=p, k=k)
    assert torch.equal(out, ref_top_k_top_p(x, p, k))
    finite = torch.isfinite(out).sum(1)
    assert finite[0] == vocab  # k = V and p = 1 keep everything
    assert finite[1] == 1 and out[1].argmax() == x[1].float().argmax()  # p = 0: the largest only
    # ties: top-k keeps every value equal to the 3rd largest (all 300); top-p then drops the
    # lower indices first (they come first in the stable ascending sum)
    kept = torch.isfinite(out[5]).nonzero().flatten()
    assert 3 < len(kept) < vocab and torch.equal(kept, torch.arange(vocab - len(kept), vocab))


def test_top_k_top_p_ties_follow_the_stable_sort():
    x = torch.ones(1, 4)
    # top-k keeps every value tied with the k-th largest
    assert torch.isfinite(npu.npu_top_k_top_p(x, None, torch.tensor([2]))).all()
    # top-p: ascending stable order 0, 1, 2, 3; running mass .25 .5 .75 1 <= 0.5 drops 0 and 1
    out = npu.npu_top_k_top_p(x, torch.tensor([0.5]), None)
    assert torch.equal(out, torch.tensor([[-INF, -INF, 1.0, 1.0]]))


def test_top_k_top_p_p_one_drops_only_zero_probability():
    x = torch.tensor([[0.0, -INF, 1.0, -200.0, 2.0]])
    out = npu.npu_top_k_top_p(x, torch.tensor([1.0]), None)
    assert torch.equal(out, ref_top_k_top_p(x, torch.tensor([1.0]), None))
    assert torch.equal(torch.isfinite(out), torch.tensor([[True, False, True, False, True]]))


def test_top_k_top_p_without_filters_is_a_copy():
    x = torch.randn(3, 50)
    out = npu.npu_top_k_top_p(x)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_top_k_top_p_large_nucleus_grows_the_sorted_set():
    # flat logits over 20000 entries: top-p 0.95 keeps most of them (beyond the first guess)
    x = logits_of(2, 20000, torch.float32, seed=5, lo=-0.5, hi=0.5)
    p = torch.tensor([0.95, 0.999])
    out = npu.npu_top_k_top_p(x, p, None)
    assert torch.equal(out, ref_top_k_top_p(x, p, None))
    assert torch.isfinite(out).sum() > 30000


@pytest.mark.parametrize("shape", [(0, 50), (3, 0)], ids=str)
def test_top_k_top_p_empty(shape):
    x = torch.randn(shape)
    p = torch.rand(shape[0])
    assert npu.npu_top_k_top_p(x, p, None).shape == shape


def test_top_k_top_p_non_contiguous():
    x = logits_of(40, 9, torch.bfloat16, seed=7).t()  # [9, 40], strided
    p = torch.rand(18).to(torch.bfloat16)[::2]
    k = torch.randint(1, 40, (9, 2), dtype=torch.int32)[:, 1]
    assert not x.is_contiguous() and not p.is_contiguous() and not k.is_contiguous()
    assert torch.equal(npu.npu_top_k_top_p(x, p, k), ref_top_k_top_p(x.contiguous(), p, k))


def test_top_k_top_p_on_the_npu_device():
    x, p = logits_of(4, 500, torch.float16, seed=2), torch.rand(4).half()
    k = torch.tensor([5, 50, 500, 1], dtype=torch.int32)
    out = torch_npu.npu_top_k_top_p(x.npu(), p.npu(), k.npu())
    assert out.device.type == "npu"
    assert torch.equal(out.cpu(), ref_top_k_top_p(x, p, k))


@pytest.mark.parametrize("args,message", [
    ((torch.randn(8),), "argument 'logits' must be 2-D"),
    ((torch.randn(2, 8).double(),), "argument 'logits' must be float32, float16 or bfloat16"),
    ((torch.randn(2, 8), torch.rand(3)), "argument 'p' must have shape [2]"),
    ((torch.randn(2, 8), torch.ones(2, dtype=torch.int32)), "argument 'p' must be float32"),
    ((torch.randn(2, 8), None, torch.ones(2)), "argument 'k' must be int32 or int64"),
    ((torch.randn(2, 8), None, torch.tensor([1, 0])), "argument 'k' must hold values in [1"),
    ((torch.randn(2, 8), None, torch.tensor([9, 1])), "row 0 has 9"),
])
def test_top_k_top_p_bad_inputs(args, message):
    with pytest.raises(RuntimeError, match="npu_top_k_top_p: ") as error:
        npu.npu_top_k_top_p(*args)
    assert message in str(error.value)


def test_top_k_top_p_strict_mode():
    x = torch.randn(2, 2000)
    with opennpu.strict():
        with pytest.raises(RuntimeError, match="'p' must have the dtype of 'logits'.*strict"):
            npu.npu_top_k_top_p(x, torch.rand(2).half(), None)
        with pytest.raises(RuntimeError, match="'k' must hold values <= 1024.*strict"):
            npu.npu_top_k_top_p(x, None, torch.tensor([5, 1500], dtype=torch.int32))
    npu.npu_top_k_top_p(x, None, torch.tensor([5, 1500], dtype=torch.int32))  # not strict: fine


def test_top_k_top_p_is_not_differentiable():
    x = torch.randn(2, 9, requires_grad=True)
    out = opennpu.npu_top_k_top_p(x, torch.rand(2), None)
    with pytest.raises(RuntimeError, match="npu_top_k_top_p: not differentiable"):
        out.sum().backward()


# ---------------------------------------------------------------------------------------------
# npu_top_k_top_p_sample

def sample_inputs(rows, vocab, dtype, use_k, use_p, use_min_p, input_is_logits, seed=0):
    g = torch.Generator().manual_seed(seed)
    hi = 10.0 if input_is_logits else 1.0
    x = (torch.rand(rows, vocab, generator=g) * hi).to(dtype)
    k = torch.randint(1, min(vocab, 1024), (rows,), generator=g) if use_k else \
        torch.randint(1025, max(vocab, 2048), (rows,), generator=g)
    p = torch.rand(rows, generator=g).to(dtype) if use_p else torch.ones(rows, dtype=dtype)
    min_p = torch.rand(rows, generator=g).to(dtype) if use_min_p else None
    q = torch.rand(rows, vocab, generator=g)
    return x, k.int(), p, q, min_p


FLAGS = [(k, p, m) for k in (0, 1) for p in (0, 1) for m in (0, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "k%d-p%d-minp%d" % f)
@pytest.mark.parametrize("input_is_logits", [True, False])
@pytest.mark.parametrize("post", ["qSample", "None", "multiNomial"])
def test_sample_matches_reference(dtype, flags, input_is_logits, post):
    x, k, p, q, min_p = sample_inputs(7, 300, dtype, *flags, input_is_logits,
                                      seed=sum(flags) + 3 * input_is_logits)
    kwargs = dict(is_need_logits=True, min_ps=min_p, input_is_logits=input_is_logits,
                  post_sample=post)
    draws = None
    if post == "multiNomial":
        kwargs["generator"] = torch.Generator().manual_seed(11)
        draws = torch.empty(7, 300).exponential_(generator=torch.Generator().manual_seed(11))
    else:
        kwargs["q"] = q if post == "qSample" else None
    index, kept = torch_npu.npu_top_k_top_p_sample(x, k, p, **kwargs)
    kwargs.pop("generator", None)
    ref_index, ref_kept = ref_sample(x, k, p, draws=draws, **kwargs)
    assert index.dtype == torch.int64 and kept.dtype == torch.float32
    assert torch.equal(index, ref_index)
    assert torch.equal(kept, ref_kept)


def test_sample_top_p_without_top_k_grows_past_the_guess():
    x, k, p, q, _ = sample_inputs(5, 6000, torch.float32, 0, 1, 0, True, seed=9)
    x = x * 0.2  # a flat distribution: the nucleus is far larger than top_k_guess
    for guess in (4, 32, 0, -1):
        index, kept = npu.npu_top_k_top_p_sample(x, k, p, q, is_need_logits=True,
                                                 top_k_guess=guess)
        ref_index, ref_kept = ref_sample(x, k, p, q, is_need_logits=True)
        assert torch.equal(index, ref_index) and torch.equal(kept, ref_kept), guess


def test_sample_edges():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
    k = torch.tensor([2, 9, 3], dtype=torch.int32)  # 9 > vocab: top-k skipped
    p = torch.tensor([0.0, 1.0, 0.5])  # 0: the largest alone; 1: skipped
    q = torch.ones(3, 4)
    index, kept = npu.npu_top_k_top_p_sample(x, k, p, q, is_need_logits=True)
    # row 0: ties 3.0 at 1 and 2, the lower index first; row 1: no filter, argmax
    assert index.tolist() == [1, 3, 0]
    assert torch.isfinite(kept).sum(1).tolist() == [1, 4, 2]
    # ks_max bounds top-k: k = 2 > ks_max = 1 (rounded up to 8, so k = 9 stays skipped too)
    index, kept = npu.npu_top_k_top_p_sample(x, torch.tensor([9, 9, 9]), torch.ones(3), q,
                                             is_need_logits=True, ks_max=1)
    assert torch.isfinite(kept).all()
    # min_p >= 1 keeps one token
    _, kept = npu.npu_top_k_top_p_sample(x, k, torch.ones(3), None, is_need_logits=True,
                                         min_ps=torch.ones(3))
    assert torch.isfinite(kept).sum(1).tolist() == [1, 1, 1]


def test_sample_outputs_without_logits_and_empty_batch():
    x, k, p, q, _ = sample_inputs(3, 50, torch.float16, 1, 1, 0, True)
    index, kept = npu.npu_top_k_top_p_sample(x, k, p, q)
    assert index.shape == (3,) and kept.shape == (0,) and kept.dtype == torch.float32
    index, kept = npu.npu_top_k_top_p_sample(x[:0], k[:0], p[:0], q[:0], is_need_logits=True)
    assert index.shape == (0,) and kept.shape == (0, 50)
    # [batch, 1] per-row tensors, as the docs allow for skipped stages
    index2, _ = npu.npu_top_k_top_p_sample(x, k[:, None], p[:, None], q)
    assert torch.equal(index2, npu.npu_top_k_top_p_sample(x, k, p, q)[0])


def test_sample_non_contiguous():
    x, k, p, q, m = sample_inputs(6, 200, torch.bfloat16, 1, 1, 1, True, seed=4)
    xs, qs = x.t().contiguous().t(), q.t().contiguous().t()
    ks, ps, ms = (torch.stack([t, t], 1)[:, 1] for t in (k, p, m))
    assert not xs.is_contiguous() and not ks.is_contiguous()
    got = npu.npu_top_k_top_p_sample(xs, ks, ps, qs, min_ps=ms, is_need_logits=True)
    want = npu.npu_top_k_top_p_sample(x, k, p, q, min_ps=m, is_need_logits=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_sample_multinomial_is_reproducible_and_matches_torch_multinomial():
    x, k, p, _, _ = sample_inputs(8, 400, torch.float32, 1, 1, 0, True, seed=6)
    runs = [npu.npu_top_k_top_p_sample(x, k, p, post_sample="multiNomial",
                                       generator=torch.Generator().manual_seed(s))[0]
            for s in (5, 5, 6)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    # the golden: torch.multinomial over the kept probabilities, packed to the left
    rows = []
    for b in range(8):
        vals, idx = x[b].sort(descending=True, stable=True)
        prob = vals[:k[b]].softmax(0)
        keep = ~((prob.cumsum(0) - prob) >= p[b])
        rows.append((idx[:k[b]][keep], prob[keep]))
    packed = torch.zeros(8, 400)
    for b, (_, prob) in enumerate(rows):
        packed[b, :len(prob)] = prob
    pick = torch.multinomial(packed, 1, True, generator=torch.Generator().manual_seed(5))
    assert runs[0].tolist() == [rows[b][0][pick[b, 0]].item() for b in range(8)]
    # the default generator is used without one
    torch.manual_seed(3)
    a = npu.npu_top_k_top_p_sample(x, k, p, post_sample="multiNomial")[0]
    torch.manual_seed(3)
    assert torch.equal(a, npu.npu_top_k_top_p_sample(x, k, p, post_sample="multiNomial")[0])


def test_sample_exponential_race_follows_the_distribution():
    # qSample with q ~ Exp(1) samples from the kept probabilities
    x = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).expand(4000, 3).contiguous()
    q = torch.empty(4000, 3).exponential_(generator=torch.Generator().manual_seed(0))
    index, _ = npu.npu_top_k_top_p_sample(x, torch.full((4000,), 3), torch.ones(4000), q)
    freq = torch.bincount(index, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.03), freq


def test_sample_on_the_npu_device():
    x, k, p, q, m = sample_inputs(5, 120, torch.float16, 1, 1, 1, True, seed=8)
    got = torch_npu.npu_top_k_top_p_sample(x.npu(), k.npu(), p.npu(), q.npu(), min_ps=m.npu(),
                                           is_need_logits=True)
    assert got[0].device.type == "npu"
    want = ref_sample(x, k, p, q, min_ps=m, is_need_logits=True)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])


@pytest.mark.parametrize("kwargs,message", [
    (dict(post_sample="gumbel"), "argument 'post_sample' must be 'qSample', 'multiNomial' or"),
    (dict(q=torch.rand(3, 7)), "argument 'q' must have the shape of 'logits'"),
    (dict(q=torch.rand(3, 8).double()), "argument 'q' must be float32"),
    (dict(q=torch.zeros(3, 2, dtype=torch.int64), post_sample="multiNomial"),
     "argument 'q' must be None for post_sample='multiNomial'"),
    (dict(ks_max=0), "argument 'ks_max' must be a positive integer"),
    (dict(min_ps=torch.rand(2)), "argument 'min_ps' must have shape [3]"),
    (dict(top_k=torch.ones(3)), "argument 'top_k' must be int32 or int64"),
    (dict(top_p=torch.ones(4)), "argument 'top_p' must have shape [3]"),
    (dict(logits=torch.rand(3, 8, 1)), "argument 'logits' must be 2-D"),
])
def test_sample_bad_inputs(kwargs, message):
    args = dict(logits=torch.rand(3, 8), top_k=torch.ones(3, dtype=torch.int32),
                top_p=torch.ones(3))
    for name in ("logits", "top_k", "top_p"):
        if name in kwargs:
            args[name] = kwargs.pop(name)
    with pytest.raises(RuntimeError, match="npu_top_k_top_p_sample: ") as error:
        npu.npu_top_k_top_p_sample(args["logits"], args["top_k"], args["top_p"], **kwargs)
    assert message in str(error.value)


# ---------------------------------------------------------------------------------------------
# both: opcheck, compile, portable path

def test_opcheck():
    x, k, p, q, m = sample_inputs(4, 64, torch.float32, 1, 1, 1, True)
    opcheck(npu.npu_top_k_top_p.default, [((x, p, k), {}), ((x, None, k), {}),
                                          ((x.half(), p.half(), None), {})])
    opcheck(npu.npu_top_k_top_p_sample.default, [
        ((x, k, p), dict(q=q, min_ps=m, is_need_logits=True)),
        ((x.bfloat16(), k, p.bfloat16()), dict(post_sample="None")),
    ])


def test_compiles_without_graph_breaks():
    def step(x, p, k, q):
        filtered = torch_npu.npu_top_k_top_p(x, p, k)
        probs = filtered.float().softmax(-1)
        index, kept = torch_npu.npu_top_k_top_p_sample(x, k, p, q, is_need_logits=True)
        return probs, index, kept

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for rows, vocab in ((3, 100), (5, 130)):
        x, k, p, q, _ = sample_inputs(rows, vocab, torch.float32, 1, 1, 0, True, seed=rows)
        for c, e in zip(compiled(x, p, k, q), step(x, p, k, q)):
            assert torch.equal(c, e)
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_portable_path_matches_the_kernels():
    """The ATen compositions (CUDA / XPU / MPS path), forced onto CPU, against the C++ kernels."""
    from opennpu.ops import portable

    for dtype in DTYPES:
        x, k, p, q, m = sample_inputs(6, 700, dtype, 1, 1, 1, True, seed=2)
        calls = [(npu.npu_top_k_top_p, (x, p, k), {}), (npu.npu_top_k_top_p, (x, None, k), {}),
                 (npu.npu_top_k_top_p, (x, p, None), {})]
        for flags in FLAGS:
            for logits_in in (True, False):
                x2, k2, p2, q2, m2 = sample_inputs(6, 300, dtype, *flags, logits_in, seed=5)
                for post, qq in (("qSample", q2), ("None", None)):
                    calls.append((npu.npu_top_k_top_p_sample, (x2, k2, p2), dict(
                        q=qq, min_ps=m2, is_need_logits=True, input_is_logits=logits_in,
                        post_sample=post)))
        for op, args, kwargs in calls:
            want = op(*args, **kwargs)
            with portable.force():
                got = op(*args, **kwargs)
            for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want))):
                assert torch.equal(a, b), (op, dtype, kwargs)
    x, k, p, _, _ = sample_inputs(6, 300, torch.float32, 1, 1, 0, True, seed=1)
    want = npu.npu_top_k_top_p_sample(x, k, p, post_sample="multiNomial",
                                      generator=torch.Generator().manual_seed(2))
    with portable.force():
        got = npu.npu_top_k_top_p_sample(x, k, p, post_sample="multiNomial",
                                         generator=torch.Generator().manual_seed(2))
    assert torch.equal(got[0], want[0])
