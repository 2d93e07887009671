"""The scaled_masked_softmax rule: softmax((x * scale).masked_fill(mask, -inf), -1) (seed 000)
-> npu_scaled_masked_softmax."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion_helpers import count, grads, run_compiled
from opennpu.compile import CompilerConfig, get_npu_backend
from opennpu.testing.tolerances import assert_close


class SeedSoftmax(nn.Module):
    """Seed 000's native code."""

    def __init__(self, scale=0.8):
        super().__init__()
        self.scale = scale

    def forward(self, x, mask):
        return torch.softmax((x * self.scale).masked_fill(mask, -1 * torch.inf), dim=-1)


class Unscaled(nn.Module):
    def forward(self, x, mask):
        return x.masked_fill(mask, float("-inf")).softmax(dim=-1)


class MinFill(nn.Module):
    """transformers-style masking with the dtype's lowest finite value."""

    def forward(self, x, mask):
        return torch.softmax((x * 0.125).masked_fill(mask, torch.finfo(x.dtype).min), dim=3)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def inputs(dtype, x_shape=(2, 3, 8, 40), mask_shape=(1, 1, 8, 40), requires_grad=False):
    x = torch.randn(x_shape, dtype=dtype, requires_grad=requires_grad)
    mask = torch.randn(mask_shape) >= 1
    mask[..., 0] = False  # every row keeps a score (a fully masked row: see the test below)
    return x, mask


