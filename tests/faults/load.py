"""A steady mixed load through proxy replicas that records the outcome of every single request.

    with Load([replica_a.url, replica_b.url], clients=6) as load:
        load.wait_for(20)                  # the load is flowing
        ... inject a fault ...
    load.counts()                          # {"total": 812, "ok": 809, "sse_error": 3, ...}
    load.failures()                        # the Outcomes that did not succeed

The load runs on its own event loop in a background thread, so a test can inject faults with blocking calls
(processes, etcdctl, polls) while it goes on. ``clients`` coroutines each send one request at a time, cycling
through ``KINDS`` (streamed or not, disaggregated or mixed model, completions or chat) and the replicas, with
a short pause between requests. Each request carries ``X-Request-Id: {tag}-r{replica}-{seq}``, so what a node
recorded (``GET /sim/requests``) can be traced to the replica that sent it.

Outcomes: ``ok``; ``http_error`` (any status but 200); ``sse_error`` (a stream that ended with an SSE error
event); ``transport_error`` (connection refused/reset, timeout, or a stream that ended without ``[DONE]``);
``bad_response`` (a 200 whose body is not a completion, or a stream that is not one answer: several ``[DONE]``,
events after it, or chunks under different ids); ``disconnected`` (a request this client abandoned on purpose,
see ``spawn(disconnect_after=...)``). Only ``ok`` and ``disconnected`` are successes.

Each outcome keeps the request's body and the ``Answer`` received (text, finish reason, usage), so a scenario
can compare it with what one healthy node answers to the same body: ``expected_answers(...)``. The simulated
model is deterministic, so they must be equal however the proxy got the answer (retried, resumed elsewhere).

Like an L4 balancer with ``option redispatch``, a request whose TCP connect is refused goes to the next
replica (nothing was sent yet); the outcome says so in ``redirected``. ``exclude(url)`` takes a replica out of
the rotation, as an operator drains a server in the balancer before stopping it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from tests.support.procs import wait_until

MODEL = "sim-model"
"""Served by prefill + decode nodes: the proxy runs the disaggregated flow."""
MIXED_MODEL = "mixed-model"
"""Served by mixed nodes only."""

OK = "ok"
HTTP_ERROR = "http_error"
SSE_ERROR = "sse_error"
TRANSPORT_ERROR = "transport_error"
BAD_RESPONSE = "bad_response"
DISCONNECTED = "disconnected"
RESULTS = (OK, HTTP_ERROR, SSE_ERROR, TRANSPORT_ERROR, BAD_RESPONSE, DISCONNECTED)
SUCCESSES = frozenset({OK, DISCONNECTED})


@dataclass(frozen=True, kw_only=True)
class Kind:
    """One shape of request."""

    model: str
    stream: bool
    path: str

    @property
    def name(self) -> str:
        mode = "disagg" if self.model == MODEL else "mixed"
        return f"{mode}/{'stream' if self.stream else 'full'}/{self.path.rsplit('/', 1)[-1]}"


KINDS = (
    Kind(model=MODEL, stream=True, path="/v1/chat/completions"),
    Kind(model=MIXED_MODEL, stream=False, path="/v1/completions"),
    Kind(model=MODEL, stream=False, path="/v1/completions"),
    Kind(model=MIXED_MODEL, stream=True, path="/v1/chat/completions"),
)
DISAGG_STREAM, MIXED_FULL, DISAGG_FULL, MIXED_STREAM = KINDS


@dataclass(frozen=True, kw_only=True)
class Answer:
    """What a client got of a completion: for a deterministic model, the same from every healthy node."""

    text: str
    finish_reason: str | None
    usage: tuple[int, int] | None
    """(prompt_tokens, completion_tokens), when the answer carried usage."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What happened to one request. Times are ``time.monotonic()``; ``wall_*`` are ``time.time()``."""

    request_id: str
    replica: str
    """Base URL of the replica that answered (after a redirect: the one it was redirected to)."""
    kind: str
    stream: bool
    started: float
    ended: float
    wall_started: float
    wall_ended: float
    result: str
    status: int | None
    node: str | None
    """``x-sim-node`` of the answer: the node that generated it (the decode node in the disaggregated flow)."""
    tokens: int
    """Chunks with generated text received (streams), or completion tokens (full answers)."""
    detail: str
    redirected: bool
    path: str
    body: dict[str, Any]
    """The request's JSON body, as sent."""
    answer: Answer | None = None
    """What was received, also of a stream that ended with an error event (its text so far)."""
    dones: int = 0
    """``[DONE]`` events received (a stream)."""
    error_events: int = 0
    """SSE error events received (a stream)."""

    @property
    def succeeded(self) -> bool:
        return self.result in SUCCESSES

    @property
    def duration(self) -> float:
        return self.ended - self.started

    def __str__(self) -> str:
        return (
            f"{self.request_id} {self.kind} via {self.replica} node={self.node} {self.result}"
            f"({self.status}) t={self.started:.3f}+{self.duration:.3f}s {self.detail}"
        )


