"""etcd's two streams: a lease's keep-alive and a watch. Each opens its own channel, so failing over never cancels
a call that another task is still awaiting (grpc.aio turns that into a CancelledError)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc  # type: ignore[import-untyped,unused-ignore]
import grpc.aio  # type: ignore[import-untyped,unused-ignore]
from google.protobuf.message import Message

from vllm_etcd_proxy.fleet.etcd.errors import (
    Compacted,
    EtcdError,
    EtcdUnavailable,
    LeaseLost,
    bad_token,
    member_answered,
    transient,
    translate,
)
from vllm_etcd_proxy.fleet.etcd.values import Event, EventType, WatchBatch, key_value, prefix_range
from vllm_etcd_proxy.fleet.pb import etcd_rpc_pb2 as pb

if TYPE_CHECKING:
    from vllm_etcd_proxy.fleet.etcd.client import EtcdClient

log = logging.getLogger(__name__)

WATCH_IDLE_TIMEOUT = 15 * 60.0
"""Seconds a watch may stay silent: etcd sends progress every 10 min; keepalive finds dead peers sooner."""
_REQUIRE_LEADER = ("hasleader", "true")
"""Stream metadata: a member cut off from its cluster's leader ends our stream instead of going quiet."""
_BROKEN = (grpc.aio.AioRpcError, TimeoutError, asyncio.InvalidStateError, EtcdUnavailable)
"""How a stream fails: gRPC's error, our read timeout, grpc.aio's state error on a dying call, or an EOF."""


@contextlib.asynccontextmanager
async def _stream(client: EtcdClient, method: str, request: type[Message], reply: type[Message]) -> AsyncIterator[Any]:
    """One stream on a new channel to the client's current endpoint; the channel closes on the way out."""
    channel = client.new_channel(client.current_endpoint)
    try:
        serialize, parse = request.SerializeToString, reply.FromString
        stream = channel.stream_stream(method, request_serializer=serialize, response_deserializer=parse)
        yield stream(metadata=[*await client.call_metadata(), _REQUIRE_LEADER])
    finally:
        await channel.close()


def _failed(client: EtcdClient, exc: BaseException, endpoint: str) -> None:
    """Account a broken stream: a rejected token is dropped, a failure worth retrying moves the client on to
    another member (not away from one that answered, see ``EtcdClient.endpoint_failed``), anything else is raised."""
    if isinstance(exc, grpc.aio.AioRpcError):
        if bad_token(exc):
            client.forget_token()
            return
        if not transient(exc):
            raise translate(exc, endpoint) from None
        client.endpoint_failed(endpoint, answered=member_answered(exc))
        return
    client.endpoint_failed(endpoint)


async def keep_alive(
    client: EtcdClient, lease_id: int, ttl: int, on_refresh: Callable[[int], None] | None = None
) -> None:
    """Refresh a lease every ``ttl``/3 s on one stream until cancelled.

    Stream errors reconnect (failing over) while the lease may still be alive. Raises ``LeaseLost`` when
    etcd answers TTL <= 0 or when no refresh succeeded within the lease's remaining TTL.
    """
    interval, delay = ttl / 3, 0.1
    expires = time.monotonic() + ttl
    method = "/etcdserverpb.Lease/LeaseKeepAlive"
    while True:
        endpoint = client.current_endpoint
        try:
            async with _stream(client, method, pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse) as call:
                while True:
                    sent = time.monotonic()
                    async with asyncio.timeout(max(0.0, min(client.settings.timeout, expires - sent))):
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
        except _BROKEN as exc:
            _failed(client, exc, endpoint)
            if time.monotonic() >= expires:
                raise LeaseLost(f"lease {lease_id:x} not refreshed within its TTL ({ttl}s)") from None
            log.warning("etcd lease keepalive failed endpoint=%s lease=%x error=%s", endpoint, lease_id,
                        type(exc).__name__)  # fmt: skip
            await asyncio.sleep(min(delay, max(0.0, expires - time.monotonic())))
            delay = min(delay * 2, max(interval, 0.1))


async def watch_prefix(
    client: EtcdClient, prefix: str | bytes, start_revision: int, *, idle_timeout: float = WATCH_IDLE_TIMEOUT
) -> AsyncGenerator[WatchBatch, None]:
    """Watch every key under ``prefix`` from ``start_revision``; yield one ``WatchBatch`` per response.

    The first batch is the ``created`` one; progress notifications come as batches without events.
    Raises ``Compacted`` when ``start_revision`` was compacted, ``EtcdUnavailable`` when the stream fails
    or stays silent for ``idle_timeout`` s (resume from the last batch's revision + 1).
    """
    key, end = prefix_range(prefix)
    create = pb.WatchCreateRequest(key=key, range_end=end, start_revision=start_revision, progress_notify=True)
    endpoint = client.current_endpoint
    try:
        async with _stream(client, "/etcdserverpb.Watch/Watch", pb.WatchRequest, pb.WatchResponse) as call:
            async with asyncio.timeout(client.settings.timeout):
                await call.write(pb.WatchRequest(create_request=create))
            created = False
            while True:
                async with asyncio.timeout(idle_timeout if created else client.settings.timeout):
                    reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise EtcdUnavailable(f"etcd {endpoint} closed the watch stream")
                if reply.canceled:
                    if reply.compact_revision:
                        raise Compacted(reply.compact_revision)
                    raise EtcdError(f"etcd {endpoint} cancelled the watch: {reply.cancel_reason}")
                created = created or reply.created
                events = [
                    Event(type=EventType.DELETE if e.type == pb.Event.DELETE else EventType.PUT, kv=key_value(e.kv))
                    for e in reply.events
                ]
                yield WatchBatch(reply.header.revision, events, reply.created)
    except _BROKEN as exc:
        _failed(client, exc, endpoint)
        if isinstance(exc, grpc.aio.AioRpcError):
            raise translate(exc, endpoint) from None
        if isinstance(exc, EtcdUnavailable):
            raise
        raise EtcdUnavailable(f"etcd {endpoint}: watch stream timed out or broke") from None
