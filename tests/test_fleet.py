"""The whole path on real etcd: registrars write leased keys, two proxy replicas watch them and route."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Reaper
from tests.support.etcd_server import EtcdServer
from tests.support.procs import wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.registrar_proc import Registrar, wait_for_no_key
from tests.support.sim_node import SimNode

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


@pytest.fixture
def replicas(etcd: EtcdServer, logs_dir: Path) -> Iterator[list[ProxyProc]]:
    started: list[ProxyProc] = []
    try:
        for i in range(2):
            started.append(ProxyProc(logs_dir, "--etcd", etcd.endpoint, name=f"proxy{i}", admin_key="adm"))
        yield started
    finally:
        for replica in started:
            replica.stop()


@pytest.fixture
def node(logs_dir: Path) -> Iterator[SimNode]:
    with SimNode(logs_dir, "decode", role="decode") as sim:
        yield sim


def key(role: str, node_id: str) -> str:
    return f"/vllm/default/{role}/{node_id}"


def test_registered_node_becomes_routable_on_every_replica(
    etcd: EtcdServer, replicas: list[ProxyProc], logs_dir: Path, reap: Reaper
) -> None:
    with SimNode(logs_dir, "prefill", role="prefill") as prefill, SimNode(logs_dir, "decode", role="decode") as decode:
        reap(Registrar(etcd, prefill.url, logs_dir, role="prefill", name="reg-p"))
        reap(Registrar(etcd, decode.url, logs_dir, role="decode", name="reg-d"))
        for replica in replicas:
            replica.wait_routable("prefill", prefill.host_port)
            replica.wait_routable("decode", decode.host_port)
            response = replica.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200, response.text
            assert response.headers["x-sim-prefill-engine"] == prefill.engine_id
            assert replica.get("/ready").status_code == 200


def test_node_whose_registrar_is_killed_disappears_when_its_lease_expires(
    etcd: EtcdServer, replicas: list[ProxyProc], node: SimNode, logs_dir: Path, reap: Reaper
) -> None:
    reg = reap(Registrar(etcd, node.url, logs_dir, ttl=3))
    for replica in replicas:
        replica.wait_routable("decode", node.host_port)
    reg.kill()
    wait_for_no_key(etcd, key("decode", node.host_port), timeout=15)
    for replica in replicas:
        replica.wait_gone("decode", node.host_port, timeout=5)
    response = replicas[0].post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 404


def test_registrar_sigterm_drains_then_deregisters(
    etcd: EtcdServer, replicas: list[ProxyProc], node: SimNode, logs_dir: Path, reap: Reaper
) -> None:
    reg = reap(Registrar(etcd, node.url, logs_dir))
    for replica in replicas:
        replica.wait_routable("decode", node.host_port)
    # The stream in flight lasts (100 tokens at 0.2 s) until the draining node has been seen refusing, then is let
    # run to its end: were it to end first, the registrar would deregister the node and the model be unknown (404).
    node.configure(itl=0.2)
    with httpx.stream(
        "POST", f"{replicas[0].url}/v1/chat/completions", json={**CHAT, "max_tokens": 100, "stream": True}, timeout=30
    ) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        reg.signal(signal.SIGTERM)
        for replica in replicas:
            wait_until(lambda r=replica: any(w["status"] == "draining" for w in r.workers()), 5, "draining")
        # A draining node takes no new requests, but the one in flight runs to the end.
        assert replicas[1].post("/v1/chat/completions", json=CHAT).status_code == 503
        node.configure(itl=0.001)
        rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
    assert reg.wait(15) == 0
    for replica in replicas:
        replica.wait_gone("decode", node.host_port, timeout=5)


def test_bare_etcdctl_key_with_empty_value_is_routable(
    etcd: EtcdServer, replicas: list[ProxyProc], node: SimNode
) -> None:
    etcd.etcdctl("put", key("decode", node.host_port), "")
    for replica in replicas:
        replica.wait_routable("decode", node.host_port)
        answer = replica.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200 and answer.headers["x-sim-node"] == node.host_port
    etcd.etcdctl("del", key("decode", node.host_port))
    for replica in replicas:
        replica.wait_gone("decode", node.host_port)


GARBAGE = [
    ("decode/127.0.0.11:1", "not json"),
    ("decode/127.0.0.12:1", "[1,2]"),
    ("gpu/127.0.0.13:1", ""),
    ("decode/no-port", ""),
    ("decode/127.0.0.14:1", '{"url": "ftp://127.0.0.14:1"}'),
    ("decode/127.0.0.15:1", '{"url": "http://user:pw@127.0.0.15:1"}'),
    ("prefill/127.0.0.16:1", '{"role": "decode"}'),
]


def test_garbage_in_etcd_is_ignored_and_counted_without_disturbing_nodes(
    etcd: EtcdServer, replicas: list[ProxyProc], node: SimNode
) -> None:
    etcd.etcdctl("put", key("decode", node.host_port), "")
    for suffix, value in GARBAGE:
        etcd.etcdctl("put", f"/vllm/default/{suffix}", value)
    for replica in replicas:
        wait_until(lambda r=replica: r.status()["discovery"]["invalid_total"] >= len(GARBAGE), 10, "all counted")
        status = replica.status()
        assert status["decode_nodes"] == [node.host_port]
        assert status["prefill_node_count"] == 0
        assert set(status["discovery"]["invalid_keys"]) == {f"/vllm/default/{suffix}" for suffix, _ in GARBAGE}
        assert replica.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert f"vllm_proxy_etcd_ignored_keys {float(len(GARBAGE))}" in replica.get("/metrics").text
    # A bad value replacing a good one removes that node, and a fixed value brings it back.
    etcd.etcdctl("put", key("decode", node.host_port), "{broken")
    replicas[0].wait_gone("decode", node.host_port)
    etcd.etcdctl("put", key("decode", node.host_port), "")
    replicas[0].wait_routable("decode", node.host_port)


def test_admin_changes_through_one_replica_are_seen_by_the_other(
    etcd: EtcdServer, replicas: list[ProxyProc], node: SimNode
) -> None:
    body = {"type": "decode", "instance": node.host_port}
    added = replicas[0].post("/instances/add", json=body, headers={"X-Api-Key": "adm"})
    assert added.json() == {"message": f"Added {node.host_port} to decode_instances."}
    replicas[1].wait_routable("decode", node.host_port)
    assert replicas[1].post("/v1/chat/completions", json=CHAT).status_code == 200
    assert etcd.etcdctl("get", key("decode", node.host_port), "--print-value-only").strip()
    removed = replicas[1].post("/instances/remove", json=body, headers={"Authorization": "Bearer adm"})
    assert removed.json() == {"message": f"Removed {node.host_port} from decode_instances."}
    replicas[0].wait_gone("decode", node.host_port)


def test_replica_keeps_serving_its_last_pool_while_etcd_is_down(
    etcd: EtcdServer, replicas: list[ProxyProc], node: SimNode
) -> None:
    etcd.etcdctl("put", key("decode", node.host_port), "")
    replicas[0].wait_routable("decode", node.host_port)
    etcd.kill()
    wait_until(lambda: not replicas[0].status()["discovery"]["connected"], 30, "replica to notice etcd is gone")
    assert replicas[0].post("/v1/chat/completions", json=CHAT).status_code == 200
    assert "vllm_proxy_etcd_connected 0.0" in replicas[0].get("/metrics").text
    etcd.start()
    wait_until(lambda: replicas[0].status()["discovery"]["connected"], 30, "replica to reconnect")


def test_a_node_id_registered_under_two_roles_is_served_once_and_the_other_takes_over(
    etcd: EtcdServer, replicas: list[ProxyProc], node: SimNode
) -> None:
    etcd.etcdctl("put", key("decode", node.host_port), "")
    replicas[0].wait_routable("decode", node.host_port)
    etcd.etcdctl("put", key("prefill", node.host_port), "")
    wait_until(
        lambda: key("prefill", node.host_port) in replicas[0].status()["discovery"]["invalid_keys"],
        10,
        "the duplicate to be refused",
    )
    assert replicas[0].status()["prefill_node_count"] == 0
    etcd.etcdctl("del", key("decode", node.host_port))
    replicas[0].wait_routable("prefill", node.host_port)
    replicas[0].wait_gone("decode", node.host_port)
    assert key("prefill", node.host_port) not in replicas[0].status()["discovery"]["invalid_keys"]
