"""A TCP server on loopback that accepts connections and reads requests but never answers: a wedged node.

    hole = Blackhole().start()
    hole.url                       # http://127.0.0.1:PORT, to register as a node
    hole.seen()                    # every HTTP request head it read: method, path, x-request-id, time
    hole.close()                   # drop every connection

Connections stay open until the peer closes them (a client timeout) or ``close()``.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from tests.support.procs import HOST, free_port


@dataclass(frozen=True, kw_only=True)
class SeenRequest:
    method: str
    path: str
    request_id: str | None
    at: float
    """time.monotonic() when the request head was complete."""


class Blackhole:
    def __init__(self) -> None:
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._seen: list[SeenRequest] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()

    @property
    def host_port(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.host_port}"

    def start(self) -> Blackhole:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((HOST, self.port))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, name=f"blackhole-{self.port}", daemon=True).start()
        return self

    def seen(self, method: str | None = None) -> list[SeenRequest]:
        with self._lock:
            return [r for r in self._seen if method is None or r.method == method]

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        buffer = b""
        try:
            while chunk := conn.recv(65536):
                buffer += chunk
                while b"\r\n\r\n" in buffer:
                    head, buffer = buffer.split(b"\r\n\r\n", 1)
                    self._record(head)
                    length = _content_length(head)
                    while len(buffer) < length and (chunk := conn.recv(65536)):
                        buffer += chunk
                    buffer = buffer[length:]
        except OSError:
            pass

    def _record(self, head: bytes) -> None:
        lines = head.decode("latin-1").split("\r\n")
        method, path, *_ = lines[0].split(" ") + ["", ""]
        headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        request_id = next((v.strip() for k, v in headers.items() if k.strip().lower() == "x-request-id"), None)
        with self._lock:
            self._seen.append(SeenRequest(method=method, path=path, request_id=request_id, at=time.monotonic()))


def _content_length(head: bytes) -> int:
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length" and value.strip().isdigit():
            return int(value.strip())
    return 0
