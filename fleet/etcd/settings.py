"""How to reach etcd: endpoints, timeouts, TLS and credentials."""

from __future__ import annotations

from dataclasses import dataclass, field

TIMEOUT = 5.0
"""Default of ``EtcdSettings.timeout`` (and of ``--etcd-timeout`` in every program): a healthy etcd answers in
milliseconds."""
DEAD_AFTER = 3.0
"""Default of ``EtcdSettings.dead_after``: a dead stream noticed within 3 s, and a 10 s lease rides out a partition
of up to 6 s (``lease_bound``)."""
KEEPALIVE_TIME, KEEPALIVE_TIMEOUT = 10.0, 5.0
"""Defaults of ``EtcdSettings.keepalive_time`` (etcd refuses pings more often than every 5 s) and
``keepalive_timeout``."""
PROBES_PER_BOUND = 3
"""A stream asks etcd for an answer this many times per ``dead_after``, so one late answer is not a death."""
BURST_EVENTS, BURST_WINDOW = 32, 0.25
"""Defaults of ``EtcdSettings.burst_events`` and ``burst_window``: 128 events a second or more is a burst."""
BURST_PAUSE = 0.2
"""Default of ``EtcdSettings.burst_pause``."""


@dataclass(frozen=True, kw_only=True)
class EtcdSettings:
    """How to reach etcd."""

    endpoints: tuple[str, ...]
    """Client URLs (``http://host:port``, ``https://host:port``) or ``host:port``, tried in order."""
    timeout: float = TIMEOUT
    """Seconds for every unary call (its gRPC deadline)."""
    dead_after: float = DEAD_AFTER
    """Seconds of silence after which a stream counts as dead and is opened again (on the next endpoint): a
    watch or lease keep-alive that has heard nothing from etcd, or a new stream that has not answered its first
    request. Both streams ask for an answer every ``probe_interval`` s (a watch progress request, a lease
    refresh), so a healthy etcd is never silent that long. gRPC pings alone cannot get there: etcd refuses them
    more often than every 5 s, so they notice a dead connection after 5 s plus their timeout at best."""
    keepalive_time: float = KEEPALIVE_TIME
    """Seconds between gRPC keepalive pings on a busy connection; etcd refuses pings more often than 5 s."""
    keepalive_timeout: float = KEEPALIVE_TIMEOUT
    """Seconds to wait for a ping ack before gRPC closes the connection (a backstop to ``dead_after``)."""
    cacert: str | None = None
    """PEM file of the CA that signed etcd's server certificate."""
    cert: str | None = None
    """PEM client certificate, for an etcd started with --client-cert-auth."""
    key: str | None = None
    """PEM private key of ``cert``."""
    user: str | None = None
    """etcd user, when etcd has auth enabled."""
    password: str | None = field(default=None, repr=False)
    """Password of ``user``; never logged, not in repr."""
    burst_events: int = BURST_EVENTS
    """A watch that received this many events within ``burst_window`` s is in a burst, and pauses: etcd sends
    a watcher that keeps up one response per revision (grpc.aio spends about 90 us reading each), but replays a
    watch started in the past in responses of up to 1,000 revisions."""
    burst_window: float = BURST_WINDOW
    burst_pause: float = BURST_PAUSE
    """Seconds a watch in a burst stops listening before it asks etcd again from its last revision + 1 (and
    gets what came meanwhile in one response); 0 never pauses. Events are late by up to this plus etcd's 0.1 s
    catch-up period."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        for endpoint in self.endpoints:
            grpc_target(endpoint)
        if not 0.3 <= self.dead_after <= 600:
            raise ValueError("dead_after must be between 0.3 and 600 s")
        if self.keepalive_timeout <= 0:
            raise ValueError("keepalive_timeout must be more than 0 s")
        if self.keepalive_time < 5.0:
            raise ValueError("keepalive_time must be >= 5 s: etcd answers faster pings with GOAWAY")
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd cert and key go together")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd user and password go together")
        if self.burst_events < 1 or self.burst_window <= 0 or not 0 <= self.burst_pause <= 60:
            raise ValueError("burst_events and burst_window must be positive, burst_pause 0 to 60 s")

    @property
    def probe_interval(self) -> float:
        """Seconds between the requests a stream makes only so that etcd answers (``dead_after`` / 3)."""
        return self.dead_after / PROBES_PER_BOUND

    @property
    def lease_bound(self) -> float:
        """Seconds a lease may go unrefreshed through a partition besides the partition itself: the last
        refresh may be one ``probe_interval`` old when the bytes stop, and after they flow again the attempt in
        flight takes up to ``dead_after`` to give up before a new connection refreshes. A lease of TTL s survives
        every partition shorter than TTL - ``lease_bound``."""
        return self.dead_after + self.probe_interval


def parse_endpoints(text: str) -> tuple[str, ...]:
    """Split ``--etcd URL[,URL...]``; each item is ``http(s)://host:port`` or ``host:port``."""
    endpoints = tuple(part.strip().rstrip("/") for part in text.split(",") if part.strip())
    if not endpoints:
        raise ValueError("no etcd endpoint given")
    for endpoint in endpoints:
        grpc_target(endpoint)
    return endpoints


def grpc_target(endpoint: str) -> tuple[str, bool | None]:
    """The gRPC target ``host:port`` and whether the scheme asks for TLS (None when there is no scheme)."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        scheme, rest = "", endpoint
    rest = rest.rstrip("/")
    if scheme not in ("", "http", "https") or not rest or "/" in rest or "@" in rest:
        raise ValueError(f"etcd endpoint {endpoint!r} is not http(s)://host:port or host:port")
    if ":" not in rest.rpartition("]")[2]:
        rest += ":2379"
    return rest, {"": None, "http": False, "https": True}[scheme]
