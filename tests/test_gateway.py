"""Producers behind the real SGLang gateway (``sglang-router``) in front of two simulators:
routing, weight versions through the gateway, aborts fanned out to its workers, and a worker
that dies in the middle of a run."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.consumer import GroupConsumer
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.testing.sim import SimConfig, SimEngine


def _router_binary() -> str | None:
    candidate = Path(sys.executable).parent / "sglang-router"
    found = str(candidate) if candidate.exists() else shutil.which("sglang-router")
    if found is None:
        return None
    try:
        ok = subprocess.run([found, "--help"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return found if ok else None


ROUTER = _router_binary()
pytestmark = pytest.mark.skipif(
    ROUTER is None, reason="the sglang-router binary (pip install sglang-router) cannot run here"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Gateway:
    """A real ``sglang-router launch`` process in front of the given worker URLs."""

    def __init__(self, workers: list[str], log: Path, policy: str = "round_robin") -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        args = [
            ROUTER or "sglang-router", "launch", "--worker-urls", *workers,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-port", str(_free_port()),  # default 29000 would clash between gateways
            "--policy", policy,
            "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
            "--worker-startup-timeout-secs", "30",
        ]  # fmt: skip
        with open(log, "wb") as handle:
            self.process = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT)

    async def workers(self) -> dict[str, bool]:
        async with httpx.AsyncClient(timeout=2) as http:
            try:
                reply = (await http.get(f"{self.url}/workers")).json()
            except (httpx.HTTPError, ValueError):
                return {}
        return {w["url"]: w["is_healthy"] for w in reply.get("workers", [])}

    async def wait_healthy(self, urls: list[str]) -> None:
        async def ready() -> bool:
            assert self.process.poll() is None, self.log.read_text(errors="replace")[-3000:]
            workers = await self.workers()
            return all(workers.get(u) for u in urls)

        await wait_until(ready, timeout=30, interval=0.2, message=f"gateway workers {urls} healthy")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def gateways(tmp_path: Path) -> Iterator[list[Gateway]]:
    started: list[Gateway] = []
    yield started
    for gateway in started:
        gateway.stop()


@pytest.fixture
async def two_sims() -> AsyncIterator[list[SimEngine]]:
    sims = [SimEngine(SimConfig(seed=10 + i, mean_tokens=16, latency_per_token=0.002)) for i in range(2)]
    for sim in sims:
        await sim.start()
    yield sims
    for sim in sims:
        await sim.aclose()


async def test_producers_through_the_gateway_survive_a_dead_worker(
    redis_url: str, redis: Redis, ns: str, procs: ProcessPool, tmp_path: Path,
    gateways: list[Gateway], two_sims: list[SimEngine],
) -> None:  # fmt: skip
    a, b = two_sims
    gateway = Gateway([a.url, b.url], tmp_path / "gateway.log")
    gateways.append(gateway)
    await gateway.wait_healthy([a.url, b.url])
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=4)
    await add_prompts(redis, ns, 200)
    producers = [procs.producer(redis_url, ns, gateway.url, name=f"gw{i}", concurrency=8) for i in range(2)]
    taken: list[int] = []
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        for _ in range(5):
            batch = await asyncio.wait_for(consumer.take(4), 30)
            taken += [g.index for g in batch.groups]
            await consumer.commit(batch)
        assert a.state.requests > 0 and b.state.requests > 0, "the gateway routes to both workers"
        for group in batch.groups:
            for sample in group.samples:
                assert sample.weight_versions == [0]
                assert sample.metadata["engine"] == gateway.url
                assert "weight_version_source" not in sample.metadata

        await b.aclose()  # a worker dies mid-run: in-flight requests fail or abort
        survivor_before = a.state.requests
        await wait_until(
            lambda: _unhealthy(gateway, b.url), timeout=20, interval=0.2, message="the gateway marks the dead worker"
        )
        for _ in range(5):
            batch = await asyncio.wait_for(consumer.take(4), 30)
            taken += [g.index for g in batch.groups]
            await consumer.commit(batch)
    assert len(taken) == len(set(taken)) == 40
    assert a.state.requests > survivor_before, "the survivor took over"
    for producer in producers:
        assert producer.poll() is None, procs.logs() + gateway.log.read_text(errors="replace")[-2000:]


async def _unhealthy(gateway: Gateway, url: str) -> bool:
    return (await gateway.workers()).get(url) is False


async def test_gateway_weight_version_abort_and_tokenize_reach_the_workers(
    tmp_path: Path, gateways: list[Gateway]
) -> None:
    slow = [
        SimEngine(SimConfig(seed=i, mean_tokens=200, length_sigma=0, latency_per_token=0.05, weight_version=7,
                            report_weight_version=False))
        for i in range(2)
    ]  # fmt: skip
    for sim in slow:
        await sim.start()
    try:
        gateway = Gateway([s.url for s in slow], tmp_path / "gateway.log")
        gateways.append(gateway)
        await gateway.wait_healthy([s.url for s in slow])
        async with EngineClient(EngineSettings(urls=(gateway.url,), max_retries=1)) as engine:
            assert await engine.weight_version() == 7  # /model_info is not routed; /get_model_info is
            assert await engine.tokenize("1+2") == [49, 43, 50]  # the gateway has no /tokenize: a worker's
            tasks = [
                asyncio.create_task(engine.generate(text=f"Compute {i} + 1", max_new_tokens=200)) for i in range(2)
            ]
            await wait_until(
                lambda: all(s.state.running >= 1 for s in slow), timeout=10, message="one request on each worker"
            )
            await engine.abort_all()  # the gateway has no /abort_request: each worker it lists
            generations = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert [g.finish_reason for g in generations] == ["abort", "abort"]
        assert all(len(g.output_ids) < 200 for g in generations)  # cut short (maybe before the first token)
        assert [g.weight_version for g in generations] == [7, 7]
        assert [s.state.aborted for s in slow] == [1, 1]
    finally:
        for sim in slow:
            await sim.aclose()
