"""Paged KV cache and scatter ops: npu_scatter_nd_update(_), npu_scatter_pa_kv_cache(_functional),
npu_gather_pa_kv_cache(_functional) (Ascend ScatterNdUpdate, ScatterPaKvCache, GatherPaKvCache).

Pure data movement of any dtype (rows copied as bytes, in parallel over tokens / index rows).
Two cache layouts, as torch_npu's ``cache_mode``:

- ``'Norm'``: ``[num_blocks, block_size, a, b]`` (vLLM's), a token's ``a * b`` elements together;
- ``'PA_NZ'``: ``[num_blocks, H // last, block_size, last]``, a token's ``H`` elements in chunks
  of ``last``, chunk c at ``cache[block, c, offset, :]`` (the NZ blocking spelled out in the
  shape; on Ascend such a cache is also cast to FRACTAL_NZ, here that is only recorded).

None of them is differentiable (torch_npu registers no gradient either).
"""

from __future__ import annotations

import torch

from ._registry import mark_not_differentiable, register_fake

_ops = torch.ops.npu


def npu_scatter_nd_update(self, indices, updates):
    """A copy of ``self`` with ``out[tuple(indices[i])] = updates[i]``.

    ``indices`` (int32 / int64) ``[..., a]`` addresses the first ``a`` dims of ``self``;
    ``updates`` has shape ``indices.shape[:-1] + self.shape[a:]`` and self's dtype (any dtype).
    Repeated indices: the last update wins. Out-of-range indices are an error."""
    return _ops.npu_scatter_nd_update(self, indices, updates)


def npu_scatter_nd_update_(self, indices, updates):
    """In-place npu_scatter_nd_update: writes into ``self`` and returns it."""
    return _ops.npu_scatter_nd_update_(self, indices, updates)


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *,
                            compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                            cache_mode="PA_NZ"):
    """Writes token t of ``key`` / ``value`` ([T, N, D_k] / [T, N, D_v]) into slot
    ``slot_mapping[t]`` of ``key_cache`` / ``value_cache`` in place: block
    ``slot // block_size``, offset ``slot % block_size``; a negative slot skips the token.
    ``cache_mode`` ``'Norm'`` (or None) or ``'PA_NZ'`` (the default, as torch_npu) picks the cache
    layout (module docstring). Caches of any dtype matching key / value. Repeated slots: the
    last token wins. The compression scenario (4-D key, ``compress_lens``,
    ``compress_seq_offsets``, ``seq_lens``) is not implemented (clear error)."""
    return _ops.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping,
                                        compress_lens=compress_lens,
                                        compress_seq_offsets=compress_seq_offsets,
                                        seq_lens=seq_lens, cache_mode=cache_mode)


def npu_scatter_pa_kv_cache_functional(key, value, key_cache, value_cache, slot_mapping, *,
                                       compress_lens=None, compress_seq_offsets=None,
                                       seq_lens=None, cache_mode="PA_NZ"):
    """npu_scatter_pa_kv_cache into copies of the caches; returns ``(key_cache, value_cache)``."""
    return _ops.npu_scatter_pa_kv_cache_functional(
        key, value, key_cache, value_cache, slot_mapping, compress_lens=compress_lens,
        compress_seq_offsets=compress_seq_offsets, seq_lens=seq_lens, cache_mode=cache_mode)


def npu_gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                           seq_offset=None, is_seq_lens_cumsum=False):
    """Reads the tokens of each sequence out of a paged cache into ``key`` / ``value`` in place.

    Sequence i has ``seq_lens[i]`` tokens (``seq_lens[i+1] - seq_lens[i]`` with
    ``is_seq_lens_cumsum``); its token j is at block ``block_tables[i, s + j // block_size]``,
    offset ``j % block_size``, where ``s = seq_offset[i] // block_size`` (0 without seq_offset).
    Tokens are written to consecutive rows of key / value, sequence after sequence, up to
    ``key.shape[0]`` rows; later rows keep their values. A block index past the table's end or
    outside ``[0, num_blocks)`` gives zeros (torch_npu's golden). The layout ('Norm' or 'PA_NZ')
    follows from the cache's shape against key's row size ('Norm' where both fit)."""
    return _ops.npu_gather_pa_kv_cache(key_cache, value_cache, block_tables, seq_lens, key, value,
                                       seq_offset=seq_offset,
                                       is_seq_lens_cumsum=is_seq_lens_cumsum)


