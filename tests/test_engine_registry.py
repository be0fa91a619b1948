"""The engine registry (``rollstream engines``): engines joining and leaving a running producer
(``--engines-from-registry``), with nothing lost and nothing doubled."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections import Counter

import httpx
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, take_all, wait_until
from redis.asyncio import Redis
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.protocol import EngineRegistry, check_engine_url
from rollstream.common.urls import check_url
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine.settings import EngineSettings
from rollstream.testing.sim import SimConfig, SimEngine


async def cli(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollstream.cli", *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


@pytest.mark.parametrize("url", [
    "ftp://x", "http://", "http://user:secret@h:1", "http://a b", "sglang-0:30000", "http://127.0.0.1:99999",
    "http://127.0.0.1:abc", "http://127.0.0.1:0", "http://h:", "http://[::1", "http://::1:8000",
])
def test_urls_that_cannot_be_registered_are_refused(url: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(repr(url)) + "|credentials"):
        check_engine_url(url)


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999", "http://[::1", "ftp://h:1", "http://h:abc"])
def test_one_check_for_every_url_that_reaches_the_fleet(url: str) -> None:
    """``--engine`` (the engine settings) refuses what ``engines add`` refuses, naming the URL."""
    with pytest.raises(ConfigError, match=re.escape(repr(url))):
        EngineSettings(urls=(url,))
    with pytest.raises(ConfigError, match=re.escape(repr(url))):
        check_engine_url(url)


def test_the_scheme_is_case_insensitive_everywhere_and_ipv6_hosts_keep_their_brackets() -> None:
    assert check_engine_url("HTTP://127.0.0.1:5/") == "http://127.0.0.1:5"
    assert EngineSettings(urls=("HTTPS://e:1",)).urls == ("https://e:1",)
    assert check_url("http://[::1]:8000") == "http://[::1]:8000"
    assert EngineSettings(urls=("http://u:pw@[::1]:8000",)).urls == ("http://u:pw@[::1]:8000",)  # --engine may


async def test_bad_registry_entries_are_skipped_with_a_warning_and_never_kill_a_producer(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """Entries written past ``engines add`` (redis-cli) with a port out of range, no port digits or
    an unclosed IPv6 bracket: at start and while running, the producer skips each with a warning
    naming it and trains every prompt (was: every registry producer dead within 150 ms)."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    active = json.dumps({"state": "active"})
    await redis.hset(keys.engines, mapping={sim.url.replace("http://", "HTTP://"): active,
                                            "http://127.0.0.1:99999": active, "http://[::1": active})
    producer = _produce_from_registry(procs, redis_url, ns)
    await add_prompts(redis, ns, 8)
    taken = await take_all(redis_url, ns, 8, 2, timeout=60)
    await redis.hset(keys.engines, "http://127.0.0.1:abc", active)  # read by the running producer

    def warned() -> bool:
        return "'http://127.0.0.1:abc' skipped" in procs.log_of(producer)

    await wait_until(warned, timeout=30, message="the entry added while running skipped with a warning")
    await add_prompts(redis, ns, 8, start=8)
    taken += await take_all(redis_url, ns, 8, 2, timeout=60)
    assert Counter(taken) == Counter(range(16))
    assert producer.poll() is None, procs.log_of(producer)
    log = procs.log_of(producer)
    assert "'http://127.0.0.1:99999' skipped" in log and "'http://[::1' skipped" in log, log


async def test_engines_add_refuses_a_bad_port_and_names_the_url(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns)
    for url in ("http://127.0.0.1:99999", "http://[::1"):
        code, out = await cli("engines", "add", "--redis", redis_url, "--ns", ns, url)
        assert code == 2 and url in out and "Traceback" not in out, out
    assert await redis.hlen(Keys(ns).engines) == 0
    code, out = await cli("produce", "--redis", redis_url, "--ns", ns, "--concurrency", "4", "--reward", "math",
                          "--engine", "http://127.0.0.1:99999")
    assert code == 2 and "http://127.0.0.1:99999" in out and "Traceback" not in out, out


async def test_the_cli_adds_drains_lists_and_removes(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns)
    base = ("--redis", redis_url, "--ns", ns)
    assert (await cli("engines", "add", *base, "http://e1:30000", "https://e2/"))[0] == 0
    code, out = await cli("engines", "add", *base, "http://u:pw@e3:1")
    assert code == 2 and "credentials" in out
    code, out = await cli("engines", "drain", *base, "http://nope:1")
    assert code == 2 and "not registered" in out
    assert (await cli("engines", "drain", *base, "http://e1:30000"))[0] == 0
    code, out = await cli("engines", "list", *base, "--json")
    listed = {e["url"]: e["state"] for e in json.loads(out[out.index("[") :])}
    assert listed == {"http://e1:30000": "draining", "https://e2": "active"}
    assert (await cli("engines", "remove", *base, "http://e1:30000"))[0] == 0
    assert set(await EngineRegistry(redis, Keys(ns)).entries()) == {"https://e2"}
    await redis.hset(Keys(ns).engines, "http://bad", b"\xff")
    assert (await EngineRegistry(redis, Keys(ns)).entries())["http://bad"].damage == "not JSON"


async def _take_pairs(consumer: GroupConsumer, taken: list[int], count: int) -> None:
    """Take and commit ``count`` groups two at a time, their indexes appended to ``taken``."""
    async with asyncio.timeout(120):
        while count > 0:
            batch = await consumer.take(2)
            taken.extend(g.index for g in batch.groups)
            await consumer.commit(batch)
            count -= 2


