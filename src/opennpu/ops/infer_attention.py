"""Inference attention: npu_fused_infer_attention_score (+ .out, _get_max_workspace,
_infer_output) and npu_fused_infer_attention_score_v2.

Math (torch_npu's contract): ``out = softmax(scale * Q K^T + pse_shift + mask) V`` per head, with
GQA (``num_key_value_heads``), per-batch ``actual_seq_lengths`` / ``actual_seq_lengths_kv``,
paged KV caches (``block_table`` + ``block_size``), MLA (``query_rope`` / ``key_rope``: scores
``scale * (q k + q_rope k_rope)``) and ``softmax_lse`` (log-sum-exp of the scaled logits).
Prefill runs on npu_fusion_attention's flash kernels; decode (one query row per sequence) on a
kernel that reads the cache in place (an int8 cache dequantised chunk by chunk). Inference only:
not differentiable.
"""

from __future__ import annotations

import torch

from ._registry import mark_not_differentiable, register_fake

_ops = torch.ops.npu

# input_layout -> (layout of query/key/value, layout of attention_out)
LAYOUTS = {
    "BSH": ("BSH", "BSH"), "BSND": ("BSND", "BSND"), "BNSD": ("BNSD", "BNSD"),
    "TND": ("TND", "TND"), "NTD": ("NTD", "NTD"), "NSD": ("NSD", "NSD"),
    "BNSD_BSND": ("BNSD", "BSND"), "BSH_BNSD": ("BSH", "BNSD"), "BSND_BNSD": ("BSND", "BNSD"),
    "BSH_NBSD": ("BSH", "NBSD"), "BSND_NBSD": ("BSND", "NBSD"), "BNSD_NBSD": ("BNSD", "NBSD"),
    "TND_NTD": ("TND", "NTD"), "NTD_TND": ("NTD", "TND"),
}


def output_shapes(query, value, input_layout, paged, num_heads, num_key_value_heads, lse_flag):
    """(attention_out shape, softmax_lse shape) of a call (SymInt-friendly)."""
    layout = input_layout.upper()
    if layout not in LAYOUTS:
        raise RuntimeError(f"npu_fused_infer_attention_score: argument 'input_layout' must be one "
                           f"of {', '.join(LAYOUTS)}, but got '{input_layout}'")
    lin, lout = LAYOUTS[layout]
    n = num_heads
    kvn = num_key_value_heads or num_heads
    b, s = {"BSH": (query.shape[0], query.shape[1]), "BSND": (query.shape[0], query.shape[1]),
            "BNSD": (query.shape[0], query.shape[2]), "NSD": (1, query.shape[1]),
            "TND": (1, query.shape[0]), "NTD": (1, query.shape[1])}[lin]
    hidden = value.dim() == 3 if paged else lin == "BSH"
    dv = value.shape[-1] // kvn if hidden else value.shape[-1]
    if paged and value.dim() == 5:  # NZ: [num_blocks, KVN, D / c, block_size, c]
        dv = value.shape[2] * value.shape[4]
    out = {"BSH": [b, s, n * dv], "BSND": [b, s, n, dv], "BNSD": [b, n, s, dv],
           "NBSD": [n, b, s, dv], "NSD": [n, s, dv], "TND": [s, n, dv], "NTD": [n, s, dv]}[lout]
    if not lse_flag:
        return out, [1]
    return out, ([s, n, 1] if lin in ("TND", "NTD") else [b, n, s, 1])


