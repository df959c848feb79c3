"""The fake engine: a FIFO scheduler with --max-num-seqs slots, a prefix cache, timed token generation, request
records, counters.

No HTTP here: app.py turns a request into a ``Job`` (its answer already decided by ``sim.tokens``) and iterates
``Engine.generate(job)``. A generation that is not iterated to its end (client gone, task cancelled) is recorded
as cancelled and frees its slot at once. Time to the first token is ``ttft + uncached prompt tokens *
prefill_per_token``, or one ``itl`` on a decode leg whose KV was pulled from a prefill node; with
--batch-slowdown, each of these waits grows with the sequences running beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter, deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from vllm_etcd_proxy.sim import tokens
from vllm_etcd_proxy.sim.errors import ApiError
from vllm_etcd_proxy.sim.gpu import GIB, Gpu, OutOfMemory, OwnGpu, SharedGpu
from vllm_etcd_proxy.sim.knobs import Knobs
from vllm_etcd_proxy.sim.kvevents import KvEventsConfig, Publisher
from vllm_etcd_proxy.sim.latency import Latencies
from vllm_etcd_proxy.sim.lora import Adapters
from vllm_etcd_proxy.sim.prefix_cache import Lease, PrefixCache
from vllm_etcd_proxy.sim.record import Job, Record
from vllm_etcd_proxy.sim.settings import SimSettings
from vllm_etcd_proxy.sim.sleepmode import SleepMode
from vllm_etcd_proxy.sim.vocab import HfVocab

logger = logging.getLogger(__name__)

MAX_RECORDS = 1000
"""Recent requests kept for GET /sim/requests."""


class Slots:
    """--max-num-seqs as a FIFO: ``acquire`` waits in line; a waiter that is cancelled leaves the line."""

    def __init__(self, limit: int):
        self.limit = limit
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # granted a slot in the same instant we were cancelled: hand it on
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.running -= 1
        self._grant()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.running < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)


def make_gpu(settings: SimSettings) -> Gpu:
    """The node's own device, or the one of ``--gpu`` it shares with the nodes given the same directory."""
    if settings.gpu is None:
        return OwnGpu()
    return SharedGpu(settings.gpu, settings.name, round(settings.gpu_capacity_gib * GIB))


