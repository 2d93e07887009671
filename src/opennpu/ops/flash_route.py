"""npu_fusion_attention and npu_fused_infer_attention_score on CUDA through ATen's flash-attention
kernels, where the call fits.

The portable composition (portable.py) materialises the [B, N, Sq, Skv] scores in float32: right
everywhere, slow and memory-bound on a GPU. Where a call asks for what flash attention computes,
the portable forward and backward hand it to `aten::_flash_attention_forward` / `_backward`
(the kernels behind F.scaled_dot_product_attention), which read Q, K, V in their layout (BSND
strides; BSH, SBH and BNSD are views of it, TND is the varlen form) and never store the scores.

A call fits when
- the tensors are float16 / bfloat16 on a CUDA device of compute capability 8.0 or newer, with
  torch.backends.cuda.flash_sdp_enabled() (turning it off restores the composition);
- there is no pse, sink or dropout (keep_prob = 1: the dropout bits must be opennpu's Philox
  stream, which flash does not draw), and no element count is zero;
- the head size is a multiple of 8, at most 256, equal for Q, K and V, and N is a multiple of
  N_kv (GQA / MQA run natively);
- the visible keys form a band the flash kernels express. Flash aligns its band to the bottom
  right: key j is visible from query i iff i + shift - left <= j <= i + shift + right, with
  shift = Skv - Sq and -1 for an unbounded side. Without atten_mask nothing is masked (as in the
  CPU kernel); sparse_mode 3 is (left, right) = (-1, 0) and 4 is (pre, next); 2 (j <= i) is
  (-1, -shift) when Skv <= Sq. Modes that read the mask's content (0, 1, 5) and the prefix /
  split-varlen modes (5-8) keep the composition. TND fits with sparse_mode 0 without a mask, 3,
  or 2 when every sequence is square, and cumulative lengths that cover the whole tensors.

Kernel. Among the kernels behind F.scaled_dot_product_attention, the route takes the one SDPA
itself would pick (aten::_fused_sdp_choice, asked for the forward and for the backward): cuDNN's fused
attention where SDPA prefers it (Hopper and newer with a recent cuDNN; dense calls whose band is
all keys or square causal), flash otherwise. Under torch.compile's tracing the choice cannot
be asked and flash runs. `last_kernel` names the kernel of the latest call (for tests and
benchmarks).

Statistics. Flash returns the log-sum-exp L of each row's scaled logits, not the row max m and
the sum s = sum(exp(logit - m)) that the CPU kernel writes. The route returns softmax_max = L and
softmax_sum = 1: the same normaliser, since every consumer uses the pair as m + log(s) (the
backward, and ring attention's merge of partial results: s * exp(m - M) is unchanged). Rows that
see no key keep the CPU kernel's (-inf, 0). The backward rebuilds L = m + log(s) from whichever
kernel wrote the pair.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

_HALF = (torch.float16, torch.bfloat16)
_CUDNN = 3  # SDPBackend.CUDNN_ATTENTION
last_kernel = None  # "flash" or "cudnn": the kernel of the latest forward or backward


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)


@dataclass(frozen=True)
class FlashCall:
    layout: str
    heads: int
    kv_heads: int
    head_dim: int
    left: int  # window sizes, -1 = unbounded
    right: int
    cum_q: list | None = None  # TND: cumulative ends of the sequences
    cum_kv: list | None = None


def _available(query) -> bool:
    return (query.device.type == "cuda" and torch.backends.cuda.flash_sdp_enabled()
            and torch.cuda.is_available()  # fake CUDA tensors on a machine without a GPU
            and _capable(query.device.index if query.device.index is not None
                         else torch.cuda.current_device()))


def _window(mode, has_mask, sq, skv, pre, nxt, skv_min=None):
    """(left, right) of the band of sparse_mode `mode`, or None where flash cannot express it.
    skv_min: the shortest key length where batches differ (skv the longest). Flash treats a
    side of at least seqlen_k as unbounded, so a finite right side that reaches that far while
    rows above still see fewer keys (Sq > Skv) has no flash form."""
    if not has_mask:
        return -1, -1
    skv_min = skv if skv_min is None else skv_min

    def right_side(r):
        if r >= sq - 1:  # even the first row sees every key: unbounded
            return -1
        return r if r < skv_min else None

    if mode == 3:
        return -1, 0
    if mode == 2:  # j <= i is the band (-1, Sq - Skv) at the bottom right
        right = right_side(sq - skv) if sq >= skv else None
        return None if right is None else (-1, right)
    if mode == 4:
        right = right_side(nxt) if pre >= 0 and nxt >= 0 else None
        # a left side past the first key shows every key left of the diagonal: unbounded
        return None if right is None else (-1 if pre >= skv - 1 else pre, right)
    return None


def _cumulative(ends, total):
    """The ends as a list when they rise monotonically and cover `total` rows, else None."""
    if ends is None or len(ends) == 0:
        return None
    ends = [int(e) for e in ends]
    if ends[-1] != total or any(b < a for a, b in zip([0] + ends, ends)):
        return None
    return ends


def plan(query, key, value, head_num, input_layout, *, pse=None, atten_mask=None, keep_prob=1.0,
         pre_tokens=2147483647, next_tokens=2147483647, sparse_mode=0, sink=None,
         actual_seq_qlen=None, actual_seq_kvlen=None) -> FlashCall | None:
    """The flash call for these arguments, or None where the composition must run."""
    if not _available(query) or query.dtype not in _HALF:
        return None
    if key.dtype != query.dtype or value.dtype != query.dtype or key.shape != value.shape:
        return None
    if pse is not None or sink is not None or keep_prob < 1.0:
        return None
    if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
        return None
    layout = input_layout.upper()
    if layout in ("BSH", "SBH"):
        d = query.shape[2] // head_num
        if d == 0 or query.shape[2] != d * head_num or key.shape[2] % d or value.shape[2] != key.shape[2]:
            return None
        nkv = key.shape[2] // d
    elif layout in ("BSND", "BNSD", "TND"):
        d = query.shape[-1]
        nkv = key.shape[-2] if layout in ("BSND", "TND") else key.shape[1]
        if key.shape[-1] != d or value.shape[-1] != d:
            return None
    else:
        return None
    if d % 8 or d > 256 or nkv == 0 or head_num % nkv:
        return None
    has_mask = atten_mask is not None
    if layout == "TND":
        cum_q = _cumulative(actual_seq_qlen, query.shape[0])
        cum_kv = _cumulative(actual_seq_kvlen, key.shape[0])
        if cum_q is None or cum_kv is None or len(cum_q) != len(cum_kv):
            return None
        lens = [(b - a, d_ - c) for a, b, c, d_ in zip([0] + cum_q, cum_q, [0] + cum_kv, cum_kv)]
        if any(sq > 0 and skv == 0 for sq, skv in lens):
            return None
        if has_mask and sparse_mode not in (2, 3):
            return None
        if has_mask and sparse_mode == 2 and any(sq != skv for sq, skv in lens):
            return None
        left, right = (-1, 0) if has_mask else (-1, -1)
        return FlashCall(layout, head_num, nkv, d, left, right, cum_q, cum_kv)
    sq = query.shape[{"BSH": 1, "SBH": 0, "BSND": 1, "BNSD": 2}[layout]]
    skv = key.shape[{"BSH": 1, "SBH": 0, "BSND": 1, "BNSD": 2}[layout]]
    window = _window(sparse_mode, has_mask, sq, skv, pre_tokens, next_tokens)
    if window is None:
        return None
    return FlashCall(layout, head_num, nkv, d, *window)


def _bsnd(t, call: FlashCall, heads: int):
    """A BSND view of a BSH / SBH / BSND / BNSD tensor (no copy); TND stays [T, N, D]."""
    # .view, not .unflatten: splitting one dim is always a view, and .view costs less host time
    if call.layout == "BSH":
        return t.view(t.shape[0], t.shape[1], heads, call.head_dim)
    if call.layout == "SBH":
        return t.view(t.shape[0], t.shape[1], heads, call.head_dim).transpose(0, 1)
    if call.layout == "BNSD":
        return t.transpose(1, 2)
    return t


def _from_bsnd(t, call: FlashCall):
    if call.layout == "BSH":
        return t.flatten(2).contiguous()
    if call.layout == "SBH":
        return t.transpose(0, 1).flatten(2).contiguous()
    if call.layout == "BNSD":
        return t.transpose(1, 2).contiguous()
    return t.contiguous()


def _lengths(call: FlashCall, q, k):
    """(cum_seq_q, cum_seq_k, max_q, max_k) of the flash call."""
    if call.cum_q is None:
        return None, None, q.shape[1], k.shape[1]
    dev = q.device
    cq = torch.tensor([0] + call.cum_q, dtype=torch.int32, device=dev)
    ck = torch.tensor([0] + call.cum_kv, dtype=torch.int32, device=dev)
    max_q = max(b - a for a, b in zip([0] + call.cum_q, call.cum_q))
    max_k = max(b - a for a, b in zip([0] + call.cum_kv, call.cum_kv))
    return cq, ck, max_q, max_k


def _prefers_cudnn(call: FlashCall, q, k, v, scale, training: bool) -> bool:
    """Whether SDPA would run cuDNN's attention for these BSND operands (dense calls only), asked
    for a forward (`training` False) or for the backward of one."""
    return _dense_cudnn_candidate(call, q, k) and _cudnn_chosen(
        call, *(t.transpose(1, 2) for t in (q, k, v)), scale, training)


def _dense_cudnn_candidate(call: FlashCall, q, k) -> bool:
    """A dense call (BSND q, k) whose band cuDNN's is_causal can express, on real tensors."""
    if call.cum_q is not None or call.left != -1 or call.right not in (-1, 0):
        return False
    if call.right == 0 and q.shape[1] != k.shape[1]:
        return False  # SDPA's is_causal is top-left: the same band only if square
    return torch.backends.cuda.cudnn_sdp_enabled() and not torch._subclasses.fake_tensor.is_fake(q)


