"""Redis connections and riding out Redis outages.

Two rules from redis-py's behaviour shape this module:

* a blocking read (``XREADGROUP ... BLOCK``) needs a socket timeout *above* its BLOCK time,
  otherwise redis-py times the socket out and silently re-sends the command; blocking readers
  therefore get their own client, made by :func:`connect` with ``block_ms``;
* a client holds at most :data:`MAX_CONNECTIONS` connections (a Cluster client as many commands
  in flight); more commands at once wait;
* redis-py's own retry covers a blip; a Redis restart takes longer, so the long-running loops
  wrap their steps in :class:`Outage`, which backs off (bounded), logs once per outage and
  once on recovery;
* redis-py's socket timeout is timed on the event loop, so it counted the time the loop stood
  still (user code blocking it, DESIGN §4.16): a command in flight across a stall longer than
  the timeout was timed out although Redis had answered at once, and re-sent by the retry. A
  script then ran twice: a second ADMIT left the first one's prompts pending under the producer
  but never worked on, so they were taken over after the lease (issue 43); a second PUBLISH
  reported a duplicate. Every connection here reads its replies under :class:`ReplyDeadline`,
  which gives a stalled loop its time back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit

from redis.asyncio import BlockingConnectionPool, Connection, Redis
from redis.asyncio.cluster import ClusterNode, ClusterPubSub, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError, OutOfMemoryError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .backoff import Backoff
from .cancellation import cancel_requests, raise_if_cancelled
from .errors import ConfigError, RedisOutOfMemory

T = TypeVar("T")
logger = logging.getLogger(__name__)

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ConnectionError,
    OSError,
    RedisOutOfMemory,
    OutOfMemoryError,
)
"""Errors that mean "Redis is (briefly) unreachable" or "refuses writes at maxmemory until
memory is freed": retry with backoff, do not fail."""


PASSWORD_ENV = "ROLLSTREAM_REDIS_PASSWORD"
"""Environment variable with the Redis password (used when the URL carries none)."""
PASSWORD_FILE_ENV = "ROLLSTREAM_REDIS_PASSWORD_FILE"
"""Environment variable naming a file whose first line is the Redis password."""
USERNAME_ENV = "ROLLSTREAM_REDIS_USERNAME"
"""Environment variable with the ACL user name (used when the URL carries none)."""
SENTINEL_PASSWORD_ENV = "ROLLSTREAM_SENTINEL_PASSWORD"
"""Environment variable with the password of the Sentinels themselves (``requirepass`` there)."""
MAX_CONNECTIONS = 32
"""Connections one client opens at most (plain, TLS, unix and Sentinel URLs; a Cluster client's
pools are redis-py's own, per node, and it keeps at most this many commands in flight).
Unbounded, a producer opened one per command in flight: 65 with 256 episodes in flight, ~220
with 1024, and a few dozen producers would reach Redis' ``maxclients`` (10,000 by default)."""

_PLAIN_SCHEMES = ("redis", "rediss", "unix")
_SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_OWN_QUERY = ("wait_replicas", "wait_timeout_ms", "sentinel_password", "sentinel_username")
_WAITED_COMMANDS = frozenset({"EVALSHA", "EVAL"})
_MAX_WAIT_MS = 5000
_SECRET_WORDS = ("password", "secret", "token", "key", "auth")


