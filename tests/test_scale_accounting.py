"""The scale benchmark's Redis accounting, on a real Redis: a slowlog window attributes each
EVALSHA to its script by sha and every other command to the kind of work it does."""

from __future__ import annotations

import sys
from pathlib import Path

from redis.asyncio import Redis
from rollstream.common import lua
from rollstream.common.config import PipelineConfig
from rollstream.common.keys import Keys
from rollstream.common.protocol import Heartbeat, Heartbeats, PromptQueue
from rollstream.runtime.redis_server import EmbeddedRedis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ lives at the repository root

from bench.common import add_prompts, init_ns
from bench.scale import METER, Meter, slowlog_breakdown

CONFIG = PipelineConfig(n_samples_per_prompt=2, batch_size=2, max_backlog=10, max_staleness=1)
"""What ADMIT reads: the namespace's config."""


async def test_slowlog_window_attributes_scripts_and_commands(redis_server: EmbeddedRedis) -> None:
    meter = Meter(redis_server.url)
    producer = Redis.from_url(redis_server.url, client_name="rollstream-producer-p0")
    try:
        keys: Keys = await init_ns(producer, "scaleacct", n_samples_per_prompt=2, batch_size=2, max_staleness=1)
        await add_prompts(producer, keys, 0, 2)
        queue = PromptQueue(producer, keys, "p0")
        await queue.admit(CONFIG)  # loads the script
        for source in (lua.PUBLISH, lua.RECLAIM_TURN):  # loaded before the window (no NOSCRIPT round trip in it)
            await producer.script_load(source.source)
        await meter.slowlog_on(1000)
        admitted = await queue.admit(CONFIG)
        await Heartbeats(producer, keys).write("p0", Heartbeat(state="running"), 0)
        await queue.reclaim_turn(1000)
        await queue.any_idle(60_000)
        (item,) = admitted.entries
        await queue.publish(item.stream, item.entry_id, {"index": 0, "data": b"x"})
        await meter.redis.ping()  # the meter's own commands are left out
        entries = await meter.slowlog_off()
    finally:
        await producer.aclose()
        await meter.redis.aclose()
    kinds, complete = slowlog_breakdown(entries)
    assert complete
    assert kinds["admit"]["calls"] == 1
    assert kinds["publish"]["calls"] == 1
    assert kinds["heartbeat"]["calls"] == 1
    # the turn (RECLAIM_TURN), and XPENDING IDLE on each prompt stream (eval lane, retry, prompts)
    assert kinds["reclaim"]["calls"] == 1 + len(queue.streams)
    assert "other" not in kinds, kinds
    assert all(v["usec"] >= 0 for v in kinds.values())
    assert METER == "rsscale-meter"
