"""npu_scatter_nd_update(_), npu_scatter_pa_kv_cache(_functional), npu_gather_pa_kv_cache(_functional)
against loop references written from op-plugin's goldens (test_npu_scatter_nd_update.py,
test_scatter_pa_kv_cache.py, test_npu_gather_pa_kv_cache.py)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import opennpu  # noqa: F401
import torch_npu
from op_helpers import dtype_id, opcheck

npu = torch.ops.npu
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


def rand(*shape, dtype=torch.float32):
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-100, 100, shape, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# npu_scatter_nd_update

def ref_scatter_nd(self, indices, updates):
    out = self.clone()
    depth = indices.shape[-1]
    idx = indices.reshape(-1, depth).tolist()
    upd = updates.reshape(len(idx), *self.shape[depth:])
    for r, i in enumerate(idx):
        out[tuple(i)] = upd[r]
    return out


def test_scatter_nd_update_op_plugin_example():
    var = torch.zeros(3, 2, dtype=torch.float16)
    out = torch_npu.npu_scatter_nd_update(var, torch.tensor([[0, 0], [1, 1]]),
                                          torch.tensor([10.0, 20.0], dtype=torch.float16))
    assert torch.equal(out, torch.tensor([[10, 0], [0, 20], [0, 0]], dtype=torch.float16))
    assert torch.equal(var, torch.zeros(3, 2, dtype=torch.float16))  # out of place


@pytest.mark.parametrize("dtype", DTYPES + (torch.bool, torch.int64), ids=dtype_id)
@pytest.mark.parametrize("shape,index_shape", [((24, 128), (12, 1)), ((4, 5, 6), (3, 2)),
                                               ((7, 3, 5), (2, 4, 3)), ((83,), (5, 1)),
                                               ((5, 769), (1, 1))])
def test_scatter_nd_update_matches_reference(dtype, shape, index_shape):
    torch.manual_seed(0)
    self = rand(*shape, dtype=dtype) if dtype != torch.bool else torch.rand(shape) > 0.5
    depth = index_shape[-1]
    rows = torch.Size(index_shape[:-1]).numel()
    flat = torch.randperm(torch.Size(shape[:depth]).numel())[:rows]
    indices = torch.stack(torch.unravel_index(flat, shape[:depth]), -1).reshape(index_shape)
    upd_shape = index_shape[:-1] + shape[depth:]
    updates = rand(*upd_shape, dtype=dtype) if dtype != torch.bool else torch.rand(upd_shape) > 0.5
    for index_dtype in (torch.int32, torch.int64):
        expected = ref_scatter_nd(self, indices, updates)
        assert torch.equal(npu.npu_scatter_nd_update(self, indices.to(index_dtype), updates),
                           expected)
        inplace = self.clone()
        assert npu.npu_scatter_nd_update_(inplace, indices.to(index_dtype), updates) is inplace
        assert torch.equal(inplace, expected)


def test_scatter_nd_update_repeated_indices_last_wins():
    self = torch.zeros(4, 3)
    indices = torch.tensor([[1], [2], [1], [1]])
    updates = torch.arange(12.0).view(4, 3)
    out = npu.npu_scatter_nd_update(self, indices, updates)
    assert torch.equal(out[1], updates[3]) and torch.equal(out[2], updates[1])


def test_scatter_nd_update_non_contiguous_and_empty():
    base = torch.randn(6, 10)
    self = base.t()  # [10, 6], not contiguous
    indices = torch.tensor([[3], [7]])
    updates = torch.randn(10, 6)[::5]  # [2, 6], strided rows
    expected = ref_scatter_nd(self, indices, updates)
    assert torch.equal(npu.npu_scatter_nd_update(self, indices, updates), expected)
    npu.npu_scatter_nd_update_(self, indices, updates)
    assert torch.equal(self, expected) and torch.equal(base.t(), expected)  # written through
    empty = npu.npu_scatter_nd_update(torch.ones(3, 0), torch.tensor([[1]]), torch.ones(1, 0))
    assert empty.shape == (3, 0)
    same = npu.npu_scatter_nd_update(torch.ones(3, 2), torch.zeros(0, 1, dtype=torch.long),
                                     torch.ones(0, 2))
    assert torch.equal(same, torch.ones(3, 2))


def test_scatter_nd_update_on_npu():
    self = torch.zeros(5, 4).npu()
    indices = torch.tensor([[4], [0]]).npu()
    updates = torch.randn(2, 4).npu()
    out = torch_npu.npu_scatter_nd_update(self, indices, updates)
    assert out.device.type == "npu"
    torch_npu.npu_scatter_nd_update_(self, indices, updates)
    expected = ref_scatter_nd(torch.zeros(5, 4), indices.cpu(), updates.cpu())
    assert torch.equal(out.cpu(), expected) and torch.equal(self.cpu(), expected)


def test_scatter_nd_update_bad_inputs():
    self, upd = torch.zeros(4, 3), torch.ones(2, 3)
    with pytest.raises(RuntimeError, match="npu_scatter_nd_update: argument 'indices' must be "
                                           "int32 or int64, but got Float"):
        npu.npu_scatter_nd_update(self, torch.zeros(2, 1), upd)
    with pytest.raises(RuntimeError, match=r"argument 'indices' must hold indices into 'self' "
                                           r"\(dim 0 of size 4\), but row 1 has 4"):
        npu.npu_scatter_nd_update(self, torch.tensor([[0], [4]]), upd)
    with pytest.raises(RuntimeError, match=r"row 0 has -1"):
        npu.npu_scatter_nd_update_(self, torch.tensor([[-1], [0]]), upd)
    with pytest.raises(RuntimeError, match=r"argument 'updates' must have shape "
                                           r"indices.shape\[:-1\] \+ self.shape\[1:\] = \[2, 3\]"):
        npu.npu_scatter_nd_update(self, torch.tensor([[0], [1]]), torch.ones(2, 4))
    with pytest.raises(RuntimeError, match="argument 'updates' must have the dtype of 'self'"):
        npu.npu_scatter_nd_update(self, torch.tensor([[0], [1]]), upd.half())
    with pytest.raises(RuntimeError, match="argument 'indices' must have a last dim"):
        npu.npu_scatter_nd_update(self, torch.zeros(2, 3, dtype=torch.long), upd)
    assert torch.equal(self, torch.zeros(4, 3))  # a failed in-place call wrote nothing


def test_scatter_nd_update_not_differentiable():
    self = torch.zeros(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="npu_scatter_nd_update: not differentiable"):
        npu.npu_scatter_nd_update(self, torch.tensor([[0]]), torch.ones(1, 3)).sum().backward()
    with pytest.raises(RuntimeError, match="npu_scatter_nd_update_: not differentiable"):
        npu.npu_scatter_nd_update_(torch.zeros(4, 3), torch.tensor([[0]]),
                                   torch.ones(1, 3, requires_grad=True))
    with torch.no_grad():
        npu.npu_scatter_nd_update_(torch.zeros(4, 3), torch.tensor([[0]]),
                                   torch.ones(1, 3, requires_grad=True))


def test_scatter_nd_update_opcheck():
    opcheck(npu.npu_scatter_nd_update.default,
            [((torch.randn(5, 4), torch.tensor([[1], [3]]), torch.randn(2, 4)), {}),
             ((torch.randn(4, 5, 6), torch.tensor([[0, 1], [3, 4]], dtype=torch.int32),
               torch.randn(2, 6)), {})])
    opcheck(npu.npu_scatter_nd_update_.default,
            [((torch.randn(5, 4), torch.tensor([[1], [3]]), torch.randn(2, 4)), {})])


# ---------------------------------------------------------------------------------------------
# npu_scatter_pa_kv_cache / npu_gather_pa_kv_cache

def ref_scatter_cache(tok, cache, slots, nz):
    out = cache.clone()
    block_size = cache.shape[2] if nz else cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, o = divmod(slot, block_size)
        row = tok[t].reshape(-1)
        if nz:
            out[b, :, o, :] = row.view(cache.shape[1], cache.shape[3])
        else:
            out[b, o] = row.view(cache.shape[2:])
    return out


def make_scatter_inputs(tokens, heads, dk, dv, blocks, block_size, dtype, nz, last=16):
    key = rand(tokens, heads, dk, dtype=dtype)
    value = rand(tokens, heads, dv, dtype=dtype)
    if nz:
        kc = rand(blocks, heads * dk // last, block_size, last, dtype=dtype)
        vc = rand(blocks, heads * dv // last, block_size, last, dtype=dtype)
    else:
        kc = rand(blocks, block_size, heads, dk, dtype=dtype)
        vc = rand(blocks, block_size, heads, dv, dtype=dtype)
    slots = torch.randperm(blocks * block_size)[:tokens].to(torch.int32)
    return key, value, kc, vc, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", ["Norm", "PA_NZ", None])
@pytest.mark.parametrize("tokens,heads,dk,dv,blocks,block_size",
                         [(16, 4, 32, 64, 2, 32), (7, 3, 16, 48, 5, 4), (1, 1, 16, 16, 1, 1),
                          (83, 2, 64, 32, 7, 16)])
def test_scatter_pa_kv_cache_matches_reference(dtype, mode, tokens, heads, dk, dv, blocks,
                                               block_size):
    torch.manual_seed(0)
    nz = mode == "PA_NZ"
    key, value, kc, vc, slots = make_scatter_inputs(tokens, heads, dk, dv, blocks, block_size,
                                                    dtype, nz)
    slots[::3] = -1  # padding tokens are skipped
    ek, ev = ref_scatter_cache(key, kc, slots, nz), ref_scatter_cache(value, vc, slots, nz)
    fk, fv = npu.npu_scatter_pa_kv_cache_functional(key, value, kc, vc, slots, cache_mode=mode)
    assert torch.equal(fk, ek) and torch.equal(fv, ev)
    assert npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots.long(), cache_mode=mode) is None
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("tokens", [40, 1100], ids=["tiled", "row_by_row"])
def test_scatter_pa_kv_cache_nz_repeated_slots(dtype, tokens):
    """PA_NZ with repeated slots (the last token wins) and padding: small plans are copied chunk
    column by chunk column, plans over 2 MiB row by row; both give the reference's cache."""
    torch.manual_seed(2)
    key, value, kc, vc, slots = make_scatter_inputs(tokens, 8, 128, 128, tokens // 16 + 2, 16,
                                                    dtype, True)
    slots[5::7] = slots[3::7][: len(slots[5::7])]  # later tokens overwrite earlier ones
    slots[::11] = -1
    ek, ev = ref_scatter_cache(key, kc, slots, True), ref_scatter_cache(value, vc, slots, True)
    npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode="PA_NZ")
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