def _cudnn_chosen(call: FlashCall, qb, kb, vb, scale, training: bool) -> bool:
    """aten::_fused_sdp_choice for BNSD views, with requires_grad as a forward (`training`
    False) or a backward sees it."""
    operands = (qb, kb, vb)
    if training or any(t.requires_grad for t in operands):
        operands = [t.detach().requires_grad_(training) for t in operands]
    choice = torch.ops.aten._fused_sdp_choice(*operands, None, 0.0, call.right == 0, scale=scale,
                                              enable_gqa=call.kv_heads != call.heads)
    return choice == _CUDNN


def _cudnn_forward(call, qb, kb, vb, scale):
    """(out BSND, lse [B, N, Sq]) from cuDNN for BNSD views, or None where cuDNN finds no plan
    for the call."""
    try:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            qb, kb, vb, None, True, 0.0, call.right == 0, False, scale=scale)[:2]
    except RuntimeError:  # cuDNN frontend: no execution plan for this shape; flash computes it
        return None
    return out.transpose(1, 2), lse[..., 0]


def _cudnn_backward(call, g, q, k, v, o, lse, scale):
    zero = torch.zeros((), dtype=torch.int64, device=q.device)  # Philox state: no dropout
    bnsd = [t.transpose(1, 2) for t in (g, q, k, v, o)]
    try:
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            *bnsd, lse.unsqueeze(-1).contiguous(), zero, zero, None, None, None, q.shape[1],
            k.shape[1], 0.0, call.right == 0, scale=scale)
    except RuntimeError:
        return None
    return [t.transpose(1, 2) for t in grads]


