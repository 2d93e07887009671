"""The graph-mode API: CompilerConfig, get_npu_backend, register_replacement, the torchair names,
user passes, graph dumps, the Inductor path with training, and the FX graph cache."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import opennpu
from fusion_helpers import count, run_compiled
from opennpu.compile import CompilerConfig, get_npu_backend, register_replacement, rule_names
from opennpu.testing.tolerances import assert_close

npu = torch.ops.npu


# --- CompilerConfig ---------------------------------------------------------------------------


def test_config_defaults_follow_torchair():
    config = CompilerConfig()
    assert config.experimental_config.pattern_fusion_pass is True
    assert config.mode == "max-autotune"
    assert config.debug.graph_dump.type is None
    assert config.debug.run_eagerly is False
    assert config.experimental_config.frozen_parameter is False
    assert config.with_options({"frozen_parameter": True}).experimental_config.frozen_parameter


@pytest.mark.parametrize("assign, error, text", [
    (lambda c: setattr(c.experimental_config, "pattern_fusion_pas", True), AttributeError,
     "unknown option CompilerConfig.experimental_config.pattern_fusion_pas"),
    (lambda c: setattr(c.experimental_config, "pattern_fusion_pass", 1), TypeError,
     "CompilerConfig.experimental_config.pattern_fusion_pass must be bool, got int"),
    (lambda c: setattr(c.debug.graph_dump, "type", "onnx"), ValueError,
     "CompilerConfig.debug.graph_dump.type must be one of [None, 'py', 'txt', 'pbtxt'], "
     "got 'onnx'"),
    (lambda c: setattr(c, "mode", "fast"), ValueError, "CompilerConfig.mode must be one of"),
    (lambda c: setattr(c.experimental_config, "disabled_patterns", ["rms"]), ValueError,
     "names unknown rules ['rms']"),
    (lambda c: setattr(c, "debug", None), AttributeError, "CompilerConfig.debug is a group"),
    (lambda c: setattr(c, "post_grad_custom_pre_pass", 3), TypeError,
     "post_grad_custom_pre_pass must be"),
])
def test_config_rejects_bad_assignments(assign, error, text):
    with pytest.raises(error) as info:
        assign(CompilerConfig())
    assert text in str(info.value)


def test_get_npu_backend_rejects_other_config_types():
    with pytest.raises(TypeError, match="compiler_config must be a CompilerConfig, got dict"):
        get_npu_backend(compiler_config={"pattern_fusion_pass": False})


def test_torch_compile_options_are_applied_and_checked():
    module = _AddNorm()
    args = _add_norm_inputs()
    backend = get_npu_backend()
    out = torch.compile(module, backend=backend,
                        options={"pattern_fusion_pass": False, "force_eager": True})(*args)
    assert not backend.fusions
    torch.testing.assert_close(out, module(*args))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown option 'fusion'"):
        torch.compile(module, backend=get_npu_backend(), options={"fusion": True})(*args)


# --- entry points -----------------------------------------------------------------------------


class _AddNorm(nn.Module):
    def __init__(self, h=16):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(h) + 0.5)

    def forward(self, x, r):
        x = x + r
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype), x


def _add_norm_inputs(h=16):
    return torch.randn(2, 3, h), torch.randn(2, 3, h)


def test_seed_003_snippet_runs_through_torchair_names():
    import torch_npu  # noqa: F401  (the seed imports it first)
    import torchair

    model = _AddNorm()
    config = torchair.CompilerConfig()
    config.experimental_config.pattern_fusion_pass = False
    config.debug.run_eagerly = True
    npu_backend = torchair.get_npu_backend(compiler_config=config)
    opt_model = torch.compile(model, backend=npu_backend)
    out = opt_model(*_add_norm_inputs())
    assert not npu_backend.fusions and len(out) == 2
    assert torchair.register_replacement is register_replacement


def test_opennpu_compile_is_callable_and_backend_has_a_name():
    config = CompilerConfig()
    config.debug.run_eagerly = True
    model = _AddNorm()
    args = _add_norm_inputs()
    out = opennpu.compile(model, config=config, fullgraph=True)(*args)
    for got, want in zip(out, model(*args)):
        assert_close(got, want, dtype=torch.float32)
    from torch._dynamo import list_backends

    assert "opennpu" in list_backends()


# --- register_replacement ---------------------------------------------------------------------

H_USER = 56  # the user rule's extra_check only accepts this hidden size (as TorchAir's doc example)


def _user_search(x1, x2, gamma):
    x_out = torch.add(x1, x2)
    y, _ = npu.npu_rms_norm(x_out, gamma)
    return y, x_out


def _user_replace(x1, x2, gamma):
    y, _, x_out = npu.npu_add_rms_norm(x1, x2, gamma)
    return y, x_out


def _user_check(match):
    return match.kwargs["x1"].meta["val"].shape[-1] == H_USER


class _ExplicitAddNorm(nn.Module):
    def forward(self, x1, x2, gamma):
        x = x1 + x2
        return npu.npu_rms_norm(x, gamma)[0], x


@pytest.fixture(scope="module")
def user_rule():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        example = (torch.empty(1, 1, 2), torch.empty(1, 1, 2), torch.empty(2))
    register_replacement(search_fn=_user_search, replace_fn=_user_replace, example_inputs=example,
                         extra_check=_user_check, name="user_add_rms_norm")
    return "user_add_rms_norm"


def test_user_rule_fires_where_its_check_accepts(user_rule):
    assert user_rule in rule_names()
    for h, fired in ((H_USER, 1), (24, 0)):
        args = (torch.randn(3, h), torch.randn(3, h), torch.rand(h) + 0.5)
        after = run_compiled(_ExplicitAddNorm(), *args)
        assert after.fusions[user_rule] == fired
        assert count(after.ops, "npu_add_rms_norm.") == fired
        for got, want in zip(after.outputs, _ExplicitAddNorm()(*args)):
            assert_close(got, want, dtype=torch.float32)


def test_user_rules_share_the_fusion_switch_and_names(user_rule):
    args = (torch.randn(3, H_USER), torch.randn(3, H_USER), torch.rand(H_USER) + 0.5)
    assert not run_compiled(_ExplicitAddNorm(), *args, fusion=False).fusions
    assert not run_compiled(_ExplicitAddNorm(), *args, disabled=[user_rule]).fusions


def test_register_replacement_rejects_bad_arguments():
    with pytest.raises(TypeError, match="search_fn and replace_fn must be callables"):
        register_replacement(None, _user_replace, [torch.empty(2)])
    with pytest.raises(ValueError, match="example_inputs must contain at least one tensor"):
        register_replacement(_user_search, _user_replace, [1.0])
    with pytest.raises(ValueError, match="is the name of a built-in rule"):
        register_replacement(_user_search, _user_replace, [torch.empty(2)], name="rms_norm")


# --- user passes, dumps -----------------------------------------------------------------------


def test_custom_passes_run_before_and_after_the_rules(tmp_path):
    seen = []

    def pre(gm, example_inputs, config):
        seen.append(("pre", count(opennpu.compile.node_targets(gm), "npu_add_rms_norm_cast"),
                     len(example_inputs), config.mode))

    def post(gm, example_inputs, config):
        seen.append(("post", count(opennpu.compile.node_targets(gm), "npu_add_rms_norm_cast"),
                     len(example_inputs), config.mode))

    class Cast(nn.Module):
        def forward(self, x1, x2, gamma):
            y, _, x = npu.npu_add_rms_norm(x1, x2, gamma)
            return x, y.to(torch.float32)

    config = CompilerConfig()
    config.debug.run_eagerly = True
    config.post_grad_custom_pre_pass = pre
    config.post_grad_custom_post_pass = post
    config.debug.graph_dump.type = "txt"
    config.debug.graph_dump.path = str(tmp_path)
    args = (torch.randn(2, 8, dtype=torch.float16), torch.randn(2, 8, dtype=torch.float16),
            torch.rand(8, dtype=torch.float16))
    torch.compile(Cast(), backend=get_npu_backend(compiler_config=config))(*args)
    assert seen == [("pre", 0, 3, "max-autotune"), ("post", 1, 3, "max-autotune")]
    (dump,) = tmp_path.glob("inference_graph_*.txt")
    assert "npu.npu_add_rms_norm_cast.default" in dump.read_text()


# --- Inductor, training, FX graph cache ---------------------------------------------------------


def test_cache_key_covers_rules_and_autograd_formulas(monkeypatch):
    """The pass uuid hashes the rules and the ops' Python sources (autograd formulas, fake
    kernels): a changed backward formula must not be served from a graph cached before it."""
    from pathlib import Path

    from opennpu.compile import backend as backend_module

    hashed = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(backend_module, "_SOURCE_HASH", None)
    monkeypatch.setattr(Path, "read_bytes", lambda self: hashed.append(self) or read_bytes(self))
    backend_module._source_hash()
    names = {(p.parent.name, p.name) for p in hashed}
    assert ("ops", "rotary.py") in names and ("ops", "norm.py") in names
    assert ("compile", "fusion.py") in names and ("rules", "rotary.py") in names


def test_inductor_training_and_fx_graph_cache(tmp_path, monkeypatch, request):
    """One module through Inductor: fused ops in forward and backward, outputs and gradients equal
    to eager; a second compile is served from the FX graph cache with the fusion intact, and a
    compile with fusion off does not hit the fused entry."""
    from torch._dynamo.utils import counters
    import torch._inductor.config as inductor_config

    import torch._functorch.config as functorch_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # The compile tests' fixture turns the whole-graph caches off; this test is about them.
    stack = contextlib.ExitStack()
    stack.enter_context(inductor_config.patch(fx_graph_cache=True))
    stack.enter_context(functorch_config.patch(enable_autograd_cache=True))
    request.addfinalizer(stack.close)
    model = _AddNorm(32)
    x, r = torch.randn(4, 5, 32, requires_grad=True), torch.randn(4, 5, 32)

    def compile_once(fusion: bool):
        torch._dynamo.reset()
        counters.clear()
        config = CompilerConfig()
        config.experimental_config.pattern_fusion_pass = fusion
        backend = get_npu_backend(compiler_config=config)
        y, xo = torch.compile(model, backend=backend)(x, r)
        (y.square().sum() + xo.sum()).backward()
        grad_x = x.grad.clone()
        x.grad = None
        model.zero_grad()
        return backend, y, grad_x, dict(counters["inductor"])

    backend, y, grad_x, first = compile_once(True)
    assert backend.fusions == {"rms_norm": 1, "add_rms_norm": 1}
    phases = {phase for phase, _ in backend.graphs}
    assert {"pre_autograd", "forward", "backward"} <= phases
    ops = {str(n.target) for phase, gm in backend.graphs for n in gm.graph.nodes}
    assert "npu.npu_add_rms_norm.default" in ops and "npu.npu_rms_norm_backward.default" in ops
    ye, xe = model(x, r)
    (ye.square().sum() + xe.sum()).backward()
    assert_close(y, ye, dtype=torch.float32)
    assert_close(grad_x, x.grad, dtype=torch.float32)
    x.grad = None
    model.zero_grad()
    assert first.get("fxgraph_cache_miss", 0) >= 1

    backend2, y2, _, second = compile_once(True)
    assert second.get("fxgraph_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0
    torch.testing.assert_close(y2, y)
    assert backend2.fusions == backend.fusions  # replayed from the passes' record

    _, y3, _, third = compile_once(False)
    assert third.get("fxgraph_cache_miss", 0) >= 1
    assert_close(y3, ye, dtype=torch.float32)


def test_fused_graph_keeps_buffer_updates_in_place_ops_and_views():
    """The pre-autograd stage re-traces Dynamo's graph: BatchNorm's running statistics, an
    in-place add and a returned view must behave exactly as in eager."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(16)
            self.weight = nn.Parameter(torch.rand(16) + 0.5)

        def forward(self, x):
            h = self.bn(x)
            y = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
            y.add_(1.0)
            return y, y[:, :4]

    compiled_model, eager_model = Mixed(), Mixed()
    eager_model.load_state_dict(compiled_model.state_dict())
    x = torch.randn(8, 16, requires_grad=True)
    after = run_compiled(compiled_model, x, backward=True)
    expected = eager_model(x)
    assert after.fusions == {"rms_norm": 1}
    for got, want in zip(after.outputs, expected):
        assert_close(got, want, dtype=torch.float32)
    assert_close(compiled_model.bn.running_mean, eager_model.bn.running_mean, dtype=torch.float32)
    assert_close(compiled_model.bn.running_var, eager_model.bn.running_var, dtype=torch.float32)
    assert compiled_model.bn.num_batches_tracked.item() == 1
    expected[0].square().sum().backward()
    assert_close(compiled_model.weight.grad, eager_model.weight.grad, dtype=torch.float32)


