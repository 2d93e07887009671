"""Real public CUDA training programs (scripts/public_programs.py) on CPU, under transfer_to_npu
and after the offline converter: the losses of the npu runs equal those of the CPU run.

Needs the fetched repositories, so it runs only when OPENNPU_PUBLIC_PROGRAMS names a folder that
holds them as `<owner>+<name>/repo` git directories (the layout of the `fetch` tool), e.g.
`OPENNPU_PUBLIC_PROGRAMS=/work/.mirror pytest tests/migrate/test_public_programs.py`; otherwise
the tests are skipped. About 40 s (nanoGPT) and 60 s (word_language_model) on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import opennpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "public_programs.py"
SRC = str(Path(opennpu.__file__).resolve().parent.parent)  # the opennpu this test imports
PROGRAMS = {  # id: (repository, commit); the commits recorded in docs/migration.md
    "nanogpt": ("karpathy+nanoGPT", "3adf61e154c3fe3fca428ad6bc3818b27a3b8291"),
    "word_language_model": ("pytorch+examples", "ac7e960b35f72f24f0b04c3826c9d9e228599b6b"),
}


@pytest.mark.parametrize("program", PROGRAMS)
def test_public_program_losses_match_cpu_in_every_mode(program):
    folder = os.environ.get("OPENNPU_PUBLIC_PROGRAMS")
    if not folder:
        pytest.skip("OPENNPU_PUBLIC_PROGRAMS is not set (a folder with the fetched repositories)")
    repo_name, commit = PROGRAMS[program]
    repo = Path(folder) / repo_name / "repo"
    if not repo.is_dir():
        pytest.skip(f"{repo} does not exist (fetch github:{repo_name.replace('+', '/')})")
    has_commit = subprocess.run(["git", "--git-dir", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"],
                                capture_output=True)
    if has_commit.returncode != 0:
        pytest.skip(f"{repo} lacks commit {commit[:12]}")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_TRANSFER_TO_NPU"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, str(SCRIPT), str(repo), "--program", program, "--ref", commit,
                           "--modes", "cpu,transfer,convert"], env=env, capture_output=True, text=True,
                          timeout=900)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "transfer vs cpu: losses match" in out, out
    assert "convert vs cpu: losses match" in out, out
