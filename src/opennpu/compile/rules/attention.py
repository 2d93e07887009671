"""Attention written in PyTorch -> npu_fusion_attention (pre_autograd).

The forms matched (pre-dispatch ATen; q [B, Nq, Sq, D], k [B, Nk, Skv, D], v [B, Nk, Skv, Dv]):

(a) seed 000's chain: s = matmul(q, k.transpose(2, 3)) * scale; optionally
    s.masked_fill(mask, -inf) (masked_fill_ on the fresh scores, or a 0-dim -inf tensor, is
    canonicalised to this before matching, see fusion.remove_noops); p = softmax(s, -1) or
    softmax(s, -1, dtype=float32), optionally .to(q.dtype); out = matmul(p, v).
(b) transformers' eager_attention_forward: the same chain with repeat_kv(k) / repeat_kv(v)
    (unsqueeze(2), expand, reshape) and an additive float mask, s + mask; its dropout is removed
    before matching when it is the identity (p = 0 or eval), and a real dropout blocks the match.
(c) F.scaled_dot_product_attention (aten.scaled_dot_product_attention) with attn_mask None, bool
    (True = attend) or float (additive), is_causal, scale, enable_gqa, and with transformers'
    repeat_kv feeding k and v (absorbed: the fused op takes the Nk key heads as GQA).

The replacement, per mask kind:
- none / is_causal: npu_fusion_attention(q, k, v, Nq, layout, scale=scale), is_causal as
  sparse_mode 2 (causal from the top-left, SDPA's alignment when Sq != Skv) with a broadcast
  [2048, 2048] view standing for torch_npu's compressed mask (mode 2 never reads it).
- bool mask: atten_mask = mask (masked_fill: True = masked out, npu's convention) or
  ~mask (SDPA: True = attend), viewed as [B|1, N|1, Sq, Skv] (broadcast dims stay stride 0).
- additive mask: pse = mask. npu_fusion_attention computes scale * (Q K^T + pse), so the scale is
  folded into q (q * scale, scale=1) and the mask is added unscaled, exactly as the composition
  adds it. transformers' masks hold finfo.min (not -inf) where masked; a fully masked row then has
  equal logits in both, so both give the uniform average (not 0), and no mask value overflows
  (dividing the mask by the scale instead would turn finfo.min into -inf).
GQA: repeat_kv and SDPA's enable_gqa give query head h the key head h // (Nq / Nk), which is
npu_fusion_attention's grouping.

Layout: when q, k and v all lie in memory as [B, S, N, D] (transformers' projections viewed
[B, S, N, D] and transposed to BNSD), the op runs in layout BSND on q.transpose(1, 2) (a free
view) and its output is transposed back, so neither the inputs nor the output are copied
(transformers' attn_output.transpose(1, 2).contiguous() then finds it contiguous). Otherwise BNSD.

Numerics: the fused op forms the scores in fp32 (fp16/bf16 GEMM operands with fp32 accumulation),
runs an fp32 softmax and rounds P to the input dtype once before P V, as the composition does, so
it is at least as accurate as the fp16/bf16 chain (which also rounds the scores). Fully masked rows:
SDPA gives 0, as the fused op does; the masked_fill(-inf) chain gives NaN there (0 / 0), the fused
op 0. Checks (_attention_ok): same float dtype for q, k, v (fp32/fp16/bf16); equal batch, static
Nq divisible by Nk; masks that broadcast to the scores without enlarging them; masked_fill's value
-inf; softmax over the last dim in float32 or q's dtype and a result in q's dtype; SDPA without
dropout; the sizes of repeat_kv's expand/reshape (the patterns leave sizes, dims, floats and dtypes
as wildcards: generic_sizes) and the transpose of the last two dims of k. Speed: see _fast_enough
(short sequences stay with SDPA, and with the chain in training).
"""

from __future__ import annotations

import math

import torch

from .. import rule_registry
from ..rule_registry import fusion_rule
from ._util import FLOAT_DTYPES, bsnd_in_memory, empty, known, size_hint, val

