"""What a test may change at runtime through POST /sim/config; every knob starts from the SimSettings field of
the same name."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from vllm_etcd_proxy.sim.settings import SimSettings


@dataclass(kw_only=True)
class Knobs:
    """The runtime knobs; see SimSettings for each one's meaning."""

    ttft: float
    itl: float
    prefill_per_token: float
    batch_slowdown: float
    output_len: int
    max_num_seqs: int
    fail_rate: float
    fail_status: int
    fail_after_tokens: int
    hang: bool
    hang_after_tokens: int
    set_cookie: str
    """A ``Set-Cookie`` value sent with every generation response; empty sends none (cookie-leak tests)."""
    kv_events_drop: int
    kv_events_corrupt: int
    kv_events_encoding: str
    kv_events_hash: str
    kv_replay_frames: int
    scaling: bool
    """While true, every request but /sim/* is answered 503 as by vLLM's elastic-EP scaling (``scaling.py``)."""
    lora_swap_time: float
    lora_load_time: float
    lora_load_fail: int

    @classmethod
    def from_settings(cls, settings: SimSettings) -> Knobs:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update; a bad name or value is a ValueError and changes nothing."""
        validated: dict[str, Any] = {}
        for name, value in changes.items():
            current = getattr(self, name, None) if name in {f.name for f in fields(self)} else None
            if current is None:
                raise ValueError(f"unknown knob {name!r}")
            if isinstance(current, str):
                ok = isinstance(value, str)
            elif isinstance(current, bool):
                ok = isinstance(value, bool)
            elif isinstance(current, int):
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            else:
                ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
            if not ok:
                raise ValueError(f"bad value for {name}: {value!r}")
            validated[name] = float(value) if isinstance(current, float) else value
        if validated.get("max_num_seqs", self.max_num_seqs) < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if validated.get("fail_rate", self.fail_rate) > 1:
            raise ValueError("fail_rate must be between 0 and 1")
        if validated.get("kv_events_encoding", self.kv_events_encoding) not in ("map", "array"):
            raise ValueError("kv_events_encoding must be map or array")
        if validated.get("kv_events_hash", self.kv_events_hash) not in ("int", "bytes"):
            raise ValueError("kv_events_hash must be int or bytes")
        if validated.get("kv_replay_frames", self.kv_replay_frames) not in (3, 4):
            raise ValueError("kv_replay_frames must be 3 or 4")
        if not 100 <= validated.get("fail_status", self.fail_status) <= 599:
            raise ValueError("fail_status must be an HTTP status")
        for name, value in validated.items():
            setattr(self, name, value)
