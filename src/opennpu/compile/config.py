"""CompilerConfig: TorchAir's configuration object, with the options opennpu's backend honours.

The attribute paths are TorchAir's (`config.experimental_config.pattern_fusion_pass`,
`config.debug.graph_dump.type`, ...) so a script written for torchair configures opennpu unchanged.
Every assignment is validated: an unknown option or a bad value raises at once, naming the option,
what it accepts and what came, instead of being silently ignored at compile time.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

class _Option:
    """One leaf option: a default, and either a set of allowed values or a type check."""

    def __init__(self, default: Any, allowed: tuple | None = None, kind: type | tuple | None = None,
                 convert: Callable[[Any], Any] | None = None, doc: str = "",
                 noop: str | None = None, unsupported: str | None = None):
        """`noop`: why the option is accepted and has no effect here (GE-only knobs).
        `unsupported`: why any value other than the default raises NotImplementedError."""
        self.default, self.allowed, self.kind, self.convert, self.doc = (
            default, allowed, kind, convert, doc)
        self.noop, self.unsupported = noop, unsupported

    def check(self, path: str, value: Any) -> Any:
        if self.unsupported is not None and value != self.default:
            raise NotImplementedError(f"{path} = {value!r} is not available in opennpu: "
                                      f"{self.unsupported}; only the default {self.default!r} "
                                      f"is accepted")
        if self.allowed is not None and value not in self.allowed:
            raise ValueError(f"{path} must be one of {list(self.allowed)}, "
                             f"got {value!r}")
        if self.kind is not None and not isinstance(value, self.kind):
            names = (self.kind,) if isinstance(self.kind, type) else self.kind
            expected = " or ".join("None" if k is type(None) else k.__name__ for k in names)
            raise TypeError(f"{path} must be {expected}, "
                            f"got {type(value).__name__} ({value!r})")
        return self.convert(value) if self.convert else value


class _Group:
    """A node of the configuration tree; leaves are _Option, inner nodes are _Group subclasses."""

    _options: dict[str, _Option] = {}
    _groups: dict[str, type[_Group]] = {}

    def __init__(self, path: str):
        object.__setattr__(self, "_path", path)
        for name, option in self._options.items():
            object.__setattr__(self, name, copy.copy(option.default))
        for name, group in self._groups.items():
            object.__setattr__(self, name, group(f"{path}.{name}"))

    def __setattr__(self, name: str, value: Any) -> None:
        path = f"{self._path}.{name}"
        if name in self._groups:
            raise AttributeError(f"{path} is a group of options; set its fields "
                                 f"({', '.join(self._groups[name]._fields())}) instead")
        if name not in self._options:
            raise AttributeError(f"unknown option {path}; {self._path} has "
                                 f"{', '.join(self._fields())}")
        object.__setattr__(self, name, self._options[name].check(path, value))

    @classmethod
    def _fields(cls) -> list[str]:
        return [*cls._options, *cls._groups]

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self._options:
            value = getattr(self, name)
            out[name] = sorted(value) if isinstance(value, (set, frozenset)) else value
        for name in self._groups:
            out[name] = getattr(self, name).as_dict()
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.as_dict()})"


def _dump_path(value: str) -> str:
    return os.path.realpath(value)


def _rule_names(option: str):
    def convert(value) -> frozenset[str]:
        names = frozenset([value] if isinstance(value, str) else value)
        from .rules import rule_names  # the rule modules register their names on import

        unknown = sorted(names - set(rule_names()))
        if unknown:
            raise ValueError(f"CompilerConfig.experimental_config.{option} names unknown "
                             f"rules {unknown}; the rules are {sorted(rule_names())}")
        return names
    return convert


class _GraphDump(_Group):
    _options = {
        "type": _Option(None, allowed=(None, "py", "txt", "pbtxt"),
                        doc="write every graph after fusion: 'py' (readable FX code with "
                            "shapes), 'txt' (the FX graph IR) or 'pbtxt' (the FX graph as "
                            "protobuf text, one op block per node)"),
        "path": _Option(".", kind=str, convert=_dump_path, doc="folder for the dumps"),
    }


_GE = "it steers Ascend's graph engine (GE), which opennpu does not have"
_BOOL = (True, False)


def _ge_noop(default: Any, allowed: tuple | None = None, kind: type | tuple | None = None) -> _Option:
    return _Option(default, allowed=allowed, kind=kind, noop=_GE)


class _DataDump(_Group):
    _options = {
        "type": _Option(None, allowed=(None, "npy"),
                        unsupported="per-op tensor dumps in eager mode are not implemented"),
        "filter": _Option(None, kind=(type(None), Callable),
                          unsupported="per-op tensor dumps in eager mode are not implemented"),
    }


class _FxSummary(_Group):
    _options = {
        "type": _Option(None, allowed=(None, "csv"),
                        unsupported="the per-op converter support summary lists GE converters"),
        "skip_compile": _Option(True, allowed=_BOOL, noop=_GE),
    }


class _Debug(_Group):
    _options = {
        "run_eagerly": _Option(False, kind=bool,
                               doc="run the fused ATen graphs op by op instead of with Inductor"),
        "deadlock_check": _ge_noop(False, _BOOL),
    }
    _groups = {"graph_dump": _GraphDump, "data_dump": _DataDump, "fx_summary": _FxSummary}


class _ExportExperimental(_Group):
    _options = {
        "enable_record_nn_module_stack": _Option(
            False, allowed=_BOOL,
            doc="dynamo_export writes each node's nn_module_stack into dynamo.pbtxt"),
        "auto_atc_config_generated": _Option(
            False, allowed=_BOOL, noop="the ATC json templates configure Ascend's offline "
                                       "model compiler, which opennpu does not have"),
        "enable_lite_export": _ge_noop(False, _BOOL),
    }


class _Export(_Group):
    """Set by dynamo_export itself (as TorchAir does); users set only `experimental`."""
    _options = {
        "export_mode": _Option(False, allowed=_BOOL),
        "export_path_dir": _Option("./", kind=str),
        "export_name": _Option(None, kind=(type(None), str)),
        "weight_name": _Option(None, kind=(type(None), dict)),
        "inputs_name": _Option(None, kind=(type(None), dict, list)),
    }
    _groups = {"experimental": _ExportExperimental}


class _DumpConfig(_Group):
    """GE's per-op data dump in graph mode."""
    _options = {
        "enable_dump": _Option(False, allowed=_BOOL,
                               unsupported="GE's per-op data dump in graph mode is not implemented"),
        "dump_path": _ge_noop("./", kind=str),
        "dump_mode": _ge_noop("all", ("input", "output", "all")),
        "quant_dumpable": _ge_noop(False, _BOOL),
        "dump_step": _ge_noop("", kind=str),
        "dump_layer": _ge_noop("", kind=str),
        "dump_data": _ge_noop("tensor", ("tensor", "stats")),
        "dump_config_path": _ge_noop(None, kind=(type(None), str)),
        "data_dump_stage": _ge_noop("optimized", ("original", "optimized")),
    }


