"""vllm-registrar as a real process against a real etcd and real simulated vLLM nodes.

TTLs of 3 s keep the lease tests short; the registrar accepts >= 2 and warns below 5 (see settings.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.faults.fleet import holds
from tests.support.etcd_server import EtcdServer
from tests.support.procs import HOST, free_port, http_ok, port_is_free, process_gone, python_module, wait_until
from tests.support.registrar_proc import (
    Entry,
    Registrar,
    lease_ttl,
    read_key,
    run_registrar,
    wait_for_key,
    wait_for_no_key,
)
from tests.support.sim_node import SimNode
from vllm_etcd_proxy.registrar.supervisor import command_line

StartSim = Callable[..., SimNode]
StartRegistrar = Callable[..., Registrar]

STUBBORN_CHILD = (
    sys.executable,
    "-c",
    textwrap.dedent(
        """
        import signal
        signal.signal(signal.SIGTERM, lambda *_: print(" ".join(["ignoring", "SIGTERM"]), flush=True))
        print(" ".join(["stubborn", "child", "up"]), flush=True)
        while True:
            signal.pause()
        """
    ),
)
"""A wrapped command that outlives SIGTERM (a wedged vLLM); it never answers HTTP, so it is never registered.
Its lines are joined from pieces: the registrar logs the command, and a test waiting for a line must not find it
there. Each is one write, though: the child's output and the registrar's log share a file, and a line printed as
separate arguments (a write each, unbuffered) was once cut in two by a log line in between."""

ENGINE = textwrap.dedent(
    """
    import os, signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(" ".join(["engine", f"pid={os.getpid()}"]), flush=True)
    signal.pause()
    """
)
COMMAND_WITH_AN_ENGINE = (
    sys.executable,
    "-c",
    f"import signal, subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {ENGINE!r}])\nsignal.pause()\n",
)
"""A wrapped command that dies of SIGTERM at once, with a process of its own in its group (vLLM's engine core)
that outlives SIGTERM."""

BAD_FLAGS = {
    "unknown role": ["--role", "gpu", "--url", "http://127.0.0.1:8100"],
    "url with another scheme": ["--role", "decode", "--url", "ftp://127.0.0.1:8100"],
    "url with credentials": ["--role", "decode", "--url", "http://user:pw@127.0.0.1:8100"],
    "url that is not a url": ["--role", "decode", "--url", "127.0.0.1:8100"],
    "label without =": ["--role", "decode", "--url", "http://127.0.0.1:8100", "--label", "zone"],
    "ttl below 2": ["--role", "decode", "--url", "http://127.0.0.1:8100", "--ttl", "1"],
    "ttl not a number": ["--role", "decode", "--url", "http://127.0.0.1:8100", "--ttl", "ten"],
    "unknown flag": ["--role", "decode", "--url", "http://127.0.0.1:8100", "--colour", "red"],
    "-- without a command": ["--role", "decode", "--url", "http://127.0.0.1:8100", "--"],
    "kv events not tcp": ["--role", "decode", "--url", "http://127.0.0.1:8100", "--kv-events", "ipc:///tmp/kv"],
    "kv replay alone": ["--role", "decode", "--url", "http://127.0.0.1:8100", "--kv-events-replay", "tcp://h:1"],
    "no role, no child": ["--url", "http://127.0.0.1:8100"],
    "no role, a child without a kv_role": ["--url", "http://127.0.0.1:8100", "--", "vllm", "serve", "m"],
    "role both, a child that only prefills": [
        "--role",
        "both",
        "--url",
        "http://127.0.0.1:8100",
        "--",
        "vllm",
        "serve",
        "m",
        "--kv-transfer-config",
        '{"kv_connector": "NixlConnector", "kv_role": "kv_producer"}',
    ],
    "child's kv_role unknown": [
        "--url",
        "http://127.0.0.1:8100",
        "--",
        "vllm",
        "serve",
        "m",
        "--kv-transfer-config",
        '{"kv_role": "kv_everything"}',
    ],
    "child kv config not JSON": [
        "--role",
        "decode",
        "--url",
        "http://127.0.0.1:8100",
        "--",
        "vllm",
        "serve",
        "m",
        "--kv-events-config",
        "{enable",
    ],
}


@pytest.fixture
def sims(logs_dir: Path) -> Iterator[StartSim]:
    started: list[SimNode] = []

    def start(name: str = "sim", *, wait_healthy: bool = True, **knobs: Any) -> SimNode:
        node = SimNode(logs_dir, f"{name}{len(started)}", **knobs)
        started.append(node)
        return node.start(wait_healthy=wait_healthy)

    yield start
    for node in started:
        node.stop()


@pytest.fixture
def registrars(etcd: EtcdServer, logs_dir: Path) -> Iterator[StartRegistrar]:
    started: list[Registrar] = []

    def start(url: str, *flags: str, **kwargs: Any) -> Registrar:
        registrar = Registrar(etcd, url, logs_dir, *flags, name=f"registrar{len(started)}", **kwargs)
        started.append(registrar)
        return registrar

    yield start
    for registrar in started:
        registrar.stop()
        print(f"---- {registrar.name} log ----\n{registrar.log()}")  # shown when a test fails


def decode_key(node_id: str) -> str:
    return f"/vllm/default/decode/{node_id}"


def long_completion(pool: ThreadPoolExecutor, url: str, tokens: int) -> Future[httpx.Response]:
    body = {"model": "sim-model", "prompt": "tell me a story", "max_tokens": tokens, "ignore_eos": True}
    return pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60.0)


def running(url: str) -> int:
    return int(httpx.get(f"{url}/sim/requests", timeout=5.0).json()["running"])


def test_registers_once_the_node_is_healthy_with_models_from_the_node(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar, tmp_path: Path
) -> None:
    unhealthy = tmp_path / "unhealthy"
    unhealthy.touch()
    node = sims(model=["m-a", "m-b"], unhealthy_file=unhealthy, wait_healthy=False)
    registrar = registrars(node.url, "--label", "zone=a", "--label", "gpu=h100", role="prefill")
    key = f"/vllm/default/prefill/{node.host_port}"
    registrar.wait_for_log("node not ready yet")
    assert read_key(etcd, key) is None

    unhealthy.unlink()
    entry = wait_for_key(etcd, key)
    registered_at = entry.record.pop("registered_at")
    cards = entry.record.pop("model_cards")
    # The node's own /v1/models entries, for the proxy's merged model list.
    assert [(c["id"], c["owned_by"]) for c in cards] == [("m-a", "vllm"), ("m-b", "vllm")]
    assert entry.record == {
        "url": node.url,
        "role": "prefill",
        "models": ["m-a", "m-b"],
        "status": "serving",
        "labels": {"zone": "a", "gpu": "h100"},
        "version": "0.11.0+sim",
        "source": "registrar",
    }
    assert abs(datetime.fromisoformat(registered_at).timestamp() - time.time()) < 60
    assert 0 < lease_ttl(etcd, entry.lease) <= 10


def test_kv_event_endpoints_go_into_the_record_with_a_wildcard_host_named(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar
) -> None:
    node = sims()
    registrars(node.url, "--kv-events", "tcp://*:5557", "--kv-events-replay", f"tcp://{HOST}:5558")
    entry = wait_for_key(etcd, decode_key(node.host_port))
    assert (entry.record["kv_events"], entry.record["kv_events_replay"]) == (f"tcp://{HOST}:5557", f"tcp://{HOST}:5558")


def test_a_both_node_registers_under_the_role_both(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar
) -> None:
    node = sims(role="both")
    registrars(node.url, role="both")
    entry = wait_for_key(etcd, f"/vllm/default/both/{node.host_port}")
    assert entry.record["role"] == "both"


def test_wrapper_mode_takes_the_role_from_the_childs_kv_transfer_config(
    etcd: EtcdServer, registrars: StartRegistrar
) -> None:
    port = free_port()
    config = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
    child = python_module("vllm_etcd_proxy.sim", "--host", HOST, "--port", str(port), "--kv-transfer-config", config)
    registrars(f"http://{HOST}:{port}", role=None, command=tuple(child))
    entry = wait_for_key(etcd, f"/vllm/default/both/{HOST}:{port}", timeout=20)
    assert (entry.record["role"], entry.record["kv_connector"]) == ("both", "NixlConnector")
    assert httpx.get(f"http://{HOST}:{port}/sim/config", timeout=5).json()["role"] == "both"  # the sim read it too


def test_key_expires_with_its_lease_after_the_registrar_is_killed(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar
) -> None:
    node = sims()
    env = {"VLLM_REGISTRAR_CLUSTER": "c1", "VLLM_REGISTRAR_ETCD_PREFIX": "/t"}
    registrar = registrars(node.url, "--models", "x,y", "--node-id", "node-7", ttl=3, env=env)
    entry = wait_for_key(etcd, "/t/c1/decode/node-7", models=["x", "y"], url=node.url)
    assert 0 < lease_ttl(etcd, entry.lease) <= 3

    registrar.kill()
    wait_for_no_key(etcd, "/t/c1/decode/node-7", timeout=10)
    assert lease_ttl(etcd, entry.lease) == -1


def test_sigterm_marks_the_key_draining_and_waits_for_requests_in_flight(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar
) -> None:
    node = sims(itl=0.05)
    registrar = registrars(node.url, "--drain-timeout", "30")
    key = decode_key(node.host_port)
    entry = wait_for_key(etcd, key, status="serving")
    with ThreadPoolExecutor(1) as pool:
        request = long_completion(pool, node.url, tokens=50)  # 2.5 s
        wait_until(lambda: running(node.url) == 1, 5, "the request to run")
        registrar.signal(signal.SIGTERM)

        draining = wait_for_key(etcd, key, status="draining")
        assert draining.lease == entry.lease
        assert registrar.alive() and not request.done()
        assert request.result(timeout=20).status_code == 200
    assert registrar.wait(10) == 0
    assert read_key(etcd, key) is None  # revoked at exit, not left to expire
    assert lease_ttl(etcd, entry.lease) == -1
    assert "drained" in registrar.log()


def test_drain_timeout_bounds_the_wait_for_requests_in_flight(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar
) -> None:
    node = sims(itl=0.5)
    registrar = registrars(node.url, "--drain-timeout", "1")
    key = decode_key(node.host_port)
    wait_for_key(etcd, key)
    with ThreadPoolExecutor(1) as pool:
        request = long_completion(pool, node.url, tokens=100)  # 50 s
        wait_until(lambda: running(node.url) == 1, 5, "the request to run")
        started = time.monotonic()
        registrar.signal(signal.SIGINT)
        assert registrar.wait(10) == 0
        assert 1.0 <= time.monotonic() - started < 5.0
        assert running(node.url) == 1
        assert read_key(etcd, key) is None
        node.kill()
        assert request.exception(timeout=10) is not None
    assert "drain timeout" in registrar.log()


def test_unhealthy_node_is_withdrawn_and_restored_under_the_same_lease(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar, tmp_path: Path
) -> None:
    unhealthy = tmp_path / "unhealthy"
    node = sims(unhealthy_file=unhealthy)
    registrar = registrars(node.url)
    key = decode_key(node.host_port)
    entry = wait_for_key(etcd, key)

    unhealthy.touch()
    wait_for_no_key(etcd, key, timeout=5)
    assert registrar.alive() and lease_ttl(etcd, entry.lease) > 0

    unhealthy.unlink()
    restored = wait_for_key(etcd, key, timeout=5, status="serving")
    assert restored.lease == entry.lease
    log = registrar.log()
    assert "node unhealthy, withdrawn" in log and "node healthy again, restored" in log


def test_a_sleep_mark_the_proxy_wrote_into_the_record_survives_the_registrars_next_write(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar, tmp_path: Path
) -> None:
    unhealthy = tmp_path / "unhealthy"
    node = sims(unhealthy_file=unhealthy)
    registrar = registrars(node.url)
    key = decode_key(node.host_port)
    entry = wait_for_key(etcd, key)
    marked = json.dumps({**entry.record, "sleep": "asleep"}, separators=(",", ":"), sort_keys=True)
    etcd.etcdctl("put", f"--lease={entry.lease:x}", key, marked)  # as the proxy's node operations write it
    registrar.wait_for_log("sleep mark kept")
    unhealthy.touch()  # withdrawn, then restored: the registrar writes its record again
    wait_for_no_key(etcd, key, timeout=5)
    unhealthy.unlink()
    restored = wait_for_key(etcd, key, timeout=5, status="serving")
    assert restored.record["sleep"] == "asleep" and restored.lease == entry.lease


def test_a_record_is_not_written_again_while_the_nodes_models_stay_the_same(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar
) -> None:
    # vLLM answers every GET /v1/models with a new `created` and new permission ids: no change to its models.
    node = sims()
    registrar = registrars(node.url)  # follows the node's models, every --health-interval (0.2 s)
    wait_for_key(etcd, decode_key(node.host_port))
    holds(lambda: "record updated" not in registrar.log(), 2.0, "the record as first written")


def test_key_deleted_by_an_operator_is_not_put_back(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar, tmp_path: Path
) -> None:
    unhealthy = tmp_path / "unhealthy"
    node = sims(unhealthy_file=unhealthy)
    registrar = registrars(node.url)
    key = decode_key(node.host_port)
    entry = wait_for_key(etcd, key)

    etcd.etcdctl("del", key)
    registrar.wait_for_log("key removed by someone else")
    # A health flap and a drain must not bring it back either.
    unhealthy.touch()
    registrar.wait_for_log("node unhealthy, withdrawn")
    unhealthy.unlink()
    registrar.wait_for_log("node healthy again, restored")
    assert registrar.alive() and lease_ttl(etcd, entry.lease) > 0
    registrar.signal(signal.SIGTERM)
    assert registrar.wait(10) == 0

    assert read_key(etcd, key) is None
    log = registrar.log()
    assert log.count("registered key=") == 1 and "record updated" not in log


def test_key_deleted_with_its_revoked_lease_comes_back_under_a_new_lease(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar
) -> None:
    node = sims()
    registrar = registrars(node.url)
    key = decode_key(node.host_port)
    before = wait_for_key(etcd, key)

    etcd.etcdctl("lease", "revoke", format(before.lease, "x"))
    registrar.wait_for_log("lease lost")
    after = wait_for_key(etcd, key, timeout=5)
    assert after.lease != before.lease and lease_ttl(etcd, after.lease) > 0
    assert "key removed by someone else" not in registrar.log()


def test_key_comes_back_under_a_new_lease_after_etcd_was_down_longer_than_the_ttl(
    etcd: EtcdServer, sims: StartSim, registrars: StartRegistrar
) -> None:
    node = sims()
    registrar = registrars(node.url, ttl=3)
    key = decode_key(node.host_port)
    before = wait_for_key(etcd, key)

    etcd.kill()
    registrar.wait_for_log("lease lost", timeout=15)
    etcd.restart()

    after: list[Entry] = []

    def moved() -> bool:
        entry = read_key(etcd, key)
        if entry is None or entry.lease == before.lease:
            return False
        after.append(entry)
        return True

    wait_until(moved, 20, "the key under a new lease")
    assert after[-1].record["status"] == "serving"
    wait_until(lambda: lease_ttl(etcd, before.lease) == -1, 10, "the old lease to be revoked")
    assert registrar.alive()


def test_wrapper_mode_drains_before_stopping_the_child_and_exits_with_its_code(
    etcd: EtcdServer, registrars: StartRegistrar
) -> None:
    port = free_port()
    url = f"http://{HOST}:{port}"
    child = python_module("vllm_etcd_proxy.sim", "--host", HOST, "--port", str(port), "--itl", "0.05")
    registrar = registrars(url, command=tuple(child))
    key = decode_key(f"{HOST}:{port}")
    wait_for_key(etcd, key, timeout=20, models=["sim-model"])
    with ThreadPoolExecutor(1) as pool:
        request = long_completion(pool, url, tokens=50)  # 2.5 s
        wait_until(lambda: running(url) == 1, 5, "the request to run")
        registrar.signal(signal.SIGTERM)
        wait_for_key(etcd, key, status="draining")
        assert request.result(timeout=20).status_code == 200  # the child kept serving during the drain
    # uvicorn re-raises the SIGTERM after its graceful shutdown: the child dies of it, as a shell reports.
    assert registrar.wait(15) == 128 + signal.SIGTERM
    assert read_key(etcd, key) is None
    assert not http_ok(f"{url}/health")
    log = registrar.log()
    assert log.index("drained") < log.index("forwarding signal=SIGTERM") < log.index("child exited")


def test_wrapper_mode_reads_the_kv_event_endpoints_from_the_childs_kv_events_config(
    etcd: EtcdServer, registrars: StartRegistrar
) -> None:
    port, events, replay = free_port(), free_port(), free_port()
    config = json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
            "topic": "kv",
        }
    )
    child = python_module("vllm_etcd_proxy.sim", "--host", HOST, "--port", str(port), "--kv-events-config", config)
    registrars(f"http://{HOST}:{port}", command=tuple(child))
    entry = wait_for_key(etcd, decode_key(f"{HOST}:{port}"), timeout=20)
    assert (entry.record["kv_events"], entry.record["kv_events_replay"]) == (
        f"tcp://{HOST}:{events}",
        f"tcp://{HOST}:{replay}",
    )


def test_child_exiting_on_its_own_is_deregistered_at_once_and_its_code_passed_on(
    etcd: EtcdServer, registrars: StartRegistrar
) -> None:
    port = free_port()
    child = python_module("vllm_etcd_proxy.sim", "--host", HOST, "--port", str(port))
    registrar = registrars(f"http://{HOST}:{port}", ttl=30, command=tuple(child))
    key = decode_key(f"{HOST}:{port}")
    wait_for_key(etcd, key, timeout=20)

    os.kill(registrar.child_pid(), signal.SIGKILL)
    assert registrar.wait(10) == 128 + signal.SIGKILL
    assert read_key(etcd, key) is None  # revoked, long before the 30 s TTL


def test_a_killed_registrars_child_exits_and_the_same_start_command_works_again(
    etcd: EtcdServer, registrars: StartRegistrar
) -> None:
    port = free_port()
    url = f"http://{HOST}:{port}"
    start_command = tuple(python_module("vllm_etcd_proxy.sim", "--host", HOST, "--port", str(port)))
    first = registrars(url, ttl=3, command=start_command)
    key = decode_key(f"{HOST}:{port}")
    before = wait_for_key(etcd, key, timeout=20)

    first.kill()  # SIGKILL: the OOM killer, a crashed supervisor
    wait_until(lambda: port_is_free(port), 15, "the child to exit and free its port")
    assert not http_ok(f"{url}/health")
    assert f"registrar pid={first.pid} is gone" in first.log()

    again = registrars(url, ttl=3, command=start_command)
    wait_until(lambda: (read_key(etcd, key) or before).lease != before.lease, 20, "the node registered again")
    assert again.alive() and http_ok(f"{url}/health")


def test_a_child_ignoring_sigterm_is_killed_after_the_drain_timeout_once_its_registrar_is_killed(
    registrars: StartRegistrar,
) -> None:
    registrar = registrars(f"http://{HOST}:{free_port()}", "--drain-timeout", "1", command=STUBBORN_CHILD)
    registrar.wait_for_log("stubborn child up", timeout=15)
    child = registrar.child_pid()

    registrar.kill()
    registrar.wait_for_log("ignoring SIGTERM")  # it was asked first
    wait_until(lambda: process_gone(child), 15, "the child to be SIGKILLed")
    log = registrar.log()
    assert "still running 1.0s after SIGTERM: SIGKILL" in log
    assert log.count("ignoring SIGTERM") == 1  # asked once: the registrar's threads dying one by one are not asks


def test_what_the_child_started_goes_too_once_the_child_is_gone(registrars: StartRegistrar) -> None:
    registrar = registrars(f"http://{HOST}:{free_port()}", "--drain-timeout", "60", command=COMMAND_WITH_AN_ENGINE)
    registrar.wait_for_log("engine pid=", timeout=15)
    found = re.search(r"engine pid=(\d+)", registrar.log())
    assert found is not None
    engine = int(found[1])

    registrar.kill()
    # Well before the 60 s grace: the child died of the SIGTERM, so nothing is left to wait for.
    wait_until(lambda: process_gone(engine), 20, "the child's engine process to be killed")


def test_ctrl_c_reaches_the_registrar_alone_and_the_child_only_after_the_drain(
    etcd: EtcdServer, registrars: StartRegistrar
) -> None:
    port = free_port()
    child = python_module("vllm_etcd_proxy.sim", "--host", HOST, "--port", str(port))
    registrar = registrars(f"http://{HOST}:{port}", command=tuple(child))
    wait_for_key(etcd, decode_key(f"{HOST}:{port}"), timeout=20)

    os.killpg(registrar.pid, signal.SIGINT)  # what a terminal does: the foreground process group
    assert registrar.wait(15) == 0  # the child's code: uvicorn exits 0 after a SIGINT
    log = registrar.log()
    assert log.index("draining on signal=SIGINT") < log.index("forwarding signal=SIGINT") < log.index("child exited")
    assert not http_ok(f"http://{HOST}:{port}/health")


def test_a_supervisor_whose_registrar_died_before_it_started_never_runs_the_command(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    done = subprocess.run(
        command_line(command, parent=int(gone.stdout), grace=1.0), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1
    assert "died before the command started: not starting it" in done.stderr
    assert not marker.exists()


def test_a_command_that_cannot_be_run_exits_127_saying_so(etcd: EtcdServer, registrars: StartRegistrar) -> None:
    registrar = registrars(f"http://{HOST}:{free_port()}", command=("no-such-vllm-xyz", "serve"))
    assert registrar.wait(15) == 127
    assert "vllm-registrar: error: cannot run 'no-such-vllm-xyz': No such file or directory" in registrar.log()
    assert etcd.etcdctl("get", "--prefix", "/vllm", "--keys-only").strip() == ""


def test_child_failing_before_it_is_ready_is_never_registered(etcd: EtcdServer, registrars: StartRegistrar) -> None:
    url = f"http://{HOST}:{free_port()}"
    registrar = registrars(url, command=("python3", "-c", "import sys; sys.exit(3)"))
    assert registrar.wait(10) == 3
    assert etcd.etcdctl("get", "--prefix", "/vllm", "--keys-only").strip() == ""


@pytest.mark.parametrize("flags", list(BAD_FLAGS.values()), ids=list(BAD_FLAGS))
def test_bad_flags_give_one_error_line_and_exit_2(flags: list[str]) -> None:
    done = run_registrar("--etcd", "http://127.0.0.1:2379", *flags)
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-registrar: error: "), done.stderr


def test_unreachable_etcd_at_start_gives_one_error_line_and_exits_1() -> None:
    url = f"http://{HOST}:{free_port()}"
    done = run_registrar("--etcd", url, "--etcd-timeout", "1", "--role", "decode", "--url", "http://127.0.0.1:9")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-registrar: error: cannot connect to etcd"), done.stderr