def redact_url(url: str) -> str:
    """``url`` with its password, and query values named like secrets (password, token, key),
    replaced by ``***``. Used for Redis and engine URLs alike."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable Redis URL>"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hosts = netloc.rpartition("@")
        user, colon, _secret = userinfo.partition(":")
        netloc = f"{user}:***@{hosts}" if colon else f"{user}@{hosts}"
    query = "&".join(
        f"{k}=***" if any(w in k.lower() for w in _SECRET_WORDS) and not k.startswith("ssl_") else f"{k}={v}"
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    )
    return _join_url(parts.scheme, netloc, parts.path, query)


def _join_url(scheme: str, netloc: str, path: str, query: str) -> str:
    """A URL from its parts that keeps ``//`` with an empty host (``urlunsplit`` writes
    ``unix:/path``, which redis-py refuses)."""
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")


def _read_password_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline().rstrip("\r\n")
    except OSError as exc:
        raise ConfigError(f"cannot read the Redis password file {path!r}: {exc.strerror}") from None


def _credentials(parts: SplitResult, password: str | None) -> tuple[str | None, str | None]:
    """(username, password): the URL's, else the ``password`` argument, else the environment."""
    username = unquote(parts.username) if parts.username else None
    secret = unquote(parts.password) if parts.password else None
    if secret is None:
        secret = password
    if secret is None and os.environ.get(PASSWORD_ENV):
        secret = os.environ[PASSWORD_ENV]
    if secret is None and os.environ.get(PASSWORD_FILE_ENV):
        secret = _read_password_file(os.environ[PASSWORD_FILE_ENV])
    if username is None and os.environ.get(USERNAME_ENV):
        username = os.environ[USERNAME_ENV]
    return username, secret


SOCKET_TIMEOUT = 10.0
"""Seconds a reply may take (a blocking read's: its BLOCK time more) before the connection is
dropped and the command retried."""
STALL_SLACK = 0.1
"""Seconds a reply's deadline may fire late before the loop counts as having stood still at it."""


class ReplyDeadline:
    """``asyncio.timeout(seconds)`` around one reply, except that a stalled loop does not time it
    out. When the deadline fires more than :data:`STALL_SLACK` late, the loop stood still past it
    and the reply may be waiting unread in the socket: the window starts over. When it fires on
    time it expires one turn of the loop later, so a reply read by this turn's I/O (a stall that
    ended just before) is parsed first. A server that does not answer still times out."""

    __slots__ = ("_handle", "_loop", "_seconds", "_timeout", "_when")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds

    async def __aenter__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout = asyncio.timeout(None)
        await self._timeout.__aenter__()
        self._arm(self._loop.time())

    async def __aexit__(self, *exc_info: Any) -> None:
        self._handle.cancel()
        await self._timeout.__aexit__(*exc_info)

    def _arm(self, now: float) -> None:
        self._when = now + self._seconds
        self._handle = self._loop.call_at(self._when, self._due)

    def _due(self) -> None:
        now = self._loop.time()
        late = now - self._when
        if late > STALL_SLACK:
            logger.debug("a reply's %.1f s deadline fired %.1f s late (the loop stood still): waiting again",
                         self._seconds, late)
            self._arm(now)
        else:
            self._timeout.reschedule(now)


class _StallTolerantReads:
    """Mixed into every connection class :func:`connect` uses: the socket timeout of a reply is
    :class:`ReplyDeadline`'s instead of redis-py's (a read with its own ``timeout``, pub/sub's,
    is left as it is)."""

    socket_timeout: float | None

    async def read_response(
        self, disable_decoding: bool = False, timeout: float | None = None, **options: Any  # noqa: ASYNC109 -- redis-py's
    ) -> Any:
        parent: Any = super()
        if timeout is not None or not self.socket_timeout:
            return await parent.read_response(disable_decoding, timeout, **options)
        try:
            async with ReplyDeadline(self.socket_timeout):
                return await parent.read_response(disable_decoding, math.inf, **options)
        except TimeoutError:
            if options.get("disconnect_on_error", True):
                await parent.disconnect(nowait=True)
            raise RedisTimeoutError(f"Timeout reading from {parent._host_error()}") from None


_TOLERANT: dict[type[Any], type[Any]] = {}


