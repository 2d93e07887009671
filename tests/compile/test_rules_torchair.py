"""TorchAir's default rules (seed 003) on models that call the npu ops explicitly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusion_helpers import count, run_compiled
from opennpu.testing.tolerances import assert_close

npu = torch.ops.npu


class DsModel(nn.Module):
    """The three source patterns of TorchAir's system test, one epsilon spelled out."""

    def forward(self, x1, x2, gamma, smooth, x3):
        y, _, x = npu.npu_add_rms_norm(x1, x2, gamma)                     # rule (a)
        q1, s1 = npu.npu_dynamic_quant(y, smooth_scales=smooth)
        y2, _, x = npu.npu_add_rms_norm(x, x3, gamma, 1e-5)               # rule (b)
        q2, s2 = npu.npu_dynamic_quant(y2.flatten(0, 1))
        y3, _, x = npu.npu_add_rms_norm(x, x3, gamma)                     # rule (c)
        cast = y3.view(-1, y3.size(-1)).to(torch.float32)
        return q1, s1, q2, s2.view(-1, 1), x, cast, y3


def _inputs(dtype, shape=(2, 3, 32)):
    h = shape[-1]
    return [torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype),
            (torch.rand(h) + 0.5).to(dtype), (torch.rand(h) + 0.5).to(dtype),
            torch.randn(shape, dtype=dtype)]


RULES = ["torchair_add_rms_norm_dynamic_quant", "torchair_add_rms_norm_flatten_dynamic_quant",
         "torchair_add_rms_norm_cast"]


def _check_outputs(got, want, dtype):
    q1, s1, q2, s2, x, cast, y3 = got
    e_q1, e_s1, e_q2, e_s2, e_x, e_cast, e_y3 = want
    # The fused ops quantise the fp32 y the separate ops round to fp16/bf16 first: the int8
    # codes may differ by one step where that rounding crosses a half-step, never more.
    for q, e in ((q1, e_q1), (q2, e_q2)):
        assert q.dtype == torch.int8 and q.shape == e.shape
        assert (q.int() - e.int()).abs().max() <= 1
    for s, e in ((s1, e_s1), (s2, e_s2)):
        assert s.shape == e.shape
        assert_close(s, e, dtype=dtype)
    assert_close(x, e_x, dtype=dtype)
    assert cast.dtype == torch.float32 and cast.shape == e_cast.shape
    assert_close(cast, e_cast, dtype=dtype)
    assert_close(y3, e_y3, dtype=dtype)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_default_rules_fire_once_each(dtype, dynamic):
    args = _inputs(dtype)
    before = run_compiled(DsModel(), *args, fusion=False, dynamic=dynamic)
    after = run_compiled(DsModel(), *args, dynamic=dynamic)
    assert count(before.ops, "npu_add_rms_norm.") == 3 and count(before.ops, "npu_dynamic_quant") == 2
    assert after.fusions == {rule: 1 for rule in RULES}
    assert count(after.ops, "npu_add_rms_norm.") == 0 and count(after.ops, "npu_dynamic_quant") == 0
    assert count(after.ops, "npu_add_rms_norm_dynamic_quant") == 2
    assert count(after.ops, "npu_add_rms_norm_cast") == 1
    _check_outputs(after.outputs, DsModel()(*args), dtype)


def test_dynamic_graph_serves_other_shapes():
    from opennpu.compile import CompilerConfig, get_npu_backend

    config = CompilerConfig()
    config.debug.run_eagerly = True
    backend = get_npu_backend(compiler_config=config)
    compiled = torch.compile(DsModel(), backend=backend, dynamic=True, fullgraph=True)
    for shape in [(2, 3, 32), (4, 5, 32), (3, 2, 32)]:
        args = _inputs(torch.float16, shape)
        _check_outputs(compiled(*args), DsModel()(*args), torch.float16)
    assert backend.fusions == {rule: 1 for rule in RULES}


@pytest.mark.parametrize("rule", RULES)
def test_each_default_rule_can_be_disabled(rule):
    after = run_compiled(DsModel(), *_inputs(torch.float16), disabled=[rule])
    # the npu_add_rms_norm left takes the previous sum, dead after it, except in rule (a), whose
    # addends are graph inputs: add_rms_norm_inplace writes the sum there
    inplace = {} if rule == RULES[0] else {"add_rms_norm_inplace": 1}
    assert after.fusions == {**{r: 1 for r in RULES if r != rule}, **inplace}


