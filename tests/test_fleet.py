"""The engine fleet (producer/engine/fleet.py): engines fail one at a time. Routing on its own
(bounded loads, cache affinity, states), and real producer processes against a sick fleet."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, take_all, wait_until
from redis.asyncio import Redis
from rollstream.common.events import recent_events
from rollstream.common.keys import Keys
from rollstream.common.protocol import EngineRegistry
from rollstream.producer.engine import EngineClient, EngineSettings, EngineState
from rollstream.producer.engine.fleet import Fleet
from rollstream.producer.engine.monitor import COLD_STALL_BOUND, STALL_FACTOR
from rollstream.producer.engine.routing import AFFINITY_SLACK
from rollstream.testing.sim import SimConfig, SimEngine
from test_inspect import run_inspect

REFUSING = "http://127.0.0.1:9"
"""Nothing listens there: a dead host (connection refused)."""


def test_a_groups_requests_go_to_one_engine_while_its_load_stays_within_the_bound() -> None:
    fleet = Fleet([f"http://e{i}" for i in range(4)], balance=0.25)
    # Light load: each key keeps to its own engine.
    homes = {}
    for k in range(40):
        engine = fleet.pick(f"{k}:0")
        assert engine is not None
        homes[k] = engine.url
        assert fleet.pick(f"{k}:0") is engine  # the same key, the same engine
    assert len(set(homes.values())) == 4  # keys spread over the ring
    # Heavy load on one key: never above (1 + balance) x the mean (and the slack a group keeps).
    for _ in range(400):
        engine = fleet.pick("hot:0")
        assert engine is not None
        engine.in_flight += 1
        loads = [e.in_flight for e in fleet.engines.values()]
        assert max(loads) <= 1.25 * sum(loads) / len(loads) + 1 + AFFINITY_SLACK
    assert min(loads) < max(loads) / 2  # one hot key fills the ring's first engines, not all at random


def test_engines_out_of_routing_get_nothing_and_the_last_one_is_never_taken_out() -> None:
    fleet = Fleet(["http://a", "http://b", "http://c"], eject_after=2)
    a, b, c = (fleet.engines[u] for u in ("http://a", "http://b", "http://c"))
    assert fleet.failed(a, "connection refused", at_once=True) and a.state is EngineState.EJECTED
    assert not fleet.failed(b, "HTTP 500") and b.state is EngineState.SUSPECT
    assert fleet.failed(b, "HTTP 500") and b.state is EngineState.EJECTED
    assert {fleet.pick(f"{k}:0").url for k in range(20)} == {"http://c"}  # type: ignore[union-attr]
    assert not fleet.failed(c, "reset", at_once=True) and c.routed  # the last one stays, suspect
    fleet.rejoin(a, "probe answered")
    assert a.state is EngineState.SUSPECT and a.routed
    fleet.answered(a)
    assert a.state is EngineState.HEALTHY


def test_an_engine_behind_the_trainer_gets_no_work_and_rejoins_when_it_caught_up() -> None:
    fleet = Fleet(["http://a", "http://b"])
    a, b = fleet.engines["http://a"], fleet.engines["http://b"]
    fleet.set_trainer_version(7, 1)
    fleet.version_seen(a, 7)
    fleet.version_seen(b, 0)
    assert b.state is EngineState.BEHIND and "at version 0, the trainer at 7" in b.reason
    assert {fleet.pick(f"{k}:0").url for k in range(20)} == {"http://a"}  # type: ignore[union-attr]
    fleet.version_seen(b, 6)
    assert b.state is EngineState.HEALTHY


def test_engines_of_a_fleet_join_only_after_their_first_answer() -> None:
    fleet = Fleet(["http://a", "http://b"], joining=True)
    a, b = fleet.engines["http://a"], fleet.engines["http://b"]
    assert a.state is b.state is EngineState.JOINING and fleet.pick("1:0") is None
    assert fleet.failed(a, "refused", at_once=True) and a.state is EngineState.JOINING  # still waits to join
    fleet.joined(b, "probe answered")
    assert {fleet.pick(f"{k}:0").url for k in range(20)} == {"http://b"}  # type: ignore[union-attr]
    assert [e["state"] for e in fleet.status()] == ["joining", "healthy"]


def test_registry_engines_join_drain_and_leave() -> None:
    fleet = Fleet(["http://static"])
    fleet.apply_registry({"http://new": "active"}, drain_timeout=60)
    new = fleet.engines["http://new"]
    assert new.state is EngineState.JOINING and not new.routed  # no request before its first answer
    assert {fleet.pick(f"{k}:0").url for k in range(20)} == {"http://static"}  # type: ignore[union-attr]
    fleet.joined(new, "probe answered")
    assert new.state is EngineState.HEALTHY and new.routed
    fleet.apply_registry({"http://new": "draining"}, drain_timeout=60)
    assert fleet.engines["http://new"].state is EngineState.DRAINING
    fleet.apply_registry({}, drain_timeout=60)
    fleet.drop_drained(now=0.0)
    assert list(fleet.engines) == ["http://static"]


class _Wedged:
    """Accepts connections and reads, never answers: a GPU or NCCL hang."""

    def __init__(self) -> None:
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def __aenter__(self) -> _Wedged:
        async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            self._writers.append(writer)
            while await reader.read(65536):
                pass

        self._server = await asyncio.start_server(hold, "127.0.0.1", 0)
        return self

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        for writer in self._writers:
            writer.close()
        self._server.close()


async def test_a_sick_fleet_costs_only_its_sick_engines_requests(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """Four engines: two healthy, one refusing connections (a dead host), one wedged (accepts,
    never answers, /health hangs too). Every prompt is trained once, the producer never exits,
    and its heartbeat names the sick engines with their state (was: a fatal EngineError within
    seconds, every retry back on the dead engine, the run stalled). Neither ever answered a
    probe, so neither ever joined: both are ``joining`` and got no request (issue 43)."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    await add_prompts(redis, ns, 16)
    async with SimEngine(SimConfig(seed=3, mean_tokens=16)) as second, _Wedged() as wedged:
        producer = procs.producer(
            redis_url, ns, sim.url, "--engine", second.url, "--engine", REFUSING, "--engine", wedged.url,
            "--health-interval", "0.5", "--health-timeout", "1.0", name="sick-fleet", concurrency=8,
        )
        taken = await take_all(redis_url, ns, 16, 4, timeout=180)
        assert Counter(taken) == Counter(range(16))
        assert producer.poll() is None, procs.log_of(producer)

        async def sick_states() -> dict[str, str] | None:
            beat = json.loads((await redis.hget(keys.producers, "sick-fleet")) or "{}")
            states = {e["url"]: e["state"] for e in beat.get("engine_fleet", [])}
            healthy = {states.get(sim.url), states.get(second.url)} <= {"healthy", "suspect"}
            return states if healthy and states.get(REFUSING) == states.get(wedged.url) == "joining" else None

        await wait_until(sick_states, timeout=30, message="the sick engines named in the heartbeat, the others healthy")
        assert wedged.connections >= 1  # probed (its /health hangs), never sent a request
        _, out = await run_inspect(redis_url, ns)
        assert f"engine {wedged.url} joining" in " ".join(out.split()), out
        log = procs.log_of(producer)
        assert "sent again elsewhere" not in log and f"engine {wedged.url}: joining ->" not in log, log
    assert not [e for e in await recent_events(redis, keys) if e.kind == "fatal"]


