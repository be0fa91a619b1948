"""Tests for rollstream.producer.rewards: math, remote and module:function rewards."""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from conftest import wait_until
from rollstream.common.errors import ConfigError, RewardError
from rollstream.common.models import Sample
from rollstream.producer.rewards import (
    MathReward,
    PythonReward,
    RemoteReward,
    RewardBroken,
    RewardFunction,
    answers_match,
    extract_answer,
    load_reward,
    math_reward,
    validate_rewards,
)

TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _reward_fns_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``reward_fns`` importable whatever pytest's import mode / rootdir is."""
    monkeypatch.syspath_prepend(str(TESTS_DIR))


def samples_of(*responses: str) -> list[Sample]:
    return [Sample(index=i, response=r) for i, r in enumerate(responses)]


# ------------------------------------------------------------------------------------------
# math
# ------------------------------------------------------------------------------------------

MATH_CASES = [
    # (response, label, expected reward)
    (r"So the total is \boxed{42}.", 42, 1.0),
    (r"So the total is \boxed{42}.", "42", 1.0),
    (r"\boxed{42}", 42.0, 1.0),
    (r"\boxed{12.0}", "12", 1.0),
    (r"\boxed{12}", "12.0", 1.0),
    (r"\boxed{{12}}", 12, 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac{3}{4}}", "3/4", 1.0),
    (r"\boxed{-\frac{1}{2}}", -0.5, 1.0),
    (r"\boxed{1/2}", "\\frac{1}{2}", 1.0),
    (r"\boxed{0.5}", "1/3", 0.0),
    (r"\boxed{\$1,234}", 1234, 1.0),
    (r"\boxed{x = 5}", 5, 1.0),
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{\text{Paris}}", "paris", 1.0),
    (r"\boxed{ New   York }", "new york", 1.0),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),  # nested braces, string compare
    (r"first \boxed{7}, finally \boxed{9}", 9, 1.0),  # the last box wins
    (r"first \boxed{7}, finally \boxed{9}", 7, 0.0),
    (r"\boxed{7} and then a cut-off \boxed{12", 7, 1.0),  # unbalanced last box is skipped
    ("The answer is 42.", 42, 1.0),
    ("The answer is 42. Hope that helps, 7 is not it", 42, 1.0),
    ("The final answer is 42 apples.", "42", 1.0),
    ("I thought the answer is 3; but no, the answer is 4", 4, 1.0),
    ("Answer: $12.0$", 12, 1.0),
    ("**Answer:** 7", "7", 1.0),
    ("The answer is:\n  18", 18, 1.0),
    ("Natalia sold 48 clips.\n#### 1,234", "1234", 1.0),
    ("#### 1,234", 1234, 1.0),
    ("the answer is 1,234, clearly", 1234, 1.0),
    ("The answer is 50%", 50, 1.0),
    ("The answer is -3", "-3", 1.0),
    ("The answer is 0.333333333", "1/3", 1.0),  # within the tolerance
    ("The answer is 0.33", "1/3", 0.0),
    ("The answer is 41.", 42, 0.0),
    (r"\boxed{43}", 42, 0.0),
    ("I computed 42 but I am not sure.", 42, 0.0),  # no final answer
    ("", 42, 0.0),
    ("The answer is 12", "Reasoning... #### 12", 1.0),  # a GSM8K-style full solution label
]


@pytest.mark.parametrize(("response", "label", "expected"), MATH_CASES)
def test_math_reward_table(response: str, label: Any, expected: float) -> None:
    assert math_reward(response, label) == expected


def test_extract_answer() -> None:
    assert extract_answer(r"\boxed{\frac{a}{b}}") == r"\frac{a}{b}"
    assert extract_answer(r"\boxed 7") == "7"
    assert extract_answer("The answer is 42.") == "42"
    assert extract_answer("#### 72") == "72"
    assert extract_answer("nothing here") is None
    assert extract_answer(r"\boxed{}") is None


