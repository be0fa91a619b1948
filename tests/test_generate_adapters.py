"""``--generate slime:`` / ``miles:`` / ``openai:``: slime's and miles' generate functions and
OpenAI-API agents on real producer processes (real Redis, the simulator over HTTP), with exact
accounting and loss masks checked token by token; plus the endpoint's refusals in process.

The simulator's tokens are bytes and the fake tokenizer's too, so a sample's response text is
its response tokens one for one: the tests find the tool's text in it and check that the loss
mask is 0 exactly there (log-prob 0), 1 everywhere else (with the engine's negative log-probs)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from array import array
from pathlib import Path
from typing import Any

import adapter_fns
import httpx
import pytest
from conftest import ProcessPool, add_prompts, make_namespace, wait_until
from integration_helpers import STANDINS
from redis.asyncio import Redis
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.models import Group, Prompt, Sample, Status
from rollstream.consumer import GroupConsumer
from rollstream.integrations.endpoints import EndpointServer
from rollstream.integrations.generate import load_framework_generate
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.rewards import load_reward
from rollstream.producer.rollout import Rollout
from rollstream.producer.settings import EpisodeSettings, ProducerSettings
from rollstream.producer.tokenizer import load_tokenizer
from rollstream.producer.worker import Producer
from rollstream.testing.sim import SimConfig, SimEngine
from rollstream.testing.sim.simulator import detokenize

TESTS_DIR = Path(__file__).parent
TOKENIZER = "fake_tokenizer:FakeChatTokenizer"
N = 2


@pytest.fixture
def producer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Producer processes import the test functions, the fake tokenizer and the stand-ins."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS_DIR), str(STANDINS)]))


def _observations(turns: int) -> list[str]:
    return [adapter_fns.OBS.format(k) for k in range(turns - 1)]


def check_tool_masks(sample: Sample, observations: list[str]) -> None:
    """Mask 0 (log-prob 0) exactly on the observation tokens, 1 (engine log-probs) elsewhere."""
    rlen = sample.response_length
    response_ids = list(sample.tokens[sample.prompt_length :])
    text = detokenize(response_ids)
    assert text == sample.response
    expected = [1] * rlen
    start = 0
    for obs in observations:
        at = text.index(obs, start)
        expected[at : at + len(obs)] = [0] * len(obs)
        start = at + len(obs)
    assert list(sample.loss_mask) == expected
    assert sample.rollout_log_probs is not None and len(sample.rollout_log_probs) == rlen
    for mask, lp in zip(expected, sample.rollout_log_probs, strict=True):
        assert (lp == 0.0) if mask == 0 else (lp < 0.0)


async def _take_all(redis_url: str, ns: str, groups: int, per_take: int) -> list[Group]:
    out: list[Group] = []
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:
        while len(out) < groups:
            batch = await asyncio.wait_for(consumer.take(per_take), 60)
            out.extend(batch.groups)
            await consumer.commit(batch)
    return out


async def _dead_reasons(redis_url: str, redis: Redis, ns: str) -> str:
    """Drive take() (which recycles / dead-letters FAILED groups) until something is dead-lettered."""
    async with await GroupConsumer.connect(redis_url, ns, "trainer") as consumer:

        async def dead() -> list[Any]:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await consumer.take(1)
            return await redis.xrange(Keys(ns).dead)

        entries = await wait_until(dead, timeout=40, interval=0.1, message="a dead-lettered prompt")
    return " ".join(v.decode() for _, fields in entries for k, v in fields.items() if k == b"reason")


# -- producer processes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "turns"),
    [
        ("slime:adapter_fns.slime_tool_loop", adapter_fns.TURNS),
        ("miles:adapter_fns.miles_tool_loop", adapter_fns.TURNS),
        ("miles:adapter_fns.miles_legacy_loop", 1),  # slime's form through miles' LegacyGenerateFnAdapter
        ("slime:slime.rollout.sglang_rollout.generate", 1),  # slime's stock generate, unchanged
    ],
)
async def test_framework_functions_on_producers_exact_accounting(
    spec: str, turns: int, redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool,
    producer_path: None,
) -> None:
    prompts = 6
    await make_namespace(redis, ns, n_samples_per_prompt=N, batch_size=3)
    await add_prompts(redis, ns, prompts)
    procs.producer(
        redis_url, ns, sim.url, "--generate", spec, "--tokenizer", TOKENIZER, "--engine-concurrency", "2",
        name="adapter",
    )
    groups = await _take_all(redis_url, ns, prompts, 3)
    assert sorted(g.index for g in groups) == list(range(prompts)), procs.logs()
    calls = 0
    for group in groups:
        assert len(group.samples) == N
        assert sorted(s.index for s in group.samples) == list(range(N))
        for sample in group.samples:
            assert sample.status in (Status.COMPLETED, Status.TRUNCATED), (sample.error, procs.logs())
            assert sample.prompt_length > 0
            assert sample.prompt_length + sample.response_length == len(sample.tokens)
            made = len(sample.weight_versions)  # one version per engine call
            if sample.finish_reason != "length":  # the miles loop stops early on "length"
                assert made == turns
            assert sample.weight_versions == [0] * made
            assert sample.reward is not None
            check_tool_masks(sample, _observations(made))
            calls += made
            if "legacy" in spec:
                assert sample.metadata["legacy"] is True
    # every engine call of every episode went to the engine once (no retry, no duplicate) ...
    assert sim.state.requests == calls
    assert await redis.xlen(Keys(ns).dead) == 0
    # ... through the producer's engine slots: never more than 2 at once, while more episodes ran
    async def beat() -> dict[str, Any]:
        value = json.loads(await redis.hget(Keys(ns).producers, "adapter") or "{}")
        return value if value.get("engine_requests_peak", 0) >= 1 else {}

    counters = await wait_until(beat, timeout=20, message="a heartbeat after the engine calls")
    assert counters["engine_requests_peak"] <= 2 < counters["episodes_peak"], counters
    assert sim.state.max_running_seen <= 2


async def test_openai_agent_on_a_producer_masks_token_by_token(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool, producer_path: None
) -> None:
    prompts = 4
    await make_namespace(redis, ns, n_samples_per_prompt=N, batch_size=2)
    await add_prompts(redis, ns, prompts)
    procs.producer(redis_url, ns, sim.url, "--generate", "openai:adapter_fns.openai_tool_agent",
                   "--tokenizer", TOKENIZER, name="agent")
    groups = await _take_all(redis_url, ns, prompts, 2)
    assert sorted(g.index for g in groups) == list(range(prompts))
    for group in groups:
        for sample in group.samples:
            assert sample.status in (Status.COMPLETED, Status.TRUNCATED), (sample.error, procs.logs())
            replies = sample.metadata["replies"]
            assert len(replies) == adapter_fns.TURNS and sample.metadata["agent_turns"] == adapter_fns.TURNS
            # the prompt is the chat template's rendering of the agent's first request
            prompt = f"[FAKE]user: {group.prompt}|[FAKE]assistant:"
            assert detokenize(list(sample.tokens[: sample.prompt_length])) == prompt
            # between two model turns: the end of the assistant message, the tool message and the
            # next generation prompt, as the template writes them; the model's tokens are the engine's
            between = [f"|[FAKE]tool: tool result {k}|[FAKE]assistant:" for k in range(adapter_fns.TURNS - 1)]
            expected_text = "".join(r + b for r, b in zip(replies, [*between, ""], strict=True))
            assert sample.response == "".join(replies)
            response_ids = list(sample.tokens[sample.prompt_length :])
            assert detokenize(response_ids) == expected_text
            expected_mask: list[int] = []
            for reply, gap in zip(replies, [*between, ""], strict=True):
                expected_mask += [1] * len(reply.encode()) + [0] * len(gap.encode())
            assert list(sample.loss_mask) == expected_mask
            assert sample.weight_versions == [0] * adapter_fns.TURNS
            assert sample.weight_version_spans is not None and len(sample.weight_version_spans) == adapter_fns.TURNS
            assert sample.rollout_log_probs is not None
            assert all((lp == 0.0) == (m == 0) for lp, m in zip(sample.rollout_log_probs, expected_mask, strict=True))
    assert sim.state.requests == prompts * N * adapter_fns.TURNS


async def test_openai_agent_with_a_wrong_key_is_refused(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool, producer_path: None
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=N, batch_size=2)
    await add_prompts(redis, ns, 2)
    procs.producer(redis_url, ns, sim.url, "--generate", "openai:adapter_fns.openai_wrong_key_agent",
                   "--tokenizer", TOKENIZER, name="wrongkey")
    groups = await _take_all(redis_url, ns, 2, 2)
    for group in groups:
        for sample in group.samples:
            assert sample.metadata["wrong_key_status"] == 401
            # the refused request wrote nothing: one model turn, all of it trainable
            assert list(sample.loss_mask) == [1] * sample.response_length
            assert len(sample.weight_versions) == 1
    assert sim.state.requests == 2 * N  # the refused requests never reached an engine


async def test_a_conversation_that_does_not_extend_the_recorded_one_fails_the_sample(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool, producer_path: None
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=N, batch_size=1, max_attempts=1)
    await add_prompts(redis, ns, 1)
    procs.producer(redis_url, ns, sim.url, "--generate", "openai:adapter_fns.openai_rewriting_agent",
                   "--tokenizer", TOKENIZER, name="rewriter")
    reason = await _dead_reasons(redis_url, redis, ns)
    assert "does not extend the recorded one" in reason and "(edited)" in reason, reason
    assert "message 1 (assistant) differs" in reason, reason


@pytest.mark.parametrize(
    ("fn", "expected"),
    [("slime_nested", "nested list"), ("slime_unencodable_metadata", "metadata is not plain data")],
)
async def test_a_garbage_result_fails_the_sample_and_is_dead_lettered(
    fn: str, expected: str, redis_url: str, redis: Redis, ns: str, sim: SimEngine, procs: ProcessPool,
    producer_path: None,
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=N, batch_size=1, max_attempts=2)
    await add_prompts(redis, ns, 1)
    producer = procs.producer(redis_url, ns, sim.url, "--generate", f"slime:adapter_fns.{fn}",
                              "--tokenizer", TOKENIZER, name="garbage")
    reason = await _dead_reasons(redis_url, redis, ns)
    assert expected in reason, reason
    assert producer.poll() is None, procs.log_of(producer)  # one sample's problem, not the producer's


# -- in process: the endpoint itself --------------------------------------------------------------


class _Harness:
    """A Rollout on a real EngineClient against the simulator (no Redis): one group at a time."""

    def __init__(self, sim: SimEngine, spec: str, server: EndpointServer, **engine: Any) -> None:
        self.sim = sim
        self.spec = spec
        self.server = server
        self.engine_kwargs = engine
        self.partial = False
        self.resumed: asyncio.Event | None = None

    async def group(self, index: int = 0, prompt: Any = "Compute 1 + 2.") -> Group:
        tokenizer = load_tokenizer(TOKENIZER)
        settings = EngineSettings(urls=(self.sim.url,), max_new_tokens=64, **self.engine_kwargs)
        async with EngineClient(settings, tokenizer=tokenizer) as engine:
            fn = load_framework_generate(self.spec, tokenizer=TOKENIZER, server=self.server)
            resumed = self.resumed
            wait = None if resumed is None else resumed.wait
            rollout = Rollout(engine, load_reward("math"), N, EpisodeSettings(generate=fn),
                              partial_rollout=self.partial, wait_resumed=wait)
            return await rollout.run(Prompt(index=index, prompt=prompt, label="3"), 0)


@pytest.fixture
def standins_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS_DIR))


async def test_the_endpoint_answers_only_its_episode_and_closes_after_it(
    sim: SimEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = EndpointServer()
    seen: dict[str, Any] = {}

    async def agent(*, base_url: str, api_key: str, prompt: Any, request_kwargs: Any, metadata: Any) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
        async with httpx.AsyncClient(timeout=30) as client:
            for key, name in ((None, "none"), ("wrong", "wrong"), (api_key, "own")):
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                reply = await client.post(f"{base_url}/chat/completions", json=body, headers=headers)
                seen[name] = (reply.status_code, reply.json())
            # an SGLang request to a chat-only endpoint is not served
            seen["generate"] = (await client.post(base_url.removesuffix("/v1") + "/generate", json={})).status_code
        seen["base_url"] = base_url

    group = await _Harness(sim, _agent_module(monkeypatch, agent), server).group()
    assert seen["none"][0] == 401 and seen["wrong"][0] == 401
    assert seen["none"][1]["error"]["code"] == "invalid_api_key"
    assert seen["own"][0] == 200 and seen["own"][1]["choices"][0]["message"]["role"] == "assistant"
    assert seen["generate"] == 404
    assert seen["base_url"].startswith("http://127.0.0.1:")
    assert all(s.status in (Status.COMPLETED, Status.TRUNCATED) for s in group.samples)
    assert all(list(s.loss_mask) == [1] * s.response_length for s in group.samples)
    assert server.open_endpoints == 0
    async with httpx.AsyncClient(timeout=5) as client:  # the episode's port is closed with it
        with pytest.raises(httpx.ConnectError):
            await client.get(seen["base_url"] + "/models")
    await server.aclose()


async def test_the_producer_closes_the_endpoint_server_when_it_drains(
    redis_url: str, redis: Redis, ns: str, sim: SimEngine, standins_importable: None
) -> None:
    await make_namespace(redis, ns, n_samples_per_prompt=N, batch_size=1)
    await add_prompts(redis, ns, 1)
    server = EndpointServer()
    fn = load_framework_generate("openai:adapter_fns.openai_tool_agent", tokenizer=TOKENIZER, server=server)
    settings = ProducerSettings(namespace=ns, concurrency=N, name="closer", episodes=EpisodeSettings(generate=fn))
    async with EngineClient(EngineSettings(urls=(sim.url,), max_new_tokens=64),
                            tokenizer=load_tokenizer(TOKENIZER)) as engine:
        producer = await Producer.connect(redis_url, settings, engine, load_reward("math"))
        run = asyncio.create_task(producer.run())
        try:
            await wait_until(lambda: producer.published == 1, timeout=30, message="the group published")
            assert server.running  # its episodes ran on it
        finally:
            producer.stop()
            await asyncio.wait_for(run, 30)
            await producer.aclose()
    assert not server.running and server.open_endpoints == 0  # closed by the drain, not by the test


def _agent_module(monkeypatch: pytest.MonkeyPatch, agent: Any) -> str:
    module = type(sys)("_adapter_agent")
    module.agent = agent  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "_adapter_agent", module)
    return "openai:_adapter_agent:agent"


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        ("resend", "send every earlier message and at least one new one"),
        ("drop_first", "message 0 (user) differs"),
        ("stream", "stream=true is not supported"),
        ("n2", "n must be 1"),
        ("tools", "the tools changed"),
    ],
)
async def test_chat_requests_that_cannot_be_recorded_fail_the_sample(
    second: str, expected: str, sim: SimEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    statuses: list[int] = []

    async def agent(*, base_url: str, api_key: str, prompt: Any, request_kwargs: Any, metadata: Any) -> None:
        headers = {"Authorization": f"Bearer {api_key}"}
        first = [{"role": "user", "content": prompt}]
        async with httpx.AsyncClient(timeout=30, headers=headers) as client:
            reply = (await client.post(f"{base_url}/chat/completions", json={"messages": first})).json()
            answer = reply["choices"][0]["message"]
            longer = [*first, answer, {"role": "user", "content": "and?"}]
            body: dict[str, Any] = {
                "resend": {"messages": [*first, answer]},
                "drop_first": {"messages": [*longer[1:], {"role": "user", "content": "x"}]},
                "stream": {"messages": longer, "stream": True},
                "n2": {"messages": longer, "n": 2},
                "tools": {"messages": longer, "tools": [{"type": "function", "function": {"name": "f"}}]},
            }[second]
            # the refusal cancels the agent (usually before it reads the 400); if it gets here, it is a 400
            response = await client.post(f"{base_url}/chat/completions", json=body)
            statuses.append(response.status_code)
            await asyncio.sleep(30)  # never ends by itself

    server = EndpointServer()
    try:
        async with asyncio.timeout(20):
            group = await _Harness(sim, _agent_module(monkeypatch, agent), server).group()
    finally:
        await server.aclose()
    assert set(statuses) <= {400}
    for sample in group.samples:
        assert sample.status == Status.FAILED and sample.error and expected in sample.error, sample.error


async def test_an_engine_refusal_through_the_proxy_fails_the_sample_at_once(sim: SimEngine) -> None:
    """slime's post would retry a failed request 60 times, 1 s apart: the refusal ends the episode instead."""
    server = EndpointServer()
    sim.state.generate_errors = 1000
    sim.state.generate_error_status = 400  # a refusal (not retried by the engine client)
    try:
        async with asyncio.timeout(30):
            group = await _Harness(sim, "slime:slime.rollout.sglang_rollout.generate", server, max_retries=0).group()
    finally:
        sim.state.generate_errors = 0
        await server.aclose()
    assert all(s.status == Status.FAILED for s in group.samples)
    assert all(s.error and "400" in s.error for s in group.samples), [s.error for s in group.samples]


