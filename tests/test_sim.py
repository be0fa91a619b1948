"""Tests of the simulated engine (a test double for SGLang / vLLM)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from rollstream.testing.sim import SimConfig, SimEngine, detokenize, evaluate_last_expression, tokenize

QUESTION = "What is 8 * 12 - 5?"
BOXED = re.compile(r"\\boxed\{([^}]*)\}")

Factory = Callable[..., Awaitable[tuple[SimEngine, httpx.AsyncClient]]]


@pytest.fixture
async def sim() -> AsyncIterator[Factory]:
    """Start simulated engines (with an httpx client each); all are closed at the end."""
    started: list[tuple[SimEngine, httpx.AsyncClient]] = []

    async def start(**kwargs: Any) -> tuple[SimEngine, httpx.AsyncClient]:
        engine = SimEngine(SimConfig(**kwargs))
        await engine.start()
        client = httpx.AsyncClient(base_url=engine.url, timeout=10.0)
        started.append((engine, client))
        return engine, client

    yield start
    for engine, client in started:
        await client.aclose()
        await engine.aclose()


async def _wait_for(predicate: Callable[[], bool], limit: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + limit
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


# --------------------------------------------------------------------------- pure helpers


def test_tokenizer_round_trip() -> None:
    text = "héllo 8 * 3"
    ids = tokenize(text)
    assert ids == list(text.encode())
    assert all(0 <= i <= 255 for i in ids)
    assert detokenize(ids) == text
    assert detokenize([ord("a") + 256]) == "a"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (QUESTION, 91),
        ("first 1 + 1, then (3 + 4) * 2?", 14),
        ("7 / 2", 3.5),
        ("10 / 3", 3.33),
        ("8 / 4", 2),
        ("no numbers here", None),
        ("just 42", None),
        ("What is 2 + 3? ... The answer is \\boxed{-4", 5),
        ("1 / 0", None),
    ],
)
def test_evaluate_last_expression(text: str, expected: int | float | None) -> None:
    assert evaluate_last_expression(text) == expected


@pytest.mark.parametrize(
    "kwargs",
    [
        {"accuracy": 1.5},
        {"accuracy": -0.1},
        {"mean_tokens": 0},
        {"length_sigma": -1.0},
        {"max_tokens_cap": 0},
        {"latency_per_token": -0.1},
        {"base_latency": float("inf")},
        {"max_running": 0},
        {"weight_version": -1},
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SimConfig(**kwargs)


# --------------------------------------------------------------------------- /generate


async def test_generate_with_text(sim: Factory) -> None:
    _, client = await sim(accuracy=1.0, mean_tokens=80, length_sigma=0.0)
    r = await client.post("/generate", json={"text": QUESTION, "rid": "r1"})
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert meta["id"] == "r1"
    assert meta["finish_reason"]["type"] == "stop"
    assert meta["prompt_tokens"] == len(QUESTION.encode())
    assert meta["completion_tokens"] == len(body["output_ids"]) == 80
    assert detokenize(body["output_ids"]) == body["text"]
    assert meta["weight_version"] == "0"
    assert "output_token_logprobs" not in meta
    assert BOXED.findall(body["text"]) == ["91"]
    filler = body["text"][: body["text"].index(" The answer is")]
    assert re.fullmatch(r"[a-z ]*", filler)


async def test_generate_with_input_ids_and_logprobs(sim: Factory) -> None:
    _, client = await sim(accuracy=1.0)
    r = await client.post(
        "/generate",
        json={
            "input_ids": tokenize(QUESTION),
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4096},
        },
    )
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert meta["prompt_tokens"] == len(tokenize(QUESTION))
    assert BOXED.findall(body["text"]) == ["91"]
    assert meta["id"]  # generated when absent
    logprobs = meta["output_token_logprobs"]
    assert len(logprobs) == len(body["output_ids"])
    assert all(len(entry) == 3 and entry[2] is None for entry in logprobs)
    assert [entry[1] for entry in logprobs] == body["output_ids"]
    assert all(isinstance(entry[0], float) and entry[0] <= 0 for entry in logprobs)


async def test_max_new_tokens_truncates(sim: Factory) -> None:
    _, client = await sim(mean_tokens=200, length_sigma=0.0)
    r = await client.post(
        "/generate",
        json={"text": QUESTION, "sampling_params": {"max_new_tokens": 10}, "return_logprob": True},
    )
    meta = r.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "length"
    assert meta["completion_tokens"] == 10
    assert len(r.json()["output_ids"]) == len(meta["output_token_logprobs"]) == 10


async def test_accuracy(sim: Factory) -> None:
    _, right = await sim(accuracy=1.0, seed=1)
    _, wrong = await sim(accuracy=0.0, seed=2)
    for _ in range(10):
        body = {"text": QUESTION, "sampling_params": {"max_new_tokens": 100_000}}
        r = await right.post("/generate", json=body)
        assert BOXED.findall(r.json()["text"]) == ["91"]
        r = await wrong.post("/generate", json=body)
        (answer,) = BOXED.findall(r.json()["text"])
        assert answer != "91"
        assert int(answer) != 91


async def test_same_seed_is_deterministic(sim: Factory) -> None:
    _, a = await sim(seed=7)
    _, b = await sim(seed=7)
    for _ in range(3):
        ra = await a.post("/generate", json={"text": QUESTION})
        rb = await b.post("/generate", json={"text": QUESTION})
        assert ra.json()["output_ids"] == rb.json()["output_ids"]


async def test_poison_and_bad_requests_are_refused(sim: Factory) -> None:
    _, client = await sim()
    r = await client.post("/generate", json={"text": "POISON: what is 1 + 1?"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == 400
    assert (await client.post("/generate", json={"text": ["a", "b"]})).status_code == 400
    assert (await client.post("/generate", json={})).status_code == 400
    assert (await client.post("/generate", content=b"not json")).status_code == 400


async def test_abort_all_mid_generation(sim: Factory) -> None:
    # 200 tokens over 10 s: aborted early, some tokens and far from all, loaded machine or not.
    engine, client = await sim(mean_tokens=200, length_sigma=0.0, latency_per_token=0.05)
    task = asyncio.create_task(
        client.post("/generate", json={"text": QUESTION, "return_logprob": True, "rid": "x"})
    )
    await _wait_for(lambda: engine.state.running == 1)
    await asyncio.sleep(0.2)
    assert (await client.post("/abort_request", json={"abort_all": True})).json() == {}
    r = await task
    assert r.status_code == 200
    body = r.json()
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["finish_reason"]["message"].startswith("Abort")
    assert 0 < meta["completion_tokens"] < 200
    assert len(body["output_ids"]) == len(meta["output_token_logprobs"])
    assert len(body["output_ids"]) == meta["completion_tokens"]
    assert detokenize(body["output_ids"]) == body["text"]
    stats = (await client.get("/sim/stats")).json()
    assert stats["aborted"] == 1
    assert stats["running"] == 0


async def test_abort_by_rid(sim: Factory) -> None:
    engine, client = await sim(mean_tokens=100, length_sigma=0.0, latency_per_token=0.02)  # 2 s each
    a = asyncio.create_task(client.post("/generate", json={"text": "a", "rid": "a"}))
    b = asyncio.create_task(client.post("/generate", json={"text": "b", "rid": "b"}))
    await _wait_for(lambda: engine.state.running == 2)
    await client.post("/abort_request", json={"rid": "a"})
    assert (await a).json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await b).json()["meta_info"]["finish_reason"]["type"] == "stop"


async def test_pause_aborts_in_flight_and_holds_new_requests(sim: Factory) -> None:
    # 60 tokens at 20 ms: the first request is still running when the pause arrives, even on a
    # loaded machine (at 2 ms it sometimes finished first)
    engine, client = await sim(mean_tokens=60, length_sigma=0.0, latency_per_token=0.02)
    first = asyncio.create_task(client.post("/generate", json={"text": QUESTION}))
    await _wait_for(lambda: engine.state.running == 1)
    r = await client.post("/pause_generation", json={"mode": "abort"})
    assert r.status_code == 200
    assert r.json()["success"] is True
    assert (await first).json()["meta_info"]["finish_reason"]["type"] == "abort"

    held = asyncio.create_task(client.post("/generate", json={"text": QUESTION}))
    held_cmpl = asyncio.create_task(client.post("/v1/completions", json={"prompt": QUESTION}))
    await asyncio.sleep(0.3)
    assert not held.done()
    assert not held_cmpl.done()
    assert (await client.get("/sim/stats")).json()["paused"] is True

    assert (await client.post("/continue_generation")).status_code == 200
    r = await held
    assert r.status_code == 200
    assert r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    assert (await held_cmpl).json()["choices"][0]["finish_reason"] == "length"
    assert (await client.get("/sim/stats")).json()["paused"] is False


async def test_update_weights_bumps_version(sim: Factory) -> None:
    _, client = await sim(weight_version=3)
    assert (await client.get("/model_info")).json()["weight_version"] == "3"
    r = await client.post("/update_weights_from_disk", json={"model_path": "/ckpt/4"})
    assert r.json()["success"] is True
    assert r.json()["num_paused_requests"] == 0
    info = (await client.get("/model_info")).json()
    assert info["weight_version"] == "4"
    assert info["model_path"] == "rollstream-sim"
    assert info["is_generation"] is True
    r = await client.post(
        "/update_weights_from_disk", json={"model_path": "x", "weight_version": "9"}
    )
    assert r.json()["success"] is True
    assert (await client.get("/get_model_info")).json()["weight_version"] == "9"
    r = await client.post("/generate", json={"text": "hi"})
    assert r.json()["meta_info"]["weight_version"] == "9"

    await client.post("/sim/faults", json={"report_weight_version": False})
    r = await client.post("/generate", json={"text": "hi"})
    assert "weight_version" not in r.json()["meta_info"]


# --------------------------------------------------------------------------- /v1/completions


async def test_completions_n_choices_and_token_ids(sim: Factory) -> None:
    _, client = await sim(accuracy=1.0, mean_tokens=40)
    r = await client.post(
        "/v1/completions",
        json={
            "model": "rollstream-sim",
            "prompt": QUESTION,
            "n": 3,
            "max_tokens": 1000,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["prompt_token_ids"] == tokenize(QUESTION)
    assert "weight_version" not in body
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    total = 0
    for choice in choices:
        assert choice["finish_reason"] == "stop"
        lp = choice["logprobs"]
        ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        assert all(t.startswith("token_id:") for t in lp["tokens"])
        assert detokenize(ids) == choice["text"]
        assert ids == choice["token_ids"]
        assert len(lp["token_logprobs"]) == len(ids) == len(lp["text_offset"])
        assert all(x <= 0 for x in lp["token_logprobs"])
        assert BOXED.findall(choice["text"]) == ["91"]
        total += len(ids)
    assert body["usage"] == {
        "prompt_tokens": len(tokenize(QUESTION)),
        "completion_tokens": total,
        "total_tokens": total + len(tokenize(QUESTION)),
    }


async def test_completions_defaults_and_token_prompt(sim: Factory) -> None:
    _, client = await sim(mean_tokens=64, length_sigma=0.0)
    r = await client.post("/v1/completions", json={"prompt": tokenize(QUESTION)})
    body = r.json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"  # max_tokens defaults to 16
    assert len(choice["text"]) == 16
    assert choice["logprobs"] is None
    assert body["usage"]["prompt_tokens"] == len(QUESTION)
    r = await client.post("/v1/completions", json={"prompt": ["a", "b"]})
    assert r.status_code == 400
    r = await client.post("/v1/completions", json={"prompt": "POISON"})
    assert r.status_code == 400


async def test_completions_abort(sim: Factory) -> None:
    # 200 tokens over 10 s: aborted early, some tokens and far from all, loaded machine or not.
    engine, client = await sim(mean_tokens=200, length_sigma=0.0, latency_per_token=0.05)
    task = asyncio.create_task(
        client.post("/v1/completions", json={"prompt": QUESTION, "max_tokens": 500, "n": 2})
    )
    await _wait_for(lambda: engine.state.running == 2)
    await client.post("/abort_request", json={"abort_all": True})
    body = (await task).json()
    assert [c["finish_reason"] for c in body["choices"]] == ["abort", "abort"]
    assert body["usage"]["completion_tokens"] < 400


# --------------------------------------------------------------------------- faults, misc


async def test_generate_fault_injection(sim: Factory) -> None:
    _, client = await sim()
    r = await client.post("/sim/faults", json={"generate_errors": 2, "generate_error_status": 500})
    assert r.status_code == 200
    assert (await client.post("/generate", json={"text": "a"})).status_code == 500
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status_code == 500
    assert (await client.post("/generate", json={"text": "a"})).status_code == 200
    await client.post("/sim/faults", json={"generate_errors": -1, "generate_error_status": 429})
    for _ in range(3):
        assert (await client.post("/generate", json={"text": "a"})).status_code == 429
    await client.post("/sim/faults", json={"generate_errors": 0})
    assert (await client.post("/generate", json={"text": "a"})).status_code == 200
    stats = (await client.get("/sim/stats")).json()
    assert stats["requests"] == 7
    assert stats["faults_injected"] == 5
    bad = await client.post(
        "/sim/faults", json={"generate_errors": 1, "generate_error_status": 418}
    )
    assert bad.status_code == 400


async def test_model_info_modes(sim: Factory) -> None:
    _, client = await sim(weight_version=2)
    await client.post("/sim/faults", json={"model_info": "garbage"})
    r = await client.get("/model_info")
    assert r.status_code == 200
    with pytest.raises(ValueError):
        r.json()
    await client.post("/sim/faults", json={"model_info": "error"})
    assert (await client.get("/get_model_info")).status_code == 500
    await client.post("/sim/faults", json={"model_info": "missing"})
    info = (await client.get("/model_info")).json()
    assert "weight_version" not in info
    assert info["model_path"] == "rollstream-sim"
    await client.post("/sim/faults", json={"model_info": "non_integer"})
    assert (await client.get("/model_info")).json()["weight_version"] == "abc"
    await client.post("/sim/faults", json={"model_info": "hang"})
    with pytest.raises(httpx.ReadTimeout):
        await client.get("/model_info", timeout=0.2)
    await client.post("/sim/faults", json={"model_info": "ok"})
    assert (await client.get("/model_info")).json()["weight_version"] == "2"
    assert (await client.post("/sim/faults", json={"model_info": "nope"})).status_code == 400


async def test_max_running_respected(sim: Factory) -> None:
    engine, client = await sim(max_running=3, base_latency=0.05, mean_tokens=20)
    replies = await asyncio.gather(
        *(client.post("/generate", json={"text": f"{i} + {i}"}) for i in range(10))
    )
    assert all(r.status_code == 200 for r in replies)
    stats = (await client.get("/sim/stats")).json()
    assert stats["max_running_seen"] == 3
    assert stats["requests"] == 10
    assert stats["running"] == 0
    assert engine.state.max_running_seen <= 3


async def test_abort_reaches_queued_requests(sim: Factory) -> None:
    engine, client = await sim(max_running=1, base_latency=2.0)
    tasks = [
        asyncio.create_task(client.post("/generate", json={"text": "x", "rid": f"q{i}"}))
        for i in range(3)
    ]
    await _wait_for(lambda: engine.state.running == 1 and engine.state.waiting == 2)
    await client.post("/abort_request", json={"abort_all": True})
    replies = await asyncio.gather(*tasks)
    for r in replies:
        meta = r.json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] == 0
    assert engine.state.running == 0


async def test_misc_endpoints(sim: Factory) -> None:
    engine, client = await sim(seed=5)
    assert engine.url == f"http://127.0.0.1:{engine.port}"
    assert engine.port > 0
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/health_generate")).status_code == 200
    info = (await client.get("/get_server_info")).json()
    assert info["sim_config"]["seed"] == 5
    tok = (await client.post("/tokenize", json={"prompt": "abc"})).json()
    assert tok == {"tokens": [97, 98, 99], "count": 3, "max_model_len": 32768}
    assert (await client.post("/detokenize", json={"tokens": [97, 98]})).json()["text"] == "ab"
    models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["rollstream-sim"]


async def test_close_releases_paused_requests() -> None:
    async with SimEngine(SimConfig()) as engine:
        async with httpx.AsyncClient(base_url=engine.url, timeout=5.0) as client:
            await client.post("/pause_generation")
            task = asyncio.create_task(client.post("/generate", json={"text": "a"}))
            await asyncio.sleep(0.1)
            assert not task.done()
            await engine.aclose()
            r = await task
            assert r.status_code == 503


async def test_client_disconnect_frees_the_slot(sim: Factory) -> None:
    engine, client = await sim(max_running=1, base_latency=5.0)
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/generate", json={"text": "a"}, timeout=0.2)
    await _wait_for(lambda: engine.state.running == 0 and not engine.state.jobs)
    assert engine.state.semaphore._value == 1  # the slot was given back


# -- what the fleet checks need: a prefix cache, a wedge, a restart on old weights --------------


async def test_a_repeated_prompt_finds_its_prefix_in_the_cache_and_a_restart_empties_it() -> None:
    prompt = "What is 2 + 3? " * 8  # 120 tokens: 7 whole blocks
    async with SimEngine(SimConfig(prefix_cache_tokens=4096, mean_tokens=8, weight_version=5)) as engine:
        async with httpx.AsyncClient(base_url=engine.url) as client:
            first = (await client.post("/generate", json={"text": prompt})).json()["meta_info"]
            second = (await client.post("/generate", json={"text": prompt})).json()["meta_info"]
            assert first["cached_tokens"] == 0 and first["prompt_tokens"] == 120
            assert second["cached_tokens"] == 112  # every whole block
            stats = (await client.get("/sim/stats")).json()
            assert (stats["prompt_tokens"], stats["cached_tokens"]) == (240, 112)
            restarted = (await client.post("/sim/restart", json={})).json()
            assert restarted["weight_version"] == 0
            third = (await client.post("/generate", json={"text": prompt})).json()["meta_info"]
            assert third["cached_tokens"] == 0 and third["weight_version"] == "0"


async def test_a_wedged_engine_accepts_and_never_answers_until_it_clears() -> None:
    async with SimEngine(SimConfig(mean_tokens=8)) as engine:
        async with httpx.AsyncClient(base_url=engine.url) as client:
            await client.post("/sim/faults", json={"wedge": True})
            with pytest.raises(httpx.TimeoutException):
                await client.get("/health", timeout=0.5)
            pending = asyncio.ensure_future(client.post("/generate", json={"text": "1 + 1"}, timeout=30))
            assert (await client.get("/sim/stats")).json()["wedged"] is True  # /sim/* still answers
            assert not pending.done()
            await client.post("/sim/faults", json={"wedge": False})
            assert (await pending).status_code == 200
            assert (await client.get("/health", timeout=5)).status_code == 200
