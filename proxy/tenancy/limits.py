"""A tenant's counters on this replica, and the part of the fleet's limits it enforces.

Each replica enforces its share of each limit (shares.py: in proportion to where the tenant's demand is): ``rpm``
and ``tpm`` as token buckets that hold a minute's worth of the share and refill it continuously over a minute,
``concurrency`` as a count of requests in flight. A request is admitted while the tpm bucket is not in debt, on an
estimate of its tokens (``estimate_tokens``), and charged what the node's ``usage`` says when it ends; the
difference is given back or owed.

When the shares move, what is left in the buckets moves with them, so that the fleet never holds more than one
bucket's worth: a replica whose share shrinks keeps its bucket as full as it was, in proportion; one whose share
grows gets the new part as full as the buckets of the replicas that gave it up were (their records say). A
bucket's fill then changes at 1/60 a second whatever its share, so a replica can follow its shares lazily, when
the tenant next asks. A share that grows is taken ``SETTLE`` seconds after it was first seen: by then every
replica that gave it up has seen that and published its state after it (its fill, and its fill when it gave),
so what it spent in its last second before is not handed on as unspent. It is taken at once when they are known
to hold nothing of the tenant (their records have none of it and are older than a publish takes). A concurrency
share never takes slots that another replica's requests still hold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from vllm_etcd_proxy.proxy.errors import RateLimited
from vllm_etcd_proxy.proxy.tenancy.demand import Decaying, Steady, TenantReport, rounded_fill, rounded_up
from vllm_etcd_proxy.proxy.tenancy.keys import Limits
from vllm_etcd_proxy.proxy.tenancy.shares import Fleet

WINDOW = 60.0
"""Seconds a bucket takes to refill from empty: the limits are per minute."""
CONCURRENCY_RETRY = 1
"""Retry-After (s) for a key at its concurrency limit: a request of its own may end any moment."""
SETTLE = 1.5
"""Seconds before a replica takes a larger share: longer than a record takes to be published (1 s) and watched,
so that what the replicas that gave it up spent or still run is in their records by then."""
HELD_WEIGHT = 0.2
"""Weight of the latest request in the moving average of how long requests hold a slot."""
IDLE = 1e-3
"""A demand below this part of the limit (and a full bucket, nothing running) is no longer published."""


def duration(seconds: float) -> str:
    """OpenAI's form of ``x-ratelimit-reset-*``: ``120ms``, ``6.5s``, ``1m30s``."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s"


class Bucket:
    """A token bucket whose capacity is this replica's share of a per-minute limit; ``follow`` moves it to the
    share of a new split (by replica), the level with it."""

    __slots__ = ("level", "at", "capacity", "split", "rising", "target", "gave")

    def __init__(self) -> None:
        self.level = 0.0
        self.at = 0.0
        self.capacity = 0.0
        self.split: Mapping[str, float] | None = None
        """The split last followed (None: never used on this replica)."""
        self.rising: float | None = None
        """Since when a larger share (``target``) waits to be taken."""
        self.target = 0.0
        self.gave = 1.0
        """The fill when the share last shrank (the part given was that full)."""

    @property
    def fill(self) -> float:
        return self.level / self.capacity if self.capacity > 0 else 1.0

    @property
    def claimed(self) -> float:
        """The share this bucket holds or is about to take (what the others must not count as given)."""
        return max(self.capacity, self.target) if self.rising is not None else self.capacity

    def refill(self, now: float) -> float:
        if self.capacity > 0:
            self.level = min(self.capacity, self.level + (now - self.at) * self.capacity / WINDOW)
        self.at = now
        return self.level

    def follow(self, split: Mapping[str, float], fleet: Fleet, tenant: str, kind: str, now: float) -> None:
        if split is self.split:
            return
        me = fleet.me
        new = split.get(me, 0.0)
        if self.split is None:
            # First use here: full, as the share was while no bucket held it.
            self.level, self.capacity, self.split, self.at = new, new, split, now
            return
        old = self.capacity
        self.refill(now)
        if new > old:
            if self.rising is None:
                self.rising = now
            self.target = new
            if now - self.rising < SETTLE and not fleet.quiet_givers(self.split, split, tenant, now):
                return  # what the givers spent in their last second is in their records only by then
            # etcd away: the others still hold what the frozen records say they gave; only the refill grows.
            fill = 0.0 if fleet.decay(now) else _fill_given(self.split, split, me, fleet, tenant, kind, self.fill)
            self.level += (new - old) * fill
        elif new < old:
            self.gave = self.fill
            self.level *= new / old
        self.capacity, self.split, self.rising = new, split, None

    def wait(self, missing: float, limit: int, count: int, now: float) -> float:
        """Seconds until ``missing`` more units have flowed in, at this replica's share or, when that is less,
        the even one (a tenant that keeps asking here gets more of the limit within a second or two), or until a
        larger share waiting to be taken is."""
        rate = max(self.capacity, limit / count)
        wait = missing * WINDOW / rate if rate > 0 else WINDOW
        return min(wait, max(0.0, self.rising + SETTLE - now)) if self.rising is not None else wait


