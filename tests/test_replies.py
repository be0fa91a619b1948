"""The fast reply parser against the stdlib parser on real-shaped replies; malformed replies give
a clear EngineReplyInvalid (never a crash); the reply size bound and the total deadline."""

from __future__ import annotations

import asyncio
import json
import random
from array import array
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web
from rollstream.common.errors import EngineRejected
from rollstream.producer.engine import EngineClient, EngineReplyInvalid, EngineSettings
from rollstream.producer.engine.openai import parse_chat, parse_completions
from rollstream.producer.engine.sglang import parse_sglang


def _sglang(tokens: int, *, logprobs: bool = True, seed: int = 0, finish: Any = None) -> dict[str, Any]:
    rng = random.Random(seed)
    ids = [rng.randrange(151_000) for _ in range(tokens)]
    meta: dict[str, Any] = {
        "id": "abc",
        "finish_reason": finish if finish is not None else {"type": "length", "length": tokens},
        "prompt_tokens": 10,
        "completion_tokens": tokens,
        "weight_version": "7",
    }
    if logprobs:
        meta["output_token_logprobs"] = [[-rng.random() * 5, t, None] for t in ids]
    return {"text": "x" * tokens, "output_ids": ids, "meta_info": meta}


def _completions(tokens: int, n: int, *, token_ids: bool) -> dict[str, Any]:
    rng = random.Random(n)
    choices = []
    for index in reversed(range(n)):  # out of order on purpose: the parser sorts by index
        ids = [rng.randrange(151_000) for _ in range(tokens)]
        choice: dict[str, Any] = {
            "index": index,
            "text": f"answer {index}",
            "finish_reason": "stop",
            "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-rng.random() for _ in ids]},
        }
        if token_ids:
            choice["token_ids"] = ids
        choices.append(choice)
    return {"id": "cmpl", "choices": choices, "prompt_token_ids": [1, 2, 3]}


def _chat(tokens: int, n: int) -> dict[str, Any]:
    rng = random.Random(n)
    choices = []
    for index in range(n):
        ids = [rng.randrange(151_000) for _ in range(tokens)]
        content = [{"token": f"token_id:{t}", "logprob": -rng.random(), "top_logprobs": []} for t in ids]
        choices.append(
            {
                "index": index,
                "message": {"role": "assistant", "content": f"reply {index}"},
                "finish_reason": "length",
                "logprobs": {"content": content},
                "prompt_token_ids": [5, 6],
            }
        )
    return {"id": "chat", "choices": choices}


# -- parity with the stdlib parser ------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [0, 1, 1024, 8192])
@pytest.mark.parametrize("logprobs", [True, False])
def test_sglang_matches_the_stdlib_parser(tokens: int, logprobs: bool) -> None:
    reply = _sglang(tokens, logprobs=logprobs)
    raw = json.dumps(reply).encode()
    [parsed] = parse_sglang(raw, want_logprobs=logprobs)
    reference = json.loads(raw)
    assert isinstance(parsed.output_ids, array) and parsed.output_ids.typecode == "i"
    assert list(parsed.output_ids) == reference["output_ids"]
    assert parsed.text == reference["text"]
    assert parsed.finish_reason == "length"
    assert parsed.weight_version == 7
    if logprobs:
        assert parsed.log_probs == array("f", [p[0] for p in reference["meta_info"]["output_token_logprobs"]])
    else:
        assert parsed.log_probs is None


def test_sglang_list_reply_for_n_and_ids_from_logprob_pairs_and_string_finish() -> None:
    replies = [_sglang(5, seed=i) for i in range(3)]
    parsed = parse_sglang(json.dumps(replies).encode(), want_logprobs=True)
    assert [list(p.output_ids) for p in parsed] == [r["output_ids"] for r in replies]
    reply = _sglang(4, finish="stop")
    del reply["output_ids"]
    [one] = parse_sglang(json.dumps(reply).encode(), want_logprobs=True)
    assert list(one.output_ids) == [p[1] for p in reply["meta_info"]["output_token_logprobs"]]
    assert one.finish_reason == "stop"


