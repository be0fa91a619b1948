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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from rollstream.common.codec import prompt_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt
from rollstream.consumer import GroupConsumer
from rollstream.engines import WeightSync
from rollstream.testing.children import start_cli, stop_processes
from rollstream.testing.server import EmbeddedRedis, free_port
from rollstream.testing.tiny_model import addition_prompts, build_model
from rollstream.testing.vllm_server import vllm_server

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


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop vLLM and the children on SIGTERM too
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32, help="samples in flight, both sides")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
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
                for round_ in range(args.rounds):
                    raw_tokens, raw_s = asyncio.run(raw_round(url, ids, args.concurrency, args.max_tokens))
                    rs_tokens, rs_s = asyncio.run(rollstream_round(redis.url, "b", records))
                    row = {"round": round_, "raw_tok_s": raw_tokens / raw_s, "rollstream_tok_s": rs_tokens / rs_s,
                           "raw_tokens": raw_tokens, "rollstream_tokens": rs_tokens}
                    row["ratio"] = row["rollstream_tok_s"] / row["raw_tok_s"]
                    results.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                stop_processes([producer])
    print("| round | raw tok/s | rollstream tok/s | rollstream / raw |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['round']} | {r['raw_tok_s']:.0f} | {r['rollstream_tok_s']:.0f} | {r['ratio']:.2f} |")


async def _set_version(url: str) -> None:
    async with WeightSync([url]) as sync:
        await sync.set_version(0)


if __name__ == "__main__":
    main()
