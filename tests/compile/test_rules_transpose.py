"""The confusion_transpose rule: permute + reshape (and reshape + permute + contiguous) ->
npu_confusion_transpose, on the eager path only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion_helpers import count, grads, run_compiled
from opennpu.compile import CompilerConfig, get_npu_backend

B, C, H, W = 4, 3, 6, 5  # seed 000's data.shape, scaled down


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def seed_example_one(d):
    return torch.permute(d, (0, 2, 1, 3)).reshape(H, B, C * W)


def seed_example_two_materialised(d):
    return d.view(B, H * C * W).transpose(1, 0).contiguous()


def attention_output(d):  # [B, N, S, D] -> [B, S, N * D]
    return d.transpose(1, 2).reshape(B, H, -1)


def contiguous_then_view(d):
    return d.permute(0, 2, 1, 3).contiguous().view(B, H, -1)


def reshape_then_t(d):
    return d.reshape(B, -1).t().contiguous()


def reshape_then_permute(d):
    return d.reshape(B, C * H, W).permute(2, 0, 1).contiguous()


FUSED = [seed_example_one, seed_example_two_materialised, attention_output, contiguous_then_view,
         reshape_then_t, reshape_then_permute]


@pytest.mark.parametrize("fn", FUSED, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_forms_fused_bit_exact(fn, dtype):
    data = (torch.rand(B, C, H, W) * 100).to(dtype)
    module = Fn(fn)
    before = run_compiled(module, data, fusion=False)
    after = run_compiled(module, data)
    assert count(before.ops, "npu_confusion_transpose") == 0
    assert after.fusions == {"confusion_transpose": 1}
    assert count(after.ops, "npu.npu_confusion_transpose.") == 1
    assert count(after.ops, "aten.permute") + count(after.ops, "aten.clone") == 0
    expected = fn(data)
    assert after.outputs.dtype == expected.dtype and after.outputs.stride() == expected.stride()
    assert torch.equal(after.outputs, expected)


def test_backward_through_the_fused_op():
    x = torch.randn(B, C, H, W, requires_grad=True)
    module = Fn(lambda d: attention_output(d * 2.0))
    compiled = run_compiled(module, x, backward=True)
    (dx,) = grads(x)
    module(x).float().square().sum().backward()
    assert compiled.fusions == {"confusion_transpose": 1}
    assert count(compiled.ops, "npu_confusion_transpose_backward") == 1
    torch.testing.assert_close(dx, x.grad)


def seed_example_two(d):  # a view in eager: fusing it would add a copy and break its aliasing
    return d.view(B, H * C * W).transpose(1, 0)


def permute_size_one_dims(d):  # the reshape of this permutation is a view: no copy to replace
    return d.unsqueeze(1).permute(1, 0, 2, 3, 4).reshape(B, -1)


def contiguous_already(d):  # contiguous() of a contiguous permutation returns it as is
    return d.reshape(B, 1, -1).transpose(0, 1).contiguous()


@pytest.mark.parametrize("fn", [seed_example_two, permute_size_one_dims, contiguous_already],
                         ids=lambda f: f.__name__)
def test_views_are_left_alone(fn):
    data = torch.rand(B, C, H, W)
    compiled = run_compiled(Fn(fn), data)
    assert not compiled.fusions and count(compiled.ops, "npu_") == 0
    expected = fn(data)
    assert compiled.outputs.stride() == expected.stride() and torch.equal(compiled.outputs,
                                                                          expected)


def test_dynamic_shapes_are_left_alone():
    """perm and shape are int[]: symbolic sizes would be specialised, so nothing is fused."""
    config = CompilerConfig()
    config.debug.run_eagerly = True
    backend = get_npu_backend(compiler_config=config)
    fn = torch.compile(lambda d: d.transpose(1, 2).reshape(d.shape[0], d.shape[2], -1),
                       backend=backend, dynamic=True, fullgraph=True)
    for shape in [(2, 3, 4, 5), (3, 4, 5, 6)]:
        data = torch.rand(shape)
        assert torch.equal(fn(data), data.transpose(1, 2).reshape(shape[0], shape[2], -1))
    assert not backend.fusions


def test_rule_can_be_disabled_by_name():
    data = torch.rand(B, C, H, W)
    compiled = run_compiled(Fn(seed_example_one), data, disabled=["confusion_transpose"])
    assert not compiled.fusions and count(compiled.ops, "npu_") == 0


def test_not_applied_under_inductor():
    """The one Inductor compile of this file: the eager-only rule stays out of Inductor graphs
    (where the op is not faster than the generated copy; measurements in rules/transpose.py)."""
    data = torch.rand(B, C, H, W)
    compiled = run_compiled(Fn(seed_example_one), data, eager=False)
    assert "confusion_transpose" not in compiled.fusions
    assert count(compiled.ops, "npu_") == 0
    assert torch.equal(compiled.outputs, seed_example_one(data))
