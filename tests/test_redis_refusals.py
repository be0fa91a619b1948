"""Redis refusing a call, on a real Redis: NOGROUP (a destroyed consumer group) becomes
``NamespaceGone`` on every queue call, and NOPERM (an ACL user without a command, in a script or
outside) becomes ``RedisPermissionDenied`` naming the command, the user and the role of
``deploy/redis/users.acl.template`` that grants it."""

from __future__ import annotations

import inspect
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError, NamespaceGone, RedisPermissionDenied
from rollstream.common.events import FATAL, recent_events
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys
from rollstream.common.lua import (
    JOURNAL_APPEND,
    LEASE,
    LIMIT_ACQUIRE,
    LIMIT_RENEW,
    PUBLISH,
    RATE_TAKE,
    SWEEP_JOURNALS,
    script_commands,
)
from rollstream.common.protocol import (
    Control,
    DeadLetters,
    Feed,
    GroupQueue,
    Guarded,
    Heartbeat,
    Heartbeats,
    JournalHash,
    NameLease,
    PromptQueue,
    StreamView,
)
from rollstream.common.redis_errors import OPERATOR_ROLE, ROLE_COMMANDS
from rollstream.consumer import GroupConsumer
from rollstream.testing.sim import SimEngine

TEMPLATE = Path(__file__).resolve().parent.parent / "deploy" / "redis" / "users.acl.template"

# -- NOGROUP on every queue call ------------------------------------------------------------

Call = Callable[[Any, Keys, Redis, bytes], Awaitable[Any]]
CONFIG = PipelineConfig(n_samples_per_prompt=2, batch_size=2, max_backlog=10)

PROMPT_CALLS: dict[str, Call] = {
    "admit": lambda q, k, r, e: q.admit(CONFIG),
    "renew": lambda q, k, r, e: q.renew(k.prompts, [e]),
    "own_pending": lambda q, k, r, e: q.own_pending(),
    "own_pending_ids": lambda q, k, r, e: q.own_pending_ids(k.prompts),
    "any_idle": lambda q, k, r, e: q.any_idle(0),
    "reclaim": lambda q, k, r, e: q.reclaim(0, 10),
    "ack_deleted": lambda q, k, r, e: q.ack_deleted(k.prompts, e),
    "publish": lambda q, k, r, e: q.publish(k.prompts, e, {"x": "y"}),
    "give_back": lambda q, k, r, e: q.give_back(k.prompts, e, {"x": "y"}),
    "dead_letter": lambda q, k, r, e: q.dead_letter(k.prompts, e, {"x": "y"}, "reason"),
}
GROUP_CALLS: dict[str, Call] = {
    "read": lambda q, k, r, e: q.read(r, 1, 10),
    "own_pending_page": lambda q, k, r, e: q.own_pending_page("0"),
    "pending_ids": lambda q, k, r, e: q.pending_ids(),
    "ack_deleted": lambda q, k, r, e: q.ack_deleted(e),
    "recycle": lambda q, k, r, e: q.recycle(e, "recycled_failed", {"x": "y"}),
    "dead_letter": lambda q, k, r, e: q.dead_letter(e, {"x": "y"}, "reason"),
    "drop_filtered": lambda q, k, r, e: q.drop_filtered(e, "reason"),
    "release": lambda q, k, r, e: q.release(),
    "commit": lambda q, k, r, e: q.commit([e]),
}
NO_GROUP_INVOLVED = {
    (PromptQueue, "wait_for_new"): "XREAD of new entries, no consumer group",
    (PromptQueue, "count_reclaimed"): "HINCRBY of the state hash",
    (PromptQueue, "trained_steps"): "HGET of the state hash",
    (PromptQueue, "reclaim_turn"): "RECLAIM_TURN script on the state hash",
    (PromptQueue, "announce_reclaim"): "HSET of the state hash",
    (GroupQueue, "fetch"): "XRANGE needs no group (see the fetch test below)",
    (GroupQueue, "record_rows"): "ROW_STATS script on the rows hash, no consumer group",
}


def _public_coroutines(cls: type) -> set[str]:
    return {name for name, value in vars(cls).items() if not name.startswith("_") and inspect.iscoroutinefunction(value)}


