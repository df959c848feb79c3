"""Real processes on loopback for tests: free ports, start with captured logs, wait with a deadline, stop."""

from __future__ import annotations

import errno
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from bench.procs import free_port as bench_free_port

HOST = "127.0.0.1"


_ports_lock = threading.Lock()


def free_port() -> int:
    """A loopback port that is free now and was never handed out before in this test process, drawn below the
    kernel's ephemeral range (``bench.procs.free_port``: outgoing connections take their ports from that range).
    Safe from several threads of a test at once."""
    with _ports_lock:
        return bench_free_port()


class DeadPort:
    """A loopback port where nothing listens, held so no other process can take it: a node that refuses at once.

    The sockets are bound (127.0.0.1 and, where the machine has it, ::1) but never listen, so a connection to
    ``127.0.0.1:port``, ``[::1]:port`` or ``localhost:port`` is refused without reaching anything.
    """

    def __init__(self) -> None:
        self._sockets: list[socket.socket] = []
        while not self._sockets:
            v4 = socket.socket()
            v4.bind((HOST, 0))
            port = int(v4.getsockname()[1])
            v6: socket.socket | None = None
            if socket.has_ipv6:
                v6 = socket.socket(socket.AF_INET6)
                try:
                    v6.bind(("::1", port))
                except OSError as exc:
                    v6.close()
                    v6 = None
                    if exc.errno == errno.EADDRINUSE:  # taken on ::1: try another number
                        v4.close()
                        continue
            self._sockets = [v4] if v6 is None else [v4, v6]
        self.port = port

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``check`` until it returns true or ``timeout`` seconds pass (then fail saying ``what``)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:  # noqa: BLE001 - a check that raises is "not yet"
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def port_is_free(port: int) -> bool:
    """True when a server could listen on 127.0.0.1:``port`` now (bound as uvicorn binds: SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def process_gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie nobody reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def http_ok(url: str, verify: ssl.SSLContext | bool = True) -> bool:
    try:
        return httpx.get(url, timeout=1.0, verify=verify).status_code == 200
    except httpx.HTTPError:
        return False


class Proc:
    """A child process whose stdout+stderr go to a log file; stop() always reaps it."""

    def __init__(self, name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_dir / f"{name}.log"
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def kill(self) -> None:
        """SIGKILL, the way a crash looks to everyone else."""
        if self.alive():
            self.popen.kill()
        self.popen.wait(10)
        self._log.close()

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return self.popen.returncode


def python_module(module: str, *args: str) -> list[str]:
    """argv that runs ``python -m module args`` with this interpreter (console scripts need not be on PATH)."""
    return [sys.executable, "-m", module, *args]
