"""Text renderings of an FX graph: the formats of graph_dump.type and of dynamo_export's dump.

- "py": readable FX code with shapes (GraphModule.print_readable);
- "txt": the FX graph IR (str(gm.graph));
- "pbtxt": the graph as protobuf text in the layout of TorchAir's dynamo.pbtxt (a `name`, then one
  `op { name type input attr }` block per node), with FX's targets as op types. It is written
  by a plain text renderer, so it needs no protobuf schema; Netron and the like read GE's GraphDef,
  not this, but a reader of dynamo.pbtxt finds the same fields in the same places.
"""

from __future__ import annotations

import torch

KINDS = ("py", "txt", "pbtxt")


def render(gm: torch.fx.GraphModule, kind: str, *, name: str = "graph",
           module_stack: bool = False) -> str:
    if kind == "py":
        return gm.print_readable(print_output=False, include_stride=False, include_device=False)
    if kind == "txt":
        return str(gm.graph)
    if kind == "pbtxt":
        return _pbtxt(gm, name, module_stack)
    raise ValueError(f"graph rendering: kind must be one of {list(KINDS)}, got {kind!r}")


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _op_type(node: torch.fx.Node) -> str:
    if node.op == "placeholder":
        return "Data"
    if node.op == "output":
        return "NetOutput"
    if node.op == "get_attr":
        return "Const"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return getattr(target, "__qualname__", None) or str(target)


def _meta(node: torch.fx.Node) -> str | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return f"Tensor(dtype={val.dtype}, shape={list(val.shape)})"
    if isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val):
        return "(" + ", ".join(f"Tensor(dtype={v.dtype}, shape={list(v.shape)})" for v in val) + ")"
    return None if val is None else repr(val)


def _has_node(arg) -> bool:
    found = []
    torch.fx.node.map_arg(arg, found.append)
    return bool(found)


def _attr(lines: list[str], key: str, value: str) -> None:
    lines += ["  attr {", f"    key: {_quote(key)}", f"    value {{ s: {_quote(value)} }}", "  }"]


def _pbtxt(gm: torch.fx.GraphModule, name: str, module_stack: bool) -> str:
    lines = [f"name: {_quote(name)}"]
    for node in gm.graph.nodes:
        lines += ["op {", f"  name: {_quote(node.name)}", f"  type: {_quote(_op_type(node))}"]
        for arg in node.all_input_nodes:
            lines.append(f"  input: {_quote(arg.name)}")
        constants = [repr(a) for a in node.args if not _has_node(a)]
        if constants:
            _attr(lines, "_constant_args", ", ".join(constants))
        if node.kwargs:
            _attr(lines, "_kwargs", ", ".join(
                f"{k}={v.name if isinstance(v, torch.fx.Node) else repr(v)}"
                for k, v in node.kwargs.items()))
        meta = _meta(node)
        if meta is not None:
            _attr(lines, "_meta", meta)
        stack = node.meta.get("nn_module_stack")
        if module_stack and stack:
            _attr(lines, "nn_module_stack", " -> ".join(path for path, _ in stack.values() if path))
        lines.append("}")
    return "\n".join(lines) + "\n"