def _fill_given(
    old: Mapping[str, float],
    new: Mapping[str, float],
    me: str,
    fleet: Fleet,
    tenant: str,
    kind: str,
    default: float,
) -> float:
    """How full the part of the limit the other replicas gave up from ``old`` to ``new`` was, from their records
    (weighted by what each gave); ``default`` when none gave anything."""
    given = {r: share - new.get(r, 0.0) for r, share in old.items() if r != me and share > new.get(r, 0.0)}
    total = math.fsum(given.values())
    if total <= 0:
        return default
    parts = (fleet.given_fill(r, tenant, kind, old[r]) * part for r, part in given.items())
    return math.fsum(parts) / total


class Slots:
    """The concurrency share this replica takes: a smaller one at once, a larger one ``SETTLE`` s after it was
    first seen (at once when the replicas that gave it up are known to run nothing of the tenant)."""

    __slots__ = ("taken", "split", "rising")

    def __init__(self) -> None:
        self.taken: int | None = None
        self.split: Mapping[str, float] = {}
        self.rising: float | None = None

    def allowed(self, split: Mapping[str, float], fleet: Fleet, tenant: str, limit: int, now: float) -> int:
        """Requests this replica may have in flight now: its share, less what other replicas' requests hold
        beyond theirs (a replica that gave up slots may still run requests in them)."""
        me, count = fleet.me, fleet.count
        shares = {r: math.ceil(s - 1e-9) for r, s in split.items()}
        taken = self._take(split, shares[me], fleet, tenant, now)
        held = sum(max(s, fleet.running(r, tenant)) for r, s in shares.items() if r != me)
        held += (count - len(shares)) * math.ceil(limit / count)  # --workers without etcd: replicas with no record
        return max(0, min(taken, limit + count - 1 - held))

    def _take(self, split: Mapping[str, float], share: int, fleet: Fleet, tenant: str, now: float) -> int:
        if self.taken is not None and share > self.taken:
            self.rising = now if self.rising is None else self.rising
            if now - self.rising < SETTLE and not fleet.quiet_givers(self.split, split, tenant, now):
                return self.taken
        self.taken, self.split, self.rising = share, split, None
        return share


class TenantCounters:
    """One tenant's use of this replica: kept across key reloads while the tenant exists."""

    __slots__ = (
        "requests",
        "tokens",
        "slots",
        "running",
        "asked",
        "asked_tokens",
        "wanted",
        "held",
        "published",
        "reported",
    )

    def __init__(self) -> None:
        self.requests = Bucket()
        self.tokens = Bucket()
        self.slots = Slots()
        self.running = 0
        self.asked = Decaying()
        self.asked_tokens = Decaying()
        self.wanted = Decaying()
        self.held = 0.0
        """How long its requests held a concurrency slot here lately (seconds, a moving average; 0: none yet)."""
        self.published = {kind: Steady() for kind in ("rpm", "tpm", "concurrency")}
        self.reported = False
        """This replica's record has the tenant (else its next request wakes the publisher)."""

    def ask(self, limits: Limits, estimate: int, now: float) -> None:
        """A request arrived: it counts as demand whether it is admitted or not."""
        if limits.rpm or limits.concurrency:
            self.asked.add(1, now)
        if limits.tpm:
            self.asked_tokens.add(estimate, now)
        if limits.concurrency:
            self.wanted.reach(self.running + 1, now)

    def released(self, held: float) -> None:
        """A request that held a concurrency slot for ``held`` seconds ended."""
        self.held = held if not self.held else self.held + HELD_WEIGHT * (held - self.held)

    def concurrency_demand(self, now: float) -> float:
        """Requests it would have in flight here if nothing refused them: what it asks a second times how long a
        request holds a slot (Little's law), and at least the most it wanted at once lately."""
        return max(self.wanted.read(now), self.asked.read(now) * self.held)

    def report(self, limits: Limits, now: float) -> TenantReport | None:
        """The tenant's entry in this replica's record, None once it asked nothing lately and holds nothing."""
        published = self.published
        rpm = published["rpm"].follow(self.asked.read(now) * WINDOW) if limits.rpm else 0.0
        tpm = published["tpm"].follow(self.asked_tokens.read(now) * WINDOW) if limits.tpm else 0.0
        wanted = published["concurrency"].follow(self.concurrency_demand(now)) if limits.concurrency else 0.0
        requests = _bucket_fields(self.requests, now) if limits.rpm else (1.0, 0.0, 1.0)
        tokens = _bucket_fields(self.tokens, now) if limits.tpm else (1.0, 0.0, 1.0)
        idle = rpm <= limits.rpm * IDLE and tpm <= limits.tpm * IDLE and wanted < 0.5
        if idle and requests[0] >= 1.0 and tokens[0] >= 1.0 and not self.running:
            self.reported = False
            return None
        self.reported = True
        return TenantReport(
            rpm=rpm,
            rpm_fill=requests[0],
            rpm_cap=requests[1],
            rpm_gave=requests[2],
            tpm=tpm,
            tpm_fill=tokens[0],
            tpm_cap=tokens[1],
            tpm_gave=tokens[2],
            concurrency=wanted,
            running=self.running,
        )


