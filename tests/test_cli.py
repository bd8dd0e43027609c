"""The ``ragserve`` command line (ragserve/cli.py): the subcommand table, help, the
one-line user errors and the engine flags every engine-building command shares."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

from ragserve import cli
from ragserve.cli import COMMANDS, build_parser, engine_config_from_args, main
from ragserve.config import EngineConfig
from ragserve.config_flags import config_from_args, to_argv
from ragserve.engine.guarded_sampling import FAIL_SAMPLING_ENV
from ragserve.server.config import ServerConfig


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_table_lists_every_subcommand() -> None:
    assert list(COMMANDS) == [
        "generate",
        "serve",
        "cluster",
        "bench",
        "summarize",
        "docqa",
        "loadtest",
    ]
    assert list(subcommands(build_parser())) == list(COMMANDS)
    for module_name in COMMANDS.values():
        assert module_name.startswith("ragserve.commands.")
        assert callable(importlib.import_module(module_name).add_parser)


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_subcommand_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"ragserve {name}" in capsys.readouterr().out


def test_user_error_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--block-size", "3"]) == 2
    err = capsys.readouterr().err
    assert err == "ragserve generate: error: block_size must be a power of two, got 3\n"


def test_bad_choice_exits_2_with_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--dtype", "float8"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith("ragserve serve: error: argument --dtype: invalid choice")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "prefix", "--num-questions", "2"], "--num-questions: must be >= 5, got 2"),
        (["bench", "throughput", "--num-prompts", "0"], "--num-prompts: must be >= 1, got 0"),
        (["bench", "fp8-quality", "--variants", "fp8 KV,fp8-kv"], "unknown variants ['fp8-kv']"),
        (["bench", "rag", "--rules", "leading,oracle"], "unknown selection rule(s) oracle"),
        (
            ["bench", "cluster", "--configs", "1:affinity,1:bogus"],
            "'1:bogus' is not REPLICAS:ROUTER",
        ),
    ],
)
def test_bench_options_no_run_could_use_are_refused_before_any_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors


def test_a_command_that_cannot_be_imported_leaves_the_others(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A command whose optional dependency is missing when its parser is added.
    (tmp_path / "needs_missing_dependency.py").write_text(
        "def add_parser(subparsers, name):\n    import no_such_dependency  # noqa: F401\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    table = {
        "absent": "ragserve.commands.no_such_command",
        "lacking": "needs_missing_dependency",
        **COMMANDS,
    }
    monkeypatch.setattr(cli, "COMMANDS", table)
    assert list(subcommands(build_parser())) == list(table)
    for argv in (["lacking"], ["lacking", "sub", "--flag", "value"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1
        assert err[0].startswith(
            "ragserve lacking: error: needs_missing_dependency cannot be imported"
        )
        assert "no_such_dependency" in err[0]
    assert main(["absent"]) == 2
    assert capsys.readouterr().err.startswith("ragserve absent: error: ")


def test_engine_config_from_args_round_trips() -> None:
    config = EngineConfig(
        model="some/model",
        dtype="bfloat16",
        block_size=32,
        kv_cache_gib=0.5,
        enforce_eager=True,
        async_scheduling=False,
        kv_disk_dir="/tmp/kv",
    )
    for command in (
        "generate",
        "bench throughput",
        "summarize x --out y",
        "docqa --docs d --questions q --out y",
    ):
        args = build_parser().parse_args([*command.split(), *to_argv(config)])
        assert engine_config_from_args(args) == config, command
    assert engine_config_from_args(build_parser().parse_args(["generate"])) == EngineConfig()


def test_serve_flags_build_both_configs() -> None:
    argv = [
        "serve",
        "--port",
        "0",
        "--api-key",
        "a",
        "--api-key",
        "b",
        "--max-waiting-requests",
        "8",
        "--max-queue-seconds",
        "0",
        "--ingest-lease-seconds",
        "4.5",
        "--no-prefix-caching",
    ]
    args = build_parser().parse_args(argv)
    assert config_from_args(ServerConfig, args) == ServerConfig(
        port=0,
        api_keys=("a", "b"),
        max_waiting_requests=8,
        max_queue_seconds=0.0,
        ingest_lease_seconds=4.5,
    )
    assert engine_config_from_args(args) == EngineConfig(enable_prefix_caching=False)
    defaults = build_parser().parse_args(["serve"])
    assert config_from_args(ServerConfig, defaults) == ServerConfig()
    assert defaults.api_key_file is None
    with pytest.raises(ValueError, match="watch round"):  # renewed too late: taken over
        ServerConfig(ingest_lease_seconds=2.0)


@pytest.mark.slow  # loads the embedded model
def test_generate_prints_a_failed_prompt_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(FAIL_SAMPLING_ENV, "offline-1")  # the second prompt's draws fail
    assert (
        main(
            [
                "generate",
                "--max-tokens",
                "2",
                "--max-model-len",
                "256",
                "--kv-cache-gib",
                "0.05",
                "a",
                "b",
                "c",
            ]
        )
        == 1
    )
    answers = capsys.readouterr().out.split("> ")[1:]
    failed = [answer.split("\n")[1].startswith("(failed: ") for answer in answers]
    assert failed == [False, True, False]
