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
from ._util import arg, has_kernels, known_contiguous

aten = torch.ops.aten


def _is_float32_on_host(t) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32
            and t.device.type in ("cpu", "npu"))


def _linear_operands(node: torch.fx.Node):
    """(input, weight, bias) nodes of an mm / addmm that is a float32 linear, else None."""
    first = 0 if node.target is aten.mm.default else 1  # addmm(bias, mat1, mat2)
    if first and (node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1):
        return None
    mat1, transpose = node.args[first:first + 2]
    # mat2 must be permute(w, [1, 0]) of a 2-D contiguous float32 w
    if not (isinstance(transpose, torch.fx.Node) and transpose.op == "call_function"
            and transpose.target is aten.permute.default and list(transpose.args[1]) == [1, 0]):
        return None
    x, w, b = arg(node, first), arg(transpose, 0), arg(node, 0) if first else None
    if not (_is_float32_on_host(x) and x.dim() == 2 and _is_float32_on_host(w) and w.dim() == 2
            and known_contiguous(w) and w.device == x.device):
        return None
    if first and not (_is_float32_on_host(b) and b.dim() == 1 and b.device == x.device
                      and b.shape[0] == w.shape[0]):
        return None
    if not has_kernels(("opennpu::_linear",), x):
        return None
    return mat1, transpose.args[0], node.args[0] if first else None


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
