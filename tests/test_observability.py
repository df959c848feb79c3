"""The dashboards that come with the replica (issue 21): the alerting rules pass ``promtool check rules`` and our
``promtool test rules`` file; the rules and the Grafana dashboard name only metrics a replica really exports;
and a real Prometheus (Debian's package) scraping a real replica answers every dashboard query with data."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.procs import HOST, Proc, free_port, http_ok, wait_until
from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "docs" / "prometheus" / "alerts.yml"
RULES_TEST = REPO / "docs" / "prometheus" / "alerts.test.yml"
DASHBOARD = REPO / "docs" / "grafana" / "vllm-proxy.json"
MODEL = "sim-model"
_NAME = re.compile(r"\b(vllm_proxy_[a-z0-9_]+)\b")


def tool(name: str) -> str:
    binary = shutil.which(name)
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing: .ci/run installs Debian's prometheus package")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return binary


def dashboard_queries() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def rule_queries() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_the_alerting_rules_pass_promtool_check_and_our_rule_tests() -> None:
    promtool = tool("promtool")
    for argv in (["check", "rules", str(RULES)], ["test", "rules", RULES_TEST.name]):
        done = subprocess.run([promtool, *argv], capture_output=True, text=True, timeout=60, cwd=RULES.parent)
        assert done.returncode == 0, done.stdout + done.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    tested = {
        t["alertname"] for case in yaml.safe_load(RULES_TEST.read_text())["tests"] for t in case["alert_rule_test"]
    }
    assert tested == alerts, "every alert has a rule test"


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def replica(logs: Path) -> Iterator[ProxyProc]:
    nodes = [SimNode(logs, "obs-prefill", role="prefill"), SimNode(logs, "obs-decode", role="decode", itl=0.002)]
    proxy = None
    try:
        for node in nodes:
            node.start()
        proxy = ProxyProc(
            logs,
            "--prefill",
            nodes[0].host_port,
            "--decode",
            nodes[1].host_port,
            "--scrape-load",
            "0.2",
            name="obs-proxy",
        )
        proxy.wait_routable("prefill", nodes[0].host_port)
        proxy.wait_routable("decode", nodes[1].host_port)
        yield proxy
    finally:
        if proxy is not None:
            proxy.stop()
        for node in nodes:
            node.stop()


@pytest.fixture(scope="module")
def traffic(replica: ProxyProc) -> Iterator[None]:
    """Streamed and plain chat completions, one after another, until the module's tests are done."""
    stop = threading.Event()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "the same question again"}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    def send() -> None:
        with httpx.Client(base_url=replica.url, timeout=10) as client:
            while not stop.is_set():
                client.post("/v1/chat/completions", json=body)
                client.post("/v1/chat/completions", json={**body, "stream": False, "stream_options": None})

    sender = threading.Thread(target=send, name="traffic", daemon=True)
    sender.start()
    wait_until(lambda: "vllm_proxy_generation_tokens_total{" in replica.get("/metrics").text, 20, "a first answer")
    yield
    stop.set()
    sender.join(timeout=15)


def exported_names(replica: ProxyProc) -> set[str]:
    """Every series name the replica's /metrics declares or shows (histograms with their three series)."""
    names: set[str] = set()
    for line in replica.get("/metrics").text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_rules_and_dashboard_name_only_metrics_a_replica_exports(replica: ProxyProc, traffic: None) -> None:
    exported = exported_names(replica)
    for where, queries in (("alerts.yml", rule_queries()), ("vllm-proxy.json", dashboard_queries())):
        named = {name for q in queries for name in _NAME.findall(q)}
        assert named and not named - exported, f"{where} names metrics no replica exports: {named - exported}"


@pytest.fixture(scope="module")
def prometheus(replica: ProxyProc, logs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = tool("prometheus")
    home = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "vllm-proxy", "static_configs": [{"targets": [f"{HOST}:{replica.port}"]}]}],
    }
    (home / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://{HOST}:{port}"
    proc = Proc(
        "prometheus",
        [
            binary,
            f"--config.file={home / 'prometheus.yml'}",
            f"--storage.tsdb.path={home / 'data'}",
            f"--web.listen-address={HOST}:{port}",
        ],
        logs,
    )
    try:
        wait_until(lambda: http_ok(f"{url}/-/ready"), 30, "prometheus ready")
        yield url
    finally:
        proc.stop()


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def test_a_real_prometheus_scraping_a_replica_answers_every_dashboard_query(
    prometheus: str, replica: ProxyProc, traffic: None
) -> None:
    pending = {q.replace("$__rate_interval", "20s") for q in dashboard_queries()}

    def answered() -> bool:
        for expr in list(pending):
            values = [float(r["value"][1]) for r in query(prometheus, expr)]
            if values and any(not math.isnan(v) for v in values):
                pending.discard(expr)
        return not pending

    wait_until(answered, 60, "data for every dashboard query", interval=1.0)
    nodes = {(r["metric"]["node"], r["metric"]["role"]) for r in query(prometheus, "vllm_proxy_node_running")}
    assert nodes == {(w["id"], w["role"]) for w in replica.workers()}


def test_the_alerting_rules_load_and_evaluate_in_a_real_prometheus(prometheus: str) -> None:
    def evaluated() -> list[dict[str, Any]]:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [r for g in groups for r in g["rules"] if r.get("lastEvaluation", "").startswith("2")]

    wait_until(lambda: len(evaluated()) == len(rule_queries()), 30, "every rule evaluated", interval=0.5)
    assert all(r["health"] == "ok" for r in evaluated()), evaluated()
    firing = httpx.get(f"{prometheus}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
    assert [a for a in firing if a["state"] == "firing"] == [], "a healthy fleet fires no alert"
