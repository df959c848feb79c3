"""Simulated KV-event publishers in a process of their own (``python -m bench.kv_fleet publish``), for tests of a
replica following many nodes: vLLM 0.32's frames and four-frame replay, a probe prefix of its own per node.

    fleet = KvPublishers(logs_dir, 400, block_size=4)   # bound, each with its probe (seq 0) buffered for replay
    fleet.kv_flags()                                     # --kv-events NODE=ENDPOINT,REPLAY for each node
    fleet.ask({"rate": 5})                               # batches a second each; 0 pauses
    fleet.report()                                       # node address -> batches sent, blocks held
    fleet.stop()
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from tests.support.procs import HOST, free_port

ROOT = Path(__file__).resolve().parent.parent.parent


class KvPublishers:
    """``count`` publishers; node ``i``'s address (its id in the replica's pool) is ``addresses[i]``."""

    def __init__(self, log_dir: Path, count: int, *, block_size: int = 4, capacity: int = 1000) -> None:
        self.addresses = [f"{HOST}:{free_port()}" for _ in range(count)]
        self.endpoints = [(free_port(), free_port()) for _ in range(count)]
        spec = {
            "block_size": block_size,
            "capacity": capacity,
            "buffer": 1000,
            "publishers": [{"index": i, "events": e, "replay": r} for i, (e, r) in enumerate(self.endpoints)],
        }
        self._log = open(log_dir / "kv-publishers.log", "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "bench.kv_fleet", "publish", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=ROOT,
        )
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self._in: IO[bytes] = self.popen.stdin
        self._out: IO[bytes] = self.popen.stdout
        self._read()  # bound

    def kv_flags(self) -> list[str]:
        return [
            f"{node}=tcp://{HOST}:{events},tcp://{HOST}:{replay}"
            for node, (events, replay) in zip(self.addresses, self.endpoints, strict=True)
        ]

    def ask(self, message: dict[str, Any]) -> Any:
        self._in.write(json.dumps(message).encode() + b"\n")
        self._in.flush()
        return self._read()

    def report(self) -> dict[str, dict[str, int]]:
        return {self.addresses[p["index"]]: p for p in self.ask({"report": True})}

    def _read(self) -> Any:
        line = self._out.readline()
        if not line:
            raise RuntimeError(f"the publishers exited with {self.popen.wait()}")
        return json.loads(line)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)
        self._in.close()
        self._out.close()
        self._log.close()
