"""The one-flag run: the pipeline a slime or miles run starts by itself.

Without ``ROLLSTREAM_REDIS_URL`` the data source starts, as children it owns
(:class:`rollstream.runtime.children.Supervisor`): an embedded redis-server with AOF
(``appendfsync always``) whose data lives under ``{--save}/rollstream/redis``, so a resumed run
finds its streams and its journal; then it initialises the namespace from the run's flags and
stores the run's rollout flags (:mod:`rollstream.integrations.flags`), and starts ``rollstream
feed`` over ``--prompt-data`` and ``rollstream produce`` against the run's router. A child that
dies is restarted with a backoff; the children die with the trainer process (parent-death
signal), and :meth:`LocalPipeline.close` (also run at exit) stops them gracefully.

With ``ROLLSTREAM_REDIS_URL`` set nothing is started unless ``ROLLSTREAM_START`` asks for the
feeder and/or the producers (the multi-node recipe: a shared Redis, this node's producers and
the feeder started by the run, more producers elsewhere with ``rollstream produce --redis URL
--ns NS --engine URL``).
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import logging
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollstream.common.connection import connect
from rollstream.common.errors import ConfigError, PipelineError, RollstreamError
from rollstream.common.keys import Keys
from rollstream.common.loop_thread import LoopThread
from rollstream.common.namespace import init_namespace
from rollstream.common.protocol import NameLease, RolloutFlagsHash
from rollstream.runtime.children import ChildSpec, Supervisor
from rollstream.runtime.redis_server import EmbeddedRedis, free_port, wait_for_redis

from .flags import RunPlan, require_engine

logger = logging.getLogger(__name__)

START = "ROLLSTREAM_START"
PRODUCERS = "ROLLSTREAM_PRODUCERS"
COMPONENTS = ("redis", "feeder", "producers")
REDIS_READY_TIMEOUT = 120.0
"""Seconds the embedded Redis may take to answer (it replays its AOF first on a resume)."""


def components(environ: Mapping[str, str], *, redis_url_set: bool) -> tuple[str, ...]:
    """What the run starts: ``ROLLSTREAM_START`` (comma-separated, ``none`` for nothing), by
    default everything without ``ROLLSTREAM_REDIS_URL`` and nothing with it."""
    raw = environ.get(START, "").strip()
    if not raw:
        return () if redis_url_set else COMPONENTS
    if raw == "none":
        return ()
    wanted = tuple(part.strip() for part in raw.split(",") if part.strip())
    unknown = [part for part in wanted if part not in COMPONENTS]
    if unknown:
        raise ConfigError(
            f"environment variable {START}={raw!r}: unknown {unknown}; use none or {', '.join(COMPONENTS)}"
        )
    if redis_url_set and "redis" in wanted:
        raise ConfigError(f"environment variable {START} asks for redis, but ROLLSTREAM_REDIS_URL names one already")
    if not redis_url_set and "redis" not in wanted:
        raise ConfigError(f"environment variable {START}={raw!r} needs redis: ROLLSTREAM_REDIS_URL is not set")
    return tuple(c for c in COMPONENTS if c in wanted)


def producer_count(environ: Mapping[str, str]) -> int:
    raw = environ.get(PRODUCERS, "").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"environment variable {PRODUCERS}={raw!r} must be an integer >= 1")
    return int(raw)


def _child_pythonpath() -> str:
    """The trainer's import path, so a reward module the trainer imports is importable by producers."""
    entries = [p for p in sys.path if p and os.path.isdir(p)]
    extra = os.environ.get("PYTHONPATH")
    return os.pathsep.join(dict.fromkeys([*entries, *(extra.split(os.pathsep) if extra else [])]))


