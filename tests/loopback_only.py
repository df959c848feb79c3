"""Run a command in a network namespace that has only the loopback interface.

    python -m tests.loopback_only pytest -q

Inside, a connection to any address but loopback fails at once (ENETUNREACH) instead of sending a packet, so a
test that would reach another machine fails loudly. As root this is ``unshare --net``; otherwise an unprivileged
user namespace (``unshare --user --map-root-user --net``). Where neither can be made, the command runs with the
machine's network and one line on stderr says so. Installing packages happens before, outside.

The command sees ``VLLM_TEST_NETNS=loopback-only`` inside the namespace (tests/test_loopback_only.py reads it).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import subprocess
import sys

MARKER = "VLLM_TEST_NETNS"
INSIDE = "loopback-only"
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1


def bring_loopback_up() -> None:
    """Set ``lo`` up (a new network namespace starts with it down), as ``ip link set lo up`` does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP))


def only_loopback() -> bool:
    """True when ``lo`` is the only network interface this process can see."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def _unshare_prefixes() -> list[list[str]]:
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    root = [unshare, "--net"]
    user = [unshare, "--user", "--map-root-user", "--net"]
    return [root, user] if os.geteuid() == 0 else [user]


def _run_inside(command: list[str]) -> int:
    bring_loopback_up()
    if not only_loopback():
        print("loopback-only: the namespace has interfaces besides lo; refusing to run", file=sys.stderr)
        return 2
    os.environ[MARKER] = INSIDE
    os.execvp(command[0], command)


def main(argv: list[str]) -> int:
    command = argv[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m tests.loopback_only COMMAND [ARGS...]", file=sys.stderr)
        return 2
    if os.environ.get(MARKER) == INSIDE:  # re-entered inside the namespace
        return _run_inside(command)
    for prefix in _unshare_prefixes():
        if subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
            continue
        env = {**os.environ, MARKER: INSIDE}
        return subprocess.run([*prefix, sys.executable, os.path.abspath(__file__), *command], env=env).returncode
    reason = "unshare not found" if shutil.which("unshare") is None else "no network namespace can be made here"
    print(f"loopback-only: {reason}; the tests run with this machine's network", file=sys.stderr)
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
