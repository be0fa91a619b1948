"""Durable episodes (``rollstream init --durable-episodes``): every finished step of an episode is
journaled in Redis, and the producer that takes the prompt over replays it.

A *step* is an engine call's reply (tokens, log-probs, versions, spans, finish reason), an
``observe()`` (only a digest of its tokens: the user's code produces them again) or an
``episode.once(key, fn)`` result. :class:`PromptJournal` is one prompt attempt's journal: the
steps read when the producer starts the prompt (``{}`` for a fresh one) and the writer, which
appends one step at a time under the attempt's lease (the JOURNAL_APPEND script: a producer
whose prompt was taken over writes nothing). :class:`EpisodeLog` is one member's part.

Replay: while the journal has steps, each call compares what it is about to do with the next
journaled step, a digest of the request (the trajectory's token ids, the length limit and the
sampling parameters) or of the observed tokens. Equal: the journaled reply is the answer, and no
engine call is made. Different (a nondeterministic tool, changed code) or undecodable: the rest
of the journal is dropped (the next append replaces it), the episode goes on live, and the
divergence is counted (``resume_diverged``) and logged once with the step. Versions come from
the journaled replies, so a resumed episode's staleness is the uninterrupted one's.

Writing is best effort by design: a journal that cannot be written (the byte budget is reached,
the lease was lost, Redis is unreachable) stops journaling that episode, which then runs as
without durable episodes; the prompt's own hand-overs stay exact.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
from rollstream.common.arrays import Packed
from rollstream.common.codec.wire import DEFAULT_LIMITS, from_le_bytes, le_bytes, unpackb
from rollstream.common.connection import TRANSIENT_ERRORS

from .engine import Generation

logger = logging.getLogger(__name__)

Append = Callable[[int, int, bytes], Awaitable[str]]
"""``(member, seq, step) -> 'ok' | 'lost' | 'full'``: the JOURNAL_APPEND script for one prompt."""


@dataclass(slots=True)
class JournalStats:
    """A producer's journal counters (heartbeat, metrics, the benchmark)."""

    journaled: int = 0
    """Steps appended."""
    replayed: int = 0
    """Steps answered from a journal (no engine call, no ``once`` function run)."""
    resumed: int = 0
    """Episodes that started with a journal."""
    diverged: int = 0
    """Resumed episodes that met a different step and went on live (``resume_diverged``)."""
    unwritten: int = 0
    """Episodes whose journaling stopped: byte budget, lost lease or Redis unreachable."""


def pack_ints(values: array[int] | Sequence[int]) -> bytes:
    return bytes(le_bytes(values if isinstance(values, array) and values.typecode == "i" else array("i", values)))


def unpack_ints(raw: bytes) -> array[int]:
    return from_le_bytes("i", raw)


def pack_floats(values: array[float]) -> bytes:
    return bytes(le_bytes(values if values.typecode == "f" else array("f", values)))


def unpack_floats(raw: bytes) -> array[float]:
    return from_le_bytes("f", raw)


def routing_rows(held: Packed | None, generations: Sequence[Generation]) -> Packed | None:
    """The routing rows a trajectory holds after ``generations`` (as :func:`~.replay.with_routed_experts`
    folds them: a full replay replaces the rows, one with a start row is spliced after them)."""
    for g in generations:
        experts = g.routed_experts
        if experts is None:
            continue
        start = g.routed_experts_start
        if not start:
            held = experts
        elif held is not None and len(held) >= start and held.shape[1:] == experts.shape[1:]:
            held = held.rows(start).concat(experts)
        else:
            held = None
    return held


def pack_generations(generations: Sequence[Generation], held: Packed | None = None) -> list[list[Any]] | None:
    """The engine-side arrays of one call's replies, as journaled: per reply its routing replay
    (R3: the codec's packed array, typecode, shape and little-endian bytes, with its start row) and
    its prefix-cache / speculative-decoding counters; None when no reply carries any. A replay of
    the whole sequence whose first rows are the ``held`` ones (the trajectory's rows so far) is
    journaled from the row after them, so a long episode's journal grows with its tokens, not
    with its turns times its tokens."""
    out: list[list[Any]] = []
    for g in generations:
        experts = g.routed_experts
        packed = None
        start = g.routed_experts_start
        if experts is not None:
            rows = experts
            if (
                not start and held is not None and 0 < len(held) <= len(experts)
                and held.shape[1:] == experts.shape[1:] and held.typecode == experts.typecode
                and experts.rows(len(held)).data == held.data
            ):
                start = len(held)
                rows = Packed(experts.data[start * experts.row_size:], (len(experts) - start, *experts.shape[1:]))
            packed = [rows.typecode, list(rows.shape), bytes(le_bytes(rows.data))]
            held = routing_rows(held, [g])
        out.append([packed, start, dict(g.counters) if g.counters else None])
    return out if any(p is not None or c is not None for p, _, c in out) else None


