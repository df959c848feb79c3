"""etcd's two streams: a lease's keep-alive and a watch. Each opens its own channel, so failing over never cancels
a call that another task is still awaiting (grpc.aio turns that into a CancelledError).

A silent partition (bytes dropped, connections open) shows only as silence, so each stream makes etcd speak:
a prober writes a request every ``settings.probe_interval`` s (a lease refresh; a watch progress request, which
etcd answers at once), and a read that waits longer than ``settings.dead_after`` ends the stream as dead. The
next attempt opens a new connection, on the next endpoint when there are several.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
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
    from vllm_etcd_proxy.fleet.etcd.settings import EtcdSettings

log = logging.getLogger(__name__)

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
        async with asyncio.timeout(client.settings.dead_after):  # the token may need a call of its own
            metadata = await client.call_metadata()
        yield stream(metadata=[*metadata, _REQUIRE_LEADER])
    finally:
        await channel.close()


@contextlib.asynccontextmanager
async def _probing(call: Any, request: Message, every: float, sent: deque[float] | None = None) -> AsyncIterator[None]:
    """Write ``request`` on ``call`` at once and then every ``every`` s while the body runs (appending the time of
    each write to ``sent``). A write that fails ends the probing quietly: the reader learns why, or hears silence."""

    async def probe() -> None:
        with contextlib.suppress(*_BROKEN):
            while True:
                if sent is not None:
                    sent.append(time.monotonic())
                await call.write(request)
                await asyncio.sleep(every)

    task = asyncio.create_task(probe(), name="etcd stream probe")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait([task])
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("etcd stream probe failed: %r", exc)


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
    """Refresh a lease every ``ttl``/3 or ``probe_interval`` s, whichever is shorter, on one stream until cancelled.

    A refresh is the stream's probe: no answer for ``dead_after`` s means a dead connection, and the stream is
    opened again (failing over) while the lease may still be alive; a failure that came quickly waits a capped
    back-off first. Raises ``LeaseLost`` when etcd answers TTL <= 0 or when no refresh succeeded within the
    lease's remaining TTL.
    """
    settings = client.settings
    interval, delay = min(ttl / 3, settings.probe_interval), 0.1
    expires = time.monotonic() + ttl
    method = "/etcdserverpb.Lease/LeaseKeepAlive"
    request = pb.LeaseKeepAliveRequest(ID=lease_id)
    while True:
        endpoint, started = client.current_endpoint, time.monotonic()
        sent: deque[float] = deque()  # when each unanswered refresh was written; etcd answers in order
        try:
            async with _stream(client, method, pb.LeaseKeepAliveRequest, pb.LeaseKeepAliveResponse) as call:
                async with _probing(call, request, interval, sent):
                    while True:
                        async with asyncio.timeout(max(0.0, min(settings.dead_after, expires - time.monotonic()))):
                            reply = await call.read()
                        if reply is grpc.aio.EOF:
                            raise EtcdUnavailable(f"etcd {endpoint} closed the keepalive stream")
                        if reply.TTL <= 0:
                            raise LeaseLost(f"lease {lease_id:x} expired or was revoked")
                        expires, delay = (sent.popleft() if sent else started) + reply.TTL, 0.1
                        if on_refresh is not None:
                            on_refresh(reply.TTL)
        except _BROKEN as exc:
            _failed(client, exc, endpoint)
            now = time.monotonic()
            if now >= expires:
                raise LeaseLost(f"lease {lease_id:x} not refreshed within its TTL ({ttl}s)") from None
            log.warning(
                "etcd lease keepalive failed endpoint=%s lease=%x error=%s after=%.1fs",
                endpoint,
                lease_id,
                _reason(exc),
                now - started,
            )
            # An attempt that timed out has waited enough: the next one goes at once, on a new connection.
            await asyncio.sleep(min(max(0.0, delay - (now - started)), max(0.0, expires - now)))
            delay = min(delay * 2, max(interval, 0.1))


async def watch_prefix(
    client: EtcdClient, prefix: str | bytes, start_revision: int
) -> AsyncGenerator[WatchBatch, None]:
    """Watch every key under ``prefix`` from ``start_revision``; yield one ``WatchBatch`` per response.

    The first batch is the ``created`` one; etcd's own progress notifications come as batches without events.
    Raises ``Compacted`` when ``start_revision`` was compacted, ``EtcdUnavailable`` when the stream fails or
    etcd says nothing for ``dead_after`` s although asked every ``probe_interval`` s (resume from the last batch's
    revision + 1).

    In a burst (``settings.burst_events`` events within ``burst_window`` s) the watch is cancelled and created
    again on the same stream ``burst_pause`` s later from the last revision + 1, which etcd replays in one
    response (a watcher behind is caught up every 0.1 s, up to 1,000 revisions a response): a burst of
    registrations costs a few responses a second instead of one per put. The stream and its probes stay up
    meanwhile, so silence is noticed as before; a compaction during the pause raises ``Compacted``.
    """
    endpoint, bound = client.current_endpoint, client.settings.dead_after
    try:
        async with (
            _stream(client, "/etcdserverpb.Watch/Watch", pb.WatchRequest, pb.WatchResponse) as call,
            _Pacer(call, client.settings) as pacer,
        ):
            watch = _Watch(endpoint, pacer, prefix, start_revision)
            async with asyncio.timeout(bound):
                await call.write(watch.create(start_revision))
            while True:
                async with asyncio.timeout(bound):
                    reply = await call.read()
                batch = watch.answer(reply)
                if batch is not None:
                    yield batch
    except _BROKEN as exc:
        _failed(client, exc, endpoint)
        if isinstance(exc, EtcdUnavailable):
            raise
        raise _watch_broke(exc, endpoint, bound) from None


def _watch_broke(exc: BaseException, endpoint: str, bound: float) -> EtcdError:
    """Ours for a watch stream that broke with gRPC's error, our read timeout or grpc.aio's state error."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return translate(exc, endpoint)
    if isinstance(exc, TimeoutError):
        return EtcdUnavailable(f"etcd {endpoint}: watch stream timed out, nothing heard for {bound:g}s")
    return EtcdUnavailable(f"etcd {endpoint}: watch stream broke ({type(exc).__name__})")


