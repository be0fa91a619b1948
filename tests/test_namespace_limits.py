"""Namespace-wide limits and rates: the scripts on Redis directly (leased units, waiters, a limits
hash that is gone, the token bucket), then real ``rollstream produce`` processes: a killed
producer's units come back within the lease, and a rate holds across producers."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys, StateField
from rollstream.common.protocol import NamespaceLimits, parse_limit, parse_rate
from rollstream.consumer import GroupConsumer
from rollstream.ops.snapshot import snapshot
from rollstream.producer.episode_runtime import EpisodeLimits, EpisodeRuntime
from rollstream.producer.shared_limits import SharedLimits
from rollstream.testing.sim import SimEngine
from test_episodes_pipeline import heartbeat
from test_faults import wait_exit

FNS = Path(__file__).with_name("durable_fns.py")


def fn(name: str) -> str:
    return f"{FNS}:{name}"


def test_specs_parse_and_bad_ones_are_config_errors() -> None:
    assert parse_limit("sandbox=64") == ("sandbox", 64)
    assert parse_rate("judge=600/min") == ("judge", 10.0)
    assert parse_rate("judge=2/s") == ("judge", 2.0)
    for bad in ("sandbox", "sandbox=0", "sand box=3", "x=-1"):
        with pytest.raises(ConfigError):
            parse_limit(bad)
    for bad in ("judge=5", "judge=0/s", "judge=5/week"):
        with pytest.raises(ConfigError):
            parse_rate(bad)


async def _view(limits: NamespaceLimits, name: str) -> dict[str, object]:
    return next(v.as_dict() for v in await limits.views() if v.name == name)


async def test_units_are_leased_waiters_listed_and_an_expired_holders_unit_comes_back(redis: Redis, ns: str) -> None:
    limits = NamespaceLimits(redis, Keys(ns))
    await limits.set({"sandbox": 2}, {})
    assert await limits.acquire("sandbox", "a:1", 60_000, 0, 0) == ("ok", 2)
    assert await limits.acquire("sandbox", "b:1", 200, 0, 0) == ("ok", 2)  # a short lease: "b" dies
    assert await limits.acquire("sandbox", "a:2", 60_000, 0, 0) == ("wait", 2)
    assert (await _view(limits, "sandbox"))["waiters"] == 1
    # b never renews: its unit comes back once its lease is over, and the waiter gets it
    await wait_until(lambda: _granted(limits, "a:2"), message="the expired unit back")
    view = await _view(limits, "sandbox")
    assert (view["holders"], view["waiters"], view["acquired"], view["peak"]) == (2, 0, 3, 2)
    assert await limits.renew("sandbox", ["a:1", "b:1"], 60_000) == ["b:1"]
    await limits.release("sandbox", "a:1")
    assert (await _view(limits, "sandbox"))["holders"] == 1


async def _granted(limits: NamespaceLimits, token: str) -> bool:
    return (await limits.acquire("sandbox", token, 60_000, 0, 0))[0] == "ok"


async def test_a_limits_hash_that_is_gone_falls_back_to_the_size_last_read(redis: Redis, ns: str) -> None:
    keys = Keys(ns)
    limits = NamespaceLimits(redis, keys)
    assert await limits.acquire("sandbox", "a:1", 60_000, 0, 0) == ("unknown", 0)
    await redis.delete(keys.limits)  # a Redis restarted without it: the producer's hint holds
    assert await limits.acquire("sandbox", "a:1", 60_000, 1, 0) == ("ok", 1)
    assert await limits.acquire("sandbox", "a:2", 60_000, 1, 0) == ("wait", 1)
    await limits.set({"sandbox": 2}, {})  # the hash, where there is one, wins: raised at runtime
    assert await limits.acquire("sandbox", "a:2", 60_000, 1, 0) == ("ok", 2)


async def test_a_rate_gives_a_burst_then_says_when_the_next_token_is_due(redis: Redis, ns: str) -> None:
    limits = NamespaceLimits(redis, Keys(ns))
    assert await limits.take("judge", 0.0, 0) == ("unknown", 0)
    await limits.set({}, {"judge": 2.0})
    assert [(await limits.take("judge", 0.0, 0))[0] for _ in range(2)] == ["ok", "ok"]
    status, wait_ms = await limits.take("judge", 0.0, 0)
    assert status == "wait" and 0 < wait_ms <= 500
    assert (await _view(limits, "judge"))["acquired"] == 2


async def test_a_killed_producers_units_come_back_within_its_lease(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=1, lease_seconds=3.0)
    limits = NamespaceLimits(redis, keys)
    await limits.set({"sandbox": 1}, {})
    await add_prompts(redis, ns, 1, text="Compute 3 + 4.")
    monkeypatch.setenv("TOOL_LOG", str(tmp_path / "tools.log"))
    monkeypatch.setenv("BLOCK_AT", "1")
    first = procs.producer(redis_url, ns, sim.url, "--generate", fn("limited"), name="a")

    async def one_holds_one_waits() -> bool:
        view = await _view(limits, "sandbox")
        return (view["holders"], view["waiters"]) == (1, 1)

    await wait_until(one_holds_one_waits, message="a holds the unit, its other episode waits")

    async def waiting_holds_no_engine_slot() -> bool:
        beat = await heartbeat(redis, ns, "a")
        return beat.episodes == 2 and beat.engine_requests == 0

    await wait_until(waiting_holds_no_engine_slot, message="two episodes in flight, no engine request")
    first.send_signal(signal.SIGKILL)
    await wait_exit(first)
    monkeypatch.delenv("BLOCK_AT")
    procs.producer(redis_url, ns, sim.url, "--generate", fn("limited"), name="b")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(90):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    assert batch.groups[0].producer == "b"

    async def all_gone() -> bool:  # a's waiting entry lapses within its lease too
        view = await _view(limits, "sandbox")
        return (view["holders"], view["waiters"]) == (0, 0)

    await wait_until(all_gone, message="no holder, no waiter left")
    assert (await _view(limits, "sandbox"))["peak"] == 1  # never two at once


async def test_a_rate_holds_across_producers_and_changes_at_runtime(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=1, batch_size=1)
    limits = NamespaceLimits(redis, keys)
    await limits.set({}, {"judge": 1 / 60})  # one token a minute, a burst of one
    release = tmp_path / "release"
    monkeypatch.setenv("RELEASE", str(release))
    for name in ("a", "b"):  # concurrency 1: the first episode holds its producer until the release
        procs.producer(redis_url, ns, sim.url, "--generate", fn("rated"), name=name, concurrency=1)
    await add_prompts(redis, ns, 2, text="Compute 3 + 4.")

    async def both_admitted() -> bool:
        return int(await redis.hget(keys.state, StateField.ADMITTED) or 0) == 2  # type: ignore[misc]

    await wait_until(both_admitted, message="one episode on each producer")
    await wait_until(lambda: _acquired_is(limits, 1), message="the burst's one token taken")
    assert (await _view(limits, "judge"))["acquired"] == 1  # the other producer's episode waits for the next
    await limits.set({}, {"judge": 10.0})  # `rollstream limits set --rate judge=10/s` while it waits
    await wait_until(lambda: _acquired_is(limits, 2), message="the second token, at the new rate")
    release.touch()
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(2)
        await consumer.commit(batch)
    assert sorted(g.producer for g in batch.groups) == ["a", "b"]


async def _acquired_is(limits: NamespaceLimits, count: int) -> bool:
    return (await _view(limits, "judge"))["acquired"] == count


async def test_a_producer_wide_limit_and_a_namespace_limit_of_one_name_both_apply(redis: Redis, ns: str) -> None:
    keys = Keys(ns)
    limits = NamespaceLimits(redis, keys)
    await limits.set({"sandbox": 2}, {})
    runtime = EpisodeRuntime(None, EpisodeLimits(named={"sandbox": 1}))  # type: ignore[arg-type]  # no engine call
    runtime.shared = SharedLimits(limits, "p", 30.0)
    await runtime.shared.refresh()
    async with runtime.limit("sandbox"):
        assert runtime.named["sandbox"].busy == 1  # the producer's own slot
        assert (await _view(limits, "sandbox"))["holders"] == 1  # and a namespace unit
        snap = await snapshot(redis, keys)  # inspect shows the holder
        assert [(row["name"], row["holders"]) for row in snap["limits"]] == [("sandbox", 1)]
    assert runtime.named["sandbox"].busy == 0 and (await _view(limits, "sandbox"))["holders"] == 0
    with pytest.raises(KeyError):
        runtime.limit("judge")
    with pytest.raises(KeyError):
        await runtime.rate("judge")


def _cli(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "rollstream.cli", *args], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_init_writes_limits_and_rates_and_limits_set_list_remove_change_them(redis_url: str, ns: str) -> None:
    _cli("init", "--redis", redis_url, "--ns", ns, "--n-samples", "2", "--batch-size", "1",
         "--limit", "sandbox=3", "--rate", "judge=120/min")
    rows = {row["name"]: row for row in json.loads(_cli("limits", "list", "--redis", redis_url, "--ns", ns, "--json"))}
    assert (rows["sandbox"]["kind"], rows["sandbox"]["size"]) == ("limit", 3)
    assert (rows["judge"]["kind"], rows["judge"]["size"]) == ("rate", "2/s")
    _cli("limits", "set", "--redis", redis_url, "--ns", ns, "sandbox=5", "--rate", "judge=30/min")
    _cli("limits", "remove", "--redis", redis_url, "--ns", ns, "judge")
    text = _cli("limits", "list", "--redis", redis_url, "--ns", ns)
    assert "sandbox" in text and " 5 " in text and "judge" not in text
    bad = subprocess.run([sys.executable, "-m", "rollstream.cli", "limits", "set", "--redis", redis_url, "--ns", ns,
                          "sandbox=lots"], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "NAME=K" in bad.stderr  # a ConfigError: one line, exit 2


async def test_limits_remove_reaches_running_producers_at_their_next_try(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 49 finding 13: a producer kept applying a removed limit (its last-read size stands in
    for a lost hash, and a removed one looked the same). Its three waiting episodes of a limit of
    one go on once ``rollstream limits remove`` runs, as they would after a ``limits set``: within
    the wait allowed (at least 60 s), far shorter than the producer's re-read of the sizes (a third
    of the 300 s lease)."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=4, batch_size=1, lease_seconds=300.0)
    limits = NamespaceLimits(redis, keys)
    await limits.set({"sandbox": 1}, {})
    tool_log, release = tmp_path / "tools.log", tmp_path / "release"
    monkeypatch.setenv("TOOL_LOG", str(tool_log))
    monkeypatch.setenv("RELEASE", str(release))
    procs.producer(redis_url, ns, sim.url, "--generate", fn("held_until_release"), name="a", concurrency=4)
    await add_prompts(redis, ns, 1, text="Compute 3 + 4.")

    async def one_in_three_waiting() -> bool:
        view = await _view(limits, "sandbox")
        return (view["holders"], view["waiters"]) == (1, 3)

    await wait_until(one_in_three_waiting, message="one episode in the sandbox, three waiting")
    _cli("limits", "remove", "--redis", redis_url, "--ns", ns, "sandbox")

    def inside() -> int:
        return sum(1 for line in (tool_log.read_text().splitlines() if tool_log.exists() else ())
                   if line.split(" ", 1)[1].startswith("sandbox"))

    await wait_until(lambda: inside() == 4, message="all four episodes past the removed limit")
    release.touch()
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    assert len(batch.groups[0].samples) == 4
    assert [row.name for row in await limits.views()] == []  # gone from list and inspect
    _cli("limits", "set", "--redis", redis_url, "--ns", ns, "sandbox=2")  # and set again later
    assert await limits.acquire("sandbox", "x:1", 60_000, 0, 0) == ("ok", 2)


async def test_a_removed_limit_is_not_applied_even_with_a_producers_hint(redis: Redis, ns: str) -> None:
    limits = NamespaceLimits(redis, Keys(ns))
    await limits.set({"sandbox": 1}, {"judge": 1 / 60})
    assert await limits.acquire("sandbox", "a:1", 60_000, 1, 0) == ("ok", 1)
    assert await limits.acquire("sandbox", "a:2", 60_000, 1, 0) == ("wait", 1)
    assert (await limits.take("judge", 1 / 60, 0))[0] == "ok"
    assert await limits.remove(["sandbox", "judge"], 1) == 2
    assert await limits.acquire("sandbox", "a:2", 60_000, 1, 0) == ("removed", 0)
    assert await limits.take("judge", 1 / 60, 0) == ("removed", 0)
    shared = SharedLimits(limits, "p", 30.0)
    await shared.refresh()  # the mark keeps the hash from looking lost
    assert shared.is_removed("sandbox") and not shared.has_limit("sandbox")
    runtime = EpisodeRuntime(None, EpisodeLimits())  # type: ignore[arg-type]  # no engine call
    runtime.shared = shared
    async with runtime.limit("sandbox"):  # unlimited now, not an unknown name
        pass
    await runtime.rate("judge")


async def test_limits_set_or_remove_on_a_namespace_that_does_not_exist_fails(
    redis: Redis, redis_url: str, ns: str
) -> None:
    for args in (("set", "sandbox=3"), ("remove", "sandbox")):
        bad = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "rollstream.cli", "limits", args[0], "--redis", redis_url, "--ns", ns,
                             args[1]], capture_output=True, text=True, timeout=60, check=False,
        )
        assert bad.returncode == 2 and f"namespace {ns!r} has no config" in bad.stderr, bad.stderr
    assert await redis.exists(Keys(ns).limits) == 0  # nothing written


async def test_a_unit_goes_to_the_longest_waiter_not_to_a_newcomer_polling_fast(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 49 finding 19: a real producer's episode waits for the one unit (backed off to a try
    every 0.5 s); a newcomer asks every 20 ms. When the holder lets go, the unit goes to the
    episode, which waited longer; the newcomer gets it after the episode is done with it."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=1, batch_size=1)
    limits = NamespaceLimits(redis, keys)
    await limits.set({"sandbox": 1}, {})
    assert await limits.acquire("sandbox", "holder", 60_000, 0, 0) == ("ok", 1)
    tool_log = tmp_path / "tools.log"
    monkeypatch.setenv("TOOL_LOG", str(tool_log))
    procs.producer(redis_url, ns, sim.url, "--generate", fn("limited"), name="a")
    await add_prompts(redis, ns, 1, text="Compute 3 + 4.")

    async def waiters(count: int) -> bool:
        return (await _view(limits, "sandbox"))["waiters"] == count

    await wait_until(lambda: waiters(1), message="the episode waiting for the unit")
    waiting_since = asyncio.get_running_loop().time()

    async def newcomer() -> bool:
        """Ask every 20 ms until granted; whether the episode had had the unit by then."""
        started = asyncio.get_running_loop().time()
        while True:
            waited_ms = int((asyncio.get_running_loop().time() - started) * 1000)
            if (await limits.acquire("sandbox", "newcomer", 60_000, 0, waited_ms))[0] == "ok":
                return tool_log.exists() and "sandbox 0" in tool_log.read_text()
            await asyncio.sleep(0.02)

    fast = asyncio.create_task(newcomer())
    await wait_until(lambda: waiters(2), message="the newcomer waiting too")
    # the episode's tries are 0.5 s apart by now (20 ms doubling: 1 s of waiting is past the cap)
    await wait_until(lambda: asyncio.get_running_loop().time() - waiting_since > 1.5, message="a long wait")
    await limits.release("sandbox", "holder")
    async with asyncio.timeout(60):
        episode_first = await fast
    assert episode_first, "the newcomer polling fast took the unit from the episode that waited longer"
    await limits.release("sandbox", "newcomer")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(60):
            batch = await consumer.take(1)
        await consumer.commit(batch)
    assert (await _view(limits, "sandbox"))["peak"] == 1


async def test_a_waiter_that_stops_asking_loses_its_place_in_line(redis: Redis, ns: str) -> None:
    limits = NamespaceLimits(redis, Keys(ns))
    await limits.set({"sandbox": 1}, {})
    assert await limits.acquire("sandbox", "h", 60_000, 0, 0) == ("ok", 1)
    assert await limits.acquire("sandbox", "dead", 60_000, 0, 5_000, 300) == ("wait", 1)  # first in line
    assert await limits.acquire("sandbox", "live", 60_000, 0, 0, 300) == ("wait", 1)
    await limits.release("sandbox", "h")
    assert await limits.acquire("sandbox", "live", 60_000, 0, 10, 300) == ("wait", 1)  # "dead" is ahead
    # "dead" never asks again: within its 300 ms the line is "live"'s
    await wait_until(lambda: _granted_to(limits, "live"), message="the unit for the live waiter")


async def _granted_to(limits: NamespaceLimits, token: str) -> bool:
    return (await limits.acquire("sandbox", token, 60_000, 0, 100, 300))[0] == "ok"
