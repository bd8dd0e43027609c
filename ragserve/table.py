"""Plain-text tables on stdout, for the command-line tools and the benchmarks alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """``title``, then right-aligned columns: floats to 3 significant digits (whole numbers
    from 100 up), None as ``-``."""
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for index, row in enumerate(cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))
    print(end="", flush=True)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)
