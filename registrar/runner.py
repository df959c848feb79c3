"""The registrar's life: run the child, wait for the node, register, watch its health, drain on a signal.

Signals work as in uvicorn: the handlers only record the signal and set events; the main task drains within
``--drain-timeout``, and a second SIGTERM/SIGINT cuts the drain short. In wrapper mode the child runs in its own
process group, so a terminal's Ctrl-C reaches the registrar alone and the drain (proxies stop routing) comes
before the child hears the signal; then every signal we got is forwarded and we wait for the child to exit.
A child that exits on its own is deregistered at once, and its exit code becomes ours (128+N for signal N).
The child is the command under a supervisor of ours (supervisor.py) that stops its process group if we are killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from vllm_etcd_proxy.fleet.etcd import EtcdAuthError, EtcdClient, EtcdError, EtcdUnavailable
from vllm_etcd_proxy.fleet.pb.node_record_pb2 import NodeRecord
from vllm_etcd_proxy.fleet.records import Status, set_cards
from vllm_etcd_proxy.registrar.errors import NodeUnreachable, ProbeError, StartupError
from vllm_etcd_proxy.registrar.lease import Registration
from vllm_etcd_proxy.registrar.probe import NodeProbe
from vllm_etcd_proxy.registrar.settings import RegistrarSettings
from vllm_etcd_proxy.registrar.supervisor import command_line

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
STARTUP_PATIENCE = 15.0
"""Seconds a registrar whose etcd answers but has no leader (an election) keeps asking before it exits 1."""
DRAIN_SETTLE = 0.5
"""Seconds after marking the key draining before an idle node counts as drained: requests that a proxy sent
just before it saw the new status are still on the wire."""
DRAIN_POLL = 0.25
"""Seconds between /metrics polls while draining."""
CHILD_STOP_TIMEOUT = 10.0
"""Seconds a child gets after SIGTERM when the registrar itself fails, before SIGKILL."""


def shell_exit_code(returncode: int) -> int:
    """A child's exit status the way a shell reports it: 128+N for death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _wait_any(events: Iterable[asyncio.Event], timeout: float | None, *also: asyncio.Future[Any]) -> None:
    """Return when one of ``events`` is set, one of ``also`` is done, or ``timeout`` s passed."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait([*waiters, *also], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class Runner:
    """One registrar run; ``run()`` returns the process exit code."""

    def __init__(self, settings: RegistrarSettings) -> None:
        self._settings = settings
        self._signals: list[signal.Signals] = []
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()
        self._signalled = asyncio.Event()
        self._child_gone = asyncio.Event()
        self._child: asyncio.subprocess.Process | None = None
        self._child_exit: asyncio.Task[int] | None = None

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals.append(sig)
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()
        self._signalled.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            client = EtcdClient(self._settings.etcd)
            try:
                await client.connect()
                # Fails now, not after the node is up, when our user may not touch the key.
                await self._first_read(client)
            except EtcdAuthError as exc:
                raise StartupError(
                    f"etcd refused us: {exc} (check --etcd-user, the password and the user's "
                    f"role on {self._settings.key})"
                ) from None
            except EtcdError as exc:
                raise StartupError(f"cannot connect to etcd: {exc}") from None
            try:
                return await self._run_connected(client)
            finally:
                await client.close()
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)

    async def _first_read(self, client: EtcdClient) -> None:
        """Read our key once. A member answered ``connect``, so an unavailable answer now is a cluster between
        leaders (an election takes a second or two): ask again for up to ``STARTUP_PATIENCE`` s before giving up."""
        deadline = asyncio.get_running_loop().time() + STARTUP_PATIENCE
        pause = 0.1
        while True:
            try:
                await client.get(self._settings.key)
                return
            except EtcdUnavailable as exc:
                if asyncio.get_running_loop().time() + pause > deadline:
                    raise
                logger.warning("etcd answered but cannot serve a read yet (%s); asking again in %.1fs", exc, pause)
                await asyncio.sleep(pause)
                pause = min(2.0, pause * 2)

    async def _run_connected(self, client: EtcdClient) -> int:
        s = self._settings
        logger.info("registrar starting key=%s url=%s ttl=%d wrapper=%s", s.key, s.url, s.ttl, bool(s.command))
        if s.ttl <= s.etcd.lease_bound:
            # The lease can go this long unrefreshed beyond a partition itself (see EtcdSettings.lease_bound).
            logger.warning(
                "ttl=%d is short: not above %.1fs (--etcd-dead-after + a third), so even a short etcd "
                "hiccup or partition can drop the key until etcd answers again",
                s.ttl,
                s.etcd.lease_bound,
            )
        if self._stop.is_set():
            return 0  # told to stop before anything started
        if s.command:
            await self._start_child(s.command)
        try:
            async with NodeProbe(s.url, timeout=s.health_timeout, tls=s.node_tls.context()) as probe:
                await self._serve(client, probe)
            return await self._finish_child()
        finally:
            await self._reap_child()

    async def _start_child(self, command: tuple[str, ...]) -> None:
        # Own process group: signals from a terminal reach us only; we forward them after the drain. The
        # supervisor reports a command it cannot run (exit 127 or 126) and exits with the command's code.
        supervised = command_line(command, parent=os.getpid(), grace=self._settings.drain_timeout)
        try:
            self._child = await asyncio.create_subprocess_exec(*supervised, process_group=0)
        except OSError as exc:
            raise StartupError(f"cannot start the supervisor {supervised[0]!r}: {exc.strerror or exc}") from None
        self._child_exit = asyncio.create_task(self._child.wait(), name="child exit")
        self._child_exit.add_done_callback(lambda _: self._child_gone.set())
        logger.info("child started pid=%d command=%s", self._child.pid, shlex.join(command))

    async def _serve(self, client: EtcdClient, probe: NodeProbe) -> None:
        s = self._settings
        ready = await self._wait_ready(probe)
        if ready is None:
            return
        models, version = ready
        record = NodeRecord(
            url=s.url,
            role=s.role.value,
            models=models,
            status=Status.SERVING.value,
            labels=dict(s.labels),
            version=version,
            registered_at=_now_rfc3339(),
            source="registrar",
            kv_events=s.kv_events or "",
            kv_events_replay=s.kv_events_replay or "",
            kv_connector=s.kv_connector or "",
        )
        set_cards(record, probe.cards)
        registration = Registration(client, key=s.key, ttl=s.ttl, record=record)
        registration.start()
        try:
            await self._watch_health(probe, registration, models)
            if self._stop.is_set() and not self._child_gone.is_set():
                await self._drain(probe, registration)
        finally:
            await registration.stop()
        if self._child_gone.is_set() and not self._stop.is_set():
            logger.warning("child exited on its own: deregistered key=%s", s.key)

    async def _wait_ready(self, probe: NodeProbe) -> tuple[tuple[str, ...], str] | None:
        """Poll the node until it is healthy (and lists its models when they are auto); None if told to stop."""
        s = self._settings
        logger.info("waiting for the node to become ready url=%s", s.url)
        reason = ""
        while True:
            try:
                await probe.check_health()
                models = s.models if s.models is not None else await probe.models()
                version = await probe.version()
            except ProbeError as exc:
                if str(exc) != reason:
                    reason = str(exc)
                    logger.info("node not ready yet url=%s reason=%s", s.url, reason)
            else:
                logger.info("node ready url=%s models=%s version=%s", s.url, ",".join(models), version or "-")
                return models, version
            await _wait_any((self._stop, self._child_gone), s.health_interval)
            if self._stop.is_set() or self._child_gone.is_set():
                return None

    async def _watch_health(self, probe: NodeProbe, registration: Registration, models: tuple[str, ...]) -> None:
        """Withdraw the node after ``unhealthy_after`` failed checks, restore it when healthy; follow models."""
        s = self._settings
        failures = 0
        while True:
            await _wait_any((self._stop, self._child_gone), s.health_interval, registration.task)
            if registration.task.done():
                registration.task.result()  # a bug: let it surface
                raise RuntimeError("the registration ended by itself")
            if self._stop.is_set() or self._child_gone.is_set():
                return
            try:
                await probe.check_health()
            except ProbeError as exc:
                failures += 1
                if failures == s.unhealthy_after:
                    registration.set_withdrawn(True)
                    logger.warning(
                        "node unhealthy, withdrawn url=%s failures=%d reason=%s operator_removed=%s",
                        s.url,
                        failures,
                        exc,
                        registration.removed_by_operator,
                    )
                elif failures < s.unhealthy_after:
                    logger.info("health check failed url=%s failures=%d reason=%s", s.url, failures, exc)
                continue
            if failures >= s.unhealthy_after:
                registration.set_withdrawn(False)
                logger.info(
                    "node healthy again, restored url=%s operator_removed=%s", s.url, registration.removed_by_operator
                )
            failures = 0
            if s.models is None:
                models = await self._follow_models(probe, registration, models)

    async def _follow_models(
        self, probe: NodeProbe, registration: Registration, models: tuple[str, ...]
    ) -> tuple[str, ...]:
        """LoRA adapters come and go at run time; keep the record's model list current."""
        try:
            current = await probe.models()
        except ProbeError as exc:
            logger.debug("model list unavailable url=%s reason=%s", self._settings.url, exc)
            return models
        if current != models or registration.cards_changed(probe.cards):
            logger.info("models changed url=%s models=%s", self._settings.url, ",".join(current))
            registration.set_models(current, probe.cards)
        return current

    async def _drain(self, probe: NodeProbe, registration: Registration) -> None:
        """Mark the key draining, then wait for running+waiting == 0 (or the timeout, or another signal).

        The node counts as drained only once etcd holds the draining mark (plus ``DRAIN_SETTLE``): while etcd
        is unreachable the proxies keep routing to it, so an idle moment proves nothing.
        """
        s = self._settings
        loop = asyncio.get_running_loop()
        deadline = loop.time() + s.drain_timeout
        logger.info("draining on signal=%s key=%s drain_timeout=%.1fs", self._signals[0].name, s.key, s.drain_timeout)
        registration.set_status(Status.DRAINING)
        marked = asyncio.ensure_future(registration.wait_applied(s.drain_timeout))
        settled: float | None = None
        unknown_logged = False
        try:
            while not self._hurry.is_set() and not self._child_gone.is_set():
                if settled is None and marked.done():
                    settled = loop.time() + DRAIN_SETTLE
                load: int | None
                try:
                    load = await probe.load()
                except NodeUnreachable as exc:
                    logger.info("node gone while draining url=%s reason=%s", s.url, exc)
                    return
                except ProbeError as exc:
                    load = None
                    if not unknown_logged:
                        unknown_logged = True
                        logger.warning("node load unknown while draining url=%s reason=%s", s.url, exc)
                now = loop.time()
                if load == 0 and settled is not None and now >= settled:
                    logger.info("drained url=%s", s.url)
                    return
                if now >= deadline:
                    logger.warning(
                        "drain timeout after %.1fs url=%s load=%s marked=%s",
                        s.drain_timeout,
                        s.url,
                        load,
                        settled is not None,
                    )
                    return
                pending = () if marked.done() else (marked,)
                await _wait_any((self._hurry, self._child_gone), min(DRAIN_POLL, deadline - now), *pending)
        finally:
            marked.cancel()
        if self._hurry.is_set():
            logger.warning("second signal: drain cut short url=%s", s.url)

    async def _finish_child(self) -> int:
        """Forward the signals we got to the child and wait for it; return its exit code (0 without one)."""
        child = self._child
        if child is None or self._child_exit is None:
            return 0
        forwarded = 0
        while not self._child_exit.done():
            self._signalled.clear()
            for sig in self._signals[forwarded:]:
                logger.info("forwarding signal=%s to child pid=%d", sig.name, child.pid)
                child.send_signal(sig)
            forwarded = len(self._signals)
            await _wait_any((self._signalled,), None, self._child_exit)
        code = shell_exit_code(self._child_exit.result())
        logger.info("child exited pid=%d code=%d", child.pid, code)
        return code

    async def _reap_child(self) -> None:
        """On an error path, do not leave the child running without its registrar."""
        child, exited = self._child, self._child_exit
        if child is None or exited is None or exited.done():
            return
        logger.warning("stopping child pid=%d", child.pid)
        child.terminate()
        done, _ = await asyncio.wait([exited], timeout=CHILD_STOP_TIMEOUT)
        if not done:
            # The supervisor leads the child's process group: the command and whatever it started go too.
            with contextlib.suppress(ProcessLookupError):  # it just exited
                os.killpg(child.pid, signal.SIGKILL)
            await exited
