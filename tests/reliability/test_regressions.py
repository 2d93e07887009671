"""The defects an outside tester found (issue 19), each reproduced as written in the report."""

from __future__ import annotations

import pytest
import torch
import torch_npu

import opennpu
from opennpu.testing import reference as R


def test_ffn_token_counts_that_wrap_int64_are_rejected():
    with pytest.raises(RuntimeError, match="npu_ffn: argument 'expert_tokens' must sum to the M = 8"):
        torch_npu.npu_ffn(torch.randn(8, 16), torch.randn(3, 16, 32), torch.randn(3, 32, 16),
                          "relu", expert_tokens=[2**63 - 1, 2**63 - 1, 10])


def test_grouped_matmul_sizes_that_wrap_int64_are_rejected():
    with pytest.raises(RuntimeError, match="npu_grouped_matmul: argument 'group_list' must cover"):
        torch_npu.npu_grouped_matmul([torch.randn(6, 4)], [torch.randn(2, 4, 3)],
                                     group_list=torch.tensor([2**62, 2**62]), split_item=3,
                                     group_type=0, group_list_type=1)


@pytest.mark.parametrize("kw", [dict(next_tockens=2**63 - 1), dict(pre_tockens=2**63 - 1),
                                dict(pre_tockens=-(2**63)), dict(next_tockens=-(2**63)),
                                dict(sparse_mode=4, pre_tockens=2**63 - 1, next_tockens=2**63 - 1)])
def test_attention_token_limits_at_int64_extremes(kw):
    q = torch.zeros(1, 4, 4)
    v = torch.eye(4)[None]
    mask = torch.zeros(4, 4, dtype=torch.bool)
    out = torch_npu.npu_fusion_attention(q, q, v, 1, "BSH", atten_mask=mask, **kw)[0]
    full = R.full_visibility_mask(kw.get("sparse_mode", 0), 4, 4, 1, 1, mask,
                                  kw.get("pre_tockens", 2147483647),
                                  kw.get("next_tockens", 2147483647))
    expected = R.attention_reference(q, q, v, 1, "BSH", mask_full=full)[0]
    torch.testing.assert_close(out, expected.float())
    dq, dk, dv, _, _ = torch_npu.npu_fusion_attention_grad(q, q, v, torch.ones(1, 4, 4), 1, "BSH",
                                                            atten_mask=mask, **kw)
    leaves = [t.double().requires_grad_() for t in (q, q.clone(), v)]
    ref = R.attention_reference(*leaves, 1, "BSH", mask_full=full)[0]
    grads = torch.autograd.grad(ref.sum(), leaves)
    for got, want in zip((dq, dk, dv), grads):
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_device_mix_raises_instead_of_returning_garbage():
    with pytest.raises(RuntimeError, match="npu_rms_norm: argument 'gamma' must be on the device"):
        torch_npu.npu_rms_norm(torch.randn(4, 8), torch.empty(8, device="meta"))
    with pytest.raises(RuntimeError, match="npu_rms_norm: argument 'gamma' must be on the device"):
        torch_npu.npu_rms_norm(torch.randn(4, 8, device="meta"), torch.empty(8))
    # all on meta: shapes only, on meta
    y, _ = torch_npu.npu_rms_norm(torch.randn(4, 8, device="meta"), torch.ones(8, device="meta"))
    assert y.device.type == "meta"


@pytest.mark.parametrize("layout", ["transposed grad", "permuted param"])
def test_clip_grad_norm_scales_gradients_laid_out_unlike_their_parameter(layout):
    if layout == "transposed grad":
        p = torch.nn.Parameter(torch.randn(4, 6))
        p.grad = torch.randn(6, 4).t()
    else:
        p = torch.nn.Parameter(torch.randn(6, 4).t())
        p.grad = torch.randn(4, 6)
    before = p.grad.clone()
    norm = opennpu.optim.NpuFusedAdamW([p]).clip_grad_norm_fused_(0.5)
    torch.testing.assert_close(norm, before.norm())
    torch.testing.assert_close(p.grad, before * (0.5 / (before.norm() + 1e-6)))


def test_grouped_matmul_one_by_one_views_with_odd_strides():
    x, w, b = torch.randn(1, 1), torch.randn(1, 2)[:, ::2], torch.randn(1)
    (y,) = torch_npu.npu_grouped_matmul([x], [w], bias=[b], group_type=-1)
    torch.testing.assert_close(y, x @ w + b)
