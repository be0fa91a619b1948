"""The Lua scripts that make every hand-over atomic.

MULTI/EXEC cannot branch on a result, and every hand-over must: a prompt attempt ends in exactly
one of *group published*, *prompt recycled* or *dead-lettered*, and only the holder whose XACK
returned 1 may do that. Each script therefore starts with the XACK (or a cursor check) and
does nothing else when it finds the work already done, which also makes every script safe to
re-send after a dropped connection.

All keys of a script share the namespace hash tag, so the scripts run on Redis Cluster.

Each script is one file of ``common/scripts/`` (read once, at import): a header of comments that
says why, then ``-- KEYS:`` and ``-- ARGV:`` naming its keys and arguments in order (``*name``: the
variadic rest), and ``-- uses:`` the shared preludes (``_archive.lua``, ``_pending.lua``,
``_now.lua``) it needs after ``_helpers.lua``. :func:`load` turns the header into named local
bindings in front of the body (the rest is ``name_at``, its first ARGV index), so a body never
indexes ``KEYS[n]``/``ARGV[n]``, and fills in the ``state`` hash's fields, written ``'$NAME'``, from
:class:`~.keys.StateField` (an unknown name fails the import). A call names its arguments
(:meth:`Script.lists`); a KEYS name that is a :class:`~.keys.Keys` property fills itself in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from .admission import MEASURED_CADENCE_CAP
from .config import PipelineConfig
from .keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, SourceField, StateField
from .redis_errors import translated

SCRIPTS_DIR = Path(__file__).with_name("scripts")
"""The ``.lua`` files; a name starting with ``_`` is a prelude, the others are scripts."""

_STATE_FIELDS = {name: value for name, value in vars(StateField).items() if name.isupper() and isinstance(value, str)}
_FILES = {path.stem: path.read_text(encoding="utf-8") for path in sorted(SCRIPTS_DIR.glob("*.lua"))}
_HEADER = re.compile(r"^-- (KEYS|ARGV|uses):(.*)$", re.M)


def _fill(text: str) -> str:
    """``'$NAME'`` replaced by the quoted ``StateField`` value (ValueError for an unknown name)."""

    def field_name(match: re.Match[str]) -> str:
        if match.group(1) not in _STATE_FIELDS:
            raise ValueError(f"unknown state field {match.group(0)} in a Lua script")
        return f"'{_STATE_FIELDS[match.group(1)]}'"

    return re.sub(r"'\$([A-Z_]+)'", field_name, text)


PRELUDES = {name[1:]: _fill(text) for name, text in _FILES.items() if name.startswith("_")}
"""The shared Lua helpers by name (``helpers`` starts every script)."""


def _header(text: str) -> dict[str, list[str]]:
    """The ``-- KEYS:``, ``-- ARGV:`` and ``-- uses:`` lines of a script's leading comment block."""
    lead = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lead.append(line)
    return {name: value.split() for name, value in _HEADER.findall("\n".join(lead))}


def _bindings(keys: Sequence[str], argv: Sequence[str]) -> str:
    """Lua locals naming KEYS and ARGV in declaration order; the variadic rest is ``name_at``."""
    lines = []
    if keys:
        lines.append(f"local {', '.join(keys)} = {', '.join(f'KEYS[{i}]' for i in range(1, len(keys) + 1))}")
    fixed = [name for name in argv if not name.startswith("*")]
    if fixed:
        lines.append(f"local {', '.join(fixed)} = {', '.join(f'ARGV[{i}]' for i in range(1, len(fixed) + 1))}")
    lines += [f"local {name[1:]}_at = {len(fixed) + 1}" for name in argv if name.startswith("*")]
    return "".join(line + "\n" for line in lines)