@pytest.mark.parametrize("unused", [None])
def test_fleet_status_names_the_hit_rate_where_the_engine_reports_it(unused: None) -> None:
    fleet = Fleet(["http://a"])
    a = fleet.engines["http://a"]
    assert "prefix_hit_rate" not in a.status()
    a.prompt_tokens, a.cached_tokens = 100, 75
    assert a.status()["prefix_hit_rate"] == 0.75


def test_a_large_fleets_status_lists_only_its_engines_in_trouble() -> None:
    fleet = Fleet([f"http://e{i}" for i in range(100)])
    assert len(fleet.status()) == 0
    fleet.failed(fleet.engines["http://e7"], "refused", at_once=True)
    assert [e["url"] for e in fleet.status()] == ["http://e7"]
    assert len(Fleet([f"http://e{i}" for i in range(10)]).status()) == 10


async def test_catch_up_engines_loads_the_recorded_weights_into_an_engine_found_behind(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """The trainer at version 5 recorded where its weights are; one of two engines restarted on
    version 0. A producer with ``--catch-up-engines`` finds it behind, loads the weights into it
    (SGLang ``/update_weights_from_disk``) and routes to it again; every prompt is trained once."""
    import httpx
    from rollstream.consumer import GroupConsumer

    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_staleness=1)
    async with GroupConsumer.connect(redis_url, ns, "trainer-catch-up") as consumer:
        await consumer.set_weight_version(5)
        await consumer.record_weights("/checkpoints/step-5", 5)
    async with SimEngine(SimConfig(seed=8, mean_tokens=16, weight_version=5)) as old, httpx.AsyncClient() as http:
        await http.post(f"{sim.url}/sim/restart", json={"version": 5})
        await http.post(f"{old.url}/sim/restart", json={"version": 0})
        producer = procs.producer(redis_url, ns, sim.url, "--engine", old.url, "--catch-up-engines",
                                  "--health-interval", "0.3", name="catching-up", concurrency=4)

        async def caught_up() -> bool:
            beat = json.loads((await redis.hget(keys.producers, "catching-up")) or "{}")
            states = {e["url"]: (e["state"], e["version"]) for e in beat.get("engine_fleet", [])}
            return states.get(old.url) in (("healthy", 5), ("suspect", 5))

        await add_prompts(redis, ns, 16)  # admissions tell the producer the trainer's version
        taken = await take_all(redis_url, ns, 16, 2, timeout=120)
        await wait_until(caught_up, timeout=60, message="the old engine caught up")
        stats = (await http.get(f"{old.url}/sim/stats")).json()
        assert stats["weight_version"] == 5
        await add_prompts(redis, ns, 16, start=16)
        taken += await take_all(redis_url, ns, 16, 2, timeout=120)
        assert Counter(taken) == Counter(range(32))
        assert (await http.get(f"{old.url}/sim/stats")).json()["requests"] > stats["requests"]  # routed to again
    log = procs.log_of(producer)
    assert "loading /checkpoints/step-5 (version 5)" in log and "behind" in log, log


