"""One node's KV-cache event subscription: its sockets, its sequence and what follows from it (reader.py reads
every node's in one thread).

Frames come in order (wire.py) and their events go to the index. ``seq`` counts the node's batches: a jump
forward is a gap, filled from the node's replay socket (a DEALER asks ``[b"", start]`` and reads batches until
seq -1, replay.py); a gap that cannot be filled means the view of that node can no longer be trusted, so its
entries are dropped and it starts afresh. ``seq`` going backwards (outside a range just replayed) means the node
restarted with an empty cache: its entries are dropped too. A malformed frame is counted, logged once per node,
and skipped. A subscriber that joins a node that has been publishing asks for the node's whole replay buffer
first.

Most frames are the next batch: ``frame`` applies them at once. A frame that needs the replay socket (a gap, a
restart, the first frame after a reconnection) is handed back as a ``Pending``; the reader stops reading the
node's socket (ZMQ keeps what comes meanwhile) and runs ``settle`` for it, then reads on.

A node counts as tracked while its publisher is connected (ZMQ's socket monitor says so) and not silent:
silent is a node that completed requests through this replica, ``SILENT_REQUESTS`` or more in each of two
``SILENT_CHECK`` windows in a row, without a single event, and whose replay socket then holds batches that never
came live, or does not answer (or that has none to ask). Untracked nodes are routed by content affinity.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from vllm_etcd_proxy.proxy.discovery.pool import NodeState
from vllm_etcd_proxy.proxy.kvcache.replay import replay, same_process
from vllm_etcd_proxy.proxy.kvcache.wire import Event, Malformed, read_batch, read_seq

log = logging.getLogger(__name__)

SILENT_CHECK = 5.0
SILENT_REQUESTS = 4
RECEIVE_HWM = 100_000
"""Frames ZMQ keeps for a subscriber busy with a replay (vLLM's own publisher keeps 100,000 too)."""
RECENT_SEEN = 8
"""Batches remembered by seq and payload, to tell a restarted node after a reconnection."""
REPLAYED_WINDOW = 2.0
"""Seconds after a replay during which live frames it already brought count as seen, not as a restart: those
ZMQ kept while the replay ran (a restarted node's new frames come later than that)."""
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the publish-to-index lag histogram on /metrics."""
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class KvSink(Protocol):
    """What the subscribers feed: the index (index.py)."""

    def apply(self, name: str, events: Iterable[Event]) -> None: ...

    def drop(self, name: str) -> None: ...


@dataclass
class KvStats:
    """Totals over all nodes, for /metrics; ``lag_counts[i]``: live batches applied within ``LAG_BUCKETS[i]`` of
    their publishing (not cumulative; the last entry counts those later than every bucket)."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    malformed: int = 0
    restarts: int = 0
    lag_counts: list[int] = field(default_factory=lambda: [0] * (len(LAG_BUCKETS) + 1))
    lag_sum: float = 0.0
    lag: float = 0.0
    """Of the last live batch applied, any node's."""


class Pending(NamedTuple):
    """A frame ``frame`` could not apply on its own: ``settle`` it. ``restarted``: the node restarted (True),
    did not (False), or the replay socket must say (None: the first frame after a reconnection)."""

    seq: int
    payload: bytes
    restarted: bool | None


class Subscriber:
    """One node's subscription (see the module docstring); ``view()`` is what /list_workers shows. Its state is
    written by the reader's thread and read by the request path (single values: each read is whole)."""

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
        self.sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]] | None = None
        """(events, monitor) while open, read without futures (reader.py polls their descriptors)."""
        self._owned: tuple[zmq.asyncio.Socket, zmq.asyncio.Socket] | None = None
        self.fds: tuple[int, ...] = ()
        """The sockets' descriptors, while the reader polls them."""
        self.monitor_due = True
        """The monitor socket signalled since it was last read."""

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

    # -- sockets ------------------------------------------------------------------------------------------------

    def open(self, context: zmq.asyncio.Context) -> None:
        """The SUB socket, connecting (ZMQ retries until the publisher answers), and its monitor."""
        sub = context.socket(zmq.SUB)
        for option, value in (
            (zmq.SUBSCRIBE, b""),
            (zmq.RCVHWM, RECEIVE_HWM),
            (zmq.LINGER, 0),
            (zmq.RECONNECT_IVL_MAX, 5000),
        ):
            sub.setsockopt(option, value)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._owned = (sub, monitor)
        self.sockets = (zmq.Socket.shadow(sub.underlying), zmq.Socket.shadow(monitor.underlying))
        sub.connect(self.endpoint)

    def close(self) -> None:
        if self._owned is not None:
            sub, monitor = self._owned
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
        self._owned = self.sockets = None
        self.connected = False

    def read(self, budget: int) -> Pending | bool:
        """Take in what the sockets hold, ``budget`` frames at most: a ``Pending`` to settle before reading on,
        else whether frames are left."""
        assert self.sockets is not None
        events, monitor = self.sockets
        if self.monitor_due:
            while cast(int, monitor.getsockopt(_EVENTS)) & _POLLIN:
                self._monitor(monitor.recv_multipart(zmq.NOBLOCK))
        recv, flags = events.recv, cast(Callable[[int], int], events.getsockopt)
        for _ in range(budget):
            if not flags(_EVENTS) & _POLLIN:
                return False
            part = recv(zmq.NOBLOCK, copy=False)  # a Frame says whether more follow: no RCVMORE asked
            frames = [part.bytes]
            while part.more:  # a message's parts arrive together
                part = recv(zmq.NOBLOCK, copy=False)
                frames.append(part.bytes)
            pending = self.frame(frames)
            if pending is not None:
                return pending
        return True

    def _monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            self.connected = True
            log.info("kv events connected node=%s endpoint=%s", self.name, self.endpoint)
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected, self._resumed = False, True
            log.warning("kv events disconnected node=%s endpoint=%s", self.name, self.endpoint)

    def check_silence(self) -> bool:
        """Called every ``SILENT_CHECK`` seconds. True when the node looks silent and its replay socket is to say
        whether it is (``confirm_silence``); a node without one is marked silent at once."""
        served, suspect = self.state.served, False
        if self.counts["batches"] != self._batches_seen:
            self._quiet_windows, self.silent = 0, False
        elif served - self._served_seen >= SILENT_REQUESTS:
            self._quiet_windows += 1
            if self._quiet_windows >= 2 and not self.silent:
                suspect = self.replay is not None
                if not suspect:
                    self._mark_silent("it served requests but published nothing")
        self._served_seen, self._batches_seen = served, self.counts["batches"]
        return suspect

    async def confirm_silence(self, context: zmq.asyncio.Context) -> None:
        """Requests without events are no proof of a lost publisher: one whose prompts a node held whole and whose
        answers filled no block store nothing, so vLLM publishes nothing for them. Ask the replay socket for what
        came after the last batch: when it answers with nothing, the publisher is alive and nothing was missed;
        when it answers batches, they are applied, but the live feed lost them (silent); when it does not answer,
        silent."""
        before = self.counts["batches"]
        answered = await self.catch_up(context, 0 if self.last_seq is None else self.last_seq + 1)
        missed = self.counts["batches"] - before
        self._batches_seen = self.counts["batches"]  # batches that came by replay do not end a silence
        if answered and not missed:
            self._quiet_windows = 0
        elif not answered:
            self._mark_silent("it served requests but published nothing, and its replay socket does not answer")
        else:
            self._mark_silent(f"its replay socket held {missed} batches that never came live")

    def _mark_silent(self, why: str) -> None:
        if not self.silent:
            self.silent = True
            log.warning("kv events silent node=%s: %s; routing by content for it", self.name, why)

    def malformed(self, reason: str) -> None:
        self._count("malformed")
        if not self._warned:
            self._warned = True
            log.warning(
                "kv events: malformed frame skipped node=%s reason=%s (logged once per node)", self.name, reason
            )

    # -- frames -------------------------------------------------------------------------------------------------

    def frame(self, frames: list[bytes]) -> Pending | None:
        """One frame of the SUB socket: applied when it is the next batch; a ``Pending`` when the replay socket
        must be asked first."""
        self.connected = True  # whatever the monitor said last: a frame came
        if len(frames) != 3:
            self.malformed(f"{len(frames)} frames, not 3")
            return None
        try:
            seq = read_seq(frames[1])
        except Malformed as exc:
            self.malformed(str(exc))
            return None
        last = self.last_seq
        resumed, self._resumed = self._resumed, False
        if last is not None and seq <= last:
            if time.monotonic() < self._replayed_until and self._replayed.get(seq) == hash(frames[2]):
                return None  # seen in a replay already
            return Pending(seq, frames[2], True)
        if last is not None and resumed and self.replay is not None:
            return Pending(seq, frames[2], None)
        if (last is not None and seq > last + 1) or (last is None and seq > 0 and self.replay is not None):
            return Pending(seq, frames[2], False)
        self.apply(seq, frames[2], live=True)
        return None

    async def settle(self, context: zmq.asyncio.Context, pending: Pending) -> None:
        """Apply a frame that needed the replay socket: ask it whether the node restarted, fill the gap before
        the frame (or forget the node's blocks when that cannot be done), then apply the frame."""
        seq, payload, restarted = pending
        if restarted is None:
            assert self.replay is not None
            restarted = not await same_process(context, self.replay, self._seen, self.malformed)
        last = self.last_seq
        if restarted:
            self._count("restarts")
            log.info(
                "kv events: node restarted (seq %d after %s) node=%s: its blocks are forgotten", seq, last, self.name
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
            self.apply(seq, payload, live=True)

    async def catch_up_at_start(self, context: zmq.asyncio.Context) -> None:
        """What the node held before this replica subscribed: its whole replay buffer."""
        try:
            if self.replay is not None:
                await self.catch_up(context, 0)
        finally:
            self.caught_up = True

    async def _gap(self, context: zmq.asyncio.Context, start: int) -> None:
        """Batches from ``start`` were missed: replay them, or forget the node's blocks when that cannot be done."""
        self._count("gaps")
        if self.replay is None or not await self.catch_up(context, start):
            log.warning("kv events: gap from seq %d not replayed node=%s: its blocks are forgotten", start, self.name)
            self._sink.drop(self.name)

    async def catch_up(self, context: zmq.asyncio.Context, start: int) -> bool:
        """Apply the replay socket's batches from ``start``; False when it did not answer. When its buffer no
        longer reaches back to ``start`` (> 0), the batches between are lost: the node's blocks are dropped
        first, and the replayed ones are the best view there is."""
        assert self.replay is not None
        self._count("replays")
        first: int | None = None
        self._replayed = replayed = {}
        try:
            async with contextlib.aclosing(replay(context, self.replay, start, self.malformed)) as answers:
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
                    self.apply(seq, payload, live=False)
        except (TimeoutError, Malformed, zmq.ZMQError) as exc:
            log.warning(
                "kv events: replay failed node=%s endpoint=%s error=%s", self.name, self.replay, type(exc).__name__
            )
            return False
        self._replayed_until = time.monotonic() + REPLAYED_WINDOW
        return True

    def apply(self, seq: int, payload: bytes, live: bool) -> None:
        self.last_seq = seq
        self._seen.append((seq, payload))  # kept, not hashed: compared only after a reconnection
        try:
            batch = read_batch(seq, payload)
        except Malformed as exc:
            self.malformed(str(exc))
            return
        if batch.bad_events:
            self.malformed(f"{batch.bad_events} malformed events in a batch")
        events, counts, stats = batch.events, self.counts, self._stats
        self._sink.apply(self.name, events)
        counts["batches"] += 1
        counts["events"] += len(events)
        stats.batches += 1
        stats.events += len(events)
        self.last_event_at = time.monotonic()
        self.lag = lag = max(0.0, time.time() - batch.ts)
        if live:  # a replayed batch's lag is how long ago the node published it, not how far behind we are
            stats.lag_counts[bisect.bisect_left(LAG_BUCKETS, lag)] += 1
            stats.lag_sum += lag
            stats.lag = lag
