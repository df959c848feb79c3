"""docker-compose.yml, checked without a Docker engine: its structure, its wiring (registrar URLs, ports, etcd
endpoints, the HAProxy backends), and every command line of our three programs through their real parsers.

``docker-compose config`` and ``haproxy -c`` add their own checks where those binaries exist.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.support.certs import CertAuthority
from vllm_etcd_proxy.proxy.flags import build_parser as proxy_parser
from vllm_etcd_proxy.proxy.flags import settings_from_args as proxy_settings
from vllm_etcd_proxy.proxy.operations.tls import ServerTls
from vllm_etcd_proxy.registrar.cli import parse_command_line as registrar_command_line
from vllm_etcd_proxy.registrar.errors import UsageError
from vllm_etcd_proxy.sim.cli import parse_settings as sim_settings

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
HAPROXY_CFG = REPO / "docker" / "haproxy.cfg"
HAPROXY_TLS_CFG = REPO / "docker" / "haproxy-tls.cfg"
MAKE_CERTS = REPO / "docker" / "tls" / "make-certs.sh"
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERFILE_VLLM = REPO / "docker" / "Dockerfile.vllm"

ETCD_URL = "http://etcd:2379"
NIXL_KV_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
OUR_ENV_PREFIXES = ("VLLM_PROXY_", "VLLM_REGISTRAR_", "VLLM_SIM_", "ADMIN_API_KEY")

_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``$$``), recursively."""
    if isinstance(value, str):

        def sub(match: re.Match[str]) -> str:
            if match.group(0) == "$$":
                return "$"
            name, op, default = match.group("name", "op", "default")
            found = env.get(name)
            if op == ":-" and not found:
                return default
            if op == "-" and found is None:
                return default
            return found or ""

        return _VAR.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict), "docker-compose.yml is not a mapping"
    result: dict[str, Any] = interpolate(doc, env or {})
    return result


COMPOSE_DOC = load_compose()
SERVICES: dict[str, dict[str, Any]] = COMPOSE_DOC["services"]


def argv_of(service: dict[str, Any]) -> list[str]:
    """What the container runs: entrypoint + command, as exec-form lists (a string is split like a shell)."""
    parts: list[str] = []
    for key in ("entrypoint", "command"):
        value = service.get(key) or []
        parts += shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    return parts


def split_wrapper(argv: list[str]) -> tuple[list[str], list[str]]:
    """``vllm-registrar FLAGS -- COMMAND`` -> (registrar argv, child argv)."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def flag(argv: list[str], name: str) -> str | None:
    """The value of ``--name V`` or ``--name=V`` (the last one wins, as in argparse)."""
    found = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith(name + "="):
            found = arg.split("=", 1)[1]
    return found


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def profiles(service: dict[str, Any]) -> list[str]:
    return list(service.get("profiles") or [])


def programs(argv: list[str]) -> list[str]:
    registrar, child = split_wrapper(argv)
    return [Path(registrar[0]).name if registrar else "", Path(child[0]).name if child else ""]


def node_services(profile: str | None) -> dict[str, dict[str, Any]]:
    """Services that run a registrar in wrapper mode, in the default set (None) or in ``profile``."""
    return {
        name: s
        for name, s in SERVICES.items()
        if programs(argv_of(s))[0] == "vllm-registrar" and (profile in profiles(s) if profile else not profiles(s))
    }


def proxy_services(profile: str | None = None) -> dict[str, dict[str, Any]]:
    """Services that run vllm-proxy, in the default set (None) or in ``profile``."""
    return {
        name: s
        for name, s in SERVICES.items()
        if programs(argv_of(s))[0] == "vllm-proxy" and (profile in profiles(s) if profile else not profiles(s))
    }


def one_shot(name: str) -> bool:
    """A service that runs to completion before others start (they wait for service_completed_successfully)."""
    for service in SERVICES.values():
        deps = service.get("depends_on") or {}
        if isinstance(deps, dict) and (deps.get(name) or {}).get("condition") == "service_completed_successfully":
            return True
    return False


@pytest.fixture
def service_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Our programs read VLLM_* variables: start from none of them, then set one service's ``environment``."""
    for key in list(os.environ):
        if key.startswith(OUR_ENV_PREFIXES):
            monkeypatch.delenv(key)

    def apply(service: dict[str, Any]) -> dict[str, str]:
        env = env_of(service)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return env

    return apply


# ---- structure ----


