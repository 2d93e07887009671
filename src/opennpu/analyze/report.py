"""The census as CSV (stable columns, sorted by op: diffable in CI), a terminal table and a
self-contained HTML page."""

from __future__ import annotations

import csv
import html
import io
from collections import Counter
from pathlib import Path

from .census import PHASES
from .support import Row, ascend_data

FORMATS = ("csv", "table", "html")
FILE_NAMES = {"csv": "op_census.csv", "table": "op_census.txt", "html": "op_census.html"}
FUSION_CSV = "fusions.csv"  # written beside op_census.csv when the fusion report ran
FUSION_COLUMNS = ("rule", "matches", "stage", "replacement", "eager_only", "advice")
STATUS_ORDER = ("fused", "native", "composite", "ascend-cpu-fallback", "missing")


def to_csv(rows: list[Row]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(Row.columns())
    for row in sorted(rows, key=lambda r: r.op):
        writer.writerow([getattr(row, c) for c in Row.columns()])
    return out.getvalue()


def fusions_to_csv(fusions) -> str:
    """One row per rule that matched, sorted by rule; no rows when none did (or on an error)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(FUSION_COLUMNS)
    for m in sorted(fusions.matches, key=lambda m: m.rule):
        writer.writerow([m.rule, m.matches, m.stage, m.replacement, m.eager_only, m.advice()])
    return out.getvalue()


def _provenance() -> str:
    data = ascend_data()
    parts = [f"{name} {src['branch']}@{src['commit'][:10]}"
             for name, src in sorted(data["sources"].items())]
    return f"Ascend data: torch {data['torch_version']}, " + ", ".join(parts) + f" ({data['date']})"


def _summary(rows: list[Row]) -> str:
    counts = Counter(r.status for r in rows)
    calls = Counter()
    for r in rows:
        calls[r.status] += r.calls
    return ", ".join(f"{s} {counts[s]} ops / {calls[s]} calls" for s in STATUS_ORDER if counts[s])


def _fusion_lines(fusions) -> list[str]:
    if fusions is None:
        return []
    lines = [f"Fused replacements (graph mode's rules over {fusions.module}):"]
    if fusions.error:
        lines.append(f"  not available: {fusions.error}")
    elif not fusions.matches:
        lines.append("  no rule matched")
    for m in fusions.matches:
        lines.append(f"  {m.rule} matched {m.matches}x -> {m.advice()}")
    return lines


def _format_table(header: list[str], body: list[list[str]], widths: dict[int, int]) -> list[str]:
    cells = [header, *body]
    for i, limit in widths.items():
        for row in cells:
            if len(row[i]) > limit:
                row[i] = row[i][:limit - 3] + "..."
    size = [max(len(row[i]) for row in cells) for i in range(len(header))]
    rule = "  ".join("-" * w for w in size)
    render = lambda row: "  ".join(c.ljust(w) for c, w in zip(row, size)).rstrip()  # noqa: E731
    return [render(header), rule, *(render(r) for r in body)]


def table(rows: list[Row], fusions=None, *, census=None, signature_width: int = 60) -> str:
    """A readable text table: most-called ops first within each status."""
    order = {s: i for i, s in enumerate(STATUS_ORDER)}
    ranked = sorted(rows, key=lambda r: (order.get(r.status, len(order)), -r.calls, -r.inner, r.op))
    header = ["op", "calls", "inner", "phase", "status", "npu", "ascend", "top signature"]
    body = []
    for r in ranked:
        phase = "+".join(p for p in PHASES if getattr(r, p)) or "inner"
        top = r.signatures.split(" | ")[0]
        body.append([r.op, str(r.calls), str(r.inner), phase, r.status, r.npu, r.ascend, top])
    lines = _format_table(header, body, {7: signature_width})
    lines += ["", f"{len(rows)} ops: {_summary(rows)}", _provenance()]
    if census is not None and census.steps is not None:
        lines.append(f"steps: {census.steps_done} {census.step_on} step(s)"
                     + (" (stopped there)" if census.stopped_early else ""))
    flagged = [r.op for r in rows if r.status in ("ascend-cpu-fallback", "missing")]
    if flagged:
        lines.append("flagged: " + ", ".join(sorted(flagged)))
    lines += ["", *_fusion_lines(fusions)] if fusions is not None else []
    return "\n".join(lines) + "\n"


_CSS = """body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#eee}td.n{text-align:right}.fused{background:#d9f2d9}.native{background:#fff}
.composite{background:#eef3fb}.ascend-cpu-fallback{background:#fff0cc}.missing{background:#f8d0d0}
code{font-size:12px}"""


def to_html(rows: list[Row], fusions=None, *, title: str = "opennpu op census") -> str:
    """One self-contained page (inline CSS, no scripts, no external assets)."""
    esc = html.escape
    out = ["<!DOCTYPE html>", "<html lang=\"en\">", "<head>", "<meta charset=\"utf-8\"/>",
           f"<title>{esc(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
           f"<h1>{esc(title)}</h1>", f"<p>{esc(f'{len(rows)} ops: {_summary(rows)}')}</p>",
           f"<p>{esc(_provenance())}</p>"]
    if fusions is not None:
        out.append("<h2>Fused replacements</h2>")
        lines = _fusion_lines(fusions)[1:]
        out.append("<ul>" + "".join(f"<li>{esc(line.strip())}</li>" for line in lines) + "</ul>")
    out.append("<h2>Operators</h2>")
    out.append("<table>")
    out.append("<tr>" + "".join(f"<th>{esc(c)}</th>" for c in Row.columns()) + "</tr>")
    numeric = {"calls", "inner", *PHASES}
    for r in sorted(rows, key=lambda r: r.op):
        cells = []
        for c in Row.columns():
            value = getattr(r, c)
            if c == "signatures":
                cells.append("<td>" + "<br/>".join(f"<code>{esc(s)}</code>"
                                                   for s in str(value).split(" | ")) + "</td>")
            else:
                cells.append(f"<td class=\"n\">{esc(str(value))}</td>" if c in numeric
                             else f"<td>{esc(str(value))}</td>")
        out.append(f"<tr class=\"{esc(r.status)}\">" + "".join(cells) + "</tr>")
    out += ["</table>", "</body>", "</html>"]
    return "\n".join(out) + "\n"


def write(census, directory=None, *, formats=("table",), fusions=None) -> str:
    """Render the census; write each of `formats` into `directory` (FILE_NAMES). Returns the
    terminal table."""
    unknown = set(formats) - set(FORMATS)
    if unknown:
        raise ValueError(f"opennpu.analyze: unknown format(s) {sorted(unknown)}; "
                         f"choose from {FORMATS}")
    rows = census.rows()
    text = table(rows, fusions, census=census)
    if directory is not None:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        rendered = {"csv": lambda: to_csv(rows), "table": lambda: text,
                    "html": lambda: to_html(rows, fusions)}
        for kind in formats:
            (folder / FILE_NAMES[kind]).write_text(rendered[kind]())
        if "csv" in formats and fusions is not None:
            (folder / FUSION_CSV).write_text(fusions_to_csv(fusions))
    return text
