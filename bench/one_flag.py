"""What the one-flag run costs: seconds from a slime-shaped trainer's start to its first trained
rollout when it starts its own pipeline (embedded Redis with AOF, namespace, feeder, producer)
and when the same pipeline is already running (``ROLLSTREAM_REDIS_URL`` set); seconds from a
SIGKILL of the trainer until none of its children is left; seconds from the resumed trainer's
start to its first (replayed) rollout.

The trainer is ``tests/one_flag_trainer.py`` over the stand-in slime (its argument parser and
rollout manager), against the engine simulator; both variants run side by side in one run.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollstream.runtime.children import wait_for_http
from rollstream.runtime.redis_server import EmbeddedRedis, free_port

from bench.common import ROOT, Table, children, spawn

TRAINER = ROOT / "tests" / "one_flag_trainer.py"
BATCH, N = 8, 4


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    raise RuntimeError(f"timed out after {timeout} s waiting for {what}")


def _trained(save: Path) -> list[dict[str, Any]]:
    path = save / "trained.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip() and "rollout" in line]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _dataset(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"input": f"what is {i}?", "label": str(i)}) + "\n" for i in range(count)))
    return path


def _argv(engine_port: int, dataset: Path, save: Path, rollouts: int) -> list[str]:
    return [
        str(TRAINER), "slime",
        "--rollout-function-path", "rollstream.integrations.slime.generate_rollout",
        "--data-source-path", "rollstream.integrations.slime.RollstreamDataSource",
        "--rollout-batch-size", str(BATCH), "--n-samples-per-prompt", str(N),
        "--prompt-data", str(dataset), "--label-key", "label", "--custom-rm-path", "user_rm.rm",
        "--rollout-max-response-len", "64", "--sglang-router-ip", "127.0.0.1",
        "--sglang-router-port", str(engine_port), "--sglang-server-concurrency", "64",
        "--save", str(save), "--load", str(save), "--save-interval", "2", "--num-rollout", str(rollouts),
    ]


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLSTREAM_")}
    return {**env, **extra}


def _trainer(argv: list[str], log: Path, env: dict[str, str]) -> Any:
    """The trainer as its own process (spawn()'s env is added to ours: replace it whole here)."""
    import subprocess

    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)


def _one_flag(engine_port: int, work: Path) -> dict[str, float]:
    save = work / "ckpt"
    dataset = _dataset(work / "prompts.jsonl", 400)
    t0 = time.monotonic()
    first = _trainer(_argv(engine_port, dataset, save, 100), work / "t1.log", _clean_env(ONE_FLAG_HANG_AFTER="2"))
    try:
        _wait(lambda: _trained(save), 120, "the first rollout")
        to_first = time.monotonic() - t0
        _wait(lambda: len(_trained(save)) >= 3, 120, "three rollouts")
        pids = json.loads((save / "rollstream" / "children.json").read_text())
        t1 = time.monotonic()
        first.kill()
        first.wait()
        _wait(lambda: not any(_alive(p) for p in pids.values()), 60, "the children to die with the trainer")
        to_no_children = time.monotonic() - t1
    finally:
        first.kill()
        first.wait()
    before = len(_trained(save))
    t2 = time.monotonic()
    second = _trainer(_argv(engine_port, dataset, save, 5), work / "t2.log", _clean_env())
    try:
        _wait(lambda: len(_trained(save)) > before, 120, "the resumed run's first rollout")
        to_resumed = time.monotonic() - t2
        second.wait(120)
    finally:
        second.kill()
        second.wait()
    return {"first": to_first, "orphans_gone": to_no_children, "resumed_first": to_resumed}


def _own_pipeline(engine_port: int, work: Path) -> float:
    save = work / "ckpt"
    dataset = _dataset(work / "prompts.jsonl", 400)
    ns = "bench"
    with EmbeddedRedis(dir=work / "redis", appendonly=True) as server, children() as procs:
        url = server.url
        init = spawn(["-m", "rollstream.cli", "init", "--redis", url, "--ns", ns, "--n-samples", str(N),
                      "--batch-size", str(BATCH), "--max-backlog", str(2 * BATCH)], work / "init.log")
        init.wait(60)
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "standins"), os.environ.get("PYTHONPATH", "")])}
        procs.append(spawn(["-m", "rollstream.cli", "feed", str(dataset), "--redis", url, "--ns", ns, "--forever",
                            "--prompt-key", "input", "--label-key", "label"], work / "feed.log", env))
        procs.append(spawn(["-m", "rollstream.cli", "produce", "--redis", url, "--ns", ns, "--engine",
                            f"http://127.0.0.1:{engine_port}", "--concurrency", "64", "--reward", "slime:user_rm.rm",
                            "--max-new-tokens", "64"], work / "produce.log", env))
        t0 = time.monotonic()
        trainer = _trainer(
            _argv(engine_port, dataset, save, 1), work / "t.log",
            _clean_env(ROLLSTREAM_REDIS_URL=url, ROLLSTREAM_NAMESPACE=ns, ROLLSTREAM_CONSUMER_NAME="trainer"),
        )
        try:
            _wait(lambda: _trained(save), 120, "the first rollout")
            elapsed = time.monotonic() - t0
            trainer.wait(60)
        finally:
            trainer.kill()
            trainer.wait()
    return elapsed


def run(quick: bool = False) -> list[Table]:
    repeats = 1 if quick else 5
    port = free_port()
    one: list[dict[str, float]] = []
    own: list[float] = []
    with children() as procs:
        procs.append(spawn(["-m", "rollstream.cli", "sim-engine", "--port", str(port), "--mean-tokens", "32"]))
        wait_for_http(f"http://127.0.0.1:{port}")
        for _ in range(repeats):
            for variant in ("one", "own"):  # side by side, alternating
                work = Path(tempfile.mkdtemp(prefix="rollstream-bench-oneflag-"))
                try:
                    if variant == "one":
                        one.append(_one_flag(port, work))
                    else:
                        own.append(_own_pipeline(port, work))
                finally:
                    shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    first_one, first_own = med(r["first"] for r in one), med(own)
    rows: list[list[Any]] = [
        ["trainer start → first rollout, one-flag (starts Redis, namespace, feeder, producer)", first_one,
         first_one / first_own],
        ["trainer start → first rollout, pipeline already running (ROLLSTREAM_REDIS_URL)", first_own, 1.0],
        ["SIGKILL of the trainer → none of its children left", med(r["orphans_gone"] for r in one), float("nan")],
        ["resumed trainer start → first (replayed) rollout", med(r["resumed_first"] for r in one), float("nan")],
    ]
    return [Table(
        name="one_flag",
        title=f"The one-flag run: start, crash, resume (median of {repeats}, batch {BATCH} x n={N}, simulator)",
        headers=["what", "seconds", "ratio to a running pipeline"],
        rows=rows,
        notes=[
            "the trainer is tests/one_flag_trainer.py over the stand-in slime; its Python start is in every figure",
            "the resumed trainer releases the dead one's consumer-name lease (its data-dir lock proves it gone)",
        ],
        command="python -m bench one_flag",
    )]
