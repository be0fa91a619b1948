"""Every branch of every Lua script in ``common/scripts/`` (loaded by ``common/lua.py``).

Run against fakeredis (with lupa) where fakeredis runs the script like Redis does. fakeredis
answers XREADGROUP inside Lua with a differently shaped reply (``{}`` instead of nil when
empty, no outer list per stream), so ADMIT's ``empty`` and ``ok`` branches run against the real
redis-server (``redis`` fixture) instead; every other branch is covered on both.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fakeredis
import pytest
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from rollstream.common import lua
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import connect
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField
from rollstream.common.namespace import init_namespace
from rollstream.common.protocol import Feed, GroupQueue, PromptQueue
from rollstream.common.protocol import groups as groups_module
from rollstream.common.protocol import prompts as prompts_module


@pytest.fixture
async def fake() -> AsyncIterator[Redis]:
    client = fakeredis.FakeAsyncRedis()
    yield client
    await client.aclose()


@pytest.fixture(params=["fake", "real"])
async def r(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[Redis]:
    """The same test against fakeredis and the real redis-server."""
    client: Redis = fakeredis.FakeAsyncRedis() if request.param == "fake" else connect(redis_url)
    yield client
    await client.aclose()


@dataclass
class Seams:
    """The protocol classes that run the scripts: producer ``p1``, trainer ``t``, the feeder."""

    prompts: PromptQueue
    groups: GroupQueue
    feed: Feed


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Sets the time (ms) the seams pass to the scripts."""

    def set_to(ms: int) -> None:
        for module in (prompts_module, groups_module):
            monkeypatch.setattr(module, "now_ms", lambda: ms)

    return set_to


async def _setup(client: Redis, ns: str, **config: Any) -> tuple[Keys, Seams]:
    keys = Keys(ns)
    cfg = PipelineConfig(n_samples_per_prompt=2, batch_size=2, **config)
    await init_namespace(client, keys, cfg, force=True)
    return keys, Seams(PromptQueue(client, keys, "p1"), GroupQueue(client, keys, "t"), Feed(client, keys))


async def _state(client: Redis, keys: Keys) -> dict[str, str]:
    raw = await client.hgetall(keys.state)
    return {k.decode(): v.decode() for k, v in raw.items()}


async def _read_prompt(client: Redis, keys: Keys, consumer: str = "p1") -> bytes:
    """Take one prompt into ``consumer``'s pending list without the ADMIT script."""
    reply = await client.xreadgroup(PRODUCERS_GROUP, consumer, {keys.prompts: ">"}, count=1)
    return bytes(reply[0][1][0][0])


# -- PUBLISH ------------------------------------------------------------------------------


