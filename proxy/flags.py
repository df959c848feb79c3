"""``vllm-proxy``'s flags: the parser (the source of ``--help`` and of the README's table) and flags -> ProxySettings.

Every flag also reads ``VLLM_PROXY_<FLAG>`` (dashes as underscores; lists comma-separated, ``LIST_FLAGS``). The
flag definitions are the one place of every default: ProxySettings has none, and help texts say ``%(default)s``.
"""

from __future__ import annotations

import argparse
import math
import ssl
from ipaddress import ip_network

from vllm_etcd_proxy.fleet.etcd import (
    BURST_PAUSE,
    DEAD_AFTER,
    KEEPALIVE_TIME,
    KEEPALIVE_TIMEOUT,
    TIMEOUT,
    EtcdSettings,
    parse_endpoints,
)
from vllm_etcd_proxy.fleet.flags import read_password
from vllm_etcd_proxy.fleet.records import CLUSTER, KEY_PREFIX, kv_event_flags
from vllm_etcd_proxy.fleet.tls import NodeTlsSettings
from vllm_etcd_proxy.fleet.version import add_version_flag
from vllm_etcd_proxy.proxy.discovery.ejection import PROBE_RATE as EJECT_PROBE_RATE
from vllm_etcd_proxy.proxy.discovery.ejection import EjectionSettings
from vllm_etcd_proxy.proxy.discovery.loadwatch import SCRAPE_RATE
from vllm_etcd_proxy.proxy.discovery.prober import PROBE_RATE as MODELS_PROBE_RATE
from vllm_etcd_proxy.proxy.operations.tls import ServerTlsSettings
from vllm_etcd_proxy.proxy.routing.balancer import DEFAULT_POLICIES, POLICY_NAMES
from vllm_etcd_proxy.proxy.settings import ProxySettings, TimeoutSettings
from vllm_etcd_proxy.proxy.telemetry.spans import traces_endpoint

