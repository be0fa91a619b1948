"""The payload plane against inline Redis (issue 48 item 4): per-token arrays in the stream entry
(inline) or in a payload store (``fs://`` on /dev/shm, ``mooncake://`` over TCP), side by side.

``python -m bench payload`` (~9 min at load 12-15 on 2 shared cores, a few on a quiet machine);
``python -m bench.payload --rounds 5 --hold 4 --flow 8`` for a bigger run; ``--pin`` runs
redis-server and the other client on CPU 0 and everything else on the others
(``bench/out/payload-pinned.json``), as on a cluster where Redis has a host of its own; ``python
-m bench.payload render [--pin]`` prints the tables again from the JSON. Every variant runs on its
own fresh Redis 7 (``/usr/bin/redis-server``, else the embedded one), the variants interleaved
round by round (order rotated); figures are medians over the rounds.

One round of one variant, groups of 16 samples x 8k response tokens with a 48 x 8 routing
replay (uint8, ~50 MB a group), a producer in its own process (``bench/payload_child.py``: ADMIT,
encode, put, PUBLISH: the calls ``Producer`` makes):

1. **hold**: one warm-up group, then ``hold`` groups published with no trainer: Redis
   ``used_memory`` growth per group held, and Redis CPU (``INFO cpu``) per publish.
2. **drain**: the trainer (this process) takes them in batches, fetches every array (touching
   each page) and commits: its bytes per second against ``numpy.fromfile`` of the same bytes from
   /dev/shm (the physical bound here); one object through the store's own interface (put, get).
3. **flow**: the producer publishes ``flow`` more while the trainer takes, fetches and commits:
   groups/s end to end, Redis CPU per group (everything: ADMIT, PUBLISH, read, commit, the
   store's ledger) and ``INFO commandstats`` per group.
4. **flow again** with another client (``bench/payload_probe.py``, its own process) adding a
   small entry with XADD every millisecond: its worst latency, and Redis' slowlog.
5. with a store, **ranks**: one take of 8 groups of unequal lengths, ``batch.shard(rank, 4)``
   fetched rank by rank: the store bytes each rank read.

Beside them, the rounds of two groups without R3 (inline): 16 x 8k (what stays in the entry
with a store) and 8 x 1k (the CPU target's reference). And the "before" table of issue 48: one
XADD of a group's bytes (6, 50, 200 MB) while another client PINGs every millisecond. And
:func:`projection`: docs/scale.md's large run with 16 x 32k R3 groups.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy
import redis as redis_sync
from rollstream.common import lua
from rollstream.common.codec import group_fields, group_fields_offloaded
from rollstream.common.connection import connect
from rollstream.consumer import Batch, GroupConsumer
from rollstream.runtime.redis_server import EmbeddedRedis, find_redis_server

from bench.common import OUT, PROMPT_TOKENS, R3_SHAPE, ROOT, Table, add_prompts, init_ns, spawn, stop_all
from bench.payload_child import bench_group

REDIS7 = "/usr/bin/redis-server"
SAMPLES, TOKENS = 16, 8192
BASE_SAMPLES, BASE_TOKENS = 8, 1024
WORLD = 4
BATCH = 2
"""The trainer's take size, the same for every variant: a take's own calls (~17) are per take, so
per-group Redis CPU is compared at one batch size (the 8 x 1k row once took 8: 0.58 ms a group
against 0.68-0.83 at 2). Two, not more: a take of 8 inline R3 groups is a ~470 MB reply, and 8
Mooncake groups outgrow its reused read memory (1 GiB with the batch before still held)."""
IDLE_S = 1.0
"""Redis' CPU over this long, the producer and the trainer connected and idle, before the flow:
its fixed cost a second (its cron, their heartbeats), which a slow flow would charge its few groups."""
STORE_HOLD = 4
"""With a store, this many times the inline variant's held groups (Redis holds a few KB of each)."""
STORE_FLOW = 2
"""With a store, this many times the inline variant's flowing groups: two takes a flow phase."""
MIN_BYTES = 64 * 1024
"""``--payload-min-bytes`` with a store (init's default): a sample's arrays go once they reach it."""
REDIS_CPUS = {0}
"""With ``--pin``: redis-server and the other client run on these CPUs, everything else (this
process, the producer, the store's processes) on the rest, as on a cluster where Redis has its own
host: the other client's latency then shows what Redis makes it wait, not this machine's scheduling."""
PAGE = 4096
WAIT = 600.0
SLOW_US = 5_000
"""Commands slower than this (us) are kept in the slowlog: what stalls Redis, by command."""


def redis_binary() -> str:
    return REDIS7 if os.access(REDIS7, os.X_OK) else find_redis_server()


def redis_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False).stdout
    return next((w[2:] for w in out.split() if w.startswith("v=")), "?")


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f}"


# -- the other client ------------------------------------------------------------------------


class Probe:
    """``bench/payload_probe.py`` in its own process: one small command a millisecond, each timed."""

    def __init__(self, port: int, kind: str, workdir: Path, pin: bool = False) -> None:
        self.port, self.kind, self.pin = port, kind, pin
        self.out = workdir / f"probe-{kind}-{time.monotonic_ns()}.json"
        self.proc: subprocess.Popen[bytes] | None = None
        self.records: list[tuple[float, float]] = []

    def __enter__(self) -> Probe:
        self.proc = spawn(["-m", "bench.payload_probe", "--port", str(self.port), "--kind", self.kind,
                           "--out", str(self.out)], OUT / "payload-probe.log")
        if self.pin:
            os.sched_setaffinity(self.proc.pid, REDIS_CPUS)
        ready = self.out.with_suffix(".ready")
        deadline = time.monotonic() + 60
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the probe did not start (see {OUT / 'payload-probe.log'})")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            stop_all([self.proc])
        if self.out.exists():
            self.records = [tuple(r) for r in json.loads(self.out.read_text())]

    def worst(self, start: float, end: float) -> float:
        """The longest call that overlapped ``[start, end]`` (monotonic seconds), in ms."""
        hits = [lat for t0, lat in self.records if t0 <= end and t0 + lat >= start]
        return max(hits) * 1e3 if hits else float("nan")

    def calls(self, start: float, end: float) -> int:
        return sum(1 for t0, _ in self.records if start <= t0 <= end)


