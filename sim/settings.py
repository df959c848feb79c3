"""How one simulated vLLM node is configured: built once by cli.py from flags and ``VLLM_SIM_*`` variables."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path


class Role(StrEnum):
    """What the node is in a disaggregated fleet; prefill and decode nodes run a (simulated) NixlConnector."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


def engine_id_for(node_id: str) -> str:
    """The NIXL engine id a node announces: a UUID, as in vLLM, but stable for a given node id."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"vllm-sim:{node_id}"))


@dataclass(frozen=True, kw_only=True)
class SimSettings:
    """One node's startup configuration, built by cli.py: the flag definitions hold the defaults, and a field has
    one here only when no flag sets it (a knob changed at runtime alone). The knobs start from these values."""

    host: str
    """Listen address."""
    port: int
    """Listen port."""
    models: tuple[str, ...]
    """Served model names; like vLLM's --served-model-name, the first one names responses and metrics."""
    model_root: str
    """The model path vLLM was started with (``root`` of the base models' cards); empty means the first served
    name, as vLLM's default served name is the model path."""
    tokenizer: Path | None
    """Encode text with the Hugging Face tokenizer of this directory (written there when it has none; see
    ``vocab``) instead of the word tokenizer; it is then the default ``root`` of the base models' cards."""
    loras: tuple[tuple[str, str], ...]
    """LoRA adapters served beside the base model, as vLLM's --lora-modules NAME=PATH: each has a model card with
    ``parent`` the first served name and ``root`` its path, and requests may name it."""
    lora_bases: tuple[tuple[str, str], ...]
    """Adapters whose --lora-modules JSON names a ``base_model_name``: their cards' ``parent``."""
    enable_lora: bool
    """vLLM's --enable-lora: requests may name adapters, the runtime routes may load them (--lora implies it)."""
    max_loras: int
    """vLLM's --max-loras: adapters in one batch; a request for one more waits (sim/lora.py)."""
    runtime_lora_updating: bool
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: only then are /v1/load_lora_adapter and /v1/unload_lora_adapter
    served."""
    dev_mode: bool
    """vLLM's VLLM_SERVER_DEV_MODE: only then are its development routes (sleep mode, cache resets) served."""
    lora_swap_time: float
    """Seconds added to the first token of a request whose adapter had to be swapped into a slot."""
    lora_load_time: float
    """Seconds POST /v1/load_lora_adapter takes."""
    lora_load_fail: int
    """When not 0, POST /v1/load_lora_adapter fails with this status (404: vLLM's "No adapter found")."""
    wake_time: float
    """Seconds POST /wake_up takes when it brings memory back (vLLM reloading the weights)."""
    wake_fail: int
    """When not 0, a POST /wake_up that brings memory back fails with this status (the node stays asleep)."""
    weights_gib: float
    """GiB of weights the node holds on its GPU while awake (``vllm_sim:gpu_memory_used_bytes``; sleep frees them)."""
    kv_cache_gib: float
    """GiB of KV cache the node holds on its GPU while awake."""
    gpu: Path | None
    """A directory standing for a GPU shared with the nodes given the same one (sim/gpu.py); None: its own."""
    gpu_capacity_gib: float
    """The shared GPU's memory: a start or a wake that would need more fails as CUDA's out of memory (0: no
    limit)."""
    role: Role
    """prefill/decode answer kv_transfer_params like NixlConnector; mixed has no connector and ignores them."""
    node_id: str
    """Name in logs, /sim/* and the x-sim-node header; empty means host:port."""
    ttft: float
    """Seconds from being scheduled to the first token (the simulated prefill)."""
    itl: float
    """Seconds between two generated tokens."""
    prefill_per_token: float
    """Seconds added to ttft per prompt token not found in the prefix cache (0: ttft ignores the cache)."""
    batch_slowdown: float
    """How much each other running sequence slows a step, as a batch slows vLLM's steps: a prefill or token gap
    that takes t alone takes t x (1 + batch_slowdown x (running - 1)), running counted when it starts (0: load
    changes nothing)."""
    output_len: int
    """Length of an answer before the simulated EOS (finish_reason "stop") when max_tokens allows it; counted
    from the start of the answer, so a continuation ends where the original would (see sim/tokens.py)."""
    max_num_seqs: int
    """Sequences generating at once, as vLLM's --max-num-seqs; more wait in a FIFO queue."""
    fail_rate: float
    """Fraction of inference requests answered at once with fail_status and vLLM's error JSON."""
    fail_status: int
    """HTTP status of injected failures (500, or 503/429 to look busy)."""
    fail_after_tokens: int
    """When > 0, every generation fails after this many tokens (streams end with an error event)."""
    hang: bool
    """Accept and schedule inference requests but never answer them (until hang is switched off)."""
    hang_after_tokens: int
    """When > 0, every generation stops sending after this many tokens without closing (until the client leaves
    or the knob is raised or set to 0)."""
    set_cookie: str = ""
    """A ``Set-Cookie`` value sent with every completion response (empty: none), as a cookie-setting gateway."""
    startup_delay: float
    """Seconds during which /health answers 503, like a vLLM server still loading its model."""
    unhealthy_file: Path | None
    """While this file exists /health answers 503: lets a test flip health from outside."""
    api_key: str | None
    """Like vLLM's --api-key: every /v1/* route then needs ``Authorization: Bearer KEY``."""
    max_model_len: int
    """Context length: prompt plus max_tokens beyond it is a 400, as in vLLM."""
    side_channel_host: str
    """Host announced as remote_host in kv_transfer_params; empty means host."""
    side_channel_port: int
    """Port announced as remote_port (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default); nothing listens on it."""
    block_size: int
    """Tokens per KV block (vLLM's --block-size): the prefix cache's unit, and what sizes remote_block_ids."""
    cache_blocks: int
    """KV blocks of the simulated cache; 0 disables prefix caching."""
    kv_events_config: str
    """vLLM's ``--kv-events-config`` JSON; with ``enable_kv_cache_events`` the node publishes its cache's events
    (kvevents.py). Empty: none."""
    kv_events_drop: int = 0
    """The next this many event batches are numbered and kept for replay, but not sent (a gap for subscribers)."""
    kv_events_corrupt: int = 0
    """The next this many event batches are sent with a payload that is not msgpack."""
    kv_events_encoding: str = "map"
    """Events as vLLM 0.32 sends them, maps tagged by ``type`` ("map"), or as older tagged arrays ("array")."""
    kv_events_hash: str = "int"
    """Block hashes published as unsigned 64-bit ints ("int", vLLM's default) or as bytes ("bytes")."""
    kv_replay_frames: int
    """Frames per replay answer: vLLM 0.32's four, ``[b"", topic, seq, payload]``, or older vLLM's three,
    ``[b"", seq, payload]`` (the end marker alike, with seq -1)."""
    scaling: bool
    """Answer every request (but /sim/*) with 503 as vLLM's elastic-EP ScalingMiddleware does while it scales."""
    ssl_certfile: str | None
    """Serve HTTPS with this PEM certificate (vLLM's --ssl-certfile); None: plain HTTP."""
    ssl_keyfile: str | None
    """Its PEM private key (vLLM's --ssl-keyfile)."""
    ssl_ca_certs: str | None
    """CAs client certificates must chain to (vLLM's --ssl-ca-certs)."""
    ssl_cert_reqs: int
    """vLLM's --ssl-cert-reqs: 0 no client certificate, 1 optional, 2 required."""
    log_level: str
    """Python logging level name."""

    @property
    def name(self) -> str:
        """The node id, defaulting to host:port (bracketed for IPv6)."""
        if self.node_id:
            return self.node_id
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def engine_id(self) -> str:
        return engine_id_for(self.name)

    @property
    def served_model(self) -> str:
        """The name vLLM puts in responses and metric labels whatever alias was requested."""
        return self.models[0]

    @property
    def root(self) -> str:
        """``root`` of the base models' cards."""
        return self.model_root or (str(self.tokenizer) if self.tokenizer else "") or self.served_model

    @property
    def kv_host(self) -> str:
        return self.side_channel_host or self.host
