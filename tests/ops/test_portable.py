"""The portable path (src/opennpu/ops/portable.py): every torch.ops.npu op as an ATen composition,
registered for CUDA / XPU / MPS and as an Inductor decomposition there.

On CPU the tests force it (opennpu.ops.portable.force) and compare it with the oracles of
opennpu.testing.reference under the tolerance table, and with the C++ CPU kernel (exact for index
and code outputs). The GPU tests at the end run each case on CUDA tensors against the CPU kernel;
without a GPU they are skipped (written and collected, not yet run).
"""

from __future__ import annotations

import contextlib

import math
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from op_helpers import LOW_DTYPES, dtype_id, randn

import opennpu
from opennpu.ops import portable
from opennpu.ops._registry import DIFFERENTIABILITY
from opennpu.testing import reference as R
from opennpu.testing.tolerances import assert_close, tolerance

F32, F64, I32, I64 = torch.float32, torch.float64, torch.int32, torch.int64
FLOATS = (F32, *LOW_DTYPES)
npu = torch.ops.npu

# Ops of torch.ops.npu that have no portable kernel yet ("ns::name[.overload] (KEY)"): listed
# here so a gap is explicit. Empty: every op has one.
KNOWN_GAPS: set[str] = set()


# ----------------------------------------------------------------------------- registry


