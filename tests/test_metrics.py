"""The producer's Prometheus endpoint (``produce --metrics-port``): served, and moving with the work."""

from __future__ import annotations

import httpx
from conftest import add_prompts, make_namespace, wait_until
from prometheus_client.parser import text_string_to_metric_families
from rollstream.common.keys import Keys
from rollstream.consumer import GroupConsumer
from rollstream.runtime.redis_server import free_port

UNLABELLED = (
    "rollstream_requests_in_flight",
    "rollstream_generation_seconds",
    "rollstream_tokens_generated",
    "rollstream_groups_published",
    "rollstream_engine_retries",
    "rollstream_admission_blocked_seconds",
    "rollstream_producer_published",  # a declared stat (tests/test_stats.py: all of them)
    "rollstream_producer_info",
)
"""Served once the producer is connected (the endpoint is up before, while it waits for Redis: its
own stats follow); the by-kind/by-reason counters appear with their first sample."""


async def scrape(url: str) -> dict[str, float]:
    """Sample name (with sorted labels except namespace/producer) -> value."""
    async with httpx.AsyncClient() as client:
        response = await client.get(url, timeout=5)
    response.raise_for_status()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        out[f"family:{family.name}"] = 1.0
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("namespace", "producer"))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


async def test_metrics_endpoint_serves_the_listed_metrics_and_they_move(redis_url, redis, ns, sim, procs):
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=2, batch_size=2)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    procs.producer(redis_url, ns, sim.url, "--metrics-port", str(port), "--metrics-host", "127.0.0.1", name="pm")

    async def served() -> dict[str, float] | None:
        try:
            metrics = await scrape(url)
        except httpx.HTTPError:
            return None
        return metrics if all(f"family:{name}" in metrics for name in UNLABELLED) else None

    # A generous deadline: a producer process can take tens of seconds to start on a loaded machine.
    before = await wait_until(served, timeout=90, interval=0.2,
                              message=f"metrics endpoint serving {UNLABELLED}\n{procs.logs()}")
    assert before["rollstream_groups_published_total{}"] == 0
    assert before["rollstream_requests_in_flight{}"] == 0

    await add_prompts(redis, ns, 4)

    async def published(count: int) -> dict[str, float] | None:
        metrics = await scrape(url)
        return metrics if metrics["rollstream_groups_published_total{}"] >= count else None

    after = await wait_until(lambda: published(4), timeout=20, message=f"4 groups in the metrics\n{procs.logs()}")
    assert after["rollstream_groups_published_total{}"] == 4
    assert after["rollstream_producer_published_total{}"] == 4  # the producer's own stats, read at the scrape
    assert after["rollstream_producer_concurrency{}"] > 0
    assert after["rollstream_generation_seconds_count{}"] >= 8  # 4 prompts x n=2 requests
    assert after["rollstream_tokens_generated_total{}"] > 0
    assert after["rollstream_generation_seconds_bucket{le=+Inf}"] == after["rollstream_generation_seconds_count{}"]
    assert after["rollstream_requests_in_flight{}"] == 0
    assert after[f"rollstream_engine_state{{engine={sim.url},state=healthy}}"] == 1  # per engine
    assert after[f"rollstream_engine_in_flight{{engine={sim.url}}}"] == 0
    assert after[f"rollstream_engine_weight_version{{engine={sim.url}}}"] == 0

    # Paused: admission is refused and both the refusals and the blocked seconds grow.
    async with await GroupConsumer.connect(redis_url, ns, "trainer-0") as consumer:
        await consumer.pause()
        await add_prompts(redis, ns, 1, start=4)

        async def blocked() -> dict[str, float] | None:
            metrics = await scrape(url)
            ok = metrics.get("rollstream_admission_blocked_seconds_total{}", 0) > 0.5 and metrics.get(
                "rollstream_admission_blocked_total{reason=paused}", 0) > 0
            return metrics if ok else None

        await wait_until(blocked, timeout=20, interval=0.25, message="admission blocked in the metrics")
        assert await redis.xlen(keys.groups) == 4
        await consumer.resume()

    # A POISON prompt is refused by the engine (HTTP 400): an error by kind.
    await add_prompts(redis, ns, 1, start=5, text="POISON 1 + 1")

    # The errors are counted while the group is generated, the group published (failed) after
    # them; prompt 4, admitted on resume, may still be running too: wait for both.
    async def errors() -> dict[str, float] | None:
        metrics = await scrape(url)
        ok = metrics.get("rollstream_errors_total{kind=engine_http_400}", 0) >= 2 and metrics[
            "rollstream_groups_published_total{}"] >= 6
        return metrics if ok else None

    final = await wait_until(errors, timeout=20, interval=0.25,
                             message=f"engine errors and 6 groups published\n{procs.logs()}")
    assert "family:rollstream_errors" in final
    assert final["rollstream_groups_published_total{}"] == 6
    assert "family:rollstream_admission_blocked" in final
