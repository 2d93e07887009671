"""Fusion attention family: npu_fusion_attention, npu_fusion_attention_grad, their v2 / v3
variants (the same kernels behind other argument forms) and _npu_dropout_gen_mask.

Math (torch_npu's contract): ``out = Dropout(Softmax(Mask(scale * (Q K^T + pse))), keep_prob) V``
per head, with grouped-query attention (each key/value head serves head_num / Nkv query heads).
The CPU kernel is flash-style: tiles of query rows against tiles of keys with an online softmax,
BLAS GEMMs for the products, fp32 accumulation for fp16/bf16, and O(S * D) memory.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

from ._registry import (DIFFERENTIABILITY, _register_mutable_overload_kernel, acc_dtype,
                        accepts_input_keyword, mark_backward_op, register_autograd, register_fake)

_ops = torch.ops.npu

MAX_TOKENS = 2147483647


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=MAX_TOKENS,
                         next_tockens=MAX_TOKENS, inner_precise=0, prefix=None,
                         actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, softmax_layout="", sink=None,
                         dropout_mask=None, seed=0, offset=0):
    """Fused attention ``Dropout(Softmax(Mask(scale * (Q K^T + pse)))) V``, torch_npu's contract.

    Layouts (``input_layout``): ``BSH`` ``[B, S, N*D]``, ``SBH`` ``[S, B, N*D]``, ``BSND``,
    ``BNSD`` and ``TND`` ``[T, N, D]`` (variable length: ``actual_seq_qlen`` /
    ``actual_seq_kvlen`` are cumulative sequence ends without the leading 0, e.g. ``[2, 4, 6]``).
    ``head_num`` is the query head count; key/value may have fewer heads (GQA/MQA) and value a
    smaller head size.

    Masks: ``atten_mask`` is bool/uint8 with True = masked out, ``[B|1, N|1, Sq, Skv]`` or
    ``[Sq, Skv]``. ``sparse_mode`` 0: the mask plus the band ``i - pre_tockens <= j <= i +
    next_tockens``; 1: the mask alone; 2: causal from the top-left; 3: causal aligned to the
    bottom-right (``j <= i + Skv - Sq``); 4: the band with its origin at the bottom-right;
    5/6: bottom-right causal with the first ``prefix[b]`` keys always visible (5 also reads the
    mask); 7/8 (TND): split long sequences, causal bottom-right / top-left with one band sequence
    (the last / first non-empty one). In modes 2-4 and 6-8 the mask is the compressed
    placeholder and is not read. Without ``atten_mask`` every key is visible (as in torch_npu).
    A row that sees no key gives zeros.

    ``pse`` ``[B|1, N|1, Sq|1, Skv]`` is added before scaling. ``sink`` (float32 ``[head_num]``)
    adds one logit per head to every softmax row. ``keep_prob < 1`` drops probabilities with
    opennpu's Philox generator (``opennpu.manual_seed``): the returned ``seed`` and ``offset``
    regenerate the same mask in the backward and in ``_npu_dropout_gen_mask``.

    Returns ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``:
    attention_out in query's dtype and layout (head size of value); softmax_max / softmax_sum
    float32 (float64 for float64 inputs) ``[B, N, Sq, 8]`` (TND ``[T, N, 8]``) with the row max of the logits and the row sum
    of ``exp(logit - max)``, 8 copies each; softmax_out empty; numels the number of mask bits.
    On CUDA, calls that fit flash attention run ATen's flash kernels and return the row's
    log-sum-exp as softmax_max with softmax_sum = 1, the same normaliser ``max + log(sum)``
    (opennpu.ops.flash_route lists what fits).
    Differentiable in query, key, value, pse and sink.
    """
    return _ops.npu_fusion_attention(
        query, key, value, head_num, input_layout, pse, padding_mask, atten_mask, scale,
        keep_prob, pre_tockens, next_tockens, inner_precise, prefix, actual_seq_qlen,
        actual_seq_kvlen, sparse_mode, gen_mask_parallel, sync, softmax_layout, sink,
        dropout_mask, seed, offset)


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None,
                              padding_mask=None, atten_mask=None, softmax_max=None,
                              softmax_sum=None, softmax_in=None, attention_in=None,
                              scale_value=1.0, keep_prob=1.0, pre_tockens=MAX_TOKENS,
                              next_tockens=MAX_TOKENS, inner_precise=0, seed=0, offset=0,
                              numels=0, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                              sparse_mode=0, gen_mask_parallel=True, sync=False,
                              softmax_layout="", sink=None):
    """Gradient of npu_fusion_attention: returns ``(dq, dk, dv, dpse, dsink)``.

    P is recomputed from ``softmax_max`` / ``softmax_sum``; ``attention_in`` is the forward's
    output (if any of the three is missing the forward is recomputed). ``seed``, ``offset`` and
    ``numels`` are the forward's, so dropout regenerates the same mask. dk/dv are summed over
    each query-head group; dpse is reduced to pse's shape (empty without pse), dsink is float32
    ``[head_num]`` (empty without sink). Math: ``dS = P * (dP - rowsum(dO * O)) * scale``,
    ``dQ = dS K``, ``dK = dS^T Q``, ``dV = P'^T dO`` (P' with the dropout mask / keep_prob).
    """
    return _ops.npu_fusion_attention_grad(
        query, key, value, dy, head_num, input_layout, pse=pse, padding_mask=padding_mask,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
        softmax_in=softmax_in, attention_in=attention_in, scale_value=scale_value,
        keep_prob=keep_prob, pre_tockens=pre_tockens, next_tockens=next_tockens,
        inner_precise=inner_precise, seed=seed, offset=offset, numels=numels, prefix=prefix,
        actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
        sparse_mode=sparse_mode, gen_mask_parallel=gen_mask_parallel, sync=sync,
        softmax_layout=softmax_layout, sink=sink)


def npu_fusion_attention_v2(query, key, value, head_num, input_layout, **kwargs):
    """npu_fusion_attention with torch_npu's v2 arguments (keyword-only after ``input_layout``:
    pse, padding_mask, atten_mask, query_rope, key_rope, scale, keep_prob, pre_tokens,
    next_tokens, inner_precise, prefix, actual_seq_qlen, actual_seq_kvlen, sparse_mode,
    gen_mask_parallel, sync, pse_type, q_start_idx, kv_start_idx, softmax_layout, sink,
    dropout_mask, seed, offset; the schema's defaults apply to those not given).

    ``pre_tokens`` / ``next_tokens`` are v1's ``pre_tockens`` / ``next_tockens``.
    ``query_rope`` / ``key_rope`` (MLA, given together): q/k-shaped tensors with their own head
    size Dr in the same layout; the scores become ``q k^T + q_rope k_rope^T`` (one product of
    the per-head concatenations ``[q, q_rope]`` and ``[k, k_rope]``). ``pse_type`` 1 (default)
    is v1's ``scale * (q k^T + pse)``; 0 is ``scale * q k^T + pse``; 2 and 3 (ALiBi generated
    from slopes, with ``q_start_idx`` / ``kv_start_idx``) raise. Returns v1's seven outputs.
    Differentiable in query, key, value, pse, query_rope, key_rope and sink.
    """
    return _ops.npu_fusion_attention_v2(query, key, value, head_num, input_layout, **kwargs)


def npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout, **kwargs):
    """Gradient of npu_fusion_attention_v2: ``(dq, dk, dv, dpse, dq_rope, dk_rope, dsink)``.

    Arguments as npu_fusion_attention_grad's with v2's names (``pre_tokens``, ``next_tokens``,
    ``query_rope``, ``key_rope``, ``pse_type``). dq_rope / dk_rope have the shapes of query_rope
    / key_rope (empty without rope), dpse of pse (empty without pse), dsink float32
    ``[head_num]`` (empty without sink).
    """
    return _ops.npu_fusion_attention_grad_v2(query, key, value, dy, head_num, input_layout,
                                             **kwargs)


def npu_fusion_attention_v3(query, key, value, head_num, input_layout, *args, **kwargs):
    """npu_fusion_attention for graph capture: ``actual_seq_qlen`` / ``actual_seq_kvlen`` are 1-D
    integer tensors in host memory (CPU, or npu) and ``seed`` / ``offset`` come back as
    one-element int64 tensors on query's device (zeros without dropout), so the outputs are
    ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset)``. No
    ``dropout_mask`` argument and no ``numels`` output. ``npu_fusion_attention_v3.out`` writes
    the six outputs into ``attention_score``, ``softmax_max``, ``softmax_sum``, ``softmax_out``,
    ``seed``, ``offset`` (its ``workspace`` is unused). Differentiable in query, key, value, pse
    and sink through npu_fusion_attention_grad_v3.
    """
    return _ops.npu_fusion_attention_v3(query, key, value, head_num, input_layout, *args,
                                        **kwargs)


def npu_fusion_attention_grad_v3(query, key, value, dy, head_num, input_layout, **kwargs):
    """Gradient of npu_fusion_attention_v3: ``(dq, dk, dv, dpse, dsink)``. ``seed`` / ``offset``
    are v3's tensors; ``actual_seq_qlen`` / ``actual_seq_kvlen`` host tensors; no ``numels``.
    ``npu_fusion_attention_grad_v3.out`` writes ``dq, dk, dv, dpse, dsink`` (``workspace``
    unused)."""
    return _ops.npu_fusion_attention_grad_v3(query, key, value, dy, head_num, input_layout,
                                             **kwargs)


def _v3_out(query, key, value, head_num, input_layout, *args, **kwargs):
    """The ``.out`` overload: keyword outputs attention_score, softmax_max, softmax_sum,
    softmax_out, seed, offset."""
    return _ops.npu_fusion_attention_v3.out(query, key, value, head_num, input_layout, *args,
                                            **kwargs)


def _grad_v3_out(query, key, value, dy, head_num, input_layout, **kwargs):
    """The ``.out`` overload: keyword outputs dq, dk, dv, dpse, dsink."""
    return _ops.npu_fusion_attention_grad_v3.out(query, key, value, dy, head_num, input_layout,
                                                 **kwargs)


npu_fusion_attention_v3.out = _v3_out
npu_fusion_attention_grad_v3.out = _grad_v3_out


@accepts_input_keyword
def _npu_dropout_gen_mask(self, size, p, seed, offset, *, parallel=True, sync=None):
    """Bit-packed dropout keep mask of ``prod(size)`` elements with drop probability ``p``.

    Bit k (little-endian within each uint8) is 1 when element k is kept. The bits come from the
    Philox stream ``(seed, offset)``, the one npu_fusion_attention draws from, so after
    ``opennpu.manual_seed(s)`` the first attention with dropout uses exactly
    ``_npu_dropout_gen_mask(q, [numels], 1 - keep_prob, s, 0)``. Length: ``ceil(n / 128) * 16``
    bytes (padding bits are 0). ``self`` only gives the device.
    """
    return _ops._npu_dropout_gen_mask(self, size, p, seed, offset, parallel=parallel, sync=sync)


def manual_seed(seed: int) -> None:
    """Seeds opennpu's Philox generator (dropout in fused ops) and restarts it at offset 0."""
    torch.ops.opennpu.manual_seed(int(seed))