async def _requests(engine: SimEngine) -> int:
    async with httpx.AsyncClient() as http:
        stats = (await http.get(f"{engine.url}/sim/stats")).json()
    return int(stats["requests"])


async def test_engines_join_and_drain_under_a_running_producer_and_every_prompt_is_trained_once(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    keys = Keys(ns)
    registry = EngineRegistry(redis, keys)
    # a small backlog paces the producer by the takes, so prompts are left when the engine joins
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_backlog=4)
    slow = SimConfig(seed=4, mean_tokens=16, latency_per_token=0.01)
    async with SimEngine(slow) as joining:
        await redis.hset(keys.engines, "not a url", json.dumps({"state": "active"}))  # skipped, with a warning
        producer = procs.producer(redis_url, ns, sim.url, "--engines-from-registry", name="follower", concurrency=4)
        await add_prompts(redis, ns, 40)
        taken: list[int] = []
        async with GroupConsumer.connect(redis_url, ns, "trainer-r") as consumer:
            async def take(count: int) -> None:
                await _take_pairs(consumer, taken, count)

            await take(4)
            await registry.add([joining.url])

            async def joined() -> bool:
                beat = json.loads((await redis.hget(keys.producers, "follower")) or "{}")
                states = {e["url"]: e.get("state") for e in beat.get("engine_fleet", [])}
                return states.get(joining.url) not in (None, "joining")

            await wait_until(joined, timeout=60, message="the registered engine answered its first probe")
            async with asyncio.timeout(120):  # taking, so the backlog never stops the producer meanwhile
                while not await _requests(joining):
                    await take(2)
            await take(min(10, 40 - len(taken) - 10))
            await registry.drain([joining.url])

            async def drained() -> bool:
                beat = json.loads((await redis.hget(keys.producers, "follower")) or "{}")
                states = {e["url"]: e for e in beat.get("engine_fleet", [])}
                entry = states.get(joining.url, {})
                return entry.get("state") == "draining" and entry.get("in_flight") == 0

            await wait_until(drained, timeout=60, message="the drained engine idle")
            after_drain = await _requests(joining)
            await take(40 - len(taken))
        assert Counter(taken) == Counter(range(40))  # nothing lost, nothing doubled
        assert await _requests(joining) == after_drain  # a drained engine gets no new requests
    assert producer.poll() is None, procs.log_of(producer)
    assert "engine registry entry 'not a url' skipped" in procs.log_of(producer)


def _produce_from_registry(procs: ProcessPool, redis_url: str, ns: str, *extra: str) -> subprocess.Popen[bytes]:
    """A producer with no ``--engine``: its engines are the registry's."""
    return procs.start("produce", "--redis", redis_url, "--ns", ns, "--engines-from-registry", "--concurrency", "4",
                       "--reward", "math", "--max-new-tokens", "256", "--heartbeat-interval", "0.5",
                       "--name", "registry-only", *extra, log_name="registry-only")


async def test_a_producer_on_the_registry_alone_follows_engines_replacing_each_other(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """No ``--engine``: the producer starts on the registry's engine; removed while another is
    added, it is drained and dropped, the prompts after go to the new one, and every prompt is
    trained once."""
    keys = Keys(ns)
    registry = EngineRegistry(redis, keys)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    await registry.add([sim.url])
    async with SimEngine(SimConfig(seed=6, mean_tokens=16)) as second:
        producer = _produce_from_registry(procs, redis_url, ns)
        taken: list[int] = []
        async with GroupConsumer.connect(redis_url, ns, "trainer-alone") as consumer:
            async def take(count: int) -> None:
                await _take_pairs(consumer, taken, count)

            await add_prompts(redis, ns, 12)
            await take(12)
            await registry.add([second.url])
            await registry.remove([sim.url])

            async def replaced() -> bool:
                beat = json.loads((await redis.hget(keys.producers, "registry-only")) or "{}")
                return [e["url"] for e in beat.get("engine_fleet", [])] == [second.url]

            await wait_until(replaced, timeout=60, message="the removed engine dropped, the added one in the fleet")
            first_requests = await _requests(sim)
            await add_prompts(redis, ns, 12, start=12)
            await take(12)
        assert Counter(taken) == Counter(range(24))  # nothing lost, nothing doubled
        assert await _requests(sim) == first_requests and await _requests(second) > 0
    assert producer.poll() is None, procs.log_of(producer)


async def test_produce_without_engines_says_what_to_give(redis: Redis, redis_url: str, ns: str) -> None:
    await make_namespace(redis, ns)
    base = ("produce", "--redis", redis_url, "--ns", ns, "--concurrency", "4", "--reward", "math")
    code, out = await cli(*base)
    assert code == 2 and "--engine URL" in out and "--engines-from-registry" in out, out
    code, out = await cli(*base, "--engines-from-registry", "--no-engine-timeout", "0.5")
    assert code == 2 and "lists no active engine" in out and "rollstream engines add" in out, out


async def test_produce_on_a_namespace_never_initialised_says_to_run_init(redis_url: str, ns: str) -> None:
    """Was: ``--concurrency``/``--reward`` asked for, as if giving them would help."""
    code, out = await cli("produce", "--redis", redis_url, "--ns", ns, "--engine", "http://127.0.0.1:30000")
    assert code == 2 and "rollstream init" in out and ns in out and "--concurrency" not in out, out
