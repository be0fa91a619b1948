"""Several named sources mixed exactly: the apportionment, the feeder's steering, take()'s quotas,
a source running dry, and the errors. Real redis-server, real producer and feeder processes."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from pathlib import Path

import pytest
from conftest import ProcessPool, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.codec import decode_prompt_entry, prompt_fields
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys, SourceField, StateField
from rollstream.common.mix import apportion, carries, parse_mix, source_caps
from rollstream.common.models import Prompt
from rollstream.common.protocol.prompts import PromptQueue
from rollstream.consumer import GroupConsumer
from rollstream.ops.snapshot import snapshot
from rollstream.producer.feeder import Feeder, FeedSettings, load_jsonl
from rollstream.runtime.redis_server import free_port
from rollstream.testing.sim import SimConfig, SimEngine
from test_metrics import scrape


def test_largest_remainder_carried_across_steps_is_exact_in_the_long_run() -> None:
    weights = parse_mix("a=0.5,b=0.3,c=0.2")
    committed: Counter[str] = Counter()
    for step in range(1, 200):
        target = 1 + step % 7
        quotas = apportion(target, weights, carries(weights, committed))
        assert sum(quotas.values()) == target and min(quotas.values()) >= 0
        committed.update(quotas)
        total = sum(committed.values())
        for name, weight in weights.items():
            assert abs(committed[name] - weight * total) < 1  # exact to the group, at every step
    assert apportion(4, {"a": 1.0, "b": 2.0}) == {"a": 1, "b": 3}
    with pytest.raises(ConfigError, match="positive"):
        parse_mix("a=0")
    with pytest.raises(ConfigError, match="NAME=WEIGHT"):
        parse_mix("a")
    with pytest.raises(ConfigError, match="named twice"):
        parse_mix("a=1,a=2")


def write(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "label": "1"}) + "\n" for p in prompts))
    return path


async def test_every_batch_holds_each_sources_share_though_one_is_slower(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, tmp_path: Path
) -> None:
    """Source ``slow``'s prompts take ~20x longer to generate (prefill of long prompts): every batch
    is still exactly 4 fast + 2 slow, the feeder steered by what is alive, the fast surplus bounded."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=6, mix="fast=2,slow=1")
    fast = write(tmp_path / "fast.jsonl", [f"f{i}" for i in range(50)])
    slow = write(tmp_path / "slow.jsonl", [f"s{i} " + "x" * 400 for i in range(50)])
    config = SimConfig(seed=1, mean_tokens=8, latency_per_token=0.001, prefill_per_token=0.0005)
    async with SimEngine(config) as sim:
        procs.start("feed", "--redis", redis_url, "--ns", ns, f"fast={fast}", f"slow={slow}", "--forever",
                    "--window", "16", "--shuffle", log_name="feeder")
        port = free_port()
        procs.producer(redis_url, ns, sim.url, "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                       concurrency=16)
        async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
            for _ in range(6):
                batch = await asyncio.wait_for(consumer.take(6), 120)
                assert Counter(g.source for g in batch.groups) == {"fast": 4, "slow": 2}, procs.logs()
                assert batch.metrics["source/fast/groups"] == 4 and batch.metrics["source/slow/groups"] == 2
                assert batch.metrics["source/slow/response_length"] > 0
                assert all(str(g.prompt).startswith(g.source[0]) for g in batch.groups)
                await consumer.commit(batch)
            backlog = [f for _, f in await redis.xrange(keys.groups)]
            assert {f[b"source"] for f in backlog} <= {b"fast", b"slow"}  # a plain field, for redis-cli
            assert sum(f[b"source"] == b"fast" for f in backlog) <= 16  # the fast surplus stays bounded
        state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.sources)).items()}
        assert int(state[SourceField.of("fast", "committed")]) == 24
        assert int(state[SourceField.of("slow", "committed")]) == 12
        assert int(state[SourceField.of("fast", "fed")]) >= 24 and int(state[SourceField.of("slow", "position")]) > 0
        queued = [decode_prompt_entry(f) for _, f in await redis.xrange(keys.prompts)]
        assert {p.source for p in queued} <= {"fast", "slow"}
        rows = {row["name"]: row for row in (await snapshot(redis, keys))["sources"]}  # what inspect shows
        assert rows["fast"]["committed_share"] == 0.6667 and rows["slow"]["target_share"] == 0.3333
        metrics = await scrape(f"http://127.0.0.1:{port}/metrics")
        assert metrics["rollstream_source_groups_published_total{source=slow}"] >= 12
        assert metrics["rollstream_source_groups_published_total{source=fast}"] >= 24


