"""Producer CPU per engine call: an episode function against a slime function (through the
per-episode SGLang ``/generate`` endpoint) and an OpenAI-API agent (through the per-episode chat
endpoint), the same 3-turn episode with tool observations.

The simulator runs in a child process (its CPU is not counted); the parent runs a
:class:`~rollstream.producer.rollout.Rollout` with ``--concurrency`` episodes in flight and
reports *its own* process CPU time per engine call and per episode. What each adds over the
episode API is the cost of the framework's HTTP client (slime's ``post`` is httpx), the endpoint
(aiohttp), and the JSON of the reply (SGLang's ``output_token_logprobs`` lists; for chat, two
chat-template renderings per turn).

Usage::

    python -m bench.adapters --episodes 256 --concurrency 64 --tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import sys
import time
from typing import Any

from rollstream.common.models import Prompt
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.episode import Episode
from rollstream.producer.rewards import load_reward
from rollstream.producer.rollout import Rollout
from rollstream.producer.settings import EpisodeSettings
from rollstream.producer.tokenizer import PromptTokenizer

from bench.common import ROOT, Table, children, machine, spawn

TURNS = 3
N = 4
OBS = "\n<obs>tool result {}</obs>\n"
VARIANTS = ("episode", "slime", "openai")
TOKENIZER = "bench.adapters:ByteChatTokenizer"


class ByteChatTokenizer:
    """Byte ids (the simulator's) and a small chat template."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, messages: Any, tokenize: bool = True, add_generation_prompt: bool = True,
                            tools: Any = None, **kwargs: Any) -> Any:
        text = "".join(f"<{m['role']}>{m.get('content') or ''}</s>" for m in messages)
        if add_generation_prompt:
            text += "<assistant>"
        return self.encode(text) if tokenize else text


async def episode_fn(episode: Episode) -> Any:
    """The baseline: the same loop on the episode API."""
    for turn in range(TURNS):
        await episode.generate()
        if turn < TURNS - 1:
            await episode.observe(list(OBS.format(turn).encode()))
    return episode.sample


async def slime_fn(args: Any, sample: Any, sampling_params: Any) -> Any:
    """A search-r1-style slime function (slime's stand-in modules, as in the tests)."""
    from slime.utils.http_utils import post

    url = f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate"
    sample.tokens = list(sample.prompt.encode())
    for turn in range(TURNS):
        output = await post(url, {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True})
        items = output["meta_info"]["output_token_logprobs"]
        sample.append_response_tokens(args, tokens=[i[1] for i in items], log_probs=[i[0] for i in items],
                                      trainable=True, meta_info=output["meta_info"], text=output["text"])
        if turn < TURNS - 1:
            sample.append_response_tokens(args, tokens=list(OBS.format(turn).encode()), trainable=False)
    return sample


_CLIENT: Any = None


async def openai_fn(*, base_url: str, api_key: str, prompt: Any, request_kwargs: Any, metadata: Any) -> None:
    """An agent loop on raw httpx (the SDK's own cost left out), one client shared by the agents
    (creating an httpx client costs ~80 ms of CPU, its SSL context)."""
    global _CLIENT
    import httpx

    if _CLIENT is None:
        _CLIENT = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=None))
    client = _CLIENT
    messages = [{"role": "user", "content": prompt}]
    headers = {"Authorization": f"Bearer {api_key}"}
    if True:
        for turn in range(TURNS):
            reply = await client.post(f"{base_url}/chat/completions", headers=headers,
                                      json={"model": "m", "messages": messages, **request_kwargs})
            reply.raise_for_status()
            messages.append(reply.json()["choices"][0]["message"])
            if turn < TURNS - 1:
                messages.append({"role": "tool", "content": f"tool result {turn}"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_http(url: str) -> None:
    import httpx

    async with httpx.AsyncClient() as client:
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url + "/health")).status_code == 200:
                    return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the simulator at {url} did not start")