class _FusionConfig(_Group):
    _options = {
        "fusion_switch_file": _Option(
            None, kind=(type(None), str),
            noop="the file switches GE's fusion passes; opennpu's rules are switched with "
                 "experimental_config.disabled_patterns"),
    }


class _InferenceConfig(_Group):
    _options = {
        "dynamic_gears_merge_policy": _Option(
            "zip", allowed=("zip", "product"),
            noop="set_dim_gears compiles one symbolic graph covering every gear instead of "
                 "one GE graph per gear, so there are no gear combinations to merge"),
    }


class _GeConfig(_Group):
    _options = {
        "enable_single_stream": _ge_noop(False, _BOOL),
        "oo_level": _ge_noop("O3", ("O1", "O3")),
        "oo_constant_folding": _ge_noop(None, (None, True, False)),
        "oo_dead_code_elimination": _ge_noop(None, (None, True, False)),
        "export_compile_stat": _ge_noop("2", ("0", "1", "2")),
        "aicore_num": _ge_noop(None, kind=(type(None), str)),
        "optimization_switch": _ge_noop(None, kind=(type(None), str, dict)),
    }


class _AoeConfig(_Group):
    _options = {
        "aoe_mode": _Option(None, kind=(type(None), str),
                            unsupported="AOE tunes GE graphs and operators on Ascend"),
        "work_path": _ge_noop("./", kind=str),
        "aoe_config_file": _ge_noop(None, kind=(type(None), str)),
    }


