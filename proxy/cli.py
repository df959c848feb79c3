"""``vllm-proxy``: flags and environment (parsed in flags.py) -> ProxySettings; logging; runs uvicorn.

Every flag also reads ``VLLM_PROXY_<FLAG>`` (dashes as underscores; lists comma-separated); the admin key
also reads ``ADMIN_API_KEY`` as in the seed. A flag on the command line wins over the environment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from vllm_etcd_proxy.fleet.etcd import EtcdAuthError, EtcdClient, EtcdError, EtcdUnavailable
from vllm_etcd_proxy.fleet.flags import environment_defaults
from vllm_etcd_proxy.fleet.records import KeyLayout
from vllm_etcd_proxy.proxy.app import build_app
from vllm_etcd_proxy.proxy.flags import ENV_PREFIX, LIST_FLAGS, build_parser, settings_from_args
from vllm_etcd_proxy.proxy.httpserver import GatheringHttpToolsProtocol
from vllm_etcd_proxy.proxy.operations.hangup import StartHangups
from vllm_etcd_proxy.proxy.operations.info import Lifecycle
from vllm_etcd_proxy.proxy.operations.workers import run_workers
from vllm_etcd_proxy.proxy.settings import ProxySettings

WORKER_READY_WAIT = 15.0
"""Seconds a starting worker waits to be ready (etcd synced, a node routable) before it takes connections."""


async def check_etcd(settings: ProxySettings) -> str | None:
    """Why etcd cannot be used with these settings (bad credentials, no permission, TLS mismatch), or None.

    An etcd that is merely unreachable is not fatal: the replica starts, serves its static pools, reports
    not ready, and keeps trying.
    """
    assert settings.etcd is not None
    prefix = KeyLayout(prefix=settings.etcd_prefix, cluster=settings.cluster).cluster_prefix
    try:
        async with EtcdClient(settings.etcd) as client:
            await client.get(prefix)
    except EtcdAuthError as exc:
        return f"etcd refused us: {exc} (check --etcd-user, the password and the user's role on {prefix})"
    except EtcdUnavailable as exc:
        if any(mark in str(exc) for mark in ("handshake", "Handshake", "CERTIFICATE", "TSI_", "Socket closed")):
            hint = "check --etcd-cacert, --etcd-cert, --etcd-key and the URL scheme"
            return f"cannot talk to etcd over TLS: {exc} ({hint})"
        logging.getLogger(__name__).warning("etcd is not reachable yet; starting anyway: %s", exc)
    except EtcdError as exc:
        return f"etcd answered with an error: {exc}"
    return None


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT, report not ready for ``delay`` seconds (so a balancer's health checks take
    the replica out) while still serving, then let uvicorn stop listening and finish what is in flight."""

    def __init__(self, config: uvicorn.Config, *, delay: float, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self._delay = delay
        self._lifecycle = lifecycle

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._delay <= 0 or self._lifecycle.shutting_down:
            self._lifecycle.shutting_down = True
            super().handle_exit(sig, frame)
            return
        self._lifecycle.shutting_down = True
        logging.getLogger(__name__).info("shutting down: not ready for %gs, then draining", self._delay)
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(loop.call_later, self._delay, super().handle_exit, sig, frame)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    # httpx (the control plane: probes, scrapes) logs every request at info; our own lines carry what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def parse_settings(argv: Sequence[str]) -> ProxySettings:
    """Flags (then ``VLLM_PROXY_*`` variables) to settings; a usage error exits with status 2."""
    parser = build_parser()
    argv = list(argv)
    try:
        environment_defaults(parser, ENV_PREFIX, argv, LIST_FLAGS)
    except ValueError as exc:
        parser.error(str(exc))
    if parser.get_default("admin_key") is None and os.environ.get("ADMIN_API_KEY"):
        parser.set_defaults(admin_key=os.environ["ADMIN_API_KEY"])  # the seed's variable
    args = parser.parse_args(argv)
    if args.max_attempts < 1:
        parser.error("--max-attempts must be at least 1")
    if args.max_resumes < 0:
        parser.error("--max-resumes must be 0 or more")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if not args.etcd and not (args.prefill or args.decode or args.mixed or args.both):
        parser.error("give --etcd, or static nodes with --prefill/--decode/--mixed/--both")
    try:
        settings = settings_from_args(args)
        build_app(settings)  # static nodes and policies are checked here, before anything starts
    except ValueError as exc:
        parser.error(str(exc))
    return settings


def listening_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """The replica's listening socket; with ``reuse_port`` several workers bind the same port and the kernel
    spreads new connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    # Not listening yet: uvicorn listens once the app has started, so no connection waits on a worker that is
    # still starting (or dies while starting).
    sock.setblocking(False)
    return sock


def serve(settings: ProxySettings, *, reuse_port: bool = False) -> None:
    """Run one replica (or one worker of it) until SIGTERM/SIGINT, then drain."""
    hangups = StartHangups()
    if settings.api_key_file or settings.tls is not None:
        hangups.catch()  # before the files are read: a SIGHUP from here on reloads once the app handles it
    # A worker (reuse_port) restarted beside running ones listens only once ready (or after WORKER_READY_WAIT s).
    app = build_app(settings, wait_ready=WORKER_READY_WAIT if reuse_port else 0.0, hangups=hangups)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=GatheringHttpToolsProtocol,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=max(1, round(settings.shutdown_timeout)),
        lifespan="on",
        server_header=False,
    )
    config.load()
    # Our own context rather than uvicorn's: the app keeps it, and SIGHUP loads a new certificate into it.
    config.ssl = app.ssl_context
    sock = listening_socket(settings.host, settings.port, reuse_port=reuse_port)
    # uvicorn re-raises SIGTERM after its graceful shutdown; a replica that drained cleanly exits 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    DrainingServer(config, delay=settings.shutdown_delay, lifecycle=app.lifecycle).run(sockets=[sock])


def main(argv: Sequence[str] | None = None) -> None:
    # gRPC's C core prints its own error lines to stderr; ours already say what failed and why.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = parse_settings(argv)
    configure_logging(settings.log_level)
    if settings.etcd is not None:
        problem = asyncio.run(check_etcd(settings))
        if problem is not None:
            print(f"vllm-proxy: error: {problem}", file=sys.stderr)
            sys.exit(1)
    if settings.workers > 1:
        try:
            sys.exit(run_workers(settings, argv))
        except OSError as exc:
            print(
                f"vllm-proxy: error: cannot listen on {settings.host}:{settings.port}: {exc.strerror}", file=sys.stderr
            )
            sys.exit(1)
    serve(settings)


if __name__ == "__main__":
    main()
