"""A real ``vllm-proxy`` process on a free loopback port."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

from tests.support.procs import HOST, Proc, free_port, http_ok, python_module, wait_until


class ProxyProc:
    """``python -m proxy`` with the given flags; ``.url`` is its base URL. ``admin_key`` sets ADMIN_API_KEY.
    ``tls``: the replica serves HTTPS (its ``--ssl-*`` flags are in ``args``), reached with this client context."""

    def __init__(
        self,
        log_dir: Path,
        *args: str,
        name: str = "proxy",
        admin_key: str | None = None,
        env: dict[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
    ):
        self.tls = tls
        self.verify: ssl.SSLContext | bool = tls or True
        self.port = free_port()
        full_env = dict(env or {})
        if admin_key:
            full_env["ADMIN_API_KEY"] = admin_key
        argv = python_module("vllm_etcd_proxy.proxy", "--host", HOST, "--port", str(self.port), *args)
        self.proc = Proc(name, argv, log_dir, env=full_env)
        try:
            wait_until(lambda: http_ok(f"{self.url}/health", self.verify), 20, f"{name} /health")
        except BaseException:
            self.proc.stop()
            raise

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.port}"

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, verify=self.verify, **kwargs)

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        return httpx.post(self.url + path, timeout=30, verify=self.verify, **kwargs)

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = self.get("/status").json()
        return body

    def workers(self) -> list[dict[str, Any]]:
        body: list[dict[str, Any]] = self.get("/list_workers").json()["workers"]
        return body

    def wait_routable(self, role: str, node_id: str, timeout: float = 15) -> None:
        """Until ``node_id`` of ``role`` is known with its models and not ejected."""

        def ready() -> bool:
            return any(
                w["role"] == role
                and w["id"] == node_id
                and w["models_known"]
                and not w["ejected"]
                and w["status"] == "serving"
                for w in self.workers()
            )

        wait_until(ready, timeout, f"{role} node {node_id} routable on {self.proc.name}")

    def wait_gone(self, role: str, node_id: str, timeout: float = 15) -> None:
        wait_until(
            lambda: not any(w["role"] == role and w["id"] == node_id for w in self.workers()),
            timeout,
            f"{role} node {node_id} gone from {self.proc.name}",
        )

    def stop(self) -> int | None:
        return self.proc.stop()
