"""Core commands: server, init, feed, produce, sim-engine, pause, resume, trainer release.

Why over 500 lines: one parser block and one ``cmd_*`` function per command, each short; the
longest, ``produce``, is mostly the mapping of its flags onto the settings classes (the reward
and the generate function come from their one loader each: :func:`rollstream.producer.rewards.load_reward`,
``rollstream.producer.plugin.load_generate``)."""

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
from collections.abc import Mapping
from typing import Any

from rollstream import ops
from rollstream.common.config import PipelineConfig
from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.namespace import init_namespace
from rollstream.common.protocol import EngineRegistry, check_engine_url
from rollstream.producer.engine.settings import ENGINE_APIS

logger = logging.getLogger("rollstream.cli")

REWARD_ARGS = "ROLLSTREAM_REWARD_ARGS"


def register(sub: Any, base: list[argparse.ArgumentParser], with_redis: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("server", parents=base, help="run a private redis-server in the foreground")
    p.add_argument("--port", type=int, default=6379)
    p.add_argument("--dir", default=None, help="data directory (default: a temporary one)")
    p.add_argument("--appendonly", action="store_true", help="AOF persistence with appendfsync always")
    p.add_argument("--appendfsync", default="always", choices=["always", "everysec", "no"])
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("init", parents=with_redis, help="write a namespace's pipeline config")
    p.add_argument("--n-samples", type=int, required=True, help="samples per prompt (group size)")
    p.add_argument("--batch-size", type=int, required=True, help="groups per training step")
    p.add_argument("--max-staleness", type=int, default=None)
    p.add_argument("--max-backlog", type=int, default=256)
    p.add_argument(
        "--max-backlog-bytes", type=parse_bytes, default=0, metavar="SIZE",
        help="byte budget of the groups held in Redis (e.g. 8GiB; 0 = none); checked against maxmemory",
    )
    p.add_argument(
        "--max-group-bytes", type=parse_bytes, default=512 * 1024 * 1024, metavar="SIZE",
        help="a larger group is dead-lettered (group_too_large), default 512MiB",
    )
    p.add_argument("--lease", type=float, default=120.0, help="prompt lease in seconds")
    p.add_argument("--max-attempts", type=int, default=5)
    p.add_argument("--partial-rollout", action="store_true", help="continue aborted samples")
    p.add_argument("--no-admission-control", action="store_true", help="disable staleness-aware admission")
    p.add_argument("--recycle-filtered", action="store_true", help="recycle groups the keep filter rejects")
    p.add_argument("--heartbeat-timeout", type=float, default=15.0)
    p.add_argument(
        "--steps-per-version", type=int, default=1,
        help="training steps per weight version (staleness-aware admission; docs/staleness.md)",
    )
    p.add_argument("--force", action="store_true", help="overwrite a different existing config")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("feed", parents=with_redis, help="feed a JSONL dataset into the prompt stream")
    p.add_argument("dataset", help="JSONL file, one object per line")
    epochs = p.add_mutually_exclusive_group()
    epochs.add_argument("--epochs", type=int, default=1)
    epochs.add_argument("--forever", action="store_true")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shuffle-scheme", default="rollstream", choices=["rollstream", "slime"],
                   help="slime: the order slime's and miles' --rollout-shuffle --rollout-seed give")
    p.add_argument("--prompt-key", default="prompt")
    p.add_argument("--label-key", default="label", help="'' for no label (slime's default)")
    p.add_argument("--metadata-key", default=None,
                   help="metadata is this field's object (plus --tool-key's tools), as in slime; "
                        "default: every field other than the prompt and the label")
    p.add_argument("--tool-key", default=None, help="with --metadata-key: the tools field, kept as metadata['tools']")
    p.add_argument("--as-chat", action="store_true",
                   help="a text prompt becomes one user message (slime's --apply-chat-template; the producer's "
                        "--tokenizer renders the template)")
    p.add_argument("--window", type=int, default=256, help="at most this many prompts queued")
    p.set_defaults(func=cmd_feed)

    p = sub.add_parser("produce", parents=with_redis, help="run a rollout producer")
    p.add_argument("--engine", action="append", default=[], metavar="URL",
                   help="engine URL (repeatable; or --engines-from-registry)")
    p.add_argument("--engine-api", default="sglang", choices=ENGINE_APIS,
                   help="vllm: vLLM's /inference/v1/generate (token ids, weight version spans)")
    p.add_argument("--request-seed", action="store_true",
                   help="send a random per-request seed (vllm API; kills vLLM's CPU engine on reschedule)")
    p.add_argument("--model", default=None, help="model name (OpenAI-compatible engines)")
    p.add_argument("--tokenizer", default=None, metavar="NAME_OR_PATH",
                   help="tokenize prompts and render chat templates locally (Hugging Face name/path, "
                        "needs the transformers extra; or module:attribute)")
    stored = " (default: the run's stored rollout flags, see docs/integrations.md)"
    p.add_argument("--concurrency", type=int, default=None, help="samples in flight at most" + stored)
    p.add_argument(
        "--reward", default=None, metavar="SPEC",
        help="math | remote:URL | module:function | slime:module.fn | slime-group:module.fn (also miles:)" + stored,
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 1024" + stored)
    p.add_argument("--temperature", type=float, default=None, help="default 1.0" + stored)
    p.add_argument("--top-p", type=float, default=None, help="default 1.0" + stored)
    p.add_argument("--n-samples", type=int, default=None, help="must match the namespace config")
    p.add_argument("--name", default=None, help="producer id (default host-pid)")
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--heartbeat-interval", type=float, default=2.0)
    p.add_argument("--engines-from-registry", action="store_true",
                   help="use the namespace's engine registry (`rollstream engines add|drain|remove`), re-read "
                        "every heartbeat, alone or beside the --engine URLs")
    p.add_argument("--max-retries", type=int, default=5, help="engine retries per request")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between the engine monitor's probes of engines in trouble (docs/engines.md)")
    p.add_argument("--health-timeout", type=float, default=5.0,
                   help="an engine whose /health gives no answer this long while its requests wait is wedged")
    p.add_argument("--eject-after", type=int, default=3,
                   help="failed requests in a row (5xx, unusable replies) that take an engine out of routing")
    p.add_argument("--route-balance", type=float, default=0.25,
                   help="cache-aware routing keeps each engine within (1 + this) x the mean load")
    p.add_argument("--no-engine-timeout", type=float, default=120.0,
                   help="seconds a request waits while no engine is usable before the producer fails")
    p.add_argument("--catch-up-engines", action="store_true",
                   help="load the trainer's recorded weights (WeightSync.update, GroupConsumer.record_weights) into "
                        "an engine found behind, then let it rejoin (docs/engines.md)")
    p.add_argument("--adaptive-concurrency", action=argparse.BooleanOptionalAction, default=True,
                   help="limit each engine's samples in flight by its own load (KV usage, preemptions), between "
                        "--concurrency-floor and --concurrency (docs/engines.md)")
    p.add_argument("--concurrency-floor", type=int, default=4,
                   help="the least samples in flight an engine's adaptive limit allows")
    p.add_argument("--request-timeout", type=float, default=3600.0,
                   help="seconds one engine request may take in total, reply body included")
    p.add_argument("--max-reply-mib", type=float, default=None,
                   help="largest engine reply accepted, in MiB (checked while reading); default: derived per "
                        "request from --max-new-tokens, n and log-probs (docs/engines.md)")
    p.add_argument("--reward-timeout", type=float, default=300.0,
                   help="seconds the reward may take on one group; past it the group fails (recycled)")
    p.add_argument("--reward-failure-limit", type=int, default=8,
                   help="the reward failing on this many distinct prompts in a row is fatal (a broken reward)")
    p.add_argument("--engine-failure-limit", type=int, default=8,
                   help="an engine (or all engines) refusing or answering unusable replies on this many "
                        "distinct prompts in a row is fatal (a broken engine)")
    p.add_argument("--long-request-after", type=float, default=600.0,
                   help="seconds after which an engine request in flight is reported as long (inspect warns)")
    p.add_argument("--loop-stall-after", type=float, default=None, metavar="SECONDS",
                   help="event-loop lag that counts as a stall, logged with the code that blocked the loop "
                        "(default: a fifth of the lease, at most 5 s)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="0.0.0.0")
    p.add_argument("--gc-threshold", type=int, default=None, metavar="N",
                   help="once started, freeze the start-up heap and run Python's young garbage collection "
                        "every N net allocations (default 50000; 0: Python's own 700, nothing frozen)")
    p.add_argument(
        "--routed-experts", type=parse_moe_shape, default=None, metavar="LAYERSxTOPKxEXPERTS",
        help="ask the engine for the MoE routing replay (R3: SGLang's return_routed_experts, vLLM's "
             "choices[].routed_experts with --engine-api vllm; the server runs with "
             "--enable-return-routed-experts), e.g. 48x8x128; checked against this shape",
    )
    p.add_argument("--engine-stats", action="store_true",
                   help="record SGLang's prefix-cache and speculative-decoding counters per sample")
    p.add_argument(
        "--teacher-engine", action="append", default=None, metavar="URL",
        help="score every response on this SGLang teacher (log-probs of the response tokens: "
             "teacher_log_probs, on-policy distillation); repeatable",
    )
    add_episode_arguments(p)
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("sim-engine", parents=base, help="run the engine simulator (an SGLang test double)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accuracy", type=float, default=0.7)
    p.add_argument("--mean-tokens", type=int, default=64)
    p.add_argument("--length-sigma", type=float, default=0.5)
    p.add_argument("--latency-per-token", type=float, default=0.0)
    p.add_argument("--base-latency", type=float, default=0.0)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--weight-version", type=int, default=0)
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
    p.add_argument("--consumer", required=True)
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


def add_episode_arguments(p: argparse.ArgumentParser) -> None:
    """The rollout plug-in and its caps (docs/rollouts.md), shared by ``produce`` and ``demo``."""
    p.add_argument("--generate", default=None, metavar="MODULE:FUNCTION",
                   help="the rollout plug-in: async def generate(episode) -> Sample | list[Sample] "
                        "(default: the single-turn rollout); slime:pkg.mod.fn / miles:pkg.mod.fn run "
                        "those frameworks' generate functions, openai:pkg.mod.fn an OpenAI-API agent")
    p.add_argument("--engine-concurrency", type=int, default=None,
                   help="engine requests in flight at most (default: --concurrency); tool time holds none")
    p.add_argument("--limit", action="append", default=[], metavar="NAME=K",
                   help="a named concurrency limit for `async with episode.limit(NAME)` (repeatable)")
    p.add_argument("--episode-timeout", type=float, default=None,
                   help="seconds one episode may take in total; past it the sample fails (recycled)")
    p.add_argument("--max-context", type=int, default=None,
                   help="tokens an episode's trajectory may hold: max_new_tokens is clamped to the room left")
    p.add_argument("--endpoint-host", default="127.0.0.1",
                   help="where the per-episode endpoints of --generate slime:/miles:/openai: listen "
                        "(loopback by default; the OpenAI endpoint answers only the episode's key)")
    p.add_argument("--generate-failure-limit", type=int, default=8,
                   help="the generate function failing on this many distinct prompts in a row is fatal")


def episode_options(args: argparse.Namespace) -> dict[str, Any]:
    """ProducerSettings keywords from :func:`add_episode_arguments`' flags."""
    from rollstream.producer.session import EpisodeLimits, parse_limits

    return {
        "generate": _load_generate(args) if args.generate else None,
        "limits": EpisodeLimits(
            engine_concurrency=args.engine_concurrency,
            named=parse_limits(args.limit),
            episode_timeout=args.episode_timeout,
            max_context=args.max_context,
        ),
        "generate_failure_limit": args.generate_failure_limit,
    }


def _load_generate(args: argparse.Namespace) -> Any:
    """``--generate`` through its one loader (the integrations register ``slime:`` / ``miles:`` /
    ``openai:`` when imported)."""
    import rollstream.integrations.generate  # noqa: F401 - registers the slime:/miles:/openai: schemes
    from rollstream.producer.plugin import GenerateContext, load_generate

    context = GenerateContext(
        tokenizer=getattr(args, "tokenizer", None),
        concurrency=getattr(args, "concurrency", 256) or 256,
        endpoint_host=getattr(args, "endpoint_host", "127.0.0.1"),
    )
    return load_generate(args.generate, context)


def run_with_signals(main: Any, on_signal: Any) -> None:
    """Run ``main`` (a coroutine function) with SIGTERM/SIGINT calling ``on_signal()``."""

    async def runner() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await main()

    asyncio.run(runner())


def cmd_server(args: argparse.Namespace) -> int:
    from rollstream.testing.server import EmbeddedRedis

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


def parse_moe_shape(value: str) -> tuple[int, int, int]:
    """``LAYERSxTOPKxEXPERTS`` (e.g. ``48x8x128``) as three positive ints (argparse type)."""
    parts = value.lower().split("x")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not LAYERSxTOPKxEXPERTS (e.g. 48x8x128)")
    return shape


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
        admission_control=False if args.no_admission_control else None,
        recycle_filtered=args.recycle_filtered,
        heartbeat_timeout=args.heartbeat_timeout,
        steps_per_version=args.steps_per_version,
        max_backlog_bytes=args.max_backlog_bytes,
        max_group_bytes=args.max_group_bytes,
    )
    keys = Keys(args.ns)
    written = asyncio.run(_with_redis(args.redis, lambda r: init_namespace(r, keys, config, force=args.force)))
    logger.info("namespace %s %s: %s", args.ns, "initialised" if written else "unchanged", config)
    return 0


def cmd_feed(args: argparse.Namespace) -> int:
    from rollstream.producer.feeder import Feeder, FeedSettings, load_jsonl

    settings = FeedSettings(
        namespace=args.ns,
        epochs=None if args.forever else args.epochs,
        shuffle=args.shuffle,
        seed=args.seed,
        window=args.window,
        shuffle_scheme=args.shuffle_scheme,
    )
    records = load_jsonl(
        args.dataset, args.prompt_key, args.label_key or None,
        metadata_key=args.metadata_key, tool_key=args.tool_key, as_chat=args.as_chat,
    )
    redis = connect(args.redis, name="rollstream-feeder")
    feeder = Feeder(redis, records, settings)

    async def main() -> None:
        try:
            await feeder.run()
        finally:
            await redis.aclose()

    run_with_signals(main, feeder.stop)
    return 0


PRODUCE_DEFAULTS: dict[str, Any] = {"max_new_tokens": 1024, "temperature": 1.0, "top_p": 1.0}
"""``rollstream produce``'s defaults for what neither the command line nor the stored flags set."""


def apply_stored_flags(args: argparse.Namespace, stored: Mapping[str, str]) -> dict[str, Any]:
    """Fill the produce options not given on the command line from a run's stored rollout flags
    (:class:`rollstream.integrations.flags.RolloutFlags`); explicit flags win. Returns the extra
    engine sampling parameters stored with them."""
    from rollstream.integrations.flags import RolloutFlags

    flags = RolloutFlags.from_fields(stored) if stored else None
    taken = []
    for name in ("concurrency", "reward", "tokenizer", "max_new_tokens", "temperature", "top_p"):
        if getattr(args, name) is None and flags is not None and getattr(flags, name) is not None:
            setattr(args, name, getattr(flags, name))
            taken.append(name)
        if getattr(args, name) is None and name in PRODUCE_DEFAULTS:
            setattr(args, name, PRODUCE_DEFAULTS[name])
    missing = [f"--{name.replace('_', '-')}" for name in ("concurrency", "reward") if getattr(args, name) is None]
    if missing:
        raise ConfigError(
            f"rollstream produce needs {' and '.join(missing)}: namespace {args.ns!r} holds no stored rollout flags "
            f"(a slime/miles run that starts its pipeline stores them), so give them on the command line"
        )
    if flags is None:
        return {}
    if flags.reward_args is not None and not os.environ.get(REWARD_ARGS):
        os.environ[REWARD_ARGS] = flags.reward_args  # the run's args for a slime:/miles: reward
    if flags.generate is not None:
        if not hasattr(args, "generate"):
            raise ConfigError(
                f"namespace {args.ns!r} was started with a custom generate function ({flags.generate}), which "
                f"this rollstream cannot run on producers"
            )
        if args.generate is None:
            args.generate = flags.generate
            taken.append("generate")
    if taken:
        logger.info(
            "produce: %s from the run's stored rollout flags (%s)", ", ".join(taken), Keys(args.ns).rollout_flags
        )
    return dict(flags.sampling_params)


async def _read_stored_flags(url: str, ns: str, required: bool) -> dict[str, str]:
    """The stored flags; when nothing required is missing, an unreachable Redis is not waited for
    (the producer itself waits for it and says so)."""
    from rollstream.common.connection import TRANSIENT_ERRORS, Outage
    from rollstream.common.protocol import RolloutFlagsHash

    redis = connect(url, name="rollstream-produce-flags")
    try:
        return await Outage(logger, "produce (reading the stored rollout flags)").run(
            lambda: RolloutFlagsHash(redis, Keys(ns)).read(), give_up_after=STORED_FLAGS_WAIT if required else 0.0
        )
    except TRANSIENT_ERRORS as exc:
        if required:
            raise
        logger.warning("produce: could not read the stored rollout flags (%s); using the command line's", exc)
        return {}
    finally:
        await redis.aclose()


async def _registry_engines(url: str, ns: str, wait: float) -> tuple[str, ...]:
    """The registry's active engines (``--engines-from-registry`` alone), waiting up to ``wait``
    seconds for one to be added (producers may start before the engines)."""
    from rollstream.common.connection import Outage
    from rollstream.common.protocol.engine_registry import EngineRegistry

    keys = Keys(ns)
    redis = connect(url, name="rollstream-produce-registry")
    try:
        registry = EngineRegistry(redis, keys)
        deadline = time.monotonic() + wait
        while True:
            entries = await Outage(logger, "produce (reading the engine registry)").run(
                registry.entries, give_up_after=STORED_FLAGS_WAIT)
            active = tuple(u for u, e in entries.items() if e.usable and e.state == "active")
            if active:
                return active
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"the engine registry {keys.engines} lists no active engine after {wait:g} s: add one with "
                    f"`rollstream engines add --ns {ns} URL`, or give --engine URL"
                )
            logger.info("produce: waiting for an active engine in the registry %s", keys.engines)
            await asyncio.sleep(1.0)
    finally:
        await redis.aclose()


