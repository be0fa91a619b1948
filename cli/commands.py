"""Core commands: server, init, feed, sim-engine, engines, pause, resume, trainer release
(``produce`` is :mod:`.produce`): one parser block and one short ``cmd_*`` function each."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import time
from typing import Any

from rollstream import ops
from rollstream.common.config import STALENESS_RULES, PipelineConfig
from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError
from rollstream.common.events import now_ms
from rollstream.common.keys import Keys
from rollstream.common.namespace import init_namespace, load_config
from rollstream.common.protocol import (
    EngineRegistry,
    NamespaceLimits,
    check_engine_url,
    format_rate,
    parse_limits_and_rates,
)
from rollstream.common.settings_fields import documented
from rollstream.producer.engine.settings import parse_moe_shape

logger = logging.getLogger("rollstream.cli")

def register(sub: Any, base: list[argparse.ArgumentParser], with_redis: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("server", parents=base, help="run a private redis-server in the foreground")
    p.add_argument("--port", type=int, default=6379, help="TCP port to listen on (default: %(default)s)")
    p.add_argument("--dir", default=None, help="data directory (default: a temporary one)")
    p.add_argument("--appendonly", action="store_true", help="AOF persistence with appendfsync always")
    p.add_argument("--appendfsync", default="always", choices=["always", "everysec", "no"],
                   help="when --appendonly writes reach the disk (default: %(default)s: no acknowledged write lost)")
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("init", parents=with_redis, help="write a namespace's pipeline config")
    p.add_argument("--n-samples", type=int, required=True, help=documented(PipelineConfig, "n_samples_per_prompt"))
    p.add_argument("--batch-size", type=int, required=True, help=documented(PipelineConfig, "batch_size"))
    p.add_argument("--max-staleness", type=int, default=None, help=documented(PipelineConfig, "max_staleness"))
    p.add_argument("--max-backlog", type=int, default=256, help=documented(PipelineConfig, "max_backlog"))
    for flag, name in (("--max-backlog-bytes", "max_backlog_bytes"), ("--max-group-bytes", "max_group_bytes"),
                       ("--archive-bytes", "archive_bytes")):
        default = next(f.default for f in dataclasses.fields(PipelineConfig) if f.name == name)
        p.add_argument(flag, type=parse_bytes, default=default, metavar="SIZE",
                       help=documented(PipelineConfig, name, note="SIZE: bytes, or with a unit (512MiB, 8GiB)."))
    p.add_argument("--payload-store", default="", metavar="URL",
                   help=documented(PipelineConfig, "payload_store", default="none"))
    p.add_argument("--payload-min-bytes", type=parse_bytes, default=64 * 1024, metavar="SIZE",
                   help=documented(PipelineConfig, "payload_min_bytes", note="SIZE: bytes, or with a unit (64KiB)."))
    p.add_argument("--row-stats", type=int, default=0, metavar="K",
                   help="keep each row's statistics over its last K groups, for feed --curriculum (0: none)")
    p.add_argument("--mix", default="", metavar="NAME=WEIGHT,...",
                   help="named sources' weights: every batch take() returns holds each one's share exactly; "
                        "feed them with rollstream feed NAME=PATH ... (default: none, one unnamed source)")
    p.add_argument("--lease", type=float, default=120.0, help=documented(PipelineConfig, "lease_seconds"))
    p.add_argument("--max-attempts", type=int, default=5, help=documented(PipelineConfig, "max_attempts"))
    p.add_argument("--partial-rollout", action=argparse.BooleanOptionalAction, default=True,
                   help=documented(PipelineConfig, "partial_rollout"))
    p.add_argument("--durable-episodes", action="store_true", help=documented(PipelineConfig, "durable_episodes"))
    p.add_argument("--staleness-rule", choices=STALENESS_RULES, default="newest_token",
                   help=documented(PipelineConfig, "staleness_rule"))
    p.add_argument("--no-admission-control", action="store_true",
                   help="turn off staleness-aware admission (on when --max-staleness is set)")
    p.add_argument("--recycle-filtered", action="store_true", help=documented(PipelineConfig, "recycle_filtered"))
    p.add_argument("--heartbeat-timeout", type=float, default=15.0,
                   help=documented(PipelineConfig, "heartbeat_timeout"))
    p.add_argument("--steps-per-version", type=int, default=1, help=documented(PipelineConfig, "steps_per_version"))
    p.add_argument("--limit", action="append", default=[], metavar="NAME=K",
                   help="a namespace-wide limit: `async with episode.limit(NAME)` holds one of K units across "
                        "every producer (repeatable; change at runtime with `rollstream limits set`)")
    p.add_argument("--rate", action="append", default=[], metavar="NAME=R/s",
                   help="a namespace-wide rate (R/s or R/min): `await episode.rate(NAME)` takes a token (repeatable)")
    p.add_argument("--force", action="store_true", help="overwrite a different existing config")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("limits", help="namespace-wide limits and rates: set, list (holders, waiters, waits), remove")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, what, specs in (("set", "set limits (NAME=K) and rates (--rate NAME=R/s)", "NAME=K"),
                                ("list", "every limit and rate: size, holders, waiters, mean wait, peak", ""),
                                ("remove", "delete limits and rates by name", "NAME")):
        a = actions.add_parser(action, parents=with_redis, help=what)
        if specs:
            a.add_argument("specs", nargs="*", metavar=specs)
        if action == "set":
            a.add_argument("--rate", action="append", default=[], metavar="NAME=R/s", help="a rate (R/s or R/min)")
        if action == "list":
            a.add_argument("--json", action="store_true", help="as JSON")
        a.set_defaults(func=cmd_limits)

    p = sub.add_parser("feed", parents=with_redis, help="stream a dataset (JSONL, Parquet, shards) into the prompts")
    p.add_argument("dataset", nargs="+",
                   help="a JSONL or Parquet file, a folder or glob of them (path@[start:stop]: those rows); "
                        "NAME=PATH ... for the named sources of the namespace's mix (rollstream init --mix)")
    epochs = p.add_mutually_exclusive_group()
    epochs.add_argument("--epochs", type=int, default=1, help="passes over the dataset (default: %(default)s)")
    epochs.add_argument("--forever", action="store_true", help="pass over the dataset again and again until stopped")
    p.add_argument("--shuffle", action="store_true", help="shuffle each epoch (a buffered, seeded shuffle)")
    p.add_argument("--seed", type=int, default=0, help="the shuffle's seed (default: %(default)s)")
    p.add_argument("--shuffle-scheme", default="rollstream", choices=["rollstream", "slime"],
                   help="rollstream's shuffle, or slime: the order slime's and miles' --rollout-shuffle "
                        "--rollout-seed give (default: %(default)s)")
    p.add_argument("--shuffle-buffer", type=int, default=65536,
                   help="rows held to shuffle a dataset larger than this (units in a seeded order, rows "
                        "through a seeded buffer); a dataset that fits is fully permuted (docs/running.md) "
                        "(default: %(default)s)")
    p.add_argument("--prompt-key", default="prompt", help="the row field holding the prompt (default: %(default)s)")
    p.add_argument("--label-key", default="label", help="'' for no label (slime's default)")
    p.add_argument("--metadata-key", default=None,
                   help="metadata is this field's object (plus --tool-key's tools), as in slime; "
                        "default: every field other than the prompt and the label")
    p.add_argument("--tool-key", default=None, help="with --metadata-key: the tools field, kept as metadata['tools']")
    p.add_argument("--as-chat", action="store_true",
                   help="a text prompt becomes one user message (slime's --apply-chat-template; the producer's "
                        "--tokenizer renders the template)")
    p.add_argument("--window", type=int, default=256, help="at most this many prompts queued (default: %(default)s)")
    p.add_argument("--curriculum", default=None, metavar="zero-variance|MODULE:FUNCTION",
                   help="ask a sampler of each row's statistics before feeding it (init --row-stats K); "
                        "zero-variance defers rows whose last groups had zero reward variance (docs/running.md)")
    p.add_argument("--curriculum-k", type=int, default=1, help="zero-variance: groups looked at (default: %(default)s)")
    p.add_argument("--curriculum-offer", type=float, default=0.1,
                   help="zero-variance: probability a deferred row is fed anyway each epoch (default: %(default)s)")
    p.add_argument("--curriculum-max-gap", type=int, default=4,
                   help="zero-variance: a row is fed whatever its history once its last group is this many epochs "
                        "old (default: %(default)s)")
    p.set_defaults(func=cmd_feed)

    p = sub.add_parser("sim-engine", parents=base, help="run the engine simulator (an SGLang test double)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="TCP port to listen on (default: %(default)s)")
    from rollstream.testing.sim.model import SimConfig  # its fields' docstrings are the flags' help

    for name in ("seed", "accuracy", "mean_tokens", "length_sigma", "latency_per_token", "base_latency",
                 "max_running", "weight_version"):
        default = getattr(SimConfig(), name)
        p.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                       help=documented(SimConfig, name))
    p.add_argument("--no-weight-version", action="store_true", help="omit meta_info.weight_version")
    p.add_argument("--moe", type=parse_moe_shape, default=None, metavar="LAYERSxTOPKxEXPERTS",
                   help="answer return_routed_experts with a routing replay of this shape")
    p.add_argument("--prefix-cache-tokens", type=int, default=0,
                   help="a prefix cache of this many tokens (meta_info.cached_tokens); 0: none")
    p.add_argument("--prefill-per-token", type=float, default=0.0,
                   help="seconds per prompt token not in the prefix cache")
    p.add_argument("--kv-capacity-tokens", type=int, default=0,
                   help="KV memory in tokens: requests beyond it queue, and are preempted when the running ones "
                        "outgrow it (recomputed at --prefill-per-token); 0: unlimited")
    p.set_defaults(func=cmd_sim_engine)

    p = sub.add_parser("pause", parents=with_redis, help="stop producers from admitting new prompts")
    p.set_defaults(func=cmd_pause)
    p = sub.add_parser("resume", parents=with_redis, help="let producers admit again")
    p.add_argument("--version", type=int, default=None, help="record this weight version first")
    p.set_defaults(func=cmd_resume)

    p = sub.add_parser(
        "release-trainer", parents=with_redis,
        help="move a gone trainer consumer's uncommitted groups back to the stream and delete it",
    )
    p.add_argument("--consumer", required=True, metavar="NAME",
                   help="the trainer's consumer name (GroupConsumer.connect)")
    p.set_defaults(func=cmd_release_trainer)

    p = sub.add_parser("engines", help="the engine registry: producers with --engines-from-registry follow it")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, what in (("add", "register engines (active)"), ("drain", "no new requests; in-flight ones finish"),
                         ("remove", "forget engines (producers drain, then drop them)"), ("list", "the registry")):
        a = actions.add_parser(action, parents=with_redis, help=what)
        a.add_argument("urls", nargs="*", metavar="URL", help="http(s) engine URLs, without credentials")
        if action == "list":
            a.add_argument("--json", action="store_true", help="as JSON")
        a.set_defaults(func=cmd_engines)


def run_with_signals(main: Any, on_signal: Any) -> None:
    """Run ``main`` (a coroutine function) with SIGTERM/SIGINT calling ``on_signal()``."""

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await main()

    asyncio.run(runner())


def cmd_server(args: argparse.Namespace) -> int:
    from rollstream.runtime.redis_server import EmbeddedRedis

    server = EmbeddedRedis(port=args.port, dir=args.dir, appendonly=args.appendonly, appendfsync=args.appendfsync)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with server:
        logger.info("redis-server %s ready at %s (data in %s)", server.binary, server.url, server.dir)
        while not stopping and server.process is not None and server.process.poll() is None:
            time.sleep(0.2)
    return 0


async def _with_redis(url: str, work: Any) -> Any:
    redis = connect(url, name="rollstream-cli")
    try:
        return await work(redis)
    finally:
        await redis.aclose()


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


def parse_bytes(value: str) -> int:
    """A size such as ``8GiB``, ``500MB`` or ``1048576`` in bytes (argparse type)."""
    number = value.strip().rstrip("bBiIkKmMgGtT")
    unit = value.strip()[len(number):].lower()
    try:
        size = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{value!r} is not a size (e.g. 8GiB, 500MB, 1048576)") from None
    if size < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative")
    return int(size)


def cmd_init(args: argparse.Namespace) -> int:
    config = PipelineConfig(
        n_samples_per_prompt=args.n_samples,
        batch_size=args.batch_size,
        max_staleness=args.max_staleness,
        max_backlog=args.max_backlog,
        lease_seconds=args.lease,
        max_attempts=args.max_attempts,
        partial_rollout=args.partial_rollout,
        durable_episodes=args.durable_episodes,
        staleness_rule=args.staleness_rule,
        admission_control=False if args.no_admission_control else None,
        recycle_filtered=args.recycle_filtered,
        heartbeat_timeout=args.heartbeat_timeout,
        steps_per_version=args.steps_per_version,
        max_backlog_bytes=args.max_backlog_bytes,
        max_group_bytes=args.max_group_bytes,
        archive_bytes=args.archive_bytes,
        payload_store=args.payload_store,
        payload_min_bytes=args.payload_min_bytes,
        mix=args.mix,
        row_stats=args.row_stats,
    )
    keys = Keys(args.ns)
    limits, rates = parse_limits_and_rates(args.limit, args.rate)

    async def work(redis: Any) -> bool:
        written = await init_namespace(redis, keys, config, force=args.force)
        await NamespaceLimits(redis, keys).set(limits, rates)
        return written

    written = asyncio.run(_with_redis(args.redis, work))
    logger.info("namespace %s %s: %s", args.ns, "initialised" if written else "unchanged", config)
    return 0


def named_sources(specs: list[str]) -> dict[str, str]:
    """``NAME=PATH`` arguments as ``{name: path}``; empty for one plain path."""
    from rollstream.common.mix import check_source_name

    if len(specs) == 1 and ("=" not in specs[0] or os.path.exists(specs[0])):
        return {}
    named: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise ConfigError(f"{spec!r}: several datasets are fed as named sources, NAME=PATH")
        if name in named:
            raise ConfigError(f"source {name!r} is named twice")
        named[check_source_name(name)] = path
    return named


def cmd_limits(args: argparse.Namespace) -> int:
    keys = Keys(args.ns)
    if args.action == "set":
        limits, rates = parse_limits_and_rates(args.specs, args.rate)
        if not limits and not rates:
            raise ConfigError("limits set: give NAME=K and/or --rate NAME=R/s")

        async def set_limits(redis: Any) -> None:
            await load_config(redis, keys)  # a namespace that does not exist: NamespaceNotInitialized
            await NamespaceLimits(redis, keys).set(limits, rates)

        asyncio.run(_with_redis(args.redis, set_limits))
        logger.info("namespace %s: limits %s, rates %s", args.ns, limits,
                    {n: format_rate(r) for n, r in rates.items()})
        return 0
    if args.action == "remove":
        if not args.specs:
            raise ConfigError("limits remove: give the names to remove")

        async def remove_limits(redis: Any) -> int:
            await load_config(redis, keys)
            return await NamespaceLimits(redis, keys).remove(args.specs, now_ms())

        removed = asyncio.run(_with_redis(args.redis, remove_limits))
        logger.info("namespace %s: %d limit/rate field(s) removed", args.ns, removed)
        return 0
    views = asyncio.run(_with_redis(args.redis, lambda r: NamespaceLimits(r, keys).views()))
    rows = [v.as_dict() for v in views]
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    sys.stdout.write(f"{'name':<16} {'kind':<6} {'size':>10} {'holders':>8} {'waiters':>8} {'granted':>8} "
                     f"{'mean wait s':>11} {'peak':>5}\n")
    for row in rows:
        sys.stdout.write(f"{row['name']:<16} {row['kind']:<6} {row['size']!s:>10} {row['holders']:>8} "
                         f"{row['waiters']:>8} {row['acquired']:>8} {row['mean_wait_s']:>11} {row['peak']:>5}\n")
    return 0


def curriculum_of(args: argparse.Namespace) -> Any:
    """The feed command's curriculum sampler, or None."""
    if args.curriculum is None:
        return None
    from rollstream.producer.curriculum import load_sampler

    options = {}
    if args.curriculum == "zero-variance":
        options = {"k": args.curriculum_k, "offer": args.curriculum_offer, "max_gap": args.curriculum_max_gap}
    return load_sampler(args.curriculum, **options)