def unpack_generations(raw: Any) -> list[Generation]:
    """The replies :func:`pack_generations` journaled, holding only what the sample takes from
    them (:func:`~.replay.with_routed_experts`): a resumed R3 sample equals an uninterrupted one."""
    out: list[Generation] = []
    for packed, start, counters in raw or ():
        experts = None
        if packed is not None:
            code, shape, data = packed
            experts = Packed(from_le_bytes(str(code), data), tuple(shape))
        out.append(Generation(
            "", array("i"), None, None, routed_experts=experts, routed_experts_start=int(start),
            counters={str(k): int(v) for k, v in counters.items()} if counters else None,
        ))
    return out


def request_digest(kind: str, trajectory: int, tokens: array[int] | Sequence[int] | None, extra: Any) -> bytes:
    """What identifies one step's request: its kind, trajectory, the token ids it sends and the
    rest (limit, sampling parameters, text source) as canonical JSON."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{kind}:{trajectory}:".encode())
    if tokens is not None:
        h.update(pack_ints(tokens))
    h.update(json.dumps(extra, sort_keys=True, separators=(",", ":"), default=str).encode())
    return h.digest()


class PromptJournal:
    """One prompt attempt's journal: its members' steps as read, and the writer."""

    def __init__(
        self,
        steps: Mapping[int, list[bytes]],
        append: Append,
        on_diverged: Callable[[], Awaitable[None]],
        stats: JournalStats,
        where: str,
    ) -> None:
        self.steps = steps
        self.append = append
        self.on_diverged = on_diverged
        self.stats = stats
        self.where = where

    def member(self, member: int) -> EpisodeLog:
        return EpisodeLog(self, member, list(self.steps.get(member, ())))


class EpisodeLog:
    """One episode's journal: replays its steps while they match, then appends the live ones.

    Steps are matched by their request, not only by position: a call whose request is not the
    next journaled step's takes a later step with the same request when that request appears once
    among the steps not yet replayed (parallel calls of one episode, ``asyncio.gather``, finish in
    another order on resume). Appends are serialised, so parallel calls never write one seq."""

    def __init__(self, journal: PromptJournal, member: int, steps: list[bytes]) -> None:
        self.journal = journal
        self.member = member
        self.steps = steps
        self.seq = 0
        """The next step's number to append (while replaying: the first step not replayed yet)."""
        self.taken: set[int] = set()
        """Steps after ``seq`` already replayed out of order."""
        self.replaying = bool(steps)
        self.writing = True
        self._decoded: dict[int, Any] = {}
        self._lock = asyncio.Lock()
        if steps:
            journal.stats.resumed += 1

    def _step(self, at: int) -> Any:
        if at not in self._decoded:
            try:
                self._decoded[at] = unpackb(self.steps[at], DEFAULT_LIMITS)
            except Exception:  # msgpack raises a zoo of types: an unreadable step is a difference
                self._decoded[at] = None
        return self._decoded[at]

    def _take(self, at: int) -> dict[str, Any]:
        step = self._step(at)
        self.taken.add(at)
        while self.seq in self.taken:
            self.taken.discard(self.seq)
            self._decoded.pop(self.seq, None)
            self.seq += 1
        self.journal.stats.replayed += 1
        if self.seq >= len(self.steps):
            self.replaying = False
        return step

    async def match(self, kind: str, digest: bytes, key: str | None = None) -> dict[str, Any] | None:
        """The journaled step that answers this call (the next one, or a later one with the same
        request when that request is unique among the steps left), else None: the journal is
        exhausted, or nothing left asks this (diverged: counted, logged once, replay off)."""
        if not self.replaying:
            return None
        if self.seq >= len(self.steps):
            self.replaying = False
            return None

        def same(step: Any) -> bool:
            return (
                isinstance(step, dict) and step.get("k") == kind and step.get("r") == digest
                and (key is None or step.get("key") == key)
            )

        step = self._step(self.seq)
        if same(step):
            return self._take(self.seq)
        later = [at for at in range(self.seq + 1, len(self.steps)) if at not in self.taken and same(self._step(at))]
        if len(later) == 1:
            return self._take(later[0])
        self.replaying = False
        self.taken.clear()
        self.journal.stats.diverged += 1
        logger.warning(
            "%s member %d: resumed episode diverged from its journal at step %d of %d (%s): "
            "the rest is dropped, the episode goes on live",
            self.journal.where, self.member, self.seq, len(self.steps),
            "unreadable step" if not isinstance(step, dict) else f"journaled {step.get('k')!r}, now {kind!r}",
        )
        try:
            await self.journal.on_diverged()
        except TRANSIENT_ERRORS as exc:  # only a counter
            logger.debug("resume_diverged not counted: %s", exc)
        return None

    async def record(self, step: dict[str, Any]) -> None:
        """Append a live step (no-op once journaling stopped for this episode)."""
        data = msgpack.packb(step, use_bin_type=True)
        async with self._lock:
            if not self.writing:
                return
            try:
                status = await self.journal.append(self.member, self.seq, data)
            except TRANSIENT_ERRORS as exc:
                status = f"unreachable ({type(exc).__name__}: {exc})"
            if status == "ok":
                self.seq += 1
                self.journal.stats.journaled += 1
                return
            self.writing = False
        self.journal.stats.unwritten += 1
        logger.warning(
            "%s member %d: journaling stopped at step %d: %s; the episode goes on without it",
            self.journal.where, self.member, self.seq,
            {"full": "the namespace byte budget is reached", "lost": "the prompt's lease was lost"}.get(status, status),
        )

    @property
    def durable(self) -> bool:
        """Whether stopping this episode now keeps its progress (its journal is being written)."""
        return self.writing