def test_every_queue_call_is_listed_here_so_a_new_one_gets_its_nogroup_test() -> None:
    for cls, calls in ((PromptQueue, PROMPT_CALLS), (GroupQueue, GROUP_CALLS)):
        listed = set(calls) | {name for (owner, name) in NO_GROUP_INVOLVED if owner is cls}
        assert _public_coroutines(cls) == listed, f"{cls.__name__}: add the new method to this file's tables"


def test_every_public_coroutine_of_every_namespace_client_is_guarded() -> None:
    clients = [PromptQueue, GroupQueue, Control, NameLease, Feed, DeadLetters, JournalHash, StreamView]
    assert set(clients) <= set(Guarded.__subclasses__())
    unguarded = [
        f"{cls.__name__}.{name}" for cls in Guarded.__subclasses__() for name in _public_coroutines(cls)
        if not getattr(getattr(cls, name), "__rollstream_guarded__", False)
    ]
    assert not unguarded and _public_coroutines(PromptQueue)


async def _destroyed(redis: Redis, ns: str) -> tuple[Keys, bytes]:
    """A namespace with one prompt admitted (pending), then its consumer groups destroyed."""
    await make_namespace(redis, ns)
    keys = Keys(ns)
    await add_prompts(redis, ns, 2)
    admitted = await PromptQueue(redis, keys, "p").admit(CONFIG)
    assert admitted.status == "ok"
    for stream, group in ((keys.prompts, PRODUCERS_GROUP), (keys.retry, PRODUCERS_GROUP), (keys.groups, TRAINER_GROUP)):
        assert await redis.xgroup_destroy(stream, group) == 1
    return keys, admitted.entries[0].entry_id


@pytest.mark.parametrize("name", sorted(PROMPT_CALLS))
async def test_prompt_queue_call_on_a_destroyed_group_raises_namespace_gone(redis: Redis, ns: str, name: str) -> None:
    keys, entry_id = await _destroyed(redis, ns)
    with pytest.raises(NamespaceGone, match=f"namespace '{ns}'.*init"):
        await PROMPT_CALLS[name](PromptQueue(redis, keys, "p"), keys, redis, entry_id)
    assert await redis.xlen(keys.prompts) == 2  # nothing deleted by the refused call


@pytest.mark.parametrize("name", sorted(GROUP_CALLS))
async def test_group_queue_call_on_a_destroyed_group_raises_namespace_gone(redis: Redis, ns: str, name: str) -> None:
    keys, entry_id = await _destroyed(redis, ns)
    with pytest.raises(NamespaceGone, match=f"namespace '{ns}'.*init"):
        await GROUP_CALLS[name](GroupQueue(redis, keys, "t"), keys, redis, entry_id)
    assert await redis.xlen(keys.prompts) == 2


async def test_fetch_of_a_deleted_namespace_is_empty_and_its_ack_raises_namespace_gone(redis: Redis, ns: str) -> None:
    """What ``take()`` does with a delivered entry it cannot read: fetch (empty), then ack."""
    keys, _ = await _destroyed(redis, ns)
    await redis.delete(keys.groups)
    queue = GroupQueue(redis, keys, "t")
    assert await queue.fetch(b"1-1") == {}
    with pytest.raises(NamespaceGone):
        await queue.ack_deleted(b"1-1")


# -- NOPERM: ACL users of the template, each missing commands ---------------------------------


def _role_rules(role: str, ns: str, password: str, without: set[str]) -> list[str]:
    """The template's rules of ``role`` for namespace ``ns``, less the commands ``without``."""
    line = next(li for li in TEMPLATE.read_text().splitlines() if li.startswith(f"user {role} "))
    rules = line.replace("@NS@", ns).split()[2:]
    return [f">{password}" if r.startswith(">") else r for r in rules if r.lstrip("+") not in without]


@pytest.fixture
async def acl_user(redis: Redis, redis_url: str) -> AsyncIterator[Callable[[str, str, set[str]], str]]:
    """Make an ACL user with a role's rules less some commands; its URL. Deleted afterwards."""
    made: list[str] = []

    async def make(role: str, ns: str, without: set[str]) -> str:
        name, password = f"{role}-{ns}", secrets.token_hex(8)
        await redis.execute_command("ACL", "SETUSER", name, "reset", *_role_rules(role, ns, password, without))
        made.append(name)
        return redis_url.replace("redis://", f"redis://{name}:{password}@", 1)

    yield make
    for name in made:
        await redis.execute_command("ACL", "DELUSER", name)