async def test_publish_adds_group_acks_prompt_and_counts(r: Redis, ns: str, clock: Callable[[int], None]) -> None:
    keys, seams = await _setup(r, ns)
    await r.xadd(keys.prompts, {"index": 0})
    pid = await _read_prompt(r, keys)
    clock(1234)
    gid = await seams.prompts.publish(keys.prompts, pid, {"index": 0, "data": b"x"})
    assert gid is not None
    assert await r.xlen(keys.prompts) == 0  # acknowledged and deleted
    assert (await r.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0
    rows = await r.xrange(keys.groups)
    assert [row[0] for row in rows] == [gid] and rows[0][1][b"data"] == b"x"
    state = await _state(r, keys)
    assert state["published"] == "1" and state["last_publish_ms"] == "1234"


async def test_publish_of_an_acknowledged_prompt_is_a_discarded_duplicate(
    r: Redis, ns: str, clock: Callable[[int], None]
) -> None:
    keys, seams = await _setup(r, ns)
    await r.xadd(keys.prompts, {"index": 0})
    pid = await _read_prompt(r, keys)
    clock(1)
    assert await seams.prompts.publish(keys.prompts, pid, {"index": 0}) is not None
    clock(2)
    assert await seams.prompts.publish(keys.prompts, pid, {"index": 0}) is None
    assert await r.xlen(keys.groups) == 1
    state = await _state(r, keys)
    assert state["published"] == "1" and state["duplicates_discarded"] == "1"
    assert state["last_publish_ms"] == "1"


# -- MOVE (recycle, return, dead-letter) --------------------------------------------------


async def test_recycle_moves_group_back_to_the_retry_stream_and_counts(r: Redis, ns: str) -> None:
    keys, seams = await _setup(r, ns)
    gid = await r.xadd(keys.groups, {"index": 3})
    await r.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    assert await seams.groups.recycle(gid, StateField.RECYCLED_STALE, {"index": 3, "attempt": 1})
    assert await r.xlen(keys.groups) == 0
    rows = await r.xrange(keys.retry)
    assert len(rows) == 1 and rows[0][1] == {b"index": b"3", b"attempt": b"1"}
    assert await r.xlen(keys.prompts) == 0
    assert (await _state(r, keys))["recycled_stale"] == "1"
    # Re-sent (or a second holder): nothing happens.
    assert not await seams.groups.recycle(gid, StateField.RECYCLED_STALE, {"index": 3, "attempt": 1})
    assert await r.xlen(keys.retry) == 1
    assert (await _state(r, keys))["recycled_stale"] == "1"


async def test_return_prompt_goes_to_the_retry_stream_and_counts(r: Redis, ns: str) -> None:
    keys, seams = await _setup(r, ns)
    await r.xadd(keys.prompts, {"index": 0})
    await r.xadd(keys.prompts, {"index": 1})
    pid = await _read_prompt(r, keys)
    assert await seams.prompts.give_back(keys.prompts, pid, {"index": 0})
    assert [row[1][b"index"] for row in await r.xrange(keys.prompts)] == [b"1"]
    assert [row[1][b"index"] for row in await r.xrange(keys.retry)] == [b"0"]
    assert (await _state(r, keys))["returned"] == "1"
    assert not await seams.prompts.give_back(keys.prompts, pid, {"index": 0})
    assert await r.xlen(keys.retry) == 1


async def test_dead_letter_keeps_fields_and_reason(r: Redis, ns: str, clock: Callable[[int], None]) -> None:
    keys, seams = await _setup(r, ns)
    gid = await r.xadd(keys.groups, {"index": 7, "reason": "spoofed"})
    await r.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    clock(99)
    assert await seams.groups.dead_letter(gid, {b"index": b"7", b"reason": b"spoofed"}, "max_attempts: x")
    rows = await r.xrange(keys.dead)
    assert len(rows) == 1
    fields = rows[0][1]
    assert fields[b"source"] == b"groups" and fields[b"reason"] == b"max_attempts: x"
    assert fields[b"entry_id"] == gid and fields[b"index"] == b"7" and fields[b"ts_ms"] == b"99"
    assert (await _state(r, keys))["dead_lettered"] == "1"
    assert not await seams.groups.dead_letter(gid, {}, "again")
    assert await r.xlen(keys.dead) == 1


# -- ACK_DELETE ----------------------------------------------------------------------------


async def test_ack_delete_counts_only_acknowledged_entries(r: Redis, ns: str, clock: Callable[[int], None]) -> None:
    keys, seams = await _setup(r, ns)
    ids = [await r.xadd(keys.groups, {"index": i}) for i in range(3)]
    await r.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    clock(42)
    acked = await seams.groups.commit(ids[:2])
    assert acked == 2 and await r.xlen(keys.groups) == 1
    state = await _state(r, keys)
    assert state["committed"] == "2" and state["last_commit_ms"] == "42"
    # Already acknowledged: nothing counted; the time field is still written.
    clock(43)
    again = await seams.groups.commit(ids[:2])
    assert again == 0
    state = await _state(r, keys)
    assert state["committed"] == "2" and state["last_commit_ms"] == "43"


async def test_ack_delete_second_counter_without_time_field(r: Redis, ns: str) -> None:
    keys, seams = await _setup(r, ns)
    gid = await r.xadd(keys.groups, {"index": 0})
    await r.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    acked = await seams.groups.drop_filtered(gid, "zero_variance")
    assert acked == 1
    state = await _state(r, keys)
    assert state["filtered"] == "1" and state["filtered:zero_variance"] == "1"
    assert "last_commit_ms" not in state
    assert await seams.groups.commit([]) == 0


# -- ADMIT ---------------------------------------------------------------------------------


def _admit_args(*, max_backlog: int = 10, admission: bool = True, count: int = 1) -> dict[str, Any]:
    """ADMIT's arguments: batch size 2, max staleness 1, the rule on or off."""
    config = PipelineConfig(
        n_samples_per_prompt=2, batch_size=2, max_staleness=1, max_backlog=max_backlog, admission_control=admission
    )
    return {"config": config, "count": count}


async def test_admit_refuses_while_paused(r: Redis, ns: str) -> None:
    keys, seams = await _setup(r, ns, max_staleness=1)
    await r.xadd(keys.prompts, {"index": 0})
    await r.hset(keys.state, StateField.PAUSED, 1)
    assert (await seams.prompts.admit(**_admit_args())).status == "paused"
    assert (await r.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0
    assert "admitted" not in await _state(r, keys)


async def test_admit_refuses_at_the_ready_backlog_cap(r: Redis, ns: str) -> None:
    keys, seams = await _setup(r, ns, max_staleness=1)
    await r.xadd(keys.prompts, {"index": 0})
    for i in range(3):
        await r.xadd(keys.groups, {"index": i})
    reply = await seams.prompts.admit(**_admit_args(max_backlog=3, admission=False))
    assert (reply.status, reply.terms) == ("backlog", [3])
    assert (await r.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0


async def test_admit_backlog_cap_ignores_taken_groups(redis: Redis, ns: str) -> None:
    """Taken-but-uncommitted groups are not backlog: a trainer that commits only at checkpoints
    must not block admission."""
    keys, seams = await _setup(redis, ns, max_staleness=1)
    await redis.xadd(keys.prompts, {"index": 0})
    for i in range(3):
        await redis.xadd(keys.groups, {"index": i})
    await redis.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"}, count=1)
    assert (await seams.prompts.admit(**_admit_args(max_backlog=3, admission=False))).status == "ok"


async def test_admit_reads_no_more_than_the_backlog_room(redis: Redis, ns: str) -> None:
    keys, seams = await _setup(redis, ns, max_staleness=1)
    for i in range(10):
        await redis.xadd(keys.prompts, {"index": i})
    for i in range(3):
        await redis.xadd(keys.groups, {"index": i})
    reply = await seams.prompts.admit(**_admit_args(max_backlog=5, admission=False, count=8))
    assert reply.status == "ok" and len(reply.entries) == 2


async def test_admit_without_admission_control_ignores_staleness(redis: Redis, ns: str) -> None:
    keys, seams = await _setup(redis, ns, max_staleness=1)
    for i in range(20):
        await redis.xadd(keys.prompts, {"index": i})
    reply = await seams.prompts.admit(**_admit_args(admission=False, count=20, max_backlog=100))
    assert reply.status == "ok" and len(reply.entries) == 20


async def test_admit_reads_one_prompt_counts_it_and_reports_version(
    redis: Redis, ns: str, clock: Callable[[int], None]
) -> None:
    """Real server only: fakeredis shapes XREADGROUP replies inside Lua differently."""
    keys, seams = await _setup(redis, ns, max_staleness=1)
    await redis.hset(keys.state, "weight_version", 7)
    first = await redis.xadd(keys.prompts, {"index": 0, "data": b"\x00\xff"})
    await redis.xadd(keys.prompts, {"index": 1})
    clock(555)
    reply = await seams.prompts.admit(**_admit_args())
    assert (reply.status, reply.weight_version) == ("ok", 7)
    assert [(e.stream, e.entry_id, e.fields) for e in reply.entries] == [
        (keys.prompts, first, {b"index": b"0", b"data": b"\x00\xff"})
    ]
    pending = await redis.xpending_range(keys.prompts, PRODUCERS_GROUP, "-", "+", 10)
    assert [(p["message_id"], p["consumer"]) for p in pending] == [(first, b"p1")]
    state = await _state(redis, keys)
    assert state["admitted"] == "1" and state["last_admit_ms"] == "555"


async def test_admit_reads_the_retry_stream_first_fifo_then_prompts(redis: Redis, ns: str) -> None:
    keys, seams = await _setup(redis, ns)
    fresh = [await redis.xadd(keys.prompts, {"index": i}) for i in range(3)]
    retry = [await redis.xadd(keys.retry, {"index": 10 + i}) for i in range(2)]
    reply = await seams.prompts.admit(**_admit_args(admission=False, count=4))
    assert [(e.stream, e.entry_id) for e in reply.entries] == [
        (keys.retry, retry[0]), (keys.retry, retry[1]), (keys.prompts, fresh[0]), (keys.prompts, fresh[1]),
    ]
    assert (await _state(redis, keys))["admitted"] == "4"
    assert (await redis.xpending(keys.retry, PRODUCERS_GROUP))["pending"] == 2


async def test_admit_on_empty_streams(redis: Redis, ns: str) -> None:
    keys, seams = await _setup(redis, ns, max_staleness=1)
    reply = await seams.prompts.admit(**_admit_args())
    assert (reply.status, reply.entries) == ("empty", [])
    assert "admitted" not in await _state(redis, keys)


# -- RENEW ---------------------------------------------------------------------------------


async def test_renew_own_entries_and_report_lost_ones(r: Redis, ns: str) -> None:
    keys, seams = await _setup(r, ns)
    await r.xadd(keys.prompts, {"index": 0})
    await r.xadd(keys.prompts, {"index": 1})
    mine = await _read_prompt(r, keys, "p1")
    theirs = await _read_prompt(r, keys, "p2")
    assert await seams.prompts.renew(keys.prompts, [mine]) == []
    # Taken over by p2, acknowledged, or never existed: lost, and never stolen back.
    assert sorted(await seams.prompts.renew(keys.prompts, [mine, theirs, b"1-1"])) == sorted([theirs, b"1-1"])
    pending = await r.xpending_range(keys.prompts, PRODUCERS_GROUP, "-", "+", 10)
    assert {p["message_id"]: p["consumer"] for p in pending} == {mine: b"p1", theirs: b"p2"}
    assert await seams.prompts.renew(keys.prompts, []) == []


async def test_renew_resets_idle_time(redis: Redis, ns: str) -> None:
    keys, seams = await _setup(redis, ns)
    await redis.xadd(keys.prompts, {"index": 0})
    mine = await _read_prompt(redis, keys, "p1")
    await redis.xclaim(keys.prompts, PRODUCERS_GROUP, "p1", 0, [mine], idle=60_000, justid=True)
    before = (await redis.xpending_range(keys.prompts, PRODUCERS_GROUP, "-", "+", 1))[0]
    assert before["time_since_delivered"] >= 60_000
    assert await seams.prompts.renew(keys.prompts, [mine]) == []
    after = (await redis.xpending_range(keys.prompts, PRODUCERS_GROUP, "-", "+", 1))[0]
    assert after["time_since_delivered"] < 10_000


# -- FEED ----------------------------------------------------------------------------------


async def test_feed_adds_and_moves_the_cursor_once(r: Redis, ns: str) -> None:
    keys, seams = await _setup(r, ns)
    entries = [{"index": 0, "data": b"a"}, {"index": 1, "data": b"b"}]
    added = await seams.feed.add(expected_next=0, next_after=2, epoch=0, position=2, dataset="d", entries=entries)
    assert added == 2
    rows = await r.xrange(keys.prompts)
    assert [row[1] for row in rows] == [{b"index": b"0", b"data": b"a"}, {b"index": b"1", b"data": b"b"}]
    state = await _state(r, keys)
    assert (state["feed_next_index"], state["feed_epoch"], state["feed_position"], state["feed_dataset"]) == (
        "2", "0", "2", "d",
    )
    assert state["fed"] == "2"
    # Re-sent with the old cursor: nothing added.
    assert await seams.feed.add(expected_next=0, next_after=2, epoch=0, position=2, dataset="d", entries=entries) is None
    assert await r.xlen(keys.prompts) == 2
    # An empty feed from the right cursor only moves it.
    assert await seams.feed.add(expected_next=2, next_after=2, epoch=1, position=0, dataset="d", entries=[]) == 0
    assert (await _state(r, keys))["feed_epoch"] == "1"


async def test_feed_rejects_entries_of_different_shapes(fake: Redis, ns: str) -> None:
    _, seams = await _setup(fake, ns)
    with pytest.raises(ValueError, match="same fields"):
        await seams.feed.add(
            expected_next=0, next_after=2, epoch=0, position=2, dataset="d",
            entries=[{"index": 0}, {"index": 1, "data": b"x"}],
        )


# -- the declarations ------------------------------------------------------------------------


_LUA_NAMES = frozenset(
    "and break do else elseif end false for function if in local nil not or repeat return then true until while "
    "redis cjson cmsgpack tonumber tostring type string math table unpack pcall ipairs pairs next".split()
)


def _code(text: str) -> str:
    """Lua code without comments and string literals."""
    return re.sub(r"'[^'\n]*'", "''", re.sub(r"--[^\n]*", "", text))


def _bound(code: str) -> set[str]:
    """Names a chunk binds: locals, functions and their parameters, loop variables."""
    names: set[str] = set()
    for group in re.findall(r"local\s+function\s+(\w+)\(([^)]*)\)|local\s+([\w\s,]+?)\s*=|for\s+([\w\s,]+?)\s*(?:=|in)",
                            code):
        for part in group:
            names.update(n.strip() for n in part.replace("(", ",").split(",") if n.strip())
    return names


def _declaration_problems(script: lua.Script) -> list[str]:
    """Where a script's ``-- KEYS:``/``-- ARGV:`` names and its body disagree: the body indexes a
    bare ``KEYS[n]``/``ARGV[n]``, leaves a declared name unused, reads a name that is neither
    declared, a local nor a Lua builtin, or reads the variadic rest (``name_at``, ``#ARGV``)
    without declaring it."""
    body = _code(script.body)
    problems = []
    if bare := re.findall(r"KEYS\[|ARGV\[\d", body):
        problems.append(f"{script.name}: the body indexes {bare} instead of a declared name")
    declared = {*script.keys, *(a for a in script.argv if not a.startswith("*"))}
    rest = {f"{a[1:]}_at" for a in script.argv if a.startswith("*")}
    used = set(re.findall(r"(?<![.:\w])([A-Za-z_]\w*)", re.sub(r"[{,]\s*\w+\s*=(?!=)", ",", body)))
    if unused := (declared | rest) - used:
        problems.append(f"{script.name}: declared and unused: {sorted(unused)}")
    preludes = "".join(_code(text) for text in lua.PRELUDES.values())
    shared = {n.strip() for names in re.findall(r"^local (?:function )?([\w, ]+)", preludes, re.M) for n in names.split(",")}
    if unknown := used - declared - rest - _bound(body) - shared - _LUA_NAMES - {"ARGV"}:
        problems.append(f"{script.name}: the body reads undeclared {sorted(unknown)}")
    if "#ARGV" in body and not rest:
        problems.append(f"{script.name}: the body reads a variadic ARGV rest, none declared")
    return problems


def _bound_by_seams() -> dict[str, list[str]]:
    """Script name -> the protocol modules that bind it (``lua.NAME.bind(...)``)."""
    out: dict[str, list[str]] = {}
    for path in sorted(Path(groups_module.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr == "bind" and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "lua"):
                out.setdefault(node.value.attr, []).append(path.stem)
    return out


def test_every_declaration_matches_the_keys_and_argv_its_body_uses() -> None:
    assert [p for script in lua.SCRIPTS for p in _declaration_problems(script)] == []


def test_the_declaration_check_finds_a_wrong_declaration() -> None:
    """The check above can fail: a key left out, an ARGV too many, a rest renamed, a bare index."""
    assert _declaration_problems(dataclasses.replace(lua.PUBLISH, keys=lua.PUBLISH.keys[:3]))
    assert _declaration_problems(dataclasses.replace(lua.FORGET, argv=(*lua.FORGET.argv, "extra")))
    assert _declaration_problems(dataclasses.replace(lua.REQUEUE, argv=("dead_id", "tally", "*fields")))
    assert _declaration_problems(dataclasses.replace(lua.LEASE, argv=("token", "ttl_ms", "*more")))
    assert _declaration_problems(dataclasses.replace(lua.RELEASE, body=lua.RELEASE.body.replace("token", "ARGV[1]")))


def test_every_lua_file_is_a_declared_script() -> None:
    """A script file nobody loads, or a prelude nobody uses, is found."""
    files = {path.stem for path in lua.SCRIPTS_DIR.glob("*.lua")}
    assert {name for name in files if not name.startswith("_")} == {s.name.lower() for s in lua.SCRIPTS}
    used = {"helpers"} | {p for s in lua.SCRIPTS for p in re.findall(r"^-- uses:(.*)$", s.body, re.M) for p in p.split()}
    assert {name[1:] for name in files if name.startswith("_")} == used == set(lua.PRELUDES)


def test_every_script_is_declared_once_and_bound_by_a_protocol_seam() -> None:
    """No script without the seam that runs it, and no seam binding an undeclared one."""
    declared = {name: value for name, value in vars(lua).items() if isinstance(value, lua.Script)}
    assert {s.name for s in lua.SCRIPTS} == set(declared) == {s.name for s in declared.values()}
    assert set(_bound_by_seams()) == set(declared)


def test_a_call_naming_a_wrong_argument_is_refused() -> None:
    with pytest.raises(TypeError, match="unknown argument"):
        lua.FORGET.lists(Keys("ns"), {"entry_id": "1-1", "entryid": "1-1"})
    with pytest.raises(TypeError, match="missing argument 'entry_id'"):
        lua.FORGET.lists(Keys("ns"), {})
    keys = Keys("ns")
    assert lua.FORGET.lists(keys, {"entry_id": "1-1"}) == (
        [keys.groups, keys.state, keys.group_bytes, keys.payload_held, keys.payload_free, keys.payload_refs],
        [TRAINER_GROUP, "1-1", 0],
    )


def test_a_script_file_with_a_wrong_header_or_field_fails_to_load(monkeypatch: pytest.MonkeyPatch) -> None:
    files = {**lua._FILES, "bad_field": "-- KEYS: state\nredis.call('HSET', state, '$NO_SUCH_FIELD', 1)\n",
             "bad_prelude": "-- KEYS: state\n-- uses: nothing\nreturn state\n",
             "good": "-- KEYS: state\n-- ARGV: *ids\nreturn #ARGV - ids_at + 1 + num(redis.call('HGET', state, '$DEAD'))\n"}
    monkeypatch.setattr(lua, "_FILES", files)
    with pytest.raises(ValueError, match="unknown state field '\\$NO_SUCH_FIELD'"):
        lua.load("bad_field")
    with pytest.raises(ValueError, match="unknown prelude"):
        lua.load("bad_prelude")
    with pytest.raises(ValueError, match="no Lua script 'missing'"):
        lua.load("missing")
    with pytest.raises(ValueError, match="no Lua script '_helpers'"):
        lua.load("_helpers")
    good = lua.load("good")
    assert (good.keys, good.argv) == (("state",), ("*ids",))
    assert "local state = KEYS[1]\nlocal ids_at = 1\n" in good.source
    assert f"'{StateField.DEAD}'" in good.source and "$DEAD" not in good.source


async def test_a_seam_reaches_redis_py_through_one_frame(fake: Redis, ns: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GroupQueue.recycle -> Bound.__call__ -> redis-py's Script (issue 39: it was five frames)."""
    stacks: list[list[str]] = []
    original = AsyncScript.__call__

    async def spy(self: AsyncScript, *args: Any, **kwargs: Any) -> Any:
        stacks.append([frame.function for frame in inspect.stack()[1:]])
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(AsyncScript, "__call__", spy)
    keys, seams = await _setup(fake, ns)
    gid = await fake.xadd(keys.groups, {"index": 3})
    await fake.xreadgroup(TRAINER_GROUP, "t", {keys.groups: ">"})
    assert await seams.groups.recycle(gid, StateField.RECYCLED_STALE, {"index": 3})
    assert stacks[0][: stacks[0].index("recycle") + 1] == ["__call__", "recycle"]
