"""Command-line flags generated from a frozen config dataclass, so each option is defined once.

A field's type and default come from the dataclass, its help text, choices and flag
spelling from :func:`option`. The rules:

- the flag is ``--field-name`` unless the option gives another (``flag="--prefix-caching"``);
- ``bool`` and ``bool | None`` fields become ``--flag/--no-flag``;
- ``int``, ``float`` and ``str`` fields (each may be ``| None``) take one value;
- ``tuple[str, ...]`` fields take one value per repeated flag;
- a field with ``cli=False`` has no flag (a setting for code and tests, not for users).

The parsed value of every field lands in ``args.<field name>``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    ConfigT = TypeVar("ConfigT", bound=DataclassInstance)

T = TypeVar("T")

_KEY = "ragserve.option"
_SCALARS = (bool, int, float, str)


@dataclass(frozen=True)
class Option:
    """What a config field shows on the command line (see the module docstring)."""

    help: str = ""
    choices: tuple[str, ...] = ()
    flag: str | None = None
    cli: bool = True


def option(
    default: T,
    *,
    help: str,
    choices: Sequence[str] = (),
    flag: str | None = None,
    cli: bool = True,
) -> T:
    """A dataclass field with ``default`` and how it appears as a flag."""
    spec = Option(help=help, choices=tuple(choices), flag=flag, cli=cli)
    return dataclasses.field(default=default, metadata={_KEY: spec})


@dataclass(frozen=True)
class Flag:
    """One field's flag: its option string, the field, its default and resolved type."""

    name: str  # the option string, e.g. ``--block-size``
    field: dataclasses.Field[Any]
    option: Option
    default: Any
    kind: type  # bool, int, float, str, or tuple for a repeated flag


def flags(config_type: type[DataclassInstance]) -> Iterator[Flag]:
    """The flags of ``config_type``'s fields, in field order (``cli=False`` fields left out).

    TypeError for a field without a plain default or whose type has no flag form: give
    it ``cli=False``.
    """
    hints = typing.get_type_hints(config_type)
    for field in dataclasses.fields(config_type):
        spec = field.metadata.get(_KEY, Option())
        if not spec.cli:
            continue
        kind = _kind(hints[field.name])
        if kind is None or field.default is dataclasses.MISSING:
            raise TypeError(
                f"{config_type.__name__}.{field.name}: a flag needs a default and an int, "
                f"float, str, bool or tuple[str, ...] type, not {hints[field.name]}; "
                "or give it option(..., cli=False)"
            )
        name = spec.flag or "--" + field.name.replace("_", "-")
        yield Flag(name, field, spec, field.default, kind)


def _kind(hint: Any) -> type | None:
    """bool, int, float or str (each may be ``| None``), tuple for ``tuple[str, ...]``;
    None for any other type."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [arg for arg in args if arg is not type(None)]
        return rest[0] if len(rest) == 1 and rest[0] in _SCALARS else None
    if hint in _SCALARS:
        return hint
    if typing.get_origin(hint) is tuple and args == (str, ...):
        return tuple
    return None


def add_flags(parser: argparse._ActionsContainer, config_type: type[DataclassInstance]) -> None:
    """Add a flag for each of ``config_type``'s fields to ``parser`` (or an argument group)."""
    for flag in flags(config_type):
        spec = flag.option
        kwargs: dict[str, Any] = {"dest": flag.field.name, "help": spec.help or None}
        metavar = flag.name[2:].replace("-", "_").upper()
        if flag.kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction, default=flag.default)
        elif flag.kind is tuple:
            # NOTE: argparse copies a list default before appending to it.
            kwargs.update(action="append", default=list(flag.default), metavar=metavar)
        elif spec.choices:
            kwargs.update(type=flag.kind, default=flag.default, choices=spec.choices)
        else:
            kwargs.update(type=flag.kind, default=flag.default, metavar=metavar)
        parser.add_argument(flag.name, **kwargs)


def config_from_args(
    config_type: type[ConfigT], args: argparse.Namespace, **values: Any
) -> ConfigT:
    """``config_type`` built from the parsed flags; ``values`` set fields that have none
    (or override them)."""
    fields: dict[str, Any] = {}
    for flag in flags(config_type):
        value = getattr(args, flag.field.name)
        fields[flag.field.name] = tuple(value) if flag.kind is tuple else value
    return config_type(**{**fields, **values})


def to_argv(config: DataclassInstance) -> list[str]:
    """Flags that rebuild ``config`` from the defaults: one per field that differs.

    ValueError for a difference no flag can express (a ``cli=False`` field, or None in
    place of a value).
    """
    argv: list[str] = []
    by_field = {flag.field.name: flag for flag in flags(type(config))}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value == field.default:
            continue
        flag = by_field.get(field.name)
        if flag is None or value is None:
            raise ValueError(f"no flag sets {field.name}={value!r}")
        if flag.kind is bool:
            argv.append(flag.name if value else "--no-" + flag.name[2:])
        elif flag.kind is tuple:
            for item in value:
                argv += [flag.name, str(item)]
        else:
            argv += [flag.name, str(value)]
    return argv


def check_choices(config: DataclassInstance) -> None:
    """ValueError when a field with choices holds another value."""
    for field in dataclasses.fields(config):
        spec = field.metadata.get(_KEY)
        value = getattr(config, field.name)
        if spec is None or not spec.choices or value in spec.choices:
            continue
        raise ValueError(f"{field.name} must be one of {', '.join(spec.choices)}, got {value!r}")
