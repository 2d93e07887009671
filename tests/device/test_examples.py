"""The runnable examples run, and check what they claim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_seed001_manual_migration_matches_cpu_bit_for_bit():
    result = subprocess.run([sys.executable, str(EXAMPLES / "seed001_manual_migration.py")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bit-identical to the CPU run: True" in result.stdout, result.stdout


def test_demo_npu_section_trains_identically_on_npu_and_cpu():
    from opennpu.demo import _seed001_training, npu_device_demo

    text = npu_device_demo(threads=1, steps=6)
    rows = {line[:26].strip(): line for line in text.splitlines()[2:]}
    assert set(rows) == {"fp32 cpu", "fp32 npu", "fp16 autocast + scaler cpu",
                         "fp16 autocast + scaler npu"}
    assert rows["fp32 npu"].endswith("bit-identical")
    losses, _ = _seed001_training("npu", use_amp=False, steps=8)
    assert losses[4] < losses[0]  # it learns: the same batch, one pass later
