"""What the post_grad passes did to each graph, kept beside Inductor's caches.

AOTAutograd's cache and Inductor's FX graph cache serve a whole compiled graph without running the
passes, so on a warm cache the fusion counters, the graph dumps and the log of what fused would go
silent. Each compile therefore writes, for every graph phase the passes ran on, the counts and the
graph after fusion (as text, in every dump format) into `{inductor cache dir}/opennpu_passes/{key}.json`.
A compile the caches serve replays that record; a compile served without one (its record deleted,
or written by a build that did not keep records) compiles again with the two caches off.

The key covers what decides the passes' output: the graph handed to AOTAutograd (its code and the
metadata of its inputs and constants), grad mode, and the pass uuid (opennpu's rule and op
sources, the compiler options, the user's rules, torch's version). Two compiles with one key run
the same deterministic passes on the same graphs, so replaying is exact.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import torch

FORWARD_PHASES = ("forward", "inference")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return (f"T{tuple(x.shape)}{tuple(x.stride())}{x.dtype}{x.device.type}"
                f"{x.requires_grad}{isinstance(x, torch.nn.Parameter)}")
    if isinstance(x, (int, float, bool, str, torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"{type(x).__name__}:{x}"
    return type(x).__name__


def graph_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], pass_uuid: str) -> str:
    digest = hashlib.sha256()
    digest.update(f"{pass_uuid}|grad={torch.is_grad_enabled()}|".encode())
    digest.update(gm.code.encode())
    for x in example_inputs:
        digest.update(_describe(x).encode())
    for node in gm.graph.find_nodes(op="get_attr"):
        digest.update(f"{node.target}:{_describe(getattr(gm, str(node.target), None))}".encode())
    return digest.hexdigest()


class PassRecord:
    """The record of one compile: phase -> {"counts": {rule: n}, and one text per dump format}."""

    def __init__(self, key: str):
        self.key = key
        self.phases: dict[str, dict[str, Any]] = {}

    @property
    def path(self) -> Path:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return Path(cache_dir()) / "opennpu_passes" / f"{self.key}.json"

    def add(self, phase: str, counts: Counter, gm: torch.fx.GraphModule) -> None:
        """Keep what the passes did to `phase`'s graph, and write the record (atomically: two
        processes compiling one graph write the same content)."""
        from .graph_text import KINDS, render

        self.phases[phase] = {"counts": dict(counts), **{kind: render(gm, kind) for kind in KINDS}}
        path = self.path
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_suffix(f".{id(self)}.tmp")
        scratch.write_text(json.dumps(self.phases))
        scratch.replace(path)

    def saw_forward(self) -> bool:
        return any(phase in self.phases for phase in FORWARD_PHASES)

    def load(self) -> dict[str, dict[str, Any]] | None:
        """The phases recorded under this key by an earlier compile, or None."""
        try:
            phases = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(phases, dict) or not any(p in phases for p in FORWARD_PHASES):
            return None
        return phases
