"""What a ``take()`` reads and records beside its groups: :class:`TrainerMonitor`.

The consumer's other Redis reads (its groups, its name lease) are :class:`~.groups.GroupQueue` and
:class:`~.groups.NameLease`; this class holds the rest, each one round trip: the statistics of a
take (:meth:`TrainerMonitor.mark_take`), the diagnosis of a wait (:meth:`TrainerMonitor.diagnose`),
the admission terms ``inspect`` shows, the stale-streak record, the bias ledger's counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from ..admission import AdmissionTerms, admission_capacity
from ..bias import PREFIX as _BIAS
from ..config import PipelineConfig
from ..events import FATAL, Event, events_to_read, now_ms, parse_events
from ..keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from ..redis_errors import is_oom
from ..redis_values import int_or, text
from .control import TAKEN_MESSAGE
from .guard import Guarded, Server, is_nogroup, memory_figures

BIAS_PREFIX = _BIAS.encode()

def _ledger_fields(state: Mapping[bytes, bytes]) -> dict[str, int]:
    """The ``bias:`` fields of a state hash as read (a damaged value counts 0: ``inspect`` names it)."""
    out: dict[str, int] = {}
    for name, value in state.items():
        if name.startswith(BIAS_PREFIX):
            try:
                out[name.decode()] = int(value)
            except (ValueError, UnicodeDecodeError):
                out[name.decode(errors="replace")] = 0
    return out


# -- views -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TakeStats:
    """What a ``take()`` reports beside its groups, read in one round trip."""

    groups_length: int
    groups_pending: int
    prompts_pending: int
    """In flight: pending in the prompt and retry streams."""
    admission_blocked_ms: int
    heartbeats: dict[bytes, bytes]
    bias: dict[str, int] = field(default_factory=dict)
    """The bias ledger's fields of the state hash (:mod:`~..bias`), the take's hand-backs added."""


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """Everything a waiting ``take()`` looks at to say why it waits, read in one round trip."""

    now_ms: int
    """When it was read (the clock heartbeats are judged against)."""
    heartbeats: dict[bytes, bytes]
    """The raw ``producers`` hash (parse with :class:`~..heartbeat.Heartbeat`)."""
    state: dict[str, str]
    """The ``state`` hash as text (damaged bytes replaced)."""
    groups_length: int
    groups_pending: int
    queued: int
    """Entries in the prompt and retry streams."""
    terms: AdmissionTerms
    """The admission rule's terms now (what ADMIT would compute)."""
    fatal: Event | None
    """The newest producer FATAL event, if any (recovered or not: see ``events.unrecovered``)."""
    memory: dict[str, Any] | None = None
    """Redis' memory figures (:func:`.guard.memory_figures`); None when INFO is not allowed."""

    @property
    def waiting(self) -> int:
        """Groups in the group stream not delivered to any trainer consumer yet."""
        return max(0, self.groups_length - self.groups_pending)


def _pending(reply: Any) -> int:
    """An XPENDING summary's count; a group that does not exist (NOGROUP) counts as 0, any other
    error is raised."""
    if isinstance(reply, ResponseError) and is_nogroup(reply):
        return 0
    if isinstance(reply, Exception):
        raise reply
    return int(reply["pending"])


def _raise_errors(replies: list[Any]) -> None:
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply


def _admission_terms(
    config: PipelineConfig,
    state: Mapping[str, Any],
    *,
    prompts: int,
    retry: int,
    groups_length: int,
    groups_pending: int,
) -> AdmissionTerms:
    """The one mapping from what Redis holds to the admission rule's terms."""
    return admission_capacity(
        prompts_pending=prompts,
        retry_pending=retry,
        groups_length=groups_length,
        groups_pending=groups_pending,
        committed=int_or(state.get(StateField.COMMITTED)),
        version_start_consumed=int_or(state.get(StateField.VERSION_START_CONSUMED)),
        prev_version_consumed=int_or(state.get(StateField.PREV_VERSION_CONSUMED)),
        steps_per_version=config.steps_per_version,
        max_staleness=config.max_staleness or 0,
        batch_size=config.batch_size,
    )


FATAL_SCAN = events_to_read(1, FATAL)
"""Events read (newest first) to find the newest FATAL one, as ``recent_events(count=1, kind=FATAL)``."""


