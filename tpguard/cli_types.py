"""Option types the commands share (tpguard/cli.py, launch/options.py): a name among choices and a
comma-separated list. Typer callbacks, so a bad value is a one-line usage error (exit 2)."""

from __future__ import annotations

from collections.abc import Callable

import typer


def one_of(*choices: str) -> Callable:
    """The value must be one of `choices` (the option's help lists them, "a | b")."""

    def check(value):
        if value is not None and value not in choices:
            raise typer.BadParameter(f"{value!r} is not one of {' | '.join(choices)}")
        return value

    return check


def comma_list(cast: Callable = str) -> Callable:
    """"a,b,c" -> a tuple of `cast` values (empty items dropped)."""

    def convert(text):
        if text is None or isinstance(text, tuple):  # unset, or a default given as a tuple
            return text
        try:
            return tuple(cast(t) for t in text.split(",") if t.strip())
        except ValueError:
            raise typer.BadParameter(f"{text!r}: expected comma-separated {cast.__name__} values") from None

    return convert