def test_scatter_pa_kv_cache_default_mode_is_pa_nz():
    key, value, kc, vc, slots = make_scatter_inputs(16, 4, 32, 32, 2, 32, torch.float16, True)
    ek, ev = ref_scatter_cache(key, kc, slots, True), ref_scatter_cache(value, vc, slots, True)
    torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, ek) and torch.equal(vc, ev)


def test_scatter_pa_kv_cache_strided_inputs_and_caches():
    torch.manual_seed(1)
    qkv = torch.randn(9, 3, 4, 32)  # key / value as views of a fused projection
    key, value = qkv[:, 1], qkv[:, 2]
    both = torch.randn(2, 6, 8, 4, 32)  # one [2, blocks, block_size, N, D] tensor for k and v
    kc, vc = both[0], both[1]
    slots = torch.randperm(48)[:9]
    ek, ev = ref_scatter_cache(key, kc, slots, False), ref_scatter_cache(value, vc, slots, False)
    npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode="Norm")
    assert torch.equal(both[0], ek) and torch.equal(both[1], ev)
    # a cache whose rows are not contiguous goes through a contiguous copy
    kt = torch.randn(6, 8, 32, 4).transpose(2, 3)  # [6, 8, 4, 32]
    vt = torch.randn(6, 8, 4, 32)
    ekt = ref_scatter_cache(key, kt, slots, False)
    npu.npu_scatter_pa_kv_cache(key, value, kt, vt, slots, cache_mode="Norm")
    assert torch.equal(kt, ekt)