class CastToHalf(nn.Module):
    """y viewed and cast to fp16, not fp32: npu_add_rms_norm_cast's output is fp32 only."""

    def forward(self, x1, x2, gamma):
        y, _, x = npu.npu_add_rms_norm(x1, x2, gamma)
        return x, y.view(-1, y.size(-1)).to(torch.float16)


class WrongView(nn.Module):
    """flatten(1, 2) instead of flatten(0, 1): the view is a wildcard in the pattern, the check
    must see the difference."""

    def forward(self, x1, x2, gamma):
        y, _, x = npu.npu_add_rms_norm(x1, x2, gamma)
        q, s = npu.npu_dynamic_quant(y.flatten(1, 2))
        return q, s.view(-1, 1), x


@pytest.mark.parametrize("module", [CastToHalf(), WrongView()], ids=lambda m: type(m).__name__)
def test_lookalikes_are_not_fused(module):
    args = [torch.randn(2, 3, 4, 8, dtype=torch.bfloat16), torch.randn(2, 3, 4, 8, dtype=torch.bfloat16),
            torch.rand(8, dtype=torch.bfloat16) + 0.5]
    after = run_compiled(module, *args, dynamic=True)
    assert not after.fusions
    for got, want in zip(after.outputs, module(*args)):
        torch.testing.assert_close(got, want)


def test_fused_graph_dump_shows_the_fused_op(tmp_path):
    """Seed 003: with graph_dump on, the dumped graph after fusion shows the fused op."""
    from opennpu.compile import CompilerConfig, get_npu_backend

    config = CompilerConfig()
    config.debug.run_eagerly = True
    config.debug.graph_dump.type = "py"
    config.debug.graph_dump.path = str(tmp_path)
    torch.compile(DsModel(), backend=get_npu_backend(compiler_config=config))(*_inputs(torch.float16))
    dumps = list(tmp_path.glob("inference_graph_*_rank_0_pid_*_ts_*.py"))
    assert len(dumps) == 1
    text = dumps[0].read_text()
    assert "torch.ops.npu.npu_add_rms_norm_dynamic_quant.default(" in text
    assert "output_mask = [True, False]" in text
    assert "torch.ops.npu.npu_add_rms_norm_cast.default(" in text
    assert 'i8[6, 32]' in text and "torch.ops.aten.reshape.default" in text
    assert "npu_dynamic_quant.default" not in text


_WARM_CACHE_SCRIPT = """
import sys
import torch, torch_npu, torchair

class Model(torch.nn.Module):
    def forward(self, x1, x2, gamma):
        y, _, x = torch_npu.npu_add_rms_norm(x1, x2, gamma)
        q, scale = torch_npu.npu_dynamic_quant(y)
        return q, scale, x

config = torchair.CompilerConfig()
config.debug.graph_dump.type = "py"
config.debug.graph_dump.path = sys.argv[1]
backend = torchair.get_npu_backend(compiler_config=config)
args = [torch.randn(2, 3, 32, dtype=torch.float16), torch.randn(2, 3, 32, dtype=torch.float16),
        torch.rand(32, dtype=torch.float16) + 0.5]
torch.compile(Model(), backend=backend)(*args)
print(dict(backend.fusions))
"""


