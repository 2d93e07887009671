"""The add_rms_norm_inplace rule: npu_add_rms_norm writes its sum into an addend's buffer where
nothing reads that buffer afterwards (opennpu::_add_rms_norm_inplace), and nowhere else."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion_helpers import count, run_compiled
from opennpu.compile import CompilerConfig, get_npu_backend
from opennpu.testing.tolerances import assert_close

npu = torch.ops.npu
RULE = "add_rms_norm_inplace"
H = 16


@pytest.fixture(autouse=True)
def _no_speed_gate(monkeypatch):
    """The add_rms_norm rule leaves inference graphs under 512 rows native; these are smaller."""
    from opennpu.compile.rules import _util

    monkeypatch.setattr(_util, "INFERENCE_MIN_TOKENS", 1)


def weights(dtype=torch.float32, grad=False):
    torch.manual_seed(0)
    ws = [torch.randn(H, H, dtype=dtype) / 4, torch.rand(H, dtype=dtype) + 0.5,
          torch.randn(H, H, dtype=dtype) / 4, torch.rand(H, dtype=dtype) + 0.5]
    return [w.requires_grad_(grad) for w in ws]


def layer(h, residual, w_o, g1, w_down, g2):
    """A decoder layer's two residual adds, written with torch_npu's op: attention's output
    projection added to the residual (an input), the MLP's added to that sum."""
    attn = h @ w_o                                                  # dead after the add
    y, _, x = npu.npu_add_rms_norm(residual, attn, g1, 1e-5)
    mlp = y @ w_down                                                # dead after the add
    y2, _, x2 = npu.npu_add_rms_norm(x, mlp, g2)                    # x: dead after too
    return y2, x2


def compile_fn(fn, *, eager=True, disabled=(), fusion=True):
    config = CompilerConfig()
    config.debug.run_eagerly = eager
    config.experimental_config.pattern_fusion_pass = fusion
    config.experimental_config.disabled_patterns = list(disabled)
    backend = get_npu_backend(compiler_config=config)
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True), backend


def ops_of(backend):
    from opennpu.compile import node_targets

    ops = {}
    for phase, gm in backend.graphs:
        if phase != "pre_autograd":
            for target, n in node_targets(gm).items():
                ops[target] = ops.get(target, 0) + n
    return ops


def inputs(dtype=torch.float32, rows=6, grad=False):
    torch.manual_seed(1)
    return [torch.randn(2, rows, H, dtype=dtype).requires_grad_(grad) for _ in range(2)]


