"""An opt-in check against a real vLLM 0.32 (CPU build): what the simulator copies and the proxy relies on.

Not part of the test suite nor of CI: it installs vLLM's CPU build (~4 GB) into a virtualenv of its own
(``--home``, default ~/.cache/vllm-etcd-proxy/real-vllm, reused when there) and makes a tiny random Llama there.
Then, in a network namespace with only loopback, it starts etcd, one ``vllm-proxy`` replica, a ``vllm-sim`` node
asked the same questions, and two real ``vllm serve`` at a time, each under ``vllm-registrar`` in wrapper mode:

1. a mixed pair publishing KV-cache events (node a also serves a LoRA adapter): the PUB frames, ``extra_keys``
   with ``cache_salt`` and with the adapter, the replay socket's answers read with pyzmq; a second replica
   started late must index the blocks the nodes already hold; model cards, the Responses API across the two
   replicas, token ids (return_token_ids, streamed chat's prompt_token_ids, resuming from ids), kv-aware routing;
2. a prefill/decode pair over NixlConnector: the decode node's external_kv_transfer prompt tokens grow when
   the proxy runs the exchange;
3. a pair of ``kv_both`` nodes (their role read from ``--kv-transfer-config``): a long prompt split one way, a
   longer one starting with it the other way (prefilled where its start is cached), a short one on one node.

One PASS/FAIL line per check, with the evidence; exit status 1 when any failed. About 2 minutes to install
the first time, then 5-8 minutes a run on 2 cores. Run: ``make real-vllm`` or ``python -m bench.real_vllm``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import zmq

from bench import real_vllm_checks as checks
from bench.procs import Fleet, Server
from bench.real_vllm_env import DEFAULT_HOME, TORCH, RealVllm, ensure
from bench.real_vllm_stack import MODEL, TOPIC, NodeSpec, first_child, pair, start_etcd, start_proxy, wait_routable
from vllm_etcd_proxy.sim.vocab import HfVocab

ROOT = Path(__file__).resolve().parent.parent
INSIDE = "--inside-namespace"
WARM_UP_TRIES = 3
PHASES = ("mixed", "pd", "both")


class Report:
    """Prints each check's line as it is decided; counts them."""

    def __init__(self) -> None:
        self.passed = self.failed = 0

    def record(self, name: str, ok: bool, evidence: str) -> None:
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        print(f"{'PASS' if ok else 'FAIL'} {name}: {evidence}", flush=True)


