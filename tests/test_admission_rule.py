"""The staleness-aware admission rule: the ADMIT script (Lua, inside Redis) and
``common.admission.admission_capacity`` (Python, for inspect and take() diagnostics) agree, and
the rule's edge cases (K = 1, K = 3, a version that never moves, a jump of 5, c >= G, empty or
absent state fields). Against the real redis-server: the script reads stream state (XPENDING)."""

from __future__ import annotations

import random

from redis.asyncio import Redis
from rollstream.common.admission import (
    MEASURED_CADENCE_CAP,
    admission_capacity,
    admission_stall,
    groups_per_version,
    wait_cause,
)
from rollstream.common.config import PipelineConfig
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from rollstream.common.namespace import init_namespace
from rollstream.common.protocol import Control, GroupQueue, PromptQueue

WAITING = 12
"""Fresh prompts waiting in every case, more than any ``count`` asked for."""


async def _fill(redis: Redis, keys: Keys, *, prompts: int, retry: int, groups: int, taken: int) -> None:
    """``prompts`` / ``retry`` entries in flight (pending under another producer), ``groups``
    groups of which ``taken`` are pending in the trainer, and WAITING fresh prompts."""
    for stream, count in ((keys.prompts, prompts), (keys.retry, retry)):
        for i in range(count):
            await redis.xadd(stream, {"index": i})
        if count:
            await redis.xreadgroup(PRODUCERS_GROUP, "other", {stream: ">"}, count=count)
    for i in range(groups):
        await redis.xadd(keys.groups, {"index": i})
    if taken:
        await redis.xreadgroup(TRAINER_GROUP, "trainer", {keys.groups: ">"}, count=taken)
    for i in range(WAITING):
        await redis.xadd(keys.prompts, {"index": 100 + i})


async def test_lua_and_python_agree_on_random_inputs(redis: Redis, ns: str) -> None:
    rng = random.Random(11)
    for case in range(150):
        keys = Keys(f"{ns}-{case}")
        k, s, b = rng.randint(1, 4), rng.randint(0, 3), rng.randint(1, 5)
        config = PipelineConfig(n_samples_per_prompt=2, batch_size=b, max_staleness=s, steps_per_version=k)
        await init_namespace(redis, keys, config)
        prompts, retry = rng.randint(0, 6), rng.randint(0, 4)
        groups = rng.randint(0, 8)
        taken = rng.randint(0, groups)
        await _fill(redis, keys, prompts=prompts, retry=retry, groups=groups, taken=taken)
        fields = {
            StateField.COMMITTED: rng.randint(0, 100),
            StateField.VERSION_START_CONSUMED: rng.randint(0, 120),
            StateField.PREV_VERSION_CONSUMED: rng.randint(0, 80),
        }
        for name, value in fields.items():
            if rng.random() < 0.8:  # sometimes absent
                await redis.hset(keys.state, name, value if rng.random() < 0.9 else "")
        raw = {name: await redis.hget(keys.state, name) for name in fields}
        number = {name: int(v) if v else 0 for name, v in raw.items()}
        terms = admission_capacity(
            prompts_pending=prompts, retry_pending=retry, groups_length=groups, groups_pending=taken,
            committed=number[StateField.COMMITTED],
            version_start_consumed=number[StateField.VERSION_START_CONSUMED],
            prev_version_consumed=number[StateField.PREV_VERSION_CONSUMED],
            steps_per_version=k, max_staleness=s, batch_size=b,
        )
        count = rng.randint(1, 8)
        config = PipelineConfig(
            n_samples_per_prompt=1, batch_size=b, max_backlog=1000, max_staleness=s, steps_per_version=k
        )
        reply = await PromptQueue(redis, keys, "p").admit(config, count)
        where = f"case {case}: {terms}, count {count}: {reply.status} {reply.terms} {len(reply.entries)}"
        if terms.room == 0:
            assert reply.status == "staleness", where
            assert reply.terms == [terms.outstanding, terms.capacity, terms.c, terms.groups_per_version], where
        else:
            assert reply.status == "ok", where
            assert len(reply.entries) == min(count, terms.room), where
            # retry entries come first: all of them were in flight already, so only fresh ones here
            assert all(item.stream == keys.prompts for item in reply.entries), where
        await redis.delete(*keys.all_keys())


