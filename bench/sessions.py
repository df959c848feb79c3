"""Multi-turn chat sessions against OpenAI-compatible endpoints, with one record per request.

``sessions`` sessions, ``concurrency`` of them running at once, each of ``turns`` turns. Every turn sends
``/v1/chat/completions`` with ``stream: true`` and usage, carrying the whole conversation so far: the shared
system preamble (the same text in every session, as an application's prompt is), the session's own first user
message, then for each earlier turn the assistant's answer as received and a new user message. With
``api="completions"`` the same conversation is one text prompt sent to ``/v1/completions``: the preamble, then
``"\nUser: <message>\nAssistant:"`` and the answer as received, turn after turn. A ``Target``
decides where each request goes, ``(session, turn) -> Route``, so the same sessions can go straight to nodes
(``pinned``, ``round_robin``) or through one or several proxy replicas (``round_robin`` over them).

Each session has its own ``httpx.AsyncClient``, as separate chat users have their own connections. This also
keeps the generator cheap: httpcore's pool scans all of its connections on every request (bench/README.md).
All clients share one SSL context, which is never used on plain http but which httpx otherwise builds per
client, loading the CA bundle: about 33 ms of CPU each, during which the loop stalls every other session.

    workload = Workload(sessions=64, concurrency=16, turns=6)
    run = run_sync(workload, pinned(node_urls))          # or: await run_sessions(workload, target)
    run.turns  # one Turn per request: session, turn, url, status, error, ttft, latency, tokens, node
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import random
import ssl
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import orjson

from bench.procs import own_cpu_seconds
from vllm_etcd_proxy.sim.tokens import encode

T = TypeVar("T")
PATH = "/v1/chat/completions"
PATHS = {"chat": PATH, "completions": "/v1/completions", "token-ids": "/v1/completions"}
"""The endpoint of each ``Workload.api``."""
REQUEST_ID_HEADER = "X-Request-Id"
NODE_HEADER = "x-sim-node"
"""The response header naming the vllm-sim node that answered; the proxy passes it through."""
_WORDS = (
    "the proxy routes each request to a node that serves the model and streams tokens back as they come "
    "while sessions keep their history so every turn repeats what was said before with a little more added "
    "cache prefix latency budget replica balance queue window context summary question answer detail example"
).split()


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where one request goes: a base URL (``http://host:port``) and extra request headers."""

    url: str
    headers: Mapping[str, str] = field(default_factory=dict)


Target = Callable[[int, int], Route]
"""(session id, turn index) -> Route. Called once per request, just before it is sent."""


def pinned(urls: Sequence[str]) -> Target:
    """Session ``s`` always goes to ``urls[s % len(urls)]``: what a client-side balancer with perfect session
    affinity does (session ids are consecutive integers, so the sessions spread evenly)."""
    routes = [Route(url=u) for u in urls]
    return lambda session, turn: routes[session % len(routes)]


def round_robin(urls: Sequence[str]) -> Target:
    """Each request to the next URL in turn, whatever its session: spraying over nodes, or alternating
    between proxy replicas."""
    routes = [Route(url=u) for u in urls]
    counter = itertools.count()
    return lambda session, turn: routes[next(counter) % len(routes)]


def with_session_header(target: Target, name: str = "X-Session-ID") -> Target:
    """``target`` plus a header carrying the session id, for a proxy that routes by session affinity."""

    def route(session: int, turn: int) -> Route:
        base = target(session, turn)
        return Route(url=base.url, headers={**base.headers, name: str(session)})

    return route


def request_id(tag: str, session: int, turn: int) -> str:
    """The X-Request-Id ``with_request_ids`` sends: unique per (tag, session, turn), parsed by ``parse_request_id``."""
    return f"{tag}-s{session}-t{turn}"


