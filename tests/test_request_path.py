"""The per-request work done once (producer, group, trajectory) still sends and records exactly
what it did when every request rebuilt it: multi-turn bodies carry the whole trajectory, the
JSON cache of a trajectory's ids never serves ids it does not hold, the shared sampling mapping
is the producer's, and ``episode.response_length`` is the snapshot's."""

from __future__ import annotations

import json
from array import array
from typing import Any

import httpx
import msgspec
from rollstream.common.models import Prompt, Sample, Status
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.engine.ids_json import ENCODER as _ENCODER
from rollstream.producer.engine.ids_json import IdsJson
from rollstream.producer.episode import Episode
from rollstream.producer.rewards import PythonReward
from rollstream.producer.rollout import Rollout
from rollstream.producer.settings import EpisodeSettings

URL = "http://engine"
PROMPT_IDS = [7, 8, 9]
TOOL = [900, 901, 902]


class TurnEngine:
    """SGLang-like ``/generate``: two new tokens per request (numbered by request), every body kept."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/generate":
            return httpx.Response(404)
        body = json.loads(request.content)
        self.bodies.append(body)
        k = len(self.bodies)
        output = [1000 + 2 * k, 1001 + 2 * k]
        meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.25, t, None] for t in output],
                "weight_version": "5"}
        return httpx.Response(200, json={"text": f"t{k}", "output_ids": output, "meta_info": meta})


async def _run(fn: Any, n: int = 2, **sampling: Any) -> tuple[TurnEngine, list[Sample], list[int]]:
    engine = TurnEngine()
    client = EngineClient(
        EngineSettings(urls=(URL,), max_new_tokens=64, temperature=0.7, sampling_params=sampling),
        transport=httpx.MockTransport(engine),
    )
    lengths: list[int] = []

    async def generate(episode: Episode) -> Sample:
        return await fn(episode, lengths)

    rollout = Rollout(client, PythonReward(lambda *a: 1.0, name="one"), n, EpisodeSettings(generate=generate))
    try:
        group = await rollout.run(Prompt(index=0, prompt="p", input_ids=array("i", PROMPT_IDS)), 0)
    finally:
        await client.aclose()
    return engine, group.samples, lengths


async def _three_turns(episode: Episode, lengths: list[int]) -> Sample:
    for turn in range(3):
        lengths.append(episode.response_length)
        assert episode.response_length == episode.sample.response_length
        await episode.generate()
        if turn < 2:
            await episode.observe(TOOL)
    lengths.append(episode.response_length)
    return episode.sample


async def test_every_turn_sends_the_whole_trajectory_so_far() -> None:
    engine, samples, lengths = await _run(_three_turns)
    assert len(engine.bodies) == 6 and all(s.status == Status.COMPLETED for s in samples)
    sent = sorted((tuple(b["input_ids"]) for b in engine.bodies), key=len)
    for sample in samples:
        tokens = sample.tokens.tolist()
        assert tokens[:3] == PROMPT_IDS and sample.response_length == 2 * 3 + 3 * 2
        # Each turn's body: the prompt + every earlier reply and observation, nothing more.
        starts = [3, 3 + 2 + 3, 3 + 2 * (2 + 3)]
        for start in starts:
            assert tuple(tokens[:start]) in sent
        assert sample.loss_mask is not None and sample.loss_mask.tolist() == [1, 1, 0, 0, 0] * 2 + [1, 1]
        assert sample.rollout_log_probs is not None and sample.rollout_log_probs.tolist() == [-0.25] * 2 + [0.0] * 3 + \
            [-0.25] * 2 + [0.0] * 3 + [-0.25] * 2
        assert sample.weight_versions == [5, 5, 5]
        assert sample.weight_version_spans == [(0, 2, 5), (5, 7, 5), (10, 12, 5)]
    assert sorted(set(lengths)) == [0, 5, 10, 12]


async def test_the_sampling_mapping_is_the_producers_and_a_replaced_one_is_sent() -> None:
    async def changed(episode: Episode, lengths: list[int]) -> Sample:
        await episode.generate()
        await episode.generate(stop=["</tool>"])
        return episode.sample

    engine, _, _ = await _run(changed, n=1, top_k=5)
    first, second = (b["sampling_params"] for b in engine.bodies)
    assert first == {"max_new_tokens": 64, "temperature": 0.7, "top_p": 1.0, "top_k": 5}
    assert second == {**first, "stop": ["</tool>"]}


def test_ids_json_matches_the_ids_and_a_copy_that_changed_is_encoded_afresh() -> None:
    ids = array("i")
    cache = IdsJson(ids)
    assert _ENCODER.encode({"input_ids": cache.ids()}) == b'{"input_ids":[]}'
    for chunk in ([1, 2, 3], [], [2**31 - 1, 0], [-5]):
        ids.extend(chunk)
        assert _ENCODER.encode({"input_ids": cache.ids()}) == msgspec.json.encode({"input_ids": ids.tolist()})
    copy = cache.ids()
    copy.append(42)  # grew after its JSON was written: never the stale text
    assert msgspec.json.decode(_ENCODER.encode(copy)) == [1, 2, 3, 2**31 - 1, 0, -5, 42]
    assert ids.tolist() == [1, 2, 3, 2**31 - 1, 0, -5]  # a copy: the trajectory's own ids are untouched
    older = cache.ids()
    ids.extend([8, 9])
    newer = cache.ids()
    assert _ENCODER.encode(newer) == b"[1,2,3,2147483647,0,-5,8,9]"
    assert _ENCODER.encode(older) == b"[1,2,3,2147483647,0,-5]"  # encoded after a longer one: its own ids
