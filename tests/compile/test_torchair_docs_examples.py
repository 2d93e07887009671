"""TorchAir's documentation examples (Ascend/torchair, docs/zh/ascend_ir), run as scripts.

Each script follows the steps of one documented example, in our own words, and runs unchanged on
opennpu: the same imports (torch_npu, torchair), the same calls, the same configuration. The
scripts run in this process (runpy) from a fresh folder, except the one that registers a rule
for good (a child process); the checks after each look at what the
documentation says the example produces. docs/torchair_api.md lists the examples that do not run.
"""

from __future__ import annotations

import runpy
import textwrap

import pytest
import torch


def run_script(tmp_path, monkeypatch, source: str) -> dict:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "example.py"
    path.write_text(textwrap.dedent(source))
    return runpy.run_path(str(path), run_name="__main__")


QUICK_START = """
    import torch
    import torch_npu
    import torchair
    from torchair import patch_for_hcom

    patch_for_hcom()                       # collectives may be traced into the graph

    class AddNet(torch.nn.Module):
        def forward(self, a, b):
            return torch.add(a, b)

    net = AddNet().npu()
    config = torchair.CompilerConfig()     # max-autotune, the default mode
    backend = torchair.get_npu_backend(compiler_config=config)
    compiled = torch.compile(net, backend=backend)
    a = torch.randn(2, 2).npu()
    b = torch.randn(2, 2).npu()
    result = compiled(a, b)
"""


def test_quick_start(tmp_path, monkeypatch):
    env = run_script(tmp_path, monkeypatch, QUICK_START)
    assert env["result"].device.type == "npu"
    torch.testing.assert_close(env["result"], env["a"] + env["b"])


GET_COMPILER = """
    import torch
    from torch._functorch.aot_autograd import aot_module_simplified
    import torch_npu
    import torchair
    from torchair.configs.compiler_config import CompilerConfig

    class Sum(torch.nn.Module):
        def forward(self, x, y):
            return x + y

    captured = []

    def my_backend(gm: torch.fx.GraphModule, example_inputs):
        npu_compiler = torchair.get_compiler(CompilerConfig())
        captured.append(str(gm))
        return aot_module_simplified(gm, example_inputs, fw_compiler=npu_compiler)

    torch.npu.set_device(0)
    x = torch.ones([2, 2], dtype=torch.int32).npu()
    y = torch.ones([2, 2], dtype=torch.int32).npu()
    out = torch.compile(Sum().npu(), backend=my_backend, dynamic=False)(x, y)
"""


def test_get_compiler(tmp_path, monkeypatch):
    env = run_script(tmp_path, monkeypatch, GET_COMPILER)
    assert torch.equal(env["out"].cpu(), torch.full((2, 2), 2, dtype=torch.int32))
    assert len(env["captured"]) == 1


REGISTER_REPLACEMENT = """
    import functools
    import torch, torch_npu, torchair
    from torch._inductor.pattern_matcher import Match
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchair.core.utils import logger

    def search_fn(x1, x2, gamma):          # add, then rms_norm of the sum
        total = torch.add(x1, x2)
        y, _ = torch_npu.npu_rms_norm(total, gamma)
        return y, total

    def replace_fn(x1, x2, gamma):         # the fused op
        y, _, total = torch_npu.npu_add_rms_norm(x1, x2, gamma)
        return y, total

    def only_hidden_7168(match: Match):
        x1 = match.kwargs.get("x1")
        if x1 is None or not hasattr(x1, "meta") or "val" not in x1.meta:
            return False
        return x1.meta["val"].shape[-1] == 7168

    with FakeTensorMode():
        act = functools.partial(torch.empty, (1, 1, 2), device="npu", dtype=torch.float16)
        weight = functools.partial(torch.empty, 2, device="npu", dtype=torch.float16)
        torchair.register_replacement(search_fn=search_fn, replace_fn=replace_fn,
                                      example_inputs=(act(), act(), weight()),
                                      extra_check=only_hidden_7168)

    class Net(torch.nn.Module):
        def forward(self, a, b, gamma):
            total = torch.add(a, b)
            y, _ = torch_npu.npu_rms_norm(total, gamma)
            return torch.abs(y), torch.sqrt(total)

    config = torchair.CompilerConfig()
    config.debug.graph_dump.type = "py"
    backend = torchair.get_npu_backend(compiler_config=config)
    a = torch.randn(1, 1, 7168, dtype=torch.float16, device="npu")
    b = torch.randn(1, 1, 7168, dtype=torch.float16, device="npu")
    gamma = torch.ones(7168, dtype=torch.float16, device="npu")
    result = torch.compile(Net(), backend=backend)(a, b, gamma)
"""


