"""The record a replica publishes in its ``replicas/{id}`` key: what it holds of each tenant's limits, what the
tenant asks of it, and the capacity it hands to other replicas (holdings.py keeps these; shares.py reads them).

A record is JSON, one entry per tenant and limit this replica holds something of (or asks for, or hands on)::

    {"tenants": {"team-a": {"rpm": {"cap": 540, "fill": 0.02, "ask": 610, "want": 2,
                                    "to": {"host-9-ab12": [7, 60, 1.2]}, "got": {"host-3-cd34": 4}},
                            "concurrency": {"cap": 5, "running": 4, "ask": 5}}}}

``cap``: the part of the limit it holds (rpm, tpm: per minute; concurrency: requests in flight); ``fill``: how
full its bucket of it is (1 full, below 0 in debt; rates only); ``running``: its requests in flight (concurrency);
``ask``: what the tenant asked of it lately (per minute, admitted or not; concurrency: how many it wanted in
flight); ``want``: what its requests waiting for capacity need now (requests, tokens, slots); ``short``: what it
refused lately for want of capacity (per minute; concurrency: requests a second); ``to``: capacity it
handed to a replica and that replica has not acknowledged yet, ``[sequence, cap, level]``; ``got``: the sequence of
the last hand-over it took from each replica whose record still shows one; ``heir_of``: replicas that left whose
part it took (replicas.py). Fields at their default are left out,
and so is a tenant this replica neither holds, asks, nor hands anything of: it holds its even part of what no
record holds (shares.py). Numbers are rounded so that a record changes only when something did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

KINDS = ("rpm", "tpm", "concurrency")
WINDOW = 60.0
"""Seconds a bucket takes to refill from empty: the rate limits are per minute."""
_FILL_STEP = 0.02


class InvalidRecord(ValueError):
    """A ``replicas/{id}`` value that cannot be read; the replica still counts, holding nothing."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """Capacity handed from one replica to another: ``cap`` of the limit with ``level`` of it unspent."""

    seq: int
    cap: float
    level: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Entry:
    """One tenant's limit as one replica's record has it (see the module's docstring)."""

    cap: float = 0.0
    fill: float = 1.0
    running: int = 0
    ask: float = 0.0
    want: float = 0.0
    short: float = 0.0
    to: Mapping[str, Transfer] = field(default_factory=dict)
    got: Mapping[str, int] = field(default_factory=dict)
    heir_of: tuple[str, ...] = ()

    @property
    def spare(self) -> float:
        """What this replica could hand on: its bucket's level (rates), its free slots (concurrency)."""
        return self.cap - self.running if self.running else self.cap * self.fill


Record = dict[str, dict[str, Entry]]
"""tenant -> limit kind -> entry."""

_DEFAULTS = Entry()


def rounded(value: float) -> float:
    """Two significant digits: a demand that drifts a little does not change the record."""
    return float(f"{value:.2g}") if value else 0.0


def rounded_up(value: float, digits: int = 3) -> float:
    """``digits`` significant digits, never below ``value`` (a capacity: what the others count as held must not
    be less than what is)."""
    if value <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(value)) - digits + 1)
    return float(f"{math.ceil(value / step - 1e-6) * step:.{digits}g}")


def rounded_fill(fill: float) -> float:
    return round(round(fill / _FILL_STEP) * _FILL_STEP, 2)


def exact(value: float) -> float:
    """A handed-over amount, taken as it is written: nine significant digits are plenty and stay stable."""
    return float(f"{value:.9g}")


def encode(record: Mapping[str, Mapping[str, Entry]]) -> bytes:
    """A record's bytes; equal records give equal bytes (so an unchanged record is not put again)."""
    tenants: dict[str, dict[str, dict[str, Any]]] = {}
    for tenant, kinds in record.items():
        out = {kind: _fields(entry) for kind, entry in kinds.items()}
        if out:
            tenants[tenant] = out
    return orjson.dumps({"tenants": tenants}, option=orjson.OPT_SORT_KEYS)


