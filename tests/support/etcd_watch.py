"""Records when keys change in etcd, as seen by ``etcdctl watch``: an independent clock for "within N s of
registering" claims (the proxy's own client is what is under test, so it is not used here).

    with EtcdWatch("http://127.0.0.1:2379", "/vllm/", logs_dir) as watch:
        watch.wait_ready(etcd.etcdctl)
        ...
        put = watch.wait_for("PUT", "/vllm/default/decode/127.0.0.1:8200", timeout=10)
        put.wall                   # time.time() when etcdctl printed the event
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.support.procs import wait_until


@dataclass(frozen=True, kw_only=True)
class WatchEvent:
    type: str
    """PUT or DELETE."""
    key: str
    value: bytes
    revision: int
    wall: float
    """time.time() when the event was read."""
    at: float
    """time.monotonic() when the event was read."""


class EtcdWatch:
    def __init__(self, endpoints: str, prefix: str, log_dir: Path, name: str = "etcd-watch"):
        self._prefix = prefix
        env = {**os.environ, "ETCDCTL_API": "3"}
        self._stderr = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            ["etcdctl", f"--endpoints={endpoints}", "watch", "--prefix", prefix, "-w", "json"],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        self._events: list[WatchEvent] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=name, daemon=True)
        self._reader.start()

    def events(self) -> list[WatchEvent]:
        with self._lock:
            return list(self._events)

    def first(self, type_: str, key: str) -> WatchEvent | None:
        return next((e for e in self.events() if e.type == type_ and e.key == key), None)

    def wait_for(self, type_: str, key: str, timeout: float) -> WatchEvent:
        wait_until(lambda: self.first(type_, key) is not None, timeout, f"etcd {type_} of {key}")
        event = self.first(type_, key)
        assert event is not None
        return event

    def wait_ready(self, etcdctl: Callable[..., str], timeout: float = 10.0) -> None:
        """Until the watch is established: put a marker key under the prefix until it shows up."""
        marker = f"{self._prefix.rstrip('/')}/_watch_ready/{uuid.uuid4().hex[:8]}"
        deadline = time.monotonic() + timeout

        def seen() -> bool:
            return any(e.key == marker for e in self.events())

        while not seen():
            if time.monotonic() > deadline or self._proc.poll() is not None:
                raise TimeoutError(f"etcdctl watch did not start within {timeout}s")
            etcdctl("put", marker, "")
            try:
                wait_until(seen, 0.5, "watch marker")
            except TimeoutError:
                continue
        etcdctl("del", marker)

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)
        self._reader.join(5)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> EtcdWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            wall, at = time.time(), time.monotonic()
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            revision = int(reply.get("Header", {}).get("revision", 0))
            for event in reply.get("Events") or []:
                kv = event.get("kv", {})
                parsed = WatchEvent(
                    type="DELETE" if event.get("type") == 1 else "PUT",
                    key=base64.b64decode(kv.get("key", "")).decode(errors="replace"),
                    value=base64.b64decode(kv.get("value", "")),
                    revision=revision,
                    wall=wall,
                    at=at,
                )
                with self._lock:
                    self._events.append(parsed)
