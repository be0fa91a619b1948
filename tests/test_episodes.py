"""User-written rollouts (episodes) in-process: the session against the multi-turn simulator.

Exact accounting: masks and log-probs per token, versions per engine call, engine slots and
episodes from the runtime's counters (never timings)."""

from __future__ import annotations

import asyncio
import contextlib
import math
from array import array
from collections.abc import AsyncIterator
from typing import Any

import episode_fns
import httpx
import pytest
from conftest import wait_until
from rollstream.common.errors import ConfigError, GenerateBroken
from rollstream.common.models import Group, Prompt, Sample, Status
from rollstream.common.protocol import parse_limit, parse_limits
from rollstream.producer.checks import check_sample
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.episode import Episode, SamplingParams
from rollstream.producer.episode_runtime import EpisodeLimits
from rollstream.producer.plugin import load_generate
from rollstream.producer.rewards import PythonReward
from rollstream.producer.rollout import Rollout, single_turn
from rollstream.producer.settings import EpisodeSettings
from rollstream.testing.sim import SimConfig, SimEngine
from rollstream.testing.sim.simulator import detokenize, tokenize

CALC = "What is 2 + 3? [tools=2]"


@pytest.fixture
async def sim() -> AsyncIterator[SimEngine]:
    async with SimEngine(SimConfig(seed=3, mean_tokens=24, accuracy=1.0)) as engine:
        yield engine


@contextlib.asynccontextmanager
async def make_rollout(
    url: str, fn: Any, n: int = 1, *, partial: bool = False, limits: EpisodeLimits | None = None,
    max_new_tokens: int = 64, failure_limit: int = 8,
) -> AsyncIterator[Rollout]:
    engine = EngineClient(EngineSettings(urls=(url,), max_new_tokens=max_new_tokens, max_retries=0))
    reward = PythonReward(lambda sample, prompt, label: 1.0, name="one")
    settings = EpisodeSettings(generate=fn, limits=limits or EpisodeLimits(), generate_failure_limit=failure_limit)
    try:
        yield Rollout(engine, reward, n, settings, partial_rollout=partial, producer="p")
    finally:
        await engine.aclose()
        await reward.aclose()


def observed_spans(sample: Sample) -> list[tuple[int, int]]:
    """(start, end) over the response of every ``<result>...</result>`` the tool appended."""
    text = detokenize(sample.response_tokens.tolist())
    spans, start = [], 0
    while (i := text.find("<result>", start)) >= 0:
        end = text.index("</result>", i) + len("</result>")
        spans.append((i, end))
        start = end
    return spans


async def test_a_three_turn_episode_masks_exactly_the_tool_tokens(sim: SimEngine) -> None:
    async with make_rollout(sim.url, episode_fns.calculator, n=2) as rollout:
        group = await rollout.run(Prompt(index=0, prompt=CALC), admitted_version=0)
    assert group.status == Status.COMPLETED and len(group.samples) == 2
    prompt_ids = tokenize(CALC)
    for member, sample in enumerate(group.samples):
        assert sample.index == member and check_sample(sample) is None
        assert sample.tokens.tolist()[: sample.prompt_length] == prompt_ids
        text = detokenize(sample.response_tokens.tolist())
        assert text.count("<tool>calc: 2 + 3</tool>") == 2 and text.endswith("The answer is \\boxed{5}.")
        tool = observed_spans(sample)
        assert len(tool) == 2 and all(text[s:e] == "<result>5</result>" for s, e in tool)
        assert sample.loss_mask is not None and sample.rollout_log_probs is not None
        expected = [0 if any(s <= i < e for s, e in tool) else 1 for i in range(sample.response_length)]
        assert sample.loss_mask.tolist() == expected  # 0 exactly on the tool tokens
        log_probs = sample.rollout_log_probs.tolist()
        assert all(lp == 0.0 for lp, m in zip(log_probs, expected, strict=True) if not m)
        assert all(lp < 0 for lp, m in zip(log_probs, expected, strict=True) if m)
        assert sample.weight_versions == [0, 0, 0]  # one per engine call
        spans = sample.weight_version_spans
        assert spans is not None and len(spans) == 3
        model = [(s, e) for s, e, _ in spans]
        gaps = [(model[i][1], model[i + 1][0]) for i in range(2)]
        assert gaps == tool  # the model's spans and the tool's tokens tile the response
        assert model[0][0] == 0 and model[-1][1] == sample.response_length
        assert sample.reward == 1.0
    assert rollout.runtime.episode_turns == 6