def _capacity(*, k: int, s: int = 1, b: int = 4, outstanding: int = 0, consumed: int, start: int, prev: int = 0) -> int:
    return admission_capacity(
        prompts_pending=outstanding, retry_pending=0, groups_length=0, groups_pending=0, committed=consumed,
        version_start_consumed=start, prev_version_consumed=prev, steps_per_version=k, max_staleness=s, batch_size=b,
    ).capacity


def test_capacity_k1_every_step() -> None:
    """K = 1, S = 1, B = 4: 8 at the start of a version, one batch less after one step."""
    assert _capacity(k=1, consumed=40, start=40) == 8
    assert _capacity(k=1, consumed=42, start=40) == 6
    assert _capacity(k=1, consumed=44, start=40) == 4  # c = G: the version is due to move
    assert _capacity(k=1, consumed=400, start=40) == 4  # it did not: S * G keeps flowing


def test_capacity_k3() -> None:
    """K = 3, S = 1, B = 4: G = 12, capacity 24 at the start, 12 after three steps."""
    assert _capacity(k=3, consumed=0, start=0) == 24
    assert _capacity(k=3, consumed=4, start=0) == 20
    assert _capacity(k=3, consumed=12, start=0) == 12
    assert _capacity(k=3, consumed=13, start=0) == 12


def test_capacity_never_below_one_and_c_never_negative() -> None:
    assert _capacity(k=1, s=0, consumed=100, start=0) == 1  # S = 0, standing still: one at a time
    assert _capacity(k=1, s=0, consumed=2, start=0) == 2
    assert _capacity(k=2, consumed=3, start=10) == 16  # released groups made consumed < start: c = 0


def test_measured_cadence_raises_g_within_its_cap() -> None:
    assert groups_per_version(1, 4, 0) == 4
    assert groups_per_version(1, 4, 12) == 12  # the previous version lasted 3 steps
    assert groups_per_version(1, 4, 4000) == MEASURED_CADENCE_CAP * 4  # stood still 1000 steps: capped
    assert groups_per_version(3, 4, 4) == 12  # never below the declared cadence


async def _admit(queue: PromptQueue, k: int, count: int = 100) -> tuple[str, int]:
    config = PipelineConfig(n_samples_per_prompt=1, batch_size=4, max_backlog=1000, max_staleness=1, steps_per_version=k)
    reply = await queue.admit(config, count)
    return reply.status, len(reply.entries)


async def _train_step(redis: Redis, keys: Keys, groups: int) -> None:
    """``groups`` in-flight prompts become groups that the trainer takes and commits."""
    pending = await redis.xpending_range(keys.prompts, PRODUCERS_GROUP, "-", "+", groups)
    queue = PromptQueue(redis, keys, "p")
    for p in pending:
        await queue.publish(keys.prompts, p["message_id"], {"index": 0})
    reply = await redis.xreadgroup(TRAINER_GROUP, "trainer", {keys.groups: ">"}, count=groups)
    ids = [eid for eid, _ in reply[0][1]]
    await GroupQueue(redis, keys, "trainer").commit(ids)


async def _scenario(redis: Redis, ns: str, k: int, versions: list[int]) -> list[int]:
    """Admitted prompts before each step, for a trainer that takes 4 groups per step and sets the
    version ``versions[step]`` after it (S = 1, B = 4)."""
    keys = Keys(ns)
    await init_namespace(redis, keys, PipelineConfig(n_samples_per_prompt=2, batch_size=4, max_staleness=1))
    for i in range(200):
        await redis.xadd(keys.prompts, {"index": i})
    control = Control(redis, keys)
    queue = PromptQueue(redis, keys, "p")
    admitted = []
    for version in versions:
        status, got = await _admit(queue, k)
        admitted.append(got)
        assert status in ("ok", "staleness")
        await _train_step(redis, keys, 4)
        await control.set_weight_version(version)
    return admitted


async def test_version_never_moves_keeps_admitting(redis: Redis, ns: str) -> None:
    """The old rule stopped after (0 + S + 1) * B admissions; now, once the version is due
    (c >= G), S * G = 4 stay outstanding and every step admits a batch."""
    admitted = await _scenario(redis, ns, 1, [0] * 8)
    assert admitted[:2] == [8, 0] and all(a == 4 for a in admitted[2:]), admitted


