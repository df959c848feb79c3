"""How to reach etcd: endpoints, timeouts, TLS and credentials."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class EtcdSettings:
    """How to reach etcd."""

    endpoints: tuple[str, ...]
    """Client URLs (``http://host:port``, ``https://host:port``) or ``host:port``, tried in order."""
    timeout: float = 5.0
    """Seconds for every unary call and for opening a stream; a healthy etcd answers in milliseconds."""
    keepalive_time: float = 10.0
    """Seconds between gRPC keepalive pings on a busy connection; etcd refuses pings more often than 5 s."""
    keepalive_timeout: float = 5.0
    """Seconds to wait for a ping ack before a connection counts as dead (a silent partition)."""
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

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        for endpoint in self.endpoints:
            grpc_target(endpoint)
        if self.keepalive_time < 5.0:
            raise ValueError("keepalive_time must be >= 5 s: etcd answers faster pings with GOAWAY")
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd cert and key go together")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd user and password go together")


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
