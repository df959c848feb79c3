"""TLS flags that cannot work are refused at start with one line naming the flag (exit 2), before anything
listens: a missing file, a key that is not the certificate's, client certificates asked for with no CA to check
them against."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support.certs import CertAuthority
from tests.support.registrar_proc import run_registrar
from vllm_etcd_proxy.proxy.cli import parse_settings

NODE = ["--mixed", "127.0.0.1:9"]


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertAuthority:
    assert shutil.which("openssl"), "openssl makes the test certificates (.ci/run installs it)"
    return CertAuthority(tmp_path_factory.mktemp("ca"))


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as stopped:
        parse_settings([*NODE, *argv])
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_a_replica_with_a_certificate_and_its_key_is_accepted(ca: CertAuthority) -> None:
    served = ca.issue("flags-ok")
    settings = parse_settings([*NODE, "--ssl-certfile", served.cert, "--ssl-keyfile", served.key])
    assert settings.tls is not None and settings.tls.certfile == served.cert
    assert parse_settings(NODE).tls is None


def test_tls_flags_that_cannot_work_are_refused_naming_the_flag(
    ca: CertAuthority, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    served, other = ca.issue("flags-served"), ca.issue("flags-other")
    missing = str(tmp_path / "missing.pem")
    cases = {
        "--ssl-keyfile needs --ssl-certfile": ["--ssl-keyfile", served.key],
        "--ssl-cert-reqs needs --ssl-certfile": ["--ssl-cert-reqs", "2"],
        "needs --ssl-ca-certs": ["--ssl-certfile", served.cert, "--ssl-keyfile", served.key, "--ssl-cert-reqs", "2"],
        "--ssl-certfile": ["--ssl-certfile", missing, "--ssl-keyfile", served.key],
        "KEY_VALUES_MISMATCH": ["--ssl-certfile", served.cert, "--ssl-keyfile", other.key],
        "--ssl-ca-certs": ["--ssl-certfile", served.cert, "--ssl-keyfile", served.key, "--ssl-ca-certs", missing],
        "--node-ca-bundle": ["--node-ca-bundle", missing],
        "--node-key needs --node-cert": ["--node-key", served.key],
    }
    for said, argv in cases.items():
        assert said in refused(argv, capsys), argv
    assert "invalid choice" in refused(["--ssl-cert-reqs", "3"], capsys)


def test_the_registrar_refuses_a_node_ca_bundle_it_cannot_read(tmp_path: Path) -> None:
    done = run_registrar(
        "--etcd",
        "127.0.0.1:9",
        "--role",
        "decode",
        "--url",
        "https://127.0.0.1:9",
        "--node-ca-bundle",
        str(tmp_path / "missing.pem"),
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "--node-ca-bundle" in done.stderr and "No such file or directory" in done.stderr, done.stderr
