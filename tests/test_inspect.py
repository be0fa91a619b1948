"""``rollstream inspect`` against a real pipeline: counts, producer liveness, health and exit codes."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from typing import Any

import pytest
from conftest import add_prompts, make_namespace, wait_until
from rollstream.common.keys import Keys
from rollstream.consumer import GroupConsumer
from rollstream.ops.snapshot import snapshot


async def run_inspect(redis_url: str, ns: str, *extra: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollstream.cli", "inspect", "--redis", redis_url, "--ns", ns, *extra,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode in (0, 1), err.decode()
    return proc.returncode, out.decode()


async def inspect_json(redis_url: str, ns: str, *extra: str) -> tuple[int, dict[str, Any]]:
    code, out = await run_inspect(redis_url, ns, "--json", *extra)
    return code, json.loads(out)


async def polled_snapshot(redis: Any, ns: str, **options: float) -> dict[str, Any]:
    """What ``inspect --json`` prints, read in-process: cheap to poll (a CLI process a poll bought
    nothing; a test runs the command once its condition holds). Its verdict is the command's exit
    code: 1 exactly when it names a problem."""
    snap = await snapshot(redis, Keys(ns), **options)
    assert snap["health"]["ok"] == (not snap["health"]["problems"]), snap["health"]
    return snap


async def test_inspect_json_counts_after_feed_take_commit_recycle_and_a_killed_producer(redis_url, ns, redis, sim, procs):
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, heartbeat_timeout=3.0)

    async def state(field: str) -> int:
        return int(await redis.hget(keys.state, field) or 0)

    # The poison prompt goes first and is published first, so the first take() reads it first.
    await add_prompts(redis, ns, 1, start=0, text="POISON: Compute 1 + 1 and box it.")
    pa = procs.producer(redis_url, ns, sim.url, name="pa")
    await wait_until(lambda: state("published"), message=f"the poison group\n{procs.logs()}")
    await add_prompts(redis, ns, 9, start=1)
    await wait_until(lambda: _eq(state("published"), 10), message=f"10 groups published\n{procs.logs()}")


    async def beat_of_pa() -> dict[str, Any]:
        return json.loads(await redis.hget(keys.producers, "pa") or b"{}")

    await wait_until(lambda: _eq(_published(beat_of_pa()), 10), message="pa's heartbeat to count 10 groups")
    consumer = await GroupConsumer.connect(redis_url, ns, "trainer-0", on_producer_failure="warn")
    try:
        await consumer.pause()
        pa.send_signal(signal.SIGKILL)
        pa.wait(10)
        procs.producer(redis_url, ns, sim.url, name="pb")
        first = await asyncio.wait_for(consumer.take(4), 120)
        await consumer.commit(first)
        second = await asyncio.wait_for(consumer.take(5), 120)
        assert len(first) + len(second) == 9
    finally:
        await consumer.aclose()

    async def settled() -> bool:
        snap = await snapshot(redis, keys)
        names = {p["name"]: p["status"] for p in snap["producers"]}
        return names.get("pa") == "dead" and names.get("pb") == "running"

    await wait_until(settled, timeout=20, message=f"pa dead and pb running\n{procs.logs()}")
    code, snap = await inspect_json(redis_url, ns)
    assert code == 0, snap["health"]
    assert snap["schema"] == 1 and snap["namespace"] == ns
    assert snap["prompts"] == {
        **snap["prompts"], "queued": 0, "in_flight": 0, "waiting": 0, "leases_expiring": 0,
    }
    assert snap["retry"] == {"queued": 1, "in_flight": 0, "waiting": 1}  # the recycled (failed) prompt
    groups = snap["groups"]
    assert (groups["length"], groups["backlog"], groups["taken_uncommitted"]) == (5, 0, 5)
    assert [(c["name"], c["pending"]) for c in groups["consumers"]] == [("trainer-0", 5)]
    counters = snap["counters"]
    assert counters["published"] == 10
    assert counters["committed"] == 4
    assert counters["recycled_failed"] == 1
    assert counters["dead_lettered"] == 0 and counters["duplicates_discarded"] == 0
    by_name = {p["name"]: p for p in snap["producers"]}
    assert by_name["pa"]["status"] == "dead" and not by_name["pa"]["alive"]
    assert by_name["pa"]["published"] == 10 and by_name["pa"]["host"]
    assert by_name["pb"]["alive"] and by_name["pb"]["published"] == 0
    assert snap["producers_alive"] == 1
    trainer = snap["trainer"]
    assert trainer["paused"] is True and trainer["weight_version"] == 0
    assert trainer["last_take_ms"] and trainer["last_commit_ms"]
    assert snap["config"]["n_samples_per_prompt"] == 2 and snap["config"]["heartbeat_timeout"] == 3.0
    assert snap["health"]["ok"] is True and snap["health"]["problems"] == []
    warnings = " | ".join(snap["health"]["warnings"])
    assert "dead producer" in warnings and "pa" in warnings and "paused" in warnings

    code, text = await run_inspect(redis_url, ns)
    assert code == 0
    assert "HEALTHY" in text and "DEAD" in text and "pb" in text and "running" in text


async def _published(beat: Any) -> int:
    return int((await beat).get("published", 0))


async def _eq(value: Any, expected: Any) -> bool:
    return (await value) == expected


async def test_inspect_exit_code_follows_producer_liveness_and_a_stuck_backlog(redis_url, ns, redis, sim, procs):
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, heartbeat_timeout=2.0)
    await add_prompts(redis, ns, 3)
    producer = procs.producer(redis_url, ns, sim.url, name="only")
    await wait_until(lambda: _eq(redis.xlen(keys.groups), 3), message=f"3 groups\n{procs.logs()}")

    code, snap = await inspect_json(redis_url, ns)
    assert code == 0, snap["health"]
    assert snap["health"] == {**snap["health"], "ok": True, "problems": []}

    # Groups waiting and no trainer: healthy under the default threshold, stuck under a tiny one
    # once the last publish is older than it (a fast machine gets here sooner than 0.5 s).
    async def stuck() -> bool:
        snap = await polled_snapshot(redis, ns, stuck_after=0.5)
        return not snap["health"]["ok"] and any("backlog stuck" in p for p in snap["health"]["problems"])

    await wait_until(stuck, timeout=20, interval=0.2, message="inspect --stuck-after 0.5 to report a stuck backlog")
    code, snap = await inspect_json(redis_url, ns, "--stuck-after", "0.5")  # and the command says so
    assert code == 1 and any("backlog stuck" in p for p in snap["health"]["problems"]), snap["health"]

    producer.send_signal(signal.SIGKILL)
    producer.wait(10)

    async def unhealthy() -> bool:
        snap = await polled_snapshot(redis, ns)
        return not snap["health"]["ok"] and any("no live producer" in p for p in snap["health"]["problems"])

    await wait_until(unhealthy, timeout=20, interval=0.5, message="inspect to report no live producer")
    code, text = await run_inspect(redis_url, ns)
    assert code == 1 and "UNHEALTHY" in text and "no live producer" in text and "DEAD" in text


async def test_a_fatal_event_with_no_group_published_since_is_unhealthy(redis_url, ns, redis, procs):
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    await add_prompts(redis, ns, 1)
    # No engine listens on this port: the producer retries, fails, records a fatal event and exits.
    producer = procs.producer(redis_url, ns, "http://127.0.0.1:9", "--max-retries", "0", name="broken")
    await asyncio.to_thread(producer.wait, 90)
    assert producer.returncode != 0
    code, snap = await inspect_json(redis_url, ns)
    assert code == 1
    problems = " | ".join(snap["health"]["problems"])
    assert "fatal error in broken" in problems and "no live producer" in problems
    fatal = [e for e in snap["events"] if e["kind"] == "fatal"]
    assert fatal and fatal[0]["source"] == "broken" and "Traceback" in fatal[0]["traceback_head"][0]
    assert "EngineError" in fatal[0]["exception"]
    assert {p["name"]: p["status"] for p in snap["producers"]} == {"broken": "failed"}


async def test_inspect_reports_an_admission_stall_with_its_terms_and_take_names_it(
    redis_url, ns, redis, sim, procs, caplog
):
    """A gone producer's 8 leases fill the admission capacity ((S + 1) * G = 8): the live producer
    is refused (staleness), nothing is ready, 40 prompts wait. Stalled (exit 1) past
    ``--stall-after``, with the rule's terms; HEALTHY again once the leases are released."""
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, max_staleness=1, lease_seconds=120.0)
    await add_prompts(redis, ns, 48)
    ghost = await redis.xreadgroup("producers", "ghost", {keys.prompts: ">"}, count=8)
    ghost_ids = [eid for eid, _ in ghost[0][1]]
    procs.producer(redis_url, ns, sim.url, name="live")

    async def stalled() -> bool:
        snap = await polled_snapshot(redis, ns, stall_after=1)
        return not snap["health"]["ok"] and any("admission stalled" in p for p in snap["health"]["problems"])

    await wait_until(stalled, timeout=20, interval=0.5, message=f"inspect to report the stall\n{procs.logs()}")
    code, snap = await inspect_json(redis_url, ns, "--stall-after", "1")
    assert code == 1
    (problem,) = [p for p in snap["health"]["problems"] if "admission stalled" in p]
    assert "staleness" in problem and "40 prompts queued" in problem, problem
    admission = snap["admission"]
    assert {k: admission[k] for k in ("outstanding", "capacity", "c", "groups_per_version", "room")} == {
        "outstanding": 8, "capacity": 8, "c": 0, "groups_per_version": 4, "room": 0,
    }
    assert (admission["steps_per_version"], admission["max_staleness"], admission["batch_size"]) == (1, 1, 4)
    assert admission["refusals"]["staleness"] > 1 and admission["last_admit_ms"] is None
    assert [p["admission"] for p in snap["producers"]] == ["staleness"]
    code, text = await run_inspect(redis_url, ns, "--stall-after", "1")
    assert code == 1 and "admission stalled" in text and "outstanding" in text

    # take() waits, and its warning says why.
    caplog.set_level("WARNING", logger="rollstream.consumer.group_consumer")
    async with await GroupConsumer.connect(redis_url, ns, "trainer", warn_interval=0.3) as consumer:
        take = asyncio.create_task(consumer.take(4))
        # Until the warning is logged (after the first empty read), however slow the machine.
        await wait_until(lambda: "waiting for" in caplog.text or take.done(), timeout=30, message="take()'s warning")
        assert not take.done(), take
        take.cancel()
        with pytest.raises(asyncio.CancelledError):
            await take
    assert "admission blocked by staleness: outstanding 8 >= capacity 8" in caplog.text, caplog.text

    # The gone producer's prompts are dealt with (here: acknowledged): admission flows again.
    await redis.xack(keys.prompts, "producers", *ghost_ids)
    await redis.xdel(keys.prompts, *ghost_ids)
    await wait_until(lambda: _eq(redis.xlen(keys.groups), 8), message=f"8 groups\n{procs.logs()}")
    code, snap = await inspect_json(redis_url, ns, "--stall-after", "1")
    assert code == 0 and snap["health"]["problems"] == [], snap["health"]
    assert snap["admission"]["last_admit_ms"] is not None
