"""The code examples of the docs run, as written (issue 50): each block marked
``<!-- example: NAME ... -->`` in README.md or docs/*.md is read from the doc and run here against
real Redis, a real producer process and the engine simulator, so a renamed API or a changed
signature fails the suite instead of leaving a newcomer with code that does not work."""

from __future__ import annotations

import ast
import asyncio
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
from conftest import ProcessPool, add_prompts, make_namespace
from redis.asyncio import Redis
from rollstream.common.keys import Keys, StateField
from rollstream.common.models import Status
from rollstream.consumer import GroupConsumer
from rollstream.producer.curriculum import RowStats, load_sampler
from rollstream.testing.sim import SimEngine
from test_layers import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"<!-- example: ([\w-]+)")
TESTED = {"durable-episode", "eval-lane", "curriculum"}
"""Every example name this file runs (test_every_marked_example_is_run keeps it complete)."""


def examples() -> dict[str, str]:
    """Example name -> the code of the fenced block that follows its mark (dedented)."""
    found: dict[str, str] = {}
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for number, line in enumerate(lines):
            mark = MARK.search(line)
            if mark is None:
                continue
            fence = next(i for i in range(number + 1, len(lines)) if lines[i].strip().startswith("```"))
            end = next(i for i in range(fence + 1, len(lines)) if lines[i].strip() == "```")
            assert mark.group(1) not in found, f"two examples named {mark.group(1)}"
            found[mark.group(1)] = textwrap.dedent("\n".join(lines[fence + 1 : end])) + "\n"
    return found


def example(name: str) -> str:
    return examples()[name]


def test_every_marked_example_is_run() -> None:
    assert set(examples()) == TESTED


async def test_the_durable_episode_example_runs_its_tool_sandbox_and_engine_calls_journaled(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path
) -> None:
    code = tmp_path / "my_rollout.py"
    code.write_text(example("durable-episode"))
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2, durable_episodes=True)
    await add_prompts(redis, ns, 2, text="Compute 2 + 3. [tools=2:calc]")  # two tool calls, then an answer
    procs.producer(redis_url, ns, sim.url, "--generate", f"{code}:generate")
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        async with asyncio.timeout(120):
            batch = await consumer.take(2)
        await consumer.commit(batch)
    samples = [s for g in batch.groups for s in g.samples]
    assert len(samples) == 4 and all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in samples)
    sandboxes = [s.metadata["sandbox"] for s in samples]
    assert all(box.startswith("sandbox-") for box in sandboxes) and len(set(sandboxes)) == 4  # once per episode
    for sample in samples:
        assert 0 in sample.loss_mask and 1 in sample.loss_mask  # the tool's tokens (0) between the model's (1)
    steps = int(await redis.hget(Keys(ns).state, StateField.JOURNAL_STEPS) or 0)  # type: ignore[misc]
    assert steps >= 4 * (1 + 3 + 2)  # each episode: once, 3 generates, 2 observes, journaled


async def test_the_eval_lane_example_runs_beside_training(
    redis: Redis, redis_url: str, ns: str, sim: SimEngine, procs: ProcessPool, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    await add_prompts(redis, ns, 200)
    procs.producer(redis_url, ns, sim.url)
    (tmp_path / "eval.jsonl").write_text("".join(f'{{"prompt": "Compute {i} + 2.", "label": "{i + 2}"}}\n'
                                                 for i in range(4)))
    monkeypatch.chdir(tmp_path)  # the example names eval.jsonl
    printed: list[tuple[Any, ...]] = []
    trained: list[int] = []
    code = compile(example("eval-lane"), "docs/running.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        scope = {"consumer": consumer, "num_steps": 25, "batch_size": 4,
                 "train_on": lambda groups: trained.append(len(groups)), "print": lambda *a: printed.append(a)}
        async with asyncio.timeout(180):
            await eval(code, scope)  # the block's top-level awaits: a coroutine
    assert trained == [4] * 25
    assert printed, "the eval never finished within 25 training steps"
    step, name, pass_rate, versions, lag = printed[0]
    assert name == "arith-test" and 0 <= pass_rate <= 1 and sum(versions.values()) == 16 and lag >= 0
    # one eval, reported at every step from the one it finished at
    assert [(line[0], line[1]) for line in printed] == [(s, "arith-test") for s in range(step, 25)]


def test_the_curriculum_example_is_a_sampler_feed_loads(tmp_path: Path) -> None:
    path = tmp_path / "my_curriculum.py"
    path.write_text(example("curriculum"))
    sample = load_sampler(f"{path}:sample")  # what `rollstream feed --curriculum my_curriculum.py:sample` loads
    mastered = RowStats(trained=3, rewards=(1.0, 0.9, 1.0), variances=(0.0, 0.1, 0.0), last_version=2, last_epoch=1)
    learning = RowStats(trained=3, rewards=(0.2, 0.5, 0.4), variances=(0.1, 0.2, 0.2), last_version=2, last_epoch=1)
    assert sample(None, 0, 0.99) and sample(RowStats(0, (), (), 0, 0), 0, 0.99)
    assert sample(learning, 2, 0.99)
    assert not sample(mastered, 2, 0.99) and sample(mastered, 2, 0.1)
