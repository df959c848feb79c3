"""The wrapped command's supervisor: the command dies with its registrar, whatever kills the registrar.

In wrapper mode the registrar does not run the command itself but
``python -m vllm_etcd_proxy.registrar.supervisor --parent PID --grace S -- COMMAND ARGS...``, as the leader of a new
process group (so a terminal's Ctrl-C still reaches the registrar alone). The supervisor asks Linux for a signal
when its parent dies (``PR_SET_PDEATHSIG``), starts the command in its group, forwards the signals it gets to the
command, and exits with the command's code (128+N for death by signal N). When the registrar dies instead (SIGKILL,
the OOM killer), it sends SIGTERM to the whole group (vLLM and the engine-core processes it started), waits
``--grace`` seconds (the registrar's ``--drain-timeout``), then SIGKILLs the group, itself included: nobody is left
to report to.

Why a process of ours rather than PDEATHSIG on the command: the death signal reaches only the direct child, and
once the registrar is dead nobody would be left to send the SIGKILL after the grace. The death signal is only a
wake-up: the parent counts as dead when ``getppid()`` stops naming it, checked right after arming (the registrar may
have died before) and on every signal. The kernel sends the death signal whenever the *thread* we are attached to
exits (we then move to another thread of the registrar, or to init once it has none) and keeps it armed, so a
false alarm costs one check. Idle, the supervisor sleeps in ``sigwaitinfo``: no timer, no poll. It imports the
standard library and errors.py only, to start fast. Linux only (prctl, real-time signals), as is vLLM.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import NoReturn

from vllm_etcd_proxy.registrar.errors import UsageError

logger = logging.getLogger(__name__)

PROG = "vllm-registrar"
"""Our error lines look like the registrar's: to the user this is one program."""
PR_SET_PDEATHSIG = 1
"""From <linux/prctl.h>."""
_LIBC = ctypes.CDLL(None, use_errno=True)
DEATH_SIGNAL = signal.SIGRTMIN
"""What the kernel sends us when a thread of the registrar exits: one that nobody sends or forwards. A dying
registrar's threads end one by one, and each may send it while ``getppid()`` still names the registrar."""
FORWARDED = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2})
"""Signals passed on to the command while the registrar lives."""
WATCHED = FORWARDED | {signal.SIGCHLD, DEATH_SIGNAL}
"""Blocked for good and taken with sigwaitinfo: no handler runs, no signal is lost between two waits."""


def command_line(command: Sequence[str], *, parent: int, grace: float) -> list[str]:
    """How the registrar (pid ``parent``) runs ``command`` under a supervisor."""
    return [sys.executable, "-m", __name__, "--parent", str(parent), "--grace", repr(grace), "--", *command]


def _parse(argv: Sequence[str]) -> tuple[int, float, list[str]]:
    argv = list(argv)
    if "--" not in argv or argv.index("--") != 4 or argv[0] != "--parent" or argv[2] != "--grace":
        raise UsageError("usage: --parent PID --grace SECONDS -- COMMAND ARGS...")
    command = argv[5:]
    if not command:
        raise UsageError("'--' must be followed by a command")
    try:
        parent, grace = int(argv[1]), float(argv[3])
    except ValueError:
        raise UsageError(f"--parent must be a pid and --grace seconds, not {argv[1]!r} and {argv[3]!r}") from None
    if parent <= 0 or not grace >= 0:
        raise UsageError(f"--parent must be a pid and --grace 0 or more, not {parent} and {grace}")
    return parent, grace, command


def _set_death_signal(sig: int) -> None:
    """Ask Linux for ``sig`` when our parent (thread) exits."""
    if _LIBC.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))


def _in_command(supervisor: int) -> None:
    """Runs in the forked command before exec: our blocked signals are not its business. Should this supervisor
    itself be SIGKILLed, the command gets SIGTERM (it may still stop its own children) instead of running on."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WATCHED)
    _set_death_signal(signal.SIGTERM)
    if os.getppid() != supervisor:  # we died between the fork and the line above
        os._exit(1)


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _start(command: list[str]) -> subprocess.Popen[bytes]:
    try:
        supervisor = os.getpid()
        return subprocess.Popen(command, preexec_fn=lambda: _in_command(supervisor))
    except OSError as exc:
        print(f"{PROG}: error: cannot run {command[0]!r}: {exc.strerror or exc}", file=sys.stderr, flush=True)
        raise SystemExit(127 if isinstance(exc, FileNotFoundError) else 126) from None


def _supervise(child: subprocess.Popen[bytes], parent: int, grace: float) -> int:
    """Forward signals to the command until it exits; return its code. Stop the group if the registrar dies."""
    while True:
        signo = signal.sigwaitinfo(WATCHED).si_signo
        if child.poll() is not None:
            return _exit_code(child.returncode)
        if os.getppid() != parent:
            _stop_group(child, parent, grace)
        if signo in FORWARDED:
            child.send_signal(signo)


def _stop_group(child: subprocess.Popen[bytes], parent: int, grace: float) -> NoReturn:
    """The registrar is gone: SIGTERM to the whole group, SIGKILL to what is left after ``grace`` s."""
    group = os.getpgrp()
    logger.warning(
        "registrar pid=%d is gone: SIGTERM to the command's process group pgid=%d, SIGKILL after %.1fs",
        parent,
        group,
        grace,
    )
    os.killpg(group, signal.SIGTERM)  # ours stays blocked and pending: harmless
    deadline = time.monotonic() + grace
    while child.poll() is None:
        left = deadline - time.monotonic()
        if left <= 0:
            logger.warning("command pid=%d still running %.1fs after SIGTERM: SIGKILL pgid=%d", child.pid, grace, group)
            break
        signal.sigtimedwait({signal.SIGCHLD}, left)
    else:
        logger.info("command pid=%d exited code=%d after its registrar died", child.pid, _exit_code(child.returncode))
    # Whatever the command left in its group (engine cores), this process included.
    os.killpg(group, signal.SIGKILL)
    os._exit(128 + signal.SIGKILL)  # not reached: the signal above ends us on the way out of the call


def run(argv: Sequence[str]) -> int:
    """Supervise the command ``argv`` names; return the exit code (the command's, 128+N for signal N)."""
    parent, grace, command = _parse(argv)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # an inherited SIG_IGN would reap the command behind our back
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)  # the group we stop must be ours alone, never the terminal's or the registrar's
    _set_death_signal(DEATH_SIGNAL)
    if os.getppid() != parent:
        logger.warning("registrar pid=%d died before the command started: not starting it", parent)
        return 1
    return _supervise(_start(command), parent, grace)


def main(argv: Sequence[str] | None = None) -> int:
    # Our own process, so our own logging, in the registrar's format (we share its stderr).
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except UsageError as exc:
        print(f"{PROG}: supervisor: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    # Run this module as imported under its own name, so that log lines name it (not "__main__").
    from vllm_etcd_proxy.registrar.supervisor import main as supervised_main

    code = supervised_main()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: the registrar learns the command's code some 10 ms sooner
