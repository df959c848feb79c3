"""Child processes for a benchmark run: started on loopback, CPU time read from /proc, always stopped.

Children get ``PR_SET_PDEATHSIG``: if the benchmark itself is killed (a test timeout sends SIGKILL), the kernel
kills the node and proxy too, so no run leaves a server behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
_CLK_TCK = os.sysconf("SC_CLK_TCK")


PORTS_FROM = 10_000
"""The lowest port handed out (well above the well-known ones)."""


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and not handed out before by this process, drawn below the kernel's ephemeral
    range: a port from binding port 0 comes from that range, where any outgoing connection's local port does
    too, and one could take it before its server binds it (seen: a replica that could not listen, "address
    already in use"). Random draws repeat (two of thirty draws collide about once in fifty runs), hence the
    memory of what was handed out."""
    top = _ephemeral_floor()
    for _ in range(1000):
        port = random.randrange(PORTS_FROM, top)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # everything below the range is taken: the range it is
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that started it exits (Linux; else a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a live process so far: the sum of its threads' run time in ns (schedstat), which a short run
    of a fast server does not round to nothing as utime + stime's clock ticks (10 ms) do; those when schedstat is
    missing. A thread that ended takes its time with it: the servers measured keep theirs."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
                total += int((task / "schedstat").read_text().split()[0])
    except FileNotFoundError:
        total = 0
    if total:
        return total / 1e9
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may hold spaces and parentheses: split after its closing one.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over all CPUs (from /proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return (sum(values) - idle) / _CLK_TCK, sum(values) / _CLK_TCK


def own_cpu_seconds() -> float:
    """CPU seconds of this process, all threads."""
    return time.process_time()


def pin(pid: int, cpus: set[int]) -> None:
    """Restrict every thread of a live process to ``cpus``: sched_setaffinity on a pid moves only that one
    thread, and threads started afterwards inherit the affinity of the thread that starts them."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


class Server:
    """``python -m MODULE ARGS`` listening on 127.0.0.1:``port`` (or ``command``, which must listen there
    itself); output goes to a log file. ``env`` replaces this process's environment when given."""

    def __init__(
        self,
        name: str,
        module: str,
        port: int,
        args: Sequence[str],
        log_dir: Path,
        command: Sequence[str] | None = None,
        tls: ssl.SSLContext | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        """``tls``: the server speaks https, checked with this client context; ``cwd``: where it runs (a checkout
        of another commit: ``python -m`` imports its sources first)."""
        self.name = name
        self.port = port
        self.tls = tls
        self.log_path = log_dir / f"{name}.log"
        argv = list(command) if command else [sys.executable, "-m", module, "--host", HOST, "--port", str(port), *args]
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
                env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
                cwd=cwd,
            )

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def pin(self, cpus: set[int]) -> None:
        """Run this server (all of its threads) only on ``cpus``."""
        pin(self.pid, cpus)

    def wait_ready(self, path: str, timeout: float) -> None:
        """Until GET ``path`` answers 200; raises with the log's tail if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + path, timeout=1.0, verify=self.tls or True).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} not ready on {self.url}{path} after {timeout:g} s:\n{self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s; always reaps."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


class Fleet(contextlib.AbstractContextManager["Fleet"]):
    """The servers of one run; leaving the ``with`` block stops every one of them, in reverse order."""

    def __init__(self, keep_logs: Path | None = None) -> None:
        self._tmp = None if keep_logs else tempfile.TemporaryDirectory(prefix="bench-")
        self.log_dir = keep_logs or Path(self._tmp.name)  # type: ignore[union-attr]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.servers: list[Server] = []
        self._ready_paths: dict[str, str] = {}
        self._ports: set[int] = set()

    def port(self) -> int:
        """A free loopback port not yet handed out in this run."""
        port = free_port()
        while port in self._ports:  # a port handed out here may not be bound yet: the kernel can offer it again
            port = free_port()
        self._ports.add(port)
        return port

    def start(
        self,
        name: str,
        module: str,
        args: Sequence[str],
        ready_path: str,
        *,
        command: Callable[[int], Sequence[str]] | None = None,
        tls: ssl.SSLContext | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Server:
        """Start a server on a free port without waiting for it (servers start in parallel; see wait_ready).
        ``command(port)``, when given, is the whole command line instead of ``python -m module``; ``tls``: it
        speaks https, checked with this client context; ``cwd``: the checkout it runs from."""
        port = self.port()
        server = Server(name, module, port, args, self.log_dir, command(port) if command else None, tls, env, cwd)
        self.servers.append(server)
        self._ready_paths[server.name] = ready_path
        return server

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Until every server answers 200 on its ready path, all within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        for server in self.servers:
            server.wait_ready(self._ready_paths[server.name], max(0.0, deadline - time.monotonic()))

    def __exit__(self, *exc: object) -> None:
        for server in reversed(self.servers):
            server.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


PEER_BENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "bench"
"""The peer harness (``../shared/bench``): its fake vLLM backends and load generator."""


def loadgen(
    shared_bench: Path, url: str, concurrency: int, seconds: float, *extra: str, check: bool = True
) -> dict[str, Any]:
    """The peer harness's load generator against ``url``'s ``/v1/completions`` for ``seconds`` at ``concurrency``
    (``extra``: more of its flags); its JSON report. ``check``: fail when it counted errors (it exits 1)."""
    command = [sys.executable, str(shared_bench / "loadgen.py"), "--url", f"{url}/v1/completions"]
    command += ["-n", "0", "-c", str(concurrency), "--duration", str(seconds), *extra]
    done = subprocess.run(command, capture_output=True, text=True, check=check)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def code_version() -> str:
    """The commit the servers run from, with "+dirty" when proxy/ or sim/ have uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "proxy", "sim"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def checkout_arg(spec: str) -> tuple[str, Path]:
    """``--build NAME=CHECKOUT``: a name and a directory holding this project's sources to run servers from (``.``
    for this checkout, a ``git worktree`` of another commit for the code before)."""
    name, sep, checkout = spec.partition("=")
    path = Path(checkout).resolve()
    if not sep or not name or not (path / "vllm_etcd_proxy").is_dir():
        raise argparse.ArgumentTypeError(f"{spec!r}: not NAME=CHECKOUT with CHECKOUT holding vllm_etcd_proxy/")
    return name, path


def add_run_flags(parser: argparse.ArgumentParser, quick: Mapping[str, object], quick_help: str) -> None:
    """The flags every session benchmark has: --quick (``quick_help``, then the values it sets), --json, --save,
    --logs. ``parse_quick`` applies --quick."""
    add = parser.add_argument
    add("--quick", action="store_true", help=f"{quick_help} (" + ", ".join(f"{k}={v}" for k, v in quick.items()) + ")")
    add("--json", action="store_true", help="print the figures as JSON instead of tables")
    add("--save", type=Path, help="also write the JSON report to this file")
    add("--logs", type=Path, help="keep the servers' logs in this directory")


def parse_quick(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, quick: Mapping[str, object]
) -> argparse.Namespace:
    """Parse ``argv``; with --quick, ``quick``'s values replace the ones given."""
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in quick.items():
            setattr(args, key, value)
    return args


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the benchmark's with-blocks, which stop the servers


def report_and_exit_status(
    run: Callable[[], dict[str, object]],
    render: Callable[[dict[str, object]], str],
    *,
    as_json: bool,
    save: Path | None = None,
) -> int:
    """Run a benchmark (SIGTERM stops it cleanly), print its report as a table or JSON, optionally save the
    JSON; the exit status is 1 when a request failed."""
    signal.signal(signal.SIGTERM, _terminate)
    report = run()
    if save is not None:
        save.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if as_json else render(report))
    return 0 if report["ok"] else 1


def machine(started: str, loadavg_start: str) -> dict[str, object]:
    """What a report says about the machine a run had: CPUs, Python, kernel, date, load before and after."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "date": started,
        "loadavg_start": loadavg_start,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[0],
    }
