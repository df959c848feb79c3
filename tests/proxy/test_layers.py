"""Each layer of the request path alone (serving/layers.py), around a handler of the test's that stands for the
layers inside it: what the client is answered, whether the request goes on, and what the layer leaves on it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from prometheus_client import CollectorRegistry

from vllm_etcd_proxy.proxy.errors import ClientLeft, NoNodeAvailable
from vllm_etcd_proxy.proxy.serving.guard import ClientKeys, ConcurrencyLimit
from vllm_etcd_proxy.proxy.serving.layers import Accounting, Concurrency, Keys
from vllm_etcd_proxy.proxy.serving.parsing import read_headers
from vllm_etcd_proxy.proxy.serving.request import ProxyRequest, Tally
from vllm_etcd_proxy.proxy.serving.routes import Kind
from vllm_etcd_proxy.proxy.telemetry.metrics import ProxyMetrics

ROUTE = "/v1/completions"


class Client:
    """One request's ASGI side: what it sends (nothing after the headers) and what it was answered."""

    def __init__(self, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.scope = {"type": "http", "method": "POST", "path": ROUTE, "headers": headers or []}
        self.messages: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    def request(self) -> ProxyRequest:
        client = read_headers(self.scope, session_header=b"x-session-id", backend_auth=None)
        return ProxyRequest(
            self.scope, self.receive, self.send, kind=Kind.GENERATE, route=ROUTE, started=0.0, client=client
        )

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    def error(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(b"".join(m.get("body", b"") for m in self.messages[1:]))["error"]
        return body


class Inner:
    """The layers inside: records the requests that reached it and answers 200 once ``release`` is set."""

    def __init__(self) -> None:
        self.seen: list[ProxyRequest] = []
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, request: ProxyRequest) -> None:
        self.seen.append(request)
        await self.release.wait()
        request.status = 200
        await request.send({"type": "http.response.start", "status": 200, "headers": []})
        await request.send_last(b"{}")


async def test_keys_refuse_a_request_without_a_valid_key_and_pass_one_with_its_limits() -> None:
    inner = Inner()
    layer = Keys(inner, ClientKeys(["sk-good"]))
    for headers in ([], [(b"authorization", b"Bearer sk-bad")]):
        client = Client(headers)
        await layer(client.request())
        assert client.status == 401 and client.error()["code"] == "invalid_api_key"
    assert inner.seen == []
    client = Client([(b"authorization", b"Bearer sk-good")])
    request = client.request()
    await layer(request)
    assert client.status == 200 and inner.seen == [request] and request.limits is not None


async def test_the_concurrency_limit_answers_503_past_it_and_frees_its_slot_when_a_request_ends() -> None:
    inner = Inner()
    inner.release.clear()
    layer = Concurrency(inner, ConcurrencyLimit(1))
    first = Client()
    running = asyncio.create_task(layer(first.request()))
    while not inner.seen:
        await asyncio.sleep(0)
    second = Client()
    await layer(second.request())
    assert second.status == 503 and (b"retry-after", b"1") in second.messages[0]["headers"]
    inner.release.set()
    await running
    third = Client()
    await layer(third.request())
    assert (first.status, third.status) == (200, 200) and len(inner.seen) == 2


async def test_accounting_answers_what_no_layer_did_and_counts_every_request_by_its_status() -> None:
    metrics = ProxyMetrics(CollectorRegistry())

    async def no_node(request: ProxyRequest) -> None:
        raise NoNodeAvailable("no node is available for model 'm' right now; retry shortly")

    async def client_left(request: ProxyRequest) -> None:
        await request.refuse(ClientLeft("the client left while queued"))

    for inner in (no_node, client_left):
        client = Client()
        await Accounting(inner, metrics)(client.request())
    metrics.flush()  # what a scrape does first
    assert metrics.requests.labels(ROUTE, "none", "503")._value.get() == 1
    assert metrics.client_disconnects._value.get() == 1


async def test_accounting_records_a_completions_tokens_from_its_usage() -> None:
    metrics = ProxyMetrics(CollectorRegistry())
    usage = orjson.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 3}})

    async def answered(request: ProxyRequest) -> None:
        request.model, request.tally, request.status = "m", Tally(), 200
        request.tally.tail, request.tally.first_at = usage, 0.01

    client = Client()
    request = client.request()
    await Accounting(answered, metrics)(request)
    assert request.usage() == (7, 3)
    metrics.flush()
    assert metrics.requests.labels(ROUTE, "none", "200")._value.get() == 1


class FailsAfterHeaders:
    """The layers inside: the answer's headers (and a first event) go out, then a ``ProxyError`` escapes."""

    def __init__(self, content_type: bytes) -> None:
        self.content_type = content_type

    async def __call__(self, request: ProxyRequest) -> None:
        await request.respond(200, [(b"content-type", self.content_type)])
        await request.send_body(b'data: {"choices": []}\n\n')
        raise NoNodeAvailable("the continuation found no node")


async def test_an_error_after_the_answers_headers_ends_a_stream_with_an_error_event_not_a_second_answer() -> None:
    client = Client()
    await Accounting(FailsAfterHeaders(b"text/event-stream"), ProxyMetrics(CollectorRegistry()))(client.request())
    starts = [m for m in client.messages if m["type"] == "http.response.start"]
    assert len(starts) == 1 and starts[0]["status"] == 200
    last = client.messages[-1]
    assert last["more_body"] is False and b'"error"' in last["body"] and b"no node" in last["body"]


async def test_an_error_after_a_json_answers_headers_leaves_it_unfinished() -> None:
    client = Client()
    await Accounting(FailsAfterHeaders(b"application/json"), ProxyMetrics(CollectorRegistry()))(client.request())
    # One start, and no last message: the server drops the connection, so the client sees a truncated answer.
    assert [m["type"] for m in client.messages] == ["http.response.start", "http.response.body"]
    assert client.messages[-1]["more_body"] is True
