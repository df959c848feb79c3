"""A tenant's counters on this replica, and the share of the fleet's limits it enforces.

Each of R live replicas (replicas.py) enforces limit/R: ``rpm`` and ``tpm`` as token buckets that hold a minute's
worth of the share and refill it continuously over a minute, ``concurrency`` as ceil(limit/R) requests in flight.
A request is admitted while the tpm bucket is not in debt, on an estimate of its tokens (``estimate_tokens``),
and charged what the node's ``usage`` says when it ends; the difference is given back or owed.
"""

from __future__ import annotations

import math
import time
from typing import Any

from vllm_etcd_proxy.proxy.errors import RateLimited
from vllm_etcd_proxy.proxy.tenancy.keys import Limits

WINDOW = 60.0
"""Seconds a bucket takes to refill from empty: the limits are per minute."""
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


class Bucket:
    """``level`` of a token bucket whose capacity and refill follow the limit's share (they change with R)."""

    __slots__ = ("level", "at")

    def __init__(self) -> None:
        self.level = math.inf  # full, whatever the capacity turns out to be
        self.at = 0.0

    def refill(self, capacity: float, now: float) -> float:
        self.level = min(capacity, self.level + (now - self.at) * capacity / WINDOW)
        self.at = now
        return self.level

    @staticmethod
    def wait(capacity: float, missing: float) -> float:
        """Seconds until ``missing`` more units have flowed in."""
        return missing * WINDOW / capacity if capacity > 0 else WINDOW


class TenantCounters:
    """One tenant's use of this replica: kept across key reloads while the tenant exists."""

    __slots__ = ("requests", "tokens", "running")

    def __init__(self) -> None:
        self.requests = Bucket()
        self.tokens = Bucket()
        self.running = 0


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
    """An admitted request's claim on its tenant: the limits it started with, what it reserved."""

    __slots__ = ("counters", "limits", "replicas", "reserved", "headers")

    def __init__(
        self, counters: TenantCounters, limits: Limits, replicas: int, reserved: int, headers: list[tuple[bytes, bytes]]
    ) -> None:
        self.counters = counters
        self.limits = limits
        self.replicas = replicas
        self.reserved = reserved
        self.headers = headers

    def finish(self, tokens: int | None) -> None:
        """The request ended: ``tokens`` used per the node (None: what was reserved stands)."""
        counters = self.counters
        counters.running -= 1
        if self.limits.tpm and tokens is not None:
            counters.tokens.level += self.reserved - tokens


def admit(counters: TenantCounters, limits: Limits, replicas: int, estimate: int) -> Grant:
    """Take one request for ``limits``' tenant on this replica, or raise ``RateLimited`` naming the limit hit."""
    now = time.monotonic()
    name = limits.tenant
    if limits.concurrency:
        share = math.ceil(limits.concurrency / replicas)
        if counters.running >= share:
            raise RateLimited(
                f"Concurrency limit reached for tenant {name}: Limit {limits.concurrency} requests in flight "
                f"({share} on this replica of {replicas}). Please try again in {CONCURRENCY_RETRY}s.",
                kind="concurrency",
                headers={"Retry-After": str(CONCURRENCY_RETRY), **_headers(counters, limits, replicas, now)},
            )
    if limits.rpm:
        capacity = limits.rpm / replicas
        if counters.requests.refill(capacity, now) < 1:
            wait = Bucket.wait(capacity, 1 - counters.requests.level)
            raise _over(
                f"requests per min (RPM): Limit {limits.rpm}", "requests", wait, counters, limits, replicas, now
            )
    if limits.tpm:
        capacity = limits.tpm / replicas
        if counters.tokens.refill(capacity, now) <= 0:
            wait = Bucket.wait(capacity, 1 - counters.tokens.level)
            raise _over(f"tokens per min (TPM): Limit {limits.tpm}", "tokens", wait, counters, limits, replicas, now)
    if limits.rpm:
        counters.requests.level -= 1
    reserved = 0
    if limits.tpm:
        reserved = estimate
        counters.tokens.level -= estimate
    counters.running += 1
    headers = _headers(counters, limits, replicas, now) if limits.rpm or limits.tpm else {}
    return Grant(counters, limits, replicas, reserved, [(k.encode(), v.encode()) for k, v in headers.items()])


def _over(
    what: str, kind: str, wait: float, counters: TenantCounters, limits: Limits, replicas: int, now: float
) -> RateLimited:
    retry = max(1, math.ceil(wait))
    return RateLimited(
        f"Rate limit reached for tenant {limits.tenant} on {what}. Please try again in {duration(wait)}.",
        kind=kind,
        headers={"Retry-After": str(retry), **_headers(counters, limits, replicas, now)},
    )


def _headers(counters: TenantCounters, limits: Limits, replicas: int, now: float) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*``: the key's fleet limits; what is left, as this replica's share times R."""
    out: dict[str, str] = {}
    for kind, limit, bucket in (("requests", limits.rpm, counters.requests), ("tokens", limits.tpm, counters.tokens)):
        if not limit:
            continue
        capacity = limit / replicas
        level = bucket.refill(capacity, now)
        out[f"x-ratelimit-limit-{kind}"] = str(limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level * replicas)))
        out[f"x-ratelimit-reset-{kind}"] = duration(Bucket.wait(capacity, capacity - level))
    return out
