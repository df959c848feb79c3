"""What wrapper mode's supervisor (registrar/supervisor.py) costs a node: start-up, memory, CPU while it waits,
and the extra hop of a forwarded signal.

    python -m bench.supervisor_cost [--runs 20] [--idle 10] [--json]

Start-up: ``true`` run ``--runs`` times bare and under the supervisor, median wall time of each (start to exit).
Memory and idle CPU: the supervisor of a ``sleep`` over ``--idle`` seconds (its RSS, its CPU ticks, its wake-ups).
Signal: SIGTERM to the supervisor until its ``sleep`` is dead (and until the supervisor has exited with the code),
against SIGTERM straight to a ``sleep``, medians. Exits 1 if the supervised code is not 143 (128 + SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_etcd_proxy.registrar.supervisor import command_line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.supervisor_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="start-ups and signals measured, each way (20)")
    p.add_argument("--idle", type=float, default=10.0, help="seconds the idle supervisor is watched (10)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = p.parse_args(argv)
    if args.runs < 1 or args.idle <= 0:
        p.error("--runs and --idle must be positive")
    return args


def supervised(command: list[str]) -> list[str]:
    return command_line(command, parent=os.getpid(), grace=30.0)


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def start_to_exit(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True)
    return time.perf_counter() - started


def _proc_status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _runs_sleep(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"
    except FileNotFoundError:
        return False


def _sleeper(supervise: bool) -> subprocess.Popen[bytes]:
    """A ``sleep``, bare or supervised, returned once ``sleep`` runs (start-up is measured apart)."""
    command = ["sleep", "3600"]
    proc = subprocess.Popen(supervised(command) if supervise else command)
    while not any(_runs_sleep(pid) for pid in (_children(proc.pid) if supervise else [proc.pid])):
        time.sleep(0.001)
    return proc


def idle(seconds: float) -> tuple[int, int, int, int]:
    """(RSS kB, anonymous RSS kB, CPU ticks, voluntary context switches) of a supervisor waiting ``seconds``."""
    proc = _sleeper(supervise=True)
    try:
        ticks, switches = _cpu_ticks(proc.pid), _proc_status(proc.pid, "voluntary_ctxt_switches")
        time.sleep(seconds)
        return (
            _proc_status(proc.pid, "VmRSS"),
            _proc_status(proc.pid, "RssAnon"),
            _cpu_ticks(proc.pid) - ticks,
            _proc_status(proc.pid, "voluntary_ctxt_switches") - switches,
        )
    finally:
        proc.kill()
        proc.wait()


def signal_to_exit(supervise: bool) -> tuple[float, float, int]:
    """Seconds from SIGTERM to the death of a ``sleep``, and to the exit of the process signalled (with
    ``supervise``, the supervisor, which forwards the signal and reports the code); and its exit code."""
    proc = _sleeper(supervise)
    sleep = _children(proc.pid)[0] if supervise else proc.pid
    pidfd = os.pidfd_open(sleep)
    try:
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        select.select([pidfd], [], [])
        died = time.perf_counter() - started
    finally:
        os.close(pidfd)
    code = proc.wait()
    return died, time.perf_counter() - started, code


def measure(runs: int, idle_seconds: float) -> dict[str, Any]:
    report: dict[str, Any] = {
        "start_to_exit_ms": {
            "bare": median_ms([start_to_exit(["true"]) for _ in range(runs)]),
            "supervised": median_ms([start_to_exit(supervised(["true"])) for _ in range(runs)]),
        }
    }
    rss, anon, ticks, switches = idle(idle_seconds)
    report["idle"] = {"seconds": idle_seconds, "rss_kb": rss, "anon_kb": anon, "cpu_ticks": ticks, "wakeups": switches}
    for name, supervise in (("bare", False), ("supervised", True)):
        samples = [signal_to_exit(supervise) for _ in range(runs)]
        report[f"sigterm_{name}"] = {
            "to_death_ms": median_ms([died for died, _, _ in samples]),
            "to_exit_ms": median_ms([exited for _, exited, _ in samples]),
            "exit_codes": sorted({code for _, _, code in samples}),
        }
    return report


def print_table(report: dict[str, Any]) -> None:
    start, idle_, bare, wrapped = (
        report[k] for k in ("start_to_exit_ms", "idle", "sigterm_bare", "sigterm_supervised")
    )
    print(f"start to exit of `true`: bare {start['bare']:.1f} ms, supervised {start['supervised']:.1f} ms (medians)")
    print(
        f"idle supervisor over {idle_['seconds']:g} s: RSS {idle_['rss_kb']} kB ({idle_['anon_kb']} kB anonymous), "
        f"CPU {idle_['cpu_ticks']} ticks, {idle_['wakeups']} wake-ups"
    )
    print(
        f"SIGTERM to the sleep's death: bare {bare['to_death_ms']:.2f} ms, supervised {wrapped['to_death_ms']:.2f} ms; "
        f"to the exit of the process signalled: {bare['to_exit_ms']:.2f} ms, {wrapped['to_exit_ms']:.2f} ms (medians)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args.runs, args.idle)
    # The supervisor must pass the command's death by SIGTERM on as the shell's 128+15, as a bare one shows it.
    report["ok"] = report["sigterm_supervised"]["exit_codes"] == [128 + signal.SIGTERM]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
