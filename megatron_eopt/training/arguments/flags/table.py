"""`Flag`: one row of a flag table, and `add_flags`, which turns rows into argparse arguments.

A row holds the option, its type, default, choices and help; the flag it needs (`needs`); and
its status: active, `NO_EFFECT` (accepted, changes nothing here, named at start-up with `reason`)
or `REFUSED` (a one-line error with `reason`). Exclusions between flags live in the checks, whose
messages say why each pair cannot go together.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional

ACTIVE = "active"
NO_EFFECT = "changes nothing here"
REFUSED = "refused"


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


AUTO: Any = _Auto()  # argparse's own default: False for a switch, None for a value


@dataclass(frozen=True)
class Flag:
    option: str
    type: Optional[Callable[[str], Any]] = None
    default: Any = AUTO
    help: str = ""
    choices: Optional[tuple] = None
    action: Optional[str] = None  # 'store_true' / 'store_false' (a switch); None takes a value
    nargs: Any = None
    dest: Optional[str] = None  # default: the option's name with '_' for '-'
    aliases: tuple[str, ...] = ()  # further spellings of the option
    metavar: Any = None
    needs: Optional[str] = None  # the flag (dest) it only applies with
    status: str = ACTIVE
    reason: str = ""  # why it changes nothing here or is refused

    @property
    def name(self) -> str:
        return self.dest or self.option.lstrip("-").replace("-", "_")

    def kwargs(self) -> dict[str, Any]:
        """`add_argument` keyword arguments."""
        kwargs: dict[str, Any] = {"dest": self.name, "help": self.help or self.reason or None}
        for key in ("type", "choices", "action", "nargs", "metavar"):
            if getattr(self, key) is not None:
                kwargs[key] = getattr(self, key)
        if self.default is not AUTO:
            kwargs["default"] = self.default
        return kwargs


def switch(option: str, help: str = "", **fields: Any) -> Flag:
    """A `store_true` flag."""
    return Flag(option, action="store_true", help=help, **fields)


def add_flags(parser: argparse.ArgumentParser, title: str, rows: Iterable[Flag]) -> None:
    group = parser.add_argument_group(title=title)
    for row in rows:
        group.add_argument(row.option, *row.aliases, **row.kwargs())


def option_of(name: str) -> str:
    """The command-line spelling of a dest."""
    return "--" + name.replace("_", "-")


def replaced(args: argparse.Namespace, **values: Any) -> argparse.Namespace:
    """A new namespace: `args` with `values` (defaults resolved); `args` itself is left as parsed."""
    return argparse.Namespace(**{**vars(args), **values})


def settings_from_flags(args: argparse.Namespace, cls: type, computed: Mapping[str, Any],
                        renamed: Mapping[str, str] = {}, skip: Iterable[str] = ()) -> Any:
    """`cls(...)`, a dataclass of settings, from the flags by name: each field is `computed[field]`,
    else the flag `renamed[field]`, else the flag of the same name (not in `skip`; None keeps the
    field's default)."""
    skip = set(skip)
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in computed:
            values[field.name] = computed[field.name]
        elif field.name in renamed:
            values[field.name] = getattr(args, renamed[field.name])
        elif field.name not in skip and getattr(args, field.name, None) is not None:
            values[field.name] = getattr(args, field.name)
    return cls(**values)


def given_needing(args: argparse.Namespace, rows: Iterable[Flag], needed: str) -> list[str]:
    """The options of `rows` that need the flag `needed` (their `needs` column) and were given."""
    return [row.option for row in rows if row.needs == needed and getattr(args, row.name) not in (None, False)]