# -- before: one big XADD, another client's PING ---------------------------------------------


def before(rounds: int, sizes: tuple[int, ...], workdir: Path) -> dict[str, Any]:
    """Per group size (16 x N tokens with R3): XADD and XRANGE seconds of its entry while another
    process PINGs every millisecond, the worst PING during each, and during an idle second."""
    binary = redis_binary()
    results: dict[int, dict[str, list[float]]] = {}
    for tokens in sizes:
        fields = group_fields(bench_group(SAMPLES, tokens, r3=True))
        size = len(fields["data"])
        res = results.setdefault(tokens, {"bytes": [size], "xadd": [], "xrange": [], "ping_xadd": [], "ping_xrange": [],
                                          "ping_idle": []})
        for _ in range(rounds):
            with EmbeddedRedis(binary=binary) as server:
                client = redis_sync.Redis(port=server.port, socket_timeout=120)
                with Probe(server.port, "ping", workdir) as probe:
                    idle0 = time.monotonic()
                    time.sleep(1.0)
                    idle1 = t0 = time.monotonic()
                    entry_id = client.xadd("before:groups", fields)
                    t1 = time.monotonic()
                    rows = client.xrange("before:groups", entry_id, entry_id)
                    t2 = time.monotonic()
                    assert len(rows[0][1][b"data"]) == size
                    del rows
                    time.sleep(0.05)
                client.close()
            res["xadd"].append(t1 - t0)
            res["xrange"].append(t2 - t1)
            res["ping_xadd"].append(probe.worst(t0, t1))
            res["ping_xrange"].append(probe.worst(t1, t2))
            res["ping_idle"].append(probe.worst(idle0, idle1))
        del fields
    return {"binary": binary, "version": redis_version(binary), "sizes": results}


def before_table(result: dict[str, Any], rounds: int, command: str) -> Table:
    rows = []
    for tokens, res in result["sizes"].items():
        rows.append([f"16 x {int(tokens) // 1024}k", res["bytes"][0] / 1e6, statistics.median(res["xadd"]) * 1e3,
                     statistics.median(res["xrange"]) * 1e3, statistics.median(res["ping_xadd"]),
                     statistics.median(res["ping_xrange"]), max(res["ping_xadd"] + res["ping_xrange"]),
                     statistics.median(res["ping_idle"])])
    return Table(
        "payload_before",
        f"Before (inline): one XADD of a group's bytes while another client PINGs every ms (Redis {result['version']})",
        ["group (R3 48 x 8)", "MB", "XADD ms", "XRANGE of it ms", "worst PING during XADD ms",
         "worst PING during XRANGE ms", "worst PING of all rounds ms", "worst PING, idle second ms"],
        rows,
        [
            f"Medians of {rounds} rounds, each on a fresh redis-server ({result['binary']}); the PINGs come from "
            "bench/payload_probe.py in its own process (redis-py, one a millisecond), timed from send to reply; "
            "'idle second': the same probe in the second before the XADD (this machine's noise floor).",
            "The group: 16 samples x (N response + 64 prompt tokens), ids, log-probs, a loss mask, a response text "
            "of 4 characters a token and a 48 x 8 uint8 routing replay, encoded by the codec (group_fields); XADD "
            "and XRANGE from this process (redis-py, hiredis).",
            f"Load average at the end: {load()} (2 cores shared with other work).",
        ],
        command,
    )


# -- the variants ----------------------------------------------------------------------------


@dataclass
class Variant:
    name: str
    store: str | None = None
    """The payload store URL (``--payload-store``), None: inline."""
    samples: int = SAMPLES
    tokens: int = TOKENS
    r3: bool = True
    hold: int = 2
    flow: int = 3
    batch: int = 2
    setup: Any = None
    """A context manager factory bringing the store up for one round (Mooncake's processes) and
    giving its URL."""
    runs: list[dict[str, Any]] = field(default_factory=list)


def namespace_config(variant: Variant, store: str | None, batch: int, backlog: int) -> dict[str, Any]:
    config: dict[str, Any] = {"n_samples_per_prompt": variant.samples, "batch_size": batch, "max_backlog": backlog}
    if store is not None:
        config["payload_store"], config["payload_min_bytes"] = store, MIN_BYTES
    return config


async def info_cpu(redis: Any) -> float:
    cpu = await redis.info("cpu")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"])


async def commandstats(redis: Any) -> dict[str, tuple[int, float]]:
    """``INFO commandstats``: calls and microseconds by command (Redis 7 counts the commands a
    script runs under their own names, as well as the EVALSHA)."""
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"])) for name, v in stats.items()}


def commands_per_group(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]], groups: int) -> dict[str, list[float]]:
    """Calls and microseconds per group by command, between two :func:`commandstats`."""
    out = {}
    for name, (calls, usec) in after.items():
        calls0, usec0 = before.get(name, (0, 0.0))
        if calls > calls0 and name not in ("info", "slowlog|get", "config|set"):
            out[name] = [(calls - calls0) / groups, (usec - usec0) / groups]
    return out