async def test_catch_up_engines_catches_up_a_fleet_of_one_and_waits_for_it_rather_than_fail(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool
) -> None:
    """One engine, restarted on version 0; the trainer at 5 recorded its weights. With
    ``--catch-up-engines`` the producer holds the engine out of routing while they load (3 s, past
    ``--no-engine-timeout 1``: requests wait for it, the producer does not fail for want of an
    engine), then routes to it again; every prompt is trained once. Was: a fleet of one was never
    checked for its version, so the engine stayed healthy at version 0 and every group it made was
    recycled as stale, indefinitely."""
    import httpx
    from rollstream.consumer import GroupConsumer

    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_staleness=1)
    async with GroupConsumer.connect(redis_url, ns, "trainer-one-engine") as consumer:
        await consumer.set_weight_version(5)
        await consumer.record_weights("/checkpoints/step-5", 5)
    config = SimConfig(seed=11, mean_tokens=16, latency_per_token=0.002)
    async with SimEngine(config) as only, httpx.AsyncClient() as http:
        await http.post(f"{only.url}/sim/faults", json={"reload_seconds": 3})
        producer = procs.producer(redis_url, ns, only.url, "--catch-up-engines", "--health-interval", "0.3",
                                  "--no-engine-timeout", "1", name="one-engine", concurrency=4)
        await add_prompts(redis, ns, 16)
        taken = await take_all(redis_url, ns, 16, 2, timeout=90)
        assert Counter(taken) == Counter(range(16))
        assert only.state.reloads == ["/checkpoints/step-5"] and only.state.weight_version == 5

        async def routed_at_version_5() -> bool:  # what the heartbeat shows (written every 0.5 s)
            return _engine_state(await _beat(redis, keys, "one-engine"), only.url) in (("healthy", 5), ("suspect", 5))

        await wait_until(routed_at_version_5, timeout=30, message="the heartbeat: routed, at version 5")
        assert producer.poll() is None, procs.log_of(producer)
    log = procs.log_of(producer)
    assert "held while version 5 loads into it" in log and "loaded version 5" in log, log
    assert "no usable engine" not in log, log