async def test_tool_time_holds_no_engine_slot(sim: SimEngine) -> None:
    release = asyncio.Event()
    in_tool = 0

    async def blocking_tool(episode: Episode) -> Sample:
        nonlocal in_tool
        await episode.generate(max_new_tokens=8)
        in_tool += 1
        await release.wait()
        await episode.observe("<result>ok</result>")
        await episode.generate(max_new_tokens=8)
        return episode.sample

    limits = EpisodeLimits(engine_concurrency=1)
    async with make_rollout(sim.url, blocking_tool, n=4, limits=limits) as rollout:
        task = asyncio.create_task(rollout.run(Prompt(index=0, prompt="hi"), admitted_version=0))
        runtime = rollout.runtime
        # All four episodes in their tool at once on ONE engine slot: the tool holds none.
        await wait_until(lambda: in_tool == 4, message="four episodes in the tool")
        assert (runtime.episodes, runtime.engine_requests) == (4, 0)
        release.set()
        group = await asyncio.wait_for(task, 30)
    assert group.status in (Status.COMPLETED, Status.TRUNCATED)
    assert runtime.engine_slots.peak == 1 and runtime.episodes_peak == 4
    assert sim.state.stats()["max_running_seen"] == 1
    assert runtime.episode_turns == 8 and runtime.engine_requests == 0 and runtime.episodes == 0


async def test_named_limits_cap_tools_producer_wide(sim: SimEngine) -> None:
    inside = peak = 0

    async def sandboxed(episode: Episode) -> Sample:
        nonlocal inside, peak
        await episode.generate(max_new_tokens=4)
        async with episode.limit("sandbox"):
            inside += 1
            peak = max(peak, inside)
            await asyncio.sleep(0.01)
            inside -= 1
        return episode.sample

    async def unknown(episode: Episode) -> Sample:
        async with episode.limit("gpu"):
            return episode.sample

    limits = EpisodeLimits(named=parse_limits(["sandbox=2"]))
    async with make_rollout(sim.url, sandboxed, n=6, limits=limits) as rollout:
        group = await rollout.run(Prompt(index=0, prompt="hi"), admitted_version=0)
    assert group.status != Status.FAILED and peak == 2
    async with make_rollout(sim.url, unknown, n=1, limits=limits) as rollout:
        group = await rollout.run(Prompt(index=0, prompt="hi"), admitted_version=0)
    (sample,) = group.samples
    assert sample.status == Status.FAILED and sample.error is not None and "no limit named 'gpu'" in sample.error


@pytest.mark.parametrize("bad", ["sandbox", "sandbox=0", "sandbox=x", "=3", "a=+3", "a=3_0", "a=\u00b2", "a=-1"])
def test_malformed_limits_are_config_errors(bad: str) -> None:
    """One ``NAME=K`` parser (common.protocol.parse_limit) for a producer's and the namespace's
    limits: K in decimal digits only (``a=²`` was a ValueError here, ``a=+3`` passed init's)."""
    with pytest.raises(ConfigError):
        parse_limits([bad])
    with pytest.raises(ConfigError):
        parse_limit(bad)
    with pytest.raises(ConfigError, match="given twice"):
        parse_limits(["a=1", "a=2"])