class TrainerMonitor(Guarded):
    """A trainer's reads and records beside its groups, on one namespace (NOGROUP, NOPERM and OOM
    translated as for every namespace client)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def mark_take(self, bias: Mapping[str, int] | None = None) -> TakeStats:
        """Record the time of a ``take()`` (not when Redis is out of memory), add ``bias`` (the
        take's hand-backs to the bias ledger, :mod:`~..bias`) and read its statistics (one round
        trip), then announce it: producers refused for a full backlog retry at once instead
        of polling ADMIT every 0.2 s (docs/scale.md). The PUBLISH is a command of its own: a Redis
        Cluster pipeline cannot route it."""
        keys = self.keys
        added = {k: v for k, v in (bias or {}).items() if v}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(keys.state, StateField.LAST_TAKE_MS, now_ms())
            for name, count in added.items():
                pipe.hincrby(keys.state, name, count)
            pipe.xlen(keys.groups)
            pipe.xpending(keys.groups, TRAINER_GROUP)
            pipe.xpending(keys.prompts, PRODUCERS_GROUP)
            pipe.xpending(keys.retry, PRODUCERS_GROUP)
            pipe.hgetall(keys.state)
            pipe.hgetall(keys.producers)
            replies = await pipe.execute(raise_on_error=False)
        # The time of the take and the ledger are statistics: Redis refuses them at maxmemory, and
        # take() goes on.
        for reply in replies[: 1 + len(added)]:
            if isinstance(reply, Exception) and not is_oom(reply):
                raise reply
        replies = replies[1 + len(added):]
        _raise_errors(replies)
        groups_len, groups_pending, prompts_pending, retry_pending, state, beats = replies
        await self.redis.publish(keys.control, TAKEN_MESSAGE)
        return TakeStats(
            groups_length=int(groups_len),
            groups_pending=int(groups_pending["pending"]),
            prompts_pending=int(prompts_pending["pending"]) + int(retry_pending["pending"]),
            admission_blocked_ms=int_or(state.get(StateField.ADMISSION_BLOCKED_MS.encode())),
            heartbeats=dict(beats),
            bias=_ledger_fields(state),
        )

    async def bias(self) -> dict[str, int]:
        """The bias ledger's fields of the state hash (:mod:`~..bias`)."""
        return _ledger_fields(await self.redis.hgetall(self.keys.state))

    async def add_bias(self, bias: Mapping[str, int], forget: Sequence[str] = ()) -> None:
        """Add to the bias ledger (a committed batch, a producer's dead letter) and drop the
        fields of ``forget`` (epochs no longer kept); a statistic: refused at maxmemory, it is lost."""
        added = {k: v for k, v in bias.items() if v}
        if not added and not forget:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for name, count in added.items():
                pipe.hincrby(self.keys.state, name, count)
            if forget:
                pipe.hdel(self.keys.state, *forget)
            replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and not is_oom(reply):
                raise reply

    async def diagnose(self, config: PipelineConfig) -> Diagnosis:
        """Why a take waits, in one pipelined round trip: heartbeats, state, stream lengths, the
        admission terms, the newest FATAL event and Redis' memory figures (on a Cluster those are a
        second call: INFO goes to every node). A missing producers' group counts as empty (as
        for :meth:`admission_terms`); a missing trainer group is a deleted namespace (NamespaceGone)."""
        keys = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.producers)
            pipe.hgetall(keys.state)
            pipe.xlen(keys.groups)
            pipe.xlen(keys.prompts)
            pipe.xlen(keys.retry)
            pipe.xpending(keys.prompts, PRODUCERS_GROUP)
            pipe.xpending(keys.retry, PRODUCERS_GROUP)
            pipe.xpending(keys.groups, TRAINER_GROUP)
            pipe.xrevrange(keys.events, count=FATAL_SCAN)
            if in_pipeline := not isinstance(self.redis, RedisCluster):
                pipe.info("memory")  # a cluster sends INFO to every node: not in a pipeline
            replies = await pipe.execute(raise_on_error=False)
        beats, state_raw, groups_len, prompts_len, retry_len, prompts_raw, retry_raw, groups_raw, events = replies[:9]
        _raise_errors([beats, state_raw, groups_len, prompts_len, retry_len, groups_raw, events])
        if in_pipeline:  # an ACL role without INFO gets its refusal here: no figures, not an error
            memory = None if isinstance(replies[9], Exception) else memory_figures(replies[9])
        else:
            memory = await Server(self.redis).memory()
        prompts, retry, groups_pending = _pending(prompts_raw), _pending(retry_raw), int(groups_raw["pending"])
        state = {text(k): text(v) for k, v in state_raw.items()}
        fatal = parse_events(events, keys, 1, FATAL)
        return Diagnosis(
            now_ms=now_ms(),
            heartbeats=dict(beats),
            state=state,
            groups_length=int(groups_len),
            groups_pending=groups_pending,
            queued=int(prompts_len) + int(retry_len),
            terms=_admission_terms(
                config, state, prompts=prompts, retry=retry, groups_length=int(groups_len),
                groups_pending=groups_pending,
            ),
            fatal=fatal[0] if fatal else None,
            memory=memory,
        )

    async def admission_terms(self, config: PipelineConfig) -> AdmissionTerms:
        """The admission rule's terms now (what ADMIT would compute), read in one round trip; a
        stream or group that does not exist counts as empty."""
        keys = self.keys
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xpending(keys.prompts, PRODUCERS_GROUP)
            pipe.xpending(keys.retry, PRODUCERS_GROUP)
            pipe.xlen(keys.groups)
            pipe.xpending(keys.groups, TRAINER_GROUP)
            pipe.hmget(
                keys.state,
                [StateField.COMMITTED, StateField.VERSION_START_CONSUMED, StateField.PREV_VERSION_CONSUMED],
            )
            replies = await pipe.execute(raise_on_error=False)

        def pending(reply: object) -> int:
            return int(reply["pending"]) if isinstance(reply, dict) else 0

        fields = (StateField.COMMITTED, StateField.VERSION_START_CONSUMED, StateField.PREV_VERSION_CONSUMED)
        return _admission_terms(
            config, dict(zip(fields, replies[4], strict=True)), prompts=pending(replies[0]),
            retry=pending(replies[1]), groups_length=int_or(replies[2]), groups_pending=pending(replies[3]),
        )

    async def record_stale_streak(self, values: Mapping[str, int]) -> None:
        """Write a trainer's stale-recycling diagnosis (the ``StateField.STALE`` fields) for ``inspect``."""
        await self.redis.hset(self.keys.state, mapping={name: int(values[name]) for name in StateField.STALE})