def _fields(entry: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("cap", "fill", "running", "ask", "want", "short"):
        value = getattr(entry, name)
        if value != getattr(_DEFAULTS, name):
            out[name] = int(value) if float(value).is_integer() else value
    if entry.to:
        out["to"] = {r: [t.seq, _number(t.cap), _number(t.level)] for r, t in entry.to.items()}
    if entry.got:
        out["got"] = dict(entry.got)
    if entry.heir_of:
        out["heir_of"] = sorted(entry.heir_of)
    return out


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def decode(value: bytes) -> Record:
    """The tenants of a record; an empty value (a replica with no limited tenant, or just started) has none.
    Raises ``InvalidRecord``; unknown fields (and limit kinds) are ignored."""
    if not value.strip():
        return {}
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError:
        raise InvalidRecord("the value is not JSON") from None
    tenants = parsed.get("tenants", {}) if isinstance(parsed, dict) else None
    if not isinstance(tenants, dict):
        raise InvalidRecord("the value is not a JSON object with a 'tenants' object")
    record: Record = {}
    for tenant, kinds in tenants.items():
        if not isinstance(kinds, dict):
            raise InvalidRecord(f"tenant {tenant!r}: not an object")
        record[str(tenant)] = {kind: _entry(tenant, kind, kinds[kind]) for kind in KINDS if kind in kinds}
    return record


def _entry(tenant: str, kind: str, fields: object) -> Entry:
    where = f"tenant {tenant!r} {kind}"
    if not isinstance(fields, dict):
        raise InvalidRecord(f"{where}: not an object")
    cap = _read(fields, "cap", 0.0, where, least=0.0)
    fill = min(1.0, _read(fields, "fill", 1.0, where))
    running = _read(fields, "running", 0.0, where, least=0.0)
    ask = _read(fields, "ask", 0.0, where, least=0.0)
    want = _read(fields, "want", 0.0, where, least=0.0)
    short = _read(fields, "short", 0.0, where, least=0.0)
    return Entry(
        cap=cap,
        fill=fill,
        running=int(running),
        ask=ask,
        want=want,
        short=short,
        to=_transfers(fields.get("to", {}), where),
        got=_acks(fields.get("got", {}), where),
        heir_of=_names(fields.get("heir_of", []), where),
    )


def _read(fields: Mapping[str, object], name: str, default: float, where: str, least: float | None = None) -> float:
    given = fields.get(name, default)
    if not _is_number(given):
        raise InvalidRecord(f"{where}: {name} must be a number")
    value = float(given)  # type: ignore[arg-type]
    if least is not None and value < least:
        raise InvalidRecord(f"{where}: {name} must be {least:g} or more")
    return value


def _is_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _transfers(given: object, where: str) -> dict[str, Transfer]:
    if not isinstance(given, dict):
        raise InvalidRecord(f"{where}: to must be an object")
    out = {}
    for replica, value in given.items():
        if not (isinstance(value, list) and len(value) == 3 and all(_is_number(v) for v in value)):
            raise InvalidRecord(f"{where}: to[{replica!r}] must be [sequence, cap, level]")
        seq, cap, level = value
        if not float(seq).is_integer() or seq < 1 or cap < 0:
            raise InvalidRecord(f"{where}: to[{replica!r}] must have a sequence of 1 or more and a cap of 0 or more")
        out[str(replica)] = Transfer(seq=int(seq), cap=float(cap), level=float(level))
    return out


def _names(given: object, where: str) -> tuple[str, ...]:
    if not isinstance(given, list) or not all(isinstance(name, str) for name in given):
        raise InvalidRecord(f"{where}: heir_of must be a list of replica ids")
    return tuple(given)


def _acks(given: object, where: str) -> dict[str, int]:
    if not isinstance(given, dict):
        raise InvalidRecord(f"{where}: got must be an object")
    out = {}
    for replica, seq in given.items():
        if not _is_number(seq) or not float(seq).is_integer():
            raise InvalidRecord(f"{where}: got[{replica!r}] must be a whole number")
        out[str(replica)] = int(seq)
    return out