aten = torch.ops.aten
SCALE = 0.0917  # an unusual literal, so scalar_workaround finds the scale in the traced pattern
MASK_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # additive masks (fp64: see _mask_ok)
# sparse_mode 2 (causal from the top-left) takes torch_npu's compressed [2048, 2048] mask, which is
# not read: a broadcast view of one element stands for it.
COMPRESSED = 2048
LEFT_UP_CAUSAL = 2


# --- the replacement ----------------------------------------------------------------------------


def _attention(q, k, v, *, scale, atten_mask=None, pse=None, causal=False):
    """npu_fusion_attention's output for BNSD q, k, v, in BNSD."""
    heads = q.shape[1]
    kwargs = {}
    if pse is not None:
        kwargs["pse"] = pse
    if causal:
        atten_mask = q.new_ones((), dtype=torch.bool).expand(COMPRESSED, COMPRESSED)
        kwargs["sparse_mode"] = LEFT_UP_CAUSAL
    if atten_mask is not None:
        kwargs["atten_mask"] = atten_mask
    if scale != 1.0:  # the dispatcher drops a default argument; keep the call canonical
        kwargs["scale"] = scale
    if all(bsnd_in_memory(t) for t in (q, k, v)):
        out = torch.ops.npu.npu_fusion_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), heads, "BSND", **kwargs)[0]
        return out.transpose(1, 2)
    return torch.ops.npu.npu_fusion_attention(q, k, v, heads, "BNSD", **kwargs)[0]


def _mask_4d(mask, q, k):
    """mask (broadcastable to [B, Nq, Sq, Skv], checked) as a [B|1, N|1, Sq, Skv] view."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(-1, -1, q.shape[2], k.shape[2])


def _additive(q, k, v, mask, scale):
    """Additive mask: scale * Q K^T + mask as (scale * Q) K^T + pse with scale 1 (see above)."""
    return _attention(q * scale, k, v, scale=1.0, pse=_mask_4d(mask, q, k))


def _sdpa_mask(q, k, v, mask, scale):
    if mask.dtype == torch.bool:  # SDPA: True = take part in attention; npu: True = masked out
        return _attention(q, k, v, scale=scale, atten_mask=_mask_4d(torch.logical_not(mask), q, k))
    return _additive(q, k, v, mask, scale)


def _default_scale(q) -> float:
    """SDPA's default scale, 1 / sqrt(D) (D is a static int: checked)."""
    return 1.0 / math.sqrt(q.shape[-1])


# --- speed gate -----------------------------------------------------------------------------------
# A rule fires only where the fused op is at least as fast as what it replaces. Measured on this
# VM's CPU (AVX512-BF16/FP16, AMX; thread CPU time, 1 thread, B=1, 16 query / 4 key heads, D=64,
# causal): against SDPA's CPU flash kernel the fused op's forward costs more up
# to Skv = 256 (0.5-0.9x: a fixed ~30 us per call, then parity) and wins from 384 on (1.1x); its
# fp32 forward+backward likewise (0.25-0.9x below 384, 1.1-1.2x from 384); fp16/bf16
# forward+backward wins at every length (2-3x: SDPA's CPU backward is slow in half precision).
# Against the matmul/softmax/matmul chain the forward wins at every length (1.05x at S=16, 2-9x
# from 128), forward+backward from Skv = 64 (0.7-0.8x at 16, 1.0-1.1x at 64).
SDPA_MIN_KV = 384            # SDPA replaced below this only in fp16/bf16 training
CHAIN_TRAINING_MIN_KV = 64   # the chain replaced below this only in inference


def _fast_enough(q, k, v, is_sdpa: bool) -> bool:
    kv_len = size_hint(k.shape[2])
    if kv_len is None:
        return True
    training = rule_registry.training()
    if is_sdpa:
        return kv_len >= SDPA_MIN_KV or (training and q.dtype != torch.float32)
    return kv_len >= CHAIN_TRAINING_MIN_KV or not training