def test_every_npu_op_has_a_portable_kernel():
    """A new op without a portable implementation fails here (CUDA, XPU and MPS keys)."""
    missing = set(portable.missing_portable_kernels())
    assert missing == KNOWN_GAPS, f"no portable kernel: {sorted(missing - KNOWN_GAPS)}"
    for name in ("npu::npu_rms_norm", "npu::npu_fusion_attention", "npu::npu_grouped_matmul.List"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")


def test_every_portable_op_is_decomposed_for_inductor():
    from torch._inductor.decomposition import select_decomp_table

    table = select_decomp_table()
    for qualname in portable.IMPLS:
        if qualname not in portable.NOT_DECOMPOSED:
            assert portable._overload(qualname) in table, qualname


def _cpu_kernel_is_portable(qualname="npu::npu_rms_norm"):
    return "portable.py" in torch._C._dispatch_dump(qualname).split("CPU:")[1].split("\n")[0]


def test_force_switches_the_cpu_kernel_and_restores_it():
    assert not portable.is_forced() and not _cpu_kernel_is_portable()
    with portable.force():
        assert portable.is_forced() and _cpu_kernel_is_portable()
        with portable.force():  # nests
            assert _cpu_kernel_is_portable()
        assert _cpu_kernel_is_portable()
    assert not portable.is_forced() and not _cpu_kernel_is_portable()
    with portable.force(False):
        assert not _cpu_kernel_is_portable()


def test_environment_variable_forces_the_whole_process(monkeypatch):
    monkeypatch.setenv("OPENNPU_FORCE_PORTABLE", "0")
    assert portable.force_from_environment() is None
    monkeypatch.setenv("OPENNPU_FORCE_PORTABLE", "1")
    forced = portable.force_from_environment()  # what `import opennpu` does
    try:
        assert portable.is_forced() and _cpu_kernel_is_portable("npu::npu_swiglu")
    finally:
        forced.__exit__(None, None, None)
    assert not portable.is_forced() and not _cpu_kernel_is_portable("npu::npu_swiglu")


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    """op(*args, **kwargs) built by make(dtype); ref(*args, **kwargs) gives the oracle's outputs
    (None entries are checked against the CPU kernel only), compared with the table's tolerance
    times `scale`. Index / code outputs must equal the CPU kernel's."""

    id: str
    op: Callable
    make: Callable
    ref: Callable | None = None
    scale: float = 1.0
    dtypes: tuple = FLOATS
    codes_off_by_one: bool = False
    kernel_scale: float = 2.0
    marks: list = field(default_factory=list)


def _x_gamma(dtype, shape=(3, 7, 83)):
    return [randn(*shape, dtype=dtype), (torch.rand(shape[-1]) + 0.5).to(dtype)], {}


def _noncontig(t):
    """The same values as a non-contiguous view."""
    return t.t().contiguous().t() if t.dim() == 2 else t.transpose(0, 1).contiguous().transpose(0, 1)


def _rms_backward_inputs(dtype):
    x, g = randn(5, 769, dtype=dtype), (torch.rand(769) + 0.5).to(dtype)
    _, rstd = npu.npu_rms_norm(x, g)
    return [randn(5, 769, dtype=dtype), x, g, rstd], {}


def _rotary(dtype, mode="half", shape=(2, 5, 3, 64), bshape=(1, 5, 1, 64)):
    return [randn(*shape, dtype=dtype), randn(*bshape, dtype=dtype), randn(*bshape, dtype=dtype),
            mode], {}


def _softmax(dtype, triu=False):
    x = randn(2, 3, 17, 83, dtype=dtype)
    mask = torch.rand(2, 1, 17, 83) < 0.3  # broadcast over heads
    return [x, mask, 0.7, triu], {}


def _softmax_backward(dtype):
    x, mask, scale, _ = _softmax(dtype)[0]
    y = npu.npu_scaled_masked_softmax(x, mask, scale, False)
    return [randn(*x.shape, dtype=dtype), y, mask, scale, False], {}


def _gating(dtype):
    x = randn(19, 8, dtype=dtype)
    finished = torch.rand(19) < 0.2
    return [x, finished, 3], {}


def _init_routing(dtype):
    n, k, experts = 13, 3, 5
    expert_idx = torch.randint(0, experts, (n, k), dtype=I32)
    row_idx = torch.arange(n * k, dtype=I32).view(k, n).t().contiguous()
    return [randn(n, 16, dtype=dtype), row_idx, expert_idx, 9], {}


def _finalize(dtype, mode=0):
    n, k, experts, h = 11, 2, 4, 24
    rows = randn(n * k, h, dtype=dtype)
    src = torch.randperm(n * k).to(I32)
    return [rows, randn(n, h, dtype=dtype), randn(n, h, dtype=dtype),
            randn(experts, h, dtype=dtype), randn(n, k, dtype=dtype), src,
            torch.randint(0, experts, (n, k), dtype=I32), mode], {}


def _gmm(dtype, split_item=0):
    x = randn(23, 16, dtype=dtype)
    w = randn(3, 16, 8, dtype=dtype)
    b = randn(3, 8, dtype=dtype)
    return [[x], [w]], dict(bias=[b], group_list=[5, 5, 20], split_item=split_item)


def _gmm_tensor(dtype):
    x = [randn(4, 16, dtype=dtype), randn(7, 3, 16, dtype=dtype)]
    w = [randn(16, 8, dtype=dtype), randn(16, 5, dtype=dtype).t().contiguous().t()]
    return [x, w], dict(group_list=None, group_type=-1)


def _ffn(dtype, activation="swiglu", experts=False):
    i = 24
    n1 = 2 * i if activation in R.FFN_GLU else i
    if experts:
        return [randn(12, 16, dtype=dtype) * 0.5, randn(3, 16, n1, dtype=dtype) * 0.3,
                randn(3, i, 16, dtype=dtype) * 0.3, activation], dict(expert_tokens=[4, 0, 8])
    return [randn(3, 5, 16, dtype=dtype) * 0.5, randn(16, n1, dtype=dtype) * 0.3,
            randn(i, 16, dtype=dtype) * 0.3, activation], dict(bias1=randn(n1, dtype=dtype))


def _ffn_int8(dtype):
    x = torch.randint(-128, 128, (9, 32), dtype=torch.int8)
    w1 = torch.randint(-128, 128, (32, 16), dtype=torch.int8)
    w2 = torch.randint(-128, 128, (16, 32), dtype=torch.int8)
    kw = dict(deq_scale1=torch.rand(16) * 4 / (128 * 128 * 6), deq_scale2=torch.rand(32) * 4 /
              (128 * 128 * 4), scale=torch.full((1,), 50.0), offset=torch.zeros(1),
              output_dtype=torch.float16)
    return [x, w1, w2, "relu"], kw


def _attention(dtype, layout="BNSD", mode=0, mask=True, pse=False, sink=False, gqa=True):
    b, nq, nkv, sq, skv, d, dv = 2, 4, 2 if gqa else 4, 17, 23, 16, 8
    q, k, v = [R.attention_from_bnsd(t, layout).contiguous() for t in (
        randn(b, nq, sq, d, dtype=dtype), randn(b, nkv, skv, d, dtype=dtype),
        randn(b, nkv, skv, dv, dtype=dtype))]
    kw = dict(scale=0.25, sparse_mode=mode)
    if mask:
        kw["atten_mask"] = torch.rand(b, 1, sq, skv) < 0.3 if mode in (0, 1, 5) else \
            torch.ones(2048, 2048, dtype=torch.bool).triu(1)
        if mode == 0:
            kw.update(pre_tockens=9, next_tockens=3)
        if mode == 5:
            kw["prefix"] = [3, 30]
    if pse:
        kw["pse"] = randn(1, nq, sq, skv, dtype=dtype)
    if sink:
        kw["sink"] = torch.randn(nq)
    return [q, k, v, nq, layout], kw


def _attention_tnd(dtype, mode=3):
    qlen, kvlen = [5, 12, 20], [7, 12, 26]
    n, d = 2, 8
    q, k, v = randn(20, n, d, dtype=dtype), randn(26, n, d, dtype=dtype), randn(26, n, d, dtype=dtype)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    return [q, k, v, n, "TND"], dict(atten_mask=mask, sparse_mode=mode, scale=0.3,
                                       actual_seq_qlen=qlen, actual_seq_kvlen=kvlen)


def _attention_grad(dtype, **kw):
    args, kwargs = _attention(dtype, **kw)
    out = npu.npu_fusion_attention(*args, **kwargs)
    scale = kwargs.pop("scale")
    grad_kw = dict(kwargs, scale_value=scale, softmax_max=out[1], softmax_sum=out[2],
                   attention_in=out[0])
    return [*args[:3], randn(*out[0].shape, dtype=dtype), *args[3:]], grad_kw


def _attention_grad_tnd(dtype):
    args, kwargs = _attention_tnd(dtype)
    out = npu.npu_fusion_attention(*args, **kwargs)
    kwargs["scale_value"] = kwargs.pop("scale")
    return [*args[:3], randn(*out[0].shape, dtype=dtype), *args[3:]], dict(
        kwargs, softmax_max=out[1], softmax_sum=out[2], attention_in=out[0])


def _attention_v2_rope(dtype, layout="BSH"):
    args, kwargs = _attention(dtype, layout, 3)
    q, k = args[0], args[1]
    rope = lambda t: randn(*t.shape[:-1], 4 if layout not in ("BSH", "SBH") else  # noqa: E731
                           t.shape[-1] // 2, dtype=dtype)
    kwargs.update(query_rope=rope(q), key_rope=rope(k))
    kwargs["pse"] = randn(1, 4, 17, 23, dtype=dtype)
    kwargs["pse_type"] = 0
    return args, kwargs


def _attention_v3_tnd(dtype):
    args, kwargs = _attention_tnd(dtype)
    kwargs["actual_seq_qlen"] = torch.tensor(kwargs["actual_seq_qlen"])
    kwargs["actual_seq_kvlen"] = torch.tensor(kwargs["actual_seq_kvlen"])
    return args, kwargs


def _grad_call(forward, dtype, args, kwargs):
    """The gradient op's arguments for a forward call: a random dy and the forward's outputs."""
    out = forward(*args, **kwargs)
    kwargs = dict(kwargs, softmax_max=out[1], softmax_sum=out[2], attention_in=out[0])
    kwargs["scale_value"] = kwargs.pop("scale")
    return [*args[:3], randn(*out[0].shape, dtype=dtype), *args[3:]], kwargs


def _attention_grad_v2(dtype):
    return _grad_call(npu.npu_fusion_attention_v2, dtype, *_attention_v2_rope(dtype))


def _attention_grad_v3(dtype, tnd=False):
    inputs = _attention_v3_tnd(dtype) if tnd else _attention(dtype, "BNSD", 2)
    return _grad_call(npu.npu_fusion_attention_v3, dtype, *inputs)


def _ref_attention(q, k, v, n, layout, *, atten_mask=None, sparse_mode=0, pre_tockens=2**31 - 1,
                   next_tockens=2**31 - 1, prefix=None, pse=None, sink=None, scale=1.0):
    d = q.shape[-1] // n if layout in ("BSH", "SBH") else q.shape[-1]
    sq = R.attention_to_bnsd(q, layout, d, n).shape[2]
    skv = k.shape[1] if layout in ("BSH", "BSND") else k.shape[0] if layout == "SBH" else k.shape[2]
    b = q.shape[1] if layout == "SBH" else q.shape[0]
    full = None
    if atten_mask is not None:
        full = R.full_visibility_mask(sparse_mode, sq, skv, b, 1, atten_mask if sparse_mode in
                                      (0, 1, 5) else None, pre_tockens, next_tockens, prefix)
    out, _, _ = R.attention_reference(q, k, v, n, layout, pse=pse, sink=sink, mask_full=full,
                                      scale=scale)
    return [out, None, None, None]


def _quant_case(dtype, **kw):
    return [randn(3, 7, 64, dtype=dtype)], kw


def _smooth_group(dtype):
    x = randn(10, 32, dtype=dtype)
    return [x], dict(smooth_scales=(torch.rand(3, 32) + 0.5).to(dtype),
                     group_index=torch.tensor([3, 8, 10], dtype=I64))


def _mx(dtype, **kw):
    """Values over many binades (MX and block quantisers), with zeros."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(70, 64, generator=gen) * torch.exp2(torch.randint(-10, 10, (70, 64),
                                                                      generator=gen).float())
    x[::7, ::5] = 0
    return [x.to(dtype)], kw


def _bytes(*shape, lo=0, hi=256):
    return torch.randint(lo, hi, shape, dtype=torch.int32).to(torch.uint8)


def _qmm(dtype, int4=False, **kw):
    """npu_quant_matmul's codes (int8, or int4 words with x2 as a transposed [n, k / 8]); the
    float dtype picks the output (float32: int8 requantisation)."""
    gen = torch.Generator().manual_seed(0)
    lo, hi = (-8, 8) if int4 else (-128, 128)
    x1 = torch.randint(lo, hi, (2, 5, 48), dtype=torch.int8, generator=gen)
    x2 = torch.randint(lo, hi, (48, 24), dtype=torch.int8, generator=gen)
    if int4:
        x1, x2 = R.pack_int4(x1), R.pack_int4(x2.t().contiguous()).t()
    out = {} if dtype == F32 else {"output_dtype": dtype}
    return [x1, x2, torch.rand(24, generator=gen) * 0.01], {**out, **kw}


def _arndq(dtype, **kw):
    x1, x2 = randn(4, 9, 48, dtype=dtype), randn(4, 9, 48, dtype=dtype)
    g = (torch.rand(48) + 0.5).to(dtype)
    return [x1, x2, g], kw


def _fia_decode_paged(dtype):
    q = randn(3, 1, 4 * 16, dtype=dtype)
    k, v = randn(6, 8, 2 * 16, dtype=dtype), randn(6, 8, 2 * 16, dtype=dtype)
    table = torch.tensor([[5, 1], [0, 2], [3, 4]], dtype=torch.int32)
    return [q, k, v], dict(num_heads=4, num_key_value_heads=2, scale=0.25, block_table=table,
                           block_size=8, actual_seq_lengths_kv=[13, 16, 1], softmax_lse_flag=True)


def _fia_prefill(dtype):
    q, k, v = randn(2, 4, 7, 16, dtype=dtype), randn(2, 2, 11, 16, dtype=dtype), \
        randn(2, 2, 11, 16, dtype=dtype)
    mask = torch.rand(2, 1, 7, 11) < 0.3
    return [q, k, v], dict(num_heads=4, num_key_value_heads=2, input_layout="BNSD", scale=0.3,
                           atten_mask=mask, pre_tokens=4, next_tokens=1, softmax_lse_flag=True,
                           actual_seq_lengths=[7, 5])


def _fia_v2_tnd(dtype):
    q, k, v = randn(9, 4, 16, dtype=dtype), randn(20, 2, 16, dtype=dtype), \
        randn(20, 2, 16, dtype=dtype)
    return [q, k, v], dict(num_query_heads=4, num_key_value_heads=2, softmax_scale=0.3,
                           input_layout="TND", actual_seq_qlen=[1, 9], actual_seq_kvlen=[6, 20],
                           sparse_mode=3, learnable_sink=randn(4, dtype=torch.bfloat16),
                           return_softmax_lse=True)

_ROUTING_MAP = torch.zeros(9, 5, dtype=torch.bool).scatter(
    1, torch.rand(9, 5, generator=torch.Generator().manual_seed(5)).argsort(-1)[:, :2], True)


def _routing_map_rows(drop_and_pad=False):
    """permute_with_routing_map of [9, 24] tokens by _ROUTING_MAP (18 pairs, or capacity 4)."""
    return npu.npu_moe_token_permute_with_routing_map(
        torch.zeros(9, 24), _ROUTING_MAP, num_out_tokens=20 if drop_and_pad else 18,
        drop_and_pad=drop_and_pad)


def _routing_map_grad_index():
    """(out_index, permuted_token_id) of the drop-and-pad unpermute."""
    slots = _routing_map_rows(True)[2]
    return list(npu._npu_moe_token_unpermute_with_routing_map(
        torch.zeros(20, 24), slots, [9, 24], routing_map=_ROUTING_MAP, drop_and_pad=True)[1:3])


_ROUTING_V2 = torch.randint(0, 8, (11, 3), generator=torch.Generator().manual_seed(4),
                            dtype=I32)
_TOKEN_ROUTING = torch.randint(0, 5, (9, 3), generator=torch.Generator().manual_seed(3))


def _token_permute(dtype, num_out_tokens=None):
    """(tokens [9, 24], indices [9, 3]) and the sorted_indices of their permute."""
    tokens = randn(9, 24, dtype=dtype)
    _, sorted_indices = npu.npu_moe_token_permute(tokens, _TOKEN_ROUTING, num_out_tokens)
    return [tokens, _TOKEN_ROUTING, num_out_tokens], sorted_indices


CASES = [
    Case("rms_norm", npu.npu_rms_norm, _x_gamma, R.rms_norm),
    Case("rms_norm_2d_gamma", npu.npu_rms_norm,
         lambda d: ([randn(3, 5, 7, dtype=d), (torch.rand(5, 7) + 0.5).to(d)], {}), R.rms_norm),
    Case("rms_norm_noncontig", npu.npu_rms_norm,
         lambda d: ([_noncontig(randn(83, 5, dtype=d)), (torch.rand(5) + 0.5).to(d)], {}),
         R.rms_norm),
    Case("rms_norm_empty", npu.npu_rms_norm,
         lambda d: ([randn(0, 8, dtype=d), torch.ones(8, dtype=d)], {}), R.rms_norm),
    Case("rms_norm_fp32_gamma", npu.npu_rms_norm,
         lambda d: ([randn(4, 33, dtype=d), torch.rand(33) + 0.5], {}), R.rms_norm),
    Case("gemma_rms_norm", npu.npu_gemma_rms_norm, _x_gamma, R.gemma_rms_norm),
    Case("rms_norm_backward", npu.npu_rms_norm_backward, _rms_backward_inputs,
         R.rms_norm_backward, scale=8),
    Case("add_rms_norm", npu.npu_add_rms_norm,
         lambda d: ([randn(2, 7, 83, dtype=d), randn(7, 83, dtype=d),
                     (torch.rand(83) + 0.5).to(d)], {}),
         lambda x1, x2, g: R.add_rms_norm(x1, x2.expand_as(x1), g)),
    Case("add_rms_norm_cast", npu.npu_add_rms_norm_cast,
         lambda d: ([randn(5, 129, dtype=d), randn(5, 129, dtype=d),
                     (torch.rand(129) + 0.5).to(d)], {}), R.add_rms_norm_cast),
    Case("add_rms_norm_v2_functional", npu.npu_add_rms_norm_v2_functional,
         lambda d: ([randn(5, 129, dtype=d), randn(5, 129, dtype=d),
                     (torch.rand(129) + 0.5).to(d)], {}),
         lambda x1, x2, g: (lambda y, r, x: (r, y, x))(*R.add_rms_norm(x1, x2, g))),
    Case("dynamic_quant", npu.npu_dynamic_quant, _quant_case),
    Case("dynamic_quant_smooth_int4", npu.npu_dynamic_quant,
         lambda d: _quant_case(d, smooth_scales=(torch.rand(64) + 0.5).to(d), dst_type=16)),
    Case("dynamic_quant_group", npu.npu_dynamic_quant, _smooth_group),
    Case("dynamic_quant_fp8", npu.npu_dynamic_quant,
         lambda d: _quant_case(d, dst_type=torch.float8_e4m3fn, quant_mode="pertensor")),
    Case("dynamic_quant_hif8", npu.npu_dynamic_quant,
         lambda d: _quant_case(d, smooth_scales=(torch.rand(64) + 0.5).to(d), dst_type=290)),
    Case("dynamic_quant_hif8_pertensor", npu.npu_dynamic_quant,
         lambda d: _quant_case(d, dst_type=290, quant_mode="pertensor", dst_type_max=224.0)),
    Case("dynamic_quant_pertensor", npu.npu_dynamic_quant,
         lambda d: _quant_case(d, quant_mode="pertensor", dst_type_max=100.0)),
    Case("quantize_per_channel", npu.npu_quantize,
         lambda d: ([randn(3, 7, 64, dtype=d) * 30, torch.rand(7) + 0.1,
                     torch.randint(-4, 4, (7,), dtype=torch.int32), torch.qint8, 1], {})),
    Case("quantize_hif8_div", npu.npu_quantize,
         lambda d: ([randn(3, 7, 33, dtype=d) * 300, torch.rand(7) + 0.1, torch.randn(7), 290, 1],
                    {})),
    Case("quantize_hif8_mul", npu.npu_quantize,
         lambda d: ([randn(3, 7, 33, dtype=d) * 30, (torch.rand(7, 1) + 0.5).to(d),
                     torch.randn(7, 1).to(d), 290, -2, False], {})),
    Case("quantize_ascend_int4", npu.npu_quantize,
         lambda d: ([randn(3, 7, 64, dtype=d) * 5, (torch.rand(7, 1) + 0.5).to(d),
                     randn(7, 1, dtype=d), torch.quint4x2, -2, False], {})),
    Case("add_rms_norm_dynamic_quant", npu.npu_add_rms_norm_dynamic_quant,
         lambda d: _arndq(d, smooth_scale1=torch.rand(48, dtype=d) + 0.5,
                          smooth_scale2=torch.rand(48, dtype=d) + 0.5, beta=randn(48, dtype=d)),
         codes_off_by_one=True),
    Case("add_rms_norm_dynamic_quant_one_branch", npu.npu_add_rms_norm_dynamic_quant,
         lambda d: _arndq(d, output_mask=[True, False]), codes_off_by_one=True),
    Case("swiglu", npu.npu_swiglu, lambda d: ([randn(3, 7, 2 * 83, dtype=d)], {}), R.swiglu),
    Case("swiglu_dim0_noncontig", npu.npu_swiglu,
         lambda d: ([_noncontig(randn(14, 9, dtype=d)), 0], {}), R.swiglu),
    Case("swiglu_backward", npu.npu_swiglu_backward,
         lambda d: ([randn(3, 83, dtype=d), randn(3, 166, dtype=d)], {}), R.swiglu_backward),
    Case("geglu_tanh", npu.npu_geglu, lambda d: ([randn(5, 2 * 83, dtype=d)], {}), R.geglu),
    Case("geglu_erf_left", npu.npu_geglu, lambda d: ([randn(6, 4, 7, dtype=d), 1, 0, True], {}),
         R.geglu),
    Case("geglu_grad", npu.npu_geglu_grad,
         lambda d: ([randn(5, 83, dtype=d), x := randn(5, 166, dtype=d),
                     npu.npu_geglu(x)[1]], {})),
    Case("geglu_grad_erf_left", npu.npu_geglu_grad,
         lambda d: ([randn(5, 4, 7, dtype=d), x := randn(5, 8, 7, dtype=d),
                     npu.npu_geglu(x, 1, 0, True)[1], 1, 0, True], {})),
    Case("fast_gelu", npu.fast_gelu, lambda d: ([randn(7, 83, dtype=d) * 4], {}), R.fast_gelu),
    Case("npu_fast_gelu", npu.npu_fast_gelu, lambda d: ([randn(0, 5, dtype=d)], {}),
         R.fast_gelu),
    Case("fast_gelu_backward", npu.npu_fast_gelu_backward,
         lambda d: ([randn(7, 83, dtype=d), randn(7, 83, dtype=d) * 4], {}),
         R.fast_gelu_backward),
    Case("rotary_half", npu.npu_rotary_mul, _rotary, R.rotary_mul),
    Case("rotary_interleave", npu.npu_rotary_mul, lambda d: _rotary(d, "interleave"),
         R.rotary_mul),
    Case("rotary_matrix", npu.npu_rotary_mul,
         lambda d: ([randn(2, 3, 8, dtype=d), randn(2, 3, 8, dtype=d), randn(2, 3, 8, dtype=d),
                     "half", randn(8, 8, dtype=d)], {}),
         lambda x, r1, r2, m, rot: R.rotary_mul(x, r1, r2, m, rot), scale=2),
    Case("rotary_backward", npu.npu_rotary_mul_backward,
         lambda d: ([randn(2, 5, 3, 64, dtype=d), *_rotary(d)[0]], {}),
         R.rotary_mul_backward, scale=8),
    Case("interleave_rope", npu.npu_interleave_rope,
         lambda d: ([randn(2, 3, 5, 64, dtype=d), randn(2, 1, 5, 64, dtype=d),
                     randn(2, 1, 1, 64, dtype=d)], {})),
    Case("scaled_masked_softmax", npu.npu_scaled_masked_softmax, _softmax,
         R.scaled_masked_softmax),
    Case("scaled_masked_softmax_triu", npu.npu_scaled_masked_softmax,
         lambda d: _softmax(d, True), R.scaled_masked_softmax),
    Case("scaled_masked_softmax_backward", npu.npu_scaled_masked_softmax_backward,
         _softmax_backward, R.scaled_masked_softmax_backward, scale=2),
    Case("confusion_transpose", npu.npu_confusion_transpose,
         lambda d: ([randn(2, 3, 4, 5, dtype=d), [0, 2, 1, 3], [2, 4, 15], True], {}),
         R.confusion_transpose),
    Case("confusion_transpose_view_first", npu.npu_confusion_transpose,
         lambda d: ([randn(6, 20, dtype=d), [1, 0, 2], [6, 4, 5], False], {}),
         R.confusion_transpose),
    Case("confusion_transpose_backward", npu.npu_confusion_transpose_backward,
         lambda d: ([randn(2, 4, 15, dtype=d), [0, 2, 1, 3], [2, 3, 4, 5], False], {}),
         R.confusion_transpose_backward),
    # edge shapes: empty, single element, non-contiguous
    Case("swiglu_empty", npu.npu_swiglu, lambda d: ([randn(0, 3, 10, dtype=d)], {}), R.swiglu),
    Case("add_rms_norm_one", npu.npu_add_rms_norm,
         lambda d: ([randn(1, 1, dtype=d), randn(1, 1, dtype=d), torch.ones(1, dtype=d)], {}),
         R.add_rms_norm),
    Case("rotary_noncontig", npu.npu_rotary_mul,
         lambda d: ([randn(3, 2, 4, 16, dtype=d).transpose(0, 1), randn(1, 3, 1, 16, dtype=d),
                     randn(1, 3, 1, 16, dtype=d)], {}), R.rotary_mul),
    Case("scaled_masked_softmax_noncontig_uint8", npu.npu_scaled_masked_softmax,
         lambda d: ([randn(2, 2, 33, 7, dtype=d).transpose(-1, -2),
                     (torch.rand(2, 1, 7, 33) < 0.5).to(torch.uint8), 2.0, False], {}),
         R.scaled_masked_softmax),
    Case("scaled_masked_softmax_empty", npu.npu_scaled_masked_softmax,
         lambda d: ([randn(0, 2, 4, 8, dtype=d), torch.zeros(1, 1, 4, 8, dtype=torch.bool)], {}),
         R.scaled_masked_softmax),
    Case("dynamic_quant_noncontig", npu.npu_dynamic_quant,
         lambda d: ([randn(64, 9, dtype=d).t()], {})),
    Case("quant_matmul", npu.npu_quant_matmul,
         lambda d: _qmm(d, pertoken_scale=torch.rand(5), bias=torch.randn(24).to(d))
         if d != F32 else _qmm(d, offset=torch.randn(24), bias=torch.ones(24, dtype=I32))),
    Case("quant_matmul_int4_int64_scale", npu.npu_quant_matmul,
         lambda d: (lambda a, k: (a[:2] + [npu.npu_trans_quant_param(a[2], torch.ones(24))], k))(
             *_qmm(d, int4=True)), dtypes=(F32,)),
    Case("quant_matmul_a8w4", npu.npu_quant_matmul,
         lambda d: ([torch.randint(-128, 128, (5, 64), dtype=torch.int8),
                     torch.randint(-2**31, 2**31 - 1, (64, 3), dtype=I32), torch.rand(2, 24)],
                    dict(offset=torch.randn(24), pertoken_scale=torch.rand(5),
                         output_dtype=torch.bfloat16 if d == torch.bfloat16 else torch.float16,
                         group_sizes=[0, 0, 32])), dtypes=LOW_DTYPES),
    Case("quant_matmul_int32", npu.npu_quant_matmul,
         lambda d: _qmm(d, output_dtype=I32, bias=torch.ones(24, dtype=I32)), dtypes=(F32,)),
    Case("quant_matmul_fp8", npu.npu_quant_matmul,
         lambda d: ([randn(5, 40).to(torch.float8_e4m3fn), randn(24, 40).to(torch.float8_e5m2).t(),
                     torch.rand(24)], dict(pertoken_scale=torch.rand(5), bias=torch.randn(24),
                                           output_dtype=d))),
    Case("quant_matmul_mxfp4", npu.npu_quant_matmul,
         lambda d: ([torch.randint(0, 256, (5, 48), dtype=torch.uint8),
                     torch.randint(0, 256, (24, 48), dtype=torch.uint8).t(),
                     torch.randint(120, 135, (24, 2, 2), dtype=torch.uint8).transpose(0, 1)],
                    dict(pertoken_scale=torch.randint(120, 135, (5, 2, 2), dtype=torch.uint8),
                         x1_dtype=296, x2_dtype=296, scale_dtype=293, pertoken_scale_dtype=293,
                         output_dtype=d))),
    Case("quant_matmul_fp8_per_block", npu.npu_quant_matmul,
         lambda d: ([randn(5, 200).to(torch.float8_e4m3fn),
                     randn(140, 200).to(torch.float8_e5m2).t(), torch.rand(2, 2).t() + 0.5],
                    dict(pertoken_scale=torch.rand(5, 2) + 0.5, bias=torch.randn(140),
                         output_dtype=d))),
    Case("quant_matmul_hif8_per_block", npu.npu_quant_matmul,
         lambda d: ([_bytes(3, 4, 150, lo=0, hi=100), _bytes(150, 20, lo=128, hi=228),
                     torch.rand(2, 1)], dict(pertoken_scale=torch.rand(3, 1, 2), x1_dtype=290,
                                            x2_dtype=290, group_sizes=[128, 128, 128],
                                            output_dtype=d))),
    Case("quant_matmul_mx_e1m2", npu.npu_quant_matmul,
         lambda d: ([_bytes(5, 48), _bytes(24, 48).t(),
                     torch.randint(120, 135, (24, 2, 2), dtype=torch.uint8).transpose(0, 1)],
                    dict(pertoken_scale=torch.randint(120, 135, (5, 2, 2), dtype=torch.uint8),
                         x1_dtype=297, x2_dtype=297, scale_dtype=293, pertoken_scale_dtype=293,
                         output_dtype=d))),
    Case("trans_quant_param", npu.npu_trans_quant_param,
         lambda d: ([torch.rand(1, 6), torch.randn(6) * 100, 1], {}), dtypes=(F32,)),
    Case("convert_weight_to_int4pack", npu.npu_convert_weight_to_int4pack,
         lambda d: ([torch.randint(-8, 8, (3, 4, 16), dtype=I32)], {}), dtypes=(F32,)),
    Case("dynamic_mx_quant_fp4", npu.npu_dynamic_mx_quant, lambda d: _mx(d, round_mode="floor")),
    Case("dynamic_mx_quant_fp8_axis0", npu.npu_dynamic_mx_quant,
         lambda d: _mx(d, axis=0, dst_type=24, scale_alg=1)),
    Case("dynamic_mx_quant_e1m2", npu.npu_dynamic_mx_quant, lambda d: _mx(d, dst_type=297)),
    Case("dynamic_mx_quant_with_dual_axis", npu.npu_dynamic_mx_quant_with_dual_axis,
         lambda d: ([_mx(d)[0][0].reshape(2, 35, 64)], {"dst_type": 23})),
    Case("grouped_dynamic_mx_quant", npu.npu_grouped_dynamic_mx_quant,
         lambda d: ([_mx(d)[0][0], torch.tensor([3, 64, 70], dtype=I32)], {"dst_type": 24})),
    Case("dynamic_block_quant", npu.npu_dynamic_block_quant,
         lambda d: ([_mx(d)[0][0].reshape(2, 35, 64)], {"row_block_size": 4,
                                                        "col_block_size": 32})),
    Case("dynamic_block_quant_hif8", npu.npu_dynamic_block_quant,
         lambda d: ([_mx(d)[0][0].reshape(2, 35, 64)], {"dst_type": 290, "round_mode": "round",
                                                        "row_block_size": 4,
                                                        "col_block_size": 32})),
    Case("dynamic_block_quant_fp8", npu.npu_dynamic_block_quant,
         lambda d: ([_mx(d)[0][0]], {"dst_type": 24, "min_scale": 1e-3})),
    Case("moe_gating", npu.npu_moe_gating_top_k_softmax, _gating),
    Case("moe_gating_v2", npu.npu_moe_gating_top_k_softmax_v2,
         lambda d: ([randn(2, 7, 20, dtype=d)], dict(k=3, finished=torch.rand(2, 7) < 0.3,
                                                     output_softmax=True))),
    Case("moe_gating_v2_renorm", npu.npu_moe_gating_top_k_softmax_v2,
         lambda d: ([randn(9, 33, dtype=d)], dict(k=5, renorm=1))),
    Case("moe_init_routing", npu.npu_moe_init_routing, _init_routing),
    Case("moe_init_routing_v2", npu.npu_moe_init_routing_v2,
         lambda d: ([randn(11, 24, dtype=d), _ROUTING_V2], dict(
             active_num=25, expert_num=8, expert_tokens_num_type=2, expert_tokens_num_flag=True,
             active_expert_range=[1, 7], scale=torch.rand(11)))),
    Case("moe_init_routing_v2_gather_counts", npu.npu_moe_init_routing_v2,
         lambda d: ([randn(11, 24, dtype=d), _ROUTING_V2], dict(
             expert_num=8, expert_tokens_num_type=0, expert_tokens_num_flag=True,
             row_idx_type=1))),
    Case("moe_init_routing_v2_drop_pad_dynamic", npu.npu_moe_init_routing_v2,
         lambda d: ([randn(11, 24, dtype=d), _ROUTING_V2], dict(
             expert_num=8, drop_pad_mode=1, expert_capacity=3, expert_tokens_num_type=1,
             expert_tokens_num_flag=True, quant_mode=1, scale=torch.rand(8, 24) + 0.5)),
         codes_off_by_one=True),
    Case("moe_init_routing_v2_dynamic", npu.npu_moe_init_routing_v2,
         lambda d: ([randn(11, 24, dtype=d), _ROUTING_V2], dict(
             expert_num=8, quant_mode=1, active_expert_range=[2, 8], scale=torch.rand(6, 24))),
         codes_off_by_one=True),
    Case("moe_init_routing_v2_static", npu.npu_moe_init_routing_v2,
         lambda d: ([randn(11, 24, dtype=d) * 50, _ROUTING_V2], dict(
             expert_num=8, quant_mode=0, scale=torch.tensor([0.7]), offset=torch.tensor([0.2]))),
         codes_off_by_one=True),
    Case("moe_compute_expert_tokens", npu.npu_moe_compute_expert_tokens,
         lambda d: ([torch.tensor([0, 0, 1, 3, 3, 3, 6], dtype=I32), 8], {}), dtypes=(F32,)),
    Case("moe_finalize", npu.npu_moe_finalize_routing, _finalize, R.moe_finalize_routing,
         scale=4),
    Case("moe_finalize_drop_pad", npu.npu_moe_finalize_routing,
         lambda d: ([randn(4, 5, 24, dtype=d), randn(11, 24, dtype=d), None, None,
                     randn(11, 2, dtype=d), torch.randint(-1, 20, (22,), dtype=I32), None, 3],
                    {}), R.moe_finalize_routing, scale=4),
    Case("moe_token_permute", npu.npu_moe_token_permute, lambda d: (_token_permute(d)[0], {}),
         dtypes=(F32, F64)),
    Case("moe_token_permute_drop", npu.npu_moe_token_permute,
         lambda d: ([randn(9, 24, dtype=d), torch.randint(0, 4, (9,), dtype=I32), -2], {}),
         dtypes=(F32,)),
    Case("moe_token_permute_grad", npu.npu_moe_token_permute_grad,
         lambda d: ([randn(9, 24, dtype=d), randn(20, 24, dtype=d), _TOKEN_ROUTING,
                     _token_permute(d, 20)[1]], {}), scale=4),
    Case("moe_token_permute_grad_v2", npu.npu_moe_token_permute_grad_v2,
         lambda d: ([randn(20, 24, dtype=d), _token_permute(d, 20)[1], 9, d, 3], {}), scale=4),
    Case("moe_token_unpermute", npu.npu_moe_token_unpermute,
         lambda d: ([randn(20, 24, dtype=d), _token_permute(d, 20)[1],
                     torch.rand(9, 3, dtype=d)], {}), scale=4),
    Case("moe_token_unpermute_no_probs", npu.npu_moe_token_unpermute,
         lambda d: ([randn(27, 24, dtype=d), _token_permute(d)[1]], {})),
    Case("moe_token_unpermute_grad", npu.npu_moe_token_unpermute_grad,
         lambda d: ([randn(20, 24, dtype=d), randn(9, 24, dtype=d), _token_permute(d, 20)[1],
                     torch.rand(9, 3)], {}), scale=4),
    Case("moe_token_unpermute_grad_v2", npu.npu_moe_token_unpermute_grad_v2,
         lambda d: ([randn(27, 24, dtype=d), _token_permute(d)[1], 27, d], {})),
    Case("moe_token_permute_with_routing_map", npu.npu_moe_token_permute_with_routing_map,
         lambda d: ([randn(9, 24, dtype=d), _ROUTING_MAP],
                    dict(probs=torch.rand(9, 5, dtype=d), num_out_tokens=18))),
    Case("moe_token_permute_with_routing_map_pad", npu.npu_moe_token_permute_with_routing_map,
         lambda d: ([randn(9, 24, dtype=d), _ROUTING_MAP.to(torch.int8)],
                    dict(num_out_tokens=20, drop_and_pad=True))),
    Case("moe_token_permute_with_routing_map_grad",
         npu.npu_moe_token_permute_with_routing_map_grad,
         lambda d: ([randn(18, 24, dtype=d), torch.rand(18), _routing_map_rows()[2], _ROUTING_MAP,
                     5, 9, False], {}), scale=4),
    Case("moe_token_unpermute_with_routing_map", npu.npu_moe_token_unpermute_with_routing_map,
         lambda d: ([randn(18, 24, dtype=d), _routing_map_rows()[2], [9, 24]],
                    dict(probs=torch.rand(9, 5, dtype=d), routing_map=_ROUTING_MAP)), scale=4),
    Case("moe_token_unpermute_with_routing_map_internal_pad",
         npu._npu_moe_token_unpermute_with_routing_map,
         lambda d: ([randn(20, 24, dtype=d), _routing_map_rows(True)[2], [9, 24]],
                    dict(probs=torch.rand(9, 5, dtype=d), drop_and_pad=True)), scale=4),
    Case("moe_token_unpermute_with_routing_map_grad",
         npu.npu_moe_token_unpermute_with_routing_map_grad,
         lambda d: ([randn(9, 24, dtype=d), *_routing_map_grad_index(), _ROUTING_MAP,
                     randn(20, 24, dtype=d),
                     torch.rand(9, 5, dtype=d), True, [9, 24]], {}), scale=4),
    Case("grouped_matmul_list", npu.npu_grouped_matmul.List, _gmm, scale=4),
    Case("grouped_matmul_split3", npu.npu_grouped_matmul.List, lambda d: _gmm(d, 3), scale=4),
    Case("grouped_matmul_tensors", npu.npu_grouped_matmul, _gmm_tensor, scale=4),
    Case("grouped_matmul_tensor_group_list", npu.npu_grouped_matmul,
         lambda d: ([_gmm(d)[0][0], _gmm(d)[0][1]],
                    dict(group_list=torch.tensor([5, 5, 20]), split_item=2, group_type=0)), scale=4),
    # the per-token A8W8 path with a fused activation (float32 values, one rounding), and
    # group_list_type 2's (group, rows) pairs out of group order, a group repeated
    Case("grouped_matmul_a8w8_act", npu.npu_grouped_matmul,
         lambda d: ([[torch.randint(-128, 128, (12, 32), dtype=torch.int8)],
                     [torch.randint(-128, 128, (3, 32, 16), dtype=torch.int8)]],
                    dict(scale=[torch.rand(3, 16) * 1e-3], per_token_scale=[torch.rand(12)],
                         group_list=torch.tensor([[2, 5], [0, 4], [2, 3]]), split_item=3,
                         group_type=0, group_list_type=2, act_type=2, output_dtype=d))),
    Case("grouped_matmul_pairs", npu.npu_grouped_matmul,
         lambda d: ([_gmm(d)[0][0], _gmm(d)[0][1]],
                    dict(group_list=torch.tensor([[1, 6], [0, 0], [2, 9], [1, 8]]), split_item=2,
                         group_type=0, group_list_type=2)), scale=4),
    Case("grouped_matmul_fp8", npu.npu_grouped_matmul.List,
         lambda d: ([[randn(5, 40).to(torch.float8_e4m3fn)],
                     [randn(2, 24, 40).to(torch.float8_e5m2).mT]],
                    dict(scale=[torch.rand(2, 24)], per_token_scale=[torch.rand(5)],
                         bias=[torch.randn(2, 24)], group_list=[2, 5], split_item=3,
                         group_type=0, output_dtype=d))),
    Case("grouped_matmul_mxfp4", npu.npu_grouped_matmul.List,
         lambda d: ([[_bytes(5, 48).view(torch.float4_e2m1fn_x2)],
                     [_bytes(2, 24, 48).view(torch.float4_e2m1fn_x2).mT]],
                    dict(scale=[_bytes(2, 24, 2, 2, lo=120, hi=135).view(torch.float8_e8m0fnu)
                                .transpose(1, 2)],
                         per_token_scale=[_bytes(5, 2, 2, lo=120, hi=135)
                                          .view(torch.float8_e8m0fnu)],
                         group_list=[3, 5], split_item=3, group_type=0, output_dtype=d))),
    Case("ffn_swiglu", npu.npu_ffn, _ffn, scale=4),
    Case("ffn_experts_gelu", npu.npu_ffn, lambda d: _ffn(d, "gelu", True), scale=4),
    Case("ffn_int8", npu.npu_ffn, _ffn_int8, dtypes=(F32,), scale=4),
    Case("fusion_attention", npu.npu_fusion_attention, _attention, _ref_attention, scale=2,
         kernel_scale=4),
    Case("fusion_attention_bsh_causal_pse_sink", npu.npu_fusion_attention,
         lambda d: _attention(d, "BSH", 3, pse=True, sink=True), _ref_attention, scale=2,
         kernel_scale=4),
    Case("fusion_attention_sbh_prefix", npu.npu_fusion_attention,
         lambda d: _attention(d, "SBH", 5, gqa=False), _ref_attention, scale=2, kernel_scale=4),
    Case("fusion_attention_bsnd_band", npu.npu_fusion_attention,
         lambda d: _attention(d, "BSND", 4), _ref_attention, scale=2, kernel_scale=4),
    Case("fusion_attention_tnd", npu.npu_fusion_attention, _attention_tnd, kernel_scale=4),
    Case("fusion_attention_tnd_mode8", npu.npu_fusion_attention,
         lambda d: _attention_tnd(d, 8), kernel_scale=4),
    Case("fusion_attention_v2_rope_pse0", npu.npu_fusion_attention_v2, _attention_v2_rope,
         kernel_scale=4),
    Case("fusion_attention_v2_bnsd_rope", npu.npu_fusion_attention_v2,
         lambda d: _attention_v2_rope(d, "BNSD"), kernel_scale=4),
    Case("fusion_attention_v3", npu.npu_fusion_attention_v3,
         lambda d: _attention(d, "BSND", 4), kernel_scale=4),
    Case("fusion_attention_v3_tnd", npu.npu_fusion_attention_v3, _attention_v3_tnd,
         kernel_scale=4),
    Case("fia_decode_paged_gqa", npu.npu_fused_infer_attention_score, _fia_decode_paged),
    Case("fia_prefill_bnsd_mask", npu.npu_fused_infer_attention_score, _fia_prefill),
    Case("fia_workspace", npu._npu_fused_infer_attention_score_get_max_workspace, _fia_prefill),
    Case("fia_infer_output", npu._npu_fused_infer_attention_score_infer_output,
         lambda d: ([randn(2, 4, 1, 8, dtype=d), randn(2, 2, 9, 8, dtype=d)],
                    dict(input_layout="BNSD", num_heads=4, num_key_value_heads=2,
                         softmax_lse_flag=True))),
    Case("fia_v2_tnd_sink", npu.npu_fused_infer_attention_score_v2, _fia_v2_tnd),
    Case("fia_int8_out", npu.npu_fused_infer_attention_score,
         lambda d: (_fia_prefill(d)[0], {**_fia_prefill(d)[1], "quant_scale2": randn(4, 16) * 20}),
         codes_off_by_one=True),
    Case("fia_v2_hif8_out", npu.npu_fused_infer_attention_score_v2,
         lambda d: (_fia_v2_tnd(d)[0], {**_fia_v2_tnd(d)[1], "quant_scale_out": randn(1) * 500,
                                        "out_dtype": 290}),
         codes_off_by_one=True),
    Case("fia_v2_workspace", npu._npu_fused_infer_attention_score_v2_get_max_workspace,
         _fia_v2_tnd),
    Case("fia_v2_infer_output", npu._npu_fused_infer_attention_score_v2_infer_output,
         lambda d: ([randn(2, 4, 1, 8, dtype=d), randn(2, 2, 9, 8, dtype=d)],
                    dict(input_layout="BNSD", num_query_heads=4, num_key_value_heads=2,
                         return_softmax_lse=True, quant_scale_out=randn(1),
                         out_dtype=torch.float8_e5m2))),
    Case("fusion_attention_grad", npu.npu_fusion_attention_grad, _attention_grad,
         kernel_scale=8),
    Case("fusion_attention_grad_pse_sink", npu.npu_fusion_attention_grad,
         lambda d: _attention_grad(d, layout="BSH", mode=2, pse=True, sink=True), kernel_scale=8),
    Case("fusion_attention_grad_tnd", npu.npu_fusion_attention_grad, _attention_grad_tnd,
         kernel_scale=8),
    Case("fusion_attention_grad_v2_rope", npu.npu_fusion_attention_grad_v2, _attention_grad_v2,
         kernel_scale=8),
    Case("fusion_attention_grad_v3", npu.npu_fusion_attention_grad_v3, _attention_grad_v3,
         kernel_scale=8),
    Case("fusion_attention_grad_v3_tnd", npu.npu_fusion_attention_grad_v3,
         lambda d: _attention_grad_v3(d, True), kernel_scale=8),
    Case("scatter_nd_update", npu.npu_scatter_nd_update,
         lambda d: ([randn(6, 5, 3, dtype=d), torch.tensor([[4, 1], [0, 2], [5, 0]]),
                     randn(3, 3, dtype=d)], {})),
    Case("top_k_top_p", npu.npu_top_k_top_p,
         lambda d: ([randn(5, 300, dtype=d), torch.rand(5).to(d),
                     torch.tensor([1, 7, 300, 40, 2], dtype=I32)], {})),
    Case("top_k_top_p_sample", npu.npu_top_k_top_p_sample,
         lambda d: ([randn(5, 300, dtype=d) * 3, torch.tensor([1, 7, 2000, 40, 2000], dtype=I32),
                     torch.tensor([0.5, 1.0, 0.7, 0.0, 1.0]).to(d)],
                    dict(q=torch.rand(5, 300), min_ps=torch.tensor([0.0, 0.2, 0.1, 0.5, 0.3]),
                         is_need_logits=True))),
]


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _flat(o)]
    return [out]


def _looser(a, b):
    """The dtype of the larger tolerance: a float32 output computed from low-precision inputs (a
    weight gradient, a statistic) is compared at the inputs' tolerance, as the op tests do."""
    return a if b is None or tolerance(a)[0] >= tolerance(b)[0] else b


def _compare(case, port, kernel, refs=None, where="portable", dtype=None):
    port, kernel = _flat(port), _flat(kernel)
    assert len(port) == len(kernel)
    for i, (p, k) in enumerate(zip(port, kernel)):
        if not isinstance(k, torch.Tensor):
            assert p == k, f"output {i}: {p} vs the kernel's {k}"
            continue
        assert p.dtype == k.dtype and p.shape == k.shape, \
            f"output {i}: {p.dtype} {tuple(p.shape)} vs the kernel's {k.dtype} {tuple(k.shape)}"
        assert p.device.type == k.device.type or where != "portable"
        p, k = p.cpu(), k.cpu()
        if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # fp8 codes: bit for bit
            p, k = p.view(torch.uint8), k.view(torch.uint8)
        if not (p.is_floating_point() or p.is_complex()):
            if case.codes_off_by_one:
                assert p.numel() == 0 or (p.int() - k.int()).abs().max() <= 1, f"output {i}"
            else:
                assert torch.equal(p, k), f"output {i}: differs from the kernel's"
            continue
        if k.numel() == 1 and k.dim() == 0:
            continue  # a disabled branch's placeholder
        assert_close(p, k, dtype=_looser(p.dtype, dtype), scale=case.kernel_scale,
                     msg=f"output {i} against the CPU kernel")
    if refs is not None:
        for i, (p, r) in enumerate(zip(port, _flat(refs))):
            if isinstance(r, torch.Tensor) and p.is_floating_point():
                assert_close(p.cpu(), r, dtype=_looser(p.dtype, dtype), scale=case.scale,
                             msg=f"output {i} against the reference")


def _case_params():
    return [pytest.param(c, d, id=f"{c.id}-{dtype_id(d)}") for c in CASES for d in c.dtypes]


@pytest.mark.parametrize("case,dtype", _case_params())
def test_forced_portable_matches_reference_and_kernel(case, dtype):
    args, kwargs = case.make(dtype)
    kernel = case.op(*args, **kwargs)
    with portable.force():
        port = case.op(*args, **kwargs)
    refs = case.ref(*args, **kwargs) if case.ref is not None else None
    _compare(case, port, kernel, refs, dtype=dtype)


def _qualname(op):
    if isinstance(op, torch._ops.OpOverloadPacket):
        op = op.default
    name = op._schema.name
    return name if op._overloadname == "default" else f"{name}.{op._overloadname}"


def test_opcheck_forced():
    """Schema and fake-kernel agreement (shapes, dtypes, strides) of the portable kernels."""
    seen = set()
    with portable.force():
        for case in CASES:
            name = _qualname(case.op)
            if name in seen or case.id == "grouped_matmul_tensor_group_list":
                continue
            seen.add(name)
            op = case.op.default if isinstance(case.op, torch._ops.OpOverloadPacket) else case.op
            args, kwargs = case.make(F32)
            torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor"))


def test_cases_cover_every_op():
    covered = {_qualname(c.op) for c in CASES}
    wanted = {q for q in portable.IMPLS if q.startswith("npu::")} - portable.NOT_DECOMPOSED
    assert wanted <= covered, sorted(wanted - covered)


@pytest.mark.parametrize("dtype", (F32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("kind", ["bsh", "tnd", "given_mask"])
def test_attention_dropout_matches_the_kernel(kind, dtype):
    """Dropout draws the same Philox bits and advances the generator as the CPU kernel does;
    gradients through autograd regenerate them."""
    if kind == "tnd":
        args, kwargs = _attention_tnd(dtype)
    else:
        args, kwargs = _attention(dtype, "BSH", 3, pse=True, sink=True)
    kwargs["keep_prob"] = 0.7
    if kind == "given_mask":
        numels = 2 * 4 * 17 * 23
        # the mask (seed, offset) gives: backward regenerates it from them
        kwargs["dropout_mask"] = npu._npu_dropout_gen_mask.Tensor(args[0], [numels], 0.3, 9, 4)
        kwargs.update(seed=9, offset=4)

    def run():
        opennpu.manual_seed(5)
        leaves = [t.detach().clone().requires_grad_() for t in args[:3]]
        res = opennpu.npu_fusion_attention(*leaves, *args[3:], **kwargs)
        grads = torch.autograd.grad(res[0], leaves, torch.ones_like(res[0]))
        return [*res, *grads], opennpu.get_rng_state()

    kernel, kernel_state = run()
    with portable.force():
        port, port_state = run()
    assert port_state == kernel_state
    case = Case("dropout", None, None, kernel_scale=8)
    _compare(case, port, kernel, dtype=dtype)


def test_gen_mask_portable_gives_the_kernel_bits():
    x = torch.empty(3)
    want = npu._npu_dropout_gen_mask.Tensor(x, [300], 0.3, 7, 0)
    got = portable._npu_dropout_gen_mask(x, [300], 0.3, 7, 0)
    assert torch.equal(got, want)


def test_add_rms_norm_v2_portable_writes_like_the_kernel():
    x1, x2, g = randn(6, 40, dtype=torch.bfloat16), randn(6, 40, dtype=torch.bfloat16), \
        torch.rand(40) + 0.5
    a, b = x1.clone(), x2.clone()
    want = npu.npu_add_rms_norm_v2(a, b, g)
    c, d = x1.clone(), x2.clone()
    with portable.force():
        got = npu.npu_add_rms_norm_v2(c, d, g)
    assert got.dtype == want.dtype
    assert_close(got, want)
    assert_close(c, a, scale=2)
    assert torch.equal(d, b)


def test_grouped_matmul_unimplemented_quantised_paths_are_refused():
    # A8W8 and the weight-only paths have compositions (test_grouped_matmul_quant.py compares
    # them with the kernel); the A8W4 offset and int4 x do not
    (x, w), kw = _gmm(F32)
    with portable.force(), pytest.raises(NotImplementedError, match="offset"):
        npu.npu_grouped_matmul.List(x, w, offset=[torch.ones(8)], **kw)


def test_grouped_matmul_pairs_and_act_type_errors_follow_the_kernel():
    """Bad (group, rows) pairs and act_type uses raise on the portable path as on the kernel."""
    (x, w), _ = _gmm(F32)
    xq, wq = torch.randint(-128, 128, (6, 16), dtype=torch.int8), \
        torch.randint(-128, 128, (3, 16, 8), dtype=torch.int8)
    pairs = dict(split_item=2, group_type=0, group_list_type=2)
    bad = [
        (([x[0]], [w[0]]), dict(pairs, group_list=torch.tensor([[3, 4]])),
         r"'group_list' must hold group indices in \[0, 3\) .* entry 0 has 3"),
        (([x[0]], [w[0]]), dict(pairs, group_list=torch.tensor([[0, -1]])),
         r"'group_list' must hold non-negative group sizes .* entry 0 has -1 after 0"),
        (([x[0]], [w[0]]), dict(pairs, group_list=torch.tensor([[0, 5], [1, 19]])),
         r"'group_list' must hold non-negative group sizes .* entry 1 has 19 after 5"),
        (([x[0]], [w[0]]), dict(pairs, group_list=torch.tensor([0, 5])),
         r"'group_list' must be \[E, 2\] .* but got shape \[2\]"),
        (([x[0]], [w[0]]), dict(pairs, group_list=torch.tensor([[0, 5]]), split_item=0),
         r"'split_item' must be 2 or 3"),
        (([x[0]], [w[0]]), dict(group_list=torch.tensor([5, 10, 23]), split_item=3,
                                 group_type=0, act_type=1), r"'act_type' applies only"),
        (([xq], [wq]), dict(scale=[torch.rand(3, 8)], per_token_scale=[torch.rand(6)],
                            group_list=torch.tensor([2, 4, 6]), split_item=3, group_type=0,
                            act_type=3, output_dtype=torch.bfloat16), r"'act_type' must be 0"),
        (([xq], [wq]), dict(scale=[torch.rand(3, 8)], per_token_scale=[torch.rand(6)],
                            group_list=torch.tensor([2, 4, 6]), split_item=3, group_type=0,
                            act_type=1), r"'output_dtype' must be torch.float16"),
    ]
    for (xs, ws), kw, pattern in bad:
        for forced in (False, True):
            with contextlib.ExitStack() as stack:
                if forced:
                    stack.enter_context(portable.force())
                with pytest.raises(RuntimeError, match=pattern):
                    npu.npu_grouped_matmul(xs, ws, **kw)


# ----------------------------------------------------------------------------- gradients
# The autograd formulas of the family modules call the backward ops, which the forced path
# serves too: gradients through the portable path equal the kernel's and the oracle's.

GRAD_CASES = {
    "npu_rms_norm": (lambda x, g: opennpu.npu_rms_norm(x, g)[0],
                     lambda d: [randn(4, 7, 83, dtype=d), torch.rand(83, dtype=d) + 0.5],
                     lambda x, g: R.rms_norm(x, g)[0]),
    "npu_add_rms_norm": (lambda a, b, g: opennpu.npu_add_rms_norm(a, b, g)[0::2],
                         lambda d: [randn(3, 65, dtype=d), randn(3, 65, dtype=d),
                                    torch.rand(65, dtype=d) + 0.5], None),
    "npu_swiglu": (opennpu.npu_swiglu, lambda d: [randn(5, 2 * 83, dtype=d)], R.swiglu),
    "npu_geglu": (lambda x: opennpu.npu_geglu(x)[0], lambda d: [randn(5, 2 * 33, dtype=d)],
                  lambda x: R.geglu(x)[0]),
    "npu_fast_gelu": (opennpu.npu_fast_gelu, lambda d: [randn(7, 9, dtype=d)], R.fast_gelu),
    "fast_gelu": (opennpu.fast_gelu, lambda d: [randn(0, 9, dtype=d)], R.fast_gelu),
    "npu_gemma_rms_norm": (lambda x, g: opennpu.npu_gemma_rms_norm(x, g)[0],
                           lambda d: [randn(3, 5, 16, dtype=d), randn(5, 16, dtype=d)],
                           lambda x, g: R.gemma_rms_norm(x, g)[0]),
    "_silu_mul": (torch.ops.opennpu._silu_mul,
                  lambda d: [randn(4, 33, dtype=d), randn(4, 33, dtype=d)],
                  lambda a, b: torch.nn.functional.silu(a) * b),
    "npu_rotary_mul": (opennpu.npu_rotary_mul,
                       lambda d: [randn(2, 5, 3, 64, dtype=d), randn(1, 5, 1, 64, dtype=d),
                                  randn(1, 5, 1, 64, dtype=d)], R.rotary_mul),
    "npu_scaled_masked_softmax": (lambda x: opennpu.npu_scaled_masked_softmax(
        x, torch.zeros(7, 9, dtype=torch.bool), 0.5, True), lambda d: [randn(2, 7, 9, dtype=d)],
        lambda x: R.scaled_masked_softmax(x, None, 0.5, True)),
    "npu_confusion_transpose": (lambda x: opennpu.npu_confusion_transpose(
        x, [0, 2, 1, 3], [2, 4, 15], True), lambda d: [randn(2, 3, 4, 5, dtype=d)], None),
    "npu_moe_token_permute": (lambda x: opennpu.npu_moe_token_permute(x, _TOKEN_ROUTING.to(x.device), 20)[0],
                              lambda d: [randn(9, 24, dtype=d)], None),
    "npu_moe_token_unpermute": (lambda r, p: opennpu.npu_moe_token_unpermute(
        r, _token_permute(F32, 20)[1].to(r.device), p), lambda d: [randn(20, 24, dtype=d), torch.rand(9, 3)],
        None),
    "npu_moe_token_permute_with_routing_map": (
        lambda x, p: opennpu.npu_moe_token_permute_with_routing_map(
            x, _ROUTING_MAP.to(x.device), probs=p, num_out_tokens=20, drop_and_pad=True)[:2],
        lambda d: [randn(9, 24, dtype=d), torch.rand(9, 5)], None),
    "npu_moe_token_unpermute_with_routing_map": (
        lambda r, p: opennpu.npu_moe_token_unpermute_with_routing_map(
            r, _routing_map_rows()[2].to(r.device), [9, 24], probs=p,
            routing_map=_ROUTING_MAP.to(r.device)),
        lambda d: [randn(18, 24, dtype=d), torch.rand(9, 5)], None),
    "_npu_moe_token_unpermute_with_routing_map": (
        lambda r, p: opennpu._npu_moe_token_unpermute_with_routing_map(
            r, _routing_map_rows(True)[2].to(r.device), [9, 24], probs=p,
            routing_map=_ROUTING_MAP.to(r.device), drop_and_pad=True)[0],
        lambda d: [randn(20, 24, dtype=d), torch.rand(9, 5)], None),
    "npu_fusion_attention": (lambda q, k, v, p: opennpu.npu_fusion_attention(
        q, k, v, 4, "BSH", pse=p, atten_mask=torch.ones(2048, 2048, dtype=torch.bool,
                                                device=q.device).triu(1),
        sparse_mode=3, scale=0.3)[0],
        lambda d: [randn(2, 9, 32, dtype=d), randn(2, 11, 16, dtype=d), randn(2, 11, 16, dtype=d),
                   randn(1, 4, 9, 11, dtype=d)], None),
    "npu_fusion_attention_v2": (lambda q, k, v, qr, kr: opennpu.npu_fusion_attention_v2(
        q, k, v, 4, "BSH", query_rope=qr, key_rope=kr, scale=0.3)[0],
        lambda d: [randn(2, 9, 32, dtype=d), randn(2, 11, 16, dtype=d), randn(2, 11, 16, dtype=d),
                   randn(2, 9, 16, dtype=d), randn(2, 11, 8, dtype=d)], None),
    "npu_fusion_attention_v3": (lambda q, k, v: opennpu.npu_fusion_attention_v3(
        q, k, v, 2, "TND", actual_seq_qlen=torch.tensor([4, 9]),
        actual_seq_kvlen=torch.tensor([5, 11]), scale=0.3)[0],
        lambda d: [randn(9, 2, 8, dtype=d), randn(11, 1, 8, dtype=d), randn(11, 1, 8, dtype=d)],
        None),
}


def _grads(fn, inputs, seed=1):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.float() * torch.randn(o.shape, generator=gen).to(o.device)).sum() for o in outs)
    return torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])


