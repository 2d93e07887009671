"""Shared helpers of the fusion attention tests (test_attention.py, the torch_npu contract, and
test_attention_cpu_tiles.py, the CPU kernel's tiles, blocks and knobs).

The oracle is opennpu.testing.reference.attention_reference in float64, with the complete
visibility mask built independently by reference.full_visibility_mask from the sparse-mode rules.
"""

from __future__ import annotations

import torch
from op_helpers import leaf_copies

import opennpu
from opennpu.testing import reference as R
from opennpu.testing.tolerances import assert_close

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
MAX = 2147483647
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")
# The compressed placeholders torch_npu passes for the modes that do not read the mask.
CAUSAL_2048 = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
PREFIX_3072 = torch.triu(torch.ones(3072, 2048, dtype=torch.bool), diagonal=1)
READS_MASK = (0, 1, 5)

fa = opennpu.npu_fusion_attention
fa_grad = opennpu.npu_fusion_attention_grad



def make_qkv(b, nq, nkv, sq, skv, d, dv=None, layout="BNSD", dtype=F32):
    """q, k, v in `layout`, made as BNSD tensors and converted."""
    bnsd = (torch.randn(b, nq, sq, d, dtype=dtype), torch.randn(b, nkv, skv, d, dtype=dtype),
            torch.randn(b, nkv, skv, dv or d, dtype=dtype))
    return [R.attention_from_bnsd(t, layout).contiguous() for t in bnsd]


def make_tnd(tq, tkv, nq, nkv, d, dv=None, dtype=F32):
    return [torch.randn(tq, nq, d, dtype=dtype), torch.randn(tkv, nkv, d, dtype=dtype),
            torch.randn(tkv, nkv, dv or d, dtype=dtype)]


def spans(ends):
    """[(start, length)] of torch_npu's cumulative ends (trailing zeros = unused batches)."""
    out, prev = [], 0
    for end in ends:
        if end < prev:
            out.append((prev, 0))
        else:
            out.append((prev, end - prev))
            prev = end
    return out


def dims(q, k, n, layout, qlen=None, kvlen=None):
    """(B, Sq, Skv) of a non-TND call, or the per-sequence lengths of a TND call."""
    if layout == "TND":
        return [s for _, s in spans(qlen)], [s for _, s in spans(kvlen)]
    b, s = {"BSH": (0, 1), "SBH": (1, 0), "BSND": (0, 1), "BNSD": (0, 2)}[layout]
    return q.shape[b], q.shape[s], k.shape[s]


def expected_numels(q, k, n, layout, qlen=None, kvlen=None):
    if layout == "TND":
        sq, skv = dims(q, k, n, layout, qlen, kvlen)
        return n * sum(a * b for a, b in zip(sq, skv))
    b, sq, skv = dims(q, k, n, layout)
    return b * n * sq * skv


def mask_for(mode, user_mask):
    """The atten_mask tensor torch_npu users pass for `mode`: the real mask where it is read,
    the compressed placeholder otherwise."""
    if mode in READS_MASK:
        return user_mask
    return PREFIX_3072 if mode == 6 else CAUSAL_2048


def tnd_full_masks(mode, qlen, kvlen, user_mask=None, pre=MAX, nxt=MAX, prefix=None):
    """Per-sequence [1, sq, skv] masks of a TND call; modes 7/8 are modes 3/2 except the last /
    first non-empty sequence, which is mode 4."""
    sp_q, sp_k = spans(qlen), spans(kvlen)
    nonempty = [i for i, (_, s) in enumerate(sp_q) if s > 0]
    masks = []
    for i, ((_, sq), (_, skv)) in enumerate(zip(sp_q, sp_k)):
        m = mode
        if mode == 7:
            m = 4 if i == nonempty[-1] else 3
        elif mode == 8:
            m = 4 if i == nonempty[0] else 2
        um = user_mask[:sq, :skv] if user_mask is not None else None
        pf = [prefix[i]] if prefix is not None else None
        masks.append(R.full_visibility_mask(m, sq, skv, 1, 1, um, pre, nxt, pf)[0])
    return masks


def unpack_bits(mask, numels):
    """Bit k (little-endian within each byte) of a _npu_dropout_gen_mask tensor, as 0/1 int64."""
    bits = (mask.long()[:, None] >> torch.arange(8)) & 1
    return bits.flatten()[:numels]


def tnd_keep_from_bits(bits, n, qlen, kvlen):
    """Per-sequence [n, sq, skv] keep masks: sequences one after another, each (n, i, j)."""
    out, pos = [], 0
    for (_, sq), (_, skv) in zip(spans(qlen), spans(kvlen)):
        count = n * sq * skv
        out.append(bits[pos:pos + count].view(n, sq, skv))
        pos += count
    return out


