"""Issue 49's minor feeder and config findings (17, and 16's curriculum part): weights near the
float maximum, a malformed row slice, a limit named twice, a curriculum that raises or defers
every row. Real redis-server; the CLI ones through real `rollstream` processes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from conftest import ProcessPool, make_namespace, wait_until
from redis.asyncio import Redis
from rollstream.common.datasets import open_dataset
from rollstream.common.errors import ConfigError
from rollstream.common.keys import Keys
from rollstream.common.mix import apportion, normalised, parse_mix, source_caps


def test_weights_near_the_float_maximum_keep_their_shares() -> None:
    """`a=1e308,b=1e308` summed to infinity: every share 0, quotas {a: 1, b: 1} for a batch of 4."""
    weights = parse_mix("a=1e308,b=1e308")
    assert normalised(weights) == {"a": 0.5, "b": 0.5}
    assert apportion(4, weights) == {"a": 2, "b": 2}
    assert apportion(4, parse_mix("a=1.5e308,b=5e307")) == {"a": 3, "b": 1}
    assert json.loads(source_caps("a=1e308,b=1e308", 8, 4)) == {"a": 4, "b": 4}


def test_a_malformed_row_slice_says_what_is_wrong(tmp_path: Path) -> None:
    """`data.jsonl@[a:b]` was reported as "the glob matches no file"."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q"}\n')
    for bad in ("@[a:b]", "@[1:2:3]", "@[]", "@[1.5:]"):
        with pytest.raises(ConfigError, match=r"row slice .* expected PATH@\[START:STOP\]") as caught:
            open_dataset(f"{data}{bad}")
        assert "glob" not in str(caught.value)
    assert open_dataset(f"{data}@[0:1]").rows == 1


async def test_a_limit_or_rate_given_twice_is_refused(
    redis: Redis, redis_url: str, ns: str, procs: ProcessPool
) -> None:
    """`init --limit a=1 --limit a=2`: the last one won silently; now exit 2 naming both."""
    init = procs.start("init", "--redis", redis_url, "--ns", ns, "--n-samples", "2", "--batch-size", "4",
                       "--limit", "a=1", "--limit", "a=2", log_name="init")
    assert await asyncio.to_thread(init.wait, 120) == 2, procs.logs()
    assert "--limit 'a' is given twice (a=1, then 'a=2')" in procs.log_of(init), procs.logs()
    assert await redis.exists(Keys(ns).config) == 0
    await make_namespace(redis, ns)
    again = procs.start("limits", "set", "--redis", redis_url, "--ns", ns, "b=3", "--rate", "j=1/s",
                        "--rate", "j=2/s", log_name="set")
    assert await asyncio.to_thread(again.wait, 120) == 2, procs.logs()
    assert "--rate 'j' is given twice" in procs.log_of(again)
    assert await redis.hgetall(Keys(ns).limits) == {}


CURRICULA = '''
def broken(stats, epoch, draw):
    return stats.trained > 0  # stats is None for a row with no history: AttributeError
'''


async def test_a_curriculum_that_raises_is_a_clear_error_naming_it(
    redis: Redis, redis_url: str, ns: str, tmp_path: Path, procs: ProcessPool
) -> None:
    """Finding 16: `rollstream feed --curriculum FILE:broken`, whose function raises: exit 2 with
    one message naming the function, the exception, where it was raised and the row; no traceback."""
    await make_namespace(redis, ns, row_stats=1)
    module = tmp_path / "curricula.py"
    module.write_text(CURRICULA)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(5)))
    feeder = procs.start("feed", "--redis", redis_url, "--ns", ns, str(data), "--curriculum", f"{module}:broken")
    assert await asyncio.to_thread(feeder.wait, 120) == 2, procs.logs()
    log = procs.log_of(feeder)
    assert "the curriculum " in log and ":broken raised AttributeError: 'NoneType' object has no attribute" in log, log
    assert f"at {module}:3) on row 0 of epoch 0: fix it, or feed without --curriculum" in log, log
    assert "Traceback" not in log
    assert await redis.xlen(Keys(ns).prompts) == 0


async def test_a_curriculum_that_defers_every_row_warns_and_backs_off(
    redis: Redis, ns: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 17: a curriculum deferring every row walked 21,132 epochs in 12 s feeding nothing,
    without a word. Now: after a whole epoch deferred, a warning, then a wait (1 s, doubling) per
    epoch deferred, so the epochs walked stay as many as the warnings."""
    import logging

    from rollstream.producer.feeder import Feeder, FeedSettings

    keys = Keys(ns)
    await make_namespace(redis, ns, row_stats=1)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(10)))
    caplog.set_level(logging.WARNING, logger="rollstream")
    settings = FeedSettings(namespace=ns, epochs=None, chunk=4, poll_interval=0.02,
                            curriculum=lambda stats, epoch, draw: False)
    feeder = Feeder(redis, open_dataset(data), settings)
    task = asyncio.create_task(feeder.run())

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "deferred every one of the last" in r.getMessage()]

    try:
        await wait_until(lambda: len(warnings()) >= 2, message="two warnings")
        epoch = int(await redis.hget(keys.state, "feed_epoch") or 0)
    finally:
        feeder.stop()
        await task
    assert epoch <= 3, epoch  # walked at full speed, it would be thousands of epochs
    assert "(a whole epoch of every source; now at epoch 1): nothing fed. Waiting 1 s" in warnings()[0], warnings()
    assert "Waiting 2 s" in warnings()[1]
    assert await redis.xlen(keys.prompts) == 0