# --- frozen_parameter ---------------------------------------------------------------------------


class _LinearNorm(nn.Module):
    """A linear into a Llama-style RMSNorm, plus a buffer (which frozen_parameter leaves an input)."""

    def __init__(self, h=32, n=48):
        super().__init__()
        self.proj = nn.Linear(h, n, bias=False)
        self.weight = nn.Parameter(torch.rand(n) + 0.5)
        self.register_buffer("shift", torch.randn(n))

    def forward(self, x):
        h = self.proj(x).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype) + self.shift.to(x.dtype)


def _frozen_backend():
    config = CompilerConfig()
    config.experimental_config.frozen_parameter = True
    return get_npu_backend(compiler_config=config)


def _inputs_and_constants(backend):
    """Placeholders and get_attr nodes of the graphs Inductor compiled (after freezing)."""
    nodes = [n for phase, gm in backend.graphs if phase != "pre_autograd" for n in gm.graph.nodes]
    return (sum(n.op == "placeholder" for n in nodes), sum(n.op == "get_attr" for n in nodes))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_parameter_folds_parameters_in_inference(dtype):
    """Inference with frozen_parameter: the parameters are constants of the compiled graph (the
    input and the buffer stay placeholders), the fusion still fires, outputs match eager."""
    model = _LinearNorm().to(dtype)
    x = torch.randn(2, 5, 32, dtype=dtype)
    backend = _frozen_backend()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(x)
        want = model(x)
    assert backend.fusions == {"rms_norm": 1}
    placeholders, constants = _inputs_and_constants(backend)
    assert placeholders == 2 and constants >= 2
    if dtype == torch.float32:
        assert_close(out, want, dtype=dtype)
        return
    # bf16: both sides round the linear's output and the product, differently ordered; compare
    # their errors against the float32 model (relative Frobenius norms).
    with torch.no_grad():
        ref = copy.deepcopy(model).float()(x.float()).double()
    err, err_eager = ((t.double() - ref).norm() / ref.norm() for t in (out, want))
    assert err <= 1.5 * err_eager + 1e-4, (err, err_eager)


def test_frozen_parameter_leaves_training_graphs_alone():
    """Grad mode on: parameters stay inputs, so gradients reach them."""
    model = _LinearNorm()
    x = torch.randn(2, 5, 32)
    backend = _frozen_backend()
    torch.compile(model, backend=backend)(x).square().sum().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    assert backend.fusions == {"rms_norm": 1}
    assert _inputs_and_constants(backend)[1] == 0
    for g, want in zip(got, model.parameters()):
        assert_close(g, want.grad, dtype=torch.float32)


def test_frozen_parameter_never_serves_one_modules_weights_to_another():
    """Dynamo shares compiled code between instances of one class (a layer compiled per
    instance, a function taking the model as an argument): the frozen constants must stay with
    the parameters they were folded from."""
    x = torch.randn(2, 5, 32)
    backend = _frozen_backend()

    def run(model, x):
        return model(x)

    run_compiled = torch.compile(run, backend=backend)
    with torch.no_grad():
        for seed in (0, 1, 2):
            torch.manual_seed(seed)
            model = _LinearNorm()
            assert_close(torch.compile(model, backend=backend)(x), model(x), dtype=torch.float32)
            assert_close(run_compiled(model, x), model(x), dtype=torch.float32)