async def info_memory(redis: Any) -> int:
    """``used_memory`` without the clients' buffers (a query buffer that held a 50 MB argument
    is kept a while by the connection that sent it)."""
    memory = await redis.info("memory")
    return int(memory["used_memory"]) - int(memory.get("mem_clients_normal", 0))


def touch(view: numpy.ndarray) -> int:
    """Read one byte of every page of ``view`` (an mmap'd array is faulted in), its bytes."""
    flat = view.reshape(-1).view(numpy.uint8)
    int(flat[::PAGE].sum())
    return int(flat.nbytes)


async def fetch(batch: Batch) -> int:
    """Every array of the batch fetched (its offloaded ones from the store, CRC-32 checked) and
    touched: the arrays' bytes."""
    if hasattr(batch, "fetch"):
        await batch.fetch()
    total = 0
    for name in ("tokens", "log_probs", "routed_experts"):
        for view in getattr(batch, f"{name}_numpy")():
            if view is not None:
                total += touch(view)
    return total


def fromfile_bandwidth(nbytes: int, workdir: Path, repeat: int = 3) -> float:
    """Bytes/s of ``numpy.fromfile`` (plus the same touch) of ``nbytes`` from a /dev/shm file."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else workdir
    path = shm / f"rollstream-bench-fromfile-{os.getpid()}"
    numpy.random.default_rng(0).integers(0, 255, nbytes, dtype=numpy.uint8).tofile(path)
    try:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            touch(numpy.fromfile(path, dtype=numpy.uint8))
            times.append(time.perf_counter() - started)
        return nbytes / statistics.median(times)
    finally:
        path.unlink()


async def store_bandwidth(url: str, nbytes: int, repeat: int = 3) -> dict[str, float]:
    """Bytes/s of one object of ``nbytes`` through the store's interface: ``put``; ``get`` with
    its CRC-32 checked and every page touched (what a fetch does). The objects are deleted at the
    end, retried until the store confirms (Mooncake refuses under a read lease): ``delete_s``."""
    from rollstream.common.payload import checksum, open_store

    data = numpy.random.default_rng(1).integers(0, 255, nbytes, dtype=numpy.uint8)
    crc = checksum([data])
    store = open_store(url)
    puts, gets = [], []
    keys = [f"bench/bandwidth-{os.getpid()}-{time.monotonic_ns()}-{i}" for i in range(repeat)]
    try:
        for key in keys:
            started = time.perf_counter()
            await store.put(key, [data])
            put = time.perf_counter()
            view = await store.get(key, nbytes)
            if checksum([view]) != crc:
                raise RuntimeError(f"{url}: {key} read back with another checksum")
            touch(numpy.frombuffer(view, dtype=numpy.uint8))
            gets.append(time.perf_counter() - put)
            puts.append(put - started)
            del view
        started = time.perf_counter()
        left = list(keys)
        async with asyncio.timeout(120):
            while left:
                gone = set(await store.delete(left))
                left = [k for k in left if k not in gone]
                if left:
                    await asyncio.sleep(0.1)
        deleted = time.perf_counter() - started
    finally:
        await store.close()
    return {"put": nbytes / statistics.median(puts), "get": nbytes / statistics.median(gets), "delete_s": deleted}


MOONCAKE_SEGMENT = "4GB"
"""The store process's memory: every object a round puts (~2.6 GB), should none be freed before its end."""


def mooncake_variant(plan: dict[str, int]) -> Variant | None:
    """Mooncake over TCP (``testing/mooncake_cluster.py``: a real master and one store process of
    :data:`MOONCAKE_SEGMENT` on loopback, fresh each round) when its backend and binaries are here."""
    if importlib.util.find_spec("rollstream.testing.mooncake_cluster") is None:
        return None
    if importlib.util.find_spec("rollstream.common.payload.mooncake") is None:
        return None
    from rollstream.testing.mooncake_cluster import MooncakeCluster, mooncake_unavailable

    why = mooncake_unavailable()
    if why is not None:
        print(f"  (no Mooncake variant: {why})", flush=True)
        return None

    @contextlib.contextmanager
    def cluster() -> Iterator[str]:
        with MooncakeCluster(stores=1, segment=MOONCAKE_SEGMENT) as running:
            yield running.url

    return Variant("mooncake", store="mooncake://", setup=cluster, **plan)


