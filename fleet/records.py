"""The etcd key layout and node records, shared by the proxy and the registrar.

Key: ``{prefix}/{cluster}/{role}/{node_id}``. Value: a ``NodeRecord`` (protos/node_record.proto) as proto3
JSON, or empty, which means ``url=http://{node_id}``, status serving, models learned from the node.
"""

from __future__ import annotations

import ipaddress
import json
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from google.protobuf import json_format

from vllm_etcd_proxy.fleet.pb import node_record_pb2
from vllm_etcd_proxy.fleet.vllm import ModelCard, plain_numbers

MAX_VALUE_BYTES = 64 * 1024
"""A record larger than this is refused: real ones are a few hundred bytes."""


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


class Status(StrEnum):
    SERVING = "serving"
    DRAINING = "draining"


class Sleep(StrEnum):
    """The record's ``sleep`` mark (the proxy's node operations): a marked node gets no new requests."""

    AWAKE = ""
    DRAINING = "draining"
    """Going to sleep: no new requests; once idle the node is put to sleep."""
    ASLEEP = "asleep"
    """vLLM's sleep mode is on: woken on demand (``--wake-on-demand``) or by the admin API."""


class Source(StrEnum):
    """Where the proxy learned of a node."""

    ETCD = "etcd"
    STATIC = "static"
    ADMIN = "admin"


class InvalidRecord(ValueError):
    """A key or value in etcd that does not describe a node; the message says why."""


@dataclass(frozen=True, kw_only=True)
class Node:
    """One vLLM server as the proxy routes to it."""

    node_id: str
    role: Role
    url: str
    """Base URL without a trailing slash, e.g. ``http://10.0.0.5:8100``."""
    models: tuple[str, ...] = ()
    """Served model names; empty until learned from ``GET /v1/models`` when the record named none."""
    status: Status = Status.SERVING
    labels: Mapping[str, str] = field(default_factory=dict)
    source: Source = Source.ETCD
    key: str | None = None
    """The etcd key this node came from, if any."""
    learn_models: bool = False
    """True when the record named no models, so the proxy asks the node."""
    cards: Mapping[str, ModelCard] = field(default_factory=dict)
    """The node's own model list entries by model id (from the record's ``model_cards``), when it gave them."""
    kv_events: str | None = None
    """``tcp://HOST:PORT`` of the node's KV-cache event publisher (vLLM's ``--kv-events-config``), if any."""
    kv_events_replay: str | None = None
    """``tcp://HOST:PORT`` of that publisher's replay socket, if any."""
    sleep: Sleep = Sleep.AWAKE
    """The record's sleep mark: ``draining`` or ``asleep`` take the node out of routing."""

    @property
    def host_port(self) -> str:
        """``host:port`` of the URL, the form the seed's /status and admin API use."""
        return url_host_port(self.url)


_BAD_NODE_ID = re.compile(r"[\s/]")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*$")


def _valid_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return bool(_HOSTNAME.match(host))


def split_host_port(text: str) -> tuple[str, int]:
    """Parse ``host:port``, ``[ipv6]:port`` or ``hostname:port``; raise ``InvalidRecord`` otherwise."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not _valid_host(host):
        raise InvalidRecord(f"{text!r} is not host:port")
    port = int(port_text)
    if not 0 < port < 65536:
        raise InvalidRecord(f"{text!r} has port {port} outside 1-65535")
    return host, port


def validate_url(url: str) -> str:
    """Check a node URL (http/https, a host, no credentials, query or fragment); return it without trailing /.

    Messages never quote the URL: a refused one may carry a password.
    """
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidRecord("url is malformed") from None
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise InvalidRecord("url must not carry credentials")
    if parts.scheme not in ("http", "https"):
        raise InvalidRecord(f"url scheme {parts.scheme[:16]!r} is not http or https")
    if not parts.hostname:
        raise InvalidRecord("url has no host")
    if parts.query or parts.fragment:
        raise InvalidRecord("url must not have a query or fragment")
    if port == 0:
        raise InvalidRecord("url has port 0")
    return url.rstrip("/")


def validate_kv_endpoint(text: str, field_name: str = "kv_events") -> str:
    """Check a KV-event endpoint, ``tcp://HOST:PORT`` (a name, IPv4, or ``[IPv6]``); return it unchanged."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme != "tcp":
        raise InvalidRecord(f"{field_name} must be tcp://HOST:PORT, not {text[:64]!r}")
    try:
        split_host_port(rest)
    except InvalidRecord:
        raise InvalidRecord(f"{field_name} must be tcp://HOST:PORT, not {text[:64]!r}") from None
    return text