def test_default_stack_has_etcd_haproxy_two_proxies_and_two_simulated_nodes_per_role() -> None:
    assert {"etcd", "haproxy"} <= SERVICES.keys()
    default = [name for name, s in SERVICES.items() if not profiles(s)]
    assert "etcd" in default and "haproxy" in default
    assert len(proxy_services()) == 2
    roles = [flag(split_wrapper(argv_of(s))[0], "--role") or "" for s in node_services(None).values()]
    assert sorted(roles) == ["decode", "decode", "prefill", "prefill"]
    assert all(programs(argv_of(s))[1] == "vllm-sim" for s in node_services(None).values())


def test_real_vllm_nodes_only_in_the_vllm_profile() -> None:
    real = {name: s for name, s in SERVICES.items() if "vllm" in argv_of(s) and "serve" in argv_of(s)}
    assert real, "no `vllm serve` service"
    for name, service in real.items():
        assert profiles(service) == ["vllm"], f"{name} must be in profile vllm only"
    assert all(not profiles(s) for s in SERVICES.values() if "vllm-sim" in argv_of(s))
    roles = sorted(flag(split_wrapper(argv_of(s))[0], "--role") or "" for s in node_services("vllm").values())
    assert roles == ["decode", "prefill"]


def test_references_between_services_volumes_and_files_exist() -> None:
    volumes = set((COMPOSE_DOC.get("volumes") or {}).keys())
    for name, service in SERVICES.items():
        deps = service.get("depends_on") or []
        for dep in deps if isinstance(deps, list) else deps.keys():
            assert dep in SERVICES, f"{name} depends_on unknown service {dep}"
            assert profiles(SERVICES[dep]) in ([], profiles(service)), f"{name} depends on {dep} from another profile"
        mode = service.get("network_mode", "")
        if mode.startswith("service:"):
            assert mode.removeprefix("service:") in SERVICES, f"{name}: network_mode {mode}"
        for volume in service.get("volumes") or []:
            source = (volume.split(":")[0] if isinstance(volume, str) else volume.get("source", "")) or ""
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in volumes, f"{name} uses undeclared volume {source}"
        build = service.get("build")
        if build:
            context = REPO / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), f"{name}: build context {context}"
            if isinstance(build, dict) and "dockerfile" in build:
                assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']} missing"
        assert "image" in service or "build" in service, f"{name} has neither image nor build"


def test_every_long_running_service_restarts_and_nodes_drain_before_docker_kills_them() -> None:
    for name, service in SERVICES.items():
        assert service.get("restart") in {"unless-stopped", "always", "on-failure"}, f"{name}: restart policy"
        balancer = str(service.get("image", "")).startswith("haproxy:")
        assert "healthcheck" in service or balancer or one_shot(name), f"{name}: no healthcheck"
    for name, service in {**node_services(None), **node_services("vllm")}.items():
        drain = float(flag(split_wrapper(argv_of(service))[0], "--drain-timeout") or 30)
        grace = service.get("stop_grace_period", "10s")
        assert grace.endswith("s") and float(grace[:-1]) > drain, f"{name}: stop_grace_period <= --drain-timeout"


def test_published_ports_are_valid_and_unique_and_haproxy_is_the_only_entry_point() -> None:
    seen: dict[int, str] = {}
    for name, service in SERVICES.items():
        for port in service.get("ports") or []:
            parts = str(port).split(":")
            assert 2 <= len(parts) <= 3, f"{name}: port {port!r} must be [IP:]HOST:CONTAINER"
            host, container = int(parts[-2]), int(parts[-1].split("/")[0])
            assert 0 < host < 65536 and 0 < container < 65536, f"{name}: {port}"
            assert host not in seen, f"host port {host} published by {seen.get(host)} and {name}"
            seen[host] = name
            if profiles(service) == ["observe"]:
                assert parts[0] == "127.0.0.1", f"{name}: an operator's tool is published on loopback only"
    assert seen.get(8000) == "haproxy"
    default = {n for n in seen.values() if not profiles(SERVICES[n])}
    assert default == {"haproxy"}, "only the balancer is published by the default stack"


# ---- command lines through our real parsers ----


def _registrar(argv: list[str]) -> Any:
    try:
        settings, _ = registrar_command_line(argv[1:])
    except UsageError as exc:
        pytest.fail(f"vllm-registrar rejects {shlex.join(argv)}: {exc}")
    return settings