class Child:
    """bench/payload_child.py, driven stage by stage through files in its own directory."""

    def __init__(self, url: str, ns: str, variant: Variant, stages: list[tuple[int, list[int]]], workdir: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="child-", dir=workdir))
        spec = ",".join(f"{count}:{'/'.join(map(str, sizes))}" for count, sizes in stages)
        args = ["-m", "bench.payload_child", "--redis", url, "--ns", ns, "--dir", str(self.dir),
                "--samples", str(variant.samples), "--stages", spec]
        self.proc = spawn(args + (["--r3"] if variant.r3 else []), OUT / "payload-child.log")
        self._wait("ready")

    def _wait(self, name: str) -> None:
        deadline = time.monotonic() + WAIT
        while not (self.dir / name).exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the producer child exited with {self.proc.returncode}: {OUT / 'payload-child.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the producer child did not reach {name} in {WAIT} s")
            time.sleep(0.002)

    async def stage(self, i: int, wait: bool = True) -> None:
        (self.dir / f"go.{i}").touch()
        if wait:
            await asyncio.to_thread(self._wait, f"done.{i}")

    async def done(self, i: int) -> None:
        await asyncio.to_thread(self._wait, f"done.{i}")

    def close(self, failed: bool = False) -> dict[str, Any]:
        """Its figures, once it ends (at once, killed, when the round ``failed``)."""
        if failed:
            stop_all([self.proc])
        try:
            self.proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            stop_all([self.proc])
        path = self.dir / "child.json"
        out: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        shutil.rmtree(self.dir, ignore_errors=True)
        return out


async def drain(consumer: GroupConsumer, groups: int, batch_size: int) -> dict[str, Any]:
    """Take ``groups`` waiting groups in batches, fetch every array, commit."""
    taken = fetched = 0
    take_s = fetch_s = 0.0
    while taken < groups:
        started = time.perf_counter()
        batch = await consumer.take(min(batch_size, groups - taken))
        took = time.perf_counter()
        fetched += await fetch(batch)
        fetch_s += time.perf_counter() - took
        take_s += took - started
        await consumer.commit(batch)
        taken += len(batch)
    return {"groups": taken, "bytes": fetched, "take_s": take_s, "fetch_s": fetch_s}


async def shard_bytes(consumer: GroupConsumer, groups: int) -> list[float]:
    """One take of ``groups`` waiting groups split ``batch.shard(rank, WORLD)``: the share of the
    batch's store bytes each rank read from the store (its gets counted, one by one or in
    batches: ``get_many``, Mooncake's) fetching its shard."""
    batch = await consumer.take(groups)
    store = batch.plane.store
    read = [0]
    original, original_many = store.get, store.get_many

    async def counted(key: str, size: int) -> Any:
        read[0] += size
        return await original(key, size)

    async def counted_many(items: Sequence[tuple[str, int]]) -> Any:
        read[0] += sum(size for _, size in items)
        return await original_many(items)

    store.get, store.get_many = counted, counted_many
    shares = []
    try:
        for rank in range(WORLD):
            before = read[0]
            await fetch(batch.shard(rank, WORLD))
            shares.append((read[0] - before) / batch.store_bytes)
    finally:
        del store.get, store.get_many
    await consumer.commit(batch)
    return shares


SHARD_SIZES = [4096, 5120, 6144, 7168, 8192, 10240, 11264, 12288]
"""The response lengths of the groups split across ranks (8 groups of 16, each its own length,
mean 7.9k): shard() balances whole groups by tokens, so unequal groups show its balance."""


async def one_round(variant: Variant, workdir: Path, pin: bool = False) -> dict[str, Any]:
    """One round of ``variant`` on a fresh Redis: hold, drain, flow, flow with the probe, and with
    a store the split across ranks (the module docstring)."""
    binary = redis_binary()
    hold, flow, batch_size = variant.hold, variant.flow, variant.batch
    out: dict[str, Any] = {"variant": variant.name}
    size = [variant.tokens]
    stages = [(1, size), (hold, size), (flow, size), (flow, size)]
    if variant.store is not None:
        stages.append((len(SHARD_SIZES), SHARD_SIZES))
    prompts = sum(count for count, _ in stages)
    setup = variant.setup() if variant.setup is not None else contextlib.nullcontext(variant.store)
    with setup as store, EmbeddedRedis(binary=binary) as server:
        if pin and server.process is not None:
            os.sched_setaffinity(server.process.pid, REDIS_CPUS)
        redis = connect(server.url)
        ns = "pb-" + "".join(c if c.isalnum() else "-" for c in variant.name)
        keys = await init_ns(redis, ns, **namespace_config(variant, store, batch_size, prompts))
        await redis.config_set("slowlog-max-len", 1024)
        await redis.config_set("slowlog-log-slower-than", SLOW_US)
        await add_prompts(redis, keys, 0, prompts)
        group = bench_group(variant.samples, variant.tokens, variant.r3)
        out["payload"] = len(group_fields(group)["data"])
        if variant.store is not None:  # what the entry keeps, and what goes to the store
            fields, objects = group_fields_offloaded(group, MIN_BYTES, lambda: f"{ns}/{'0' * 32}")
            out["entry_bytes"] = sum(len(v) if isinstance(v, bytes) else len(str(v)) for v in fields.values())
            out["store_bytes"] = sum(o.ref.size for o in objects)
        del group
        child = Child(server.url, ns, variant, stages, workdir)
        try:
            await child.stage(0)  # a warm-up group: scripts loaded, the stream and its groups exist
            mem0, cpu0 = await info_memory(redis), await info_cpu(redis)
            await child.stage(1)
            mem1, cpu1 = await info_memory(redis), await info_cpu(redis)
            out["memory_per_group"] = (mem1 - mem0) / hold
            out["publish_cpu"] = (cpu1 - cpu0) / hold
            async with await GroupConsumer.connect(server.url, ns, "trainer", stall_timeout=120) as consumer:
                cpu1 = await info_cpu(redis)
                drained = await drain(consumer, 1 + hold, batch_size)
                cpu2 = await info_cpu(redis)
                out["read_commit_cpu"] = (cpu2 - cpu1) / (1 + hold)
                out["drain"] = drained
                per_group = drained["bytes"] // drained["groups"]
                out["fromfile"] = await asyncio.to_thread(fromfile_bandwidth, per_group, workdir)
                if variant.store is not None:
                    out["store"] = await store_bandwidth(store, per_group)
                idle = await info_cpu(redis)
                await asyncio.sleep(IDLE_S)
                out["fixed_cpu_per_s"] = (await info_cpu(redis) - idle) / IDLE_S
                started = time.monotonic()
                cpu2, stats2 = await info_cpu(redis), await commandstats(redis)
                await child.stage(2, wait=False)
                out["flow"] = await drain(consumer, flow, batch_size)
                ended = time.monotonic()
                cpu3, stats3 = await info_cpu(redis), await commandstats(redis)
                out["commands"] = commands_per_group(stats2, stats3, flow)
                await child.done(2)
                out["groups_per_s"] = flow / (ended - started)
                out["cycle_cpu"] = (cpu3 - cpu2) / flow
                out["group_cpu"] = (cpu3 - cpu2 - out["fixed_cpu_per_s"] * (ended - started)) / flow
                with Probe(server.port, "xadd", workdir, pin) as probe:
                    idle0 = time.monotonic()
                    await asyncio.sleep(1.0)
                    idle1 = started = time.monotonic()
                    await child.stage(3, wait=False)
                    await drain(consumer, flow, batch_size)
                    ended = time.monotonic()
                    await child.done(3)
                out["probe_worst"] = probe.worst(started, ended)
                out["probe_idle"] = probe.worst(idle0, idle1)
                out["probe_calls"] = probe.calls(started, ended)
                out["probe_p99"] = _p99(probe, started, ended)
                out["slowest"] = slowest(await redis.slowlog_get(1024))
            if variant.store is not None:
                await child.stage(4)
                # the ranks' way: take() only checks each object is there (payload_check="size"),
                # each rank fetches its own shard
                async with await GroupConsumer.connect(
                    server.url, ns, "trainer-ranks", stall_timeout=120, payload_check="size"
                ) as ranks:
                    out["ranks"] = await shard_bytes(ranks, len(SHARD_SIZES))
        except BaseException:
            child.close(failed=True)
            raise
        else:
            out["child"] = child.close()
        finally:
            if variant.store is not None and variant.store.startswith("fs://"):
                shutil.rmtree(urlsplit(variant.store).path, ignore_errors=True)
        await redis.aclose()
    return out


SCRIPT_NAMES = {hashlib.sha1(s.source.encode()).hexdigest(): s.name for s in lua.SCRIPTS}


def slowest(entries: list[Any]) -> dict[str, float]:
    """The longest call of each command (EVALSHA by script name) over SLOW_US, in ms."""
    out: dict[str, float] = {}
    for entry in entries:
        words = entry["command"].split()
        name = words[0].decode().upper() if words else "?"
        if name == "EVALSHA" and len(words) > 1:
            name = SCRIPT_NAMES.get(words[1].decode(), "EVALSHA")
        out[name] = max(out.get(name, 0.0), entry["duration"] / 1e3)
    return out


def _p99(probe: Probe, start: float, end: float) -> float:
    lat = sorted(lat for t0, lat in probe.records if start <= t0 <= end)
    return lat[int(0.99 * (len(lat) - 1))] * 1e3 if lat else float("nan")


# -- the run ---------------------------------------------------------------------------------


def variants(hold: int, flow: int, small_flow: int) -> list[Variant]:
    """inline, fs (/dev/shm) and Mooncake where they can run; then the two rows without R3 (inline):
    8 x 1k (the CPU target's reference) and 16 x 8k (the R3 group's other arrays, inline)."""
    big = {"hold": hold, "flow": flow, "batch": BATCH}
    found = [Variant("inline", **big)]
    stored = {**big, "hold": STORE_HOLD * hold, "flow": STORE_FLOW * flow}  # cheap with a store: steadier figures
    if importlib.util.find_spec("rollstream.common.payload.plane") is not None and Path("/dev/shm").is_dir():
        found.append(Variant("fs", store="fs:///dev/shm/rollstream-bench-payload", **stored))
    mooncake = mooncake_variant(stored)
    if mooncake is not None:
        found.append(mooncake)
    found.append(Variant("inline, no R3", tokens=TOKENS, r3=False, hold=8, flow=4 * flow, batch=BATCH))
    found.append(Variant("inline, 8 x 1k, no R3", samples=BASE_SAMPLES, tokens=BASE_TOKENS, r3=False, hold=8,
                         flow=small_flow, batch=BATCH))
    return found


def measure(rounds: int, hold: int, flow: int, small_flow: int, pin: bool = False) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="rollstream-bench-payload-"))
    OUT.mkdir(parents=True, exist_ok=True)
    chosen = variants(hold, flow, small_flow)
    loads = [load()]
    cpus = os.sched_getaffinity(0)
    if pin:
        if not cpus - REDIS_CPUS:
            raise SystemExit(f"--pin needs CPUs besides {sorted(REDIS_CPUS)} (this process may use {sorted(cpus)})")
        os.sched_setaffinity(0, cpus - REDIS_CPUS)  # every child started from here on inherits it
    try:
        for round_ in range(rounds):
            shift = round_ % len(chosen)
            for variant in chosen[shift:] + chosen[:shift]:  # interleaved, the order rotated each round
                result = asyncio.run(one_round(variant, workdir, pin))
                variant.runs.append(result)
                print(f"  round {round_ + 1} {variant.name}: {_brief(result)} (load {load()})", flush=True)
            loads.append(load())
    finally:
        os.sched_setaffinity(0, cpus)
        shutil.rmtree(workdir, ignore_errors=True)
    return {"variants": chosen, "loads": loads, "rounds": rounds, "pinned": pin}


