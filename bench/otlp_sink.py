"""A do-nothing OTLP/HTTP receiver for benchmarks of a replica with tracing on: reads each POST, answers 200.

.venv/bin/python -m bench.otlp_sink 43181 &       # then --otlp-traces-endpoint http://127.0.0.1:43181
"""

from __future__ import annotations

import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 4318), _Sink).serve_forever()


if __name__ == "__main__":
    main()