STORED_FLAGS_WAIT = 60.0
"""Seconds ``produce`` waits for Redis to read the stored flags (it may be starting with us)."""


def cmd_produce(args: argparse.Namespace) -> int:
    import rollstream.integrations.framework_rewards  # noqa: F401 - registers the slime:/miles: reward schemes
    from rollstream.producer import gcpolicy
    from rollstream.producer.engine import EngineClient, EngineSettings
    from rollstream.producer.rewards import load_reward
    from rollstream.producer.settings import ProducerSettings, default_producer_name
    from rollstream.producer.teacher import TeacherScorer
    from rollstream.producer.tokenizer import load_tokenizer
    from rollstream.producer.worker import Producer

    gc_young = gcpolicy.check(args.gc_threshold)
    needs_stored = any(
        getattr(args, name) is None
        for name in ("concurrency", "reward", "tokenizer", "max_new_tokens", "temperature", "top_p")
    )
    required = args.concurrency is None or args.reward is None
    stored = asyncio.run(_read_stored_flags(args.redis, args.ns, required)) if needs_stored else {}
    sampling_params = apply_stored_flags(args, stored)
    if not args.engine and not args.engines_from_registry:
        raise ConfigError("produce needs engines: --engine URL (repeatable), or --engines-from-registry")
    registry_urls: tuple[str, ...] = ()
    if not args.engine:
        registry_urls = asyncio.run(_registry_engines(args.redis, args.ns, args.no_engine_timeout))
    engine_settings = EngineSettings(
        urls=tuple(args.engine),
        registry_urls=registry_urls,
        api=args.engine_api,
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        sampling_params=sampling_params,
        max_retries=args.max_retries,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        eject_after=args.eject_after,
        balance=args.route_balance,
        no_engine_timeout=args.no_engine_timeout,
        catch_up=args.catch_up_engines,
        adaptive_concurrency=args.adaptive_concurrency,
        concurrency_floor=args.concurrency_floor,
        request_timeout=args.request_timeout,
        max_reply_bytes=None if args.max_reply_mib is None else int(args.max_reply_mib * 2**20),
        request_seed=args.request_seed,
        routed_experts=args.routed_experts,
        engine_stats=args.engine_stats,
    )
    teacher_settings = None
    if args.teacher_engine:
        teacher_settings = dataclasses.replace(
            engine_settings, urls=tuple(args.teacher_engine), routed_experts=None, api="sglang"
        )
    settings = ProducerSettings(
        namespace=args.ns,
        concurrency=args.concurrency,
        name=args.name or default_producer_name(),
        n_samples=args.n_samples,
        drain_timeout=args.drain_timeout,
        heartbeat_interval=args.heartbeat_interval,
        engines_from_registry=args.engines_from_registry,
        reward_failure_limit=args.reward_failure_limit,
        engine_failure_limit=args.engine_failure_limit,
        long_request_after=args.long_request_after,
        loop_stall_after=args.loop_stall_after,
        **episode_options(args),
    )
    if args.metrics_port is not None:
        from rollstream.producer.metrics import ProducerMetrics
    reward = load_reward(args.reward, timeout=args.reward_timeout)
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    holder: dict[str, Producer] = {}
    stop_requested = False

    def on_signal() -> None:
        nonlocal stop_requested
        stop_requested = True
        if "producer" in holder:
            holder["producer"].stop()

    async def main() -> None:
        metrics = ProducerMetrics(args.ns, settings.name) if args.metrics_port is not None else None
        runner = None
        async with contextlib.AsyncExitStack() as stack:
            engine = await stack.enter_async_context(EngineClient(engine_settings, tokenizer=tokenizer))
            teacher = None
            if teacher_settings is not None:
                teacher = await stack.enter_async_context(TeacherScorer(EngineClient(teacher_settings)))
            try:
                if metrics is not None:
                    metrics.attach(engine)
                    runner = await metrics.serve(args.metrics_host, args.metrics_port)
                producer = await Producer.connect(args.redis, settings, engine, reward, metrics=metrics,
                                                  teacher=teacher)
                gcpolicy.tune(gc_young)
                holder["producer"] = producer
                if stop_requested:
                    producer.stop()
                try:
                    await producer.run()
                finally:
                    await producer.aclose()
            finally:
                await reward.aclose()
                if runner is not None:
                    await runner.cleanup()

    try:
        run_with_signals(main, on_signal)
    except Exception as exc:
        if isinstance(exc, ValueError) and "producer" not in holder:
            raise
        logger.error("producer %s exited on a fatal error: %s", settings.name, exc)
        return 1
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