def test_graph_dump_and_fusion_counts_survive_a_warm_compile_cache(tmp_path):
    """Issue 25: two fresh processes sharing one Inductor cache directory compile the same model;
    the second, served by warm caches, must still dump its fused graph and count its fusions."""
    import subprocess
    import sys

    script = tmp_path / "compile_twice.py"
    script.write_text(_WARM_CACHE_SCRIPT)
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    for run in ("cold", "warm"):
        dump_dir = tmp_path / run
        done = subprocess.run([sys.executable, str(script), str(dump_dir)], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().splitlines()[-1] == \
            "{'torchair_add_rms_norm_dynamic_quant': 1}", (run, done.stdout)
        dumps = list(dump_dir.glob("forward_graph_*_rank_0_pid_*_ts_*.py"))
        assert len(dumps) == 1, (run, sorted(p.name for p in dump_dir.glob("*")))
        assert "torch.ops.npu.npu_add_rms_norm_dynamic_quant.default(" in dumps[0].read_text()


class _QuantNorm(nn.Module):
    """Seed 003's dump example: npu_add_rms_norm's y quantised without smooth scales (rule a)."""

    def forward(self, x1, x2, gamma):
        y, _, x = npu.npu_add_rms_norm(x1, x2, gamma)
        q, scale = npu.npu_dynamic_quant(y)
        return q, scale, x


class _NativeNorm(nn.Module):
    """A Llama-style RMSNorm in native PyTorch (the pre_autograd rms_norm rule), trainable: its
    post_grad forward and backward graphs are dumped, with no post_grad rule firing."""

    def forward(self, x1, x2, gamma):
        h = (x1 + x2).float()
        return gamma * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x1.dtype)


def _compile_with_dump(path, *args, backward=False):
    from opennpu.compile import CompilerConfig, get_npu_backend

    config = CompilerConfig()
    config.debug.graph_dump.type = "txt"
    config.debug.graph_dump.path = str(path)
    backend = get_npu_backend(compiler_config=config)
    torch._dynamo.reset()
    model = _NativeNorm() if backward else _QuantNorm()
    out = torch.compile(model, backend=backend, fullgraph=True)(*args)
    if backward:
        out.float().square().sum().backward()
    return backend, out


@pytest.mark.parametrize("backward", [False, True], ids=["inference", "training"])
def test_a_cache_served_compile_replays_its_fusions_and_dumps(tmp_path, monkeypatch, backward):
    """The second compile of one graph is served by AOTAutograd's / Inductor's caches, which skip
    the passes: the record the first compile kept reports the same fusions and dumps the same
    graphs (forward, and backward when training)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    args = _inputs(torch.float16)[:2] + [(torch.rand(32) + 0.5).half()]
    if backward:
        args = [a.requires_grad_() for a in args]
    with inductor_config.patch(fx_graph_cache=True), \
            functorch_config.patch(enable_autograd_cache=True):
        cold, want = _compile_with_dump(tmp_path / "cold", *args, backward=backward)
        warm, got = _compile_with_dump(tmp_path / "warm", *args, backward=backward)
    want_fusions = ({"rms_norm": 1, "add_rms_norm": 1} if backward
                    else {"torchair_add_rms_norm_dynamic_quant": 1})
    assert cold.fusions == warm.fusions == want_fusions
    cold_phases = {phase for phase, _ in cold.graphs} - {"pre_autograd"}
    assert cold_phases == ({"forward", "backward"} if backward else {"forward"})
    assert {phase for phase, _ in warm.graphs} <= {"pre_autograd"}, "the warm compile re-ran the passes"

    def dumps(folder):
        return {p.name.split("_rank_")[0].split("_graph_")[0]: p.read_text()
                for p in folder.glob("*_graph_*_rank_0_pid_*.txt")}

    assert dumps(tmp_path / "warm") == dumps(tmp_path / "cold")
    fused_op = "npu_add_rms_norm.default" if backward else "npu_add_rms_norm_dynamic_quant.default"
    assert fused_op in dumps(tmp_path / "warm")["forward"]
    for a, b in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
        assert torch.equal(a, b)


def test_a_cache_served_compile_without_a_record_compiles_again(tmp_path, monkeypatch):
    """With the record gone (deleted, or the cache filled by a build that kept none), the compile
    runs again with the caches off, so the passes run and report."""
    import shutil

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    args = _inputs(torch.float16)[:2] + [(torch.rand(32) + 0.5).half()]
    with inductor_config.patch(fx_graph_cache=True), \
            functorch_config.patch(enable_autograd_cache=True):
        _compile_with_dump(tmp_path / "cold", *args)
        shutil.rmtree(tmp_path / "cache" / "opennpu_passes")
        warm, _ = _compile_with_dump(tmp_path / "warm", *args)
    assert warm.fusions == {"torchair_add_rms_norm_dynamic_quant": 1}
    assert "forward" in {phase for phase, _ in warm.graphs}
    assert len(list((tmp_path / "warm").glob("forward_graph_*.txt"))) == 1
