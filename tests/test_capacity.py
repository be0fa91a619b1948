"""Per-sample capacity: an in-process Producer on real Redis, its engine an httpx.MockTransport
double whose first sample of prompt 0 runs until the test lets it finish (a long tail)."""

from __future__ import annotations

import asyncio
import json

import httpx
from conftest import add_prompts, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.keys import PRODUCERS_GROUP, Keys
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.rewards import PythonReward
from rollstream.producer.settings import EpisodeSettings, ProducerSettings
from rollstream.producer.worker import Producer

N = 4


class LongTailEngine:
    """SGLang ``/generate``: instant replies, except the first request of prompt 0, which waits
    for :attr:`release`. Counts the requests running at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.slow_started = asyncio.Event()
        self.running = 0
        self.max_running = 0
        self._slow_taken = False

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            if body["text"].startswith("Compute 0 ") and not self._slow_taken:
                self._slow_taken = True
                self.slow_started.set()
                async with asyncio.timeout(30):
                    await self.release.wait()
            else:
                await asyncio.sleep(0.01)
        finally:
            self.running -= 1
        meta = {"finish_reason": {"type": "stop"}, "weight_version": "0",
                "output_token_logprobs": [[-0.5, 5, None], [-0.5, 6, None]]}
        return httpx.Response(200, json={"text": "ok", "output_ids": [5, 6], "meta_info": meta})


async def test_a_long_tailed_group_frees_the_slots_of_its_finished_samples(
    redis: Redis, redis_url: str, ns: str
) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns, n_samples_per_prompt=N, batch_size=4)
    await add_prompts(redis, ns, 4)
    engine = LongTailEngine()
    client = EngineClient(EngineSettings(urls=("http://engine",), max_new_tokens=8),
                          transport=httpx.MockTransport(engine))
    reward = PythonReward(lambda sample, prompt, label: 1.0, name="one")
    # Room for one prompt and one sample more: with capacity held per group, prompt 0's slow
    # sample would keep the other prompts out until it ends.
    settings = ProducerSettings(namespace=ns, concurrency=N + 1, name="tail",
                                episodes=EpisodeSettings(tokenize_prompts=False))
    producer = await Producer.connect(redis_url, settings, client, reward)
    run = asyncio.create_task(producer.run())
    try:
        async with asyncio.timeout(30):
            await engine.slow_started.wait()
        await wait_until(lambda: _xlen_is(redis, keys.groups, 3), timeout=20,
                         message="prompts 1-3 published while prompt 0's slow sample runs")
        # The slow sample; its 3 finished siblings gave theirs back. (Admission holds n units for
        # the length of an ADMIT round trip before it finds the stream empty: wait that out.)
        await wait_until(lambda: producer.in_flight_samples == 1, timeout=5, message="one sample in flight")
        assert not engine.release.is_set() and engine.running == 1
        assert engine.max_running <= N + 1

        engine.release.set()
        await wait_until(lambda: _xlen_is(redis, keys.groups, 4), timeout=20, message="prompt 0 published")
        assert producer.in_flight_samples == 0
    finally:
        engine.release.set()
        producer.stop()
        await asyncio.wait_for(run, 30)
        await producer.aclose()
        await client.aclose()
    indexes = sorted(int(fields[b"index"]) for _, fields in await redis.xrange(keys.groups))
    assert indexes == [0, 1, 2, 3]  # each prompt published exactly once
    assert producer.published == 4 and producer.duplicates == 0
    assert (await redis.xpending(keys.prompts, PRODUCERS_GROUP))["pending"] == 0
    assert engine.max_running <= N + 1


async def _xlen_is(redis: Redis, stream: str, expected: int) -> bool:
    return int(await redis.xlen(stream)) == expected
