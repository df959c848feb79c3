"""The registrar's errors. etcd errors stay ``fleet.etcd``'s; httpx errors become ``ProbeError`` in probe.py.

::

    RegistrarError
    ├── UsageError        bad flags or environment: one stderr line, exit 2
    ├── StartupError      etcd unreachable at start, command not runnable: one stderr line, exit_code (1)
    └── ProbeError        the node answered badly or not in time
        └── NodeUnreachable   nothing listens at the node's URL (connection refused, DNS failure)
"""

from __future__ import annotations


class RegistrarError(Exception):
    """Base of the registrar's own errors."""


class UsageError(RegistrarError):
    """A flag or environment variable is missing or malformed; the message names it."""

    exit_code = 2


class StartupError(RegistrarError):
    """The registrar cannot start (etcd unreachable, command not found); the message says why."""

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ProbeError(RegistrarError):
    """The node's HTTP API gave no usable answer (timeout, bad status, unparseable body)."""


class NodeUnreachable(ProbeError):
    """Nothing listens at the node's URL: the server is not up yet, or gone."""
