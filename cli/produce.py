"""``rollstream produce``: its flags are derived from one settings tree, :class:`ProduceOptions`.

The tree is the producer's settings (:class:`~rollstream.producer.settings.ProducerSettings`,
with its episode settings and limits), the engine's (:class:`~rollstream.producer.engine.EngineSettings`)
and the process's own options below; each field carries its flag, help and default
(:mod:`rollstream.common.settings_fields`). What the command line leaves out comes from the run's
stored rollout flags (a slime/miles run stores them), then from the fields' defaults.
``tests/test_produce_options.py`` fails when a flag has no field or a field no flag.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.settings_fields import add_flags, branch, build, default_of, option, stored_taken, walk
from rollstream.integrations.framework_rewards import REWARD_ARGS
from rollstream.producer.engine.settings import EngineSettings
from rollstream.producer.settings import ProducerSettings

from .commands import run_with_signals

logger = logging.getLogger("rollstream.cli")

STORED_NOTE = "the run's stored rollout flags, see docs/integrations.md"
STORED_FLAGS_WAIT = 60.0
"""Seconds ``produce`` waits for Redis to read the stored flags (it may be starting with us)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ProduceOptions:
    """Everything ``rollstream produce`` takes: the settings tree and the process's own options."""

    producer: ProducerSettings = branch(ProducerSettings, required=True)
    reward: str = option(
        stored=True, parse=str, metavar="SPEC",
        help="math | remote:URL | module:function | slime:module.fn | slime-group:module.fn (also miles:)")
    engine: EngineSettings = branch(EngineSettings, required=True)
    reward_timeout: float = option(
        300.0, help="seconds the reward may take on one group; past it the group fails (recycled)")
    tokenizer: str | None = option(
        None, stored=True, parse=str, metavar="NAME_OR_PATH",
        help="tokenize prompts and render chat templates locally (Hugging Face name/path, needs the "
             "transformers extra; or module:attribute)")
    generate: str | None = option(
        None, stored=True, parse=str, metavar="MODULE:FUNCTION",
        help="the rollout plug-in: async def generate(episode) -> Sample | list[Sample] (default: the "
             "single-turn rollout); slime:pkg.mod.fn / miles:pkg.mod.fn run those frameworks' generate "
             "functions, openai:pkg.mod.fn an OpenAI-API agent")
    endpoint_host: str = option(
        "127.0.0.1", help="where the per-episode endpoints of --generate slime:/miles:/openai: listen (the "
                          "OpenAI endpoint answers only the episode's key)")
    teacher_engines: tuple[str, ...] = option(
        (), flag="--teacher-engine", parse=str, repeat=True, convert=tuple, metavar="URL",
        help="score every response on this SGLang teacher (log-probs of the response tokens: "
             "teacher_log_probs, on-policy distillation); repeatable")
    metrics_port: int | None = option(None, parse=int, help="serve Prometheus metrics on this port")
    metrics_host: str = option("0.0.0.0", help="the metrics server's address")
    gc_threshold: int | None = option(
        None, parse=int, metavar="N",
        help="once started, freeze the start-up heap and run Python's young garbage collection every N net "
             "allocations (default 50000; 0: Python's own 700, nothing frozen)")


