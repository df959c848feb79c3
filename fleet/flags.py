"""Flags and environment, read alike by every program (proxy, registrar, simulated node).

Every flag ``--some-flag`` also reads ``<PREFIX>SOME_FLAG``; a flag given on the command line wins over the
environment (list flags too: the command line's list replaces the environment's, it does not add to it). List
flags take a comma-separated list from the environment, switches 1/true/yes/on. The etcd password comes from
``--etcd-password`` (or its variable) or from the first line of ``--etcd-password-file``; giving both is an
error, not a precedence.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection, Mapping, Sequence


def environment_defaults(
    parser: argparse.ArgumentParser,
    prefix: str,
    argv: Sequence[str],
    lists: Collection[str] = (),
    environ: Mapping[str, str] = os.environ,
) -> None:
    """Make ``<prefix><DEST>`` variables the defaults of the flags not on ``argv``; raises ``ValueError``
    naming the variable when a value does not convert to the flag's type."""
    defaults: dict[str, object] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version") or _given(action, argv):
            continue
        name = prefix + action.dest.upper()
        text = environ.get(name)
        if not text:
            continue
        if action.dest in lists:
            defaults[action.dest] = [item.strip() for item in text.split(",") if item.strip()]
        elif isinstance(action.const, bool) and action.nargs == 0:  # store_true / store_false
            defaults[action.dest] = (text.strip().lower() in _TRUE) == action.const
        elif callable(action.type):
            try:
                defaults[action.dest] = action.type(text)
            except ValueError:
                raise ValueError(f"{name}={text!r} is not a valid {action.option_strings[0]}") from None
        else:
            defaults[action.dest] = text
    parser.set_defaults(**defaults)


_TRUE = frozenset({"1", "true", "yes", "on"})


def _given(action: argparse.Action, argv: Sequence[str]) -> bool:
    options = action.option_strings
    return any(arg in options or arg.split("=", 1)[0] in options for arg in argv if arg.startswith("-"))


def read_password(password: str | None, password_file: str | None) -> str | None:
    """The etcd password; raises ``ValueError`` when both sources are given or the file cannot be read."""
    if password and password_file:
        raise ValueError("give --etcd-password or --etcd-password-file, not both")
    if not password_file:
        return password or None
    try:
        with open(password_file, encoding="utf-8") as handle:
            return handle.readline().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"--etcd-password-file {password_file}: {exc.strerror or exc}") from None