def npu_fused_infer_attention_score(query, key, value, **kwargs):
    """Inference attention ``softmax(scale * Q K^T + pse_shift + mask) V`` (torch_npu's contract).

    ``input_layout``: BSH, BSND, BNSD, TND, NTD, NSD, or an input_output pair (BNSD_BSND,
    BSH_BNSD, BSND_BNSD, BSH_NBSD, BSND_NBSD, BNSD_NBSD, TND_NTD, NTD_TND). ``num_heads`` query
    heads, ``num_key_value_heads`` key/value heads (0: as many; GQA otherwise).
    ``actual_seq_lengths`` / ``actual_seq_lengths_kv``: per-batch lengths (one value for all
    batches), cumulative ends for TND/NTD; with ``block_table`` (int32 [B, max_blocks]) and
    ``block_size`` the key/value are a paged cache [num_blocks, block_size, H] or
    [num_blocks, N, block_size, D] (or NZ [num_blocks, N, D / c, block_size, c], c the elements of
    32 bytes, copied to rows once per call) and ``actual_seq_lengths_kv`` the cached length per
    sequence.
    ``atten_mask`` (bool/int8/uint8, nonzero = masked) with ``sparse_mode`` 0/1 (mask, with the
    ``pre_tokens``/``next_tokens`` band in mode 0), 2/3 (causal top-left / bottom-right) and 4
    (band from the bottom-right); with one query row and no rope the sparse arguments are ignored,
    as on Ascend. ``query_rope``/``key_rope`` (MLA) add ``q_rope . k_rope`` to the scores.
    Returns ``(attention_out, softmax_lse)``: out in query's dtype with value's head size; lse
    float32 ``[B, N, S, 1]`` (TND ``[T, N, 1]``) when ``softmax_lse_flag``, else ``zeros(1)``;
    a row that sees no key gives zeros and lse ``-inf``. fp16/bf16 are computed in fp32.
    int8 ``key``/``value`` (KV-cache antiquant) are dequantised as ``(x + offset) * scale`` in
    fp32 with ``key_antiquant_scale``/``value_antiquant_scale`` (+ offsets, modes 0-5: per
    channel / tensor, per token, per head, paged per token) or the combined ``antiquant_scale``
    (row 0 key, row 1 value; ``antiquant_mode`` 0/1). ``quant_scale2`` (+ ``quant_offset2``)
    quantise the output to int8 ("int8后量化"): ``o * scale + offset`` on the float32 attention
    output, cast float32 -> float16 -> int8 (round half to even, saturated; NaN -> 0), per tensor
    (one factor) or per channel (Q_N * D factors, e.g. (Q_N, D), (1, Q_N, 1, D), (H,)); float32
    factors, or bfloat16 with a bfloat16 query. int4 K/V caches (int32 words with antiquant
    factors), a shared prefix and left padding are taken. Full quantisation: an int8 query, key
    and value with ``dequant_scale1`` / ``quant_scale1`` / ``dequant_scale2`` give
    ``(codes(exp(s - m) * quant_scale1) . v) * dequant_scale2 / sum(exp(s - m))`` with
    ``s = (q . k) * dequant_scale1 * scale``, float16 (int8 with ``quant_scale2``); see
    docs/ops.md. Not differentiable.
    """
    return _ops.npu_fused_infer_attention_score(query, key, value, **kwargs)


def _out_list(packet):
    """``packet.out`` with torch_npu's ``out=[attention_out, softmax_lse]``."""
    def out_overload(query, key, value, *, out, workspace=None, **kwargs):
        attention_out, softmax_lse = out
        return packet.out(query, key, value, workspace=workspace, attention_out=attention_out,
                          softmax_lse=softmax_lse, **kwargs)

    out_overload.__doc__ = f"{packet.__name__}.out with torch_npu's out=[attention_out, softmax_lse]."
    return out_overload


npu_fused_infer_attention_score.out = _out_list(_ops.npu_fused_infer_attention_score)


def _npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs):
    """Workspace for npu_fused_infer_attention_score.out: an empty uint8 tensor (the CPU kernels
    need none)."""
    return _ops._npu_fused_infer_attention_score_get_max_workspace(query, key, value, **kwargs)


def _npu_fused_infer_attention_score_infer_output(query, value, **kwargs):
    """Zero-filled ``(attention_out, softmax_lse)`` of npu_fused_infer_attention_score's shapes and
    dtypes (int8 out when quant_scale2 is given), for the ``.out`` overload."""
    return _ops._npu_fused_infer_attention_score_infer_output(query, value, **kwargs)