class _Experimental(_Group):
    _options = {
        "pattern_fusion_pass": _Option(True, kind=bool,
                                       doc="replace op groups by fused ops (default and user rules)"),
        "disabled_patterns": _Option(frozenset(), kind=(set, frozenset, list, tuple, str),
                                     convert=_rule_names("disabled_patterns"),
                                     doc="names of fusion rules to leave out"),
        "enabled_patterns": _Option(frozenset(), kind=(set, frozenset, list, tuple, str),
                                    convert=_rule_names("enabled_patterns"),
                                    doc="names of opt-in fusion rules to apply (off by default)"),
        "keep_inference_input_mutations": _Option(True, kind=bool),
        "frozen_parameter": _Option(False, kind=bool,
                                    doc="inference graphs take the parameters as constants"),
        "remove_noop_ops": _Option(
            True, allowed=_BOOL,
            noop="opennpu always drops no-op casts and dropouts before its rules match (they are "
                 "traced the same way), and Inductor removes the other no-ops"),
        "cc_parallel_enable": _ge_noop(False, _BOOL),
        "memory_efficiency": _ge_noop(False, _BOOL),
        "static_model_ops_lower_limit": _ge_noop(None, kind=(type(None), int)),
        "jit_compile": _ge_noop("auto", ("auto",)),
        "npu_fx_pass": _ge_noop(False, _BOOL),
        "aot_config_enable_joint_graph": _ge_noop(False, _BOOL),
        "aot_config_output_loss_index": _ge_noop(0, kind=int),
        "topology_sorting_strategy": _ge_noop("DFS", ("BFS", "DFS", "RDFS", "StableRDFS")),
        "enable_ref_data": _ge_noop(False, _BOOL),
        "enable_view_optimize": _ge_noop(True, _BOOL),
        "tiling_schedule_optimize": _ge_noop(False, _BOOL),
    }


_Pass = _Option(None, kind=(type(None), Callable),
                doc="fn(gm, example_inputs, config) run on every ATen graph")


