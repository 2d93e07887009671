"""The demo's op table (benchmarks/demo.py): its rows are benchmark cases, and its columns stay
apart whatever their contents. Nothing here times anything."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def demo(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # benchmarks/ is part of the checkout, not the wheel
    from benchmarks import demo

    return demo


def result(shape, ours=1e-3, eager=2e-3, flops=0, extra=None):
    """A result row as benchmarks.run.run_case returns it."""
    baselines = {"eager": {"median": eager}, "compile": {"median": 3e-3}, **(extra or {})}
    return {"op": "rms_norm", "direction": "fwd", "shape": shape, "dtype": "bf16",
            "ours": {"median": ours}, "baselines": baselines, "flops": flops, "gflops": 123.0,
            "copy_bw_fraction": 0.5, "max_abs_err_ours": 1e-3, "max_abs_err_eager": float("nan"),
            "speedup": {name: t["median"] / ours for name, t in baselines.items()}}


def test_columns_stay_apart_with_a_long_shape_and_long_times(demo):
    long_shape = "decode B=32 ctx=131072 N=128/8 D=128 paged causal with a long name"
    rows = [demo.table_row(result("T=1 H=4096")),
            demo.table_row(result(long_shape, ours=123.456, eager=98765.4, flops=10**12,
                                  extra={"F.rms_norm": {"median": 200.0}}))]  # times in s
    lines = demo.format_table(demo.HEADER, rows, demo.LEFT).splitlines()
    assert len(lines) == 3
    # Every cell is found again when the line is cut at runs of 2+ spaces (cells hold at most
    # single spaces): no two columns touch, however long the shape or the times.
    for line, cells in zip(lines, (demo.HEADER, *rows)):
        assert re.split(r" {2,}", line.strip()) == [c for c in cells if c], line
    assert long_shape in lines[2] and "98765400.0" in lines[2] and "F.rms_norm" in lines[2]
    # ... and each column starts (text) or ends (numbers) at the same offset on every line.
    spans = [[m.span() for m in re.finditer(r"\S+(?: \S+)*", line)] for line in lines]
    for i, name in enumerate(demo.HEADER):
        edge = 0 if i in demo.LEFT else 1
        assert len({cells[i][edge] for cells in spans}) == 1, name


def test_demo_rows_are_benchmark_cases(demo):
    cases = demo.demo_cases()
    assert [(c.op, c.direction, c.shape) for c in cases] == [r[:3] for r in demo.DEMO_ROWS]
    assert set(demo.DEMO_OPS) == {c.op for c in cases}
    assert [c.op for c in demo.demo_cases(["swiglu"])] == ["swiglu", "swiglu"]


def test_a_row_that_names_no_case_says_which(demo, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_ROWS", [*demo.DEMO_ROWS, ("rms_norm", "fwd", "T=3 H=5", "bf16")])
    with pytest.raises(LookupError, match=r"T=3 H=5"):
        demo.demo_cases()