def npu_fused_infer_attention_score_v2(query, key, value, **kwargs):
    """npu_fused_infer_attention_score with torch_npu's v2 names: ``actual_seq_qlen`` /
    ``actual_seq_kvlen``, ``num_query_heads``, ``softmax_scale``, ``return_softmax_lse``, plus
    ``learnable_sink`` (one extra logit per head in every softmax row, no value row). int8
    key/value take ``dequant_scale_key``/``dequant_scale_value`` (+ ``dequant_offset_*``,
    ``key_quant_mode``/``value_quant_mode`` 0-5) as v1's antiquant factors. ``quant_scale_out`` (+
    ``quant_offset_out``) quantise the output as v1's ``quant_scale2``: to int8 (``out_dtype``
    None or torch.int8), or to torch.float8_e5m2 / torch.float8_e4m3fn (``o * scale + offset``
    cast directly, round half to even, unsaturated as torch casts), or to hifloat8
    (``out_dtype=torch_npu.hifloat8`` = 290: uint8 codes, cast directly, ties away from zero as
    en_dtypes.hifloat8, ``|v| >= 40960`` -> inf). Query dequantisation raises. Not
    differentiable."""
    return _ops.npu_fused_infer_attention_score_v2(query, key, value, **kwargs)


npu_fused_infer_attention_score_v2.out = _out_list(_ops.npu_fused_infer_attention_score_v2)


def _npu_fused_infer_attention_score_v2_get_max_workspace(query, key, value, **kwargs):
    """Workspace for npu_fused_infer_attention_score_v2.out: an empty uint8 tensor (the CPU
    kernels need none)."""
    return _ops._npu_fused_infer_attention_score_v2_get_max_workspace(query, key, value, **kwargs)


def _npu_fused_infer_attention_score_v2_infer_output(query, value, **kwargs):
    """Zero-filled ``(attention_out, softmax_lse)`` of npu_fused_infer_attention_score_v2's shapes
    and dtypes (int8, or the float8 ``out_dtype``, when quant_scale_out is given), for ``.out``."""
    return _ops._npu_fused_infer_attention_score_v2_infer_output(query, value, **kwargs)


# ----------------------------------------------------------------------------- fake kernels


# Output dtypes of a quantised output (v2's out_dtype codes: torch's ScalarType numbering).
_OUT_DTYPES = {torch.int8: torch.int8, torch.float8_e5m2: torch.float8_e5m2,
               torch.float8_e4m3fn: torch.float8_e4m3fn}
# 290: torch_npu.hifloat8, returned as uint8 codes (torch has no hifloat8 dtype).
_OUT_DTYPE_CODES = {1: torch.int8, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn, 290: torch.uint8}


def v2_out_dtype(query, quant_scale_out, out_dtype, query_rope=None):
    """attention_out's dtype of a v2 call (int8 / float8 / uint8 hifloat8 codes when
    quant_scale_out is given; query_rope's from an int8 query, int8 MLA)."""
    if quant_scale_out is None:
        if query.dtype == torch.int8 and query_rope is not None:
            return query_rope.dtype
        return query.dtype
    if out_dtype is None:
        return torch.int8
    return _OUT_DTYPES.get(out_dtype) or _OUT_DTYPE_CODES.get(out_dtype, torch.int8)


def _fake_outputs(query, value, input_layout, block_table, num_heads, num_key_value_heads, flag,
                  dtype=None):
    out, lse = output_shapes(query, value, input_layout, block_table is not None, num_heads,
                             num_key_value_heads, flag)
    return query.new_empty(out, dtype=dtype or query.dtype), query.new_empty(lse, dtype=torch.float32)


def v1_out_dtype(query, quant_scale2, query_rope):
    """attention_out's dtype of a v1 call: int8 with quant_scale2; float16 from an int8 query
    (full quantisation; int8 MLA: query_rope's dtype); else query's."""
    if quant_scale2 is not None:
        return torch.int8
    if query.dtype == torch.int8:
        return query_rope.dtype if query_rope is not None else torch.float16
    return query.dtype