def encode_once(value: Any) -> bytes:
    """``episode.once``'s result as journaled. It must read back as itself (:func:`decode_once`),
    checked here when it is recorded: a value msgpack cannot hold, or one it would hand back
    different (a tuple as a map key, a string past the decoding limits), is the user's
    error now, not an unreadable step (and the ``once`` function run again) on resume. Int, float,
    bool and None map keys round-trip; tuples come back as lists (msgpack has one array type)."""
    try:
        raw = msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"episode.once(): the function's result must be msgpack-encodable (None, bool, int, float, "
            f"str, bytes, lists and dicts of them) to be journaled: {exc}"
        ) from None
    try:
        back = decode_once(raw)
    except Exception as exc:  # msgpack raises a zoo of types: the limits, an unhashable key, ...
        raise TypeError(
            f"episode.once(): the function's result would not read back from the journal "
            f"({type(exc).__name__}: {exc}); return plain values (str, bytes, int, float, bool, None keys)"
        ) from None
    problem = _differs(value, back, "result")
    if problem is not None:
        raise TypeError(f"episode.once(): the function's result would not read back as itself from the journal: "
                        f"{problem}")
    return raw


def decode_once(raw: bytes) -> Any:
    """A journaled ``once`` result (map keys of any msgpack scalar type, within the codec's limits)."""
    limits = DEFAULT_LIMITS
    return msgpack.unpackb(
        raw, raw=False, max_str_len=limits.max_string_bytes, max_bin_len=limits.max_payload_bytes,
        max_array_len=limits.max_container_len, max_map_len=limits.max_container_len, max_ext_len=0,
        strict_map_key=False,
    )


def _differs(value: Any, back: Any, where: str) -> str | None:
    """Where ``back`` (read back) is not ``value``, else None: a tuple read back as a list, or a
    subclass (a str enum) as its equal base value, is the same."""
    if isinstance(value, list | tuple) and isinstance(back, list):
        if len(value) != len(back):
            return f"{where} has {len(value)} items, {len(back)} read back"
        for i, (a, b) in enumerate(zip(value, back, strict=True)):
            if (problem := _differs(a, b, f"{where}[{i}]")) is not None:
                return problem
        return None
    if isinstance(value, dict) and isinstance(back, dict):
        if len(value) != len(back):
            return f"{where} has {len(value)} keys, {len(back)} read back (keys equal once encoded)"
        for (ka, a), (kb, b) in zip(value.items(), back.items(), strict=True):
            if not isinstance(ka, type(kb)) or ka != kb:
                return f"{where} key {ka!r} ({type(ka).__name__}) reads back as {kb!r} ({type(kb).__name__})"
            if (problem := _differs(a, b, f"{where}[{ka!r}]")) is not None:
                return problem
        return None
    if not isinstance(value, type(back)):  # a str enum reads back as its str: equal, kept
        return f"{where} {value!r} ({type(value).__name__}) reads back as {type(back).__name__}"
    if isinstance(value, float) and value != value and back != back:  # NaN
        return None
    return None if value == back else f"{where} {value!r} reads back as {back!r}"