def test_scatter_pa_kv_cache_repeated_slots_last_token_wins():
    key = torch.arange(4.0).view(4, 1, 1).expand(4, 1, 16).contiguous()
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    npu.npu_scatter_pa_kv_cache(key, key, kc, vc, torch.tensor([5, 1, 5, 5]), cache_mode="Norm")
    assert kc[1, 1, 0, 0] == 3 and kc[0, 1, 0, 0] == 1


def test_scatter_pa_kv_cache_empty():
    kc = torch.randn(2, 4, 2, 8)
    before = kc.clone()
    npu.npu_scatter_pa_kv_cache(torch.ones(0, 2, 8), torch.ones(0, 2, 8), kc, kc.clone(),
                                torch.zeros(0, dtype=torch.int32), cache_mode="Norm")
    assert torch.equal(kc, before)


def test_scatter_pa_kv_cache_on_npu():
    key, value, kc, vc, slots = make_scatter_inputs(10, 2, 16, 32, 3, 8, torch.bfloat16, False)
    ek, ev = ref_scatter_cache(key, kc, slots, False), ref_scatter_cache(value, vc, slots, False)
    kn, vn = kc.npu(), vc.npu()
    torch_npu.npu_scatter_pa_kv_cache(key.npu(), value.npu(), kn, vn, slots.npu(),
                                      cache_mode="Norm")
    assert torch.equal(kn.cpu(), ek) and torch.equal(vn.cpu(), ev)


