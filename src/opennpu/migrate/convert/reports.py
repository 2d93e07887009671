"""The result files, with msFmkTransplt's names and columns (spec migration.md §1.4), in
``<result>/transplant_result_file/``; and the scan of C++/CUDA sources for cuda_op_list.csv."""

from __future__ import annotations

import csv
import re
from pathlib import Path

REPORT_DIR = "transplant_result_file"
LOG_FILE = "msFmkTranspltlog.txt"
HEADERS = {
    "change_list.csv": ("File", "Start Line", "End Line", "Operation Type", "Message"),
    "unsupported_api.csv": ("File", "Start Line", "End Line", "OP", "Tips"),
    "unknown_api.csv": ("File", "Start Line", "End Line", "OP"),
    "cuda_op_list.csv": ("File", "Api"),
    "api_performance_advice.csv": ("File", "Start Line", "End Line", "OP", "Tips"),
}
CUDA_SOURCE_SUFFIXES = (".cpp", ".cu")

_PYBIND = re.compile(r"^\s*PYBIND11_MODULE\s*\(\s*\w+\s*,\s*(\w+)\s*\)", re.M)
_TORCH_LIBRARY = re.compile(
    r"^\s*TORCH_LIBRARY(_FRAGMENT|_IMPL)?\s*\(\s*(\w+)\s*,\s*(?:\w+\s*,\s*)?(\w+)\s*\)", re.M)
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def _block(text: str, start: int) -> str:
    """The text of the {...} block that follows `start` (brace matching; strings ignored)."""
    open_at = text.find("{", start)
    if open_at < 0:
        return ""
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at:i + 1]
    return text[open_at:]


def scan_cuda_ops(text: str) -> list[str]:
    """Operators a C++/CUDA source registers for Python: `m.def("name", ...)` inside
    PYBIND11_MODULE(name, m) gives `name`; `m.def("name(schema)")` / `m.impl("name", ...)` inside
    TORCH_LIBRARY[_FRAGMENT|_IMPL](ns, [key,] m) gives `ns::name`. Regular expressions with brace
    matching, not a C++ parser: macros that build the names are not followed."""
    text = _COMMENT.sub("", text)
    ops: list[str] = []
    for match in _PYBIND.finditer(text):
        var = re.escape(match.group(1))
        body = _block(text, match.end())
        ops += re.findall(rf"\b{var}\s*\.\s*def\s*\(\s*\"([^\"]+)\"", body)
    for match in _TORCH_LIBRARY.finditer(text):
        namespace, var = match.group(2), re.escape(match.group(3))
        body = _block(text, match.end())
        for schema in re.findall(rf"\b{var}\s*\.\s*(?:def|impl)\s*\(\s*\"([^\"]+)\"", body):
            ops.append(f"{namespace}::{re.split(r'[(.]', schema, maxsplit=1)[0].strip()}")
    return list(dict.fromkeys(ops))


def write_csv(path: Path, header: tuple[str, ...], rows) -> int:
    rows = list(rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return len(rows)


def collect_rows(results, cuda_ops, project_advice) -> dict[str, list[tuple]]:
    """Rows of every CSV from the per-file results (`results`: [(relative path, FileResult)])."""
    rows: dict[str, list[tuple]] = {name: [] for name in HEADERS}
    for rel, result in results:
        rows["change_list.csv"] += [(rel, *row) for row in result.changes]
        rows["unsupported_api.csv"] += [(rel, *row) for row in result.unsupported]
        rows["unknown_api.csv"] += [(rel, *row) for row in result.unknown]
        rows["api_performance_advice.csv"] += [(rel, *row) for row in result.performance]
    rows["api_performance_advice.csv"] += [("NA", "NA", "NA", op, tip) for op, tip in project_advice]
    rows["cuda_op_list.csv"] = [(rel, op) for rel, ops in cuda_ops for op in ops]
    return rows


def write_reports(report_dir: Path, rows: dict[str, list[tuple]]) -> dict[str, int]:
    report_dir.mkdir(parents=True, exist_ok=True)
    return {name: write_csv(report_dir / name, HEADERS[name], rows[name]) for name in HEADERS}
