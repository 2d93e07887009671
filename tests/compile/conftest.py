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
