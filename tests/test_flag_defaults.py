"""A default is written once, in the flag definitions (STYLE.md): settings built from flags restate none; a type
that keeps defaults for callers without flags (EtcdSettings, KeyLayout, ...) keeps its flag's; help texts state
the defaults their flags have; and the README's flag tables are what ``docs/gen_flags.py`` prints."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_etcd_proxy.fleet.etcd import EtcdSettings
from vllm_etcd_proxy.fleet.records import KeyLayout
from vllm_etcd_proxy.fleet.tls import NodeTlsSettings
from vllm_etcd_proxy.proxy.discovery.ejection import EjectionSettings
from vllm_etcd_proxy.proxy.flags import build_parser as proxy_parser
from vllm_etcd_proxy.proxy.settings import ProxySettings, TimeoutSettings
from vllm_etcd_proxy.proxy.tenancy.queue import QueueSettings
from vllm_etcd_proxy.registrar.cli import build_parser as registrar_parser
from vllm_etcd_proxy.registrar.settings import RegistrarSettings
from vllm_etcd_proxy.sim.cli import _parser as sim_parser
from vllm_etcd_proxy.sim.settings import SimSettings

ROOT = Path(__file__).resolve().parent.parent
PARSERS = {"vllm-proxy": proxy_parser, "vllm-registrar": registrar_parser, "vllm-sim": sim_parser}

BUILT_FROM_FLAGS: dict[type, set[str]] = {
    ProxySettings: set(),
    TimeoutSettings: set(),
    EjectionSettings: set(),
    RegistrarSettings: set(),
    SimSettings: {"set_cookie", "kv_events_drop", "kv_events_corrupt", "kv_events_encoding", "kv_events_hash"},
}
"""Settings made from parsed flags only, with the fields no flag sets (runtime knobs, which keep a default)."""

ETCD = {
    "timeout": "etcd_timeout",
    "dead_after": "etcd_dead_after",
    "keepalive_time": "etcd_keepalive_time",
    "keepalive_timeout": "etcd_keepalive_timeout",
    "cacert": "etcd_cacert",
    "cert": "etcd_cert",
    "key": "etcd_key",
    "user": "etcd_user",
    "password": "etcd_password",
    "burst_events": None,
    "burst_window": None,
}
LAYOUT = {"prefix": "etcd_prefix", "cluster": "cluster"}
NODE_TLS = {"ca_bundle": "node_ca_bundle", "cert": "node_cert", "key": "node_key"}
KEPT_DEFAULTS = [
    (EtcdSettings, "vllm-proxy", {**ETCD, "burst_pause": "etcd_burst_pause"}),
    (EtcdSettings, "vllm-registrar", {**ETCD, "burst_pause": None}),
    (KeyLayout, "vllm-proxy", LAYOUT),
    (KeyLayout, "vllm-registrar", LAYOUT),
    (NodeTlsSettings, "vllm-proxy", NODE_TLS),
    (NodeTlsSettings, "vllm-registrar", NODE_TLS),
    (QueueSettings, "vllm-proxy", {"recheck": None}),
]
"""Types with defaults for callers without flags (tests, benchmarks, library use): each defaulted field and the
flag that sets it in a program (None: no flag does)."""


def _defaults(cls: type) -> dict[str, object]:
    """The fields of dataclass ``cls`` that have a default, with it."""
    found: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            found[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            found[f.name] = f.default_factory()
    return found


@pytest.mark.parametrize("cls", list(BUILT_FROM_FLAGS), ids=lambda cls: cls.__name__)
def test_settings_built_from_flags_restate_none_of_their_defaults(cls: type) -> None:
    restated = sorted(set(_defaults(cls)) - BUILT_FROM_FLAGS[cls])
    assert restated == [], f"{cls.__name__} has defaults of its own for {restated}: they belong to the flags"


@pytest.mark.parametrize(
    ("cls", "program", "flags"), KEPT_DEFAULTS, ids=[f"{cls.__name__}-{program}" for cls, program, _ in KEPT_DEFAULTS]
)
def test_a_default_kept_for_callers_without_flags_is_the_flags_default(
    cls: type, program: str, flags: dict[str, str | None]
) -> None:
    parser = PARSERS[program]()
    dests = {action.dest for action in parser._actions}
    for name, value in _defaults(cls).items():
        assert name in flags, f"{cls.__name__}.{name} has a default: name the {program} flag that sets it (or None)"
        dest = flags[name]
        if dest is None:
            continue
        assert dest in dests, f"{program} has no flag {dest}"
        flag_default = parser.get_default(dest)
        assert value == flag_default, f"{cls.__name__}.{name} is {value!r}, {program}'s {dest} {flag_default!r}"


_STATED = re.compile(r"\(default:? (\d+(?:\.\d+)?)( MiB| KiB)?[;:)]")
_UNITS = {None: 1, " MiB": 1 << 20, " KiB": 1 << 10}


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    return parser._get_formatter()._expand_help(action) if action.help else ""


@pytest.mark.parametrize("program", list(PARSERS))
def test_help_texts_state_the_defaults_their_flags_have(program: str) -> None:
    parser = PARSERS[program]()
    stated = 0
    for action in parser._actions:
        for number, unit in _STATED.findall(_help(parser, action)):
            stated += 1
            flag = action.option_strings[0]
            assert isinstance(action.default, int | float), f"{flag} says default {number} but has {action.default!r}"
            assert float(number) * _UNITS[unit or None] == action.default, f"{flag}: {_help(parser, action)}"
    assert stated or program == "vllm-sim"  # the sim's table shows its defaults as gen_flags.py appends them


def test_the_readme_flag_tables_are_the_parsers() -> None:
    tables = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_flags.py")], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert tables.strip() in (ROOT / "README.md").read_text(encoding="utf-8"), (
        "README.md's flag tables are stale: regenerate them with docs/gen_flags.py"
    )
