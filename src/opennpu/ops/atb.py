"""torch_npu's ATB ops (``torch.ops.atb``): the calls vllm-ascend makes through
``torch_npu._npu_reshape_and_cache``, ``torch_npu._npu_paged_attention``,
``torch_npu._npu_flash_attention``, ``torch_npu._npu_rotary_embedding`` and
``torch_npu.atb.npu_paged_cache_load``, with op-plugin's schemas.

Each runs an existing family's CPU kernel (csrc/ops/atb/atb.cpp): the paged-cache row copies of
npu_scatter_pa_kv_cache / npu_gather_pa_kv_cache, the decode kernel of
npu_fused_infer_attention_score, npu_fusion_attention's forward and npu_rotary_mul's kernel.
fp16 / bf16 are computed in fp32 and rounded once. Lengths that ATB reads on the host
(``context_lens``, ``seq_len``) may be CPU tensors beside npu ones, as on Ascend.

None of them is differentiable (ATB registers no gradient): they write into their arguments.
"""

from __future__ import annotations

import torch

from ._registry import mark_not_differentiable, register_fake

_ops = torch.ops.atb


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    """vLLM's reshape_and_cache, in place: token t of ``key`` / ``value`` ([T, kv_heads, D_k] /
    [T, kv_heads, D_v]) into slot ``slot_indices[t]`` of ``key_cache`` / ``value_cache`` (block
    ``slot // block_size``, offset ``slot % block_size``; a negative slot skips the token; repeated
    slots: the last token wins). Caches ``[num_blocks, block_size, kv_heads, D]``, or the NZ
    blocking ``[num_blocks, kv_heads * D // 16, block_size, 16]`` (int8: 32) that ATB uses for a
    FRACTAL_NZ cache: the layout follows from the cache's shape ('Norm' where both fit). Any
    dtype, the caches' equal to key's / value's."""
    return _ops._npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)


def _npu_reshape_and_cache_siso(key, key_cache, slot_indices):
    """_npu_reshape_and_cache for a key cache alone (single input, single output)."""
    return _ops._npu_reshape_and_cache_siso(key, key_cache, slot_indices)


def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                         block_table, context_lens, out, *, workspace=None):
    """Decode attention over a paged KV cache, into ``out`` [T, num_heads, D_v].

    Query row t ([T, num_heads, D]) attends to keys / values 0 .. context_lens[t] - 1, key j at
    block ``block_table[t, j // block_size]``, offset ``j % block_size`` of ``key_cache``
    [num_blocks, block_size, num_kv_heads, D] / ``value_cache`` [..., D_v] (D_v may differ from
    D): ``softmax(scale_value * q k^T) v``, query head n reading kv head
    ``n // (num_heads // num_kv_heads)`` (GQA). fp16 / bf16 / fp32, fp32 accumulation, rounded
    once. context_lens 0 gives zeros. ``workspace`` (from _npu_paged_attention_get_workspace) is
    accepted and not needed."""
    return _ops._npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads,
                                     scale_value, block_table, context_lens, out,
                                     workspace=workspace)


def _npu_paged_attention_get_workspace(query, key_cache, value_cache, num_kv_heads, num_heads,
                                       scale_value, block_table, context_lens, out):
    """The workspace _npu_paged_attention may be given under graph capture: validates the
    arguments as _npu_paged_attention does and returns an empty uint8 tensor (the CPU kernel
    needs no workspace)."""
    return _ops._npu_paged_attention_get_workspace(query, key_cache, value_cache, num_kv_heads,
                                                   num_heads, scale_value, block_table,
                                                   context_lens, out)


def _npu_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads,
                         out):
    """Prefill attention (ATB SelfAttention, PA_ENCODER), into ``out`` [T, num_heads, D_v].

    Sequences are packed along the tokens: sequence b is rows ``sum(seq_len[:b])`` ..
    ``+ seq_len[b]`` of ``query`` [T, num_heads, D], ``key`` [T, num_kv_heads, D] and ``value``
    [T, num_kv_heads, D_v]. Logits ``scale_value * q k^T + mask[.., i, j]`` with an additive
    floating ``mask`` [S, S], [B | 1, S, S] or [B | 1, 1 | N, S, S] (S >= the longest sequence;
    -inf entries are skipped keys), GQA, softmax in fp32, output rounded once. Rows past
    ``sum(seq_len)`` are zeros."""
    return _ops._npu_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads,
                                     num_kv_heads, out)


def _npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    """vLLM's rotary_embedding, in place on ``query`` and ``key`` ([T, heads * head_size] or
    [T, heads, head_size], T = positions.numel()). ``cos_sin_cache`` [max_position, rot_dim]
    holds cos | sin halves; the first rot_dim elements of every head rotate with the row at the
    token's position: halves (``is_neox_style``) or interleaved pairs (GPT-J style); the rest of
    the head is left as it is. Computed in fp32, rounded once."""
    return _ops._npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache,
                                      is_neox_style)