# --- checks ------------------------------------------------------------------------------------


def _static_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _norm_dim(dim, rank: int):
    return dim + rank if _static_int(dim) and dim < 0 else dim


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(known(x == y) for x, y in zip(a, b))


def _broadcasts_into(mask: torch.Tensor, shape) -> bool:
    """mask broadcasts to `shape` without enlarging it: each of its (right-aligned) sizes is 1 or
    the size of `shape` (a bigger mask would broadcast the scores instead)."""
    if mask.dim() > len(shape):
        return False
    return all(known(m == 1) or known(m == s)
               for m, s in zip(reversed(mask.shape), reversed(tuple(shape))))


def _float_scale(scale) -> bool:
    return (isinstance(scale, (int, float)) and not isinstance(scale, bool)
            and math.isfinite(scale) and scale != 0)


def _repeat_kv_ok(node, heads) -> bool:
    """unsqueeze(x, 2) -> expand([B, Hk, n, S, D]) -> reshape([B, Hk * n, S, D]), Hk * n = heads."""
    if node.target is not aten.reshape.default:
        return False
    expand = node.args[0]
    if not (isinstance(expand, torch.fx.Node) and expand.target is aten.expand.default):
        return False
    unsqueeze = expand.args[0]
    if not (isinstance(unsqueeze, torch.fx.Node) and unsqueeze.target is aten.unsqueeze.default
            and _norm_dim(unsqueeze.args[1], 5) == 2):
        return False
    x = unsqueeze.args[0].meta["val"]
    big = expand.meta["val"].shape
    out = node.meta["val"].shape
    if x.dim() != 4 or len(big) != 5:
        return False
    b, hk, s, d = x.shape
    return (_same_shape((big[0], big[1], big[3], big[4]), (b, hk, s, d))
            and _same_shape(out, (b, hk * big[2], s, d)) and known(hk * big[2] == heads))


def _qkv_ok(q, k, v) -> bool:
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return False
    if not (q.dtype in FLOAT_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype):
        return False
    heads, kv_heads = q.shape[1], k.shape[1]
    # head_num is an int in the schema: the query head count must be static (it is in models,
    # where it comes from the weights' sizes).
    if not _static_int(heads):
        return False
    return (known(k.shape[0] == q.shape[0]) and known(v.shape[0] == q.shape[0])
            and known(v.shape[1] == kv_heads) and known(k.shape[3] == q.shape[3])
            and known(v.shape[2] == k.shape[2]) and known(kv_heads >= 1)
            and known(heads % kv_heads == 0))


def _mask_ok(mask, scores_shape, kinds, q_dtype) -> bool:
    """The mask broadcasts into the scores and has the dtype its use needs: bool for
    masked_fill (atten_mask); fp32/fp16/bf16 for an added mask (pse, read in fp32: an fp64
    mask's finfo.min would become -inf there); SDPA's own rule, bool or q's dtype."""
    if not isinstance(mask, torch.Tensor) or not _broadcasts_into(mask, scores_shape):
        return False
    if aten.masked_fill.Scalar in kinds:
        return mask.dtype == torch.bool
    if aten.add.Tensor in kinds:
        return mask.dtype in MASK_DTYPES
    return mask.dtype == torch.bool or mask.dtype == q_dtype


def _node_ok(node, heads, out_dtype) -> bool:
    """The constant arguments of one matched node (wildcards in the generic patterns)."""
    target, args = node.target, node.args
    if target is aten.transpose.int:
        rank = args[0].meta["val"].dim()
        return rank == 4 and {_norm_dim(args[1], 4), _norm_dim(args[2], 4)} == {2, 3}
    if target is aten.softmax.int:
        dtype = args[2] if len(args) > 2 else node.kwargs.get("dtype")
        return _norm_dim(args[1], 4) == 3 and dtype in (None, torch.float32, out_dtype)
    if target is aten.to.dtype:
        return args[1] == out_dtype
    if target is aten.masked_fill.Scalar:
        return args[2] == -math.inf and args[1].meta["val"].dtype == torch.bool
    if target is aten.mul.Tensor:
        return _float_scale(args[1])
    if target is aten.reshape.default:
        return _repeat_kv_ok(node, heads)
    return True