@pytest.mark.parametrize("eager", [True, False], ids=["run_eagerly", "inductor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fires_on_dead_addends_and_matches_eager_bit_for_bit(dtype, eager):
    args = [*inputs(dtype), *weights(dtype)]
    want = layer(*args)
    compiled, backend = compile_fn(layer, eager=eager)
    with torch.no_grad():
        got = compiled(*args)
    assert backend.fusions == {RULE: 2}
    ops = ops_of(backend)
    assert count(ops, "_add_rms_norm_inplace") == 2 and count(ops, "npu_add_rms_norm.") == 0
    assert count(ops, "copy") == 0 and count(ops, "clone") == 0
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    # and the inputs were not written
    assert torch.equal(args[0], inputs(dtype)[0]) and torch.equal(args[1], inputs(dtype)[1])


def test_inductor_code_writes_the_sum_in_place_without_a_copy():
    from torch._inductor.utils import run_and_get_code

    args = [*inputs(), *weights()]
    compiled, backend = compile_fn(layer, eager=False)
    torch._inductor.config.fx_graph_cache = False
    with torch.no_grad():
        got, (code, *_) = run_and_get_code(compiled, *args)
    assert code.count("torch.ops.opennpu._add_rms_norm_inplace.default(") == 2
    assert "npu_add_rms_norm.default(" not in code
    assert "copy_" not in code and "clone" not in code
    for g, w in zip(got, layer(*args)):
        assert torch.equal(g, w)


def test_returned_sum_is_the_addends_buffer_and_stays_valid():
    """The second sum is returned: it lives in the MLP output's buffer now, and later calls (whose
    buffers are new) do not disturb a result already returned."""
    compiled, backend = compile_fn(layer)
    args = [*inputs(), *weights()]
    with torch.no_grad():
        first = compiled(*args)
        kept = [t.clone() for t in first]
        compiled(*[a * 2 for a in args[:2]], *args[2:])
    assert backend.fusions == {RULE: 2}
    for t, k in zip(first, kept):
        assert torch.equal(t, k)


def only_the_sum(h, residual, w_o, g1, *_):
    attn = h @ w_o
    _, _, x = npu.npu_add_rms_norm(residual, attn, g1)
    return x * 2


@pytest.mark.parametrize("eager", [True, False], ids=["run_eagerly", "inductor"])
def test_op_whose_outputs_are_unused_still_runs(eager):
    """Only the sum is read, through attn's node: the in-place op itself has no users left, and
    must still run (a mutating op is never dead code)."""
    args = [*inputs(), *weights()]
    compiled, backend = compile_fn(only_the_sum, eager=eager)
    with torch.no_grad():
        got = compiled(*args)
    assert backend.fusions == {RULE: 1}
    assert torch.equal(got, only_the_sum(*args))


def test_disabled_by_name_keeps_the_functional_op():
    compiled, backend = compile_fn(layer, disabled=[RULE])
    with torch.no_grad():
        compiled(*inputs(), *weights())
    assert not backend.fusions
    assert count(ops_of(backend), "npu_add_rms_norm.") == 2
    compiled, backend = compile_fn(layer, fusion=False)
    with torch.no_grad():
        compiled(*inputs(), *weights())
    assert count(ops_of(backend), "_add_rms_norm_inplace") == 0


def residual_stream(residual, h1, h2, h3, g):
    """Consecutive layers' adds on the residual stream, the other addends graph inputs: the
    second sum goes into the first sum's buffer, the third into that same buffer again."""
    y1, _, x = npu.npu_add_rms_norm(h1, residual, g)
    y2, _, x = npu.npu_add_rms_norm(h2, x, g)
    y3, _, x = npu.npu_add_rms_norm(h3, x, g)
    return y1, y2, y3, x


def residual_stream_read_between(residual, h1, h2, h3, g):
    y1, _, x = npu.npu_add_rms_norm(h1, residual, g)
    y2, _, x = npu.npu_add_rms_norm(h2, x, g)
    seen = x * 2                               # the second sum is read besides the third add
    y3, _, x = npu.npu_add_rms_norm(h3, x, g)
    return y1, y2, y3, x, seen


@pytest.mark.parametrize("eager", [True, False], ids=["run_eagerly", "inductor"])
@pytest.mark.parametrize("fn,fired", [(residual_stream, 2), (residual_stream_read_between, 1)],
                         ids=["stream", "read_between"])
def test_one_buffer_carries_the_residual_stream(fn, fired, eager):
    args = [*inputs(), *inputs()[:2], weights()[1]]
    compiled, backend = compile_fn(fn, eager=eager)
    with torch.no_grad():
        got = compiled(*args)
    assert backend.fusions == {RULE: fired}
    for g, w in zip(got, fn(*args)):
        assert torch.equal(g, w)


# --- where it must not fire ---------------------------------------------------------------------


def graph_inputs_only(a, b, g):
    return npu.npu_add_rms_norm(a, b, g)


def addend_read_later(h, residual, w_o, g1, *_):
    attn = h @ w_o
    y, _, x = npu.npu_add_rms_norm(residual, attn, g1)
    return y + attn, x                       # attn read after the add


def addend_returned(h, residual, w_o, g1, *_):
    attn = h @ w_o
    y, _, x = npu.npu_add_rms_norm(residual, attn, g1)
    return y, x, attn


def view_of_addend_read_later(h, residual, w_o, g1, *_):
    attn = h @ w_o
    flat = attn.view(-1, H)                  # another alias of attn's buffer, read afterwards
    y, _, x = npu.npu_add_rms_norm(residual, attn.view(2, -1, H), g1)
    return y, flat.sum(0)


def addend_read_through_a_clone(h, residual, w_o, g1, *_):
    attn = h @ w_o
    y, _, x = npu.npu_add_rms_norm(residual, attn.clone(), g1)   # clone is a no-op to Inductor
    return y, attn.sum()


def transposed_addend(h, residual, w_o, g1, *_):
    attn = (h.transpose(-1, -2) @ w_o).transpose(-1, -2)          # not contiguous
    return npu.npu_add_rms_norm(residual.transpose(-1, -2).contiguous(), attn, g1)


def broadcast_addend(h, residual, w_o, g1, *_):
    return npu.npu_add_rms_norm(h @ w_o, g1 * 2, g1)   # x2 [H] broadcasts; x1 is dead, but the
                                                        # in-place op takes two equal shapes


NOT_FIRING = [graph_inputs_only, addend_read_later, addend_returned, view_of_addend_read_later,
              addend_read_through_a_clone, broadcast_addend]


@pytest.mark.parametrize("eager", [True, False], ids=["run_eagerly", "inductor"])
@pytest.mark.parametrize("fn", NOT_FIRING, ids=lambda f: f.__name__)
def test_does_not_fire_where_the_buffer_is_seen(fn, eager):
    args = [*inputs(), *weights()]
    if fn is graph_inputs_only:
        args = args[:2] + [args[3]]
    before = [a.clone() for a in args]
    compiled, backend = compile_fn(fn, eager=eager)
    with torch.no_grad():
        got = compiled(*args)
    assert RULE not in backend.fusions
    assert count(ops_of(backend), "_add_rms_norm_inplace") == 0
    for g, w in zip(got, fn(*args)):   # (Inductor's own sum / add kernels round differently)
        assert_close(g, w, dtype=torch.float32)
    for a, b in zip(args, before):
        assert torch.equal(a, b)


def test_transposed_addend_is_left_alone():
    h, r = torch.randn(2, H, H), torch.randn(2, H, H)
    args = [h, r, *weights()]
    compiled, backend = compile_fn(transposed_addend)
    with torch.no_grad():
        got = compiled(*args)
    assert RULE not in backend.fusions
    for g, w in zip(got, transposed_addend(*args)):
        assert torch.equal(g, w)


# --- training --------------------------------------------------------------------------------


def exp_addend(h, residual, g1):
    e = torch.exp(h)                          # exp saves its output for backward
    y, _, x = npu.npu_add_rms_norm(residual, e, g1)
    return y, x


@pytest.mark.parametrize("eager", [True, False], ids=["run_eagerly", "inductor"])
def test_training_fires_only_on_buffers_not_saved_for_backward(eager):
    # layer: the projections' outputs are not saved (mm saves its inputs), so both adds fire in
    # the forward graph; the sums the norms' backward needs are the buffers they were written to.
    args = [*inputs(grad=True), *weights(grad=True)]
    compiled, backend = compile_fn(layer, eager=eager)
    got = compiled(*args)
    (got[0].square().sum() + got[1].sum()).backward()
    got_grads = [a.grad.clone() for a in args]
    for a in args:
        a.grad = None
    want = layer(*args)
    (want[0].square().sum() + want[1].sum()).backward()
    assert backend.fusions == {RULE: 2}
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for g, a in zip(got_grads, args):
        assert_close(g, a.grad, dtype=torch.float32)

    # exp's output is saved for its backward: it must not be overwritten
    h, r = inputs(grad=True)
    g1 = weights(grad=True)[1]
    compiled, backend = compile_fn(exp_addend, eager=eager)
    got = compiled(h, r, g1)
    got[0].square().sum().backward()
    got_grads = [t.grad.clone() for t in (h, r, g1)]
    for t in (h, r, g1):
        t.grad = None
    want = exp_addend(h, r, g1)
    want[0].square().sum().backward()
    assert RULE not in backend.fusions
    for g, w in zip(got, want):            # (Inductor's exp kernel rounds differently)
        assert_close(g, w, dtype=torch.float32)
    for g, t in zip(got_grads, (h, r, g1)):
        assert_close(g, t.grad, dtype=torch.float32)


def sum_beside_a_trained_branch(h, residual, w_o, g1, w):
    attn = h @ w_o
    y, _, x = npu.npu_add_rms_norm(residual, attn, g1)
    return x, (y * w).sum()                  # only w requires grad


@pytest.mark.parametrize("eager", [True, False], ids=["run_eagerly", "inductor"])
def test_returned_sum_of_a_training_graph_can_be_written(eager):
    """The returned sum lives in attn's buffer (on the eager path it is a view of the projection's
    output): the caller may still modify it in place, as eager's, and the backward is unchanged."""
    h, r = inputs()
    w_o, g1 = weights()[:2]
    w = torch.rand(H, requires_grad=True)
    compiled, backend = compile_fn(sum_beside_a_trained_branch, eager=eager)
    x, loss = compiled(h, r, w_o, g1, w)
    x.mul_(2)
    loss.backward()
    got_grad = w.grad.clone()
    w.grad = None
    want_x, want_loss = sum_beside_a_trained_branch(h, r, w_o, g1, w)
    want_loss.backward()
    assert backend.fusions == {RULE: 1}
    assert torch.equal(x, want_x * 2)
    assert_close(loss, want_loss, dtype=torch.float32)
    assert_close(got_grad, w.grad, dtype=torch.float32)


# --- from native PyTorch: the add_rms_norm rule's result -----------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, h, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(h, dtype=dtype) + 0.5)

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class Layer(nn.Module):
    """transformers' decoder-layer residual structure with linear stand-ins for attention and MLP."""

    def __init__(self, dtype):
        super().__init__()
        self.input_norm, self.post_norm = RMSNorm(H, dtype), RMSNorm(H, dtype)
        self.attn = nn.Linear(H, H, bias=False, dtype=dtype)
        self.mlp = nn.Linear(H, H, bias=False, dtype=dtype)

    def forward(self, hidden):
        residual = hidden
        hidden = self.attn(self.input_norm(hidden))
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_norm(hidden))
        return residual + hidden


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_decoder_layer(dtype):
    layer_module = Layer(dtype)
    x = torch.randn(2, 8, H, dtype=dtype)
    with torch.no_grad():
        on = run_compiled(layer_module, x)
        off = run_compiled(layer_module, x, disabled=[RULE])
        want = layer_module(x)
    assert on.fusions == {"rms_norm": 2, "add_rms_norm": 1, RULE: 1}
    assert count(on.ops, "_add_rms_norm_inplace") == 1 and count(on.ops, "npu_add_rms_norm.") == 0
    assert count(off.ops, "npu_add_rms_norm.") == 1
    assert torch.equal(on.outputs, off.outputs)     # the same kernel, the sum in another buffer
    assert_close(on.outputs, want, dtype=dtype)