async def test_a_tool_that_raises_fails_its_sample_with_the_reason(sim: SimEngine) -> None:
    async with make_rollout(sim.url, episode_fns.calculator, n=2) as rollout:
        group = await rollout.run(Prompt(index=0, prompt="RAISE 1 + 1 [tools=1]"), admitted_version=0)
        good = await rollout.run(Prompt(index=1, prompt=CALC), admitted_version=0)
    assert group.status == Status.FAILED and all(s.status == Status.FAILED for s in group.samples)
    assert all(s.error and "ToolFailed: the calc tool exploded" in s.error for s in group.samples)
    assert all(s.reward is None for s in group.samples)
    assert good.status == Status.COMPLETED  # the next prompt is unaffected
    assert rollout.episodes_failed == 2


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (episode_fns.nested, "nested list"),
        (episode_fns.not_a_sample, "returned a str"),
        (episode_fns.short_mask, "loss mask has"),
        (episode_fns.nan_log_prob, "non-finite log-prob"),
        (episode_fns.tokens_mismatch, "!= prompt"),
    ],
)
async def test_garbage_results_fail_the_sample_with_the_reason(sim: SimEngine, fn: Any, reason: str) -> None:
    async with make_rollout(sim.url, fn, n=2) as rollout:
        group = await rollout.run(Prompt(index=0, prompt="hi"), admitted_version=0)
    assert [s.status for s in group.samples] == [Status.FAILED, Status.FAILED]
    assert all(s.error is not None and reason in s.error for s in group.samples), group.samples[0].error
    assert all(s.index == i for i, s in enumerate(group.samples))


async def test_a_hanging_tool_is_ended_by_the_episode_deadline(sim: SimEngine) -> None:
    limits = EpisodeLimits(episode_timeout=0.5)
    async with make_rollout(sim.url, episode_fns.calculator, n=2, limits=limits) as rollout:
        group = await rollout.run(Prompt(index=0, prompt="HANG 1 + 1 [tools=1]"), admitted_version=0)
        assert rollout.runtime.episodes == 0 and rollout.runtime.engine_requests == 0
    assert all(s.status == Status.FAILED and s.finish_reason == "deadline" for s in group.samples)
    assert all(s.error and "episode deadline" in s.error for s in group.samples)


async def test_a_function_failing_on_many_prompts_in_a_row_is_broken(sim: SimEngine) -> None:
    async with make_rollout(sim.url, episode_fns.always_raises, failure_limit=3) as rollout:
        for index in range(2):
            group = await rollout.run(Prompt(index=index, prompt="hi"), admitted_version=0)
            assert group.status == Status.FAILED
        # the same prompt again is not a new one
        await rollout.run(Prompt(index=1, prompt="hi", attempt=1), admitted_version=0)
        with pytest.raises(GenerateBroken, match="failed on 3 distinct prompts in a row"):
            await rollout.run(Prompt(index=2, prompt="hi"), admitted_version=0)


async def test_a_success_in_between_resets_the_broken_count(sim: SimEngine) -> None:
    async def flaky(episode: Episode) -> Sample:
        if "bad" in str(episode.prompt):
            raise RuntimeError("bad prompt")
        await episode.generate(max_new_tokens=4)
        return episode.sample

    async with make_rollout(sim.url, flaky, failure_limit=2) as rollout:
        for index in range(6):
            prompt = "bad" if index % 2 == 0 else "good"
            await rollout.run(Prompt(index=index, prompt=prompt), admitted_version=0)


async def test_segments_share_the_episode_id(sim: SimEngine) -> None:
    async with make_rollout(sim.url, episode_fns.two_agents, n=2) as rollout:
        group = await rollout.run(Prompt(index=0, prompt="Compute 1 + 2."), admitted_version=0)
    assert [s.index for s in group.samples] == [0, 0, 1, 1]
    assert [s.metadata["segment"] for s in group.samples] == [0, 1, 0, 1]
    assert group.size_error(2) is None and Group(index=0, prompt="", samples=group.samples[:3]).size_error(2) is None
    assert Group(index=0, prompt="", samples=group.samples[:2] * 2).size_error(2) == "4 samples, expected 2"
    checker = group.samples[1]
    assert detokenize(checker.tokens.tolist()[: checker.prompt_length]).startswith("Check: ")
    assert checker.response_length <= 8


async def test_the_context_budget_clamps_max_new_tokens(sim: SimEngine) -> None:
    prompt = "What is 2 + 3? [tools=3]"
    budget = len(tokenize(prompt)) + 40
    async with make_rollout(sim.url, episode_fns.calculator, limits=EpisodeLimits(max_context=budget)) as rollout:
        group = await rollout.run(Prompt(index=0, prompt=prompt), admitted_version=0)
    (sample,) = group.samples
    assert len(sample.tokens) <= budget and sample.status == Status.TRUNCATED
    assert check_sample(sample) is None