def _attention_ok(match) -> bool:
    q = val(match, "q")
    if not isinstance(q, torch.Tensor):
        return False
    if not _qkv_ok(q, val(match, "k"), val(match, "v")):
        return False
    heads = q.shape[1]
    out = match.output_node().meta["val"]
    if not (isinstance(out, torch.Tensor) and out.dtype == q.dtype):
        return False
    scores_shape = (q.shape[0], heads, q.shape[2], val(match, "k").shape[2])
    kinds = {node.target for node in match.nodes}
    if "mask" in match.kwargs and not _mask_ok(val(match, "mask"), scores_shape, kinds, q.dtype):
        return False
    if "scale" in match.kwargs and not _float_scale(val(match, "scale")):
        return False
    is_sdpa = False
    for node in match.nodes:
        if not _node_ok(node, heads, q.dtype):
            return False
        if node.target is aten.scaled_dot_product_attention.default:
            is_sdpa = True
            if not _sdpa_ok(node, match):
                return False
    return _fast_enough(q, val(match, "k"), val(match, "v"), is_sdpa)


def _sdpa_ok(node, match) -> bool:
    args = node.args
    mask = args[3] if len(args) > 3 else node.kwargs.get("attn_mask")
    dropout = args[4] if len(args) > 4 else node.kwargs.get("dropout_p", 0.0)
    causal = args[5] if len(args) > 5 else node.kwargs.get("is_causal", False)
    gqa = node.kwargs.get("enable_gqa", False)
    q = val(match, "q")
    if dropout != 0.0 or (causal and mask is not None):
        return False
    # Without enable_gqa (and without repeat_kv, whose reshape makes SDPA's k full-headed) SDPA
    # needs as many key heads as query heads.
    sdpa_k = args[1].meta["val"]
    if not gqa and not known(sdpa_k.shape[1] == q.shape[1]):
        return False
    # SDPA's default scale 1/sqrt(D) must be a constant of the call
    return "scale" in match.kwargs or _static_int(q.shape[-1])


# --- the patterns --------------------------------------------------------------------------------


def _repeat_kv(x, n_rep: int = 2):
    """transformers' repeat_kv (sizes are wildcards in the registered pattern: generic_sizes)."""
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def _scores(q, k, scale):
    return torch.matmul(q, k.transpose(2, 3)) * scale


SOFTMAXES = {
    "plain": lambda s, q: torch.softmax(s, dim=-1),
    "fp32": lambda s, q: torch.softmax(s, dim=-1, dtype=torch.float32),
    "fp32_back": lambda s, q: torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype),
}


def _chain_patterns(softmax, repeat: bool):
    """(search, replace) for each mask kind of the matmul/softmax/matmul chain."""
    kv = _repeat_kv if repeat else (lambda x: x)

    def none(q, k, v, scale):
        return torch.matmul(softmax(_scores(q, kv(k), scale), q), kv(v))

    def masked(q, k, v, mask, scale):
        s = _scores(q, kv(k), scale).masked_fill(mask, -math.inf)
        return torch.matmul(softmax(s, q), kv(v))

    def additive(q, k, v, mask, scale):
        return torch.matmul(softmax(_scores(q, kv(k), scale) + mask, q), kv(v))

    def fused_none(q, k, v, scale):
        return _attention(q, k, v, scale=scale)

    def fused_masked(q, k, v, mask, scale):
        return _attention(q, k, v, scale=scale, atten_mask=_mask_4d(mask, q, k))

    return [(none, fused_none, False), (masked, fused_masked, True), (additive, _additive, True)]


