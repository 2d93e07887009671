"""The report files (CSV columns, HTML), the Ascend data and its generator, and the CLI."""

from __future__ import annotations

import csv
import html.parser
import importlib.util
import io
import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from opennpu.analyze import OpCensus, ascend_data, report, runner
from opennpu.analyze.support import DATA_DIR, Row

REPO = Path(__file__).resolve().parents[2]
COLUMNS = ["op", "status", "npu", "ascend", "calls", "inner", "forward", "backward", "optimizer",
           "other", "modules", "dtypes", "devices", "signatures", "npu_detail", "note"]


@pytest.fixture(scope="module")
def census():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU()).to("npu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8).to("npu")
    with OpCensus() as census:
        model(x).sum().backward()
        opt.step()
    return census


def test_csv_columns_sorted_and_stable(census):
    assert Row.columns() == COLUMNS
    text = report.to_csv(census.rows())
    rows = list(csv.DictReader(io.StringIO(text)))
    assert list(rows[0]) == COLUMNS
    assert [r["op"] for r in rows] == sorted(r["op"] for r in rows)
    addmm = next(r for r in rows if r["op"] == "aten::addmm")
    assert addmm["calls"] == "1" and addmm["forward"] == "1"
    assert addmm["status"] == "native" and addmm["ascend"] == "op-plugin"
    assert text == report.to_csv(list(reversed(census.rows())))  # order-independent


class _Checker(html.parser.HTMLParser):
    VOID = {"meta", "br", "img", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.external, self.cells = [], [], [], 0

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") or (value and "://" in value):
                self.external.append((tag, name, value))
        if tag == "td":
            self.cells += 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()


def test_html_well_formed_and_self_contained(census, tmp_path):
    census.report(tmp_path, formats=("html", "csv", "table"))
    page = (tmp_path / "op_census.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert checker.errors == [] and checker.stack == []
    assert checker.external == []
    assert checker.cells == len(census.records) * len(COLUMNS)
    assert "aten::threshold_backward" in page and "Fused replacements" in page
    assert (tmp_path / "op_census.csv").read_text().startswith(",".join(COLUMNS))
    # a Linear + ReLU matches no rule: the fusion CSV has its header only
    assert (tmp_path / "fusions.csv").read_text() == \
        "rule,matches,stage,replacement,eager_only,advice\n"
    assert "aten::addmm" in (tmp_path / "op_census.txt").read_text()
    with pytest.raises(ValueError, match="unknown format"):
        census.report(tmp_path, formats=("pdf",))


def test_table_text(census):
    text = census.table()
    lines = text.splitlines()
    assert lines[0].split() == ["op", "calls", "inner", "phase", "status", "npu", "ascend", "top", "signature"]
    assert any(line.startswith("aten::addmm ") and "1x: float32(16), float32(4,8)" in line
               for line in lines)
    assert "Ascend data: torch v2.11" in text
    assert "no rule matched" in text  # a Linear + ReLU has nothing to fuse


def test_ascend_data_provenance():
    data = ascend_data("2.11")
    assert data["torch_version"] == "v2.11"
    op_plugin = data["sources"]["op_plugin"]
    assert op_plugin["repository"] == "https://github.com/Ascend/op-plugin"
    assert op_plugin["branch"] == "26.1.0" and len(op_plugin["commit"]) == 40
    assert data["sources"]["torch_npu"]["branch"] == "v2.11.0"
    assert {"addmm", "add.Tensor", "scaled_dot_product_attention"} <= data["op_plugin"]["aten"]
    assert {"npu_rms_norm", "npu_rotary_mul", "npu_fusion_attention", "npu_swiglu"} \
        <= data["op_plugin"]["npu"]
    assert "npu_rms_norm" not in data["op_plugin"]["aten"]
    assert "view" in data["torch_npu"]["aten"]
    raw = json.loads((DATA_DIR / "ascend_ops_2.11.json").read_text())
    assert all(raw["op_plugin"][ns] == sorted(raw["op_plugin"][ns]) for ns in ("aten", "npu"))


def test_generator_version_ranges(tmp_path):
    spec = importlib.util.spec_from_file_location("update_ascend_op_list",
                                                  REPO / "scripts" / "update_ascend_op_list.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    (tmp_path / "opp.yaml").write_text(textwrap.dedent("""\
        all_version: [v2.1, v2.2, v2.10, v2.11, v2.12]
        official:
          - func: add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor
            op_api: all_version
          - func: old_op(Tensor self) -> Tensor
            acl_op: [v2.1, v2.10]
          - func: new_op(Tensor self) -> Tensor
            op_api: [v2.12, newest]
          - func: listed(Tensor self) -> Tensor
            acl_op: v2.1, v2.11
          - func: sparse_only(Tensor self) -> Tensor
            sparse: all_version
        custom:
          - func: npu_thing(Tensor self) -> Tensor
            op_api: [v2.1, newest]
        symint:
          - func: npu_other_backward(Tensor grad) -> Tensor
            op_api: all_version
          - func: embedding(Tensor weight, Tensor indices) -> Tensor
            acl_op: [v2.1, newest]
        """))
    (tmp_path / "tnpu.yaml").write_text("supported:\n  - view\n  - func: clone\n    op_api: True\n"
                                        "custom:\n  - func: npu_format_cast(Tensor self) -> Tensor\n")
    out = tmp_path / "ascend_ops_test.json"
    assert gen.main(["--op-plugin-yaml", str(tmp_path / "opp.yaml"), "--op-plugin-ref",
                     "br@" + "a" * 40, "--torch-npu-yaml", str(tmp_path / "tnpu.yaml"),
                     "--torch-npu-ref", "v2.11.0@" + "b" * 40, "--torch-version", "v2.11",
                     "--date", "2026-01-01", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["op_plugin"] == {"aten": ["add.Tensor", "embedding", "listed"],
                                 "npu": ["npu_other_backward", "npu_thing"]}
    assert data["torch_npu"] == {"aten": ["clone", "view"], "npu": ["npu_format_cast"]}
    assert data["sources"]["op_plugin"]["commit"] == "a" * 40 and data["date"] == "2026-01-01"


SCRIPT = """\
import sys
import torch
import opennpu  # noqa: F401

model = torch.nn.Linear(8, 8).to("npu")
opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
for step in range(int(sys.argv[1])):
    model(torch.ones(2, 8, device="npu")).sum().backward()
    opt.step()
    print("finished step", step)
"""


def test_runner_steps(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    # options before the script are the analyzer's, after it the script's
    assert runner.main(["--steps", "2", "-o", str(tmp_path / "out"), "--format", "csv",
                        "--no-fusion", "--no-inner", str(script), "5"]) == 0
    out = capsys.readouterr().out
    assert "finished step 0" in out and "finished step 1" not in out  # stopped in step 2's hook
    assert "steps: 2 optimizer step(s) (stopped there)" in out
    rows = {r["op"]: r for r in csv.DictReader(open(tmp_path / "out" / "op_census.csv"))}
    assert rows["aten::addmm"]["calls"] == "2" and rows["aten::add_.Tensor"]["optimizer"] == "4"
    assert all(r["inner"] == "0" for r in rows.values())  # --no-inner
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["op_census.csv"]
    assert sys.argv[0] != str(script)  # restored


def test_cli_subcommand(tmp_path, capsys):
    """`opennpu analyze` (the package's command line, run in-process: a fresh interpreter would
    spend most of the test importing torch)."""
    from opennpu.__main__ import main

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert main(["analyze", "--steps", "1", "-o", str(tmp_path / "o"), "--no-fusion",
                 str(script), "3"]) == 0
    out = capsys.readouterr().out
    assert "aten::addmm" in out and "finished step" not in out
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == \
        ["op_census.csv", "op_census.html", "op_census.txt"]
    with pytest.raises(SystemExit):
        main(["analyze", "--step-on", "epoch", str(script)])


def test_module_entry_point_and_lazy_attribute(tmp_path, monkeypatch, capsys):
    """`python -m opennpu.analyze` (its __main__ run as such) and `opennpu.analyze` reached as
    an attribute of the package."""
    import runpy

    import opennpu

    assert opennpu.analyze.OpCensus is OpCensus
    script = tmp_path / "infer.py"
    script.write_text("import torch, opennpu\nm = torch.nn.Linear(2, 2).npu()\n"
                      "with torch.no_grad():\n    for _ in range(4):\n"
                      "        m(torch.ones(1, 2).npu())\n")
    monkeypatch.setattr(sys, "argv", ["opennpu.analyze", "--step-on", "forward", "--steps", "3",
                                      "--format", "table", "--no-fusion", str(script)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("opennpu.analyze", run_name="__main__")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "steps: 3 forward step(s) (stopped there)" in out
    assert next(line for line in out.splitlines() if line.startswith("aten::addmm ")).split()[1] == "3"


def test_failing_script_still_reported(tmp_path, capsys):
    script = tmp_path / "broken.py"
    script.write_text("import torch, opennpu\nx = torch.ones(3, device='npu')\ny = x * 2\n"
                      "raise RuntimeError('boom after one op')\n")
    assert runner.main(["-o", str(tmp_path / "o"), "--format", "csv", "--no-fusion",
                        str(script)]) == 1
    captured = capsys.readouterr()
    assert "boom after one op" in captured.err and "aten::mul.Tensor" in captured.out
    rows = {r["op"]: r for r in csv.DictReader(open(tmp_path / "o" / "op_census.csv"))}
    assert rows["aten::mul.Tensor"]["calls"] == "1"
    script.write_text("import sys\nsys.exit(3)\n")
    census = runner.run_script(script, fusion=False)
    assert census.error == "the script exited with status 3"