class _Watch:
    """One watch stream's state (which of its watches is live, the revision to resume from) and what each of
    etcd's responses on it means for ``watch_prefix``."""

    def __init__(self, endpoint: str, pacer: _Pacer, prefix: str | bytes, start_revision: int) -> None:
        self._endpoint, self._pacer = endpoint, pacer
        self._key, self._end = prefix_range(prefix)
        self._live: int | None = None
        """The watch whose events are yielded; None while paused."""
        self._resume = start_revision - 1
        """Every change up to this revision was yielded."""

    def create(self, revision: int) -> Message:
        request = pb.WatchCreateRequest(
            key=self._key, range_end=self._end, start_revision=revision, progress_notify=True
        )
        return pb.WatchRequest(create_request=request)

    def answer(self, reply: Any) -> WatchBatch | None:
        """The batch to yield for ``reply`` (None: nothing to yield); raises when etcd ended the stream or the watch."""
        if reply is grpc.aio.EOF:
            raise EtcdUnavailable(f"etcd {self._endpoint} closed the watch stream")
        if reply.canceled and reply.watch_id not in self._pacer.cancelled:
            raise self._cancelled(reply)
        if reply.created:
            return self._created(reply)
        if reply.watch_id != self._live:
            # The answer to a progress request (watch id -1): proof of life only. etcd 3.4 may send it ahead of
            # events still on their way (etcd issue 15220), so its revision is no resume point. Or events of a
            # watch cancelled in a burst: the next watch starts from ``resume + 1``.
            return None
        return self._events(reply)

    def _cancelled(self, reply: Any) -> EtcdError:
        if reply.compact_revision:
            return Compacted(reply.compact_revision)
        return EtcdError(f"etcd {self._endpoint} cancelled the watch: {reply.cancel_reason}")

    def _created(self, reply: Any) -> WatchBatch | None:
        """The first watch's creation starts the probes and is yielded; a watch created again after a pause is not."""
        first = self._live is None and not self._pacer.cancelled
        self._live = reply.watch_id
        if not first:
            return None
        self._pacer.start_probing()
        return WatchBatch(reply.header.revision, [], True)

    def _events(self, reply: Any) -> WatchBatch:
        events = [
            Event(type=EventType.DELETE if e.type == pb.Event.DELETE else EventType.PUT, kv=key_value(e.kv))
            for e in reply.events
        ]
        # A replayed response's header is etcd's current revision even when more events follow it (over 1,000
        # revisions behind): the last event is the resume point; without events, the header.
        self._resume = events[-1].kv.mod_revision if events else max(self._resume, reply.header.revision)
        if events and self._pacer.burst(asyncio.get_running_loop().time(), len(events)):
            self._pacer.pause(reply.watch_id, self.create(self._resume + 1))
            self._live = None
        return WatchBatch(self._resume, events)


class _Pacer:
    """The writes of one watch stream after its first: progress requests every ``probe_interval`` s, and in a
    burst a cancel and a create ``burst_pause`` s later (one write at a time: gRPC takes one message in flight)."""

    def __init__(self, call: Any, settings: EtcdSettings) -> None:
        self._call, self._settings = call, settings
        self._lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._since, self._count = -1e9, 0
        self.cancelled: set[int] = set()
        """Watch ids cancelled here: their cancel confirmation and late events are expected."""

    async def __aenter__(self) -> _Pacer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for task in self._tasks:
            if not task.cancelled() and (exc := task.exception()) is not None:
                log.warning("etcd watch stream write failed: %r", exc)

    def burst(self, now: float, events: int) -> bool:
        """Count ``events`` received at ``now``; True when the watch is in a burst and should pause."""
        if self._settings.burst_pause <= 0:
            return False
        if now - self._since > self._settings.burst_window:
            self._since, self._count = now, 0
        self._count += events
        if self._count < self._settings.burst_events:
            return False
        self._since, self._count = -1e9, 0
        return True

    def start_probing(self) -> None:
        self._spawn(self._probe(), "etcd watch probe")

    def pause(self, watch_id: int, create: Message) -> None:
        """Cancel ``watch_id`` now and write ``create`` after ``burst_pause`` s."""
        self.cancelled.add(watch_id)
        self._spawn(self._pause(watch_id, create), "etcd watch pause")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.create_task(work, name=name))

    async def _write(self, request: Message) -> None:
        async with self._lock:
            await self._call.write(request)

    async def _probe(self) -> None:
        with contextlib.suppress(*_BROKEN):
            while True:
                await self._write(_PROGRESS)
                await asyncio.sleep(self._settings.probe_interval)

    async def _pause(self, watch_id: int, create: Message) -> None:
        with contextlib.suppress(*_BROKEN):
            await self._write(pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=watch_id)))
            await asyncio.sleep(self._settings.burst_pause)
            await self._write(create)


_PROGRESS = pb.WatchRequest(progress_request=pb.WatchProgressRequest())


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "silent"
    if isinstance(exc, grpc.aio.AioRpcError):
        return str(exc.code().name)
    return type(exc).__name__
