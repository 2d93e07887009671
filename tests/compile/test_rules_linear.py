"""The opt-in linear_onednn rule: a float32 linear's aten.mm / aten.addmm on CPU or npu ->
opennpu::_linear (oneDNN's product from 64 rows), only where enabled_patterns names it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusion_helpers import count, grads, run_compiled
from opennpu.compile import CompilerConfig

RULE = "linear_onednn"


class MLP(nn.Module):
    """Two linears (with and without bias) around a SiLU, as a transformer's MLP."""

    def __init__(self, k=24, n=520, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(k, n, dtype=dtype)
        self.down = nn.Linear(n, k, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def _bound(module, x):
    """A loose float32 bound for two chained products: the result's magnitude times K * eps."""
    return 64 * torch.finfo(torch.float32).eps * (module(x).abs().max() + 1)


@pytest.mark.parametrize("eager", [True, False], ids=["run_eagerly", "inductor"])
@pytest.mark.parametrize("x_shape", [(80, 24), (2, 50, 24), (5, 24)], ids=str)
def test_fires_when_enabled_and_matches_eager(x_shape, eager):
    module = MLP().eval()
    x = torch.randn(*x_shape)
    with torch.no_grad():
        compiled = run_compiled(module, x, eager=eager, enabled=[RULE])
        expected = module(x)
    assert compiled.fusions[RULE] == 2
    assert count(compiled.ops, "opennpu._linear") == 2
    assert count(compiled.ops, "aten.mm") == 0 and count(compiled.ops, "aten.addmm") == 0
    assert (compiled.outputs - expected).abs().max() <= _bound(module, x)


def test_off_by_default():
    module = MLP().eval()
    with torch.no_grad():
        compiled = run_compiled(module, torch.randn(80, 24), eager=True)
    assert RULE not in compiled.fusions and count(compiled.ops, "opennpu._linear") == 0
    assert CompilerConfig().experimental_config.enabled_patterns == frozenset()


def test_disabled_wins_over_enabled():
    module = MLP().eval()
    with torch.no_grad():
        compiled = run_compiled(module, torch.randn(80, 24), enabled=[RULE], disabled=[RULE])
    assert count(compiled.ops, "opennpu._linear") == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
def test_other_dtypes_left_alone(dtype):
    module = MLP(dtype=dtype).eval()
    with torch.no_grad():
        compiled = run_compiled(module, torch.randn(80, 24, dtype=dtype), enabled=[RULE])
    assert count(compiled.ops, "opennpu._linear") == 0


def test_matmul_that_is_not_a_linear_left_alone():
    """x @ y of two activations (no weight transposed by a permute) and addmm with beta != 1."""
    def fn(a, b, c):
        return a @ b, torch.addmm(c, a, b.t().contiguous().t(), beta=0.5)

    a, b, c = torch.randn(70, 8), torch.randn(8, 6), torch.randn(6)
    compiled = run_compiled(fn, a, b, c, eager=True, enabled=[RULE])
    assert count(compiled.ops, "opennpu._linear") == 0
    for got, want in zip(compiled.outputs, fn(a, b, c)):
        torch.testing.assert_close(got, want)


def test_training_forward_and_gradients_match_eager():
    module = MLP()
    x = torch.randn(2, 40, 24, requires_grad=True)
    compiled = run_compiled(module, x, enabled=[RULE], backward=True)
    got = grads(x, *module.parameters())
    module(x).float().square().sum().backward()
    want = grads(x, *module.parameters())
    assert count(compiled.ops, "opennpu._linear") == 2  # the forward's; backward keeps aten.mm
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_dynamic_rows_cross_the_threshold():
    module = MLP().eval()
    config_rows = (8, 100, 63, 64)
    with torch.no_grad():
        for rows in config_rows:
            x = torch.randn(rows, 24)
            compiled = run_compiled(module, x, enabled=[RULE], dynamic=True, eager=False)
            assert compiled.outputs.shape == (rows, 24)
            assert (compiled.outputs - module(x)).abs().max() <= _bound(module, x)
            assert count(compiled.ops, "opennpu._linear") == 2


def test_on_the_npu_device():
    module = MLP().eval().to("npu")
    x = torch.randn(80, 24)
    with torch.no_grad():
        compiled = run_compiled(module, x.to("npu"), enabled=[RULE], eager=False)
        expected = module.cpu()(x)
    assert compiled.outputs.device.type == "npu" and count(compiled.ops, "opennpu._linear") == 2
    assert (compiled.outputs.cpu() - expected).abs().max() <= _bound(module, x)


def test_unknown_name_is_refused():
    config = CompilerConfig()
    with pytest.raises(ValueError, match=r"enabled_patterns names unknown rules \['linear_fast'\]"):
        config.experimental_config.enabled_patterns = ["linear_fast"]
