"""The pure rules of the trainer's consumer, without Redis: the verdict on a group entry
(:func:`rollstream.consumer.judge`, one table of cases), the stale streak that feeds it, and the
options checked when built (:class:`rollstream.consumer.ConsumerOptions`)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
from rollstream.common.codec import CodecLimits, decode_prompt, group_fields
from rollstream.common.config import PipelineConfig
from rollstream.common.models import Group, Sample, Status
from rollstream.consumer import Cause, ConfigError, ConsumerOptions, Route, judge
from rollstream.consumer.options import ConsumerOptionArgs
from rollstream.consumer.verdict import ALL_STALE_MARK, MAX_STALE_RECYCLES, STALE_STREAK_MIN, StaleContext
from rollstream.consumer.waiting import StaleWatch


def _group(
    versions: tuple[int, ...] = (5,),
    *,
    status: Status = Status.COMPLETED,
    n: int = 2,
    attempt: int = 0,
    history: tuple[str, ...] = (),
    error: str | None = None,
) -> Group:
    samples = [
        Sample(
            index=i, tokens=[1, 2, 3, 4], response="xy", response_length=2, reward=float(i), status=status,
            weight_versions=list(versions), error=error,
        )
        for i in range(n)
    ]
    return Group(index=7, prompt="p", samples=samples, attempt=attempt, history=list(history))


def _fields(group: Group) -> dict[bytes, Any]:
    """The entry as Redis returns it: bytes keys and values."""
    return {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in group_fields(group).items()}


CONFIG = PipelineConfig(2, 4, max_staleness=2, max_attempts=3)
STALE_ALONE = "stale: staleness 9 > 2"

# (case id, group, config, judge's keyword arguments, cause, route, the reason starts with, the
#  reason ends with, the prompt's next attempt (None: no prompt))
CASES: list[tuple[str, Group | None, PipelineConfig, dict[str, Any], Cause, Route, str, str, int | None]] = [
    ("fresh group kept", _group((5,)), CONFIG, {}, Cause.USABLE, Route.KEEP, "", "", None),
    ("at the staleness limit: kept", _group((3,)), CONFIG, {}, Cause.USABLE, Route.KEEP, "", "", None),
    ("no limit: kept however old", _group((0,)), CONFIG, {"staleness_limit": None}, Cause.USABLE, Route.KEEP,
     "", "", None),
    ("undecodable: dead letter with the codec's reason", None, CONFIG, {}, Cause.UNDECODABLE, Route.DEAD_LETTER,
     "", "", None),
    ("wrong sample count: dead letter, a prompt", _group((5,), n=3), CONFIG, {}, Cause.WRONG_SIZE,
     Route.DEAD_LETTER, "wrong_group_size: 3 samples, expected 2", "", 1),
    ("failed: recycled with its errors, attempt + 1", _group((5,), status=Status.FAILED, error="boom"), CONFIG, {},
     Cause.FAILED, Route.RECYCLE, "failed: boom", "boom", 1),
    ("aborted: recycled, attempt + 1", _group((5,), status=Status.ABORTED), CONFIG, {}, Cause.ABORTED,
     Route.RECYCLE, "aborted", "aborted", 1),
    ("aborted to max_attempts: still recycled", _group((5,), status=Status.ABORTED, attempt=2), CONFIG, {},
     Cause.ABORTED, Route.RECYCLE, "aborted", "aborted", 3),
    ("aborted past max_attempts: dead letter", _group((5,), status=Status.ABORTED, attempt=3), CONFIG, {},
     Cause.ABORTED, Route.DEAD_LETTER, "max_attempts: recycled 4 times (> 3)", "last: aborted", 4),
    ("failed before stale: failed wins", _group((0,), status=Status.FAILED), CONFIG, {}, Cause.FAILED,
     Route.RECYCLE, "failed: failed", "", 1),
    ("stale, nothing fresh seen yet: all-stale mark, attempt kept", _group((0,)), CONFIG, {}, Cause.STALE,
     Route.RECYCLE, "stale: staleness 5 > 2", ALL_STALE_MARK, 0),
    ("stale alone (others fresh): no mark", _group((0,)), CONFIG, {"stale": StaleContext(fresh_seen=True)},
     Cause.STALE, Route.RECYCLE, "stale: staleness 5 > 2", "> 2", 0),
    ("stale in a reportable streak: all-stale mark", _group((0,)), CONFIG,
     {"stale": StaleContext(fresh_seen=True, streak=STALE_STREAK_MIN - 1)}, Cause.STALE, Route.RECYCLE,
     "stale:", ALL_STALE_MARK, 0),
    ("stale never uses up attempts", _group((0,), attempt=3), CONFIG, {}, Cause.STALE, Route.RECYCLE,
     "stale:", ALL_STALE_MARK, 3),
    ("stale alone the MAX_STALE_RECYCLES-th time: dead letter",
     _group((0,), history=(STALE_ALONE,) * (MAX_STALE_RECYCLES - 1)), CONFIG,
     {"stale": StaleContext(fresh_seen=True)}, Cause.STALE, Route.DEAD_LETTER,
     f"stale_recycles: recycled as stale {MAX_STALE_RECYCLES} times", "last: stale: staleness 5 > 2", 0),
    ("stale recycles marked all-stale do not count towards the dead letter",
     _group((0,), history=(STALE_ALONE + ALL_STALE_MARK,) * (MAX_STALE_RECYCLES - 1)), CONFIG,
     {"stale": StaleContext(fresh_seen=True)}, Cause.STALE, Route.RECYCLE, "stale:", "> 2", 0),
    ("rejected by keep: dropped with the filter's reason", _group((5,)), CONFIG,
     {"keep": lambda g: "zero_variance"}, Cause.FILTERED, Route.DROP, "zero_variance", "zero_variance", None),
    ("falsy keep verdict: dropped as rejected", _group((5,)), CONFIG, {"keep": lambda g: 0}, Cause.FILTERED,
     Route.DROP, "rejected", "rejected", None),
    ("truthy keep verdict: kept", _group((5,)), CONFIG, {"keep": lambda g: 1}, Cause.USABLE, Route.KEEP,
     "", "", None),
    ("recycle_filtered: rejected groups are recycled", _group((5,)),
     dataclasses.replace(CONFIG, recycle_filtered=True), {"keep": lambda g: False}, Cause.FILTERED,
     Route.RECYCLE, "filtered: rejected", "rejected", 1),
    ("recycle_filtered past max_attempts: dead letter", _group((5,), attempt=3),
     dataclasses.replace(CONFIG, recycle_filtered=True), {"keep": lambda g: "short"}, Cause.FILTERED,
     Route.DEAD_LETTER, "max_attempts:", "last: filtered: short", 4),
    ("stale groups never reach the keep filter", _group((0,)), CONFIG, {"keep": lambda g: 1 / 0}, Cause.STALE,
     Route.RECYCLE, "stale:", "", 0),
]


@pytest.mark.parametrize(("group", "config", "kwargs", "cause", "route", "starts", "ends", "attempt"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_judge(
    group: Group | None, config: PipelineConfig, kwargs: dict[str, Any], cause: Cause, route: Route,
    starts: str, ends: str, attempt: int | None,
) -> None:
    fields = _fields(group) if group is not None else {b"data": b"\xc1 not msgpack"}
    verdict = judge(fields, config, **{"version": 5, "staleness_limit": config.max_staleness, **kwargs})
    assert (verdict.cause, verdict.route) == (cause, route), verdict.reason
    assert verdict.reason.startswith(starts) and verdict.reason.endswith(ends), verdict.reason
    if route == Route.KEEP:
        assert verdict.group is not None and verdict.fields is None
    if route in (Route.RECYCLE, Route.DEAD_LETTER):
        assert verdict.fields, "a hand-back writes its fields"
    if attempt is None:
        assert verdict.prompt is None
    else:
        assert verdict.prompt is not None and verdict.prompt.attempt == attempt
        assert verdict.prompt.history[-1] in verdict.reason  # the history's last line is the reason given
        assert verdict.fields is not None
        assert decode_prompt(verdict.fields["data"]).attempt == attempt  # what is written is that prompt
    if cause == Cause.UNDECODABLE:
        assert verdict.fields is fields and verdict.group is None and verdict.staleness is None
    elif cause != Cause.WRONG_SIZE:
        assert verdict.staleness == 5 - min(group.samples[0].weight_versions)  # type: ignore[union-attr]
    assert (verdict.rejection is not None) == (cause == Cause.FILTERED)


def test_judge_keeps_partial_samples_of_an_aborted_group_only_with_partial_rollout() -> None:
    fields = _fields(_group((5,), status=Status.ABORTED))
    plain = judge(fields, dataclasses.replace(CONFIG, partial_rollout=False), version=5, staleness_limit=2)
    partial = judge(fields, CONFIG, version=5, staleness_limit=2)  # partial rollout: the default
    assert plain.prompt is not None and plain.prompt.partial is None
    assert partial.prompt is not None and partial.prompt.partial is not None and len(partial.prompt.partial) == 2


def test_judge_dead_letters_a_group_over_the_size_limits() -> None:
    fields = _fields(_group((5,)))
    verdict = judge(fields, CONFIG, version=5, staleness_limit=2, limits=CodecLimits(max_payload_bytes=16))
    assert (verdict.cause, verdict.route) == (Cause.UNDECODABLE, Route.DEAD_LETTER)
    assert verdict.fields is fields


def test_the_stale_watch_follows_the_verdicts_and_feeds_them_back() -> None:
    watch = StaleWatch(batch_size=2)
    stale = _fields(_group((0,)))
    for count in range(1, STALE_STREAK_MIN + 1):
        verdict = judge(stale, CONFIG, version=5, staleness_limit=2, stale=watch.context())
        watch.saw(verdict, 5, 2)
        assert watch.streak is not None and watch.streak.count == count
        assert (watch.reportable is not None) == (count >= STALE_STREAK_MIN)
    assert not watch.fresh_seen
    filtered = judge(_fields(_group((5,))), CONFIG, version=5, staleness_limit=2, keep=lambda g: False)
    watch.saw(filtered, 5, 2)  # a fresh group, even a filtered one, ends the streak
    assert watch.streak is None and watch.fresh_seen and watch.context() == StaleContext(True, 0)
    alone = judge(stale, CONFIG, version=5, staleness_limit=2, stale=watch.context())
    assert not alone.reason.endswith(ALL_STALE_MARK)


# -- options ---------------------------------------------------------------------------------


def test_the_keyword_arguments_are_the_options_dataclass() -> None:
    fields = {f.name: f.type for f in dataclasses.fields(ConsumerOptions)}
    hints = typing.get_type_hints(ConsumerOptionArgs)
    assert list(hints) == list(fields)
    resolved = typing.get_type_hints(ConsumerOptions)
    assert hints == resolved


@pytest.mark.parametrize(("options", "message"), [
    ({"on_producer_failure": "ignore"}, "on_producer_failure must be 'raise' or 'warn'"),
    ({"stall_timeout": 0}, "stall_timeout and warn_interval must be positive"),
    ({"warn_interval": -1.0}, "stall_timeout and warn_interval must be positive"),
    ({"stall_timeout": float("nan")}, "stall_timeout and warn_interval must be positive"),
    ({"name_wait": -0.5}, "name_wait must be >= 0 seconds"),
    ({"keep": "module:function"}, "keep must be a callable"),
])
def test_bad_options_are_a_config_error_when_built(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConsumerOptions(**options)


def test_good_options_build() -> None:
    options = ConsumerOptions(n_samples=2, keep=bool, on_producer_failure="warn", stall_timeout=1.5, name_wait=0)
    assert (options.n_samples, options.on_producer_failure, options.stall_timeout) == (2, "warn", 1.5)
    assert ConsumerOptions().stall_timeout == 300.0