@pytest.mark.parametrize("dtype", (F32, torch.bfloat16), ids=dtype_id)
@pytest.mark.parametrize("name", sorted(GRAD_CASES))
def test_gradients_through_the_portable_path(name, dtype):
    fn, make, ref = GRAD_CASES[name]
    inputs = make(dtype)
    kernel = _grads(fn, inputs)
    with portable.force():
        port = _grads(fn, inputs)
    for i, (p, k) in enumerate(zip(port, kernel)):
        assert p.dtype == k.dtype and p.shape == k.shape
        assert_close(p, k, scale=8, msg=f"grad {i} against the CPU kernel's")
    if ref is not None:
        want = _grads(ref, [t.double() for t in inputs])
        for i, (p, w) in enumerate(zip(port, want)):
            assert_close(p, w, dtype=dtype, scale=8, msg=f"grad {i} against the reference")


def test_every_differentiable_op_has_a_gradient_case():
    differentiable = {n for n, how in DIFFERENTIABILITY.items() if how == "autograd"
                      and hasattr(torch.ops.npu, n)}
    assert differentiable <= set(GRAD_CASES), sorted(differentiable - set(GRAD_CASES))


def test_gradcheck_float64_on_the_portable_path():
    x = torch.randn(3, 6, dtype=F64, requires_grad=True)
    g = (torch.rand(6, dtype=F64) + 0.5).requires_grad_()
    q = torch.randn(1, 2, 3, 4, dtype=F64, requires_grad=True)
    k = torch.randn(1, 1, 5, 4, dtype=F64, requires_grad=True)
    v = torch.randn(1, 1, 5, 4, dtype=F64, requires_grad=True)
    s = torch.randn(2, dtype=F64, requires_grad=True)
    with portable.force():
        torch.autograd.gradcheck(lambda a, b: opennpu.npu_rms_norm(a, b)[0], (x, g))
        torch.autograd.gradcheck(lambda a: opennpu.npu_geglu(a, approximate=0)[0], (x,))
        torch.autograd.gradcheck(
            lambda a, b, c, d: opennpu.npu_fusion_attention(a, b, c, 2, "BNSD", sink=d,
                                                            scale=0.5)[0], (q, k, v, s))


