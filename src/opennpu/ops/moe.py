"""Mixture of experts: gating, routing, grouped matmul and combine.

A MoE layer on opennpu ops (``opennpu.testing.reference.npu_moe_layer`` runs exactly this)::

    logits = x @ w_gate                                                        # [T, E]
    y, expert_idx, row_idx = npu_moe_gating_top_k_softmax(logits, k=k)         # [T, k] each
    expanded_x, expanded_row_idx, expanded_expert_idx = npu_moe_init_routing(
        x, row_idx, expert_idx, active_num=T)                           # rows sorted by expert
    group_list = npu_moe_compute_expert_tokens(expanded_expert_idx, E)         # cumulative rows
    h = npu_grouped_matmul([expanded_x], [w13], group_list=group_list.long(),
                           split_item=3, group_type=0)[0]                      # [T*k, 2I]
    h = npu_grouped_matmul([npu_swiglu(h)], [w2], group_list=group_list.long(),
                           split_item=3, group_type=0)[0]                      # [T*k, H]
    out = npu_moe_finalize_routing(h, None, None, None, y, expanded_row_idx, expert_idx)

Slot j of token i is "source row" ``j * T + i`` everywhere (``row_idx`` is
``arange(T * k).view(k, T).t()``). None of these ops is differentiable, as in torch_npu (a
backward through them raises a clear error).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._registry import (DIFFERENTIABILITY, mark_backward_op, mark_not_differentiable,
                        register_autograd, register_fake)
from .quant import _qmm_float_kind, _transposed

_ops = torch.ops.npu


def npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None,
                                 k: int = 1):
    """Softmax over the last dim of ``x`` (the E experts), then its top ``k``.

    Returns ``(y, expert_idx, row_idx)``, each ``x.shape[:-1] + (k,)``:

    - ``y``: the k largest probabilities, largest first, in x's dtype (softmax in float32,
      float64 for float64 x, rounded once);
    - ``expert_idx`` (int32): their experts. Ties go to the lower expert index (a stable
      ranking); for float16 / bfloat16 x the ranking compares the rounded probabilities, as
      torch_npu's golden does. Rows where ``finished`` (bool, ``x.shape[:-1]``) is True get
      expert index E (y is still the top k);
    - ``row_idx`` (int32): ``j * rows + i`` for row i and slot j, i.e.
      ``arange(rows * k).view(k, rows).t()``, the row_idx npu_moe_init_routing takes.

    1 <= k <= E (strict mode: k <= 1024, 2-D / 3-D x, fp16 / bf16 / fp32).
    """
    return _ops.npu_moe_gating_top_k_softmax(x, finished, k)


def npu_moe_gating_top_k_softmax_v2(x: torch.Tensor, *, k: int = 1,
                                    finished: torch.Tensor | None = None, renorm: int | None = 0,
                                    output_softmax: bool | None = False):
    """MoE gating, v2: returns ``(y, expert_idx, softmax)``.

    - ``renorm=0``: softmax over the last dim of ``x`` (the E experts) in float32, then its top
      ``k`` ranked as float32 (ties to the lower expert; unlike v1, fp16 / bf16 probabilities are
      not rounded before ranking); ``y`` = those probabilities rounded to x's dtype;
    - ``renorm=1``: the top k of the logits themselves, ``y`` = the softmax of those k values.

    ``expert_idx`` int32 ``x.shape[:-1] + (k,)``, E in rows where ``finished`` (bool,
    ``x.shape[:-1]``) is True. ``softmax``: the whole float32 softmax ``[x.shape]`` when renorm is 0
    and ``output_softmax`` is True, else an empty float32 ``[0]``. 0 <= k <= E. Not differentiable.
    """
    return _ops.npu_moe_gating_top_k_softmax_v2(x, k=k, finished=finished, renorm=renorm,
                                                output_softmax=output_softmax)


def npu_moe_init_routing(x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor,
                         active_num: int):
    """Sorts the (token, slot) pairs by expert and gathers the tokens in that order.

    ``x`` [N, H], ``expert_idx`` [N, k] (int32, or int64), ``row_idx`` [N, k] (int32: a
    permutation of ``range(N * k)``, normally gating's row_idx). The N*k entries of expert_idx
    (row-major) are sorted stably by expert (a counting sort); with ``sorted_row[p]`` the
    row_idx entry that lands at position p, returns:

    - ``expanded_x`` [min(active_num, N) * k, H]: ``x[sorted_row[p] % N]`` (the first rows only
      when active_num < N);
    - ``expanded_row_idx`` [N * k] int32: ``expanded_row_idx[sorted_row[p]] = p``, where each
      source row went (npu_moe_finalize_routing's ``expanded_src_to_dst_row``);
    - ``expanded_expert_idx`` [N * k] int32: the sorted experts.

    x may have any dtype (the rows are copied, not computed).
    """
    return _ops.npu_moe_init_routing(x, row_idx, expert_idx, active_num)


def npu_moe_init_routing_v2(x: torch.Tensor, expert_idx: torch.Tensor, *,
                            scale: torch.Tensor | None = None,
                            offset: torch.Tensor | None = None, active_num: int = -1,
                            expert_capacity: int = -1, expert_num: int = -1,
                            drop_pad_mode: int = 0, expert_tokens_num_type: int = 0,
                            expert_tokens_num_flag: bool = False, quant_mode: int = -1,
                            active_expert_range: Sequence[int] = (), row_idx_type: int = 0,
                            x_dtype: int | None = None):
    """MoE routing v2: sorts the (token, slot) pairs by expert and gathers the tokens.

    ``x`` [N, H], ``expert_idx`` [N, K] (int32 / int64). Pairs whose expert lies in
    ``active_expert_range`` = [start, end) (default ``[0, expert_num)``) are "valid"; the N*K
    pairs are sorted stably by expert, experts below start last. Returns
    ``(expanded_x, expanded_row_idx, expert_tokens, expanded_scale)``:

    - ``drop_pad_mode=0``: ``expanded_x`` ``[min(active_num, N*K), H]`` (N*K rows when
      active_num <= 0) holds ``x[order[p] // K]`` for the first ``min(active_num, valid)``
      positions, zeros after; ``drop_pad_mode=1``: ``[expert_num, expert_capacity, H]``, pair of
      rank j within expert e in slot ``(e - start) * capacity + j`` (pairs past the capacity
      dropped, empty slots 0);
    - ``expanded_row_idx`` [N*K] (expert_idx's dtype): ``row_idx_type=0``: where each pair went
      (-1: not placed), ``1``: the pair at each sorted position;
    - ``expert_tokens`` int64 (zeros unless ``expert_tokens_num_flag``): valid pairs per active
      expert as cumulative counts (type 0), counts (type 1), or ``[expert_num, 2]`` (expert,
      count) rows of the experts with tokens, then zeros (type 2);
    - ``expanded_scale`` float32 [rows of expanded_x]: ``scale[token]`` of each row
      (quant_mode -1 with a ``[N]`` scale), the dynamic quantisation scales (quant_mode 1), else 0.

    ``quant_mode`` 0: int8 ``round(x * scale + offset)`` in float16 steps (one scale and
    offset); 1: int8 dynamic quantisation (npu_dynamic_quant) of the rows with an optional smooth
    ``scale`` [H] / [1, H] or per active expert ``[end - start, H]``. The Ascend950 modes
    (MXFP8, HIF8, MXFP4, FP8, INT4) and ``x_dtype`` are not implemented (clear errors); drop-pad
    supports ``expert_tokens_num_type=1`` and ``row_idx_type=0`` only. Not differentiable.
    """
    return _ops.npu_moe_init_routing_v2(
        x, expert_idx, scale=scale, offset=offset, active_num=active_num,
        expert_capacity=expert_capacity, expert_num=expert_num, drop_pad_mode=drop_pad_mode,
        expert_tokens_num_type=expert_tokens_num_type,
        expert_tokens_num_flag=expert_tokens_num_flag, quant_mode=quant_mode,
        active_expert_range=list(active_expert_range), row_idx_type=row_idx_type,
        x_dtype=x_dtype)


def npu_moe_compute_expert_tokens(sorted_expert_for_source_row: torch.Tensor,
                                  num_expert: int) -> torch.Tensor:
    """Cumulative row counts per expert of sorted expert indices.

    ``out[e]`` = the number of entries ``<= e`` (one past expert e's last row): a
    ``group_list`` for npu_grouped_matmul with ``group_list_type=0``. The input is 1-D int32 (or
    int64), sorted (e.g. npu_moe_init_routing's expanded_expert_idx; an error says where it is
    not); the output has its dtype and ``num_expert`` entries. Experts with no rows repeat the
    previous count; entries >= num_expert (finished rows) are not counted.
    """
    return _ops.npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert)


def npu_moe_finalize_routing(expanded_permuted_rows: torch.Tensor, skip1: torch.Tensor | None,
                             skip2: torch.Tensor | None, bias: torch.Tensor | None,
                             scales: torch.Tensor | None, expanded_src_to_dst_row: torch.Tensor,
                             export_for_source_row: torch.Tensor | None,
                             drop_pad_mode: int | None = 0, k: int | None = 1) -> torch.Tensor:
    """Combines the experts' output rows back into tokens, in one pass:

    ``out[i] = skip1[i] + skip2[i] + sum_j scales[i, j] * (rows[src(i, j)] + bias[e(i, j)])``

    with ``src(i, j) = expanded_src_to_dst_row[j * N + i]`` (drop_pad_mode 0 / 1) or
    ``[i * k + j]`` (2 / 3) and ``e(i, j) = export_for_source_row[i, j]`` (the [N, k] expert_idx;
    needed only with a bias). Every term is optional: no skips = 0, no scales = 1, no bias = 0.
    drop_pad_mode 1 / 3: rows is ``[E, C, H]`` and src -1 marks a dropped slot whose row counts as
    0 (its bias still counts, as in torch_npu's golden). N and k come from scales [N, k]; without
    scales, ``k`` (op-plugin's argument: N = len(expanded_src_to_dst_row) / k) when it is not 1,
    else export_for_source_row, else the skips [N, H], else k = 1.

    rows, skip1, skip2: one dtype (fp16 / bf16 / fp32), the output's; bias [E, H] and scales
    [N, k] may be float32 too. Accumulated in float32 (float64 for float64), rounded once.
    """
    return _ops.npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
                                         expanded_src_to_dst_row, export_for_source_row,
                                         drop_pad_mode, k)


def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor,
                          num_out_tokens: int | None = None, padded_mode: bool = False):
    """MoE dispatch (Megatron's ``permute``): groups the tokens by expert.

    ``tokens`` [T, H]; ``indices`` [T] or [T, K] (int32 / int64): the expert of each of the
    N = T*K (token, slot) pairs. The pairs (row-major) are sorted stably by expert; with
    ``order[p]`` the pair at sorted position p, returns:

    - ``permuted_tokens`` [R, H]: ``tokens[order[p] // K]`` for the first R positions, R =
      ``min(num_out_tokens, N)`` when num_out_tokens > 0, else ``N + num_out_tokens`` (None / 0:
      all N; the dropped pairs are the last ones in expert order);
    - ``sorted_indices`` [N] int32: ``sorted_indices[order[p]] = p``, the position each pair went
      to (what npu_moe_token_unpermute takes).

    Any dtype (rows are copied). Differentiable in ``tokens`` (npu_moe_token_permute_grad_v2).
    ``padded_mode=True`` ([E, capacity] token lists) is not implemented (a clear error says so).
    """
    return _ops.npu_moe_token_permute(tokens, indices, num_out_tokens, padded_mode)


def npu_moe_token_permute_grad(tokens: torch.Tensor, grad_permuted_tokens: torch.Tensor,
                               indices: torch.Tensor, sorted_indices: torch.Tensor,
                               padded_mode: bool = False) -> torch.Tensor:
    """Gradient of npu_moe_token_permute with respect to ``tokens`` ([T, H], tokens' dtype):
    ``grad[t] = sum_k grad_permuted_tokens[sorted_indices[t*K + k]]``, pairs past
    grad_permuted_tokens' rows (dropped by num_out_tokens) adding 0; summed in float32 (float64
    for float64), rounded once. ``tokens`` gives only the shape and dtype, ``indices`` only K."""
    return _ops.npu_moe_token_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices,
                                           padded_mode)


def npu_moe_token_permute_grad_v2(grad_permuted_tokens: torch.Tensor,
                                  sorted_indices: torch.Tensor, tokens_size_0: int,
                                  tokens_dtype: torch.dtype, num_topK: int,
                                  padded_mode: bool = False) -> torch.Tensor:
    """npu_moe_token_permute_grad from tokens' row count and dtype and K, without the tensors
    (what the autograd of npu_moe_token_permute calls: nothing of the forward is kept but
    sorted_indices)."""
    return _ops.npu_moe_token_permute_grad_v2(grad_permuted_tokens, sorted_indices, tokens_size_0,
                                              tokens_dtype, num_topK, padded_mode)


def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs: torch.Tensor | None = None, padded_mode: bool = False,
                            restore_shape: Sequence[int] | None = None) -> torch.Tensor:
    """MoE combine (Megatron's ``unpermute``): the inverse of npu_moe_token_permute, weighted.

    ``out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*K + k]]`` with K =
    ``probs.size(1)`` (``probs`` [T, K]; without probs K = 1, weight 1, T = N). Positions
    ``>= permuted_tokens.size(0)`` are pairs num_out_tokens dropped: they add 0. Output
    ``[N / K, H]`` in permuted_tokens' dtype (fp16 / bf16 / fp32 / fp64); probs may have
    another floating dtype (e.g. float32 with bf16 tokens). Summed in float32 (float64 for
    float64), rounded once. Differentiable in permuted_tokens and probs
    (npu_moe_token_unpermute_grad_v2; permuted_tokens is kept for backward only with probs).
    ``restore_shape`` is used by padded mode only, which is not implemented.
    """
    return _ops.npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode,
                                        restore_shape)


def npu_moe_token_unpermute_grad(permuted_tokens: torch.Tensor,
                                 grad_unpermuted_tokens: torch.Tensor,
                                 sorted_indices: torch.Tensor, probs: torch.Tensor | None = None,
                                 padded_mode: bool = False,
                                 restore_shape: Sequence[int] | None = None):
    """Gradients of npu_moe_token_unpermute: returns ``(grad_permuted_tokens, grad_probs)``.

    ``grad_permuted_tokens[sorted_indices[q]] = probs[q] * grad[q // K]`` (rows no pair points
    at are 0), in permuted_tokens' dtype; ``grad_probs[t, k] = dot(grad[t],
    permuted_tokens[sorted_indices[t*K + k]])`` (0 for dropped pairs) in probs' dtype, summed in
    float32; without probs a 0-dim zero in grad's dtype. sorted_indices must not repeat a
    position (it is a permutation)."""
    return _ops.npu_moe_token_unpermute_grad(permuted_tokens, grad_unpermuted_tokens,
                                             sorted_indices, probs, padded_mode, restore_shape)


def npu_moe_token_unpermute_grad_v2(grad_unpermuted_tokens: torch.Tensor,
                                    sorted_indices: torch.Tensor, permuted_tokens_size_0: int,
                                    permuted_tokens_dtype: torch.dtype,
                                    probs: torch.Tensor | None = None, padded_mode: bool = False,
                                    restore_shape: Sequence[int] | None = None,
                                    permuted_tokens: torch.Tensor | None = None):
    """npu_moe_token_unpermute_grad from permuted_tokens' row count and dtype; the tensor itself
    is needed (for grad_probs) only with probs."""
    return _ops.npu_moe_token_unpermute_grad_v2(grad_unpermuted_tokens, sorted_indices,
                                                permuted_tokens_size_0, permuted_tokens_dtype,
                                                probs, padded_mode, restore_shape,
                                                permuted_tokens)


def npu_moe_token_permute_with_routing_map(tokens: torch.Tensor, routing_map: torch.Tensor, *,
                                           probs: torch.Tensor | None = None,
                                           num_out_tokens: int | None = None,
                                           drop_and_pad: bool = False):
    """MoE dispatch from a routing map ``[T, E]`` (bool / int, nonzero = routed).

    Returns ``(permuted_tokens, permuted_probs, sorted_indices)``:

    - dropless: the routed (token, expert) pairs expert-major, tokens ascending; row p is the
      pair's token and ``permuted_probs[p]`` its ``probs[token, expert]``. ``num_out_tokens``
      (default T) rounded down to a multiple of T must equal ``routing_map.sum()``.
      ``sorted_indices`` [pairs] int32: the row of each pair in token-major order (what
      npu_moe_token_unpermute_with_routing_map takes);
    - ``drop_and_pad``: each expert gets ``capacity = num_out_tokens // E`` slots, filled with
      its routed tokens in ascending order and then, as op-plugin's golden does, with unrouted
      tokens; ``sorted_indices`` [E * capacity] = each slot's token.

    ``permuted_probs`` is an empty ``[0]`` tensor without probs (torch_npu: None).
    Differentiable in tokens and probs (npu_moe_token_permute_with_routing_map_grad).
    """
    return _ops.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
        drop_and_pad=drop_and_pad)


def npu_moe_token_permute_with_routing_map_grad(permuted_token_out_grad, probs_grad,
                                                sorted_indices, routing_map, experts_num: int,
                                                tokens_num: int, drop_and_pad: bool):
    """Gradients of npu_moe_token_permute_with_routing_map: ``(tokens_grad [T, H], probs_grad
    [T, E])``: each token's rows summed (float32 accumulation), each row's probs gradient put
    back at its (token, expert); probs_grad is an empty ``[0]`` when ``probs_grad`` is None."""
    return _ops.npu_moe_token_permute_with_routing_map_grad(
        permuted_token_out_grad, probs_grad, sorted_indices, routing_map, experts_num,
        tokens_num, drop_and_pad)


def npu_moe_token_unpermute_with_routing_map(permuted_tokens: torch.Tensor,
                                             sorted_indices: torch.Tensor,
                                             restore_shape: Sequence[int], *,
                                             probs: torch.Tensor | None = None,
                                             routing_map: torch.Tensor | None = None,
                                             drop_and_pad: bool = False) -> torch.Tensor:
    """MoE combine for npu_moe_token_permute_with_routing_map: ``out`` [restore_shape] =
    ``[T, H]``, each token the sum of its permuted rows weighted by ``probs[token, expert]``
    (1 without probs), in float32, rounded once. Dropless: ``sorted_indices`` gives the row of
    each token-major routed pair (``routing_map`` places the probs; without it every token has
    rows / T pairs); drop_and_pad: ``sorted_indices`` is each slot's token (padding slots
    included, as op-plugin's golden does). Differentiable in permuted_tokens and probs
    (npu_moe_token_unpermute_with_routing_map_grad)."""
    return _ops.npu_moe_token_unpermute_with_routing_map(
        permuted_tokens, sorted_indices, list(restore_shape), probs=probs,
        routing_map=routing_map, drop_and_pad=drop_and_pad)


def _npu_moe_token_unpermute_with_routing_map(permuted_tokens, sorted_indices, restore_shape, *,
                                              probs=None, routing_map=None, drop_and_pad=False):
    """npu_moe_token_unpermute_with_routing_map with what its gradient takes: ``(out,
    out_index, permuted_token_id, permute_probs)``; with drop_and_pad out_index is the stable
    argsort of the slot tokens and permuted_token_id those tokens sorted, dropless both are
    sorted_indices; permute_probs: the probs of the routed pairs token-major (dropless,
    ``probs[routing_map]``) or of each slot (drop_and_pad); empty ``[0]`` without probs."""
    return _ops._npu_moe_token_unpermute_with_routing_map(
        permuted_tokens, sorted_indices, list(restore_shape), probs=probs,
        routing_map=routing_map, drop_and_pad=drop_and_pad)


def npu_moe_token_unpermute_with_routing_map_grad(unpermuted_tokens_grad, out_index,
                                                  permuted_token_id, routing_map,
                                                  permuted_tokens, probs, drop_and_pad: bool,
                                                  restore_shape: Sequence[int]):
    """Gradients of npu_moe_token_unpermute_with_routing_map: ``(permuted_tokens_grad,
    probs_grad)``; probs_grad [T, E] in the gradient's dtype (row dot products in float32), an
    empty ``[0]`` without probs."""
    return _ops.npu_moe_token_unpermute_with_routing_map_grad(
        unpermuted_tokens_grad, out_index, permuted_token_id, routing_map, permuted_tokens,
        probs, drop_and_pad, list(restore_shape))


def npu_grouped_matmul(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], *,
                       bias: Sequence[torch.Tensor] | None = None, scale=None, offset=None,
                       antiquant_scale=None, antiquant_offset=None, per_token_scale=None,
                       group_list: torch.Tensor | Sequence[int] | None = None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item: int = 0,
                       group_type: int | None = None, group_list_type: int = 0,
                       act_type: int = 0, tuning_config: Sequence[int] | None = None,
                       output_dtype: torch.dtype | int | None = None, x_dtype=None,
                       weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None) -> list[torch.Tensor]:
    """Grouped matmul: ``y_g = x_g @ w_g (+ b_g)`` for G groups (float, or A8W8, A8W4,
    weight-only, float8 / MX quantised), returned as a list.

    The groups (G = ``len(weight)``, or E for one 3-D weight ``[E, K, N]``):

    - ``x`` holds G tensors (``group_type`` -1 or 0): group g is ``x[g] @ weight[g]``; with
      ``split_item`` 0 / 1, x[g] may have leading dims (kept in y[g]).
    - ``x`` holds one 2-D ``[M, K]`` and ``group_list`` is given (``group_type=0``): group g is
      the g-th row range of x. ``group_list`` (an int64 Tensor, or a list of ints: the ``.List``
      overload) holds cumulative row ends (``group_list_type=0``, what
      npu_moe_compute_expert_tokens returns) or group sizes (``group_list_type=1``); groups may
      be empty. ``group_list_type=2``: an ``[E, 2]`` Tensor of (group index, rows) pairs (a
      sparse expert list, npu_moe_init_routing_v2's ``expert_tokens_num_type=2``), x's rows in
      the list's order, ``split_item`` 2 / 3; the output keeps x's row order.

    - ``group_type=2`` (grouping on K): one x ``[M, K]`` (may be a transposed view), one weight
      ``[K, N]``; group g is ``x[:, K_g] @ weight[K_g, :]`` over the g-th range of K that
      ``group_list`` cuts; ``split_item`` 2 / 3, no bias; one output ``[G, M, N]``.

    ``split_item`` 0 / 1: one output per group; 2 / 3: one output ``[rows, N]`` with the groups'
    rows in order (all groups share N; rows of x after the last group are 0). ``bias``: one
    ``[N_g]`` tensor per weight tensor, or one ``[E, N]`` with a 3-D weight, in x's dtype or
    float32. Weights may be transposed views (``w.transpose(-1, -2)`` of ``[.., N, K]``).

    dtypes: float16, bfloat16, float32 (and float64); fp16 / bf16 accumulate in float32 (bias
    added in float32) and round once. Each group's GEMM is BLAS (MKL), tiled and spread over the
    threads. ``output_dtype`` must be None or x's dtype there.

    Quantised paths (``group_type`` -1 / 0):

    - A8W8: int8 x and int8 weights, ``scale`` per weight tensor (``[N]`` / ``[1]``, or
      ``[E, N]`` / ``[E, 1]`` for a 3-D weight; float32, bfloat16, or int64 from
      npu_trans_quant_param, whose packed offset applies to int8 outputs), optional
      ``per_token_scale`` per x tensor (float32 ``[M]``), ``bias`` int32 (added to the int32
      accumulator) or float (added after the dequantisation, float outputs only):
      ``y = (x @ w (+ bias_int32)) * scale (* per_token_scale) (+ bias_float)`` computed in fp32
      from the exact int32 product and rounded once to ``output_dtype``: None / int8 (round half
      to even, saturated), float16, bfloat16, float32, or int32 (the raw accumulator + int32 bias;
      then no scale).
    - A16W8 / A16W4 (weight-only): float16 / bfloat16 x, int8 weights or int32 ones packing eight
      int4 codes (npu_convert_weight_to_int4pack's layout; N = 8 x the last dim, or K when the
      weight is a transposed view), ``antiquant_scale`` (x's dtype, ``[N]`` / ``[E, N]`` per
      channel; ``[G, N]`` / ``[E, G, N]`` per group of K / G rows, int4 only) and optional
      ``antiquant_offset`` (same shape): ``y = x @ ((w + offset) * scale) + bias``, the weight
      dequantised into x's dtype as op-plugin's golden does (float16: ``w + offset`` rounded to
      float16 before ``* scale``), then the float GEMM.
    - A8W4: int8 x, int32 weights packing eight int4 codes along N, ``scale`` per group of K
      (``[E, G, N]`` / ``[G, N]``; int64 with the float32 bits in the low 32, or float32),
      ``bias`` float ``[E, N]``, ``per_token_scale``, ``output_dtype`` float16 / bfloat16: each
      group is npu_quant_matmul's A8W4 product (op-plugin's golden: x = 16 hi + lo + 8, float16
      accumulation over the K groups, ``(acc_hi * 16 + acc_lo + bias) * per_token_scale``).

    - float8 / MX (Ascend 950): float8_e4m3fn / float8_e5m2 or float4_e2m1 x and weights (torch's
      float8 / float4_e2m1fn_x2 dtypes, or int8 / uint8 bytes with ``x_dtype`` / ``weight_dtype``
      torch_npu.float4_e2m1fn_x2 = 296, float8_e4m3fn 292, float8_e5m2 291 or torch's codes;
      float4: two codes per byte along the memory-contiguous dim, x ``[M, K / 2]``, weights
      ``[E, K, N / 2]`` or the transpose of a contiguous ``[E, N, K / 2]``), ``output_dtype``
      float16 / bfloat16 / float32, float ``bias``. float8 with per-channel ``scale`` (as A8W8)
      and float32 ``per_token_scale``: ``y = (x @ w) * scale (* per_token_scale) (+ bias)``; MX:
      float8_e8m0 block scales of 32 along K (``scale_dtype`` / ``per_token_scale_dtype``
      torch_npu.float8_e8m0fnu = 293, or float8_e8m0fnu tensors) as npu_dynamic_mx_quant writes
      them, ``per_token_scale`` x's ``[M, ceil(K / 64), 2]``, ``scale`` the weights'
      ``[E, ceil(K / 64), N, 2]`` (a transpose of dims 1 / 2 for transposed weights):
      ``y = (x * scale_x) @ (w * scale_w) (+ bias)``. Each group is npu_quant_matmul's float
      product.

    float4_e1m2 x / weights (``x_dtype`` / ``weight_dtype`` 297) take the MX path like
    float4_e2m1.

    Not implemented (a clear error says so): A4W4 (int4 x), A8W4's ``offset``, hifloat8
    operands, npu_quant_matmul's per-block float32 scales, the ``activation_*`` inputs;
    ``act_type`` (1 relu, 2 gelu tanh, 4 fast_gelu, 5 silu) applies, as on Ascend, to the
    per-token A8W8 path only (float32 values activated, rounded once); ``tuning_config`` is
    accepted and ignored. Off the float8 / MX path ``x_dtype`` / ``weight_dtype`` /
    ``scale_dtype`` / ``per_token_scale_dtype`` must be None or name the tensors' own dtype
    (``torch.quint4x2`` / ``torch.int4`` for int32 int4 weights, ``torch.uint64`` for an int64
    scale).

    ``group_type`` None: this wrapper picks 0 when ``group_list`` splits one x, else -1
    (torch_npu, like ``torch.ops.npu.npu_grouped_matmul`` with a Tensor or no ``group_list``,
    requires it: "Requires manual passing group_type").
    """
    if group_type is None:
        group_type = 0 if group_list is not None and len(x) == 1 else -1
    kwargs = dict(bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                  antiquant_offset=antiquant_offset, per_token_scale=per_token_scale,
                  group_list=group_list, activation_input=activation_input,
                  activation_quant_scale=activation_quant_scale,
                  activation_quant_offset=activation_quant_offset, split_item=split_item,
                  group_type=group_type, group_list_type=group_list_type, act_type=act_type,
                  output_dtype=output_dtype)
    if group_list is not None and not isinstance(group_list, torch.Tensor):
        if x_dtype is not None or weight_dtype is not None or scale_dtype is not None \
                or per_token_scale_dtype is not None:
            raise RuntimeError("npu_grouped_matmul: argument 'x_dtype' / 'weight_dtype' / "
                               "'scale_dtype' / 'per_token_scale_dtype' exist only with a Tensor "
                               "group_list (the .List overload lacks them); got a list group_list")
        return _ops.npu_grouped_matmul.List(list(x), list(weight), **kwargs)
    return _ops.npu_grouped_matmul.default(list(x), list(weight), tuning_config=tuning_config,
                                           x_dtype=x_dtype, weight_dtype=weight_dtype,
                                           scale_dtype=scale_dtype,
                                           per_token_scale_dtype=per_token_scale_dtype, **kwargs)


# ----------------------------------------------------------------------------- fake kernels


@register_fake("npu::npu_moe_gating_top_k_softmax")
def _gating_fake(x, finished=None, k=1):
    shape = (*x.shape[:-1], k)
    return (x.new_empty(shape), x.new_empty(shape, dtype=torch.int32),
            x.new_empty(shape, dtype=torch.int32))


@register_fake("npu::npu_moe_gating_top_k_softmax_v2")
def _gating_v2_fake(x, *, k=1, finished=None, renorm=0, output_softmax=False):
    shape = (*x.shape[:-1], k)
    softmax_shape = x.shape if (renorm or 0) == 0 and output_softmax else (0,)
    return (x.new_empty(shape), x.new_empty(shape, dtype=torch.int32),
            x.new_empty(softmax_shape, dtype=torch.float32))


@register_fake("npu::npu_moe_init_routing")
def _init_routing_fake(x, row_idx, expert_idx, active_num):
    n, h = x.shape
    k = expert_idx.shape[1]
    return (x.new_empty((torch.sym_min(active_num, n) * k, h)),
            x.new_empty((n * k,), dtype=torch.int32), x.new_empty((n * k,), dtype=torch.int32))


@register_fake("npu::npu_moe_init_routing_v2")
def _init_routing_v2_fake(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                          expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                          expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=-1,
                          active_expert_range=(), row_idx_type=0, x_dtype=None):
    n, h = x.shape
    nk = n * expert_idx.shape[1]
    start, end = active_expert_range if len(active_expert_range) == 2 else (0, expert_num)
    experts = expert_num if expert_num > 0 else end
    dtype = x.dtype if quant_mode == -1 else torch.int8
    if drop_pad_mode == 1:
        rows = experts * expert_capacity
        expanded_x = x.new_empty((experts, expert_capacity, h), dtype=dtype)
    else:
        rows = nk if active_num <= 0 else torch.sym_min(active_num, nk)
        expanded_x = x.new_empty((rows, h), dtype=dtype)
    counts = ((experts, 2) if expert_tokens_num_type == 2 else (end - start,))
    return (expanded_x, expert_idx.new_empty((nk,)), x.new_empty(counts, dtype=torch.int64),
            x.new_empty((rows,), dtype=torch.float32))


@register_fake("npu::npu_moe_compute_expert_tokens")
def _compute_expert_tokens_fake(sorted_expert_for_source_row, num_expert):
    return sorted_expert_for_source_row.new_empty((num_expert,))


@register_fake("npu::npu_moe_finalize_routing")
def _finalize_routing_fake(expanded_permuted_rows, skip1, skip2, bias, scales,
                           expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0, k=1):
    if scales is not None:
        n = scales.shape[0]
    elif k is not None and k != 1:
        n = expanded_src_to_dst_row.shape[0] // k
    elif export_for_source_row is not None:
        n = export_for_source_row.shape[0]
    elif skip1 is not None or skip2 is not None:
        n = (skip1 if skip1 is not None else skip2).shape[0]
    else:
        n = expanded_src_to_dst_row.shape[0]
    return expanded_permuted_rows.new_empty((n, expanded_permuted_rows.shape[-1]))


def _group_sizes(values, group_list_type):
    if group_list_type == 1:
        return list(values)
    return [b - a for a, b in zip([0, *values[:-1]], values)]


def _gmm_weight_n(w, fp4=False):
    """N of a 2-D weight view, or of a 3-D [E, K, N] one: int32 weights pack eight int4 codes per
    element along N (along K when the view is the transpose of a contiguous [.., N, K]); float4
    ones (fp4) two per byte, likewise."""
    n = w.shape[-1]
    if fp4:
        return n if _transposed(w) else 2 * n
    if w.dtype != torch.int32:
        return n
    transposed = not w.is_contiguous() and w.stride(-2) == 1 and w.stride(-1) == w.shape[-2]
    return n if transposed else 8 * n


def _gmm_out_dtype(x, output_dtype):
    """The output dtype: output_dtype (a torch.dtype or its ScalarType code), else x's."""
    if output_dtype is None:
        return x[0].dtype
    if isinstance(output_dtype, torch.dtype):
        return output_dtype
    return _GMM_DTYPE_OF_CODE.get(int(output_dtype), x[0].dtype)


# ScalarType codes of the output dtypes npu_grouped_matmul accepts.
_GMM_DTYPE_OF_CODE = {1: torch.int8, 3: torch.int32, 5: torch.float16, 6: torch.float32,
                      7: torch.float64, 15: torch.bfloat16}


def _grouped_matmul_fake(x, weight, group_list, split_item, group_list_type, group_type=None,
                         output_dtype=None, weight_dtype=None):
    dtype = _gmm_out_dtype(x, output_dtype)
    fp4 = _qmm_float_kind(weight[0], weight_dtype) in ("fp4", "fp4_e1m2")
    if group_type == 2:  # grouping on K: one output [G, M, N]
        groups = len(group_list) if not isinstance(group_list, torch.Tensor) \
            else group_list.shape[0]
        return [x[0].new_empty((groups, x[0].shape[0], weight[0].shape[1]), dtype=dtype)]
    single_weight = len(weight) == 1 and weight[0].dim() == 3
    groups = weight[0].shape[0] if single_weight else len(weight)
    n_of = [_gmm_weight_n(weight[0], fp4)] * groups if single_weight \
        else [_gmm_weight_n(w, fp4) for w in weight]
    split_x = group_list is not None and len(x) == 1
    split_item = 0 if split_item is None else split_item
    if split_item >= 2:
        rows = x[0].shape[0] if split_x else sum(t.shape[0] for t in x)
        return [x[0].new_empty((rows, n_of[0] if groups else weight[0].shape[-1]), dtype=dtype)]
    if not split_x:
        return [t.new_empty((*t.shape[:-1], n), dtype=dtype) for t, n in zip(x, n_of)]
    if isinstance(group_list, torch.Tensor):  # the group sizes are data
        ctx = torch.library.get_ctx()
        sizes = [ctx.new_dynamic_size() for _ in range(groups)]
    else:
        sizes = _group_sizes(list(group_list), 0 if group_list_type is None else group_list_type)
    return [x[0].new_empty((m, n), dtype=dtype) for m, n in zip(sizes, n_of)]


@register_fake("npu::npu_grouped_matmul")
def _grouped_matmul_tensor_fake(x, weight, *, bias=None, scale=None, offset=None,
                                antiquant_scale=None, antiquant_offset=None, per_token_scale=None,
                                group_list=None, activation_input=None,
                                activation_quant_scale=None, activation_quant_offset=None,
                                split_item=0, group_type=None, group_list_type=0, act_type=0,
                                tuning_config=None, output_dtype=None, x_dtype=None,
                                weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    return _grouped_matmul_fake(x, weight, group_list, split_item, group_list_type, group_type,
                                output_dtype, weight_dtype)


@register_fake("npu::npu_grouped_matmul.List")
def _grouped_matmul_list_fake(x, weight, *, bias=None, scale=None, offset=None,
                              antiquant_scale=None, antiquant_offset=None, per_token_scale=None,
                              group_list=None, activation_input=None, activation_quant_scale=None,
                              activation_quant_offset=None, split_item=0, group_type=None,
                              group_list_type=0, act_type=0, output_dtype=None):
    return _grouped_matmul_fake(x, weight, group_list, split_item, group_list_type, group_type,
                                output_dtype)


def _permuted_rows(n, num_out_tokens):
    if num_out_tokens is not None and num_out_tokens > 0:
        return torch.sym_min(num_out_tokens, n)
    return n + (num_out_tokens or 0)


@register_fake("npu::npu_moe_token_permute")
def _token_permute_fake(tokens, indices, num_out_tokens=None, padded_mode=False):
    n = indices.numel()
    return (tokens.new_empty((_permuted_rows(n, num_out_tokens), tokens.shape[1])),
            indices.new_empty((n,), dtype=torch.int32))


@register_fake("npu::npu_moe_token_permute_grad")
def _token_permute_grad_fake(tokens, grad_permuted_tokens, indices, sorted_indices,
                             padded_mode=False):
    return grad_permuted_tokens.new_empty((tokens.shape[0], grad_permuted_tokens.shape[1]),
                                          dtype=tokens.dtype)


@register_fake("npu::npu_moe_token_permute_grad_v2")
def _token_permute_grad_v2_fake(grad_permuted_tokens, sorted_indices, tokens_size_0,
                                tokens_dtype, num_topK, padded_mode=False):
    return grad_permuted_tokens.new_empty((tokens_size_0, grad_permuted_tokens.shape[1]),
                                          dtype=tokens_dtype)


@register_fake("npu::npu_moe_token_unpermute")
def _token_unpermute_fake(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                          restore_shape=None):
    rows = probs.shape[0] if probs is not None else sorted_indices.shape[0]
    return permuted_tokens.new_empty((rows, permuted_tokens.shape[1]))


def _unpermute_grad_fake(grad, rows, dtype, probs):
    grad_probs = probs.new_empty(probs.shape) if probs is not None else grad.new_empty(())
    return grad.new_empty((rows, grad.shape[1]), dtype=dtype), grad_probs


@register_fake("npu::npu_moe_token_unpermute_grad")
def _token_unpermute_grad_fake(permuted_tokens, grad_unpermuted_tokens, sorted_indices,
                               probs=None, padded_mode=False, restore_shape=None):
    return _unpermute_grad_fake(grad_unpermuted_tokens, permuted_tokens.shape[0],
                                permuted_tokens.dtype, probs)


@register_fake("npu::npu_moe_token_unpermute_grad_v2")
def _token_unpermute_grad_v2_fake(grad_unpermuted_tokens, sorted_indices, permuted_tokens_size_0,
                                  permuted_tokens_dtype, probs=None, padded_mode=False,
                                  restore_shape=None, permuted_tokens=None):
    return _unpermute_grad_fake(grad_unpermuted_tokens, permuted_tokens_size_0,
                                permuted_tokens_dtype, probs)


# ----------------------------------------------------------------------------- autograd


def _token_permute_setup(ctx, inputs, output):
    tokens, indices, _num_out_tokens, padded_mode = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1])
    ctx.shape = (tokens.shape[0], tokens.dtype, 1 if indices.dim() == 1 else indices.shape[1])
    ctx.padded_mode = padded_mode


def _token_permute_bwd(ctx, grad_permuted, _grad_sorted_indices):
    if not ctx.needs_input_grad[0]:
        return None, None, None, None
    (sorted_indices,) = ctx.saved_tensors
    rows, dtype, k = ctx.shape
    grad = _ops.npu_moe_token_permute_grad_v2(grad_permuted, sorted_indices, rows, dtype, k,
                                              ctx.padded_mode)
    return grad, None, None, None


def _token_unpermute_setup(ctx, inputs, output):
    permuted_tokens, sorted_indices, probs, padded_mode, restore_shape = inputs
    # permuted_tokens is needed for grad_probs only: without probs it is not kept (op-plugin's
    # _npu_moe_token_unpermute keeps it then only on older CANN / Ascend950).
    if probs is not None:
        ctx.save_for_backward(sorted_indices, probs, permuted_tokens)
    else:
        ctx.save_for_backward(sorted_indices)
    ctx.rows = (permuted_tokens.shape[0], permuted_tokens.dtype)
    ctx.args = (padded_mode, restore_shape)


def _token_unpermute_bwd(ctx, grad):
    sorted_indices, *rest = ctx.saved_tensors
    probs, permuted_tokens = rest if rest else (None, None)
    rows, dtype = ctx.rows
    padded_mode, restore_shape = ctx.args
    grad_rows, grad_probs = _ops.npu_moe_token_unpermute_grad_v2(
        grad, sorted_indices, rows, dtype, probs, padded_mode, restore_shape, permuted_tokens)
    return (grad_rows if ctx.needs_input_grad[0] else None, None,
            grad_probs if probs is not None and ctx.needs_input_grad[2] else None, None, None)


register_autograd("npu_moe_token_permute", _token_permute_bwd, _token_permute_setup)
register_autograd("npu_moe_token_unpermute", _token_unpermute_bwd, _token_unpermute_setup)
mark_backward_op("npu_moe_token_permute_grad", "npu_moe_token_permute")
mark_backward_op("npu_moe_token_permute_grad_v2", "npu_moe_token_permute")
mark_backward_op("npu_moe_token_unpermute_grad", "npu_moe_token_unpermute")
mark_backward_op("npu_moe_token_unpermute_grad_v2", "npu_moe_token_unpermute")



@register_fake("npu::npu_moe_token_permute_with_routing_map")
def _permute_with_routing_map_fake(tokens, routing_map, *, probs=None, num_out_tokens=None,
                                   drop_and_pad=False):
    unit = routing_map.shape[1] if drop_and_pad else tokens.shape[0]
    requested = tokens.shape[0] if num_out_tokens is None else num_out_tokens
    rows = requested // unit * unit if unit else 0
    permuted_probs = (probs.new_empty((rows,)) if probs is not None
                      else tokens.new_empty((0,)))
    return (tokens.new_empty((rows, tokens.shape[1])), permuted_probs,
            tokens.new_empty((rows,), dtype=torch.int32))


@register_fake("npu::npu_moe_token_permute_with_routing_map_grad")
def _permute_with_routing_map_grad_fake(permuted_token_out_grad, probs_grad, sorted_indices,
                                        routing_map, experts_num, tokens_num, drop_and_pad):
    g = permuted_token_out_grad
    probs_out = (probs_grad.new_empty((tokens_num, experts_num)) if probs_grad is not None
                 else g.new_empty((0,)))
    return g.new_empty((tokens_num, g.shape[1])), probs_out


def _unpermute_with_routing_map_outputs(permuted_tokens, sorted_indices, restore_shape, probs):
    rows = permuted_tokens.shape[0]
    permute_probs = probs.new_empty((rows,)) if probs is not None \
        else permuted_tokens.new_empty((0,))
    return (permuted_tokens.new_empty((restore_shape[0], restore_shape[1])),
            sorted_indices.new_empty((rows,)), sorted_indices.new_empty((rows,)), permute_probs)


@register_fake("npu::npu_moe_token_unpermute_with_routing_map")
def _unpermute_with_routing_map_fake(permuted_tokens, sorted_indices, restore_shape, *,
                                     probs=None, routing_map=None, drop_and_pad=False):
    return permuted_tokens.new_empty((restore_shape[0], restore_shape[1]))


@register_fake("npu::_npu_moe_token_unpermute_with_routing_map")
def _unpermute_with_routing_map_internal_fake(permuted_tokens, sorted_indices, restore_shape, *,
                                              probs=None, routing_map=None, drop_and_pad=False):
    return _unpermute_with_routing_map_outputs(permuted_tokens, sorted_indices, restore_shape,
                                               probs)


@register_fake("npu::npu_moe_token_unpermute_with_routing_map_grad")
def _unpermute_with_routing_map_grad_fake(unpermuted_tokens_grad, out_index, permuted_token_id,
                                          routing_map, permuted_tokens, probs, drop_and_pad,
                                          restore_shape):
    g = unpermuted_tokens_grad
    probs_grad = g.new_empty(probs.shape) if probs is not None else g.new_empty((0,))
    return g.new_empty((out_index.shape[0], g.shape[1])), probs_grad


# The routing-map ops take probs keyword-only, which register_autograd refuses: an Autograd
# kernel runs them below autograd inside an autograd.Function whose backward calls the grad op.


class _PermuteWithRoutingMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, routing_map, probs, num_out_tokens, drop_and_pad):
        with torch._C._AutoDispatchBelowAutograd():
            out = _ops.npu_moe_token_permute_with_routing_map(
                tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens,
                drop_and_pad=drop_and_pad)
        ctx.mark_non_differentiable(out[2])
        ctx.save_for_backward(out[2], routing_map)
        ctx.sizes = (tokens.shape[0], routing_map.shape[1], drop_and_pad, probs is not None)
        return out

    @staticmethod
    def backward(ctx, grad_permuted, grad_probs, _grad_sorted_indices):
        sorted_indices, routing_map = ctx.saved_tensors
        tokens_num, experts_num, drop_and_pad, has_probs = ctx.sizes
        tokens_grad, probs_grad = _ops.npu_moe_token_permute_with_routing_map_grad(
            grad_permuted, grad_probs if has_probs else None, sorted_indices, routing_map,
            experts_num, tokens_num, drop_and_pad)
        return tokens_grad, None, probs_grad if has_probs else None, None, None


class _UnpermuteWithRoutingMap(torch.autograd.Function):
    """_npu_moe_token_unpermute_with_routing_map: differentiable in its first output, as in
    op-plugin's derivatives.yaml (the public op calls it)."""

    @staticmethod
    def forward(ctx, permuted_tokens, sorted_indices, restore_shape, probs, routing_map,
                drop_and_pad):
        with torch._C._AutoDispatchBelowAutograd():
            out = _ops._npu_moe_token_unpermute_with_routing_map(
                permuted_tokens, sorted_indices, restore_shape, probs=probs,
                routing_map=routing_map, drop_and_pad=drop_and_pad)
        ctx.mark_non_differentiable(*out[1:])
        # op-plugin's gradient gets (out_index, permuted_token_id) with drop_and_pad, else
        # sorted_indices for both
        index = (out[1], out[2]) if drop_and_pad else (sorted_indices, sorted_indices)
        ctx.save_for_backward(*index, routing_map, permuted_tokens if probs is not None else None,
                              probs)
        ctx.args = (drop_and_pad, list(restore_shape))
        return out

    @staticmethod
    def backward(ctx, grad, *_index_grads):
        out_index, token_id, routing_map, permuted_tokens, probs = ctx.saved_tensors
        drop_and_pad, restore_shape = ctx.args
        grad_rows, grad_probs = _ops.npu_moe_token_unpermute_with_routing_map_grad(
            grad, out_index, token_id, routing_map, permuted_tokens, probs, drop_and_pad,
            restore_shape)
        return (grad_rows, None, None, grad_probs.to(probs.dtype) if probs is not None else None,
                None, None)


@torch.library.impl("npu::npu_moe_token_permute_with_routing_map", "Autograd")
def _permute_with_routing_map_autograd(tokens, routing_map, *, probs=None, num_out_tokens=None,
                                       drop_and_pad=False):
    return _PermuteWithRoutingMap.apply(tokens, routing_map, probs, num_out_tokens, drop_and_pad)


@torch.library.impl("npu::_npu_moe_token_unpermute_with_routing_map", "Autograd")
def _unpermute_with_routing_map_internal_autograd(permuted_tokens, sorted_indices,
                                                  restore_shape, *, probs=None, routing_map=None,
                                                  drop_and_pad=False):
    return _UnpermuteWithRoutingMap.apply(permuted_tokens, sorted_indices, restore_shape, probs,
                                          routing_map, drop_and_pad)


@torch.library.impl("npu::npu_moe_token_unpermute_with_routing_map", "Autograd")
def _unpermute_with_routing_map_autograd(permuted_tokens, sorted_indices, restore_shape, *,
                                         probs=None, routing_map=None, drop_and_pad=False):
    return _ops._npu_moe_token_unpermute_with_routing_map(
        permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
        drop_and_pad=drop_and_pad)[0]


DIFFERENTIABILITY["npu_moe_token_permute_with_routing_map"] = "autograd"
DIFFERENTIABILITY["npu_moe_token_unpermute_with_routing_map"] = "autograd"
DIFFERENTIABILITY["_npu_moe_token_unpermute_with_routing_map"] = "autograd"
mark_backward_op("npu_moe_token_permute_with_routing_map_grad",
                 "npu_moe_token_permute_with_routing_map")
mark_backward_op("npu_moe_token_unpermute_with_routing_map_grad",
                 "npu_moe_token_unpermute_with_routing_map")

_INFERENCE_ONLY = "inference only: torch_npu registers no backward for it"
mark_not_differentiable("npu_moe_gating_top_k_softmax", _INFERENCE_ONLY)
mark_not_differentiable("npu_moe_gating_top_k_softmax_v2", _INFERENCE_ONLY)
mark_not_differentiable("npu_moe_init_routing", _INFERENCE_ONLY)
mark_not_differentiable("npu_moe_init_routing_v2", _INFERENCE_ONLY)
mark_not_differentiable("npu_moe_compute_expert_tokens", "integer output")
mark_not_differentiable("npu_moe_finalize_routing", _INFERENCE_ONLY)
mark_not_differentiable("npu_grouped_matmul", "opennpu implements no backward for it yet")

__all__ = ["npu_moe_gating_top_k_softmax", "npu_moe_init_routing",
           "npu_moe_compute_expert_tokens", "npu_moe_finalize_routing", "npu_grouped_matmul",
           "npu_moe_token_permute", "npu_moe_token_permute_grad", "npu_moe_token_permute_grad_v2",
           "npu_moe_token_unpermute", "npu_moe_token_unpermute_grad",
           "npu_moe_token_unpermute_grad_v2", "npu_moe_gating_top_k_softmax_v2",
           "npu_moe_init_routing_v2", "npu_moe_token_permute_with_routing_map",
           "npu_moe_token_permute_with_routing_map_grad",
           "npu_moe_token_unpermute_with_routing_map",
           "_npu_moe_token_unpermute_with_routing_map",
           "npu_moe_token_unpermute_with_routing_map_grad"]
