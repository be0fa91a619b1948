"""Redis' refusals as rollstream errors: NOPERM (the ACL user lacks a command or a key) becomes
:class:`~.errors.RedisPermissionDenied` naming the command, the user and the role of
``deploy/redis/users.acl.template`` that grants it; OOM (``maxmemory`` reached) becomes the
transient :class:`~.errors.RedisOutOfMemory`. Both also when a Lua script's command got them:
Redis 6.2 then answers only "Error running script ...: The user executing the script can't run
this command" (or "-OOM ..."), so the script's name and its commands stand in for the command.

No Redis commands here: the protocol package, lua.py, namespace.py and events.py translate their calls
through :func:`translated` and :func:`translate_errors`.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, Concatenate, ParamSpec, TypeVar

from redis.exceptions import NoPermissionError, OutOfMemoryError, ResponseError

from .errors import RedisOutOfMemory, RedisPermissionDenied

P = ParamSpec("P")
R = TypeVar("R")

ACL_TEMPLATE = "deploy/redis/users.acl.template"

ROLE_COMMANDS: dict[str, frozenset[str]] = {
    "producer": frozenset(
        "hello auth ping client|setname evalsha script|load xreadgroup xread xack xadd xdel xclaim xautoclaim "
        "xpending xrange xlen xgroup|create xinfo|groups hget hmget hgetall hset hsetnx hincrby subscribe unsubscribe "
        "hstrlen hdel del zadd zrem zscore zcard zremrangebyscore zrangebyscore zrank zrange time scan".split()
    ),
    "trainer": frozenset(
        "hello auth ping client|setname evalsha script|load multi exec discard publish xreadgroup xread xrevrange "
        "xack xadd xdel xclaim xautoclaim xpending xrange xlen xgroup|create xgroup|delconsumer xinfo|groups "
        "xinfo|consumers hget hmget hgetall hset hsetnx hincrby get set pexpire del hkeys hdel zadd zrem zrange hlen "
        "hscan".split()
    ),
}
"""The commands each role of the ACL template grants by name (tests/test_redis_errors.py checks
this against the template); the ``operator`` role grants categories (every command rollstream's
operator tools use) and is named for every command."""
OPERATOR_ROLE = "operator"

_COMMAND_IN_MESSAGE = re.compile(r"run the '([^']+)' command", re.IGNORECASE)
_SCRIPT_LINE = re.compile(r"@user_script:(\d+)")
_CALLED = re.compile(r"redis\.p?call\('([A-Z]+)'")
_SCRIPT_NOPERM = ("can't run this command", "no permissions to", "noperm", "acl failure in script")
_OOM_WORDS = ("oom command not allowed", "used memory > 'maxmemory'")


def roles_granting(command: str) -> tuple[str, ...]:
    """The template's roles that grant ``command`` (``xgroup|create`` form), operator last."""
    name = command.lower()
    return (*(role for role, granted in ROLE_COMMANDS.items() if name in granted), OPERATOR_ROLE)


def acl_user(redis: Any) -> str:
    """The ACL user a client authenticates as (``default`` without one)."""
    for owner in (getattr(redis, "connection_pool", None), getattr(redis, "nodes_manager", None)):
        kwargs = getattr(owner, "connection_kwargs", None)
        if isinstance(kwargs, dict) and kwargs.get("username"):
            return str(kwargs["username"])
    return "default"


def is_noperm(exc: BaseException) -> bool:
    if isinstance(exc, NoPermissionError):
        return True
    return isinstance(exc, ResponseError) and any(w in str(exc).lower() for w in _SCRIPT_NOPERM)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, OutOfMemoryError | RedisOutOfMemory):
        return True
    return isinstance(exc, ResponseError) and any(w in str(exc).lower() for w in _OOM_WORDS)


def _refused_in_script(raw: str, source: str) -> str | None:
    """The command on the script line Redis 6.2 names (``@user_script:N``), when there is one."""
    line = _SCRIPT_LINE.search(raw)
    lines = source.splitlines()
    if line is None or not 1 <= int(line.group(1)) <= len(lines):
        return None
    called = dict.fromkeys(_CALLED.findall(lines[int(line.group(1)) - 1]))
    return next(iter(called)) if len(called) == 1 else None


def permission_denied(
    exc: BaseException, user: str, *, script: str = "", commands: Sequence[str] = (), source: str = ""
) -> RedisPermissionDenied:
    """The typed error for a NOPERM reply; ``script``, its ``commands`` and ``source`` when a
    script got it."""
    raw = str(exc)
    match = _COMMAND_IN_MESSAGE.search(raw)
    on_line = _refused_in_script(raw, source) if source and not match else None
    where = f" (inside the {script} script)" if script else ""
    if match:
        command = match.group(1).lower()
        what = f"the {command.upper()} command{where}"
        roles = roles_granting(command)
    elif on_line:
        command = on_line.lower()
        what = f"the {on_line} command{where}"
        roles = roles_granting(command)
    elif "key" in raw.lower() or "channel" in raw.lower():
        command = "key or channel"
        what = f"a key or channel of this namespace{where}"
        roles = (*ROLE_COMMANDS, OPERATOR_ROLE)
    elif commands:
        command = "|".join(c.lower() for c in commands)
        what = f"one of {', '.join(c.upper() for c in commands)}{where}"
        granting = [set(roles_granting(c)) for c in commands]
        roles = tuple(r for r in (*ROLE_COMMANDS, OPERATOR_ROLE) if all(r in g for g in granting))
    else:
        command = "unknown"
        what = f"a command{where}"
        roles = (OPERATOR_ROLE,)
    message = (
        f"Redis ACL user {user!r} may not run {what}: {raw[:240]}. In {ACL_TEMPLATE} the role "
        f"{' / '.join(roles)} grants it: give {user!r} that role's rules (its commands, key and "
        f"channel patterns; docs/deploy.md), or connect as that role's user"
    )
    return RedisPermissionDenied(message, command=command, user=user, roles=roles)


def out_of_memory(exc: BaseException, *, script: str = "") -> RedisOutOfMemory:
    where = f" (the {script} script changed nothing)" if script else ""
    return RedisOutOfMemory(
        f"Redis is out of memory: used_memory reached maxmemory and it refuses writes{where} "
        f"({str(exc)[:160]}); commits free memory, or raise maxmemory (docs/operations.md)"
    )


@contextlib.contextmanager
def translated(
    redis: Any, *, script: str = "", commands: Sequence[str] = (), source: str = ""
) -> Iterator[None]:
    """NOPERM and OOM replies of the calls inside as rollstream errors; other errors unchanged."""
    try:
        yield
    except ResponseError as exc:
        if is_noperm(exc):
            raise permission_denied(
                exc, acl_user(redis), script=script, commands=commands, source=source
            ) from exc
        if is_oom(exc):
            raise out_of_memory(exc, script=script) from exc
        raise


def translate_errors(
    fn: Callable[Concatenate[Any, P], Awaitable[R]],
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, R]]:
    """Decorate a coroutine function whose first argument is the client: :func:`translated`."""

    @functools.wraps(fn)
    async def wrapper(redis: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with translated(redis):
            return await fn(redis, *args, **kwargs)

    wrapper.__rollstream_translated__ = True  # type: ignore[attr-defined]
    return wrapper