def test_scatter_pa_kv_cache_bad_inputs():
    key, value, kc, vc, slots = make_scatter_inputs(4, 2, 16, 16, 2, 4, torch.float32, False)
    call = npu.npu_scatter_pa_kv_cache
    with pytest.raises(RuntimeError, match="npu_scatter_pa_kv_cache: argument 'cache_mode' must "
                                           "be 'Norm', 'PA_NZ' or None, but got 'ND'"):
        call(key, value, kc, vc, slots, cache_mode="ND")
    with pytest.raises(RuntimeError, match=r"argument 'slot_mapping' must hold slots in "
                                           r"\[0, num_blocks \* block_size\) = \[0, 8\)"):
        call(key, value, kc, vc, torch.tensor([0, 1, 8, 2]), cache_mode="Norm")
    with pytest.raises(RuntimeError, match="argument 'slot_mapping' must be int32 or int64"):
        call(key, value, kc, vc, slots.float(), cache_mode="Norm")
    with pytest.raises(RuntimeError, match=r"argument 'slot_mapping' must be 1-D with one slot "
                                           r"per token \(4\)"):
        call(key, value, kc, vc, slots[:3], cache_mode="Norm")
    with pytest.raises(RuntimeError, match=r"argument 'key_cache' must be a 4-D 'Norm' cache "
                                           r"\[num_blocks, block_size, a, b\] with a \* b = 32"):
        call(key, value, kc[..., :8], vc, slots, cache_mode="Norm")
    with pytest.raises(RuntimeError, match=r"argument 'key_cache' must be a 4-D 'PA_NZ' cache"):
        call(key, value, kc, vc, slots)  # default PA_NZ with a Norm-shaped cache
    with pytest.raises(RuntimeError, match="argument 'key_cache' must have the dtype of 'key'"):
        call(key, value, kc.half(), vc, slots, cache_mode="Norm")
    with pytest.raises(RuntimeError, match="argument 'value' must be 3-D"):
        call(key, value[:3], kc, vc, slots, cache_mode="Norm")
    with pytest.raises(RuntimeError, match="argument 'key' must be 3-D"):
        call(key[None], value, kc, vc, slots, cache_mode="Norm")
    with pytest.raises(RuntimeError, match="argument 'compress_lens' .* is not implemented"):
        call(key, value, kc, vc, slots, compress_lens=slots, cache_mode="Norm")
    with pytest.raises(RuntimeError, match="argument 'value_cache' must have the blocks of "
                                           "'key_cache'"):
        call(key, value, kc, vc[:1], slots, cache_mode="Norm")


