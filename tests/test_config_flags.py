"""Flags generated from config dataclasses (ragserve/config_flags.py): every field of
EngineConfig and ServerConfig is a flag with the field's default, and flags round-trip."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

import pytest

from ragserve.config import EngineConfig
from ragserve.config_flags import (
    Flag,
    add_flags,
    check_choices,
    config_from_args,
    flags,
    option,
    to_argv,
)
from ragserve.server.config import ServerConfig

CONFIGS = [EngineConfig, ServerConfig]
# Settings for code and tests, not for users of `ragserve serve`.
SERVER_ONLY_IN_CODE = {
    "max_n",
    "max_documents_per_request",
    "completion_default_max_tokens",
    "retry_after_seconds",
}


def parser_for(config_type: type[Any]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    add_flags(parser, config_type)
    return parser


def other_value(flag: Flag) -> Any:
    """A valid value of ``flag``'s field that is not its default."""
    default = flag.default
    if flag.kind is bool:
        return True if default is None else not default
    if flag.kind is tuple:
        return ("first", "second")
    if flag.option.choices:
        return next(c for c in reversed(flag.option.choices) if c != default)
    if flag.kind is str:
        return f"x-{flag.field.name}"
    if flag.kind is int:
        return default * 2 if default else 1
    return default / 2 if default else 1.5


@pytest.mark.parametrize("config_type", CONFIGS, ids=lambda c: c.__name__)
def test_every_field_has_a_flag_with_its_default(config_type: type[Any]) -> None:
    flagged = {flag.field.name: flag for flag in flags(config_type)}
    unflagged = {f.name for f in dataclasses.fields(config_type)} - set(flagged)
    assert unflagged == (SERVER_ONLY_IN_CODE if config_type is ServerConfig else set())
    parser = parser_for(config_type)
    for name, flag in flagged.items():
        assert flag.name in parser.format_usage(), name
        default = parser.get_default(name)
        assert (tuple(default) if flag.kind is tuple else default) == flag.field.default, name
    assert config_from_args(config_type, parser.parse_args([])) == config_type()


@pytest.mark.parametrize("config_type", CONFIGS, ids=lambda c: c.__name__)
def test_each_flag_sets_its_field(config_type: type[Any]) -> None:
    parser = parser_for(config_type)
    for flag in flags(config_type):
        config = config_type(**{flag.field.name: other_value(flag)})
        argv = to_argv(config)
        assert argv[0] in (flag.name, "--no-" + flag.name[2:]), argv
        assert config_from_args(config_type, parser.parse_args(argv)) == config


def test_engine_flags_keep_their_spellings() -> None:
    parser = parser_for(EngineConfig)
    config = config_from_args(
        EngineConfig,
        parser.parse_args(["--no-prefix-caching", "--enforce-eager", "--no-async-scheduling"]),
    )
    assert not config.enable_prefix_caching
    assert config.enforce_eager
    assert config.async_scheduling is False
    config = config_from_args(EngineConfig, parser.parse_args(["--async-scheduling"]))
    assert config.async_scheduling is True
    assert config.enable_prefix_caching


def test_quantization_flag_defaults_to_none_and_takes_fp8() -> None:
    from ragserve.models.llama import QUANTIZATIONS

    parser = parser_for(EngineConfig)
    assert config_from_args(EngineConfig, parser.parse_args([])).quantization == "none"
    config = config_from_args(EngineConfig, parser.parse_args(["--quantization", "fp8"]))
    assert config.quantization == "fp8"
    assert to_argv(config) == ["--quantization", "fp8"]
    # The config stays free of torch, so it spells the model's names out: they must agree.
    assert flags_by_name(EngineConfig)["--quantization"].option.choices == QUANTIZATIONS


def test_the_step_size_defaults_by_device_and_a_given_one_is_kept() -> None:
    parser = parser_for(EngineConfig)
    unset = config_from_args(EngineConfig, parser.parse_args([]))
    assert unset.max_num_batched_tokens is None
    assert unset.for_device("cpu").step_tokens == 2048
    assert unset.for_device("cuda").step_tokens == 8192
    # offline (the LLM class) CPU steps are larger, as vLLM's CPU defaults
    assert unset.for_device("cpu", offline=True).step_tokens == 4096
    assert unset.for_device("cuda", offline=True).step_tokens == 8192
    given = config_from_args(EngineConfig, parser.parse_args(["--max-num-batched-tokens", "512"]))
    assert given.for_device("cuda").step_tokens == 512
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


def flags_by_name(config_type: type[Any]) -> dict[str, Flag]:
    return {flag.name: flag for flag in flags(config_type)}


def test_api_key_repeats() -> None:
    args = parser_for(ServerConfig).parse_args(["--api-key", "a", "--api-key", "b"])
    assert config_from_args(ServerConfig, args).api_keys == ("a", "b")
    assert parser_for(ServerConfig).get_default("api_keys") == []


@pytest.mark.parametrize(
    "flag", [f for f in flags(EngineConfig) if f.option.choices], ids=lambda f: f.name
)
def test_choices_reject_other_values(flag: Flag, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parser_for(EngineConfig).parse_args([flag.name, "bogus"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "invalid choice: 'bogus'" in errors[0]
    with pytest.raises(ValueError, match=f"{flag.field.name} must be one of .*got 'bogus'"):
        EngineConfig(**{flag.field.name: "bogus"})


@dataclass(frozen=True)
class Sample:
    name: str = option("a", help="a name")
    ratio: float | None = option(None, help="a ratio")
    color: str = option("red", help="a color", choices=("red", "blue"))
    cache: bool = option(True, help="a switch on by default", flag="--cache-it")
    tags: tuple[str, ...] = option((), help="repeatable", flag="--tag")
    hidden: int = option(3, help="no flag", cli=False)

    def __post_init__(self) -> None:
        check_choices(self)


def test_flag_rules() -> None:
    assert [(f.name, f.kind) for f in flags(Sample)] == [
        ("--name", str),
        ("--ratio", float),
        ("--color", str),
        ("--cache-it", bool),
        ("--tag", tuple),
    ]
    sample = Sample(ratio=0.5, color="blue", cache=False, tags=("x", "y"))
    argv = to_argv(sample)
    assert argv == [
        "--ratio",
        "0.5",
        "--color",
        "blue",
        "--no-cache-it",
        "--tag",
        "x",
        "--tag",
        "y",
    ]
    assert config_from_args(Sample, parser_for(Sample).parse_args(argv), hidden=4) == (
        dataclasses.replace(sample, hidden=4)
    )
    with pytest.raises(ValueError, match="no flag sets hidden=4"):
        to_argv(Sample(hidden=4))
    with pytest.raises(ValueError, match="color must be one of red, blue, got 'green'"):
        Sample(color="green")


@dataclass(frozen=True)
class NoDefault:
    count: int


@dataclass(frozen=True)
class OddType:
    value: complex = option(1j, help="no flag form")


@pytest.mark.parametrize("config_type", [NoDefault, OddType])
def test_fields_without_a_flag_form_are_refused(config_type: type[Any]) -> None:
    with pytest.raises(TypeError, match="cli=False"):
        parser_for(config_type)