# ----------------------------------------------------------------------------- torch.compile


def _npu_nodes(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"
            and str(n.target).split(".")[0] in ("npu", "opennpu")]


def _recording_backend(graphs):
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    from functorch.compile import make_boxed_func

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record,
                        decompositions=select_decomp_table())


def _layer(x, g, r1, r2):
    y, _ = torch.ops.npu.npu_rms_norm(x, g, 1e-6)
    y = torch.ops.npu.npu_rotary_mul(y, r1, r2)
    y = torch.ops.npu.npu_swiglu(torch.cat([y, y * 2], -1))
    return torch.ops.npu.fast_gelu(y) + 1


def _layer_inputs(requires_grad=False):
    return [randn(2, 6, 32, requires_grad=requires_grad),
            (torch.rand(32) + 0.5).requires_grad_(requires_grad),
            randn(1, 6, 32), randn(1, 6, 32)]


@pytest.mark.parametrize("forced", [False, True], ids=["cpu", "forced"])
def test_compiled_graph_keeps_or_decomposes_the_ops(forced):
    graphs = []
    inputs = _layer_inputs(requires_grad=True)
    with portable.force(forced):
        want = _layer(*inputs)
        compiled = torch.compile(_layer, backend=_recording_backend(graphs), fullgraph=True,
                                 dynamic=True)
        got = compiled(*inputs)
        got.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    nodes = [t for gm in graphs for t in _npu_nodes(gm)]
    if forced:
        assert nodes == [], f"npu ops left in the forced graph: {nodes}"
    else:
        for op in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "fast_gelu"):
            assert any(op in t for t in nodes), (op, nodes)