def ref_gather(cache, block_tables, seq_lens, out, seq_offset, cumsum, nz):
    out = out.clone()
    num_blocks = cache.shape[0]
    block_size = cache.shape[2] if nz else cache.shape[1]
    lens = seq_lens.tolist()
    if cumsum:
        lens = [b - a for a, b in zip(lens, lens[1:])]
    row = 0
    for i, n in enumerate(lens):
        start = 0 if seq_offset is None else int(seq_offset[i]) // block_size
        for j in range(n):
            if row >= out.shape[0]:
                return out
            idx = start + j // block_size
            b = int(block_tables[i, idx]) if idx < block_tables.shape[1] else -1
            if 0 <= b < num_blocks:
                src = cache[b, :, j % block_size, :] if nz else cache[b, j % block_size]
                out[row] = src.reshape(out.shape[1:])
            else:
                out[row] = 0
            row += 1
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("nz", [False, True], ids=["Norm", "PA_NZ"])
@pytest.mark.parametrize("cumsum", [False, True])
@pytest.mark.parametrize("with_offset", [False, True])
def test_gather_pa_kv_cache_matches_reference(dtype, nz, cumsum, with_offset):
    torch.manual_seed(0)
    batch, blocks, heads, block_size, dk, dv, max_blocks = 3, 8, 4, 16, 32, 16, 5
    lens = torch.tensor([37, 1, 20], dtype=torch.int32)
    if nz:
        kc = rand(blocks, heads * dk // 16, block_size, 16, dtype=dtype)
        vc = rand(blocks, heads * dv // 16, block_size, 16, dtype=dtype)
    else:
        kc = rand(blocks, block_size, heads, dk, dtype=dtype)
        vc = rand(blocks, block_size, heads, dv, dtype=dtype)
    tables = torch.randint(0, blocks, (batch, max_blocks), dtype=torch.int32)
    tables[1, 0] = -1  # invalid block: zeros
    tables[2, 1] = blocks
    seq_offset = torch.tensor([0, 17, 40], dtype=torch.int32) if with_offset else None
    seq_lens = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()]) if cumsum \
        else lens
    total = int(lens.sum())
    key, value = rand(total, heads, dk, dtype=dtype), rand(total, heads, dv, dtype=dtype)
    ek = ref_gather(kc, tables, seq_lens, key, seq_offset, cumsum, nz)
    ev = ref_gather(vc, tables, seq_lens, value, seq_offset, cumsum, nz)
    fk, fv = npu.npu_gather_pa_kv_cache_functional(kc, vc, tables, seq_lens, key, value,
                                                   seq_offset=seq_offset,
                                                   is_seq_lens_cumsum=cumsum)
    assert torch.equal(fk, ek) and torch.equal(fv, ev)
    npu.npu_gather_pa_kv_cache(kc, vc, tables.long(), seq_lens, key, value,
                               seq_offset=seq_offset, is_seq_lens_cumsum=cumsum)
    assert torch.equal(key, ek) and torch.equal(value, ev)


def test_gather_pa_kv_cache_fewer_rows_and_extra_rows():
    kc, vc = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    tables = torch.tensor([[3, 1], [0, 2]])
    lens = torch.tensor([10, 5])
    small = torch.full((6, 2, 16), 7.0)  # fewer rows than tokens: the first 6 tokens
    ek = ref_gather(kc, tables, lens, small, None, False, False)
    npu.npu_gather_pa_kv_cache(kc, vc, tables, lens, small, small.clone())
    assert torch.equal(small, ek)
    big = torch.full((20, 2, 16), 7.0)  # more rows: rows 15.. keep their values
    npu.npu_gather_pa_kv_cache(kc, vc, tables, lens, big, big.clone())
    assert torch.equal(big, ref_gather(kc, tables, lens, torch.full((20, 2, 16), 7.0), None,
                                       False, False))
    assert (big[15:] == 7).all()


