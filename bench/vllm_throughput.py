"""Tokens/s through rollstream against a raw client, on the same real vLLM (CPU, the tiny model).

``.venv-vllm/bin/python -m bench.vllm_throughput [--prompts 96] [--concurrency 32] [--rounds 2]``

Both sides send the same requests (``/inference/v1/generate``, token ids, ``n`` = 4, the same
``max_tokens``, the same number of samples in flight) to one vLLM; raw is an aiohttp loop with a
semaphore, rollstream is one producer process (``--engine-api vllm``) and a trainer taking every
group. Rounds alternate raw / rollstream after a warm-up round, so load from elsewhere hits both.
Timed from the first request (raw) or the resume that lets the already-running producer admit
(rollstream) to the last sample (raw) or the last group taken (rollstream): rollstream's figure
includes Redis, the reward, publishing and the trainer's take. The model is the untrained tiny
Llama, so nearly every sample runs to ``max_tokens`` (fixed work per request).

Beside the rates, per round: the CPU-seconds the client side used (raw: this process; rollstream:
the producer, Redis and this process as the trainer) — on a CPU engine every one of them is taken
from the engine's cores — and the engine's own view, sampled from its ``/metrics`` every 0.2 s:
the mean number of requests running and waiting (how busy each client kept it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from rollstream.common.codec import prompt_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt
from rollstream.consumer import GroupConsumer
from rollstream.runtime.children import start_cli, stop_processes
from rollstream.runtime.redis_server import EmbeddedRedis, free_port
from rollstream.testing.tiny_model import addition_prompts, build_model
from rollstream.testing.vllm_server import vllm_server
from rollstream.weight_sync import WeightSync

N = 4


async def raw_round(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[int, float]:
    gate = asyncio.Semaphore(max(1, concurrency // N))
    tokens = 0

    async def one(session: aiohttp.ClientSession, ids: list[int]) -> None:
        nonlocal tokens
        body = {"token_ids": ids, "output_mode": "text",
                "sampling_params": {"n": N, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "logprobs": 0}}
        async with gate, session.post(url + "/inference/v1/generate", json=body) as response:
            reply = await response.json()
        tokens += sum(len(c["token_ids"]) for c in reply["choices"])

    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, ids) for ids in prompts))
    return tokens, time.monotonic() - started


async def rollstream_round(redis_url: str, ns: str, records: list[dict[str, str]]) -> tuple[int, float]:
    keys = Keys(ns)
    async with GroupConsumer.connect(redis_url, ns, "bench", stall_timeout=300) as consumer:
        deadline = time.monotonic() + 300
        while b'"running"' not in ((await consumer.redis.hget(keys.producers, "bench")) or b""):
            if time.monotonic() > deadline:
                raise RuntimeError("the producer did not start")
            await asyncio.sleep(0.2)
        await consumer.pause()
        for i, r in enumerate(records):
            await consumer.redis.xadd(keys.prompts, prompt_fields(Prompt(index=i, prompt=r["prompt"], label=r["label"])))
        started = time.monotonic()
        await consumer.resume()
        tokens = taken = 0
        while taken < len(records):
            batch = await consumer.take(min(8, len(records) - taken))
            taken += len(batch.groups)
            tokens += sum(s.response_length for g in batch.groups for s in g.samples)
            await consumer.commit(batch)
        return tokens, time.monotonic() - started


async def shared_windows(
    url: str, redis_url: str, ns: str, records: list[dict[str, str]], prompts: list[list[int]], concurrency: int,
    max_tokens: int, windows: int, seconds: float,
) -> list[tuple[int, int]]:
    """Raw and rollstream at once on the same engine, each with ``concurrency`` samples in flight
    and never out of prompts: the (raw, rollstream) tokens completed in each of ``windows``
    windows of ``seconds`` after a warm-up. Sharing the engine at every instant, both see the same
    engine speed (continuous batching serves every sequence alike), so the ratio is how fully each
    keeps its own slots busy, free of the load other processes put on the machine."""
    keys = Keys(ns)
    marks: list[float] = []
    raw_done: list[tuple[float, int]] = []
    rs_done: list[tuple[float, int]] = []
    stop = asyncio.Event()

    async def raw_worker(session: aiohttp.ClientSession, offset: int) -> None:
        i = offset
        while not stop.is_set():
            body = {"token_ids": prompts[i % len(prompts)], "output_mode": "text",
                    "sampling_params": {"n": N, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0,
                                        "logprobs": 0}}
            async with session.post(url + "/inference/v1/generate", json=body) as response:
                reply = await response.json()
            raw_done.append((time.monotonic(), sum(len(c["token_ids"]) for c in reply["choices"])))
            i += concurrency // N

    async with GroupConsumer.connect(redis_url, ns, "bench", stall_timeout=300) as consumer:
        await consumer.pause()
        total = int((windows + 1) * seconds * 2 * concurrency // N) + 4 * len(records)  # more than it can do
        for i in range(total):
            r = records[i % len(records)]
            await consumer.redis.xadd(keys.prompts, prompt_fields(Prompt(index=10**6 + i, prompt=r["prompt"],
                                                                         label=r["label"])))

        async def trainer() -> None:
            while not stop.is_set():
                batch = await consumer.take(1)
                rs_done.append((time.monotonic(), sum(s.response_length for g in batch.groups for s in g.samples)))
                await consumer.commit(batch)

        async with aiohttp.ClientSession() as session:
            await consumer.resume()
            tasks = [asyncio.create_task(raw_worker(session, k)) for k in range(max(1, concurrency // N))]
            tasks.append(asyncio.create_task(trainer()))
            start = time.monotonic() + seconds  # one window of warm-up
            marks = [start + k * seconds for k in range(windows + 1)]
            await asyncio.sleep(marks[-1] - time.monotonic())
            stop.set()
            await consumer.pause()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    out = []
    for k in range(windows):
        lo, hi = marks[k], marks[k + 1]
        out.append((sum(t for at, t in raw_done if lo <= at < hi), sum(t for at, t in rs_done if lo <= at < hi)))
    return out


class Occupancy:
    """The engine's running / waiting requests, sampled from ``/metrics`` while a round runs."""

    def __init__(self, url: str) -> None:
        self.url = url + "/metrics"
        self.running: list[float] = []
        self.waiting: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    async with session.get(self.url) as response:
                        text = await response.text() if response.status == 200 else ""
                except aiohttp.ClientError:
                    text = ""
                for line in text.splitlines():
                    if line.startswith("vllm:num_requests_running"):
                        self.running.append(float(line.rsplit(" ", 1)[1]))
                    elif line.startswith("vllm:num_requests_waiting"):
                        self.waiting.append(float(line.rsplit(" ", 1)[1]))
                await asyncio.sleep(0.2)

    async def __aenter__(self) -> Occupancy:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def means(self) -> tuple[float, float]:
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return mean(self.running), mean(self.waiting)


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


