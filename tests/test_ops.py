"""``rollstream ns`` and ``rollstream dead`` against the real server, as subprocesses."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from conftest import add_prompts, make_namespace, wait_until
from rollstream import ops
from rollstream.common.errors import ConfigError, NamespaceNotInitialized
from rollstream.common.keys import TRAINER_GROUP, Keys, StateField
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import free_port


async def cli(*args: str, stdin: bytes = b"") -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollstream.cli", *args,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(stdin), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_ns_delete_removes_only_that_namespace(redis_url, redis, ns):
    other = f"{ns}-other"
    await make_namespace(redis, ns)
    await make_namespace(redis, other)
    await add_prompts(redis, ns, 3)
    await add_prompts(redis, other, 2)
    await redis.xadd(Keys(ns).dead, {"source": "prompts", "reason": "test"})
    await redis.hset(Keys(ns).journal("trainer-0"), "meta", "{}")  # the slime/miles checkpoint journal
    await redis.hset(Keys(other).journal("trainer-0"), "meta", "{}")
    await redis.set(f"unrelated:{ns}", "keep me")

    code, out = await cli("ns", "list", "--redis", redis_url)
    assert code == 0 and ns in out.split() and other in out.split()

    code, out = await cli("ns", "delete", "--redis", redis_url, "--ns", ns, stdin=b"not-the-name\n")
    assert code == 1 and "nothing deleted" in out
    assert await redis.exists(Keys(ns).prompts)

    code, out = await cli("ns", "delete", "--redis", redis_url, "--ns", ns, stdin=f"{ns}\n".encode())
    assert code == 0, out
    assert not await redis.exists(*Keys(ns).all_keys())
    assert [k async for k in redis.scan_iter(match=f"rollstream:{{{ns}}}:*")] == []
    assert await redis.xlen(Keys(other).prompts) == 2
    assert await redis.exists(Keys(other).config, Keys(other).state, Keys(other).groups) == 3
    assert await redis.exists(Keys(other).journal("trainer-0"))
    assert await redis.get(f"unrelated:{ns}") == b"keep me"

    code, out = await cli("ns", "list", "--redis", redis_url)
    assert ns not in out.split() and other in out.split()
    code, out = await cli("ns", "delete", "--redis", redis_url, "--ns", other, "--yes")
    assert code == 0 and not await redis.exists(*Keys(other).all_keys())


async def test_dead_undecodable_entries_cannot_be_requeued_and_can_be_dropped(redis_url, redis, ns):
    keys = Keys(ns)
    await make_namespace(redis, ns)
    bad = (await redis.xadd(keys.dead, {"source": "prompts", "reason": "not_msgpack: x", "data": b"\xc1\xff"})).decode()

    code, out = await cli("dead", "list", "--redis", redis_url, "--ns", ns, "--json")
    assert code == 0
    row = json.loads(out.strip().splitlines()[-1])
    assert row["id"] == bad and row["requeueable"] is False and row["reason"] == "not_msgpack: x"

    code, out = await cli("dead", "requeue", "--redis", redis_url, "--ns", ns, "--id", bad)
    assert code == 1 and "cannot requeue" in out
    assert await redis.xlen(keys.dead) == 1 and await redis.xlen(keys.prompts) == 0

    code, out = await cli("dead", "drop", "--redis", redis_url, "--ns", ns, "--all", stdin=b"no\n")
    assert code == 1 and await redis.xlen(keys.dead) == 1
    code, out = await cli("dead", "drop", "--redis", redis_url, "--ns", ns, "--id", bad, "--yes")
    assert code == 0 and "dropped 1" in out and await redis.xlen(keys.dead) == 0


@pytest.fixture
async def rejecting_engine() -> AsyncIterator[str]:
    """A misconfigured engine: it refuses every generate request with HTTP 400."""

    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "model not loaded", "code": 400}}, status=400)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def test_dead_requeue_brings_prompts_back_and_they_get_trained_on(
    redis_url, redis, ns, sim, procs, rejecting_engine
):
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_attempts=1)
    await add_prompts(redis, ns, 2)
    broken = procs.producer(redis_url, ns, rejecting_engine, name="misconfigured")
    # A process start on a loaded machine takes seconds: the timed waits below are for the work.
    await wait_until(lambda: _running(redis, keys, "misconfigured"), timeout=60,
                     message=f"the misconfigured producer running\n{procs.logs()}")

    consumer = await GroupConsumer.connect(redis_url, ns, "trainer-0", on_producer_failure="warn")
    try:
        # Every attempt fails: recycled once (max_attempts=1), then dead-lettered.
        take = asyncio.create_task(consumer.take(2))
        await wait_until(lambda: _eq(redis.xlen(keys.dead), 2), message=f"2 dead letters\n{procs.logs()}")
        take.cancel()
        await asyncio.gather(take, return_exceptions=True)
        broken.send_signal(signal.SIGTERM)
        await asyncio.to_thread(broken.wait, 15)

        code, out = await cli("dead", "list", "--redis", redis_url, "--ns", ns)
        assert code == 0 and out.count("requeueable=yes") == 2 and "max_attempts" in out, out

        procs.producer(redis_url, ns, sim.url, name="fixed")
        await wait_until(lambda: _running(redis, keys, "fixed"), timeout=60,
                         message=f"the fixed producer running\n{procs.logs()}")
        code, out = await cli("dead", "requeue", "--redis", redis_url, "--ns", ns, "--all")
        assert code == 0 and "requeued 2 of 2" in out, out
        assert await redis.xlen(keys.dead) == 0
        assert int(await redis.hget(keys.state, "requeued")) == 2

        batch = await asyncio.wait_for(consumer.take(2), 20)
        assert sorted(g.index for g in batch.groups) == [0, 1]
        assert all(g.attempt == 0 and g.producer == "fixed" for g in batch.groups)
        assert await consumer.commit(batch) == 2
    finally:
        await consumer.aclose()
    code, out = await cli("dead", "requeue", "--redis", redis_url, "--ns", ns, "--id", "1-1")
    assert "no such dead entry" in out


async def _eq(value, expected) -> bool:
    return (await value) == expected


async def _running(redis, keys: Keys, name: str) -> bool:
    beat = json.loads((await redis.hget(keys.producers, name)) or "{}")
    return beat.get("state") == "running"


async def test_operator_pause_resume_and_release(redis, ns):
    """``rollstream.ops`` in-process: pause/resume write the state hash; release_consumer hands a
    gone trainer's pending groups back to the stream and deletes the consumer."""
    keys = Keys(ns)
    with pytest.raises(NamespaceNotInitialized):
        await ops.pause(redis, keys)
    await make_namespace(redis, ns)
    await ops.pause(redis, keys)
    assert await redis.hget(keys.state, StateField.PAUSED) == b"1"
    await ops.resume(redis, keys, 3)
    assert await redis.hmget(keys.state, [StateField.PAUSED, StateField.WEIGHT_VERSION]) == [b"0", b"3"]
    with pytest.raises(ConfigError):
        await ops.resume(redis, keys, -1)

    for index in range(3):
        await redis.xadd(keys.groups, {"index": index, "data": b"x"})
    await redis.xreadgroup(TRAINER_GROUP, "gone", {keys.groups: ">"}, count=2)
    assert await ops.release_consumer(redis, keys, "gone") == 2
    assert (await redis.xpending(keys.groups, TRAINER_GROUP))["pending"] == 0
    assert await redis.xlen(keys.groups) == 3
    assert "gone" not in {c["name"].decode() for c in await redis.xinfo_consumers(keys.groups, TRAINER_GROUP)}
