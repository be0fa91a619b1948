"""What a request kept over a weight update (``/pause?mode=keep``) generates, token by token.

``.venv-vllm/bin/python -m bench.vllm_keep [--cycles 8] [--clear-cache true|false]``: the tiny model
on a real vLLM (CPU) and two perturbed copies of its weights (v1, v2, as tests/test_vllm.py). Each
cycle starts 8 requests of n=4 (up to 300 tokens, temperature 1), and 0.3-1.2 s later moves vLLM
to the other weights the way ``WeightSync`` does (pause keep, ``reload_weights``,
``update_weight_version``, resume). Every returned token is recomputed in transformers (fp32) with
both weights: a table of how many tokens before / after each sample's split match its span's
version within 1e-3, the worst gap, and how many tokens v1 and v2 themselves agree on.
docs/engines.md ("keep: what holds") quotes a run of each ``--clear-cache``.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

TOLERANCE = 1e-3


def _perturbed(model: Any, seed: int) -> Any:
    import torch

    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return other


def _logprobs(model: Any, ids: list[int], prompt: int, count: int) -> Any:
    import torch

    tokens = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    out = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, tokens[0, 1:, None]).squeeze(-1)
    return out[prompt - 1 : prompt - 1 + count]


async def _cycles(url: str, paths: dict[int, Path], tokenizer: Any, cycles: int, clear: str) -> list[dict[str, Any]]:
    from rollstream.testing.tiny_model import addition_prompts

    rng = random.Random(0)
    results: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as http:

        async def post(path: str, body: Any = None) -> Any:
            reply = await http.post(path, json=body)
            reply.raise_for_status()
            return reply.json()

        async def generate(prompt: str) -> tuple[list[int], Any]:
            ids = tokenizer.encode(prompt)
            params = {"n": 4, "max_tokens": 300, "temperature": 1.0, "logprobs": 0}
            return ids, await post("/inference/v1/generate", {"token_ids": ids, "sampling_params": params,
                                                               "output_mode": "text"})

        async def move(version: int) -> None:
            await post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(paths[version])}})
            await post("/update_weight_version", {"new_version": str(version)})

        await move(1)
        version = 1
        for cycle in range(cycles):
            tasks = [asyncio.create_task(generate(r["prompt"])) for r in addition_prompts(8, seed=100 + cycle)]
            await asyncio.sleep(rng.uniform(0.3, 1.2))
            new = 2 if version == 1 else 1
            await post(f"/pause?mode=keep&clear_cache={clear}")
            await move(new)
            await post("/resume")
            for ids, reply in await asyncio.gather(*tasks):
                for choice in reply["choices"]:
                    results.append({"prompt": ids, "out": choice["token_ids"], "spans": choice["weight_versions"],
                                    "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]]})
            version = new
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=8)
    parser.add_argument("--clear-cache", choices=["true", "false"], default="true")
    args = parser.parse_args(argv)

    import torch
    from rollstream.runtime.redis_server import free_port
    from rollstream.testing.tiny_model import build_model, save_weights
    from rollstream.testing.vllm_server import vllm_server
    from transformers import AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="vllm-keep-") as tmp:
        work = Path(tmp)
        model_dir = build_model(work / "model")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        base = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
        models = {1: _perturbed(base, 1), 2: _perturbed(base, 2)}
        paths = {v: save_weights(m, work / f"v{v}") for v, m in models.items()}
        started = time.monotonic()
        with vllm_server(model_dir, free_port(), work / "vllm.log") as url:
            results = asyncio.run(_cycles(url, paths, tokenizer, args.cycles, args.clear_cache))
    rows = {"spanning": 0, "single": 0, "before ok": 0, "before": 0, "after ok": 0, "after": 0, "single ok": 0,
            "single tokens": 0, "tokens": 0, "v1 ~ v2": 0}
    worst = 0.0
    for r in results:
        count = len(r["out"])
        recomputed = {v: _logprobs(models[v], r["prompt"] + r["out"], len(r["prompt"]), count) for v in (1, 2)}
        rollout = torch.tensor(r["logprobs"])
        rows["tokens"] += count
        rows["v1 ~ v2"] += int(((recomputed[1] - recomputed[2]).abs() <= TOLERANCE).sum())
        spans = [(int(s["version"]), s["start"], s["end"]) for s in r["spans"] or []]
        parts = ("before", "after") if len(spans) == 2 else ("single",)
        rows["spanning" if len(spans) == 2 else "single"] += 1
        for part, (version, start, end) in zip(parts, spans, strict=False):
            gap = (rollout[start:end] - recomputed[version][start:end]).abs()
            worst = max(worst, float(gap.max()) if end > start else 0.0)
            rows[f"{part} ok" if part != "single" else "single ok"] += int((gap <= TOLERANCE).sum())
            rows[part if part != "single" else "single tokens"] += end - start
    print(f"| clear_cache | cycles | spanning samples | before the split: tokens matching the old version | "
          f"after: matching the new | single-version samples: tokens matching | worst gap | tokens where v1 ~ v2 |\n"
          f"|---|---|---|---|---|---|---|---|\n"
          f"| {args.clear_cache} | {args.cycles} | {rows['spanning']} of {rows['spanning'] + rows['single']} | "
          f"{rows['before ok']} of {rows['before']} | {rows['after ok']} of {rows['after']} | "
          f"{rows['single ok']} of {rows['single tokens']} | {worst:.2g} | {rows['v1 ~ v2']} of {rows['tokens']} |\n"
          f"_({time.monotonic() - started:.0f} s)_", flush=True)


if __name__ == "__main__":
    main()