async def test_an_abort_with_partial_rollout_off_aborts_the_episode() -> None:
    """The function sees SGLang's ``abort`` (and marks its sample ABORTED, as on SGLang); the
    producer aborts the episode whole, whatever the function returns."""
    server = EndpointServer()
    slow = SimConfig(seed=1, mean_tokens=40, length_sigma=0.0, latency_per_token=0.05)
    async with SimEngine(slow) as engine:
        task = asyncio.ensure_future(_Harness(engine, "slime:adapter_fns.slime_tool_loop", server).group())
        try:
            await wait_until(lambda: len(engine.state.jobs) == N, timeout=20, message="both episodes in the engine")
            assert engine.state.abort() == N  # as a weight update does
            group = await asyncio.wait_for(task, 30)
        finally:
            await server.aclose()
    assert all(s.status == Status.ABORTED for s in group.samples), [(s.status, s.error) for s in group.samples]
    assert engine.state.requests == N  # no turn after the abort


async def test_an_abort_with_partial_rollout_on_is_continued_inside_the_proxy() -> None:
    """slime's stock generate sees one reply: the aborted call was continued from its tokens
    under the new weights, and both versions are recorded."""
    server = EndpointServer()
    slow = SimConfig(seed=1, mean_tokens=40, length_sigma=0.0, latency_per_token=0.05)
    async with SimEngine(slow) as engine:
        harness = _Harness(engine, "slime:slime.rollout.sglang_rollout.generate", server)
        harness.partial = True
        harness.resumed = asyncio.Event()
        task = asyncio.ensure_future(harness.group())
        try:
            await wait_until(lambda: len(engine.state.jobs) == N, timeout=20, message="both episodes generating")
            assert engine.state.abort() == N  # a weight update: abort what is in flight ...
            await wait_until(lambda: not engine.state.jobs, timeout=20, message="the aborted replies")
            engine.state.weight_version = 1  # ... load the new weights, resume
            harness.resumed.set()
            group = await asyncio.wait_for(task, 60)
        finally:
            await server.aclose()
    for sample in group.samples:
        assert sample.status == Status.COMPLETED, (sample.status, sample.error)
        assert sample.weight_versions == [0, 1]
        assert detokenize(list(sample.tokens[sample.prompt_length :])) == sample.response
        assert list(sample.loss_mask) == [1] * sample.response_length
    assert engine.state.requests == 2 * N and engine.state.aborted == N


