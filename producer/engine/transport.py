"""HTTP to the engines: one connection pool, bounded reads, a total deadline per request.

:class:`~.http11.Http11Transport` (the default, in its own module) speaks HTTP/1.1 on
``asyncio.Protocol``: at 256 concurrent requests with 1k-token replies it costs about a third of
the CPU per request of ``aiohttp.ClientSession`` (``python -m bench.http_client http``;
docs/benchmarks.md). :class:`HttpxTransport` runs any ``httpx`` transport (tests pass
``httpx.MockTransport``) through the same bounds.

Every read is bounded: a 200 body by the caller's ``limit`` (a declared ``Content-Length``
over it fails at once, a streamed body as soon as it passes it: ``EngineReplyInvalid``
``too_large``), any other status by its first :data:`ERROR_BODY_BYTES` (kept for the error
message). Connection-level failures (refused, reset, a broken HTTP response) raise the builtin
``ConnectionError`` whatever the library (the client retries it); the deadline ``TimeoutError``.
Credentials in an engine URL (``user:password@``) travel as an ``Authorization`` header only, to
that origin: the URLs the client shows (logs, errors, the heartbeat) never hold them.
"""

from __future__ import annotations

import asyncio
import base64
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, TypeAlias
from urllib.parse import unquote, urlsplit, urlunsplit

from rollstream.common.errors import EngineReplyInvalid

if TYPE_CHECKING:
    import httpx

ERROR_BODY_BYTES = 65536
"""How much of a non-200 body is read (for the error message)."""
JSON = "application/json"


def split_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its ``user:password@``, and the ``Authorization`` header value they make
    (None when there are none)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    pair = f"{unquote(parts.username or '')}:{unquote(parts.password or '')}".encode()
    return bare, "Basic " + base64.b64encode(pair).decode("ascii")


def origin(url: str) -> str:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


class Transport(ABC):
    """One HTTP request at a time, bounded; subclasses bring the client library."""

    def __init__(self) -> None:
        self._credentials: dict[str, str] = {}

    def add_credentials(self, url: str, authorization: str) -> None:
        """Send ``authorization`` on every request to ``url``'s origin."""
        self._credentials[origin(url)] = authorization

    def _headers(self, url: str, body: bytes | None) -> dict[str, str]:
        headers = {"content-type": JSON} if body is not None else {}
        if self._credentials:
            auth = self._credentials.get(origin(url))
            if auth is not None:
                headers["authorization"] = auth
        return headers

    async def request(
        self, method: str, url: str, body: bytes | None = None, *, limit: int, seconds: float,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """The status and the body (see the module docstring for the bounds); ``TimeoutError``
        when the whole exchange takes more than ``seconds``. ``headers``: sent beside the fixed ones."""
        sent = self._headers(url, body)
        if headers:
            sent.update(headers)
        async with asyncio.timeout(seconds):  # in total, not per read
            return await self._request(method, url, body, sent, limit)

    @abstractmethod
    async def _request(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], limit: int
    ) -> tuple[int, bytes]: ...

    @abstractmethod
    async def aclose(self) -> None: ...


def too_large(url: str, detail: str) -> EngineReplyInvalid:
    return EngineReplyInvalid("too_large", detail, url)


async def read_bounded(chunks: AsyncIterator[bytes], status: int, limit: int, url: str) -> bytes:
    """A streamed body under the bound: a 200's ``limit`` (``too_large`` past it), any other
    status's first :data:`ERROR_BODY_BYTES` (the rest left unread)."""
    cap = limit if status == 200 else ERROR_BODY_BYTES
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        if size + len(chunk) > cap:
            if status != 200:
                parts.append(chunk[: cap - size])
                break
            raise too_large(url, f"more than {limit} bytes")
        size += len(chunk)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class HttpxTransport(Transport):
    """Any ``httpx`` transport (``httpx.MockTransport`` in tests) under the same bounds."""

    def __init__(self, transport: httpx.AsyncBaseTransport, *, connect_timeout: float) -> None:
        import httpx

        super().__init__()
        self._errors = httpx.TransportError
        self._http = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(None, connect=connect_timeout))

    async def _request(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], limit: int
    ) -> tuple[int, bytes]:
        try:
            async with self._http.stream(method, url, content=body, headers=headers) as response:
                status = response.status_code
                length = response.headers.get("content-length", "")
                if status == 200 and length.isdigit() and int(length) > limit:
                    raise too_large(url, f"Content-Length {length} > {limit} bytes")
                return status, await read_bounded(response.aiter_bytes(), status, limit, url)
        except self._errors as exc:
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self._http.aclose()


if TYPE_CHECKING:
    TransportArg: TypeAlias = "httpx.AsyncBaseTransport | Transport"
    """What ``EngineClient(transport=...)`` takes: a transport, or any httpx transport to run."""
