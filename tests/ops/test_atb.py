"""torch_npu's ATB ops (torch.ops.atb): _npu_reshape_and_cache(_siso), _npu_paged_attention
(+ _get_workspace), _npu_flash_attention, _npu_rotary_embedding, npu_paged_cache_load(.out),
against loop references written from op-plugin's goldens (test_atb_reshape_and_cache*.py,
test_atb_paged_attention.py, test_atb_flash_attention.py, test_atb_rope.py,
test_atb_paged_cache_load.py), computed in float64."""

from __future__ import annotations

import pytest
import torch

import opennpu  # noqa: F401
import torch_npu
from op_helpers import dtype_id, opcheck
from opennpu.ops import atb as atb_wrappers
from opennpu.testing.tolerances import assert_close

atb = torch.ops.atb
HALF = (torch.float16, torch.bfloat16, torch.float32)


# ---------------------------------------------------------------------------------------------
# references (float64, loops as op-plugin's goldens)

def ref_reshape_and_cache(tok, cache, slots):
    out = cache.clone()
    block_size = cache.shape[1]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[s // block_size, s % block_size] = tok[t].reshape(out.shape[2:])
    return out


def ref_paged_attention(query, key_cache, value_cache, kv_heads, heads, scale, table, lens):
    T, N, _ = query.shape
    block_size = key_cache.shape[1]
    out = torch.zeros(T, N, value_cache.shape[-1], dtype=torch.float64)
    g = heads // kv_heads
    for t, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        ks = torch.stack([key_cache[table[t, j // block_size], j % block_size] for j in range(n)])
        vs = torch.stack([value_cache[table[t, j // block_size], j % block_size] for j in range(n)])
        for h in range(N):
            q = query[t, h].double()
            s = (ks[:, h // g].double() @ q) * scale
            p = torch.softmax(s, 0)
            out[t, h] = p @ vs[:, h // g].double()
    return out


def ref_flash_attention(q, k, v, mask, seq_len, scale, heads, kv_heads):
    T = q.shape[0]
    out = torch.zeros(T, heads, v.shape[-1], dtype=torch.float64)
    g = heads // kv_heads
    start = 0
    for b, n in enumerate(seq_len.tolist()):
        m = mask.double()
        if m.dim() >= 3:
            m = m[b if m.shape[0] > 1 else 0]
        for h in range(heads):
            mh = m[h if m.dim() == 3 and m.shape[0] > 1 else 0] if m.dim() == 3 else m
            qs = q[start:start + n, h].double()
            ks = k[start:start + n, h // g].double()
            vs = v[start:start + n, h // g].double()
            s = qs @ ks.T * scale + mh[:n, :n]
            out[start:start + n, h] = torch.softmax(s, -1) @ vs
        start += n
    return out


def ref_rope(positions, x, head_size, cache, neox):
    rot = cache.shape[-1]
    cs = cache.double()[positions.reshape(-1).long()]
    cos, sin = cs[:, : rot // 2].unsqueeze(1), cs[:, rot // 2:].unsqueeze(1)
    h = x.double().reshape(cs.shape[0], -1, head_size).clone()
    r = h[..., :rot]
    if neox:
        x1, x2 = r[..., : rot // 2], r[..., rot // 2:]
        new = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    else:
        x1, x2 = r[..., ::2], r[..., 1::2]
        new = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
    h[..., :rot] = new
    return h.reshape(x.shape)


def ref_cache_load(cache, table, lens, starts, cumsum):
    lens = lens.tolist()
    if cumsum:
        lens = [b - a for a, b in zip(lens, lens[1:])]
    bs = cache.shape[1]
    rows = []
    for b, n in enumerate(lens):
        s = 0 if starts is None else int(starts[b]) // bs
        rows += [cache[table[b, s + j // bs], j % bs] for j in range(n)]
    return torch.stack(rows) if rows else cache.new_zeros(0, *cache.shape[2:])


def paged_inputs(T=3, N=4, KVN=2, D=16, Dv=8, blocks=9, bs=4, max_blocks=3, dtype=torch.float16,
                 lens=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, N, D, generator=g).to(dtype)
    kc = torch.randn(blocks, bs, KVN, D, generator=g).to(dtype)
    vc = torch.randn(blocks, bs, KVN, Dv, generator=g).to(dtype)
    table = torch.stack([torch.randperm(blocks, generator=g)[:max_blocks] for _ in range(T)])
    table = table.to(torch.int32)
    if lens is None:
        lens = torch.randint(1, max_blocks * bs + 1, (T,), generator=g)
    return q, kc, vc, table, torch.as_tensor(lens, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------
# torch_npu names

def test_torch_npu_exposes_the_atb_packets():
    for name in ("_npu_reshape_and_cache", "_npu_reshape_and_cache_siso", "_npu_paged_attention",
                 "_npu_paged_attention_get_workspace", "_npu_flash_attention",
                 "_npu_rotary_embedding"):
        assert getattr(torch_npu, name) is getattr(atb, name)
    assert torch_npu.atb.npu_paged_cache_load is atb.npu_paged_cache_load
    import torch_npu.atb as sub
    assert sub.npu_paged_cache_load is atb.npu_paged_cache_load


# ---------------------------------------------------------------------------------------------
# _npu_reshape_and_cache(_siso)

@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16, torch.float32, torch.int8),
                         ids=dtype_id)
def test_reshape_and_cache_matches_reference(dtype):
    torch.manual_seed(0)
    T, H, Dk, Dv, blocks, bs = 7, 3, 83, 5, 6, 4

    def rnd(*s):
        return torch.randn(s).to(dtype) if dtype.is_floating_point else torch.randint(-9, 9, s, dtype=dtype)

    key, value = rnd(T, H, Dk), rnd(T, H, Dv)
    kc, vc = rnd(blocks, bs, H, Dk), rnd(blocks, bs, H, Dv)
    slots = torch.randperm(blocks * bs)[:T].to(torch.int32)
    slots[2] = -1  # padding token: skipped
    ek, ev = ref_reshape_and_cache(key, kc, slots), ref_reshape_and_cache(value, vc, slots)
    assert torch_npu._npu_reshape_and_cache(key, value, kc, vc, slots) is None
    assert torch.equal(kc, ek) and torch.equal(vc, ev)
    kc2 = rnd(blocks, bs, H, Dk)
    ek2 = ref_reshape_and_cache(key, kc2, slots.long())
    torch_npu._npu_reshape_and_cache_siso(key, kc2, slots.long())
    assert torch.equal(kc2, ek2)


def test_reshape_and_cache_nz_layout_and_strided_inputs():
    # op-plugin's int8 case: caches in the NZ blocking [blocks, H*D/32 (int8) | /16, bs, 32 | 16]
    torch.manual_seed(0)
    T, blocks, bs = 5, 3, 8
    key = torch.randint(-128, 128, (T, 1, 64), dtype=torch.int8)
    value = torch.randn(T, 2, 16, dtype=torch.float32)[:, :1].to(torch.bfloat16)  # [T, 1, 16]
    kc = torch.randint(-128, 128, (blocks, 2, bs, 32), dtype=torch.int8)
    vc = torch.randn(blocks, 1, bs, 16).to(torch.bfloat16)
    slots = torch.tensor([0, 9, 23, 5, 17], dtype=torch.int32)
    ek, ev = kc.clone(), vc.clone()
    for t, s in enumerate(slots.tolist()):
        for c in range(2):
            ek[s // bs, c, s % bs] = key[t].reshape(-1)[c * 32:(c + 1) * 32]
        ev[s // bs, 0, s % bs] = value[t].reshape(-1)
    torch_npu._npu_reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)
    # a non-contiguous key (a slice of a fused qkv projection) and a strided cache view
    qkv = torch.randn(T, 3, 2, 8)
    big = torch.zeros(blocks, bs, 2, 16)
    cache = big[..., :8]
    expected = ref_reshape_and_cache(qkv[:, 1], cache, slots)
    torch_npu._npu_reshape_and_cache_siso(qkv[:, 1], cache, slots)
    assert torch.equal(cache, expected) and not big[..., 8:].any()


def test_reshape_and_cache_empty_and_errors():
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    torch_npu._npu_reshape_and_cache(torch.zeros(0, 1, 8), torch.zeros(0, 1, 8), kc, vc,
                                     torch.zeros(0, dtype=torch.int32))
    key = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match=r"_npu_reshape_and_cache: argument 'slot_mapping' must "
                                           r"hold slots in \[0, num_blocks \* block_size\)"):
        torch_npu._npu_reshape_and_cache(key, key, kc, vc, torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="_npu_reshape_and_cache: argument 'key_cache' must have "
                                           "the dtype of 'key'"):
        torch_npu._npu_reshape_and_cache(key.half(), key, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="_npu_reshape_and_cache_siso: argument 'key_cache' must "
                                           "be a 4-D cache"):
        torch_npu._npu_reshape_and_cache_siso(torch.ones(2, 1, 7), kc, torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="_npu_reshape_and_cache: argument 'slot_mapping' must "
                                           "be int32 or int64"):
        torch_npu._npu_reshape_and_cache(key, key, kc, vc, torch.tensor([0.0, 1.0]))
    assert not kc.any() and not vc.any()  # nothing written by a failed call


def test_reshape_and_cache_repeated_slot_last_token_wins():
    kc = torch.zeros(1, 4, 1, 2)
    key = torch.arange(6.0).reshape(3, 1, 2)
    torch_npu._npu_reshape_and_cache_siso(key, kc, torch.tensor([1, 1, 1]))
    assert torch.equal(kc[0, 1, 0], key[2, 0])


# ---------------------------------------------------------------------------------------------
# _npu_paged_attention

@pytest.mark.parametrize("dtype", HALF, ids=dtype_id)
@pytest.mark.parametrize("T,N,KVN,D,Dv,bs", [(3, 4, 2, 16, 8, 4), (2, 8, 8, 40, 40, 16),
                                              (5, 6, 1, 7, 3, 3), (1, 32, 16, 288, 96, 128)])
def test_paged_attention_matches_reference(dtype, T, N, KVN, D, Dv, bs):
    max_blocks = 3 if bs < 128 else 8
    q, kc, vc, table, lens = paged_inputs(T, N, KVN, D, Dv, blocks=max(9, max_blocks + 2), bs=bs,
                                          max_blocks=max_blocks, dtype=dtype)
    scale = D ** -0.5
    out = torch.full((T, N, Dv), float("nan"), dtype=dtype)
    torch_npu._npu_paged_attention(q, kc, vc, KVN, N, scale, table, lens, out)
    expected = ref_paged_attention(q, kc, vc, KVN, N, scale, table, lens)
    assert_close(out, expected, dtype)


def test_paged_attention_layouts_zero_lengths_and_workspace():
    q, kc, vc, table, lens = paged_inputs(T=4, lens=[5, 0, 12, 1], dtype=torch.bfloat16)
    expected = ref_paged_attention(q, kc, vc, 2, 4, 0.3, table, lens)
    # 2-D query / out [T, N * D], int64 block table, a workspace that is accepted and not needed
    ws = torch_npu._npu_paged_attention_get_workspace(q, kc, vc, 2, 4, 0.3, table, lens,
                                                      torch.empty(4, 4, 8, dtype=torch.bfloat16))
    assert ws.dtype == torch.uint8 and ws.numel() == 0
    out2 = torch.full((4, 32), 7.0, dtype=torch.bfloat16)
    torch_npu._npu_paged_attention(q.reshape(4, -1), kc, vc, 2, 4, 0.3, table.long(), lens.long(),
                                   out2, workspace=ws)
    assert_close(out2.view(4, 4, 8), expected, torch.bfloat16)
    assert not out2[1].any()  # no key: zeros
    # non-contiguous query and out (strided views), caches sliced out of a wider tensor
    out3 = torch.zeros(4, 4, 16, dtype=torch.bfloat16)[..., ::2]
    qs = torch.cat([q, q], -1)[..., :16]
    torch_npu._npu_paged_attention(qs, kc, vc, 2, 4, 0.3, table, lens, out3)
    assert_close(out3, expected, torch.bfloat16)
    # no tokens
    torch_npu._npu_paged_attention(q[:0], kc, vc, 2, 4, 0.3, table[:0], lens[:0], out3[:0])


def test_paged_attention_errors():
    q, kc, vc, table, lens = paged_inputs()
    out = torch.empty(3, 4, 8, dtype=torch.float16)
    cases = [
        ((q, kc, vc, 3, 4, 0.1, table, lens, out), "argument 'num_kv_heads' must be positive and "
                                                   "divide num_heads"),
        ((q, kc.float(), vc, 2, 4, 0.1, table, lens, out), "argument 'key_cache' must have the "
                                                           "dtype of 'query'"),
        ((q, kc, vc, 2, 4, 0.1, table, lens + 100, out), "argument 'context_lens' must hold "
                                                         "lengths in"),
        ((q, kc, vc, 2, 4, 0.1, table + 50, lens, out), "argument 'block_table' must hold block "
                                                        "ids"),
        ((q, kc, vc, 2, 4, 0.1, table, lens, out[..., :4]), "argument 'out' must be"),
        ((q, kc, vc, 2, 4, float("nan"), table, lens, out), "argument 'scale_value' must be "
                                                            "finite"),
        ((q.double(), kc.double(), vc.double(), 2, 4, 0.1, table, lens, out.double()),
         "argument 'query' must be float16, bfloat16 or float32"),
        ((q, kc.transpose(1, 2), vc, 2, 4, 0.1, table, lens, out), "argument 'key_cache' must be "
                                                                   r"\[num_blocks"),
    ]
    for args, text in cases:
        with pytest.raises(RuntimeError, match="_npu_paged_attention: " + text):
            torch_npu._npu_paged_attention(*args)


# ---------------------------------------------------------------------------------------------
# _npu_flash_attention

def causal(S, value=float("-inf"), dtype=torch.float16):
    return torch.triu(torch.ones(S, S), 1).mul(value).nan_to_num(neginf=float("-inf")).to(dtype)


@pytest.mark.parametrize("dtype", HALF + (torch.float64,), ids=dtype_id)
@pytest.mark.parametrize("mask_kind", ["neginf", "minus10000", "batched", "random"])
def test_flash_attention_matches_reference(dtype, mask_kind):
    torch.manual_seed(0)
    lens = torch.tensor([5, 1, 13, 7], dtype=torch.int32)
    T, N, KVN, D, Dv, S = int(lens.sum()), 4, 2, 24, 9, 16
    q = torch.randn(T, N, D).to(dtype)
    k = torch.randn(T, KVN, D).to(dtype)
    v = torch.randn(T, KVN, Dv).to(dtype)
    if mask_kind == "neginf":
        mask = causal(S, dtype=dtype)
    elif mask_kind == "minus10000":
        mask = torch.triu(torch.full((S, S), -10000.0), 1).to(dtype)
    elif mask_kind == "batched":
        mask = causal(S, dtype=dtype).expand(4, 1, S, S).clone()
        mask[2, 0, :, 0] = float("-inf")  # sequence 2 never sees its first key ...
        mask[2, 0, 0, 0] = 0  # ... except from row 0
    else:
        mask = torch.randn(4, S, S).to(dtype)
    scale = D ** -0.5
    out = torch.full((T, N, Dv), float("nan"), dtype=dtype)
    torch_npu._npu_flash_attention(q, k, v, mask, lens, scale, N, KVN, out)
    expected = ref_flash_attention(q, k, v, mask, lens, scale, N, KVN)
    assert_close(out, expected, dtype)


def test_flash_attention_2d_inputs_padding_rows_and_op_plugin_shapes():
    torch.manual_seed(0)
    lens = torch.tensor([4, 6])
    T = 12  # two rows past the sequences: zeros
    q, k, v = torch.randn(T, 8 * 16).half(), torch.randn(T, 2 * 16).half(), torch.randn(T, 2 * 5).half()
    mask = causal(6, -10000.0)
    out = torch.full((T, 8 * 5), 3.0, dtype=torch.half)
    torch_npu._npu_flash_attention(q, k, v, mask, lens, 0.25, 8, 2, out)
    expected = ref_flash_attention(q.view(T, 8, 16), k.view(T, 2, 16), v.view(T, 2, 5), mask, lens,
                                   0.25, 8, 2)
    assert_close(out.view(T, 8, 5), expected, torch.float16)
    assert not out[10:].any()


def test_flash_attention_errors():
    q, k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    out, mask, lens = torch.empty(4, 2, 8), torch.zeros(4, 4), torch.tensor([4])
    cases = [
        ((q, k, v, mask, torch.tensor([3, 3]), 1.0, 2, 2, out), "argument 'seq_len' must hold "
                                                                 "lengths >= 0 whose sum"),
        ((q, k, v, torch.zeros(3, 3), lens, 1.0, 2, 2, out), "argument 'mask' must be"),
        ((q, k, v, mask.bool(), lens, 1.0, 2, 2, out), "argument 'mask' must be a floating"),
        ((q, k.half(), v, mask, lens, 1.0, 2, 2, out), "argument 'key' must have the dtype"),
        ((q, k, v, mask, lens, 1.0, 2, 1, out), "argument 'key' must be"),
        ((q, k, v, mask, lens, 0.0, 2, 2, out), "argument 'scale_value' must be nonzero"),
        ((q, k, v, mask, lens, 1.0, 2, 2, out[:3]), "argument 'out' must be"),
    ]
    for args, text in cases:
        with pytest.raises(RuntimeError, match="_npu_flash_attention: " + text):
            torch_npu._npu_flash_attention(*args)


# ---------------------------------------------------------------------------------------------
# _npu_rotary_embedding

def cos_sin_cache(max_pos, rot, dtype=torch.float32):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float), inv)
    return torch.cat([f.cos(), f.sin()], -1).to(dtype)


@pytest.mark.parametrize("dtype", HALF + (torch.float64,), ids=dtype_id)
@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("head_size,rot", [(128, 128), (80, 32), (6, 6)])
def test_rotary_embedding_matches_reference(dtype, neox, head_size, rot):
    torch.manual_seed(0)
    T = 7
    positions = torch.randint(0, 50, (T,))
    q = torch.randn(T, 3 * head_size).to(dtype)
    k = torch.randn(T, 1, head_size).to(dtype)
    cache = cos_sin_cache(64, rot)
    eq, ek = (ref_rope(positions, x, head_size, cache, neox) for x in (q, k))
    ptr = q.data_ptr()
    torch_npu._npu_rotary_embedding(positions.int(), q, k, head_size, cache, neox)
    assert q.data_ptr() == ptr
    assert_close(q, eq, dtype)
    assert_close(k, ek, dtype)


def test_rotary_embedding_non_contiguous_batched_positions_and_errors():
    torch.manual_seed(0)
    positions = torch.randint(0, 30, (2, 3))  # [batch, seq]: flattened
    qkv = torch.randn(6, 3, 2 * 16)
    q, k = qkv[:, 0], qkv[:, 1]  # strided views of a fused projection
    eq, ek = (ref_rope(positions, x, 16, cos_sin_cache(32, 16), True) for x in (q, k))
    torch_npu._npu_rotary_embedding(positions, q, k, 16, cos_sin_cache(32, 16), True)
    assert_close(qkv[:, 0], eq, torch.float32)
    assert_close(qkv[:, 1], ek, torch.float32)
    with pytest.raises(RuntimeError, match=r"_npu_rotary_embedding: argument 'positions' must "
                                           r"hold positions in \[0, max_position = 32\)"):
        torch_npu._npu_rotary_embedding(positions + 40, q, k, 16, cos_sin_cache(32, 16), True)
    with pytest.raises(RuntimeError, match="_npu_rotary_embedding: argument 'head_size' must be "
                                           "at least cos_sin_cache's rot_dim"):
        torch_npu._npu_rotary_embedding(positions, q, k, 8, cos_sin_cache(32, 16), True)
    with pytest.raises(RuntimeError, match="_npu_rotary_embedding: argument 'key' must hold"):
        torch_npu._npu_rotary_embedding(positions, q, k[:, :10], 16, cos_sin_cache(32, 16), True)
    torch_npu._npu_rotary_embedding(positions[:0], q[:0], k[:0], 16, cos_sin_cache(32, 16), True)


# ---------------------------------------------------------------------------------------------
# npu_paged_cache_load

@pytest.mark.parametrize("cumsum", [False, True])
@pytest.mark.parametrize("dtype", (torch.float16, torch.int8), ids=dtype_id)
def test_paged_cache_load_matches_reference(cumsum, dtype):
    torch.manual_seed(0)
    blocks, bs, B = 16, 4, 3
    kc = torch.randn(blocks, bs, 1, 12).to(dtype)
    vc = torch.randn(blocks, bs, 1, 5).to(dtype)
    table = torch.stack([torch.randperm(blocks) for _ in range(B)]).int()
    lens = torch.tensor([5, 0, 9], dtype=torch.int32)
    starts = torch.tensor([3, 8, 4], dtype=torch.int32)
    arg = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()]) if cumsum else lens
    key, value = torch_npu.atb.npu_paged_cache_load(kc, vc, table, arg, seq_starts=starts,
                                                    cumsum=cumsum)
    assert torch.equal(key, ref_cache_load(kc, table, arg, starts, cumsum))
    assert torch.equal(value, ref_cache_load(vc, table, arg, starts, cumsum))
    k2, v2 = torch.empty_like(key), torch.empty_like(value)
    r = torch_npu.atb.npu_paged_cache_load(kc, vc, table, arg, cumsum=cumsum, key=k2, value=v2)
    assert r[0] is k2 and r[1] is v2
    assert torch.equal(k2, ref_cache_load(kc, table, arg, None, cumsum))
    with pytest.raises(RuntimeError, match="npu_paged_cache_load: argument 'context_lens' must"):
        torch_npu.atb.npu_paged_cache_load(kc, vc, table, lens.float())


# ---------------------------------------------------------------------------------------------
# dispatcher contracts: opcheck, torch.compile, the npu device, graph capture, autograd

def test_opcheck():
    q, kc, vc, table, lens = paged_inputs(dtype=torch.float32)
    out = torch.empty(3, 4, 8)
    positions = torch.arange(4)
    lens2 = torch.tensor([3, 2], dtype=torch.int32)
    opcheck(atb._npu_reshape_and_cache, [((torch.randn(3, 2, 8), torch.randn(3, 2, 4),
                                           torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 4),
                                           torch.tensor([0, 5, 7])), {})])
    opcheck(atb._npu_reshape_and_cache_siso, [((torch.randn(3, 2, 8), torch.randn(4, 2, 2, 8),
                                                torch.tensor([0, 5, -1])), {})])
    opcheck(atb._npu_paged_attention, [((q, kc, vc, 2, 4, 0.25, table, lens, out), {})])
    opcheck(atb._npu_paged_attention_get_workspace, [((q, kc, vc, 2, 4, 0.25, table, lens, out), {})])
    opcheck(atb._npu_flash_attention, [((torch.randn(5, 2, 8), torch.randn(5, 1, 8),
                                         torch.randn(5, 1, 4), causal(3, dtype=torch.float32),
                                         lens2, 0.3, 2, 1, torch.empty(5, 2, 4)), {})])
    opcheck(atb._npu_rotary_embedding, [((positions, torch.randn(4, 16), torch.randn(4, 8), 8,
                                          cos_sin_cache(8, 8), False), {})])
    opcheck(atb.npu_paged_cache_load.out,
            [((kc, vc, table, lens), {"key": torch.empty(int(lens.sum()), 2, 16, dtype=kc.dtype),
                                      "value": torch.empty(int(lens.sum()), 2, 8, dtype=kc.dtype)})])


def test_torch_compile_fullgraph():
    torch._dynamo.reset()
    q, kc, vc, table, lens = paged_inputs(dtype=torch.float32)

    def step(key, value, kc, vc, slots, q, table, lens, out, positions, cache):
        torch_npu._npu_rotary_embedding(positions, q, key, 16, cache, True)
        torch_npu._npu_reshape_and_cache(key, value, kc, vc, slots)
        torch_npu._npu_paged_attention(q, kc, vc, 2, 4, 0.25, table, lens, out)
        return out

    args = lambda: (torch.ones(3, 2, 16), torch.ones(3, 2, 8), kc.clone(), vc.clone(),  # noqa: E731
                    torch.tensor([0, 13, 30]), q.clone(), table, lens, torch.empty(3, 4, 8),
                    torch.tensor([1, 2, 3]), cos_sin_cache(8, 16))
    eager_args, compiled_args = args(), args()
    expected = step(*eager_args)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_args)
    torch.testing.assert_close(got, expected)
    for a, b in zip(eager_args, compiled_args):
        torch.testing.assert_close(a, b)  # the in-place writes reached the inputs


def test_on_the_npu_device_with_host_lengths_and_graph_update():
    q, kc, vc, table, lens = paged_inputs(dtype=torch.float16, lens=[12, 12, 12])
    new_lens = torch.tensor([3, 7, 1], dtype=torch.int32)
    dq, dkc, dvc, dtable = (t.npu() for t in (q, kc, vc, table))
    out = torch.zeros(3, 4, 8, dtype=torch.float16, device="npu")
    torch_npu._npu_paged_attention(dq, dkc, dvc, 2, 4, 0.25, dtable, lens, out)  # lens on the host
    assert out.device.type == "npu"
    assert_close(out.cpu(), ref_paged_attention(q, kc, vc, 2, 4, 0.25, table, lens), torch.float16)
    # op-plugin's aclgraph update pattern: capture with one context_lens, update, replay
    graph_out = torch.zeros_like(out)
    ws = torch_npu._npu_paged_attention_get_workspace(dq, dkc, dvc, 2, 4, 0.25, dtable, new_lens,
                                                      graph_out)
    g = torch.npu.NPUGraph()
    update_stream = torch.npu.Stream()
    with torch.npu.graph(g):
        stream = torch.npu.current_stream()
        torch.npu.graph_task_group_begin(stream)
        torch_npu._npu_paged_attention(dq, dkc, dvc, 2, 4, 0.25, dtable, lens, graph_out,
                                       workspace=ws)
        handle = torch.npu.graph_task_group_end(stream)
    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, handle)
        torch_npu._npu_paged_attention(dq, dkc, dvc, 2, 4, 0.25, dtable, new_lens, graph_out,
                                       workspace=ws)
        torch.npu.graph_task_update_end(update_stream)
    graph_out.zero_()
    g.replay()
    assert_close(graph_out.cpu(), ref_paged_attention(q, kc, vc, 2, 4, 0.25, table, new_lens),
                 torch.float16)
    # the other ops on npu tensors
    key, value = torch.randn(2, 2, 16).half().npu(), torch.randn(2, 2, 8).half().npu()
    torch_npu._npu_reshape_and_cache(key, value, dkc, dvc, torch.tensor([1, 6]).npu())
    assert torch.equal(dkc.cpu()[0, 1], key.cpu()[0])
    lens2 = torch.tensor([2, 3], dtype=torch.int32)
    fo = torch.empty(5, 2, 4, device="npu")
    torch_npu._npu_flash_attention(torch.randn(5, 2, 8).npu(), torch.randn(5, 1, 8).npu(),
                                   torch.randn(5, 1, 4).npu(), causal(3, dtype=torch.float32).npu(),
                                   lens2, 0.3, 2, 1, fo)
    assert fo.device.type == "npu" and fo.isfinite().all()


def test_not_differentiable():
    q, kc, vc, table, lens = paged_inputs(dtype=torch.float32)
    with pytest.raises(RuntimeError, match="_npu_paged_attention: not differentiable"):
        torch_npu._npu_paged_attention(q.requires_grad_(), kc, vc, 2, 4, 0.25, table, lens,
                                       torch.empty(3, 4, 8))


def test_wrappers_call_the_ops():
    kc = torch.zeros(1, 4, 1, 2)
    atb_wrappers._npu_reshape_and_cache_siso(torch.ones(1, 1, 2), kc, torch.tensor([2]))
    assert kc[0, 2].eq(1).all()
    k, v = atb_wrappers.npu_paged_cache_load(kc, kc, torch.tensor([[0]]), torch.tensor([3]))
    assert k.shape == (3, 1, 2) and k[2].eq(1).all()


def test_portable_compositions_match_the_cpu_kernels():
    """The ATen compositions CUDA / XPU / MPS run (src/opennpu/ops/portable.py), forced on CPU."""
    from opennpu.ops import portable

    q, kc, vc, table, lens = paged_inputs(T=4, lens=[5, 0, 12, 1], dtype=torch.float32)
    lens2 = torch.tensor([3, 2], dtype=torch.int32)
    fa = (torch.randn(5, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 4),
          torch.triu(torch.full((3, 3), -10000.0), 1).expand(2, 3, 3).clone(), lens2, 0.3, 2, 1)
    positions, cache = torch.tensor([3, 1, 7]), cos_sin_cache(8, 8)

    def run():
        outs = []
        kc2, vc2 = kc.clone(), vc.clone()
        atb._npu_reshape_and_cache(torch.ones(2, 2, 16), torch.ones(2, 2, 8), kc2, vc2,
                                   torch.tensor([1, -1]))
        outs += [kc2, vc2]
        out = torch.empty(4, 4, 8)
        atb._npu_paged_attention(q, kc2, vc2, 2, 4, 0.25, table, lens, out)
        fo = torch.empty(5, 2, 4)
        atb._npu_flash_attention(*fa, fo)
        for neox in (False, True):
            x, y = torch.randn(3, 2 * 12, generator=torch.Generator().manual_seed(1)), torch.ones(3, 12)
            atb._npu_rotary_embedding(positions, x, y, 12, cache, neox)
            outs += [x, y]
        outs += [out, fo, *atb.npu_paged_cache_load(kc2, vc2, table, lens, seq_starts=lens2.new_tensor([0, 4, 4, 0]))]
        return outs

    native = run()
    with portable.force():
        composed = run()
    for a, b in zip(composed, native):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
