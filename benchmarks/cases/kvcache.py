"""Paged KV cache write / read (npu_scatter_pa_kv_cache, npu_gather_pa_kv_cache) and
npu_scatter_nd_update: pure copies, so the target is the copy bandwidth (the %copy column).

The native compositions are what PyTorch code writes for the same copy: an index_put_ into the
cache viewed as rows of slots (vLLM's reference reshape_and_cache), and for the read an
index_select into the output with the slot ids precomputed outside the timed call (generous to
the baseline: the op derives them from the block tables on every call). Slots follow vLLM's
allocation: blocks in random order, tokens consecutive within a block.
"""

from __future__ import annotations

import functools

import torch
from opennpu.testing.timing import compiled

from ..common import Case, Timed, randn

npu = torch.ops.npu
HEADS, HEAD_DIM, BLOCK = 8, 128, 128


def _slots(tokens, num_blocks):
    order = torch.randperm(num_blocks)
    t = torch.arange(tokens)
    return (order[t // BLOCK] * BLOCK + t % BLOCK).to(torch.int32)


def native_scatter(key, value, kc, vc, slots):
    s = slots.long()
    kc.view(-1, HEADS, HEAD_DIM).index_put_((s,), key)
    vc.view(-1, HEADS, HEAD_DIM).index_put_((s,), value)
    return kc, vc


def native_scatter_nz(key, value, kc, vc, slots):
    s = slots.long()
    b, o = s // BLOCK, s % BLOCK
    kc[b, :, o, :] = key.reshape(key.shape[0], kc.shape[1], kc.shape[3])
    vc[b, :, o, :] = value.reshape(value.shape[0], vc.shape[1], vc.shape[3])
    return kc, vc


def scatter(tokens, nz, dtype, threads):
    num_blocks = max(2 * tokens // BLOCK, 4)
    key, value = randn(tokens, HEADS, HEAD_DIM, dtype=dtype), randn(tokens, HEADS, HEAD_DIM,
                                                                    dtype=dtype)
    shape = (num_blocks, HEADS * HEAD_DIM // 16, BLOCK, 16) if nz else \
        (num_blocks, BLOCK, HEADS, HEAD_DIM)
    kc, vc = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    slots = _slots(tokens, num_blocks)
    native = native_scatter_nz if nz else native_scatter
    native_compiled = compiled(native, key, value, kc3, vc3, slots, threads=threads)
    mode = "PA_NZ" if nz else "Norm"

    def ours():
        npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode=mode)
        return kc, vc

    return Timed(
        ours=ours,
        baselines={"eager": lambda: native(key, value, kc2, vc2, slots),
                   "compile": lambda: native_compiled(key, value, kc3, vc3, slots)},
        reference=lambda: native(key, value, kc.clone(), vc.clone(), slots),
    )


def native_gather(flat_k, flat_v, ids, key, value):
    torch.index_select(flat_k, 0, ids, out=key)
    torch.index_select(flat_v, 0, ids, out=value)
    return key, value


def gather(tokens, dtype, threads):
    batch = 4
    per_seq = tokens // batch
    num_blocks = batch * (per_seq // BLOCK + 1) + 4
    kc = randn(num_blocks, BLOCK, HEADS, HEAD_DIM, dtype=dtype)
    vc = randn(num_blocks, BLOCK, HEADS, HEAD_DIM, dtype=dtype)
    max_blocks = per_seq // BLOCK + 1
    tables = torch.randperm(num_blocks)[:batch * max_blocks].view(batch, max_blocks).int()
    lens = torch.full((batch,), per_seq, dtype=torch.int32)
    j = torch.arange(per_seq)
    ids = torch.cat([tables[i, j // BLOCK].long() * BLOCK + j % BLOCK for i in range(batch)])
    key = torch.empty(batch * per_seq, HEADS, HEAD_DIM, dtype=dtype)
    value = torch.empty_like(key)
    key2, value2, key3, value3 = (torch.empty_like(key) for _ in range(4))
    flat_k, flat_v = kc.view(-1, HEADS, HEAD_DIM), vc.view(-1, HEADS, HEAD_DIM)
    native_compiled = compiled(native_gather, flat_k, flat_v, ids, key3, value3, threads=threads)

    def ours():
        npu.npu_gather_pa_kv_cache(kc, vc, tables, lens, key, value)
        return key, value

    return Timed(
        ours=ours,
        baselines={"eager": lambda: native_gather(flat_k, flat_v, ids, key2, value2),
                   "compile": lambda: native_compiled(flat_k, flat_v, ids, key3, value3)},
        reference=lambda: (flat_k[ids], flat_v[ids]),
    )


def native_scatter_nd(var, indices, updates):
    return var.clone().index_put_((indices[:, 0].long(),), updates)


def scatter_nd(rows, width, dtype, threads):
    var = randn(4 * rows, width, dtype=dtype)
    indices = torch.randperm(4 * rows)[:rows].view(rows, 1)
    updates = randn(rows, width, dtype=dtype)
    native_compiled = compiled(native_scatter_nd, var, indices, updates, threads=threads)
    return Timed(
        ours=lambda: npu.npu_scatter_nd_update(var, indices, updates),
        baselines={"eager": lambda: native_scatter_nd(var, indices, updates),
                   "compile": lambda: native_compiled(var, indices, updates)},
        reference=lambda: native_scatter_nd(var, indices, updates),
    )


def cases(quick: bool, dtypes):
    token_counts = (256, 8192) if quick else (256, 2048, 8192)
    for dtype in dtypes:
        e = dtype.itemsize
        for tokens in token_counts:
            nbytes = 2 * 2 * tokens * HEADS * HEAD_DIM * e  # key + value read, cache rows written
            for nz in (False, True):
                yield Case("scatter_pa_kv_cache", "fwd",
                           f"{tokens} tok {HEADS}x{HEAD_DIM} {'PA_NZ' if nz else 'Norm'}", dtype,
                           nbytes, functools.partial(scatter, tokens, nz, dtype),
                           ("npu_scatter_pa_kv_cache",))
            yield Case("gather_pa_kv_cache", "fwd", f"{tokens} tok {HEADS}x{HEAD_DIM} Norm", dtype,
                       nbytes, functools.partial(gather, tokens, dtype),
                       ("npu_gather_pa_kv_cache",))
        rows, width = 4096, 2048
        # var copied (read + write) and the updated rows written over it
        yield Case("scatter_nd_update", "fwd", f"{4 * rows}x{width}, {rows} rows", dtype,
                   (2 * 4 * rows + 2 * rows) * width * e,
                   functools.partial(scatter_nd, rows, width, dtype), ("npu_scatter_nd_update",))