def initial_seed() -> int:
    """The seed of opennpu's Philox generator."""
    return torch.ops.opennpu.initial_seed()


def get_rng_state() -> tuple[int, int]:
    """``(seed, offset)`` of the next draw of opennpu's Philox generator."""
    seed, offset = torch.ops.opennpu.get_rng_state()
    return seed, offset


def set_rng_state(state) -> None:
    """Restores a ``(seed, offset)`` pair from get_rng_state."""
    seed, offset = state
    torch.ops.opennpu.set_rng_state(int(seed), int(offset))


# ----------------------------------------------------------------------------- shapes

_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


def _shapes(query, key, value, head_num, layout):
    """(attention_out shape, softmax stats shape) for the fake kernels."""
    layout = layout.upper()
    if layout in ("BSH", "SBH"):
        head_dim = query.shape[2] // head_num
        kv_heads = key.shape[2] // head_dim
        value_dim = value.shape[2] // kv_heads
        out = [query.shape[0], query.shape[1], head_num * value_dim]
        batch, seq = (query.shape[0], query.shape[1]) if layout == "BSH" else (query.shape[1], query.shape[0])
        return out, [batch, head_num, seq, 8]
    out = list(query.shape[:-1]) + [value.shape[-1]]
    if layout == "BSND":
        return out, [query.shape[0], head_num, query.shape[1], 8]
    if layout == "BNSD":
        return out, [query.shape[0], head_num, query.shape[2], 8]
    return out, [query.shape[0], head_num, 8]  # TND


