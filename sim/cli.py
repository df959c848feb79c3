"""``vllm-sim`` / ``python -m sim``: flags (each also ``VLLM_SIM_<NAME>``) -> SimSettings -> uvicorn.

The flag definitions hold every default; SimSettings has defaults only for the knobs no flag sets.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import uvicorn

from vllm_etcd_proxy.fleet.flags import environment_defaults
from vllm_etcd_proxy.fleet.version import add_version_flag
from vllm_etcd_proxy.sim import vocab
from vllm_etcd_proxy.sim.app import create_app
from vllm_etcd_proxy.sim.gpu import OutOfMemory
from vllm_etcd_proxy.sim.kvevents import KvEventsConfig
from vllm_etcd_proxy.sim.settings import Role, SimSettings

SHUTDOWN_TIMEOUT = 3
"""Seconds uvicorn waits for open requests on SIGTERM; hung ones would otherwise hold it forever."""
MODEL = "sim-model"
"""The served model name without --model."""

LoraList = tuple[tuple[str, str], ...]
"""(name, path) of each adapter served."""
LoraModule = tuple[str, str, str]
"""(name, path, base model or "") of one --lora-modules value."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-sim", description="A CPU-only simulated vLLM node (OpenAI-compatible API, vLLM wire format)."
    )
    add_version_flag(parser)

    def add(flag: str, kind: type, default: object, help: str) -> None:
        parser.add_argument(flag, type=kind, default=default, help=help)

    add("--host", str, "127.0.0.1", "listen address")
    # vLLM's default port is 8000; 8100 is the usual prefill port in the disagg examples.
    add("--port", int, 8100, "listen port")
    parser.add_argument(
        "--model",
        action="append",
        default=None,
        help=f"served model name, repeatable; the first names responses and metrics (default {MODEL}; "
        "VLLM_SIM_MODEL takes a comma-separated list)",
    )
    add("--model-root", str, "", "the model path vLLM would serve (root of the base model cards)")
    parser.add_argument(
        "--tokenizer",
        default="",
        metavar="DIR",
        help="encode with the Hugging Face tokenizer in DIR, written "
        "there if missing (a router can load it; the default root of the model cards)",
    )
    parser.add_argument(
        "--write-tokenizer",
        default="",
        metavar="DIR",
        help="write the simulator's Hugging Face tokenizer "
        "directory (tokenizer.json, tokenizer_config.json with the chat template) to DIR and exit",
    )
    parser.add_argument(
        "--lora",
        action="append",
        default=None,
        metavar="NAME[=PATH]",
        help="serve a LoRA adapter beside the base model (repeatable; VLLM_SIM_LORA takes a comma-separated list)",
    )
    parser.add_argument(
        "--lora-modules",
        action="append",
        nargs="+",
        default=None,
        metavar="NAME=PATH|JSON",
        help='vLLM\'s form: NAME=PATH or \'{"name": N, "path": P, "base_model_name": B}\' (needs --enable-lora)',
    )
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (vLLM's flag)")
    add("--max-loras", int, 1, "adapters in one batch; a request for one more waits")
    add("--lora-swap-time", float, 0.0, "seconds an adapter swapped into a slot adds to TTFT")
    add("--lora-load-time", float, 0.0, "seconds POST /v1/load_lora_adapter takes")
    add("--lora-load-fail", int, 0, "status every adapter load fails with (0: none)")
    add("--wake-time", float, 0.0, "seconds POST /wake_up takes to bring the weights back")
    add("--wake-fail", int, 0, "status every POST /wake_up that brings memory back fails with (0: none)")
    add("--weights-gib", float, 1.0, "GiB of GPU memory the weights take while awake")
    add("--kv-cache-gib", float, 1.0, "GiB of GPU memory the KV cache takes while awake")
    add(
        "--gpu",
        str,
        "",
        "a directory standing for a GPU shared with the nodes given the same one (default: a GPU of its own)",
    )
    add("--gpu-capacity-gib", float, 0.0, "memory of the --gpu device: more fails as out of memory (0: no limit)")
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="answer everything 503 as a vLLM scaling its elastic EP does",
    )
    add("--role", str, "mixed", "prefill, decode or mixed (mixed ignores kv_transfer_params)")
    add("--node-id", str, "", "node id (default host:port)")
    add("--ttft", float, 0.02, "seconds to the first token")
    add("--itl", float, 0.005, "seconds between tokens")
    add(
        "--prefill-per-token",
        float,
        0.0,
        "seconds added to --ttft per prompt token not found in the prefix cache",
    )
    add(
        "--batch-slowdown",
        float,
        0.0,
        "each other running sequence makes a prefill or token gap this fraction longer (0: load changes nothing)",
    )
    add("--output-len", int, 16, "answer length before a simulated EOS when max_tokens allows")
    add("--max-num-seqs", int, 64, "concurrent sequences; more wait in a FIFO queue")
    add("--fail-rate", float, 0.0, "fraction of requests answered with --fail-status")
    add("--fail-status", int, 500, "status of injected failures (500, 503, 429...)")
    add("--fail-after-tokens", int, 0, "fail every generation after N tokens (0: never)")
    parser.add_argument(
        "--hang",
        action="store_true",
        help="accept inference requests but never answer them",
    )
    add(
        "--hang-after-tokens",
        int,
        0,
        "every generation stops sending, without closing, after N tokens (0: never)",
    )
    add("--startup-delay", float, 0.0, "seconds /health answers 503 after start")
    add("--unhealthy-file", str, "", "while this file exists /health answers 503")
    add("--api-key", str, "", "require Authorization: Bearer KEY on /v1/*")
    add("--max-model-len", int, 4096, "context length in tokens")
    add("--block-size", int, 16, "tokens per KV block (prefix cache, remote_block_ids)")
    # 64k tokens at block size 16.
    add("--cache-blocks", int, 4096, "KV blocks of the prefix cache (0: no prefix caching)")
    add("--kv-events-config", str, "", "vLLM's KVEventsConfig JSON: publish KV-cache events")
    add("--kv-replay-frames", int, 4, "frames per replay answer: 4 (vLLM 0.32) or 3 (older)")
    add("--side-channel-host", str, "", "remote_host announced to decode nodes")
    add("--side-channel-port", int, 5600, "remote_port announced to decode nodes")
    add("--ssl-certfile", str, "", "serve HTTPS with this PEM certificate chain (vLLM's flag)")
    add("--ssl-keyfile", str, "", "its PEM private key, unless in --ssl-certfile's file (vLLM's flag)")
    add("--ssl-ca-certs", str, "", "PEM CAs that client certificates must chain to (vLLM's flag)")
    parser.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=[0, 1, 2],
        default=0,
        help="client certificates, the ssl module's numbers: 0 none, 1 optional, 2 required (vLLM's flag)",
    )
    add("--log-level", str, "info", "debug, info, warning, error")
    return parser


