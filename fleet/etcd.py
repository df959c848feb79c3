"""The only module that talks to etcd: a small asyncio etcd v3 client on grpc.aio.

Errors leave this module as ``EtcdError``s, never as gRPC errors::

    EtcdError              etcd refused or failed a request (``.code`` is the gRPC status name, if any)
    +-- EtcdUnavailable    no endpoint answered in time, or a stream broke: retry, resume a watch
    +-- Compacted          a watch's start revision was compacted away: re-list
    +-- LeaseLost          a lease expired, was revoked, or could not be refreshed within its TTL
    +-- EtcdAuthError      bad user or password, or permission denied

Keys and values come back as this module's frozen ``KeyValue`` and ``Event`` dataclasses, so no other module
imports the generated protobuf code (``status()`` alone returns etcd's ``StatusResponse`` as is).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar, cast

import grpc  # type: ignore[import-untyped,unused-ignore]
import grpc.aio  # type: ignore[import-untyped,unused-ignore]
from google.protobuf.message import Message

from vllm_etcd_proxy.fleet.pb import etcd_rpc_pb2 as pb

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=Message)
_TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_KV, _LEASE = "/etcdserverpb.KV/", "/etcdserverpb.Lease/"
_STATUS, _AUTH = "/etcdserverpb.Maintenance/Status", "/etcdserverpb.Auth/Authenticate"
_REQUIRE_LEADER = ("hasleader", "true")
"""Stream metadata: a member cut off from its cluster's leader ends our stream instead of going quiet."""
_PAGE = 1000
"""Keys per Range page in get_prefix."""
WATCH_IDLE_TIMEOUT = 15 * 60.0
"""Seconds a watch may stay silent: etcd sends progress every 10 min; keepalive finds dead peers sooner."""


class EtcdError(Exception):
    """etcd refused or failed a request."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class EtcdUnavailable(EtcdError):
    """No endpoint answered in time, or a stream broke."""


class Compacted(EtcdError):
    """The watch start revision is older than etcd's compaction point."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted; oldest available is {compact_revision}", "OUT_OF_RANGE")
        self.compact_revision = compact_revision


class LeaseLost(EtcdError):
    """The lease is gone (expired or revoked) or could not be refreshed for longer than its TTL."""


class EtcdAuthError(EtcdError):
    """Authentication failed or the user lacks permission."""


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
            _target(endpoint)
        if self.keepalive_time < 5.0:
            raise ValueError("keepalive_time must be >= 5 s: etcd answers faster pings with GOAWAY")
        if (self.cert is None) != (self.key is None):
            raise ValueError("etcd cert and key go together")
        if (self.user is None) != (self.password is None):
            raise ValueError("etcd user and password go together")


class EventType(StrEnum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, kw_only=True)
class KeyValue:
    """A key and its value as etcd stores them (bytes: etcd does not require UTF-8)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True, kw_only=True)
class Event:
    """A watch event; for a DELETE, ``kv`` holds the key and the deletion revision, and an empty value."""

    type: EventType
    kv: KeyValue


@dataclass(frozen=True)
class WatchBatch:
    """One watch response: the ``created`` one and progress notifications have no events.

    ``revision`` is the response header's: every change up to it has been delivered, so a broken watch resumes
    at ``revision + 1``. In the ``created`` batch it is etcd's current revision.
    """

    revision: int
    events: list[Event]
    created: bool = False


def parse_endpoints(text: str) -> tuple[str, ...]:
    """Split ``--etcd URL[,URL...]``; each item is ``http(s)://host:port`` or ``host:port``."""
    endpoints = tuple(part.strip().rstrip("/") for part in text.split(",") if part.strip())
    if not endpoints:
        raise ValueError("no etcd endpoint given")
    for endpoint in endpoints:
        _target(endpoint)
    return endpoints


def _target(endpoint: str) -> tuple[str, bool | None]:
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


def _b(text: str | bytes) -> bytes:
    return text.encode() if isinstance(text, str) else text