def test_gather_pa_kv_cache_strided_outputs_and_npu():
    torch.manual_seed(2)
    kc, vc = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    tables, lens = torch.tensor([[3, 1], [0, 2]]), torch.tensor([9, 4])
    out = torch.zeros(13, 2, 2, 16)
    key, value = out[:, :, 0], out[:, :, 1]  # rows strided
    npu.npu_gather_pa_kv_cache(kc, vc, tables, lens, key, value)
    assert torch.equal(out[:, :, 0], ref_gather(kc, tables, lens, torch.zeros(13, 2, 16), None,
                                                False, False))
    kt = torch.zeros(13, 16, 2).transpose(1, 2)  # rows not contiguous
    npu.npu_gather_pa_kv_cache(kc, vc, tables, lens, kt, torch.zeros(13, 2, 16))
    assert torch.equal(kt, out[:, :, 0])
    kn, vn = torch.zeros(13, 2, 16).npu(), torch.zeros(13, 2, 16).npu()
    torch_npu.npu_gather_pa_kv_cache(kc.npu(), vc.npu(), tables.npu(), lens.npu(), kn, vn)
    assert torch.equal(kn.cpu(), out[:, :, 0]) and torch.equal(vn.cpu(), out[:, :, 1])


def test_gather_pa_kv_cache_bad_inputs():
    kc, vc = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    tables, lens = torch.tensor([[3, 1], [0, 2]]), torch.tensor([9, 4])
    key, value = torch.zeros(13, 2, 16), torch.zeros(13, 2, 16)
    call = npu.npu_gather_pa_kv_cache
    with pytest.raises(RuntimeError, match=r"npu_gather_pa_kv_cache: argument 'block_tables' "
                                           r"must be 2-D \[batch, max_blocks\] with batch = 2"):
        call(kc, vc, tables[:1], lens, key, value)
    with pytest.raises(RuntimeError, match=r"argument 'seq_lens' must hold lengths >= 0, but "
                                           r"sequence 1 has length -4"):
        call(kc, vc, tables, torch.tensor([9, -4]), key, value)
    with pytest.raises(RuntimeError, match=r"argument 'seq_lens' must be non-decreasing"):
        call(kc, vc, tables[:1], torch.tensor([5, 2]), key, value, is_seq_lens_cumsum=True)
    with pytest.raises(RuntimeError, match=r"argument 'key_cache' must be a 4-D cache"):
        call(kc, vc, tables, lens, torch.zeros(13, 3, 16), value)
    with pytest.raises(RuntimeError, match=r"argument 'seq_offset' must be 1-D with one offset"):
        call(kc, vc, tables, lens, key, value, seq_offset=torch.tensor([1]))
    with pytest.raises(RuntimeError, match=r"argument 'seq_offset' must hold offsets >= 0"):
        call(kc, vc, tables, lens, key, value, seq_offset=torch.tensor([-1, 0]))
    with pytest.raises(RuntimeError, match="argument 'value_cache' must have the dtype of"):
        call(kc, vc.half(), tables, lens, key, value)
    with pytest.raises(RuntimeError, match="argument 'block_tables' must be int32 or int64"):
        call(kc, vc, tables.float(), lens, key, value)


def test_kv_cache_ops_not_differentiable():
    key = torch.randn(2, 1, 16, requires_grad=True)
    kc, vc = torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match="npu_scatter_pa_kv_cache: not differentiable"):
        npu.npu_scatter_pa_kv_cache(key, key, kc, vc, torch.tensor([0, 1]), cache_mode="Norm")
    fk, _ = npu.npu_scatter_pa_kv_cache_functional(key, key, kc, vc, torch.tensor([0, 1]),
                                                   cache_mode="Norm")
    with pytest.raises(RuntimeError, match="npu_scatter_pa_kv_cache_functional: not "
                                           "differentiable"):
        fk.sum().backward()