def _numels(query, key, head_num, layout, actual_seq_qlen, actual_seq_kvlen):
    layout = layout.upper()
    if layout == "TND":
        total, prev_q, prev_k = 0, 0, 0
        for end_q, end_k in zip(actual_seq_qlen, actual_seq_kvlen):
            if end_q < prev_q or end_k < prev_k:  # trailing zeros: batches not computed
                break
            total += (end_q - prev_q) * (end_k - prev_k)
            prev_q, prev_k = end_q, end_k
        return head_num * total
    seq_dim = {"BSH": 1, "SBH": 0, "BSND": 1, "BNSD": 2}[layout]
    batch_dim = 1 if layout == "SBH" else 0
    return query.shape[batch_dim] * head_num * query.shape[seq_dim] * key.shape[seq_dim]


# ----------------------------------------------------------------------------- fake kernels


@register_fake("npu::npu_fusion_attention")
def _fusion_attention_fake(query, key, value, head_num, input_layout, pse=None,
                           padding_mask=None, atten_mask=None, scale=1.0, keep_prob=1.0,
                           pre_tockens=MAX_TOKENS, next_tockens=MAX_TOKENS, inner_precise=0,
                           prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                           sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout="",
                           sink=None, dropout_mask=None, seed=0, offset=0):
    out_shape, stats_shape = _shapes(query, key, value, head_num, input_layout)
    if keep_prob < 1.0 and dropout_mask is None:
        # The generator's state is only known when the op runs.
        ctx = torch.library.get_ctx()
        seed, offset = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    numels = _numels(query, key, head_num, input_layout, actual_seq_qlen, actual_seq_kvlen)
    stats_dtype = acc_dtype(query.dtype)  # float32 (float64 for float64 inputs)
    return (
        query.new_empty(out_shape),
        query.new_empty(stats_shape, dtype=stats_dtype),
        query.new_empty(stats_shape, dtype=stats_dtype),
        query.new_empty([0]),
        seed,
        offset,
        numels,
    )