def summarize(outcomes: Sequence[Outcome]) -> dict[str, int]:
    """Counts by result, plus total, failed and redirected."""
    counter = Counter(o.result for o in outcomes)
    counts = {"total": len(outcomes), **{r: counter.get(r, 0) for r in RESULTS}}
    counts["failed"] = sum(1 for o in outcomes if not o.succeeded)
    counts["redirected"] = sum(1 for o in outcomes if o.redirected)
    return counts


def report(scenario: int, title: str, outcomes: Sequence[Outcome], **extra: object) -> str:
    """Print (and return) one line of counts for the scenario: pytest shows it with -s or -rA."""
    counts = summarize(outcomes)
    span = max((o.ended for o in outcomes), default=0.0) - min((o.started for o in outcomes), default=0.0)
    rate = {"per_s": round(len(outcomes) / span, 1) if span > 0 else 0.0}
    parts = [f"{k}={v}" for k, v in {**counts, **rate, **extra}.items()]
    line = f"scenario {scenario} [{title}]: {' '.join(parts)}"
    print(line)
    return line


def describe(outcomes: Sequence[Outcome], limit: int = 10) -> str:
    """The first ``limit`` outcomes, one per line, for an assertion message."""
    lines = [str(o) for o in outcomes[:limit]]
    if len(outcomes) > limit:
        lines.append(f"... and {len(outcomes) - limit} more")
    return "\n".join(lines)


