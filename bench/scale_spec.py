"""What one scale benchmark run measures (``bench.scale``): its steps' producer counts and
everything they share; ``BIG`` is ``python -m bench scale``, ``QUICK`` its ``--quick``."""

from __future__ import annotations

from dataclasses import dataclass, field

N = 8
"""Samples per prompt."""


@dataclass
class Spec:
    """One benchmark run: the producer counts of its steps and everything they share."""

    producers: list[int]
    hosts: int = 8
    concurrency: int = 16
    """Samples in flight per producer: ``concurrency // N`` groups."""
    latency: float = 4.0
    """Seconds per engine request (the simulator's base latency, sigma 0)."""
    tokens: int = 32
    lease: float = 10.0
    max_staleness: int = 2
    warmup_batches: int = 2
    measured_batches: int = 6
    slowlog_batches: int = 2
    tail_batches: int = 6
    """Batches after the SIGKILL (the reclaim happens while they are taken)."""
    kill_fraction: float = 0.25
    full_backlog_s: float = 5.0
    """Each of the two windows with the trainer holding off and the backlog full."""
    sizes: list[list[int]] = field(default_factory=lambda: [[8, 1024], [8, 8192], [16, 32768]])
    size_repeats: int = 24
    admit_consumers: list[int] = field(default_factory=lambda: [8, 32, 128, 512, 2048])
    pending_sizes: list[int] = field(default_factory=lambda: [256, 4096, 32768])
    variants: list[str] = field(default_factory=lambda: [""])
    """Producer variants ("" = this code; others: bench.worker ``--variant``), side by side in one run."""
    variant_producers: list[int] = field(default_factory=list)
    """The steps (producer counts) that run every variant; the others run this code only."""
    timeout: float = 1500.0
    """The whole run's deadline (seconds): the driver is killed past it."""

    def batch(self, producers: int) -> int:
        """Groups per batch: one round of every producer's groups in flight."""
        return producers * (self.concurrency // N)

    def batches(self) -> int:
        return self.warmup_batches + self.measured_batches + self.slowlog_batches + self.tail_batches


BIG = Spec(producers=[8, 32, 128], variants=["", "before"], variant_producers=[128])
QUICK = Spec(producers=[8], hosts=2, measured_batches=3, tail_batches=4, sizes=[[8, 1024]], size_repeats=8,
             admit_consumers=[8, 128], pending_sizes=[256, 4096])