async def test_single_turn_is_the_default_plug_in(sim: SimEngine) -> None:
    async with make_rollout(sim.url, None, n=2) as rollout:
        assert rollout.generate is single_turn
        group = await rollout.run(Prompt(index=0, prompt="Compute 1 + 2."), admitted_version=0)
    assert all(s.weight_version_spans is None and s.weight_versions == [0] for s in group.samples)
    assert rollout.runtime.episode_turns == 2


async def test_an_abort_mid_turn_is_continued_with_partial_rollout(sim: SimEngine) -> None:
    """The engine aborts the running call (a weight update): the session resubmits the tokens
    so far and the user's code sees one turn holding both versions; nothing lost or repeated."""
    slow = SimConfig(seed=4, mean_tokens=120, length_sigma=0.0, latency_per_token=0.01, accuracy=1.0)
    async with SimEngine(slow) as engine, httpx.AsyncClient(base_url=engine.url) as http:
        seen: list[Any] = []

        async def one_turn(episode: Episode) -> Sample:
            seen.append(await episode.generate())
            return episode.sample

        async with make_rollout(engine.url, one_turn, partial=True, max_new_tokens=200) as rollout:
            task = asyncio.create_task(rollout.run(Prompt(index=0, prompt="Compute 4 * 5."), admitted_version=0))
            await wait_until(lambda: engine.state.running == 1, message="the call generating")
            await asyncio.sleep(0.2)  # some tokens accrue (any number works, zero included)
            await http.post("/pause_generation", json={"mode": "abort"})
            await http.post("/update_weights_from_disk", json={"weight_version": "1"})
            await http.post("/continue_generation", json={})
            group = await asyncio.wait_for(task, 30)
        (sample,) = group.samples
        (turn,) = seen
    assert sample.status == Status.COMPLETED and check_sample(sample) is None
    assert sample.weight_versions == [0, 1] and turn.weight_versions == (0, 1)
    spans = sample.weight_version_spans
    assert spans is not None and [v for _, _, v in spans] == [0, 1]
    assert spans[0][1] == spans[1][0] and spans[1][1] == sample.response_length
    text = detokenize(sample.response_tokens.tolist())
    assert text == sample.response and text.endswith("The answer is \\boxed{20}.")
    assert text.count("The answer is") == 1  # continued, not restarted
    assert sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == sample.response_length
    assert rollout.runtime.aborts_continued == 1 and engine.state.stats()["aborted"] == 1


async def test_an_abort_on_the_openai_api_continues_from_the_prompt_ids_the_engine_echoed() -> None:
    """OpenAI API, a text prompt whose ids the producer does not know (no tokenizer, no
    /tokenize): the aborted reply echoes the prompt ids (``return_token_ids``), so the session
    continues the call as token input (prompt ids + its tokens) instead of aborting the episode;
    the first tokens are the aborted call's own and the new version is read after the abort."""
    slow = SimConfig(seed=4, mean_tokens=120, length_sigma=0.0, latency_per_token=0.01, accuracy=1.0)
    async with SimEngine(slow) as engine, httpx.AsyncClient(base_url=engine.url) as http:
        client = EngineClient(EngineSettings(urls=(engine.url,), api="openai", model="rollstream-sim",
                                             max_new_tokens=200, max_retries=0, model_info_ttl=3600.0))

        async def one_turn(episode: Episode) -> Sample:
            await episode.generate()
            return episode.sample

        reward = PythonReward(lambda sample, prompt, label: 1.0, name="one")
        settings = EpisodeSettings(generate=one_turn, tokenize_prompts=False)
        try:
            await client.check_versions()  # version 0, believed until an abort
            rollout = Rollout(client, reward, 1, settings, partial_rollout=True, producer="p")
            task = asyncio.create_task(rollout.run(Prompt(index=0, prompt="Compute 4 * 5."), admitted_version=0))
            await wait_until(lambda: engine.state.running == 1, message="the call generating")
            await asyncio.sleep(0.2)
            await http.post("/pause_generation", json={"mode": "abort"})
            await http.post("/update_weights_from_disk", json={"weight_version": "1"})
            await http.post("/continue_generation", json={})
            group = await asyncio.wait_for(task, 30)
        finally:
            await client.aclose()
            await reward.aclose()
    (sample,) = group.samples
    assert sample.status == Status.COMPLETED and check_sample(sample) is None
    assert list(sample.tokens[: sample.prompt_length]) == tokenize("Compute 4 * 5.")
    (first,) = engine.state.aborted_outputs
    spans = sample.weight_version_spans
    assert spans is not None and [v for _, _, v in spans] == [0, 1] and spans[0][1] == len(first) > 0
    assert sample.response_tokens.tolist()[: len(first)] == first
    assert sample.response.count("The answer is") == 1  # continued, not restarted
    assert rollout.runtime.aborts_continued == 1


