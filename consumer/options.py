"""The trainer's consumer options, listed once: :class:`ConsumerOptions`.

``GroupConsumer.connect(...)`` and ``SyncGroupConsumer(...)`` take them as keyword arguments
(typed by :class:`ConsumerOptionArgs`, which a test keeps equal to the dataclass) and build one
``ConsumerOptions``, checked when built: a bad option is a :class:`ConfigError` before anything
connects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypedDict

from rollstream.common.codec import DEFAULT_LIMITS, CodecLimits
from rollstream.common.errors import ConfigError

from .filters import KeepFilter

NAME_LEASE_SECONDS = 10.0
"""A trainer's hold on its consumer name lasts this long unless renewed (every quarter of it)."""
NAME_WAIT_SECONDS = NAME_LEASE_SECONDS + 2.0
"""How long ``connect`` waits for a consumer name held by another trainer (it may have crashed)."""

OnProducerFailure = Literal["raise", "warn"]
PayloadCheck = Literal["checksum", "size"]


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    """What a trainer chooses when it connects (the namespace's config holds the rest)."""

    n_samples: int | None = None
    """Expected ``n_samples_per_prompt``: ``ConfigError`` when the namespace differs (None: any)."""
    batch_size: int | None = None
    """Expected ``batch_size``, as ``n_samples``."""
    keep: KeepFilter | None = None
    """The dynamic-sampling filter (named only here, by the trainer's own code: nothing is imported
    from Redis); ``take(keep=...)`` overrides it for one call. With a payload store it runs before
    any fetch: a sample's offloaded arrays (its tokens too) are ``Unfetched`` there and its text an
    ``UnfetchedText``, their lengths known, their values refused (``PayloadNotFetched``). A filter
    that reads them anyway is not an error: ``take()`` fetches that group (checksums verified,
    whatever ``payload_check``) and runs the filter again on the values; an object that cannot be
    read recycles the group with the reason. Filters on rewards, lengths and versions fetch nothing."""
    on_producer_failure: OnProducerFailure = "raise"
    """``raise``: ``take()`` raises ``ProducerFailed`` for an unrecovered producer failure; ``warn``
    logs it once instead."""
    stall_timeout: float = 300.0
    """Seconds without a live producer (or with nothing but stale groups) before ``take()`` raises
    ``PipelineStalled`` (``AllGroupsStale``)."""
    warn_interval: float = 30.0
    """Seconds between the warnings of a ``take()`` that waits."""
    limits: CodecLimits = DEFAULT_LIMITS
    """Size limits for decoding a group entry (over them: dead-lettered)."""
    name_wait: float = NAME_WAIT_SECONDS
    """Seconds ``connect`` waits for the consumer name while another trainer holds it (a crashed
    holder's hold expires within ``NAME_LEASE_SECONDS``), then ``ConsumerNameInUse``."""
    payload_check: PayloadCheck = "checksum"
    """With a payload store (docs/wire.md): what ``take()`` checks of each group's objects before
    it counts the group. ``checksum``: every object is read and its CRC-32 verified (one read of
    every byte by the taking process; ``fs`` maps the files, so it reads the page cache), the
    arrays are then in the batch. ``size``: each object is only looked up (present, right size),
    and the arrays are fetched on first access, by whichever rank uses them
    (``batch.shard(rank, world_size)``), their checksum verified then (a mismatch raises
    ``PayloadCorrupt``, never a wrong array); until then an offloaded field (the tokens too) is an
    ``Unfetched`` placeholder (the text an ``UnfetchedText``) whose values raise ``PayloadNotFetched``.
    A group whose check fails is recycled with the reason, naming the store and the key."""

    def __post_init__(self) -> None:
        if self.on_producer_failure not in ("raise", "warn"):
            raise ConfigError("on_producer_failure must be 'raise' or 'warn'")
        if not self.stall_timeout > 0 or not self.warn_interval > 0:
            raise ConfigError("stall_timeout and warn_interval must be positive")
        if not self.name_wait >= 0:
            raise ConfigError(f"name_wait must be >= 0 seconds, got {self.name_wait!r}")
        if self.payload_check not in ("checksum", "size"):
            raise ConfigError(f"payload_check must be 'checksum' or 'size', got {self.payload_check!r}")
        if self.keep is not None and not callable(self.keep):
            raise ConfigError(f"keep must be a callable (group -> verdict) or None, got {type(self.keep).__name__}")


class ConsumerOptionArgs(TypedDict, total=False):
    """:class:`ConsumerOptions` as keyword arguments (``**options: Unpack[ConsumerOptionArgs]``)."""

    n_samples: int | None
    batch_size: int | None
    keep: KeepFilter | None
    on_producer_failure: OnProducerFailure
    stall_timeout: float
    warn_interval: float
    limits: CodecLimits
    name_wait: float
    payload_check: PayloadCheck