@register_fake("npu::npu_fused_infer_attention_score")
def _fia_fake(query, key, value, *, block_table=None, num_heads=1, input_layout="BSH",
              num_key_value_heads=0, softmax_lse_flag=False, quant_scale2=None, query_rope=None,
              **_):
    return _fake_outputs(query, value, input_layout, block_table, num_heads, num_key_value_heads,
                         softmax_lse_flag, v1_out_dtype(query, quant_scale2, query_rope))


@register_fake("npu::npu_fused_infer_attention_score.out")
def _fia_out_fake(query, key, value, *, attention_out, softmax_lse, **_):
    return attention_out, softmax_lse


@register_fake("npu::_npu_fused_infer_attention_score_get_max_workspace")
def _fia_workspace_fake(query, key, value, **_):
    return query.new_empty([0], dtype=torch.uint8)


@register_fake("npu::_npu_fused_infer_attention_score_infer_output")
def _fia_infer_output_fake(query, value, *, input_layout="BSH", quant_scale2=None,
                           block_table=None, num_heads=1, num_key_value_heads=0,
                           softmax_lse_flag=False, query_rope=None):
    out, lse = output_shapes(query, value, input_layout, block_table is not None, num_heads,
                             num_key_value_heads, softmax_lse_flag)
    return (query.new_empty(out, dtype=v1_out_dtype(query, quant_scale2, query_rope)),
            query.new_empty(lse, dtype=torch.float32))


@register_fake("npu::npu_fused_infer_attention_score_v2")
def _fia_v2_fake(query, key, value, *, block_table=None, num_query_heads=1, input_layout="BSH",
                 num_key_value_heads=0, return_softmax_lse=False, quant_scale_out=None,
                 out_dtype=None, query_rope=None, **_):
    return _fake_outputs(query, value, input_layout, block_table, num_query_heads,
                         num_key_value_heads, return_softmax_lse,
                         v2_out_dtype(query, quant_scale_out, out_dtype, query_rope))


@register_fake("npu::npu_fused_infer_attention_score_v2.out")
def _fia_v2_out_fake(query, key, value, *, attention_out, softmax_lse, **_):
    return attention_out, softmax_lse


@register_fake("npu::_npu_fused_infer_attention_score_v2_get_max_workspace")
def _fia_v2_workspace_fake(query, key, value, **_):
    return query.new_empty([0], dtype=torch.uint8)


@register_fake("npu::_npu_fused_infer_attention_score_v2_infer_output")
def _fia_v2_infer_output_fake(query, value, *, query_dtype=None, value_dtype=None,
                              input_layout="BSH", quant_scale_out=None, block_table=None,
                              num_query_heads=1, num_key_value_heads=0, return_softmax_lse=False,
                              query_rope=None, out_dtype=None):
    return _fake_outputs(query, value, input_layout, block_table, num_query_heads,
                         num_key_value_heads, return_softmax_lse,
                         v2_out_dtype(query, quant_scale_out, out_dtype, query_rope))


_INFERENCE = "an inference op; torch_npu registers no gradient"
for _name in ("npu_fused_infer_attention_score", "_npu_fused_infer_attention_score_get_max_workspace",
              "_npu_fused_infer_attention_score_infer_output", "npu_fused_infer_attention_score_v2",
              "_npu_fused_infer_attention_score_v2_get_max_workspace",
              "_npu_fused_infer_attention_score_v2_infer_output"):
    mark_not_differentiable(_name, _INFERENCE)

__all__ = ["npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2",
           "_npu_fused_infer_attention_score_get_max_workspace",
           "_npu_fused_infer_attention_score_infer_output",
           "_npu_fused_infer_attention_score_v2_get_max_workspace",
           "_npu_fused_infer_attention_score_v2_infer_output"]