def _map_tensors(value, fn):
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    return value


def test_every_op_traces_on_fake_cuda_tensors(dtype=F32):
    """No GPU needed: each case traced (Inductor's table, not forced) with fake CUDA inputs runs
    the composition on CUDA-device fake tensors, so a CPU-only constructor or a host round trip
    in it fails here, and no npu op is left in the graph. An op with a native CUDA kernel
    (csrc/ops/<family>/<family>_cuda.cu, where the build has CUDA) stays whole instead."""
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    table = select_decomp_table()
    seen = set()
    for case in CASES:  # one case per op (all of attention's: layouts and modes differ)
        if case.id in ("grouped_matmul_tensor_group_list", "grouped_dynamic_mx_quant",
                       "fusion_attention_v3_tnd", "fusion_attention_grad_v3_tnd") or (
                _qualname(case.op) in seen and "attention" not in case.id):
            continue
        seen.add(_qualname(case.op))
        args, kwargs = case.make(dtype)
        mode = FakeTensorMode()
        with mode:
            to_cuda = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,  # noqa: E731
                                                    device="cuda")
            fargs = _map_tensors(args, to_cuda)
            fkwargs = {k: _map_tensors(v, to_cuda) for k, v in kwargs.items()}
            gm = make_fx(lambda *a: case.op(*a, **fkwargs), decomposition_table=table)(*fargs)
        if "cuda" not in portable.PORTABLE_DEVICES.get(_qualname(case.op), ()):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(_qualname(case.op), "CUDA")
            assert _npu_nodes(gm) == [str(case.op if isinstance(case.op, torch._ops.OpOverload)
                                          else case.op.default)], (case.id, _npu_nodes(gm))
            continue
        assert _npu_nodes(gm) == [], (case.id, _npu_nodes(gm))
        devices = {n.meta["val"].device.type for n in gm.graph.nodes
                   if isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim()}
        assert devices <= {"cuda"}, (case.id, devices)


