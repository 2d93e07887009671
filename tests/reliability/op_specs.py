"""One valid small call per op and the reference that judges it: the seeds of the bad-input sweep.

Each OpSpec builds the keyword arguments of a valid call (float32, a few elements, fresh from a
seeded generator) and gives the expected outputs for any arguments through opennpu.testing's
references, which compute in float32/float64 on the CPU with Python integers. The sweep
(bad_inputs.py) derives its bad and edge cases from these calls; a case whose call the op
accepts must then match the reference computed on the very same arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch_npu

from opennpu.testing import reference as R

I32 = torch.int32
I64 = torch.int64


@dataclass
class ShapeOnly:
    """An expected output known only by its shape and dtype."""
    shape: tuple
    dtype: torch.dtype


@dataclass
class OpSpec:
    name: str                        # the case id; also the op name errors must carry
    call: Callable                   # what users call (the torch_npu alias, or an overload)
    schema: torch.FunctionSchema
    build: Callable[[], dict]        # keyword arguments of a valid call
    reference: Callable[[dict], list]  # expected outputs (None: not compared)
    index_args: tuple[str, ...] = ()  # integer tensors whose values are indices or counts
    sum_tolerance: float = 1.0       # scales the float32 tolerance (long reductions)
    notes: dict = field(default_factory=dict)


def _spec(name, build, reference, *, overload="default", index_args=(), **kw) -> OpSpec:
    packet = getattr(torch.ops.npu, name)
    call = getattr(torch_npu, name) if overload == "default" else getattr(packet, overload)
    schema = getattr(packet, overload)._schema
    label = name if overload == "default" else f"{name}.{overload}"
    return OpSpec(label, call, schema, build, reference, tuple(index_args), **kw)


def randn(*shape):
    return torch.randn(*shape, dtype=torch.float32)


# Cases whose outcome is known to differ from the reference, with why. They run as strict
# xfails: one that starts to pass fails the suite until it is taken off this list.
_ATTENTION_NON_FINITE = (
    "non-finite attention inputs: a row whose visible scores are all -inf (an inf in q or k, or "
    "an infinite scale) gives 0 by the fully-masked-row rule where the reference's softmax gives "
    "NaN, and float32-max inputs overflow differently in the tiled float32 products than in the "
    "float64 reference"
)
KNOWN_DEVIATIONS = {
    **{("npu_fusion_attention", label): _ATTENTION_NON_FINITE
       for label in ("query:inf", "key:inf", "key:max_float32", "value:max_float32", "scale=inf",
                     "scale=-inf")},
    **{("npu_fusion_attention_grad", label): _ATTENTION_NON_FINITE
       for label in ("query:-inf", "query:max_float32", "key:inf", "key:-inf", "key:max_float32",
                     "value:max_float32", "dy:max_float32", "scale_value=inf")},
}
# Known deviations whose outcome depends on the CPU (they run as non-strict xfails): which
# non-finite attention cases overflow or meet inf * 0 inside the tiled float32 products differs
# between the BLAS / sgemm kernels of an AVX2 and an AVX-512 CPU (on a Zen 4, forward
# value:max_float32 deviates while the backward's query:-inf, key:+-inf and scale_value=inf cases
# match the reference; on a Zen 3 the other way round).
CPU_DEPENDENT_DEVIATIONS = {
    ("npu_fusion_attention", "value:max_float32"),
    *{("npu_fusion_attention_grad", label)
      for label in ("query:-inf", "key:inf", "key:-inf", "scale_value=inf")},
}


# ----------------------------------------------------------------------------- references


def _attention_mask(kw, b, n, sq, skv):
    return R.full_visibility_mask(kw.get("sparse_mode", 0), sq, skv, b, n,
                                  kw.get("atten_mask"), kw.get("pre_tockens", 2147483647),
                                  kw.get("next_tockens", 2147483647), kw.get("prefix"))


def _attention_forward(kw):
    q, k = kw["query"], kw["key"]
    b, sq, skv, n = q.shape[0], q.shape[1], k.shape[1], kw["head_num"]
    if kw.get("input_layout", "BSH") != "BSH" or kw.get("keep_prob", 1.0) != 1.0:
        raise ValueError("reference covers BSH without dropout")
    mask = _attention_mask(kw, b, n, sq, skv) if kw.get("atten_mask") is not None else None
    return R.attention_reference(q, k, kw["value"], n, "BSH", mask_full=mask,
                                 scale=kw.get("scale", kw.get("scale_value", 1.0)))


def _attention_ref(kw):
    out, _, _ = _attention_forward(kw)
    return [out, None, None, None, None, None, None]


def _attention_grad_ref(kw):
    """(dq, dk, dv) in closed form from the probabilities, float64 (the sweep's children are
    forked, and autograd refuses to run in a fork once the parent has used its device threads)."""
    q, k, v, dy = (kw[n].double() for n in ("query", "key", "value", "dy"))
    b, sq, skv, n = q.shape[0], q.shape[1], k.shape[1], kw["head_num"]
    if kw.get("input_layout", "BSH") != "BSH" or kw.get("keep_prob", 1.0) != 1.0:
        raise ValueError("reference covers BSH without dropout")
    if any(t.shape[-1] % n for t in (q, k, v)) or k.shape[-1] != q.shape[-1]:
        raise ValueError("reference covers equal head counts")
    heads = lambda t: t.unflatten(2, (n, -1)).transpose(1, 2)  # noqa: E731  [B, N, S, D]
    qh, kh, vh, doh = heads(q), heads(k), heads(v), heads(dy)
    scale = kw.get("scale_value", 1.0)
    scores = scale * qh @ kh.transpose(-1, -2)
    if kw.get("atten_mask") is not None:
        masked = _attention_mask(kw, b, n, sq, skv)
        scores = scores.masked_fill(masked, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    p = torch.where(torch.isneginf(scores).all(-1, keepdim=True), 0.0, p)  # fully masked rows
    dv = p.transpose(-1, -2) @ doh
    dp = doh @ vh.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk = scale * ds @ kh, scale * ds.transpose(-1, -2) @ qh
    bsh = lambda t: t.transpose(1, 2).flatten(2)  # noqa: E731
    return [bsh(dq), bsh(dk), bsh(dv), None, None]


def _gelu_derivative(x, approximate):
    if approximate == 1:  # tanh form: 0.5 x (1 + tanh(u)), u = c (x + 0.044715 x^3)
        c = math.sqrt(2 / math.pi)
        t = torch.tanh(c * (x + 0.044715 * x**3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)
    cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
    return cdf + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _geglu_grad_ref(kw):
    """d/dx of npu_geglu's out in closed form (float64): out = linear * gelu(gate)."""
    x, dy = kw["self"].double(), kw["grad_output"].double()
    dim, approximate = kw.get("dim", -1), kw.get("approximate", 1)
    if approximate not in (0, 1):
        raise ValueError("approximate must be 0 or 1")
    first, second = R._halves(x, dim)
    gate, linear = (first, second) if kw.get("activate_left", False) else (second, first)
    d_linear = dy * R.gelu(gate, approximate)
    d_gate = dy * linear * _gelu_derivative(gate, approximate)
    halves = (d_gate, d_linear) if kw.get("activate_left", False) else (d_linear, d_gate)
    return [torch.cat(halves, dim=dim)]


