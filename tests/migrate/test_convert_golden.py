"""Golden projects for the offline converter: golden/<project>/input is converted with the CLI and
the converted sources, run_distributed_npu.sh and the report CSVs of the result (not the log, which
has timestamps) must equal golden/<project>/expected<suffix>/; every other file is a copy of the
input.

Regenerate after an intended change with OPENNPU_REGEN_GOLDEN=1 and review the diff by hand.
"""

from __future__ import annotations

import difflib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import opennpu

from opennpu.migrate.convert import cli

GOLDEN = Path(__file__).with_name("golden")
SRC = Path(opennpu.__file__).resolve().parents[1]  # the opennpu this test imports (installed)
CASES = {  # id: (project, expected folder, extra arguments)
    "single_script": ("single_script", "expected", []),
    "single_script-distributed": ("single_script", "expected_distributed",
                                  ["distributed", "-m", "train.py", "-t", "model"]),
    "gpt_package": ("gpt_package", "expected", []),
    "cuda_extension": ("cuda_extension", "expected", []),
}


def _tree(root: Path, compared: bool = True) -> dict[str, str]:
    """The files of a result: those the golden expected/ holds (`compared`: converted .py files,
    run_distributed_npu.sh, report CSVs), or the others, which are plain copies of the input."""
    files = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name == "msFmkTranspltlog.txt" or "__pycache__" in p.parts:
            continue
        if (p.suffix in (".py", ".sh", ".csv")) == compared:
            files[p.relative_to(root).as_posix()] = p.read_text(encoding="utf-8")
    return files


@pytest.mark.parametrize("case", CASES)
def test_golden_project(case, tmp_path, capsys):
    project, expected_name, extra = CASES[case]
    assert cli.main(["-i", str(GOLDEN / project / "input"), "-o", str(tmp_path), *extra]) == 0
    result = tmp_path / ("input_msft_multi" if extra else "input_msft")
    out = capsys.readouterr().out
    assert "change_list.csv" in out and "rows" in out
    assert (result / "transplant_result_file" / "msFmkTranspltlog.txt").is_file()
    got = _tree(result)
    input_dir = GOLDEN / project / "input"
    assert _tree(result, compared=False) == _tree(input_dir, compared=False)  # copied as they are
    expected_dir = GOLDEN / project / expected_name
    if os.environ.get("OPENNPU_REGEN_GOLDEN"):
        shutil.rmtree(expected_dir, ignore_errors=True)
        for rel, text in got.items():
            (expected_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            (expected_dir / rel).write_text(text, encoding="utf-8")
    expected = _tree(expected_dir)
    assert sorted(got) == sorted(expected)
    for rel in expected:
        diff = "".join(difflib.unified_diff(expected[rel].splitlines(True), got[rel].splitlines(True),
                                            f"expected/{rel}", f"got/{rel}"))
        assert not diff, diff


def test_golden_outputs_are_fixed_points(capsys):
    """Converting an expected (already converted) project changes nothing: --check exits 0."""
    for project in ("single_script", "gpt_package", "cuda_extension"):
        assert cli.main(["-i", str(GOLDEN / project / "expected"), "--check"]) == 0, project
    assert "0 of" in capsys.readouterr().err


def _losses(output: str) -> list[tuple[int, float, str]]:
    rows = re.findall(r"step (\d+) loss (\S+) on (\w+)", output)
    return [(int(step), float(loss), device) for step, loss, device in rows]


def test_converted_script_trains_on_npu_like_the_original_on_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def run(path: Path, *args: str) -> str:
        done = subprocess.run([sys.executable, str(path), "--steps", "4", *args], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    original = _losses(run(GOLDEN / "single_script" / "input" / "train.py", "--device", "cpu"))
    converted = _losses(run(GOLDEN / "single_script" / "expected" / "train.py"))
    assert [d for *_, d in original] == ["cpu"] * 4
    assert [d for *_, d in converted] == ["npu"] * 4
    assert [s for s, *_ in converted] == [0, 1, 2, 3]
    for (_, a, _), (_, b, _) in zip(original, converted):
        assert b == pytest.approx(a, rel=1e-6, abs=1e-7)
