"""Shared pieces of the benchmarks: the instant engine double, groups, prompts, processes, tables."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import textwrap
import time
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
from redis.asyncio import Redis
from rollstream.common.codec import prompt_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.keys import Keys
from rollstream.common.models import Group, Packed, Prompt, Sample
from rollstream.common.namespace import init_namespace
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineClient, EngineSettings, Generation
from rollstream.producer.rewards import RewardFunction
from rollstream.runtime.children import stop_processes
from rollstream.testing.samples import routed_experts

ROOT = Path(__file__).resolve().parent.parent
# ROLLSTREAM_BENCH_OUT redirects tables, logs and plots (the smoke test keeps the committed ones intact).
OUT = Path(os.environ["ROLLSTREAM_BENCH_OUT"]) if "ROLLSTREAM_BENCH_OUT" in os.environ else ROOT / "bench" / "out"
IMG = OUT / "img" if "ROLLSTREAM_BENCH_OUT" in os.environ else ROOT / "docs" / "img"
PROMPT_TOKENS = 64


# -- data ----------------------------------------------------------------------------------


R3_SHAPE = (48, 8, 128)
"""The routing replay of the R3 benchmarks: 48 MoE layers, top-8 of 128 experts (uint8 ids)."""


def make_group(n: int, tokens: int, *, seed: int = 0, index: int = 0, r3: bool = False, r3_code: str = "B") -> Group:
    """A group of ``n`` samples of ``tokens`` response tokens with log-probs (random values);
    with ``r3``, each sample carries a :data:`R3_SHAPE` routing replay (``r3_code``: its dtype)."""
    rng = random.Random(seed)
    prompt_ids = [rng.randrange(32000) for _ in range(PROMPT_TOKENS)]
    samples = []
    for i in range(n):
        resp = [rng.randrange(152000) for _ in range(tokens)]
        samples.append(
            Sample(
                index=i,
                tokens=array("i", prompt_ids + resp),
                response="x" * 64,
                response_length=tokens,
                reward=1.0,
                finish_reason="stop",
                weight_versions=[0],
                rollout_log_probs=array("f", [-rng.random() * 5 for _ in range(tokens)]),
                metadata={"engine": "http://engine"},
            )
        )
        if r3:
            layers, topk, experts = R3_SHAPE
            replay = routed_experts(PROMPT_TOKENS + tokens, layers, topk, experts, seed + i)
            if r3_code != replay.typecode:
                replay = Packed(array(r3_code, replay.data), replay.shape)
            samples[-1].routed_experts = replay
    return Group(index=index, prompt="What is 1+1?", samples=samples, label="2", producer="bench")


# -- the instant engine double -----------------------------------------------------------------


def sglang_reply(tokens: int, seed: int = 0) -> bytes:
    """A SGLang ``/generate`` reply with ``tokens`` output tokens and their log-probs."""
    rng = random.Random(seed)
    ids = [rng.randrange(152000) for _ in range(tokens)]
    lps = [round(-rng.random() * 5, 6) for _ in range(tokens)]
    body = {
        "text": "The answer is \\boxed{2}.",
        "output_ids": ids,
        "meta_info": {
            "finish_reason": {"type": "stop"},
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
            "weight_version": "0",
            "completion_tokens": tokens,
        },
    }
    return json.dumps(body).encode()


def instant_transport(tokens: int, delay: float = 0.0) -> httpx.MockTransport:
    """An in-process engine: every ``/generate`` answers the same precomputed reply at once
    (or after ``delay`` seconds, without holding a slot)."""
    body = sglang_reply(tokens)
    headers = {"content-type": "application/json"}

    if delay <= 0:

        def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, content=body, headers=headers)

        return httpx.MockTransport(handler)

    import asyncio

    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(delay)
        return httpx.Response(200, content=body, headers=headers)

    return httpx.MockTransport(slow)


class NoEngine(EngineClient):
    """No engine at all: every request returns one prebuilt :class:`Generation` at once (no
    HTTP, no JSON), so a producer on it measures the pipeline's own cost per sample."""

    def __init__(self, tokens: int, settings: EngineSettings | None = None) -> None:
        super().__init__(settings or EngineSettings(urls=("http://none",)), transport=instant_transport(tokens))
        rng = random.Random(0)
        self._reply = Generation(
            text="The answer is \\boxed{2}.",
            output_ids=array("i", [rng.randrange(152000) for _ in range(tokens)]),
            log_probs=array("f", [-rng.random() * 5 for _ in range(tokens)]),
            finish_reason="stop",
            weight_version=0,
            engine="http://none",
        )

    async def _generate(self, n: int, *args: Any) -> list[Generation]:
        return [self._reply] * n


