"""Generated hostile input: whatever arrives, the replica answers a well-formed status, keeps serving, and its
pools hold exactly the valid registrations."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.etcd_server import EtcdServer
from tests.support.procs import DeadPort, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"
ROUTES = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
    "/v1/models",
    "/instances/add",
    "/instances/remove",
    "/status",
    "/list_workers",
    "/health",
    "/ready",
    "/metrics",
    "/nope",
    "/v1/../etc/passwd",
    "/v1/completions/extra",
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
field_values = st.one_of(json_values, st.just(MODEL))
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {},
        optional={
            "model": field_values,
            "stream": field_values,
            "max_tokens": field_values,
            "prompt": field_values,
            "messages": field_values,
            "stream_options": field_values,
            "n": field_values,
        },
    ).map(lambda v: json.dumps(v).encode()),
    st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(1, 3000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth),
)
header_values = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40)
headers = st.dictionaries(
    st.sampled_from(["content-type", "x-request-id", "authorization", "x-api-key", "accept", "content-encoding"]),
    header_values,
    max_size=4,
)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def stack(logs: Path) -> Iterator[tuple[ProxyProc, SimNode]]:
    with SimNode(logs, "node", role="mixed") as node:
        replica = ProxyProc(logs, "--mixed", node.host_port, admin_key="adm")
        try:
            replica.wait_routable("mixed", node.host_port)
            yield replica, node
        finally:
            replica.stop()


@pytest.fixture(scope="module")
def client(stack: tuple[ProxyProc, SimNode]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack[0].url, timeout=10) as shared:
        yield shared


def assert_well_formed(response: httpx.Response) -> None:
    assert response.status_code in {200, 400, 401, 403, 404, 405, 408, 413, 422, 503}, response.status_code
    from_node = "x-sim-node" in response.headers  # a node's own answer (e.g. vLLM's 404 for an unknown route)
    if (
        response.status_code >= 400
        and response.headers.get("content-type", "").startswith("application/json")
        and not from_node
    ):
        error = response.json()["error"]
        assert isinstance(error, dict) and {"message", "type", "code"} <= set(error), error


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(METHODS), route=st.sampled_from(ROUTES), body=bodies, extra=headers)
def test_any_request_gets_a_well_formed_answer_and_the_replica_keeps_serving(
    client: httpx.Client, method: str, route: str, body: bytes, extra: dict[str, str]
) -> None:
    answer = client.request(method, route, content=body, headers=extra)
    assert_well_formed(answer)
    ok = client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    )
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "messages": "hi"}, "messages"),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"model": MODEL, "messages": [1]}, "messages"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "9"}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "stream": 1}, "stream"),
        ({"model": [MODEL], "prompt": "x"}, "model"),
        ({"model": MODEL, "prompt": 5}, "prompt"),
    ],
)
def test_wrong_field_types_are_400_naming_the_field_and_reach_no_node(
    stack: tuple[ProxyProc, SimNode], body: dict[str, Any], param: str
) -> None:
    replica, node = stack
    node.clear_requests()
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    answer = replica.post(route, json=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == param
    assert node.requests() == []


VALID_ROLES = ["prefill", "decode", "mixed"]
LOOPBACK_NAMES = {"127.0.0.1", "localhost", "::1"}
DEAD = "{dead}"
"""Stands for the port of a DeadPort in generated keys and URLs: valid records point where nothing listens."""
etcd_keys = st.one_of(
    st.builds(
        lambda r, h, p: f"/vllm/default/{r}/{h}:{p}".encode(),
        st.sampled_from(VALID_ROLES + ["gpu", ""]),
        st.sampled_from(["127.0.0.1", "localhost", "[::1]", "bad host", ""]),
        st.sampled_from([DEAD, "0", "70000", "x", ""]),
    ),
    st.binary(max_size=30).map(lambda b: b"/vllm/default/decode/" + b),
)
etcd_values = st.one_of(
    st.just(b""),
    st.binary(max_size=100),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {},
        optional={
            "url": st.sampled_from(
                [f"http://127.0.0.1:{DEAD}", "ftp://x:1", "http://u:p@h:1", f"https://localhost:{DEAD}/p", 5]
            ),
            "role": st.sampled_from(VALID_ROLES + ["x", 3]),
            "models": st.sampled_from([["m"], "m", [1]]),
            "status": st.sampled_from(["serving", "draining", "asleep"]),
            "labels": json_values,
        },
    ).map(lambda v: json.dumps(v).encode()),
)


def test_generated_garbage_in_etcd_leaves_exactly_the_valid_nodes(etcd: EtcdServer, logs_dir: Path) -> None:
    from vllm_etcd_proxy.fleet.records import InvalidRecord, KeyLayout

    examples: dict[bytes, bytes] = {}

    @settings(max_examples=150, deadline=None, database=None)
    @given(key=etcd_keys, value=etcd_values)
    def collect(key: bytes, value: bytes) -> None:
        examples[key] = value

    collect()
    dead = DeadPort()
    examples = {
        k.replace(DEAD.encode(), str(dead.port).encode()): v.replace(DEAD.encode(), str(dead.port).encode())
        for k, v in examples.items()
    }
    valid: set[str] = set()
    layout = KeyLayout()
    for key, value in list(examples.items()):
        try:
            node = layout.parse(key, value)
        except InvalidRecord:
            continue
        if urlsplit(node.url).hostname not in LOOPBACK_NAMES or urlsplit(node.url).port != dead.port:
            del examples[key]  # random bytes that happen to name a real host: never hand those to a replica
        elif node.node_id in {v.split("/", 1)[1] for v in valid}:
            del examples[key]  # one node id under two roles: which one wins depends on list vs watch order
        else:
            valid.add(f"{node.role.value}/{node.node_id}")
    replica = ProxyProc(logs_dir, "--etcd", etcd.endpoint, "--models-refresh", "3600")
    try:
        import asyncio

        from vllm_etcd_proxy.fleet.etcd import EtcdClient, EtcdSettings

        async def write_all() -> None:
            async with EtcdClient(EtcdSettings(endpoints=(etcd.endpoint,))) as client:
                for key, value in examples.items():
                    await client.put(key, value)

        asyncio.run(write_all())

        def converged() -> bool:
            status = replica.status()
            seen = {f"{w['role']}/{w['id']}" for w in replica.workers()}
            return seen == valid and status["discovery"]["invalid_total"] >= len(examples) - len(valid)

        wait_until(converged, 20, "the replica's pool to hold exactly the valid keys")
        assert replica.get("/health").status_code == 200
    finally:
        replica.stop()
        dead.close()
