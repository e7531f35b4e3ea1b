"""Dataclass fields as command-line options: the one builder every `artgw` command uses.

A settings dataclass declares each option once, on its field:

    port: int = field(default=8000, metadata={"help": "port to listen on"})

and `add_options(parser, Settings)` turns every such field into `--port` (`--x/--no-x` for a bool),
reading `ARTGW_PORT` when the flag is not given (the command line wins); the help shows the default
and the variable. The metadata is plain data, so gateway/ and trainer/ need no import from here:

- "help" (required): one line for `--help`.
- "option": False: not a user option (the CLI computes it, or only code sets it).
- "aliases": extra flags kept for compatibility, e.g. ("--max-wait",).
- "inverse_env": a variable that turns a bool *off* when true, e.g. ARTGW_NO_MIGRATE.
- "flag": the flag when it is not `--field-name` (a plural field with a singular, repeated flag); the
  variable follows the flag: `"flag": "--model-name"` reads ARTGW_MODEL_NAME.
- "env": the variable when the derived one would clash with another command's (`keys create --model`
  reads ARTGW_KEY_MODELS, not the trainer's ARTGW_MODEL).
- "repeat": True, for a `tuple[str, ...]`: the flag is given once per value (`--model-name a --model-name b`)
  and the variable is a comma list (`ARTGW_MODEL_NAME=a,b`).

Types: str, int, float (finite), bool, Path, `Literal[...]` (the choices), `tuple[str, ...]` (one
shell-quoted string, or a repeated flag with "repeat"), and `X | None` of those ('' gives None; 'none'
too, except for strings). An empty environment variable counts as unset (compose writes `${X:-}`).
Parsing only checks the type; the dataclass's `__post_init__` checks the values, so a bad value is
rejected with its message, never clamped, whether it came from a flag, a variable or code.

After `parse_args`, `resolve(args)` fills every registered option from the command line, the
environment or the default, and `build(Settings, args)` makes the dataclass from what was given.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import math
import os
import shlex
import types
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = [
    "ENV_PREFIX",
    "ArgumentParser",
    "Option",
    "OptionError",
    "add_options",
    "build",
    "given",
    "options_of",
    "parse_bool",
    "resolve",
]

ENV_PREFIX = "ARTGW_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
# Where the registered options travel on the parsed namespace (argparse copies a subparser's defaults).
_REGISTRY = "_artgw_options"
_GIVEN = "_artgw_given"

T = TypeVar("T")


class OptionError(ValueError):
    """A value from the command line or the environment that cannot be used; the message names where it came from."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: `PROG: message (see PROG --help)`, exit 2, no usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected one of {'/'.join(TRUE)} or {'/'.join(FALSE)}, got {text!r}")


def _parse_int(text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):  # nan slips through every `x < 0` check downstream
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _parse_path(text: str) -> Path:
    if not text:
        raise argparse.ArgumentTypeError("expected a path, got an empty value")
    return Path(text)