ENV_PREFIX = "VLLM_PROXY_"
LIST_FLAGS = {
    "prefill",
    "decode",
    "mixed",
    "model",
    "api_key",
    "admin_allow_cidr",
    "tokenizer",
    "kv_events",
    "sleep_after_idle",
}
MAX_BODY_BYTES = 32 * 1024 * 1024
"""A 128k-token prompt is about 1 MB of JSON; inline images take more."""
MAX_HEADER_BYTES = 64 * 1024
"""Real clients send a few KiB."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-proxy",
        description="OpenAI-compatible proxy for a vLLM fleet; nodes come from etcd and/or static flags.",
    )
    add_version_flag(p)
    add = p.add_argument
    add("--host", default="0.0.0.0", help="listen address (default %(default)s)")
    add("--port", type=int, default=8000, help="listen port (default %(default)s)")
    add(
        "--ssl-certfile",
        metavar="FILE",
        help="serve HTTPS (and WSS) with this PEM certificate chain, as vLLM's flag; re-read on SIGHUP, "
        "connections already open keep theirs (default: plain HTTP)",
    )
    add("--ssl-keyfile", metavar="FILE", help="the PEM private key of --ssl-certfile (default: in its file)")
    add("--ssl-ca-certs", metavar="FILE", help="PEM CAs that client certificates must chain to")
    add(
        "--ssl-cert-reqs",
        type=int,
        default=int(ssl.CERT_NONE),
        choices=[int(ssl.CERT_NONE), int(ssl.CERT_OPTIONAL), int(ssl.CERT_REQUIRED)],
        help="client certificates, as vLLM's flag (the ssl module's numbers): 0 not asked, 1 checked when "
        "shown, 2 required; 1 and 2 need --ssl-ca-certs (default %(default)s)",
    )
    add("--etcd", help="etcd endpoints, URL[,URL...]; without it the static flags are the pools")
    add("--etcd-prefix", default=KEY_PREFIX, help="key prefix (default %(default)s)")
    add("--cluster", default=CLUSTER, help="cluster name under the prefix (default %(default)s)")
    for role in ("prefill", "decode", "mixed"):
        add(
            f"--{role}",
            nargs="+",
            action="extend",
            default=[],
            metavar="HOST:PORT",
            help=f"static {role} nodes (host:port or URL; repeatable)",
        )
    add(
        "--kv-events",
        nargs="+",
        action="extend",
        default=[],
        metavar="NODE=ENDPOINT[,REPLAY]",
        help="a static node's KV-cache event publisher, tcp://HOST:PORT, and optionally its replay socket "
        "(NODE as given to --prefill/--decode/--mixed; repeatable)",
    )
    add(
        "--model",
        nargs="+",
        action="extend",
        default=[],
        help="model(s) the static nodes serve (default: ask each node's /v1/models)",
    )
    add("--admin-key", help="admin API key (also ADMIN_API_KEY); without one the admin API answers 403")
    add(
        "--admin-allow-cidr",
        nargs="+",
        action="extend",
        default=[],
        metavar="CIDR",
        help="networks /instances/add may point at (repeatable; default any)",
    )
    add(
        "--api-key",
        nargs="+",
        action="extend",
        default=[],
        help="client API key required on /v1/* (repeatable; "
        "VLLM_PROXY_API_KEY takes a comma-separated list); default: open",
    )
    add(
        "--api-key-file",
        help="client keys, one a line: KEY [tenant=NAME] [rpm=N] [tpm=N] [concurrency=N] "
        "[priority=N] [share=N] (# comments allowed); reloaded on SIGHUP",
    )
    add(
        "--queue-timeout",
        type=float,
        default=0.0,
        help="seconds a request may wait in the replica, queued fairly "
        "by tenant and priority, while every node of its model is full; then 503 (default %(default)g: no queue, "
        "requests go to the nodes' own queues)",
    )
    add(
        "--queue-when-waiting",
        type=int,
        default=0,
        help="with --queue-timeout: a node whose scraped waiting "
        "queue holds N requests counts as full, as one this replica has --max-connections open on (default "
        "%(default)s: off)",
    )
    add(
        "--wake-on-demand",
        action="store_true",
        help="a request whose model has no node awake but some asleep (vLLM's sleep mode) waits while one "
        "replica wakes exactly one of them (claimed in etcd), up to --wake-timeout",
    )
    add(
        "--wake-timeout",
        type=float,
        default=60.0,
        help="seconds a request waits for a node of its model to wake, then 503 with Retry-After (default %(default)g)",
    )
    add(
        "--sleep-after-idle",
        nargs="+",
        action="extend",
        default=[],
        metavar="[MODEL=]S",
        help="put a node to sleep once its model has had no request for S seconds anywhere in the fleet, "
        "drained first (MODEL=S for one model, a bare S for every model; a node's record label "
        "sleep-after-idle=S wins; repeatable; default: never)",
    )
    add(
        "--min-awake",
        type=int,
        default=1,
        help="nodes of each model --sleep-after-idle always leaves awake (default %(default)s; 0 needs "
        "--wake-on-demand for a model to come back)",
    )
    add(
        "--sleep-level",
        type=int,
        default=1,
        choices=[0, 1, 2],
        help="vLLM's sleep level for idle nodes: 0 pauses the scheduler, 1 offloads the weights to CPU memory, "
        "2 discards them (default %(default)s)",
    )
    add(
        "--sleep-drain-timeout",
        type=float,
        default=30.0,
        help="seconds a node going to sleep (admin API or idle) may take to finish its requests; then it sleeps "
        "with vLLM's mode=wait, so the rest still finish (default %(default)g)",
    )
    add("--backend-api-key", help="key sent to nodes started with vLLM's --api-key (default: pass the client's)")
    add(
        "--max-concurrent-requests",
        type=int,
        default=0,
        help="in-flight requests before 503 (default %(default)s: no limit)",
    )
    add(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"largest request body (default {MAX_BODY_BYTES >> 20} MiB)",
    )
    add(
        "--max-header-bytes",
        type=int,
        default=MAX_HEADER_BYTES,
        help=f"largest request headers (default {MAX_HEADER_BYTES >> 10} KiB)",
    )
    add("--body-timeout", type=float, default=60.0, help="seconds to receive a request body (default %(default)g)")
    add(
        "--policy",
        choices=POLICY_NAMES,
        help="balancing policy for every role (default: kv-aware for prefill "
        "and mixed nodes, which is cache-aware for nodes that publish no KV events; least-load for decode "
        "nodes)",
    )
    for role in ("prefill", "decode", "mixed"):
        add(
            f"--{role}-policy",
            choices=POLICY_NAMES,
            help=f"policy for {role} nodes (default: --policy, else {DEFAULT_POLICIES[role]})",
        )
    add(
        "--affinity-header",
        default="x-session-id",
        help="session header for consistent-hash (default "
        "%(default)s; without it: the body's user, else the prompt's start)",
    )
    add(
        "--pd-min-prompt-tokens",
        type=int,
        default=0,
        help="for a prefill/decode model: a prompt with fewer new "
        "tokens than this (those no earlier request had, so no prefix cache holds) skips the prefill leg and goes "
        "straight to a decode node (default %(default)s: never)",
    )
    add(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=PATH_OR_HUB_ID",
        help="the tokenizer of MODEL "
        "for routing on token ids: a directory with tokenizer.json (and tokenizer_config.json for the chat "
        "template), or a hub id (fetched at start); repeatable; default: the model card's root when it is such "
        "a directory",
    )
    add(
        "--scrape-load",
        type=float,
        default=0.5,
        help="seconds between scrapes of each node's /metrics (running "
        "and waiting requests, KV-cache usage) for the load-aware policies (default %(default)g; 0: off)",
    )
    add(
        "--scrape-rate",
        type=float,
        default=SCRAPE_RATE,
        help="load scrapes a second at most over all nodes, "
        "a fifth of them for nodes without traffic, new or failing (default %(default)g: a node of a model in "
        "demand is scraped every --scrape-load s up to --scrape-rate x --scrape-load such nodes, less often "
        "beyond)",
    )
    add("--max-attempts", type=int, default=3, help="nodes tried per leg before failing (default %(default)s)")
    add(
        "--max-resumes",
        type=int,
        default=2,
        help="times a stream may go on from another node after its node "
        "failed mid-way (default %(default)s; 0: never, the stream ends with an error event)",
    )
    # Timeouts for LLM serving: a LAN node connects in milliseconds, so 5 s means it is gone; a 100k-token prompt
    # on a busy node takes minutes to prefill; a non-streamed completion sends its headers only when it is done.
    add("--connect-timeout", type=float, default=5.0, help="seconds to connect to a node (default %(default)g)")
    add(
        "--prefill-timeout",
        type=float,
        default=300.0,
        help="seconds for the whole prefill leg (default %(default)g)",
    )
    add(
        "--first-byte-timeout",
        type=float,
        default=600.0,
        help="seconds until a node's response headers (default %(default)g; a non-streamed completion sends them "
        "when done)",
    )
    add("--stream-idle-timeout", type=float, default=120.0, help="longest gap between chunks (default %(default)g)")
    add(
        "--eject-after",
        type=int,
        default=3,
        help="consecutive failures that eject a node from this replica (default %(default)s; 0 disables)",
    )
    add(
        "--eject-backoff",
        type=float,
        default=1.0,
        help="seconds before an ejected node's first probe (default %(default)g)",
    )
    add("--eject-max-backoff", type=float, default=30.0, help="longest wait between probes (default %(default)g)")
    add(
        "--eject-probe-rate",
        type=float,
        default=EJECT_PROBE_RATE,
        help="probes of ejected nodes a second at most, over all nodes (default %(default)g)",
    )
    add(
        "--shutdown-delay",
        type=float,
        default=0.0,
        help="seconds a replica reports not ready after SIGTERM "
        "before it stops listening, for balancers that health-check /ready (default %(default)g)",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=60.0,
        help="seconds SIGTERM waits for in-flight requests (default %(default)g)",
    )
    add("--models-refresh", type=float, default=15.0, help="seconds between /v1/models polls (default %(default)g)")
    add(
        "--models-probe-rate",
        type=float,
        default=MODELS_PROBE_RATE,
        help="/v1/models polls a second at most "
        "over all nodes, half of them for refreshes and failing nodes (default %(default)g)",
    )
    add(
        "--max-connections",
        type=int,
        default=1000,
        help="connections open to one node at most; more requests wait for one (default %(default)s)",
    )
    add("--etcd-timeout", type=float, default=TIMEOUT, help="seconds per etcd call (default %(default)g)")
    add(
        "--etcd-dead-after",
        type=float,
        default=DEAD_AFTER,
        help="seconds of silence after which the etcd watch "
        "counts as dead (a silent partition) and reconnects, to another endpoint if there are several; it asks "
        "etcd for progress every third of this (default %(default)g)",
    )
    add(
        "--etcd-burst-pause",
        type=float,
        default=BURST_PAUSE,
        help="seconds the etcd watch stops listening "
        "in a burst of changes (over 128 a second) before it asks again from its last revision, so etcd sends what "
        "came meanwhile in one message instead of one per change; changes are late by up to this plus 0.1 s in a "
        "burst only (default %(default)g; 0: never)",
    )
    add(
        "--etcd-keepalive-time",
        type=float,
        default=KEEPALIVE_TIME,
        help="seconds between gRPC pings on a busy etcd connection, 5 or more: etcd refuses faster pings "
        "(default %(default)g)",
    )
    add(
        "--etcd-keepalive-timeout",
        type=float,
        default=KEEPALIVE_TIMEOUT,
        help="seconds to wait for a ping's answer before gRPC drops the connection (default %(default)g)",
    )
    add(
        "--node-ca-bundle",
        metavar="FILE",
        help="PEM CAs that the certificates of https:// nodes must chain to (default: the system's)",
    )
    add("--node-cert", metavar="FILE", help="PEM client certificate for https:// nodes that require one")
    add("--node-key", metavar="FILE", help="the PEM private key of --node-cert (default: in its file)")
    add("--etcd-cacert", help="CA bundle to verify etcd's TLS certificate")
    add("--etcd-cert", help="client certificate for etcd")
    add("--etcd-key", help="client key for etcd")
    add("--etcd-user", help="etcd user name")
    add("--etcd-password", help="etcd password (prefer VLLM_PROXY_ETCD_PASSWORD or --etcd-password-file)")
    add("--etcd-password-file", help="file whose first line is the etcd password")
    add(
        "--workers",
        type=int,
        default=1,
        help="processes serving the port, each with its own etcd watch and "
        "pools; use one per core the replica may use (default %(default)s)",
    )
    add(
        "--otlp-traces-endpoint",
        metavar="URL",
        help="send OpenTelemetry traces there, OTLP over HTTP (a span per "
        "request, a child per leg; as vLLM's flag; a bare host:port gets /v1/traces; default "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off); needs pip install 'vllm-etcd-proxy[otel]'",
    )
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="default %(default)s")
    return p


def tokenizer_flag(spec: str) -> tuple[str, str]:
    """``MODEL=PATH_OR_HUB_ID`` of --tokenizer."""
    model, sep, source = spec.partition("=")
    if not (sep and model.strip() and source.strip()):
        raise ValueError(f"--tokenizer {spec!r}: expected MODEL=PATH_OR_HUB_ID")
    return model.strip(), source.strip()


def idle_flag(spec: str) -> tuple[str, float]:
    """``[MODEL=]S`` of --sleep-after-idle (model ``""``: every model)."""
    model, sep, seconds = spec.rpartition("=")
    try:
        value = float(seconds)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0 or (sep and not model.strip()):
        raise ValueError(f"--sleep-after-idle {spec!r}: expected [MODEL=]SECONDS, seconds more than 0")
    return model.strip(), value


def server_tls(args: argparse.Namespace) -> ServerTlsSettings | None:
    """The listener's TLS from the ``--ssl-*`` flags (None: plain HTTP); ``ValueError`` for a set that cannot
    work."""
    if not args.ssl_certfile:
        for flag, value in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-ca-certs", args.ssl_ca_certs)):
            if value:
                raise ValueError(f"{flag} needs --ssl-certfile")
        if args.ssl_cert_reqs != ssl.CERT_NONE:
            raise ValueError("--ssl-cert-reqs needs --ssl-certfile")
        return None
    if args.ssl_cert_reqs != ssl.CERT_NONE and not args.ssl_ca_certs:
        raise ValueError(
            f"--ssl-cert-reqs {args.ssl_cert_reqs} needs --ssl-ca-certs (the CAs client certificates chain to)"
        )
    return ServerTlsSettings(
        certfile=args.ssl_certfile,
        keyfile=args.ssl_keyfile or None,
        ca_certs=args.ssl_ca_certs or None,
        cert_reqs=ssl.VerifyMode(args.ssl_cert_reqs),
    )


def _check_positive(args: argparse.Namespace) -> None:
    for flag in ("scrape_rate", "models_probe_rate", "eject_probe_rate", "wake_timeout"):
        if getattr(args, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be more than 0")
    for flag in ("min_awake", "sleep_drain_timeout"):
        if getattr(args, flag) < 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be 0 or more")


def settings_from_args(args: argparse.Namespace) -> ProxySettings:
    _check_positive(args)
    etcd = None
    if args.etcd:
        etcd = EtcdSettings(
            endpoints=parse_endpoints(args.etcd),
            timeout=args.etcd_timeout,
            dead_after=args.etcd_dead_after,
            burst_pause=args.etcd_burst_pause,
            keepalive_time=args.etcd_keepalive_time,
            keepalive_timeout=args.etcd_keepalive_timeout,
            cacert=args.etcd_cacert,
            cert=args.etcd_cert,
            key=args.etcd_key,
            user=args.etcd_user,
            password=read_password(args.etcd_password, args.etcd_password_file),
        )
    return ProxySettings(
        host=args.host,
        port=args.port,
        tls=server_tls(args),
        node_tls=NodeTlsSettings(
            ca_bundle=args.node_ca_bundle or None, cert=args.node_cert or None, key=args.node_key or None
        ),
        etcd=etcd,
        etcd_prefix=args.etcd_prefix,
        cluster=args.cluster,
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        mixed=tuple(args.mixed),
        models=tuple(args.model),
        admin_key=args.admin_key or None,
        admin_allow=tuple(ip_network(c, strict=False) for c in args.admin_allow_cidr),
        api_keys=tuple(args.api_key),
        api_key_file=args.api_key_file or None,
        queue_timeout=args.queue_timeout,
        queue_when_waiting=args.queue_when_waiting,
        wake_on_demand=args.wake_on_demand,
        wake_timeout=args.wake_timeout,
        sleep_after_idle=tuple(idle_flag(spec) for spec in args.sleep_after_idle),
        min_awake=args.min_awake,
        sleep_level=args.sleep_level,
        sleep_drain_timeout=args.sleep_drain_timeout,
        backend_api_key=args.backend_api_key or None,
        max_concurrent=args.max_concurrent_requests,
        max_body_bytes=args.max_body_bytes,
        body_timeout=args.body_timeout,
        max_header_bytes=args.max_header_bytes,
        policies=tuple(
            (r, getattr(args, f"{r}_policy") or args.policy or DEFAULT_POLICIES[r])
            for r in ("prefill", "decode", "mixed")
        ),
        max_attempts=args.max_attempts,
        max_resumes=args.max_resumes,
        affinity_header=args.affinity_header.lower(),
        scrape_load=args.scrape_load,
        pd_min_prompt_tokens=args.pd_min_prompt_tokens,
        tokenizers=tuple(tokenizer_flag(spec) for spec in args.tokenizer),
        timeouts=TimeoutSettings(
            connect=args.connect_timeout,
            prefill=args.prefill_timeout,
            first_byte=args.first_byte_timeout,
            stream_idle=args.stream_idle_timeout,
        ),
        ejection=EjectionSettings(
            after=args.eject_after,
            base_backoff=args.eject_backoff,
            max_backoff=args.eject_max_backoff,
            probe_rate=args.eject_probe_rate,
        ),
        shutdown_timeout=args.shutdown_timeout,
        shutdown_delay=args.shutdown_delay,
        models_refresh=args.models_refresh,
        models_probe_rate=args.models_probe_rate,
        scrape_rate=args.scrape_rate,
        max_connections=args.max_connections,
        log_level=args.log_level,
        workers=args.workers,
        otlp_traces_endpoint=traces_endpoint(args.otlp_traces_endpoint),
        kv_events=kv_event_flags(args.kv_events),
    )