class ConstReward(RewardFunction):
    """Reward 1.0 for every sample: the benchmarks measure the pipeline, not the scorer."""

    name = "const"

    async def _score(self, prompt: Any, label: Any, samples: list[Sample], metadata: Mapping[str, Any]) -> Any:
        return [1.0] * len(samples)


# -- redis ---------------------------------------------------------------------------------


async def init_ns(redis: Redis, ns: str, **config: Any) -> Keys:
    keys = Keys(ns)
    await init_namespace(redis, keys, PipelineConfig(**config), force=True)
    return keys


def bench_prompt(index: int, *, with_ids: bool = True) -> Prompt:
    a, b = index % 97, (index * 7) % 89
    return Prompt(
        index=index,
        prompt=f"What is {a} + {b}?",
        label=str(a + b),
        input_ids=array("i", range(PROMPT_TOKENS)) if with_ids else None,
    )


async def add_prompts(redis: Redis, keys: Keys, start: int, count: int, *, with_ids: bool = True) -> None:
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(start, start + count):
            pipe.xadd(keys.prompts, prompt_fields(bench_prompt(i, with_ids=with_ids)))  # type: ignore[arg-type]
        await pipe.execute()


async def consume(consumer: GroupConsumer, batches: int, batch_size: int) -> float:
    """Seconds to take and commit ``batches`` batches of ``batch_size`` groups."""
    started = time.perf_counter()
    for _ in range(batches):
        batch = await consumer.take(batch_size)
        await consumer.commit(batch)
    return time.perf_counter() - started


# -- processes -------------------------------------------------------------------------------


def spawn(args: Sequence[str], log: Path | None = None, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python -m <args>`` from the repository root, in its own session."""
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(
            [sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, **(env or {})},
        )
    finally:
        if log is not None:
            out.close()  # type: ignore[union-attr]


def stop_all(children: Sequence[subprocess.Popen[bytes]], timeout: float = 15.0) -> None:
    stop_processes(children, timeout)


@contextlib.contextmanager
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        stop_all(procs)


def cpu_seconds(pids: Sequence[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def rss_mb(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return float("nan")


# -- output ----------------------------------------------------------------------------------


@dataclass
class Table:
    """A markdown table plus the notes printed under it."""

    name: str
    title: str
    headers: list[str]
    rows: list[list[Any]]
    notes: list[str]
    command: str = ""

    def markdown(self) -> str:
        def cell(v: Any) -> str:
            if isinstance(v, float):
                if v != v:
                    return "-"
                return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
            return str(v)

        lines = [f"### {self.title}", ""]
        if self.command:
            lines += [f"`{self.command}`", ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "|".join("---" for _ in self.headers) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(cell(v) for v in row) + " |")
        if self.notes:
            lines.append("")
            for note in self.notes:  # wrapped as docs/*.md's prose is (tests/test_protocol.py)
                lines += textwrap.wrap(f"- {note}", width=100, subsequent_indent="  ",
                                       break_long_words=False, break_on_hyphens=False)
        return "\n".join(lines) + "\n"


def machine() -> str:
    return (
        f"{platform.machine()}, {os.cpu_count()} cores ({platform.processor() or platform.platform()}), "
        f"Python {platform.python_version()}"
    )


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


async def wait_engine(url: str) -> None:
    """Until the engine (a simulator started by a benchmark) answers ``/health``, at most 20 s."""
    import asyncio

    import httpx

    async with httpx.AsyncClient() as http:
        for _ in range(400):
            try:
                if (await http.get(url + "/health", timeout=1)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the engine at {url} did not start")
