"""The producer's stats are declared once (``common/heartbeat.py``): the heartbeat, the Prometheus
series, ``inspect``'s screen and its ``--json`` all carry every declared field."""

from __future__ import annotations

import dataclasses
import json

from conftest import make_namespace
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rollstream.cli.inspect import render
from rollstream.common.events import now_ms
from rollstream.common.heartbeat import COUNTER, DETAIL, NUMERIC, TEXT, TIME, Heartbeat, stats
from rollstream.common.keys import Keys
from rollstream.common.protocol import Heartbeats
from rollstream.ops import snapshot
from rollstream.producer.metrics import ProducerMetrics

KINDS = (*NUMERIC, TEXT, DETAIL)


def every_stat_set(now: int) -> Heartbeat:
    """A live heartbeat whose every field differs from its default (so each one can be found)."""
    values: dict[str, object] = {}
    for number, s in enumerate(stats(), 1):
        kind = str(dataclasses.fields(Heartbeat)[number - 1].type)
        if s.kind == TIME:
            values[s.name] = now - 1000 * number
        elif kind == "int":
            values[s.name] = 100 + number
        elif kind == "float":
            values[s.name] = number + 0.25
        elif kind == "str":
            values[s.name] = f"{s.name}-value"
        elif kind == "list[str]":
            values[s.name] = [f"http://{s.name}:1"]
        else:
            values[s.name] = [{"url": f"http://{s.name}:2", "state": "healthy", "in_flight": 0, "version": 1}]
    values.update(state="running", last_seen_ms=now)
    return Heartbeat(**values)  # type: ignore[arg-type]


def test_every_stat_is_declared_with_a_meaning_and_a_kind() -> None:
    declared = stats()
    assert [s.name for s in declared] == [f.name for f in dataclasses.fields(Heartbeat)]
    for s in declared:
        assert s.meaning and s.kind in KINDS, s
        kind = str(next(f.type for f in dataclasses.fields(Heartbeat) if f.name == s.name))
        assert (s.kind == DETAIL) == kind.startswith("list"), s  # a list is shown, not a series
        assert s.kind in (TEXT, DETAIL) or kind in ("int", "float"), s  # a series is a number
        assert s.kind != TIME or s.name.endswith("_ms"), s


def test_every_stat_is_in_the_heartbeat_and_the_prometheus_series() -> None:
    beat = every_stat_set(now_ms())
    assert set(json.loads(beat.to_json())) == {s.name for s in stats()}
    assert Heartbeat.parse(beat.to_json()) == beat

    metrics = ProducerMetrics("ns", "p")
    metrics.watch(lambda: beat)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for s in stats():
        if s.kind in NUMERIC:
            family = families[s.metric.removesuffix("_total")]
            assert family.type == ("counter" if s.kind == COUNTER else "gauge"), s
            assert family.documentation.startswith(s.meaning), s
            [sample] = [x for x in family.samples if not x.name.endswith("_created")]
            assert sample.value == getattr(beat, s.name) and sample.labels == {"namespace": "ns", "producer": "p"}
        elif s.kind == TEXT:
            [info] = families["rollstream_producer_info"].samples
            assert info.labels[s.name] == str(getattr(beat, s.name)), s
        else:  # a list: the engines, exported per engine (rollstream_engine_*)
            assert s.kind == DETAIL and s.metric not in families, s


async def test_every_stat_is_in_inspect_and_its_json(redis, ns) -> None:
    keys = Keys(ns)
    await make_namespace(redis, ns)
    beat = every_stat_set(now_ms())
    await Heartbeats(redis, keys).write("p1", beat)
    snap = await snapshot(redis, keys)
    [row] = json.loads(json.dumps(snap))["producers"]
    for s in stats():
        assert row[s.name] == json.loads(json.dumps(getattr(beat, s.name))), s

    console = Console(width=400, record=True)
    console.print(render(snap, plain=True))
    table = console.export_text().split("producer stats", 1)[1]
    for s in stats():
        assert f"\n{s.name}" in table, s
        assert s.meaning[:40] in table, s
