"""The rollout (one prompt -> one scored group) in-process, against an engine on httpx.MockTransport."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from rollstream.common.errors import EngineBroken
from rollstream.common.models import Group, Prompt, PromptContent, Sample, Status
from rollstream.producer.engine import EngineClient, EngineSettings, EngineState
from rollstream.producer.rewards import PythonReward, RewardBroken, RewardFunction
from rollstream.producer.rollout import Rollout
from rollstream.producer.settings import EpisodeSettings
from rollstream.producer.telemetry import Metrics

URL = "http://engine"
PROMPT_IDS = [7, 8, 9]


class FakeEngine:
    """An SGLang-like engine: /tokenize, /generate; no model-info endpoint unless given."""

    def __init__(self, *, version: int | None = 3, finish: str = "stop", status: int = 200) -> None:
        self.version = version
        self.finish = finish
        self.status = status
        self.generate_bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/tokenize":
            return httpx.Response(200, json={"tokens": PROMPT_IDS})
        if path == "/generate":
            body = json.loads(request.content)
            self.generate_bodies.append(body)
            if self.status != 200:
                return httpx.Response(self.status, text="prompt too long")
            n = len(self.generate_bodies)
            output = [100 + n, 200 + n]
            meta: dict[str, Any] = {
                "finish_reason": {"type": self.finish},
                "output_token_logprobs": [[-0.5, t, None] for t in output],
            }
            if self.version is not None:
                meta["weight_version"] = str(self.version)
            return httpx.Response(200, json={"text": f"answer {n}", "output_ids": output, "meta_info": meta})
        return httpx.Response(404)


class CountingMetrics(Metrics):
    def __init__(self) -> None:
        self.started = self.finished = self.tokens = 0

    def request_started(self) -> None:
        self.started += 1

    def request_finished(self, seconds: float) -> None:
        self.finished += 1

    def tokens_generated(self, count: int) -> None:
        self.tokens += count


def rollout(engine: FakeEngine, n: int = 2, *, partial: bool = False, metrics: Metrics | None = None) -> Rollout:
    client = EngineClient(EngineSettings(urls=(URL,), max_new_tokens=16), transport=httpx.MockTransport(engine))
    reward = PythonReward(lambda sample, prompt, label: float(sample.index), name="by-index")
    return Rollout(client, reward, n, partial_rollout=partial, producer="p-1", metrics=metrics)


async def test_a_text_prompt_becomes_a_scored_group_of_prompt_plus_response_ids() -> None:
    engine = FakeEngine(version=3)
    metrics = CountingMetrics()
    group = await rollout(engine, 2, metrics=metrics).run(
        Prompt(index=5, prompt="2 + 2?", label="4", epoch=1, attempt=2, metadata={"src": "a"}), admitted_version=1
    )
    assert isinstance(group, Group)
    assert (group.index, group.epoch, group.attempt, group.producer) == (5, 1, 2, "p-1")
    assert group.metadata == {"src": "a"} and group.label == "4"
    assert all(body["input_ids"] == PROMPT_IDS for body in engine.generate_bodies)
    assert len(group.samples) == 2
    for i, sample in enumerate(group.samples):
        assert sample.index == i and sample.status == Status.COMPLETED
        assert sample.tokens.tolist()[:3] == PROMPT_IDS and sample.response_length == 2
        assert sample.prompt_length == 3 and sample.response_tokens.tolist() == sample.tokens.tolist()[3:]
        assert sample.loss_mask is not None and sample.loss_mask.tolist() == [1, 1]
        assert sample.weight_versions == [3]
        assert sample.rollout_log_probs is not None and sample.rollout_log_probs.tolist() == [-0.5, -0.5]
        assert sample.reward == float(i)
    assert (metrics.started, metrics.finished, metrics.tokens) == (2, 2, 4)


async def test_without_an_engine_version_the_admitted_version_is_recorded() -> None:
    group = await rollout(FakeEngine(version=None), 1).run(Prompt(index=0, prompt="hi"), admitted_version=7)
    sample = group.samples[0]
    assert sample.weight_versions == [7]
    assert sample.metadata["weight_version_source"] == "trainer_at_admission"


async def test_a_refused_request_gives_failed_samples_and_no_reward() -> None:
    group = await rollout(FakeEngine(status=400), 2).run(Prompt(index=0, prompt="hi"), admitted_version=0)
    assert group.status == Status.FAILED
    assert all(s.status == Status.FAILED and s.reward is None for s in group.samples)
    assert all(s.error is not None and "prompt too long" in s.error for s in group.samples)
    assert all(s.prompt_length == 3 and s.response_length == 0 for s in group.samples)


async def test_aborted_samples_are_scored_never_and_continued_with_partial_rollout() -> None:
    aborted = await rollout(FakeEngine(finish="abort"), 1).run(Prompt(index=0, prompt="hi"), admitted_version=0)
    first = aborted.samples[0]
    assert first.status == Status.ABORTED and first.reward is None
    engine = FakeEngine(version=4)
    retry = Prompt(index=0, prompt="hi", attempt=1, input_ids=PROMPT_IDS, partial=[first])
    group = await rollout(engine, 1, partial=True).run(retry, admitted_version=0)
    sample = group.samples[0]
    # the continuation sends prompt + the aborted response and asks only for the remaining tokens
    assert engine.generate_bodies[0]["input_ids"] == first.tokens.tolist()
    assert engine.generate_bodies[0]["sampling_params"]["max_new_tokens"] == 16 - first.response_length
    assert sample.status == Status.COMPLETED and sample.response_length == 4
    assert sample.tokens.tolist()[: len(first.tokens)] == first.tokens.tolist()
    assert sample.weight_versions == [3, 4] and sample.metadata["continued_from"] == 2
    assert sample.prompt_length == 3
    assert sample.loss_mask is not None and sample.loss_mask.tolist() == [1] * 4


async def test_completed_partial_samples_are_kept_as_they_are() -> None:
    done = Sample(index=0, tokens=[*PROMPT_IDS, 1], response="x", response_length=1, weight_versions=[2])
    engine = FakeEngine()
    group = await rollout(engine, 2, partial=True).run(
        Prompt(index=0, prompt="hi", input_ids=PROMPT_IDS, partial=[done]), admitted_version=0
    )
    assert group.samples[0].tokens.tolist() == done.tokens.tolist()
    assert len(engine.generate_bodies) == 1  # only the missing second sample was generated


async def test_sample_done_reports_every_sample_once_before_the_reward() -> None:
    reported: list[int] = []
    rewarded_after: list[int] = []

    def score(sample: Sample, prompt: PromptContent, label: Any) -> float:
        rewarded_after.append(sum(reported))
        return 1.0

    client = EngineClient(EngineSettings(urls=(URL,), max_new_tokens=16), transport=httpx.MockTransport(FakeEngine()))
    run = Rollout(client, PythonReward(score, name="s"), 3)
    await run.run(Prompt(index=0, prompt="hi"), admitted_version=0, sample_done=reported.append)
    assert reported == [1, 1, 1]  # one call per sample request, as each ends
    assert rewarded_after == [3, 3, 3]  # capacity is released before the group is scored
    refused: list[int] = []
    await rollout(FakeEngine(status=400), 2).run(Prompt(index=0, prompt="hi"), admitted_version=0, sample_done=refused.append)
    assert sum(refused) == 2  # refused requests free their capacity too


class MetadataReward(RewardFunction):
    """Records the metadata it is given (RemoteReward sends it in its request body)."""

    name = "metadata"

    def __init__(self) -> None:
        self.seen: list[Mapping[str, Any]] = []

    async def _score(
        self, prompt: PromptContent, label: Any, samples: list[Sample], metadata: Mapping[str, Any]
    ) -> list[float]:
        self.seen.append(metadata)
        return [1.0] * len(samples)


async def test_the_reward_function_receives_the_group_metadata() -> None:
    reward = MetadataReward()
    client = EngineClient(EngineSettings(urls=(URL,)), transport=httpx.MockTransport(FakeEngine()))
    group = await Rollout(client, reward, 2).run(
        Prompt(index=0, prompt="hi", metadata={"difficulty": "hard"}), admitted_version=0
    )
    assert reward.seen == [{"difficulty": "hard"}]
    assert [s.reward for s in group.samples] == [1.0, 1.0]


async def test_a_reward_failing_on_a_prompt_fails_its_group_and_a_broken_one_is_fatal() -> None:
    def picky(sample: Sample, prompt: PromptContent, label: Any) -> float:
        if prompt != "good":
            raise ValueError(f"cannot score {prompt!r}")
        return 1.0

    client = EngineClient(EngineSettings(urls=(URL,), max_new_tokens=16), transport=httpx.MockTransport(FakeEngine()))
    roll = Rollout(client, PythonReward(picky, name="picky"), 2, EpisodeSettings(reward_failure_limit=3))
    bad = await roll.run(Prompt(index=0, prompt="bad"), admitted_version=0)
    assert bad.status == Status.FAILED
    assert all(s.status == Status.FAILED and s.reward is None for s in bad.samples)
    assert all(s.error is not None and "reward: reward 'picky' failed" in s.error for s in bad.samples)
    assert all(s.response_length == 2 for s in bad.samples)  # the generation is kept, only unscored
    # The same prompt again, then one scored group: the count of distinct failures starts over.
    await roll.run(Prompt(index=0, prompt="bad", attempt=1), admitted_version=0)
    await roll.run(Prompt(index=1, prompt="bad"), admitted_version=0)
    assert (await roll.run(Prompt(index=2, prompt="good"), admitted_version=0)).status == Status.COMPLETED
    await roll.run(Prompt(index=3, prompt="bad"), admitted_version=0)
    await roll.run(Prompt(index=4, prompt="bad"), admitted_version=0)
    with pytest.raises(RewardBroken, match="failed on 3 distinct prompts in a row"):
        await roll.run(Prompt(index=5, prompt="bad"), admitted_version=0)
    await client.aclose()


class RoutedEngines:
    """Engines by host: ``good`` answers usable replies, ``garbage`` an HTML page, ``refusing``
    HTTP 400; ``garbage_for`` prompts get garbage from every engine."""

    def __init__(self, garbage_for: str = "") -> None:
        self.good = FakeEngine()
        self.garbage_for = garbage_for

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            text = json.loads(request.content).get("text")
            if request.url.host == "garbage" or (self.garbage_for and text == self.garbage_for):
                return httpx.Response(200, text="<html>oops</html>")
            if request.url.host == "refusing":
                return httpx.Response(400, text="no")
        return self.good(request)


def _alternating(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client picks engines in turn (among the least loaded), not at random."""
    import itertools

    from rollstream.producer.engine import routing

    turn = itertools.count()
    monkeypatch.setattr(routing.random, "choice", lambda seq: seq[next(turn) % len(seq)])


