"""etcd with security switched on, for tests: simple auth with short-lived tokens, and TLS with client
certificates made by the ``openssl`` command."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.support.etcd_server import EtcdServer
from tests.support.procs import HOST, Proc, wait_until


class AuthEtcd(EtcdServer):
    """etcd whose simple auth tokens expire after one idle second, so re-authentication is exercised."""

    def argv(self) -> list[str]:
        return [*super().argv(), "--auth-token-ttl", "1"]


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def make_certs(root: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all EC P-256 (fast to make)."""
    key_args = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca_key, ca = str(root / "ca.key"), str(root / "ca.pem")
    openssl("req", "-x509", *key_args, "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=test-ca")
    paths = {"cacert": ca}
    for name, usage in (("server", "serverAuth"), ("client", "clientAuth")):
        key, csr, cert, ext = (str(root / f"{name}.{ext}") for ext in ("key", "csr", "pem", "ext"))
        Path(ext).write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        openssl("req", *key_args, "-keyout", key, "-out", csr, "-subj", f"/CN={name}")
        openssl(
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            "1",
            "-extfile",
            ext,
        )
        paths[f"{name}_cert"], paths[f"{name}_key"] = cert, key
    return paths


class TlsEtcd(EtcdServer):
    """etcd serving https only, requiring a client certificate signed by the test CA."""

    certs: dict[str, str] = {}

    @property
    def endpoint(self) -> str:
        return f"https://{HOST}:{self.client_port}"

    def argv(self) -> list[str]:
        c = self.certs
        return [
            *super().argv(),
            "--cert-file",
            c["server_cert"],
            "--key-file",
            c["server_key"],
            "--trusted-ca-file",
            c["cacert"],
            "--client-cert-auth",
        ]

    def start(self, timeout: float = 20.0) -> None:
        self.proc = Proc(self.name, self.argv(), self.log_dir)
        c = self.certs
        tls = [f"--cacert={c['cacert']}", f"--cert={c['client_cert']}", f"--key={c['client_key']}"]
        wait_until(lambda: self.etcdctl(*tls, "get", "/probe") is not None, timeout, "tls etcd answers")
