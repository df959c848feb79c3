"""A real ``vllm-sim`` process (``python -m sim``) on a free loopback port, for tests of the proxy and registrar.

    node = SimNode(logs_dir, role="prefill", ttft=0.05, max_num_seqs=2)
    node.start()                       # waits until GET /health answers 200
    httpx.post(f"{node.url}/v1/completions", json={"model": "sim-model", "prompt": "hi"})
    node.requests()                    # what the node saw: request ids, kv_transfer_params, cancelled, ...
    node.configure(hang=True)          # change ttft/itl/fail_rate/fail_status/hang/... at runtime
    node.sleep(); node.wake_up()       # vLLM's sleep mode: generation holds meanwhile
    node.kill()                        # SIGKILL, like a crash; node.stop() is a clean SIGTERM

Keyword knobs are the CLI flags with underscores (``max_num_seqs=1``, ``api_key="k"``, ``hang=True``); a
``list``/``tuple`` value repeats the flag (``model=["a", "b"]``, ``lora=["sql", "chat=/loras/chat"]``). See
``python -m vllm_etcd_proxy.sim --help``. ``env`` adds environment variables (``RUNTIME_LORA`` serves the runtime
LoRA routes, as ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`` does in vLLM; ``DEV_MODE`` the sleep-mode and cache
routes, as ``VLLM_SERVER_DEV_MODE=1``).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

from tests.support.procs import HOST, Proc, free_port, http_ok, python_module, wait_until

RUNTIME_LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"}
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}
"""vLLM serves its development routes (sleep mode, cache resets) only with this."""


class SimNode:
    """One simulated vLLM node. ``url`` is ``http://127.0.0.1:PORT``; ``host_port`` is also its node id."""

    def __init__(
        self,
        log_dir: Path,
        name: str | None = None,
        *,
        port: int | None = None,
        env: dict[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
        **knobs: Any,
    ):
        self.tls = tls
        """The node serves HTTPS (its ``ssl_certfile``... knobs given), reached with this client context."""
        self.verify: ssl.SSLContext | bool = tls or True
        self.log_dir = log_dir
        self.env = env
        self.port = port or free_port()
        self.name = name or f"sim-{self.port}"
        self.knobs = knobs
        self.proc: Proc | None = None

    @property
    def host_port(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host_port}"

    def argv(self) -> list[str]:
        args = ["--host", HOST, "--port", str(self.port)]
        for key, value in self.knobs.items():
            flag = "--" + key.replace("_", "-")
            if value is None or value is False:
                continue
            if value is True:
                args.append(flag)
            elif isinstance(value, list | tuple):
                for item in value:
                    args += [flag, str(item)]
            else:
                args += [flag, str(value)]
        return python_module("vllm_etcd_proxy.sim", *args)

    def start(self, timeout: float = 15.0, wait_healthy: bool = True) -> SimNode:
        """Start the process; wait until /health is 200 (or, with ``wait_healthy=False``, until it answers)."""
        proc = self.proc = Proc(self.name, self.argv(), self.log_dir, env=self.env)
        path = "/health" if wait_healthy else "/sim/config"

        def up_or_dead() -> bool:
            return not proc.alive() or http_ok(f"{self.url}{path}", self.verify)

        try:
            wait_until(up_or_dead, timeout, f"{self.name} on {self.url}{path}")
        except TimeoutError:
            log = proc.log()
            self.stop()
            raise TimeoutError(f"{self.name} did not come up in {timeout}s; its log:\n{log}") from None
        if not proc.alive():
            log = proc.log()
            self.stop()
            raise RuntimeError(f"{self.name} exited with {proc.popen.returncode}; its log:\n{log}")
        return self

    def kill(self) -> None:
        """SIGKILL: the node vanishes mid-request, as in a crash."""
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> None:
        """SIGTERM and reap (uvicorn gives open requests a few seconds)."""
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def restart(self, **changes: Any) -> SimNode:
        """Stop, apply knob ``changes``, start again on the same port."""
        self.stop()
        self.knobs.update(changes)
        return self.start()

    def log(self) -> str:
        return self.proc.log() if self.proc is not None else ""

    def __enter__(self) -> SimNode:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the /sim/* control endpoints ----

    def _get(self, path: str) -> Any:
        response = httpx.get(f"{self.url}{path}", timeout=5.0, verify=self.verify)
        response.raise_for_status()
        return response.json()

    def info(self) -> dict[str, Any]:
        """GET /sim/config: node_id, role, engine_id, models and the current knobs."""
        result: dict[str, Any] = self._get("/sim/config")
        return result

    @property
    def engine_id(self) -> str:
        """The NIXL engine id this node puts in remote_engine_id of its prefill responses."""
        return str(self.info()["engine_id"])

    def configure(self, **changes: Any) -> dict[str, Any]:
        """POST /sim/config: ttft, itl, prefill_per_token, output_len, max_num_seqs, fail_rate, fail_status,
        fail_after_tokens, hang, hang_after_tokens, set_cookie, scaling."""
        response = httpx.post(f"{self.url}/sim/config", json=changes, timeout=5.0, verify=self.verify)
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result

    def snapshot(self) -> dict[str, Any]:
        """GET /sim/requests: node_id, role, engine_id, running, waiting, counters (prefix_cache_queries and
        prefix_cache_hits among them), kv_cache (block_size, capacity_blocks, used_blocks, cached_blocks, usage),
        requests."""
        result: dict[str, Any] = self._get("/sim/requests")
        return result

    def requests(self) -> list[dict[str, Any]]:
        """Recent requests, oldest first: id, request_id (the X-Request-Id header), path, query, method,
        content_type, body_sha256, body_length, body_request_id, session_id, cache_salt, priority,
        data_parallel_rank, traceparent, model, stream, state, status, cancelled, prompt_tokens, cached_tokens,
        completion_tokens, max_tokens, kv_transfer_params, prefill, authorization, cookie, upload_sha256,
        upload_size, upload_filename, detail."""
        return list(self.snapshot()["requests"])

    def clear_requests(self) -> None:
        httpx.delete(f"{self.url}/sim/requests", timeout=5.0, verify=self.verify).raise_for_status()

    def wait_for_request(self, timeout: float = 5.0, **match: Any) -> dict[str, Any]:
        """Poll until a recorded request has all the given field values (e.g. ``request_id="r1",
        cancelled=True``) and return it."""
        found: list[dict[str, Any]] = []

        def check() -> bool:
            found[:] = [r for r in self.requests() if all(r.get(k) == v for k, v in match.items())]
            return bool(found)

        wait_until(check, timeout, f"a request matching {match} on {self.name}")
        return found[-1]

    @property
    def ws_url(self) -> str:
        """``ws://127.0.0.1:PORT``, for /v1/realtime."""
        return f"{'wss' if self.tls else 'ws'}://{self.host_port}"

    def sleep(self, level: int = 1, mode: str = "abort") -> dict[str, Any]:
        """POST /sleep (needs ``DEV_MODE``): generation holds until wake_up(); /is_sleeping says so."""
        params: dict[str, Any] = {"level": level, "mode": mode}
        response = httpx.post(f"{self.url}/sleep", params=params, timeout=10.0, verify=self.verify)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def wake_up(self, *tags: str) -> dict[str, Any]:
        """POST /wake_up, all of the node or ``tags`` (``weights``, ``kv_cache``, ``scheduling``)."""
        params = [("tags", tag) for tag in tags]
        response = httpx.post(f"{self.url}/wake_up", params=params, timeout=10.0, verify=self.verify)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def gpu_memory(self) -> int:
        """What the node holds on its (simulated) GPU, from its ``vllm_sim:gpu_memory_used_bytes``."""
        for line in self.metrics().splitlines():
            if line.startswith("vllm_sim:gpu_memory_used_bytes{"):
                return int(float(line.rsplit(" ", 1)[1]))
        raise AssertionError("no vllm_sim:gpu_memory_used_bytes on the node's /metrics")

    def close_websockets(self, code: int = 1000) -> list[str]:
        """Close every open /v1/realtime session from the node's side; returns their session ids."""
        response = httpx.post(f"{self.url}/sim/realtime/close", json={"code": code}, timeout=5.0, verify=self.verify)
        response.raise_for_status()
        return list(response.json()["closed"])

    def metrics(self) -> str:
        response = httpx.get(f"{self.url}/metrics", timeout=5.0, verify=self.verify)
        response.raise_for_status()
        return response.text
