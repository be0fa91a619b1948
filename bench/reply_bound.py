"""Reply bound: real reply sizes against the derived per-request bound (``reply_byte_bound``).

The longest legitimate replies (every sample uses all of ``max_new_tokens``, log-probs on): the
SGLang reply of ``bench.common.sglang_reply`` (152k vocabulary, 6-decimal log-probs) and the
simulator's SGLang, completions and chat replies (``n`` = 4). Prints each reply's bytes, the
bound the client derives for that request, their ratio, and what ``--concurrency 256`` samples
of such requests can hold in flight, against the former fixed 64 MiB per request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.testing.sim import SimConfig, SimEngine

from bench.common import Table, sglang_reply

CONCURRENCY = 256
OLD_BOUND = 64 * 2**20
PROMPT = "Compute 1 + 2 and box it. " * 40


def _row(what: str, tokens: int, n: int, size: int, bound: int) -> list[Any]:
    in_flight = CONCURRENCY // n * bound  # a request for n samples holds n units of --concurrency
    return [what, f"{n} x {tokens}", size, round(size / (n * tokens), 1), bound, round(bound / size, 1),
            round(in_flight / 2**20), round(CONCURRENCY // n * OLD_BOUND / 2**30)]


async def _sim_rows(tokens: int) -> list[list[Any]]:
    rows = []
    async with SimEngine(SimConfig(seed=3, mean_tokens=tokens * 2, length_sigma=0.0)) as engine:
        client = EngineClient(EngineSettings(urls=(engine.url,), api="openai", model="m", max_new_tokens=tokens))
        messages = [{"role": "user", "content": PROMPT}]
        cases = [
            ("simulator /generate", "/generate", 1,
             {"text": PROMPT, "return_logprob": True, "sampling_params": {"max_new_tokens": tokens}},
             client.reply_limit(tokens)),
            ("simulator /v1/completions", "/v1/completions", 4,
             {"prompt": PROMPT, "n": 4, "max_tokens": tokens, "logprobs": 0, "return_tokens_as_token_ids": True,
              "return_token_ids": True},
             client.reply_limit(tokens, 4, len(PROMPT.encode()) + 16, 5)),
            ("simulator /v1/chat/completions", "/v1/chat/completions", 4,
             {"messages": messages, "n": 4, "max_tokens": tokens, "logprobs": True,
              "return_tokens_as_token_ids": True, "return_token_ids": True},
             client.reply_limit(tokens, 4, len(json.dumps(messages)) + 256, 5)),
        ]
        async with httpx.AsyncClient() as http:
            for what, path, n, body, bound in cases:
                size = len((await http.post(engine.url + path, json=body, timeout=120)).content)
                rows.append(_row(what, tokens, n, size, bound))
        await client.aclose()
    return rows


def run(quick: bool = False) -> list[Table]:
    sizes = [256] if quick else [1024, 4096]
    client = EngineClient(EngineSettings(urls=("http://unused",)))
    rows = [_row("SGLang /generate (152k vocab)", t, 1, len(sglang_reply(t)), client.reply_limit(t)) for t in sizes]
    asyncio.run(client.aclose())
    for tokens in sizes:
        rows += asyncio.run(_sim_rows(tokens))
    return [Table(
        name="reply_bound",
        title="Reply bound: the longest legitimate replies vs the derived per-request bound",
        headers=["reply", "samples x tokens", "bytes", "bytes/token", "derived bound", "bound/reply",
                 f"in flight at --concurrency {CONCURRENCY}, MiB", "with 64 MiB per request, GiB"],
        rows=rows,
        notes=["bound = 256 KiB + n x max_new_tokens x (96 + 256 with log-probs) + (n + 1) x prompt tokens x 12 "
               "(vLLM echoes prompt ids); `producer.engine.reply_byte_bound`"],
        command="python -m bench reply_bound",
    )]
