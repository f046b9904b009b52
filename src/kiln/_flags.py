"""Command-line spellings declared on the options dataclasses, so that each option is written down once.

A field of an options dataclass carries its flag in its metadata::

    http_port: int = field(default=8000, metadata=flag("--http-port", help="..."))

The field gives the name, type and default; the flag gives the spelling, help and how it is written.
``kiln.cli`` derives the argparse arguments from the fields and builds the options object back from what was
parsed; :func:`command_words` turns an options object back into the flags that reproduce it. This module imports
only kiln.errors, so that the options of every layer can declare their flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kiln.errors import InvalidArgumentError

FLAG = "kiln.flag"  # the metadata key

class _FieldDefault:
    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


FIELD_DEFAULT: Any = _FieldDefault()  # a flag's default: the field's own

# value: the flag takes a value; switch: present means true (store_true); negated_switch: present means false;
# optional_value: alone means true, or takes a BOOL.
Form = Literal["value", "switch", "negated_switch", "optional_value"]


@dataclass(frozen=True)
class Flag:
    """How one options field is written on a command line. ``names`` empty: a positional argument."""

    names: tuple[str, ...]
    help: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # text -> field value; default: from the field's type
    form: Form = "value"
    env: str | None = None  # the default is read from this environment variable when the parser is made
    group: str | None = None  # the --help section
    required: bool = False
    default: Any = FIELD_DEFAULT  # the command's default where it differs from the field's (the API's)

    @property
    def spelling(self) -> str:
        """The name written out: the first long one (``--measurement-interval`` rather than ``-p``)."""
        return next((name for name in self.names if name.startswith("--")), self.names[0])


def flag(*names: str, help: str | None = None, metavar: str | None = None, choices: tuple[str, ...] | None = None,
         parse: Callable[[str], Any] | None = None, form: Form = "value", env: str | None = None,
         group: str | None = None, required: bool = False, default: Any = FIELD_DEFAULT) -> dict[str, Flag]:
    """Field metadata declaring the field's command-line flag (no names: a positional argument)."""
    return {FLAG: Flag(names, help, metavar, choices, parse, form, env, group, required, default)}


def flag_of(field: dataclasses.Field[Any]) -> Flag | None:
    found = field.metadata.get(FLAG)
    return found if isinstance(found, Flag) else None


def parse_bool(text: str) -> bool:
    """A BOOL flag value, as Triton's flags take it: 1/0, true/false, yes/no, on/off."""
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got '{text}'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {value}")
    return value


def seconds(text: str) -> float:
    """A duration flag where 0 means "no limit": a finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got '{text}'") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text}")
    return value


def positive_seconds(text: str) -> float:
    """A duration flag that must be longer than zero."""
    value = seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError(f"expected more than 0 seconds, got {text}")
    return value


def checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """A flag parser that checks the text with ``parse`` and keeps the text (parsed again where it is used): a
    bad value is a usage error naming the flag."""
    def check(text: str) -> str:
        try:
            parse(text)
        except InvalidArgumentError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    return check


def command_words(options: Any, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The arguments that give ``options`` (a flagged dataclass, nested ones included) every flagged setting it
    holds: positionals first, then one flag per set value. Fields in ``skip`` and fields set to None are left out."""
    positionals: list[str] = []
    flags: list[str] = []
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        declared = flag_of(field)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            flags += command_words(value, skip=skip)
        elif declared is None or field.name in skip or value is None:
            continue
        elif not declared.names:
            positionals.append(_text(value))
        elif declared.form in ("switch", "negated_switch"):
            if value == (declared.form == "switch"):
                flags.append(declared.spelling)
        elif isinstance(value, (list, tuple)) and declared.parse is None:  # a repeated flag
            for item in value:
                flags += [declared.spelling, _text(item)]
        elif (text := _text(value)).startswith("-"):  # argparse would read a separate "-..." word as a flag
            flags.append(f"{declared.spelling}={text}")
        else:
            flags += [declared.spelling, text]
    return positionals + flags


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(_text(item) for item in value)
    return str(value)