def cmd_feed(args: argparse.Namespace) -> int:
    from rollstream.common.datasets import RowFormat, open_dataset
    from rollstream.producer.feeder import Feeder, FeedSettings

    settings = FeedSettings(
        namespace=args.ns,
        epochs=None if args.forever else args.epochs,
        shuffle=args.shuffle,
        seed=args.seed,
        window=args.window,
        shuffle_scheme=args.shuffle_scheme,
        shuffle_buffer=args.shuffle_buffer,
        curriculum=curriculum_of(args),
    )
    row_format = RowFormat(args.prompt_key, args.label_key or None, args.metadata_key, args.tool_key, args.as_chat)
    named = named_sources(args.dataset)
    datasets: Any = (
        {name: open_dataset(path, row_format) for name, path in named.items()} if named
        else open_dataset(args.dataset[0], row_format)
    )
    redis = connect(args.redis, name="rollstream-feeder")
    feeder = Feeder(redis, datasets, settings)

    async def main() -> None:
        try:
            await feeder.run()
        finally:
            await redis.aclose()

    run_with_signals(main, feeder.stop)
    return 0


def cmd_sim_engine(args: argparse.Namespace) -> int:
    from rollstream.testing.sim.simulator import SimConfig, serve

    config = SimConfig(
        seed=args.seed,
        accuracy=args.accuracy,
        mean_tokens=args.mean_tokens,
        length_sigma=args.length_sigma,
        latency_per_token=args.latency_per_token,
        base_latency=args.base_latency,
        max_running=args.max_running,
        weight_version=args.weight_version,
        report_weight_version=not args.no_weight_version,
        moe=args.moe,
        prefix_cache_tokens=args.prefix_cache_tokens,
        prefill_per_token=args.prefill_per_token,
        kv_capacity_tokens=args.kv_capacity_tokens,
    )
    task: dict[str, asyncio.Task[None]] = {}

    async def main() -> None:
        task["serve"] = asyncio.create_task(serve(config, args.host, args.port))
        with contextlib.suppress(asyncio.CancelledError):
            await task["serve"]

    def on_signal() -> None:
        if "serve" in task:
            task["serve"].cancel()

    run_with_signals(main, on_signal)
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    urls = [check_engine_url(u) for u in args.urls] if args.action in ("add", "drain") else list(args.urls)
    if args.action != "list" and not urls:
        raise ConfigError(f"rollstream engines {args.action} needs at least one URL")

    async def work(redis: Any) -> int:
        registry = EngineRegistry(redis, Keys(args.ns))
        if args.action == "add":
            await registry.add(urls)
            logger.info("registered %s in namespace %s", ", ".join(urls), args.ns)
        elif args.action == "drain":
            missing = await registry.drain(urls)
            if missing:
                raise ConfigError(f"not registered in namespace {args.ns}: {', '.join(missing)}")
            logger.info("draining %s in namespace %s", ", ".join(urls), args.ns)
        elif args.action == "remove":
            removed = await registry.remove(urls)
            logger.info("removed %d of %d engines from namespace %s", removed, len(urls), args.ns)
        else:
            entries = await registry.entries()
            if getattr(args, "json", False):
                print(json.dumps([dataclasses.asdict(e) for e in entries.values()], indent=2))
            else:
                for e in sorted(entries.values(), key=lambda e: e.url):
                    print(f"{e.url}\t{e.state or 'DAMAGED: ' + e.damage}\t{e.by}")
        return 0

    result: int = asyncio.run(_with_redis(args.redis, work))
    return result


def cmd_pause(args: argparse.Namespace) -> int:
    keys = Keys(args.ns)
    asyncio.run(_with_redis(args.redis, lambda r: ops.pause(r, keys)))
    logger.info("namespace %s paused: producers admit nothing until `rollstream resume`", args.ns)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    keys = Keys(args.ns)
    asyncio.run(_with_redis(args.redis, lambda r: ops.resume(r, keys, args.version)))
    logger.info("namespace %s resumed%s", args.ns, "" if args.version is None else f" at version {args.version}")
    return 0


def cmd_release_trainer(args: argparse.Namespace) -> int:
    keys = Keys(args.ns)
    moved = asyncio.run(_with_redis(args.redis, lambda r: ops.release_consumer(r, keys, args.consumer)))
    sys.stdout.write(f"moved {moved} uncommitted groups of {args.consumer!r} back to the stream\n")
    return 0