def test_sglang_abort_without_tokens_is_a_valid_empty_sample() -> None:
    raw = json.dumps({"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "x"}}}).encode()
    [parsed] = parse_sglang(raw, want_logprobs=True)
    assert parsed.finish_reason == "abort" and len(parsed.output_ids) == 0 and parsed.log_probs is None


@pytest.mark.parametrize("token_ids", [True, False])
def test_completions_with_n_match_the_stdlib_parser(token_ids: bool) -> None:
    reply = _completions(300, 4, token_ids=token_ids)
    parsed = parse_completions(json.dumps(reply).encode(), 4, want_logprobs=True)
    by_index = sorted(reply["choices"], key=lambda c: c["index"])
    for p, choice in zip(parsed, by_index, strict=True):
        assert list(p.output_ids) == [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
        assert p.log_probs == array("f", choice["logprobs"]["token_logprobs"])
        assert p.text == choice["text"] and p.finish_reason == "stop"
        assert p.prompt_ids == array("i", [1, 2, 3])


def test_chat_matches_the_stdlib_parser() -> None:
    reply = _chat(200, 2)
    parsed = parse_chat(json.dumps(reply).encode(), 2, want_logprobs=True)
    for p, choice in zip(parsed, reply["choices"], strict=True):
        content = choice["logprobs"]["content"]
        assert list(p.output_ids) == [int(c["token"].split(":")[1]) for c in content]
        assert p.log_probs == array("f", [c["logprob"] for c in content])
        assert p.text == choice["message"]["content"] and p.prompt_ids == array("i", [5, 6])


def test_openai_without_logprobs_or_ids_gives_empty_ids() -> None:
    reply = {"choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}]}
    [parsed] = parse_completions(json.dumps(reply).encode(), 1, want_logprobs=False)
    assert parsed.text == "hi" and len(parsed.output_ids) == 0 and parsed.log_probs is None


# -- malformed replies ---------------------------------------------------------------------------------


def _mutated(change: Callable[[dict[str, Any]], Any]) -> bytes:
    reply = _sglang(4)
    change(reply)
    return json.dumps(reply).encode()


def _set_logprob(value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda r: r["meta_info"]["output_token_logprobs"][2].__setitem__(0, value)


MALFORMED_SGLANG = {
    "empty object": (b"{}", "schema"),
    "empty list": (b"[]", "schema"),
    "not json": (b"<html>bad gateway</html>", "not_json"),
    "truncated": (json.dumps(_sglang(4)).encode()[:-7], "not_json"),
    "a number": (b"42", "schema"),
    "meta_info missing": (_mutated(lambda r: r.pop("meta_info")), "schema"),
    "meta_info not an object": (_mutated(lambda r: r.__setitem__("meta_info", [1])), "schema"),
    "finish_reason missing": (_mutated(lambda r: r["meta_info"].pop("finish_reason")), "schema"),
    "output_ids a string": (_mutated(lambda r: r.__setitem__("output_ids", "1 2 3")), "schema"),
    "token id a float": (_mutated(lambda r: r["output_ids"].__setitem__(1, 1.5)), "schema"),
    "negative token id": (_mutated(lambda r: r["output_ids"].__setitem__(1, -3)), "schema"),
    "huge token id": (_mutated(lambda r: r["output_ids"].__setitem__(1, 2**40)), "schema"),
    "text not a string": (_mutated(lambda r: r.__setitem__("text", 5)), "schema"),
    "NaN log-prob": (_mutated(_set_logprob(float("nan"))), "not_json"),
    "inf log-prob": (_mutated(_set_logprob(float("-inf"))), "not_json"),
    "overflowing log-prob": (_mutated(_set_logprob(-1e300)), "non_finite_logprob"),
    "null log-prob": (_mutated(_set_logprob(None)), "non_finite_logprob"),
    "string log-prob": (_mutated(_set_logprob("-0.5")), "schema"),
    "pair too short": (_mutated(lambda r: r["meta_info"]["output_token_logprobs"].__setitem__(0, [-0.1])), "schema"),
    "fewer log-probs": (_mutated(lambda r: r["meta_info"]["output_token_logprobs"].pop()), "count_mismatch"),
    "no log-probs": (_mutated(lambda r: r["meta_info"].pop("output_token_logprobs")), "no_logprobs"),
    "no ids at all": (_mutated(lambda r: (r.pop("output_ids"), r["meta_info"].pop("output_token_logprobs"))), "schema"),
}


@pytest.mark.parametrize("name", list(MALFORMED_SGLANG))
def test_malformed_sglang_replies_raise_a_clear_error(name: str) -> None:
    raw, reason = MALFORMED_SGLANG[name]
    with pytest.raises(EngineReplyInvalid) as info:
        parse_sglang(raw, want_logprobs=True, where="http://e/generate")
    assert info.value.reason == reason
    assert isinstance(info.value, EngineRejected)  # the producer makes a FAILED sample of it
    assert "http://e/generate" in str(info.value) and reason in str(info.value)


def test_malformed_openai_replies_raise_a_clear_error() -> None:
    good = _completions(3, 2, token_ids=True)
    cases: list[tuple[bytes, int, str]] = [
        (b"{}", 2, "schema"),
        (json.dumps(good).encode(), 3, "choices"),
        (json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode(), 1, "schema"),  # no finish_reason
    ]
    short = json.loads(json.dumps(good))
    short["choices"][0]["logprobs"]["token_logprobs"].pop()
    cases.append((json.dumps(short).encode(), 2, "count_mismatch"))
    garbled = _completions(3, 1, token_ids=False)
    garbled["choices"][0]["logprobs"]["tokens"][0] = "hello"
    cases.append((json.dumps(garbled).encode(), 1, "schema"))
    for raw, n, reason in cases:
        with pytest.raises(EngineReplyInvalid) as info:
            parse_completions(raw, n, want_logprobs=True)
        assert info.value.reason == reason, raw
    chat = _chat(3, 1)
    chat["choices"][0]["logprobs"]["content"][1]["logprob"] = None
    with pytest.raises(EngineReplyInvalid, match="non_finite_logprob"):
        parse_chat(json.dumps(chat).encode(), 1, want_logprobs=True)


async def test_an_invalid_reply_fails_the_request_without_retries() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"meta_info": {}}))
    async with EngineClient(EngineSettings(urls=("http://e",)), transport=transport) as engine:
        with pytest.raises(EngineReplyInvalid, match="schema"):
            await engine.generate(input_ids=[1, 2])
        assert engine.retries == 0 and engine.errors == {"bad_reply": 1} and engine.in_flight == 0


async def test_generation_arrays_through_a_mock_transport() -> None:
    reply = _sglang(16)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=reply))
    async with EngineClient(EngineSettings(urls=("http://e",)), transport=transport) as engine:
        generation = await engine.generate(input_ids=array("i", [1, 2]))
    assert generation.output_ids == array("i", reply["output_ids"])
    assert generation.log_probs is not None and len(generation.log_probs) == 16
    assert generation.weight_version == 7


