"""``make demo`` (``python -m tests.demo``): a whole fleet on loopback, a few requests through it, then wait.

Starts etcd, 2 prefill + 2 decode simulated vLLM nodes (each run by ``vllm-registrar`` in wrapper mode) and
2 ``vllm-proxy`` replicas that find the nodes through etcd; sends one streamed and one non-streamed chat
completion through each replica, showing which decode node answered and which prefill node's KV it pulled;
prints each replica's ``/status``; then keeps running until Ctrl-C or SIGTERM, and tears everything down.

``DEMO_ONESHOT=1``: tear down right after the requests; exit 0 only if every request succeeded.
Process logs go to ``./demo-logs/``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import httpx

from tests.support.stack import LocalStack, StackNode, StackProxy

MODEL = "sim-model"
SIM_FLAGS = ("--ttft", "0.1", "--itl", "0.04", "--output-len", "16")
"""Slow enough that the streamed tokens visibly trickle in, fast enough for a CI run."""
START_TIMEOUT = 60.0
REQUEST_TIMEOUT = 30.0


class Interrupted(BaseException):
    """SIGINT/SIGTERM arrived. A BaseException, so that retry loops which swallow ``Exception`` let it pass."""


@dataclass
class Outcome:
    what: str
    ok: bool
    detail: str


class Demo:
    def __init__(self, stack: LocalStack) -> None:
        self.stack = stack
        self.by_node_id = {n.node_id: n for n in stack.nodes}
        self.outcomes: list[Outcome] = []

    def describe(self, node_id: str | None, engine_id: str | None) -> tuple[bool, str]:
        """Check the two x-sim-* headers against the stack: a known decode node, KV from a known prefill node."""
        decode: StackNode | None = self.by_node_id.get(node_id or "")
        prefill = next((n for n in self.stack.nodes if n.role == "prefill" and n.engine_id == engine_id), None)
        ok = decode is not None and decode.role == "decode" and prefill is not None
        answered = f"{decode.name} ({node_id})" if decode else f"unknown node {node_id!r}"
        kv_from = f"{prefill.name} (engine {engine_id})" if prefill else f"no known prefill (engine {engine_id!r})"
        return ok, f"answered by {answered}, KV from {kv_from}"

    def body(self, proxy: StackProxy, stream: bool) -> dict[str, object]:
        kind = "streamed" if stream else "non-streamed"
        body: dict[str, object] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Hello from the demo: a {kind} request through {proxy.name}"}],
            "max_tokens": 16,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def streamed(self, client: httpx.Client, proxy: StackProxy) -> Outcome:
        what = f"{proxy.name}: streamed chat completion"
        print(f"\n== {what} ==", flush=True)
        tokens, done, error = 0, False, ""
        url = f"{proxy.url}/v1/chat/completions"
        with client.stream("POST", url, json=self.body(proxy, stream=True)) as response:
            if response.status_code != 200:
                response.read()
                return Outcome(what, False, f"HTTP {response.status_code}: {response.text[:300]}")
            print("   tokens: ", end="", flush=True)
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ").strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = str(event["error"].get("message", event["error"]))
                    break
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or ""
                    if text:
                        tokens += 1
                        print(text, end="", flush=True)
            print(flush=True)
            ok, where = self.describe(response.headers.get("x-sim-node"), response.headers.get("x-sim-prefill-engine"))
        if error or not done or not tokens:
            return Outcome(what, False, error or f"stream ended after {tokens} tokens without [DONE]")
        return Outcome(what, ok, f"{tokens} tokens, {where}")

    def non_streamed(self, client: httpx.Client, proxy: StackProxy) -> Outcome:
        what = f"{proxy.name}: non-streamed chat completion"
        print(f"\n== {what} ==", flush=True)
        response = client.post(f"{proxy.url}/v1/chat/completions", json=self.body(proxy, stream=False))
        if response.status_code != 200:
            return Outcome(what, False, f"HTTP {response.status_code}: {response.text[:300]}")
        content = response.json()["choices"][0]["message"]["content"]
        print(f"   content: {content}", flush=True)
        ok, where = self.describe(response.headers.get("x-sim-node"), response.headers.get("x-sim-prefill-engine"))
        return Outcome(what, ok and bool(content), where)

    def run_requests(self) -> None:
        with httpx.Client(timeout=REQUEST_TIMEOUT) as client:
            for proxy in self.stack.proxies:
                for send in (self.streamed, self.non_streamed):
                    try:
                        outcome = send(client, proxy)
                    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                        outcome = Outcome(f"{proxy.name}: {send.__name__}", False, f"{type(exc).__name__}: {exc}")
                    print(f"   {'ok' if outcome.ok else 'FAILED'}: {outcome.detail}", flush=True)
                    self.outcomes.append(outcome)

    def print_status(self) -> None:
        for proxy in self.stack.proxies:
            print(f"\n== GET {proxy.url}/status ({proxy.name}) ==", flush=True)
            try:
                print(json.dumps(proxy.status(), indent=2), flush=True)
            except (httpx.HTTPError, ValueError) as exc:
                print(f"   failed: {exc}", flush=True)


def print_layout(stack: LocalStack, log_dir: Path) -> None:
    print("\nThe stack is up; every replica routes to every node:", flush=True)
    print(f"  {'etcd':<10} {stack.etcd_endpoint}    keys under /vllm/default/", flush=True)
    for node in stack.nodes:
        print(
            f"  {node.name:<10} {node.url}  {node.role} vllm-sim under vllm-registrar, engine {node.engine_id}",
            flush=True,
        )
    for proxy in stack.proxies:
        print(f"  {proxy.name:<10} {proxy.url}  vllm-proxy --etcd {stack.etcd_endpoint}", flush=True)
    print(f"  {'logs':<10} {log_dir}/", flush=True)


def print_hints(stack: LocalStack) -> None:
    proxy = stack.proxies[0]
    print(
        "\nStill running. Try:\n"
        f"  curl -s {proxy.url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f'       -d \'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}]}}\'\n'
        f"  curl -s {proxy.url}/list_workers\n"
        f"  ETCDCTL_API=3 etcdctl --endpoints={stack.etcd_endpoint} get --prefix /vllm/\n"
        "Ctrl-C stops everything.",
        flush=True,
    )


def main() -> int:
    oneshot = os.environ.get("DEMO_ONESHOT", "").lower() in {"1", "true", "yes", "on"}
    log_dir = Path.cwd() / "demo-logs"
    log_dir.mkdir(exist_ok=True)
    for old in log_dir.glob("*.log"):
        old.unlink()
    work_dir = Path(tempfile.mkdtemp(prefix="vllm-demo-"))
    signalled: list[int] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only the first signal interrupts; a second one must not cut the (bounded) teardown short.
        if not signalled:
            signalled.append(signum)
            raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    stack = LocalStack(work_dir, log_dir, prefill=2, decode=2, replicas=2, model=MODEL, sim_flags=SIM_FLAGS)
    try:
        print(
            f"Starting etcd, 2 prefill + 2 decode simulated nodes under registrars, 2 proxy replicas "
            f"(logs in {log_dir}/) ...",
            flush=True,
        )
        began = time.monotonic()
        stack.start(timeout=START_TIMEOUT)
        demo = Demo(stack)
        print(f"Up in {time.monotonic() - began:.1f}s.", flush=True)
        print_layout(stack, log_dir)
        demo.run_requests()
        demo.print_status()
        failed = [o for o in demo.outcomes if not o.ok]
        if failed:
            print(f"\nDEMO FAILED: {len(failed)} of {len(demo.outcomes)} requests failed:", flush=True)
            for outcome in failed:
                print(f"  {outcome.what}: {outcome.detail}", flush=True)
        else:
            print(f"\nAll {len(demo.outcomes)} requests succeeded.", flush=True)
        if oneshot:
            return 1 if failed else 0
        print_hints(stack)
        while True:
            signal.pause()
    except Interrupted as exc:
        print(f"\n{exc.args[0]}: stopping ...", flush=True)
        return 130 if oneshot else 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"\nDEMO FAILED: {exc}\nSee the logs in {log_dir}/", file=sys.stderr, flush=True)
        return 1
    finally:
        signalled.append(0)
        print("Tearing down: registrars drain and deregister first, then the replicas, then etcd.", flush=True)
        stack.stop()
        shutil.rmtree(work_dir, ignore_errors=True)
        print("Stopped.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