def npu_paged_cache_load(key_cache, value_cache, block_table, context_lens, *, seq_starts=None,
                         cumsum=False, key=None, value=None):
    """Reads each sequence's tokens out of a paged cache into consecutive rows (vLLM's
    gather_cache): sequence b has ``context_lens[b]`` tokens (``context_lens[b+1] -
    context_lens[b]`` with ``cumsum``), token j at block ``block_table[b, s + j // block_size]``,
    offset ``j % block_size``, ``s = seq_starts[b] // block_size`` (0 without seq_starts).
    Returns new ``(key, value)`` [tokens, heads, D], or writes into ``key`` / ``value`` when both
    are given (the .out overload)."""
    if key is not None or value is not None:
        return _ops.npu_paged_cache_load.out(key_cache, value_cache, block_table, context_lens,
                                             seq_starts=seq_starts, cumsum=cumsum, key=key,
                                             value=value)
    return _ops.npu_paged_cache_load(key_cache, value_cache, block_table, context_lens,
                                     seq_starts=seq_starts, cumsum=cumsum)


# -- fake kernels --------------------------------------------------------------------------------

@register_fake("atb::_npu_reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_indices):
    return None


@register_fake("atb::_npu_reshape_and_cache_siso")
def _reshape_and_cache_siso_fake(key, key_cache, slot_indices):
    return None


@register_fake("atb::_npu_paged_attention", host_args=("context_lens",))
def _paged_attention_fake(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                          block_table, context_lens, out, *, workspace=None):
    return None


@register_fake("atb::_npu_paged_attention_get_workspace", host_args=("context_lens",))
def _paged_attention_get_workspace_fake(query, key_cache, value_cache, num_kv_heads, num_heads,
                                        scale_value, block_table, context_lens, out):
    return query.new_empty((0,), dtype=torch.uint8)


@register_fake("atb::_npu_flash_attention", host_args=("seq_len",))
def _flash_attention_fake(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads,
                          out):
    return None


@register_fake("atb::_npu_rotary_embedding")
def _rotary_embedding_fake(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    return None


@register_fake("atb::npu_paged_cache_load.out")
def _paged_cache_load_out_fake(key_cache, value_cache, block_table, context_lens, *,
                               seq_starts=None, cumsum=False, key, value):
    return key, value


@register_fake("atb::npu_paged_cache_load")
def _paged_cache_load_fake(key_cache, value_cache, block_table, context_lens, *, seq_starts=None,
                           cumsum=False):
    # The token count is the sum of context_lens' values: a size only the data knows.
    tokens = torch.library.get_ctx().new_dynamic_size()
    return (key_cache.new_empty((tokens, key_cache.shape[2], key_cache.shape[3])),
            value_cache.new_empty((tokens, value_cache.shape[2], value_cache.shape[3])))


@torch.library.impl("atb::npu_paged_cache_load.out", "Functionalize")
def _paged_cache_load_out_functionalize(key_cache, value_cache, block_table, context_lens, *,
                                        seq_starts=None, cumsum=False, key, value):
    """Functionalization (torch.compile, opcheck) of the .out overload, which returns its aliased
    key / value and so is not auto-functionalized: npu_gather_pa_kv_cache_functional (the same
    copy into copies of key / value), then key / value take its results."""
    from torch._subclasses.functional_tensor import CppFunctionalizeAPI

    api = CppFunctionalizeAPI()
    tensors = [t for t in (key_cache, value_cache, block_table, context_lens, seq_starts, key,
                           value) if t is not None]
    for t in tensors:
        api.sync(t)
    kc, vc, bt, cl, ss, k, v = api.unwrap_tensors(
        (key_cache, value_cache, block_table, context_lens, seq_starts, key, value))
    with api.redispatch_to_next():
        new_k, new_v = torch.ops.npu.npu_gather_pa_kv_cache_functional(
            kc, vc, bt, cl, k, v, seq_offset=ss, is_seq_lens_cumsum=cumsum)
    for old, new in ((key, new_k), (value, new_v)):
        api.replace(old, new)
        api.commit_update(old)
    return key, value


ATB_OPS = ("_npu_reshape_and_cache", "_npu_reshape_and_cache_siso", "_npu_paged_attention",
           "_npu_paged_attention_get_workspace", "_npu_flash_attention", "_npu_rotary_embedding",
           "npu_paged_cache_load")

_REASON = "ATB inference op writing into its arguments; torch_npu registers no gradient"
for _name in ATB_OPS:
    mark_not_differentiable(_name, _REASON, namespace="atb")
del _name

__all__ = list(ATB_OPS)
