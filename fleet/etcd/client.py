"""The etcd client: one channel for unary calls that fails over between endpoints, KV and lease calls."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar, cast

import grpc  # type: ignore[import-untyped,unused-ignore]
import grpc.aio  # type: ignore[import-untyped,unused-ignore]
from google.protobuf.message import Message

from vllm_etcd_proxy.fleet.etcd import streams
from vllm_etcd_proxy.fleet.etcd.errors import (
    EtcdError,
    EtcdUnavailable,
    bad_token,
    member_answered,
    transient,
    translate,
)
from vllm_etcd_proxy.fleet.etcd.settings import EtcdSettings, grpc_target
from vllm_etcd_proxy.fleet.etcd.values import KeyValue, WatchBatch, key_value, prefix_range, to_bytes
from vllm_etcd_proxy.fleet.pb import etcd_rpc_pb2 as pb

log = logging.getLogger(__name__)

_M = TypeVar("_M", bound=Message)
_KV, _LEASE = "/etcdserverpb.KV/", "/etcdserverpb.Lease/"
_STATUS, _AUTH = "/etcdserverpb.Maintenance/Status", "/etcdserverpb.Auth/Authenticate"
_PAGE = 1000
"""Keys per Range page in get_prefix."""


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
                await self.call_metadata()
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

    def new_channel(self, endpoint: str) -> Any:
        """A new gRPC channel to ``endpoint`` with the client's keepalive and TLS settings (streams.py opens one per
        stream)."""
        s = self.settings
        target, tls = grpc_target(endpoint)
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

    def forget_token(self) -> None:
        """Drop the auth token (etcd rejected it): the next call authenticates again."""
        self._token = None

    def _use(self, index: int) -> None:
        if self._channel is not None:
            self._retire(self._channel)
        self._index = index
        self._channel = self.new_channel(self.current_endpoint)
        self._token = None  # etcd's simple tokens are valid on the member that issued them only

    def _retire(self, channel: Any) -> None:
        task = asyncio.ensure_future(channel.close(grace=self.settings.timeout))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def endpoint_failed(self, endpoint: str, *, answered: bool = False) -> None:
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

    async def call_metadata(self) -> list[tuple[str, str]]:
        """The metadata a call carries: the auth token, fetched first if the client has none."""
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
                metadata = await self.call_metadata() if auth else []
                return await self._once(self._channel, method, request, reply, metadata)
            except grpc.aio.AioRpcError as exc:
                if auth and bad_token(exc) and not reauthenticated:
                    log.info("etcd auth token rejected; authenticating again endpoint=%s", endpoint)
                    self._token, reauthenticated = None, True
                    continue
                if not transient(exc):
                    raise translate(exc, endpoint) from None
                if member_answered(exc) and time.monotonic() + delay < patience:
                    log.info("etcd cannot serve yet endpoint=%s method=%s: %s", endpoint, method, exc.details())
                    self.endpoint_failed(endpoint, answered=True)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.5)
                    continue
                failures += 1
                log.warning("etcd call failed endpoint=%s method=%s code=%s", endpoint, method, exc.code())
                self.endpoint_failed(endpoint)
                if failures >= len(self.settings.endpoints):
                    raise translate(exc, endpoint) from None

    # KV

    async def get(self, key: str | bytes) -> KeyValue | None:
        reply = await self._unary(_KV + "Range", pb.RangeRequest(key=to_bytes(key)), pb.RangeResponse)
        return key_value(reply.kvs[0]) if reply.kvs else None

    async def get_prefix(self, prefix: str | bytes) -> tuple[int, list[KeyValue]]:
        """All keys under ``prefix`` at one revision, paged; returns (revision, kvs sorted by key)."""
        start, end = prefix_range(prefix)
        revision, kvs = 0, list[KeyValue]()
        while True:
            request = pb.RangeRequest(key=start, range_end=end, limit=_PAGE, revision=revision)
            reply = await self._unary(_KV + "Range", request, pb.RangeResponse)
            revision = revision or reply.header.revision
            kvs.extend(key_value(kv) for kv in reply.kvs)
            if not reply.more or not reply.kvs:
                return revision, kvs
            start = reply.kvs[-1].key + b"\0"

    async def put(self, key: str | bytes, value: bytes | str, *, lease: int = 0) -> int:
        """Put and return the new revision."""
        request = pb.PutRequest(key=to_bytes(key), value=to_bytes(value), lease=lease)
        return (await self._unary(_KV + "Put", request, pb.PutResponse)).header.revision

    async def delete(self, key: str | bytes) -> int:
        """Delete one key; return how many were deleted (0 or 1)."""
        request = pb.DeleteRangeRequest(key=to_bytes(key))
        return (await self._unary(_KV + "DeleteRange", request, pb.DeleteRangeResponse)).deleted

    async def put_if(self, key: str | bytes, value: bytes | str, *, mod_revision: int, lease: int = 0) -> int:
        """Put only while the key's last change is still ``mod_revision`` (0: only if the key does not exist), in
        one transaction; returns the new revision, 0 when the key had changed (nothing written)."""
        put = pb.RequestOp(request_put=pb.PutRequest(key=to_bytes(key), value=to_bytes(value), lease=lease))
        return await self._txn(key, mod_revision, put)

    async def delete_if(self, key: str | bytes, *, mod_revision: int) -> bool:
        """Delete the key only while its last change is still ``mod_revision``; False when it had changed."""
        delete = pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=to_bytes(key)))
        return bool(await self._txn(key, mod_revision, delete))

    async def _txn(self, key: str | bytes, mod_revision: int, op: pb.RequestOp) -> int:
        compare = pb.Compare(
            result=pb.Compare.EQUAL, target=pb.Compare.MOD, key=to_bytes(key), mod_revision=mod_revision
        )
        reply = await self._unary(_KV + "Txn", pb.TxnRequest(compare=[compare], success=[op]), pb.TxnResponse)
        return reply.header.revision if reply.succeeded else 0

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

    # Streams (streams.py): each opens its own channel

    async def keep_alive(self, lease_id: int, ttl: int, on_refresh: Callable[[int], None] | None = None) -> None:
        """Keep a lease alive on one stream until cancelled, reconnecting within ``dead_after`` s of silence (see
        ``streams.keep_alive``)."""
        await streams.keep_alive(self, lease_id, ttl, on_refresh)

    def watch_prefix(self, prefix: str | bytes, start_revision: int) -> AsyncGenerator[WatchBatch, None]:
        """Watch every key under ``prefix`` from ``start_revision``; ``dead_after`` s of silence end it (see
        ``streams.watch_prefix``)."""
        return streams.watch_prefix(self, prefix, start_revision)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as file:
        return file.read()