def stats_expected(ref_stat, layout, softmax_layout=""):
    """The reference's [B, N, Sq] (TND: token-major [T, N]) statistic in the op's storage,
    replicated 8 times: TND with softmax_layout "" stores [N, T, 8] memory viewed as [T, N, 8]."""
    if layout == "TND" and softmax_layout == "":
        t, n = ref_stat.shape
        ref_stat = ref_stat.t().contiguous().view(t, n)
    return ref_stat.unsqueeze(-1).expand(*ref_stat.shape, 8)


def check_stats(smax, ssum, ref_max, ref_sum, layout, softmax_layout="", scale=4.0, dtype=F32):
    """The statistics are float32 (float64 for float64 inputs, an opennpu extension)."""
    stats_dtype = F64 if dtype == F64 else F32
    for name, got, ref in (("softmax_max", smax, ref_max), ("softmax_sum", ssum, ref_sum)):
        want = stats_expected(ref, layout, softmax_layout)
        assert got.dtype == stats_dtype, f"{name}: dtype {got.dtype}"
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
        assert torch.equal(got, got[..., :1].expand_as(got)), f"{name}: the 8 copies differ"
        assert_close(got, want, dtype=F32, scale=scale, msg=name)


def check_attention(q, k, v, n, layout, *, mask_full=None, keep=None, grads=True, out_scale=1.0,
                    grad_scale=4.0, stats_scale=4.0, pse=None, sink=None, **kw):
    """npu_fusion_attention(q, k, v, n, layout, pse=pse, sink=sink, **kw) against the float64
    reference: attention_out, softmax_max / softmax_sum (8 copies), the 7-tuple's other entries
    and (grads=True) the autograd gradients of q, k, v (and pse, sink). `mask_full` is the
    reference's complete visibility mask; `keep` its dropout keep mask. Returns the op's tuple."""
    inputs = [t for t in (q, k, v, pse, sink) if t is not None]
    leaves = [t.detach().clone().requires_grad_(grads) for t in inputs]
    lq, lk, lv = leaves[:3]
    lpse = leaves[3] if pse is not None else None
    lsink = leaves[-1] if sink is not None else None
    res = fa(lq, lk, lv, n, layout, pse=lpse, sink=lsink, **kw)
    assert isinstance(res, tuple) and len(res) == 7
    out, smax, ssum, sout, seed, offset, numels = res

    ref_leaves = leaf_copies(leaves, F64)
    rq, rk, rv = ref_leaves[:3]
    ref_out, ref_max, ref_sum = R.attention_reference(
        rq, rk, rv, n, layout, pse=ref_leaves[3] if pse is not None else None,
        sink=ref_leaves[-1] if sink is not None else None, mask_full=mask_full,
        scale=kw.get("scale", 1.0), keep=keep, keep_prob=kw.get("keep_prob", 1.0),
        actual_seq_qlen=kw.get("actual_seq_qlen"), actual_seq_kvlen=kw.get("actual_seq_kvlen"))

    assert out.dtype == q.dtype and out.shape == ref_out.shape, (out.dtype, out.shape)
    assert not out.isnan().any(), "NaN in attention_out"
    assert_close(out, ref_out, scale=out_scale, msg="attention_out")
    check_stats(smax, ssum, ref_max, ref_sum, layout, kw.get("softmax_layout", ""), stats_scale,
                dtype=q.dtype)
    assert sout.shape == (0,)
    assert all(type(x) is int for x in (seed, offset, numels))
    assert numels == expected_numels(q, k, n, layout, kw.get("actual_seq_qlen"),
                                     kw.get("actual_seq_kvlen"))
    if grads:
        dy = torch.randn_like(out)
        ours = torch.autograd.grad(out, leaves, dy)
        want = (torch.autograd.grad(ref_out, ref_leaves, dy.double(), allow_unused=True)
                if ref_out.requires_grad else [None] * len(leaves))  # no token is attended
        names = ["dq", "dk", "dv"] + (["dpse"] if pse is not None else []) + (
            ["dsink"] if sink is not None else [])
        for name, g, w, t in zip(names, ours, want, inputs):
            assert g.shape == t.shape and g.dtype == t.dtype, (name, g.shape, g.dtype)
            assert not g.isnan().any(), f"{name}: NaN"
            w = torch.zeros_like(g, dtype=F64) if w is None else w
            assert_close(g, w, dtype=q.dtype, scale=grad_scale, msg=name)
    return res


def gen_keep(q, numels, keep_prob, seed, offset):
    mask = opennpu._npu_dropout_gen_mask(q, [numels], 1 - keep_prob, seed, offset)
    return unpack_bits(mask, numels)