async def test_a_fleet_of_one_whose_catch_up_does_not_take_is_routed_again(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool
) -> None:
    """One engine at version 0, the trainer at 5, and a reload that answers success and loads
    nothing: the engine is held for the catch-up, then routed again (the only engine: a fleet
    without one would be fatal) with the reason shown, and tried again only after the pause. The
    producer runs on; nothing says "no usable engine"."""
    from rollstream.consumer import GroupConsumer
    from rollstream.testing.sim.sglang_api import NOT_TAKEN

    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_staleness=1)
    async with SimEngine(SimConfig(seed=13, mean_tokens=16, latency_per_token=0.002)) as only, \
            GroupConsumer.connect(redis_url, ns, "trainer-one-not-taken") as consumer:
        await consumer.set_weight_version(5)
        await consumer.record_weights(f"/checkpoints/{NOT_TAKEN}-5", 5)
        producer = procs.producer(redis_url, ns, only.url, "--catch-up-engines", "--health-interval", "0.3",
                                  "--no-engine-timeout", "1", name="one-not-taken", concurrency=4)
        await add_prompts(redis, ns, 8)
        # the trainer takes: every group (version 0) is recycled as stale, so requests keep coming
        taking = asyncio.create_task(consumer.take(2))
        try:

            async def reloaded() -> int | None:
                return only.state.requests if only.state.reloads else None

            requests = await wait_until(reloaded, timeout=60, message="the catch-up's reload")

            async def routed_again() -> bool:
                return only.state.requests >= requests + 8  # held, it got none

            await wait_until(routed_again, timeout=30, message="requests on the only engine again")
        finally:
            taking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taking

        async def routed_at_version_0() -> bool:  # what the heartbeat shows (written every 0.5 s)
            beat = await _beat(redis, keys, "one-not-taken")
            return _engine_state(beat, only.url) in (("healthy", 0), ("suspect", 0))

        await wait_until(routed_at_version_0, timeout=30, message="the heartbeat: routed, at version 0")
        assert only.state.reloads == [f"/checkpoints/{NOT_TAKEN}-5"]
        assert producer.poll() is None, procs.log_of(producer)
    log = procs.log_of(producer)
    assert "held while version 5 loads into it" in log and "no usable engine" not in log, log
    assert f"engine {only.url}: behind -> suspect: behind: reload did not take" in log, log


async def test_a_vllm_catch_up_empties_the_prefix_cache_its_reload_keeps(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool
) -> None:
    """``--engine-api vllm``: a prompt generated on version 0 is cached; the trainer moves to 3 and
    the engine is caught up (``reload_weights`` keeps the cache, as vLLM's does). The same prompt
    again reuses no KV from the old weights: the catch-up resets the prefix cache before the label
    moves. Was: every cached block of it was reused under the new weights (the simulator's
    ``stale_cached_tokens``; on real vLLM, samples labelled new that match neither version)."""
    import httpx
    from rollstream.consumer import GroupConsumer

    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_staleness=0)
    text = "Think it through step by step, then write the answer in a box. " * 4 + "Compute 3 + 1."
    config = SimConfig(seed=12, mean_tokens=16, latency_per_token=0.001, prefix_cache_tokens=1 << 16)
    async with SimEngine(config) as only, httpx.AsyncClient() as http, \
            GroupConsumer.connect(redis_url, ns, "trainer-vllm-cache") as consumer:
        await consumer.set_weight_version(0)
        producer = procs.producer(redis_url, ns, only.url, "--engine-api", "vllm", "--catch-up-engines",
                                  "--health-interval", "0.3", name="vllm-cache", concurrency=4)
        await add_prompts(redis, ns, 4, text=text)
        taken = await _take(consumer, 4)
        before = (await http.get(f"{only.url}/sim/stats")).json()
        assert before["stale_cached_tokens"] == 0 and only.state.prefix_cache, before  # the prompt is cached
        await consumer.pause()
        await consumer.record_weights("/checkpoints/step-3", 3)
        await consumer.resume(3)
        await add_prompts(redis, ns, 4, start=4, text=text)
        taken += await _take(consumer, 4)
        after = (await http.get(f"{only.url}/sim/stats")).json()
    assert Counter(taken) == Counter(range(8))
    assert only.state.reloads == ["/checkpoints/step-3"] and after["weight_version"] == 3, after
    assert after["cached_tokens"] > before["cached_tokens"], after  # the prompt was cached again, afresh
    assert after["stale_cached_tokens"] == 0, after
    assert "loaded version 3" in procs.log_of(producer)


async def _take(consumer: Any, count: int, timeout: float = 60) -> list[int]:
    """Take and commit ``count`` groups with ``consumer`` (the namespace's one trainer)."""
    indexes: list[int] = []
    async with asyncio.timeout(timeout):
        while len(indexes) < count:
            batch = await consumer.take(min(2, count - len(indexes)))
            indexes += [g.index for g in batch.groups]
            assert await consumer.commit(batch) == len(batch)
    return indexes


