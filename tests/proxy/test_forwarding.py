"""What a client sees when nodes answer 5xx, 429/503 or break mid-answer: retried or ended exactly as README
"Operations" says. The replica runs for real (uvicorn on loopback); only its transport to the nodes is a
scripted one, so each node's answer is exact."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import orjson
import pytest
import uvicorn

from tests.support.procs import HOST, free_port
from vllm_etcd_proxy.proxy.app import ProxyApp, build_app
from vllm_etcd_proxy.proxy.errors import UpstreamFailed
from vllm_etcd_proxy.proxy.flags import build_parser, settings_from_args
from vllm_etcd_proxy.proxy.serving.forwarder import BUSY_HOLD
from vllm_etcd_proxy.proxy.upstream.transport import UpstreamRequest, UpstreamResponse

MODEL = "m"
NODE_A, NODE_B = "127.0.0.1:1", "127.0.0.1:2"
SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


@dataclass
class Answer:
    """How a scripted node answers one request."""

    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=lambda: list(JSON))
    chunks: list[bytes] = field(default_factory=lambda: [b'{"ok": true}'])
    then: Exception | None = None
    """Raised by read() after the chunks, instead of the end of the body."""
    refuse: Exception | None = None
    """Raised by send(): the node could not be reached."""


class ScriptedResponse:
    def __init__(self, answer: Answer) -> None:
        self.status = answer.status
        self.headers = answer.headers
        self._chunks = list(answer.chunks)
        self._then = answer.then
        self.closed = False

    async def read(self) -> bytes:
        if self._chunks:
            return self._chunks.pop(0)
        if self._then is not None:
            raise self._then
        return b""

    def close(self) -> None:
        self.closed = True


class ScriptedTransport:
    """Each node answers with its script's answers in turn, the last one from then on."""

    def __init__(self, scripts: dict[str, list[Answer]]) -> None:
        self.scripts = scripts
        self.calls: list[str] = []
        self.bodies: list[bytes] = []

    async def send(self, request: UpstreamRequest) -> UpstreamResponse:
        node = f"{request.origin.host}:{request.origin.port}"
        self.calls.append(node)
        self.bodies.append(request.body)
        script = self.scripts[node]
        answer = script.pop(0) if len(script) > 1 else script[0]
        if answer.refuse is not None:
            raise answer.refuse
        return ScriptedResponse(answer)


@asynccontextmanager
async def replica(transport: ScriptedTransport, *flags: str) -> AsyncIterator[str]:
    """A replica with static mixed nodes A and B on a real loopback port (more ``vllm-proxy`` flags may be
    given); yields its URL."""
    argv = ["--mixed", NODE_A, NODE_B, "--model", MODEL, "--policy", "round-robin", *flags]
    app: ProxyApp = build_app(settings_from_args(build_parser().parse_args(argv)), transport=transport)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host=HOST, port=port, log_config=None, lifespan="on", loop="asyncio", http="httptools")
    )
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        yield f"http://{HOST}:{port}"
    finally:
        server.should_exit = True
        await task


def completion(stream: bool = False) -> dict[str, object]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": stream}


async def workers(client: httpx.AsyncClient) -> dict[str, dict[str, object]]:
    listed = (await client.get("/list_workers")).json()["workers"]
    return {w["id"]: w for w in listed}


async def test_a_5xx_is_retried_on_another_node_and_counts_against_the_first() -> None:
    transport = ScriptedTransport(
        {NODE_A: [Answer(status=500, chunks=[b'{"error": "boom"}'])], NODE_B: [Answer(chunks=[b'{"from": "b"}'])]}
    )
    async with replica(transport, "--eject-after", "0") as url, httpx.AsyncClient(base_url=url) as client:
        for _ in range(4):
            answer = await client.post("/v1/completions", json=completion())
            assert answer.status_code == 200 and answer.json() == {"from": "b"}
        assert transport.calls.count(NODE_B) == 4 and 1 <= transport.calls.count(NODE_A) <= 4
        # A was tried before B whenever it was tried at all: a retry never goes back to a node already tried.
        assert all(transport.calls[i + 1] == NODE_B for i, n in enumerate(transport.calls) if n == NODE_A)
        state = await workers(client)
        assert state[NODE_A]["consecutive_failures"] == transport.calls.count(NODE_A)
        assert state[NODE_B]["consecutive_failures"] == 0
        assert state[NODE_A]["in_flight"] == state[NODE_B]["in_flight"] == 0


