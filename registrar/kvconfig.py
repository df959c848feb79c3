"""What the wrapped vLLM's command line says of the node: where it publishes its KV-cache events (the registrar's
flags, or the child's ``--kv-events-config``), and which side of a KV transfer it can be (``--kv-transfer-config``).

vLLM's ``--kv-events-config`` is a JSON KVEventsConfig: ``enable_kv_cache_events``, ``publisher`` ("zmq"),
``endpoint`` (default ``tcp://*:5557``), ``replay_endpoint``, ``topic``. vLLM binds an endpoint whose host is
``*`` (or ``::``); proxies elsewhere reach it at the host of the node's ``--url``, which is what the record says.

vLLM's ``--kv-transfer-config`` is a JSON KVTransferConfig: ``kv_connector`` (e.g. "NixlConnector") and
``kv_role``: ``kv_producer`` (it can prefill for another node), ``kv_consumer`` (it can decode from another's
prefill) or ``kv_both`` (either, request by request: the registry's role ``both``).
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Sequence

from vllm_etcd_proxy.fleet.records import InvalidRecord, Role, validate_kv_endpoint
from vllm_etcd_proxy.registrar.errors import UsageError

FLAG = "--kv-events-config"
TRANSFER_FLAG = "--kv-transfer-config"
KV_ROLES = {"kv_producer": Role.PREFILL, "kv_consumer": Role.DECODE, "kv_both": Role.BOTH}
"""A node's role when its ``kv_role`` says it and ``--role`` is not given."""
PLAYS = {
    "kv_producer": frozenset([Role.PREFILL, Role.MIXED]),
    "kv_consumer": frozenset([Role.DECODE, Role.MIXED]),
    "kv_both": frozenset(Role),
}
"""The roles a node of each ``kv_role`` can be registered as (a kv_both node may be held to one side)."""
DEFAULT_ENDPOINT = "tcp://*:5557"
"""vLLM's default publisher endpoint."""
_WILDCARDS = ("*", "[::]", "::", "0.0.0.0")


def child_config(command: Sequence[str], flag: str = FLAG) -> str | None:
    """The JSON text of ``flag`` in the child's command line (``FLAG JSON`` or ``FLAG=JSON``)."""
    for i, arg in enumerate(command):
        if arg == flag and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None


def _child_json(command: Sequence[str], flag: str) -> dict[str, object] | None:
    """The child's ``flag`` as a JSON object (None without the flag); ``UsageError`` when it is not one."""
    text = child_config(command, flag)
    if text is None:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"the child's {flag} is not JSON: {exc.msg}") from None
    if not isinstance(config, dict):
        raise UsageError(f"the child's {flag} is not a JSON object")
    return config


def child_transfer(command: Sequence[str]) -> tuple[str | None, str | None]:
    """(kv_role, kv_connector) of the child's ``--kv-transfer-config``; (None, None) without one."""
    config = _child_json(command, TRANSFER_FLAG)
    if config is None:
        return None, None
    kv_role, connector = config.get("kv_role"), config.get("kv_connector")
    if kv_role is not None and (not isinstance(kv_role, str) or kv_role not in KV_ROLES):
        known = ", ".join(KV_ROLES)
        raise UsageError(f"the child's {TRANSFER_FLAG} has kv_role {str(kv_role)[:32]!r}, not one of {known}")
    return kv_role, connector if isinstance(connector, str) else None


def node_role(given: Role | None, kv_role: str | None) -> Role:
    """The role to register: ``--role`` when given (one the child's kv_role can play), else the kv_role's."""
    if given is None:
        if kv_role is None:
            raise UsageError(f"--role is required (or a child whose {TRANSFER_FLAG} names its kv_role)")
        return KV_ROLES[kv_role]
    if kv_role is not None and given not in PLAYS[kv_role]:
        raise UsageError(f"--role {given.value} does not fit the child's {TRANSFER_FLAG} kv_role {kv_role}")
    return given


def published(endpoint: str, url: str, field: str) -> str:
    """``endpoint`` as other hosts reach it: a wildcard host becomes the host of ``url``; then validated."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if sep and colon and host in _WILDCARDS:
        name = urllib.parse.urlsplit(url).hostname or ""
        endpoint = f"{scheme}://{f'[{name}]' if ':' in name else name}:{port}"
    try:
        return validate_kv_endpoint(endpoint, field)
    except InvalidRecord as exc:
        raise UsageError(str(exc)) from None


def from_child(command: Sequence[str], url: str) -> tuple[str | None, str | None]:
    """(events, replay) endpoints the child's ``--kv-events-config`` publishes on; (None, None) without one."""
    config = _child_json(command, FLAG)
    if config is None:
        return None, None
    if not config.get("enable_kv_cache_events") or config.get("publisher", "zmq") != "zmq":
        return None, None
    endpoint, replay = config.get("endpoint", DEFAULT_ENDPOINT), config.get("replay_endpoint")
    if not isinstance(endpoint, str) or not (replay is None or isinstance(replay, str)):
        raise UsageError(f"the child's {FLAG} has an endpoint that is not a string")
    events = published(endpoint, url, "kv_events")
    return events, published(replay, url, "kv_events_replay") if replay else None