async def test_one_bad_reply_fails_one_sample_and_an_engine_failing_on_every_prompt_is_fatal() -> None:
    client = EngineClient(EngineSettings(urls=("http://good",), max_new_tokens=16),
                          transport=httpx.MockTransport(RoutedEngines(garbage_for="bad")))
    roll = Rollout(client, PythonReward(lambda s, p, lab: 1.0, name="one"),
                   2, EpisodeSettings(engine_failure_limit=3, tokenize_prompts=False))
    bad = await roll.run(Prompt(index=0, prompt="bad"), admitted_version=0)
    assert bad.status == Status.FAILED and all("not_json" in (s.error or "") for s in bad.samples)
    # The same prompt again (a retry) counts once; a usable reply ends the run of failures.
    await roll.run(Prompt(index=0, prompt="bad", attempt=1), admitted_version=0)
    await roll.run(Prompt(index=1, prompt="bad"), admitted_version=0)
    assert (await roll.run(Prompt(index=2, prompt="good"), admitted_version=0)).status == Status.COMPLETED
    await roll.run(Prompt(index=3, prompt="bad"), admitted_version=0)
    await roll.run(Prompt(index=4, prompt="bad"), admitted_version=0)
    with pytest.raises(EngineBroken, match="3 distinct prompts in a row") as caught:
        await roll.run(Prompt(index=5, prompt="bad"), admitted_version=0)
    assert caught.value.engine == "http://good" and caught.value.reason == "reply:not_json"
    await client.aclose()


