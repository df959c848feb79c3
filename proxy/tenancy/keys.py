"""The key set: client keys, each naming a tenant and its limits, from ``--api-key``/``--api-key-file`` and etcd.

A file line is ``KEY [tenant=NAME] [rpm=N] [tpm=N] [concurrency=N] [priority=N] [share=N]`` (a bare ``KEY`` is a
tenant of its own, named by the key's short hash); an etcd key ``{prefix}/{cluster}/keys/{sha256 hex of KEY}``
holds the same fields as JSON. Only SHA-256 digests are kept: a presented key is hashed and looked up by its
digest, and the entry found is compared with ``hmac.compare_digest``. The lookup's timing depends on the digest
of what the client sent, which tells it nothing about any real key. Keys are never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import orjson

from vllm_etcd_proxy.proxy.errors import Unauthorized
from vllm_etcd_proxy.proxy.tenancy.bearer import bearer_token

log = logging.getLogger(__name__)

_FIELDS = ("rpm", "tpm", "concurrency", "priority", "share")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_TENANT = re.compile(r"[A-Za-z0-9_.:@/-]{1,64}")


class InvalidKey(ValueError):
    """A key line or etcd value that cannot be used (the message never contains the key)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """One key's tenant and limits; 0 means no limit (priority 0 is vLLM's default)."""

    tenant: str
    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0
    priority: int | None = None
    """The priority of the key's requests for the queue (lower is more urgent); None: the body's."""
    share: int = 1
    """The tenant's weight among the tenants waiting in a queue."""

    @property
    def limited(self) -> bool:
        return bool(self.rpm or self.tpm or self.concurrency)


def digest_of(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def short_name(digest: bytes) -> str:
    """The tenant name of a key that names none."""
    return "key-" + digest.hex()[:12]


def _number(field: str, value: object) -> int:
    if isinstance(value, str) and re.fullmatch(r"-?\d{1,12}", value):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidKey(f"{field} must be an integer")
    if field != "priority" and value < 0:
        raise InvalidKey(f"{field} must be 0 or more")
    if field == "share" and value < 1:
        raise InvalidKey("share must be 1 or more")
    return value


def limits_from(fields: Mapping[str, object], digest: bytes) -> Limits:
    """Limits from a key's fields (file or etcd); unknown fields are refused in a file, ignored in etcd."""
    tenant = fields.get("tenant")
    if tenant is None or tenant == "":
        tenant = short_name(digest)
    if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
        raise InvalidKey("tenant must be 1-64 characters of letters, digits and _.:@/-")
    numbers = {f: _number(f, fields[f]) for f in _FIELDS if fields.get(f) is not None}
    return Limits(tenant=tenant, **numbers)


def parse_line(line: str) -> tuple[bytes, Limits]:
    """(digest, limits) of one ``--api-key-file`` line (already stripped, not a comment)."""
    key, *pairs = line.split()
    digest = digest_of(key)
    fields: dict[str, object] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in ("tenant", *_FIELDS):
            raise InvalidKey(f"unknown field {name!r} (fields: tenant, {', '.join(_FIELDS)})")
        fields[name] = value
    return digest, limits_from(fields, digest)


def parse_value(name: str, value: bytes) -> tuple[bytes, Limits]:
    """(digest, limits) of an etcd key ``keys/{name}``; an empty value is a key of its own tenant."""
    if not _DIGEST.fullmatch(name):
        raise InvalidKey("the key name must be the SHA-256 of the client key, 64 lowercase hex digits")
    digest = bytes.fromhex(name)
    if not value.strip():
        return digest, limits_from({}, digest)
    try:
        fields = orjson.loads(value)
    except orjson.JSONDecodeError:
        raise InvalidKey("the value is not JSON") from None
    if not isinstance(fields, dict):
        raise InvalidKey("the value is not a JSON object")
    return digest, limits_from(fields, digest)


def read_key_file(path: str, on_invalid: Callable[[int, str], None]) -> dict[bytes, Limits]:
    """Every valid line of the file; ``on_invalid(line_number, reason)`` for the others. Raises OSError."""
    entries: dict[bytes, Limits] = {}
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            try:
                digest, limits = parse_line(line)
            except InvalidKey as exc:
                on_invalid(number, str(exc))
                continue
            entries[digest] = limits
    return entries


class KeySet:
    """The valid client keys by digest, from three sources merged (flags, the file, etcd); empty: open API.

    ``check`` is the request path's one call: ``None`` while no key is configured, else the key's ``Limits``."""

    def __init__(self, flag_keys: Iterable[str] = ()) -> None:
        self._flags = {digest_of(k): limits_from({}, digest_of(k)) for k in flag_keys if k}
        self._file: dict[bytes, Limits] = {}
        self._etcd: dict[bytes, Limits] = {}
        self._by_digest: dict[bytes, tuple[bytes, Limits]] = {d: (d, v) for d, v in self._flags.items()}
        self._tenants = {limits.tenant: limits for limits in self._flags.values()}
        self.version = 0
        """Changes with every change of the set (so callers can tell a reload happened)."""

    def __len__(self) -> int:
        return len(self._by_digest)

    def _merge(self) -> None:
        merged = {**self._flags, **self._file, **self._etcd}
        self._by_digest = {digest: (digest, limits) for digest, limits in merged.items()}
        self._tenants = {limits.tenant: limits for limits in merged.values()}
        self.version += 1

    def tenants(self) -> Mapping[str, Limits]:
        """The tenants named by the set now (the one source of tenant labels), by name; several keys of one
        tenant share its counters, and the limits of the one merged last."""
        return self._tenants

    def set_file(self, entries: Mapping[bytes, Limits]) -> None:
        self._file = dict(entries)
        self._merge()

    def set_etcd(self, entries: Mapping[bytes, Limits]) -> None:
        self._etcd = dict(entries)
        self._merge()

    def put_etcd(self, digest: bytes, limits: Limits | None) -> None:
        if limits is None:
            self._etcd.pop(digest, None)
        else:
            self._etcd[digest] = limits
        self._merge()

    def check(self, authorization: str | bytes | None) -> Limits | None:
        """401 unless ``authorization`` is ``Bearer <a key of the set>``; None when the set is empty."""
        table = self._by_digest
        if not table:
            return None
        token = bearer_token(authorization)
        if token is None:
            raise Unauthorized("an API key is required: send it as 'Authorization: Bearer <key>'")
        given = digest_of(token)
        found = table.get(given)
        if found is None or not hmac.compare_digest(found[0], given):
            raise Unauthorized("the API key is not valid")
        return found[1]