def npu_gather_pa_kv_cache_functional(key_cache, value_cache, block_tables, seq_lens, key, value,
                                      *, seq_offset=None, is_seq_lens_cumsum=False):
    """npu_gather_pa_kv_cache into copies of ``key`` / ``value``; returns them."""
    return _ops.npu_gather_pa_kv_cache_functional(
        key_cache, value_cache, block_tables, seq_lens, key, value, seq_offset=seq_offset,
        is_seq_lens_cumsum=is_seq_lens_cumsum)


@register_fake("npu::npu_scatter_nd_update")
def _scatter_nd_update_fake(self, indices, updates):
    return torch.empty_like(self, memory_format=torch.contiguous_format)


@register_fake("npu::npu_scatter_nd_update_")
def _scatter_nd_update__fake(self, indices, updates):
    return self


@register_fake("npu::npu_scatter_pa_kv_cache")
def _scatter_pa_kv_cache_fake(key, value, key_cache, value_cache, slot_mapping, *,
                              compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                              cache_mode="PA_NZ"):
    return None


@register_fake("npu::npu_scatter_pa_kv_cache_functional")
def _scatter_pa_kv_cache_functional_fake(key, value, key_cache, value_cache, slot_mapping, *,
                                         compress_lens=None, compress_seq_offsets=None,
                                         seq_lens=None, cache_mode="PA_NZ"):
    return (torch.empty_like(key_cache, memory_format=torch.contiguous_format),
            torch.empty_like(value_cache, memory_format=torch.contiguous_format))


@register_fake("npu::npu_gather_pa_kv_cache")
def _gather_pa_kv_cache_fake(key_cache, value_cache, block_tables, seq_lens, key, value, *,
                             seq_offset=None, is_seq_lens_cumsum=False):
    return None


@register_fake("npu::npu_gather_pa_kv_cache_functional")
def _gather_pa_kv_cache_functional_fake(key_cache, value_cache, block_tables, seq_lens, key,
                                        value, *, seq_offset=None, is_seq_lens_cumsum=False):
    return (torch.empty_like(key, memory_format=torch.contiguous_format),
            torch.empty_like(value, memory_format=torch.contiguous_format))


@torch.library.impl("npu::npu_scatter_nd_update_", "Functionalize")
def _scatter_nd_update__functionalize(self, indices, updates):
    """Functionalization (torch.compile, opcheck) of the in-place op, which returns its aliased
    `self` and so is not auto-functionalized: the out-of-place op, then `self` takes its value."""
    from torch._subclasses.functional_tensor import CppFunctionalizeAPI

    api = CppFunctionalizeAPI()
    for t in (self, indices, updates):
        api.sync(t)
    args = api.unwrap_tensors((self, indices, updates))
    with api.redispatch_to_next():
        out = _ops.npu_scatter_nd_update(*args)
    api.replace(self, out)
    api.commit_update(self)
    return self


_REASON = "data movement into a cache or an index update; torch_npu registers no gradient"
for _name in ("npu_scatter_nd_update", "npu_scatter_nd_update_", "npu_scatter_pa_kv_cache",
              "npu_scatter_pa_kv_cache_functional", "npu_gather_pa_kv_cache",
              "npu_gather_pa_kv_cache_functional"):
    mark_not_differentiable(_name, _REASON)
del _name

__all__ = ["npu_scatter_nd_update", "npu_scatter_nd_update_", "npu_scatter_pa_kv_cache",
           "npu_scatter_pa_kv_cache_functional", "npu_gather_pa_kv_cache",
           "npu_gather_pa_kv_cache_functional"]
