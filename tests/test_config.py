"""The engine's configuration refuses numbers that would fail, or do the wrong thing, later."""

from __future__ import annotations

import pytest

from ragserve.cli import main as ragserve_main
from ragserve.config import EngineConfig


@pytest.mark.parametrize(
    "field",
    ["kv_cache_gib", "kv_cpu_gib", "kv_disk_gib", "kv_load_gib_per_step", "kv_remote_timeout_s"],
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), True], ids=["nan", "inf", "bool"])
def test_sizes_and_times_must_be_finite_numbers(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{field} must be a finite number"):
        EngineConfig(**{field: value})


def test_the_cli_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert ragserve_main(["generate", "--kv-cpu-gib", "nan", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["ragserve generate: error: kv_cpu_gib must be a finite number, got nan"]
