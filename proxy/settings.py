"""Everything a replica is configured with, built only by ``flags.settings_from_args`` (flags + environment):
no field has a default here, the flag definitions hold them all."""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network

from vllm_etcd_proxy.fleet.etcd import EtcdSettings
from vllm_etcd_proxy.fleet.tls import NodeTlsSettings
from vllm_etcd_proxy.proxy.discovery.ejection import EjectionSettings
from vllm_etcd_proxy.proxy.operations.tls import ServerTlsSettings


@dataclass(frozen=True, kw_only=True)
class TimeoutSettings:
    """Upstream timeouts, in seconds."""

    connect: float
    """TCP/TLS connect to a node."""
    prefill: float
    """Whole prefill leg (queueing + prompt processing)."""
    first_byte: float
    """Until response headers; a non-streamed completion sends them only when generation is done."""
    stream_idle: float
    """Longest gap between two chunks of a response body before the stream is cut."""


@dataclass(frozen=True, kw_only=True)
class ProxySettings:
    """One replica's configuration."""

    host: str
    """Listen address."""
    port: int
    """Listen port."""
    tls: ServerTlsSettings | None
    """The listener's TLS (``--ssl-*``, reloaded on SIGHUP); None: plain HTTP."""
    node_tls: NodeTlsSettings
    """How ``https://`` nodes are checked (``--node-ca-bundle``) and answered (``--node-cert``)."""
    etcd: EtcdSettings | None
    """etcd connection; None means static pools only (the embedded default)."""
    etcd_prefix: str
    """Key prefix: keys are {prefix}/{cluster}/{role}/{node_id}."""
    cluster: str
    """Cluster name inside the prefix, so several fleets can share one etcd."""
    prefill: tuple[str, ...]
    """Static prefill nodes, host:port or URL."""
    decode: tuple[str, ...]
    """Static decode nodes, host:port or URL."""
    mixed: tuple[str, ...]
    """Static mixed (non-disaggregated) nodes, host:port or URL."""
    models: tuple[str, ...]
    """Models the static nodes serve; empty means ask each node's GET /v1/models."""
    admin_key: str | None
    """Key for /instances/*; None disables the admin API (403)."""
    admin_allow: tuple[IPv4Network | IPv6Network, ...]
    """Networks allowed as /instances/add targets; empty allows any address."""
    api_keys: tuple[str, ...]
    """Client keys for /v1/*, /tokenize, /detokenize; empty leaves them open."""
    api_key_file: str | None
    """``--api-key-file``: a key per line with its tenant and limits (tenancy/keys.py); reloaded on SIGHUP."""
    queue_timeout: float
    """Seconds a request may wait in this replica while every node of its model is full (then 503); 0: no queue."""
    queue_when_waiting: int
    """With the queue on, a node whose scraped waiting queue holds this many counts as full (0: only
    --max-connections makes a node full)."""
    wake_on_demand: bool
    """A request whose model has no node awake but some asleep waits while one of them is woken."""
    wake_timeout: float
    """Seconds such a request waits before 503 with Retry-After."""
    sleep_after_idle: tuple[tuple[str, float], ...]
    """(model, seconds): a node of the model (``""``: any) idle that long fleet-wide is put to sleep."""
    min_awake: int
    """Nodes of each model idle sleeps always leave awake."""
    sleep_level: int
    """vLLM's sleep level for idle sleeps (0, 1 or 2)."""
    sleep_drain_timeout: float
    """Seconds a node going to sleep may take to finish its requests (then vLLM's mode=wait lets them finish)."""
    backend_api_key: str | None
    """Key sent to nodes started with vLLM's --api-key; None passes the client's Authorization through."""
    max_concurrent: int
    """Proxied requests in flight on this replica before new ones get 503 + Retry-After; 0 = no limit."""
    policies: tuple[tuple[str, str], ...]
    """(role, policy) for each role (by default affinity where a prefix cache saves work, by the nodes' KV events
    where they publish them, else by content; load where it does not)."""
    affinity_header: str
    """Header naming a session for consistent-hash; else the body's ``user``, else the prompt's start."""
    pd_min_prompt_tokens: int
    """A disaggregated model's request whose prompt has fewer new (uncached) tokens than this skips the prefill
    leg and goes straight to a decode node; 0 never skips."""
    tokenizers: tuple[tuple[str, str], ...]
    """(model, tokenizer directory or hub id) from --tokenizer: the token ids routing reads
    (kvcache/prompt/tokens.py)."""
    scrape_load: float
    """Seconds between scrapes of each node's /metrics queue for the load-aware policies; 0 = off."""
    max_resumes: int
    """Times one stream may go on from another node after its node failed mid-way; 0 turns resuming off."""
    max_attempts: int
    """Nodes tried for one leg before the request fails (only before its first byte reached the client)."""
    timeouts: TimeoutSettings
    """Upstream timeouts."""
    ejection: EjectionSettings
    """When failing nodes leave this replica's routing and how they are probed back."""
    shutdown_delay: float
    """Seconds /ready answers 503 after SIGTERM while the replica still serves, before it stops listening."""
    shutdown_timeout: float
    """Seconds SIGTERM waits for in-flight requests and streams before the replica exits anyway."""
    max_body_bytes: int
    """Largest request body (413 above)."""
    max_header_bytes: int
    """Largest total size of request headers (431 above)."""
    body_timeout: float
    """Seconds a client may take to send its body (408 after), so slow senders cannot hold resources."""
    models_refresh: float
    """Seconds between GET /v1/models polls of nodes whose record names no models."""
    scrape_rate: float
    """Load scrapes a second at most over all nodes (a fifth of them for nodes without traffic, new or failing)."""
    models_probe_rate: float
    """GET /v1/models probes a second at most over all nodes (half of them for refreshes and failing nodes)."""
    max_connections: int
    """Connections open to one node at most; requests beyond wait for one (within the first-byte timeout)."""
    workers: int
    """Processes serving the port (SO_REUSEPORT), each with its own watch and pools; one per core."""
    kv_events: tuple[tuple[str, str, str | None], ...]
    """Static nodes' KV-event publishers: (node as given to --prefill/--decode/--mixed, endpoint, replay or None)."""
    otlp_traces_endpoint: str | None
    """Where OTLP/HTTP traces go (a span per request, a child per leg); None: no tracing at all."""
    log_level: str
    """Python logging level name."""