def test_decompositions_decline_cpu_and_host_data():
    from torch._inductor.decomposition import select_decomp_table

    table = select_decomp_table()
    (x, w), kw = _gmm(F32)
    gmm = table[npu.npu_grouped_matmul.default]
    assert table[npu.npu_rms_norm.default](*_x_gamma(F32)[0]) is NotImplemented  # CPU
    with portable.force():
        assert table[npu.npu_rms_norm.default](*_x_gamma(F32)[0]) is not NotImplemented
        assert gmm(x, w, group_list=torch.tensor([5, 5, 20]), group_type=0) is NotImplemented
        assert gmm(x, w, group_list=None, group_type=-1) is not NotImplemented


def test_inductor_keeps_the_fused_op_on_cpu():
    """Unforced on CPU the decomposition declines and Inductor calls the C++ kernel (an extern
    fallback that portable registers: Inductor refuses an implicit one for an op that also has a
    decomposition)."""
    from torch._inductor.utils import run_and_get_code

    x, g = _x_gamma(F32)[0]
    compiled = torch.compile(lambda a, b: torch.ops.npu.npu_rms_norm(a, b, 1e-6), fullgraph=True,
                             backend="inductor")
    out, code = run_and_get_code(compiled, x, g)
    assert "torch.ops.npu.npu_rms_norm.default" in "".join(code)
    torch.testing.assert_close(out, torch.ops.npu.npu_rms_norm(x, g), rtol=0, atol=0)