def _brief(r: dict[str, Any]) -> str:
    return (f"{r['memory_per_group'] / 1e6:.3f} MB held/group, publish {r['publish_cpu'] * 1e3:.2f} ms CPU, "
            f"cycle {r['cycle_cpu'] * 1e3:.2f} ms CPU/group, {r['groups_per_s']:.2f} groups/s, "
            f"probe worst {r['probe_worst']:.1f} ms (idle {r['probe_idle']:.1f}), "
            f"Redis' longest {max(r['slowest'].values(), default=0):.0f} ms")


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def tables(result: dict[str, Any], command: str) -> list[Table]:
    chosen: list[Variant] = result["variants"]
    base_cpu = _median(chosen[-1].runs, "group_cpu")
    same_cpu = _median(chosen[-2].runs, "group_cpu")
    rows: list[list[Any]] = []
    stalls, stores, commands = [], [], []
    for variant in chosen:
        runs = variant.runs
        payload = runs[0]["payload"]
        mem = _median(runs, "memory_per_group")
        cpu = _median(runs, "group_cpu")
        bandwidths = [r["drain"]["bytes"] / (r["drain"]["take_s"] + r["drain"]["fetch_s"]) for r in runs]
        ratio = statistics.median(b / r["fromfile"] for b, r in zip(bandwidths, runs, strict=True))
        fractions = [share for r in runs for share in r.get("ranks", [])]
        longest = statistics.median(max(r["slowest"].values(), default=0.0) for r in runs)
        rows.append([
            variant.name, f"{variant.samples} x {variant.tokens // 1024}k{' R3' if variant.r3 else ''}",
            payload / 1e6, mem / 1e6, mem / payload, _median(runs, "publish_cpu") * 1e3,
            _median(runs, "read_commit_cpu") * 1e3, _median(runs, "cycle_cpu") * 1e3,
            _median(runs, "fixed_cpu_per_s") * 1e3, cpu * 1e3, cpu / base_cpu, cpu / same_cpu,
            _median(runs, "probe_worst"), max(r["probe_worst"] for r in runs), _median(runs, "probe_p99"),
            _median(runs, "probe_idle"), f"{longest:.0f}" if longest else f"< {SLOW_US / 1000:g}",
            _median(runs, "groups_per_s"), statistics.median(bandwidths) / 1e9, _median(runs, "fromfile") / 1e9,
            ratio, f"{min(fractions):.3f}-{max(fractions):.3f}" if fractions else "-",
        ])
        names = {name for r in runs for name in r["slowest"]}
        worst = {name: statistics.median(r["slowest"].get(name, 0.0) for r in runs) for name in names}
        top = sorted(worst.items(), key=lambda kv: -kv[1])[:4]
        stalls.append(f"{variant.name}: " + (", ".join(f"{n} {ms:.0f}" for n, ms in top if ms) or "none"))
        names = {name for r in runs for name in r["commands"]}
        calls = {n: statistics.median(r["commands"].get(n, [0.0, 0.0])[0] for r in runs) for n in names}
        usec = {n: statistics.median(r["commands"].get(n, [0.0, 0.0])[1] for r in runs) for n in names}
        heavy = sorted(names, key=lambda n: -usec[n])[:6]
        commands.append(f"{variant.name}: {sum(calls.values()):.1f} calls, " + ", ".join(
            f"{n} {calls[n]:.1f} x {usec[n] / max(calls[n], 1e-9):.0f} us" for n in heavy))
        if variant.store is not None:
            put = statistics.median(r["store"]["put"] for r in runs) / 1e9
            get = statistics.median(r["store"]["get"] for r in runs) / 1e9
            delete = statistics.median(r["store"]["delete_s"] for r in runs) * 1e3
            stores.append(f"{variant.name}: put {put:.2f} GB/s, get + CRC-32 + touch {get:.2f} GB/s, "
                          "all 3 deleted (confirmed) "
                          f"{delete:.0f} ms after the last get")
    layers, topk, _ = R3_SHAPE
    big = chosen[0]
    return [Table(
        "payload",
        f"Payload plane vs inline Redis: groups of {SAMPLES} x {TOKENS // 1024}k tokens with a {layers} x {topk} "
        "routing replay, side by side"
        + (f" (--pin: redis-server and the other client on CPU {sorted(REDIS_CPUS)}, the rest on the others)"
           if result.get("pinned") else ""),
        ["variant", "group", "payload MB", "Redis MB held per group", "held / payload", "publish Redis CPU ms",
         "read+commit Redis CPU ms", "Redis CPU ms per group (whole cycle)", "Redis' fixed CPU ms a second",
         "Redis CPU ms per group (less the fixed)", "x the 8 x 1k group",
         "x the 16 x 8k group without R3",
         "other client's worst XADD ms (median)", "worst of all rounds ms", "its p99 ms", "its worst, idle second ms",
         "Redis' longest command ms", "groups/s end to end", "trainer GB/s (take + fetch)", "numpy.fromfile GB/s",
         "trainer / fromfile", f"store bytes per rank of {WORLD}"],
        rows,
        [
            f"Medians of {result['rounds']} rounds, variants interleaved (order rotated each round), each round on a "
            f"fresh Redis {redis_version(redis_binary())}: a warm-up group, hold {big.hold} groups (with a store "
            f"{STORE_HOLD * big.hold}), drain them in take() batches, then {big.flow} groups flowing (with a store "
            f"{STORE_FLOW * big.flow}), twice (the rows without R3: 8 held, {chosen[-2].flow} and {chosen[-1].flow} "
            f"flowing). Every trainer takes {BATCH} groups at a time: a take's own calls are per take, so per-group "
            "CPU is compared at one batch size. Targets (issue 48): held <= 1 % of the payload with a "
            "store; CPU within 2x the 8 x 1k group; the other client's worst under 10 ms; trainer >= 0.5 x "
            f"numpy.fromfile; 0.25 of the bytes per rank of {WORLD}.",
            "The groups: ids, log-probs, a loss mask and a response text of 4 characters a token (what a real "
            "tokenizer gives), plus the routing replay. With a store all of them are in the sample's object: "
            "the entry keeps the control fields, the reward, one spec per array and the refs.",
            "Redis MB held: used_memory (less the clients' buffers) growth over the hold groups / hold. Redis CPU: "
            "INFO cpu used_cpu_sys + used_cpu_user deltas per group: publish (ADMIT + PUBLISH; with a store the "
            "intents too), read+commit (take + commit + freeing), whole cycle (the first flow phase: everything). "
            f"Redis' fixed CPU a second: over the {IDLE_S:g} s before that phase, producer and trainer connected and "
            "idle (Redis' cron, their heartbeats: what docs/scale.md counts per producer a second, not per group); "
            "less the fixed: the whole cycle less that rate over the phase's length, per group (a slow flow would "
            "charge its few groups with it); the ratios are of this.",
            "Other client: bench/payload_probe.py in its own process, an XADD of a 4 KB entry every millisecond, "
            "timed send to reply, during the second flow phase; 'idle second': the same probe just before it (the "
            "machine's noise floor: the probe or Redis preempted). Redis' longest command: the slowlog's longest "
            f"(commands over {SLOW_US / 1000:g} ms kept) in the round, median of the rounds: what another client "
            "waits behind without the machine's scheduling.",
            "groups/s: flow groups / from the producer's go to the last commit (producer: bench/payload_child.py, "
            "ADMIT, encode, put, PUBLISH, one group at a time; trainer: take, fetch every array touching each page, "
            "commit).",
            "trainer GB/s: the arrays' bytes / (take + fetch) seconds in the drain (take() reads and checks every "
            "object: payload_check='checksum', the default); numpy.fromfile (plus the same touch) of a group's "
            "array bytes from a /dev/shm file, in the same round; trainer / fromfile: the median of the rounds' "
            f"ratios. Store bytes per rank: one take (payload_check='size') of {len(SHARD_SIZES)} groups of 16 x "
            f"{'/'.join(f'{t / 1024:g}' for t in SHARD_SIZES)}k tokens, batch.shard(rank, {WORLD}) fetched rank by "
            "rank: the bytes each rank's gets read from the store over the batch's store bytes (min-max over "
            "rounds and ranks); inline has none to split (take reads every byte).",
            "Commands per group in the first flow phase (INFO commandstats deltas / groups, medians; a "
            "script's inner commands counted under their names as well as its EVALSHA), the six costliest by "
            "time, calls x us each: " + "; ".join(commands) + ".",
            f"Redis' longest call of each command (slowlog over {SLOW_US / 1000:g} ms; median of the rounds, ms; "
            "EVALSHA by script): " + "; ".join(stalls) + ".",
            *(["One object of a group's array bytes through the store's own interface (median of 3 a round, "
               "median of the rounds): " + "; ".join(stores) + "."] if stores else []),
            f"Load average (1, 5, 15 min) before and after each round: {'; '.join(result['loads'])} "
            "(2 cores shared with other work).",
        ],
        command,
    )]