def _stall_tolerant(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` with :class:`_StallTolerantReads` mixed in (one class per class)."""
    if issubclass(connection_class, _StallTolerantReads):
        return connection_class
    if connection_class not in _TOLERANT:
        _TOLERANT[connection_class] = type(
            f"StallTolerant{connection_class.__name__}", (_StallTolerantReads, connection_class), {}
        )
    return _TOLERANT[connection_class]


class _BlockingPool(BlockingConnectionPool):
    """redis-py's blocking pool, its connections reading under :class:`ReplyDeadline`."""

    connection_class: type[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection_class = _stall_tolerant(self.connection_class)


class _ReplicatedRedis(Redis):
    """A client that follows each script (every state move) with ``WAIT replicas timeout`` on
    the same connection, so the call returns once that many replicas have the write."""

    wait_replicas = 1
    wait_timeout_ms = 1000
    unreplicated = 0

    async def _send_command_parse_response(self, conn: Any, command_name: Any, *args: Any, **options: Any) -> Any:
        result = await super()._send_command_parse_response(conn, command_name, *args, **options)
        name = command_name.decode() if isinstance(command_name, bytes) else str(command_name)
        if name.upper() in _WAITED_COMMANDS:
            await conn.send_command("WAIT", self.wait_replicas, self.wait_timeout_ms)
            acked = int(await conn.read_response())
            if acked < self.wait_replicas:
                self.unreplicated += 1
                if self.unreplicated == 1 or self.unreplicated % 100 == 0:
                    logger.warning(
                        "WAIT: %d of %d replicas acknowledged within %d ms (%d writes so far)",
                        acked, self.wait_replicas, self.wait_timeout_ms, self.unreplicated,
                    )
        return result


def connect(
    url: str,
    *,
    block_ms: int | None = None,
    name: str | None = None,
    password: str | None = None,
    wait_replicas: int | None = None,
    wait_timeout_ms: int | None = None,
) -> Redis:
    """A client for ``url``. With ``block_ms``, the socket timeout leaves room for BLOCK.

    URL forms (see docs/deploy.md):

    * ``redis://[[user]:pass@]host:port/db``, ``rediss://...`` (TLS; ``?ssl_ca_certs=PATH``,
      ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``), ``unix:///path?db=0``;
    * ``redis+sentinel://[[user]:pass@]host1:26379,host2:26379/SERVICE[/db]`` (``rediss+sentinel``
      for TLS; ``?sentinel_password=`` or ``$ROLLSTREAM_SENTINEL_PASSWORD`` for the Sentinels);
    * ``redis+cluster://[[user]:pass@]host1:port,host2:port`` (``rediss+cluster`` for TLS).

    A password missing from the URL comes from ``password``, ``$ROLLSTREAM_REDIS_PASSWORD`` or
    the file named by ``$ROLLSTREAM_REDIS_PASSWORD_FILE`` (so it stays out of ``ps``);
    ``$ROLLSTREAM_REDIS_USERNAME`` names the ACL user. ``?wait_replicas=N&wait_timeout_ms=T``
    (or the keyword options) make every script wait for ``N`` replicas (``WAIT N T``).
    """
    try:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL {redact_url(url)}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _PLAIN_SCHEMES + _SENTINEL_SCHEMES + _CLUSTER_SCHEMES:
        raise ConfigError(
            f"bad Redis URL {redact_url(url)}: scheme must be one of "
            f"{', '.join(_PLAIN_SCHEMES + _SENTINEL_SCHEMES + _CLUSTER_SCHEMES)}"
        )
    wait_replicas = _int_option(query, "wait_replicas", wait_replicas, url)
    wait_timeout_ms = _int_option(query, "wait_timeout_ms", wait_timeout_ms, url)
    if wait_replicas and not 1 <= (wait_timeout_ms or 1000) <= _MAX_WAIT_MS:
        raise ConfigError(
            f"bad Redis URL {redact_url(url)}: wait_timeout_ms must be 1..{_MAX_WAIT_MS} "
            "(0 would block forever; more would outlast the socket timeout and re-send the script)"
        )
    username, secret = _credentials(parts, password)
    socket_timeout = SOCKET_TIMEOUT if block_ms is None else block_ms / 1000 + SOCKET_TIMEOUT
    options: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": 5.0,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=2),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError, BusyLoadingError],
        "client_name": name,
        "decode_responses": False,
        "username": username,
        "password": secret,
    }
    logger.debug("connecting to %s as %s", redact_url(url), name or "(unnamed)")
    if scheme in _CLUSTER_SCHEMES:
        if wait_replicas:
            raise ConfigError("wait_replicas is not supported with redis+cluster URLs")
        return _cluster(parts, query, scheme.startswith("rediss"), options, url)
    redis_class: type[Redis] = Redis
    if wait_replicas:
        redis_class = type(
            "ReplicatedRedis", (_ReplicatedRedis,),
            {"wait_replicas": wait_replicas, "wait_timeout_ms": wait_timeout_ms or 1000},
        )
    if scheme in _SENTINEL_SCHEMES:
        return _sentinel(parts, query, scheme.startswith("rediss"), options, redis_class, url)
    plain_query = urlencode({k: v for k, v in query.items() if k not in _OWN_QUERY})
    netloc = parts.netloc.rpartition("@")[2]
    plain_url = _join_url(parts.scheme, netloc, parts.path, plain_query)
    try:
        pool = _BlockingPool.from_url(plain_url, health_check_interval=15, **_pool_options(options), **options)
    except ValueError as exc:
        raise ConfigError(f"bad Redis URL {redact_url(url)}: {exc}") from None
    return redis_class.from_pool(pool)


def _pool_options(options: dict[str, Any]) -> dict[str, Any]:
    """At most :data:`MAX_CONNECTIONS` per client; a command waits for a free one, as long as a
    command's own socket timeout at most (then ``ConnectionError``, an outage like any other)."""
    return {"max_connections": MAX_CONNECTIONS, "timeout": options["socket_timeout"]}


class _SentinelBlockingPool(SentinelConnectionPool, BlockingConnectionPool):
    """The Sentinel-managed pool (the master's address from the Sentinels) under the same bound,
    its connections reading under :class:`ReplyDeadline`."""

    connection_class: type[Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.connection_class = _stall_tolerant(self.connection_class)


def _int_option(query: dict[str, str], key: str, given: int | None, url: str) -> int | None:
    if key not in query:
        return given
    try:
        value = int(query[key])
    except ValueError:
        raise ConfigError(f"bad Redis URL {redact_url(url)}: {key} must be an integer") from None
    if value < 0:
        raise ConfigError(f"bad Redis URL {redact_url(url)}: {key} must be >= 0")
    return value


def _hosts(parts: SplitResult, default_port: int, url: str) -> list[tuple[str, int]]:
    hosts = []
    for item in parts.netloc.rpartition("@")[2].split(","):
        host, _, port = item.strip().rpartition(":") if item.count(":") == 1 or "]" in item else (item, "", "")
        host = host.strip("[]") or item.strip("[]")
        try:
            hosts.append((host, int(port) if port else default_port))
        except ValueError:
            raise ConfigError(f"bad Redis URL {redact_url(url)}: bad port in {item!r}") from None
    if not hosts or not all(h for h, _ in hosts):
        raise ConfigError(f"bad Redis URL {redact_url(url)}: no host")
    return hosts


def _tls_options(query: dict[str, str], tls: bool) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in query.items() if k.startswith("ssl_")}
    if "ssl_check_hostname" in out:
        out["ssl_check_hostname"] = out["ssl_check_hostname"].lower() in ("1", "true", "yes", "on")
    if tls:
        out["ssl"] = True
    return out


def _sentinel(parts: SplitResult, query: dict[str, str], tls: bool, options: dict[str, Any],
              redis_class: type[Redis], url: str) -> Redis:
    path = [p for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ConfigError(f"bad Redis URL {redact_url(url)}: expected redis+sentinel://HOSTS/SERVICE[/DB]")
    try:
        db = int(path[1]) if len(path) == 2 else int(query.get("db", 0))
    except ValueError:
        raise ConfigError(f"bad Redis URL {redact_url(url)}: the database must be an integer") from None
    tls_options = _tls_options(query, tls)
    sentinel_options: dict[str, Any] = {
        "socket_timeout": 2.0,
        "socket_connect_timeout": 2.0,
        "password": query.get("sentinel_password") or os.environ.get(SENTINEL_PASSWORD_ENV) or None,
        "username": query.get("sentinel_username"),
        **tls_options,
    }
    sentinel = Sentinel(
        _hosts(parts, 26379, url), sentinel_kwargs=sentinel_options,
        **{k: v for k, v in options.items() if k not in ("retry",)}, **tls_options,
    )
    client: Redis = sentinel.master_for(
        path[0], redis_class=redis_class, connection_pool_class=_SentinelBlockingPool, db=db,
        retry=options["retry"], health_check_interval=15, **_pool_options(options),
    )
    return client


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _ClusterPubSub(ClusterPubSub):
    """Two gaps of redis-py's cluster pub/sub, closed for the producer's control listener:

    * SUBSCRIBE is routed by the slots cache, which is empty until the client's first command:
      a client whose first use is ``pubsub()`` failed with ``KeyError: <slot>``; load it first;
    * a connection error here does not refresh the cache, so after a failover every new
      ``pubsub()`` picked the dead node again, forever; refresh it, then raise as before.
    """

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        await self.cluster.initialize()
        try:
            return await super().execute_command(*args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError):
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await self.cluster.nodes_manager.initialize()
            raise


class _Cluster(RedisCluster):
    """redis-py's cluster client with three gaps closed: pub/sub (above), XREAD's slot (below), and
    its pools, which hold 100 connections per node and raise ``MaxConnectionsError`` past them
    instead of waiting: at most :data:`MAX_CONNECTIONS` commands are in flight, the others wait."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_flight = asyncio.Semaphore(MAX_CONNECTIONS)
        # Every node's connections read under ReplyDeadline: the nodes known now, and those the
        # topology adds later (made from the shared connection options).
        options = self.nodes_manager.connection_kwargs
        options["connection_class"] = _stall_tolerant(options.get("connection_class", Connection))
        for node in self.nodes_manager.startup_nodes.values():
            node.connection_class = _stall_tolerant(node.connection_class)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            # the topology first, outside the bound: the first commands of a fresh client, run
            # at once under it, failed inside redis-py (a connection without a writer)
            await self.initialize()
        async with self._in_flight:
            return await super().execute_command(*args, **kwargs)

    def pubsub(self, node: Any = None, host: str | None = None, port: int | None = None,
               **kwargs: Any) -> ClusterPubSub:
        return _ClusterPubSub(self, node=node, host=host, port=port, **kwargs)

    async def _determine_slot(self, command: str, *args: Any) -> int:
        """XREAD and XREADGROUP have "movable keys": redis-py asks one fixed node (``COMMAND
        GETKEYS``) where their keys are, outside its failover handling, so once that node died
        every blocking read failed forever. Their key follows STREAMS: hash it here."""
        if _text(command).upper() in ("XREAD", "XREADGROUP"):
            words = [_text(a).upper() for a in args]
            if "STREAMS" in words and words.index("STREAMS") + 1 < len(args):
                return int(self.keyslot(args[words.index("STREAMS") + 1]))
        return int(await super()._determine_slot(command, *args))


def _cluster(parts: SplitResult, query: dict[str, str], tls: bool, options: dict[str, Any], url: str) -> Redis:
    nodes = [ClusterNode(host, port) for host, port in _hosts(parts, 6379, url)]
    cluster_options = {k: v for k, v in options.items() if k not in ("retry_on_error",)}
    client: Redis = _Cluster(startup_nodes=nodes, **cluster_options, **_tls_options(query, tls))
    return client


class Outage:
    """Tracks one component's view of Redis availability: bounded backoff, one log line each way.

    Two kinds of outage, tracked apart: Redis unreachable (ends at the next successful call) and
    Redis out of memory (``maxmemory`` reached: reads and some scripts still work, so it ends only
    when a call that was refused for memory succeeds: ``recovered(wrote=True)``)."""

    def __init__(self, logger: logging.Logger, what: str, *, max_delay: float = 2.0) -> None:
        self._logger = logger
        self._what = what
        self._backoff = Backoff(base=0.05, cap=max_delay)
        self._since: float | None = None
        self._oom_since: float | None = None
        self._attempt = 0
        self.count = 0
        self.oom_count = 0

    @property
    def out_of_memory(self) -> bool:
        """Whether a write was refused for memory and none has succeeded since."""
        return self._oom_since is not None

    async def failed(self, exc: BaseException) -> None:
        """Record a failure, log it if it starts an outage, and sleep the backoff."""
        if isinstance(exc, RedisOutOfMemory | OutOfMemoryError):
            if self._oom_since is None:
                self._oom_since = time.monotonic()
                self.oom_count += 1
                self._logger.warning(
                    "%s: Redis is out of memory (used_memory reached maxmemory; under maxmemory-policy "
                    "noeviction it refuses writes): %s; backing off until memory is freed (the trainer's "
                    "commits free it) or maxmemory is raised", self._what, exc,
                )
        elif self._since is None:
            self._since = time.monotonic()
            self.count += 1
            self._logger.warning("%s: lost Redis (%s: %s); reconnecting", self._what, type(exc).__name__, exc)
        self._attempt += 1
        await self._backoff.sleep(self._attempt)

    def recovered(self, *, wrote: bool = False) -> None:
        """A call succeeded; ``wrote``: one that had been refused for memory (ends that outage)."""
        if self._since is not None:
            self._logger.warning(
                "%s: Redis is back after %.1f s", self._what, time.monotonic() - self._since
            )
        self._since = None
        if wrote and self._oom_since is not None:
            self._logger.warning(
                "%s: Redis accepts writes again after %.1f s out of memory", self._what,
                time.monotonic() - self._oom_since,
            )
            self._oom_since = None
        if self._oom_since is None:
            self._attempt = 0

    async def run(self, step: Callable[[], Awaitable[T]], *, give_up_after: float | None = None) -> T:
        """Run ``step`` until it succeeds, riding out transient Redis errors (out of memory too).

        A cancellation of the calling task ends it with ``CancelledError`` and is never retried,
        also when redis-py lost it (the step returned) or turned it into a connection error
        (see :mod:`~rollstream.common.cancellation`)."""
        started = time.monotonic()
        refused = False
        mark = cancel_requests()
        while True:
            try:
                result = await step()
            except TRANSIENT_ERRORS as exc:
                raise_if_cancelled(mark, cause=exc)  # our cancellation, not an outage: never sent again
                if give_up_after is not None and time.monotonic() - started > give_up_after:
                    raise
                refused = refused or isinstance(exc, RedisOutOfMemory | OutOfMemoryError)
                await self.failed(exc)
                continue
            self.recovered(wrote=refused)
            raise_if_cancelled(mark)  # the step ran, but the caller's cancellation still arrives
            return result

    async def forever(
        self,
        turn: Callable[[], Awaitable[bool]],
        *,
        wrote: bool = False,
        on_error: Callable[[], None] | None = None,
    ) -> NoReturn:
        """The resilient loop step, for every long-running loop: run ``turn`` again and again
        (checking for a cancellation before each); a transient Redis error in a turn is
        recorded (one log line per outage), ``on_error`` runs, the backoff is slept and the next
        turn follows. A turn that returns True talked to Redis and succeeded: the outage ends
        (``wrote``: its writes too, see :meth:`recovered`); False: it had nothing to ask. A
        cancellation ends the loop as in :meth:`run`, one that came out as a Redis error too."""
        mark = cancel_requests()
        while True:
            raise_if_cancelled(mark)
            try:
                asked = await turn()
            except TRANSIENT_ERRORS as exc:
                raise_if_cancelled(mark, cause=exc)
                if on_error is not None:
                    on_error()
                await self.failed(exc)
                continue
            if asked:
                self.recovered(wrote=wrote)