async def _beat(redis: Redis, keys: Keys, name: str) -> dict[str, object]:
    return json.loads((await redis.hget(keys.producers, name)) or "{}")  # type: ignore[no-any-return]


def _engine_state(beat: dict[str, object], url: str) -> tuple[str, int | None] | None:
    fleet = beat.get("engine_fleet")
    states = {e["url"]: (e["state"], e["version"]) for e in fleet} if isinstance(fleet, list) else {}
    return states.get(url)


async def test_a_refused_admission_never_tells_the_fleet_the_trainer_is_at_version_0(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """The trainer at 5, one engine restarted on version 0 (no catch-up): found behind while
    prompts are admitted, it stays behind through the refusals that follow (feed ended: ``empty``;
    paused). Was: every refusal carried version 0, the engine was logged ``caught up: at version
    0`` and routed to again."""
    import httpx
    from rollstream.consumer import GroupConsumer

    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_staleness=1)
    async with SimEngine(SimConfig(seed=9, mean_tokens=16, weight_version=5)) as old, httpx.AsyncClient() as http:
        await http.post(f"{sim.url}/sim/restart", json={"version": 5})
        await http.post(f"{old.url}/sim/restart", json={"version": 0})
        async with GroupConsumer.connect(redis_url, ns, "trainer-refusals") as consumer:
            await consumer.set_weight_version(5)
            producer = procs.producer(redis_url, ns, sim.url, "--engine", old.url, "--health-interval", "0.3",
                                      name="refused", concurrency=4)
            await add_prompts(redis, ns, 8)

            async def behind() -> bool:
                return _engine_state(await _beat(redis, keys, "refused"), old.url) == ("behind", 0)

            await wait_until(behind, timeout=60, message="the old engine found behind")
            taken = await take_all(redis_url, ns, 8, 2, timeout=60)  # the feed ends: 'empty' refusals
            await consumer.pause()

            async def paused_beats() -> int | None:
                beat = await _beat(redis, keys, "refused")
                return int(beat["last_seen_ms"]) if beat.get("admission") == "paused" else None  # type: ignore[call-overload]

            first = await wait_until(paused_beats, timeout=30, message="the producer refused as paused")

            async def later_beats() -> bool:
                seen = await paused_beats()
                return seen is not None and seen >= first + 1500  # three heartbeats (and monitor ticks) later

            await wait_until(later_beats, timeout=30, message="heartbeats after the refusals")
            assert _engine_state(await _beat(redis, keys, "refused"), old.url) == ("behind", 0)
    assert Counter(taken) == Counter(range(8))
    assert "caught up" not in procs.log_of(producer), procs.log_of(producer)


async def test_a_catch_up_that_does_not_take_backs_off_and_names_the_engine(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """The reload answers success and the engine stays at version 0: one reload, then a pause,
    and the engine's reason says ``behind: reload did not take``. Was: a reload every monitor tick,
    indefinitely (back-to-back weight loads on a real engine)."""
    import httpx
    from rollstream.consumer import GroupConsumer
    from rollstream.testing.sim.sglang_api import NOT_TAKEN

    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, max_staleness=1)
    async with SimEngine(SimConfig(seed=10, mean_tokens=16)) as old, httpx.AsyncClient() as http:
        await http.post(f"{sim.url}/sim/restart", json={"version": 5})
        async with GroupConsumer.connect(redis_url, ns, "trainer-not-taken") as consumer:
            await consumer.set_weight_version(5)
            await consumer.record_weights(f"/checkpoints/{NOT_TAKEN}-5", 5)
        producer = procs.producer(redis_url, ns, sim.url, "--engine", old.url, "--catch-up-engines",
                                  "--health-interval", "0.3", name="not-taken", concurrency=4)
        await add_prompts(redis, ns, 8)

        async def named() -> str | None:
            for entry in (await _beat(redis, keys, "not-taken")).get("engine_fleet", []):  # type: ignore[union-attr]
                if entry["url"] == old.url and "behind: reload did not take" in entry.get("reason", ""):
                    return str(entry["reason"])
            return None

        await wait_until(named, timeout=60, message="the engine named: behind, reload did not take")
        first = int((await _beat(redis, keys, "not-taken"))["last_seen_ms"])  # type: ignore[call-overload]

        async def later() -> bool:
            return int((await _beat(redis, keys, "not-taken"))["last_seen_ms"]) >= first + 3000  # type: ignore[call-overload]

        await wait_until(later, timeout=30, message="ten monitor ticks later")
        assert old.state.reloads == [f"/checkpoints/{NOT_TAKEN}-5"]
        taken = await take_all(redis_url, ns, 8, 2, timeout=60)
    assert Counter(taken) == Counter(range(8))
    log = procs.log_of(producer)
    assert f"engine {old.url}: behind: reload did not take" in log, log


