"""What a replica's tenants asked of it lately, and the record it publishes about them in its ``replicas/{id}`` key.

Demand is what a tenant asked, admitted or not: requests and (estimated) tokens as rates that decay with a time
constant of ``TAU`` seconds, and the requests it would have in flight. Every replica reads
the others' records (replicas.py) and splits each limit in proportion (shares.py).

A record is JSON, one entry per tenant with a limit that asked something lately::

    {"tenants": {"team-a": {"rpm": 610, "rpm_fill": 0.02, "rpm_cap": 590, "tpm": 51000, "tpm_fill": 0.4,
                            "tpm_cap": 190000, "tpm_gave": 0.5, "concurrency": 5, "running": 4}}}

``rpm`` and ``tpm``: what it asked per minute; ``*_fill``: how full this replica's bucket of that limit is (1 full,
below 0 in debt), ``*_cap`` its capacity (this replica's share, or the larger one it is about to take),
``*_gave`` its fill when its share last shrank (1 when it never did); ``concurrency``: how many requests it
would have in flight here if none were refused (what it asks a second times how long a request holds a slot,
and at least the most it wanted at once lately); ``running``: how many run now. Fields a limit does not have,
and values at their default, are left out. A tenant absent from a record asked nothing lately, its buckets
there are full and it runs nothing there. A demand is published again only when it moved by more than a quarter
(``Steady``), fills rounded to 0.02, so that a record changes only when something did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import orjson

TAU = 2.0
"""Seconds over which demand fades by a factor e: how fast shares follow traffic that moves to another replica."""
STEADY = 1.25
"""A published demand changes when the measured one is more than this factor away from it."""
_FILL_STEP = 0.02


class InvalidRecord(ValueError):
    """A ``replicas/{id}`` value that cannot be read; the replica still counts, with no demand."""


class Decaying:
    """A value that fades by a factor e every ``TAU`` seconds: a rate (``add``) or a peak (``reach``)."""

    __slots__ = ("value", "at")

    def __init__(self) -> None:
        self.value = 0.0
        self.at = 0.0

    def read(self, now: float) -> float:
        return self.value * math.exp(-(now - self.at) / TAU) if self.value else 0.0

    def add(self, amount: float, now: float) -> None:
        """``amount`` more units were asked now (the value is then a rate per second)."""
        self.value = self.read(now) + amount / TAU
        self.at = now

    def reach(self, level: float, now: float) -> None:
        """``level`` was wanted now (the value is then the recent peak)."""
        self.value = max(level, self.read(now))
        self.at = now


class Steady:
    """A demand as published: it follows the measure only once that moved by more than a factor ``STEADY``.
    A steady tenant's split then stays put: every change of split hands part of a bucket to replicas that may
    not give it back as full (a replica that gives takes at once, one that receives a second and a half later)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def follow(self, measured: float) -> float:
        if not measured or not self.value or not 1 / STEADY <= measured / self.value <= STEADY:
            self.value = rounded(measured)
        return self.value


@dataclass(frozen=True, kw_only=True, slots=True)
class TenantReport:
    """One tenant's entry in a replica's record (see the module's docstring)."""

    rpm: float = 0.0
    rpm_fill: float = 1.0
    rpm_cap: float = 0.0
    rpm_gave: float = 1.0
    tpm: float = 0.0
    tpm_fill: float = 1.0
    tpm_cap: float = 0.0
    tpm_gave: float = 1.0
    concurrency: float = 0.0
    running: int = 0

    def demand(self, kind: str) -> float:
        """What the tenant asked of this replica for ``kind`` (``rpm``, ``tpm`` or ``concurrency``)."""
        value: float = getattr(self, kind)
        return value

    def given_fill(self, kind: str, share: float) -> float:
        """How full the part this replica gave of its ``share`` of the ``kind`` limit was: its bucket's fill
        while it holds that share still (it has not spent since, or it would have followed), else its fill when
        it last gave (1 when it never gave: a share above the one its bucket started with was never used)."""
        cap: float = getattr(self, f"{kind}_cap")
        if not cap or cap >= share * (1 - 1e-6):
            value: float = getattr(self, f"{kind}_fill")
        else:
            value = getattr(self, f"{kind}_gave")
        return value


_FILLS = ("_fill", "_gave")
NO_REPORT = TenantReport()
"""What a record without the tenant says: nothing asked, buckets full, nothing running."""
_DEFAULTS = asdict(NO_REPORT)


def rounded(value: float) -> float:
    """Two significant digits: a demand that drifts a little does not change the record."""
    return float(f"{value:.2g}") if value else 0.0


def rounded_up(value: float) -> float:
    """Three significant digits, never below ``value`` (a capacity: a replica that still holds a share must not
    look as if it had given part of it)."""
    if value <= 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(value)) - 2)
    return float(f"{math.ceil(value / step - 1e-9) * step:.3g}")


def rounded_fill(fill: float) -> float:
    return round(round(fill / _FILL_STEP) * _FILL_STEP, 2)


def encode(reports: Mapping[str, TenantReport]) -> bytes:
    """A record's bytes; equal reports give equal bytes (so an unchanged record is not put again)."""
    tenants = {}
    for tenant, report in reports.items():
        fields = {k: v for k, v in asdict(report).items() if v != _DEFAULTS[k]}
        tenants[tenant] = {k: int(v) if float(v).is_integer() else v for k, v in fields.items()}
    return orjson.dumps({"tenants": tenants}, option=orjson.OPT_SORT_KEYS)


def decode(value: bytes) -> dict[str, TenantReport]:
    """The tenants of a record; an empty value (a replica with no limited tenant, or of an older version) has
    none. Raises ``InvalidRecord``; unknown fields are ignored."""
    if not value.strip():
        return {}
    try:
        parsed = orjson.loads(value)
    except orjson.JSONDecodeError:
        raise InvalidRecord("the value is not JSON") from None
    tenants = parsed.get("tenants", {}) if isinstance(parsed, dict) else None
    if not isinstance(tenants, dict):
        raise InvalidRecord("the value is not a JSON object with a 'tenants' object")
    return {str(tenant): _report(tenant, fields) for tenant, fields in tenants.items()}


def _report(tenant: str, fields: object) -> TenantReport:
    if not isinstance(fields, dict):
        raise InvalidRecord(f"tenant {tenant!r}: not an object")
    values: dict[str, float] = {}
    for name, default in _DEFAULTS.items():
        given = fields.get(name, default)
        if isinstance(given, bool) or not isinstance(given, int | float) or not math.isfinite(given):
            raise InvalidRecord(f"tenant {tenant!r}: {name} must be a number")
        if given < 0 and not name.endswith(_FILLS):
            raise InvalidRecord(f"tenant {tenant!r}: {name} must be 0 or more")
        values[name] = min(float(given), 1.0) if name.endswith(_FILLS) else float(given)
    running = int(values.pop("running"))
    return TenantReport(**values, running=running)