def projection(result: dict[str, Any], command: str) -> Table:
    """docs/scale.md's large run (512 prompts x 16 a step, a step a minute, max_staleness 1) with
    16 x 32k-token R3 groups: what one Redis core, one Redis node and the store carry, from
    docs/scale.md's committed run (bench/out/scale.json: a 16 x 32k group without R3, the fixed
    cost of 1,024 producers) plus what this run measured R3 to add (inline) or the store's ledger
    to add (a store), each as the difference from the same 16 x 8k group without R3."""
    from bench.scale_report import LARGE_RUN, NIC_BYTES_PER_S
    from bench.scale_report import projection as scale_projection

    scale = scale_projection(json.loads((ROOT / "bench" / "out" / "scale.json").read_text()))
    big = next(z for z in scale["sizes"] if z["n"] == 16 and z["tokens"] == 32768)
    base_us, fixed = big["runs"][1024]["us_per_group"], scale["producers"][1024]["fixed_total_us_per_s"]
    demand = scale["demand_groups_per_s"]
    held_groups = (LARGE_RUN["max_staleness"] + 2) * LARGE_RUN["prompts_per_step"]
    layers, topk, _ = R3_SHAPE
    r3_big = 16 * (PROMPT_TOKENS + 32768 - 1) * layers * topk
    r3_here = SAMPLES * (PROMPT_TOKENS + TOKENS - 1) * layers * topk
    variants = {v["name"]: v for v in result["variants"]}
    same = variants["inline, no R3"]["runs"]
    same_cpu, same_mem = _median(same, "group_cpu") * 1e6, _median(same, "memory_per_group")
    per_token = (PROMPT_TOKENS + 32768) / (PROMPT_TOKENS + TOKENS)
    rows: list[list[Any]] = []
    for name, v in variants.items():
        if not v["r3"]:
            continue
        runs = v["runs"]
        cpu, mem = _median(runs, "group_cpu") * 1e6, _median(runs, "memory_per_group")
        if v["store"] is None:  # R3 in the entry: its cost per byte, at 201 MB
            us = base_us + (cpu - same_cpu) / r3_here * r3_big
            held = big["memory_bytes"] + (mem - same_mem) / r3_here * r3_big
            wire = big["wire_bytes"] + r3_big
            store_held = store_traffic = float("nan")
            put = get = "-"
        else:  # the entry (control fields, array specs, refs) and the ledger: as measured, per group
            us, held = cpu, mem
            wire = max(held, _median(runs, "entry_bytes"))
            objects = _median(runs, "store_bytes") * per_token  # R3, tokens, log-probs, masks, text
            store_held, store_traffic = held_groups * objects / 1e9, 2 * demand * objects / 1e9
            put = f"{statistics.median(r['store']['put'] for r in runs) / 1e9:.2f}"
            get = f"{statistics.median(r['store']['get'] for r in runs) / 1e9:.2f}"
        rows.append([
            name, us, (1e6 - fixed) / us, f"{(fixed + demand * us) / 1e6:.0%}", held_groups * held / 1e9,
            NIC_BYTES_PER_S / (2 * wire), 2 * demand * wire / 1e6, store_held, store_traffic, put, get,
        ])
    return Table(
        "payload_projection",
        f"Projected: the large run with R3 ({LARGE_RUN['prompts_per_step']} prompts x {LARGE_RUN['n']} a step, a "
        f"step a minute = {demand:.2f} groups/s of 16 x 32k, {r3_big / 1e6:.0f} MB of R3 each; 1,024 producers; "
        f"{held_groups:,} groups held at max_staleness {LARGE_RUN['max_staleness']})",
        ["variant", "Redis CPU us per group", "groups/s on one Redis core", "the run's share of one core",
         f"Redis GB held ({held_groups:,} groups)", "groups/s on Redis' 10 Gbit/s", "Redis MB/s (in + out)",
         "store GB held", "store GB/s (in + out)", "store put GB/s measured here", "store get GB/s measured here"],
        rows,
        [
            f"From docs/scale.md's committed run (bench/out/scale.json): a 16 x 32k group without R3 costs "
            f"{base_us:,.0f} us of Redis CPU (PUBLISH + read + commit + ADMIT) and holds {big['memory_bytes'] / 1e6:.2f} "
            f"MB; 1,024 producers' fixed cost {fixed / 1e3:.0f} ms/s. From this run: inline, R3's Redis CPU and "
            "memory per byte (the R3 row minus the 16 x 8k row without R3, over its R3 bytes) times the 16 x 32k "
            "group's; with a store, the store row's Redis CPU (less Redis' fixed cost a second: the producers' is "
            "counted above) and memory per group as measured: every array "
            "and the text are in the store, and the entry (the control fields, one spec per array, the refs) does "
            "not grow with the tokens (3.9 KB for 16 x 8k, 4.1 KB for 16 x 32k); its bytes on the wire: the "
            f"entry's; the store's bytes: the row's objects times the tokens' ratio ({per_token:.2f}).",
            "Store GB/s: every object put once and fetched once. Measured here: one client, one 50 MB object "
            "at a time, on this 2-core machine (loopback for Mooncake): the floor, not a cluster's figure.",
        ],
        command,
    )