def test_register_replacement(tmp_path):
    """In a child process: the rule it registers stays registered for the process's lifetime, and
    test_graph_mode registers the same pattern."""
    import os
    import subprocess
    import sys

    (tmp_path / "example.py").write_text(textwrap.dedent(REGISTER_REPLACEMENT) + textwrap.dedent("""
        print("fused", dict(backend.fusions))
    """))
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(torch.__file__))  # keep this interpreter's packages
    import opennpu

    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(opennpu.__file__)),
                                         env.get("PYTHONPATH", ""), src])
    done = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fused {'search_fn': 1}" in done.stdout
    dumps = sorted(p.name for p in tmp_path.glob("*.py") if p.name != "example.py")
    assert any(n.startswith("dynamo_original_graph_") for n in dumps)
    fused = [p for p in tmp_path.glob("*_graph_*.py") if not p.name.startswith("dynamo_original")]
    assert fused and "npu_add_rms_norm" in fused[0].read_text()


GRAPH_DUMP = """
    import logging
    import torch, torch_npu, torchair
    from torchair import logger

    logger.setLevel(logging.DEBUG)          # step 1: the FX graph in the log

    class Scaled(torch.nn.Module):
        def forward(self, x, y):
            return torch.select_scatter(x, y, 0, 1) * 10

    config = torchair.CompilerConfig()      # step 2: dump the graphs as protobuf text
    config.debug.graph_dump.type = "pbtxt"
    config.debug.graph_dump.path = "./test"
    backend = torchair.get_npu_backend(compiler_config=config)
    model = torch.compile(Scaled(), backend=backend)
    out = model(torch.randn(2, 2, 2), torch.randn(2, 2))
    logger.setLevel(logging.NOTSET)
"""


def test_graph_dump(tmp_path, monkeypatch, capsys):
    (tmp_path / "test").mkdir()  # the documentation asks for an existing folder
    run_script(tmp_path, monkeypatch, GRAPH_DUMP)
    assert "[DEBUG] TORCHAIR(" in capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "test").iterdir())
    assert any(n.startswith("dynamo_original_graph_") and "_rank_0_pid_" in n
               and n.endswith(".pbtxt") for n in names)
    optimized = [p for p in (tmp_path / "test").iterdir() if not p.name.startswith("dynamo_")]
    assert optimized and 'type: "aten.select_scatter.default"' in optimized[0].read_text()


CACHE_COMPILE = """
    import dataclasses
    import logging
    from typing import List
    import torch
    import torch_npu
    import torchair
    from torchair import logger
    from torchair.configs.compiler_config import CompilerConfig

    config = CompilerConfig()
    logger.setLevel(logging.INFO)

    @dataclasses.dataclass
    class Step:                             # a vLLM-like input record
        data: torch.Tensor
        is_prompt: bool

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = torch.nn.Linear(2, 1)
            self.linear2 = torch.nn.Linear(2, 1)
            for p in self.parameters():
                torch.nn.init.ones_(p)
            self.cached_prompt = torchair.inference.cache_compile(self.prompt, config=config)
            self.cached_decode = torchair.inference.cache_compile(self.decode, config=config)

        def forward(self, x: Step, kv: List[torch.Tensor]):
            if x.is_prompt:
                return self.cached_prompt(x, kv)
            return self.cached_decode(x, kv)

        def _forward(self, x, kv):
            return self.linear2(x.data) + self.linear2(kv[0])

        def prompt(self, x, y):
            return self._forward(x, y)

        def decode(self, x, y):
            return self._forward(x, y)

    x = Step(data=torch.ones(2, 2).npu(), is_prompt=True)
    kv = [torch.ones(2, 2).npu()]
    net = Net().npu()
    prompt_out = net(x, kv)
    x.is_prompt = False
    decode_out = net(x, kv)
    logger.setLevel(logging.NOTSET)
"""


