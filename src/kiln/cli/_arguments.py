"""argparse arguments derived from the flags declared on options dataclasses (kiln/_flags.py), and the options
object built back from what argparse parsed: a flag is added and read by the same field, so none can be missed."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kiln._flags import FIELD_DEFAULT, Flag, flag_of, parse_bool

if TYPE_CHECKING:
    Commands = argparse._SubParsersAction["CommandParser"]  # what a command module adds its parser to

T = TypeVar("T")

Groups = dict[str, "argparse._ArgumentGroup"]

_PARSERS: dict[Any, Callable[[str], Any]] = {bool: parse_bool, int: int, float: float, str: str, Path: Path}


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser that can also hold subcommands named by its first word, beside a positional argument of its
    own: ``kiln edge calibrate SAMPLES`` runs ``calibrate``, ``kiln edge MODEL`` the edge itself. argparse's
    subparsers cannot do this, since a subcommand and a positional would compete for the same word; a command
    without a positional of its own uses argparse's subparsers (``kiln bench compare``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subcommands: dict[str, argparse.ArgumentParser] = {}

    def add_subcommand(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        self.subcommands[name] = subcommand = argparse.ArgumentParser(prog=f"{self.prog} {name}", **kwargs)
        return subcommand

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        words = list(sys.argv[1:] if args is None else args)
        if words and words[0] in self.subcommands:
            return self.subcommands[words[0]].parse_known_args(words[1:], namespace)
        return super().parse_known_args(words, namespace)


def add_flags(parser: argparse.ArgumentParser, options_class: type[Any], groups: Groups | None = None) -> None:
    """Add an argument for every flagged field of ``options_class`` and of the options dataclasses it holds.

    A flag with a ``group`` goes into that --help section, made on first use; pass ``groups`` to share the
    sections with arguments the command adds itself."""
    groups = {} if groups is None else groups
    for field, declared, hint in declared_fields(options_class):
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if declared.group is not None:
            if declared.group not in groups:
                groups[declared.group] = parser.add_argument_group(declared.group)
            target = groups[declared.group]
        names, settings = _argument(field, declared, hint)
        target.add_argument(*names, **settings)


def build(options_class: type[T], args: argparse.Namespace, **given: Any) -> T:
    """``options_class`` from the parsed flags of its fields (nested options included); ``given`` sets fields
    that are not flags of their own, or that the command worked out from several flags."""
    unknown = set(given) - _names(options_class)
    if unknown:
        raise TypeError(f"{options_class.__name__} has no field {', '.join(sorted(unknown))}")
    built: T = _build(options_class, args, given)
    return built


def declared_fields(options_class: type[Any]) -> Iterator[tuple[dataclasses.Field[Any], Flag, Any]]:
    """(field, flag, type) of every flagged field, nested options dataclasses walked in field order."""
    for field, hint in _all_fields(options_class):
        declared = flag_of(field)
        if declared is not None:
            yield field, declared, hint


def _all_fields(options_class: type[Any]) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(options_class)
    for field in dataclasses.fields(options_class):
        hint = hints[field.name]
        if _is_options(hint):
            yield from _all_fields(hint)
        elif field.init:
            yield field, hint


def _names(options_class: type[Any]) -> set[str]:
    hints = typing.get_type_hints(options_class)
    names = {field.name for field in dataclasses.fields(options_class)}
    return names.union(*(_names(hints[name]) for name in names if _is_options(hints[name])))


def _build(options_class: type[Any], args: argparse.Namespace, given: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(options_class)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(options_class):
        hint = hints[field.name]
        if field.name in given:
            values[field.name] = given[field.name]
        elif _is_options(hint):
            values[field.name] = _build(hint, args, given)
        elif flag_of(field) is not None:
            value = getattr(args, field.name)
            if not _repeated(field, hint):
                values[field.name] = value
            elif value is not None:  # the values given, as the field's own sequence type (none: its default)
                values[field.name] = value if typing.get_origin(_strip_none(hint)) is list else tuple(value)
    return options_class(**values)


def _argument(field: dataclasses.Field[Any], declared: Flag, hint: Any) -> tuple[list[str], dict[str, Any]]:
    settings: dict[str, Any] = {"help": declared.help}
    if declared.choices is not None:
        settings["choices"] = declared.choices
    default = _default(field) if declared.default is FIELD_DEFAULT else declared.default
    if declared.env is not None:
        default = os.environ.get(declared.env, default)
    if declared.form in ("switch", "negated_switch"):
        settings |= {"action": "store_true" if declared.form == "switch" else "store_false", "default": default}
    else:
        element = _element(field, hint)
        if element not in _PARSERS and declared.parse is None:
            raise TypeError(f"the flag of field '{field.name}' needs a parse function: no parser for {element}")
        settings["type"] = declared.parse or _PARSERS[element]
        # argparse would name the value after the field; name it after the flag, as a hand-written flag would be
        settings["metavar"] = declared.metavar or ("BOOL" if element is bool else None) or _metavar(declared)
        if _repeated(field, hint):
            settings |= {"action": "append", "default": None}  # an append default would be shared across parses
        else:
            settings["default"] = default
        if declared.form == "optional_value":
            settings |= {"nargs": "?", "const": True}
    if not declared.names:  # a positional argument: argparse takes its name as its destination
        return [field.name], {k: v for k, v in settings.items() if k != "default"}
    if declared.required:
        settings["required"] = True
    return list(declared.names), {**settings, "dest": field.name}


def _metavar(declared: Flag) -> str | None:
    if declared.choices is not None or not declared.names:
        return None
    long = [name for name in declared.names if name.startswith("--")]
    return (long or list(declared.names))[0].lstrip("-").replace("-", "_").upper()


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _element(field: dataclasses.Field[Any], hint: Any) -> Any:
    """The type one flag value converts to: the field's type, or its item type for a repeated flag."""
    stripped = _strip_none(hint)
    return typing.get_args(stripped)[0] if _repeated(field, hint) else stripped


def _repeated(field: dataclasses.Field[Any], hint: Any) -> bool:
    """A list or tuple field whose flag parses one item per use (no parse function of its own for the whole)."""
    declared = flag_of(field)
    return (declared is not None and declared.parse is None and declared.form == "value"
            and typing.get_origin(_strip_none(hint)) in (list, tuple))


def _strip_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(hint) if member is not type(None)]
        if len(members) == 1:
            return members[0]
    return hint


def _is_options(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint) and any(
        flag_of(field) is not None or _is_options(typing.get_type_hints(hint)[field.name])
        for field in dataclasses.fields(hint))