async def test_a_broken_engine_among_good_ones_is_taken_out_and_all_broken_engines_are_fatal_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _alternating(monkeypatch)
    reward = PythonReward(lambda s, p, lab: 1.0, name="one")
    settings = EpisodeSettings(engine_failure_limit=3, tokenize_prompts=False)
    # One engine of two answers garbage: it is ejected (not fatal) and the good one does the rest.
    client = EngineClient(EngineSettings(urls=("http://good", "http://garbage"), max_new_tokens=16,
                                         eject_after=3, health_interval=60.0),
                          transport=httpx.MockTransport(RoutedEngines()))
    roll = Rollout(client, reward, 1, settings)
    statuses = [(await roll.run(Prompt(index=index, prompt="x"), admitted_version=0)).status for index in range(20)]
    # Each group's key names its engine (cache-aware routing): the garbage engine gets its share
    # until its third unusable reply, then nothing.
    failed = [i for i, status in enumerate(statuses) if status == Status.FAILED]
    assert len(failed) == 3 and all(status == Status.COMPLETED for status in statuses[failed[-1] + 1 :])
    garbage = client.fleet.engines["http://garbage"]
    assert garbage.state == EngineState.EJECTED and "not_json" in garbage.reason
    assert client.fleet.engines["http://good"].state == EngineState.HEALTHY
    await client.aclose()
    # Two engines broken in different ways: after 3 prompts neither has 3 alone, all engines have.
    client = EngineClient(EngineSettings(urls=("http://refusing", "http://garbage"), max_new_tokens=16),
                          transport=httpx.MockTransport(RoutedEngines()))
    roll = Rollout(client, reward, 1, settings)
    for index in range(2):
        assert (await roll.run(Prompt(index=index, prompt="x"), admitted_version=0)).status == Status.FAILED
    expected = r"^all engines gave no usable reply for 3 distinct prompts in a row \(none usable from any"
    with pytest.raises(EngineBroken, match=expected) as caught:
        await roll.run(Prompt(index=2, prompt="x"), admitted_version=0)
    assert caught.value.engine == "all engines" and caught.value.reason in ("http_400", "reply:not_json")
    await client.aclose()


async def test_an_eval_prompt_is_sampled_with_its_eval_settings() -> None:
    """The eval lane's n, token limit, temperature and top-p reach the engine; a training prompt
    keeps the producer's."""
    from rollstream.common.eval_lane import EVAL_KEY, EvalSettings

    engine = FakeEngine()
    roll = rollout(engine, 2)
    lane = EvalSettings("e", n_samples=3, max_new_tokens=5, temperature=0.25, top_p=0.5)
    group = await roll.run(Prompt(index=0, prompt="1 + 1?", metadata={EVAL_KEY: lane.as_metadata()}), admitted_version=0)
    assert len(group.samples) == 3
    assert [b["sampling_params"] for b in engine.generate_bodies] == [
        {"temperature": 0.25, "top_p": 0.5, "max_new_tokens": 5}
    ] * 3
    engine.generate_bodies.clear()
    await roll.run(Prompt(index=1, prompt="2 + 2?"), admitted_version=0)
    assert [b["sampling_params"] for b in engine.generate_bodies] == [
        {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16}
    ] * 2
