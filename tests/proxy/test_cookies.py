"""One client's state never reaches another client's request: a node's Set-Cookie goes back to the client
whose request caused it and to no one else, on mixed and disaggregated legs, streamed or not."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MIXED_MODEL, PD_MODEL = "mixed-model", "pd-model"
ALICE_COOKIE = "secret-session=alice-123; Path=/; HttpOnly"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def nodes(logs: Path) -> Iterator[dict[str, SimNode]]:
    started = {
        "mixed": SimNode(logs, "cookie-mixed", role="mixed", model=MIXED_MODEL),
        "prefill": SimNode(logs, "cookie-prefill", role="prefill", model=PD_MODEL),
        "decode": SimNode(logs, "cookie-decode", role="decode", model=PD_MODEL),
    }
    try:
        for node in started.values():
            node.start()
        yield started
    finally:
        for node in started.values():
            node.stop()


@pytest.fixture(scope="module")
def proxy(logs: Path, nodes: dict[str, SimNode]) -> Iterator[ProxyProc]:
    replica = ProxyProc(logs, *(arg for role, node in nodes.items() for arg in (f"--{role}", node.host_port)))
    try:
        for role, node in nodes.items():
            replica.wait_routable(role, node.host_port)
        yield replica
    finally:
        replica.stop()


def _send(proxy: ProxyProc, model: str, request_id: str, stream: bool, cookie: str | None = None) -> httpx.Response:
    # A fresh connection and no client-side jar: whatever Cookie reaches the node was added by the proxy.
    headers = {"x-request-id": request_id, **({"cookie": cookie} if cookie else {})}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}
    with httpx.Client(timeout=30) as client:
        response = client.post(f"{proxy.url}/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]")
    return response


@pytest.mark.parametrize("model", [MIXED_MODEL, PD_MODEL])
def test_a_nodes_cookie_reaches_only_the_client_it_was_set_for(
    proxy: ProxyProc, nodes: dict[str, SimNode], model: str
) -> None:
    legs = [nodes["mixed"]] if model == MIXED_MODEL else [nodes["prefill"], nodes["decode"]]
    for stream in (False, True):
        tag = f"{model}-{'stream' if stream else 'json'}"
        for node in legs:
            node.configure(set_cookie=ALICE_COOKIE)
        alice = _send(proxy, model, f"alice-{tag}", stream, cookie="mine=alice")
        assert ALICE_COOKIE in alice.headers.get_list("set-cookie")
        for node in legs:
            node.configure(set_cookie="")
        for n in range(3):
            for bob_stream in (False, True):
                bob = _send(proxy, model, f"bob-{tag}-{n}-{bob_stream}", bob_stream)
                assert "set-cookie" not in bob.headers
        for node in legs:
            seen = [r for r in node.requests() if r["request_id"].endswith(tag) or f"-{tag}-" in r["request_id"]]
            alices = [r for r in seen if r["request_id"].startswith("alice-")]
            bobs = [r for r in seen if r["request_id"].startswith("bob-")]
            assert len(alices) == 1 and len(bobs) == 6, (node.name, seen)
            # Alice's own cookie goes with her request, and only hers; nobody gets the node's cookie back.
            assert alices[0]["cookie"] == "mine=alice", node.name
            assert [r["cookie"] for r in bobs] == [None] * 6, node.name
