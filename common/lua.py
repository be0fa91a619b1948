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

A protocol seam (``common/protocol/``) binds the scripts it runs (:meth:`Script.bind`) and shapes
their replies itself; the few argument shapes that several seams share are the functions below
(:func:`tally`, :func:`refs`, :func:`flatten`, :func:`journal`, :func:`episode_of`, :func:`move_terms`,
:func:`dead_letter`).
A new script: its ``.lua`` file, its ``load`` line here, and the seam method that calls it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from .admission import MEASURED_CADENCE_CAP
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

    def bind(self, redis: Redis, keys: Keys) -> Bound:
        """This script on ``redis`` for the namespace ``keys`` (what a protocol seam holds)."""
        return Bound(self, redis, keys)


PUBLISH = load("publish", tally="", objects="", prompt_refs="")
MOVE = load("move", tally="", fate="", reason="", actor="", now_ms=0, objects="")
ACK_DELETE = load(
    "ack_delete", tally="", second_counter="", time_field="", now_ms=0, fate="", reason="", actor="",
)
EVAL_COLLECT = load("eval_collect")
EVAL_BEGIN = load("eval_begin")
EVAL_CHUNK = load("eval_chunk")
EVAL_SUBMITTED = load("eval_submitted")
ARCHIVED = load("archived")
ADMIT = load(
    "admit", group=PRODUCERS_GROUP, trainer_group=TRAINER_GROUP, cadence_cap=MEASURED_CADENCE_CAP, source_caps=""
)
SET_VERSION = load("set_version", trainer_group=TRAINER_GROUP)
RENEW = load("renew", group=PRODUCERS_GROUP)
RECLAIM_TURN = load("reclaim_turn")
FEED = load("feed")
FORGET = load("forget", group=TRAINER_GROUP, now_ms=0)
JOURNAL_APPEND = load("journal_append", group=PRODUCERS_GROUP, objects="")
SWEEP_JOURNALS = load("sweep_journals")
LIMIT_ACQUIRE = load("limit_acquire")
LIMIT_RENEW = load("limit_renew")
RATE_TAKE = load("rate_take")
ROW_STATS = load("row_stats")
REQUEUE = load("requeue", tally="")
SWEEP_PAYLOAD = load("sweep_payload")
DROP_DEAD = load("drop_dead")
ADOPT_ORPHANS = load("adopt_orphans")
LEASE = load("lease")
RELEASE = load("release")

SCRIPTS: tuple[Script, ...] = tuple(value for value in list(globals().values()) if isinstance(value, Script))
"""Every script declared here (found, never listed by hand); each is bound by the protocol seam
that runs it (``common/protocol/``)."""


_DEAD_LETTER_FIELDS = frozenset({"source", "reason", "entry_id", "ts_ms"})
"""Fields a dead-letter entry sets itself; an original field of the same name is dropped."""


def tally(fields: Mapping[Any, Any], kind: str) -> str:
    """The ``sources`` counter an entry of a named source moves (its plain ``source`` field), or ''."""
    source = fields.get("source", fields.get(b"source", ""))
    name = source.decode("utf-8", "replace") if isinstance(source, bytes) else str(source)
    return SourceField.of(name, kind) if name else ""


def refs(fields: Mapping[Any, Any]) -> str:
    """The payload object set an entry refers to (its plain ``refs`` field), or ''."""
    value = fields.get("refs", fields.get(b"refs", ""))
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def flatten(fields: Mapping[Any, Any]) -> list[Any]:
    """A mapping as the flat name, value, ... list XADD takes (a variadic ARGV rest)."""
    out: list[Any] = []
    for key, value in fields.items():
        out.append(key)
        out.append(value)
    return out


def journal(keys: Keys, key: str | None, *, keep: bool = False) -> dict[str, str]:
    """PUBLISH's and MOVE's ``journal`` and ``drop``: the prompt's episode journal deleted in the
    same step, or kept (``keep``: MOVE moves its pointer to the prompt's new entry), or none (the
    state key stands in: every KEYS entry is a key of the namespace's slot)."""
    return {"journal": key or keys.state, "drop": "1" if key and not keep else ""}


def episode_of(keys: Keys, stream: str, fields: Mapping[Any, Any]) -> str | None:
    """The episode journal key of a prompt entry of ``stream``, from its plain ``index`` and
    ``epoch`` fields (None when they are missing or not numbers) and, in the eval lane, ``eval``
    (:meth:`~.keys.Keys.episode_lane`)."""
    found = []
    for name in ("index", "epoch"):
        value = fields.get(name, fields.get(name.encode()))
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
        if value is None or not text.isdigit():
            return None
        found.append(int(text))
    return keys.episode(found[0], found[1], keys.episode_lane(stream, fields))


def move_terms(keys: Keys, source: str, target: str) -> dict[str, str]:
    """MOVE's ``ledger`` (the byte ledger follows a group out of, or within, the group stream) and
    the archive's ``kind`` of the stream an entry leaves."""
    groups = keys.groups
    return {
        "source": source, "target": target,
        "ledger": ("s" if source == groups else "") + ("t" if source == target == groups else ""),
        "kind": "groups" if source == groups else "retry" if source == keys.retry else "prompts",
    }


def dead_letter(keys: Keys, source: str, entry_id: str | bytes, reason: str, fields: Mapping[Any, Any],
                now: int) -> dict[Any, Any]:
    """A dead letter's fields: where it came from, why and when, then the entry's own fields (kept
    as they came, bytes that are not UTF-8 included: a hostile entry must be dead-lettered, not
    crash the process that reads it)."""
    kind = "groups" if source == keys.groups else "prompts"
    original = {k: v for k, v in fields.items() if _field_name(k) not in _DEAD_LETTER_FIELDS}
    return {"source": kind, "reason": reason, "entry_id": entry_id, "ts_ms": now, **original}


def _field_name(name: str | bytes) -> str:
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else name


def status(value: Any) -> str:
    """A script's status reply (``ok``, ``wait``...) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def script_commands(script: Script | str) -> tuple[str, ...]:
    """The Redis commands a script calls, in order of first use (the helpers' included)."""
    source = script.source if isinstance(script, Script) else script
    return tuple(dict.fromkeys(re.findall(r"redis\.p?call\('([A-Z]+)'", source)))


class Bound:
    """One script on one client and namespace, called with its arguments by name; redis-py
    reloads it on NOSCRIPT, and NOPERM and OOM replies are translated naming the script and the
    commands it calls (Redis 6.2 does not say which one was refused)."""

    __slots__ = ("_call", "commands", "keys", "redis", "script")

    def __init__(self, script: Script, redis: Redis, keys: Keys) -> None:
        self.script = script
        self.redis = redis
        self.keys = keys
        self.commands = script_commands(script)
        self._call = redis.register_script(script.source)

    async def __call__(self, **named: Any) -> Any:
        keys, args = self.script.lists(self.keys, named)
        with translated(self.redis, script=self.script.name, commands=self.commands, source=self.script.source):
            return await self._call(keys=keys, args=args)