async def test_k3_cadence_refills_at_each_version(redis: Redis, ns: str) -> None:
    # Declared K = 3: 24 outstanding at most; the trainer consumes 4 per step and bumps every 3.
    admitted = await _scenario(redis, ns, 3, [0, 0, 1, 1, 1, 2, 2, 2])
    # Each new version opens one version's worth (G = 12); within a version c eats the room.
    assert admitted == [24, 0, 0, 12, 0, 0, 12, 0], admitted


async def test_undeclared_cadence_is_measured(redis: Redis, ns: str) -> None:
    """K declared 1, the trainer bumps every 3 steps: G grows to 12 after the first version."""
    keys = Keys(ns)
    await _scenario(redis, ns, 1, [0, 0, 1])
    state = await redis.hgetall(keys.state)
    assert state[StateField.PREV_VERSION_CONSUMED.encode()] == b"12"
    assert state[StateField.VERSION_START_CONSUMED.encode()] == b"12"


async def test_version_jump_restarts_c(redis: Redis, ns: str) -> None:
    keys = Keys(ns)
    await _scenario(redis, ns, 1, [0, 5])
    state = await redis.hgetall(keys.state)
    assert state[StateField.WEIGHT_VERSION.encode()] == b"5"
    assert state[StateField.VERSION_START_CONSUMED.encode()] == b"8"  # c restarts at 0
    # Same version set again (a resume): nothing recorded.
    await Control(redis, keys).resume(5)
    assert (await redis.hgetall(keys.state))[StateField.VERSION_START_CONSUMED.encode()] == b"8"


def _stall(**overrides: object) -> str | None:
    args: dict[str, object] = {
        "producers_alive": 1, "prompts_waiting": 10, "in_flight_prompts": 0, "ready": 0,
        "last_admit_age_s": 100.0, "refusals": {"staleness": 100.0}, "terms": None, "stall_after": 60.0,
    }
    args.update(overrides)
    return admission_stall(**args)


def test_admission_stall_rule() -> None:
    assert _stall() is not None and "staleness for 100 s" in str(_stall())
    assert _stall(producers_alive=0) is None  # "no live producer" is its own problem
    assert _stall(prompts_waiting=0) is None  # nothing to admit
    assert _stall(ready=1) is None  # the trainer has work
    assert _stall(last_admit_age_s=10.0) is None  # admitted recently
    assert _stall(refusals={"paused": 100.0}) is None  # the operator's choice
    assert _stall(refusals={"staleness": 10.0}, in_flight_prompts=3) is None  # busy, refused only briefly
    assert _stall(refusals={}, last_admit_age_s=None) is None  # just started
    assert _stall(refusals={}) is not None  # admitted once, idle since, nothing in flight: stalled
    assert _stall(last_admit_age_s=None) is not None and "never admitted" in str(_stall(last_admit_age_s=None))


def test_wait_cause_names_the_likeliest_cause() -> None:
    base: dict[str, object] = {
        "producers_alive": 1, "paused": False, "prompts_waiting": 5, "in_flight_prompts": 2, "ready": 0,
        "refusals": {}, "terms": None, "engine_retries": 0, "last_error": "",
    }

    def cause(**overrides: object) -> str:
        return wait_cause(**{**base, **overrides})

    terms = admission_capacity(
        prompts_pending=8, retry_pending=0, groups_length=0, groups_pending=0, committed=0,
        version_start_consumed=0, prev_version_consumed=0, steps_per_version=1, max_staleness=1, batch_size=4,
    )
    assert cause(producers_alive=0).startswith("no live producer")
    assert cause(paused=True).startswith("admission paused")
    assert cause(refusals={"staleness": 3.0}, terms=terms).startswith(
        "admission blocked by staleness: outstanding 8 >= capacity 8"
    )
    assert cause(refusals={"backlog": 3.0}).startswith("admission blocked by the backlog cap")
    assert cause(last_error="p1: EngineError").startswith("engines failing: p1: EngineError")
    assert cause(prompts_waiting=0, in_flight_prompts=0).startswith("no prompts queued")
    assert cause() == "generating: 2 prompts in flight"
