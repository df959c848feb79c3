"""Every node's KV-event sockets, read by one thread of the replica (``KvReader``).

A replica follows every publishing node, and a busy vLLM node sends a batch per engine step: hundreds of nodes
send thousands of batches a second. Read by a task per node on the request path's event loop, each batch cost a
wake-up of its own and requests waited behind them (bench/README.md, bench.kv_ingest). Here one thread with an
event loop of its own reads them all:
- each node's SUB socket and its monitor are in one epoll set, armed one-shot: a socket that signals is read
  until it is empty, then armed again; a node waiting for its replay socket is simply not armed (ZMQ keeps its
  frames meanwhile);
- after a round of reading the thread sleeps ``TICK`` seconds, so that one wake-up takes in every batch that came
  meanwhile (at 10,000 batches a second, ~50 a round) rather than one each;
- it reads for ``SLICE`` seconds at most before sleeping for a moment, so the request path, which needs the
  interpreter's lock too, never waits long for it (a thread holding the lock gives it up only at a blocking call
  or, when another thread has asked for 5 ms, at the interpreter's switch interval);
- replays (replay.py) run as tasks of that loop, one node at a time each, while the others are read on.
The index is changed from this thread under its lock (index.py); nodes are added and removed from the request
path's loop through ``add`` and ``remove``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import select
import threading
import time
from collections.abc import Coroutine
from typing import Any

import zmq
import zmq.asyncio

from vllm_etcd_proxy.proxy.kvcache.subscription import SILENT_CHECK, KvSink, KvStats, Pending, Subscriber

log = logging.getLogger(__name__)

TICK = 0.005
"""Seconds between rounds of reading while batches keep coming: the lag it adds, at most."""
SLICE = 0.001
"""Seconds of reading before the thread sleeps for a moment (``PAUSE``) and lets the request path run."""
PAUSE = 0.0002
"""(Not through the event loop, whose shortest sleep is a millisecond.)"""
BEHIND = 0.05
"""Seconds of lag behind the nodes (the last live batch's) past which the reader no longer pauses between
slices: on a machine short of CPU, requests then wait for the lock up to the interpreter's switch interval
(5 ms), rather than the index falling seconds behind."""
BUDGET = 32
"""Frames read from one socket before the others get their turn (and the slice's clock is read)."""
RETRY = 1.0
"""Seconds before a subscriber that failed (a bug) is opened again."""
SOCKETS_PER_NODE = 4
"""A SUB socket, its monitor's two ends, and a DEALER while replaying."""
_ARMED = select.EPOLLIN | select.EPOLLONESHOT


class KvReader:
    """The reading thread (module docstring). ``start`` it, ``add`` and ``remove`` subscribers from any thread,
    ``stop`` it from the request path's loop."""

    def __init__(self, sink: KvSink, stats: KvStats) -> None:
        self._sink, self._stats = sink, stats
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._context: zmq.asyncio.Context | None = None
        self._epoll = select.epoll()
        self._by_fd: dict[int, tuple[Subscriber, bool]] = {}
        """A socket's descriptor -> its subscriber, and whether it is the monitor's."""
        self._subs: dict[Subscriber, asyncio.Task[None] | None] = {}
        """Open subscribers -> the task settling one of its frames or catching up, if one runs."""
        self._ready: dict[Subscriber, None] = {}
        """Subscribers to read, in turn (a dict as an ordered set)."""
        self._wake: asyncio.Event | None = None
        self._done = threading.Event()

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(ready,), name="kv-events", daemon=True)
        self._thread.start()
        ready.wait()

    def add(self, sub: Subscriber) -> None:
        self._call(self._add, sub)

    def remove(self, sub: Subscriber) -> None:
        self._call(self._remove, sub)

    def _call(self, fn: Any, sub: Subscriber) -> None:
        if self._loop is not None and not self._done.is_set():
            self._loop.call_soon_threadsafe(fn, sub)

    async def stop(self) -> None:
        """Close every subscriber and end the thread."""
        if self._loop is None or self._thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed
            self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join, 10.0)

    # -- the thread ---------------------------------------------------------------------------------------------

    def _open(self, loop: asyncio.AbstractEventLoop) -> list[asyncio.Task[None]]:
        self._loop = loop
        self._context = zmq.asyncio.Context()
        # ZMQ's default of 1,023 sockets a context would stop at ~250 nodes: allow as many as it can.
        self._context.set(zmq.MAX_SOCKETS, self._context.get(zmq.SOCKET_LIMIT))
        self._wake = asyncio.Event()
        loop.add_reader(self._epoll.fileno(), self._collect)
        return [loop.create_task(self._guard(self._read)), loop.create_task(self._guard(self._watch_silence))]

    async def _shut(self, tasks: list[asyncio.Task[None]]) -> None:
        assert self._loop is not None and self._context is not None
        self._done.set()
        tasks = tasks + [task for task in self._subs.values() if task is not None]
        for sub in list(self._subs):
            self._remove(sub)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop.remove_reader(self._epoll.fileno())
        self._epoll.close()
        self._context.term()

    def _main(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            tasks = self._open(loop)
        finally:
            ready.set()  # start() returns either way; a failure here is logged by the thread's excepthook
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._shut(tasks))
            loop.close()

    async def _guard(self, run: Any) -> None:
        """Run a loop of this thread forever; a bug in it is logged with its traceback and it starts again."""
        delay = 0.5
        while True:
            try:
                await run()
            except Exception:
                log.exception("kv events reader failed; starting it again in %.1fs", delay)
            await asyncio.sleep(delay)
            delay = min(30.0, 2 * delay)

    def _add(self, sub: Subscriber) -> None:
        assert self._context is not None
        _room_for(len(self._subs) + 1)
        self._subs[sub] = None
        try:
            sub.open(self._context)
        except zmq.ZMQError:
            log.exception("kv events: cannot subscribe node=%s endpoint=%s", sub.name, sub.endpoint)
            self._failed(sub)
            return
        assert sub.sockets is not None
        fds = []
        for socket, monitor in zip(sub.sockets, (False, True), strict=True):
            fd = socket.getsockopt(zmq.FD)
            assert isinstance(fd, int)
            fds.append(fd)
            self._by_fd[fd] = (sub, monitor)
            self._epoll.register(fd, 0)  # armed once its first replay is in
        sub.fds = tuple(fds)
        self._run_for(sub, sub.catch_up_at_start(self._require_context()))

    def _remove(self, sub: Subscriber) -> None:
        if sub not in self._subs:
            return
        task = self._subs.pop(sub)
        if task is not None:
            task.cancel()
        self._ready.pop(sub, None)
        self._close(sub)
        self._sink.drop(sub.name)

    def _close(self, sub: Subscriber) -> None:
        for fd in sub.fds:
            self._by_fd.pop(fd, None)
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        sub.fds = ()
        sub.close()

    def _failed(self, sub: Subscriber) -> None:
        """A bug in one subscriber must not end its node's tracking for good: forget what it said, and open
        it again in a moment."""
        self._ready.pop(sub, None)
        self._close(sub)
        self._sink.drop(sub.name)
        sub.last_seq, sub.caught_up = None, True
        assert self._loop is not None
        self._loop.call_later(RETRY, self._reopen, sub)

    def _reopen(self, sub: Subscriber) -> None:
        if sub in self._subs and sub.sockets is None:
            del self._subs[sub]
            self._add(sub)

    def _require_context(self) -> zmq.asyncio.Context:
        assert self._context is not None
        return self._context

    def _run_for(self, sub: Subscriber, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` for the subscriber, its sockets unread meanwhile; then read them again."""
        assert self._loop is not None
        self._subs[sub] = self._loop.create_task(self._then_read(sub, work), name=f"kv-events {sub.name}")

    async def _then_read(self, sub: Subscriber, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception:
            log.exception("kv events subscriber failed node=%s", sub.name)
            self._subs[sub] = None
            self._failed(sub)
            return
        self._subs[sub] = None
        self._mark(sub)

    def _mark(self, sub: Subscriber, monitor: bool = True) -> None:
        """Read the subscriber in the next round (its monitor too, or only its events)."""
        sub.monitor_due = sub.monitor_due or monitor
        self._ready[sub] = None
        assert self._wake is not None
        self._wake.set()

    def _collect(self) -> None:
        """The epoll set signalled: its ready subscribers are read in the next round (each fires once: one-shot)."""
        for fd, _ in self._epoll.poll(0):
            found = self._by_fd.get(fd)
            if found is not None and self._subs.get(found[0], 1) is None:
                self._mark(*found)

    async def _read(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._ready:
                if not self._round():
                    await asyncio.sleep(TICK)  # what comes meanwhile is read in one round
                    self._collect()
                else:
                    if self._stats.lag < BEHIND:  # the slice ran out: the interpreter's lock goes to requests,
                        time.sleep(PAUSE)  # unless the index falls behind the nodes (a starved machine)
                    await asyncio.sleep(0)  # and this loop's own work (replays, nodes added) runs

    def _round(self) -> bool:
        """Read the ready subscribers for one slice; whether some are left with frames."""
        deadline = time.perf_counter() + SLICE
        for sub in list(self._ready):
            del self._ready[sub]
            try:
                found = sub.read(BUDGET)
            except Exception:
                log.exception("kv events subscriber failed node=%s", sub.name)
                self._failed(sub)
                continue
            if isinstance(found, Pending):
                self._run_for(sub, sub.settle(self._require_context(), found))
            elif found:
                self._ready[sub] = None  # more to read: its turn again after the others
            else:
                self._arm(sub)
                sub.monitor_due = False
            if time.perf_counter() >= deadline:
                break
        return bool(self._ready)

    def _arm(self, sub: Subscriber) -> None:
        """Arm the descriptors that fired (one-shot: each fired once); the monitor's only when it did."""
        for fd in sub.fds if sub.monitor_due else sub.fds[:1]:
            self._epoll.modify(fd, _ARMED)

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(SILENT_CHECK)
            for sub in list(self._subs):
                if sub.check_silence() and self._subs.get(sub, 1) is None:  # not while it replays already
                    self._run_for(sub, sub.confirm_silence(self._require_context()))


def _room_for(nodes: int) -> None:
    """Raise the process's open-file limit towards what ``nodes`` subscribers need (each socket holds a
    descriptor, each connection another), as far as the hard limit allows."""
    wanted = 256 + 2 * SOCKETS_PER_NODE * nodes
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