def _bucket_fields(bucket: Bucket, now: float) -> tuple[float, float, float]:
    """(fill, capacity, fill when it last gave) as a record has them."""
    fill = bucket.refill(now) / bucket.capacity if bucket.capacity > 0 else 1.0
    return rounded_fill(fill), rounded_up(bucket.claimed), rounded_fill(bucket.gave)


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

    __slots__ = ("counters", "limits", "reserved", "headers", "started")

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

    def finish(self, tokens: int | None) -> None:
        """The request ended: ``tokens`` used per the node (None: what was reserved stands)."""
        counters = self.counters
        counters.running -= 1
        if self.limits.concurrency:
            counters.released(time.monotonic() - self.started)
        if self.limits.tpm and tokens is not None:
            counters.tokens.level += self.reserved - tokens


def admit(counters: TenantCounters, limits: Limits, fleet: Fleet, estimate: int, *, session: bool = False) -> Grant:
    """Take one request for ``limits``' tenant on this replica, or raise ``RateLimited`` naming the limit hit.
    A ``session`` (a WebSocket) counts against the concurrency limit only."""
    now = time.monotonic()
    if session:
        limits = Limits(tenant=limits.tenant, concurrency=limits.concurrency)
    counters.ask(limits, estimate, now)
    if not counters.reported:
        fleet.wake.set()
    if limits.concurrency:
        _check_concurrency(counters, limits, fleet, now)
    if limits.rpm:
        _check_rate(counters, limits, fleet, "rpm", now)
    if limits.tpm:
        _check_rate(counters, limits, fleet, "tpm", now)
    if limits.rpm:
        counters.requests.level -= 1
    reserved = 0
    if limits.tpm:
        reserved = estimate
        counters.tokens.level -= estimate
    counters.running += 1
    headers = _headers(counters, limits, now) if limits.rpm or limits.tpm else {}
    return Grant(counters, limits, reserved, [(k.encode(), v.encode()) for k, v in headers.items()], now)


def _check_concurrency(counters: TenantCounters, limits: Limits, fleet: Fleet, now: float) -> None:
    name, limit = limits.tenant, limits.concurrency
    allowed = counters.slots.allowed(fleet.split(name, "concurrency", limit, now), fleet, name, limit, now)
    if counters.running >= allowed:
        raise RateLimited(
            f"Concurrency limit reached for tenant {name}: Limit {limit} requests in flight "
            f"({allowed} on this replica now). Please try again in {CONCURRENCY_RETRY}s.",
            kind="concurrency",
            headers={"Retry-After": str(CONCURRENCY_RETRY), **_headers(counters, limits, now)},
        )


_RATES = {"rpm": ("requests", "requests per min (RPM)"), "tpm": ("tokens", "tokens per min (TPM)")}


def _check_rate(counters: TenantCounters, limits: Limits, fleet: Fleet, kind: str, now: float) -> None:
    limit: int = getattr(limits, kind)
    bucket = counters.requests if kind == "rpm" else counters.tokens
    bucket.follow(fleet.split(limits.tenant, kind, limit, now), fleet, limits.tenant, kind, now)
    level = bucket.refill(now)
    # A request needs a whole unit in the rpm bucket; a tpm bucket admits while it is not in debt.
    enough = level >= 1 if kind == "rpm" else level > 0
    if enough:
        return
    what, label = _RATES[kind]
    wait = bucket.wait(1 - level, limit, fleet.count, now)
    raise RateLimited(
        f"Rate limit reached for tenant {limits.tenant} on {label}: Limit {limit}. "
        f"Please try again in {duration(wait)}.",
        kind=what,
        headers={"Retry-After": str(max(1, math.ceil(wait))), **_headers(counters, limits, now)},
    )


def _headers(counters: TenantCounters, limits: Limits, now: float) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*``: the key's fleet limits; what this replica would admit now (with the tenant's
    traffic on one replica, what the fleet would) and when its bucket is full again."""
    out: dict[str, str] = {}
    for kind, limit, bucket in (("requests", limits.rpm, counters.requests), ("tokens", limits.tpm, counters.tokens)):
        if not limit:
            continue
        level = bucket.refill(now)
        out[f"x-ratelimit-limit-{kind}"] = str(limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(level + 1e-9)))
        out[f"x-ratelimit-reset-{kind}"] = duration((1 - bucket.fill) * WINDOW)
    return out