def load(name: str, **defaults: Any) -> Script:
    """The script of ``scripts/<name>.lua`` with its preludes and named bindings; ``defaults`` are
    constant ARGV values (a call may still name them)."""
    if name.startswith("_") or name not in _FILES:
        raise ValueError(f"no Lua script {name!r} in {SCRIPTS_DIR}")
    text = _FILES[name]
    header = _header(text)
    keys, argv = tuple(header.get("KEYS", ())), tuple(header.get("ARGV", ()))
    preludes = ["helpers", *header.get("uses", ())]
    if unknown := [p for p in preludes if p not in PRELUDES]:
        raise ValueError(f"script {name}: unknown prelude(s) {unknown}")
    source = "".join(PRELUDES[p] for p in preludes) + _bindings(keys, argv) + _fill(text)
    return Script(name.upper(), keys, argv, source, defaults, body=text)


@dataclass(frozen=True, slots=True)
class Script:
    """One Lua script: the names of its KEYS and ARGV in order, the constant ARGV values
    (``defaults``), the source sent to Redis and the file's own text (``body``). An ARGV name
    starting with ``*`` is the variadic rest (a sequence, spread)."""

    name: str
    keys: tuple[str, ...]
    argv: tuple[str, ...]
    source: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    body: str = ""

    def __post_init__(self) -> None:
        names = [*self.keys, *(a.lstrip("*") for a in self.argv)]
        if len(set(names)) != len(names):
            raise ValueError(f"script {self.name}: a KEYS or ARGV name is used twice: {names}")
        if any(a.startswith("*") for a in (*self.keys, *self.argv[:-1])):
            raise ValueError(f"script {self.name}: only the last ARGV name may be variadic (*name)")
        if unknown := set(self.defaults) - set(names):
            raise ValueError(f"script {self.name}: defaults for undeclared names {sorted(unknown)}")

    @property
    def names(self) -> frozenset[str]:
        """Every argument a call may name: the KEYS and ARGV names."""
        return frozenset((*self.keys, *(a.lstrip("*") for a in self.argv)))

    def lists(self, namespace: Keys, named: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
        """(KEYS, ARGV) for a call naming its arguments; a KEYS name left out that is a ``Keys``
        property is that key of ``namespace``. TypeError for a missing or unknown name."""
        given = {**self.defaults, **named}
        if unknown := given.keys() - self.names:
            raise TypeError(f"script {self.name}: unknown argument(s) {sorted(unknown)}")
        keys: list[Any] = []
        for name in self.keys:
            if name in given:
                keys.append(given[name])
            elif isinstance(getattr(Keys, name, None), property):
                keys.append(getattr(namespace, name))
            else:
                raise TypeError(f"script {self.name}: missing key {name!r}")
        args: list[Any] = []
        for name in self.argv:
            if name.startswith("*"):
                args.extend(given.get(name[1:], ()))
            elif name in given:
                args.append(given[name])
            else:
                raise TypeError(f"script {self.name}: missing argument {name!r}")
        return keys, args


PUBLISH = load("publish", tally="")
MOVE = load("move", tally="")
ACK_DELETE = load("ack_delete", tally="")
EVAL_COLLECT = load("eval_collect")
ARCHIVED = load("archived")
ADMIT = load("admit", group=PRODUCERS_GROUP, trainer_group=TRAINER_GROUP, cadence_cap=MEASURED_CADENCE_CAP)
SET_VERSION = load("set_version", trainer_group=TRAINER_GROUP)
RENEW = load("renew", group=PRODUCERS_GROUP)
RECLAIM_TURN = load("reclaim_turn")
FEED = load("feed")
FORGET = load("forget", group=TRAINER_GROUP)
JOURNAL_APPEND = load("journal_append", group=PRODUCERS_GROUP)
LIMIT_ACQUIRE = load("limit_acquire")
LIMIT_RENEW = load("limit_renew")
RATE_TAKE = load("rate_take")
ROW_STATS = load("row_stats")
REQUEUE = load("requeue", tally="")
LEASE = load("lease")
RELEASE = load("release")

SCRIPTS: tuple[Script, ...] = tuple(value for value in list(globals().values()) if isinstance(value, Script))
"""Every script declared in this module, bound by :class:`Scripts` (found, never listed by hand)."""


@dataclass(frozen=True, slots=True)
class AdmitReply:
    """ADMIT's answer: ``ok`` with entries (source stream key, id, fields) and the trainer's
    version, else a refusal with its numbers (``backlog``: ready; ``staleness``: outstanding,
    capacity, c, G) and no version (None: a refusal never reads one, so it must not pass for 0)."""

    status: str
    weight_version: int | None
    entries: list[tuple[str, bytes, dict[bytes, bytes]]]
    terms: list[int]


_DEAD_LETTER_FIELDS = frozenset({"source", "reason", "entry_id", "ts_ms"})
"""Fields a dead-letter entry sets itself; an original field of the same name is dropped."""


def _tally(fields: Mapping[Any, Any], kind: str) -> str:
    """The ``sources`` counter an entry of a named source moves (its plain ``source`` field), or ''."""
    source = fields.get("source", fields.get(b"source", ""))
    name = source.decode("utf-8", "replace") if isinstance(source, bytes) else str(source)
    return SourceField.of(name, kind) if name else ""


def _field_name(name: str | bytes) -> str:
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else name


def _flatten(fields: Mapping[Any, Any]) -> list[Any]:
    out: list[Any] = []
    for key, value in fields.items():
        out.append(key)
        out.append(value)
    return out


def script_commands(script: Script | str) -> tuple[str, ...]:
    """The Redis commands a script calls, in order of first use (the helpers' included)."""
    source = script.source if isinstance(script, Script) else script
    return tuple(dict.fromkeys(re.findall(r"redis\.p?call\('([A-Z]+)'", source)))


class _Bound:
    """One script on one client, its NOPERM and OOM replies translated (naming the script and the
    commands it calls: Redis 6.2 does not say which one was refused)."""

    def __init__(self, redis: Redis, script: Script) -> None:
        self.redis = redis
        self.script = script
        self.commands = script_commands(script)
        self._script = redis.register_script(script.source)

    async def __call__(self, *, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        s = self.script
        with translated(self.redis, script=s.name, commands=self.commands, source=s.source):
            return await self._script(keys=keys, args=args)


class Scripts:
    """Every script of this module (:data:`SCRIPTS`) bound to one namespace and one client;
    redis-py reloads them on NOSCRIPT. Each method runs one script by its declaration
    (:meth:`_run`, arguments by name) and shapes its reply."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._bound = {script.name: _Bound(redis, script) for script in SCRIPTS}

    async def _run(self, script: Script, **named: Any) -> Any:
        keys, args = script.lists(self.keys, named)
        return await self._bound[script.name](keys=keys, args=args)

    async def publish(
        self, source: str, prompt_id: str | bytes, group_fields: Mapping[str, Any], now_ms: int,
        journal: str | None = None,
    ) -> bytes | None:
        """Publish a group and ack its prompt (an entry of ``source``: prompts or retry); None when
        the prompt was already acknowledged. The size of its ``data`` enters the byte ledger; the
        prompt's episode ``journal`` (if any) is deleted with it. A prompt of the eval lane
        publishes to ``eval_groups``, outside the ledger and the sources' counters."""
        lane = source == self.keys.eval_prompts
        result = await self._run(
            PUBLISH, source=source, group=PRODUCERS_GROUP, prompt_id=prompt_id, now_ms=now_ms,
            groups=self.keys.eval_groups if lane else self.keys.groups,
            data_bytes=0 if lane else len(group_fields.get("data", b"")), fields=_flatten(group_fields),
            journal=journal or self.keys.state, drop="1" if journal else "",
            tally="" if lane else _tally(group_fields, "published"),
        )
        return result or None

    async def move(
        self,
        *,
        source: str,
        group: str,
        entry_id: str | bytes,
        target: str,
        counter: str,
        fields: Mapping[Any, Any],
        fate: str = "",
        reason: str = "",
        actor: str = "",
        now_ms: int = 0,
        journal: str | None = None,
        tally: str = "",
    ) -> bool:
        """Ack + delete ``entry_id`` in ``source`` and add ``fields`` to ``target``, atomically
        (the byte ledger follows a group entry out of, or within, the group stream; a ``fate``
        is archived, decided by ``actor``, in the same step; the prompt's episode ``journal``, if
        given, is deleted in it too; ``tally``, a field of the ``sources`` hash, counts one more)."""
        k = self.keys
        groups = k.groups
        ledger = ("s" if source == groups else "") + ("t" if source == target == groups else "")
        kind = "groups" if source == groups else "retry" if source == k.retry else "prompts"
        moved = await self._run(
            MOVE, source=source, target=target, group=group, entry_id=entry_id, counter=counter,
            ledger=ledger, fate=fate, reason=reason, actor=actor, kind=kind, now_ms=now_ms,
            fields=_flatten(fields), journal=journal or k.state, drop="1" if journal else "", tally=tally,
        )
        return bool(moved)

    async def recycle(
        self, group_id: str | bytes, counter: str, prompt_fields: Mapping[str, Any], *,
        reason: str = "", actor: str = "", now_ms: int = 0,
    ) -> bool:
        """A group's prompt back to the retry stream (archived as ``recycled`` with ``reason``)."""
        k = self.keys
        return await self.move(
            source=k.groups, group=TRAINER_GROUP, entry_id=group_id, target=k.retry,
            counter=counter, fields=prompt_fields, fate="recycled", reason=reason or counter,
            actor=actor, now_ms=now_ms, tally=_tally(prompt_fields, "recycled"),
        )

    async def return_prompt(self, source: str, prompt_id: str | bytes, prompt_fields: Mapping[Any, Any]) -> bool:
        """A draining producer's unfinished prompt (an entry of ``source``) to the retry stream (an
        eval prompt back to the eval lane)."""
        k = self.keys
        return await self.move(
            source=source, group=PRODUCERS_GROUP, entry_id=prompt_id,
            target=k.eval_prompts if source == k.eval_prompts else k.retry,
            counter=StateField.RETURNED, fields=prompt_fields,
        )

    async def dead_letter(
        self,
        *,
        source: str,
        group: str,
        entry_id: str | bytes,
        reason: str,
        fields: Mapping[Any, Any],
        now_ms: int,
        actor: str = "",
        journal: str | None = None,
    ) -> bool:
        """Move an entry to the dead-letter stream with a reason; its original fields are kept
        (and it is archived as ``dead_lettered``, decided by ``actor``; a prompt's episode
        ``journal`` is deleted)."""
        kind = "groups" if source == self.keys.groups else "prompts"
        # Field names are kept as they came (bytes that are not UTF-8 included: a hostile entry
        # must be dead-lettered, not crash the process that reads it).
        original = {k: v for k, v in fields.items() if _field_name(k) not in _DEAD_LETTER_FIELDS}
        dead_fields = {"source": kind, "reason": reason, "entry_id": entry_id, "ts_ms": now_ms, **original}
        return await self.move(
            source=source, group=group, entry_id=entry_id, target=self.keys.dead,
            counter=StateField.DEAD, fields=dead_fields, fate="dead_lettered", reason=reason, actor=actor,
            now_ms=now_ms, journal=journal, tally=_tally(fields, "lost"),
        )

    async def ack_delete(
        self,
        *,
        stream: str,
        group: str,
        ids: Sequence[str | bytes],
        counter: str,
        second_counter: str = "",
        time_field: str = "",
        now_ms: int = 0,
        fate: str = "",
        reason: str = "",
        actor: str = "",
        tally: Sequence[str] = (),
    ) -> int:
        """Acknowledge and delete ``ids``; the number acknowledged now. A ``fate`` (``trained``,
        ``filtered``) is archived for each, in the order given (a batch's order); ``tally`` (one
        ``sources`` field per id, or none) counts each acknowledged one."""
        if not ids:
            return 0
        # the ledger holds group ids only: for another stream, pass the stream itself (= none)
        sizes = self.keys.group_bytes if stream == self.keys.groups else stream
        acked = await self._run(
            ACK_DELETE, stream=stream, sizes=sizes, group=group, counter=counter,
            second_counter=second_counter, time_field=time_field, now_ms=now_ms, fate=fate, reason=reason,
            actor=actor, tally=json.dumps(list(tally)) if any(tally) else "", ids=ids,
        )
        return int(acked)

    async def eval_collect(self, name: str, result: str, actor: str, ids: Sequence[bytes | str], now_ms: int) -> int:
        """Archive and delete a finished eval's groups and store its result; the groups removed."""
        return int(await self._run(EVAL_COLLECT, name=name, result=result, actor=actor, now_ms=now_ms, ids=ids))

    async def archived(self, pairs: Sequence[tuple[bytes | str, int]], cursor: str, now_ms: int) -> int:
        """Confirm archive records written to files: deleted from the stream and the ledger; the
        number still there."""
        flat: list[Any] = []
        for record_id, size in pairs:
            flat.extend((record_id, size))
        return int(await self._run(ARCHIVED, cursor=cursor, now_ms=now_ms, pairs=flat))

    async def admit(self, *, consumer: str, config: PipelineConfig, count: int = 1, now_ms: int = 0) -> AdmitReply:
        """Run ADMIT under the namespace's ``config`` (its backlog caps and admission rule): up to
        ``count`` prompts (retry stream first), or why none."""
        result = await self._run(
            ADMIT, consumer=consumer, max_backlog=config.max_backlog,
            admission=1 if config.admission_enabled else 0, max_staleness=config.max_staleness or 0,
            batch_size=config.batch_size, steps_per_version=config.steps_per_version, count=max(1, count),
            now_ms=now_ms, max_backlog_bytes=config.max_backlog_bytes,
        )
        status = result[0].decode() if isinstance(result[0], bytes) else str(result[0])
        if status != "ok":
            return AdmitReply(status, None, [], [int(x) for x in result[1:]])
        streams = (self.keys.retry, self.keys.prompts, self.keys.eval_prompts)
        entries = []
        for i in range(2, len(result), 3):
            flat = result[i + 2] or []
            entries.append((streams[int(result[i]) - 1], result[i + 1], dict(zip(flat[::2], flat[1::2], strict=True))))
        return AdmitReply(status, int(result[1]), entries, [])

    async def forget_group(self, entry_id: str | bytes) -> int:
        """Acknowledge a delivered group entry that is gone from the stream and drop it from the
        byte ledger; the bytes it held."""
        return int(await self._run(FORGET, entry_id=entry_id))

    async def requeue(self, dead_id: str | bytes, prompt_fields: Mapping[str, Any]) -> bytes | None:
        """Move a dead-letter entry back to the retry stream; None when it was already gone."""
        result = await self._run(
            REQUEUE, dead_id=dead_id, counter=StateField.REQUEUED, tally=_tally(prompt_fields, "requeued"),
            fields=_flatten(prompt_fields),
        )
        return result or None

    async def row_stats(self, k: int, items: Sequence[tuple[str, float, float, int, int]]) -> int:
        """Record finished groups in their rows' statistics: (field, mean reward, reward variance,
        version, epoch) each, the last ``k`` kept."""
        if not items:
            return 0
        return int(await self._run(ROW_STATS, k=k, items=[v for item in items for v in item]))

    async def renew(self, stream: str, consumer: str, ids: Iterable[str | bytes]) -> list[bytes]:
        ids = list(ids)
        if not ids:
            return []
        return list(await self._run(RENEW, stream=stream, consumer=consumer, ids=ids))

    async def reclaim_turn(self, now_ms: int, interval_ms: int) -> tuple[bool, int]:
        """(whether this call took the fleet's reclaim turn, when idle prompts were last found)."""
        won, due = await self._run(RECLAIM_TURN, now_ms=now_ms, interval_ms=interval_ms)
        return bool(won), int(due)

    async def set_version(self, *, version: int | None, paused: bool | None, message: str) -> None:
        """Set the weight version (recording the consumption terms when it changes) and/or the
        paused flag, and announce ``message`` on the control channel, atomically."""
        await self._run(
            SET_VERSION, version="" if version is None else version,
            paused="" if paused is None else (1 if paused else 0), channel=self.keys.control, message=message,
        )

    async def feed(
        self,
        *,
        expected_next: int,
        next_after: int,
        epoch: int,
        position: int,
        dataset: str,
        entries: Sequence[Mapping[str, Any]],
        dead: Sequence[Mapping[str, Any]] = (),
        sources: Sequence[tuple[str, str, Any]] = (),
    ) -> int | None:
        """Add prompt entries (and dead letters for rows that cannot be fed) and move the cursor;
        None when the cursor moved meanwhile."""
        width = 2 * len(entries[0]) if entries else 0
        flat: list[Any] = []
        for fields in entries:
            if 2 * len(fields) != width:
                raise ValueError("every fed entry must have the same fields")
            flat.extend(_flatten(fields))
        result = await self._run(
            FEED, expected_next=expected_next, next_after=next_after, epoch=epoch, position=position,
            dataset=dataset, rejected=json.dumps([[str(v) for v in _flatten(d)] for d in dead]),
            updates=json.dumps([str(v) for update in sources for v in update]), width=width or 2, entries=flat,
        )
        return None if result is None else int(result)

    async def journal_append(
        self, *, source: str, consumer: str, entry_id: str | bytes, journal: str, member: int, seq: int,
        budget: int, step: bytes,
    ) -> str:
        """Append one episode step under the lease: 'ok', 'lost' (not ours) or 'full' (budget)."""
        result = await self._run(
            JOURNAL_APPEND, source=source, journal=journal, consumer=consumer, entry_id=entry_id,
            member=member, seq=seq, budget=budget, step=step,
        )
        return result.decode() if isinstance(result, bytes) else str(result)

    async def limit_acquire(
        self, *, name: str, token: str, lease_ms: int, size_hint: int, waited_ms: int
    ) -> tuple[str, int]:
        """One unit of a namespace limit: ('ok' | 'wait' | 'unknown', the limit's size)."""
        k = self.keys
        status, size = await self._run(
            LIMIT_ACQUIRE, holders=k.limit_holders(name), waiters=k.limit_waiters(name), name=name, token=token,
            lease_ms=lease_ms, size_hint=size_hint, waited_ms=waited_ms,
        )
        return (status.decode() if isinstance(status, bytes) else str(status)), int(size)

    async def limit_renew(self, name: str, tokens: Sequence[str], lease_ms: int) -> list[str]:
        """Extend the leases of ``tokens``' units; the tokens that lost theirs."""
        if not tokens:
            return []
        lost = await self._run(LIMIT_RENEW, holders=self.keys.limit_holders(name), lease_ms=lease_ms, tokens=tokens)
        return [t.decode() if isinstance(t, bytes) else str(t) for t in lost]

    async def rate_take(self, *, name: str, rate_hint: float, waited_ms: int) -> tuple[str, int]:
        """One token of a namespace rate: ('ok', 0), ('wait', ms until one is due) or ('unknown', 0)."""
        status, wait_ms = await self._run(
            RATE_TAKE, bucket=self.keys.rate_bucket(name), name=name, rate_hint=repr(float(rate_hint)),
            waited_ms=waited_ms,
        )
        return (status.decode() if isinstance(status, bytes) else str(status)), int(wait_ms)

    async def lease(self, key: str, token: str, ttl_ms: int) -> bool:
        """Take the lease ``key`` if free, or renew it if ``token`` holds it; False when another does."""
        return bool(await self._run(LEASE, lease=key, token=token, ttl_ms=ttl_ms))

    async def release(self, key: str, token: str) -> bool:
        """Delete the lease ``key`` if ``token`` still holds it."""
        return bool(await self._run(RELEASE, lease=key, token=token))
