"""Print the README's flag tables for vllm-proxy, vllm-registrar and vllm-sim, from their real argument parsers
(the same source as their ``--help``), so the tables can be regenerated when a flag changes:

    .venv/bin/python docs/gen_flags.py > /tmp/flags.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_etcd_proxy.proxy.flags import ENV_PREFIX as PROXY_ENV  # noqa: E402
from vllm_etcd_proxy.proxy.flags import build_parser as proxy_parser  # noqa: E402
from vllm_etcd_proxy.registrar.cli import ENV_PREFIX as REGISTRAR_ENV  # noqa: E402
from vllm_etcd_proxy.registrar.cli import build_parser as registrar_parser  # noqa: E402
from vllm_etcd_proxy.sim.cli import _parser as sim_parser  # noqa: E402

EXTRA_ENV = {("vllm-proxy", "admin_key"): "ADMIN_API_KEY"}
"""Variables read besides the prefix rule."""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    repeat = " ..." if action.nargs in ("+", "*") else ""
    return f"{names} `{metavar}{repeat}`"


def _description(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    # As --help shows it: a help text names its flag's default as %(default)s, never a copy of the value.
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    if action.choices:
        text += f" (one of: {', '.join(map(str, action.choices))})"
    default = action.default
    unset = default is None or default is False or default in ("", [], argparse.SUPPRESS)
    if "default" not in text and not unset:
        text += f" (default: {default})"
    if isinstance(action, argparse._AppendAction | argparse._ExtendAction) or action.nargs in ("+", "*"):
        text += "; repeatable" if "repeatable" not in text else ""
    return _cell(text)


def table(prog: str, parser: argparse.ArgumentParser, env_prefix: str) -> str:
    lines = [
        f"### `{prog}`",
        "",
        "```",
        parser.format_usage().strip(),
        "```",
        "",
        "| flag | environment | meaning |",
        "| --- | --- | --- |",
    ]
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        env = f"`{env_prefix}{action.dest.upper()}`"
        extra = EXTRA_ENV.get((prog, action.dest))
        if extra:
            env += f", `{extra}`"
        lines.append(f"| {_flag(action)} | {env} | {_description(parser, action)} |")
    return "\n".join(lines)


def main() -> None:
    tables = [
        table("vllm-proxy", proxy_parser(), PROXY_ENV),
        table("vllm-registrar", registrar_parser(), REGISTRAR_ENV),
        table("vllm-sim", sim_parser(), "VLLM_SIM_"),
    ]
    print("\n\n".join(tables))


if __name__ == "__main__":
    main()
