"""``GroupConsumer.evaluate`` of a large eval set: wall time, the trainer's peak RSS, its longest
event-loop stall (issue 49 finding 9).

A JSONL eval set of 1,000,000 prompts (``Compute i + 2.``, a label) is submitted by a fresh
trainer process to an embedded Redis; the process runs a 5 ms ticker beside ``evaluate`` and
reports the longest gap past its period (the loop stall), ``ru_maxrss`` (peak RSS) and its RSS
after connecting (the baseline), and the wall time of the call. Redis' ``used_memory`` after the
submission is the eval lane's prompts.

``ROLLSTREAM_BENCH_BEFORE=<commit>`` also runs the trainer on that commit's code (``git
archive``d to a temporary folder, imported through the editable install's mapping): the
before/after pair. ``--quick``: 20,000 prompts.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.common import Table

PROMPTS = 1_000_000
TICK_S = 0.005


def _write_set(path: Path, count: int) -> None:
    with path.open("w") as out:
        for i in range(count):
            out.write(json.dumps({"prompt": f"Compute {i} + 2.", "label": str(i + 2)}) + "\n")


def _use_tree(tree: str) -> None:
    """Import ``rollstream`` from ``tree`` (another commit's files) instead of this worktree (before
    anything imports it: this module imports rollstream only inside functions)."""
    import __editable___rollstream_0_1_0_finder as finder  # type: ignore[import-not-found]

    here = str(Path(__file__).resolve().parents[1])
    finder.MAPPING.update({k: v.replace(here, tree, 1) for k, v in finder.MAPPING.items()})


async def _child(url: str, ns: str, path: str) -> dict[str, Any]:
    from rollstream.consumer import GroupConsumer

    async with await GroupConsumer.connect(url, ns, "bench-eval") as consumer:
        base_rss = _rss_mb()
        stall = 0.0
        loop = asyncio.get_running_loop()

        async def ticker() -> None:
            nonlocal stall
            while True:
                started = loop.time()
                await asyncio.sleep(TICK_S)
                stall = max(stall, loop.time() - started - TICK_S)

        tick = asyncio.create_task(ticker())
        started = time.monotonic()
        await consumer.evaluate("big", path, n_samples=1, max_new_tokens=8)
        wall = time.monotonic() - started
        tick.cancel()
    return {"wall_s": wall, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "base_rss_mb": base_rss, "max_stall_s": stall}


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _trainer(url: str, ns: str, path: Path, tree: str | None) -> dict[str, Any]:
    args = [sys.executable, "-m", "bench.eval_submit", "--child", url, ns, str(path), tree or ""]
    done = subprocess.run(args, capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _run(count: int, before: str | None) -> list[list[Any]]:
    from rollstream.common.connection import connect
    from rollstream.runtime.redis_server import EmbeddedRedis

    from bench.common import init_ns

    work = Path(tempfile.mkdtemp(prefix="rs-bench-eval-"))
    path = work / "eval.jsonl"
    _write_set(path, count)
    trees: list[tuple[str, str | None]] = [("this tree", None)]
    if before:
        tree = work / "before"
        tree.mkdir()
        await asyncio.to_thread(_extract, before, tree)
        trees.insert(0, (f"before ({before[:9]})", str(tree)))
    rows = []
    with EmbeddedRedis(dir=work / "redis") as server:
        redis = connect(server.url)
        try:
            for label, tree_path in trees:
                ns = f"evalsub-{len(rows)}"
                await init_ns(redis, ns, n_samples_per_prompt=1, batch_size=1)
                used_before = int((await redis.info("memory"))["used_memory"])
                got = await asyncio.to_thread(_trainer, server.url, ns, path, tree_path)
                used = int((await redis.info("memory"))["used_memory"]) - used_before
                written = await redis.xlen(f"rollstream:{{{ns}}}:eval_prompts")
                rows.append([label, count, written, round(got["wall_s"], 1), round(got["peak_rss_mb"]),
                             round(got["base_rss_mb"]), round(got["max_stall_s"], 3), round(used / 2**20)])
                await redis.flushall()
        finally:
            await redis.aclose()
    return rows


def _extract(commit: str, tree: Path) -> None:
    archive = subprocess.run(["git", "archive", commit], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)


def run(quick: bool = False) -> list[Table]:
    from bench.common import Table

    count = 20_000 if quick else PROMPTS
    rows = asyncio.run(_run(count, os.environ.get("ROLLSTREAM_BENCH_BEFORE")))
    return [Table(
        "eval-submit",
        f"GroupConsumer.evaluate of a {count:,}-prompt JSONL eval set, in a fresh trainer process",
        ["code", "prompts", "written", "wall s", "peak RSS MiB", "RSS after connect MiB", "longest loop stall s",
         "Redis used_memory MiB"],
        rows,
        ["Peak RSS: ru_maxrss of the trainer process; loop stall: the longest gap past a 5 ms ticker's period "
         "while evaluate ran.",
         "ROLLSTREAM_BENCH_BEFORE=<commit> adds that commit's code as the first row."],
        "ROLLSTREAM_BENCH_BEFORE=<commit> python -m bench eval_submit",
    )]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        url, ns, path, tree = sys.argv[2:6]
        if tree:
            _use_tree(tree)
        print(json.dumps(asyncio.run(_child(url, ns, path))), flush=True)
    else:
        for table in run(quick="--quick" in sys.argv):
            print(table.markdown())
