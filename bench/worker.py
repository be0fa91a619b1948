"""A benchmark child process: a rollstream Producer on an engine double, or a raw redis-py writer.

``python -m bench.worker produce --redis URL --ns NS --tokens 1024`` runs a real
:class:`Producer` whose :class:`EngineClient` talks to the in-process instant engine
(``httpx.MockTransport``), to no engine at all (``--engine none``) or to ``--engine URL`` (the
simulator). ``BENCH_PROFILE=path`` wraps the run in cProfile and writes its text report there.

``python -m bench.worker raw --redis URL --stream S --count K`` XADDs ``K`` copies of the
encoded payload of a 8 x ``--tokens`` group, pipelined, keeping the stream under ``--cap``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import signal
from typing import Any

from rollstream.common import lua
from rollstream.common.codec import group_fields
from rollstream.common.connection import connect
from rollstream.common.protocol import PromptQueue
from rollstream.producer import gcpolicy, worker
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.episode_runtime import EpisodeLimits
from rollstream.producer.plugin import load_generate
from rollstream.producer.rewards import load_reward
from rollstream.producer.settings import EpisodeSettings, ProducerSettings
from rollstream.producer.worker import Producer

from bench.common import ConstReward, NoEngine, instant_transport, make_group
from bench.http_client import AiohttpTransport

PENDING_BEFORE = """
local function pending(key, group)
  local p = redis.pcall('XPENDING', key, group)
  if type(p) ~= 'table' or p.err then return 0 end
  return tonumber(p[1]) or 0
end
"""
"""ADMIT's pending-count helper before docs/scale.md's fix (XPENDING's summary: O(consumers))."""

ADMIT_BEFORE = dataclasses.replace(lua.ADMIT, source=lua.ADMIT.source.replace(lua.PRELUDES["pending"], PENDING_BEFORE))


def _before() -> None:
    """The producer as it was before docs/scale.md's fixes: ADMIT with the XPENDING-summary
    helper, every producer looking for idle prompts every reclaim interval (no turn, no
    announcement), and a full backlog polled every 0.2 s."""
    assert ADMIT_BEFORE != lua.ADMIT
    original = PromptQueue.__init__

    def init(self: PromptQueue, redis: Any, keys: Any, consumer: str) -> None:
        original(self, redis, keys, consumer)
        self._admit = ADMIT_BEFORE.bind(redis, keys)

    async def every_producer_scans(self: PromptQueue, interval_ms: int) -> tuple[bool, int]:
        return True, 0

    async def no_announcement(self: PromptQueue) -> None:
        return None

    PromptQueue.__init__ = init
    worker.BACKLOG_RETRY = 0.2
    PromptQueue.reclaim_turn = every_producer_scans
    PromptQueue.announce_reclaim = no_announcement


VARIANTS: dict[str, Any] = {"before": _before}
"""Name -> a function that patches the producer back to an earlier version of one path."""


async def produce(args: argparse.Namespace) -> None:
    engine: EngineClient
    if args.engine == "none":
        engine = NoEngine(args.tokens, EngineSettings(urls=("http://none",), max_new_tokens=args.max_new_tokens))
    elif args.engine:
        settings = EngineSettings(urls=(args.engine,), max_new_tokens=args.max_new_tokens)
        transport = None
        if args.transport == "aiohttp":
            transport = AiohttpTransport(max_connections=settings.max_connections, connect_timeout=settings.connect_timeout)
        engine = EngineClient(settings, transport=transport)
    else:
        engine = EngineClient(
            EngineSettings(urls=("http://instant",), max_new_tokens=args.max_new_tokens),
            transport=instant_transport(args.tokens, args.delay),
        )
    reward = load_reward(args.reward) if args.reward != "const" else ConstReward()
    settings = ProducerSettings(
        namespace=args.ns, concurrency=args.concurrency, name=args.name, drain_timeout=5.0,
        episodes=EpisodeSettings(
            generate=load_generate(args.generate) if args.generate else None,
            limits=EpisodeLimits(engine_concurrency=args.engine_concurrency),
            tokenize_prompts=False,
        ),
    )
    if args.variant:
        VARIANTS[args.variant]()
    producer = await Producer.connect(args.redis, settings, engine, reward)
    gcpolicy.tune(args.gc_threshold)  # as `rollstream produce` does
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, producer.stop)
    try:
        await producer.run()
    finally:
        await producer.aclose()
        await engine.aclose()


async def raw(args: argparse.Namespace) -> None:
    fields: dict[Any, Any] = group_fields(make_group(8, args.tokens))
    redis = connect(args.redis)
    sent = 0
    try:
        while sent < args.count:
            k = min(args.pipeline, args.count - sent)
            async with redis.pipeline(transaction=False) as pipe:
                for _ in range(k):
                    pipe.xadd(args.stream, fields)
                pipe.xlen(args.stream)
                *_, length = await pipe.execute()
            sent += k
            while length >= args.cap:
                await asyncio.sleep(0.002)
                length = await redis.xlen(args.stream)
    finally:
        await redis.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench.worker")
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("produce")
    p.add_argument("--redis", required=True)
    p.add_argument("--ns", required=True)
    p.add_argument("--name", default=f"bench-{os.getpid()}")
    p.add_argument("--engine", default="",
                   help="engine URL; 'none': no engine at all (prebuilt replies); default: the in-process instant engine")
    p.add_argument("--transport", default="http11", choices=["http11", "aiohttp"],
                   help="with --engine URL: the default transport, or aiohttp (bench.http_client's, the one before)")
    p.add_argument("--gc-threshold", type=int, default=None, help="as rollstream produce's (0: Python's own GC)")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=16384)
    p.add_argument("--reward", default="const")
    p.add_argument("--generate", default="", help="a rollout plug-in (module:function); default single-turn")
    p.add_argument("--engine-concurrency", type=int, default=None)
    p.add_argument("--variant", default="", choices=["", *VARIANTS],
                   help="run an earlier version of one producer path (bench.scale's before/after)")
    r = sub.add_parser("raw")
    r.add_argument("--redis", required=True)
    r.add_argument("--stream", required=True)
    r.add_argument("--count", type=int, required=True)
    r.add_argument("--tokens", type=int, default=1024)
    r.add_argument("--pipeline", type=int, default=8)
    r.add_argument("--cap", type=int, default=256)
    args = parser.parse_args()
    run = produce if args.mode == "produce" else raw
    profile = os.environ.get("BENCH_PROFILE")
    if profile and args.mode == "produce":
        import cProfile
        import io
        import pstats

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            with contextlib.suppress(KeyboardInterrupt):
                asyncio.run(run(args))
        finally:
            profiler.disable()
            profiler.dump_stats(profile + ".pstats")  # for pstats / snakeviz: callers, callees
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)
            with open(profile, "w") as handle:
                handle.write(text.getvalue())
        return
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