def test_kv_cache_opcheck():
    key, value, kc, vc, slots = make_scatter_inputs(6, 2, 16, 32, 3, 4, torch.float32, False)
    opcheck(npu.npu_scatter_pa_kv_cache.default,
            [((key, value, kc, vc, slots), {"cache_mode": "Norm"})])
    opcheck(npu.npu_scatter_pa_kv_cache_functional.default,
            [((key, value, kc, vc, slots), {"cache_mode": "Norm"})])
    tables, lens = torch.tensor([[2, 0], [1, 2]]), torch.tensor([5, 3])
    key, value = torch.zeros(8, 2, 16), torch.zeros(8, 2, 32)
    opcheck(npu.npu_gather_pa_kv_cache.default, [((kc, vc, tables, lens, key, value), {})])
    opcheck(npu.npu_gather_pa_kv_cache_functional.default,
            [((kc, vc, tables, lens, key, value), {"seq_offset": torch.tensor([0, 4])})])


def test_kv_cache_compiles_without_graph_breaks():
    def step(key, value, kc, vc, slots, tables, lens, out_k, out_v):
        torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode="Norm")
        torch_npu.npu_gather_pa_kv_cache(kc, vc, tables, lens, out_k, out_v)
        upd = torch_npu.npu_scatter_nd_update(out_k, slots[:1, None].long() % 2, out_k[:1])
        return out_k * 2, out_v + 1, upd

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend=counter)
    for tokens in (5, 7):
        args = [torch.randn(tokens, 2, 16), torch.randn(tokens, 2, 16),
                torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16),
                torch.randperm(32)[:tokens], torch.tensor([[0, 1, 2, 3]]),
                torch.tensor([tokens]), torch.zeros(tokens, 2, 16), torch.zeros(tokens, 2, 16)]
        eager_args = [a.clone() for a in args]
        outs, eager = compiled(*args), step(*eager_args)
        for c, e in zip(outs, eager):
            assert torch.equal(c, e)
        assert torch.equal(args[2], eager_args[2]) and torch.equal(args[7], eager_args[7])
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_portable_path_matches_the_kernels():
    """The ATen compositions (CUDA / XPU / MPS path), forced onto CPU, against the C++ kernels."""
    from opennpu.ops import portable

    torch.manual_seed(3)
    key, value, kc, vc, slots = make_scatter_inputs(9, 2, 16, 32, 3, 8, torch.bfloat16, True)
    slots[2] = -1
    tables = torch.tensor([[2, 0, 7], [1, -1, 2]])
    lens = torch.tensor([0, 11, 20])
    cases = [
        (npu.npu_scatter_nd_update_, (torch.randn(6, 4), torch.tensor([[5], [1]]),
                                      torch.randn(2, 4)), {}),
        (npu.npu_scatter_pa_kv_cache, (key, value, kc, vc, slots), {}),
        (npu.npu_scatter_pa_kv_cache_functional, (key, value, kc, vc, slots),
         {"cache_mode": "PA_NZ"}),
        (npu.npu_gather_pa_kv_cache, (kc, vc, tables, lens, torch.zeros(24, 2, 16, dtype=kc.dtype),
                                      torch.zeros(24, 2, 32, dtype=kc.dtype)),
         {"is_seq_lens_cumsum": True, "seq_offset": torch.tensor([0, 9])}),
        (npu.npu_gather_pa_kv_cache_functional,
         (kc.transpose(1, 2).contiguous().view(3, 8, 2, 16), kc.transpose(1, 2).contiguous()
          .view(3, 8, 2, 16), tables, torch.tensor([5, 9]), torch.zeros(14, 2, 16,
                                                                         dtype=kc.dtype),
          torch.zeros(14, 2, 16, dtype=kc.dtype)), {}),
    ]
    for op, args, kwargs in cases:
        ours = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        port = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        out_k = op(*ours, **kwargs)
        with portable.force():
            out_p = op(*port, **kwargs)
        for a, b in zip(ours, port):
            assert torch.equal(a, b), op
        if isinstance(out_k, tuple):
            for a, b in zip(out_k, out_p):
                assert torch.equal(a, b), op