def note(text: str) -> None:
    print(f"-- {text}", flush=True)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.real_vllm", description=__doc__.split("\n", 1)[0])
    p.add_argument(
        "--home", type=Path, default=DEFAULT_HOME, help=f"virtualenv, model and logs (default {DEFAULT_HOME})"
    )
    p.add_argument(
        "--torch",
        default=TORCH,
        help=f"pip's requirement or wheel file for torch's CPU build (default {TORCH}, found through pip's find-links)",
    )
    p.add_argument("--logs", type=Path, help="the servers' logs (default: HOME/logs/<UTC time>)")
    p.add_argument(
        "--phases", default=",".join(PHASES), help=f"which pairs to run, comma-separated (default {','.join(PHASES)})"
    )
    p.add_argument("--setup-only", action="store_true", help="build the virtualenv and the model, then stop")
    p.add_argument(INSIDE, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        p.error(f"--phases: unknown {', '.join(sorted(unknown))} (known: {', '.join(PHASES)})")
    return args


def _sim_command(env: RealVllm, events: int, replay: int) -> Callable[[int], list[str]]:
    config = f'{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{events}",'
    config += f'"replay_endpoint":"tcp://*:{replay}","topic":"{TOPIC}"}}'

    def command(port: int) -> list[str]:
        return [
            *(sys.executable, "-m", "vllm_etcd_proxy.sim", "--host", "127.0.0.1", "--port", str(port)),
            *("--model", MODEL, "--tokenizer", str(env.model), "--block-size", "128", "--kv-events-config", config),
        ]

    return command


def _warm_up(m: checks.Mixed, url: str, endpoint: str) -> None:
    """Until a subscription of ours gets the node's frames: a PUB drops what it sends before a new subscriber's
    subscription reached it, so a one-block request is sent (anew each time) until its events arrive."""
    sub = m.events(endpoint)
    for attempt in range(WARM_UP_TRIES):
        checks.complete(url, checks.words(130, f"warm up {attempt}"), 1)
        if sub.until(lambda got: bool(got), 20):
            return
    raise TimeoutError(f"no KV-event frame from {endpoint} after {WARM_UP_TRIES} requests")


def _run_mixed(fleet: Fleet, env: RealVllm, etcd: Server, r1: Server, report: Report) -> None:
    events, replay = fleet.port(), fleet.port()
    sim = fleet.start("sim", "", [], "/health", command=_sim_command(env, events, replay))
    sim.wait_ready("/health", 60)
    specs = [
        NodeSpec(name="a", role="mixed", kv_events=True, lora=True),
        NodeSpec(name="b", role="mixed", kv_events=True),
    ]
    with pair(fleet, env, etcd, specs) as nodes, zmq.Context() as context:
        a, b = nodes
        took = wait_routable([r1], nodes)
        note(f"mixed pair a, b (real vllm serve under vllm-registrar) routable on proxy1 after {took:.0f} s")
        m = checks.Mixed(
            a=a,
            b=b,
            r1=r1,
            sim=sim,
            sim_events=f"tcp://127.0.0.1:{events}",
            sim_replay=f"tcp://127.0.0.1:{replay}",
            vocab=HfVocab(env.model),
            context=context,
        )
        try:
            for url, endpoint in ((a.url, a.events or ""), (m.sim.url, m.sim_events)):
                _warm_up(m, url, endpoint)
            checks.run_all(checks.bound(checks.MIXED_CHECKS, m), report.record)
            _late_replica(fleet, etcd, m, report)
            checks.run_all(checks.bound(checks.AFTER_LATE_REPLICA, m), report.record)
        finally:
            m.close()


def _late_replica(fleet: Fleet, etcd: Server, m: checks.Mixed, report: Report) -> None:
    r2 = start_proxy(fleet, "proxy2", etcd)
    note(f"proxy2 started late: both nodes routable on it after {wait_routable([r2], [m.a, m.b], 120):.0f} s")
    m.r2 = r2
    late = (
        ("late replica indexes the nodes' existing blocks (replay)", lambda: checks.check_late_replica(m, r2)),
        ("Responses API across replicas", lambda: checks.check_responses(m, r2)),
    )
    checks.run_all(late, report.record)


def _run_pd(fleet: Fleet, env: RealVllm, etcd: Server, report: Report) -> None:
    proxies = _servers_of(fleet, "proxy1", "proxy2")
    if len(proxies) < 2:  # the mixed phase did not run: the second replica comes now
        proxies.append(start_proxy(fleet, "proxy2", etcd))
    specs = [
        NodeSpec(name="prefill", role="prefill", kv_transfer_role="kv_producer"),
        NodeSpec(name="decode", role="decode", kv_transfer_role="kv_consumer"),
    ]
    with pair(fleet, env, etcd, specs) as nodes:
        prefill, decode = nodes
        took = wait_routable(proxies, nodes)
        note(f"P/D pair (NixlConnector kv_producer/kv_consumer) routable on both replicas after {took:.0f} s")
        pd = (("P/D over NIXL through the proxy", lambda: checks.check_pd(proxies, prefill, decode)),)
        checks.run_all(pd, report.record)


def _run_both(fleet: Fleet, env: RealVllm, etcd: Server, report: Report) -> None:
    proxies = _servers_of(fleet, "proxy1", "proxy2")
    if len(proxies) < 2:
        proxies.append(start_proxy(fleet, "proxy2", etcd))
    specs = [
        NodeSpec(name=name, role="both", kv_transfer_role="kv_both", kv_events=True, role_from_child=True)
        for name in ("both-a", "both-b")
    ]
    with pair(fleet, env, etcd, specs) as nodes:
        a, b = nodes
        took = wait_routable(proxies, nodes)
        note(f"both pair (NixlConnector kv_both, role read from kv_role) routable on both replicas after {took:.0f} s")
        both = (("both nodes: KV moved both ways through the proxy", lambda: checks.check_both(proxies, a, b)),)
        checks.run_all(both, report.record)


def _phase(name: str, report: Report, run: Callable[[], None]) -> None:
    """A phase that cannot start (a server that does not come up) is one failed line, and the next phase runs."""
    started = time.monotonic()
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported with the reason; every process is stopped by now
        report.record(name, False, f"{type(exc).__name__}: {exc}")
    note(f"{name} phase: {time.monotonic() - started:.0f} s")


def _servers_of(fleet: Fleet, *names: str) -> list[Server]:
    return [s for s in fleet.servers if s.name in names]


def run_checks(args: argparse.Namespace) -> int:
    env = RealVllm(home=args.home)
    logs = args.logs or args.home / "logs" / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    report = Report()
    started = time.monotonic()
    with Fleet(keep_logs=logs) as fleet:
        etcd = start_etcd(fleet)
        r1 = start_proxy(fleet, "proxy1", etcd)
        phases = args.phases.split(",")
        if "mixed" in phases:
            _phase("mixed pair", report, lambda: _run_mixed(fleet, env, etcd, r1, report))
        if "pd" in phases:
            _phase("P/D pair", report, lambda: _run_pd(fleet, env, etcd, report))
        if "both" in phases:
            _phase("both pair", report, lambda: _run_both(fleet, env, etcd, report))
    shutil.rmtree(logs / "etcd-data", ignore_errors=True)  # 60 MB of preallocated WAL, nothing to read
    note(f"logs in {logs}; {time.monotonic() - started:.0f} s in all")
    print(f"real-vllm: {report.passed} passed, {report.failed} failed", flush=True)
    return 0 if report.failed == 0 else 1


def _in_namespace(argv: Sequence[str]) -> int:
    """Run the checks again in a loopback-only network namespace (tests/loopback_only.py): vLLM's KV-event
    sockets, told ``tcp://*:P`` as its docs say, bind every interface; there only loopback exists.

    The wrapper runs in a session of its own, so Ctrl-C reaches this process alone: it is passed on as one
    SIGTERM to the checks (the wrapper's child), which stop every process before the wrapper, then this, exit."""
    command = [sys.executable, "-m", "tests.loopback_only", sys.executable, "-m", "bench.real_vllm", *argv, INSIDE]
    wrapper = subprocess.Popen(command, cwd=ROOT, start_new_session=True)

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(first_child(wrapper.pid) or wrapper.pid, signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    return wrapper.wait()


def _terminate(signum: int, frame: object) -> None:
    # The first signal unwinds through the with-blocks, which stop every process; later ones must not cut that
    # short.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.inside_namespace:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _terminate)
        return run_checks(args)
    try:
        ensure(args.home, args.torch)
    except RuntimeError as exc:
        print(f"FAIL setup: {exc}", flush=True)
        return 1
    if args.setup_only:
        return 0
    return _in_namespace(argv)


if __name__ == "__main__":
    sys.exit(main())