def parse_request_id(text: str) -> tuple[str, int, int] | None:
    """(tag, session, turn) of an id made by ``request_id``, else None. A node may see it with a suffix of its
    own (a proxy's retry), which is ignored."""
    tag, sep, rest = text.rpartition("-s")
    session, sep2, turn = rest.partition("-t")
    digits = "".join(itertools.takewhile(str.isdigit, turn))
    if not (sep and sep2 and session.isdigit() and digits):
        return None
    return tag, int(session), int(digits)


def with_request_ids(target: Target, tag: str) -> Target:
    """``target`` plus an X-Request-Id unique to each turn, so that what a node records (GET /sim/requests) can
    be traced back to its session; ``tag`` tells runs apart."""

    def route(session: int, turn: int) -> Route:
        base = target(session, turn)
        return Route(url=base.url, headers={**base.headers, REQUEST_ID_HEADER: request_id(tag, session, turn)})

    return route


@dataclass(frozen=True, kw_only=True)
class Workload:
    """The shape of one batch of sessions; the text is deterministic for a given ``seed``."""

    sessions: int = 64
    concurrency: int = 16
    """Sessions running at once; a new session starts when one ends."""
    turns: int = 6
    first_session: int = 0
    """Session ids are first_session .. first_session + sessions - 1 (a warm-up uses ids of its own)."""
    model: str = "sim-model"
    max_tokens: int = 32
    """Per turn: the answer's length, if the node does not stop earlier."""
    system_words: int = 200
    """Words of the system preamble shared by all sessions; 0 sends no system message."""
    first_words: int = 50
    """Words of each session's first user message, unique per session."""
    followup_words: int = 15
    """Words of each later user message."""
    think: float = 0.0
    """Seconds a session waits between an answer and its next turn."""
    think_jitter: float = 0.0
    """Seconds added to each wait, uniform in [0, think_jitter), drawn per (session, turn) from ``seed``. With a
    fixed wait, sessions that start together keep running in step, which a router can mistake for affinity."""
    api: str = "chat"
    """chat (messages to /v1/chat/completions) or completions (one text prompt to /v1/completions)."""
    ramp: float = 0.0
    """Seconds over which the first ``concurrency`` sessions start, evenly spaced. With 0 they all send at the
    same instant, and, as every turn of the simulator lasts as long, they stay in step: each turn is then a
    burst of ``concurrency`` requests queued in the generator's loop. One turn's duration spreads them out."""
    timeout: float = 60.0
    """Seconds for connecting and between two reads of one request; beyond that the request fails."""
    seed: int = 0


@dataclass(kw_only=True)
class Turn:
    """One request as the client saw it. Times are seconds; ``sent`` is time.perf_counter() at sending."""

    session: int
    turn: int
    url: str
    sent: float
    status: int | None = None
    """HTTP status; None when no response came (connection refused, timeout before the headers)."""
    error: str | None = None
    """Why the request counts as failed; None for a complete 200 stream."""
    ttft: float | None = None
    """To the first SSE event carrying non-empty content (the opening role-only event does not count)."""
    latency: float | None = None
    """To the end of the stream."""
    tokens: int = 0
    """Events carrying content: one per token for vLLM and vllm-sim."""
    usage_tokens: int | None = None
    """completion_tokens of the final usage event."""
    node: str | None = None
    """The x-sim-node response header: which node answered."""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(kw_only=True)
class Run:
    """Everything one ``run_sessions`` call measured."""

    workload: Workload
    turns: list[Turn] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    """perf_counter() when the first session started and when the last one ended."""
    generator_cpu: float = 0.0
    """CPU seconds this process spent meanwhile (the load generator's own cost)."""
    loop_lag: list[float] = field(default_factory=list)
    """How late a periodic timer woke up, in seconds: time the generator's loop was too busy to read."""

    @property
    def wall(self) -> float:
        return max(self.ended - self.started, 1e-9)

    @property
    def ok(self) -> list[Turn]:
        return [t for t in self.turns if t.ok]

    @property
    def failed(self) -> list[Turn]:
        return [t for t in self.turns if not t.ok]

    def turns_per_session(self) -> Counter[int]:
        """Successful turns by session id (a session stops at its first failed turn)."""
        return Counter(t.session for t in self.turns if t.ok)

    def by_node(self) -> Counter[str]:
        """Successful requests by the node that answered."""
        return Counter(t.node or "?" for t in self.turns if t.ok)

    def errors(self) -> Counter[str]:
        return Counter(t.error for t in self.turns if t.error is not None)


