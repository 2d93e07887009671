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
