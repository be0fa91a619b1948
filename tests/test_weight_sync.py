"""WeightSync reads its HTTP calls from ``common/weight_apis.py``: the exact requests of each
engine server and pause mode, pinned here, and the producer's catch-up built from the same
declaration."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import wait_until
from rollstream import WeightSync
from rollstream.common.errors import ConfigError, WeightSyncError
from rollstream.common.weight_apis import PAUSE_MODES, WEIGHT_APIS
from rollstream.producer.engine.dialects import DIALECTS
from rollstream.testing.sim import SimConfig, SimEngine

RELOAD_VLLM = ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/3"}})
SET_VLLM = ("POST", "/update_weight_version", {"new_version": "3"})
RELOAD_SGLANG = ("POST", "/update_weights_from_disk", {"model_path": "/ckpt/3", "weight_version": "3"})

EXPECTED: dict[tuple[str, str], list[tuple[str, str, Any]]] = {
    **{
        ("vllm", mode): [
            ("POST", f"/pause?mode={mode}&clear_cache=true", None), RELOAD_VLLM, SET_VLLM, ("POST", "/resume", None),
        ]
        for mode in PAUSE_MODES
    },
    ("sglang", "abort"): [("POST", "/pause_generation", {"mode": "abort"}), RELOAD_SGLANG,
                          ("POST", "/continue_generation", {})],
    ("sglang", "keep"): [("POST", "/pause_generation", {"mode": "retract"}), RELOAD_SGLANG,
                         ("POST", "/continue_generation", {})],
    ("sglang", "wait"): [RELOAD_SGLANG],  # its reload waits for the requests in flight
}
"""The requests of ``update(None, "/ckpt/3", 3, mode=...)``, as WeightSync sent them before the
declaration (body None: no body)."""


@asynccontextmanager
async def _recorder(seen: list[tuple[str, str, Any]], reply: dict[str, Any] | None = None) -> AsyncIterator[str]:
    """A real HTTP server on a free port that records every request and answers ``reply``; its URL."""

    async def handler(request: web.Request) -> web.Response:
        content = await request.read()
        seen.append((request.method, request.raw_path, json.loads(content) if content else None))
        return web.json_response(reply or {"weight_version": "3"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("kind", "mode"), sorted(EXPECTED))
async def test_each_server_and_mode_sends_the_declared_requests_in_order(kind: str, mode: str) -> None:
    seen: list[tuple[str, str, Any]] = []
    async with _recorder(seen) as url, WeightSync([url], kind=kind) as sync:
        report = await sync.update(None, "/ckpt/3", 3, mode=mode)  # type: ignore[arg-type]
        assert ("set version" in report.seconds) == (kind == "vllm")
        assert seen == EXPECTED[kind, mode]
        seen.clear()
        assert await sync.versions() == {url: 3}
        assert seen == [("GET", WEIGHT_APIS[kind].version_path, None)]


async def test_a_reload_answering_success_false_fails_the_stage() -> None:
    seen: list[tuple[str, str, Any]] = []
    reply = {"success": False, "message": "no such folder"}
    async with _recorder(seen, reply) as url, WeightSync([url], kind="sglang") as sync:
        with pytest.raises(WeightSyncError, match="no such folder") as caught:
            await sync.update(None, "/ckpt/3", 3)
    assert caught.value.stage == "reload"


def test_the_kind_is_checked_against_the_declared_servers() -> None:
    with pytest.raises(ConfigError, match="one of vllm, sglang, got 'tgi'"):
        WeightSync(["http://e"], kind="tgi")


def test_every_server_declares_every_pause_mode() -> None:
    for name, api in WEIGHT_APIS.items():
        assert set(api.pause) == set(PAUSE_MODES), name
        assert api.reload and api.version_path.startswith("/"), name


def test_the_catch_up_is_the_declared_reload_then_the_version() -> None:
    """The producer's ``--catch-up-engines`` sends what WeightSync's reload and set-version send;
    on vLLM, whose reload keeps the prefix cache, it empties the cache before the label moves
    (WeightSync's pause empties it)."""
    reset = ("/reset_prefix_cache?reset_running_requests=true", {})
    vllm = [RELOAD_VLLM[1:], reset, SET_VLLM[1:]]
    assert DIALECTS["vllm"].weights.catch_up_requests("/ckpt/3", 3) == vllm
    assert DIALECTS["openai"].weights.catch_up_requests("/ckpt/3", 3) == vllm  # vLLM's behind its OpenAI server
    assert DIALECTS["sglang"].weights.catch_up_requests("/ckpt/3", 3) == [RELOAD_SGLANG[1:]]


async def _in_flight(sim: SimEngine, http: aiohttp.ClientSession) -> asyncio.Task[dict[str, Any]]:
    """A long ``/generate`` on ``sim``, once it is running there."""

    async def generate() -> dict[str, Any]:
        body = {"text": "count slowly", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        async with http.post(f"{sim.url}/generate", json=body) as reply:
            assert reply.status == 200, await reply.text()
            result: dict[str, Any] = await reply.json()
            return result

    task = asyncio.create_task(generate())
    await wait_until(lambda: sim.state.jobs)
    return task


async def test_an_sglang_keep_update_reloads_with_requests_in_flight_and_they_finish() -> None:
    """``keep`` on SGLang pauses with ``retract``: the reload's cache flush succeeds with requests
    in flight, and they continue after the resume (not aborted). An ``in_place`` pause, which
    ``keep`` sent before, makes that flush refuse, and SGLang's scheduler stops on it (the
    simulator answers the refusal)."""
    config = SimConfig(seed=1, latency_per_token=0.01, length_sigma=0)
    async with SimEngine(config) as sim, aiohttp.ClientSession() as http:
        task = await _in_flight(sim, http)
        async with WeightSync([sim.url], kind="sglang") as sync:
            await sync.update(None, "/ckpt/1", 1, mode="keep")
        assert sim.state.weight_version == 1 and sim.state.reloads == ["/ckpt/1"]
        async with asyncio.timeout(60):
            reply = await task
        assert reply["meta_info"]["finish_reason"]["type"] != "abort"
        assert reply["meta_info"]["completion_tokens"] > 0

        task = await _in_flight(sim, http)
        async with http.post(f"{sim.url}/pause_generation", json={"mode": "in_place"}) as paused:
            assert paused.status == 200
        async with http.post(f"{sim.url}/update_weights_from_disk", json={"model_path": "/ckpt/2"}) as refused:
            assert refused.status == 500
            assert "Cache not flushed" in await refused.text()
        async with http.post(f"{sim.url}/continue_generation", json={}) as resumed:
            assert resumed.status == 200
        async with asyncio.timeout(60):
            await task
