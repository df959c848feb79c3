"""A whole run at the default log level: no prompt, completion, key or password reaches any log."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx

from tests.conftest import Reaper
from tests.support.etcd_server import EtcdServer
from tests.support.proxy_proc import ProxyProc
from tests.support.registrar_proc import Registrar
from tests.support.sim_node import SimNode

PROMPT = "PROMPT-7f3a-confidential-merger-plans"
CLIENT_KEY = "CLIENTKEY-91ab"
WRONG_KEY = "WRONGKEY-55cd"
BACKEND_KEY = "BACKENDKEY-0e1f"
ADMIN_KEY = "ADMINKEY-c4d2"


def test_logs_of_a_whole_run_hold_no_prompt_or_secret(etcd: EtcdServer, logs_dir: Path, reap: Reaper) -> None:
    prefill = reap(SimNode(logs_dir, "prefill", role="prefill", api_key=BACKEND_KEY, output_len=64).start())
    decode = reap(SimNode(logs_dir, "decode", role="decode", api_key=BACKEND_KEY, output_len=64).start())
    regs = [
        reap(Registrar(etcd, n.url, logs_dir, "--models", "sim-model", role=r, name=f"reg-{r}"))
        for r, n in (("prefill", prefill), ("decode", decode))
    ]
    replica = reap(
        ProxyProc(
            logs_dir,
            "--etcd",
            etcd.endpoint,
            "--api-key",
            CLIENT_KEY,
            "--backend-api-key",
            BACKEND_KEY,
            admin_key=ADMIN_KEY,
        )
    )
    replica.wait_routable("prefill", prefill.host_port)
    replica.wait_routable("decode", decode.host_port)

    chat = {"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8}
    good = {"Authorization": f"Bearer {CLIENT_KEY}"}
    completions = []
    for stream in (False, True):
        answer = replica.post("/v1/chat/completions", json={**chat, "stream": stream}, headers=good)
        assert answer.status_code == 200
        completions.append(answer.text)
    assert (
        replica.post("/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {WRONG_KEY}"}).status_code
        == 401
    )
    assert (
        replica.post(
            "/instances/add", json={"type": "decode", "instance": "127.0.0.1:9"}, headers={"X-Api-Key": WRONG_KEY}
        ).status_code
        == 401
    )
    assert (
        replica.post(
            "/instances/add", json={"type": "decode", "instance": "127.0.0.1:9"}, headers={"X-Api-Key": ADMIN_KEY}
        ).status_code
        == 200
    )
    assert (
        replica.post(
            "/v1/completions", content=f'{{"model": "sim-model", "prompt": "{PROMPT}"'.encode(), headers=good
        ).status_code
        == 400
    )
    with httpx.stream(
        "POST",
        f"{replica.url}/v1/chat/completions",
        json={**chat, "stream": True, "max_tokens": 60},
        headers=good,
        timeout=10,
    ) as walked_away:
        next(walked_away.iter_lines())
    for reg in regs:
        reg.signal(signal.SIGTERM)
        reg.wait(20)
    replica.stop()

    generated = {word for text in completions for word in text.replace('"', " ").split() if word.startswith("tok")}
    logs = {path.name: path.read_text(errors="replace") for path in logs_dir.glob("*.log")}
    assert logs, "no logs captured"
    for name, text in logs.items():
        for secret in (PROMPT, CLIENT_KEY, WRONG_KEY, BACKEND_KEY, ADMIN_KEY):
            assert secret not in text, f"{secret} appears in {name}"
        assert not any(f" {word} " in text for word in generated if len(word) > 4), f"completion text in {name}"
