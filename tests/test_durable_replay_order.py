"""Replay matches journaled replies by request: parallel calls of one episode that finish in
another order on resume replay, they do not diverge. Routing-replay rows are journaled compactly."""

from __future__ import annotations

import asyncio
from array import array

import msgpack
from rollstream.common.arrays import Packed
from rollstream.producer.durable import (
    EpisodeLog,
    JournalStats,
    PromptJournal,
    pack_generations,
    request_digest,
    routing_rows,
    unpack_generations,
)
from rollstream.producer.engine import Generation


class _Journal:
    """JOURNAL_APPEND's semantics in memory: step ``seq`` replaces the member's steps from it on."""

    def __init__(self) -> None:
        self.steps: list[bytes] = []
        self.diverged = 0

    async def append(self, member: int, seq: int, step: bytes) -> str:
        await asyncio.sleep(0.001 * (seq % 2))  # the second of two parallel appends lands first
        del self.steps[seq:]
        self.steps.append(step)
        return "ok"

    async def count(self) -> None:
        self.diverged += 1


def _log(store: _Journal, steps: list[bytes]) -> tuple[EpisodeLog, JournalStats]:
    stats = JournalStats()
    return PromptJournal({0: steps}, store.append, store.count, stats, "test").member(0), stats


def _digest(ids: list[int], temperature: float) -> bytes:
    return request_digest("g", 0, ids, [8, {"temperature": temperature}])


async def test_parallel_calls_journal_both_steps_and_replay_in_any_finishing_order() -> None:
    store = _Journal()
    live, _ = _log(store, [])
    a, b = _digest([1, 2], 1.0), _digest([1, 3], 1.0)
    await asyncio.gather(live.record({"k": "g", "r": a, "x": "A"}), live.record({"k": "g", "r": b, "x": "B"}))
    assert [msgpack.unpackb(s)["x"] for s in store.steps] == ["A", "B"]  # both kept, none overwritten

    resumed, stats = _log(store, list(store.steps))
    first = await resumed.match("g", b)  # B finishes first this time
    second = await resumed.match("g", a)
    assert first is not None and first["x"] == "B"
    assert second is not None and second["x"] == "A"
    assert (stats.replayed, stats.diverged, store.diverged) == (2, 0, 0)
    assert resumed.seq == 2 and not resumed.replaying  # the next live step appends after both
    await resumed.record({"k": "g", "r": _digest([9], 1.0), "x": "C"})
    assert [msgpack.unpackb(s)["x"] for s in store.steps] == ["A", "B", "C"]


async def test_a_request_not_unique_among_the_steps_left_or_absent_is_a_divergence() -> None:
    a, c, d = _digest([1, 2], 1.0), _digest([1, 2], 0.5), _digest([7], 1.0)
    steps = [msgpack.packb({"k": "g", "r": r, "x": x}) for r, x in ((a, "A"), (c, "C1"), (c, "C2"))]

    store = _Journal()
    resumed, stats = _log(store, steps)
    assert (await resumed.match("g", c)) is None  # C is journaled twice after A: which one is unknown
    assert (stats.diverged, store.diverged, resumed.replaying) == (1, 1, False)
    assert (await resumed.match("g", a)) is None  # replay is off for good after a divergence

    store = _Journal()
    store.steps = list(steps)
    resumed, stats = _log(store, steps)
    assert (await resumed.match("g", a)) is not None
    assert (await resumed.match("g", d)) is None and stats.diverged == 1  # D was never journaled
    await resumed.record({"k": "g", "r": d, "x": "D"})
    assert [msgpack.unpackb(s)["x"] for s in store.steps] == ["A", "D"]  # the rest is dropped


async def test_sequential_replay_in_order_is_unchanged() -> None:
    a, b = _digest([1], 1.0), _digest([1, 5], 1.0)
    steps = [msgpack.packb({"k": "g", "r": r, "x": x}) for r, x in ((a, "A"), (b, "B"))]
    resumed, stats = _log(_Journal(), steps)
    assert (await resumed.match("g", a))["x"] == "A"
    assert (await resumed.match("g", b))["x"] == "B"
    assert (await resumed.match("g", a)) is None and stats.diverged == 0  # exhausted: live, no divergence


def test_a_routing_replay_is_journaled_from_its_first_new_row_unless_its_held_rows_changed() -> None:
    held = Packed.of([[1, 2], [3, 4]])
    same = Generation("", array("i"), None, "stop", routed_experts=Packed.of([[1, 2], [3, 4], [5, 6]]))
    changed = Generation("", array("i"), None, "stop", routed_experts=Packed.of([[1, 2], [9, 4], [5, 6]]))
    for reply, start, rows in ((same, 2, [[5, 6]]), (changed, 0, [[1, 2], [9, 4], [5, 6]])):
        packed = pack_generations([reply], held)
        assert packed is not None and packed[0][1] == start
        (replayed,) = unpack_generations(packed)
        assert replayed.routed_experts is not None and replayed.routed_experts.tolist() == rows
        assert routing_rows(held, [replayed]) == reply.routed_experts  # the same rows as the live reply
    assert pack_generations([Generation("", array("i"), None, "stop")], held) is None  # nothing to keep