def _dropout_mask_ref(kw):
    """Bits of a keep mask: only the degenerate probabilities are known without Philox (p = 0
    keeps every element, p = 1 none); other calls are compared by shape alone."""
    numel = 1
    for s in kw["size"]:
        if s < 0:
            raise ValueError("negative size")
        numel *= s
    p = kw["p"]
    if not 0.0 <= p <= 1.0:
        raise ValueError("p outside [0, 1]")
    nbytes = (numel + 127) // 128 * 16
    if p not in (0.0, 1.0):
        return [ShapeOnly((nbytes,), torch.uint8)]
    bits = torch.zeros(nbytes * 8, dtype=torch.uint8)
    if p == 0.0:
        bits[:numel] = 1
    packed = (bits.view(-1, 8).long() << torch.arange(8)).sum(-1).to(torch.uint8)
    return [packed]


def _ffn_ref(kw):
    return [R.ffn(kw["x"], kw["weight1"], kw["weight2"], kw["activation"],
                  expert_tokens=kw.get("expert_tokens"),
                  expert_tokens_index=kw.get("expert_tokens_index"),
                  bias1=kw.get("bias1"), bias2=kw.get("bias2"),
                  compute_dtype=torch.float64 if kw["x"].dtype == torch.float64 else torch.float32)]


