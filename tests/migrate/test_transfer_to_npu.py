"""`from torch_npu.contrib import transfer_to_npu`: CUDA code on the npu device.

The patches change torch for a whole process, so every check runs in a subprocess: the helper
scripts beside this file batch many checks per process and report them back; each is its own test
here. The subprocesses run together, started by one module fixture.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import opennpu

HERE = Path(__file__).parent
CHECKS = HERE / "transfer_checks.py"
SRC = str(Path(opennpu.__file__).resolve().parent.parent)  # the opennpu this test imports


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCH_TRANSFER_TO_NPU", "TORCH_NPU_MIGRATION_LOG", "OPENNPU_TRANSFER_JIT_SCRIPT")}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def _start(args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], env=_env(**env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=HERE)


class _Runs:
    """The subprocesses of this module, started together; `result(name)` waits for one."""

    def __init__(self, tmp: Path):
        self.log = tmp / "change_list.csv"
        env_check = ("import torch; from opennpu.migrate import transfer; "
                     "print('APPLIED', transfer.is_applied(), torch.cuda.is_available is torch.npu.is_available, "
                     "torch.randn(1, device='cuda').device.type)")
        self.procs = {
            "checks": _start([str(CHECKS)], TORCH_NPU_MIGRATION_LOG=str(self.log)),
            "training": _start([str(HERE / "cuda_training.py")]),
            "unpatch": _start([str(HERE / "unpatch_checks.py")]),
            "env_1": _start(["-c", env_check], TORCH_TRANSFER_TO_NPU="1"),
            "env_1_torch_npu": _start(["-c", "import torch_npu; " + env_check], TORCH_TRANSFER_TO_NPU="1",
                                      TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
            "env_0": _start(["-c", env_check.replace(", torch.randn(1, device='cuda').device.type", "")],
                            TORCH_TRANSFER_TO_NPU="0"),
            "env_bad": _start(["-c", "import torch"], TORCH_TRANSFER_TO_NPU="yes"),
        }
        self.done: dict[str, tuple[int, str, str]] = {}

    def result(self, name: str) -> tuple[int, str, str]:
        if name not in self.done:
            out, err = self.procs[name].communicate(timeout=300)
            self.done[name] = (self.procs[name].returncode, out, err)
        return self.done[name]

    def close(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = _Runs(tmp_path_factory.mktemp("transfer"))
    yield r
    r.close()


def _tagged(output: str, tag: str):
    for line in output.splitlines():
        if line.startswith(tag + " "):
            return line[len(tag) + 1:]
    return None


def _check_names() -> list[str]:
    spec = importlib.util.spec_from_file_location("transfer_checks", CHECKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines the checks; applies nothing
    return sorted(n for n in vars(module) if n.startswith("check_"))


@pytest.fixture(scope="module")
def check_results(runs) -> dict:
    code, out, err = runs.result("checks")
    results = _tagged(out, "RESULTS")
    assert code == 0 and results is not None, err[-3000:]
    return json.loads(results)


@pytest.mark.parametrize("name", _check_names())
def test_transfer_check(check_results, name):
    """The API groups: torch.cuda device/memory/streams/random, device arguments of factories,
    Tensor.to/new_*/cuda, modules, `with torch.device`, set_default_device, torch.load, DataLoader
    pinning, amp, backend flags, distributed (nccl -> hccl, DDP device_ids), compilers."""
    assert check_results.get(name) == "ok", check_results.get(name)


def _log_rows(runs) -> list[list[str]]:
    code, _, err = runs.result("checks")
    assert code == 0, err[-3000:]
    with open(runs.log, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def test_migration_log_columns_and_call_sites(runs):
    rows = _log_rows(runs)
    assert rows[0] == ["File", "Start Line", "End Line", "Operation Type", "Message"]
    body = rows[1:]
    assert body and all(len(r) == 5 and r[3] == "MODIFY" for r in body)
    # Every rewrite is attributed to the user's line, never to torch or opennpu internals.
    assert {r[0] for r in body} == {str(CHECKS)}
    source = CHECKS.read_text().splitlines()
    markers = [(i + 1, m.group(1).strip()) for i, line in enumerate(source)
               if (m := re.search(r"^\s+\S.*  # LOG: (.*)$", line))]
    assert len(markers) >= 8
    for line, text in markers:
        assert any(int(r[1]) == line and text in r[4] for r in body), (line, text)


def test_migration_log_once_per_call_site(runs):
    body = _log_rows(runs)[1:]
    source = CHECKS.read_text().splitlines()
    loop_line = next(i + 1 for i, s in enumerate(source) if "torch.zeros(1, device=\"cuda\")  # LOG" in s)
    assert sum(int(r[1]) == loop_line for r in body) == 1  # called three times, logged once
    keys = [(r[0], r[1], r[4]) for r in body]
    assert len(keys) == len(set(keys))
    # A call spanning lines is reported with its first and last line.
    end = next(i + 1 for i, s in enumerate(source) if "# END: torch.ones" in s)
    assert any(int(r[1]) == end - 3 and int(r[2]) == end and "'cuda:1' to 'npu:1'" in r[4] for r in body)


def test_cuda_training_program_matches_cpu_bit_for_bit(runs):
    code, out, err = runs.result("training")
    losses = _tagged(out, "LOSSES")
    assert code == 0 and losses is not None, err[-3000:]
    losses = json.loads(losses)
    assert len(losses["cpu_fp32"]) == 8
    assert losses["cuda_fp32"] == losses["cpu_fp32"]
    assert losses["cuda_bf16"] == losses["cpu_bf16"]
    assert losses["cpu_bf16"] != losses["cpu_fp32"]  # autocast really ran


def test_unpatch_restores_torch_and_the_log_is_off_by_default(runs):
    code, out, err = runs.result("unpatch")
    assert code == 0 and "UNPATCH ok" in out, err[-3000:]


@pytest.mark.parametrize("name", ["env_1", "env_1_torch_npu"])
def test_env_switch_applies_the_patches(runs, name):
    """TORCH_TRANSFER_TO_NPU=1 applies the patches when `import torch` autoloads opennpu, or at
    `import torch_npu` when autoload is off."""
    code, out, err = runs.result(name)
    assert code == 0, err[-3000:]
    assert _tagged(out, "APPLIED") == "True True npu"


def test_env_switch_off(runs):
    code, out, err = runs.result("env_0")
    assert code == 0, err[-3000:]
    assert _tagged(out, "APPLIED") == "False False"


def test_env_switch_bad_value(runs):
    code, _, err = runs.result("env_bad")
    assert code != 0
    assert "ValueError: Invalid value for TORCH_TRANSFER_TO_NPU: yes. Only '0' or '1' is supported." in err