def test_the_role_table_is_the_acl_template() -> None:
    for role, commands in ROLE_COMMANDS.items():
        rules = _role_rules(role, "x", "pw", set())
        assert {r[1:] for r in rules if r.startswith("+")} == commands, role
    assert f"user {OPERATOR_ROLE} " in TEMPLATE.read_text()
    # every command the scripts call is granted to the role whose process calls them
    assert set(script_commands(LEASE)) <= {c.upper() for c in ROLE_COMMANDS["trainer"]}
    # durable episodes: the producer journals, drops and sweeps journals
    for script in (PUBLISH, JOURNAL_APPEND, LIMIT_ACQUIRE, LIMIT_RENEW, RATE_TAKE, SWEEP_JOURNALS):
        assert set(script_commands(script)) <= {c.upper() for c in ROLE_COMMANDS["producer"]}, script.name


@pytest.mark.parametrize(("without", "refused"), [({"get", "set"}, "GET"), ({"set"}, "SET")])
async def test_a_trainer_without_get_and_set_is_told_which_role_grants_them(
    redis: Redis, ns: str, acl_user: Callable[[str, str, set[str]], Awaitable[str]], without: set[str], refused: str,
) -> None:
    """The name lease (the LEASE script's GET, then SET) is the trainer's first script."""
    await make_namespace(redis, ns)
    url = await acl_user("trainer", ns, without)
    with pytest.raises(RedisPermissionDenied) as caught:
        await GroupConsumer.connect(url, ns, "trainer-0", name_wait=0)
    error = caught.value
    assert isinstance(error, ConfigError)
    assert (error.command, error.user, error.roles) == (refused.lower(), f"trainer-{ns}", ("trainer", OPERATOR_ROLE))
    message = str(error)
    assert f"Redis ACL user 'trainer-{ns}' may not run the {refused} command (inside the LEASE script)" in message
    assert "deploy/redis/users.acl.template the role trainer / operator grants it" in message
    assert await redis.exists(Keys(ns).consumer_lease("trainer-0")) == 0  # the refused lease wrote nothing


async def test_a_command_refused_outside_a_script_is_named(
    redis: Redis, ns: str, acl_user: Callable[[str, str, set[str]], Awaitable[str]]
) -> None:
    await make_namespace(redis, ns)
    client = connect(await acl_user("producer", ns, {"hset"}))
    try:
        with pytest.raises(RedisPermissionDenied, match=r"may not run the HSET command.*role producer / trainer"):
            await Heartbeats(client, Keys(ns)).write("p", Heartbeat(state="running"), 0)
    finally:
        await client.aclose()


async def test_a_producer_missing_a_script_command_fails_loudly_and_loses_nothing(
    redis: Redis, ns: str, procs: ProcessPool, sim: SimEngine,
    acl_user: Callable[[str, str, set[str]], Awaitable[str]],
) -> None:
    """HINCRBY is called only inside ADMIT (and by heartbeats that report refused admission):
    the producer's first admission is refused, which is fatal, reported, and nothing is lost."""
    await make_namespace(redis, ns)
    keys = Keys(ns)
    await add_prompts(redis, ns, 4)
    url = await acl_user("producer", ns, {"hincrby"})
    child = procs.producer(url, ns, sim.url, name="noperm")
    await wait_until(lambda: child.poll() is not None, timeout=60, message="the producer to exit")
    assert child.returncode != 0, procs.logs()
    log = procs.log_of(child)
    assert "may not run the HINCRBY command (inside the ADMIT script)" in log and "role producer" in log, log[-3000:]
    fatal = await recent_events(redis, keys, count=1, kind=FATAL)
    assert fatal and "RedisPermissionDenied" in fatal[0].message and "HINCRBY" in fatal[0].message
    # exact accounting: every prompt is still in the prompt stream, no group was made
    assert await redis.xlen(keys.prompts) == 4
    assert await redis.xlen(keys.groups) == 0 and await redis.xlen(keys.dead) == 0
    assert re.search(r"user 'producer-\S+'", fatal[0].message)