def _sim(argv: list[str], env: dict[str, str]) -> Any:
    try:
        return sim_settings(argv[1:], env)
    except SystemExit:
        pytest.fail(f"vllm-sim rejects {shlex.join(argv)}")


def _proxy(argv: list[str]) -> Any:
    try:
        args = proxy_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"vllm-proxy rejects {shlex.join(argv)}")
    assert args.etcd, f"{shlex.join(argv)}: a compose replica finds its nodes in etcd"
    return proxy_settings(args)


@pytest.mark.parametrize("name", sorted(n for n, s in SERVICES.items() if "vllm-" in " ".join(argv_of(s))))
def test_command_line_is_accepted_by_our_parsers(name: str, service_env: Any) -> None:
    service = SERVICES[name]
    env = service_env(service)
    argv = argv_of(service)
    registrar, child = split_wrapper(argv)
    program = Path(registrar[0]).name
    assert program in {"vllm-proxy", "vllm-registrar"}, f"{name} runs {program}"
    if program == "vllm-proxy":
        settings = _proxy(argv)
        assert settings.etcd is not None and settings.etcd.endpoints == (ETCD_URL,)
        return
    settings = _registrar(argv)
    assert child, f"{name}: the registrar runs its node in wrapper mode (-- COMMAND)"
    assert tuple(child) == settings.command
    if Path(child[0]).name == "vllm-sim":
        _sim(child, {k: v for k, v in env.items() if k.startswith("VLLM_SIM_")})
    else:
        assert child[:2] == ["vllm", "serve"], f"{name}: the child is vllm-sim or `vllm serve`"


# ---- wiring ----


@pytest.mark.parametrize("name", sorted([*node_services(None), *node_services("vllm")]))
def test_registrar_url_points_at_its_own_node(name: str, service_env: Any) -> None:
    service = SERVICES[name]
    service_env(service)
    registrar, child = split_wrapper(argv_of(service))
    settings = _registrar(registrar)
    url = urlsplit(settings.url)
    assert url.hostname in {name, service.get("hostname")}, f"{name}: --url {settings.url} is another host"
    assert str(url.port) == flag(child, "--port"), f"{name}: --url port is not the node's --port"
    assert flag(child, "--host") == "0.0.0.0", f"{name}: the node must listen on the compose network"
    assert settings.etcd.endpoints == (ETCD_URL,)
    if child[0] == "vllm-sim":
        sim = _sim(child, {})
        assert sim.role == settings.role.value
        assert sim.name == settings.node_id, f"{name}: x-sim-node should name the node as its etcd key does"
    else:
        config = json.loads(flag(child, "--kv-transfer-config") or "null")
        assert config == NIXL_KV_CONFIG
        assert env_of(service).get("VLLM_NIXL_SIDE_CHANNEL_HOST") == name


def test_etcd_advertises_the_url_everyone_uses_and_takes_flags_etcd_knows() -> None:
    argv = argv_of(SERVICES["etcd"])
    assert flag(argv, "--advertise-client-urls") == ETCD_URL
    assert flag(argv, "--data-dir") in {v.split(":")[1] for v in SERVICES["etcd"]["volumes"]}
    if shutil.which("etcd") is None:  # make test installs it; keep the other checks without it
        return
    known = subprocess.run(["etcd", "--help"], capture_output=True, text=True, timeout=30)
    help_text = known.stdout + known.stderr
    for arg in argv[1:]:
        name = arg.split("=", 1)[0]
        assert re.search(rf"^\s*{re.escape(name)}\b", help_text, re.M), f"etcd does not know {name}"


def _haproxy_sections(path: Path = HAPROXY_CFG) -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not raw[0].isspace():
            current = line.strip()
            sections[current] = []
        else:
            sections[current].append(" ".join(line.split()))
    return sections


def test_haproxy_balances_tcp_over_both_replicas_checking_ready() -> None:
    mount = next(v for v in SERVICES["haproxy"]["volumes"] if "haproxy.cfg" in v)
    assert mount.split(":")[0] == "./docker/haproxy.cfg"
    assert mount.split(":")[1] == "/usr/local/etc/haproxy/haproxy.cfg"
    sections = _haproxy_sections()
    assert "mode tcp" in sections["defaults"]
    frontend = sections["frontend openai"]
    assert "bind :8000" in frontend
    backend_name = next(line.split()[1] for line in frontend if line.startswith("default_backend"))
    backend = sections[f"backend {backend_name}"]
    assert not any(line.startswith("mode http") for line in backend)
    assert "option httpchk" in backend
    assert any(line.startswith("http-check send meth GET uri /ready") for line in backend)
    servers = {line.split()[1]: line.split()[2] for line in backend if line.startswith("server ")}
    expected = {}
    for name, service in proxy_services().items():
        args = proxy_parser().parse_args(argv_of(service)[1:])
        expected[name] = f"{name}:{args.port}"
    assert servers == expected