def kv_event_flags(items: Iterable[str]) -> tuple[tuple[str, str, str | None], ...]:
    """``--kv-events NODE=ENDPOINT[,REPLAY]`` values as (node, endpoint, replay); ValueError saying what is wrong."""
    found = []
    for item in items:
        node, sep, endpoints = item.partition("=")
        events, _, replay = endpoints.partition(",")
        try:
            if not sep or not node or not events:
                raise InvalidRecord("must be NODE=tcp://HOST:PORT[,tcp://HOST:PORT]")
            found.append((node, validate_kv_endpoint(events), validate_kv_endpoint(replay) if replay else None))
        except InvalidRecord as exc:
            raise ValueError(f"--kv-events {item!r}: {exc}") from None
    return tuple(found)


def url_host_port(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


KEY_PREFIX, CLUSTER = "/vllm", "default"
"""The contract's defaults of the key layout (and of ``--etcd-prefix`` and ``--cluster`` in every program)."""


@dataclass(frozen=True, kw_only=True)
class KeyLayout:
    """``{prefix}/{cluster}/{role}/{node_id}``: building and parsing keys."""

    prefix: str = KEY_PREFIX
    cluster: str = CLUSTER

    @property
    def cluster_prefix(self) -> str:
        """The prefix every replica watches, with a trailing slash."""
        return f"{self.prefix.rstrip('/')}/{self.cluster}/"

    def key(self, role: Role, node_id: str) -> str:
        return f"{self.cluster_prefix}{role.value}/{node_id}"

    def parse_key(self, key: str) -> tuple[Role, str]:
        """Split a key under ``cluster_prefix`` into role and node id."""
        if not key.startswith(self.cluster_prefix):
            raise InvalidRecord(f"key {key!r} is not under {self.cluster_prefix!r}")
        rest = key[len(self.cluster_prefix) :]
        role_text, sep, node_id = rest.partition("/")
        if not sep or not node_id:
            raise InvalidRecord(f"key {key!r} is not {self.cluster_prefix}ROLE/NODE_ID")
        try:
            role = Role(role_text)
        except ValueError:
            raise InvalidRecord(f"key {key!r} has unknown role {role_text!r}") from None
        if len(node_id) > 255 or _BAD_NODE_ID.search(node_id):
            raise InvalidRecord(f"key {key!r} has an invalid node id")
        return role, node_id

    def parse(self, key: bytes, value: bytes) -> Node:
        """Turn one etcd key/value into a ``Node``; raise ``InvalidRecord`` with the reason otherwise."""
        try:
            key_text = key.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRecord("key is not UTF-8") from None
        role, node_id = self.parse_key(key_text)
        if not value.strip():
            host, port = split_host_port(node_id)
            return Node(node_id=node_id, role=role, url=f"http://{host}:{port}", key=key_text, learn_models=True)
        record, obj = _decode(value)
        if record.role and record.role != role.value:
            raise InvalidRecord(f"record role {record.role!r} does not match key role {role.value!r}")
        url = validate_url(record.url) if record.url else None
        if url is None:
            host, port = split_host_port(node_id)
            url = f"http://{host}:{port}"
        try:
            status = Status(record.status or Status.SERVING.value)
        except ValueError:
            raise InvalidRecord(f"unknown status {record.status!r}") from None
        try:
            sleep = Sleep(record.sleep)
        except ValueError:
            raise InvalidRecord(f"unknown sleep mark {record.sleep[:32]!r}") from None
        models = tuple(dict.fromkeys(m for m in record.models if m))
        kv_events = validate_kv_endpoint(record.kv_events) if record.kv_events else None
        replay = validate_kv_endpoint(record.kv_events_replay, "kv_events_replay") if record.kv_events_replay else None
        return Node(
            node_id=node_id,
            role=role,
            url=url,
            models=models,
            status=status,
            labels=dict(record.labels),
            source=Source.ADMIN if record.source == "admin" else Source.ETCD,
            key=key_text,
            learn_models=not models,
            cards=_cards(obj.get("model_cards"), models),
            kv_events=kv_events,
            kv_events_replay=replay if kv_events else None,
            sleep=sleep,
        )


def _cards(given: object, models: tuple[str, ...]) -> dict[str, ModelCard]:
    """The record's model cards for the models it names (the proto parse already checked they are objects)."""
    cards: dict[str, ModelCard] = {}
    for card in given if isinstance(given, list) else ():
        model_id = card.get("id") if isinstance(card, dict) else None
        if isinstance(model_id, str) and model_id in models:
            cards.setdefault(model_id, plain_numbers(card))
    return cards


def decode_record(value: bytes) -> node_record_pb2.NodeRecord:
    """Parse a non-empty value as a NodeRecord in proto3 JSON (unknown fields ignored)."""
    return _decode(value)[0]


def _decode(value: bytes) -> tuple[node_record_pb2.NodeRecord, dict[str, object]]:
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidRecord(f"value is {len(value)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRecord("value is not UTF-8") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRecord(f"value is not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise InvalidRecord("value is not a JSON object")
    fast = _plain_record(obj)
    if fast is not None:
        return fast, obj
    try:
        return json_format.ParseDict(obj, node_record_pb2.NodeRecord(), ignore_unknown_fields=True), obj
    except json_format.ParseError as exc:
        raise InvalidRecord(f"value is not a node record: {exc}") from None


def set_cards(record: node_record_pb2.NodeRecord, cards: Iterable[ModelCard]) -> None:
    """Put a node's model list entries into ``record`` (replacing any it had), as many as fit in half of
    ``MAX_VALUE_BYTES`` (a node with hundreds of adapters keeps its model names; readers show plain cards)."""
    del record.model_cards[:]
    for card in cards:
        record.model_cards.add().update(dict(card))
    while record.model_cards and len(encode_record(record)) > MAX_VALUE_BYTES // 2:
        del record.model_cards[-1]


_FIELDS = {name: name for name in node_record_pb2.NodeRecord.DESCRIPTOR.fields_by_name} | {
    field.json_name: field.name for field in node_record_pb2.NodeRecord.DESCRIPTOR.fields
}
"""Every name proto3 JSON accepts for a NodeRecord field (``registered_at`` and ``registeredAt``) -> the field."""


def _plain_record(obj: dict[str, object]) -> node_record_pb2.NodeRecord | None:
    """The record of a value as registrars write it (known fields, strings, a list of strings, a map of strings)
    without json_format, which costs most of a burst's parsing; None for anything else, which json_format judges."""
    fields: dict[str, object] = {}
    for name, value in obj.items():
        field = _FIELDS.get(name)
        if field is None or field in fields:
            return None
        if field == "model_cards":
            if not isinstance(value, list) or not all(isinstance(c, dict) for c in value):
                return None
            continue  # read from the JSON itself (``_cards``), with its ints as ints
        if field == "models":
            if not isinstance(value, list) or not all(isinstance(m, str) for m in value):
                return None
        elif field == "labels":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                return None
        elif not isinstance(value, str):
            return None
        fields[field] = value
    return node_record_pb2.NodeRecord(**fields)  # type: ignore[arg-type]


def encode_record(record: node_record_pb2.NodeRecord) -> bytes:
    """Serialise a NodeRecord as compact proto3 JSON (field names as in the .proto)."""
    obj = json_format.MessageToDict(record, preserving_proto_field_name=True)
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()
