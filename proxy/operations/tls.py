"""The replica's own TLS, with vLLM's flags (``--ssl-certfile``, ``--ssl-keyfile``, ``--ssl-ca-certs``,
``--ssl-cert-reqs``): behind an L4 balancer TLS ends here, on every replica (and every worker of one).

The listener keeps one server context for its whole life; a reload (SIGHUP) loads the new files into that same
context. New handshakes take the new certificate, and connections already open keep the one they started with
(OpenSSL copies a context's certificate into each connection when it begins), so nothing is dropped.

A reload reads each file once into memory and tries the copy on a scratch context first; only a pair that loads
there is loaded into the live one, from the same bytes. A half-written, mismatched or unreadable pair is logged
and the certificate served before is kept: the live context never holds a new certificate with an old key.
A CA bundle can only add CAs on reload (OpenSSL's store only grows): a CA taken out of ``--ssl-ca-certs`` stays
trusted until the replica restarts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass

from vllm_etcd_proxy.fleet.tls import no_password, pair, ssl_reason

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServerTlsSettings:
    """The listener's certificate and what it asks of clients."""

    certfile: str
    """PEM certificate chain (the key too, unless ``keyfile`` is given)."""
    keyfile: str | None
    """PEM private key of ``certfile``."""
    ca_certs: str | None
    """PEM CAs that client certificates must chain to."""
    cert_reqs: ssl.VerifyMode
    """Whether clients must show a certificate: CERT_NONE, CERT_OPTIONAL (checked when shown), CERT_REQUIRED."""


class ServerTls:
    """The listener's one ``SSLContext`` (``context``), and ``reload`` for SIGHUP."""

    def __init__(self, settings: ServerTlsSettings) -> None:
        """Raises ``ValueError`` naming the flag of a file that cannot be used."""
        self._settings = settings
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.verify_mode = settings.cert_reqs
        # HTTP/1.1 only (uvicorn's protocol): a client offering h2 is told so in the handshake.
        self.context.set_alpn_protocols(["http/1.1"])
        try:
            self.context.load_cert_chain(settings.certfile, settings.keyfile, password=no_password)
        except (OSError, ssl.SSLError, ValueError) as exc:
            where = pair("--ssl-certfile", settings.certfile, "--ssl-keyfile", settings.keyfile)
            raise ValueError(f"{where}: {ssl_reason(exc)}") from None
        if settings.ca_certs:
            try:
                self.context.load_verify_locations(settings.ca_certs)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"--ssl-ca-certs {settings.ca_certs}: {ssl_reason(exc)}") from None

    def reload(self) -> bool:
        """Re-read the files into the live context; False (logged, the old certificate kept) when they cannot be
        used."""
        s = self._settings
        try:
            files = [_read(s.certfile)] + ([_read(s.keyfile)] if s.keyfile else [])
            ca_data = _read(s.ca_certs).decode("ascii") if s.ca_certs else None
        except (OSError, UnicodeDecodeError) as exc:
            log.warning("TLS certificate not reloaded error=%s; serving the one loaded before", ssl_reason(exc))
            return False
        with _in_memory(files) as paths:
            cert, key = paths[0], paths[1] if len(paths) > 1 else None
            trial = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            try:
                trial.load_cert_chain(cert, key, password=no_password)
                if ca_data:
                    trial.load_verify_locations(cadata=ca_data)
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.warning(
                    "TLS certificate not reloaded certfile=%s keyfile=%s error=%s; serving the one loaded before",
                    s.certfile,
                    s.keyfile,
                    ssl_reason(exc),
                )
                return False
            self.context.load_cert_chain(cert, key, password=no_password)
            if ca_data:
                self.context.load_verify_locations(cadata=ca_data)
        log.info("TLS certificate reloaded certfile=%s", s.certfile)
        return True


def server_tls(settings: ServerTlsSettings | None) -> ServerTls | None:
    """The listener's TLS, or None for plain HTTP; raises ``ValueError`` as ``ServerTls`` does."""
    return ServerTls(settings) if settings is not None else None


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


@contextlib.contextmanager
def _in_memory(contents: list[bytes]) -> Iterator[list[str]]:
    """Paths OpenSSL can open that hold ``contents``, in anonymous memory (no copy of the key on any disk), so
    the trial and the live load read the very same bytes."""
    fds = []
    try:
        for data in contents:
            fd = os.memfd_create("vllm-proxy-tls", os.MFD_CLOEXEC)
            fds.append(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        yield [f"/proc/self/fd/{fd}" for fd in fds]
    finally:
        for fd in fds:
            os.close(fd)