async def measure(variant: str, url: str, episodes: int, concurrency: int, tokens: int) -> dict[str, float]:
    from rollstream.integrations.endpoints import EndpointServer
    from rollstream.integrations.generate import load_framework_generate

    server = EndpointServer()
    if variant == "episode":
        fn: Any = episode_fn
    else:
        fn = load_framework_generate(f"{variant}:bench.adapters:{variant}_fn", tokenizer=TOKENIZER,
                                     concurrency=concurrency * N, server=server)
    settings = EngineSettings(urls=(url,), max_new_tokens=tokens, max_connections=concurrency * N)
    async with EngineClient(settings, tokenizer=PromptTokenizer(tokenizer=ByteChatTokenizer())) as engine:
        rollout = Rollout(engine, load_reward("math"), N, EpisodeSettings(generate=fn))
        groups = episodes // N
        gate = asyncio.Semaphore(max(1, concurrency // N))

        async def one(i: int) -> None:
            async with gate:
                group = await rollout.run(Prompt(index=i, prompt=f"Compute {i} + 1.", label=str(i + 1)), 0)
                bad = [s.error for s in group.samples if s.error]
                if bad:
                    raise RuntimeError(f"{variant}: {bad[0]}")

        await one(0)  # warm-up (imports, first connections), not counted
        cpu0, wall0, calls0 = time.process_time(), time.monotonic(), rollout.runtime.episode_turns
        async with asyncio.TaskGroup() as tg:
            for i in range(1, groups + 1):
                tg.create_task(one(i))
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        calls = rollout.runtime.episode_turns - calls0
    await server.aclose()
    global _CLIENT
    if _CLIENT is not None:
        await _CLIENT.aclose()
        _CLIENT = None
    return {"cpu_per_call_ms": 1000 * cpu / calls, "cpu_per_episode_ms": 1000 * cpu / (groups * N),
            "calls": calls, "wall": wall}


def run(quick: bool = False, episodes: int = 512, concurrency: int = 64, tokens: int = 256) -> list[Table]:
    standins = str(ROOT / "tests" / "standins")  # slime's stand-in modules (http_utils, Sample)
    if standins not in sys.path:
        sys.path.insert(0, standins)
    if quick:
        episodes, concurrency, tokens = 16, 8, 32
    port = _free_port()
    rows = []
    with children() as procs:
        procs.append(spawn(["-m", "rollstream.cli", "sim-engine", "--port", str(port), "--mean-tokens", str(tokens),
                            "--length-sigma", "0", "--max-running", "100000"]))
        url = f"http://127.0.0.1:{port}"
        asyncio.run(_wait_http(url))
        results = {v: asyncio.run(measure(v, url, episodes, concurrency, tokens)) for v in VARIANTS}
    base = results["episode"]["cpu_per_call_ms"]
    for variant in VARIANTS:
        r = results[variant]
        rows.append([variant, int(r["calls"]), r["cpu_per_call_ms"], r["cpu_per_episode_ms"],
                     r["cpu_per_call_ms"] / base, r["wall"]])
    return [Table(
        name="adapters",
        title=f"Producer CPU per engine call: episode API vs slime function vs OpenAI agent ({machine()})",
        headers=["rollout", "engine calls", "CPU ms / call", "CPU ms / episode", "x episode API", "wall s"],
        rows=rows,
        notes=[f"{episodes} episodes ({N} per group), {concurrency} in flight, {TURNS} turns each with 2 tool "
               f"observations, {tokens}-token replies from the simulator in a child process (its CPU not counted)",
               "slime: slime's post (httpx) → the episode's /generate endpoint (aiohttp) → the engine client; "
               "openai: raw httpx → /v1/chat/completions (two chat-template renderings per turn)"],
        command=f"python -m bench.adapters --episodes {episodes} --concurrency {concurrency} --tokens {tokens}",
    )]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.adapters", description=__doc__)
    parser.add_argument("--episodes", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    for table in run(args.quick, args.episodes, args.concurrency, args.tokens):
        print(table.markdown())


if __name__ == "__main__":
    main()
