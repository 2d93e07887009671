"""Plain-text tables for the demo and the benchmarks: columns sized from their contents."""

from __future__ import annotations

from typing import Collection, Sequence

GAP = "  "  # between columns, whatever their contents


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                 left: Collection[int] = (0,)) -> str:
    """`header` and `rows` (cells already formatted as strings) with each column as wide as its
    widest cell and GAP between columns, so a long shape or time never runs into its neighbour.
    Columns whose index is in `left` are left-aligned (text), the others right-aligned (numbers);
    trailing blanks are stripped."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return "\n".join(
        GAP.join(cell.ljust(w) if i in left else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in (header, *rows))
