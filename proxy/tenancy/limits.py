"""One try at admitting a request on this replica: what it holds of the tenant's limits is enough (a ``Grant``),
or it is not (a ``Shortfall``, which says whether other replicas could hand over what is missing).

rpm admits a request while the bucket holds a whole unit; tpm while it is not in debt, on an estimate of the
request's tokens (``estimate_tokens``), charged what the node's ``usage`` says when it ends (the difference given
back or owed); concurrency while fewer requests run than the slots held. A refusal is OpenAI's 429 with
``Retry-After`` and the ``x-ratelimit-*`` headers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_etcd_proxy.proxy.errors import RateLimited
from vllm_etcd_proxy.proxy.tenancy.holdings import TenantCounters
from vllm_etcd_proxy.proxy.tenancy.keys import Limits
from vllm_etcd_proxy.proxy.tenancy.record import KINDS, WINDOW
from vllm_etcd_proxy.proxy.tenancy.shares import Fleet

CONCURRENCY_RETRY = 1
"""Retry-After (s) for a key at its concurrency limit: a request of its own may end any moment."""


def duration(seconds: float) -> str:
    """OpenAI's form of ``x-ratelimit-reset-*``: ``120ms``, ``6.5s``, ``1m30s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


def estimate_tokens(raw_length: int, body: dict[str, Any] | None) -> int:
    """Tokens a request is admitted on before the node counts them: its body's bytes / 4 (about one token per
    four bytes of English JSON) plus the tokens it asks for."""
    asked = 16
    if body is not None:
        for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(field)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                asked = value
                break
    return raw_length // 4 + asked


class Grant:
    """An admitted request's claim on its tenant: the limits it started with, what it reserved. ``on_end`` is
    called when it ends (a slot is free)."""

    __slots__ = ("counters", "limits", "reserved", "headers", "started", "on_end")

    def __init__(
        self,
        counters: TenantCounters,
        limits: Limits,
        reserved: int,
        headers: list[tuple[bytes, bytes]],
        started: float,
    ) -> None:
        self.counters = counters
        self.limits = limits
        self.reserved = reserved
        self.headers = headers
        self.started = started
        self.on_end: Callable[[], None] = lambda: None

    def reserve(self, estimate: int) -> None:
        """Reserve ``estimate`` tokens instead of what was reserved (a better estimate came)."""
        counters = self.counters
        counters.holding("tpm").level -= estimate - self.reserved
        self.reserved = estimate

    def finish(self, tokens: int | None, *, refund: bool = False) -> None:
        """The request ended: ``tokens`` used per the node (None: what was reserved stands); ``refund``: it was
        refused before it got anywhere (its body, its model), and its request of the rpm limit is given back."""
        counters = self.counters
        counters.running -= 1
        if self.limits.concurrency and not refund:
            counters.released(time.monotonic() - self.started)
        if self.limits.tpm and tokens is not None:
            counters.holding("tpm").level += self.reserved - tokens
        if self.limits.rpm and refund:
            counters.holding("rpm").level += 1
        self.on_end()


@dataclass(frozen=True, slots=True)
class Missing:
    kind: str
    want: float
    """What to ask the other replicas for (a unit, the request's tokens, a slot)."""
    least: float
    """The least that admits the request."""


