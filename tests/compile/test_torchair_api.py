"""TorchAir's public surface (torchair.__all__ and its submodules) as opennpu provides it."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

import torchair
from opennpu.compile import torchair_api

npu = torch.ops.npu


def test_all_names_match_torchair():
    assert torchair.__all__ == ["get_compiler", "get_npu_backend", "dynamo_export",
                                "CompilerConfig", "use_internal_format_weight", "logger",
                                "register_fx_node_ge_converter", "patch_for_hcom",
                                "register_replacement", "npu_format_cast_via_cpu"]
    for name in torchair.__all__:
        assert getattr(torchair, name) is getattr(torchair_api, name)
    for sub in ("inference", "ops", "scope", "ge", "llm_datadist"):
        assert hasattr(torchair, sub)
    from torchair.configs.compiler_config import CompilerConfig
    from torchair.core.utils import EVENT_LEVEL, logger

    assert CompilerConfig is torchair.CompilerConfig and logger is torchair.logger
    assert EVENT_LEVEL == 35


# --- CompilerConfig ------------------------------------------------------------------------------

def test_config_modes_and_torchair_option_groups():
    config = torchair.CompilerConfig()
    for mode in ("max-autotune", "reduce-overhead", "npugraph_ex"):
        config.mode = mode
    config.ge_config.oo_level = "O1"                       # GE-only: accepted, no effect
    config.experimental_config.topology_sorting_strategy = "BFS"
    config.fusion_config.fusion_switch_file = "switch.cfg"
    config.inference_config.dynamic_gears_merge_policy = "product"
    config.export.experimental.auto_atc_config_generated = True
    config.debug.graph_dump.type = "pbtxt"
    noops = torchair.CompilerConfig.noop_options()
    assert "CompilerConfig.ge_config.oo_level" in noops
    assert "CompilerConfig.fusion_config.fusion_switch_file" in noops
    assert "CompilerConfig.experimental_config.pattern_fusion_pass" not in noops
    with pytest.raises(ValueError, match=r"CompilerConfig.ge_config.oo_level must be one of"):
        config.ge_config.oo_level = "O2"


@pytest.mark.parametrize("assign, text", [
    (lambda c: setattr(c.dump_config, "enable_dump", True),
     "CompilerConfig.dump_config.enable_dump = True is not available in opennpu"),
    (lambda c: setattr(c.debug.data_dump, "type", "npy"),
     "CompilerConfig.debug.data_dump.type = 'npy' is not available"),
    (lambda c: setattr(c.aoe_config, "aoe_mode", "2"), "CompilerConfig.aoe_config.aoe_mode"),
])
def test_config_features_opennpu_lacks_raise(assign, text):
    config = torchair.CompilerConfig()
    with pytest.raises(NotImplementedError, match=text.replace(".", r"\.").replace("(", r"\(")):
        assign(config)


# --- get_compiler ----------------------------------------------------------------------------------

def _rms_model_and_inputs(device="cpu"):
    class AddNorm(nn.Module):
        def forward(self, x1, x2, gamma):
            y, _, x = npu.npu_add_rms_norm(x1, x2, gamma)
            return x, y.to(torch.float32)

    args = (torch.randn(2, 8, dtype=torch.float16, device=device),
            torch.randn(2, 8, dtype=torch.float16, device=device),
            torch.rand(8, dtype=torch.float16, device=device))
    return AddNorm(), args


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_get_compiler_runs_the_post_grad_rules_in_a_custom_backend(device):
    from torch._functorch.aot_autograd import aot_module_simplified

    compiler = torchair.get_compiler(torchair.CompilerConfig())
    seen = []

    def custom_backend(gm, example_inputs):
        from torch._inductor.decomposition import select_decomp_table

        seen.append(gm)
        # the rule matches the decomposed cast (prims.convert_element_type), as Inductor has it
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler,
                                     decompositions=select_decomp_table())

    model, args = _rms_model_and_inputs(device)
    with torch.no_grad():
        got = torch.compile(model, backend=custom_backend)(*args)
        want = model(*args)
    assert len(seen) == 1
    assert compiler.fusions["torchair_add_rms_norm_cast"] == 1
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


def test_get_compiler_rejects_a_non_config():
    with pytest.raises(TypeError, match="get_compiler: compiler_config must be a CompilerConfig, "
                                        "got dict"):
        torchair.get_compiler({})


# --- dynamo_export ---------------------------------------------------------------------------------

class _Linear2(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, y):
        return self.linear1(x) + self.linear2(y)


def test_dynamo_export_writes_the_fused_program_where_torchair_writes(tmp_path):
    from test_rules_norm import HFRMSNorm

    model, x = HFRMSNorm(16), torch.randn(2, 3, 16)
    ep = torchair.dynamo_export(x, model=model, export_path=str(tmp_path / "out"),
                                export_name="sub/rms")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["dynamo.pbtxt", "rms.pt2"]
    text = (tmp_path / "out" / "dynamo.pbtxt").read_text()
    assert 'type: "npu.npu_rms_norm.default"' in text and 'type: "aten.rsqrt' not in text
    loaded = torch.export.load(tmp_path / "out" / "rms.pt2")
    assert "npu.npu_rms_norm.default" in {str(n.target) for n in loaded.graph.nodes}
    torch.testing.assert_close(loaded.module()(x), ep.module()(x))
    torch.testing.assert_close(loaded.module()(x), model(x), atol=1e-5, rtol=1e-5)


def test_dynamo_export_without_fusion_keeps_the_native_ops(tmp_path):
    from test_rules_norm import HFRMSNorm

    config = torchair.CompilerConfig()
    config.experimental_config.pattern_fusion_pass = False
    torchair.dynamo_export(torch.randn(2, 3, 16), model=HFRMSNorm(16),
                           export_path=str(tmp_path), config=config)
    text = (tmp_path / "dynamo.pbtxt").read_text()
    assert "npu.npu_rms_norm" not in text and 'type: "aten.rsqrt.default"' in text


def test_dynamo_export_dynamic_and_module_stack(tmp_path):
    config = torchair.CompilerConfig()
    config.export.experimental.enable_record_nn_module_stack = True
    model = _Linear2()
    torchair.dynamo_export(torch.randn(3, 4), torch.randn(3, 4), model=model,
                           export_path=str(tmp_path), dynamic=True, config=config)
    assert config.export.export_mode is False  # the caller's config is left as it was
    loaded = torch.export.load(tmp_path / "export.pt2").module()
    x, y = torch.randn(7, 4), torch.randn(7, 4)
    torch.testing.assert_close(loaded(x, y), model(x, y))
    assert 'value { s: "linear2" }' in (tmp_path / "dynamo.pbtxt").read_text()


def test_dynamo_export_refuses_symlinks_and_bad_arguments(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ValueError, match="is a symbolic link"):
        torchair.dynamo_export(torch.randn(2, 4), torch.randn(2, 4), model=_Linear2(),
                               export_path=str(tmp_path / "link"))
    with pytest.raises(TypeError, match="dynamo_export: model must be a torch.nn.Module, got "
                                        "function"):
        torchair.dynamo_export(torch.randn(2), model=lambda x: x)


# --- logger ----------------------------------------------------------------------------------------

def test_logger_is_the_compile_logger_in_torchair_format(capsys):
    logger = torchair.logger
    assert logger is logging.getLogger("opennpu.compile")
    old = logger.level
    try:
        logger.setLevel(logging.DEBUG)
        torch.compile(lambda x: x * 2, backend=torchair.get_npu_backend(
            compiler_config=_eager()))(torch.ones(2))
        logger.event("an event")
    finally:
        logger.setLevel(old)
    out = capsys.readouterr().out
    assert "as Dynamo captured it" in out and "[DEBUG] TORCHAIR(" in out
    assert "[EVENT] TORCHAIR(" in out and "an event" in out


def _eager():
    config = torchair.CompilerConfig()
    config.debug.run_eagerly = True
    return config


# --- no-ops and errors -------------------------------------------------------------------------------

def test_use_internal_format_weight_and_format_cast_via_cpu_are_accepted_noops():
    model = _Linear2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert torchair.use_internal_format_weight(model) is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    w = torch.randn(4, 4)
    assert torchair.npu_format_cast_via_cpu(w, 29) is w
    with pytest.raises(TypeError, match="use_internal_format_weight: model must be a "
                                        "torch.nn.Module, got Tensor"):
        torchair.use_internal_format_weight(w)
    with pytest.raises(ValueError, match="npu_format_cast_via_cpu: acl_format 5 is not an ACL "
                                         "format"):
        torchair.npu_format_cast_via_cpu(w, 5)


def test_register_fx_node_ge_converter_is_an_accepted_noop():
    from opennpu.compile.torchair_api.converters import ge_converters

    def converter(self, meta_outputs=None):
        raise AssertionError("a GE converter never runs in opennpu")

    assert torchair.register_fx_node_ge_converter(torch.ops.aten.sin.default)(converter) \
        is converter
    assert ge_converters[torch.ops.aten.sin.default] is converter
    got = torch.compile(torch.sin, backend=torchair.get_npu_backend(
        compiler_config=_eager()))(torch.ones(3))
    torch.testing.assert_close(got, torch.sin(torch.ones(3)))
    with pytest.raises(TypeError, match="aten_op must be an operator"):
        torchair.register_fx_node_ge_converter("aten::sin")


def test_ge_and_llm_datadist_raise_naming_the_api():
    from torchair.ge import DataType, Format, Tensor, TensorSpec

    assert DataType.DT_FLOAT16 == 1 and Format.FORMAT_ND == 2
    with pytest.raises(NotImplementedError, match=r"torchair\.ge\.Const"):
        torchair.ge.Const(1.0)
    with pytest.raises(NotImplementedError, match=r"torchair\.ge\.Tensor"):
        Tensor()
    with pytest.raises(NotImplementedError, match=r"torchair\.ge\.custom_op"):
        torchair.ge.custom_op("MyOp", inputs={}, outputs=[])
    assert TensorSpec.__name__ == "TensorSpec"
    with pytest.raises(NotImplementedError, match=r"torchair\.llm_datadist\.create_npu_tensors"):
        torchair.llm_datadist.create_npu_tensors([2], torch.float16, [0])


# --- scope and ops -----------------------------------------------------------------------------------

def test_scopes_are_noops_in_eager_and_compiled_code():
    from torchair import scope

    def fn(x):
        with scope.npu_stream_switch("s1", 3):
            y = x + 1
        with scope.super_kernel("sk"), scope.limit_core_num(8, 16), scope.op_never_timeout():
            z = scope.npu_wait_tensor(y * 2, x)
        with scope.data_dump():
            return z - 1

    x = torch.randn(4)
    compiled = torch.compile(fn, backend=torchair.get_npu_backend(compiler_config=_eager()),
                             fullgraph=True)
    torch.testing.assert_close(compiled(x), (x + 1) * 2 - 1)
    torch.testing.assert_close(fn(x), (x + 1) * 2 - 1)
    with pytest.raises(TypeError, match="npu_stream_switch: stream_tag must be str, got int"):
        scope.npu_stream_switch(1)
    with pytest.raises(TypeError, match="op_never_timeout: enable must be bool, got str"):
        scope.op_never_timeout("yes")


def test_npu_print_formats_like_torchair_and_does_not_break_the_graph(capsys):
    from torchair import ops

    ops.npu_print("y is", torch.arange(6.0) * 2, summarize_size=1, tensor_detail=True)
    assert capsys.readouterr().out == \
        "y is tensor([ 0.,  ..., 10.], shape=[6], dtype=torch.float32)\n"

    def fn(x):
        y = x * 2
        ops.npu_print("y is", y)
        return y + 1

    compiled = torch.compile(fn, backend=torchair.get_npu_backend(compiler_config=_eager()),
                             fullgraph=True)  # fullgraph: a graph break would raise
    out = compiled(torch.arange(6.0))
    torch.testing.assert_close(out, torch.arange(6.0) * 2 + 1)
    assert "y is" in capsys.readouterr().out
    with pytest.raises(TypeError, match="npu_print: at least one argument must be a Tensor"):
        ops.npu_print("text only")


def test_ops_record_wait_events_and_missing_kernels():
    from torchair import ops

    marker = ops.record()
    assert marker.numel() == 0
    assert ops.wait([marker]) is None
    event = ops.npu_create_tagged_event("tag")
    assert ops.npu_create_tagged_event("tag") is event
    ops.npu_tagged_event_record(event)
    ops.npu_tagged_event_wait(event)
    assert ops.npu_record_tagged_stream(torch.ones(1), "default") is None
    with pytest.raises(TypeError, match="wait: tensors must be a list of Tensors"):
        ops.wait(marker)
    with pytest.raises(NotImplementedError, match="torchair.ops.npu_fused_infer_attention_score"):
        ops.npu_fused_infer_attention_score(torch.ones(1))


# --- patch_for_hcom ----------------------------------------------------------------------------------

def test_patch_for_hcom_makes_broadcast_and_list_all_to_all_traceable(tmp_path):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    torchair.patch_for_hcom()
    torchair.patch_for_hcom()  # idempotent
    assert funcol.traceable_collective_remaps[dist.broadcast].__name__ == \
        "opennpu_broadcast_inplace"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm

        def fn(x, outs):
            dist.broadcast(x, src=0)
            dist.all_to_all(outs, [x[:2] + 1, x[2:] + 1][:1])
            dist.all_reduce(x)
            return x * 2

        x = torch.arange(2.0)
        outs = [torch.zeros(2)]
        got = torch.compile(fn, backend=backend, fullgraph=True)(x, outs)
        torch.testing.assert_close(got, torch.arange(2.0) * 2)
        torch.testing.assert_close(outs[0], torch.arange(2.0) + 1)
        targets = {str(n.target) for n in graphs[0].graph.nodes}
        assert any("broadcast" in t for t in targets) and any("all_to_all" in t for t in targets)
    finally:
        dist.destroy_process_group()


# --- inference -----------------------------------------------------------------------------------

class _Cached(nn.Module):
    def __init__(self, cache_dir):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.cached = torchair.inference.cache_compile(self.step, cache_dir=cache_dir)

    def step(self, x):
        return torch.relu(self.linear(x))

    def forward(self, x):
        return self.cached(x)


def test_cache_compile_saves_then_serves_the_compiled_graphs(tmp_path):
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    model = _Cached(str(tmp_path / "cache"))
    x = torch.randn(3, 4)
    with inductor_config.patch(fx_graph_cache=False):
        out = model(x)
    assert not out.requires_grad  # compiled and run under no_grad, as TorchAir does
    path = model.cached.path
    assert path.name == "compiled_module" and path.parent.name == "step"
    assert path.parent.parent.name.startswith("_Cached_dynamic_")
    assert not model.cached.loaded
    entry = json.loads(path.read_text())
    assert entry["artifacts"] and entry["pass_records"]

    torch._dynamo.reset()
    again = _Cached(str(tmp_path / "cache"))
    again.load_state_dict(model.state_dict())
    assert again.cached.path == path
    torch.testing.assert_close(again(x), out)
    assert again.cached.loaded
    text = torchair.inference.readable_cache(path, print_output=False, file=tmp_path / "r.py")
    assert "cache of _Cached.step" in text and "relu" in text
    assert (tmp_path / "r.py").read_text() == text
    assert functorch_config.enable_autograd_cache is False  # the test's setting is restored


def test_cache_compile_checks_its_arguments(tmp_path):
    model = _Linear2()
    with pytest.raises(TypeError, match=r"cache_compile: unexpected keyword arguments \['speed'\]"):
        torchair.inference.cache_compile(model.forward, speed=1)
    other = torchair.CompilerConfig()
    other.debug.run_eagerly = True
    with pytest.raises(ValueError, match="config differs from the config of backend"):
        torchair.inference.cache_compile(model.forward, config=other,
                                         backend=torchair.get_npu_backend())
    assert torchair.inference.cache_compile(model.forward, ge_cache=True).dynamic is True
    with pytest.raises(ValueError, match="readable_cache: .* is not a cache_compile cache file"):
        torchair.inference.readable_cache(tmp_path / "missing")


def test_set_dim_gears_marks_the_range_dynamic():
    from torch._dynamo.utils import counters

    x = torch.ones(2, 3)
    torchair.inference.set_dim_gears(x, dim_gears={0: [2, 4, 8]})
    torchair.inference.set_dim_gears(x, dim_gears={0: (8, 4, 2)})  # the same gears again
    counters.clear()
    fn = torch.compile(lambda t: t * 2, backend=torchair.get_npu_backend(
        compiler_config=_eager()), dynamic=True)
    for n in (2, 4, 8):
        fn(torch.ones(n, 3))
    assert counters["stats"]["unique_graphs"] == 1
    with pytest.raises(ValueError, match="a tensor's gears are set once"):
        torchair.inference.set_dim_gears(x, dim_gears={0: [2, 6]})
    with pytest.raises(ValueError, match="gears must be >= 2"):
        torchair.inference.set_dim_gears(torch.ones(2), dim_gears={0: [1, 2]})
    with pytest.raises(ValueError, match="dim 0 has size 3, which is not one of its gears"):
        torchair.inference.set_dim_gears(torch.ones(3), dim_gears={0: [2, 4]})
    with pytest.raises(ValueError, match="at most 100 are allowed"):
        torchair.inference.set_dim_gears(torch.ones(2, 2), dim_gears={
            0: list(range(2, 13)), 1: list(range(2, 13))})
