"""A float32 linear's aten.mm / aten.addmm on CPU or npu -> opennpu::_linear (oneDNN's product).

In post-grad graphs F.linear(x, w, b) is ``mm(x2d, permute(w, [1, 0]))`` (``addmm(b, ...)`` with a
bias), between views for inputs of more than two dims. ATen runs that float32 product on MKL's
sgemm; opennpu::_linear runs oneDNN's inner product on the untransposed weight when the call has
64 rows and 512 outputs or more, where it measured faster (csrc/ops/linear/linear.cpp has the numbers and the
row threshold), and aten::linear otherwise, so a graph with dynamic row counts stays right for
every size. Numerics: both are float32 products with float32 accumulation, but oneDNN's
summation order measured 1.6-2.1x MKL's mean error, which is why the rule is opt-in
(experimental_config.enabled_patterns).

Matched: the weight is a 2-D contiguous float32 tensor transposed by the permute (a parameter, a
buffer or any intermediate), the bias absent or a 1-D vector of out_features, addmm's beta and
alpha 1. Backward graphs' products (grad @ w, grad^T @ x) are left to aten.mm. A frozen graph's
linears (experimental_config.frozen_parameter) are packed for MKL by Inductor's freezing passes
before post-grad rules run, and are left as they are.
"""

from __future__ import annotations

import torch

from ..rule_registry import graph_rule
from ._util import has_kernels, known_contiguous

aten = torch.ops.aten


def _value(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_float32_on_host(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32
            and t.device.type in ("cpu", "npu"))


def _transposed_weight(node) -> torch.fx.Node | None:
    """w where `node` is permute(w, [1, 0]) of a 2-D contiguous float32 w, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        return None
    weight = node.args[0]
    w = _value(weight)
    return weight if _is_float32_on_host(w) and w.dim() == 2 and known_contiguous(w) else None


def _linear_operands(node: torch.fx.Node):
    """(input, weight, bias) of an mm / addmm that is a float32 linear, else None."""
    if node.target is aten.mm.default:
        bias, (mat1, mat2) = None, node.args[:2]
    else:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            return None
        bias, mat1, mat2 = node.args[:3]
    weight = _transposed_weight(mat2)
    x = _value(mat1)
    if weight is None or not _is_float32_on_host(x) or x.dim() != 2:
        return None
    if bias is not None:
        b = _value(bias)
        if not (_is_float32_on_host(b) and b.dim() == 1 and b.device == x.device
                and b.shape[0] == _value(weight).shape[0]):
            return None
    if _value(weight).device != x.device or not has_kernels(("opennpu::_linear",), x):
        return None
    return mat1, weight, bias


@graph_rule("linear_onednn", stage="post_grad", opt_in=True,
            doc="float32 aten.mm / addmm of a linear on CPU or npu -> opennpu::_linear "
                "(oneDNN's inner product from 64 rows and 512 outputs, aten::linear below)")
def _linear_onednn(gm: torch.fx.GraphModule) -> int:
    graph = gm.graph
    count = 0
    for target in (aten.mm.default, aten.addmm.default):
        for node in list(graph.find_nodes(op="call_function", target=target)):
            operands = _linear_operands(node)
            if operands is None:
                continue
            with graph.inserting_before(node):
                fused = graph.call_function(torch.ops.opennpu._linear.default, operands)
            fused.meta.update(node.meta)
            node.replace_all_uses_with(fused)
            transpose = node.args[-1]
            graph.erase_node(node)
            if not transpose.users:  # the weight's permute, unless backward still reads it
                graph.erase_node(transpose)
            count += 1
    return count
