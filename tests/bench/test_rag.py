"""``ragserve bench rag``'s own parsing (ragserve/bench/rag.py); its emulator is in
test_rag_quality.py, its refusals through the CLI in tests/test_cli.py."""

from __future__ import annotations

import argparse

import pytest

from ragserve.bench.rag import parse_rules


def test_rules_are_parsed_once_each_and_unknown_ones_refused() -> None:
    assert parse_rules(" attention, leading,attention,") == ("attention", "leading")
    for text in ("leading,random", ",", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="choose from"):
            parse_rules(text)
