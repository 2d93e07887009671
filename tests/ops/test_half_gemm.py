"""The CPU GEMM policy for float16 / bfloat16 products (csrc/common/half_gemm.h): where the CPU has
no arithmetic for the dtype, the ops multiply float32 copies or panels and round once; where it
has, they keep their half-precision GEMMs. OPENNPU_HALF_GEMM=auto|native|fp32 forces either path
on any machine, so every affected op runs both here and is checked against the float64 reference
and against the other path (same fp32 accumulation and single rounding: only the summation order
may differ).

Affected ops: npu_ffn (its fp32 tiles against MKL / ATen half GEMMs), npu_grouped_matmul (float
path with and without bias, and the weight-only path), npu_fusion_attention (half-precision tiles
against fp32 ones). npu_rotary_mul's rotate matrix product is computed in float32 whatever the
policy (checked too).
"""

from __future__ import annotations

import math
import platform
import re

import pytest
import torch
from op_helpers import dtype_id, max_err

import opennpu
from opennpu.testing import reference as R
from opennpu.testing.tolerances import assert_close

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HALF = pytest.mark.parametrize("dtype", [F16, BF16], ids=dtype_id)
POLICIES = ("native", "fp32")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _native_here(dtype) -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    flags = _cpu_flags()
    if dtype == BF16:
        return bool(flags & {"avx512_bf16", "amx_bf16"})
    return "avx512_fp16" in flags


def _both(monkeypatch, fn):
    """fn() under OPENNPU_HALF_GEMM=native and =fp32: {policy: result}."""
    results = {}
    for policy in POLICIES:
        monkeypatch.setenv("OPENNPU_HALF_GEMM", policy)
        assert opennpu.half_gemm(BF16) == policy
        results[policy] = fn()
    monkeypatch.delenv("OPENNPU_HALF_GEMM")
    return results


def _check_both(monkeypatch, run, ref, dtype):
    """run() under both settings: each within 2x the table's tolerance of the float64 reference,
    and within 4x of each other."""
    out = _both(monkeypatch, run)
    for policy, y in out.items():
        assert y.dtype == dtype and y.shape == ref.shape, policy
        assert_close(y, ref, scale=2, msg=policy)
    assert_close(out["native"], out["fp32"], scale=4)


# ----------------------------------------------------------------------------- the policy


@HALF
def test_auto_follows_the_cpu(monkeypatch, dtype):
    monkeypatch.delenv("OPENNPU_HALF_GEMM", raising=False)
    expected = "native" if _native_here(dtype) else "fp32"
    assert opennpu.half_gemm(dtype) == expected
    monkeypatch.setenv("OPENNPU_HALF_GEMM", "auto")
    assert opennpu.half_gemm(dtype) == expected


@pytest.mark.parametrize("policy", POLICIES)
def test_forced_policy_is_reported(monkeypatch, policy):
    monkeypatch.setenv("OPENNPU_HALF_GEMM", policy)
    assert opennpu.half_gemm(F16) == policy
    assert opennpu.half_gemm(BF16) == policy
    # float32 / float64 products have nothing to convert
    assert opennpu.half_gemm(F32) == "native"
    assert opennpu.half_gemm(torch.float64) == "native"
    assert torch.ops.opennpu.half_gemm(BF16) == policy


def test_unknown_policy_is_an_error(monkeypatch):
    monkeypatch.setenv("OPENNPU_HALF_GEMM", "bf16")
    message = re.escape("OPENNPU_HALF_GEMM must be auto, native or fp32, but got 'bf16'")
    with pytest.raises(RuntimeError, match=message):
        opennpu.half_gemm(BF16)
    x, w = torch.randn(4, 8).to(BF16), torch.randn(1, 8, 3).to(BF16)
    with pytest.raises(RuntimeError, match=message):
        opennpu.npu_grouped_matmul([x], [w], group_list=torch.tensor([4]), split_item=3,
                                   group_type=0)


# ----------------------------------------------------------------------------- npu_ffn


def _ffn_inputs(m, k1, i, activation, dtype, experts=None, bias=True):
    n1 = 2 * i if activation in R.FFN_GLU else i
    e = () if experts is None else (len(experts),)
    x = torch.randn(m, k1).to(dtype)
    w1 = (torch.randn(*e, k1, n1) / math.sqrt(k1)).to(dtype)
    w2 = (torch.randn(*e, i, k1) / math.sqrt(i)).to(dtype)
    kw = {} if experts is None else {"expert_tokens": list(experts)}
    if bias:
        bd = F32 if dtype == BF16 else dtype
        kw.update(bias1=torch.randn(*e, n1).to(bd), bias2=torch.randn(*e, k1).to(bd))
    return x, w1, w2, kw


@HALF
@pytest.mark.parametrize("activation", ["fastgelu", "swiglu"])
@pytest.mark.parametrize("m,experts,bias", [(70, None, True), (1, None, False),
                                            (26, [7, 0, 19], True)])