async def test_a_node_answering_429_is_passed_over_but_never_ejected() -> None:
    transport = ScriptedTransport({NODE_A: [Answer(status=429, chunks=[b"{}"])], NODE_B: [Answer()]})
    async with replica(transport, "--eject-after", "1") as url, httpx.AsyncClient(base_url=url) as client:
        for _ in range(6):
            assert (await client.post("/v1/completions", json=completion())).status_code == 200
        state = await workers(client)
        assert transport.calls.count(NODE_A) >= 2
        assert state[NODE_A]["ejected"] is False and state[NODE_A]["consecutive_failures"] == 0


async def test_a_node_answering_503_is_held_back_for_a_while_then_tried_again_never_ejected() -> None:
    transport = ScriptedTransport({NODE_A: [Answer(status=503, chunks=[b"{}"])], NODE_B: [Answer()]})
    async with replica(transport, "--eject-after", "1") as url, httpx.AsyncClient(base_url=url) as client:
        started = time.monotonic()
        for _ in range(6):
            assert (await client.post("/v1/completions", json=completion())).status_code == 200
        if time.monotonic() - started < BUSY_HOLD:
            assert transport.calls.count(NODE_A) == 1  # held back after its 503 (vLLM scaling, say)
        deadline = time.monotonic() + 10
        while transport.calls.count(NODE_A) < 2:
            assert time.monotonic() < deadline, "the node was never tried again after its hold"
            assert (await client.post("/v1/completions", json=completion())).status_code == 200
            await asyncio.sleep(0.05)
        state = await workers(client)
        assert state[NODE_A]["ejected"] is False and state[NODE_A]["consecutive_failures"] == 0


async def test_when_every_node_fails_the_client_gets_the_last_nodes_own_error() -> None:
    error = b'{"object": "error", "message": "engine dead", "code": 500}'
    transport = ScriptedTransport(
        {NODE_A: [Answer(status=500, chunks=[error])], NODE_B: [Answer(status=500, chunks=[error])]}
    )
    async with replica(transport, "--eject-after", "0") as url, httpx.AsyncClient(base_url=url) as client:
        answer = await client.post("/v1/completions", json=completion())
        assert answer.status_code == 500 and answer.content == error
        assert len(transport.calls) == 3 and set(transport.calls) == {NODE_A, NODE_B}


async def test_unreachable_nodes_give_a_502_after_max_attempts() -> None:
    refused = Answer(refuse=UpstreamFailed("cannot connect"))
    transport = ScriptedTransport({NODE_A: [refused], NODE_B: [refused]})
    flags = ("--eject-after", "0", "--max-attempts", "2")
    async with replica(transport, *flags) as url, httpx.AsyncClient(base_url=url) as client:
        answer = await client.post("/v1/completions", json=completion())
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_failed"
        assert sorted(transport.calls) == [NODE_A, NODE_B]


async def test_a_stream_that_breaks_after_its_first_bytes_ends_with_an_error_event_and_no_retry() -> None:
    events = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n']
    broken = Answer(headers=list(SSE), chunks=events, then=UpstreamFailed("node broke off the response"))
    transport = ScriptedTransport({NODE_A: [broken], NODE_B: [broken]})
    async with replica(transport, "--max-resumes", "0") as url, httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/v1/completions", json=completion(stream=True)) as answer:
            assert answer.status_code == 200
            body = b"".join([chunk async for chunk in answer.aiter_raw()])
        assert len(transport.calls) == 1
        blocks = body.split(b"\n\n")
        assert blocks[:2] == [e.rstrip(b"\n") for e in events]
        assert orjson.loads(blocks[2].removeprefix(b"data: "))["error"]["code"] == "upstream_failed"
        assert blocks[3] == b"data: [DONE]"


async def test_a_json_body_cut_off_midway_is_left_unfinished_so_the_client_sees_an_error() -> None:
    half = Answer(
        headers=[*JSON, (b"content-length", b"40")],
        chunks=[b'{"choices": [{"text": "'],
        then=UpstreamFailed("node broke off the response"),
    )
    transport = ScriptedTransport({NODE_A: [half], NODE_B: [half]})
    async with replica(transport) as url, httpx.AsyncClient(base_url=url) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/v1/completions", json=completion())
        assert len(transport.calls) == 1
        # The replica itself is fine: the next request is answered.
        transport.scripts[NODE_A] = transport.scripts[NODE_B] = [Answer()]
        assert (await client.post("/v1/completions", json=completion())).status_code == 200


async def test_a_request_that_fails_inside_the_proxy_leaks_no_node_slot_and_no_concurrency_slot() -> None:
    transport = ScriptedTransport(
        {NODE_A: [Answer(refuse=RuntimeError("bug"))], NODE_B: [Answer(refuse=RuntimeError("bug"))]}
    )
    async with replica(transport, "--max-concurrent-requests", "1") as url, httpx.AsyncClient(base_url=url) as client:
        for _ in range(3):
            assert (await client.post("/v1/completions", json=completion())).status_code == 500
        state = await workers(client)
        assert state[NODE_A]["in_flight"] == state[NODE_B]["in_flight"] == 0
        transport.scripts[NODE_A] = transport.scripts[NODE_B] = [Answer()]
        # With a concurrency limit of 1, a leaked slot would turn this into a 503.
        assert (await client.post("/v1/completions", json=completion())).status_code == 200


