"""LoRA adapters registered once for a whole fleet: ``{prefix}/{cluster}/adapters/{name}`` holds an
``AdapterRecord`` (protos/adapter_record.proto) in proto3 JSON, e.g. ``{"path": "/loras/sql", "base": "llama"}``.

``name`` is what clients put in ``model`` and what the proxy loads the adapter as (vLLM's ``lora_name``);
``path`` is vLLM's ``lora_path``; ``base`` the served name of the base model whose nodes may load it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from google.protobuf import json_format

from vllm_etcd_proxy.fleet.pb import adapter_record_pb2
from vllm_etcd_proxy.fleet.records import MAX_VALUE_BYTES, InvalidRecord, KeyLayout

FOLDER = "adapters"
"""The folder under the cluster prefix that holds the adapters."""


@dataclass(frozen=True, kw_only=True)
class Adapter:
    name: str
    path: str
    base: str
    labels: Mapping[str, str] = field(default_factory=dict)


def adapter_key(layout: KeyLayout, name: str) -> str:
    return f"{layout.cluster_prefix}{FOLDER}/{name}"


def check_name(name: str) -> str:
    """``name`` if it can be an adapter's name (a model name: no slash, no spaces, not empty)."""
    if not name or "/" in name or name != name.strip() or any(c.isspace() for c in name) or len(name) > 256:
        raise InvalidRecord(f"adapter name {name[:64]!r} is empty, too long, or has a slash or a space")
    return name


def parse_adapter(name: str, value: bytes) -> Adapter:
    """The adapter a key of the folder holds; raises ``InvalidRecord`` with the reason otherwise."""
    check_name(name)
    if len(value) > MAX_VALUE_BYTES:
        raise InvalidRecord(f"value is {len(value)} bytes, more than {MAX_VALUE_BYTES}")
    try:
        obj = json.loads(value.decode("utf-8"))
    except UnicodeDecodeError:
        raise InvalidRecord("value is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise InvalidRecord(f"value is not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise InvalidRecord("value is not a JSON object")
    try:
        record = json_format.ParseDict(obj, adapter_record_pb2.AdapterRecord(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise InvalidRecord(f"value is not an adapter record: {exc}") from None
    if not record.path.strip() or not record.base.strip():
        raise InvalidRecord("an adapter record needs a non-empty path and base")
    return Adapter(name=name, path=record.path, base=record.base, labels=dict(record.labels))


def adapter_value(path: str, base: str, labels: Mapping[str, str] | None = None) -> bytes:
    """The value to put for an adapter (what ``parse_adapter`` reads back)."""
    record = adapter_record_pb2.AdapterRecord(path=path, base=base, labels=dict(labels or {}))
    return json_format.MessageToJson(record, indent=None, preserving_proto_field_name=True).encode()