@pytest.mark.parametrize("module", [SeedSoftmax(), Unscaled(), MinFill()],
                         ids=["seed", "unscaled", "finfo-min"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forms_fused_and_match_eager(module, dtype):
    x, mask = inputs(dtype)
    before = run_compiled(module, x, mask, fusion=False)
    after = run_compiled(module, x, mask)
    assert count(before.ops, "masked_fill") + count(before.ops, "where") >= 1
    assert count(before.ops, "npu_scaled_masked_softmax") == 0
    assert after.fusions == {"scaled_masked_softmax": 1}
    assert count(after.ops, "npu.npu_scaled_masked_softmax.") == 1
    assert count(after.ops, "masked_fill") + count(after.ops, "where") == 0
    expected = module(x, mask)
    assert after.outputs.dtype == expected.dtype == dtype
    assert_close(after.outputs, expected, dtype=dtype)


def test_scale_is_the_modules_and_gradients_match():
    module = SeedSoftmax(scale=0.37)
    x, mask = inputs(torch.float32, requires_grad=True)
    compiled = run_compiled(module, x, mask, backward=True)
    (dx,) = grads(x)
    expected = module(x, mask)
    expected.square().sum().backward()
    assert compiled.fusions == {"scaled_masked_softmax": 1}
    assert count(compiled.ops, "npu_scaled_masked_softmax_backward") == 1
    assert_close(compiled.outputs, expected, dtype=torch.float32)
    assert_close(dx, x.grad, dtype=torch.float32)


def test_dynamic_shapes_fuse_once_and_serve_new_shapes():
    module = SeedSoftmax()
    config = CompilerConfig()
    config.debug.run_eagerly = True
    backend = get_npu_backend(compiler_config=config)
    compiled_fn = torch.compile(module, backend=backend, dynamic=True, fullgraph=True)
    for shape in [(2, 3, 8, 40), (3, 2, 5, 24), (2, 4, 7, 33)]:
        x, mask = inputs(torch.bfloat16, shape, (1, 1, *shape[2:]))
        assert_close(compiled_fn(x, mask), module(x, mask), dtype=torch.bfloat16)
    assert backend.fusions["scaled_masked_softmax"] >= 1
    assert sum(backend.fusions.values()) == backend.fusions["scaled_masked_softmax"]


def test_fully_masked_row_is_uniform_where_eager_gives_nan():
    """The documented difference (rules/softmax.py): the op fills with -10000, so a row with no
    score left is uniform (torch_npu's behaviour) where the -inf composition divides 0 by 0."""
    x, mask = inputs(torch.float32)
    mask[0, 0, 3] = True
    compiled = run_compiled(SeedSoftmax(), x, mask)
    assert compiled.fusions == {"scaled_masked_softmax": 1}
    assert torch.isnan(SeedSoftmax()(x, mask)[:, :, 3]).all()
    torch.testing.assert_close(compiled.outputs[:, :, 3], torch.full((2, 3, 40), 1 / 40))


class FillMinusOne(nn.Module):
    def forward(self, x, mask):
        return torch.softmax((x * 0.8).masked_fill(mask, -1.0), dim=-1)


class OtherDim(nn.Module):
    def forward(self, x, mask):
        return torch.softmax((x * 0.8).masked_fill(mask, float("-inf")), dim=2)


class Float32Softmax(nn.Module):
    def forward(self, x, mask):
        return torch.softmax((x * 0.8).masked_fill(mask, float("-inf")), dim=-1,
                             dtype=torch.float32)


class TensorScale(nn.Module):
    def forward(self, x, mask, scale):
        return torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)


def test_tensor_scale_stays_a_multiply_before_the_unscaled_form():
    """x * t with a tensor t is no Scalar for the op: the product stays, softmax(masked_fill(.))
    is the unscaled form (scale 1)."""
    x, mask = inputs(torch.float32)
    scale = torch.tensor(0.5)
    compiled = run_compiled(TensorScale(), x, mask, scale)
    assert compiled.fusions == {"scaled_masked_softmax": 1}
    assert count(compiled.ops, "aten.mul") == 1
    assert_close(compiled.outputs, TensorScale()(x, mask, scale), dtype=torch.float32)


@pytest.mark.parametrize("module, dtype, mask_shape, extra", [
    (FillMinusOne(), torch.float32, (1, 1, 8, 40), ()),      # kept probability mass: not -10000
    (OtherDim(), torch.float32, (1, 1, 8, 40), ()),
    (Float32Softmax(), torch.float16, (1, 1, 8, 40), ()),    # fp16 scores, fp32 probabilities
    (SeedSoftmax(), torch.float32, (2, 1, 1, 8, 40), ()),    # the mask would grow the result
], ids=["fill-minus-one", "dim-2", "dtype-fp32", "mask-larger"])
def test_forms_with_other_semantics_are_left_alone(module, dtype, mask_shape, extra):
    x, mask = inputs(dtype, mask_shape=mask_shape)
    compiled = run_compiled(module, x, mask, *extra)
    assert not compiled.fusions and count(compiled.ops, "npu_") == 0
    expected = module(x, mask, *extra)
    assert compiled.outputs.dtype == expected.dtype and compiled.outputs.shape == expected.shape
    torch.testing.assert_close(compiled.outputs, expected)


def test_rule_can_be_disabled_by_name():
    x, mask = inputs(torch.float32)
    compiled = run_compiled(SeedSoftmax(), x, mask, disabled=["scaled_masked_softmax"])
    assert not compiled.fusions and count(compiled.ops, "npu_scaled_masked_softmax") == 0


def test_strict_mode_fuses_only_ascend_shapes():
    """Strict mode makes the op enforce Ascend's limits (last dim 32..8192, a multiple of 32);
    the rule must not bring the op (and its errors) into code that never called it."""
    import opennpu

    with opennpu.strict():
        x, mask = inputs(torch.float32)                                   # last dim 40
        outside = run_compiled(SeedSoftmax(), x, mask)
        x64, mask64 = inputs(torch.float32, (2, 3, 8, 64), (1, 1, 8, 64))
        inside = run_compiled(SeedSoftmax(), x64, mask64)
    assert not outside.fusions
    torch.testing.assert_close(outside.outputs, SeedSoftmax()(x, mask))
    assert inside.fusions == {"scaled_masked_softmax": 1}
    assert_close(inside.outputs, SeedSoftmax()(x64, mask64), dtype=torch.float32)
