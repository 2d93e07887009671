"""Compiling a module with opennpu's backend and reading what the fusion rules did.

`compile_with_rules` compiles twice, with pattern_fusion_pass off and on, so every rule test can
check both sides: the native ops are in the graph before and gone after, the fused op appears the
expected number of times, and the outputs (and gradients) match eager.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from opennpu.compile import CompilerConfig, get_npu_backend, node_targets


@dataclasses.dataclass
class Compiled:
    outputs: object
    fusions: Counter           # replacements per rule
    ops: Counter               # call_function targets over the graphs after fusion
    backend: object


def run_compiled(module, *args, fusion: bool = True, eager: bool = True, dynamic: bool = False,
                 disabled=(), backward: bool = False, enabled=()) -> Compiled:
    config = CompilerConfig()
    config.experimental_config.pattern_fusion_pass = fusion
    config.experimental_config.disabled_patterns = list(disabled)
    config.experimental_config.enabled_patterns = list(enabled)
    config.debug.run_eagerly = eager
    backend = get_npu_backend(compiler_config=config)
    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, dynamic=dynamic, fullgraph=True)
    out = compiled(*args)
    if backward:
        first = out[0] if isinstance(out, (tuple, list)) else out
        first.float().square().sum().backward()
    ops: Counter = Counter()
    for phase, gm in backend.graphs:
        # The pre_autograd graph is an intermediate; the post_grad graphs are what runs.
        if phase != "pre_autograd":
            ops.update(node_targets(gm))
    return Compiled(out, backend.fusions, ops, backend)


def count(ops: Counter, name: str) -> int:
    """How many nodes call an op whose qualified name contains `name` (e.g. 'npu_rms_norm.')."""
    return sum(n for target, n in ops.items() if name in target)


def grads(*tensors):
    out = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out