async def test_the_fast_sources_backlog_stays_within_its_share_of_max_backlog(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, tmp_path: Path
) -> None:
    """Two sources 5x apart in speed, max_backlog 8 (a share of 4 each), a producer with room for
    12 groups at once and a trainer slower than generation: the fast source's groups in the group
    stream never exceed 4 (watched on the stream itself), and every batch still holds 2 + 2."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, mix="fast=1,slow=1", max_backlog=8)
    fast = write(tmp_path / "fast.jsonl", [f"f{i}" for i in range(60)])
    slow = write(tmp_path / "slow.jsonl", [f"s{i} " + "x" * 320 for i in range(60)])
    # fast: 8 tokens x 5 ms = 0.04 s a sample; slow: + 320 prompt tokens x 0.5 ms of prefill = 0.2 s
    config = SimConfig(seed=1, mean_tokens=8, length_sigma=0.0, latency_per_token=0.005, prefill_per_token=0.0005)
    seen: list[int] = []
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            seen.append(sum(f.get(b"source") == b"fast" for _, f in await redis.xrange(keys.groups)))
            await asyncio.sleep(0.005)

    async with SimEngine(config) as sim:
        procs.start("feed", "--redis", redis_url, "--ns", ns, f"fast={fast}", f"slow={slow}", "--forever",
                    "--window", "32", log_name="feeder")
        procs.producer(redis_url, ns, sim.url, concurrency=24)
        watcher = asyncio.create_task(watch())
        try:
            async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
                for _ in range(8):
                    batch = await asyncio.wait_for(consumer.take(4), 120)
                    assert Counter(g.source for g in batch.groups) == {"fast": 2, "slow": 2}, procs.logs()
                    await asyncio.sleep(0.3)  # a training step longer than a slow group
                    await consumer.commit(batch)
        finally:
            stop.set()
            await watcher
    state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.sources)).items()}
    assert seen and max(seen) <= 4, (max(seen), sorted(state.items()))
    assert max(seen) == 4  # the cap was reached, so it held the fast source back
    state = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.sources)).items()}
    assert int(state["fast:published"]) - int(state["fast:committed"]) == int(state["fast:backlog"])


async def test_admission_parks_a_capped_sources_prompts_and_never_holds_back_a_lone_source(
    redis: Redis, ns: str
) -> None:
    """ADMIT itself: source ``a`` holds its cap (2 groups), ``b`` has prompts queued behind two of
    ``a``'s: those two are parked at the end of the retry stream and ``b``'s is admitted; once ``b``
    is done and has nothing left, ``a`` is admitted past its cap (nothing else could move)."""
    keys = Keys(ns)
    config = await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, mix="a=1,b=1", max_backlog=4)
    assert json.loads(source_caps(config.mix, config.max_backlog, config.batch_size)) == {"a": 2, "b": 2}
    for index, source in enumerate("aab"):
        await redis.xadd(keys.prompts, prompt_fields(Prompt(index=index, prompt=f"p{index}", source=source)))
    await redis.hset(keys.sources, mapping={"a:backlog": 2, "a:fed": 4, "b:fed": 1})
    queue = PromptQueue(redis, keys, "p1")
    reply = await queue.admit(config)
    assert [(e.stream, e.fields[b"source"]) for e in reply.entries] == [(keys.prompts, b"b")]
    assert [f[b"index"] for _, f in await redis.xrange(keys.retry)] == [b"0", b"1"]  # parked, in order
    assert await redis.xlen(keys.prompts) == 1 and (await redis.hget(keys.state, StateField.PARKED)) == b"2"
    assert (await redis.hget(keys.sources, "b:flight")) == b"1"
    # b still has a prompt in flight: a stays held back, nothing is read
    assert (await queue.admit(config)).status == "source_backlog"
    # b's group published and trained, b's feeder done: a is alone and admitted from the retry stream
    await redis.hset(keys.sources, mapping={"b:flight": 0, "b:committed": 1, "b:done": 1})
    reply = await queue.admit(config, count=2)
    assert reply.status == "ok" and [e.fields[b"index"] for e in reply.entries] == [b"0", b"1"]
    assert (await redis.hget(keys.sources, "a:flight")) == b"2"


async def test_a_source_that_runs_dry_leaves_the_mix(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool, tmp_path: Path, sim: SimEngine,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # max_backlog 4: each source's cap is 2 groups, so the caps are in play when one source is left
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, mix="few=1,many=1", max_backlog=4)
    few = write(tmp_path / "few.jsonl", [f"few{i}" for i in range(5)])
    many = write(tmp_path / "many.jsonl", [f"many{i}" for i in range(100)])
    feeder = procs.start("feed", "--redis", redis_url, "--ns", ns, f"few={few}", f"many={many}", "--epochs", "1",
                         "--window", "12", log_name="feeder")
    procs.producer(redis_url, ns, sim.url, concurrency=8)
    taken: Counter[str] = Counter()
    caplog.set_level(logging.WARNING, logger="rollstream.consumer.group_consumer")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        for _ in range(8):
            batch = await asyncio.wait_for(consumer.take(4), 120)
            taken.update(g.source for g in batch.groups)
            await consumer.commit(batch)
    assert taken == {"few": 5, "many": 27}  # every row of the dry source trained, the rest filled by the other
    assert "source 'few' ran dry" in caplog.text
    await wait_until(lambda: "source 'few' ran dry" in procs.log_of(feeder), message=procs.logs())


async def test_a_mix_and_a_feed_must_name_the_same_sources(redis: Redis, ns: str, tmp_path: Path) -> None:
    records = load_jsonl(write(tmp_path / "d.jsonl", ["a", "b"]))
    await make_namespace(redis, ns, mix="a=1,b=1")
    with pytest.raises(ConfigError, match=r"names source.*b.*that this feed does not feed"):
        await Feeder(redis, {"a": records}, FeedSettings(namespace=ns)).run()
    with pytest.raises(ConfigError, match="c not in the namespace's mix"):
        await Feeder(redis, {"a": records, "b": records, "c": records}, FeedSettings(namespace=ns)).run()
    with pytest.raises(ConfigError, match="feed them by name"):
        await Feeder(redis, records, FeedSettings(namespace=ns)).run()
    await make_namespace(redis, ns + "plain")
    with pytest.raises(ConfigError, match="need the namespace's mix"):
        await Feeder(redis, {"a": records}, FeedSettings(namespace=ns + "plain")).run()


async def test_named_sources_keep_their_own_cursor_and_epochs(redis: Redis, ns: str, tmp_path: Path) -> None:
    """Stopped and restarted, each source resumes where it stood; each runs its own epochs."""
    keys = Keys(ns)
    await make_namespace(redis, ns, mix="a=1,b=3")
    sources = {"a": load_jsonl(write(tmp_path / "a.jsonl", [f"a{i}" for i in range(4)])),
               "b": load_jsonl(write(tmp_path / "b.jsonl", [f"b{i}" for i in range(6)]))}
    settings = FeedSettings(namespace=ns, epochs=2, window=5, poll_interval=0.02, chunk=3)
    seen: list[tuple[str, int, str]] = []

    async def drain() -> None:
        rows = await redis.xrange(keys.prompts)
        if rows:
            await redis.xdel(keys.prompts, *[r[0] for r in rows])
        for _, fields in rows:
            prompt = decode_prompt_entry(fields)
            seen.append((prompt.source, prompt.epoch, str(prompt.prompt)))

    feeder = Feeder(redis, sources, settings)
    task = asyncio.create_task(feeder.run())
    await wait_until(lambda: _at_least(redis, keys.prompts, 5), message="the window filled")
    feeder.stop()
    await task
    await drain()
    task = asyncio.create_task(Feeder(redis, sources, settings).run())
    while not task.done():
        await drain()
        await asyncio.sleep(0.01)
    await drain()
    for name, rows in (("a", 4), ("b", 6)):
        mine = [(epoch, p) for s, epoch, p in seen if s == name]
        assert mine == [(e, f"{name}{i}") for e in range(2) for i in range(rows)]  # no gap, no repeat
    state = await redis.hgetall(keys.sources)
    assert state[b"a:fed"] == b"8" and state[b"b:fed"] == b"12" and state[b"a:done"] == b"1"


async def _at_least(redis: Redis, key: str, count: int) -> bool:
    return await redis.xlen(key) >= count