def _attend(call: FlashCall, q, k, v, scale, seqused_k=None):
    """(out BSND, lse [B, N, Sq] or varlen [N, T]) of BSND (or varlen [T, N, D]) operands, by the
    kernel SDPA prefers (cuDNN only for dense calls without per-batch key lengths)."""
    global last_kernel
    if seqused_k is None and _dense_cudnn_candidate(call, q, k):
        bnsd = [t.transpose(1, 2) for t in (q, k, v)]
        chosen = _cudnn_chosen(call, *bnsd, scale, training=False)
        done = _cudnn_forward(call, *bnsd, scale) if chosen else None
        if done is not None:
            last_kernel = "cudnn"
            return done
    cq, ck, max_q, max_k = _lengths(call, q, k)
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cq, ck, max_q, max_k, 0.0, False, False, scale=scale,
        window_size_left=call.left, window_size_right=call.right, seqused_k=seqused_k)
    last_kernel = "flash"
    return out, lse


def _may_see_no_key(right: int, lengths) -> bool:
    """Whether a row of some (Sq, Skv) sequence in `lengths` can see no key. Row i's band ends at
    key i + Skv - Sq + right (its start is never past the last key), so with a bounded right side
    the first rows are empty exactly when Sq > Skv + right; an unbounded side sees every key."""
    return right >= 0 and any(sq > skv + right for sq, skv in lengths)


