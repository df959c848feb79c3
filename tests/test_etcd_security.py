"""The registrar and the proxy through a TLS etcd with client certificates and through etcd's user/password
authentication: they work, and a wrong CA, a wrong password or a missing permission is one clear error."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Reaper
from tests.support.procs import free_port
from tests.support.proxy_proc import ProxyProc
from tests.support.registrar_proc import Registrar, run_registrar
from tests.support.secure_etcd import AuthEtcd, TlsEtcd, make_certs
from tests.support.sim_node import SimNode

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
def auth_etcd(tmp_path: Path, logs_dir: Path) -> Iterator[AuthEtcd]:
    server = AuthEtcd(tmp_path / "auth-data", logs_dir, name="auth-etcd")
    try:
        server.start()
        for command in (
            ["user", "add", "root:rootpw"],
            ["role", "add", "fleet-writer"],
            ["role", "grant-permission", "fleet-writer", "readwrite", "/vllm/", "--prefix=true"],
            ["role", "add", "fleet-reader"],
            ["role", "grant-permission", "fleet-reader", "read", "/vllm/", "--prefix=true"],
            ["user", "add", "registrar:regpw"],
            ["user", "grant-role", "registrar", "fleet-writer"],
            ["user", "add", "proxy:proxypw"],
            ["user", "grant-role", "proxy", "fleet-reader"],
            ["user", "add", "nobody:nopw"],
            ["auth", "enable"],
        ):
            server.etcdctl(*command)
        yield server
    finally:
        server.stop()


def proxy_exits(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a proxy that is expected to refuse to start."""
    argv = [sys.executable, "-m", "vllm_etcd_proxy.proxy", "--host", "127.0.0.1", "--port", str(free_port()), *args]
    full_env = {"PATH": "/usr/bin:/bin", **(env or {})}
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=full_env)


def error_lines(stderr: str, program: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"{program}: error:")]


def test_registrar_and_proxy_work_through_tls_with_client_certificates(
    tls_etcd: TlsEtcd, logs_dir: Path, reap: Reaper
) -> None:
    c = tls_etcd.certs
    tls = ("--etcd-cacert", c["cacert"], "--etcd-cert", c["client_cert"], "--etcd-key", c["client_key"])
    node = reap(SimNode(logs_dir, "node", role="mixed").start())
    reap(Registrar(tls_etcd, node.url, logs_dir, *tls, role="mixed"))  # type: ignore[arg-type]
    replica = reap(ProxyProc(logs_dir, "--etcd", tls_etcd.endpoint, *tls))
    replica.wait_routable("mixed", node.host_port)
    assert replica.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_wrong_ca_is_one_clear_error_for_both(tls_etcd: TlsEtcd, tmp_path: Path) -> None:
    (tmp_path / "other").mkdir()
    other = make_certs(tmp_path / "other")
    c = tls_etcd.certs
    tls = ["--etcd-cacert", other["cacert"], "--etcd-cert", c["client_cert"], "--etcd-key", c["client_key"]]
    done = proxy_exits("--etcd", tls_etcd.endpoint, *tls, "--etcd-timeout", "2")
    assert done.returncode == 1
    [line] = error_lines(done.stderr, "vllm-proxy")
    assert "TLS" in line and "CERTIFICATE_VERIFY_FAILED" in line
    reg = run_registrar(
        "--etcd", tls_etcd.endpoint, "--role", "decode", "--url", "http://127.0.0.1:9", *tls, "--etcd-timeout", "2"
    )
    assert reg.returncode == 1
    [line] = error_lines(reg.stderr, "vllm-registrar")
    assert "CERTIFICATE_VERIFY_FAILED" in line or "TLS" in line


def test_registrar_and_proxy_work_with_user_and_password_from_env_and_file(
    auth_etcd: AuthEtcd, logs_dir: Path, tmp_path: Path, reap: Reaper
) -> None:
    node = reap(SimNode(logs_dir, "node", role="mixed").start())
    reap(
        Registrar(
            auth_etcd,
            node.url,
            logs_dir,
            "--etcd-user",
            "registrar",
            role="mixed",  # type: ignore[arg-type]
            env={"VLLM_REGISTRAR_ETCD_PASSWORD": "regpw"},
        )
    )
    password_file = tmp_path / "proxy-password"
    password_file.write_text("proxypw\n")
    replica = reap(
        ProxyProc(
            logs_dir, "--etcd", auth_etcd.endpoint, "--etcd-user", "proxy", "--etcd-password-file", str(password_file)
        )
    )
    replica.wait_routable("mixed", node.host_port)
    assert replica.post("/v1/chat/completions", json=CHAT).status_code == 200
    for log in logs_dir.glob("*.log"):
        assert "regpw" not in log.read_text() and "proxypw" not in log.read_text()


def test_wrong_password_and_missing_permission_are_one_clear_error(auth_etcd: AuthEtcd) -> None:
    for user, password, expect in (("proxy", "wrong", "refused"), ("nobody", "nopw", "permission")):
        done = proxy_exits(
            "--etcd", auth_etcd.endpoint, "--etcd-user", user, env={"VLLM_PROXY_ETCD_PASSWORD": password}
        )
        assert done.returncode == 1, done.stderr
        [line] = error_lines(done.stderr, "vllm-proxy")
        assert expect in line and password not in line
        reg = run_registrar(
            "--etcd",
            auth_etcd.endpoint,
            "--role",
            "decode",
            "--url",
            "http://127.0.0.1:9",
            "--etcd-user",
            user,
            "--etcd-password",
            password,
        )
        assert reg.returncode == 1, reg.stderr
        [line] = error_lines(reg.stderr, "vllm-registrar")
        assert password not in line