async def test_a_list_of_samples_is_one_episode_with_segments(sim: SimEngine) -> None:
    server = EndpointServer()
    try:
        group = await _Harness(sim, "slime:adapter_fns.slime_two_segments", server).group()
    finally:
        await server.aclose()
    assert [s.index for s in group.samples] == [0, 0, 1, 1]
    assert [s.metadata["segment"] for s in group.samples] == [0, 1, 0, 1]
    assert [s.metadata["agent"] for s in group.samples] == ["a", "b", "a", "b"]
    for sample in group.samples:  # each keeps the version of its own call
        assert sample.status == Status.COMPLETED and sample.weight_versions == [0]
    assert sim.state.requests == 2 * N


def test_bad_specs_are_config_errors(standins_importable: None) -> None:
    with pytest.raises(ConfigError, match="must look like"):
        load_framework_generate("torch:x.y")
    with pytest.raises(ConfigError, match=r"no attribute|cannot import"):
        load_framework_generate("slime:adapter_fns.no_such_function")
    with pytest.raises(ConfigError, match="async def generate"):
        load_framework_generate("slime:os.path.join")


def test_the_one_generate_loader_builds_the_adapters_by_their_registered_scheme(standins_importable: None) -> None:
    from rollstream.integrations.generate import OpenAIAgent, SlimeGenerate
    from rollstream.producer.plugin import GenerateContext, generate_schemes, load_generate

    assert {"slime", "miles", "openai"} <= set(generate_schemes())
    fn = load_generate("slime:adapter_fns.slime_tool_loop", GenerateContext(tokenizer=TOKENIZER, endpoint_host="::1"))
    assert isinstance(fn, SlimeGenerate) and fn.base_args["hf_checkpoint"] == TOKENIZER and fn.server.host == "::1"
    assert isinstance(load_generate("openai:adapter_fns.openai_tool_agent"), OpenAIAgent)
    with pytest.raises(ConfigError, match="must look like"):
        load_generate("slime:")