def parse_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> SimSettings:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    environ = os.environ if env is None else env
    try:
        environment_defaults(parser, "VLLM_SIM_", argv, lists={"model", "lora"}, environ=environ)
    except ValueError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    models = args.model or ()
    loras, found = _loras(parser, args)
    role = _checked(parser, args)
    return SimSettings(
        host=args.host,
        port=args.port,
        models=tuple(models) or (MODEL,),
        model_root=args.model_root,
        tokenizer=Path(args.tokenizer).resolve() if args.tokenizer else None,
        loras=loras,
        lora_bases=tuple((name, base) for name, _, base in found if base),
        enable_lora=args.enable_lora or bool(loras),
        max_loras=args.max_loras,
        runtime_lora_updating=environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true"),
        dev_mode=environ.get("VLLM_SERVER_DEV_MODE", "0").strip() not in ("", "0"),
        lora_swap_time=args.lora_swap_time,
        lora_load_time=args.lora_load_time,
        lora_load_fail=args.lora_load_fail,
        wake_time=args.wake_time,
        wake_fail=args.wake_fail,
        weights_gib=args.weights_gib,
        kv_cache_gib=args.kv_cache_gib,
        gpu=Path(args.gpu).resolve() if args.gpu else None,
        gpu_capacity_gib=args.gpu_capacity_gib,
        role=role,
        node_id=args.node_id,
        ttft=args.ttft,
        itl=args.itl,
        prefill_per_token=args.prefill_per_token,
        batch_slowdown=args.batch_slowdown,
        output_len=args.output_len,
        max_num_seqs=args.max_num_seqs,
        fail_rate=args.fail_rate,
        fail_status=args.fail_status,
        fail_after_tokens=args.fail_after_tokens,
        hang=args.hang,
        hang_after_tokens=args.hang_after_tokens,
        startup_delay=args.startup_delay,
        unhealthy_file=Path(args.unhealthy_file) if args.unhealthy_file else None,
        api_key=args.api_key or None,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        kv_events_config=args.kv_events_config,
        kv_replay_frames=args.kv_replay_frames,
        side_channel_host=args.side_channel_host,
        side_channel_port=args.side_channel_port,
        scaling=args.scaling,
        ssl_certfile=args.ssl_certfile or None,
        ssl_keyfile=args.ssl_keyfile or None,
        ssl_ca_certs=args.ssl_ca_certs or None,
        ssl_cert_reqs=args.ssl_cert_reqs,
        log_level=args.log_level,
    )


