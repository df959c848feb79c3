"""WebSockets through a real vllm-proxy: vllm-sim's /v1/realtime, and a tiny echo node for binary frames and
close reasons. One node per connection, closes passed both ways, client keys, metrics."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Subprotocol

from tests.support.aio import eventually
from tests.support.procs import HOST, DeadPort
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

KEY = "client-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MODELS = ("rt-a", "rt-b")  # rt-a sorts first: the model of a session that names none
AUDIO = base64.b64encode(bytes(range(256)) * 8).decode()


@pytest.fixture(scope="module")
def module_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def nodes(module_logs: Path) -> Iterator[dict[str, SimNode]]:
    started = {model: SimNode(module_logs, model, model=model, ttft=0.01, itl=0.002) for model in MODELS}
    try:
        for node in started.values():
            node.start()
        yield started
    finally:
        for node in started.values():
            node.stop()


@pytest.fixture(scope="module")
def proxy(module_logs: Path, nodes: dict[str, SimNode]) -> Iterator[ProxyProc]:
    flags = [arg for node in nodes.values() for arg in ("--mixed", node.host_port)]
    replica = ProxyProc(module_logs, *flags, "--api-key", KEY)
    try:
        for node in nodes.values():
            replica.wait_routable("mixed", node.host_port)
        yield replica
    finally:
        replica.stop()


@pytest.fixture(autouse=True)
def _clear(nodes: dict[str, SimNode]) -> None:
    for node in nodes.values():
        node.clear_requests()


def ws_url(proxy: ProxyProc, query: str = "") -> str:
    return proxy.url.replace("http://", "ws://") + "/v1/realtime" + query


async def receive(ws: ClientConnection) -> dict[str, Any]:
    event: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 10.0))
    return event


async def transcribe(ws: ClientConnection) -> dict[str, Any]:
    """One utterance: append, commit, read up to transcription.done."""
    await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": AUDIO}))
    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
    while (event := await receive(ws))["type"] == "transcription.delta":
        pass
    return event


async def session_record(node: SimNode, request_id: str, **match: Any) -> dict[str, Any]:
    return await asyncio.to_thread(
        node.wait_for_request, 10.0, request_id=request_id, method="WEBSOCKET", path="/v1/realtime", **match
    )


def metric(proxy: ProxyProc, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in proxy.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_session_with_the_model_in_the_query_works_end_to_end(
    proxy: ProxyProc, nodes: dict[str, SimNode]
) -> None:
    headers = {**AUTH, "x-request-id": "rt-query"}
    async with connect(ws_url(proxy, "?model=rt-b"), additional_headers=headers) as ws:
        assert ws.response.headers["x-request-id"] == "rt-query"
        assert (await receive(ws))["type"] == "session.created"
        done = await transcribe(ws)
        assert done["type"] == "transcription.done" and done["text"]
    record = await session_record(nodes["rt-b"], "rt-query", state="closed")
    assert record["query"] == "model=rt-b" and record["authorization"] == AUTH["authorization"]
    assert record["detail"]["events"] == ["input_audio_buffer.append", "input_audio_buffer.commit"]
    assert not [r for r in nodes["rt-a"].requests() if r["request_id"] == "rt-query"]


@pytest.mark.parametrize("update", [{"model": "rt-b"}, {"session": {"model": "rt-b"}}], ids=["model", "session"])
async def test_the_first_session_update_moves_the_session_to_a_node_of_its_model(
    proxy: ProxyProc, nodes: dict[str, SimNode], update: dict[str, Any]
) -> None:
    async with connect(ws_url(proxy), additional_headers={**AUTH, "x-request-id": "rt-update"}) as ws:
        # vLLM speaks first: the session opens on a node of the first model, which greets the client.
        assert (await receive(ws))["type"] == "session.created"
        await ws.send(json.dumps({"type": "session.update", **update}))
        assert (await transcribe(ws))["type"] == "transcription.done"
    moved = await session_record(nodes["rt-b"], "rt-update", state="closed")
    assert moved["detail"]["events"] == ["session.update", "input_audio_buffer.append", "input_audio_buffer.commit"]
    first = await session_record(nodes["rt-a"], "rt-update", state="closed")
    assert first["detail"]["events"] == []


async def test_a_session_update_for_the_first_nodes_model_stays_there(
    proxy: ProxyProc, nodes: dict[str, SimNode]
) -> None:
    async with connect(ws_url(proxy), additional_headers={**AUTH, "x-request-id": "rt-stay"}) as ws:
        await receive(ws)
        await ws.send(json.dumps({"type": "session.update", "model": "rt-a"}))
        assert (await transcribe(ws))["type"] == "transcription.done"
    record = await session_record(nodes["rt-a"], "rt-stay", state="closed")
    assert record["detail"]["events"][0] == "session.update"


async def test_the_responses_websocket_mode_goes_to_the_node_of_the_first_events_model(
    proxy: ProxyProc, nodes: dict[str, SimNode]
) -> None:
    url = proxy.url.replace("http://", "ws://") + "/v1/responses"
    async with connect(url, additional_headers={**AUTH, "x-request-id": "rt-responses"}) as ws:
        # The client speaks first here: the session moves before response.create reaches any node.
        create = {"type": "response.create", "model": "rt-b", "input": "hello", "max_output_tokens": 3}
        await ws.send(json.dumps(create))
        while (event := await receive(ws))["type"] != "response.completed":
            assert event["type"] != "error", event
        assert event["response"]["model"] == "rt-b"
    record = await asyncio.to_thread(
        nodes["rt-b"].wait_for_request, 10.0, request_id="rt-responses", path="/v1/responses", state="closed"
    )
    assert record["detail"]["events"] == ["response.create"]


async def test_a_client_close_reaches_the_node_with_its_code(proxy: ProxyProc, nodes: dict[str, SimNode]) -> None:
    async with connect(ws_url(proxy, "?model=rt-a"), additional_headers={**AUTH, "x-request-id": "rt-bye"}) as ws:
        await receive(ws)
        await ws.close(code=4001, reason="done here")
    record = await session_record(nodes["rt-a"], "rt-bye", state="closed")
    assert (record["detail"]["closed_by"], record["detail"]["close_code"]) == ("client", 4001)


async def test_a_node_close_reaches_the_client_with_its_code(proxy: ProxyProc, nodes: dict[str, SimNode]) -> None:
    async with connect(ws_url(proxy, "?model=rt-b"), additional_headers=AUTH) as ws:
        await receive(ws)
        closed = httpx.post(f"{nodes['rt-b'].url}/sim/realtime/close", json={"code": 4002}).json()["closed"]
        assert len(closed) == 1
        with pytest.raises(ConnectionClosed) as caught:
            await asyncio.wait_for(ws.recv(), 10.0)
    assert caught.value.rcvd is not None and caught.value.rcvd.code == 4002


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}], ids=["none", "wrong"])
async def test_a_session_without_a_valid_client_key_is_refused(proxy: ProxyProc, headers: dict[str, str]) -> None:
    with pytest.raises(InvalidStatus) as caught:
        async with connect(ws_url(proxy, "?model=rt-a"), additional_headers=headers):
            pass
    response = caught.value.response
    assert response.status_code == 401
    assert json.loads(response.body)["error"]["code"] == "invalid_api_key"


async def test_an_unknown_model_is_refused_with_the_reason(proxy: ProxyProc) -> None:
    with pytest.raises(InvalidStatus) as caught:
        async with connect(ws_url(proxy, "?model=nope"), additional_headers=AUTH):
            pass
    assert caught.value.response.status_code == 404
    assert "`nope` does not exist" in json.loads(caught.value.response.body)["error"]["message"]
    async with connect(ws_url(proxy), additional_headers=AUTH) as ws:
        await receive(ws)
        await ws.send(json.dumps({"type": "session.update", "model": "nope"}))
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10.0)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert "`nope` does not exist" in closed.value.rcvd.reason


async def test_a_nodes_refusal_of_the_handshake_reaches_the_client(proxy: ProxyProc) -> None:
    url = proxy.url.replace("http://", "ws://") + "/v1/no-such-socket?model=rt-a"
    with pytest.raises(InvalidStatus) as caught:
        async with connect(url, additional_headers=AUTH):
            pass
    assert caught.value.response.status_code == 403  # starlette's answer to a WebSocket on no route
    assert metric(proxy, "vllm_proxy_websocket_sessions_total", route="/v1/other", outcome="refused_by_node") == 1


async def test_metrics_count_open_and_ended_sessions(proxy: ProxyProc) -> None:
    labels = {"route": "/v1/realtime"}
    before = metric(proxy, "vllm_proxy_websocket_sessions_total", outcome="client_closed", **labels)
    refused = metric(proxy, "vllm_proxy_websocket_sessions_total", outcome="unauthorized", **labels)
    async with connect(ws_url(proxy, "?model=rt-a"), additional_headers=AUTH) as ws:
        await receive(ws)
        assert metric(proxy, "vllm_proxy_websocket_sessions_open", **labels) == 1
        in_flight = [w["in_flight"] for w in proxy.workers()]
        assert sorted(in_flight) == [0, 1]  # least-load sees the open session
    with pytest.raises(InvalidStatus):
        async with connect(ws_url(proxy, "?model=rt-a")):
            pass
    await eventually(
        lambda: metric(proxy, "vllm_proxy_websocket_sessions_total", outcome="client_closed", **labels) == before + 1,
        10,
        "the closed session counted",
    )
    assert metric(proxy, "vllm_proxy_websocket_sessions_open", **labels) == 0
    assert metric(proxy, "vllm_proxy_websocket_sessions_total", outcome="unauthorized", **labels) == refused + 1
    assert [w["in_flight"] for w in proxy.workers()] == [0, 0]


async def test_sessions_through_either_of_two_replicas_reach_their_models_node(
    logs_dir: Path, proxy: ProxyProc, nodes: dict[str, SimNode]
) -> None:
    flags = [arg for node in nodes.values() for arg in ("--mixed", node.host_port)]
    second = await asyncio.to_thread(ProxyProc, logs_dir, *flags, "--api-key", KEY, name="proxy-2")
    try:
        for node in nodes.values():
            await asyncio.to_thread(second.wait_routable, "mixed", node.host_port)
        for replica, model in ((proxy, "rt-b"), (second, "rt-b"), (second, "rt-a")):
            rid = f"rt-{replica.port}-{model}"
            async with connect(ws_url(replica), additional_headers={**AUTH, "x-request-id": rid}) as ws:
                await receive(ws)
                await ws.send(json.dumps({"type": "session.update", "model": model}))
                assert (await transcribe(ws))["type"] == "transcription.done"
            record = await session_record(nodes[model], rid, state="closed")
            assert (record["detail"]["closed_by"], record["detail"]["close_code"]) == ("client", 1000)
    finally:
        await asyncio.to_thread(second.stop)


async def test_a_backend_key_replaces_the_clients_on_the_way_to_the_node(
    logs_dir: Path, nodes: dict[str, SimNode]
) -> None:
    flags = ("--mixed", nodes["rt-a"].host_port, "--api-key", KEY, "--backend-api-key", "node-key")
    replica = await asyncio.to_thread(ProxyProc, logs_dir, *flags)
    try:
        await asyncio.to_thread(replica.wait_routable, "mixed", nodes["rt-a"].host_port)
        async with connect(ws_url(replica), additional_headers={**AUTH, "x-request-id": "rt-backend"}) as ws:
            await receive(ws)
        record = await session_record(nodes["rt-a"], "rt-backend", state="closed")
        assert record["authorization"] == "Bearer node-key"
    finally:
        await asyncio.to_thread(replica.stop)


async def test_a_node_killed_mid_session_closes_the_client_with_1011(logs_dir: Path) -> None:
    with SimNode(logs_dir, "doomed", model="rt-a") as node:
        replica = ProxyProc(logs_dir, "--mixed", node.host_port)
        try:
            replica.wait_routable("mixed", node.host_port)
            async with connect(ws_url(replica, "?model=rt-a")) as ws:
                await receive(ws)
                node.kill()
                with pytest.raises(ConnectionClosed) as caught:
                    await asyncio.wait_for(ws.recv(), 10.0)
            assert caught.value.rcvd is not None and caught.value.rcvd.code == 1011
            assert (
                metric(replica, "vllm_proxy_websocket_sessions_total", route="/v1/realtime", outcome="node_lost") == 1
            )
        finally:
            replica.stop()


class EchoNode:
    """A WebSocket node on loopback that sends every message back as it came, and records how sessions closed."""

    def __init__(self) -> None:
        self.closes: list[tuple[int | None, str | None]] = []
        self.paths: list[str] = []
        self.server: Server | None = None

    async def handler(self, ws: ServerConnection) -> None:
        assert ws.request is not None
        self.paths.append(ws.request.path)
        with contextlib.suppress(ConnectionClosed):  # a close other than 1000 ends the loop with an error
            async for message in ws:
                if message == "close please":
                    await ws.close(4003, "as asked")
                    break
                await ws.send(message)
        self.closes.append((ws.close_code, ws.close_reason))

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(next(iter(self.server.sockets)).getsockname()[1])


@pytest.fixture
async def echo() -> AsyncIterator[EchoNode]:
    node = EchoNode()

    def select(connection: ServerConnection, offered: Sequence[Subprotocol]) -> Subprotocol | None:
        return Subprotocol("echo.v1") if "echo.v1" in offered else None

    async with serve(node.handler, HOST, 0, select_subprotocol=select) as server:
        node.server = server
        yield node


@pytest.fixture
def dead_port() -> Iterator[DeadPort]:
    port = DeadPort()
    yield port
    port.close()


async def test_binary_stays_binary_and_text_stays_text_on_any_route(
    logs_dir: Path, echo: EchoNode, dead_port: DeadPort
) -> None:
    # A dead node beside the live one: a session that picks it goes to the other before the client is accepted.
    replica = await asyncio.to_thread(
        ProxyProc, logs_dir, "--mixed", f"{HOST}:{echo.port}", "--mixed", f"{HOST}:{dead_port.port}", "--model", "echo"
    )
    try:
        url = replica.url.replace("http://", "ws://") + "/v1/some/socket?x=1"
        for _ in range(3):
            async with connect(url) as ws:
                await ws.send(b"\x00\x01binary")
                assert await asyncio.wait_for(ws.recv(), 10.0) == b"\x00\x01binary"
                await ws.send("text")
                assert await asyncio.wait_for(ws.recv(), 10.0) == "text"
                await ws.close(4004, "client reason")
        await eventually(lambda: len(echo.closes) == 3, 10, "three closes at the echo node")
        assert echo.closes == [(4004, "client reason")] * 3 and echo.paths == ["/v1/some/socket?x=1"] * 3
        assert (
            metric(
                replica,
                "vllm_proxy_upstream_requests_total",
                role="mixed",
                node=f"{HOST}:{dead_port.port}",
                outcome="connect_error",
            )
            >= 1
        )
        async with connect(url, subprotocols=[Subprotocol("other"), Subprotocol("echo.v1")]) as ws:
            assert ws.subprotocol == "echo.v1"  # the node's choice among the client's
            await ws.send("close please")
            with pytest.raises(ConnectionClosed) as caught:
                await asyncio.wait_for(ws.recv(), 10.0)
        rcvd = caught.value.rcvd
        assert rcvd is not None and (rcvd.code, rcvd.reason) == (4003, "as asked")
    finally:
        await asyncio.to_thread(replica.stop)


async def test_a_session_holds_a_slot_of_the_replica_and_one_of_its_tenants_concurrency(
    logs_dir: Path, nodes: dict[str, SimNode]
) -> None:
    keys = logs_dir / "keys.txt"
    keys.write_text("solo-key tenant=solo concurrency=1\nfree-key tenant=free\n")
    flags = ("--mixed", nodes["rt-a"].host_port, "--api-key-file", str(keys), "--max-concurrent-requests", "2")
    replica = await asyncio.to_thread(ProxyProc, logs_dir, *flags)
    solo, free = {"authorization": "Bearer solo-key"}, {"authorization": "Bearer free-key"}
    chat = {"model": "rt-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def post(headers: dict[str, str]) -> httpx.Response:
        return await asyncio.to_thread(replica.post, "/v1/chat/completions", json=chat, headers=headers)

    async def solo_admitted() -> bool:
        return (await post(solo)).status_code == 200

    async def refused(headers: dict[str, str]) -> httpx.Response:
        with pytest.raises(InvalidStatus) as caught:
            async with connect(ws_url(replica, "?model=rt-a"), additional_headers=headers):
                pass
        return caught.value.response

    try:
        await asyncio.to_thread(replica.wait_routable, "mixed", nodes["rt-a"].host_port)
        async with connect(ws_url(replica, "?model=rt-a"), additional_headers=solo) as first:
            await receive(first)
            # The session is the tenant's one request in flight: another session or request of it waits its turn.
            again = await refused(solo)
            assert again.status_code == 429 and json.loads(again.body)["error"]["type"] == "concurrency"
            assert (await post(solo)).status_code == 429
            async with connect(ws_url(replica, "?model=rt-a"), additional_headers=free) as second:
                await receive(second)
                # Two sessions open: the replica's --max-concurrent-requests 2 are taken.
                assert (await refused(free)).status_code == 503
                assert (await post(free)).status_code == 503
        await eventually(solo_admitted, 10, "the closed sessions' slots given back")
        assert (await post(free)).status_code == 200
        assert metric(replica, "vllm_proxy_websocket_sessions_total", route="/v1/realtime", outcome="rate_limited") == 1
        assert metric(replica, "vllm_proxy_websocket_sessions_total", route="/v1/realtime", outcome="replica_full") == 1
    finally:
        await asyncio.to_thread(replica.stop)