async def test_a_broken_stream_goes_on_from_another_node_with_the_rest_of_the_answer_asked_for() -> None:
    head = b'{"id": "cmpl-1", "created": 7, "model": "m", "choices": [{"index": 0, "text": '
    first = [head + b'" one"}]}\n\ndata: ', head + b'" two"}]}\n\n']  # an event cut across two reads
    broken = Answer(
        headers=list(SSE),
        chunks=[b"data: " + first[0], first[1], b"data: " + head[:20]],
        then=UpstreamFailed("node broke off the response"),
    )
    rest = (
        b'{"id": "cmpl-2", "created": 9, "model": "m", "choices": [{"index": 0, "text": " three", '
        b'"finish_reason": "length"}]}'
    )
    fine = Answer(headers=list(SSE), chunks=[b"data: " + rest + b"\n\n", b"data: [DONE]\n\n"])
    transport = ScriptedTransport({NODE_A: [broken], NODE_B: [fine]})
    async with replica(transport, "--policy", "round-robin") as url, httpx.AsyncClient(base_url=url) as client:
        # Round-robin over the nodes in URL order: the first request goes to A.
        answer = await client.post("/v1/completions", json={**completion(stream=True), "max_tokens": 3})
        events = [orjson.loads(e[6:]) for e in answer.content.split(b"\n\n") if e.startswith(b"data: {")]
        assert "".join(e["choices"][0]["text"] for e in events) == " one two three"
        assert {e["id"] for e in events} == {"cmpl-1"} and {e["created"] for e in events} == {7}
        assert answer.content.endswith(b"data: [DONE]\n\n")
        # The half event the failed node sent never reached the client; the continuation asked for the rest.
        assert transport.calls == [NODE_A, NODE_B]
        continuation = orjson.loads(transport.bodies[1])
        assert continuation["prompt"] == "hello one two" and continuation["max_tokens"] == 1


def _stream_of(text: bytes, *, finish: bool) -> list[bytes]:
    end = b', "finish_reason": "length"' if finish else b""
    event = b'data: {"id": "cmpl-1", "created": 7, "model": "m", "choices": [{"index": 0, "text": "%s"%s}]}\n\n'
    return [event % (text, end), *([b"data: [DONE]\n\n"] if finish else [])]


async def test_a_broken_stream_is_resumed_on_another_node_even_when_the_policy_prefers_the_failed_one() -> None:
    # One user: consistent-hash sends the request and its continuation to the same node, unless told to avoid it.
    broken = Answer(
        headers=list(SSE), chunks=_stream_of(b" one", finish=False), then=UpstreamFailed("node broke off the response")
    )
    fine = Answer(headers=list(SSE), chunks=_stream_of(b" two", finish=True))
    transport = ScriptedTransport({NODE_A: [broken, fine], NODE_B: [broken, fine]})
    body = {**completion(stream=True), "max_tokens": 2, "user": "u1"}
    async with replica(transport, "--policy", "consistent-hash") as url, httpx.AsyncClient(base_url=url) as client:
        answer = await client.post("/v1/completions", json=body)
        assert answer.content.endswith(b"data: [DONE]\n\n") and b'" one"' in answer.content
        assert len(transport.calls) == 2 and transport.calls[0] != transport.calls[1]


async def test_a_node_whose_streams_all_break_after_their_headers_is_ejected() -> None:
    # Headers prove nothing (a wedged engine sends them): a node that breaks every stream must not have its
    # failures reset by each new request's headers.
    broken = Answer(
        headers=list(SSE), chunks=_stream_of(b" one", finish=False), then=UpstreamFailed("node broke off the response")
    )
    fine = Answer(headers=list(SSE), chunks=_stream_of(b" two", finish=True))
    transport = ScriptedTransport({NODE_A: [broken], NODE_B: [fine]})
    flags = ("--policy", "round-robin", "--eject-after", "2", "--eject-backoff", "60")
    async with replica(transport, *flags) as url, httpx.AsyncClient(base_url=url) as client:
        for _ in range(4):
            answer = await client.post("/v1/completions", json={**completion(stream=True), "max_tokens": 2})
            assert answer.content.endswith(b"data: [DONE]\n\n")
        assert transport.calls.count(NODE_A) == 2, transport.calls
        assert (await workers(client))[NODE_A]["ejected"] is True
