"""A reward declared ``async def`` that blocks the event loop past the lease (issue 43, finding 9,
first bullet: "a blocking async reward (7 s, lease 5 s) still causes one takeover per 40-prompt
run"). The renewal thread keeps every lease alive while the loop stands still, and a reply that
came during the stall is read, not timed out and its script run again: no prompt is taken over,
none is reported a duplicate, and each is trained exactly once. Real Redis, two real producer
processes, the simulator over HTTP. The exact window is forced in tests/test_stalled_replies.py."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path

import pytest
from conftest import ProcessPool, make_namespace
from hostile_rewards import BLOCK_REWARD_SECONDS
from redis.asyncio import Redis
from rollstream.common.codec import prompt_fields
from rollstream.common.connection import SOCKET_TIMEOUT
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimEngine

TESTS_DIR = Path(__file__).parent
LEASE = 5.0
TOTAL = 40
BLOCKED = (3, 17, 30)
"""Spread out, so each stall is logged on its own (back-to-back stalls merge into one)."""


@pytest.mark.slow
@pytest.mark.parametrize("fn", ["blocking_async", "blocking_async_per_sample"])
async def test_a_blocking_async_reward_takes_over_nothing(
    fn: str, redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert BLOCK_REWARD_SECONDS > LEASE
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")])))
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, lease_seconds=LEASE)
    for index in range(TOTAL):
        text = f"Compute {index} + 1 and box it." + (" BLOCKREWARD" if index in BLOCKED else "")
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=index, prompt=text, label=str(index + 1))))
    producers = [
        procs.producer(redis_url, ns, sim.url, name=f"blockreward-{i}", reward=f"hostile_rewards:{fn}")
        for i in range(2)
    ]
    taken: Counter[int] = Counter()
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(180):
            while sum(taken.values()) < TOTAL:
                batch = await consumer.take(min(4, TOTAL - sum(taken.values())))
                taken.update(g.index for g in batch.groups)
                assert await consumer.commit(batch) == len(batch)
    assert sorted(taken) == list(range(TOTAL)) and set(taken.values()) == {1}, taken

    state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.state)).items()}
    assert int(state.get("duplicates_discarded", 0)) == 0, procs.logs()
    logs = "\n".join(procs.log_of(p) for p in producers)
    # The test tests something: each blocking reward held its producer's loop past the lease.
    stalls = [float(line.split("event loop stalled ")[1].split(" s")[0])
              for line in logs.splitlines() if "event loop stalled" in line and f"in {fn}" in line]
    assert stalls and min(stalls) > LEASE, procs.logs()
    if fn == "blocking_async_per_sample":  # and past the socket timeout: a reply in flight is waited for
        assert max(stalls) > SOCKET_TIMEOUT, procs.logs()
    # Nothing taken over. The per-sample stalls (two samples: ~14 s) outlast the 10 s socket
    # timeout: before replies were read under a stall-tolerant deadline (common/connection.py),
    # a script in flight across one ran twice, in 3 runs of 10: an ADMIT (its first prompts left
    # pending, unheld, and taken over after the lease) or a PUBLISH (a false duplicate).
    assert int(state.get("reclaimed", 0)) == 0, procs.logs()
    assert "taking over" not in logs and "lost the lease" not in logs, procs.logs()