def _loras(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[LoraList, list[LoraModule]]:
    """The adapters of --lora and --lora-modules, and the --lora-modules ones as given (with their base)."""
    loras = tuple(_lora(spec) for spec in args.lora or ())
    if any(not name for name, _ in loras):
        parser.error("--lora needs a name: NAME or NAME=PATH")
    groups = [[g] if isinstance(g, str) else g for g in args.lora_modules or ()]  # VLLM_SIM_LORA_MODULES: one
    modules = [_lora_module(spec) for specs in groups for spec in specs]
    if None in modules:
        parser.error("--lora-modules takes NAME=PATH or a JSON object with name and path")
    if modules and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora")
    found = [m for m in modules if m is not None]
    return loras + tuple((name, path) for name, path, _ in found), found


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Role:
    """Exit with a usage error for a value the node cannot run with; returns the role."""
    if args.max_loras < 1:
        parser.error("need --max-loras >= 1")
    try:
        role = Role(args.role)
    except ValueError:
        parser.error(f"--role must be one of {', '.join(Role)}")
    if args.max_num_seqs < 1 or not 0.0 <= args.fail_rate <= 1.0 or min(args.ttft, args.itl) < 0:
        parser.error("need --max-num-seqs >= 1, 0 <= --fail-rate <= 1, --ttft and --itl >= 0")
    if (
        args.block_size < 1
        or min(args.cache_blocks, args.prefill_per_token, args.hang_after_tokens, args.batch_slowdown) < 0
    ):
        parser.error(
            "need --block-size >= 1; --cache-blocks, --prefill-per-token, --hang-after-tokens, --batch-slowdown >= 0"
        )
    try:
        KvEventsConfig.parse(args.kv_events_config) if args.kv_events_config else None
    except ValueError as exc:
        parser.error(f"--kv-events-config: {exc}")
    if min(args.wake_time, args.weights_gib, args.kv_cache_gib, args.gpu_capacity_gib) < 0:
        parser.error("need --wake-time, --weights-gib, --kv-cache-gib and --gpu-capacity-gib >= 0")
    if args.kv_replay_frames not in (3, 4):
        parser.error("--kv-replay-frames must be 3 or 4")
    return role


def _lora(spec: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``NAME`` (its path then ``/adapters/NAME``)."""
    name, _, path = spec.partition("=")
    return name.strip(), path.strip() or f"/adapters/{name.strip()}"


def _lora_module(spec: str) -> LoraModule | None:
    """(name, path, base model or "") from one --lora-modules value, or None when it is neither form."""
    if spec.lstrip().startswith("{"):
        try:
            obj = json.loads(spec)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name") or ""
        if isinstance(name, str) and name and isinstance(path, str) and path:
            return name, path, str(base)
        return None
    name, sep, path = spec.partition("=")
    return (name.strip(), path.strip(), "") if sep and name.strip() and path.strip() else None


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    target = _parser().parse_known_args(argv)[0].write_tokenizer
    if target:
        print(vocab.write(target))
        return
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger(__name__).info(
        "vllm-sim starting node_id=%s role=%s models=%s engine_id=%s",
        settings.name,
        settings.role,
        ",".join(settings.models),
        settings.engine_id,
    )
    try:
        app = create_app(settings)
    except OutOfMemory as exc:  # the shared --gpu is full, as CUDA would say at vLLM's start
        sys.exit(f"vllm-sim: error: {exc}")
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=SHUTDOWN_TIMEOUT,
        ssl_certfile=settings.ssl_certfile,
        ssl_keyfile=settings.ssl_keyfile,
        ssl_ca_certs=settings.ssl_ca_certs,
        ssl_cert_reqs=settings.ssl_cert_reqs,
    )