async def test_an_abort_without_partial_rollout_aborts_the_episode_whole(sim: SimEngine) -> None:
    slow = SimConfig(seed=4, mean_tokens=120, length_sigma=0.0, latency_per_token=0.01)
    caught: list[BaseException] = []

    async def swallowing(episode: Episode) -> Sample:
        try:
            await episode.generate()
        except Exception as exc:  # catching it changes nothing
            caught.append(exc)
        return episode.sample

    async with SimEngine(slow) as engine, httpx.AsyncClient(base_url=engine.url) as http:
        async with make_rollout(engine.url, swallowing, n=2, max_new_tokens=200) as rollout:
            task = asyncio.create_task(rollout.run(Prompt(index=0, prompt="Compute 4 * 5."), admitted_version=0))
            await wait_until(lambda: engine.state.running == 2, message="both calls generating")
            await http.post("/abort_request", json={"abort_all": True})
            group = await asyncio.wait_for(task, 30)
    assert group.status == Status.ABORTED and all(s.status == Status.ABORTED for s in group.samples)
    assert len(caught) == 2 and all(s.reward is None for s in group.samples)


def test_sampling_params_replace_puts_unknown_names_in_extra() -> None:
    base = SamplingParams(max_new_tokens=8, temperature=0.5, extra={"top_k": 3})
    changed = base.replace(temperature=0.1, stop=["</tool>"])
    assert (changed.temperature, dict(changed.extra)) == (0.1, {"top_k": 3, "stop": ["</tool>"]})
    assert base.temperature == 0.5 and dict(base.extra) == {"top_k": 3}


def test_load_generate(tmp_path: Any) -> None:
    assert load_generate("episode_fns:calculator") is episode_fns.calculator
    path = tmp_path / "mine.py"
    path.write_text("async def generate(episode):\n    return episode.sample\n")
    assert load_generate(f"{path}:generate").__name__ == "generate"
    for bad in ("episode_fns:ToolFailed", "episode_fns:nothing", f"{tmp_path}/none.py:generate", "x"):
        with pytest.raises(ConfigError):
            load_generate(bad)


def test_check_sample_rules() -> None:
    ok = Sample(index=0, tokens=[1, 2, 3], response_length=2, loss_mask=[1, 0], rollout_log_probs=[-1.0, math.nan])
    assert check_sample(ok) is None  # a non-finite log-prob where the mask is 0 is not trained on
    bad_mask = Sample(index=0, tokens=[1, 2, 3], response_length=2, loss_mask=[1, 2])
    assert check_sample(bad_mask) == "loss mask holds values other than 0 and 1"
    spans = Sample(index=0, tokens=[1, 2], response_length=2, loss_mask=[1, 1], weight_version_spans=[(1, 3, 0)])
    assert "span" in (check_sample(spans) or "")
    assert check_sample(Sample(index=0, tokens=array("i", [1]), response_length=1)) is not None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_check_sample_finds_a_non_finite_log_prob_anywhere(bad: float) -> None:
    for position in (0, 1, 2, 3, 1022):
        log_probs = array("f", [-0.5] * 1023)
        log_probs[position] = bad
        sample = Sample(index=0, tokens=[0] * 1024, response_length=1023, loss_mask=b"\x01" * 1023,
                        rollout_log_probs=log_probs)
        assert check_sample(sample) == "a non-finite log-prob on a trained token (loss mask 1)"
    huge = Sample(index=0, tokens=[0] * 3, response_length=2, loss_mask=[1, 1], rollout_log_probs=[-3e38, -1.0])
    assert check_sample(huge) is None  # finite, however large
