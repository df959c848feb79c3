"""The suite runs where nothing but loopback can be reached (tests/loopback_only.py; `make test` uses it)."""

from __future__ import annotations

import errno
import os
import socket
import time

import pytest

from tests.loopback_only import INSIDE, MARKER, only_loopback

inside = pytest.mark.skipif(
    os.environ.get(MARKER) != INSIDE, reason="not run through tests/loopback_only.py: the machine's network is here"
)

# Documentation ranges (RFC 5737, RFC 3849) and a private address: nothing of ours is ever there.
OFF_MACHINE = [
    ("192.0.2.1", 80, socket.AF_INET),
    ("10.0.0.1", 8000, socket.AF_INET),
    ("2001:db8::1", 80, socket.AF_INET6),
]


@inside
def test_only_the_loopback_interface_is_visible() -> None:
    assert only_loopback(), socket.if_nameindex()


@inside
@pytest.mark.parametrize(("host", "port", "family"), OFF_MACHINE)
def test_a_connection_off_the_machine_fails_at_once(host: str, port: int, family: socket.AddressFamily) -> None:
    # Only tried once the interface list proves there is no route: the attempt cannot leave the namespace.
    assert only_loopback()
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        started = time.monotonic()
        with pytest.raises(OSError) as failure:
            sock.connect((host, port))
        assert failure.value.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL)
        assert time.monotonic() - started < 1.0


@inside
def test_loopback_still_works_inside() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with socket.create_connection(listener.getsockname(), timeout=5):
            conn, _ = listener.accept()
            conn.close()