# -- the size bound and the total deadline, against a real local server ------------------------------


async def _endless(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    while True:
        await response.write(b" " * 65536)


async def _drip(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse()
    response.enable_chunked_encoding()
    await response.prepare(request)
    while True:
        await response.write(b" ")
        await asyncio.sleep(0.05)


async def _declared_huge(request: web.Request) -> web.Response:
    return web.Response(body=b" " * 300_000, content_type="application/json")


@pytest.fixture
async def stub() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/endless/generate", _endless)
    app.router.add_post("/drip/generate", _drip)
    app.router.add_post("/huge/generate", _declared_huge)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await asyncio.wait_for(runner.cleanup(), 10)


@pytest.mark.parametrize("path", ["endless", "huge"])
async def test_a_reply_larger_than_the_bound_fails_the_request(stub: str, path: str) -> None:
    settings = EngineSettings(urls=(f"{stub}/{path}",), max_reply_bytes=200_000, request_timeout=20)
    async with EngineClient(settings) as engine:
        with pytest.raises(EngineReplyInvalid, match="too_large") as info:
            await asyncio.wait_for(engine.generate(input_ids=[1]), 30)
    assert info.value.reason == "too_large" and engine.retries == 0


async def test_a_dripping_reply_fails_at_the_total_deadline(stub: str) -> None:
    settings = EngineSettings(urls=(f"{stub}/drip",), request_timeout=1.0)
    async with EngineClient(settings) as engine:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(EngineReplyInvalid, match="deadline") as info:
            await asyncio.wait_for(engine.generate(input_ids=[1]), 30)
        assert 0.9 < loop.time() - start < 10  # the 1 s deadline, not the endless drip
    assert info.value.reason == "deadline"
