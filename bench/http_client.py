"""Client CPU per engine request, and reply parsing cost per reply.

Part 1 (``http``): a stub SGLang engine runs in a child process (so its CPU is not counted) and
answers every ``POST /generate`` after a fixed delay with one pre-encoded real-shaped reply
(``--tokens`` output ids with log-probs). The parent keeps ``--concurrency`` long-poll requests
in flight and reports *its own* process CPU time divided by the requests it completed: the cost
of the HTTP client alone (the body is read to bytes, not parsed). Clients:

* ``httpx``: ``httpx.AsyncClient`` with its default (httpcore) transport, as rollstream used;
* ``httpx-aiohttp``: ``httpx.AsyncClient`` over the ``httpx-aiohttp`` transport;
* ``aiohttp``: ``aiohttp.ClientSession`` directly;
* ``http11``: rollstream's own HTTP/1.1 transport (``producer/engine/http11.py``) alone;
* ``engine``: rollstream's ``EngineClient.generate`` (client + parsing + validation), on its
  default transport (``http11``);
* ``engine-aiohttp``: the same ``EngineClient`` on :class:`AiohttpTransport` below, the
  ``aiohttp.ClientSession`` transport it had before ``http11`` (kept here for the comparison);
* ``engine-httpx-aiohttp``: the same ``EngineClient`` given the ``httpx-aiohttp`` transport (it
  runs any ``httpx`` transport): the client as it was before it called aiohttp at all.

Part 2 (``parse``): µs to turn one reply's bytes into output ids and log-probs, stdlib ``json``
(then lists → arrays) against orjson and msgspec (straight into ``array('i')``/``array('f')``).

Usage::

    python -m bench.http_client http --concurrency 16 256 --tokens 1024 8192
    python -m bench.http_client parse --tokens 1024 8192
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import socket
import time
from array import array
from collections.abc import Callable
from typing import Any

import aiohttp
from rollstream.producer.engine.transport import ERROR_BODY_BYTES, Transport, read_bounded, too_large

CLIENTS = ("httpx", "httpx-aiohttp", "aiohttp", "http11", "engine", "engine-aiohttp", "engine-httpx-aiohttp")


def sglang_reply(tokens: int, *, logprobs: bool = True, seed: int = 0) -> dict[str, Any]:
    """A real-shaped SGLang ``/generate`` reply of ``tokens`` output tokens."""
    rng = random.Random(seed)
    ids = [rng.randrange(151_000) for _ in range(tokens)]
    meta: dict[str, Any] = {
        "id": "6f1c0c5e2b4a4f0f9d2b8a7e3c1d0e9f",
        "finish_reason": {"type": "length", "length": tokens},
        "prompt_tokens": 97,
        "completion_tokens": tokens,
        "cached_tokens": 64,
        "weight_version": "3",
        "e2e_latency": 12.5,
    }
    if logprobs:
        meta["output_token_logprobs"] = [[-rng.random() * 4, t, None] for t in ids]
    return {"text": " word" * tokens, "output_ids": ids, "meta_info": meta}


def completions_reply(tokens: int, n: int, *, seed: int = 0) -> dict[str, Any]:
    """A vLLM ``/v1/completions`` reply with ``return_tokens_as_token_ids`` and ``return_token_ids``."""
    rng = random.Random(seed)
    choices = []
    for index in range(n):
        ids = [rng.randrange(151_000) for _ in range(tokens)]
        choices.append(
            {
                "index": index,
                "text": " word" * tokens,
                "logprobs": {
                    "tokens": [f"token_id:{t}" for t in ids],
                    "token_logprobs": [-rng.random() * 4 for _ in ids],
                    "top_logprobs": None,
                    "text_offset": list(range(tokens)),
                },
                "finish_reason": "length",
                "token_ids": ids,
                "prompt_token_ids": None,
            }
        )
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices, "prompt_token_ids": [1, 2]}


# -- part 1: HTTP client CPU ----------------------------------------------------------------


class AiohttpTransport(Transport):
    """The engine client's transport before ``http11``: ``aiohttp.ClientSession``, created on
    first use, under the same bounds (the ``engine-aiohttp`` row)."""

    def __init__(self, *, max_connections: int, connect_timeout: float) -> None:
        super().__init__()
        self._max_connections = max_connections
        self._connect_timeout = connect_timeout
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout),
            cookie_jar=aiohttp.DummyCookieJar(),  # engines set none; an engine's cookies are not kept
            raise_for_status=False,
        )
        return self._session

    async def _request(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], limit: int
    ) -> tuple[int, bytes]:
        session = self._session or self._open()
        try:
            async with session.request(method, url, data=body, headers=headers, allow_redirects=False) as response:
                status = response.status
                cap = limit if status == 200 else ERROR_BODY_BYTES
                length = response.content_length
                if length is not None and length > cap and status == 200:
                    raise too_large(url, f"Content-Length {length} > {limit} bytes")
                if length is not None and length <= cap and "content-encoding" not in response.headers:
                    return status, await response.read()  # declared and within the bound
                return status, await read_bounded(response.content.iter_any(), status, limit, url)
        except aiohttp.ClientError as exc:  # before TimeoutError: a connect timeout is both
            raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None




def _serve(port: int, body: bytes, delay: float, ready: Any) -> None:
    from aiohttp import web

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(delay)
        return web.Response(body=body, content_type="application/json")

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": "3"})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/model_info", model_info)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


REQUEST = {"input_ids": list(range(100)), "sampling_params": {"max_new_tokens": 1024}, "return_logprob": True}


async def _drive(call: Callable[[], Any], concurrency: int, requests: int) -> tuple[float, float]:
    """Run ``requests`` calls with ``concurrency`` in flight; (CPU seconds, wall seconds)."""
    remaining = requests

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await call()

    for _ in range(min(concurrency, 8)):  # warm up connections and imports
        await call()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(concurrency))), 600)
    return time.process_time() - cpu0, time.perf_counter() - wall0


async def _measure(client: str, url: str, concurrency: int, requests: int) -> tuple[float, float]:
    import httpx

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    timeout = httpx.Timeout(600.0, connect=5.0)
    if client in ("httpx", "httpx-aiohttp"):
        transport = None
        if client == "httpx-aiohttp":
            from httpx_aiohttp import AiohttpTransport as HttpxAiohttp

            transport = HttpxAiohttp(limits=limits)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as http:

            async def call() -> None:
                response = await http.post(url + "/generate", json=REQUEST)
                assert response.status_code == 200 and response.content

            return await _drive(call, concurrency, requests)
    if client == "aiohttp":
        import aiohttp

        connector = aiohttp.TCPConnector(limit=1024)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:

            async def call() -> None:
                async with session.post(url + "/generate", json=REQUEST) as response:
                    assert response.status == 200 and await response.read()

            return await _drive(call, concurrency, requests)
    from rollstream.producer.engine import EngineClient, EngineSettings

    if client == "http11":
        from rollstream.producer.engine.http11 import Http11Transport

        own = Http11Transport(max_connections=1024, connect_timeout=5.0)
        content = json.dumps(REQUEST).encode()

        async def call() -> None:
            status, body = await own.request("POST", url + "/generate", content, limit=1 << 24, seconds=600)
            assert status == 200 and body

        try:
            return await _drive(call, concurrency, requests)
        finally:
            await own.aclose()
    engine_transport: Any = None
    if client == "engine-aiohttp":
        engine_transport = AiohttpTransport(max_connections=1024, connect_timeout=5.0)
    if client == "engine-httpx-aiohttp":
        from httpx_aiohttp import AiohttpTransport as HttpxAiohttpTransport

        engine_transport = HttpxAiohttpTransport(limits=limits)
    async with EngineClient(EngineSettings(urls=(url,), max_connections=1024), transport=engine_transport) as engine:

        async def call() -> None:
            generation = await engine.generate(input_ids=REQUEST["input_ids"])
            assert len(generation.output_ids) > 0

        return await _drive(call, concurrency, requests)


def run_http(args: argparse.Namespace) -> None:
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for tokens in args.tokens:
        body = json.dumps(sglang_reply(tokens)).encode()
        for concurrency in args.concurrency:
            delay = concurrency / args.rate  # keeps the stub at about --rate replies/s
            port = _free_port()
            ready = ctx.Event()
            server = ctx.Process(target=_serve, args=(port, body, delay, ready), daemon=True)
            server.start()
            try:
                if not ready.wait(30):
                    raise RuntimeError("the stub engine did not start")
                url = f"http://127.0.0.1:{port}"
                requests = max(args.requests, concurrency * 3)
                for client in args.clients:
                    results = [asyncio.run(_measure(client, url, concurrency, requests)) for _ in range(args.repeat)]
                    cpu, wall = sorted(results)[len(results) // 2]
                    rows.append((client, concurrency, tokens, len(body), cpu / requests * 1e3, requests / wall))
                    print(
                        f"{client:14} c={concurrency:4} tokens={tokens:5} {cpu / requests * 1e3:7.3f} ms/req",
                        flush=True,
                    )
            finally:
                server.kill()
                server.join(5)
    print()
    print("| client | concurrency | reply tokens | reply bytes | client CPU ms/request | requests/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for client, concurrency, tokens, size, ms, rps in rows:
        print(f"| {client} | {concurrency} | {tokens} | {size:,} | {ms:.3f} | {rps:.0f} |")
    engine_rows = [row for row in rows if row[0] == "engine"]
    if engine_rows:
        print()
        print(
            f"| EngineClient.generate | tokens/s one core ingests | engines one core serves at {args.engine_rate:,.0f} tok/s |"
        )
        print("|---|---:|---:|")
        for _, concurrency, tokens, _, ms, _ in engine_rows:
            per_core = tokens / (ms / 1e3)
            print(
                f"| {concurrency} concurrent, {tokens}-token replies | {per_core:,.0f} | {per_core / args.engine_rate:.0f} |"
            )


# -- part 2: reply parsing --------------------------------------------------------------------


def _stdlib(raw: bytes) -> tuple[array[int], array[float]]:
    reply = json.loads(raw)
    pairs = reply["meta_info"]["output_token_logprobs"]
    return array("i", reply["output_ids"]), array("f", [float(p[0]) for p in pairs])


def _orjson_arrays(raw: bytes) -> tuple[array[int], array[float]]:
    import orjson

    reply = orjson.loads(raw)
    pairs = reply["meta_info"]["output_token_logprobs"]
    return array("i", reply["output_ids"]), array("f", [p[0] for p in pairs])


def _bench(fn: Callable[[bytes], Any], raw: bytes, seconds: float = 0.5) -> float:
    fn(raw)
    count, start = 0, time.perf_counter()
    cpu0 = time.process_time()
    while time.perf_counter() - start < seconds:
        fn(raw)
        count += 1
    return (time.process_time() - cpu0) / count * 1e6


def run_parse(args: argparse.Namespace) -> None:
    import msgspec
    import orjson
    from rollstream.producer.engine import sglang as replies

    decoders: dict[str, Callable[[bytes], Any]] = {
        "stdlib json + lists -> arrays": _stdlib,
        "orjson.loads only": orjson.loads,
        "orjson + arrays, no validation": _orjson_arrays,
        "msgspec.json.decode only": msgspec.json.decode,
        "rollstream parse_sglang (chosen)": lambda raw: replies.parse_sglang(raw, want_logprobs=True),
    }
    print("| reply | decoder | µs/reply (median of 3) |")
    print("|---|---|---:|")
    for tokens in args.tokens:
        for logprobs in (True, False):
            raw = json.dumps(sglang_reply(tokens, logprobs=logprobs)).encode()
            for name, fn in decoders.items():
                if not logprobs and name.startswith("stdlib"):
                    fn = lambda raw: array("i", json.loads(raw)["output_ids"])  # noqa: E731
                if not logprobs and name.startswith("orjson +"):
                    fn = lambda raw: array("i", orjson.loads(raw)["output_ids"])  # noqa: E731
                if not logprobs and name.startswith("rollstream"):
                    fn = lambda raw: replies.parse_sglang(raw, want_logprobs=False)  # noqa: E731
                us = sorted(_bench(fn, raw) for _ in range(3))[1]
                shape = f"/generate {tokens} tokens{' + log-probs' if logprobs else ''}"
                print(f"| {shape} | {name} | {us:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    http = sub.add_parser("http", help="client CPU per request against a stub engine")
    http.add_argument("--clients", nargs="+", choices=CLIENTS, default=list(CLIENTS))
    http.add_argument("--concurrency", nargs="+", type=int, default=[16, 256])
    http.add_argument("--tokens", nargs="+", type=int, default=[1024])
    http.add_argument("--requests", type=int, default=800, help="requests per measurement (at least 3 x concurrency)")
    http.add_argument("--rate", type=float, default=250.0, help="stub replies per second (sets its delay)")
    http.add_argument("--repeat", type=int, default=1, help="runs per cell; the median is kept")
    http.add_argument("--engine-rate", type=float, default=16_000.0, help="output tokens/s of one engine")
    parse = sub.add_parser("parse", help="µs per reply, bytes to arrays")
    parse.add_argument("--tokens", nargs="+", type=int, default=[1024, 8192])
    args = parser.parse_args()
    if args.part == "http":
        run_http(args)
    else:
        run_parse(args)


if __name__ == "__main__":
    main()
