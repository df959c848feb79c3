"""``--workers N``: one replica on N cores, as N processes serving the same port.

Each worker is a whole replica of its own (its own etcd watch, pools, ejection and connections to the nodes),
listening with SO_REUSEPORT, so the kernel spreads new client connections over the workers. The parent only
supervises: it starts the workers (fresh interpreters, not forks: gRPC and a forked event loop do not mix),
restarts one that dies, and on SIGTERM/SIGINT asks each to drain and waits for them.

``/metrics`` stays whole: counters and histograms go through prometheus_client's multiprocess mode (a directory
the parent owns), so whichever worker answers a scrape reports the sum over all workers. The pool gauges
(``vllm_proxy_node_in_flight``, ejection, discovery) and ``/status``, ``/list_workers`` describe the worker that
answered: every worker watches the same etcd, so their pools agree; in-flight counts are that worker's.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_etcd_proxy.proxy.settings import ProxySettings

log = logging.getLogger(__name__)

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's switch to multiprocess mode; read when it is imported, so set before a worker starts."""
RESTART_BACKOFF = (1.0, 30.0)
"""Seconds before restarting a worker that died: the first wait, and the longest (it doubles while crashing)."""
_PR_SET_PDEATHSIG = 1


def _check_port(host: str, port: int) -> None:
    """Fail in the parent, with one clear error, when the port cannot be bound at all."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        probe.bind((host, port))


def worker_main(argv: Sequence[str]) -> None:
    """Entry point of one worker process: the same flags and environment as the parent, its own replica."""
    # Our own process group: a terminal's Ctrl-C reaches the parent only, which then asks each worker once.
    os.setpgrp()
    # The parent passes SIGHUP on to every worker: one with nothing to reload must not die of it meanwhile (nor
    # one still starting, before its app handles SIGHUP). It came blocked from the parent (``_start``): none has
    # killed this interpreter while it started, and nothing has been read yet that one should reload.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    from vllm_etcd_proxy.proxy.cli import configure_logging, parse_settings, serve

    settings = parse_settings(argv)
    configure_logging(settings.log_level)
    serve(settings, reuse_port=True)


class _Supervisor:
    def __init__(self, settings: ProxySettings, argv: Sequence[str]) -> None:
        self._settings = settings
        self._argv = list(argv)
        self._context = multiprocessing.get_context("spawn")
        self._stop = threading.Event()
        self._workers: list[BaseProcess] = []

    def _start(self, index: int) -> BaseProcess:
        process = self._context.Process(target=worker_main, args=(self._argv,), name=f"vllm-proxy-worker-{index}")
        # A new interpreter would die of a SIGHUP (its default) before worker_main ignores it: the worker starts
        # with SIGHUP blocked (a mask survives exec), and one sent to us meanwhile waits, then reaches it too.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})
        log.info("worker started index=%d pid=%s", index, process.pid)
        return process

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop.set()

    def _forward_hup(self, signum: int, frame: FrameType | None) -> None:
        for process in self._workers:  # each worker reloads its --api-key-file and TLS certificate
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGHUP)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, self._forward_hup)
        self._workers = [self._start(i) for i in range(self._settings.workers)]
        backoff = [RESTART_BACKOFF[0]] * len(self._workers)
        restart_at = [0.0] * len(self._workers)
        while not self._stop.wait(0.2):
            now = time.monotonic()
            for index, process in enumerate(self._workers):
                if process.is_alive():
                    continue
                if restart_at[index] == 0.0:
                    log.warning(
                        "worker died index=%d pid=%s exitcode=%s; restarting in %gs",
                        index,
                        process.pid,
                        process.exitcode,
                        backoff[index],
                    )
                    _forget_metrics_of(process.pid)
                    restart_at[index] = now + backoff[index]
                    backoff[index] = min(RESTART_BACKOFF[1], backoff[index] * 2)
                elif now >= restart_at[index]:
                    self._workers[index] = self._start(index)
                    restart_at[index] = 0.0
        return self._shut_down()

    def _shut_down(self) -> int:
        log.info("shutting down: asking %d workers to drain", len(self._workers))
        for process in self._workers:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self._settings.shutdown_delay + self._settings.shutdown_timeout + 10
        failed = 0
        for process in self._workers:
            process.join(max(0.1, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(5)
            # Stopped by our SIGTERM before it had set up its own handling (it was still starting): nothing lost.
            failed += process.exitcode not in (0, None, -signal.SIGTERM)
        return 1 if failed else 0


def _forget_metrics_of(pid: int | None) -> None:
    if pid is None or not os.environ.get(METRICS_DIR_ENV):
        return
    from prometheus_client import multiprocess

    with contextlib.suppress(OSError):
        multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


def run_workers(settings: ProxySettings, argv: Sequence[str]) -> int:
    """Serve with ``settings.workers`` processes until SIGTERM/SIGINT; the exit status for the parent."""
    _check_port(settings.host, settings.port)
    metrics_dir = tempfile.mkdtemp(prefix="vllm-proxy-metrics-")
    os.environ[METRICS_DIR_ENV] = metrics_dir
    try:
        return _Supervisor(settings, argv).run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