@register_fake("npu::npu_fusion_attention_grad")
def _fusion_attention_grad_fake(query, key, value, dy, head_num, input_layout, *, pse=None,
                                sink=None, **kwargs):
    return (
        query.new_empty(query.shape),
        key.new_empty(key.shape),
        value.new_empty(value.shape),
        pse.new_empty(pse.shape) if pse is not None else query.new_empty([0]),
        sink.new_empty(sink.shape) if sink is not None else query.new_empty([0], dtype=torch.float32),
    )


@register_fake("npu::npu_fusion_attention_v2")
def _fusion_attention_v2_fake(query, key, value, head_num, input_layout, *, keep_prob=1.0,
                              actual_seq_qlen=None, actual_seq_kvlen=None, dropout_mask=None,
                              seed=0, offset=0, **_):
    return _fusion_attention_fake(query, key, value, head_num, input_layout, keep_prob=keep_prob,
                                  actual_seq_qlen=actual_seq_qlen,
                                  actual_seq_kvlen=actual_seq_kvlen, dropout_mask=dropout_mask,
                                  seed=seed, offset=offset)


@register_fake("npu::npu_fusion_attention_grad_v2")
def _fusion_attention_grad_v2_fake(query, key, value, dy, head_num, input_layout, *, pse=None,
                                   query_rope=None, key_rope=None, sink=None, **_):
    dq, dk, dv, dpse, dsink = _fusion_attention_grad_fake(query, key, value, dy, head_num,
                                                          input_layout, pse=pse, sink=sink)
    empty = query.new_empty([0])
    return (dq, dk, dv, dpse,
            query_rope.new_empty(query_rope.shape) if query_rope is not None else empty,
            key_rope.new_empty(key_rope.shape) if key_rope is not None else empty, dsink)


def _v3_fake_outputs(query, key, value, head_num, input_layout):
    out_shape, stats_shape = _shapes(query, key, value, head_num, input_layout)
    stats_dtype = acc_dtype(query.dtype)
    return (query.new_empty(out_shape), query.new_empty(stats_shape, dtype=stats_dtype),
            query.new_empty(stats_shape, dtype=stats_dtype), query.new_empty([0]),
            query.new_empty([1], dtype=torch.int64), query.new_empty([1], dtype=torch.int64))


@register_fake("npu::npu_fusion_attention_v3")
def _fusion_attention_v3_fake(query, key, value, head_num, input_layout, *args, **kwargs):
    return _v3_fake_outputs(query, key, value, head_num, input_layout)


