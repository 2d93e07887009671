"""Every compile test starts from a clean Dynamo cache (a new backend per test would otherwise
count as a recompile of the same frames and hit Dynamo's recompile limit)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _no_norm_rotary_speed_gate(monkeypatch):
    """The tests use a few tokens, below which inference graphs keep their norms and rotary
    embeddings native for speed; test_speed_gate in test_rules_norm and test_rules_rotary checks
    that gate, the other tests switch it off so a graph's structure alone decides what fuses."""
    from opennpu.compile.rules import _util

    monkeypatch.setattr(_util, "INFERENCE_MIN_TOKENS", 0)


@pytest.fixture(autouse=True)
def _whole_graph_caches_off():
    """Tests that look at backend.graphs need the passes to run in this process: AOTAutograd's and
    the FX graph cache are off (a warm cache would replay the record instead, without
    GraphModules). The generated kernels' cache stays on. The warm-cache tests turn them back on."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        yield