def test_answers_match_none_label() -> None:
    assert not answers_match("42", None)


async def test_math_reward_function() -> None:
    reward = load_reward("math")
    assert isinstance(reward, MathReward)
    assert reward.name == "math"
    rewards = await reward.score(
        "What is 6 * 7?", "42", samples_of(r"\boxed{42}", "The answer is 41", "no idea")
    )
    assert rewards == [1.0, 0.0, 0.0]
    assert all(type(r) is float for r in rewards)
    assert await reward.score("q", 1, []) == []
    with pytest.raises(RewardError, match="label"):
        await reward.score("What is 6 * 7?", None, samples_of("42"))
    await reward.aclose()


# ------------------------------------------------------------------------------------------
# remote
# ------------------------------------------------------------------------------------------


class RewardServer:
    """A local reward server; ``calls`` counts requests per path, ``bodies`` keeps them."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bodies: list[dict[str, Any]] = []
        self.base = ""

    def handler(
        self, path: str, fn: Callable[[dict[str, Any], int], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            self.calls[path] = self.calls.get(path, 0) + 1
            body = await request.json()
            self.bodies.append(body)
            return await fn(body, self.calls[path])

        return handle

    def url(self, path: str) -> str:
        return f"{self.base}{path}"


async def _lengths(body: dict[str, Any], call: int) -> web.StreamResponse:
    return web.json_response({"rewards": [len(r) for r in body["responses"]]})


async def _flaky(body: dict[str, Any], call: int) -> web.StreamResponse:
    if call == 1:
        return web.Response(status=500, text="warming up")
    return await _lengths(body, call)


async def _rate_limited(body: dict[str, Any], call: int) -> web.StreamResponse:
    if call == 1:
        return web.Response(status=429, headers={"Retry-After": "0"})
    return await _lengths(body, call)


async def _always_503(body: dict[str, Any], call: int) -> web.StreamResponse:
    return web.Response(status=503, text="down")


async def _bad_request(body: dict[str, Any], call: int) -> web.StreamResponse:
    return web.Response(status=400, text="no such label")


async def _wrong_length(body: dict[str, Any], call: int) -> web.StreamResponse:
    return web.json_response({"rewards": [1.0] * (len(body["responses"]) - 1)})


async def _dicts(body: dict[str, Any], call: int) -> web.StreamResponse:
    return web.json_response(
        {"rewards": [{"score": 1.0, "length": len(r)} for r in body["responses"]]}
    )


async def _bad_value(body: dict[str, Any], call: int) -> web.StreamResponse:
    return web.json_response({"rewards": ["high"] * len(body["responses"])})


async def _not_json(body: dict[str, Any], call: int) -> web.StreamResponse:
    return web.Response(text="<html>oops</html>")


async def _no_rewards_key(body: dict[str, Any], call: int) -> web.StreamResponse:
    return web.json_response({"scores": [1.0]})


@pytest.fixture
async def reward_server() -> AsyncIterator[RewardServer]:
    server = RewardServer()
    app = web.Application()
    for path, fn in {
        "/lengths": _lengths,
        "/flaky": _flaky,
        "/rate-limited": _rate_limited,
        "/always-503": _always_503,
        "/bad-request": _bad_request,
        "/wrong-length": _wrong_length,
        "/dicts": _dicts,
        "/bad-value": _bad_value,
        "/not-json": _not_json,
        "/no-rewards-key": _no_rewards_key,
    }.items():
        app.router.add_post(path, server.handler(path, fn))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    server.base = f"http://{host}:{port}"
    try:
        yield server
    finally:
        await runner.cleanup()


async def test_remote_reward_protocol(reward_server: RewardServer) -> None:
    reward = load_reward(f"remote:{reward_server.url('/lengths')}", timeout=5)
    assert isinstance(reward, RemoteReward)
    try:
        samples = samples_of("a", "bbb", "")
        samples[1].metadata["tag"] = "x"
        rewards = await reward.score(
            [{"role": "user", "content": "hi"}], {"answer": 3}, samples, metadata={"source": "t"}
        )
        assert rewards == [1.0, 3.0, 0.0]
        assert all(type(r) is float for r in rewards)
        # a second call reuses the client
        assert await reward.score("p", None, samples_of("xy")) == [2.0]
    finally:
        await reward.aclose()
    body = reward_server.bodies[0]
    assert body["prompt"] == [{"role": "user", "content": "hi"}]
    assert body["label"] == {"answer": 3}
    assert body["responses"] == ["a", "bbb", ""]
    assert body["metadata"] == {"source": "t"}
    assert [s["index"] for s in body["samples"]] == [0, 1, 2]
    assert body["samples"][1]["metadata"] == {"tag": "x"}
    assert body["samples"][0]["status"] == "completed"
    assert reward_server.bodies[1]["metadata"] == {}


async def test_remote_reward_dict_rewards(reward_server: RewardServer) -> None:
    async with RemoteReward(reward_server.url("/dicts"), timeout=5) as reward:
        rewards = await reward.score("p", None, samples_of("ab", "c"))
    assert rewards == [{"score": 1.0, "length": 2.0}, {"score": 1.0, "length": 1.0}]


@pytest.mark.parametrize("path", ["/flaky", "/rate-limited"])
async def test_remote_reward_retries_then_succeeds(reward_server: RewardServer, path: str) -> None:
    async with RemoteReward(reward_server.url(path), timeout=5, backoff=0.01) as reward:
        assert await reward.score("p", None, samples_of("abcd")) == [4.0]
    assert reward_server.calls[path] == 2


async def test_remote_reward_gives_up_after_three_attempts(reward_server: RewardServer) -> None:
    async with RemoteReward(reward_server.url("/always-503"), timeout=5, backoff=0.01) as reward:
        with pytest.raises(RewardError, match=r"after 3 attempts.*503"):
            await reward.score("p", None, samples_of("a"))
    assert reward_server.calls["/always-503"] == 3


async def test_remote_reward_client_error_is_not_retried(reward_server: RewardServer) -> None:
    async with RemoteReward(reward_server.url("/bad-request"), timeout=5, backoff=0.01) as reward:
        with pytest.raises(RewardError, match=r"HTTP 400.*no such label"):
            await reward.score("p", None, samples_of("a"))
    assert reward_server.calls["/bad-request"] == 1


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("/wrong-length", "1 rewards for 2 samples"),
        ("/bad-value", "reward 0 is str"),
        ("/not-json", "invalid JSON"),
        ("/no-rewards-key", "expected {'rewards'"),
    ],
)
async def test_remote_reward_bad_replies(
    reward_server: RewardServer, path: str, message: str
) -> None:
    async with RemoteReward(reward_server.url(path), timeout=5, backoff=0.01) as reward:
        with pytest.raises(RewardError, match=message):
            await reward.score("p", None, samples_of("a", "b"))
    assert reward_server.calls[path] == 1


async def test_remote_reward_connection_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    async with RemoteReward(f"http://127.0.0.1:{port}/r", timeout=2, backoff=0.01) as reward:
        with pytest.raises(RewardError, match="after 3 attempts"):
            await reward.score("p", None, samples_of("a"))


async def test_remote_reward_unserialisable_label(reward_server: RewardServer) -> None:
    async with RemoteReward(reward_server.url("/lengths"), timeout=5) as reward:
        with pytest.raises(RewardError, match="JSON"):
            await reward.score("p", object(), samples_of("a"))
    assert reward_server.calls.get("/lengths", 0) == 0


# ------------------------------------------------------------------------------------------
# module:function
# ------------------------------------------------------------------------------------------


async def test_per_sample_sync_function() -> None:
    reward = load_reward("reward_fns:length_reward")
    assert isinstance(reward, PythonReward)
    assert not reward.per_group
    assert reward.name == "reward_fns:length_reward"
    rewards = await reward.score("p", None, samples_of("ab", "", "abcde"))
    assert rewards == [2.0, 0.0, 5.0]
    assert all(type(r) is float for r in rewards)


async def test_per_sample_dict_rewards() -> None:
    reward = load_reward("reward_fns:dict_reward")
    assert await reward.score("p", "yes", samples_of("yes", "no")) == [
        {"score": 1.0, "length": 3.0},
        {"score": 0.0, "length": 2.0},
    ]


async def test_per_group_async_function() -> None:
    reward = load_reward("reward_fns:exact_group")
    assert isinstance(reward, PythonReward)
    assert reward.per_group
    assert await reward.score("p", "b", samples_of("a", "b", "b")) == [0.0, 1.0, 1.0]


async def test_per_group_sync_function() -> None:
    reward = load_reward("reward_fns:rank_group")
    assert await reward.score("p", None, samples_of("c", "a", "b")) == [2.0, 0.0, 1.0]


async def test_per_group_attribute_overrides_parameter_name() -> None:
    flagged = load_reward("reward_fns:flagged_group")
    assert isinstance(flagged, PythonReward) and flagged.per_group
    assert await flagged.score("p", None, samples_of("a", "b")) == [2.0, 2.0]
    forced = load_reward("reward_fns:samples_but_per_sample")
    assert isinstance(forced, PythonReward) and not forced.per_group
    assert await forced.score("p", None, samples_of("a", "b")) == [0.0, 1.0]


async def test_dotted_attribute_path() -> None:
    reward = load_reward("reward_fns:Scorer.score")
    assert await reward.score("p", None, samples_of("a")) == [0.5]


async def test_async_per_sample_function_runs_concurrently() -> None:
    reward = load_reward("reward_fns:concurrent_reward")
    state = {"started": 0, "event": asyncio.Event(), "n": 3}
    # would time out (RewardError) if the samples were scored one after the other
    assert await reward.score(state, None, samples_of("a", "b", "c")) == [0.0, 1.0, 2.0]  # type: ignore[arg-type]


async def test_python_callable_directly() -> None:
    async def fn(sample: Sample, prompt: Any, label: Any) -> float:
        return 1.0 if sample.response == label else 0.0

    reward = PythonReward(fn)
    assert await reward.score("p", "x", samples_of("x", "y")) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("reward_fns:string_reward", "sample 0 is str"),
        ("reward_fns:bool_reward", "bool"),
        ("reward_fns:nan_reward", "not finite"),
        ("reward_fns:none_reward", "NoneType"),
        ("reward_fns:bad_dict_reward", r"\['score'\] is str"),
        ("reward_fns:short_group", "1 rewards for 2 samples"),
        ("reward_fns:not_a_list_group", "expected a list of 2 rewards"),
    ],
)
async def test_bad_return_values(spec: str, message: str) -> None:
    reward = load_reward(spec)
    with pytest.raises(RewardError, match=message):
        await reward.score("p", None, samples_of("a", "b"))


async def test_exceptions_become_reward_errors() -> None:
    reward = load_reward("reward_fns:raising_reward")
    with pytest.raises(RewardError, match="KeyError") as info:
        await reward.score("p", None, samples_of("a"))
    assert isinstance(info.value.__cause__, KeyError)

    reward = load_reward("reward_fns:raising_async_reward")
    with pytest.raises(RewardError, match=r"sample 1.*ZeroDivisionError") as info:
        await reward.score("p", None, samples_of("a", "b", "c"))
    assert isinstance(info.value.__cause__, ZeroDivisionError)


async def test_a_cancelled_error_the_function_raises_itself_is_its_failure() -> None:
    reward = load_reward("reward_fns:cancelled_reward")
    with pytest.raises(RewardError, match="CancelledError"):
        await reward.score("p", None, samples_of("a"))


@pytest.mark.parametrize("spec", ["reward_fns:exiting_reward", "reward_fns:exiting_async_reward",
                                  "reward_fns:interrupting_group"])
async def test_base_exceptions_of_the_function_become_reward_errors(spec: str) -> None:
    reward = load_reward(spec)
    with pytest.raises(RewardError, match=r"SystemExit|KeyboardInterrupt"):
        await reward.score("p", None, samples_of("a", "b"))


async def test_a_sync_reward_runs_off_the_event_loop() -> None:
    reward = load_reward("reward_fns:sleepy_sync_reward")
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        assert await reward.score("p", None, samples_of("a", "b")) == [1.0, 1.0]  # 2 x 0.2 s
    finally:
        ticker.cancel()
    assert ticks >= 10


async def test_a_hung_sync_reward_times_out_and_too_many_stuck_is_fatal() -> None:
    reward = load_reward("reward_fns:hanging_sync_reward", timeout=0.2)
    assert isinstance(reward, PythonReward)
    release = importlib.import_module("reward_fns").HANG
    release.clear()
    try:
        for expected_stuck in range(1, reward.max_stuck + 1):
            with pytest.raises(RewardError, match=r"timed out after 0\.2 s"):
                await reward.score("p", None, samples_of("a"))
            assert reward.stuck == expected_stuck
        with pytest.raises(RewardBroken, match=r"still running past the 0\.2 s deadline"):
            await reward.score("p", None, samples_of("a"))
    finally:
        release.set()
    await wait_until(lambda: reward.stuck == 0, timeout=5, message="the stuck threads to end")
    reward_ok = load_reward("reward_fns:hanging_sync_reward", timeout=5)
    assert await reward_ok.score("p", None, samples_of("a")) == [0.0]


async def test_cancelling_the_caller_is_not_swallowed() -> None:
    reward = load_reward("reward_fns:slow_reward")
    task = asyncio.create_task(reward.score("p", None, samples_of("a", "b")))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_async_timeout() -> None:
    reward = load_reward("reward_fns:slow_reward", timeout=0.05)
    with pytest.raises(RewardError, match="timed out"):
        await reward.score("p", None, samples_of("a"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "reward spec"),
        ("   ", "reward spec"),
        ("mathematics", "unknown reward spec"),
        ("remote:", "needs a URL"),
        ("remote:ftp://host/reward", "http"),
        ("remote:localhost", "http"),
        (":length_reward", "module.path:function"),
        ("reward_fns:", "module.path:function"),
        ("reward_fns:bad-name", "not a valid"),
        ("no_such_module_for_rewards:fn", "no module named 'no_such_module_for_rewards'"),
        ("reward_fns:missing_function", "has no attribute 'missing_function'"),
        ("reward_fns:NOT_CALLABLE", "not a callable"),
        ("reward_fns:one_argument", "cannot be called"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_reward(spec)


def test_bad_timeout() -> None:
    with pytest.raises(ConfigError, match="timeout"):
        load_reward("math", timeout=0)


# ------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------


def test_validate_rewards() -> None:
    assert validate_rewards([1, 0.5, {"score": 2}], 3) == [1.0, 0.5, {"score": 2.0}]
    assert validate_rewards((0.0,), 1) == [0.0]
    for bad in ([math.inf], [False], [{}], [{1: 1.0}], [{"a": True}], "1", [[1.0]]):
        with pytest.raises(RewardError):
            validate_rewards(bad, 1)
    with pytest.raises(RewardError, match="2 rewards for 1 samples"):
        validate_rewards([1.0, 2.0], 1)


def test_reward_function_interface() -> None:
    assert issubclass(MathReward, RewardFunction)
    assert issubclass(RemoteReward, RewardFunction)
    assert issubclass(PythonReward, RewardFunction)
    assert json.dumps(validate_rewards([1], 1)) == "[1.0]"