class BadAnswer(Exception):
    """A response that is not a complete, successful stream."""


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def system_preamble(workload: Workload) -> str:
    return _words(random.Random(f"system:{workload.seed}"), workload.system_words)


def user_message(workload: Workload, session: int, turn: int) -> str:
    """Turn 0's message starts with the session's own tag, so no two sessions share a prefix beyond the
    system preamble."""
    count = workload.first_words if turn == 0 else workload.followup_words
    text = _words(random.Random(f"user:{workload.seed}:{session}:{turn}"), count)
    if turn:
        return text
    tag = hashlib.blake2b(f"{workload.seed}:{session}".encode(), digest_size=4).hexdigest()
    return f"session {tag}: {text}"


def think_time(workload: Workload, session: int, turn: int) -> float:
    """Seconds session ``session`` waits before sending turn ``turn``."""
    jitter = workload.think_jitter * random.Random(f"think:{workload.seed}:{session}:{turn}").random()
    return workload.think + jitter


class _Conversation:
    """A session's prompt so far, as chat messages or as one completion text."""

    def __init__(self, workload: Workload, session: int) -> None:
        if workload.api not in PATHS:
            raise ValueError(f"api must be one of {', '.join(PATHS)}, not {workload.api!r}")
        self._workload = workload
        self._session = session
        self.messages: list[dict[str, str]] = []
        self.text = system_preamble(workload) if workload.system_words else ""
        if workload.system_words:
            self.messages.append({"role": "system", "content": self.text})
        self._ask(0)

    def _ask(self, turn: int) -> None:
        message = user_message(self._workload, self._session, turn)
        self.messages.append({"role": "user", "content": message})
        self.text += f"\nUser: {message}\nAssistant:"

    def body(self) -> bytes:
        w = self._workload
        prompt: dict[str, Any] = {"messages": self.messages} if w.api == "chat" else {"prompt": self.text}
        if w.api == "token-ids":  # the same text as the simulator's tokenizer reads it: its cache sees alike
            prompt = {"prompt": encode(self.text)}
        return orjson.dumps(
            {
                "model": w.model,
                **prompt,
                "max_tokens": w.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )

    def answered(self, answer: str, next_turn: int) -> None:
        self.messages.append({"role": "assistant", "content": answer})
        self.text += answer  # streamed text starts with its space, as vLLM's does
        self._ask(next_turn)


async def _stream(client: httpx.AsyncClient, route: Route, path: str, body: bytes, record: Turn) -> str:
    """Sends one turn and reads its SSE answer into ``record``; returns the answer's text."""
    headers = {"content-type": "application/json", **route.headers}
    answer = _Answer(record)
    async with client.stream("POST", route.url + path, content=body, headers=headers) as response:
        record.status = response.status_code
        record.node = response.headers.get(NODE_HEADER)
        if response.status_code != 200:
            text = (await response.aread())[:200].decode(errors="replace")
            raise BadAnswer(f"status {response.status_code}: {text}")
        async for chunk in response.aiter_raw():
            # The time before parsing: the parser's cost is not the server's delay.
            answer.feed(chunk, time.perf_counter())
        record.latency = time.perf_counter() - record.sent
    return answer.text()


class _Answer:
    """One turn's SSE answer as its chunks arrive: the text so far, and what its ``record`` learns (TTFT, usage)."""

    def __init__(self, record: Turn) -> None:
        self._record = record
        self._parts: list[str] = []
        self._done = False
        self._buffer = b""

    def feed(self, chunk: bytes, now: float) -> None:
        """Take a chunk that arrived at ``now``; raises ``BadAnswer`` for an error event."""
        self._buffer += chunk
        if b"\n\n" not in self._buffer:
            return
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        if not event.startswith(b"data: "):
            return  # an SSE comment or keep-alive
        data = event[6:]
        if data == b"[DONE]":
            self._done = True
            return
        obj = orjson.loads(data)
        if "error" in obj:
            raise BadAnswer(f"error event: {str(obj['error'])[:160]}")
        for choice in obj.get("choices") or ():
            # A chat chunk's delta, or a completion chunk's text.
            content = (choice.get("delta") or {}).get("content") or choice.get("text")
            if content:
                if not self._parts:
                    self._record.ttft = now - self._record.sent
                self._parts.append(content)
        if obj.get("usage"):
            self._record.usage_tokens = obj["usage"].get("completion_tokens")

    def text(self) -> str:
        """The whole answer's text once the stream ended; ``BadAnswer`` when it was not one whole answer."""
        record = self._record
        record.tokens = len(self._parts)
        if not self._done:
            raise BadAnswer("stream ended without [DONE]")
        if not self._parts:
            raise BadAnswer("no content in the stream")
        if record.usage_tokens is None:
            raise BadAnswer("no usage event although stream_options.include_usage was set")
        if record.usage_tokens != record.tokens:
            raise BadAnswer(f"{record.tokens} content events but usage says {record.usage_tokens} tokens")
        return "".join(self._parts)


async def _session(session: int, workload: Workload, target: Target, ssl_context: ssl.SSLContext, run: Run) -> None:
    conversation = _Conversation(workload, session)
    path = PATHS[workload.api]
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=4, keepalive_expiry=300)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(workload.timeout), verify=ssl_context) as client:
        for turn in range(workload.turns):
            if turn and (workload.think or workload.think_jitter):
                await asyncio.sleep(think_time(workload, session, turn))
            route = target(session, turn)
            body = conversation.body()
            record = Turn(session=session, turn=turn, url=route.url, sent=time.perf_counter())
            run.turns.append(record)
            try:
                answer = await _stream(client, route, path, body, record)
            except Exception as exc:  # noqa: BLE001 - whatever went wrong, this turn failed; record why
                record.error = f"{type(exc).__name__}: {exc}"[:200]
                return  # the conversation cannot go on without the answer
            conversation.answered(answer, turn + 1)


