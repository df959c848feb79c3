"""One node's KV-cache event subscription (kvnodes.py starts one per publishing node).

Each subscriber reads its node's frames in order (kvwire.py) and hands the events to the index. ``seq`` counts
the node's batches: a jump forward is a gap, filled from the node's replay socket (a DEALER asks ``[b"",
start]`` and reads batches until seq -1); a gap that cannot be filled means the view of that node can no
longer be trusted, so its entries are dropped and it starts afresh. ``seq`` going backwards (outside a range
just replayed) means the node restarted with an empty cache: its entries are dropped too. A malformed frame is
counted, logged once per node, and skipped. A subscriber that joins a node that has been publishing asks for
the node's whole replay buffer first.

A node counts as tracked while its publisher is connected (ZMQ's socket monitor says so) and not silent:
silent is a node that completed requests through this replica, ``SILENT_REQUESTS`` or more in each of two
``SILENT_CHECK`` windows in a row, without a single event. Untracked nodes are routed by content affinity.

The cost is a task and two sockets per publishing node, and work in proportion to the events that arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from vllm_etcd_proxy.proxy.discovery.kvreplay import replay, same_process
from vllm_etcd_proxy.proxy.discovery.kvwire import Event, Malformed, read_batch, read_seq
from vllm_etcd_proxy.proxy.discovery.pool import NodeState

log = logging.getLogger(__name__)

SILENT_CHECK = 5.0
SILENT_REQUESTS = 4
RECEIVE_HWM = 100_000
"""Frames ZMQ keeps for a subscriber busy with a replay (vLLM's own publisher keeps 100,000 too)."""
DRAIN = 256
"""Frames read in one go before the loop yields to others."""
RECENT_SEEN = 8
"""Batches remembered by seq and payload, to tell a restarted node after a reconnection."""
REPLAYED_WINDOW = 2.0
"""Seconds after a replay during which live frames it already brought count as seen, not as a restart: those
ZMQ kept while the replay ran (a restarted node's new frames come later than that)."""


class KvSink(Protocol):
    """What the subscribers feed: the index (routing/kvindex.py)."""

    def apply(self, name: str, events: Iterable[Event]) -> None: ...

    def drop(self, name: str) -> None: ...


@dataclass
class KvStats:
    """Totals over all nodes, for /metrics."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    malformed: int = 0
    restarts: int = 0


class Subscriber:
    """One node's subscription (see the module docstring); ``view()`` is what /list_workers shows."""

    def __init__(
        self, name: str, state: NodeState, endpoint: str, replay: str | None, sink: KvSink, stats: KvStats
    ) -> None:
        self.name, self.state, self.endpoint, self.replay = name, state, endpoint, replay
        self._sink, self._stats = sink, stats
        self.connected = False
        self.silent = False
        self.caught_up = replay is None
        """Its first replay (what the node held before this replica subscribed) is applied, or failed."""
        self.last_seq: int | None = None
        self._replayed: dict[int, int] = {}
        """seq -> hash of the payload, of the batches the last replay brought: the same batch seen live again
        soon after (it was on its way meanwhile) is no restart; another batch with such a seq is."""
        self._replayed_until = 0.0
        self._seen: deque[tuple[int, bytes]] = deque(maxlen=RECENT_SEEN)
        """(seq, payload) of the last batches applied: after a reconnection, a node whose replay
        socket has other batches under those seqs restarted, even if its new seqs already passed ours."""
        self._resumed = False
        """The connection dropped since the last frame."""
        self.last_event_at: float | None = None
        self.lag: float | None = None
        self.counts = {"batches": 0, "events": 0, "gaps": 0, "replays": 0, "malformed": 0, "restarts": 0}
        self._warned = False
        self._served_seen = state.served
        self._batches_seen = 0
        self._quiet_windows = 0

    @property
    def tracked(self) -> bool:
        return self.connected and not self.silent

    def view(self) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "endpoint": self.endpoint,
            "replay": self.replay,
            "connected": self.connected,
            "silent": self.silent,
            "tracked": self.tracked,
            "last_seq": self.last_seq,
            "last_event_seconds_ago": None if self.last_event_at is None else round(now - self.last_event_at, 3),
            "lag_seconds": None if self.lag is None else round(self.lag, 3),
            **self.counts,
        }

    def _count(self, what: str, n: int = 1) -> None:
        self.counts[what] += n
        setattr(self._stats, what, getattr(self._stats, what) + n)

    async def run(self, context: zmq.asyncio.Context) -> None:
        sub = context.socket(zmq.SUB)
        for option, value in (
            (zmq.SUBSCRIBE, b""),
            (zmq.RCVHWM, RECEIVE_HWM),
            (zmq.LINGER, 0),
            (zmq.RECONNECT_IVL_MAX, 5000),
        ):
            sub.setsockopt(option, value)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)  # read what is there, no future per frame
        watch: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
        loop = asyncio.get_running_loop()
        wake = _Wake(loop)
        fds: list[int] = []
        try:
            sub.connect(self.endpoint)
            if self.replay is not None:
                await self._catch_up(context, 0)
            self.caught_up = True
            # The sockets' own file descriptors wake this task, rather than pyzmq's asyncio Poller, whose every
            # poll costs futures, a timer and a callback per socket: a batch came at 0.2-0.4 ms of CPU that way.
            for socket in (raw, watch):
                fds.append(cast(int, socket.getsockopt(zmq.FD)))
                loop.add_reader(fds[-1], wake.set)
            next_check = time.monotonic() + SILENT_CHECK
            # A descriptor only says that something changed: ZMQ's EVENTS says whether a message waits (and asking
            # it costs less than the exception of reading none).
            while True:
                while _readable(watch):
                    self._monitor(watch.recv_multipart(zmq.NOBLOCK))
                more = False
                for _ in range(DRAIN):
                    if not _readable(raw):
                        break
                    await self._frame(context, raw.recv_multipart(zmq.NOBLOCK))
                else:
                    more = True
                if time.monotonic() >= next_check:
                    self._check_silence()
                    next_check = time.monotonic() + SILENT_CHECK
                if more:
                    await asyncio.sleep(0)  # DRAIN frames in a row: let the others run, then read on
                elif not (_readable(raw) or _readable(watch)):
                    await wake.wait(max(0.0, next_check - time.monotonic()))
        finally:
            for fd in fds:
                loop.remove_reader(fd)
            sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            self.connected = False

    def _monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            log.info("kv events connected node=%s endpoint=%s", self.name, self.endpoint)
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected, self._resumed = False, True
            log.warning("kv events disconnected node=%s endpoint=%s", self.name, self.endpoint)

    def _check_silence(self) -> None:
        served = self.state.served
        if self.counts["batches"] != self._batches_seen:
            self._quiet_windows, self.silent = 0, False
        elif served - self._served_seen >= SILENT_REQUESTS:
            self._quiet_windows += 1
            if self._quiet_windows >= 2 and not self.silent:
                self.silent = True
                log.warning(
                    "kv events silent node=%s: it served requests but published nothing; routing by content for it",
                    self.name,
                )
        self._served_seen, self._batches_seen = served, self.counts["batches"]

    def _malformed(self, reason: str) -> None:
        self._count("malformed")
        if not self._warned:
            self._warned = True
            log.warning(
                "kv events: malformed frame skipped node=%s reason=%s (logged once per node)", self.name, reason
            )

    async def _frame(self, context: zmq.asyncio.Context, frames: list[bytes]) -> None:
        self.connected = True  # whatever the monitor said last: a frame came
        if len(frames) != 3:
            self._malformed(f"{len(frames)} frames, not 3")
            return
        try:
            seq = read_seq(frames[1])
        except Malformed as exc:
            self._malformed(str(exc))
            return
        last = self.last_seq
        resumed, self._resumed = self._resumed, False
        restarted = False
        if last is not None and seq <= last:
            if time.monotonic() < self._replayed_until and self._replayed.get(seq) == hash(frames[2]):
                return  # seen in a replay already
            restarted = True
        elif last is not None and resumed and self.replay is not None:
            restarted = not await same_process(context, self.replay, self._seen, self._malformed)
        if restarted:
            self._count("restarts")
            log.info(
                "kv events: node restarted (seq %d after %d) node=%s: its blocks are forgotten", seq, last, self.name
            )
            self._sink.drop(self.name)
            self.last_seq = last = None
            if seq > 0:
                await self._gap(context, 0)
        elif last is not None and seq > last + 1:
            await self._gap(context, last + 1)
        elif last is None and seq > 0 and self.replay is not None:
            await self._gap(context, 0)  # the first batch seen (the replay at start had none): some came before
        if self.last_seq is None or seq > self.last_seq:
            self._apply(seq, frames[2])

    async def _gap(self, context: zmq.asyncio.Context, start: int) -> None:
        """Batches from ``start`` were missed: replay them, or forget the node's blocks when that cannot be done."""
        self._count("gaps")
        if self.replay is None or not await self._catch_up(context, start):
            log.warning("kv events: gap from seq %d not replayed node=%s: its blocks are forgotten", start, self.name)
            self._sink.drop(self.name)

    async def _catch_up(self, context: zmq.asyncio.Context, start: int) -> bool:
        """Apply the replay socket's batches from ``start``; False when it did not answer. When its buffer no
        longer reaches back to ``start`` (> 0), the batches between are lost: the node's blocks are dropped
        first, and the replayed ones are the best view there is."""
        assert self.replay is not None
        self._count("replays")
        first: int | None = None
        self._replayed = replayed = {}
        try:
            async with contextlib.aclosing(replay(context, self.replay, start, self._malformed)) as answers:
                async for seq, payload in answers:
                    if seq < start or (self.last_seq is not None and seq <= self.last_seq):
                        continue
                    if first is None:
                        first = seq
                        if seq > start > 0:
                            log.warning(
                                "kv events: replay starts at seq %d, not %d node=%s: its blocks are forgotten",
                                seq,
                                start,
                                self.name,
                            )
                            self._sink.drop(self.name)
                    replayed[seq] = hash(payload)
                    self._apply(seq, payload)
        except (TimeoutError, Malformed, zmq.ZMQError) as exc:
            log.warning(
                "kv events: replay failed node=%s endpoint=%s error=%s", self.name, self.replay, type(exc).__name__
            )
            return False
        self._replayed_until = time.monotonic() + REPLAYED_WINDOW
        return True

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self._seen.append((seq, payload))  # kept, not hashed: compared only after a reconnection
        try:
            batch = read_batch(seq, payload)
        except Malformed as exc:
            self._malformed(str(exc))
            return
        if batch.bad_events:
            self._malformed(f"{batch.bad_events} malformed events in a batch")
        self._sink.apply(self.name, batch.events)
        self._count("batches")
        self._count("events", len(batch.events))
        self.last_event_at = time.monotonic()
        self.lag = max(0.0, time.time() - batch.ts)


def _readable(socket: zmq.Socket[bytes]) -> bool:
    return bool(cast(int, socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


class _Wake:
    """A task's wake-up from file-descriptor callbacks: ``wait`` until ``set`` is called or ``timeout`` passes."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        self._waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, self.set)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
