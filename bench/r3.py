"""Routing replay (R3) on the wire and in Redis: bytes per token, encode/decode time, take() vs raw
XREADGROUP of the same bytes, Redis memory per group, and the largest batch one Redis node holds.

Groups of 8 samples (64 prompt + R response tokens, log-probs, loss masks) each with a 48-layer
top-8 routing replay (``(len(tokens) - 1, 48, 8)`` expert ids of 128 experts: uint8 on the wire).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from redis.exceptions import OutOfMemoryError
from rollstream.common.codec import decode_group, encode_group, group_fields
from rollstream.common.connection import connect
from rollstream.common.keys import Keys
from rollstream.common.namespace import MEMORY_HEADROOM
from rollstream.runtime.redis_server import EmbeddedRedis

from bench.codec import _time
from bench.common import PROMPT_TOKENS, R3_SHAPE, Table, make_group
from bench.take import _child, _hiredis_installed

N = 8
NODE_MAXMEMORY = 64 * 2**30
"""The Redis node the capacity table is stated for (64 GiB maxmemory)."""


def _codec_rows(sizes: list[int], budget: float) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for tokens in sizes:
        for label, r3, code in (("no R3", False, "B"), ("R3 uint8", True, "B"), ("R3 as int32", True, "i")):
            group = make_group(N, tokens, r3=r3, r3_code=code)
            payload = encode_group(group)
            enc = _time(lambda g=group: encode_group(g), budget)  # type: ignore[misc]
            dec = _time(lambda p=payload: decode_group(p), budget)  # type: ignore[misc]
            views = _time(lambda p=payload: decode_group(p, views=True), budget)  # type: ignore[misc]
            rows.append([f"8 x {tokens // 1024}k", label, len(payload) / 2**20, len(payload) / (N * tokens),
                         enc * 1e3, dec * 1e3, views * 1e3])
            del group, payload
    return rows


async def _redis_memory(tokens: int, count: int) -> dict[str, float]:
    """used_memory per group and its ratio to the payload, from ``count`` groups added."""
    fields = group_fields(make_group(N, tokens, r3=True))
    payload = len(fields["data"])
    with EmbeddedRedis() as server:
        redis = connect(server.url)
        base = int((await redis.info("memory"))["used_memory"])
        for i in range(count):
            await redis.xadd("rollstream:{mem}:groups", {**fields, "index": i})
        used = int((await redis.info("memory"))["used_memory"]) - base
        await redis.aclose()
    return {"payload": payload, "per_group": used / count, "ratio": used / count / payload, "count": count}


async def _fill_until_oom(tokens: int, maxmemory: int) -> dict[str, float]:
    """Groups added to a ``noeviction`` Redis of ``maxmemory`` until it refuses one (OOM)."""
    fields = group_fields(make_group(N, tokens, r3=True))
    with EmbeddedRedis() as server:
        redis = connect(server.url)
        await redis.config_set("maxmemory-policy", "noeviction")
        base = int((await redis.info("memory"))["used_memory"])
        await redis.config_set("maxmemory", maxmemory)
        held = 0
        while True:
            try:
                await redis.xadd(Keys("cap").groups, {**fields, "index": held})
            except OutOfMemoryError:
                break
            held += 1
        used = int((await redis.info("memory"))["used_memory"])
        await redis.aclose()
    return {"held": held, "payload": len(fields["data"]), "base": base, "used": used}


def run(quick: bool = False) -> list[Table]:
    sizes = [1024] if quick else [8192, 32768]
    rows = _codec_rows(sizes, 0.05 if quick else 1.0)
    tables = [Table(
        "r3_codec",
        "R3 on the wire: payload and encode/decode time of one group (8 samples, 48 layers x top-8 of 128 experts)",
        ["group", "replay", "payload MiB", "B/token", "encode ms", "decode ms (copy)", "decode ms (views, take())"],
        rows,
        [
            f"B/token = payload bytes / response tokens (the {PROMPT_TOKENS} prompt ids per sample and their replay "
            "rows included): ids 4 + log-prob 4 + mask 1 + replay 384 (uint8) or 1536 (int32, what slime and miles "
            "hold in memory).",
            "R3 as int32: the same ids in an int32 Packed array (what a 'smallest dtype' codec avoids).",
            "decode (views) is what take() runs: the replay is a memoryview on the payload, not a copy.",
        ],
        "python -m bench r3",
    )]

    groups, tokens, repeat = (8, 256, 1) if quick else (64, 2048, 3)
    take_rows: list[list[Any]] = []
    payload_mib = 0.0
    for parser in ("hiredis",) if _hiredis_installed() else ("python",):
        result = _child(parser, groups, tokens, repeat, r3=True)
        payload_mib = result["payload"] / 2**20
        raw_t, raw_p = result["times"]["raw"], result["peaks"]["raw"]
        for name in ("raw", "raw+decode", "take"):
            t, p = result["times"][name], result["peaks"][name]
            take_rows.append([parser, name, t * 1e3, t / raw_t, p / 2**20, p / raw_p])
    tables.append(Table(
        "r3_take",
        f"take({groups}) of 8 x {tokens // 1024 or tokens}{'k' if tokens >= 1024 else ''}-token R3 groups vs raw "
        f"XREADGROUP of the same bytes ({payload_mib:.0f} MiB)",
        ["reply parser", "call", "ms (median)", "x raw time", "peak MiB (tracemalloc)", "x raw peak"],
        take_rows,
        [
            f"{groups} groups of 8 samples x ({tokens} response + 64 prompt tokens) with log-probs, masks and a "
            f"48 x 8 uint8 routing replay; median of {repeat} interleaved runs (bench/take.py's machinery).",
            "raw: XREADGROUP COUNT n + XACK + XDEL; take: GroupConsumer.take(n) + commit. Target <= 1.1x raw time "
            "and peak.",
        ],
        "python -m bench r3",
    ))

    mem_tokens = 256 if quick else 2048
    mem = asyncio.run(_redis_memory(mem_tokens, 4 if quick else 32))
    cap_max = 64 * 2**20 if quick else 512 * 2**20
    cap = asyncio.run(_fill_until_oom(mem_tokens, cap_max))
    predicted = int((cap_max - cap["base"]) / mem["per_group"])
    filled_ratio = (cap["used"] - cap["base"]) / cap["held"] / cap["payload"]
    node_rows: list[list[Any]] = [
        [f"8 x {mem_tokens}", f"{mem['count']:.0f} groups added", "none", mem["payload"] / 2**20, mem["ratio"], "-", "-"],
        [f"8 x {mem_tokens}", "filled until OOM", f"{cap_max / 2**20:.0f} MiB", cap["payload"] / 2**20, filled_ratio,
         cap["held"], predicted],
    ]
    ratio = max(mem["ratio"], filled_ratio)
    for node_tokens in (8192, 32768):
        payload = N * (PROMPT_TOKENS + node_tokens) * (4 + R3_SHAPE[0] * R3_SHAPE[1]) + N * node_tokens * 5
        usable = NODE_MAXMEMORY * (1 - MEMORY_HEADROOM)
        node_rows.append([f"8 x {node_tokens // 1024}k", "computed", "64 GiB", payload / 2**20, ratio,
                          int(usable / (payload * ratio)), "-"])
    tables.append(Table(
        "r3_redis",
        "Redis memory per R3 group and the largest batch one node holds",
        ["group", "how", "maxmemory", "payload MiB", "used_memory / payload", "groups held", "predicted"],
        node_rows,
        [
            "used_memory / payload: the growth of Redis' used_memory over the payload bytes (the data fields): "
            "stream node and field overhead, allocator size classes.",
            "filled until OOM: groups added to a noeviction Redis with that maxmemory until it refuses one; "
            "predicted = (maxmemory - memory in use before) / the per-group memory of the row above.",
            f"computed: a 64 GiB node, {MEMORY_HEADROOM:.0%} kept as headroom (what `rollstream init` requires of "
            "max_backlog_bytes), payload from the codec's layout times the larger measured ratio: the most groups "
            "(ready + taken) one node holds, i.e. the largest batch and max_backlog_bytes it fits.",
        ],
        "python -m bench r3",
    ))
    return tables


if __name__ == "__main__":
    started = time.monotonic()
    for table in run():
        print(table.markdown())
    print(f"({time.monotonic() - started:.0f} s)")