class LocalPipeline:
    """The children of one run and how to stop them."""

    def __init__(
        self,
        plan: RunPlan,
        *,
        namespace: str,
        consumer: str,
        components: tuple[str, ...],
        redis_url: str | None = None,
        producers: int = 1,
    ) -> None:
        if ("redis" in components) == (redis_url is not None):
            raise ConfigError("a local pipeline either starts its Redis or is given one")
        self.plan = plan
        self.namespace = namespace
        self.consumer = consumer
        self.components = components
        self.producers = producers
        self.redis_url = redis_url
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.supervisor: Supervisor | None = None
        self.producers_started = False
        self._lock: Any = None

    @property
    def data_dir(self) -> Path:
        if self.plan.data_dir is not None:
            return self.plan.data_dir
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rollstream-run-")
            logger.warning(
                "no --save: the pipeline's data lives in %s and is deleted at exit (a restart starts anew)",
                self._tmp.name,
            )
        return Path(self._tmp.name)

    def start(self) -> str:
        """Start what the run needs; returns the Redis URL. On any failure, what was started is stopped."""
        data = self.data_dir
        data.mkdir(parents=True, exist_ok=True)
        if "redis" in self.components:
            self._lock_data_dir(data)
        self.supervisor = Supervisor(data / "logs", pids_file=data / "children.json")
        atexit.register(self.close)
        try:
            url = self._start_redis(data / "redis") if "redis" in self.components else self._url()
            self.redis_url = url
            self._prepare_namespace(url)
            env = {"PYTHONPATH": _child_pythonpath()}
            base = [sys.executable, "-m", "rollstream.cli"]
            where = ["--redis", url, "--ns", self.namespace]
            if "feeder" in self.components:
                self._supervisor().start(
                    ChildSpec("feeder", [*base, "feed", *self.plan.feed_datasets, *where, *self.plan.feed_args],
                              env=env)
                )
            if "producers" in self.components and self.plan.flags.engine is not None:
                self.start_producers(None)
        except BaseException:
            self.close()
            raise
        logger.info(
            "rollstream pipeline of this %s run: %s, namespace %s (%s; logs in %s); "
            "`rollstream inspect --redis %s --ns %s` shows it",
            self.plan.framework, self.redis_url, self.namespace, self._started(), data / "logs",
            self.redis_url, self.namespace,
        )
        return self.redis_url

    def _started(self) -> str:
        started = [c for c in self.components if c != "producers" or self.producers_started]
        pending = "producers" in self.components and not self.producers_started
        waiting = " (producers when the router is up)" if pending else ""
        return f"started: {', '.join(started) or 'nothing'}{waiting}"

    def _lock_data_dir(self, data: Path) -> None:
        """One run per data directory: two redis-servers appending to one AOF would corrupt it. The
        lock (flock) goes with this process, however it ends."""
        handle = open(data / "lock", "a+b")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise ConfigError(
                f"another run is using {data} (its pipeline's data): two runs cannot share a --save directory"
            ) from None
        self._lock = handle

    def _supervisor(self) -> Supervisor:
        """The supervisor of the children, once :meth:`start` made it."""
        if self.supervisor is None:
            raise RuntimeError("the local pipeline is not started (call start() first)")
        return self.supervisor

    def _url(self) -> str:
        """The Redis URL: given, or the embedded server's once :meth:`start` started it."""
        if self.redis_url is None:
            raise RuntimeError("the local pipeline's Redis is not started (call start() first)")
        return self.redis_url

    def _start_redis(self, directory: Path) -> str:
        supervisor = self._supervisor()
        server = EmbeddedRedis(port=free_port(), dir=directory, appendonly=True, appendfsync="always")
        port = server.port
        supervisor.start(
            ChildSpec(
                "redis", server.command(), stage=0, stop_timeout=20.0,
                ready=lambda process: wait_for_redis(port, process, REDIS_READY_TIMEOUT, log=directory / "redis.log"),
            ),
            timeout=REDIS_READY_TIMEOUT + 10,
        )
        return server.url

    def _prepare_namespace(self, url: str) -> None:
        """The namespace config from the run's flags (an existing, different one is a ConfigError:
        resume with the sizes the run was started with) and the stored rollout flags."""
        keys = Keys(self.namespace)

        async def prepare() -> None:
            redis = connect(url, name="rollstream-run-setup")
            try:
                written = await init_namespace(redis, keys, self.plan.config)
                await RolloutFlagsHash(redis, keys).replace(self.plan.flags.to_fields())
                if "redis" in self.components:
                    await self._release_dead_trainer(redis, keys)
            finally:
                await redis.aclose()
            logger.info("namespace %s %s: %s", self.namespace, "initialised" if written else "kept", self.plan.config)

        thread = LoopThread("rollstream-run-setup")
        try:
            thread.run(prepare())
        finally:
            thread.close()

    async def _release_dead_trainer(self, redis: Any, keys: Keys) -> None:
        """The run's own Redis: a consumer-name lease still held belongs to a dead earlier run of this
        ``--save`` (this process holds the data directory's lock), so it is released instead of
        waited out (its TTL)."""
        holder = await NameLease(redis, keys, self.consumer, "").holder()
        if holder is not None and await NameLease(redis, keys, self.consumer, holder).release():
            logger.info(
                "consumer name %s was still held by %s, an earlier run of this --save that is gone: released",
                self.consumer, holder,
            )

    def start_producers(self, args: Any) -> None:
        """Start the producers once the router is known (idempotent): ``args`` are the framework's,
        whose ``--sglang-router-ip/port`` it fills in when it starts the router (None: the plan's)."""
        if self.producers_started or "producers" not in self.components:
            return
        url = self._url()
        if self.plan.flags.engine is None:
            engine = require_engine(args, None)
            self.plan = dataclasses.replace(self.plan, flags=dataclasses.replace(self.plan.flags, engine=engine))
            self._prepare_namespace(url)  # the stored flags now name the router
            logger.info("the %s run's router is %s: starting its producers", self.plan.framework, engine)
        base = [sys.executable, "-m", "rollstream.cli"]
        where = ["--redis", url, "--ns", self.namespace]
        self._start_producers(base, where, {"PYTHONPATH": _child_pythonpath()})
        self.producers_started = True

    def _start_producers(self, base: list[str], where: list[str], env: dict[str, str]) -> None:
        supervisor, engine = self._supervisor(), self.plan.flags.engine
        if engine is None:
            raise RuntimeError("the producers need the router's address (start_producers() fills it in)")
        total = self.plan.flags.concurrency or 1
        for i in range(self.producers):
            name = f"{self.consumer}-producer-{i}"  # stable: a restarted producer adopts its pending prompts
            argv = [*base, "produce", *where, "--engine", engine, "--name", name]
            if self.producers > 1:  # the stored concurrency is the run's; split it
                share = total // self.producers + (1 if i < total % self.producers else 0)
                argv += ["--concurrency", str(max(1, share))]
            supervisor.start(ChildSpec(f"producer-{i}", argv, env=env))

    def problem(self) -> RollstreamError | None:
        """Why the run cannot go on (None: fine): a child stopped on a configuration error
        (ConfigError), or one failing again and again (PipelineError)."""
        if self.supervisor is None:
            return None
        for name, message in sorted(self.supervisor.fatal().items()):
            return ConfigError(
                f"the run's rollstream {name} stopped on a configuration error: {message} "
                f"(log {self.supervisor.log_path(name)})"
            )
        for name, message in sorted(self.supervisor.failed().items()):
            return PipelineError(f"the run's rollstream {name} keeps failing, given up: {message}")
        return None

    @property
    def supervises_producers(self) -> bool:
        """Producers restarted by this run: a producer's fatal error is a warning for the trainer
        (the supervisor restarts it, and gives up loudly when it keeps failing)."""
        return "producers" in self.components

    def metrics(self) -> dict[str, float]:
        """``children_restarted``: how often the supervisor restarted a child of this run."""
        if self.supervisor is None:
            return {}
        return {"children_restarted": float(sum(self.supervisor.restarts().values()))}

    def close(self) -> None:
        """Stop the children (producers and feeder drain first, Redis last). Idempotent."""
        if self.supervisor is not None:
            self.supervisor.stop()
        atexit.unregister(self.close)
        if self._lock is not None:
            self._lock.close()
            self._lock = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