def _statistics(lse, see_no_key: bool, width: int = 8):
    """The route's (softmax_max, softmax_sum), each of lse's shape and a last dim of `width`
    (copies of the row's value, as the CPU kernel writes them): (L, 1), or the CPU kernel's
    (-inf, 0) for a row that sees no key (the kernels write L = +inf there). `see_no_key` False
    (no such row can exist: _may_see_no_key) spares the test, two kernels instead of four."""
    wide = lse.unsqueeze(-1).expand(*lse.shape, width)
    if not see_no_key:
        return wide.contiguous(), torch.ones(wide.shape, dtype=lse.dtype, device=lse.device)
    dead = wide == float("inf")
    return (torch.where(dead, float("-inf"), wide).contiguous(),
            dead.logical_not().to(lse.dtype).contiguous())


def forward(call: FlashCall, query, key, value, scale, softmax_layout=""):
    """(attention_out, softmax_max, softmax_sum) in the shapes the CPU kernel returns."""
    q, k, v = _bsnd(query, call, call.heads), _bsnd(key, call, call.kv_heads), _bsnd(
        value, call, call.kv_heads)
    out, lse = _attend(call, q, k, v, scale)
    if call.layout == "TND":  # lse is [N, T]
        lengths = zip(_spans_of(call.cum_q), _spans_of(call.cum_kv))
        if softmax_layout == "":  # [N, T, 8] storage viewed as [T, N, 8], as the CPU kernel
            lse = lse.reshape(query.shape[0], call.heads)
        else:
            lse = lse.t()
    else:
        lengths = [(q.shape[1], k.shape[1])]
    smax, ssum = _statistics(lse, _may_see_no_key(call.right, lengths))
    return _from_bsnd(out, call), smax, ssum


def _spans_of(ends):
    return (b - a for a, b in zip([0] + ends, ends))


_INFER_LAYOUTS = ("BSH", "BSND", "BNSD")