def _resized(outs, like):
    """The .out overloads resize their outputs to the results' shapes, as the kernels do."""
    for out, want in zip(outs, like):
        if out.shape != want.shape:
            out.resize_(want.shape)
    return tuple(outs)


@register_fake("npu::npu_fusion_attention_v3.out")
def _fusion_attention_v3_out_fake(query, key, value, head_num, input_layout, *args,
                                  attention_score, softmax_max, softmax_sum, softmax_out, seed,
                                  offset, **kwargs):
    return _resized((attention_score, softmax_max, softmax_sum, softmax_out, seed, offset),
                    _v3_fake_outputs(query, key, value, head_num, input_layout))


@register_fake("npu::npu_fusion_attention_grad_v3")
def _fusion_attention_grad_v3_fake(query, key, value, dy, head_num, input_layout, *, pse=None,
                                   sink=None, **_):
    return _fusion_attention_grad_fake(query, key, value, dy, head_num, input_layout, pse=pse,
                                       sink=sink)


@register_fake("npu::npu_fusion_attention_grad_v3.out")
def _fusion_attention_grad_v3_out_fake(query, key, value, dy, head_num, input_layout, *, dq, dk,
                                       dv, dpse, dsink, pse=None, sink=None, **_):
    return _resized((dq, dk, dv, dpse, dsink), _fusion_attention_grad_fake(
        query, key, value, dy, head_num, input_layout, pse=pse, sink=sink))