# ---- profile tls: TLS passes through the balancer and ends on the replicas ----


def _volume_mount(service: dict[str, Any], volume: str) -> str:
    """Where ``service`` mounts the named ``volume``."""
    for entry in service.get("volumes") or []:
        source, inside = entry.split(":")[:2]
        if source == volume:
            return str(inside)
    raise AssertionError(f"the volume {volume} is not mounted")


def test_the_tls_profile_has_tls_replicas_behind_a_tcp_balancer_checking_ready_over_tls() -> None:
    assert {name for name, s in SERVICES.items() if "tls" in profiles(s)} == {
        "tls-certs",
        "haproxy-tls",
        *proxy_services("tls"),
    }
    assert len(proxy_services("tls")) == 2
    sections = _haproxy_sections(HAPROXY_TLS_CFG)
    assert "mode tcp" in sections["defaults"]
    (frontend_name,) = [name for name in sections if name.startswith("frontend ") and "stats" not in name]
    frontend = sections[frontend_name]
    (bind,) = [line.split()[1] for line in frontend if line.startswith("bind ")]
    haproxy = SERVICES["haproxy-tls"]
    assert f"{bind.lstrip(':')}:{bind.lstrip(':')}" in haproxy["ports"]
    assert [v for v in haproxy["volumes"] if "haproxy-tls.cfg" in v] == [
        "./docker/haproxy-tls.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro"
    ]
    backend_name = next(line.split()[1] for line in frontend if line.startswith("default_backend"))
    backend = sections[f"backend {backend_name}"]
    assert "option httpchk" in backend and not any(line.startswith("mode http") for line in backend)
    (defaults,) = [line.split() for line in backend if line.startswith("default-server")]
    assert "check-ssl" in defaults and defaults[defaults.index("verify") + 1] == "required"
    ca_file = defaults[defaults.index("ca-file") + 1]
    assert ca_file.startswith(_volume_mount(haproxy, "tls-certs") + "/")
    servers = {line.split()[1]: line.split()[2] for line in backend if line.startswith("server ")}
    expected = {}
    for name, service in proxy_services("tls").items():
        args = proxy_parser().parse_args(argv_of(service)[1:])
        expected[name] = f"{name}:{args.port}"
        assert args.ssl_certfile and args.ssl_keyfile, f"{name} serves TLS"
        mount = _volume_mount(service, "tls-certs")
        assert args.ssl_certfile.startswith(mount + "/") and args.ssl_keyfile.startswith(mount + "/")
        check = " ".join(service["healthcheck"]["test"])
        assert f"https://127.0.0.1:{args.port}/health" in check and ca_file.removeprefix("/certs/") in check
        deps = service["depends_on"]
        assert deps["tls-certs"]["condition"] == "service_completed_successfully"
    assert servers == expected