def test_import_does_not_load_inductor():
    """The decompositions and fallbacks are registered when Inductor's modules are imported."""
    import subprocess
    import sys

    code = ("import sys, opennpu; print(any(m.startswith('torch._inductor.decomposition') or "
            "m.startswith('torch._inductor.lowering') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False"], out.stderr[-2000:]


def test_forced_inductor_compiles_and_matches():
    inputs = _layer_inputs()
    with portable.force():
        compiled = torch.compile(_layer, backend="inductor", fullgraph=True)
        got = compiled(*inputs)
    torch.testing.assert_close(got, _layer(*inputs), rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- CUDA
# Written and collected; they run where a GPU is visible (none in CI today).

cuda = [pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _to_cuda(value):
    if isinstance(value, torch.Tensor):
        return value.cuda()
    if isinstance(value, list):
        return [_to_cuda(v) for v in value]
    return value


@pytest.mark.parametrize("case,dtype", _case_params())
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_kernel(case, dtype):
    args, kwargs = case.make(dtype)
    kernel = case.op(*args, **kwargs)
    out = case.op(*_to_cuda(args), **{k: _to_cuda(v) for k, v in kwargs.items()})
    assert all(t.is_cuda for t in _flat(out) if isinstance(t, torch.Tensor))
    if case.id.startswith("fusion_attention") and "grad" not in case.id:
        out, kernel = _normalised_stats(out), _normalised_stats(kernel)
    _compare(case, out, kernel, where="cuda", dtype=dtype)


def _normalised_stats(out):
    """Attention's (softmax_max, softmax_sum) as (max + log(sum), sum > 0): the flash route on
    CUDA returns the log-sum-exp and ones (opennpu.ops.flash_route), the same normaliser."""
    smax, ssum = out[1].double(), out[2].double()
    lse = torch.where(ssum > 0, smax + torch.log(ssum), torch.full_like(smax, -math.inf))
    return (out[0], lse, (ssum > 0).double(), *out[3:])


@pytest.mark.parametrize("name", sorted(GRAD_CASES))
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_gradients_match_cpu_kernel(name):
    fn, make, _ = GRAD_CASES[name]
    inputs = make(F32)
    want = _grads(fn, inputs)
    got = _grads(fn, [t.cuda() for t in inputs])
    for g, w in zip(got, want):
        assert g.is_cuda
        assert_close(g.cpu(), w, scale=8)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_inductor_fuses_the_composition():
    graphs = []
    inputs = [t.cuda() for t in _layer_inputs()]
    compiled = torch.compile(_layer, backend=_recording_backend(graphs), fullgraph=True)
    torch.testing.assert_close(compiled(*inputs).cpu(), _layer(*[t.cpu() for t in inputs]),
                               rtol=1e-5, atol=1e-5)
    # ops with a native CUDA kernel (csrc/ops/<family>/*_cuda.cu) stay whole; the rest decompose
    native = {name for name in ("npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "fast_gelu")
              if "cuda" not in portable.PORTABLE_DEVICES.get(f"npu::{name}", ())}
    assert {t.split(".")[1] for gm in graphs for t in _npu_nodes(gm)} == native
    torch._dynamo.reset()
    fused = torch.compile(_layer, backend="inductor", fullgraph=True)
    torch.testing.assert_close(fused(*inputs).cpu(), _layer(*[t.cpu() for t in inputs]),
                               rtol=1e-5, atol=1e-5)


def test_grouped_matmul_over_k_and_dtype_arguments_follow_the_kernel():
    # group_type 2 groups K (x's columns, weight's rows); the Tensor overload requires group_type
    x, w = randn(6, 10), randn(10, 4)
    kw = dict(group_list=torch.tensor([3, 3, 10]), split_item=3, group_type=2)
    want = npu.npu_grouped_matmul([x], [w], **kw)
    with portable.force():
        got = npu.npu_grouped_matmul([x], [w], **kw)
        assert torch.equal(got[0][1], torch.zeros(6, 4))  # the empty K range
        with pytest.raises(RuntimeError, match="Requires manual passing group_type"):
            npu.npu_grouped_matmul([x], [w], group_list=None)
        with pytest.raises(RuntimeError, match="'per_token_scale_dtype' must be None"):
            npu.npu_grouped_matmul([x], [w], group_list=None, group_type=-1,
                                   per_token_scale_dtype=6)
    assert_close(got[0], want[0])


def test_finalize_routing_k_without_scales_follows_the_kernel():
    rows = randn(12, 5)
    src_to_dst = torch.randperm(12, dtype=torch.int32)
    want = npu.npu_moe_finalize_routing(rows, None, None, None, None, src_to_dst, None, k=3)
    with portable.force():
        got = npu.npu_moe_finalize_routing(rows, None, None, None, None, src_to_dst, None, k=3)
    assert got.shape == (4, 5)
    assert_close(got, want)
