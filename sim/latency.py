"""Request latency histograms as vLLM V1 keeps them (vllm/v1/metrics/loggers.py): time to first token, the time
between output tokens, and end to end. Buckets are vLLM's, so a scraper reads the same figures from a simulated
node as from a real one."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


@dataclass
class Histogram:
    """Observations per bucket (not cumulative; the exporter sums them), their sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (upper bound, count) pairs, +Inf last, as Prometheus wants them."""
        running = 0
        pairs = []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            pairs.append((bound, float(running)))
        return pairs


@dataclass
class Latencies:
    """The three histograms of one node."""

    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
