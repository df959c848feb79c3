"""TLS to the nodes, alike in vllm-proxy and vllm-registrar: the CAs a node's ``https://`` certificate is checked
against (the system's, or ``--node-ca-bundle``), and the client certificate shown to nodes that ask for one (vLLM
started with ``--ssl-cert-reqs 2``).

A process builds one client context and shares it: every connection to every node, the request path's and the
probes' alike. Node URLs usually carry an IP address, so a node's certificate needs it as a subjectAltName.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

TLS_HINT = "check --node-ca-bundle (and --node-cert/--node-key for nodes that require client certificates)"
"""Said with every TLS failure to a node, the flags that fix most of them."""


@dataclass(frozen=True, kw_only=True)
class NodeTlsSettings:
    """How this process checks and answers the TLS of ``https://`` nodes; every field None: the system's CAs."""

    ca_bundle: str | None = None
    """PEM file of the CAs that signed the nodes' certificates, instead of the system's."""
    cert: str | None = None
    """PEM client certificate for nodes that require one."""
    key: str | None = None
    """PEM private key of ``cert`` (None: in ``cert``'s own file)."""

    def context(self) -> ssl.SSLContext:
        """The client context; raises ``ValueError`` naming the flag of a file that cannot be used."""
        try:
            context = ssl.create_default_context(cafile=self.ca_bundle)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--node-ca-bundle {self.ca_bundle}: {ssl_reason(exc)}") from None
        if self.key and not self.cert:
            raise ValueError("--node-key needs --node-cert")
        if self.cert:
            try:
                context.load_cert_chain(self.cert, self.key, password=no_password)
            except (OSError, ssl.SSLError, ValueError) as exc:
                where = pair("--node-cert", self.cert, "--node-key", self.key)
                raise ValueError(f"{where}: {ssl_reason(exc)}") from None
        context.set_alpn_protocols(["http/1.1"])
        return context


def no_password() -> str:
    """``load_cert_chain``'s password callback: without one OpenSSL asks for an encrypted key's passphrase on the
    terminal, and a server would hang there."""
    raise ValueError("the private key is encrypted; give an unencrypted key file (readable by this user only)")


_REASONS = {
    "KEY_VALUES_MISMATCH": "the key is not the certificate's: ",
    "NO_START_LINE": "not a PEM file: ",
    "CERTIFICATE_VERIFY_FAILED": "the peer's certificate does not chain to a trusted CA: ",
}


def pair(cert_flag: str, cert: str, key_flag: str, key: str | None) -> str:
    """How an error names a certificate and its key: the flags as given."""
    return f"{cert_flag} {cert}" + (f" / {key_flag} {key}" if key else "")


def ssl_reason(exc: BaseException) -> str:
    """An OSError's or SSLError's text, without the errno tuple around it."""
    if isinstance(exc, ssl.SSLError) and exc.reason:
        said = _REASONS.get(exc.reason, "")
        return f"{said}{exc.reason} ({exc.library or 'ssl'})"
    return str(getattr(exc, "strerror", None) or exc)


def is_tls_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a TLS handshake or certificate failure."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