def _gmm_ref(kw):
    gl = kw.get("group_list")
    if isinstance(gl, torch.Tensor):
        gl = gl.tolist()
    return R.grouped_matmul(kw["x"], kw["weight"], kw.get("bias"), gl, kw.get("split_item", 0),
                            kw.get("group_list_type", 0))


def _routing_inputs():
    rows, k, experts = 3, 2, 4
    expert_idx = torch.randint(0, experts, (rows, k), dtype=I32)
    row_idx = torch.arange(rows * k, dtype=I32).view(k, rows).t().contiguous()
    return rows, k, experts, expert_idx, row_idx


def _finalize_build():
    rows, k, experts, expert_idx, _ = _routing_inputs()
    return dict(expanded_permuted_rows=randn(rows * k, 8), skip1=randn(rows, 8),
                skip2=randn(rows, 8), bias=randn(experts, 8), scales=randn(rows, k),
                expanded_src_to_dst_row=torch.randperm(rows * k).to(I32),
                export_for_source_row=expert_idx, drop_pad_mode=0)


# ----------------------------------------------------------------------------- the table


def all_specs() -> list[OpSpec]:
    x38 = lambda: randn(3, 8)  # noqa: E731
    return [
        _spec("npu_rms_norm", lambda: dict(self=x38(), gamma=randn(8), epsilon=1e-6),
              lambda kw: list(R.rms_norm(kw["self"], kw["gamma"], kw.get("epsilon", 1e-6)))),
        _spec("npu_gemma_rms_norm", lambda: dict(self=x38(), gamma=randn(8), epsilon=1e-6),
              lambda kw: list(R.gemma_rms_norm(kw["self"], kw["gamma"], kw.get("epsilon", 1e-6)))),
        _spec("npu_rms_norm_backward",
              lambda: (lambda x, g: dict(dy=x38(), self=x, gamma=g,
                                         rstd=R.rms_norm(x, g)[1].float()))(x38(), randn(8)),
              lambda kw: list(R.rms_norm_backward(kw["dy"], kw["self"], kw["gamma"], kw["rstd"]))),
        _spec("npu_add_rms_norm", lambda: dict(x1=x38(), x2=x38(), gamma=randn(8), epsilon=1e-6),
              lambda kw: list(R.add_rms_norm(kw["x1"], kw["x2"], kw["gamma"],
                                             kw.get("epsilon", 1e-6)))),
        _spec("npu_add_rms_norm_cast",
              lambda: dict(x1=x38(), x2=x38(), gamma=randn(8), epsilon=1e-6),
              lambda kw: list(R.add_rms_norm_cast(kw["x1"], kw["x2"], kw["gamma"],
                                                  kw.get("epsilon", 1e-6)))),
        _spec("npu_dynamic_quant", lambda: dict(input=x38(), smooth_scales=randn(8).abs() + 0.5),
              lambda kw: list(R.dynamic_quant(kw["input"], kw.get("smooth_scales"),
                                              kw.get("group_index"), kw.get("dst_type"),
                                              kw.get("quant_mode", "pertoken"),
                                              kw.get("dst_type_max", 0.0)))),
        _spec("npu_dynamic_quant",
              lambda: dict(input=randn(4, 8), smooth_scales=randn(2, 8).abs() + 0.5,
                           group_index=torch.tensor([1, 4], dtype=I32)),
              lambda kw: list(R.dynamic_quant(kw["input"], kw.get("smooth_scales"),
                                              kw.get("group_index"), kw.get("dst_type"),
                                              kw.get("quant_mode", "pertoken"),
                                              kw.get("dst_type_max", 0.0))),
              index_args=("group_index",), notes={"variant": "grouped"}),
        _spec("npu_add_rms_norm_dynamic_quant",
              lambda: dict(x1=x38(), x2=x38(), gamma=randn(8), smooth_scale1=randn(8).abs() + 0.5,
                           epsilon=1e-6),
              lambda kw: list(R.add_rms_norm_dynamic_quant(
                  kw["x1"], kw["x2"], kw["gamma"], kw.get("smooth_scale1"),
                  kw.get("smooth_scale2"), kw.get("beta"), kw.get("epsilon", 1e-6),
                  kw.get("output_mask"), kw.get("y_dtype")))),
        _spec("npu_swiglu", lambda: dict(self=x38(), dim=-1),
              lambda kw: [R.swiglu(kw["self"], kw.get("dim", -1))]),
        _spec("npu_swiglu_backward", lambda: dict(grad_output=randn(3, 4), self=x38(), dim=-1),
              lambda kw: [R.swiglu_backward(kw["grad_output"], kw["self"], kw.get("dim", -1))]),
        _spec("npu_geglu", lambda: dict(self=x38(), dim=-1, approximate=1, activate_left=False),
              lambda kw: list(R.geglu(kw["self"], kw.get("dim", -1), kw.get("approximate", 1),
                                      kw.get("activate_left", False)))),
        _spec("npu_geglu_grad",
              lambda: (lambda x: dict(grad_output=randn(3, 4), self=x, gelu=R.geglu(x)[1].float(),
                                      dim=-1, approximate=1, activate_left=False))(x38()),
              _geglu_grad_ref),
        _spec("fast_gelu", lambda: dict(self=x38()), lambda kw: [R.fast_gelu(kw["self"])]),
        _spec("npu_fast_gelu", lambda: dict(self=x38()), lambda kw: [R.fast_gelu(kw["self"])]),
        _spec("npu_fast_gelu_backward", lambda: dict(grad=x38(), self=x38()),
              lambda kw: [R.fast_gelu_backward(kw["grad"], kw["self"])]),
        _spec("npu_rotary_mul",
              lambda: dict(self=randn(1, 2, 3, 8), r1=randn(1, 2, 1, 8), r2=randn(1, 2, 1, 8),
                           rotary_mode="half"),
              lambda kw: [R.rotary_mul(kw["self"], kw["r1"], kw["r2"],
                                       kw.get("rotary_mode", "half"), kw.get("rotate"))]),
        _spec("npu_rotary_mul_backward",
              lambda: dict(grad=randn(1, 2, 3, 8), self=randn(1, 2, 3, 8), r1=randn(1, 2, 1, 8),
                           r2=randn(1, 2, 1, 8), rotary_mode="half"),
              lambda kw: list(R.rotary_mul_backward(kw["grad"], kw["self"], kw["r1"], kw["r2"],
                                                    kw.get("rotary_mode", "half")))),
        _spec("npu_scaled_masked_softmax",
              lambda: dict(x=randn(1, 2, 3, 8), mask=torch.rand(1, 1, 3, 8) < 0.3, scale=0.5,
                           fixed_triu_mask=False),
              lambda kw: [R.scaled_masked_softmax(kw["x"], kw["mask"], kw.get("scale", 1),
                                                  kw.get("fixed_triu_mask", False))]),
        _spec("npu_scaled_masked_softmax_backward",
              lambda: (lambda x, m: dict(y_grad=randn(1, 2, 3, 8),
                                         y=R.scaled_masked_softmax(x, m, 0.5).float(), mask=m,
                                         scale=0.5, fixed_triu_mask=False))(
                  randn(1, 2, 3, 8), torch.rand(1, 1, 3, 8) < 0.3),
              lambda kw: [R.scaled_masked_softmax_backward(kw["y_grad"], kw["y"], kw["mask"],
                                                           kw["scale"], kw["fixed_triu_mask"])]),
        _spec("npu_fusion_attention",
              lambda: dict(query=randn(1, 4, 8), key=randn(1, 4, 8), value=randn(1, 4, 8),
                           head_num=2, input_layout="BSH",
                           atten_mask=torch.ones(4, 4, dtype=torch.bool).triu(1), scale=0.3,
                           sparse_mode=0),
              _attention_ref),
        _spec("npu_fusion_attention_grad",
              lambda: dict(query=randn(1, 4, 8), key=randn(1, 4, 8), value=randn(1, 4, 8),
                           dy=randn(1, 4, 8), head_num=2, input_layout="BSH",
                           atten_mask=torch.ones(4, 4, dtype=torch.bool).triu(1),
                           scale_value=0.3, sparse_mode=0),
              _attention_grad_ref),
        _spec("_npu_dropout_gen_mask",
              lambda: dict(self=randn(4), size=[2, 70], p=0.0, seed=1, offset=0),
              _dropout_mask_ref, overload="Tensor"),
        _spec("npu_ffn",
              lambda: dict(x=randn(4, 8), weight1=randn(8, 16), weight2=randn(16, 8),
                           activation="relu", bias1=randn(16)),
              _ffn_ref),
        _spec("npu_ffn",
              lambda: dict(x=randn(4, 8), weight1=randn(2, 8, 16), weight2=randn(2, 16, 8),
                           activation="gelu", expert_tokens=[1, 3]),
              _ffn_ref, notes={"variant": "experts"}),
        _spec("npu_confusion_transpose",
              lambda: dict(self=randn(2, 3, 4), perm=[0, 2, 1], shape=[2, 12],
                           transpose_first=True),
              lambda kw: [R.confusion_transpose(kw["self"], kw["perm"], kw["shape"],
                                                kw["transpose_first"])]),
        _spec("npu_confusion_transpose_backward",
              lambda: dict(grad=randn(2, 12), perm=[0, 2, 1], shape=[2, 3, 4],
                           transpose_first=False),
              lambda kw: [R.confusion_transpose_backward(kw["grad"], kw["perm"], kw["shape"],
                                                         kw["transpose_first"])]),
        _spec("npu_moe_gating_top_k_softmax",
              lambda: dict(x=randn(3, 4), finished=torch.tensor([False, True, False]), k=2),
              lambda kw: list(R.moe_gating_top_k_softmax(kw["x"], kw.get("finished"),
                                                         kw.get("k", 1)))),
        _spec("npu_moe_init_routing",
              lambda: (lambda r: dict(x=randn(r[0], 8), row_idx=r[4], expert_idx=r[3],
                                      active_num=r[0]))(_routing_inputs()),
              lambda kw: list(R.moe_init_routing(kw["x"], kw["row_idx"], kw["expert_idx"],
                                                 kw["active_num"])),
              index_args=("row_idx", "expert_idx")),
        _spec("npu_moe_compute_expert_tokens",
              lambda: dict(sorted_expert_for_source_row=torch.tensor([0, 1, 1, 3, 3], dtype=I32),
                           num_expert=4),
              lambda kw: [R.moe_compute_expert_tokens(kw["sorted_expert_for_source_row"],
                                                      kw["num_expert"])],
              index_args=("sorted_expert_for_source_row",)),
        _spec("npu_moe_finalize_routing", _finalize_build,
              lambda kw: [R.moe_finalize_routing(kw["expanded_permuted_rows"], kw["skip1"],
                                                 kw["skip2"], kw["bias"], kw["scales"],
                                                 kw["expanded_src_to_dst_row"],
                                                 kw["export_for_source_row"],
                                                 kw.get("drop_pad_mode") or 0)],
              index_args=("expanded_src_to_dst_row", "export_for_source_row")),
        _spec("npu_grouped_matmul",
              lambda: dict(x=[randn(6, 8)], weight=[randn(2, 8, 4)],
                           group_list=torch.tensor([2, 6]), split_item=3, group_type=0,
                           group_list_type=0),
              _gmm_ref, index_args=("group_list",)),
        _spec("npu_grouped_matmul",
              lambda: dict(x=[randn(2, 8), randn(3, 8)], weight=[randn(8, 4), randn(8, 4)],
                           bias=[randn(4), randn(4)], group_list=[2, 3], split_item=0,
                           group_list_type=1),
              _gmm_ref, overload="List"),
    ]