class CompilerConfig(_Group):
    """Options of opennpu's torch.compile backend (TorchAir's names).

    - ``mode``: "max-autotune" (default) compiles the fused graphs with Inductor;
      "reduce-overhead" (and "npugraph_ex", TorchAir's newer name for its captured-graph mode) does
      the same and lets Inductor capture CUDA graphs on a GPU.
    - ``experimental_config.pattern_fusion_pass`` (True): the fusion rules; user rules from
      `register_replacement` share this switch, as in TorchAir.
    - ``experimental_config.disabled_patterns``: rule names to leave out (`opennpu.compile.rule_names()`).
    - ``experimental_config.enabled_patterns``: opt-in rules to apply, off by default because they
      trade something: "linear_onednn" runs float32 linears on CPU / npu through oneDNN, faster
      than MKL on some CPUs but with a larger rounding error (docs/graph_mode.md).
    - ``experimental_config.frozen_parameter`` (False): graphs compiled with grad mode off take the
      model's parameters as constants (Inductor's freezing: weights pre-packed for oneDNN / MKL,
      constant subgraphs folded). The values at compile time are kept: after changing weights,
      call torch._dynamo.reset() and compile again. Guarded on each parameter's identity, so
      another module's parameters recompile. Buffers stay inputs; training and run_eagerly are
      unaffected.
    - ``debug.graph_dump.type`` ('py' or 'txt') and ``.path``: dump each graph after fusion.
    - ``debug.run_eagerly``: skip Inductor and run the fused graphs eagerly.
    - ``post_grad_custom_pre_pass`` / ``post_grad_custom_post_pass``: user passes
      ``fn(gm, example_inputs, config)`` run on each ATen graph before / after the fusion rules.
    - ``export.*``: set by `dynamo_export`; ``export.experimental.enable_record_nn_module_stack``
      puts each node's module path into the exported dynamo.pbtxt.

    TorchAir's other options are accepted with its names and values; those that steer Ascend's
    graph engine (``ge_config.*``, ``fusion_config.*``, most of ``experimental_config``) have no
    effect here, and those whose feature opennpu lacks (``dump_config.enable_dump``,
    ``debug.data_dump.type``, ``aoe_config.aoe_mode``, ...) raise NotImplementedError when set to
    anything but their default. `noop_options()` lists the former with the reason.
    """

    _options = {
        "mode": _Option("max-autotune", allowed=("max-autotune", "reduce-overhead", "npugraph_ex")),
        "post_grad_custom_pre_pass": _Pass,
        "post_grad_custom_post_pass": _Pass,
    }
    _groups = {"debug": _Debug, "experimental_config": _Experimental, "export": _Export,
               "dump_config": _DumpConfig, "fusion_config": _FusionConfig,
               "inference_config": _InferenceConfig, "ge_config": _GeConfig,
               "aoe_config": _AoeConfig}

    def __init__(self):
        super().__init__("CompilerConfig")

    @classmethod
    def noop_options(cls) -> dict[str, str]:
        """Every accepted option that has no effect in opennpu: its path and why."""
        out: dict[str, str] = {}

        def walk(group: type[_Group], path: str) -> None:
            for name, option in group._options.items():
                if option.noop is not None:
                    out[f"{path}.{name}"] = option.noop
            for name, sub in group._groups.items():
                walk(sub, f"{path}.{name}")

        walk(cls, "CompilerConfig")
        return out

    def copy(self) -> CompilerConfig:
        return copy.deepcopy(self)

    # torch.compile(backend=..., options={...}) keys, as npugraph_ex names them.
    _OPTION_PATHS = {
        "mode": "mode",
        "pattern_fusion_pass": "experimental_config.pattern_fusion_pass",
        "disabled_patterns": "experimental_config.disabled_patterns",
        "enabled_patterns": "experimental_config.enabled_patterns",
        "frozen_parameter": "experimental_config.frozen_parameter",
        "force_eager": "debug.run_eagerly",
        "run_eagerly": "debug.run_eagerly",
        "graph_dump_type": "debug.graph_dump.type",
        "graph_dump_path": "debug.graph_dump.path",
        "post_grad_custom_pre_pass": "post_grad_custom_pre_pass",
        "post_grad_custom_post_pass": "post_grad_custom_post_pass",
    }

    def with_options(self, options: dict[str, Any] | None) -> CompilerConfig:
        """A copy with torch.compile's flat `options` applied; unknown keys raise."""
        if not options:
            return self
        out = self.copy()
        for key, value in options.items():
            if key not in self._OPTION_PATHS:
                raise ValueError(f"opennpu backend: unknown option {key!r}; the options are "
                                 f"{sorted(self._OPTION_PATHS)}")
            *groups, leaf = self._OPTION_PATHS[key].split(".")
            node = out
            for group in groups:
                node = getattr(node, group)
            setattr(node, leaf, value)
        return out

    def fingerprint(self) -> str:
        """What the fusion result depends on, for the FX graph cache key (user passes by name)."""
        d = self.as_dict()
        for key in ("post_grad_custom_pre_pass", "post_grad_custom_post_pass"):
            fn = d[key]
            d[key] = None if fn is None else f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"
        d["debug"] = {}  # dumps and eager mode do not change the compiled graph
        return repr(d)
