"""EngineClient against the simulator in-process, and its config and tokenizer errors."""

from __future__ import annotations

import httpx
import pytest
from rollstream.common.errors import ConfigError, EngineRejected
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.tokenizer import PromptTokenizer, load_tokenizer
from rollstream.testing.sim import SimEngine
from rollstream.testing.sim.simulator import render_chat, tokenize


async def test_openai_generate_n_is_one_request_with_ids_and_logprobs(sim: SimEngine) -> None:
    settings = EngineSettings(urls=(sim.url,), api="openai", model="rollstream-sim", max_new_tokens=64)
    async with EngineClient(settings) as engine:
        generations = await engine.generate_n(3, input_ids=tokenize("Compute 2 + 2"))
        assert engine.in_flight == 0
    assert sim.state.requests == 1 and len(generations) == 3
    for g in generations:
        assert g.prompt_ids is not None and list(g.prompt_ids) == tokenize("Compute 2 + 2")
        assert g.log_probs is not None and len(g.log_probs) == len(g.output_ids) > 0
        assert g.finish_reason in ("stop", "length")


async def test_openai_weight_version_is_none_without_a_model_info_endpoint(sim: SimEngine) -> None:
    sim.state.model_info_mode = "absent"  # no /weight_info, /model_info nor /get_model_info
    settings = EngineSettings(urls=(sim.url,), api="openai", model="m")
    async with EngineClient(settings) as engine:
        generation = await engine.generate(text="Compute 1 + 1")
    assert generation.weight_version is None  # the producer then records the trainer's version


async def test_chat_messages_on_sglang_are_rejected_and_on_openai_use_chat_completions(sim: SimEngine) -> None:
    messages = [{"role": "user", "content": "Compute 5 + 5"}]
    async with EngineClient(EngineSettings(urls=(sim.url,))) as engine:
        with pytest.raises(EngineRejected, match="tokenizer"):
            await engine.generate(messages=messages)
    async with EngineClient(EngineSettings(urls=(sim.url,), api="openai", model="m")) as engine:
        generation = await engine.generate(messages=messages)
    assert generation.prompt_ids is not None and list(generation.prompt_ids) == tokenize(render_chat(messages))


class _Fake:
    def encode(self, text: str) -> list[int]:
        return [1, *text.encode()]

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> list[list[int]]:
        return [[9, *(len(m["content"]) for m in messages)]]


async def test_a_given_tokenizer_replaces_the_engine_tokenize(sim: SimEngine) -> None:
    async with EngineClient(EngineSettings(urls=(sim.url,)), tokenizer=PromptTokenizer(tokenizer=_Fake())) as engine:
        assert await engine.tokenize("ab") == [1, 97, 98]
        assert await engine.chat_ids([{"role": "user", "content": "abc"}]) == [9, 3]


def test_tokenizer_errors_are_clear() -> None:
    with pytest.raises(ConfigError, match="cannot load"):
        load_tokenizer("no_such_module_xyz:Tok")
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="transformers"):
            load_tokenizer("org/some-model")
    with pytest.raises(ConfigError, match="--model"):
        EngineSettings(urls=("http://x",), api="openai")


async def test_url_credentials_travel_as_basic_auth_only(sim: SimEngine) -> None:
    """`http://user:pw@host` works (aiohttp refuses credentials in the URL beside a header): the
    request carries `Authorization: Basic`, the engine's URL as shown holds no password."""
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        assert "@" not in str(request.url)
        return httpx.Response(200, json={"text": "x", "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"},
                                                                                       "output_token_logprobs": [[-0.1, 1, None]]}})

    url = sim.url.replace("http://", "http://user:p%40ss@")
    async with EngineClient(EngineSettings(urls=(url,)), transport=httpx.MockTransport(handler)) as engine:
        await engine.generate(input_ids=[1, 2])
        assert "p%40ss" not in repr(engine._engines[0].url) and "user" not in engine._engines[0].url
    expected = httpx.BasicAuth("user", "p@ss")._auth_header
    assert seen and all(h == expected for h in seen)
