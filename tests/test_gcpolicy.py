"""The producer's memory is freed by reference counting, and its collector policy does what it says.

A finished episode (its session, trajectories, replies) must not wait for the cyclic collector:
with the collector off, nothing of it survives the group. ``gcpolicy.tune`` runs in a child
interpreter (it changes the process's collector, which the test process keeps as it is)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from array import array
from typing import Any

import httpx
import pytest
from rollstream.common.errors import ConfigError
from rollstream.common.models import Prompt, Sample
from rollstream.producer import gcpolicy
from rollstream.producer.engine import EngineClient, EngineSettings
from rollstream.producer.episode import Episode
from rollstream.producer.rewards import PythonReward
from rollstream.producer.rollout import Rollout
from rollstream.producer.settings import EpisodeSettings
from test_request_path import PROMPT_IDS, TOOL, URL, TurnEngine


async def test_a_finished_episode_is_freed_without_the_cyclic_collector() -> None:
    alive: list[weakref.ref[Any]] = []

    async def generate(episode: Episode) -> list[Sample]:
        alive.append(weakref.ref(episode))
        await episode.generate()
        await episode.observe(TOOL)
        await episode.generate()
        other = await episode.segment(PROMPT_IDS)
        alive.append(weakref.ref(other))
        await other.generate()
        return [episode.sample, other.sample]

    client = EngineClient(EngineSettings(urls=(URL,), max_new_tokens=8), transport=httpx.MockTransport(TurnEngine()))
    rollout = Rollout(client, PythonReward(lambda *a: 1.0, name="one"), 4, EpisodeSettings(generate=generate))
    gc.collect()
    gc.disable()
    try:
        group = await rollout.run(Prompt(index=0, prompt="p", input_ids=array("i", PROMPT_IDS)), 0)
        assert len(group.samples) == 8 and len(alive) == 8
        survivors = [ref() for ref in alive if ref() is not None]
        assert not survivors, f"{len(survivors)} of {len(alive)} episodes and trajectories wait for the collector"
    finally:
        gc.enable()
        await client.aclose()


def test_tune_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    code = (
        "import gc; from rollstream.producer import gcpolicy; middle = gc.get_threshold()[1:]; "
        "gcpolicy.tune(12345); assert gc.get_threshold() == (12345, *middle), gc.get_threshold(); "
        "assert gc.get_freeze_count() > 1000, gc.get_freeze_count(); "
        "gc.unfreeze(); before = gc.get_threshold(); gcpolicy.tune(0); "
        "assert gc.get_threshold() == before and gc.get_freeze_count() == 0; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@pytest.mark.parametrize("value", [-1, 1.5, True, "700"])
def test_a_bad_threshold_is_a_config_error(value: Any) -> None:
    with pytest.raises(ConfigError, match="gc threshold"):
        gcpolicy.check(value)
    assert gcpolicy.check(None) == gcpolicy.DEFAULT_YOUNG and gcpolicy.check(0) == 0


def test_produce_refuses_a_negative_threshold_before_it_connects(capsys: pytest.CaptureFixture[str]) -> None:
    from rollstream.cli.main import main

    code = main(["produce", "--redis", "redis://127.0.0.1:1/0", "--ns", "x", "--engine", "http://127.0.0.1:1",
                 "--concurrency", "4", "--reward", "math", "--gc-threshold", "-5"])
    err = capsys.readouterr().err
    assert code == 2 and "gc threshold must be a non-negative integer" in err and err.count("\n") == 1, err