def infer(query, key, value, *, num_heads, num_key_value_heads, lin, lout, scale, atten_mask,
          sparse_mode, pre_tokens, next_tokens, seq_q, seq_kv, lse_flag, unrouted):
    """npu_fused_infer_attention_score's (attention_out, softmax_lse) by the flash kernels, or
    None where the call does not fit: the dense (not paged) BSH / BSND / BNSD layouts without
    pse_shift, rope parts, sink or quantisation (`unrouted` is True when any of those is given),
    query lengths equal to Sq, key lengths (actual_seq_lengths_kv, each at least 1) through
    flash's per-sequence `seqused_k` (varlen form), and the band of sparse_mode as in npu_fusion_attention
    except that every mode applies without a mask; a decode call (Sq = 1) sees every key."""
    if unrouted or lin not in _INFER_LAYOUTS or lout not in _INFER_LAYOUTS:
        return None
    kvn = num_key_value_heads or num_heads
    sq = query.shape[2] if lin == "BNSD" else query.shape[1]
    skv = key.shape[2] if lin == "BNSD" else key.shape[1]
    if seq_q is not None and sq > 1 and any(int(s_) != sq for s_ in seq_q):
        return None
    batch = query.shape[0]
    if seq_kv is not None and (len(seq_kv) not in (1, batch)
                               or any(not 1 <= int(s_) <= skv for s_ in seq_kv)):
        return None
    if atten_mask is not None and sparse_mode in (0, 1):
        return None  # the mask's content decides
    call = plan(query, key, value, num_heads, lin)
    if call is None or call.kv_heads != kvn:
        return None
    if sq > 1 and sparse_mode in (2, 3, 4):  # a decode call (Sq = 1) sees every key
        if sparse_mode == 2 and seq_kv is not None:
            return None  # top-left alignment with per-batch key lengths
        window = _window(sparse_mode, True, sq, skv, pre_tokens, next_tokens,
                         min(int(s_) for s_ in seq_kv) if seq_kv is not None else None)
        if window is None:
            return None
        call = dataclasses.replace(call, left=window[0], right=window[1])
    elif sq > 1 and sparse_mode == 0 and (pre_tokens < sq - 1 or next_tokens < skv - 1):
        return None  # a top-left band that hides keys
    q, k, v = _bsnd(query, call, call.heads), _bsnd(key, call, kvn), _bsnd(value, call, kvn)
    if seq_kv is None:
        out, lse = _attend(call, q, k, v, scale)
    else:
        # Per-batch key counts are flash's `seqused_k`, which only its varlen form reads: the
        # batch becomes sequences of Sq queries and Skv cache rows (a view for BSH / BSND; a
        # BNSD cache is copied into BSND order first).
        lens = [int(s_) for s_ in seq_kv]
        used = torch.tensor(lens * batch if len(lens) == 1 else lens, dtype=torch.int32,
                            device=query.device)
        call = dataclasses.replace(call, cum_q=[sq * (i + 1) for i in range(batch)],
                                   cum_kv=[skv * (i + 1) for i in range(batch)])
        flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
        out, lse = _attend(call, *flat, scale, used)
        out, lse = out.view(batch, sq, *out.shape[1:]), lse.view(-1, batch, sq).transpose(0, 1)
    out = _from_bsnd(out, FlashCall(lout, call.heads, kvn, call.head_dim, -1, -1))
    if not lse_flag:
        return out, query.new_zeros(1, dtype=torch.float32)
    lengths = [(sq, skv)] if seq_kv is None else [(sq, int(s_)) for s_ in seq_kv]
    return out, _statistics(lse, _may_see_no_key(call.right, lengths), width=1)[0]


def _lse_of(call: FlashCall, softmax_max, softmax_sum, query, softmax_layout):
    m, s = softmax_max[..., 0].float(), softmax_sum[..., 0].float()
    lse = torch.where(s > 0, m + torch.log(s), float("inf"))
    if call.layout == "TND":
        t, n = query.shape[0], call.heads
        lse = lse.contiguous().view(n, t) if softmax_layout == "" else lse.t()
    return lse.contiguous()


def backward(call: FlashCall, query, key, value, dy, attention_in, softmax_max, softmax_sum,
             scale, softmax_layout=""):
    """(dq, dk, dv) in the layout of query, key and value; None where the saved forward results
    do not fit (flash needs the output and both statistics, in the inputs' dtype)."""
    if attention_in is None or softmax_max is None or softmax_sum is None:
        return None
    if dy.dtype != query.dtype or attention_in.dtype != query.dtype:
        return None
    q, k, v = _bsnd(query, call, call.heads), _bsnd(key, call, call.kv_heads), _bsnd(
        value, call, call.kv_heads)
    # dO in O's layout (both in the layout of the call, as the forward wrote O)
    g, o = _bsnd(dy.contiguous(), call, call.heads), _bsnd(attention_in.contiguous(), call, call.heads)
    lse = _lse_of(call, softmax_max, softmax_sum, query, softmax_layout)
    global last_kernel
    grads = (_cudnn_backward(call, g, q, k, v, o, lse, scale)
             if _prefers_cudnn(call, q, k, v, scale, training=True) else None)
    if grads is not None:
        dq, dk, dv = grads
        last_kernel = "cudnn"
    else:
        cq, ck, max_q, max_k = _lengths(call, q, k)
        rng = torch.zeros(2, dtype=torch.uint64, device=query.device)  # unused without dropout
        unused = torch.empty(0, device=query.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            g, q, k, v, o, lse, cq, ck, max_q, max_k, 0.0, False, rng, unused, scale=scale,
            window_size_left=call.left, window_size_right=call.right)
        last_kernel = "flash"
    return _from_bsnd(dq, call), _from_bsnd(dk, call), _from_bsnd(dv, call)
