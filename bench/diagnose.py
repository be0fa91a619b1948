"""A waiting take()'s diagnosis: one pipelined read vs the seven sequential reads it replaced.

``python -m bench [--quick] diagnose``. Side by side, interleaved, on one Redis: the stall check
plus health summary of a ``take()`` that waits, as ``TrainerMonitor.diagnose()`` (one pipeline)
and as the reads the consumer made before it (heartbeats; the group stream's length and pending
count; heartbeats again; the state hash; the stream lengths; the admission terms; the newest
events: seven round trips, in sequence). Directly on the server (loopback), and through a local
TCP proxy that holds every chunk 0.5 ms each way (at least a 1 ms round trip, more with the event
loop's timer granularity: a stand-in for a trainer on another host), which is where round trips
cost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

from redis.asyncio import Redis
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import connect
from rollstream.common.events import FATAL, recent_events, record_event
from rollstream.common.keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys
from rollstream.common.namespace import read_state
from rollstream.common.protocol import Heartbeat, Heartbeats, TrainerMonitor
from rollstream.runtime.redis_server import EmbeddedRedis

from bench.common import Table, init_ns

DELAY_S = 0.0005
"""The proxy's hold on every chunk, each way."""


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    with suppress(ConnectionError):
        while chunk := await reader.read(65536):
            await asyncio.sleep(delay)
            writer.write(chunk)
            await writer.drain()
    writer.close()


async def _proxy(host: str, port: int, delay: float) -> asyncio.Server:
    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(host, port)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(_pipe(client_r, server_w, delay))
            tg.create_task(_pipe(server_r, client_w, delay))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _before(redis: Redis, keys: Keys, config: Any, monitor: TrainerMonitor) -> None:
    """The consumer's reads before ``diagnose()``: ``_stall_due`` then ``_health``."""
    await Heartbeats(redis, keys).raw()
    async with redis.pipeline(transaction=False) as pipe:  # waiting_groups
        pipe.xlen(keys.groups)
        pipe.xpending(keys.groups, TRAINER_GROUP)
        await pipe.execute()
    await Heartbeats(redis, keys).raw()
    await read_state(redis, keys)
    async with redis.pipeline(transaction=False) as pipe:  # stream_lengths
        pipe.xlen(keys.groups)
        pipe.xlen(keys.prompts)
        pipe.xlen(keys.retry)
        await pipe.execute()
    await monitor.admission_terms(config)
    await recent_events(redis, keys, count=1, kind=FATAL)


async def _time(call: Callable[[], Awaitable[Any]], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        started = time.perf_counter()
        await call()
        out.append((time.perf_counter() - started) * 1000)
    return out


async def _measure(quick: bool) -> Table:
    rounds = 200 if quick else 2000
    rows: list[list[Any]] = []
    with EmbeddedRedis() as server:
        admin = connect(server.url)
        ns = "bench-diagnose"
        config = PipelineConfig(n_samples_per_prompt=8, batch_size=32, max_staleness=1)
        keys = await init_ns(admin, ns, **dataclasses.asdict(config))
        for i in range(4):
            beat = Heartbeat(host="h", pid=i, state="running", last_seen_ms=int(time.time() * 1000))
            await Heartbeats(admin, keys).write(f"p{i}", beat)
        for i in range(50):
            await record_event(admin, keys, "warning", source="p0", message=f"w{i}")
        await admin.xadd(keys.prompts, {"data": b"x"})
        await admin.xreadgroup(PRODUCERS_GROUP, "p0", {keys.prompts: ">"}, count=1)
        host, port = server.url.removeprefix("redis://").split("/")[0].split(":")
        proxy = await _proxy(host, int(port), DELAY_S)
        proxied = f"redis://127.0.0.1:{proxy.sockets[0].getsockname()[1]}/0"
        try:
            for label, url in (("loopback", server.url), ("proxy, 0.5 ms hold each way", proxied)):
                redis = connect(url)
                monitor = TrainerMonitor(redis, keys)
                await monitor.diagnose(config)  # the guard's first call reads the run_id
                n = rounds if url == server.url else max(50, rounds // 10)
                before: list[float] = []
                after: list[float] = []
                for _ in range(5):  # interleaved
                    before += await _time(lambda r=redis, m=monitor: _before(r, keys, config, m), n // 5)
                    after += await _time(lambda m=monitor: m.diagnose(config), n // 5)
                b, a = statistics.median(before), statistics.median(after)
                rows.append([label, 7, f"{b:.3f}", 1, f"{a:.3f}", f"{b / a:.1f}x"])
                await redis.aclose()
        finally:
            proxy.close()
            await admin.aclose()
    return Table(
        "diagnose", "A waiting take()'s diagnosis: one pipelined read vs seven sequential reads",
        ["link", "round trips before", "median ms before", "round trips now", "median ms now", "speed-up"],
        rows,
        [f"{rounds} rounds on loopback, {max(50, rounds // 10)} through the proxy, interleaved in 5 blocks; "
         "4 heartbeats, 50 events, the state hash of a fresh namespace"],
        command="python -m bench.diagnose" + (" --quick" if quick else ""),
    )


def run(quick: bool = False) -> list[Table]:
    return [asyncio.run(_measure(quick))]


if __name__ == "__main__":
    for table in run(quick="--quick" in sys.argv):
        print(table.markdown())
