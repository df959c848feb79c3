"""vllm-registrar in front of a node served over ``https://`` that requires a client certificate: its probes go
over TLS with ``--node-ca-bundle`` and ``--node-cert``; without them the node is never registered, and the log
says which flags to check."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.certs import CertAuthority, Issued
from tests.support.etcd_server import EtcdServer
from tests.support.registrar_proc import Registrar, read_key, wait_for_key
from tests.support.sim_node import SimNode


@pytest.fixture
def ca(tmp_path: Path) -> CertAuthority:
    assert shutil.which("openssl"), "openssl makes the test certificates (.ci/run installs it)"
    return CertAuthority(tmp_path / "ca")


@pytest.fixture
def client_cert(ca: CertAuthority) -> Issued:
    return ca.issue("registrar-client", client=True)


@pytest.fixture
def node(logs_dir: Path, ca: CertAuthority, client_cert: Issued) -> Iterator[SimNode]:
    served = ca.issue("https-node")
    with SimNode(
        logs_dir,
        "https-node",
        role="decode",
        model=["tls-model"],
        ssl_certfile=served.cert,
        ssl_keyfile=served.key,
        ssl_ca_certs=ca.pem,
        ssl_cert_reqs=2,
        tls=ca.client_context(client_cert),
    ) as sim:
        yield sim


def test_an_https_node_is_registered_with_its_url_and_models_probed_over_tls(
    etcd: EtcdServer, logs_dir: Path, ca: CertAuthority, client_cert: Issued, node: SimNode
) -> None:
    tls = ["--node-ca-bundle", ca.pem, "--node-cert", client_cert.cert, "--node-key", client_cert.key]
    registrar = Registrar(etcd, node.url, logs_dir, *tls)
    try:
        entry = wait_for_key(etcd, f"/vllm/default/decode/{node.host_port}", status="serving")
        assert entry.record["url"] == node.url and entry.record["models"] == ["tls-model"]
    finally:
        assert registrar.stop() == 0


def test_without_the_ca_bundle_an_https_node_is_not_registered_and_the_log_names_the_flag(
    etcd: EtcdServer, logs_dir: Path, node: SimNode
) -> None:
    registrar = Registrar(etcd, node.url, logs_dir, name="registrar-untrusted")
    try:
        registrar.wait_for_log("--node-ca-bundle")
        assert "CERTIFICATE_VERIFY_FAILED" in registrar.log()
        assert read_key(etcd, f"/vllm/default/decode/{node.host_port}") is None
    finally:
        registrar.stop()
