"""Hugging Face accelerate detects the npu device and trains on it, in one process and in two
(torch.distributed.run on loopback, the hccl backend), with the losses of a CPU run."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).with_name("_accelerate_script.py")


def _run(*command: str, timeout: float = 180.0) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_RT_VISIBLE_DEVICES"}
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    # one flat JSON object per process; two ranks' lines may interleave on the shared stdout
    return [json.loads(obj) for obj in re.findall(r"\{[^{}]*\}", result.stdout)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_accelerate_trains_on_npu_with_the_losses_of_cpu():
    (npu,) = _run(str(SCRIPT), "npu")
    (cpu,) = _run(str(SCRIPT), "cpu")
    assert npu["npu_available"]
    assert npu["device"] == "npu" and npu["param_device"] == "npu:0" and npu["batch_device"] == "npu:0"
    assert cpu["device"] == "cpu"
    assert npu["losses"] == cpu["losses"]  # the same CPU kernels on the same bytes: bit for bit


def test_accelerate_multi_npu_uses_hccl():
    ranks = _run("-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                 "127.0.0.1", "--master_port", str(_free_port()), str(SCRIPT), "npu")
    assert len(ranks) == 2
    assert sorted(r["device"] for r in ranks) == ["npu:0", "npu:1"]
    for r in ranks:
        assert r["distributed_type"] == "DistributedType.MULTI_NPU" and r["backend"] == "hccl"
        assert r["replicas"] == 2 and r["replicas_equal"]  # DDP kept the replicas in step