async def _probe_lag(samples: list[float], interval: float) -> None:
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(interval)
        samples.append(time.perf_counter() - t0 - interval)


async def run_sessions(workload: Workload, target: Target, lag_interval: float = 0.01) -> Run:
    """Run every session of ``workload``; never raises for a failed request (see ``Turn.error``).
    ``lag_interval`` > 0 samples the loop's lag meanwhile (a timer every that many seconds)."""
    run = Run(workload=workload)
    ssl_context = ssl.create_default_context()
    pending: Iterator[int] = iter(range(workload.first_session, workload.first_session + workload.sessions))

    async def worker(index: int) -> None:
        if index and workload.ramp:
            await asyncio.sleep(index * workload.ramp / workload.concurrency)
        for session in pending:  # shared: each worker takes the next session not yet started
            await _session(session, workload, target, ssl_context, run)

    probe = asyncio.create_task(_probe_lag(run.loop_lag, lag_interval)) if lag_interval > 0 else None
    cpu0 = own_cpu_seconds()
    run.started = time.perf_counter()
    try:
        await asyncio.gather(*(worker(i) for i in range(min(workload.concurrency, workload.sessions))))
    finally:
        run.ended = time.perf_counter()
        run.generator_cpu = own_cpu_seconds() - cpu0
        if probe is not None:
            probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probe
    return run


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop when installed (the proxy and the nodes run on it too), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run_sync(workload: Workload, target: Target) -> Run:
    """``run_sessions`` in a fresh event loop, for callers that are not async."""
    return run_loop(run_sessions(workload, target))
