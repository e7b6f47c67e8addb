"""Command-line flags derived from a role's pydantic settings: declared once, in the settings
class, and parsed here (vLLM's engine/arg_utils.py builds its CLI from its config classes the
same way). Every field is a flag `--field-name` unless it is marked `cli=False` (secrets:
environment or file only); its help is the field's description; a bool is `--x/--no-x`; a
Literal is a choice. A flag given wins over the environment (env_prefix), which wins over the
default: only the flags actually given are passed to the settings class.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
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


def add_flags(parser: argparse.ArgumentParser, settings: type[BaseSettings]) -> None:
    for name, field in settings.model_fields.items():
        if not _on_cli(field):
            continue
        flag = "--" + name.replace("_", "-")
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


def parse(
    settings: type[S], argv: Sequence[str], prog: str, description: str, env_prefix: str = ""
) -> S:
    """The settings from these flags over the environment over the defaults."""
    prefix = env_prefix or str(settings.model_config.get("env_prefix", ""))
    parser = argparse.ArgumentParser(
        prog=prog,
        allow_abbrev=False,  # --redis-password must not mean --redis-password-file
        description=f"{description} Every flag can also be set as {prefix}<FLAG>.",
    )
    add_flags(parser, settings)
    return from_args(settings, parser.parse_args(list(argv)))


def from_args(settings: type[S], args: argparse.Namespace) -> S:
    """The settings from the flags add_flags() declared that were given, over the
    environment over the defaults (a subcommand's parser: its own flags are the fields)."""
    given = {
        k: getattr(args, k) for k in settings.model_fields if getattr(args, k, None) is not None
    }
    return settings(**given)
