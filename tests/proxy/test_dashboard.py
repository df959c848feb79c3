"""``GET /dashboard`` (issue 21): one self-contained page, checked in a real headless browser (Debian's
chromium) against a real fleet: it renders the nodes, their roles and the model, with no console error."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.proxy_proc import ProxyProc
from tests.support.sim_node import SimNode

MODEL = "sim-model"


def chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs Debian's chromium")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return binary


def headless(url: str, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """Chromium loads ``url``, runs its scripts for a few seconds of virtual time, then does ``extra``."""
    return subprocess.run(
        [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
            "--disable-background-networking",
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=6000",
            "--window-size=1200,900",
            *extra,
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.fixture
def fleet(logs_dir: Path) -> Iterator[tuple[ProxyProc, list[SimNode]]]:
    nodes = [SimNode(logs_dir, "prefill-a", role="prefill"), SimNode(logs_dir, "decode-a", role="decode")]
    proxy = None
    try:
        for node in nodes:
            node.start()
        proxy = ProxyProc(
            logs_dir, "--prefill", nodes[0].host_port, "--decode", nodes[1].host_port, "--scrape-load", "0.2"
        )
        proxy.wait_routable("prefill", nodes[0].host_port)
        proxy.wait_routable("decode", nodes[1].host_port)
        yield proxy, nodes
    finally:
        if proxy is not None:
            proxy.stop()
        for node in nodes:
            node.stop()


def test_the_page_is_self_contained_and_reveals_no_secret(fleet: tuple[ProxyProc, list[SimNode]]) -> None:
    proxy, _ = fleet
    page = proxy.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text), "no external resource"
    assert "@import" not in page.text and "url(" not in page.text
    assert "innerHTML" not in page.text, "node names and labels are data, never markup"


def test_the_dashboard_renders_the_fleet_in_a_real_browser_without_console_errors(
    fleet: tuple[ProxyProc, list[SimNode]], tmp_path: Path
) -> None:
    proxy, nodes = fleet
    done = headless(f"{proxy.url}/dashboard", tmp_path, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'data-rendered="' in dom, "the page's poll never rendered"
    for node in nodes:
        assert node.host_port in dom
    for text in ("prefill", "decode", MODEL, "static pools", "serving"):
        assert text in dom
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console
    errors = [
        line
        for line in done.stderr.splitlines()
        if ":ERROR:" in line and ("javascript" in line.lower() or "Uncaught" in line)
    ]
    assert not errors, errors


@pytest.fixture
def both_fleet(logs_dir: Path) -> Iterator[tuple[ProxyProc, list[SimNode]]]:
    nodes = [SimNode(logs_dir, f"both-{i}", role="both") for i in range(2)]
    proxy = None
    try:
        for node in nodes:
            node.start()
        proxy = ProxyProc(logs_dir, "--both", *(n.host_port for n in nodes), "--scrape-load", "0.2")
        for node in nodes:
            proxy.wait_routable("both", node.host_port)
        yield proxy, nodes
    finally:
        if proxy is not None:
            proxy.stop()
        for node in nodes:
            node.stop()


def test_the_dashboard_shows_both_nodes_and_how_requests_to_them_are_split(
    both_fleet: tuple[ProxyProc, list[SimNode]], tmp_path: Path
) -> None:
    proxy, nodes = both_fleet
    long = " ".join(f"w{i}" for i in range(600))
    answer = proxy.post("/v1/completions", json={"model": MODEL, "prompt": long, "max_tokens": 2})
    assert answer.status_code == 200 and "x-sim-prefill-engine" in answer.headers  # split
    done = headless(f"{proxy.url}/dashboard", tmp_path, "--dump-dom")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    for node in nodes:
        assert node.host_port in dom
    assert ">both<" in dom, "the nodes' role"
    assert 'id="elastic-nodes-tile" hidden' not in dom and 'id="elastic-split-tile" hidden' not in dom
    tile = re.search(r'id="elastic-nodes">([^<]*)<', dom)
    assert tile is not None and re.fullmatch(r"\d+ · \d+ · \d+", tile.group(1)), tile
    assert "legs / s" in dom
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console
