"""The engines' HTTP/1.1 transport (producer/engine/http11.py) against real servers: aiohttp's
for well-formed HTTP and TLS, a raw asyncio server for the framings and the breakages a general
client would hide (chunked, until-close, 1xx, a stale keep-alive, bytes past the body)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web
from rollstream.common.errors import EngineReplyInvalid
from rollstream.producer.engine.http11 import MAX_HEAD_BYTES, Http11Transport
from rollstream.producer.engine.transport import ERROR_BODY_BYTES

from tests.redis_nodes import make_certs

LIMIT = 1 << 20


def _transport(**kw: object) -> Http11Transport:
    return Http11Transport(max_connections=int(kw.pop("max_connections", 8)), connect_timeout=5.0, **kw)  # type: ignore[arg-type]


class AioServer:
    """An aiohttp server that records each request's client port (one per connection)."""

    def __init__(self) -> None:
        self.peers: list[int] = []
        self.in_flight = 0
        self.peak = 0
        self.crowd = 0
        self.crowded = asyncio.Event()
        """Set once ``crowd`` requests are in the handler at once."""
        self.gate = asyncio.Event()
        self.gate.set()
        self.disconnected = asyncio.Event()
        self.url = ""

    async def echo(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        if self.crowd and self.in_flight >= self.crowd:
            self.crowded.set()
        try:
            body = await request.read()
            await self.gate.wait()
        except asyncio.CancelledError:
            self.disconnected.set()
            raise
        finally:
            self.in_flight -= 1
        return web.Response(body=b"got " + body)

    async def auth(self, request: web.Request) -> web.Response:
        return web.Response(text=request.headers.get("authorization", "none"))

    async def chunked(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(status=int(request.query.get("status", "200")))
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(int(request.query["chunks"])):
            await response.write(b"x" * int(request.query["size"]))
        await response.write_eof()
        return response

    async def sized(self, request: web.Request) -> web.Response:
        return web.Response(status=int(request.query.get("status", "200")), body=b"y" * int(request.query["size"]))

    async def empty(self, _: web.Request) -> web.Response:
        return web.Response(status=204)


@pytest.fixture
async def aio() -> AsyncIterator[AioServer]:
    server = AioServer()
    app = web.Application()
    app.router.add_post("/echo", server.echo)
    app.router.add_get("/chunked", server.chunked)
    app.router.add_get("/sized", server.sized)
    app.router.add_get("/empty", server.empty)
    app.router.add_get("/auth", server.auth)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    yield server
    await runner.cleanup()


async def test_keep_alive_reuses_one_connection_and_posts_bodies_of_any_size(aio: AioServer) -> None:
    transport = _transport()
    try:
        for size in (0, 10, 1 << 20):
            status, body = await transport.request("POST", aio.url + "/echo", b"a" * size, limit=2 * LIMIT, seconds=30)
            assert status == 200 and body == b"got " + b"a" * size
    finally:
        await transport.aclose()
    assert len(set(aio.peers)) == 1, aio.peers


async def test_at_most_max_connections_exchanges_at_once(aio: AioServer) -> None:
    transport = _transport(max_connections=2)
    aio.gate.clear()
    aio.crowd = 2
    try:
        calls = [asyncio.create_task(transport.request("POST", aio.url + "/echo", b"%d" % i, limit=LIMIT, seconds=60))
                 for i in range(8)]
        async with asyncio.timeout(60):
            await aio.crowded.wait()
        assert aio.in_flight == 2 and not any(call.done() for call in calls)
        aio.gate.set()
        answers = await asyncio.gather(*calls)
    finally:
        await transport.aclose()
    assert sorted(body for _, body in answers) == sorted(b"got %d" % i for i in range(8))
    assert aio.peak == 2 and len(set(aio.peers)) == 2


async def test_chunked_answers_are_joined_and_bounded(aio: AioServer) -> None:
    transport = _transport()
    try:
        status, body = await transport.request("GET", aio.url + "/chunked?chunks=50&size=1000", limit=LIMIT, seconds=30)
        assert (status, body) == (200, b"x" * 50_000)
        with pytest.raises(EngineReplyInvalid, match="more than 4096 bytes") as info:
            await transport.request("GET", aio.url + "/chunked?chunks=50&size=1000", limit=4096, seconds=30)
        assert info.value.reason == "too_large"
        status, body = await transport.request(
            "GET", aio.url + "/chunked?chunks=100&size=1000&status=500", limit=LIMIT, seconds=30
        )
        assert status == 500 and body == b"x" * ERROR_BODY_BYTES  # an error keeps its first bytes
        status, body = await transport.request("GET", aio.url + "/chunked?chunks=1&size=3", limit=LIMIT, seconds=30)
        assert (status, body) == (200, b"xxx")  # the pool threw the truncated connection away
    finally:
        await transport.aclose()


async def test_declared_lengths_over_the_bound_fail_at_once_and_errors_are_truncated(aio: AioServer) -> None:
    transport = _transport()
    try:
        with pytest.raises(EngineReplyInvalid, match="Content-Length 5000 > 4096"):
            await transport.request("GET", aio.url + "/sized?size=5000", limit=4096, seconds=30)
        status, body = await transport.request("GET", aio.url + "/sized?size=200000&status=503", limit=10, seconds=30)
        assert status == 503 and body == b"y" * ERROR_BODY_BYTES
        assert await transport.request("GET", aio.url + "/empty", limit=10, seconds=30) == (204, b"")
        assert await transport.request("GET", aio.url + "/sized?size=0", limit=10, seconds=30) == (200, b"")
    finally:
        await transport.aclose()


async def test_credentials_travel_as_a_header_to_their_origin_only(aio: AioServer) -> None:
    transport = _transport()
    transport.add_credentials(aio.url, "Basic dTpw")
    try:
        assert await transport.request("GET", aio.url + "/auth", limit=LIMIT, seconds=30) == (200, b"Basic dTpw")
        other = aio.url.replace("127.0.0.1", "localhost")  # another origin, the same server
        assert await transport.request("GET", other + "/auth", limit=LIMIT, seconds=30) == (200, b"none")
    finally:
        await transport.aclose()


async def test_the_deadline_closes_the_connection_and_the_server_sees_it(aio: AioServer) -> None:
    transport = _transport()
    aio.gate.clear()
    try:
        with pytest.raises(TimeoutError):
            await transport.request("POST", aio.url + "/echo", b"slow", limit=LIMIT, seconds=0.5)
        async with asyncio.timeout(60):
            await aio.disconnected.wait()  # the engine is told: it can abort the generation
        aio.gate.set()
        assert await transport.request("POST", aio.url + "/echo", b"ok", limit=LIMIT, seconds=30) == (200, b"got ok")
    finally:
        await transport.aclose()
    assert len(set(aio.peers)) == 2  # the timed-out connection was not reused


async def test_refused_is_a_connection_error() -> None:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    transport = _transport()
    try:
        with pytest.raises(ConnectionError, match=r"127\.0\.0\.1"):
            await transport.request("GET", f"http://127.0.0.1:{port}/x", limit=10, seconds=30)
    finally:
        await transport.aclose()


# -- TLS --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def server_context(certs: dict[str, Path]) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs["server_cert"], certs["server_key"])
    return context


async def test_https_engines_are_verified(certs: dict[str, Path], server_context: ssl.SSLContext) -> None:
    server = AioServer()
    app = web.Application()
    app.router.add_post("/echo", server.echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_context)
    await site.start()
    url = f"https://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    trusting = _transport(ssl_context=ssl.create_default_context(cafile=str(certs["ca"])))
    default = _transport()  # the system's roots: the test CA is not among them
    try:
        assert await trusting.request("POST", url + "/echo", b"tls", limit=LIMIT, seconds=30) == (200, b"got tls")
        assert await trusting.request("POST", url + "/echo", b"again", limit=LIMIT, seconds=30) == (200, b"got again")
        with pytest.raises(ConnectionError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await default.request("POST", url + "/echo", b"tls", limit=LIMIT, seconds=30)
    finally:
        await trusting.aclose()
        await default.aclose()
        await runner.cleanup()
    assert len(set(server.peers)) == 1


# -- framings and breakages, on a raw server ----------------------------------------------------

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head


class RawServer:
    """Runs ``script(reader, writer, request_index_on_this_connection)`` for every request."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.heads: list[bytes] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self.transport: Http11Transport

    async def __aenter__(self) -> RawServer:
        self.transport = _transport()
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            index = 0
            try:
                while True:
                    try:
                        self.heads.append(await _read_request(reader))
                    except (asyncio.IncompleteReadError, ConnectionError):
                        return
                    await self.script(reader, writer, index)
                    if writer.is_closing():
                        return
                    index += 1
            finally:
                writer.close()

        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.transport.aclose()
        assert self._server is not None
        self._server.close()

    async def get(self, limit: int = LIMIT) -> tuple[int, bytes]:
        return await self.transport.request("GET", self.url + "/x", limit=limit, seconds=30)


async def test_until_close_and_http10_and_interim_answers() -> None:
    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.0 200 OK\r\n\r\nuntil ")
        await writer.drain()
        writer.write(b"the close")
        writer.close()

    async with RawServer(script) as server:
        assert await server.get() == (200, b"until the close")
        assert await server.get() == (200, b"until the close")
    assert server.connections == 2
    head = server.heads[0]
    assert head.startswith(b"GET /x HTTP/1.1\r\n") and b"\r\nAccept-Encoding: identity\r\n" in head


async def test_until_close_bodies_are_bounded_too() -> None:
    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + b"z" * 10_000)
        await writer.drain()
        writer.close()

    async with RawServer(script) as server:
        with pytest.raises(EngineReplyInvalid, match="more than 4096"):
            await server.get(limit=4096)


async def test_a_kept_alive_connection_closed_under_a_request_is_retried_once_on_a_new_one() -> None:
    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        if index == 1:  # the idle timeout raced the second request: closed, nothing answered
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with RawServer(script) as server:
        assert await server.get() == (200, b"ok")
        assert await server.get() == (200, b"ok")
    assert server.connections == 2 and len(server.heads) == 3


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "in the middle of its answer"),
        (b"", "before answering"),
        (b"SMTP ready\r\n\r\n", "Expected HTTP/"),
        (b"HTTP/1.1 2000 OK\r\n\r\n", "response status"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5x\r\n\r\n", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nok", "Content-Encoding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "Transfer-Encoding"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "chunk size"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX", "after chunk data"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "header token"),
        (b"HTTP/1.1 101 Switching Protocols\r\n\r\n", "101"),
        (b"HTTP/1.1 200 OK\r\nX: " + b"h" * MAX_HEAD_BYTES, "head over"),
    ],
)
async def test_broken_answers_are_connection_errors(answer: bytes, match: str) -> None:
    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(answer)
        await writer.drain()
        writer.close()

    async with RawServer(script) as server:
        with pytest.raises(ConnectionError, match=match):
            await server.get()


async def test_chunk_extensions_and_trailers_are_read_and_the_connection_kept() -> None:
    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n")
        await writer.drain()
        writer.write(b"2\r\nde\r\n0\r\nX-Trailer: t\r\n\r\n")
        await writer.drain()

    async with RawServer(script) as server:
        assert await server.get() == (200, b"abcde")
        assert await server.get() == (200, b"abcde")
    assert server.connections == 1


async def test_bytes_past_the_answer_or_connection_close_end_the_connection() -> None:
    answers = [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokJUNK", (200, b"ok")),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", (200, b"ok")),
        (b"HTTP/1.1 204 No Content\r\n\r\nJUNK", (204, b"")),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\nJUNK", (200, b"")),
    ]

    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        writer.write(answers[len(server.heads) - 1][0])
        await writer.drain()

    async with RawServer(script) as server:
        for _, expected in answers:
            assert await server.get() == expected
    assert server.connections == len(answers)  # none was reused: each answer ended its connection


async def test_a_cancelled_exchange_drops_its_connection() -> None:
    started = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        if index == 0 and len(server.heads) == 1:
            started.set()
            await reader.read()  # until the client goes away
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with RawServer(script) as server:
        call = asyncio.create_task(server.get())
        async with asyncio.timeout(60):
            await started.wait()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await server.get() == (200, b"ok")
    assert server.connections == 2


async def test_an_answer_arriving_a_byte_at_a_time_is_read_whole_and_the_connection_kept() -> None:
    """Every boundary falls inside a token (a header name, a chunk size, the CRLFs): the parser
    keeps what it has not seen the end of, and the connection serves the next request."""
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
              b"a\r\n{\"ids\": [1\r\n3\r\n, 2\r\n1\r\n]\r\n0\r\n\r\n")

    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> None:
        for byte in answer:
            writer.write(bytes([byte]))
            await writer.drain()

    async with RawServer(script) as server:
        assert await server.get() == (200, b'{"ids": [1, 2]')
        assert await server.get() == (200, b'{"ids": [1, 2]')
    assert server.connections == 1