def test_the_certificate_script_makes_a_pair_each_tls_replica_loads_and_clients_verify(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    certs = SERVICES["tls-certs"]
    assert f"./docker/tls/make-certs.sh:{argv_of(certs)[-1]}:ro" in certs["volumes"]
    env = {**os.environ, "CERTS_DIR": str(tmp_path), "CERTS_OWNER": str(os.getuid())}
    for _ in range(2):  # the second run keeps what the first made
        done = subprocess.run(["sh", str(MAKE_CERTS)], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert "keeping" in done.stdout and not (tmp_path / "ca.key").exists(), "the CA's key is gone once it signed"
    names = [*proxy_services("tls"), "localhost"]
    for name, service in proxy_services("tls").items():
        settings = _proxy(argv_of(service))
        mount = _volume_mount(service, "tls-certs")
        assert settings.tls is not None and settings.tls.keyfile is not None
        local = replace(
            settings.tls,
            certfile=str(tmp_path / settings.tls.certfile.removeprefix(mount + "/")),
            keyfile=str(tmp_path / settings.tls.keyfile.removeprefix(mount + "/")),
        )
        ServerTls(local)  # the replica would start with it
        for host in names:
            check = ["openssl", "verify", "-CAfile", str(tmp_path / "ca.pem"), "-verify_hostname", host, local.certfile]
            verified = subprocess.run(check, capture_output=True, text=True, timeout=30)
            assert verified.returncode == 0, f"{name}: {host}: {verified.stdout}{verified.stderr}"


def test_dockerfiles_install_our_package_from_files_that_exist() -> None:
    for path, base in ((DOCKERFILE, "python:3.11-slim"), (DOCKERFILE_VLLM, "vllm/vllm-openai")):
        text = path.read_text()
        args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
        froms = [interpolate(f, args) for f in re.findall(r"^FROM (\S+)", text, re.M)]
        assert froms and froms[0].startswith(base), f"{path.name}: FROM {froms}"
        assert "pip install ." in text
        for line in re.findall(r"^COPY (.+)$", text, re.M):
            for source in line.split()[:-1]:
                if not source.startswith("--"):
                    assert (REPO / source).exists(), f"{path.name} copies {source}, which does not exist"


# ---- the real tools, where installed ----


def test_docker_compose_config_accepts_the_file_and_both_profiles() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (optional: apt-get install docker-compose)")
    for extra in ([], ["--profile", "vllm"], ["--profile", "observe"], ["--profile", "tls"]):
        done = subprocess.run(
            [binary, "-f", str(COMPOSE), *extra, "config", "-q"], capture_output=True, text=True, timeout=60, cwd=REPO
        )
        assert done.returncode == 0, done.stderr


def test_haproxy_accepts_its_configs(tmp_path: Path) -> None:
    binary = shutil.which("haproxy")
    if binary is None:
        pytest.skip("haproxy is not installed (optional: apt-get install haproxy)")
    # The TLS one reads the CA from the tls-certs volume: here, from a CA of the test's own.
    CertAuthority(tmp_path / "certs")
    tls_cfg = tmp_path / "haproxy-tls.cfg"
    tls_cfg.write_text(HAPROXY_TLS_CFG.read_text().replace("/certs/", f"{tmp_path}/certs/"))
    for path in (HAPROXY_CFG, tls_cfg):
        done = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stdout + done.stderr


# ---- profile observe: Prometheus and Grafana, provisioned with our rules and dashboard ----

OBSERVE = REPO / "docs"


def _mounted(service: dict[str, Any], target: str) -> Path:
    """The repository file or folder ``service`` mounts at ``target``."""
    for volume in service.get("volumes") or []:
        source, inside = volume.split(":")[:2]
        if inside == target:
            return REPO / source
    raise AssertionError(f"nothing is mounted at {target}")


def test_the_observe_profile_has_prometheus_and_grafana_and_nothing_of_the_default_stack() -> None:
    observe = {name for name, s in SERVICES.items() if "observe" in profiles(s)}
    assert observe == {"prometheus", "grafana"}
    assert all(profiles(SERVICES[name]) == ["observe"] for name in observe)


def test_prometheus_scrapes_every_replica_and_loads_the_alerting_rules() -> None:
    service = SERVICES["prometheus"]
    argv = argv_of(service)
    config_path = flag(argv, "--config.file") or ""
    config = yaml.safe_load(_mounted(service, config_path).read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = set()
    for name, proxy in proxy_services().items():
        expected.add(f"{name}:{proxy_parser().parse_args(argv_of(proxy)[1:]).port}")
    assert targets == expected, "Prometheus scrapes the replicas (each re-exports every node's load)"
    for rules in config["rule_files"]:
        assert _mounted(service, rules) == OBSERVE / "prometheus" / "alerts.yml"


def test_grafana_is_provisioned_with_the_stacks_prometheus_and_our_dashboard() -> None:
    service = SERVICES["grafana"]
    provisioning = _mounted(service, "/etc/grafana/provisioning")
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    port = flag(argv_of(SERVICES["prometheus"]), "--web.listen-address") or ":9090"
    assert source["url"] == f"http://prometheus:{port.rsplit(':', 1)[1]}"
    dashboard = json.loads((OBSERVE / "grafana" / "vllm-proxy.json").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"] if "datasource" in p}
    assert uids == {source["uid"]}, "every panel reads the provisioned data source"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "vllm-proxy.yml").read_text())["providers"]
    folder = provider["options"]["path"]
    assert _mounted(service, f"{folder}/vllm-proxy.json") == OBSERVE / "grafana" / "vllm-proxy.json"
    home = env_of(service).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    assert home == f"{folder}/vllm-proxy.json"
