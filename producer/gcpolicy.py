"""The producer process's cyclic garbage collector, tuned once the producer has started.

Reference counting frees what a producer allocates per request (replies, samples, tasks); the
cyclic collector only looks for cycles, and with Python's thresholds ``(700, 10, 10)`` it looks
often: a young collection every 700 net container allocations (a few requests' worth of
coroutines, futures and handles), and every hundredth a full one that walks every object the
process holds, its imports included. At 256 requests in flight with 1k-token replies that was
a tenth to a fifth of the producer's CPU (``python -m bench episodes``, docs/benchmarks.md).

:func:`tune` does what SGLang and vLLM do in their servers: one last full collection, then
``gc.freeze()`` (what start-up allocated moves to a generation no collection walks), and a young
threshold of ``young`` net allocations instead of 700. Objects then have time to die by their
reference count before a collection sees them, few survive into the older generations, and full
collections become rare. Cycles are still collected; at most ``young`` extra container objects
wait for it (a few MiB). The CLI calls it (``rollstream produce --gc-threshold``); a library user
running a :class:`~rollstream.producer.worker.Producer` in their own process decides for it.
"""

from __future__ import annotations

import gc
import logging

from rollstream.common.checked import is_int
from rollstream.common.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_YOUNG = 50_000
"""The young-generation threshold :func:`tune` sets (Python's is 700)."""


def check(young: int | None) -> int:
    """``young`` validated (None: :data:`DEFAULT_YOUNG`)."""
    if young is None:
        return DEFAULT_YOUNG
    if not is_int(young) or young < 0:
        raise ConfigError(f"gc threshold must be a non-negative integer (0: Python's own), got {young!r}")
    return young


def tune(young: int | None = None) -> None:
    """Freeze what exists now and collect the young generation every ``young`` net container
    allocations (None: :data:`DEFAULT_YOUNG`); ``young`` 0 leaves the collector as Python set it."""
    young = check(young)
    if young == 0:
        return
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young, middle, old)
    logger.debug("gc: %d objects frozen, thresholds %s", gc.get_freeze_count(), gc.get_threshold())