def _prefix_range(prefix: str | bytes) -> tuple[bytes, bytes]:
    """(key, range_end) that select every key starting with ``prefix``; an empty prefix selects all keys."""
    key = _b(prefix)
    end = bytearray(key)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return key or b"\0", b"\0"  # etcd: range_end "\0" means "to the end of the keyspace"
    end[-1] += 1
    return key, bytes(end)


def _kv(kv: pb.KeyValue) -> KeyValue:
    return KeyValue(
        key=kv.key,
        value=kv.value,
        create_revision=kv.create_revision,
        mod_revision=kv.mod_revision,
        version=kv.version,
        lease=kv.lease,
    )


def _transient(exc: grpc.aio.AioRpcError) -> bool:
    """Worth a retry on another member: unreachable, too slow, or gRPC's own transport hiccup (seen as INTERNAL
    "Internal error from Core" on a stream whose member just died; etcd's own errors carry etcd's words)."""
    code = exc.code()
    return code in _TRANSIENT or (code == grpc.StatusCode.INTERNAL and "from Core" in (exc.details() or ""))


def _member_answered(exc: grpc.aio.AioRpcError) -> bool:
    """The member is up but said it cannot serve right now ("etcdserver: no leader", "leader changed", "request
    timed out"): an election is on, or this member is cut off from the others."""
    return (exc.details() or "").startswith("etcdserver:")


def _bad_token(exc: grpc.aio.AioRpcError) -> bool:
    return "invalid auth token" in (exc.details() or "")


def _translate(exc: grpc.aio.AioRpcError, endpoint: str) -> EtcdError:
    code = exc.code()
    message = f"etcd {endpoint}: {code.name} {exc.details() or ''}".strip()
    if _transient(exc) or code == grpc.StatusCode.CANCELLED:
        return EtcdUnavailable(message, code.name)
    details = exc.details() or ""
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or any(
        text in details for text in ("authentication", "user name", "password")
    ):
        return EtcdAuthError(message, code.name)
    return EtcdError(message, code.name)