class Shortfall:
    """A request this replica cannot admit now: what it misses of each limit, and whether the other replicas'
    records say they could hand it over (``waitable``)."""

    __slots__ = ("counters", "limits", "fleet", "missing", "waitable")

    def __init__(self, counters: TenantCounters, limits: Limits, fleet: Fleet, missing: list[Missing], now: float):
        self.counters, self.limits, self.fleet, self.missing = counters, limits, fleet, missing
        self.waitable = all(self._could_come(m, now) >= m.least or self._may_free(m) for m in missing)

    def _may_free(self, missing: Missing) -> bool:
        """A slot another replica holds may be handed over when one of its requests ends."""
        return missing.kind == "concurrency" and self.fleet.running_elsewhere(self.limits.tenant, missing.kind)

    def _could_come(self, missing: Missing, now: float) -> float:
        holding = self.counters.holding(missing.kind)
        mine = holding.cap + math.fsum(t.cap for t in holding.out.values())
        limit: int = getattr(self.limits, missing.kind)
        return self.fleet.available(self.limits.tenant, missing.kind, limit, mine, now, holding.taken)

    def wait(self, sign: int) -> None:
        """Add (1) or take back (-1) what the request wants while it waits."""
        for missing in self.missing:
            self.counters.holding(missing.kind).want += sign * missing.want

    def refusal(self, now: float) -> RateLimited:
        """The 429 (what was missing counts as refused here, for the shares' rebalancing)."""
        counters, limits, missing = self.counters, self.limits, self.missing[0]
        for m in self.missing:
            counters.refused[m.kind].add(m.want, now)
        name = limits.tenant
        if missing.kind == "concurrency":
            allowed = int(counters.holding("concurrency").effective(self.fleet, limits.concurrency, now) + 1e-9)
            return RateLimited(
                f"Concurrency limit reached for tenant {name}: Limit {limits.concurrency} requests in flight "
                f"({max(0, allowed)} on this replica now). Please try again in {CONCURRENCY_RETRY}s.",
                kind="concurrency",
                headers={"Retry-After": str(CONCURRENCY_RETRY), **_headers(counters, limits, now)},
            )
        limit: int = getattr(limits, missing.kind)
        holding = counters.holding(missing.kind)
        rate = max(holding.cap, limit / self.fleet.count)
        wait = missing.least * WINDOW / rate if rate > 0 else WINDOW
        what, label = _RATES[missing.kind]
        return RateLimited(
            f"Rate limit reached for tenant {name} on {label}: Limit {limit}. Please try again in {duration(wait)}.",
            kind=what,
            headers={"Retry-After": str(max(1, math.ceil(wait))), **_headers(counters, limits, now)},
        )


_RATES = {"rpm": ("requests", "requests per min (RPM)"), "tpm": ("tokens", "tokens per min (TPM)")}


def attempt(counters: TenantCounters, limits: Limits, fleet: Fleet, estimate: int, now: float) -> Grant | Shortfall:
    """Admit the request on what this replica holds of ``limits``' tenant, or say what is missing."""
    missing = [m for kind in KINDS if (m := _missing(counters, limits, kind, fleet, estimate, now)) is not None]
    if missing:
        return Shortfall(counters, limits, fleet, missing, now)
    if limits.rpm:
        counters.holding("rpm").level -= 1
    reserved = 0
    if limits.tpm:
        reserved = estimate
        counters.holding("tpm").level -= estimate
    counters.running += 1
    headers = _headers(counters, limits, now) if limits.rpm or limits.tpm else {}
    return Grant(counters, limits, reserved, [(k.encode(), v.encode()) for k, v in headers.items()], now)


def _missing(
    counters: TenantCounters, limits: Limits, kind: str, fleet: Fleet, estimate: int, now: float
) -> Missing | None:
    """What the request misses of one limit here (None: enough, or no such limit)."""
    limit: int = getattr(limits, kind)
    if not limit:
        return None
    holding = counters.holding(kind)
    cap = holding.prepare(fleet, limits.tenant, limit, now)
    if kind == "concurrency":
        return Missing(kind, 1.0, 1.0) if counters.running >= int(cap + 1e-9) else None
    if kind == "rpm":
        return Missing(kind, 1.0 - holding.level, 1.0 - holding.level) if holding.level < 1 - 1e-6 else None
    return Missing(kind, max(1.0, estimate - holding.level), 1e-6 - holding.level) if holding.level <= 0 else None


def _headers(counters: TenantCounters, limits: Limits, now: float) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*``: the key's fleet limits; what this replica would admit now of what it holds, and
    when its bucket is full again."""
    out: dict[str, str] = {}
    for kind, what in (("rpm", "requests"), ("tpm", "tokens")):
        limit: int = getattr(limits, kind)
        if not limit:
            continue
        holding = counters.holding(kind)
        fill = holding.level / holding.cap if holding.cap > 0 else 1.0
        out[f"x-ratelimit-limit-{what}"] = str(limit)
        out[f"x-ratelimit-remaining-{what}"] = str(max(0, math.floor(holding.level + 1e-9)))
        out[f"x-ratelimit-reset-{what}"] = duration((1 - min(1.0, fill)) * WINDOW)
    return out