def register(sub: Any, base: list[argparse.ArgumentParser], with_redis: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("produce", parents=with_redis, help="run a rollout producer")
    add_flags(p, ProduceOptions, stored_note=STORED_NOTE)
    p.set_defaults(func=cmd_produce)


def _unset(args: argparse.Namespace, *, required_only: bool) -> bool:
    """A stored field the command line leaves out (a required one, with ``required_only``)."""
    return any(
        leaf.option is not None and leaf.option.stored and getattr(args, leaf.dest, None) is None
        and (leaf.default is dataclasses.MISSING or not required_only)
        for leaf in walk(ProduceOptions)
    )


def produce_options(
    args: argparse.Namespace, stored: Mapping[str, str], registry_urls: tuple[str, ...] = ()
) -> ProduceOptions:
    """The options from the command line, then the run's ``stored`` rollout flags (their raw
    hash), then the defaults; the stored ``reward_args`` reach a slime:/miles: reward through
    ``$ROLLSTREAM_REWARD_ARGS`` unless it is set."""
    from rollstream.integrations.flags import RolloutFlags

    flags = RolloutFlags.from_fields(stored) if stored else None
    values = {} if flags is None else {f.name: getattr(flags, f.name) for f in dataclasses.fields(flags)}
    options: ProduceOptions = build(
        ProduceOptions, args, stored=values, command="rollstream produce",
        values={"producer.namespace": args.ns, "engine.registry_urls": registry_urls,
                "engine.sampling_params": dict(flags.sampling_params) if flags is not None else {}},
        hint=f": namespace {args.ns!r} holds no stored rollout flags (a slime/miles run that starts its pipeline "
             f"stores them), so give them on the command line",
    )
    if flags is not None:
        if flags.reward_args is not None and not os.environ.get(REWARD_ARGS):
            os.environ[REWARD_ARGS] = flags.reward_args  # the run's args for a slime:/miles: reward
        taken = stored_taken(ProduceOptions, args, values)
        if taken:
            logger.info("produce: %s from the run's stored rollout flags (%s)", ", ".join(taken),
                        Keys(args.ns).rollout_flags)
    return options


def with_generate(options: ProduceOptions) -> ProducerSettings:
    """The producer settings with ``--generate`` loaded through its one loader (the integrations
    register ``slime:`` / ``miles:`` / ``openai:`` when imported)."""
    if options.generate is None:
        return options.producer
    import rollstream.integrations.generate  # noqa: F401 - registers the slime:/miles:/openai: schemes
    from rollstream.producer.plugin import GenerateContext, load_generate

    context = GenerateContext(tokenizer=options.tokenizer, concurrency=options.producer.concurrency,
                              endpoint_host=options.endpoint_host)
    episodes = dataclasses.replace(options.producer.episodes, generate=load_generate(options.generate, context))
    return dataclasses.replace(options.producer, episodes=episodes)


async def _read_stored_flags(url: str, ns: str, required: bool) -> dict[str, str]:
    """The stored flags; when nothing required is missing, an unreachable Redis is not waited for
    (the producer itself waits for it and says so). With required flags missing and none stored,
    a namespace that was never initialised says so (``rollstream init`` first), not which flags
    to give."""
    from rollstream.common.connection import TRANSIENT_ERRORS, Outage
    from rollstream.common.namespace import load_config
    from rollstream.common.protocol import RolloutFlagsHash

    keys = Keys(ns)
    redis = connect(url, name="rollstream-produce-flags")

    async def read() -> dict[str, str]:
        stored = await RolloutFlagsHash(redis, keys).read()
        if not stored and required:
            await load_config(redis, keys)  # NamespaceNotInitialized: say that, not which flags to give
        return stored

    try:
        return await Outage(logger, "produce (reading the stored rollout flags)").run(
            read, give_up_after=STORED_FLAGS_WAIT if required else 0.0
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


def cmd_produce(args: argparse.Namespace) -> int:
    import rollstream.integrations.framework_rewards  # noqa: F401 - registers the slime:/miles: reward schemes
    from rollstream.producer import gcpolicy
    from rollstream.producer.engine import EngineClient
    from rollstream.producer.rewards import load_reward
    from rollstream.producer.teacher import TeacherScorer
    from rollstream.producer.tokenizer import load_tokenizer
    from rollstream.producer.worker import Producer

    gc_young = gcpolicy.check(args.gc_threshold)
    stored = {}
    if _unset(args, required_only=False):
        stored = asyncio.run(_read_stored_flags(args.redis, args.ns, _unset(args, required_only=True)))
    registry_urls: tuple[str, ...] = ()
    if not args.engine and args.engines_from_registry:
        wait = args.no_engine_timeout or default_of(EngineSettings, "no_engine_timeout")
        registry_urls = asyncio.run(_registry_engines(args.redis, args.ns, wait))
    options = produce_options(args, stored, registry_urls)
    settings = with_generate(options)
    teacher_settings = None
    if options.teacher_engines:
        teacher_settings = TeacherScorer.engine_settings(options.engine, options.teacher_engines)
    if options.metrics_port is not None:
        from rollstream.producer.metrics import ProducerMetrics
    reward = load_reward(options.reward, timeout=options.reward_timeout)
    tokenizer = load_tokenizer(options.tokenizer) if options.tokenizer else None
    holder: dict[str, Producer] = {}
    stop_requested = False

    def on_signal() -> None:
        nonlocal stop_requested
        stop_requested = True
        if "producer" in holder:
            holder["producer"].stop()

    async def main() -> None:
        metrics = ProducerMetrics(args.ns, settings.name) if options.metrics_port is not None else None
        runner = None
        async with contextlib.AsyncExitStack() as stack:
            engine = await stack.enter_async_context(EngineClient(options.engine, tokenizer=tokenizer))
            teacher = None
            if teacher_settings is not None:
                teacher = await stack.enter_async_context(TeacherScorer(EngineClient(teacher_settings)))
            try:
                if metrics is not None and options.metrics_port is not None:
                    metrics.attach(engine)
                    runner = await metrics.serve(options.metrics_host, options.metrics_port)
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