async def measured(url: str, pids: dict[str, int], work: Any) -> dict[str, float]:
    """``work``'s tokens and seconds, the CPU-seconds of each of ``pids`` and the engine's mean
    running / waiting requests over it."""
    cpu0 = {name: cpu_of([pid]) for name, pid in pids.items()}
    async with Occupancy(url) as occupancy:
        tokens, seconds = await work
    running, waiting = occupancy.means()
    out = {"tokens": tokens, "s": seconds, "tok_s": tokens / seconds, "running": running, "waiting": waiting}
    for name, pid in pids.items():
        out[f"cpu_{name}"] = cpu_of([pid]) - cpu0[name]
    return out


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop vLLM and the children on SIGTERM too
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32, help="samples in flight, both sides")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shared-windows", type=int, default=0,
                   help="then run both at once on the engine for this many windows (see shared_windows)")
    p.add_argument("--window", type=float, default=20.0, help="seconds per shared window")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        model = build_model(work / "model")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model))
        records = addition_prompts(args.prompts, seed=7)
        ids = [tokenizer.encode(r["prompt"]) for r in records]
        with vllm_server(model, free_port(), work / "vllm.log") as url, EmbeddedRedis(dir=work / "redis") as redis:
            asyncio.run(_set_version(url))
            subprocess.run([sys.executable, "-m", "rollstream.cli", "init", "--redis", redis.url, "--ns", "b",
                            "--n-samples", str(N), "--batch-size", "8", "--max-backlog", str(args.prompts),
                            "--force", "--log-level", "WARNING"], check=True)
            producer = start_cli(["produce", "--redis", redis.url, "--ns", "b", "--engine", url, "--engine-api", "vllm",
                                  "--tokenizer", str(model), "--concurrency", str(args.concurrency),
                                  "--max-new-tokens", str(args.max_tokens), "--reward",
                                  "rollstream.testing.tiny_model:exact_reward", "--name", "bench"],
                                 work / "producer.log")
            try:
                asyncio.run(raw_round(url, ids, args.concurrency, args.max_tokens))  # warm-up
                results: list[dict[str, float]] = []
                assert redis.process is not None
                pids = {"bench": os.getpid(), "producer": producer.pid, "redis": redis.process.pid}
                for round_ in range(args.rounds):
                    raw = asyncio.run(measured(url, pids, raw_round(url, ids, args.concurrency, args.max_tokens)))
                    rs = asyncio.run(measured(url, pids, rollstream_round(redis.url, "b", records)))
                    row: dict[str, float] = {"round": round_, "ratio": rs["tok_s"] / raw["tok_s"]}
                    row.update({f"raw_{k}": v for k, v in raw.items()})
                    row.update({f"rollstream_{k}": v for k, v in rs.items()})
                    results.append(row)
                    print(json.dumps(row), flush=True)
                shared = []
                if args.shared_windows:
                    shared = asyncio.run(shared_windows(url, redis.url, "b", records, ids, args.concurrency,
                                                        args.max_tokens, args.shared_windows, args.window))
                    print(json.dumps({"shared_windows": shared}), flush=True)
            finally:
                stop_processes([producer])
    print("| round | raw tok/s | rollstream tok/s | rollstream / raw | client CPU-s raw / rollstream (producer + Redis + "
          "trainer) | engine requests running raw / rollstream (mean) |")
    print("|---|---|---|---|---|---|")
    for r in results:
        rs_cpu = r["rollstream_cpu_producer"] + r["rollstream_cpu_redis"] + r["rollstream_cpu_bench"]
        print(f"| {r['round']} | {r['raw_tok_s']:.0f} | {r['rollstream_tok_s']:.0f} | {r['ratio']:.2f} | "
              f"{r['raw_cpu_bench']:.2f} / {rs_cpu:.2f} ({r['rollstream_cpu_producer']:.2f} + "
              f"{r['rollstream_cpu_redis']:.2f} + {r['rollstream_cpu_bench']:.2f}) | "
              f"{r['raw_running']:.1f} / {r['rollstream_running']:.1f} |")
    ratios = sorted(r["ratio"] for r in results)
    if ratios:
        print(f"\nrollstream / raw: median {ratios[len(ratios) // 2]:.2f}, range {ratios[0]:.2f}-{ratios[-1]:.2f} "
              f"over {len(ratios)} rounds")
    if shared:
        print(f"\n| shared window ({args.window:g} s) | raw tok/s | rollstream tok/s | rollstream / raw |")
        print("|---|---|---|---|")
        for k, (raw_tokens, rs_tokens) in enumerate(shared):
            print(f"| {k} | {raw_tokens / args.window:.0f} | {rs_tokens / args.window:.0f} | "
                  f"{rs_tokens / max(1, raw_tokens):.2f} |")
        raw_sum, rs_sum = sum(r for r, _ in shared), sum(x for _, x in shared)
        print(f"\nshared engine, all windows: rollstream / raw = {rs_sum / max(1, raw_sum):.3f}")


async def _set_version(url: str) -> None:
    async with WeightSync([url]) as sync:
        await sync.set_version(0)


if __name__ == "__main__":
    main()