class _Stuck:
    """Answers ``/health`` and ``/model_info``, never finishes a generation: a scheduler hang that
    the health endpoint does not see."""

    def __init__(self) -> None:
        self.generations = 0
        self._closing = asyncio.Event()
        self._runner: Any = None
        self.url = ""

    async def __aenter__(self) -> _Stuck:
        from aiohttp import web

        async def health(request: web.Request) -> web.Response:
            return web.json_response({})

        async def model_info(request: web.Request) -> web.Response:
            return web.json_response({"weight_version": "0"})

        async def generate(request: web.Request) -> web.Response:
            self.generations += 1
            await self._closing.wait()  # never answers while the test runs
            return web.json_response({"error": "shutting down"}, status=503)

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/model_info", model_info)
        app.router.add_post("/generate", generate)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing.set()
        await self._runner.cleanup()


async def test_an_engine_that_answers_health_and_never_a_generation_is_suspect_and_its_requests_go_elsewhere(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """Its /health answers, so it is never wedged; it holds requests and answers none. Past a
    bound derived from the fleet's reply times (well under --request-timeout, 3,600 s) it is
    ``suspect``, gets no new work, and its requests are sent to the healthy engine: every prompt
    is trained. Was: no group committed in 60 s, every slot on it, ``inspect`` saying healthy."""
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    async with _Stuck() as stuck:
        producer = procs.producer(redis_url, ns, sim.url, "--engine", stuck.url, "--health-interval", "0.5",
                                  "--no-adaptive-concurrency", name="stuck-fleet", concurrency=8)
        await add_prompts(redis, ns, 16)
        taken = await take_all(redis_url, ns, 16, 2, timeout=120)
        assert Counter(taken) == Counter(range(16))
        assert stuck.generations > 0  # it was sent requests, and they went elsewhere
        log = procs.log_of(producer)
        assert f"engine {stuck.url}: healthy -> suspect:" in log and "no answer for" in log, log
    assert producer.poll() is None, procs.log_of(producer)


async def test_a_stuck_engine_that_took_every_request_before_any_engine_answered_is_stalled_too(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool
) -> None:
    """The cold case: the stuck engine is the only one when the producer starts, so it holds every
    slot, and the healthy engine joins later. No engine has answered a generation, so there is no
    mean reply time to bound the silence by; the cold bound (``COLD_STALL_BOUND``, at most a
    quarter of ``--request-timeout``: 15 s here) stalls it anyway and every prompt is trained. Was: no bound
    at all, the producer stuck until ``--request-timeout`` (3,600 s by default)."""
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    registry = EngineRegistry(redis, Keys(ns))
    async with _Stuck() as stuck:
        await registry.add([stuck.url])
        producer = procs.start(
            "produce", "--redis", redis_url, "--ns", ns, "--engines-from-registry", "--concurrency", "8",
            "--reward", "math", "--max-new-tokens", "64", "--heartbeat-interval", "0.5", "--health-interval", "0.5",
            "--no-adaptive-concurrency", "--request-timeout", "60", "--name", "cold-fleet", log_name="cold-fleet",
        )
        await add_prompts(redis, ns, 16)
        await wait_until(lambda: stuck.generations >= 8, timeout=60, message="every slot on the stuck engine")
        await registry.add([sim.url])
        # under the request timeout (60 s), which would end the stuck requests without a bound
        taken = await take_all(redis_url, ns, 16, 2, timeout=50)
        assert Counter(taken) == Counter(range(16))
        log = procs.log_of(producer)
        assert f"engine {stuck.url}: healthy -> suspect:" in log and "no engine has answered yet" in log, log
    assert producer.poll() is None, procs.log_of(producer)


async def test_the_cold_bound_doubles_with_each_stall_made_under_it_and_gives_way_to_reply_times() -> None:
    """A fleet whose first generations are merely long is re-sent a few times at most: each cold
    stall doubles the bound; once an engine has answered, its reply times set the bound."""
    urls = ("http://127.0.0.1:9", "http://127.0.0.1:10")
    async with EngineClient(EngineSettings(urls=urls, adaptive_concurrency=False, request_timeout=3600)) as client:
        monitor, fleet = client.monitor, client.fleet
        first, second = (fleet.engines[url] for url in urls)
        for engine in (first, second):
            fleet.joined(engine, "test")
        assert monitor.stall_bound(first) == COLD_STALL_BOUND
        now = time.monotonic()
        first.attempts[object()] = first.last_answer = now - 2 * COLD_STALL_BOUND  # silent past it
        monitor._check_stalls(now)
        assert first.stalled and monitor.stall_bound(second) == 2 * COLD_STALL_BOUND
        second.round_trip = 2.0
        assert monitor.stall_bound(second) == STALL_FACTOR * 2.0 and monitor.stall_bound(first) == STALL_FACTOR * 2.0


class _CountedTask(asyncio.Task[Any]):
    """A task that counts the calls to its ``cancel``."""

    cancels = 0

    def cancel(self, msg: Any = None) -> bool:
        self.cancels += 1
        return super().cancel(msg)


async def test_a_request_whose_engine_is_taken_out_goes_elsewhere_and_nothing_cancels_its_task(sim: SimEngine) -> None:
    """The request learns that its engine is out through its own await (the engine's ``lost``
    future beside its HTTP call) and is sent again to the other engine; its task is never
    cancelled (was: the fleet cancelled it and the client un-cancelled it to resend)."""
    async with _Stuck() as stuck:
        settings = EngineSettings(urls=(stuck.url, sim.url), adaptive_concurrency=False)
        async with EngineClient(settings) as client:
            fleet = client.fleet
            held, good = fleet.engines[stuck.url], fleet.engines[sim.url]
            for engine in (held, good):
                fleet.joined(engine, "test")
            assert fleet.stall(good, "test: only the stuck engine is routed", 300.0)

            async def ask() -> Any:
                body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
                engine, _ = await client.request("/generate", body, limit=1 << 20)
                return engine

            asking = _CountedTask(ask())
            await wait_until(lambda: stuck.generations == 1, timeout=30, message="the request on the stuck engine")
            fleet.unstall(good)
            assert fleet.take_out(held, EngineState.EJECTED, "test: taken out")
            assert await asyncio.wait_for(asking, 30) is good
            assert asking.cancels == 0
            assert client.errors.get("engine_lost") == 1 and client.retries == 0
            assert not held.attempts and held.in_flight == 0


def _engine_code(task: asyncio.Task[Any]) -> bool:
    """Whether ``task`` runs the engine client's code (not the test servers' handlers)."""
    code = getattr(task.get_coro(), "cr_code", None)
    return code is not None and "/producer/engine/" in code.co_filename


async def test_closing_the_client_ends_every_task_its_monitor_and_versions_started(sim: SimEngine) -> None:
    """The monitor loop, a probe hanging on a wedged engine, a weight update's re-read and the
    version read it waits on are each kept by their owner and ended by ``aclose()`` (was: a read
    whose asker was cancelled ran on, referenced by nothing, until its own timeout)."""
    async with _Wedged() as wedged:
        settings = EngineSettings(urls=(sim.url, wedged.url), health_interval=0.2, health_timeout=60.0,
                                  model_info_timeout=60.0, adaptive_concurrency=False)
        before = asyncio.all_tasks()
        client = EngineClient(settings)
        try:
            await client.prepare()  # a fleet of several joins: the monitor starts probing
            await wait_until(lambda: client.fleet.engines[sim.url].state is EngineState.HEALTHY, timeout=30,
                             message="the simulator joined")
            await wait_until(lambda: wedged.connections >= 1, timeout=30, message="the wedged engine's probe")
            client.versions_moved()  # every engine's version read again: the wedged one's hangs
            await wait_until(lambda: wedged.connections >= 2, timeout=30, message="the wedged engine's version read")
            started = {task for task in asyncio.all_tasks() - before if _engine_code(task)}
            names = {task.get_name() for task in started}
            assert {"engine-monitor", f"probe {wedged.url}", "versions-moved", f"version {wedged.url}"} <= names, names
        finally:
            await client.aclose()
        assert [task.get_name() for task in started if not task.done()] == []
