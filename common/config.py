"""The namespace's pipeline config: written once by ``rollstream init``, read by everyone.

Validated on construction (``ConfigError``, a ``ValueError``; never ``assert``); stored as a plain Redis hash so
``HGETALL rollstream:{ns}:config`` reads like the command line that wrote it. It holds data only:
nothing read from Redis names code to import (a keep filter is the trainer's own argument), and
unknown fields, such as the ``keep`` of older versions, are ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .checked import is_int
from .errors import ConfigError
from .redis_values import RawHash

STALENESS_RULES = ("newest_token", "oldest_token")


@dataclass(frozen=True, slots=True)
class PipelineConfig:
    n_samples_per_prompt: int
    """Samples per prompt: every group has exactly this many."""
    batch_size: int
    """Groups per training step (``rollout_batch_size``); used by staleness-aware admission."""
    max_staleness: int | None = None
    """Groups older than this many weight versions are recycled (and admission keeps producers from
    generating them); unset disables the filter."""
    max_backlog: int = 256
    """Producers stop admitting while this many groups wait for the trainer (``XLEN groups``)."""
    lease_seconds: float = 120.0
    """Seconds a prompt may sit in a producer's pending list unrenewed before another producer takes
    it over (a producer renews its own leases while it works)."""
    max_attempts: int = 5
    """Times a prompt may be recycled (aborted, failed; not for staleness) before it goes to the
    dead-letter stream."""
    partial_rollout: bool = True
    """An engine call aborted by a weight update continues from its tokens on the new weights (an
    aborted sample that reached the trainer is continued by the next attempt) instead of being
    generated again; on by default since issue 38 (docs/staleness.md)."""
    staleness_rule: str = "newest_token"
    """How a group's staleness is counted (docs/staleness.md): ``newest_token`` (from the newest
    version of any of its tokens, the one it was finished under: a long or continued generation
    is not penalised for its length) or ``oldest_token`` (from its oldest token: strict)."""
    admission_control: bool | None = None
    """Staleness-aware admission; None means on when ``max_staleness`` is set."""
    recycle_filtered: bool = False
    """Groups rejected by the dynamic-sampling filter are recycled instead of dropped."""
    heartbeat_timeout: float = 15.0
    """Seconds after its last heartbeat a producer counts as dead (its prompts are taken over)."""
    steps_per_version: int = 1
    """Training steps per weight version the trainer declares (staleness-aware admission)."""
    max_backlog_bytes: int = 0
    """Byte budget of the group stream: producers stop admitting while the group data held in
    Redis (ready and taken, not committed) plus the prompts in flight at the mean group size
    reaches it, and groups are ready. 0 = no budget (``max_backlog`` alone bounds the backlog)."""
    durable_episodes: bool = False
    """Every finished step of a user-written episode is journaled in Redis, and a producer that
    takes the prompt over resumes the episode from it (docs/rollouts.md). Off by default: the
    journal costs Redis memory for every step held (docs/benchmarks.md)."""
    max_group_bytes: int = 512 * 1024 * 1024
    """A group whose encoded data is larger is dead-lettered (``group_too_large``), not published
    (512 MiB: Redis' ``proto-max-bulk-len`` default)."""
    row_stats: int = 0
    """Per-row statistics kept (``Keys.rows``) over this many last groups of each row, for a
    feeder curriculum (``feed --curriculum``); 0 = none."""
    mix: str = ""
    """The sources' weights, ``NAME=WEIGHT,...`` (``rollstream init --mix``): every batch
    ``take()`` returns holds each source's share exactly; "" = one unnamed source, no mix."""

    archive_bytes: int = 0
    """Byte budget of the archive stream (every group's fate, read by ``rollstream archive``);
    past it the oldest unarchived records are dropped and counted. 0 = no archive."""
    payload_store: str = ""
    """Where per-token arrays too large for a stream entry go (``fs:///dir``,
    ``mooncake://HOST:PORT?metadata=URL``; docs/wire.md): the entry keeps a reference (key,
    size, checksum) per object. "" = none, every array rides in the entry."""
    payload_min_bytes: int = 64 * 1024
    """With a payload store: a sample's packed array of at least this many bytes leaves the entry."""

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        positive_int("n_samples_per_prompt")
        positive_int("batch_size")
        positive_int("max_backlog")
        positive_int("max_attempts")
        positive_int("steps_per_version")
        if self.max_staleness is not None and (not is_int(self.max_staleness) or self.max_staleness < 0):
            raise ConfigError(f"max_staleness must be a non-negative integer or None, got {self.max_staleness!r}")
        if not isinstance(self.lease_seconds, int | float) or not self.lease_seconds >= 1:
            raise ConfigError(f"lease_seconds must be at least 1, got {self.lease_seconds!r}")
        if not isinstance(self.heartbeat_timeout, int | float) or not self.heartbeat_timeout > 0:
            raise ConfigError(f"heartbeat_timeout must be positive, got {self.heartbeat_timeout!r}")
        for name in ("max_backlog_bytes", "max_group_bytes", "archive_bytes"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ConfigError(f"{name} must be a non-negative integer (bytes), got {value!r}")
        if not is_int(self.payload_min_bytes) or (
            self.payload_min_bytes < 1
        ):
            raise ConfigError(f"payload_min_bytes must be a positive integer (bytes), got {self.payload_min_bytes!r}")
        if self.payload_store:
            from .payload.store import check_store_url

            check_store_url(self.payload_store)
        if self.max_group_bytes == 0:
            raise ConfigError("max_group_bytes must be positive")
        if self.staleness_rule not in STALENESS_RULES:
            raise ConfigError(
                f"staleness_rule must be one of {', '.join(STALENESS_RULES)}, got {self.staleness_rule!r}"
            )
        if self.admission_control and self.max_staleness is None:
            raise ConfigError("admission_control needs max_staleness")
        if not is_int(self.row_stats) or not 0 <= self.row_stats <= 64:
            raise ConfigError(f"row_stats must be an integer 0..64, got {self.row_stats!r}")
        from .mix import parse_mix

        parse_mix(self.mix)  # ConfigError when malformed

    @property
    def weights(self) -> dict[str, float]:
        """The mix as ``{source: weight}`` (empty: no mix)."""
        from .mix import parse_mix

        return parse_mix(self.mix)

    @property
    def admission_enabled(self) -> bool:
        if self.max_staleness is None:
            return False
        return True if self.admission_control is None else self.admission_control

    def to_redis(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                out[f.name] = ""
            elif isinstance(value, bool):
                out[f.name] = "1" if value else "0"
            else:
                out[f.name] = str(value)
        return out

    @classmethod
    def from_redis(cls, raw: RawHash) -> PipelineConfig:
        text = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in text:
                continue
            value = text[f.name]
            kind = str(f.type)
            try:
                if value == "" and "None" in kind:
                    kwargs[f.name] = None
                elif kind.startswith("bool"):
                    kwargs[f.name] = value == "1"
                elif kind.startswith("int"):
                    kwargs[f.name] = int(value)
                elif kind.startswith("float"):
                    kwargs[f.name] = float(value)
                else:
                    kwargs[f.name] = value
            except ValueError:
                raise ConfigError(f"config field {f.name}={value!r} in Redis is not a valid {kind}") from None
        missing = {"n_samples_per_prompt", "batch_size"} - kwargs.keys()
        if missing:
            raise ConfigError(f"config in Redis lacks {', '.join(sorted(missing))}")
        return cls(**kwargs)

    def check_matches(self, **expected: Any) -> None:
        """Raise ConfigError when a flag given to a process disagrees with the namespace."""
        for name, value in expected.items():
            if value is None:
                continue
            actual = getattr(self, name)
            if actual != value:
                raise ConfigError(
                    f"this process was started with {name}={value!r} but the namespace is "
                    f"configured with {name}={actual!r}; fix the flag or re-run `rollstream init`"
                )