def _sdpa_patterns(kv_form: str):
    """(search, replace, has_mask, has_scale) for F.scaled_dot_product_attention variants."""
    kv = _repeat_kv if kv_form == "repeat" else (lambda x: x)
    extra = {"enable_gqa": True} if kv_form == "gqa" else {}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    out = []

    def none_scale(q, k, v, scale):
        return sdpa(q, kv(k), kv(v), scale=scale, **extra)

    def none_default(q, k, v):
        return sdpa(q, kv(k), kv(v), **extra)

    def causal_scale(q, k, v, scale):
        return sdpa(q, kv(k), kv(v), is_causal=True, scale=scale, **extra)

    def causal_default(q, k, v):
        return sdpa(q, kv(k), kv(v), is_causal=True, **extra)

    def mask_scale(q, k, v, mask, scale):
        return sdpa(q, kv(k), kv(v), attn_mask=mask, scale=scale, **extra)

    def mask_default(q, k, v, mask):
        return sdpa(q, kv(k), kv(v), attn_mask=mask, **extra)

    out.append((none_scale, lambda q, k, v, scale: _attention(q, k, v, scale=scale), False, True))
    out.append((none_default, lambda q, k, v: _attention(q, k, v, scale=_default_scale(q)),
                False, False))
    out.append((causal_scale, lambda q, k, v, scale: _attention(q, k, v, scale=scale, causal=True),
                False, True))
    out.append((causal_default,
                lambda q, k, v: _attention(q, k, v, scale=_default_scale(q), causal=True),
                False, False))
    out.append((mask_scale, _sdpa_mask, True, True))
    out.append((mask_default, lambda q, k, v, mask: _sdpa_mask(q, k, v, mask, _default_scale(q)),
                True, False))
    return out


def _inputs(dtype, *, repeat: bool, mask: str | None):
    """Example q, k, v (and mask) for tracing: Nq = 4 query heads, 2 key heads when repeated."""
    kv_heads = 2 if repeat else 4
    tensors = [empty(1, 4, 8, 16, dtype=dtype), empty(1, kv_heads, 8, 16, dtype=dtype),
               empty(1, kv_heads, 8, 16, dtype=dtype)]
    if mask == "bool":
        tensors.append(empty(1, 1, 8, 8, dtype=torch.bool))
    elif mask == "float":
        tensors.append(empty(1, 1, 8, 8, dtype=dtype))
    return tensors


@fusion_rule("attention", stage="pre_autograd",
             doc="matmul/softmax/matmul attention (seed 000, transformers eager) and "
                 "F.scaled_dot_product_attention, with repeat_kv -> npu_fusion_attention")
def _register_attention(r) -> None:
    # All patterns are generic (sizes, dims, floats and dtypes are wildcards, checked by
    # _attention_ok), so one trace per structure serves every dtype and shape. Each softmax
    # spelling is traced in a dtype where it keeps its structure: fp32 drops the no-op
    # .to(float32) and a float32 softmax of fp32 scores keeps its dtype argument.
    # repeat_kv variants first: patterns are tried in registration order, and the plain ones
    # would also match with k = the repeated (copied) keys, leaving repeat_kv's copies in place.
    for name, softmax in SOFTMAXES.items():
        dtype = torch.bfloat16 if name == "fp32_back" else torch.float32
        for repeat in (True, False):
            for search, replace, has_mask in _chain_patterns(softmax, repeat):
                mask_kind = None
                if has_mask:
                    mask_kind = "bool" if search.__name__ == "masked" else "float"
                inputs = _inputs(dtype, repeat=repeat, mask=mask_kind)
                r.replacement(search, replace, inputs, extra_check=_attention_ok,
                              scalar_workaround={"scale": SCALE}, generic_sizes=True)
    for kv_form in ("repeat", "plain", "gqa"):
        for search, replace, has_mask, has_scale in _sdpa_patterns(kv_form):
            inputs = _inputs(torch.float32, repeat=kv_form != "plain",
                             mask="bool" if has_mask else None)
            r.replacement(search, replace, inputs, extra_check=_attention_ok,
                          scalar_workaround={"scale": SCALE} if has_scale else None,
                          generic_sizes=True)
