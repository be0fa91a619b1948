"""Throughput ceiling: rollstream vs raw redis-py vs the in-process asyncio.Queue design.

All move groups of 8 x ``tokens`` response tokens (plus 64 prompt ids) with log-probs to one
trainer taking batches of 64. rollstream's producers run on the *fake engine* (the in-process
``httpx.MockTransport`` double of bench.common, which answers a precomputed SGLang JSON reply:
HTTP client + reply parsing included) or on *no engine* (``bench.common.NoEngine``: a prebuilt
reply returned at once, so only the pipeline's own work is left). The raw baseline XADDs the
same encoded bytes, and its trainer reads them with or without the same decoder as take().
"""

from __future__ import annotations

import asyncio
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import Redis
from rollstream.common.codec import decode_group_entry, encode_group
from rollstream.common.connection import connect
from rollstream.common.models import Group, Sample
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.runtime.redis_server import EmbeddedRedis

from bench.common import (
    OUT,
    ConstReward,
    Table,
    add_prompts,
    bench_prompt,
    children,
    consume,
    cpu_seconds,
    init_ns,
    instant_transport,
    make_group,
    spawn,
)

BATCH = 64
N = 8


@dataclass
class Result:
    groups: int
    seconds: float
    cpu: dict[str, float]

    @property
    def rate(self) -> float:
        return self.groups / self.seconds



async def rollstream_run(
    server: EmbeddedRedis, producers: int, batches: int, tokens: int, *, engine: str = "",
    profile: Path | None = None, tag: str = "",
) -> Result:
    """``engine``: "" the fake JSON engine, "none" no engine (see the module docstring)."""
    ns = f"tp{producers}{tag}-{time.monotonic_ns()}"
    redis = connect(server.url)
    keys = await init_ns(redis, ns, n_samples_per_prompt=N, batch_size=BATCH, max_backlog=4 * BATCH)
    total = (batches + 1) * BATCH + 4 * BATCH + producers * 16
    await add_prompts(redis, keys, 0, total)
    with children() as procs:
        for i in range(producers):
            env = {"BENCH_PROFILE": str(profile)} if profile is not None and i == 0 else None
            procs.append(spawn(
                ["-m", "bench.worker", "produce", "--redis", server.url, "--ns", ns, "--tokens", str(tokens),
                 "--concurrency", "64", "--name", f"p{i}", "--engine", engine],
                OUT / f"worker-{ns}-{i}.log", env,
            ))
        async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=60) as consumer:
            await consume(consumer, 1, BATCH)  # warm-up: imports, connections, first batch
            pids = [p.pid for p in procs]
            assert server.process is not None
            cpu0 = (cpu_seconds(pids), cpu_seconds([server.process.pid]), time.process_time())
            seconds = await consume(consumer, batches, BATCH)
            cpu1 = (cpu_seconds(pids), cpu_seconds([server.process.pid]), time.process_time())
    await redis.aclose()
    cpu = {k: (b - a) / seconds for k, a, b in zip(("producers", "redis", "trainer"), cpu0, cpu1, strict=True)}
    return Result(batches * BATCH, seconds, cpu)


async def raw_run(server: EmbeddedRedis, producers: int, batches: int, tokens: int, *, decode: bool = False) -> Result:
    """redis-py alone: pipelined XADD of the same payload; XREADGROUP (+ take()'s decoder) + XACK + XDEL."""
    stream = f"raw-{producers}-{time.monotonic_ns()}"
    redis = connect(server.url)
    await redis.xgroup_create(stream, "trainer", id="0", mkstream=True)
    reader = connect(server.url, block_ms=1000)
    total = (batches + 1) * BATCH
    per = -(-total // producers)

    async def take() -> None:
        got: list[bytes] = []
        while len(got) < BATCH:
            reply = await reader.xreadgroup("trainer", "t", {stream: ">"}, count=BATCH - len(got), block=1000)
            for _, entries in reply or []:
                got.extend(eid for eid, _ in entries)
                if decode:
                    for _, fields in entries:
                        decode_group_entry(fields, views=True)
        async with redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream, "trainer", *got)
            pipe.xdel(stream, *got)
            await pipe.execute()

    with children() as procs:
        for _ in range(producers):
            procs.append(spawn(["-m", "bench.worker", "raw", "--redis", server.url, "--stream", stream,
                                "--count", str(per), "--tokens", str(tokens)]))
        await take()
        pids = [p.pid for p in procs]
        assert server.process is not None
        cpu0 = (cpu_seconds(pids), cpu_seconds([server.process.pid]), time.process_time())
        started = time.perf_counter()
        for _ in range(batches):
            await take()
        seconds = time.perf_counter() - started
        cpu1 = (cpu_seconds(pids), cpu_seconds([server.process.pid]), time.process_time())
    await redis.delete(stream)
    await redis.aclose()
    await reader.aclose()
    cpu = {k: (b - a) / seconds for k, a, b in zip(("producers", "redis", "trainer"), cpu0, cpu1, strict=True)}
    return Result(batches * BATCH, seconds, cpu)


