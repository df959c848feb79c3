"""SIGHUP: re-read what a replica can re-read without a restart (``--api-key-file``, its TLS certificate).

One handler for the process (a signal has one), which only sets an event; the reloads run on the loop, each on
its own, so a file that fails to load holds back no other. uvicorn keeps SIGTERM/SIGINT. With ``--workers`` the
parent passes SIGHUP on to every worker (workers.py), and each reloads for itself.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

log = logging.getLogger(__name__)


class Hangup:
    """The reloads to run on each SIGHUP; ``run`` in the lifespan."""

    def __init__(self) -> None:
        self._reloads: list[tuple[str, Callable[[], None]]] = []

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
