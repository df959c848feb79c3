"""``vllm-registrar``: flags and ``VLLM_REGISTRAR_*`` environment -> settings; logging; exit codes.

Every flag also reads ``VLLM_REGISTRAR_<FLAG>`` (``--etcd-password`` -> ``VLLM_REGISTRAR_ETCD_PASSWORD``); a flag
on the command line wins. ``--label`` from the environment is a comma-separated ``k=v,k2=v2`` list.
Exit codes: 0 after a drain, 2 for bad usage, 1 when etcd is unreachable at start (or on a bug), the child's
code in wrapper mode (126/127 when the command cannot be run). Errors before the start are one stderr line.
The flag definitions hold every default (RegistrarSettings has none); values are checked in ``parse_command_line``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from vllm_etcd_proxy.fleet.etcd import (
    DEAD_AFTER,
    KEEPALIVE_TIME,
    KEEPALIVE_TIMEOUT,
    TIMEOUT,
    EtcdSettings,
    parse_endpoints,
)
from vllm_etcd_proxy.fleet.flags import environment_defaults, read_password
from vllm_etcd_proxy.fleet.records import (
    CLUSTER,
    KEY_PREFIX,
    InvalidRecord,
    KeyLayout,
    Role,
    url_host_port,
    validate_url,
)
from vllm_etcd_proxy.fleet.tls import NodeTlsSettings
from vllm_etcd_proxy.fleet.version import add_version_flag
from vllm_etcd_proxy.registrar.errors import StartupError, UsageError
from vllm_etcd_proxy.registrar.kvconfig import from_child, published
from vllm_etcd_proxy.registrar.runner import Runner
from vllm_etcd_proxy.registrar.settings import MAX_TTL, MIN_TTL, RegistrarSettings

PROG = "vllm-registrar"
ENV_PREFIX = "VLLM_REGISTRAR_"
LOG_LEVEL = "INFO"
logger = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        usage=f"{PROG} --etcd URL[,URL...] --role ROLE --url http(s)://HOST:PORT [options] [-- COMMAND ARGS...]",
        description="Register a vLLM node in etcd under a lease while it is healthy; drain it on SIGTERM. "
        "With '-- COMMAND', run the node as a child process too.",
        epilog=f"Every flag also reads {ENV_PREFIX}<FLAG>, e.g. {ENV_PREFIX}ETCD_PASSWORD; the flag wins.",
    )
    add_version_flag(p)
    add = p.add_argument
    add("--etcd", metavar="URL[,URL...]", help="etcd endpoints (required)")
    add("--role", metavar="ROLE", help="prefill, decode or mixed (required)")
    add("--url", metavar="URL", help="the node's base URL, http://HOST:PORT or https://HOST:PORT (required)")
    add("--cluster", default=CLUSTER, help="cluster segment of the key (default: %(default)s)")
    add("--etcd-prefix", metavar="PREFIX", default=KEY_PREFIX, help="key prefix (default: %(default)s)")
    add("--node-id", metavar="ID", help="last key segment (default: HOST:PORT of --url)")
    # A dead node keeps its traffic for up to one TTL; 10 s rides out etcd's hiccups.
    add("--ttl", metavar="S", default=10, help=f"lease TTL in seconds, {MIN_TTL}-{MAX_TTL} (default: %(default)s)")
    add(
        "--models",
        metavar="auto|A,B",
        default="auto",
        help="served models, or auto to ask GET /v1/models (default: %(default)s)",
    )
    add("--label", metavar="K=V", action="append", help="a label for the record; repeatable")
    add(
        "--drain-timeout",
        metavar="S",
        default=30,
        help="longest wait on SIGTERM for in-flight requests; in wrapper mode also how long the command gets "
        "between SIGTERM and SIGKILL if the registrar is killed (default: %(default)s)",
    )
    add("--health-interval", metavar="S", default=2, help="seconds between health checks (default: %(default)s)")
    add("--health-timeout", metavar="S", default=2, help="seconds one probe request may take (default: %(default)s)")
    add(
        "--unhealthy-after",
        metavar="N",
        default=3,
        help="failed checks in a row before withdrawal (default: %(default)s)",
    )
    # The etcd flags' defaults are fleet.etcd's, shared with vllm-proxy and with EtcdSettings.
    add(
        "--etcd-timeout",
        metavar="S",
        default=TIMEOUT,
        help=f"seconds per etcd request and for the first connect (default: {TIMEOUT:g})",
    )
    add(
        "--etcd-dead-after",
        metavar="S",
        default=DEAD_AFTER,
        help="seconds without an answer after which the lease keep-alive (or "
        "the key's watch) counts as dead (a silent partition) and reconnects, to another endpoint if there are "
        f"several; the lease is refreshed every third of this at least (default: {DEAD_AFTER:g})",
    )
    add(
        "--etcd-keepalive-time",
        metavar="S",
        default=KEEPALIVE_TIME,
        help="seconds between gRPC pings on a busy etcd connection, 5 or more: etcd refuses faster pings "
        f"(default: {KEEPALIVE_TIME:g})",
    )
    add(
        "--etcd-keepalive-timeout",
        metavar="S",
        default=KEEPALIVE_TIMEOUT,
        help=f"seconds to wait for a ping's answer before gRPC drops the connection (default: {KEEPALIVE_TIMEOUT:g})",
    )
    add(
        "--node-ca-bundle",
        metavar="FILE",
        help="PEM CAs that an https:// node's certificate must chain to (default: the system's)",
    )
    add("--node-cert", metavar="FILE", help="PEM client certificate for a node that requires one")
    add("--node-key", metavar="FILE", help="the PEM private key of --node-cert (default: in its file)")
    add("--etcd-cacert", metavar="FILE", help="CA bundle to verify etcd's server certificate")
    add("--etcd-cert", metavar="FILE", help="client certificate for etcd")
    add("--etcd-key", metavar="FILE", help="private key of --etcd-cert")
    add("--etcd-user", metavar="USER", help="etcd user")
    add("--etcd-password", metavar="PW", help="etcd password (prefer the environment or a file)")
    add("--etcd-password-file", metavar="FILE", help="file whose first line is the etcd password")
    add(
        "--kv-events",
        metavar="ENDPOINT",
        help="tcp://HOST:PORT where the node publishes its KV-cache events "
        "(vLLM's --kv-events-config endpoint); in wrapper mode read from the child's --kv-events-config",
    )
    add("--kv-events-replay", metavar="ENDPOINT", help="tcp://HOST:PORT of that publisher's replay socket")
    add("--log-level", metavar="LEVEL", default=LOG_LEVEL, help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    return p


def _number(text: str | float, flag: str, *, low: float, high: float = math.inf) -> float:
    """A flag's value (its text, or the default) as seconds within ``low`` and ``high``."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag} must be a number of seconds, not {text!r}") from None
    if not low <= value <= high:
        raise UsageError(f"{flag} must be between {low:g} and {high:g}, not {text}")
    return value