class EtcdClient:
    """asyncio etcd v3 client: unary calls fail over between endpoints; each stream owns its channel."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._index = 0
        self._unreachable_at: dict[int, float] = {}  # endpoint index -> when it last could not be reached
        self._channel: Any = None
        self._token: str | None = None
        self._auth_lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()

    @property
    def current_endpoint(self) -> str:
        return self.settings.endpoints[self._index]

    async def __aenter__(self) -> EtcdClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Use the first endpoint that answers Maintenance/Status, then authenticate if a user is set."""
        failures = []
        for index, endpoint in enumerate(self.settings.endpoints):
            self._use(index)
            try:
                await self._once(self._channel, _STATUS, pb.StatusRequest(), pb.StatusResponse, [])
            except grpc.aio.AioRpcError as exc:
                # gRPC's details carry the cause (refused, TLS handshake, certificate verify failed).
                failures.append(f"{endpoint} ({exc.code().name}: {(exc.details() or '').strip()[:300]})")
                continue
            log.info("etcd connected endpoint=%s", endpoint)
            if self.settings.user is not None:
                await self._metadata()
            return
        tried = ", ".join(failures)
        raise EtcdUnavailable(f"no etcd endpoint answered within {self.settings.timeout}s: {tried}")

    async def close(self) -> None:
        if self._channel is not None:
            self._retire(self._channel)
            self._channel = None
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)

    # Channels: one shared by unary calls; each stream opens its own, so failing over never cancels a
    # call that another task is still awaiting (grpc.aio turns that into a CancelledError).

    def _new_channel(self, endpoint: str) -> Any:
        s = self.settings
        target, tls = _target(endpoint)
        options = [
            ("grpc.keepalive_time_ms", int(s.keepalive_time * 1000)),
            ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout * 1000)),
            ("grpc.http2.ping_timeout_ms", int(s.keepalive_timeout * 1000)),
            ("grpc.http2.max_pings_without_data", 0),  # an idle watch must keep pinging
            ("grpc.initial_reconnect_backoff_ms", 250),
            ("grpc.max_reconnect_backoff_ms", 2000),
            ("grpc.use_local_subchannel_pool", 1),  # a new channel is a new connection
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ]
        if tls or (tls is None and (s.cacert or s.cert)):
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(s.cacert), private_key=_read(s.key), certificate_chain=_read(s.cert)
            )
            return grpc.aio.secure_channel(target, credentials, options=options)
        return grpc.aio.insecure_channel(target, options=options)

    def _use(self, index: int) -> None:
        if self._channel is not None:
            self._retire(self._channel)
        self._index = index
        self._channel = self._new_channel(self.current_endpoint)
        self._token = None  # etcd's simple tokens are valid on the member that issued them only

    def _retire(self, channel: Any) -> None:
        task = asyncio.ensure_future(channel.close(grace=self.settings.timeout))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _failed(self, endpoint: str, *, answered: bool = False) -> None:
        """Move on to the next endpoint, skipping members unreachable lately (a fresh connection even when there
        is only one). ``answered``: the member is up but could not serve (no leader: an election, or this member
        is cut off from the others), so it is left without being marked unreachable. Several tasks report
        failures of the same member, so only the current endpoint's failure counts."""
        if endpoint != self.current_endpoint:
            return
        now = time.monotonic()
        if not answered:
            self._unreachable_at[self._index] = now
        count = len(self.settings.endpoints)
        following = [(self._index + step) % count for step in range(1, count + 1)]
        recent = 2 * self.settings.timeout
        reachable = [i for i in following if now - self._unreachable_at.get(i, -recent) >= recent]
        self._use(reachable[0] if reachable else min(following, key=lambda i: self._unreachable_at.get(i, 0.0)))

    async def _metadata(self) -> list[tuple[str, str]]:
        if self.settings.user is None:
            return []
        async with self._auth_lock:
            if self._token is None:
                s = self.settings
                request = pb.AuthenticateRequest(name=s.user, password=s.password or "")
                reply = await self._unary(_AUTH, request, pb.AuthenticateResponse, auth=False)
                self._token = reply.token
            return [("token", self._token)]

    async def _once(self, channel: Any, method: str, request: Message, reply: type[_M], md: list[Any]) -> _M:
        stub = channel.unary_unary(
            method, request_serializer=type(request).SerializeToString, response_deserializer=reply.FromString
        )
        return cast(_M, await stub(request, timeout=self.settings.timeout, metadata=md))

    async def _unary(self, method: str, request: Message, reply: type[_M], *, auth: bool = True) -> _M:
        failures = 0
        reauthenticated = False
        patience = time.monotonic() + self.settings.timeout  # for a cluster electing a leader
        delay = 0.05
        while True:
            if self._channel is None:
                self._use(self._index)
            endpoint = self.current_endpoint
            try:
                metadata = await self._metadata() if auth else []
                return await self._once(self._channel, method, request, reply, metadata)
            except grpc.aio.AioRpcError as exc:
                if auth and _bad_token(exc) and not reauthenticated:
                    log.info("etcd auth token rejected; authenticating again endpoint=%s", endpoint)
                    self._token, reauthenticated = None, True
                    continue
                if not _transient(exc):
                    raise _translate(exc, endpoint) from None
                if _member_answered(exc) and time.monotonic() + delay < patience:
                    log.info("etcd cannot serve yet endpoint=%s method=%s: %s", endpoint, method, exc.details())
                    self._failed(endpoint, answered=True)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
                    continue
                failures += 1
                log.warning("etcd call failed endpoint=%s method=%s code=%s", endpoint, method, exc.code())
                self._failed(endpoint)
                if failures >= len(self.settings.endpoints):
                    raise _translate(exc, endpoint) from None

    # KV

    async def get(self, key: str | bytes) -> KeyValue | None:
        reply = await self._unary(_KV + "Range", pb.RangeRequest(key=_b(key)), pb.RangeResponse)
        return _kv(reply.kvs[0]) if reply.kvs else None

    async def get_prefix(self, prefix: str | bytes) -> tuple[int, list[KeyValue]]:
        """All keys under ``prefix`` at one revision, paged; returns (revision, kvs sorted by key)."""
        start, end = _prefix_range(prefix)
        revision, kvs = 0, list[KeyValue]()
        while True:
            request = pb.RangeRequest(key=start, range_end=end, limit=_PAGE, revision=revision)
            reply = await self._unary(_KV + "Range", request, pb.RangeResponse)
            revision = revision or reply.header.revision
            kvs.extend(_kv(kv) for kv in reply.kvs)
            if not reply.more or not reply.kvs:
                return revision, kvs
            start = reply.kvs[-1].key + b"\0"

    async def put(self, key: str | bytes, value: bytes | str, *, lease: int = 0) -> int:
        """Put and return the new revision."""
        request = pb.PutRequest(key=_b(key), value=_b(value), lease=lease)
        return (await self._unary(_KV + "Put", request, pb.PutResponse)).header.revision

    async def delete(self, key: str | bytes) -> int:
        """Delete one key; return how many were deleted (0 or 1)."""
        request = pb.DeleteRangeRequest(key=_b(key))
        return (await self._unary(_KV + "DeleteRange", request, pb.DeleteRangeResponse)).deleted

    async def delete_prefix(self, prefix: str | bytes) -> int:
        key, end = _prefix_range(prefix)
        request = pb.DeleteRangeRequest(key=key, range_end=end)
        return (await self._unary(_KV + "DeleteRange", request, pb.DeleteRangeResponse)).deleted

    async def put_if_absent(self, key: str | bytes, value: bytes | str, *, lease: int = 0) -> bool:
        """Put only if the key does not exist; True if this call created it.

        A retry after a timeout may answer False for a put that the first attempt did apply.
        """
        compare = pb.Compare(key=_b(key), target=pb.Compare.CREATE, create_revision=0)  # EQUAL is 0
        put = pb.RequestOp(request_put=pb.PutRequest(key=_b(key), value=_b(value), lease=lease))
        request = pb.TxnRequest(compare=[compare], success=[put])
        return (await self._unary(_KV + "Txn", request, pb.TxnResponse)).succeeded

    async def compact(self, revision: int, physical: bool = True) -> None:
        request = pb.CompactionRequest(revision=revision, physical=physical)
        await self._unary(_KV + "Compact", request, pb.CompactionResponse)

    async def status(self) -> pb.StatusResponse:
        return await self._unary(_STATUS, pb.StatusRequest(), pb.StatusResponse)

    # Leases

    async def grant(self, ttl: int) -> int:
        """Grant a lease of ``ttl`` seconds and return its id."""
        reply = await self._unary(_LEASE + "LeaseGrant", pb.LeaseGrantRequest(TTL=ttl), pb.LeaseGrantResponse)
        if reply.error:
            raise EtcdError(f"lease grant refused: {reply.error}")
        return reply.ID

    async def revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys; a lease that is already gone is fine."""
        try:
            await self._unary(_LEASE + "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease_id), pb.LeaseRevokeResponse)
        except EtcdError as exc:
            if exc.code != "NOT_FOUND":
                raise

    async def time_to_live(self, lease_id: int) -> int:
        """Remaining seconds of a lease, -1 when it expired or is unknown."""
        request = pb.LeaseTimeToLiveRequest(ID=lease_id)
        reply = await self._unary(_LEASE + "LeaseTimeToLive", request, pb.LeaseTimeToLiveResponse)
        return reply.TTL if reply.TTL > 0 else -1

    async def keep_alive(self, lease_id: int, ttl: int, on_refresh: Callable[[int], None] | None = None) -> None:
        """Refresh a lease every ``ttl``/3 s on one stream until cancelled.

        Stream errors reconnect (failing over) while the lease may still be alive. Raises ``LeaseLost`` when
        etcd answers TTL <= 0 or when no refresh succeeded within the lease's remaining TTL.
        """
        interval, delay = ttl / 3, 0.1
        expires = time.monotonic() + ttl
        while True:
            endpoint = self.current_endpoint
            channel = self._new_channel(endpoint)
            try:
                stream = channel.stream_stream(
                    "/etcdserverpb.Lease/LeaseKeepAlive",
                    request_serializer=pb.LeaseKeepAliveRequest.SerializeToString,
                    response_deserializer=pb.LeaseKeepAliveResponse.FromString,
                )
                call = stream(metadata=[*await self._metadata(), _REQUIRE_LEADER])
                while True:
                    sent = time.monotonic()
                    async with asyncio.timeout(max(0.0, min(self.settings.timeout, expires - sent))):
                        await call.write(pb.LeaseKeepAliveRequest(ID=lease_id))
                        reply = await call.read()
                    if reply is grpc.aio.EOF:
                        raise EtcdUnavailable(f"etcd {endpoint} closed the keepalive stream")
                    if reply.TTL <= 0:
                        raise LeaseLost(f"lease {lease_id:x} expired or was revoked")
                    expires, delay = sent + reply.TTL, 0.1
                    if on_refresh is not None:
                        on_refresh(reply.TTL)
                    await asyncio.sleep(interval)
            except (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError, EtcdUnavailable) as exc:
                if isinstance(exc, grpc.aio.AioRpcError):
                    if not _transient(exc) and not _bad_token(exc):
                        raise _translate(exc, endpoint) from None
                    self._token = None if _bad_token(exc) else self._token
                if time.monotonic() >= expires:
                    raise LeaseLost(f"lease {lease_id:x} not refreshed within its TTL ({ttl}s)") from None
                log.warning(
                    "etcd lease keepalive failed endpoint=%s lease=%x error=%s",
                    endpoint,
                    lease_id,
                    type(exc).__name__,
                )
                self._failed(endpoint, answered=isinstance(exc, grpc.aio.AioRpcError) and _member_answered(exc))
                await asyncio.sleep(min(delay, max(0.0, expires - time.monotonic())))
                delay = min(delay * 2, max(interval, 0.1))
            finally:
                await channel.close()

    # Watch

    async def watch_prefix(
        self, prefix: str | bytes, start_revision: int, *, idle_timeout: float = WATCH_IDLE_TIMEOUT
    ) -> AsyncGenerator[WatchBatch, None]:
        """Watch every key under ``prefix`` from ``start_revision``; yield one ``WatchBatch`` per response.

        The first batch is the ``created`` one; progress notifications come as batches without events.
        Raises ``Compacted`` when ``start_revision`` was compacted, ``EtcdUnavailable`` when the stream fails
        or stays silent for ``idle_timeout`` s (resume from the last batch's revision + 1).
        """
        key, end = _prefix_range(prefix)
        create = pb.WatchCreateRequest(key=key, range_end=end, start_revision=start_revision, progress_notify=True)
        endpoint = self.current_endpoint
        channel = self._new_channel(endpoint)
        try:
            stream = channel.stream_stream(
                "/etcdserverpb.Watch/Watch",
                request_serializer=pb.WatchRequest.SerializeToString,
                response_deserializer=pb.WatchResponse.FromString,
            )
            call = stream(metadata=[*await self._metadata(), _REQUIRE_LEADER])
            async with asyncio.timeout(self.settings.timeout):
                await call.write(pb.WatchRequest(create_request=create))
            created = False
            while True:
                async with asyncio.timeout(idle_timeout if created else self.settings.timeout):
                    reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise EtcdUnavailable(f"etcd {endpoint} closed the watch stream")
                if reply.canceled:
                    if reply.compact_revision:
                        raise Compacted(reply.compact_revision)
                    raise EtcdError(f"etcd {endpoint} cancelled the watch: {reply.cancel_reason}")
                created = created or reply.created
                events = [
                    Event(type=EventType.DELETE if e.type == pb.Event.DELETE else EventType.PUT, kv=_kv(e.kv))
                    for e in reply.events
                ]
                yield WatchBatch(reply.header.revision, events, reply.created)
        except grpc.aio.AioRpcError as exc:
            if _bad_token(exc):
                self._token = None
            else:
                self._failed(endpoint, answered=_member_answered(exc))
            raise _translate(exc, endpoint) from None
        except (TimeoutError, asyncio.InvalidStateError, EtcdUnavailable) as exc:
            self._failed(endpoint)
            if isinstance(exc, EtcdUnavailable):
                raise
            raise EtcdUnavailable(f"etcd {endpoint}: watch stream timed out or broke") from None
        finally:
            await channel.close()


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()
