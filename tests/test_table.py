"""Plain-text tables (ragserve/table.py)."""

from __future__ import annotations

import pytest

from ragserve.table import print_table


def test_columns_align_and_numbers_are_short(capsys: pytest.CaptureFixture[str]) -> None:
    print_table("title", ["name", "value"], [["a", 0.123456], ["long name", 1234.5], ["c", None]])
    assert capsys.readouterr().out.splitlines() == [
        "",
        "title",
        "     name  value",
        "---------  -----",
        "        a  0.123",
        "long name   1234",
        "        c      -",
    ]