def _integer(text: str | int, flag: str, *, low: int, high: int) -> int:
    """A flag's value (its text, or the default) as a whole number from ``low`` to ``high``."""
    if not str(text).strip().isdigit() or not low <= int(text) <= high:
        raise UsageError(f"{flag} must be a whole number from {low} to {high}, not {text!r}")
    return int(text)


def _labels(items: Sequence[str] | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--label must be KEY=VALUE, not {item!r}")
        labels[key.strip()] = value
    return labels


def parse_command_line(argv: Sequence[str]) -> tuple[RegistrarSettings, int]:
    """Flags (plus environment) -> (settings, log level); raise ``UsageError`` saying what is wrong."""
    argv, command = _split_command(argv)
    parser = build_parser()
    try:
        environment_defaults(parser, ENV_PREFIX, argv, lists={"label"})
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    args = parser.parse_args(argv)
    for flag in ("etcd", "role", "url"):
        if not getattr(args, flag):
            raise UsageError(f"--{flag} is required (or {ENV_PREFIX}{flag.upper()})")
    role = _role(args.role)
    url = _url(args.url)
    layout, node_id = _key(args, role, url)
    models = _models(args.models)
    etcd = _etcd(args)
    node_tls = _node_tls(args)
    kv_events, kv_replay = _kv_events(args, command, url)
    settings = RegistrarSettings(
        etcd=etcd,
        role=role,
        url=url,
        node_tls=node_tls,
        node_id=node_id,
        cluster=layout.cluster,
        prefix=layout.prefix,
        ttl=_integer(args.ttl, "--ttl", low=MIN_TTL, high=MAX_TTL),
        models=models,
        labels=_labels(args.label),
        drain_timeout=_number(args.drain_timeout, "--drain-timeout", low=0, high=24 * 3600),
        health_interval=_number(args.health_interval, "--health-interval", low=0.05, high=3600),
        health_timeout=_number(args.health_timeout, "--health-timeout", low=0.05, high=300),
        unhealthy_after=_integer(args.unhealthy_after, "--unhealthy-after", low=1, high=1000),
        command=command,
        kv_events=kv_events,
        kv_events_replay=kv_replay,
    )
    return settings, _log_level(args.log_level)


def _split_command(argv: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    """The registrar's own flags, and the wrapped command after ``--`` (empty for a sidecar)."""
    argv = list(argv)
    if "--" not in argv:
        return argv, ()
    split = argv.index("--")
    command = tuple(argv[split + 1 :])
    if not command:
        raise UsageError("'--' must be followed by a command")
    return argv[:split], command


def _role(text: str) -> Role:
    try:
        return Role(text)
    except ValueError:
        raise UsageError(f"--role must be prefill, decode or mixed, not {text!r}") from None


def _url(text: str) -> str:
    try:
        return validate_url(text)
    except InvalidRecord as exc:
        raise UsageError(f"--url: {exc}") from None


def _key(args: argparse.Namespace, role: Role, url: str) -> tuple[KeyLayout, str]:
    """The key's layout and node id, checked to make a key the proxies accept."""
    node_id = args.node_id or url_host_port(url)
    # An empty --etcd-prefix or --cluster means the default.
    layout = KeyLayout(prefix=args.etcd_prefix or KEY_PREFIX, cluster=args.cluster or CLUSTER)
    if "/" in layout.cluster or not layout.cluster.strip():
        raise UsageError(f"--cluster must be a non-empty name without '/', not {layout.cluster!r}")
    try:
        layout.parse_key(layout.key(role, node_id))
    except InvalidRecord:
        raise UsageError(f"--node-id must have no '/' or spaces and at most 255 characters: {node_id!r}") from None
    return layout, node_id


def _models(text: str) -> tuple[str, ...] | None:
    """``--models``: the names given, or None for auto (asked of the node)."""
    if text.strip() == "auto":
        return None
    models = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    if not models:
        raise UsageError("--models must be auto or a comma-separated list of model names")
    return models


def _etcd(args: argparse.Namespace) -> EtcdSettings:
    try:
        password = read_password(args.etcd_password, args.etcd_password_file)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        etcd = EtcdSettings(
            endpoints=parse_endpoints(args.etcd),
            timeout=_number(args.etcd_timeout, "--etcd-timeout", low=0.1, high=300),
            dead_after=_number(args.etcd_dead_after, "--etcd-dead-after", low=0.3, high=600),
            keepalive_time=_number(args.etcd_keepalive_time, "--etcd-keepalive-time", low=5, high=3600),
            keepalive_timeout=_number(args.etcd_keepalive_timeout, "--etcd-keepalive-timeout", low=0.1, high=600),
            cacert=args.etcd_cacert,
            cert=args.etcd_cert,
            key=args.etcd_key,
            user=args.etcd_user,
            password=password,
        )
    except ValueError as exc:
        raise UsageError(f"--etcd: {exc}") from None
    for flag, path in (("--etcd-cacert", etcd.cacert), ("--etcd-cert", etcd.cert), ("--etcd-key", etcd.key)):
        if path is not None and not os.access(path, os.R_OK):
            raise UsageError(f"{flag} {path}: not a readable file")
    return etcd


def _kv_events(args: argparse.Namespace, command: tuple[str, ...], url: str) -> tuple[str | None, str | None]:
    """The node's KV-event publisher and replay socket: the flags', else the wrapped command's
    ``--kv-events-config``."""
    kv_events, kv_replay = from_child(command, url) if command else (None, None)
    if args.kv_events:
        kv_events, kv_replay = published(args.kv_events, url, "--kv-events"), None
    if args.kv_events_replay:
        if not kv_events:
            raise UsageError("--kv-events-replay needs --kv-events (or the child's --kv-events-config)")
        kv_replay = published(args.kv_events_replay, url, "--kv-events-replay")
    return kv_events, kv_replay


def _node_tls(args: argparse.Namespace) -> NodeTlsSettings:
    node_tls = NodeTlsSettings(ca_bundle=args.node_ca_bundle, cert=args.node_cert, key=args.node_key)
    try:
        node_tls.context()  # checked now: a file that cannot be used is a usage error, not a node that never answers
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return node_tls


def _log_level(text: str) -> int:
    level = logging.getLevelName((text or LOG_LEVEL).upper())
    if not isinstance(level, int):
        raise UsageError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, not {text!r}")
    return level


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        settings, level = parse_command_line(argv)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # httpx logs every probe at INFO; that is noise every --health-interval.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    try:
        return asyncio.run(Runner(settings).run())
    except StartupError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # a SIGINT before the handlers were installed
        return 130
    except Exception:
        logger.exception("registrar failed")
        return 1
