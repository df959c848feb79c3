"""A stream held open through a replica, for tests of concurrency limits: it holds its slot until released."""

from __future__ import annotations

import threading

import httpx


class HeldStream:
    """A long chat stream for ``model`` through the replica at ``url`` with ``key``, held open (its first chunk
    read) until ``release``; ``status`` once answered (429: refused)."""

    def __init__(self, url: str, key: str, model: str = "sim-model", tokens: int = 4000) -> None:
        self.status: int | None = None
        self.answered = threading.Event()
        self._release = threading.Event()
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(url, key, body))
        self._thread.start()

    def _run(self, url: str, key: str, body: dict[str, object]) -> None:
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=auth) as answer:
                self.status = answer.status_code
                chunks = answer.iter_raw()  # kept: dropping it would close the stream
                if answer.status_code == 200:
                    next(chunks)  # the stream has started: the node is generating for it
                self.answered.set()
                self._release.wait(60)

    def wait(self) -> int:
        """Its status, once answered."""
        assert self.answered.wait(30)
        assert self.status is not None
        return self.status

    def release(self) -> None:
        self._release.set()
        self._thread.join(30)
