"""SIGHUP: re-read what a replica can re-read without a restart (``--api-key-file``, its TLS certificate).

One handler for the process (a signal has one), which only sets an event; the reloads run on the loop, each on
its own, so a file that fails to load holds back no other. uvicorn keeps SIGTERM/SIGINT. With ``--workers`` the
parent passes SIGHUP on to every worker (workers.py), and each reloads for itself.

A SIGHUP that comes while the replica starts (its files read, its loop not yet handling the signal: a worker
restarted beside running ones waits seconds for readiness) is remembered by ``StartHangups`` and reloaded as soon
as the loop's handler is in place, so a renewal signalled during a (re)start is never lost.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)


class StartHangups:
    """Whether a SIGHUP arrived between ``catch`` (before the files are first read) and the loop's own handler."""

    def __init__(self) -> None:
        self.arrived = False

    def catch(self) -> None:
        """From now on a SIGHUP is noted, not fatal; the loop's handler (``Hangup.run``) takes over later."""
        signal.signal(signal.SIGHUP, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.arrived = True


class Hangup:
    """The reloads to run on each SIGHUP; ``run`` in the lifespan."""

    def __init__(self, at_start: StartHangups | None = None) -> None:
        self._reloads: list[tuple[str, Callable[[], None]]] = []
        self._at_start = at_start or StartHangups()

    def on(self, what: str, reload: Callable[[], None]) -> None:
        """Run ``reload`` on each SIGHUP (``what`` names it in logs); it logs and counts its own outcome."""
        self._reloads.append((what, reload))

    @property
    def configured(self) -> bool:
        """Whether there is anything to reload (else ``run`` need not run: SIGHUP keeps its disposition)."""
        return bool(self._reloads)

    async def run(self) -> None:
        """Until cancelled (a loop to run only when ``configured``)."""
        loop = asyncio.get_running_loop()
        hangup = asyncio.Event()
        names = ", ".join(what for what, _ in self._reloads)
        try:
            loop.add_signal_handler(signal.SIGHUP, hangup.set)
        except (ValueError, RuntimeError, NotImplementedError):  # not the main thread (an app run inside tests)
            log.info("SIGHUP cannot be handled here; read at start only: %s", names)
            await asyncio.Event().wait()  # nothing to do until cancelled
        if self._at_start.arrived:  # the files may have been read before that signal's renewal
            hangup.set()
        try:
            while True:
                await hangup.wait()
                hangup.clear()
                log.info("SIGHUP: reloading %s", names)
                for what, reload in self._reloads:
                    try:
                        reload()
                    except Exception:  # a bug in one reload must not end the others, nor later SIGHUPs
                        log.exception("reload failed what=%s", what)
        finally:
            loop.remove_signal_handler(signal.SIGHUP)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
