"""DeepSpeed (when installed: it is not a test dependency) picks the npu accelerator and trains
with ZeRO on two npu ranks over hccl (torch.distributed.run on loopback).

DeepSpeed's npu op builder reads ASCEND_HOME_PATH (CANN's install folder, which CANN's set_env.sh
exports on Ascend machines) as soon as an engine is built; any existing folder satisfies it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).with_name("_deepspeed_script.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_zero2_trains_on_two_npu_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_RT_VISIBLE_DEVICES"}
    env.setdefault("ASCEND_HOME_PATH", str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
         "127.0.0.1", "--master_port", str(_free_port()), str(SCRIPT), "2"],
        capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # one flat JSON object per rank; the ranks' lines may interleave on the shared stdout
    ranks = [json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", result.stdout)]
    assert len(ranks) == 2
    assert sorted(r["device"] for r in ranks) == ["npu:0", "npu:1"]
    assert all(r["accelerator"] == "npu" and r["backend"] == "hccl" for r in ranks)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # same data on both ranks: same losses
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