def test_ffn_both_policies(monkeypatch, dtype, activation, m, experts, bias):
    monkeypatch.delenv("OPENNPU_FFN_GEMM", raising=False)  # the op's own override wins
    x, w1, w2, kw = _ffn_inputs(m, 48, 200, activation, dtype, experts, bias)
    ref = R.ffn(x, w1, w2, activation, **kw)
    out = _both(monkeypatch, lambda: opennpu.npu_ffn(x, w1, w2, activation, **kw))
    # test_ffn.py's bound: the output's rounding and the fp32 accumulation order.
    tol = {F16: 2e-3, BF16: 1.6e-2}[dtype] * max(ref.abs().max().item(), 1.0)
    for policy, y in out.items():
        assert y.dtype == dtype and y.shape == ref.shape, policy
        assert max_err(y, ref) <= tol, (policy, max_err(y, ref), tol)
    assert max_err(out["native"], out["fp32"].double()) <= 2 * tol


# ----------------------------------------------------------------------------- npu_grouped_matmul


def _gmm_case(dtype, bias, transposed):
    sizes = [37, 0, 5, 300]  # an empty group, and one spanning two 256-row tiles
    k, n = 40, 530  # two 512-column tiles
    x = torch.randn(sum(sizes), k).to(dtype)
    w = (torch.randn(len(sizes), n, k).transpose(1, 2) if transposed
         else torch.randn(len(sizes), k, n)).to(dtype)
    b = [torch.randn(len(sizes), n).to(F32 if dtype == BF16 else dtype)] if bias else None
    gl = torch.tensor(sizes).cumsum(0)
    return x, w, b, gl


@HALF
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "wT"])
def test_grouped_matmul_both_policies(monkeypatch, dtype, bias, transposed):
    x, w, b, gl = _gmm_case(dtype, bias, transposed)
    ref = R.grouped_matmul([x], [w], b, gl, 3)[0]

    def run():
        return opennpu.npu_grouped_matmul([x], [w], bias=b, group_list=gl, split_item=3,
                                          group_type=0)[0]

    _check_both(monkeypatch, run, ref, dtype)


@HALF
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_grouped_matmul_weight_only_both_policies(monkeypatch, dtype, bias):
    sizes, k, n = [4, 0, 11, 2], 33, 29
    x = torch.randn(sum(sizes), k).to(dtype)
    w = torch.randint(-128, 128, (len(sizes), k, n), dtype=torch.int8)
    scale = (torch.rand(len(sizes), n) * 0.02).to(dtype)
    b = torch.randn(len(sizes), n).to(F32 if dtype == BF16 else dtype) if bias else None
    gl = torch.tensor(sizes).cumsum(0)
    # Reference: the dequantised weight rounded to x's dtype (the golden's rounding point),
    # then the product in float64.
    deq = (w.double() * scale.double().unsqueeze(1)).to(dtype).double()
    rows = x.double().split(sizes)
    ref = torch.cat([rows[g] @ deq[g] + (b[g].double() if bias else 0)
                     for g in range(len(sizes))])

    def run():
        return opennpu.npu_grouped_matmul([x], [w], antiquant_scale=[scale],
                                          bias=[b] if bias else None, group_list=gl,
                                          split_item=3, group_type=0)[0]

    _check_both(monkeypatch, run, ref, dtype)


# ----------------------------------------------------------------------------- attention


@HALF
def test_fusion_attention_both_policies(monkeypatch, dtype):
    monkeypatch.delenv("OPENNPU_ATTENTION_HALF_GEMM", raising=False)
    b, n, sq, skv, d = 1, 2, 33, 70, 32
    q, k, v = (torch.randn(b, n, s, d).to(dtype) for s in (sq, skv, skv))

    def run():
        return opennpu.npu_fusion_attention(q, k, v, n, "BNSD", scale=d ** -0.5)[0]

    out = _both(monkeypatch, run)
    ref = R.attention_reference(q.double(), k.double(), v.double(), n, "BNSD",
                                scale=d ** -0.5)[0]
    for policy, y in out.items():
        assert_close(y, ref, msg=policy)
    # fp32: the float32 computation rounded once, exactly.
    monkeypatch.setenv("OPENNPU_HALF_GEMM", "fp32")
    in_fp32 = opennpu.npu_fusion_attention(q.float(), k.float(), v.float(), n, "BNSD",
                                           scale=d ** -0.5)[0]
    torch.testing.assert_close(out["fp32"], in_fp32.to(dtype), rtol=0, atol=0)
    assert_close(out["native"], out["fp32"], scale=2)


# ----------------------------------------------------------------------------- rotary_mul


@HALF
def test_rotary_rotate_matrix_is_fp32_under_both_policies(monkeypatch, dtype):
    x = torch.randn(2, 3, 4, 16).to(dtype)
    r1, r2 = (torch.randn(1, 3, 1, 16).to(dtype) for _ in range(2))
    m = torch.randn(16, 16).to(dtype)
    out = _both(monkeypatch, lambda: opennpu.npu_rotary_mul(x, r1, r2, rotate=m))
    # x @ rotate in float32 and one rounding: the same bits either way.
    assert torch.equal(out["native"], out["fp32"])
    assert_close(out["fp32"], R.rotary_mul(x, r1, r2, rotate_matrix=m))