def test_generate_args_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLSTREAM_GENERATE_ARGS", '{"generate_max_turns": 4, "rollout_temperature": 0.5}')
    fn: Any = load_framework_generate("slime:adapter_fns.slime_tool_loop", tokenizer=TOKENIZER)
    assert fn.base_args["generate_max_turns"] == 4 and fn.base_args["hf_checkpoint"] == TOKENIZER
    assert "rollout_temperature" in fn.env_keys
    monkeypatch.setenv("ROLLSTREAM_GENERATE_ARGS", "[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_framework_generate("slime:adapter_fns.slime_tool_loop")


def test_framework_samples_of_a_chat_prompt_carry_its_ids() -> None:
    """A data source renders chat prompts; slime's stock generate reuses ``sample.tokens``."""
    from rollstream.integrations.convert import SLIME
    from rollstream.integrations.generate import framework_sample

    class _Info:
        index, n, member, label, metadata = 3, 2, 1, "x", {"k": 1}
        prompt = [{"role": "user", "content": "hi"}]
        prompt_ids = (1, 2, 3)

    class _Episode:
        info = _Info()

    sample = framework_sample(SLIME, _Episode())  # type: ignore[arg-type]
    assert (sample.group_index, sample.index, sample.tokens, sample.metadata) == (3, 7, [1, 2, 3], {"k": 1})
    assert sample.session_id and array("i", sample.tokens) == array("i", [1, 2, 3])
