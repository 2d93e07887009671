"""torchair.dynamo_export: export a model's inference graph, fused, to files.

TorchAir captures the model with Dynamo, converts the graph to Ascend IR and writes
`{export_path}/{export_name}.air` (GE's binary model, for Ascend's ATC compiler) and
`{export_path}/dynamo.pbtxt` (the same graph, readable). opennpu has no GE, so it exports with
torch.export instead and writes, in the same places:

- `{export_path}/{export_name}.pt2`: the ExportedProgram after opennpu's passes, weights included;
  `torch.export.load(path).module()(*args)` runs it (on any machine with opennpu installed, as
  the fused ops are opennpu's);
- `{export_path}/dynamo.pbtxt`: the graph as protobuf text (opennpu.compile.graph_text), with
  each node's module path when ``config.export.experimental.enable_record_nn_module_stack``.

The passes are those of the backend's inference compile: the pre-autograd rules on the export
graph, then (after decomposition to the functional core ATen graph) the user's
post_grad_custom_pre_pass, the post-grad rules with `register_replacement` rules, and
post_grad_custom_post_pass; ``experimental_config.pattern_fusion_pass`` and ``disabled_patterns``
apply. In a process group of more than one rank, as in TorchAir, each rank writes
`{export_name}{rank}.pt2` and `rank_{rank}/dynamo.pbtxt`. ``dynamic=True`` exports every
dimension of every tensor input as dynamic (torch.export's Dim.AUTO: dimensions the graph
specialises stay static). ATC's json templates (``auto_atc_config_generated``) are not written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from .. import fusion, graph_text
from ..config import CompilerConfig
from .logger import logger


def _rank() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _dynamic_shapes(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Dim.AUTO for every dimension of every tensor, keyed by forward's parameter names."""
    import inspect

    auto = torch.export.Dim.AUTO

    def spec(x):
        return {d: auto for d in range(x.dim())} if isinstance(x, torch.Tensor) else None

    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {name: pytree.tree_map(spec, value) for name, value in bound.items()}


def _keep_output_names(ep: torch.export.ExportedProgram) -> None:
    """A rule that replaces an output's producer renames that output; the graph signature names
    outputs by node name, so it is brought back in line with the graph."""
    from torch.export.graph_signature import TensorArgument

    (output,) = ep.graph_module.graph.find_nodes(op="output")
    for spec, node in zip(ep.graph_signature.output_specs, output.args[0]):
        if isinstance(spec.arg, TensorArgument) and isinstance(node, torch.fx.Node):
            spec.arg.name = node.name


def _apply_passes(ep: torch.export.ExportedProgram, config: CompilerConfig) -> torch.export.ExportedProgram:
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    experimental = config.experimental_config
    # The exported program runs op by op, so the eager-only rules apply (run_eagerly=True).
    inactive = fusion.inactive_rules(experimental.disabled_patterns, True,
                                     experimental.enabled_patterns)
    if experimental.pattern_fusion_pass:
        gm = ep.graph_module
        # torch.export checks each dtype conversion's input with an _assert_tensor_metadata node
        # that uses the tensor; the rules' patterns (traced by make_fx) have none, and a tensor
        # with an extra user does not match. The checks held while exporting.
        for node in list(gm.graph.nodes):
            if node.target is torch.ops.aten._assert_tensor_metadata.default:
                gm.graph.erase_node(node)
        fusion.remove_noops(gm)
        counts = fusion.apply_rules("pre_autograd", gm, inactive, training=False)
        _keep_output_names(ep)
        if counts:
            logger.debug("dynamo_export: pre-autograd rules fused %s", dict(counts))
    ep = ep.run_decompositions()
    gm = ep.graph_module
    view_to_reshape(gm)
    inputs = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    if config.post_grad_custom_pre_pass is not None:
        config.post_grad_custom_pre_pass(gm, inputs, config)
    if experimental.pattern_fusion_pass:
        counts = fusion.apply_rules("post_grad", gm, inactive)
        if counts:
            logger.debug("dynamo_export: post-grad rules fused %s", dict(counts))
    if config.post_grad_custom_post_pass is not None:
        config.post_grad_custom_post_pass(gm, inputs, config)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    _keep_output_names(ep)
    return ep


def dynamo_export(*args, model: torch.nn.Module, export_path: str = "export_file",
                  export_name: str = "export", dynamic: bool = False,
                  config: CompilerConfig | None = None, **kwargs) -> torch.export.ExportedProgram:
    """Export `model` called on the example inputs `*args, **kwargs` (see the module docstring).

    Returns the ExportedProgram it wrote (TorchAir returns None). Raises instead of TorchAir's
    logged refusal when export_path or the target file is a symbolic link."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"dynamo_export: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if not isinstance(export_path, (str, os.PathLike)) or not isinstance(export_name, str):
        raise TypeError(f"dynamo_export: export_path and export_name must be str, got "
                        f"{type(export_path).__name__} and {type(export_name).__name__}")
    if not isinstance(dynamic, bool):
        raise TypeError(f"dynamo_export: dynamic must be bool, got {type(dynamic).__name__}")
    if config is None:
        config = CompilerConfig()
    if not isinstance(config, CompilerConfig):
        raise TypeError(f"dynamo_export: config must be a CompilerConfig, got "
                        f"{type(config).__name__}")
    config = config.copy()  # the export options below are this call's own
    export_name = os.path.basename(export_name)  # TorchAir keeps only the last path component
    rank, world = _rank()
    folder = Path(export_path)
    if world > 1:
        target, pbtxt = folder / f"{export_name}{rank}.pt2", folder / f"rank_{rank}" / "dynamo.pbtxt"
    else:
        target, pbtxt = folder / f"{export_name}.pt2", folder / "dynamo.pbtxt"
    for path in (folder, target):
        if path.is_symlink():
            raise ValueError(f"dynamo_export: {path.absolute()} is a symbolic link; export_path "
                             f"and the exported file must be real paths")
    config.export.export_mode = True
    config.export.export_path_dir = str(folder)
    config.export.export_name = export_name
    config.export.weight_name = {id(p): name for name, p in
                                 [*model.named_buffers(), *model.named_parameters()]}
    logger.info("dynamo_export: export_path: %s, export_name: %s, dynamic: %s",
                export_path, export_name, dynamic)

    with torch.no_grad():
        ep = torch.export.export(model, args, kwargs or None,
                                 dynamic_shapes=_dynamic_shapes(model, args, kwargs) if dynamic else None,
                                 strict=False)
        ep = _apply_passes(ep, config)
    pbtxt.parent.mkdir(parents=True, exist_ok=True)
    pbtxt.write_text(graph_text.render(
        ep.graph_module, "pbtxt", name=export_name,
        module_stack=config.export.experimental.enable_record_nn_module_stack))
    torch.export.save(ep, target)
    logger.info("dynamo_export: wrote %s and %s", target, pbtxt)
    return ep
