"""The engines' HTTP/1.1, on ``asyncio.Protocol``: keep-alive connections and nothing else.

The producer spends most of its CPU on engine replies, and a general client's generality costs:
``aiohttp.ClientSession`` takes about 2.3x this module's CPU per 1k-token reply at 256 in flight
(``python -m bench.http_client http``, docs/benchmarks.md). What the engine client needs is
narrow: ``POST`` JSON, ``GET`` model info, to a few origins, each answer read whole into bytes
under a bound. That is all this module does:

* one pool of keep-alive connections per origin (``http`` or ``https``), at most
  ``max_connections`` exchanges at once over all origins (more wait), an idle connection evicted
  when a new origin needs room;
* the answer is parsed by llhttp (``httptools``, the parser uvicorn and Node use), not by hand:
  replies with a ``Content-Length``, ``chunked``, or (HTTP/1.0 style) up to the close; ``1xx``
  interim answers skipped; ``Accept-Encoding: identity`` is sent and any other coding refused.
  Measured against the hand-written parser it replaced, under this same pool (``python -m
  bench.http_client http``, docs/benchmarks.md): within 5 % of its CPU per request for the
  transport alone and within 2 % for ``EngineClient.generate``, 1k and 8k-token replies;
* the bound checked while reading (``EngineReplyInvalid`` ``too_large`` for a 200; other
  statuses keep their first :data:`~.transport.ERROR_BODY_BYTES`), heads of at most
  :data:`MAX_HEAD_BYTES`;
* a broken answer (what llhttp refuses, a close mid-body, refused, reset, TLS) is the builtin
  ``ConnectionError`` (the engine client retries it); a connect over ``connect_timeout`` too;
* a reused connection the server closed before answering a byte (its idle timeout raced our
  request: uvicorn closes idle connections after 5 s) is retried once at once on a new one;
* a cancelled or timed-out exchange closes its connection (the engine sees the disconnect).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import cast
from urllib.parse import urlsplit

import httptools
from rollstream.common.errors import EngineReplyInvalid

from .transport import ERROR_BODY_BYTES, Transport, too_large

MAX_HEAD_BYTES = 65536
"""Longest response head (status line and headers) accepted."""

_HEAD, _BODY, _UNTIL_CLOSE, _IDLE = range(4)
_PARSER_ERRORS = (httptools.HttpParserError, httptools.HttpParserUpgrade)  # the callback error is a parser error


class _Broken(Exception):
    """The answer does not follow HTTP/1.1; becomes ``ConnectionError``."""


class _Stale(ConnectionError):
    """A reused connection closed before any byte of the answer."""


class _Done(Exception):
    """Stops llhttp from a callback: the answer is settled, what follows is not read."""


class _Target:
    """One URL: its pool key, its request line and fixed headers, encoded once."""

    __slots__ = ("_fixed", "host", "key", "port", "prefixes", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.tls = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.tls else 80)
        self.key = (self.tls, self.host.lower(), self.port)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._fixed = f"{path} HTTP/1.1\r\nHost: {parts.netloc.rpartition('@')[2]}\r\nAccept-Encoding: identity\r\n"
        self.prefixes: dict[str, bytes] = {}

    def prefix(self, method: str) -> bytes:
        """The request line and the fixed headers for ``method``."""
        line = self.prefixes.get(method)
        if line is None:
            line = self.prefixes[method] = f"{method} {self._fixed}".encode("latin-1")
        return line


class _Connection(asyncio.Protocol):
    """One keep-alive connection: writes a request; llhttp reads the answer into ``(status, body)``
    through the ``on_*`` callbacks below."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.used = False
        self._parser = httptools.HttpResponseParser(self)
        self._state = _IDLE
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._cap = 0
        self._limit = 0
        self._status = 0
        self._head = 0
        self._length: int | None = None
        self._chunked = False
        self._keep = True
        self._got_bytes = False
        self._url = ""

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream transport: create_connection's

    def data_received(self, data: bytes) -> None:
        if self._state == _IDLE:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self._got_bytes = True
        try:
            self._feed(data)
        except _Broken as exc:
            self._fail(ConnectionError(f"broken HTTP answer from {self._url}: {exc}"))
        except EngineReplyInvalid as exc:  # too_large
            self._fail(exc)

    def eof_received(self) -> bool:
        return False  # close; connection_lost settles the exchange

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._state == _UNTIL_CLOSE:
            self._finish()
        elif not self._got_bytes and self.used:
            waiter.set_exception(_Stale(f"{self._url}: the server closed a kept-alive connection"))
        else:
            where = "before answering" if not self._got_bytes else "in the middle of its answer"
            reason = f" ({exc})" if exc is not None else ""
            waiter.set_exception(ConnectionError(f"{self._url}: the server closed the connection {where}{reason}"))

    # -- the exchange ---------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, head: bytes, body: bytes | None, limit: int, url: str) -> tuple[int, bytes]:
        """Send one request and wait for its whole answer; the connection stays usable only when
        the answer allows it (:attr:`reusable`)."""
        transport = self.transport
        if transport is None or self.closed or transport.is_closing():
            raise _Stale(f"{url}: the kept-alive connection was closed")
        waiter = asyncio.get_running_loop().create_future()
        self._waiter, self._url, self._limit = waiter, url, limit
        self._state, self._got_bytes, self._keep, self._head = _HEAD, False, True, 0
        if body is None:
            transport.write(head)
        else:
            transport.writelines((head, body))
        try:
            return await waiter
        finally:
            self._waiter = None
            self.used = True

    @property
    def reusable(self) -> bool:
        return self._keep and not self.closed and self._state == _IDLE

    def _fail(self, exc: BaseException) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def _finish(self) -> None:
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks, self._state = [], _IDLE
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, body))

    def _feed(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except _PARSER_ERRORS as exc:
            cause = exc.__context__  # what a callback raised
            if isinstance(cause, _Done):
                return
            if isinstance(cause, _Broken | EngineReplyInvalid):
                raise cause from None
            if isinstance(exc, httptools.HttpParserUpgrade):
                raise _Broken("101 Switching Protocols was not asked for") from None
            raise _Broken(str(exc) or type(exc).__name__) from None
        if self._state == _HEAD:  # llhttp holds a header it has not seen the end of: bound it here
            self._head += len(data)
            if self._head > MAX_HEAD_BYTES:
                raise _Broken(f"a response head over {MAX_HEAD_BYTES} bytes")

    # -- llhttp's callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._state == _IDLE:  # a second answer in the same read: nothing was pipelined
            self._keep = False
            raise _Done
        self._length, self._chunked = None, False

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"content-length":
            self._length = int(value)  # llhttp checked the digits and that duplicates agree
        elif name == b"transfer-encoding":
            if [c.strip() for c in value.lower().split(b",")] != [b"chunked"]:
                raise _Broken(f"Transfer-Encoding {bytes(value[:40])!r} (only chunked is read)")
            self._chunked = True
        elif name == b"content-encoding" and value.strip().lower() not in (b"", b"identity"):
            raise _Broken(f"Content-Encoding {bytes(value[:40])!r} although identity was asked for")

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        self._status, self._head = status, 0
        if 100 <= status < 200:
            if status == 101:
                raise _Broken("101 Switching Protocols was not asked for")
            return  # an interim answer (103 Early Hints): llhttp completes it, the real head follows
        self._keep = self._parser.should_keep_alive()
        self._cap = self._limit if status == 200 else ERROR_BODY_BYTES
        self._chunks, self._size = [], 0
        length = self._length
        if length is not None and length > self._cap and status == 200:
            raise too_large(self._url, f"Content-Length {length} > {self._limit} bytes")
        if status in (204, 304) or self._chunked or length is not None:
            self._state = _BODY
        else:
            self._state, self._keep = _UNTIL_CLOSE, False

    def on_body(self, body: bytes) -> None:
        size = self._size + len(body)
        if size > self._cap:
            if self._status == 200:
                raise too_large(self._url, f"more than {self._limit} bytes")
            self._chunks.append(body[: self._cap - self._size])  # an error's first bytes are enough
            self._keep = False
            self._finish()
            self.close()
            raise _Done
        self._size = size
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        if 100 <= self._status < 200:
            self._state = _HEAD
            return
        self._finish()


class Http11Transport(Transport):
    """Keep-alive HTTP/1.1 to the engines (the engine client's default transport)."""


    def __init__(
        self, *, max_connections: int, connect_timeout: float, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        super().__init__()
        self._max_connections = max_connections
        self._connect_timeout = connect_timeout
        self._ssl_context = ssl_context
        self._slots: asyncio.Semaphore | None = None
        self._idle: dict[tuple[bool, str, int], deque[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._targets: dict[str, _Target] = {}

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= 4096:  # URLs are a few paths per engine; never grows unbounded
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        return target

    async def _request(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], limit: int
    ) -> tuple[int, bytes]:
        target = self._target(url)
        lines = [target.prefix(method)]
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body) if body is not None else b"\r\n")
        head = b"".join(lines)
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._max_connections)
        async with self._slots:
            connection = await self._checkout(target, url)
            try:
                answer = await connection.exchange(head, body, limit, url)
            except _Stale:
                self._drop(connection)
                # A reused connection: the server's idle close raced the request. Once more, on a new one.
                connection = await self._connect(target, url)
                try:
                    answer = await connection.exchange(head, body, limit, url)
                except BaseException:
                    self._drop(connection)
                    raise
            except BaseException:
                self._drop(connection)
                raise
            if connection.reusable:
                self._idle.setdefault(target.key, deque()).append(connection)
            else:
                self._drop(connection)
            return answer

    async def _checkout(self, target: _Target, url: str) -> _Connection:
        idle = self._idle.get(target.key)
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be closed
            if not connection.closed and connection.transport is not None and not connection.transport.is_closing():
                return connection
            self._drop(connection)
        return await self._connect(target, url)

    def _evict(self) -> None:
        """Close idle connections of any origin, the oldest first, until a new one fits (the
        slots guarantee enough are idle)."""
        for pool in self._idle.values():
            while pool and len(self._open) >= self._max_connections:
                self._drop(pool.popleft())

    async def _connect(self, target: _Target, url: str) -> _Connection:
        if len(self._open) >= self._max_connections:
            self._evict()
        loop = asyncio.get_running_loop()
        context: ssl.SSLContext | None = None
        if target.tls:
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()
            context = self._ssl_context
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, connection = await loop.create_connection(
                    _Connection,
                    target.host,
                    target.port,
                    ssl=context,
                    server_hostname=target.host if context is not None else None,
                )
        except TimeoutError:
            raise ConnectionError(f"{url}: no connection within {self._connect_timeout:g} s") from None
        except OSError as exc:  # refused, unreachable, unknown host, TLS (ssl.SSLError is an OSError)
            raise ConnectionError(f"{url}: {type(exc).__name__}: {exc}") from exc
        self._open.add(connection)
        return connection

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        self._open.discard(connection)

    async def aclose(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()