def _body(kind: Kind, seq: str, max_tokens: int, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": kind.model, "max_tokens": max_tokens, "stream": kind.stream, "ignore_eos": True}
    if kind.stream:
        body["stream_options"] = {"include_usage": True}  # the final usage must count the whole answer
    if kind.path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": f"fault load request {seq}"}]
    else:
        body["prompt"] = f"fault load request {seq}"
    return {**body, **(extra or {})}


class Load:
    """``clients`` concurrent clients sending ``KINDS`` in turn through ``replicas`` until ``stop()``.

    Bounded: no request starts after ``max_seconds`` or once ``max_requests`` were started.
    """

    def __init__(
        self,
        replicas: Sequence[str],
        *,
        clients: int = 6,
        max_tokens: int = 8,
        stream_max_tokens: int | None = None,
        pause: float = 0.02,
        timeout: float = 30.0,
        max_seconds: float = 150.0,
        max_requests: int = 50_000,
        tag: str = "load",
    ) -> None:
        self.replicas = list(replicas)
        self.clients = clients
        self.max_tokens = max_tokens
        self.stream_max_tokens = stream_max_tokens or max_tokens
        self.pause = pause
        self.timeout = timeout
        self.max_seconds = max_seconds
        self.max_requests = max_requests
        self.tag = tag
        self._excluded: set[str] = set()
        self._outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._seq = itertools.count()
        self._started = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    # -- control (from the test's thread) -------------------------------------------------------------------

    def start(self) -> Load:
        self._thread = threading.Thread(target=self._thread_main, name=f"load-{self.tag}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the load generator's event loop did not start")
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Start no more requests; wait for those in flight to finish (their outcomes are recorded)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RuntimeError(f"load clients still running {timeout}s after stop(): a request hangs")
        if self._error is not None:
            raise RuntimeError("the load generator crashed") from self._error

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def exclude(self, replica: str) -> None:
        """Send no new request to ``replica`` (an operator draining it in the balancer)."""
        with self._lock:
            self._excluded.add(replica)

    def outcomes(self) -> list[Outcome]:
        with self._lock:
            return list(self._outcomes)

    def counts(self) -> dict[str, int]:
        return summarize(self.outcomes())

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes() if not o.succeeded]

    def wait_for(self, count: int, timeout: float = 20.0, *, after: float | None = None) -> None:
        """Until ``count`` more requests (that started after monotonic time ``after``, default now) finished."""
        since = time.monotonic() if after is None else after
        wait_until(
            lambda: sum(1 for o in self.outcomes() if o.started >= since) >= count,
            timeout,
            f"{count} requests of the load to finish",
        )

    def spawn(
        self,
        replica: str,
        kind: Kind,
        *,
        max_tokens: int,
        request_id: str,
        disconnect_after: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> concurrent.futures.Future[Outcome]:
        """One extra request on the load's loop (recorded with the others); ``disconnect_after=N`` closes the
        connection after N content chunks, as a client that goes away mid-stream; ``extra`` adds body fields."""
        assert self._loop is not None, "start() first"
        body = _body(kind, request_id, max_tokens, extra)
        coro = self._request(replica, kind, body, request_id, disconnect_after, redirect=False)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # -- the event loop's thread -----------------------------------------------------------------------------

    def _thread_main(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported by stop()
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
        timeout = httpx.Timeout(self.timeout, connect=5.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            self._client = client
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            deadline = time.monotonic() + self.max_seconds
            await asyncio.gather(*(self._client_loop(i, deadline) for i in range(self.clients)))
            # Requests started with spawn() may still run: let them end before the client closes.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            if others:
                await asyncio.wait(others, timeout=self.timeout)

    async def _client_loop(self, index: int, deadline: float) -> None:
        await asyncio.sleep(self.pause * index / max(1, self.clients))  # spread the first requests
        while not self._stopping.is_set() and time.monotonic() < deadline:
            with self._lock:
                if self._started >= self.max_requests:
                    return
                self._started += 1
                seq = next(self._seq)
                active = [r for r in self.replicas if r not in self._excluded] or self.replicas
            kind = KINDS[seq % len(KINDS)]
            replica = active[(seq // len(KINDS)) % len(active)]
            tokens = self.stream_max_tokens if kind.stream else self.max_tokens
            request_id = f"{self.tag}-r{self.replicas.index(replica)}-{seq}"
            await self._request(replica, kind, _body(kind, request_id, tokens, None), request_id, None, redirect=True)
            await asyncio.sleep(self.pause)

    async def _request(
        self,
        replica: str,
        kind: Kind,
        body: dict[str, Any],
        request_id: str,
        disconnect_after: int | None,
        *,
        redirect: bool,
    ) -> Outcome:
        started, wall_started = time.monotonic(), time.time()
        tried = [replica]
        assert self._client is not None
        while True:
            try:
                fields = await _exchange(self._client, replica + kind.path, body, request_id, disconnect_after)
                break
            except httpx.ConnectError as exc:
                with self._lock:
                    others = [r for r in self.replicas if r not in tried and r not in self._excluded]
                if redirect and others:
                    replica = others[0]
                    tried.append(replica)
                    continue
                fields = {"result": TRANSPORT_ERROR, "detail": f"{type(exc).__name__}: {exc}"}
                break
            except httpx.TransportError as exc:
                fields = {"result": TRANSPORT_ERROR, "detail": f"{type(exc).__name__}: {exc}"}
                break
        outcome = Outcome(
            request_id=request_id,
            replica=replica,
            kind=kind.name,
            stream=kind.stream,
            started=started,
            ended=fields.get("left_at", time.monotonic()),
            wall_started=wall_started,
            wall_ended=time.time(),
            status=fields.get("status"),
            node=fields.get("node"),
            tokens=fields.get("tokens", 0),
            result=fields["result"],
            detail=fields.get("detail", ""),
            redirected=len(tried) > 1,
            path=kind.path,
            body=body,
            answer=fields.get("answer"),
            dones=fields.get("dones", 0),
            error_events=fields.get("error_events", 0),
        )
        with self._lock:
            self._outcomes.append(outcome)
        return outcome


async def _exchange(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], request_id: str, disconnect_after: int | None
) -> dict[str, Any]:
    """POST ``body`` to ``url`` and read the answer: the fields of an ``Outcome`` it decides."""
    headers = {"x-request-id": request_id}
    async with client.stream("POST", url, json=body, headers=headers) as response:
        fields: dict[str, Any] = {"status": response.status_code, "node": response.headers.get("x-sim-node")}
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            return {**fields, "result": HTTP_ERROR, "detail": text[:300]}
        if not body.get("stream"):
            return {**fields, **_full_answer(await response.aread())}
        return {**fields, **await _stream_answer(response, disconnect_after)}


def _full_answer(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
        choices = data["choices"]
        usage = data["usage"]
        tokens = int(usage["completion_tokens"])
        choice = choices[0] if choices else {}
        text = choice["message"]["content"] if "message" in choice else choice.get("text")
    except (ValueError, KeyError, TypeError) as exc:
        return {"result": BAD_RESPONSE, "detail": f"{exc!r}: {raw[:200]!r}"}
    if not choices:
        return {"result": BAD_RESPONSE, "detail": f"no choices: {raw[:200]!r}"}
    answer = Answer(
        text=text or "", finish_reason=choice.get("finish_reason"), usage=(int(usage["prompt_tokens"]), tokens)
    )
    return {"result": OK, "tokens": tokens, "answer": answer}


class _StreamReader:
    """Reads an SSE answer line by line: its text, finish reason and usage, and whether it is one answer."""

    def __init__(self) -> None:
        self.tokens = 0
        """Chunks with generated text (not a chat stream's opening role chunk, not a usage chunk)."""
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: tuple[int, int] | None = None
        self.dones = 0
        self.after_done = 0
        self.errors: list[Any] = []
        self.identities: set[tuple[Any, Any, Any]] = set()
        """(id, created, model) of the chunks: one answer has one."""

    def feed(self, line: str) -> str | None:
        """Take one line; returns why the stream is not SSE JSON, if it is not."""
        if not line.startswith("data:"):
            return None
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.dones += 1
            return None
        if self.dones:
            self.after_done += 1
        event = _event(payload)
        if isinstance(event, str):
            return event
        self._take(event)
        return None

    def _take(self, event: dict[str, Any]) -> None:
        if "error" in event:
            self.errors.append(event["error"])
            return
        self.identities.add((event.get("id"), event.get("created"), event.get("model")))
        usage = event.get("usage")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            self.usage = (int(usage.get("prompt_tokens") or 0), int(usage["completion_tokens"]))
        for choice in event.get("choices") or ():
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                self._take_choice(choice)

    def _take_choice(self, choice: dict[str, Any]) -> None:
        piece = choice.get("text") or (choice.get("delta") or {}).get("content")
        if piece:
            self.tokens += 1
            self.text.append(piece)
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def fields(self) -> dict[str, Any]:
        answer = Answer(text="".join(self.text), finish_reason=self.finish_reason, usage=self.usage)
        fields = {"tokens": self.tokens, "answer": answer, "dones": self.dones, "error_events": len(self.errors)}
        if self.errors:
            return {**fields, "result": SSE_ERROR, "detail": json.dumps(self.errors)[:300]}
        if not self.dones:
            return {**fields, "result": TRANSPORT_ERROR, "detail": "stream ended without [DONE]"}
        if self.dones > 1 or self.after_done:
            return {**fields, "result": BAD_RESPONSE, "detail": f"{self.dones} [DONE], {self.after_done} events after"}
        if len(self.identities) > 1:
            return {**fields, "result": BAD_RESPONSE, "detail": f"chunks of several answers: {self.identities}"}
        if self.tokens == 0:
            return {**fields, "result": BAD_RESPONSE, "detail": "stream without a content chunk"}
        return {**fields, "result": OK}


def _event(payload: str) -> dict[str, Any] | str:
    """The event of one ``data:`` line, or why it is not a JSON object."""
    try:
        event = json.loads(payload)
    except ValueError:
        return f"not JSON: {payload[:200]}"
    if not isinstance(event, dict):
        return f"not an object: {payload[:200]}"
    return event


async def _stream_answer(response: httpx.Response, disconnect_after: int | None) -> dict[str, Any]:
    reader = _StreamReader()
    async for line in response.aiter_lines():
        bad = reader.feed(line)
        if bad is not None:
            return {"result": BAD_RESPONSE, "tokens": reader.tokens, "detail": bad}
        if disconnect_after is not None and reader.tokens >= disconnect_after:
            return {
                "result": DISCONNECTED,
                "tokens": reader.tokens,
                "left_at": time.monotonic(),
                "detail": "left mid-stream",
            }
    return reader.fields()


def expected_answers(requests: Iterable[tuple[str, Outcome]], timeout: float = 60.0) -> dict[str, Answer]:
    """What one healthy node answers to each request: ``(node URL, outcome)`` pairs, the outcome's body sent
    straight to the node (all at once). Keyed by the outcome's request id; fails if a node does not answer."""
    pairs = list(requests)

    async def ask_all() -> list[dict[str, Any]]:
        limits = httpx.Limits(max_connections=len(pairs) + 1)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            return await asyncio.gather(
                *(_exchange(client, url + o.path, o.body, f"oracle-{o.request_id}", None) for url, o in pairs)
            )

    answers: dict[str, Answer] = {}
    for (url, outcome), fields in zip(pairs, asyncio.run(ask_all()), strict=True):
        if fields["result"] != OK:
            raise AssertionError(f"{url} did not answer {outcome.request_id}'s body: {fields}")
        answers[outcome.request_id] = fields["answer"]
    return answers
