"""take() against raw redis-py: time and peak memory of one big batch (256 groups of 8 x 8k tokens),
and per-call latency of ``take(k)`` + ``commit`` for a few k on groups of 8 x 512 tokens.

Side by side, interleaved, on one Redis: ``GroupConsumer.take(256)`` + ``commit`` vs raw
``XREADGROUP COUNT 256`` + ``XACK`` + ``XDEL`` of the same entries (and raw + the same decoder),
each with redis-py's pure-Python reply parser and, when the ``hiredis`` package is installed,
with hiredis. Peak memory is measured with ``tracemalloc`` (Python allocations: every ``bytes``
object of the reply, the decoded arrays; not hiredis's own C read buffer) from just before the
call to its end, as a multiple of the batch's payload bytes (the ``data`` fields).

The second table (:func:`per_call`) is the trainer's steady state: many calls of ``take(k)`` +
``commit`` against ``XREADGROUP COUNT k`` + ``XACK`` + ``XDEL`` (with and without take()'s decoder),
alternated call by call on two streams filled ahead (the groups are waiting: no call blocks), in this process (its parser).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from rollstream.common.codec import decode_group_entry, group_fields
from rollstream.common.connection import connect
from rollstream.common.keys import TRAINER_GROUP
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis

from bench.common import ROOT, Table, init_ns, make_group, percentile

N = 8
PER_CALL_TOKENS = 512
PER_CALL = ((1, 200), (16, 60), (64, 30))
"""(k, calls) of the per-call table: enough calls for a p90, streams filled 10 calls at a time."""
ROUND = 10


async def _fill(redis: Redis, stream: str, fields: dict[Any, Any], count: int) -> None:
    for start in range(0, count, 16):
        async with redis.pipeline(transaction=False) as pipe:
            for i in range(start, min(count, start + 16)):
                pipe.xadd(stream, {**fields, "index": i})
            await pipe.execute()


async def _raw(reader: Redis, writer: Redis, stream: str, count: int, decode: bool) -> int:
    reply = await reader.xreadgroup(TRAINER_GROUP, "raw", {stream: ">"}, count=count, block=1000)
    entries = reply[0][1]
    ids = [eid for eid, _ in entries]
    if decode:
        groups = [decode_group_entry(fields, views=True) for _, fields in entries]
        assert len(groups) == count
    async with writer.pipeline(transaction=False) as pipe:
        pipe.xack(stream, TRAINER_GROUP, *ids)
        pipe.xdel(stream, *ids)
        await pipe.execute()
    return len(ids)


async def _measure(call: Callable[[], Awaitable[Any]], memory: bool) -> tuple[float, int]:
    """Seconds of one call, or (with ``memory``) its peak tracemalloc bytes above the start."""
    gc.collect()
    if not memory:
        started = time.perf_counter()
        await call()
        return time.perf_counter() - started, 0
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    result = await call()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    del result
    return 0.0, peak


async def measure(groups: int, tokens: int, repeat: int, r3: bool = False) -> dict[str, Any]:
    """Times (medians) and peaks of raw, raw+decode and take with this process's reply parser
    (``r3``: every sample with a 48 x 8 routing replay)."""
    fields: dict[Any, Any] = group_fields(make_group(N, tokens, r3=r3))
    times: dict[str, list[float]] = {"take": [], "raw": [], "raw+decode": []}
    peaks: dict[str, int] = {}
    with EmbeddedRedis() as server:
        writer = connect(server.url)
        reader = connect(server.url, block_ms=1000)
        ns = f"take-{time.monotonic_ns()}"
        keys = await init_ns(writer, ns, n_samples_per_prompt=N, batch_size=groups, max_backlog=4 * groups)
        raw_stream = f"{ns}-raw"
        await writer.xgroup_create(raw_stream, TRAINER_GROUP, id="0", mkstream=True)
        async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=60) as consumer:

            async def take() -> Any:
                batch = await consumer.take(groups)
                await consumer.commit(batch)
                return batch

            calls: dict[str, Callable[[], Awaitable[Any]]] = {
                "take": take,
                "raw": lambda: _raw(reader, writer, raw_stream, groups, False),
                "raw+decode": lambda: _raw(reader, writer, raw_stream, groups, True),
            }
            for round_ in range(repeat + 1):  # round 0 measures memory (tracemalloc slows everything)
                for name, call in calls.items():
                    await _fill(writer, keys.groups if name == "take" else raw_stream, fields, groups)
                    seconds, peak = await _measure(call, memory=round_ == 0)
                    if round_ == 0:
                        peaks[name] = peak
                    else:
                        times[name].append(seconds)
        await writer.aclose()
        await reader.aclose()
    return {"payload": len(fields["data"]) * groups, "peaks": peaks,
            "times": {k: statistics.median(v) for k, v in times.items()}}


async def per_call(plan: tuple[tuple[int, int], ...], tokens: int) -> list[dict[str, Any]]:
    """Per k: seconds of every ``take(k)`` + ``commit`` and of every raw read + XACK + XDEL."""
    fields: dict[Any, Any] = group_fields(make_group(N, tokens))
    out = []
    with EmbeddedRedis() as server:
        writer = connect(server.url)
        reader = connect(server.url, block_ms=1000)
        for k, calls in plan:
            ns = f"take-k{k}-{time.monotonic_ns()}"
            keys = await init_ns(writer, ns, n_samples_per_prompt=N, batch_size=k, max_backlog=ROUND * k)
            raw_stream = f"{ns}-raw"
            await writer.xgroup_create(raw_stream, TRAINER_GROUP, id="0", mkstream=True)
            times: dict[str, list[float]] = {"take": [], "raw": [], "raw+decode": []}
            async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=60) as consumer:

                async def take(k: int = k, consumer: GroupConsumer = consumer) -> Any:
                    await consumer.commit(await consumer.take(k))

                def raw(k: int = k, raw_stream: str = raw_stream) -> Awaitable[int]:
                    return _raw(reader, writer, raw_stream, k, False)

                def raw_decode(k: int = k, raw_stream: str = raw_stream) -> Awaitable[int]:
                    return _raw(reader, writer, raw_stream, k, True)

                done = 0
                while done < calls:
                    batch_calls = min(ROUND, calls - done)
                    await _fill(writer, keys.groups, fields, batch_calls * k)
                    await _fill(writer, raw_stream, fields, 2 * batch_calls * k)
                    gc.collect()
                    for _ in range(batch_calls):
                        for name, call in (("take", take), ("raw", raw), ("raw+decode", raw_decode)):
                            started = time.perf_counter()
                            await call()
                            times[name].append(time.perf_counter() - started)
                    done += batch_calls
            await writer.delete(keys.groups, raw_stream)
            out.append({"k": k, "calls": calls, "times": times})
        await writer.aclose()
        await reader.aclose()
    return out


def _per_call_table(quick: bool) -> Table:
    plan = ((1, 10), (4, 10)) if quick else PER_CALL
    tokens = 64 if quick else PER_CALL_TOKENS
    results = asyncio.run(per_call(plan, tokens))
    rows: list[list[Any]] = []
    for result in results:
        k, take_s, raw_s = result["k"], result["times"]["take"], result["times"]["raw"]
        decode_s = result["times"]["raw+decode"]
        take_rate, raw_rate = k * len(take_s) / sum(take_s), k * len(raw_s) / sum(raw_s)
        rows.append([k, result["calls"], statistics.median(take_s) * 1e3, percentile(take_s, 90) * 1e3,
                     statistics.median(raw_s) * 1e3, percentile(raw_s, 90) * 1e3, statistics.median(decode_s) * 1e3,
                     statistics.median(take_s) / statistics.median(raw_s), take_rate, raw_rate, take_rate / raw_rate])
    load = os.getloadavg()
    parser = "hiredis" if _hiredis_installed() else "python"
    return Table(
        "take_per_call",
        f"take(k) + commit vs raw XREADGROUP COUNT k + XACK + XDEL, per call ({N} x {tokens}-token groups)",
        ["k", "calls", "take ms (median)", "take ms (p90)", "raw ms (median)", "raw ms (p90)",
         "raw+decode ms (median)", "take / raw (median)", "take groups/s", "raw groups/s", "take / raw (groups/s)"],
        rows,
        [
            f"Groups of {N} samples x ({tokens} response + 64 prompt tokens) with log-probs; both streams filled "
            f"{ROUND} calls ahead, the calls alternated take, raw, raw+decode, take, ... (nothing waits for a group); reply "
            f"parser: {parser}; one embedded Redis, this process.",
            "take: GroupConsumer.take(k) (weight version, read, decode, checks) + commit (the ACK_DELETE script); "
            "raw: XREADGROUP COUNT k + one pipeline of XACK and XDEL (a trainer must delete too: XLEN is the backlog); "
            "raw+decode: the same plus take()'s decoder (codec.decode_group_entry, views) on every entry, alternated "
            "with the other two on the raw stream.",
            f"groups/s: k x calls / the calls' total time. Load average at the end: {load[0]:.2f} {load[1]:.2f} "
            f"{load[2]:.2f} (2 shared cores).",
        ],
        "python -m bench take",
    )


def _child(parser: str, groups: int, tokens: int, repeat: int, r3: bool = False) -> dict[str, Any]:
    """``measure`` in a fresh interpreter: redis-py picks its parser at import time."""
    env = {**os.environ, "BENCH_HIDE_HIREDIS": "1" if parser == "python" else ""}
    out = subprocess.run(
        [sys.executable, "-m", "bench.take_child", str(groups), str(tokens), str(repeat), "r3" if r3 else ""],
        cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=1800,
    ).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    if result.get("parser") != parser:
        raise RuntimeError(f"asked for the {parser} parser, the child ran {result.get('parser')}")
    return result


def _hiredis_installed() -> bool:
    try:
        import hiredis  # noqa: F401
    except ImportError:
        return False
    return True


def run(quick: bool = False) -> list[Table]:
    groups, tokens, repeat = (8, 256, 1) if quick else (256, 8192, 5)
    rows: list[list[Any]] = []
    payload_mb = 0.0
    for parser in ("python", "hiredis") if _hiredis_installed() else ("python",):
        result = _child(parser, groups, tokens, repeat)
        payload_mb = result["payload"] / 2**20
        raw = result["times"]["raw"]
        for name in ("raw", "raw+decode", "take"):
            peak = result["peaks"][name]
            rows.append([parser, name, result["times"][name] * 1e3, result["times"][name] / raw, peak / 2**20,
                         peak / result["payload"]])
    return [Table(
        "take",
        f"take({groups}) of {N} x {tokens}-token groups vs raw XREADGROUP + XACK + XDEL ({payload_mb:.0f} MB payload)",
        ["reply parser", "call", "ms (median)", "x raw", "peak MB (tracemalloc)", "peak / payload"],
        rows,
        [
            f"{groups} groups of {N} samples x ({tokens} response + 64 prompt tokens) with log-probs and loss masks; "
            f"median of {repeat} interleaved runs, each on a freshly filled stream.",
            "raw: XREADGROUP COUNT n (one reply) + pipelined XACK + XDEL; raw+decode: the same plus "
            "codec.decode_group_entry(views=True) of every entry (take()'s decoder); take: GroupConsumer.take(n) (weight version, read, decode, "
            "checks, metrics) + commit (Lua ACK_DELETE).",
            "Peak: tracemalloc peak during the call minus its start, over the payload bytes (the data fields); "
            "measured in a separate first round. The returned batch is included (its arrays are views on the "
            "reply's bytes). hiredis's own C read buffer is not seen by tracemalloc.",
        ],
        "python -m bench take",
    ), _per_call_table(quick)]