def test_cache_compile_and_readable_cache(tmp_path, monkeypatch, capsys):
    first = run_script(tmp_path, monkeypatch, CACHE_COMPILE)
    assert "saved to .torchair_cache/Net_dynamic_" in capsys.readouterr().out
    torch.testing.assert_close(first["prompt_out"].cpu(), torch.full((2, 1), 6.0))
    torch.testing.assert_close(first["decode_out"].cpu(), torch.full((2, 1), 6.0))
    (cache,) = tmp_path.glob(".torchair_cache/Net_dynamic_*/prompt/compiled_module")
    torch._dynamo.reset()
    second = run_script(tmp_path, monkeypatch, CACHE_COMPILE)  # a restart: served from cache
    assert "loaded from .torchair_cache/Net_dynamic_" in capsys.readouterr().out
    assert second["net"].cached_prompt.loaded
    # step 5: the cache file as text
    run_script(tmp_path, monkeypatch, f"""
        import torch_npu, torchair
        torchair.inference.readable_cache("{cache}", file="prompt.py")
    """)
    assert "cache of Net.prompt" in (tmp_path / "prompt.py").read_text()


DYNAMO_EXPORT = """
    import torch, torch_npu, torchair

    class TwoLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear1 = torch.nn.Linear(2, 2)
            self.linear2 = torch.nn.Linear(2, 2)
            for p in self.parameters():
                torch.nn.init.ones_(p)

        def forward(self, x, y):
            return self.linear1(x) + self.linear2(y)

    model = TwoLinear()
    x = torch.randn(2, 2)
    y = torch.randn(2, 2)
    torchair.dynamo_export(x, y, model=model, dynamic=False)

    class Weighted(torch.nn.Module):        # the API page's example
        def __init__(self):
            super().__init__()
            self.p1 = torch.nn.Parameter(torch.randn(2, 4))
            self.p2 = torch.nn.Parameter(torch.randn(2, 4))

        def forward(self, x, y):
            return x + y + self.p1 + self.p2

    torchair.dynamo_export(torch.randn(2, 4), torch.randn(2, 4), model=Weighted(),
                           export_path="./test_export_file_False", dynamic=False)
"""


def test_dynamo_export(tmp_path, monkeypatch):
    env = run_script(tmp_path, monkeypatch, DYNAMO_EXPORT)
    assert sorted(p.name for p in (tmp_path / "export_file").iterdir()) == \
        ["dynamo.pbtxt", "export.pt2"]
    program = torch.export.load(tmp_path / "export_file" / "export.pt2").module()
    torch.testing.assert_close(program(env["x"], env["y"]), env["model"](env["x"], env["y"]))
    assert (tmp_path / "test_export_file_False" / "export.pt2").exists()


API_SNIPPETS = """
    import torch
    import torch_npu
    import torchair
    from torchair import register_fx_node_ge_converter
    from torchair.ge import Tensor, TensorSpec

    class Weighted(torch.nn.Module):        # use_internal_format_weight
        def __init__(self):
            super().__init__()
            self.p1 = torch.nn.Parameter(torch.randn(2, 4))
            self.p2 = torch.nn.Parameter(torch.randn(2, 4))

        def forward(self, x, y):
            return x + y + self.p1 + self.p2

    torchair.use_internal_format_weight(Weighted())

    @register_fx_node_ge_converter(torch.ops.aten.sin.default)   # a GE converter
    def convert_sin(self: Tensor, meta_outputs: TensorSpec = None):
        raise NotImplementedError("the GE converter of aten.sin is not written")

    first = torch.ones(2, 2).npu()          # set_dim_gears
    torchair.inference.set_dim_gears(first, dim_gears={0: [2, 4]})

    torchair.patch_for_hcom()               # patch_for_hcom, then compile as usual
    class AddNet(torch.nn.Module):
        def forward(self, x, y):
            return torch.add(x, y)
    backend = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
    added = torch.compile(AddNet().npu(), backend=backend)(torch.randn(2, 2).npu(),
                                                           torch.randn(2, 2).npu())
"""


def test_api_page_snippets(tmp_path, monkeypatch):
    env = run_script(tmp_path, monkeypatch, API_SNIPPETS)
    assert env["added"].shape == (2, 2)
    assert env["first"]._torchair_dim_gears == {0: (2, 4)}