def _parse_words(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:  # an unbalanced quote
        raise argparse.ArgumentTypeError(f"expected one shell-quoted string, got {text!r} ({exc})") from None


def _parse_list(text: str) -> tuple[str, ...]:
    """A repeated option's variable: a comma list, blanks around the commas ignored, no empty item."""
    items = tuple(item.strip() for item in text.split(","))
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return items


def _parse_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return parse


def _parse_optional(parse: Callable[[str], Any], *, none_word: bool) -> Callable[[str], Any]:
    def parse_or_none(text: str) -> Any:
        if text == "" or (none_word and text.strip().lower() == "none"):
            return None
        return parse(text)

    return parse_or_none


def _converter(tp: Any, where: str) -> tuple[Callable[[str], Any], bool, tuple[str, ...]]:
    """(parse, is_bool, choices) for a field type; TypeError for a type the CLI cannot express."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        if len(inner) != 1 or len(inner) == len(get_args(tp)):
            raise TypeError(f"{where}: only `X | None` unions can be options, not {tp}")
        parse, is_bool, choices = _converter(inner[0], where)
        if is_bool:
            raise TypeError(f"{where}: `bool | None` cannot be an option")
        return _parse_optional(parse, none_word=inner[0] is not str), False, choices
    if origin is Literal:
        choices = get_args(tp)
        if not all(isinstance(c, str) for c in choices):
            raise TypeError(f"{where}: only string Literals can be options")
        return _parse_choice(choices), False, choices
    if origin is tuple and get_args(tp)[1:] == (Ellipsis,) and get_args(tp)[0] is str:
        return _parse_words, False, ()
    simple: dict[Any, Callable[[str], Any]] = {str: str, int: _parse_int, float: _parse_float, Path: _parse_path}
    if tp is bool:
        return parse_bool, True, ()
    if tp in simple:
        return simple[tp], False, ()
    raise TypeError(f"{where}: a {tp} field cannot be an option; mark it {{'option': False}}")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return shlex.join(value) or "''"
    return str(value)


@dataclass(frozen=True)
class Option:
    """One dataclass field as a command-line option."""

    owner: type  # the dataclass the field belongs to
    name: str  # the field's name, and the argparse dest
    flags: tuple[str, ...]  # --field-name first, then any aliases
    env: str  # ARTGW_FIELD_NAME
    parse: Callable[[str], Any]  # text -> value; raises argparse.ArgumentTypeError
    is_bool: bool
    choices: tuple[str, ...]
    default: Any  # dataclasses.MISSING: required
    help: str
    inverse_env: str | None = None  # a variable that, when true, turns this bool off
    repeat: bool = False  # a repeated flag (one value each); the variable is a comma list
    computed: str | None = None  # the command computes the default (this text says how); None until given

    @property
    def flag(self) -> str:
        return self.flags[0]

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING and self.computed is None

    def help_text(self) -> str:
        if self.computed is not None:
            default = f"default: {self.computed}; "
        elif self.required:
            default = "required; "
        elif self.default is None:
            default = ""
        else:
            default = f"default: {_show(self.default)}; "
        env = f"env: {self.env}"
        if self.inverse_env:
            env += f", or {self.inverse_env}=1 for {self.flag.replace('--', '--no-', 1)}"
        # argparse %-formats help strings: a literal % must be doubled.
        return f"{self.help} ({default}{env})".replace("%", "%%")

    def from_env(self, environ: Mapping[str, str]) -> tuple[bool, Any]:
        """(found, value) from the environment; OptionError naming the variable for a bad value."""
        for name, invert in ((self.env, False), (self.inverse_env, True)):
            raw = environ.get(name) if name else None
            if not raw:  # unset or empty: compose's `${X:-}` writes an empty value for "not set"
                continue
            try:
                value = _parse_list(raw) if self.repeat else self.parse(raw)
            except argparse.ArgumentTypeError as exc:
                raise OptionError(f"{name}: {exc}") from None
            return True, (not value) if invert else value
        return False, None


def options_of(
    cls: type,
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
    help: Mapping[str, str] | None = None,
    computed: Mapping[str, str] | None = None,
) -> list[Option]:
    """The options a dataclass declares, in field order. `only`/`skip` pick fields; `help` supplies help
    for a dataclass whose fields carry none; `computed` maps fields whose default the command computes
    to the text the help shows for it."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in [*(only or ()), *skip, *(help or {}), *(computed or {})]:
        if name not in fields:
            raise TypeError(f"{cls.__name__} has no field {name!r}")
    hints = get_type_hints(cls)
    options = []
    for f in fields.values():
        if (only is not None and f.name not in only) or f.name in skip or f.metadata.get("option", True) is False:
            continue
        text = f.metadata.get("help") or (help or {}).get(f.name)
        if not text:
            raise TypeError(
                f"{cls.__name__}.{f.name} has no help: give metadata={{'help': ...}} or mark it not an option"
            )
        parse, is_bool, choices = _converter(hints[f.name], f"{cls.__name__}.{f.name}")
        repeat = bool(f.metadata.get("repeat"))
        if repeat:
            if parse is not _parse_words:
                raise TypeError(f"{cls.__name__}.{f.name}: only a tuple[str, ...] can be a repeated option")
            parse = str
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        options.append(
            Option(
                owner=cls,
                name=f.name,
                flags=(flag, *f.metadata.get("aliases", ())),
                env=f.metadata.get("env") or ENV_PREFIX + flag.removeprefix("--").replace("-", "_").upper(),
                parse=parse,
                is_bool=is_bool,
                choices=choices,
                default=default,
                help=text,
                inverse_env=f.metadata.get("inverse_env"),
                repeat=repeat,
                computed=(computed or {}).get(f.name),
            )
        )
    return options


def _section(cls: type, name: str) -> type | None:
    """The dataclass base of `cls` that declares field `name`, when `cls` is made of such sections."""
    for base in cls.__mro__[1:]:
        if dataclasses.is_dataclass(base) and name in inspect.get_annotations(base):
            return base
    return None


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
    help: Mapping[str, str] | None = None,
    computed: Mapping[str, str] | None = None,
) -> list[Option]:
    """Add a dataclass's options to `parser` (see `options_of`) and register them for `resolve`."""
    options = options_of(cls, only=only, skip=skip, help=help, computed=computed)
    groups: dict[type, argparse._ArgumentGroup] = {}
    for option in options:
        # A settings type made of sections (gateway/settings.py) shows each section's options under its title.
        section = _section(cls, option.name)
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if section is not None:
            if section not in groups:
                title = section.__name__.removesuffix("Settings").lower() + " options"
                groups[section] = parser.add_argument_group(title, (section.__doc__ or "").split("\n\n")[0])
            target = groups[section]
        # SUPPRESS: the attribute exists only when the flag was given, so `resolve` can tell
        # "given on the command line" from "take the environment or the default".
        common: dict[str, Any] = {"dest": option.name, "default": argparse.SUPPRESS, "help": option.help_text()}
        if option.is_bool:
            target.add_argument(*option.flags, action=argparse.BooleanOptionalAction, **common)
        elif option.repeat:
            metavar = option.flag.rsplit("-", 1)[-1].upper()  # the flag names one value: --model-name NAME
            target.add_argument(*option.flags, action="append", type=option.parse, metavar=metavar, **common)
        else:
            metavar = "{" + ",".join(option.choices) + "}" if option.choices else option.name.upper()
            target.add_argument(*option.flags, type=option.parse, metavar=metavar, **common)
    parser.set_defaults(**{_REGISTRY: [*(parser.get_default(_REGISTRY) or []), *options]})
    return options


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Give every registered option of the parsed command its value: the command line's, else the
    environment's, else the default (None for a computed one). OptionError for a bad variable or a
    required option with neither."""
    environ = os.environ if environ is None else environ
    given_names: set[str] = set()
    for option in getattr(args, _REGISTRY, ()):
        if hasattr(args, option.name):
            given_names.add(option.name)
            if option.repeat:  # argparse appends to a list
                setattr(args, option.name, tuple(getattr(args, option.name)))
            continue
        found, value = option.from_env(environ)
        if found:
            given_names.add(option.name)
        elif option.computed is not None:
            value = None
        elif option.required:
            raise OptionError(f"{option.flag} is required (or set {option.env})")
        else:
            value = option.default
        setattr(args, option.name, value)
    setattr(args, _GIVEN, given_names)


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The options of `cls` that the command line or the environment set (after `resolve`)."""
    names = getattr(args, _GIVEN)
    return {o.name: getattr(args, o.name) for o in getattr(args, _REGISTRY, ()) if o.owner is cls and o.name in names}


def build(cls: type[T], args: argparse.Namespace, **computed: Any) -> T:
    """`cls` from the options given (the dataclass's defaults for the rest) and the computed fields;
    its `__post_init__` rejects bad values with a ValueError."""
    return cls(**{**given(args, cls), **computed})
