"""examples/migrate/cuda_train.py, a CUDA training script, trains on npu with the losses of its
CPU run (`--device cpu`), bit for bit (8 printed decimals): unchanged under transfer_to_npu
(TORCH_TRANSFER_TO_NPU=1), and after the offline converter (`opennpu.migrate`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import opennpu
from opennpu.migrate.convert import cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "migrate"
SRC = str(Path(opennpu.__file__).resolve().parent.parent)  # the opennpu this test imports


def _start(script: Path, *args: str, **extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_TRANSFER_TO_NPU",)}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")  # three processes at once on a small machine
    env.update(extra)
    return subprocess.Popen([sys.executable, script.name, *args], cwd=script.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> tuple[list[str], str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    losses = re.findall(r"^step +\d+ loss (\S+)$", out, re.M)
    device = re.search(r"^trained on (\S+) in", out, re.M).group(1)
    return losses, device


def test_cuda_train_example_on_npu_matches_cpu(tmp_path, capsys):
    assert cli.main(["-i", str(EXAMPLE), "-o", str(tmp_path)]) == 0
    converted = tmp_path / "migrate_msft" / "cuda_train.py"
    assert "torch.cuda" not in converted.read_text().split('"""', 2)[2]  # the code, not the docstring
    runs = {"cpu": _start(EXAMPLE / "cuda_train.py", "--device", "cpu"),
            "transfer": _start(EXAMPLE / "cuda_train.py", TORCH_TRANSFER_TO_NPU="1"),
            "convert": _start(converted)}
    results = {mode: _result(proc) for mode, proc in runs.items()}
    cpu_losses, cpu_device = results["cpu"]
    assert cpu_device == "cpu" and len(cpu_losses) == 12
    assert float(cpu_losses[-1]) < float(cpu_losses[0])  # it learns
    for mode in ("transfer", "convert"):
        assert results[mode] == (cpu_losses, "npu:0"), mode