class Engine:
    """State of one simulated node. Built by the app factory; everything else reads it."""

    def __init__(self, settings: SimSettings, rng: random.Random | None = None):
        self.settings = settings
        self.knobs = Knobs.from_settings(settings)
        self.slots = Slots(settings.max_num_seqs)
        self.records: deque[Record] = deque(maxlen=MAX_RECORDS)
        self.counters: Counter[str] = Counter()
        """received, completed, cancelled, failed, rejected; plus prompt_tokens, generation_tokens and the prefix
        cache's prefix_cache_queries and prefix_cache_hits (tokens)."""
        self.finished: Counter[str] = Counter()
        """Finished requests by finish reason (stop, length, abort), for vllm:request_success_total."""
        self.started_at = time.monotonic()
        self.latencies = Latencies()
        """Time to first token, between tokens and end to end of finished generations, for /metrics."""
        self._rng = rng or random.Random()
        self._unhung = asyncio.Event()
        self._knobs_changed = asyncio.Event()
        config = KvEventsConfig.parse(settings.kv_events_config) if settings.kv_events_config else None
        self.kv_events = Publisher(config, self.knobs, settings.block_size) if config is not None else None
        self.cache = PrefixCache(
            block_size=settings.block_size, capacity=settings.cache_blocks, listener=self.kv_events
        )
        self._next_block = 1
        self.hung = 0
        self.encode: tokens.Encoder = HfVocab(settings.tokenizer).encode if settings.tokenizer else tokens.encode
        """Text -> ids: the word tokenizer, or with --tokenizer the Hugging Face one written in that directory."""
        self.adapters = Adapters(settings.loras, dict(settings.lora_bases), settings.max_loras)
        self.loras: dict[str, str] = self.adapters.paths
        """LoRA adapters served now, name -> path: the startup ones plus /v1/load_lora_adapter's."""
        self.gpu = make_gpu(settings)
        sizes = {"weights": round(settings.weights_gib * GIB), "kv_cache": round(settings.kv_cache_gib * GIB)}
        self.sleep_mode = SleepMode(self.gpu, sizes)
        """vLLM's sleep mode (sleepmode.py): generation waits while the scheduler is paused."""
        self.asleep = 0
        """Requests held by sleep mode (a paused scheduler keeps them waiting)."""
        self._abort_epoch = 0
        """Bumped by each aborting sleep: generations that arrived before it end at their next step."""
        self._ended_signal = asyncio.Event()
        """Replaced (after being set) each time a generation ends: a ``wait`` sleep waits on it."""
        self.apply_knobs({})

    def apply_knobs(self, changes: dict[str, Any]) -> None:
        self.knobs.update(changes)
        self.slots.set_limit(self.knobs.max_num_seqs)
        self._signal_knobs()
        if self.knobs.hang:
            self._unhung.clear()
        else:
            self._unhung.set()

    @property
    def served_names(self) -> tuple[str, ...]:
        """Names a request may ask for: the served model names, then the LoRA adapters."""
        return (*self.settings.models, *self.loras)

    def model_name(self, requested: str | None) -> str:
        """The name responses carry: a LoRA adapter's own, else the first served name (vLLM's model_name)."""
        return requested if requested is not None and requested in self.loras else self.settings.served_model

    async def sleep(self, level: int, mode: str = "abort") -> None:
        """vLLM's sleep (sleepmode.py): the scheduler pauses (requests that arrive hold until the wake), then
        ``abort`` ends the generations already in the engine at their next step (finish_reason "abort"), ``wait``
        returns once they finished, ``keep`` freezes them until the wake; level 1 or 2 then frees the GPU memory
        and drops the prefix cache."""
        self.sleep_mode.pause(mode)
        if mode == "abort":
            self._abort_epoch += 1
            self._signal_knobs()
        elif mode == "wait":
            while self.slots.running:
                ended = self._ended_signal
                await ended.wait()
        if level >= 1:
            self.cache.clear()
        self.sleep_mode.offload(level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Wake ``tags`` (None: all), taking --wake-time when memory comes back; True when fully awake. Raises
        ``ApiError`` for --wake-fail and when the GPU has no room (CUDA's out of memory)."""
        if self.sleep_mode.waking(tags):
            await asyncio.sleep(self.knobs.wake_time)
            if self.knobs.wake_fail:
                raise ApiError(self.knobs.wake_fail, "vllm-sim: injected failure waking up")
        try:
            return self.sleep_mode.wake(tags)
        except OutOfMemory as exc:
            raise ApiError(500, str(exc)) from None

    @property
    def is_sleeping(self) -> bool:
        return self.sleep_mode.is_sleeping

    async def until_awake(self, record: Record) -> None:
        """Hold ``record``'s request while the scheduler is paused."""
        if self.sleep_mode.paused:
            state, record.state = record.state, "sleeping"
            self.asleep += 1
            try:
                await self.sleep_mode.until_awake()
            finally:
                self.asleep -= 1
            if state == "running":
                record.state = state

    def _signal_knobs(self) -> None:
        changed, self._knobs_changed = self._knobs_changed, asyncio.Event()
        changed.set()

    def receive(self, record: Record) -> None:
        self.records.append(record)
        self.counters["received"] += 1

    def should_fail(self) -> bool:
        return self.knobs.fail_rate > 0 and self._rng.random() < self.knobs.fail_rate

    def reject(self, record: Record, status: int) -> None:
        record.state, record.status = "rejected", status
        self.counters["rejected"] += 1
        self.log(record)

    def allocate_blocks(self, prompt_tokens: int) -> list[int]:
        """Block ids for a finished prefill, unique on this node like a real KV cache's."""
        count = -(-prompt_tokens // self.settings.block_size)
        blocks = list(range(self._next_block, self._next_block + count))
        self._next_block += count
        return blocks

    async def generate(
        self, job: Job, on_accept: Callable[[], Awaitable[None]] | None = None
    ) -> AsyncGenerator[int, None]:
        """Yield the job's token ids on the simulated schedule, holding a sequence slot meanwhile.

        ``on_accept`` runs once the request is past a --hang (a streamed response sends its headers there);
        a hung request counts as running, like one stuck in a wedged engine.
        """
        record = job.record
        outcome = "cancelled"
        arrived = time.monotonic()
        epoch, aborted = self._abort_epoch, False
        try:
            await self._until_unhung(record)
            await self.until_awake(record)
            if on_accept is not None:
                await on_accept()
            record.state = "waiting"
            async with self._scheduled(job) as lease:
                await self._prefill(job, lease)
                last = time.monotonic()
                self.latencies.ttft.observe(last - arrived)
                for i, token in enumerate(job.tokens):
                    if i:
                        last = await self._token_gap(last)
                    if self._fails_at(i):
                        outcome = "failed"
                        raise ApiError(500, "vllm-sim: injected engine failure during generation")
                    await self._stall(record, i, epoch)
                    if self.sleep_mode.keeps:
                        await self.until_awake(record)  # a ``keep`` sleep: frozen until the wake
                    if self._abort_epoch != epoch:
                        aborted = True
                        break
                    record.completion_tokens += 1
                    lease.tokens += 1
                    self.counters["generation_tokens"] += 1
                    yield token
                outcome = "aborted" if aborted else "done"
                if not aborted:
                    self.latencies.e2e.observe(time.monotonic() - arrived)
        finally:
            self._ended(job, outcome)

    async def _until_unhung(self, record: Record) -> None:
        """Hold ``record``'s request while --hang is on."""
        if not self._unhung.is_set():
            record.state = "hung"
            self.hung += 1
            try:
                await self._unhung.wait()
            finally:
                self.hung -= 1

    @contextlib.asynccontextmanager
    async def _scheduled(self, job: Job) -> AsyncIterator[Lease]:
        """While the body runs: a sequence slot, the job's adapter in a batch slot (swapped in first, which takes
        --lora-swap-time) and the prompt's blocks pinned in the prefix cache (the lease)."""
        swapped = job.adapter is not None and await self.adapters.enter(job.adapter)
        try:
            await self.slots.acquire()
        except BaseException:
            if job.adapter is not None:
                self.adapters.leave(job.adapter)
            raise
        lease = self.cache.admit(job.prompt, job.cache_salt, job.adapter)
        try:
            if swapped:
                await asyncio.sleep(self.knobs.lora_swap_time)
            yield lease
        finally:
            self.cache.release(lease, job.tokens[: job.record.completion_tokens])
            self.slots.release()
            if job.adapter is not None:
                self.adapters.leave(job.adapter)

    async def _prefill(self, job: Job, lease: Lease) -> None:
        """Up to the first token: --ttft plus --prefill-per-token for each prompt token the cache did not hold, or
        one --itl on a decode leg whose KV came from a prefill node."""
        record, knobs = job.record, self.knobs
        record.state, record.cached_tokens = "running", lease.hit_tokens
        self.counters["prefix_cache_queries"] = self.cache.queries
        self.counters["prefix_cache_hits"] = self.cache.hits
        uncached = len(job.prompt) - lease.hit_tokens
        await asyncio.sleep(
            self._batched(knobs.itl if job.kv_loaded else knobs.ttft + uncached * knobs.prefill_per_token)
        )
        self.counters["prompt_tokens"] += record.prompt_tokens

    async def _token_gap(self, last: float) -> float:
        """Wait one --itl after the token sent at ``last``; returns when the next one is due."""
        await asyncio.sleep(self._batched(self.knobs.itl))
        now = time.monotonic()
        self.latencies.itl.observe(now - last)
        return now

    def _fails_at(self, sent: int) -> bool:
        """--fail-after-tokens: the generation fails instead of sending its next token."""
        limit = self.knobs.fail_after_tokens
        return bool(limit) and sent >= limit

    def _ended(self, job: Job, outcome: str) -> None:
        record = job.record
        record.state = outcome
        record.cancelled = outcome == "cancelled"
        self.counters[{"done": "completed"}.get(outcome, outcome)] += 1
        self.finished[job.finish_reason if outcome == "done" else "abort"] += 1
        ended, self._ended_signal = self._ended_signal, asyncio.Event()
        ended.set()

    def _batched(self, seconds: float) -> float:
        """``seconds`` stretched by the other sequences running now (--batch-slowdown)."""
        return seconds * (1.0 + self.knobs.batch_slowdown * max(0, self.slots.running - 1))

    async def _stall(self, record: Record, sent: int, epoch: int) -> None:
        """hang_after_tokens: after that many tokens send nothing more, keeping the connection and the slot,
        until the client leaves, the knob no longer applies or an aborting sleep ends the generation."""
        while (limit := self.knobs.hang_after_tokens) and sent >= limit and self._abort_epoch == epoch:
            record.state = "hung"
            await self._knobs_changed.wait()
        record.state = "running"

    @property
    def waiting(self) -> int:
        """Requests queued for a slot, plus those held by sleep mode."""
        return self.slots.waiting + self.asleep + self.adapters.waiting

    @property
    def running(self) -> int:
        """Requests holding a slot, plus hung ones (a wedged engine reports them as running)."""
        return self.slots.running + self.hung

    def log(self, record: Record) -> None:
        """One line per request; ids and counts only, never the prompt or a key."""
        logger.info(
            "request id=%s request_id=%s path=%s status=%s state=%s prompt_tokens=%d cached_tokens=%d "
            "completion_tokens=%d",
            record.id or "-",
            record.request_id or "-",
            record.path,
            record.status,
            record.state,
            record.prompt_tokens,
            record.cached_tokens,
            record.completion_tokens,
        )

    def snapshot(self) -> dict[str, Any]:
        """GET /sim/requests."""
        return {
            "node_id": self.settings.name,
            "role": str(self.settings.role),
            "engine_id": self.settings.engine_id,
            "running": self.running,
            "waiting": self.waiting,
            "counters": {**self.counters, "lora_swaps": self.adapters.swaps},
            "kv_cache": self.cache.stats(),
            "requests": [r.to_json() for r in self.records],
        }
