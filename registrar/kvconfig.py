"""Where a node publishes its KV-cache events: the registrar's flags, or the child's ``--kv-events-config``.

vLLM's ``--kv-events-config`` is a JSON KVEventsConfig: ``enable_kv_cache_events``, ``publisher`` ("zmq"),
``endpoint`` (default ``tcp://*:5557``), ``replay_endpoint``, ``topic``. vLLM binds an endpoint whose host is
``*`` (or ``::``); proxies elsewhere reach it at the host of the node's ``--url``, which is what the record says.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Sequence

from vllm_etcd_proxy.fleet.records import InvalidRecord, validate_kv_endpoint
from vllm_etcd_proxy.registrar.errors import UsageError

FLAG = "--kv-events-config"
DEFAULT_ENDPOINT = "tcp://*:5557"
"""vLLM's default publisher endpoint."""
_WILDCARDS = ("*", "[::]", "::", "0.0.0.0")


def child_config(command: Sequence[str]) -> str | None:
    """The JSON text of ``--kv-events-config`` in the child's command line (``FLAG JSON`` or ``FLAG=JSON``)."""
    for i, arg in enumerate(command):
        if arg == FLAG and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith(FLAG + "="):
            return arg[len(FLAG) + 1 :]
    return None


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
    text = child_config(command)
    if text is None:
        return None, None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"the child's {FLAG} is not JSON: {exc.msg}") from None
    if not isinstance(config, dict):
        raise UsageError(f"the child's {FLAG} is not a JSON object")
    if not config.get("enable_kv_cache_events") or config.get("publisher", "zmq") != "zmq":
        return None, None
    endpoint, replay = config.get("endpoint", DEFAULT_ENDPOINT), config.get("replay_endpoint")
    if not isinstance(endpoint, str) or not (replay is None or isinstance(replay, str)):
        raise UsageError(f"the child's {FLAG} has an endpoint that is not a string")
    events = published(endpoint, url, "kv_events")
    return events, published(replay, url, "kv_events_replay") if replay else None