@register_fake("npu::_npu_dropout_gen_mask.Tensor")
def _dropout_gen_mask_fake(self, size, p, seed, offset, *, parallel=True, sync=None):
    numels = 1
    for s in size:
        numels *= s
    return self.new_empty([(numels + 127) // 128 * 16], dtype=torch.uint8)


# ----------------------------------------------------------------------------- autograd

# Names of the schema's arguments, in the order of `inputs`.
_ARGS = tuple(arg.name for arg in _ops.npu_fusion_attention.default._schema.arguments)


def _fusion_attention_setup(ctx, inputs, output):
    args = dict(zip(_ARGS, inputs))
    out, softmax_max, softmax_sum, _, seed, offset, numels = output
    ctx.args = {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}
    ctx.args.update(seed=seed, offset=offset, numels=numels)
    ctx.has_pse = args["pse"] is not None
    ctx.has_sink = args["sink"] is not None
    # The gradient op regenerates the dropout mask from (seed, offset): a mask the caller passed in
    # is kept to check, in backward, that it is the one (seed, offset) gives.
    user_mask = args["dropout_mask"] if args["keep_prob"] < 1.0 else None
    ctx.save_for_backward(args["query"], args["key"], args["value"], args["pse"],
                          args["atten_mask"], args["sink"], out, softmax_max, softmax_sum, user_mask)


def _check_user_dropout_mask(q, mask, a) -> None:
    """Backward regenerates the keep mask from (seed, offset); a caller's dropout_mask that is not
    that mask would give gradients of a different forward, so it is an error, not a silent one.
    Under tracing (torch.compile, opcheck) the mask's bits are not known, and the check is left out.
    """
    if is_fake(mask):
        return
    numels = int(a["numels"])
    regenerated = _ops._npu_dropout_gen_mask(q, [numels], 1.0 - a["keep_prob"], int(a["seed"]),
                                             int(a["offset"]))
    full_bytes, tail_bits = divmod(numels, 8)
    same = torch.equal(mask[:full_bytes], regenerated[:full_bytes])
    if same and tail_bits:
        low = (1 << tail_bits) - 1
        same = int(mask[full_bytes]) & low == int(regenerated[full_bytes]) & low
    if not same:
        raise RuntimeError(
            "npu_fusion_attention: backward needs the dropout mask that (seed, offset) = "
            f"({int(a['seed'])}, {int(a['offset'])}) generates (npu_fusion_attention_grad "
            "regenerates it), but the dropout_mask passed to the forward differs; pass "
            "_npu_dropout_gen_mask(query, [numels], 1 - keep_prob, seed, offset) with the same seed "
            "and offset, or let the op draw its own mask (dropout_mask=None)")


def _input_grads(ctx, names, dq, dk, dv, dpse, dsink):
    """One gradient per schema argument (`names`): q, k, v, and pse / sink where given."""
    grads = [None] * len(names)
    grads[0], grads[1], grads[2] = dq, dk, dv
    if ctx.has_pse:
        grads[names.index("pse")] = dpse
    if ctx.has_sink:
        grads[names.index("sink")] = dsink
    return tuple(grads)


def _fusion_attention_backward(ctx, grad_out, *unused_grads):
    q, k, v, pse, atten_mask, sink, out, softmax_max, softmax_sum, user_mask = ctx.saved_tensors
    a = ctx.args
    if user_mask is not None:
        _check_user_dropout_mask(q, user_mask, a)
    dq, dk, dv, dpse, dsink = _ops.npu_fusion_attention_grad(
        q, k, v, grad_out.contiguous(), a["head_num"], a["input_layout"], pse=pse,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
        attention_in=out, scale_value=a["scale"], keep_prob=a["keep_prob"],
        pre_tockens=a["pre_tockens"], next_tockens=a["next_tockens"],
        inner_precise=a["inner_precise"], seed=a["seed"], offset=a["offset"],
        numels=a["numels"], prefix=a["prefix"], actual_seq_qlen=a["actual_seq_qlen"],
        actual_seq_kvlen=a["actual_seq_kvlen"], sparse_mode=a["sparse_mode"],
        softmax_layout=a["softmax_layout"], sink=sink)
    return _input_grads(ctx, _ARGS, dq, dk, dv, dpse, dsink)


register_autograd("npu_fusion_attention", _fusion_attention_backward, _fusion_attention_setup)
mark_backward_op("npu_fusion_attention_grad", "npu_fusion_attention")


# v3: tensor sequence lengths and seed / offset, differentiable through npu_fusion_attention_grad_v3.
_V3_ARGS = tuple(arg.name for arg in _ops.npu_fusion_attention_v3.default._schema.arguments)


def _fusion_attention_v3_setup(ctx, inputs, output):
    args = dict(zip(_V3_ARGS, inputs))
    out, softmax_max, softmax_sum, _, seed, offset = output
    ctx.args = {k: v for k, v in args.items() if not isinstance(v, torch.Tensor)}
    ctx.has_pse = args["pse"] is not None
    ctx.has_sink = args["sink"] is not None
    ctx.save_for_backward(args["query"], args["key"], args["value"], args["pse"],
                          args["atten_mask"], args["sink"], args["actual_seq_qlen"],
                          args["actual_seq_kvlen"], out, softmax_max, softmax_sum, seed, offset)


def _fusion_attention_v3_backward(ctx, grad_out, *unused_grads):
    (q, k, v, pse, atten_mask, sink, qlen, kvlen, out, softmax_max, softmax_sum, seed,
     offset) = ctx.saved_tensors
    a = ctx.args
    dq, dk, dv, dpse, dsink = _ops.npu_fusion_attention_grad_v3(
        q, k, v, grad_out.contiguous(), a["head_num"], a["input_layout"], pse=pse,
        atten_mask=atten_mask, softmax_max=softmax_max, softmax_sum=softmax_sum,
        attention_in=out, scale_value=a["scale"], keep_prob=a["keep_prob"],
        pre_tockens=a["pre_tockens"], next_tockens=a["next_tockens"],
        inner_precise=a["inner_precise"], seed=seed, offset=offset, prefix=a["prefix"],
        actual_seq_qlen=qlen, actual_seq_kvlen=kvlen, sparse_mode=a["sparse_mode"],
        softmax_layout=a["softmax_layout"], sink=sink)
    return _input_grads(ctx, _V3_ARGS, dq, dk, dv, dpse, dsink)


register_autograd("npu_fusion_attention_v3", _fusion_attention_v3_backward,
                  _fusion_attention_v3_setup)
_register_mutable_overload_kernel(
    "npu::npu_fusion_attention_v3.out", _ops.npu_fusion_attention_v3.out,
    "npu_fusion_attention_v3.out: not differentiable (it writes its outputs; call "
    "npu_fusion_attention_v3 for gradients)")
mark_backward_op("npu_fusion_attention_grad_v3", "npu_fusion_attention_v3")
_register_mutable_overload_kernel(
    "npu::npu_fusion_attention_grad_v3.out", _ops.npu_fusion_attention_grad_v3.out,
    "npu_fusion_attention_grad_v3.out: not differentiable (it writes its outputs)")


# v2: keyword-only tensors (pse, query_rope, ...), which torch.library.register_autograd refuses:
# an Autograd kernel around a torch.autograd.Function, differentiable through
# npu_fusion_attention_grad_v2.
_V2 = _ops.npu_fusion_attention_v2.default
_V2_SCHEMA = _V2._schema
_V2_DIFFERENTIABLE = ("query", "key", "value", "pse", "query_rope", "key_rope", "sink")


def _bind(schema, args, kwargs):
    """{argument name: value} of a call, defaults filled in."""
    bound = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value
    return bound


class _FusionAttentionV2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bound, *differentiable):
        with torch._C._AutoDispatchBelowAutograd():
            result = _V2(**bound)
        out, softmax_max, softmax_sum, softmax_out, seed, offset, numels = result
        ctx.args = {k: v for k, v in bound.items() if not isinstance(v, torch.Tensor)}
        ctx.args.update(seed=seed, offset=offset, numels=numels)
        ctx.present = tuple(bound[name] is not None for name in _V2_DIFFERENTIABLE)
        user_mask = bound["dropout_mask"] if bound["keep_prob"] < 1.0 else None
        ctx.save_for_backward(*(bound[name] for name in _V2_DIFFERENTIABLE),
                              bound["atten_mask"], out, softmax_max, softmax_sum, user_mask)
        ctx.mark_non_differentiable(softmax_max, softmax_sum, softmax_out)
        return out, softmax_max, softmax_sum, softmax_out, seed, offset, numels

    @staticmethod
    def backward(ctx, grad_out, *unused_grads):
        q, k, v, pse, q_rope, k_rope, sink, atten_mask, out, smax, ssum, user_mask = \
            ctx.saved_tensors
        a = ctx.args
        if user_mask is not None:
            _check_user_dropout_mask(q, user_mask, a)
        grads = _ops.npu_fusion_attention_grad_v2(
            q, k, v, grad_out.contiguous(), a["head_num"], a["input_layout"], pse=pse,
            atten_mask=atten_mask, softmax_max=smax, softmax_sum=ssum, attention_in=out,
            query_rope=q_rope, key_rope=k_rope, scale_value=a["scale"],
            keep_prob=a["keep_prob"], pre_tokens=a["pre_tokens"], next_tokens=a["next_tokens"],
            inner_precise=a["inner_precise"], seed=a["seed"], offset=a["offset"],
            numels=a["numels"], prefix=a["prefix"], actual_seq_qlen=a["actual_seq_qlen"],
            actual_seq_kvlen=a["actual_seq_kvlen"], sparse_mode=a["sparse_mode"],
            pse_type=a["pse_type"], softmax_layout=a["softmax_layout"], sink=sink)
        dq, dk, dv, dpse, dq_rope, dk_rope, dsink = grads
        ordered = (dq, dk, dv, dpse, dq_rope, dk_rope, dsink)
        return (None, *(g if present else None for g, present in zip(ordered, ctx.present)))


@torch.library.impl("npu::npu_fusion_attention_v2", "Autograd")
def _fusion_attention_v2_autograd(*args, **kwargs):
    bound = _bind(_V2_SCHEMA, args, kwargs)
    differentiable = [bound[name] for name in _V2_DIFFERENTIABLE]
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in differentiable)):
        with torch._C._AutoDispatchBelowAutograd():
            return _V2(*args, **kwargs)
    return _FusionAttentionV2.apply(bound, *differentiable)


DIFFERENTIABILITY["npu_fusion_attention_v2"] = "autograd"
mark_backward_op("npu_fusion_attention_grad_v2", "npu_fusion_attention_v2")


def _gen_mask_backward(ctx, grad):
    raise RuntimeError("_npu_dropout_gen_mask: its uint8 mask output is not differentiable")


def _gen_mask_setup(ctx, inputs, output, keyword_only_inputs=None):
    pass


torch.library.register_autograd("npu::_npu_dropout_gen_mask.Tensor", _gen_mask_backward,
                                setup_context=_gen_mask_setup)
DIFFERENTIABILITY["_npu_dropout_gen_mask"] = "not differentiable: produces a uint8 bit mask"

__all__ = ["npu_fusion_attention", "npu_fusion_attention_grad", "npu_fusion_attention_v2",
           "npu_fusion_attention_grad_v2", "npu_fusion_attention_v3",
           "npu_fusion_attention_grad_v3", "_npu_dropout_gen_mask",
           "manual_seed", "initial_seed", "get_rng_state", "set_rng_state"]