def json_path(quick: bool = False, pin: bool = False) -> Path:
    return OUT / f"payload{'-quick' if quick else ''}{'-pinned' if pin else ''}.json"


def save(result: dict[str, Any], quick: bool, command: str) -> None:
    """The run's figures as JSON (``python -m bench.payload render`` prints the tables again)."""
    data = {**result, "command": command, "variants": [
        {k: getattr(v, k) for k in ("name", "store", "samples", "tokens", "r3", "hold", "flow", "batch", "runs")}
        for v in result["variants"]]}
    json_path(quick, result.get("pinned", False)).write_text(json.dumps(data, indent=1))


def render(data: dict[str, Any], command: str) -> list[Table]:
    result = {**data, "variants": [Variant(**v) for v in data["variants"]]}
    first = [before_table(data["before"], data["before"]["rounds"], command)] if "before" in data else []
    return [*first, *tables(result, command), projection(data, command)]


def run(quick: bool = False, rounds: int | None = None, hold: int | None = None, flow: int | None = None,
        before_rounds: int | None = None, command: str | None = None, pin: bool = False) -> list[Table]:
    """The before table (not with ``pin``: it measures inline Redis alone), then the variants."""
    command = command or "python -m bench payload" + (" --quick" if quick else "")
    sizes = (1024,) if quick else (1024, 8192, 32768)
    b_rounds = before_rounds or (1 if quick else 3)
    first: dict[str, Any] | None = None
    if not pin:
        workdir = Path(tempfile.mkdtemp(prefix="rollstream-bench-before-"))
        try:
            first = {**before(b_rounds, sizes, workdir), "rounds": b_rounds}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    result = measure(rounds or (1 if quick else 3), hold or (1 if quick else 2), flow or (2 if quick else 3),
                     40 if quick else 200, pin)
    if first is not None:
        result["before"] = first
    save(result, quick, command)
    return render(json.loads(json_path(quick, pin).read_text()), command)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.payload", description=__doc__)
    parser.add_argument("what", nargs="?", choices=("run", "render"), default="run",
                        help="render: the tables again from bench/out/payload.json")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hold", type=int, default=4, help="R3 groups held (and drained) a round")
    parser.add_argument("--flow", type=int, default=8, help="R3 groups flowing a round (twice)")
    parser.add_argument("--before-rounds", type=int, default=5)
    parser.add_argument("--pin", action="store_true",
                        help=f"redis-server and the other client on CPUs {sorted(REDIS_CPUS)}, the rest elsewhere "
                             "(bench/out/payload-pinned.json; no before table)")
    args = parser.parse_args()
    if args.what == "render":
        data = json.loads(json_path(pin=args.pin).read_text())
        produced = render(data, data.get("command", "python -m bench payload"))
    else:
        command = (f"python -m bench.payload --rounds {args.rounds} --hold {args.hold} --flow {args.flow} "
                   f"--before-rounds {args.before_rounds}{' --pin' if args.pin else ''}")
        produced = run(rounds=args.rounds, hold=args.hold, flow=args.flow, before_rounds=args.before_rounds,
                       command=command, pin=args.pin)
    for table in produced:
        print(table.markdown(), flush=True)


if __name__ == "__main__":
    main()
