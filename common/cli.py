"""Command-line flags derived from a role's pydantic settings: declared once, in the settings
class, and parsed here (vLLM's engine/arg_utils.py builds its CLI from its config classes the
same way). Every field is a flag `--field-name` unless it is marked `cli=False` (secrets:
environment or file only); `flag="name"` spells it `--name` instead (a flag users already type
whose field name would clash, e.g. `--json`); its help is the field's description; a bool is
`--x/--no-x`; a Literal is a choice. A flag given wins over the environment (env_prefix), which
wins over the default: only the flags actually given are passed to the settings class. A CLI
with subcommands (`python -m ledger run | report`) gives each its own settings class.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

S = TypeVar("S", bound=BaseSettings)


def _unwrap(annotation: Any) -> Any:
    """`X | None` -> X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _on_cli(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    if isinstance(extra, dict) and extra.get("cli") is False:
        return False
    return _unwrap(field.annotation) is not SecretStr


def _flag(name: str, field: FieldInfo) -> str:
    extra = field.json_schema_extra
    spelled = extra.get("flag") if isinstance(extra, dict) else None
    return "--" + (spelled if isinstance(spelled, str) else name.replace("_", "-"))


def add_flags(parser: argparse.ArgumentParser, settings: type[BaseSettings]) -> None:
    for name, field in settings.model_fields.items():
        if not _on_cli(field):
            continue
        flag = _flag(name, field)
        kind = _unwrap(field.annotation)
        kw: dict[str, Any] = {"dest": name, "default": None, "help": field.description}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is Literal:
            choices = typing.get_args(kind)
            kw.update(choices=choices, type=type(choices[0]))
        elif kind in (int, float):
            kw["type"] = kind
        elif kind is Path:
            kw["type"] = Path
        parser.add_argument(flag, **kw)


def _env_note(settings: type[BaseSettings], env_prefix: str = "") -> str:
    prefix = env_prefix or str(settings.model_config.get("env_prefix", ""))
    return f"Every flag can also be set as {prefix}<FLAG>."


def from_args(settings: type[S], args: argparse.Namespace) -> S:
    """The settings from the flags add_flags() declared that were given, over the
    environment over the defaults (also for a parser of one's own, e.g. a subcommand)."""
    return settings(
        **{k: v for k, v in vars(args).items() if v is not None and k in settings.model_fields}
    )


def parse(
    settings: type[S], argv: Sequence[str], prog: str, description: str, env_prefix: str = ""
) -> S:
    """The settings from these flags over the environment over the defaults."""
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,  # --redis-password must not mean --redis-password-file
        description=f"{description} {_env_note(settings, env_prefix)}",
    )
    add_flags(parser, settings)
    return from_args(settings, parser.parse_args(list(argv)))


def parse_command(
    commands: Mapping[str, tuple[type[BaseSettings], str]],
    argv: Sequence[str],
    prog: str,
    description: str,
) -> tuple[str, BaseSettings]:
    """`prog COMMAND [flags]`: the command named and its settings class (from `commands`:
    name -> (settings class, help)) built from its flags over the environment over defaults."""
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # a docstring's own lines
    )
    sub = parser.add_subparsers(dest="_command", required=True, metavar="COMMAND")
    for name, (settings, help_) in commands.items():
        p = sub.add_parser(
            name, allow_abbrev=False, help=help_, description=f"{help_}. {_env_note(settings)}"
        )
        add_flags(p, settings)
    args = parser.parse_args(list(argv))
    command = args._command
    return command, from_args(commands[command][0], args)
