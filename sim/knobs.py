"""What a test may change at runtime through POST /sim/config; every knob starts from the SimSettings field of
the same name."""

from __future__ import annotations

from collections.abc import Callable
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
    wake_time: float
    wake_fail: int

    @classmethod
    def from_settings(cls, settings: SimSettings) -> Knobs:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update; a bad name or value is a ValueError and changes nothing."""
        validated = {name: self._checked(name, value) for name, value in changes.items()}
        for name, allowed, message in _RANGES:
            if not allowed(validated.get(name, getattr(self, name))):
                raise ValueError(message)
        for name, value in validated.items():
            setattr(self, name, value)

    def _checked(self, name: str, value: Any) -> Any:
        """``value`` as knob ``name`` holds it; a ValueError for an unknown knob or a value of another kind."""
        current = getattr(self, name, None) if name in {f.name for f in fields(self)} else None
        if current is None:
            raise ValueError(f"unknown knob {name!r}")
        if not _same_kind(current, value):
            raise ValueError(f"bad value for {name}: {value!r}")
        return float(value) if isinstance(current, float) else value


def _same_kind(current: Any, value: Any) -> bool:
    """Whether ``value`` may replace ``current``: a string, a switch, or a number from 0 (whole for a count)."""
    if isinstance(current, str):
        return isinstance(value, str)
    if isinstance(current, bool):
        return isinstance(value, bool)
    if isinstance(current, int):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


_RANGES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("max_num_seqs", lambda seqs: seqs >= 1, "max_num_seqs must be >= 1"),
    ("fail_rate", lambda rate: rate <= 1, "fail_rate must be between 0 and 1"),
    ("kv_events_encoding", lambda encoding: encoding in ("map", "array"), "kv_events_encoding must be map or array"),
    ("kv_events_hash", lambda form: form in ("int", "bytes"), "kv_events_hash must be int or bytes"),
    ("kv_replay_frames", lambda frames: frames in (3, 4), "kv_replay_frames must be 3 or 4"),
    ("fail_status", lambda status: 100 <= status <= 599, "fail_status must be an HTTP status"),
    ("wake_fail", lambda status: status == 0 or 400 <= status <= 599, "wake_fail must be 0 or an error status"),
)
"""What a knob's value must be besides of its kind (checked on the knobs as they would be after the update)."""
