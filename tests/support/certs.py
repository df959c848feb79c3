"""Test certificates made by the ``openssl`` command: a CA, and server or client certificates it signs, EC P-256
(fast to make), valid for a day. A server certificate names 127.0.0.1 (and localhost) as its subjectAltName.

    ca = CertAuthority(tmp_path / "ca")
    server = ca.issue("server")                  # .cert, .key (paths), .der (the certificate's bytes)
    client = ca.issue("client", client=True)
    httpx.get(url, verify=ca.client_context())   # trusts this CA; cert= also shows a client certificate
"""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

_KEY_ARGS = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Issued:
    cert: str
    key: str

    @property
    def der(self) -> bytes:
        """The certificate itself, as a TLS peer sees it (``getpeercert(binary_form=True)``)."""
        return ssl.PEM_cert_to_DER_cert(Path(self.cert).read_text())


class CertAuthority:
    """A CA in its own folder; ``pem`` is its certificate, the bundle clients trust."""

    def __init__(self, root: Path, name: str = "test-ca") -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self._key = str(root / "ca.key")
        self.pem = str(root / "ca.pem")
        openssl(
            "req", "-x509", *_KEY_ARGS, "-keyout", self._key, "-out", self.pem, "-days", "1", "-subj", f"/CN={name}"
        )

    def issue(self, name: str, *, client: bool = False, sans: str = "IP:127.0.0.1,DNS:localhost") -> Issued:
        """A certificate and key for ``name`` (files ``name.pem``, ``name.key`` in the CA's folder)."""
        key, csr, cert, ext = (str(self.root / f"{name}.{suffix}") for suffix in ("key", "csr", "pem", "ext"))
        usage = "clientAuth" if client else "serverAuth"
        Path(ext).write_text(f"subjectAltName={sans}\nextendedKeyUsage={usage}\n")
        openssl("req", *_KEY_ARGS, "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
        openssl(
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            self.pem,
            "-CAkey",
            self._key,
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            "1",
            "-extfile",
            ext,
        )
        return Issued(cert=cert, key=key)

    def client_context(self, cert: Issued | None = None) -> ssl.SSLContext:
        """A client context trusting this CA only; with ``cert``, showing that client certificate."""
        context = ssl.create_default_context(cafile=self.pem)
        if cert is not None:
            context.load_cert_chain(cert.cert, cert.key)
        return context