async def inprocess_run(batches: int, tokens: int, concurrency: int = 128) -> Result:
    """The in-trainer design (miles/slime): generate -> asyncio.Queue -> drain exactly the target."""
    engine = EngineClient(EngineSettings(urls=("http://instant",)), transport=instant_transport(tokens))
    reward = ConstReward()
    queue: asyncio.Queue[Group] = asyncio.Queue()
    room = asyncio.Semaphore(concurrency // N)
    counter = iter(range(1 << 40))

    async def one_group() -> None:
        try:
            prompt = bench_prompt(next(counter))
            gens = await asyncio.gather(*(engine.generate(input_ids=prompt.input_ids) for _ in range(N)))
            samples = [
                Sample(index=i, tokens=prompt.input_ids + array("i", g.output_ids),  # type: ignore[operator]
                       response=g.text, response_length=len(g.output_ids), finish_reason=g.finish_reason,
                       weight_versions=[g.weight_version or 0], rollout_log_probs=array("f", g.log_probs or []),
                       metadata={"engine": g.engine})
                for i, g in enumerate(gens)
            ]
            for s, r in zip(samples, await reward.score(prompt.prompt, prompt.label, samples), strict=True):
                s.reward = r
            queue.put_nowait(Group(index=prompt.index, prompt=prompt.prompt, samples=samples, label=prompt.label))
        finally:
            room.release()

    tasks: set[asyncio.Task[None]] = set()

    async def generate() -> None:
        while True:
            await room.acquire()
            task = asyncio.create_task(one_group())
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def drain() -> list[Group]:
        return [await queue.get() for _ in range(BATCH)]

    gen = asyncio.create_task(generate())
    await drain()
    cpu0 = time.process_time()
    started = time.perf_counter()
    for _ in range(batches):
        batch = await drain()
        batch.sort(key=lambda g: g.index)
    seconds = time.perf_counter() - started
    cpu = {"producers": 0.0, "redis": 0.0, "trainer": (time.process_time() - cpu0) / seconds}
    gen.cancel()
    for t in list(tasks):
        t.cancel()
    await asyncio.gather(gen, *tasks, return_exceptions=True)
    await engine.aclose()
    return Result(batches * BATCH, seconds, cpu)


async def _redis_version(server: EmbeddedRedis) -> str:
    r: Redis = connect(server.url)
    info = await r.info("server")
    await r.aclose()
    return str(info.get("redis_version"))


async def measure(quick: bool) -> tuple[list[list[Any]], str, float, list[tuple[int, float, float, float]]]:
    tokens = 1024
    batches = 2 if quick else 16
    counts = [1, 2] if quick else [1, 2, 4]
    mb = len(encode_group(make_group(N, tokens))) / 1e6
    rows: list[list[Any]] = []
    curve: list[tuple[int, float, float, float]] = []
    OUT.mkdir(parents=True, exist_ok=True)
    with EmbeddedRedis() as server:
        version = await _redis_version(server)
        inproc = await inprocess_run(batches, tokens)
        for p in counts:
            raw = await raw_run(server, p, batches, tokens)
            raw_decoded = await raw_run(server, p, batches, tokens, decode=True)
            fake = await rollstream_run(server, p, batches, tokens)
            bare = await rollstream_run(server, p, batches, tokens, engine="none", tag="none")
            curve.append((p, fake.rate, bare.rate, raw.rate))
            for label, ours in (("fake (HTTP + JSON)", fake), ("none", bare)):
                rows.append([
                    p, label, ours.rate, ours.rate * mb, raw.rate, raw_decoded.rate, ours.rate / raw.rate,
                    ours.rate / raw_decoded.rate, ours.rate / inproc.rate,
                    ours.cpu["producers"] / (ours.rate * N) * 1e3,
                    f"{ours.cpu['producers']:.2f} / {ours.cpu['redis']:.2f} / {ours.cpu['trainer']:.2f}",
                    f"{raw.cpu['producers']:.2f} / {raw.cpu['redis']:.2f} / {raw.cpu['trainer']:.2f}",
                ])
    rows.append(["in-process (1 proc)", "fake (HTTP + JSON)", inproc.rate, inproc.rate * mb, "", "", "", "", 1.0,
                 "", f"0 / 0 / {inproc.cpu['trainer']:.2f}", ""])
    return rows, version, mb, curve


def run(quick: bool = False) -> list[Table]:
    rows, version, mb, curve = asyncio.run(measure(quick))
    _plot(curve, rows[-1][2])
    return [Table(
        "throughput",
        "Throughput ceiling: groups of 8 x 1k tokens, one trainer taking 64",
        ["producers", "engine", "rollstream groups/s", "rollstream MB/s", "raw groups/s", "raw+decode groups/s",
         "rollstream/raw", "rollstream/raw+decode", "rollstream/in-process", "producer CPU ms/sample",
         "CPU cores rollstream (prod/redis/trainer)", "CPU cores raw (prod/redis/trainer)"],
        rows,
        [
            f"Redis {version} (EmbeddedRedis, no persistence); payload {mb * 1e3:.1f} kB per group.",
            "Engines: 'fake (HTTP + JSON)' is the in-process httpx.MockTransport double (bench.common."
            "instant_transport): every /generate answers a precomputed SGLang JSON reply of 1024 tokens with "
            "log-probs, so producers still run the HTTP client and parse JSON. 'none' is bench.common.NoEngine: "
            "a prebuilt Generation returned at once, so what is left is the pipeline's own work (admission, "
            "samples, reward, encoding, PUBLISH).",
            "rollstream: real Producer processes (python -m bench.worker produce, concurrency 64 samples), "
            "GroupConsumer.take(64) + commit in this process. raw: the same encoded bytes, pipelined XADD (8 per "
            "round trip) from the same number of processes; XREADGROUP + XACK + XDEL; raw+decode: the same trainer "
            "also decodes every entry with take()'s decoder (codec.decode_group_entry(views=True)). in-process: "
            "one process, asyncio.Queue, the fake engine, no serialisation at all.",
            "producer CPU ms/sample: the producer processes' CPU-seconds per sample published. CPU columns: cores "
            "used (CPU-seconds / wall-second) per component during the measured window.",
        ],
        "python -m bench throughput",
    )]


def _plot(curve: list[tuple[int, float, float, float]], inproc: float) -> None:
    from bench.common import IMG, plt

    pyplot = plt()
    fig, ax = pyplot.subplots(figsize=(6, 4))
    ps = [c[0] for c in curve]
    ax.plot(ps, [c[1] for c in curve], marker="o", label="rollstream, fake engine")
    ax.plot(ps, [c[2] for c in curve], marker="^", label="rollstream, no engine")
    ax.plot(ps, [c[3] for c in curve], marker="s", label="raw redis-py")
    ax.axhline(inproc, color="grey", linestyle="--", label="in-process asyncio.Queue")
    ax.set_xlabel("producer processes")
    ax.set_ylabel("groups/s (8 x 1k tokens)")
    ax.set_xticks(ps)
    ax.legend()
    ax.set_title("throughput ceiling (2 shared cores)")
    fig.tight_layout()
    IMG.mkdir(parents=True, exist_ok=True)
    fig.savefig(IMG / "throughput.png", dpi=100)
    pyplot.close(fig)
