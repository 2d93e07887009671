"""Test-wide fixtures: a fixed RNG seed per test and a known strict-mode state.

Thread count is left alone on purpose: the kernels' at::parallel_for paths are part of what the
tests exercise.
"""

from __future__ import annotations

import pytest
import torch

import opennpu

ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@pytest.fixture(autouse=True)
def _seed_torch():
    """Every test starts from the same torch RNG state, whatever ran before it on the worker."""
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _strict_off():
    """Tests run with strict mode off (even under OPENNPU_STRICT=1); strict tests opt in."""
    with opennpu.strict(False):
        yield


@pytest.fixture(params=ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def dtype(request) -> torch.dtype:
    """fp32, fp16, bf16 and fp64."""
    return request.param


@pytest.fixture
def stream_threshold():
    """torch.ops.opennpu._set_stream_min_bytes (the output size from which kernels write with
    streaming stores; < 0: the default, the last-level cache), the default restored after."""
    set_threshold = torch.ops.opennpu._set_stream_min_bytes
    set_threshold(-1)
    yield set_threshold
    set_threshold(-1)
