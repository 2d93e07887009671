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
